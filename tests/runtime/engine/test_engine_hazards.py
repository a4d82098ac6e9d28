"""Hazard ordering: requests touching overlapping tier bytes, at least one a write, run in
submission order; everything else may run concurrently."""

from __future__ import annotations

import numpy as np
import pytest

MiB = 1 << 20


def _transfers_by_ticket(engine):
    return {row[0]: row for row in engine.timeline().transfers}


def _intervals_overlap(a, b):
    # Timeline rows: (ticket, tier, direction, layer, chunk, bytes, submit, start, end, ok).
    return a[7] < b[8] and b[7] < a[8]


def test_write_then_overlapping_read_sees_new_data(make_engine, add_tier, tier_kind):
    # A long write and a short read of its last page: if the read were not ordered after the
    # write it would finish first (both wait the same debug delay) and see the old bytes.
    e = make_engine(num_workers=4, io_chunk_bytes=64 * 1024, debug_delay_us=2000)
    tier = add_tier(e, tier_kind, block_bytes=MiB, num_blocks=4)
    size = 3 * MiB + 5
    for round_ in range(4):
        old = np.full(size, round_, np.uint8)
        e.write(tier, 3, old)
        new = np.full(size, 100 + round_, np.uint8)
        new[-4096:] = np.arange(4096) % 251
        tw = e.submit_write(tier, [(3, 0, size)], new)
        out = np.zeros(4096 + 1, np.uint8)[1:]
        tr = e.submit_read(tier, [(3 + size - 4096, 0, 4096)], out)
        e.wait(tr)  # Waiting for the read alone is enough: it ran after the write.
        np.testing.assert_array_equal(out, new[-4096:])
        e.wait(tw)


def test_read_then_overlapping_write_reads_old_data(make_engine, add_tier, tier_kind):
    # A long read and a short write at its end: the write must not land before the read got
    # there, even though both are queued together.
    e = make_engine(num_workers=4, io_chunk_bytes=64 * 1024, debug_delay_us=2000)
    tier = add_tier(e, tier_kind, block_bytes=MiB, num_blocks=4)
    size = 3 * MiB + 5
    for round_ in range(4):
        old = (np.arange(size) * (round_ + 3) % 253).astype(np.uint8)
        e.write(tier, 1, old)
        out = np.zeros(size, np.uint8)
        tr = e.submit_read(tier, [(1, 0, size)], out)
        patch = np.full(4096, 0xEE, np.uint8)
        tw = e.submit_write(tier, [(1 + size - 4096, 0, 4096)], patch)
        e.wait(tw)
        e.wait(tr)
        np.testing.assert_array_equal(out, old)
        check = np.zeros(size, np.uint8)
        e.read(tier, 1, check)
        np.testing.assert_array_equal(check[-4096:], patch)
        np.testing.assert_array_equal(check[:-4096], old[:-4096])


def test_write_write_same_bytes_last_submitted_wins(make_engine, add_tier, tier_kind):
    e = make_engine(num_workers=4, debug_delay_us=500)
    tier = add_tier(e, tier_kind, block_bytes=4096, num_blocks=64)
    tickets = []
    for v in range(16):
        # Decreasing sizes: a reordering would leave a longer, older write's tail visible.
        n = 60000 - 3000 * v
        tickets.append(e.submit_write(tier, [(7, 0, n)], np.full(n, v, np.uint8)))
    for t in tickets:
        e.wait(t)
    out = np.zeros(60000, np.uint8)
    e.read(tier, 7, out)
    expected = np.zeros(60000, np.uint8)
    for v in range(16):
        expected[: 60000 - 3000 * v] = v
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("kind", ("file_direct", "file_buffered", "host", "shm"))
def test_adjacent_unaligned_writes_sharing_a_page_both_survive(make_engine, add_tier, kind):
    """On an O_DIRECT tier each write read-modify-writes whole pages; two writes that share a
    page but not a byte must still both land."""
    rng = np.random.default_rng(3)
    e = make_engine(num_workers=4, io_chunk_bytes=4096)
    tier = add_tier(e, kind, block_bytes=4096, num_blocks=80)
    e.write(tier, 0, np.zeros(4096 * 80, np.uint8))
    expected = np.zeros(4096 * 80, np.uint8)
    tickets = []
    for page in range(0, 64):
        split = int(rng.integers(1, 4096))
        start = page * 4096 + int(rng.integers(0, split))
        end = page * 4096 + 4096 + int(rng.integers(0, 4096))  # Spills into the next page.
        a = rng.integers(1, 256, size=split - (start - page * 4096), dtype=np.uint8)
        b = rng.integers(1, 256, size=end - (page * 4096 + split), dtype=np.uint8)
        # a ends where b begins, mid-page; b also shares its tail page with the next pair's a.
        tickets.append(e.submit_write(tier, [(start, 0, a.size)], a))
        tickets.append(e.submit_write(tier, [(start + a.size, 0, b.size)], b))
        expected[start : start + a.size] = a
        expected[start + a.size : start + a.size + b.size] = b
    for t in tickets:
        e.wait(t)
    out = np.zeros_like(expected)
    e.read(tier, 0, out)
    np.testing.assert_array_equal(out, expected)


def test_reads_of_the_same_bytes_run_concurrently(make_engine, add_tier):
    e = make_engine(num_workers=4, debug_delay_us=100_000, record_timeline=True)
    tier = add_tier(e, "host", block_bytes=4096, num_blocks=4)
    outs = [np.zeros(4096, np.uint8) for _ in range(3)]
    tickets = [e.submit_read(tier, [(0, 0, 4096)], o) for o in outs]
    for t in tickets:
        e.wait(t)
    rows = _transfers_by_ticket(e)
    assert _intervals_overlap(rows[tickets[0]], rows[tickets[1]])
    assert _intervals_overlap(rows[tickets[1]], rows[tickets[2]])


@pytest.mark.parametrize(
    "kind,same_page_serialized", [("host", False), ("file_buffered", False), ("file_direct", True)]
)
def test_hazard_granularity_in_the_timeline(make_engine, add_tier, kind, same_page_serialized):
    """Disjoint writes run concurrently, except on an O_DIRECT tier when they share a page;
    overlapping read/write pairs never overlap in time and keep their order."""
    e = make_engine(num_workers=4, debug_delay_us=60_000, record_timeline=True)
    tier = add_tier(e, kind, block_bytes=4096, num_blocks=16)
    a = e.submit_write(tier, [(0, 0, 100)], np.ones(100, np.uint8))
    b = e.submit_write(tier, [(100, 0, 100)], np.ones(100, np.uint8))  # Same page, other bytes.
    c = e.submit_write(tier, [(3 * 4096, 0, 100)], np.ones(100, np.uint8))  # Another page.
    r = e.submit_read(tier, [(150, 0, 10)], np.zeros(10, np.uint8))  # Overlaps b.
    for t in (a, b, c, r):
        e.wait(t)
    rows = _transfers_by_ticket(e)
    assert _intervals_overlap(rows[a], rows[c])
    assert _intervals_overlap(rows[a], rows[b]) == (not same_page_serialized)
    if same_page_serialized:
        assert rows[b][7] >= rows[a][8]
    assert rows[r][7] >= rows[b][8]  # The read started after the write it overlaps ended.
