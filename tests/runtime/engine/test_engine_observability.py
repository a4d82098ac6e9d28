"""Throttling (in-flight cap, bandwidth pacing), stats and the timeline."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jax_tpusync.runtime.engine import monotonic_ns

MiB = 1 << 20


@pytest.mark.parametrize("kind", ("host", "file_direct"))
def test_inflight_cap_is_respected(make_engine, add_tier, kind):
    cap = 1 * MiB
    e = make_engine(
        num_workers=4, max_inflight_bytes=cap, debug_delay_us=2_000, record_timeline=True
    )
    t = add_tier(e, kind, block_bytes=MiB, num_blocks=8)
    sizes = [300_000, 700_000, 100_000, 1_000_000, 250_000, 250_000, 250_000, 250_000] * 3
    tickets = []
    for i, n in enumerate(sizes):
        off = (i % 8) * MiB
        tickets.append(e.submit_read(t, [(off, 0, n)], np.zeros(n, np.uint8)))
    for x in tickets:
        e.wait(x)
    peak = e.stats()["inflight_bytes_peak"]
    assert 0 < peak <= cap
    # Cross-check with the timeline: at every start, the running requests fit under the cap.
    rows = e.timeline().transfers
    for r in rows:
        running = sum(o[5] for o in rows if o[7] <= r[7] < o[8])
        assert running <= cap


def test_without_cap_requests_run_together(make_engine):
    e = make_engine(num_workers=4, debug_delay_us=50_000)
    t = e.add_host_tier(block_bytes=MiB, num_blocks=4)
    tickets = [e.submit_read(t, [(i * MiB, 0, MiB)], np.zeros(MiB, np.uint8)) for i in range(4)]
    for x in tickets:
        e.wait(x)
    assert e.stats()["inflight_bytes_peak"] > MiB


def test_request_larger_than_cap_runs_alone(make_engine):
    e = make_engine(
        num_workers=3, max_inflight_bytes=64 * 1024, debug_delay_us=20_000, record_timeline=True
    )
    t = e.add_host_tier(block_bytes=MiB, num_blocks=2)
    small = [e.submit_read(t, [(i * 1000, 0, 1000)], np.zeros(1000, np.uint8)) for i in range(3)]
    big = e.submit_read(t, [(MiB, 0, MiB)], np.zeros(MiB, np.uint8))
    for x in small + [big]:
        e.wait(x)
    assert e.stats()["inflight_bytes_peak"] == MiB
    rows = {r[0]: r for r in e.timeline().transfers}
    for s in small:  # FIFO under the cap: the big one waits for the small ones, then runs alone.
        assert rows[big][7] >= rows[s][8]


def test_bandwidth_pacing(make_engine):
    n = 20_000_000
    e = make_engine(max_bytes_per_second=50e6, io_chunk_bytes=256 * 1024)
    t = e.add_host_tier(block_bytes=MiB, num_blocks=20)
    buf = np.zeros(n, np.uint8)
    t0 = time.monotonic()
    e.write(t, 0, buf)
    paced = time.monotonic() - t0
    assert paced >= 0.3  # 20 MB at 50 MB/s: 0.4 s, give or take a chunk.
    fast = make_engine(io_chunk_bytes=256 * 1024)
    ft = fast.add_host_tier(block_bytes=MiB, num_blocks=20)
    t0 = time.monotonic()
    fast.write(ft, 0, buf)
    assert time.monotonic() - t0 < paced


def test_pacing_is_shared_by_concurrent_requests(make_engine):
    # Two 5 MB requests on two workers share one 50 MB/s budget: >= ~0.2 s in all.
    e = make_engine(num_workers=2, max_bytes_per_second=50e6, io_chunk_bytes=256 * 1024)
    t = e.add_host_tier(block_bytes=MiB, num_blocks=16)
    t0 = time.monotonic()
    a = e.submit_read(t, [(0, 0, 5_000_000)], np.zeros(5_000_000, np.uint8))
    b = e.submit_read(t, [(8 * MiB, 0, 5_000_000)], np.zeros(5_000_000, np.uint8))
    e.wait(a)
    e.wait(b)
    assert time.monotonic() - t0 >= 0.15


def test_stats_per_tier_and_direction(make_engine, add_tier):
    e = make_engine()
    host = add_tier(e, "host", block_bytes=4096, num_blocks=16)
    f = add_tier(e, "file_direct", block_bytes=4096, num_blocks=16)
    e.write(host, 0, np.ones(1000, np.uint8))
    e.write(host, 5000, np.ones(24, np.uint8))
    e.wait(e.submit_write(host, [(0, 0, 10), (100, 10, 20)], np.ones(30, np.uint8)))
    e.read(f, 1, np.zeros(333, np.uint8))
    s = e.stats()
    assert s["tiers"][host]["write_back"]["bytes"] == 1054
    assert s["tiers"][host]["write_back"]["requests"] == 3
    assert s["tiers"][host]["fetch"] == {
        "bytes": 0,
        "requests": 0,
        "segments": 0,
        "bytes_per_segment": 0.0,
        "busy_s": 0.0,
        "gbps": 0.0,
    }
    assert s["tiers"][host]["write_back"]["segments"] >= 3
    assert s["tiers"][f]["fetch"]["bytes"] == 333 and s["tiers"][f]["fetch"]["requests"] == 1
    assert s["tiers"][f]["write_back"]["requests"] == 0
    assert s["tiers"][host]["write_back"]["busy_s"] > 0
    assert s["tiers"][host]["write_back"]["gbps"] > 0
    assert s["waits"] == 4
    assert s["wait_s"] >= 0
    assert s["prefetch_hits"] == 0 and s["prefetch_misses"] == 0
    e.reset_stats()
    s = e.stats()
    assert len(s["tiers"]) == 2 and s["waits"] == 0 and s["inflight_bytes_peak"] == 0
    assert all(x[d]["bytes"] == 0 for x in s["tiers"] for d in ("fetch", "write_back"))


def test_busy_time_counts_overlap_once(make_engine):
    e = make_engine(num_workers=4, debug_delay_us=100_000)
    t = e.add_host_tier(block_bytes=4096, num_blocks=8)
    t0 = time.monotonic()
    tickets = [e.submit_read(t, [(i * 4096, 0, 4096)], np.zeros(4096, np.uint8)) for i in range(4)]
    for x in tickets:
        e.wait(x)
    wall = time.monotonic() - t0
    busy = e.stats()["tiers"][t]["fetch"]["busy_s"]
    assert 0.09 <= busy <= wall + 0.01  # Four concurrent 0.1 s requests: ~0.1 s busy, not 0.4.


def test_timeline_records_transfers_waits_and_marks(make_engine):
    e = make_engine(num_workers=2, debug_delay_us=50_000, record_timeline=True)
    t = e.add_host_tier(block_bytes=4096, num_blocks=8)
    before = monotonic_ns()
    assert abs(before - time.monotonic_ns()) < 50_000_000  # The same clock.
    w = e.submit_write(t, [(0, 0, 4096)], np.ones(4096, np.uint8), layer=3, chunk=1)
    r = e.submit_read(t, [(10, 0, 100)], np.zeros(100, np.uint8), layer=4, chunk=2)
    e.mark(7, layer=3, chunk=9)
    e.wait(w)
    e.wait(r)
    bad = e.submit_read(t, [(0, 0, 10)], np.zeros(10, np.uint8))
    e.cancel(bad)  # Within its 50 ms debug delay: it never completes.
    with pytest.raises(RuntimeError):
        e.wait(bad)
    after = monotonic_ns()
    tl = e.timeline()
    rows = {row[0]: row for row in tl.transfers}
    assert set(rows) == {w, r, bad}
    tw, tr = rows[w], rows[r]
    assert tw[1:6] == (t, 1, 3, 1, 4096)  # tier, direction (write-back), layer, chunk, bytes
    assert tr[1:6] == (t, 0, 4, 2, 100)
    for row in (tw, tr):
        submit, start, end, ok = row[6:]
        assert before <= submit <= start <= end <= after
        assert end - start >= 50_000_000  # The debug delay runs inside the transfer.
        assert ok is True
    assert tr[7] >= tw[8]  # Ordered after the overlapping write.
    assert rows[bad][9] is False and rows[bad][5] == 10
    waits = {row[0]: row for row in tl.waits}
    assert set(waits) == {w, r, bad}
    assert waits[r][1:3] == (4, 2)
    assert waits[r][3] <= waits[r][4] and waits[r][4] >= tr[8]
    assert tl.marks == [(7, 3, 9, tl.marks[0][3])]
    assert before <= tl.marks[0][3] <= after
    # Taking the timeline clears it.
    empty = e.timeline()
    assert empty.transfers == [] and empty.waits == [] and empty.marks == []


def test_timeline_off_by_default(make_engine):
    e = make_engine()
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    e.write(t, 0, np.ones(10, np.uint8))
    e.mark(1)
    tl = e.timeline()
    assert tl.transfers == [] and tl.waits == [] and tl.marks == []
