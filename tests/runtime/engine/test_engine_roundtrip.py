"""Byte-exact round trips through every tier kind: odd sizes, unaligned tier offsets and
memory, multi-block segments, scatter/gather, many tickets in flight, several engines."""

from __future__ import annotations

import numpy as np
import pytest

MiB = 1 << 20
BLOCK = 64 * 1024
NUM_BLOCKS = 64  # 4 MiB per tier.
FILL = 0xA5
SIZES = (1, 4095, 4097, 3 * MiB + 7)
OFFSETS = (0, 1, 4095, 4096 * 3 + 5)
GUARD = 8191  # Bytes checked on each side of a write: it must not touch its neighbours.


def _fill(engine, tier, start, n, value=FILL):
    engine.write(tier, start, np.full(n, value, dtype=np.uint8))


# (size, io_chunk_bytes): every size with the default chunk, plus multi-chunk transfers whose
# last chunk is partial (the O_DIRECT bounce pipeline and the pacing/cancel points).
CASES = [(s, MiB) for s in SIZES] + [(4097, 4096), (3 * MiB + 7, 3 * 4096)]


@pytest.mark.parametrize(
    "size,io_chunk_bytes", CASES, ids=[f"{s}B-chunk{c // 1024}K" for s, c in CASES]
)
def test_round_trip_odd_sizes_and_alignments(
    make_engine, add_tier, tier_kind, rand, unaligned, size, io_chunk_bytes
):
    e = make_engine(io_chunk_bytes=io_chunk_bytes)
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=NUM_BLOCKS)
    cap = BLOCK * NUM_BLOCKS
    for i, offset in enumerate(OFFSETS):
        lo = max(0, offset - GUARD)
        hi = min(cap, offset + size + GUARD)
        _fill(e, tier, lo, hi - lo)
        data = rand(size, seed=size * 31 + i)
        # Odd source pointer for half of the writes, aligned (numpy default) for the others.
        src = data
        if i % 2:
            src = unaligned(size)
            src[:] = data
        e.write(tier, offset, src)

        for out in (np.zeros(size, np.uint8), unaligned(size)):
            e.read(tier, offset, out)
            np.testing.assert_array_equal(out, data)

        # The neighbourhood is untouched (a read-modify-write of a partial page keeps it).
        window = e.read(tier, lo, unaligned(hi - lo))
        expected = np.full(hi - lo, FILL, np.uint8)
        expected[offset - lo : offset - lo + size] = data
        np.testing.assert_array_equal(window, expected)


def test_round_trip_non_uint8_buffers(make_engine, add_tier, tier_kind):
    e = make_engine()
    tier = add_tier(e, tier_kind, block_bytes=4096, num_blocks=16)
    src = np.linspace(-3, 3, 1001, dtype=np.float32).reshape(7, 143)
    e.write(tier, 13, src)
    out = np.empty_like(src)
    e.read(tier, 13, out)
    np.testing.assert_array_equal(out.view(np.uint32), src.view(np.uint32))
    # A non-contiguous source is made contiguous before writing.
    e.write(tier, 9000, src[:, ::2])
    out2 = np.empty((7, 72), np.float32)
    e.read(tier, 9000, out2)
    np.testing.assert_array_equal(out2, src[:, ::2])


def test_segments_spanning_blocks(make_engine, add_tier, tier_kind, rand):
    e = make_engine(io_chunk_bytes=4096)
    block = 1000  # Odd block size: block boundaries never meet page boundaries.
    tier = add_tier(e, tier_kind, block_bytes=block, num_blocks=64)
    first = e.allocate(tier, 20)
    start = first * block + 999  # One byte before a block boundary.
    data = rand(10 * block + 3, seed=7)
    e.write(tier, start, data)
    out = np.zeros_like(data)
    e.read(tier, start, out)
    np.testing.assert_array_equal(out, data)
    # Read it back block by block through a single scattered request.
    pieces = [(start + k, k, min(block, data.size - k)) for k in range(0, data.size, block)]
    out2 = np.zeros_like(data)
    e.wait(e.submit_read(tier, pieces[::-1], out2))
    np.testing.assert_array_equal(out2, data)


def test_scatter_gather_many_segments(make_engine, add_tier, tier_kind):
    rng = np.random.default_rng(1234)
    e = make_engine(io_chunk_bytes=8192)
    tier = add_tier(e, tier_kind, block_bytes=4096, num_blocks=256)  # 1 MiB.
    cap = 4096 * 256
    n = 150
    sizes = rng.integers(1, 5000, size=n)
    # Disjoint tier ranges in a shuffled order, with gaps, anywhere in the tier.
    slots = rng.permutation(cap // 6000)[:n]
    tier_offsets = slots * 6000 + rng.integers(0, 6000 - 5000, size=n)
    mem_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(sizes.sum())
    src = rng.integers(0, 256, size=total + 1, dtype=np.uint8)[1:]  # Odd pointer.
    segs = np.stack([tier_offsets, mem_offsets, sizes], axis=1)
    e.wait(e.submit_write(tier, segs, src))

    # Gather back with one request into a fresh layout (reversed memory order).
    rev_mem = np.concatenate([[0], np.cumsum(sizes[::-1])[:-1]])[::-1]
    out = np.zeros(total, np.uint8)
    e.wait(e.submit_read(tier, np.stack([tier_offsets, rev_mem, sizes], axis=1), out))
    for i in range(n):
        np.testing.assert_array_equal(
            out[rev_mem[i] : rev_mem[i] + sizes[i]], src[mem_offsets[i] : mem_offsets[i] + sizes[i]]
        )
    # And each segment on its own.
    for i in range(0, n, 17):
        one = np.zeros(int(sizes[i]), np.uint8)
        e.read(tier, int(tier_offsets[i]), one)
        np.testing.assert_array_equal(one, src[mem_offsets[i] : mem_offsets[i] + sizes[i]])


def test_zero_byte_segments_are_skipped(make_engine, add_tier, tier_kind):
    e = make_engine()
    tier = add_tier(e, tier_kind, block_bytes=4096, num_blocks=4)
    buf = np.arange(10, dtype=np.uint8)
    e.wait(e.submit_write(tier, [(5, 0, 0), (100, 0, 10), (7, 3, 0)], buf))
    e.wait(e.submit_write(tier, np.zeros((0, 3), np.int64), buf))
    out = np.zeros(10, np.uint8)
    e.read(tier, 100, out)
    np.testing.assert_array_equal(out, buf)


def test_many_tickets_in_flight(make_engine, add_tier, tier_kind, unaligned):
    rng = np.random.default_rng(99)
    e = make_engine(num_workers=3, io_chunk_bytes=16384)
    tier = add_tier(e, tier_kind, block_bytes=8192, num_blocks=64 * 8)
    n = 64
    stride = 8 * 8192
    sizes = rng.integers(1, stride - 4096, size=n)
    offsets = np.arange(n) * stride + rng.integers(0, 4096, size=n)
    datas = [rng.integers(0, 256, size=int(s), dtype=np.uint8) for s in sizes]
    writes = [
        e.submit_write(tier, [(int(o), 0, int(s))], d) for o, s, d in zip(offsets, sizes, datas)
    ]
    assert len(set(writes)) == n and all(t > 0 for t in writes)
    for t in writes:
        e.wait(t)
    outs = [unaligned(int(s)) for s in sizes]
    reads = [
        e.submit_read(tier, [(int(o), 0, int(s))], out) for o, s, out in zip(offsets, sizes, outs)
    ]
    for t in reversed(reads):  # Waiting order is free.
        e.wait(t)
    for d, out in zip(datas, outs):
        np.testing.assert_array_equal(out, d)
    s = e.stats()["tiers"][tier]
    assert s["write_back"]["requests"] == n and s["fetch"]["requests"] == n
    assert s["fetch"]["bytes"] == s["write_back"]["bytes"] == int(sizes.sum())


def test_writes_and_reads_in_flight_together(make_engine, add_tier, tier_kind):
    """Every read is submitted right after its write, without waiting: ordering does it."""
    rng = np.random.default_rng(5)
    e = make_engine(num_workers=4, io_chunk_bytes=4096)
    tier = add_tier(e, tier_kind, block_bytes=4096, num_blocks=128)
    tickets, checks = [], []
    for i in range(48):
        off = int(rng.integers(0, 4096 * 120))
        data = rng.integers(0, 256, size=int(rng.integers(1, 20000)), dtype=np.uint8)
        tickets.append(e.submit_write(tier, [(off, 0, data.size)], data))
        out = np.zeros_like(data)
        tickets.append(e.submit_read(tier, [(off, 0, data.size)], out))
        checks.append((i, off, data.copy(), out))
    for t in tickets:
        e.wait(t)
    # Later writes may overwrite earlier ones, but every read ran right after its own write
    # and before any later overlapping write.
    for _, _, data, out in checks:
        np.testing.assert_array_equal(out, data)


def test_several_engines_in_one_process(make_engine, add_tier, rand):
    engines = [make_engine(num_workers=1 + i % 2) for i in range(3)]
    assert len({e.id for e in engines}) == 3
    tiers = []
    for i, e in enumerate(engines):
        tiers.append(
            [add_tier(e, kind, block_bytes=4096, num_blocks=64) for kind in ("host", "file_direct")]
        )
    tickets = []
    expected = []
    for round_ in range(4):
        for i, e in enumerate(engines):
            for t in tiers[i]:
                data = rand(5000 + 17 * i + round_, seed=100 * i + 10 * t + round_)
                off = round_ * 6000 + i
                tickets.append((e, e.submit_write(t, [(off, 0, data.size)], data)))
                expected.append((e, t, off, data))
    for e, t in tickets:
        e.wait(t)
    for e, t, off, data in expected:
        out = np.zeros_like(data)
        e.read(t, off, out)
        np.testing.assert_array_equal(out, data)
    # Each engine counts only its own traffic.
    for e in engines:
        s = e.stats()
        assert sum(x["write_back"]["requests"] for x in s["tiers"]) == 8
    # Closing one leaves the others working.
    engines[0].close()
    out = np.zeros(10, np.uint8)
    engines[1].read(tiers[1][0], 0, out)
