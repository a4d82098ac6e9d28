"""start_fetch / wait_fetch / write_back inside jax.jit on CPU: bytes, ordering, prefetch
hit/miss accounting, and poison mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync import EngineConfig
from jax_tpusync.runtime import ops

BLOCK = 4096
TAG = np.array([0, 0], np.int32)


def _rows(tier_offsets, memory_offsets, sizes, block=BLOCK):
    return jnp.asarray(ops.segment_rows(tier_offsets, memory_offsets, sizes, block))


def _as_bytes(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


def _fetch_fn(engine_id, tier, *, compute=True):
    """jit(x, dst, segs) -> (y, dst): start, optional overlapped compute, wait."""

    def step(x, dst, segs):
        x, ticket = ops.start_fetch(engine_id, tier, x, segs, TAG, dst_bytes=ops.buffer_bytes(dst))
        y = jnp.tanh(x * 2.0) if compute else x
        dst = ops.wait_fetch(engine_id, tier, dst, ticket, segs, TAG, deps=(y,))
        return y, dst

    return jax.jit(step, donate_argnums=(1,))


def test_fetch_in_jit_uint8(make_engine, add_tier, tier_kind):
    e = make_engine()
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=64)
    data = np.random.default_rng(0).integers(0, 256, size=50_001, dtype=np.uint8)
    e.write(tier, 3 * BLOCK + 17, data)
    # Three segments: unaligned tier offsets, scattered into dst out of order.
    segs = _rows(
        [3 * BLOCK + 17, 3 * BLOCK + 17 + 20_000, 3 * BLOCK + 17 + 40_000],
        [30_001, 0, 20_001],
        [20_000, 10_001, 10_000],
    )
    fn = _fetch_fn(e.id, tier)
    y, dst = fn(jnp.ones(8), jnp.zeros(50_001, jnp.uint8), segs)
    got = _as_bytes(dst)
    np.testing.assert_array_equal(got[30_001:50_001], data[:20_000])
    np.testing.assert_array_equal(got[0:10_001], data[20_000:30_001])
    np.testing.assert_array_equal(got[20_001:30_001], data[40_000:50_000])
    np.testing.assert_allclose(y, np.tanh(2.0), rtol=1e-6)
    s = e.stats()
    assert s["prefetch_hits"] == 1 and s["prefetch_misses"] == 0
    assert s["tiers"][tier]["fetch"]["bytes"] == 20_000 + 10_001 + 10_000


def test_fetch_in_jit_float32_bits(make_engine, add_tier, tier_kind):
    e = make_engine()
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=64)
    src = np.random.default_rng(1).standard_normal((64, 257)).astype(np.float32)
    src[0, :4] = [np.nan, np.inf, -0.0, 1e-45]  # Bits, not values, must survive.
    e.write(tier, 5 * BLOCK + 3, src)
    segs = _rows([5 * BLOCK + 3], [0], [src.nbytes])
    fn = _fetch_fn(e.id, tier)
    for _ in range(3):  # Repeated calls reuse the compiled function; every one is a hit.
        _, dst = fn(jnp.ones(4), jnp.zeros((64, 257), jnp.float32), segs)
        np.testing.assert_array_equal(np.asarray(dst).view(np.uint32), src.view(np.uint32))
    assert e.stats()["prefetch_hits"] == 3


def test_fetch_without_donation_still_correct(make_engine):
    e = make_engine()
    tier = e.add_host_tier(block_bytes=BLOCK, num_blocks=16)
    data = np.arange(10_000, dtype=np.uint8)
    e.write(tier, 1, data)
    segs = _rows([1], [0], [10_000])

    @jax.jit
    def step(x, dst, segs):
        x, ticket = ops.start_fetch(e.id, tier, x, segs, TAG, dst_bytes=ops.buffer_bytes(dst))
        return ops.wait_fetch(e.id, tier, dst, ticket, segs, TAG, deps=(x,))

    dst_in = jnp.zeros(10_000, jnp.uint8)
    out = step(jnp.ones(2), dst_in, segs)
    np.testing.assert_array_equal(_as_bytes(out), data)
    np.testing.assert_array_equal(np.asarray(dst_in), 0)  # The caller's array is untouched.


def test_pipelined_layers_in_one_jit(make_engine, add_tier, tier_kind):
    """Layer i+1's fetch starts before layer i's wait, the way a decode step streams KV."""
    e = make_engine(num_workers=2)
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=64)
    layers, nbytes = 4, 3 * BLOCK + 5
    datas = [np.full(nbytes, 10 + i, np.uint8) for i in range(layers)]
    for i, d in enumerate(datas):
        e.write(tier, i * 4 * BLOCK + 1, d)
    segs = [_rows([i * 4 * BLOCK + 1], [0], [nbytes]) for i in range(layers)]

    def decode(x, bufs):
        bufs = list(bufs)
        x, ticket = ops.start_fetch(
            e.id, tier, x, segs[0], TAG, dst_bytes=ops.buffer_bytes(bufs[0])
        )
        acc = jnp.zeros((), jnp.float32)
        for i in range(layers):
            nxt = None
            if i + 1 < layers:
                x, nxt = ops.start_fetch(
                    e.id,
                    tier,
                    x,
                    segs[i + 1],
                    np.array([i + 1, 0], np.int32),
                    dst_bytes=ops.buffer_bytes(bufs[i + 1]),
                )
            x = jnp.sin(x)
            bufs[i] = ops.wait_fetch(
                e.id, tier, bufs[i], ticket, segs[i], np.array([i, 0], np.int32), deps=(x,)
            )
            acc = acc + bufs[i].astype(jnp.float32).sum()
            x = x + acc * 0
            ticket = nxt
        return acc, tuple(bufs)

    fn = jax.jit(decode, donate_argnums=(1,))
    acc, bufs = fn(jnp.ones(16), tuple(jnp.zeros(nbytes, jnp.uint8) for _ in range(layers)))
    for i in range(layers):
        np.testing.assert_array_equal(np.asarray(bufs[i]), datas[i])
    assert float(acc) == sum(float(d.astype(np.float64).sum()) for d in datas)
    assert e.stats()["prefetch_hits"] == layers


def test_write_back_then_fetch_in_a_later_call(make_engine, add_tier, tier_kind):
    # The write-back is detached and slowed down; the later fetch must still see its bytes.
    e = make_engine(debug_delay_us=30_000)
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=32)
    e.write(tier, 0, np.zeros(32 * BLOCK, np.uint8))
    src = np.random.default_rng(2).integers(0, 256, size=20_000, dtype=np.uint8)
    # Two source ranges written to two tier places (gather from src).
    wb_segs = _rows([7, 10 * BLOCK + 9], [0, 12_000], [12_000, 8_000])
    write_back = jax.jit(lambda s, g: ops.write_back(e.id, tier, s, g, TAG))
    token = write_back(jnp.asarray(src), wb_segs)
    assert token.shape == () and token.dtype == jnp.int32
    fetch = _fetch_fn(e.id, tier, compute=False)
    _, dst = fetch(
        jnp.ones(1),
        jnp.zeros(20_000, jnp.uint8),
        _rows([7, 10 * BLOCK + 9], [0, 12_000], [12_000, 8_000]),
    )
    np.testing.assert_array_equal(_as_bytes(dst), src)
    e.drain()
    assert e.stats()["tiers"][tier]["write_back"]["bytes"] == 20_000 + 32 * BLOCK


def test_write_back_then_fetch_in_the_same_call(make_engine, add_tier, tier_kind):
    e = make_engine(debug_delay_us=20_000)
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=32)
    e.write(tier, 0, np.full(32 * BLOCK, 0x11, np.uint8))
    segs = _rows([BLOCK + 100], [0], [4 * 5000])

    def step(new_kv, x, dst, segs):
        token = ops.write_back(e.id, tier, new_kv, segs, TAG)
        x, ticket = ops.start_fetch(
            e.id, tier, x, segs, TAG, dst_bytes=ops.buffer_bytes(dst), deps=(token,)
        )
        dst = ops.wait_fetch(e.id, tier, dst, ticket, segs, TAG, deps=(x,))
        return x, dst

    fn = jax.jit(step, donate_argnums=(2,))
    for round_ in range(3):
        new_kv = jnp.arange(5000, dtype=jnp.float32) + 1000.0 * round_
        _, dst = fn(new_kv, jnp.ones(3), jnp.zeros(5000, jnp.float32), segs)
        np.testing.assert_array_equal(np.asarray(dst), np.asarray(new_kv))


def test_write_back_source_may_be_reused_at_once(make_engine):
    e = make_engine(debug_delay_us=50_000)
    tier = e.add_host_tier(block_bytes=BLOCK, num_blocks=8)
    segs = _rows([0], [0], [4000])

    @jax.jit
    def step(x):
        kv = x * 2.0
        token = ops.write_back(e.id, tier, kv, segs, TAG)
        # kv's buffer is dead after the write-back returns; XLA may reuse it for this result.
        return jnp.sin(x) + token.astype(jnp.float32)

    x = jnp.arange(1000, dtype=jnp.float32)
    step(x).block_until_ready()
    e.drain()
    out = np.zeros(1000, np.float32)
    e.read(tier, 0, out)
    np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float32) * 2.0)


def test_wait_without_ticket_fetches_itself(make_engine, add_tier, tier_kind):
    e = make_engine()
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=16)
    data = np.random.default_rng(3).integers(0, 256, size=9000, dtype=np.uint8)
    e.write(tier, 33, data)
    segs = _rows([33], [0], [9000])
    fn = jax.jit(
        lambda dst, segs: ops.wait_fetch(e.id, tier, dst, ops.NO_TICKET, segs, TAG),
        donate_argnums=(0,),
    )
    out = fn(jnp.zeros(9000, jnp.uint8), segs)
    np.testing.assert_array_equal(_as_bytes(out), data)
    s = e.stats()
    assert s["prefetch_misses"] == 1 and s["prefetch_hits"] == 0
    assert s["tiers"][tier]["fetch"]["requests"] == 1


def test_mismatched_ticket_is_never_stale(make_engine, add_tier, tier_kind):
    e = make_engine(debug_delay_us=20_000)
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=16)
    stale = np.full(6000, 0xAA, np.uint8)
    wanted = np.random.default_rng(4).integers(0, 256, size=6000, dtype=np.uint8)
    e.write(tier, 1, stale)
    e.write(tier, 8 * BLOCK + 1, wanted)
    prefetched = _rows([1], [0], [6000])  # What the start fetched...
    needed = _rows([8 * BLOCK + 1], [0], [6000])  # ...is not what the wait needs.

    def step(x, dst, a, b):
        x, ticket = ops.start_fetch(e.id, tier, x, a, TAG, dst_bytes=ops.buffer_bytes(dst))
        return ops.wait_fetch(e.id, tier, dst, ticket, b, TAG, deps=(x,))

    fn = jax.jit(step, donate_argnums=(1,))
    out = fn(jnp.ones(1), jnp.zeros(6000, jnp.uint8), prefetched, needed)
    np.testing.assert_array_equal(_as_bytes(out), wanted)
    s = e.stats()
    assert s["prefetch_misses"] == 1 and s["prefetch_hits"] == 0
    # The file tier ran the stale prefetch and the real fetch; the host tier reads only at
    # the wait (memory defers its fetches: a read ahead would copy every byte twice).
    assert s["tiers"][tier]["fetch"]["requests"] == (1 if tier_kind == "host" else 2)
    # Same segments: a hit.
    out = fn(jnp.ones(1), jnp.zeros(6000, jnp.uint8), needed, needed)
    np.testing.assert_array_equal(_as_bytes(out), wanted)
    s = e.stats()
    assert s["prefetch_hits"] == 1 and s["prefetch_misses"] == 1


def test_wait_with_a_different_tag_is_still_a_hit(make_engine):
    e = make_engine(record_timeline=True)
    tier = e.add_host_tier(block_bytes=BLOCK, num_blocks=4)
    e.write(tier, 0, np.ones(100, np.uint8))
    segs = _rows([0], [0], [100])

    def step(x, dst, segs):
        x, ticket = ops.start_fetch(
            e.id, tier, x, segs, np.array([5, 6], np.int32), dst_bytes=ops.buffer_bytes(dst)
        )
        return ops.wait_fetch(e.id, tier, dst, ticket, segs, np.array([5, 6], np.int32), deps=(x,))

    out = jax.jit(step, donate_argnums=(1,))(jnp.ones(1), jnp.zeros(100, jnp.uint8), segs)
    np.testing.assert_array_equal(np.asarray(out), 1)
    tl = e.timeline()
    fetches = [r for r in tl.transfers if r[2] == 0]
    assert [(r[3], r[4]) for r in fetches] == [(5, 6)]
    assert [(w[1], w[2]) for w in tl.waits if w[0] == fetches[0][0]] == [(5, 6)]


@pytest.mark.parametrize("poison", (False, True))
@pytest.mark.parametrize("kind", ("host", "file"))
def test_only_the_wait_writes_the_buffer(make_engine, add_tier, kind, poison):
    """A fetch in flight never writes the XLA buffer: read before the wait, the buffer
    still holds what it held (even with poisoned fetches and a slow transfer); the wait
    fills it with the fetched bytes."""
    n = 4096
    data = np.random.default_rng(5).uniform(1, 2, size=n).astype(np.float32)
    e = make_engine(poison_fetches=poison, debug_delay_us=200_000)
    tier = add_tier(e, kind, block_bytes=BLOCK, num_blocks=8)
    e.write(tier, 3, data)
    segs = _rows([3], [0], [data.nbytes])

    def read_early(x, dst, segs):
        x, ticket = ops.start_fetch(e.id, tier, x, segs, TAG, dst_bytes=ops.buffer_bytes(dst))
        early_sum = dst.sum()  # Before its wait: must see the old contents.
        dst = ops.wait_fetch(e.id, tier, dst, ticket, segs, TAG, deps=(early_sum,))
        return early_sum, dst

    fn = jax.jit(read_early, donate_argnums=(1,))
    early_sum, dst = fn(jnp.ones(1), jnp.full(n, 0.5, jnp.float32), segs)
    assert float(early_sum) == 0.5 * n
    np.testing.assert_array_equal(np.asarray(dst), data)
    assert e.stats()["prefetch_hits"] == 1


def test_a_host_tier_read_runs_on_the_calling_thread_unless_a_write_conflicts(make_engine):
    """A wait's read of a memory tier does not queue behind the lone worker's unrelated
    work (it ends before a 128 MiB write to another tier does), but a write-back of its
    own bytes queued before it still comes first (the read sees the new bytes)."""
    e = make_engine(num_workers=1, record_timeline=True)
    tier = e.add_host_tier(block_bytes=BLOCK, num_blocks=4)
    other = e.add_host_tier(block_bytes=1 << 20, num_blocks=128)
    e.write(tier, 0, np.full(100, 7, np.uint8))
    segs = _rows([0], [0], [100])
    read = jax.jit(
        lambda dst: ops.wait_fetch(e.id, tier, dst, jnp.int32(ops.NO_TICKET), segs, TAG),
        donate_argnums=(0,),
    )
    # Compiled first: on a loaded machine the compile alone can outlast the write below.
    np.testing.assert_array_equal(_as_bytes(read(jnp.zeros(100, jnp.uint8))), 7)
    e.timeline()
    big = np.ones(128 << 20, np.uint8)
    busy = e.submit_write(other, [(0, 0, big.size)], big)
    np.testing.assert_array_equal(_as_bytes(read(jnp.zeros(100, jnp.uint8))), 7)
    e.wait(busy)
    transfers = e.timeline().transfers
    fetch, write = (
        next(r for r in transfers if r[2] == d and r[1] == t) for d, t in ((0, tier), (1, other))
    )
    assert fetch[8] < write[8]  # The read ended first: it never waited for the worker.
    # Behind the same worker's next big write, a write-back of the read's own bytes.
    busy = e.submit_write(other, [(0, 0, big.size)], big)
    e.submit_write(tier, [(0, 0, 100)], np.full(100, 9, np.uint8))
    np.testing.assert_array_equal(_as_bytes(read(jnp.zeros(100, jnp.uint8))), 9)
    e.wait(busy)


def test_a_fetch_of_no_bytes_is_never_queued(make_engine, add_tier, tier_kind):
    """A two-level cache's unit with nothing on one tier fetches zero-byte segments: the
    fetch is recorded only (no worker runs it, no request is counted) and its wait leaves
    the buffer as it was; one byte more is a real fetch."""
    e = make_engine()
    tier = add_tier(e, tier_kind, block_bytes=BLOCK, num_blocks=8)
    e.write(tier, BLOCK, np.full(16, 7, np.uint8))
    fn = _fetch_fn(e.id, tier)
    before = np.arange(16, dtype=np.uint8)
    _, dst = fn(jnp.ones(4), jnp.asarray(before), _rows([BLOCK, 2 * BLOCK], [0, 8], [0, 0]))
    np.testing.assert_array_equal(np.asarray(dst), before)
    s = e.stats()
    assert s["tiers"][tier]["fetch"]["requests"] == 0 and s["prefetch_hits"] == 1
    _, dst = fn(jnp.ones(4), jnp.asarray(before), _rows([BLOCK, 2 * BLOCK], [0, 8], [1, 0]))
    np.testing.assert_array_equal(np.asarray(dst), np.concatenate([[7], before[1:]]))
    assert e.stats()["tiers"][tier]["fetch"]["requests"] == 1


@pytest.mark.parametrize("split_read_bytes", [0, 64 << 10])
@pytest.mark.parametrize("kind", ["host", "file"])
def test_a_wait_copy_split_with_the_copy_helper_is_byte_exact(
    make_engine, add_tier, split_read_bytes, kind
):
    """A wait's copy of at least ``split_read_bytes`` (a host-tier read, or a file-tier
    fetch's copy from where it landed into the operand) is made half by the copy helper (a
    segment straddling the middle cut in two): byte-exact either way, split at exactly the
    threshold and not one byte below it."""
    threshold = split_read_bytes or 64 << 10
    e = make_engine(split_read_bytes=split_read_bytes)
    tier = add_tier(e, kind, block_bytes=BLOCK, num_blocks=128)
    pool = np.random.default_rng(3).integers(0, 256, 128 * BLOCK, dtype=np.uint8)
    e.write(tier, 0, pool)
    fn = _fetch_fn(e.id, tier)
    # Three uneven segments, out of tier order, scattered in the destination; the middle
    # byte of the read falls inside the second.
    sizes = [9_000, threshold - 9_000 - 7_001, 7_001]
    tier_at = [70 * BLOCK + 5, 3 * BLOCK + 1, 40 * BLOCK]
    dst_at = [0, 10_000, threshold + 20_000]
    for extra, splits in ((-1, 0), (0, 1)):
        sizes[2] = 7_001 + extra
        before = e.stats()["split_reads"]
        dst0 = np.zeros(threshold + 40_000, np.uint8)
        _, dst = fn(jnp.ones(4), jnp.asarray(dst0), _rows(tier_at, dst_at, sizes))
        want = dst0.copy()
        for t, d, n in zip(tier_at, dst_at, sizes):
            want[d : d + n] = pool[t : t + n]
        np.testing.assert_array_equal(_as_bytes(dst), want)
        assert e.stats()["split_reads"] - before == (splits if split_read_bytes else 0)


def test_split_read_bytes_must_not_be_negative():
    with pytest.raises(ValueError, match=r"split_read_bytes=-1 must be >= 0"):
        EngineConfig(split_read_bytes=-1)
