"""attend_landed: a unit fetched ahead from a file tier into the engine's landing memory,
attended where it landed (no copy into an XLA buffer), against the jnp reference; a fetch
that is not the one the op needs (other bytes, none, late) read again, never trusted; its
ordering after write-backs; the guards of attend_in_place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.runtime import ops

from support.attend_pool import (
    EXACT_ORDER_APART,
    QUANTIZED_APART,
    SHAPES,
    TAG,
    Pool,
    XlaError,
)


def file_pool(engine, file_dir, **kw):
    return Pool(engine, add_tier=functools.partial(engine.add_file_tier, file_dir), **kw)


def unit_bytes(pool) -> int:
    """The [2, batch, unit_len] rows the segments address: start_fetch's dst_bytes."""
    return 2 * pool.batch * pool.unit_len * pool.row_bytes


def landed(pool, q, want, k_start, valid, q_start, *, fetched=None, ticket=None, **kw):
    """attend_landed of segments ``want`` after start_fetch of ``fetched`` (default: the
    same segments; ``ticket=ops.NO_TICKET``: no fetch at all), in one jitted program."""
    positions = jnp.asarray(np.stack([k_start, valid, q_start]).astype(np.int32))
    fetched = want if fetched is None else fetched

    def step(q, want_rows, fetch_rows, positions):
        q, t = ops.start_fetch(
            pool.engine.id, pool.tier, q, fetch_rows, TAG, dst_bytes=unit_bytes(pool)
        )
        return ops.attend_landed(
            pool.engine.id,
            pool.tier,
            q,
            t if ticket is None else ticket,
            want_rows,
            positions,
            TAG,
            unit_len=pool.unit_len,
            kv_dtype=pool.dtype,
            tier_dtype=pool.tier_dtype,
            num_kv_heads=pool.kv_heads,
            **kw,
        )

    return jax.jit(step)(q, pool.rows(want), pool.rows(fetched), positions)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("split_read_bytes", [0, 1], ids=["one-thread", "two-threads"])
def test_a_landed_unit_matches_the_reference(
    make_engine, file_dir, dtype, heads, split_read_bytes
):
    """Three sequences (no key, a partial last block, a whole unit whose queries sit among
    its keys) in shuffled blocks of a file tier, fetched ahead and attended where they
    landed: the reference's output and log-sum-exp (the host pool's numbers), with a window
    and a soft cap or without; each a prefetch hit read where it landed."""
    q_heads, kv_heads, head_dim, q_len = heads
    e = make_engine(split_read_bytes=split_read_bytes)
    unit = 70
    pool = file_pool(
        e, file_dir, batch=3, unit_len=unit, kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype, block_rows=16,
    )  # fmt: skip
    valid = np.array([0, 37, unit], np.int32)
    k_start = np.array([5, 0, 200], np.int32)
    q_start = k_start + np.array([0, 37, 40], np.int32)
    q = jnp.asarray(
        np.random.default_rng(1).standard_normal((3, q_len, q_heads, head_dim)), jnp.float32
    )
    for window, soft_cap in ((None, None), (23, 30.0)):
        kw = dict(scale=0.3, soft_cap=soft_cap, window=window)
        out, lse = landed(pool, q, pool.segments(valid), k_start, valid, q_start, **kw)
        want_out, want_lse = pool.reference(q, k_start, valid, q_start, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), **EXACT_ORDER_APART)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **EXACT_ORDER_APART)
        assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
    stats = e.stats()
    assert stats["landed_reads"] == 2 and stats["in_place_reads"] == 0
    assert stats["prefetch_hits"] == 2 and stats["prefetch_misses"] == 0
    assert stats["tiers"][pool.tier]["fetch"]["bytes"] == 2 * 2 * int(valid.sum()) * pool.row_bytes


@pytest.mark.parametrize("tier_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("group", [1, 4], ids=lambda g: f"group{g}")
def test_landed_quantized_rows_match_the_dequantized_reference(
    make_engine, file_dir, tier_dtype, group
):
    """int8 and fp8 rows with their scales, read where they landed; the rows past each
    sequence's valid keys are NaN and never read."""
    e = make_engine()
    pool = file_pool(
        e, file_dir, batch=3, unit_len=70, kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
        block_rows=16, tier_dtype=tier_dtype, seed=group,
    )  # fmt: skip
    valid = np.array([0, 37, 70], np.int32)
    pool.poison_after(valid)
    k_start = np.array([5, 0, 200], np.int32)
    q_start = k_start + np.array([0, 37, 40], np.int32)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((3, 2, 2 * group, 64)), jnp.float32)
    for window, soft_cap in ((None, None), (23, 5.0)):
        kw = {"scale": 0.125, "soft_cap": soft_cap, "window": window}
        out, lse = landed(pool, q, pool.segments(valid), k_start, valid, q_start, **kw)
        want_out, want_lse = pool.reference(q, k_start, valid, q_start, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), **QUANTIZED_APART)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **QUANTIZED_APART)
    assert e.stats()["landed_reads"] == 2


@pytest.fixture
def make_pool16(make_engine, file_dir):
    """Two sequences of 16-row units in blocks of 4 rows of a file tier, on an engine of
    these options."""

    def make(**engine_options):
        e = make_engine(**engine_options)
        return file_pool(
            e, file_dir, batch=2, unit_len=16, kv_heads=2, head_dim=8, dtype=np.float32,
            block_rows=4,
        )  # fmt: skip

    return make


@pytest.fixture
def pool16(make_pool16):
    return make_pool16()


def _check(pool, got, k_start, valid, q_start):
    want = pool.reference(jnp.asarray(QUERY), k_start, valid, q_start, scale=0.5)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), **EXACT_ORDER_APART)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), **EXACT_ORDER_APART)


QUERY = np.random.default_rng(8).standard_normal((2, 1, 4, 8)).astype(np.float32)


@pytest.mark.parametrize(
    "fetched",
    [
        np.array([16, 9], np.int32),  # Other rows of the same blocks.
        np.array([16, 16], np.int32),  # More rows.
        np.array([0, 0], np.int32),  # Nothing.
    ],
    ids=["other-rows", "more-rows", "nothing"],
)
def test_a_fetch_of_other_bytes_is_read_again_never_trusted(pool16, fetched):
    """A prefetch that moved other tier bytes than the op needs is a miss: its landing
    buffer is dropped unread and the op fetches its own rows."""
    p = pool16
    valid = np.array([12, 9], np.int32)
    zero = np.zeros(2, np.int32)
    got = landed(
        p, jnp.asarray(QUERY), p.segments(valid), zero, valid, valid,
        fetched=p.segments(fetched), scale=0.5,
    )  # fmt: skip
    _check(p, got, zero, valid, valid)
    stats = p.engine.stats()
    assert stats["prefetch_misses"] == 1 and stats["prefetch_hits"] == 0
    assert stats["landed_reads"] == 1


def test_a_fetch_into_other_offsets_is_read_again(pool16):
    """The same tier bytes for other rows of the unit (a shifted memory offset) do not
    match either: offsets are compared, not just tier bytes."""
    p = pool16
    valid = np.array([8, 8], np.int32)
    zero = np.zeros(2, np.int32)
    want = p.segments(valid)
    shifted = [[t, m + p.row_bytes, n] for t, m, n in want]
    got = landed(p, jnp.asarray(QUERY), want, zero, valid, valid, fetched=shifted, scale=0.5)
    _check(p, got, zero, valid, valid)
    assert p.engine.stats()["prefetch_misses"] == 1


def test_no_ticket_reads_the_unit_now(pool16):
    p = pool16
    valid = np.array([16, 5], np.int32)
    zero = np.zeros(2, np.int32)
    got = landed(
        p, jnp.asarray(QUERY), p.segments(valid), zero, valid, valid,
        ticket=ops.NO_TICKET, scale=0.5,
    )  # fmt: skip
    _check(p, got, zero, valid, valid)
    stats = p.engine.stats()
    assert stats["prefetch_misses"] == 1 and stats["landed_reads"] == 1


def test_a_late_fetch_is_waited_for(make_pool16):
    """Every transfer starts 30 ms late: the op reads nothing before its fetch has ended."""
    p = make_pool16(debug_delay_us=30_000)
    valid = np.array([16, 11], np.int32)
    zero = np.zeros(2, np.int32)
    for _ in range(3):
        got = landed(p, jnp.asarray(QUERY), p.segments(valid), zero, valid, valid, scale=0.5)
        _check(p, got, zero, valid, valid)
    assert p.engine.stats()["prefetch_hits"] == 3


def test_it_sees_an_earlier_write_back_of_its_rows(make_pool16):
    """A write-back queued before the fetch (and slowed down) lands first: the landed rows
    are the new ones."""
    p = make_pool16(debug_delay_us=30_000)
    new_k = np.full((16, 2, 8), 3.0, np.float32)
    new_k[5] = 9.0
    valid = np.array([16, 16], np.int32)
    segments = p.segments(valid)
    k_rows = p.rows([[t, m, n] for t, m, n in segments if m < 16 * p.row_bytes])  # Seq 0's K.
    positions = jnp.asarray(np.stack([np.zeros(2), valid, valid]).astype(np.int32))

    def step(q, src):
        token = ops.write_back(p.engine.id, p.tier, src, k_rows, TAG)
        q, t = ops.start_fetch(
            p.engine.id, p.tier, q, p.rows(segments), TAG, dst_bytes=unit_bytes(p), deps=(token,)
        )
        return ops.attend_landed(
            p.engine.id, p.tier, q, t, p.rows(segments), positions, TAG,
            unit_len=16, kv_dtype=np.float32, num_kv_heads=2, scale=0.5,
        )  # fmt: skip

    got = jax.jit(step)(jnp.asarray(QUERY), jnp.asarray(new_k))
    p.k[0] = new_k
    _check(p, got, np.zeros(2, np.int32), valid, valid)
    assert p.engine.stats()["prefetch_hits"] == 1


def test_a_memory_tier_is_read_in_place(make_engine):
    """On a host tier (nothing is read ahead) the op reads the pool where it lies."""
    e = make_engine()
    p = Pool(e, batch=2, unit_len=16, kv_heads=2, head_dim=8, dtype=np.float32, block_rows=4)
    valid = np.array([16, 7], np.int32)
    zero = np.zeros(2, np.int32)
    got = landed(p, jnp.asarray(QUERY), p.segments(valid), zero, valid, valid, scale=0.5)
    _check(p, got, zero, valid, valid)
    stats = e.stats()
    assert stats["in_place_reads"] == 1 and stats["prefetch_hits"] == 1


def test_each_sequences_rows_must_be_exactly_its_valid_keys(pool16):
    """The guards of attend_in_place, on landed rows: rows one short of the valid keys, or
    a row twice, are refused naming the sequence; so is a segment past the unit's rows."""
    p = pool16
    zero = np.zeros(2, np.int32)
    segs = p.segments([5, 16])
    short = [list(s) for s in segs]
    short[1][2] -= p.row_bytes  # Sequence 0's K: rows [0, 4), valid 5.
    q = jnp.asarray(QUERY)
    cases = [
        (short, [5, 16], r"tpusync: the K rows of sequence 0 cover 4 rows, but it has 5"),
        (segs + [segs[-1]], [5, 16], r"the V rows of sequence 1 overlap at row 12"),
        (segs, [17, 16], r"sequence 0 has 17 valid keys in a unit of 16 rows"),
    ]
    for segments, valid, match in cases:
        valid = np.asarray(valid, np.int32)
        with pytest.raises(XlaError, match=match):
            jax.block_until_ready(landed(p, q, segments, zero, valid, valid, scale=0.5))
    end = unit_bytes(p)
    past = [list(s) for s in p.segments([16, 16])]
    past[-1][1] += p.row_bytes
    with pytest.raises(XlaError, match=rf"covers bytes \[\d+, {end + p.row_bytes}\) of a {end}-byte"):
        valid = np.array([16, 16], np.int32)
        jax.block_until_ready(landed(p, q, past, zero, valid, valid, fetched=segs, scale=0.5))
    # The first three were refused by the kernel's checks of the landed rows; the last one
    # before anything was waited for or read.
    assert p.engine.stats()["landed_reads"] == 3


def test_python_side_checks_name_the_argument(pool16):
    p = pool16
    segs = p.rows(p.segments([8, 8]))
    pos = jnp.zeros((3, 2), jnp.int32)
    q = jnp.zeros((2, 1, 4, 8), jnp.float32)

    def call(ticket=ops.NO_TICKET, **kw):
        knobs = {"unit_len": 16, "kv_dtype": np.float32, "num_kv_heads": 2, "scale": 1.0, **kw}
        return ops.attend_landed(p.engine.id, p.tier, q, ticket, segs, pos, TAG, **knobs)

    with pytest.raises(ValueError, match=r"ticket must be an int32 scalar"):
        call(ticket=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"kv_dtype=float16 must be float32 or bfloat16"):
        call(kv_dtype=np.float16)
    with pytest.raises(ValueError, match=r"unit_len=0 must be an int >= 1"):
        call(unit_len=0)


def test_a_unit_across_two_tiers_is_attended_in_one_pass(make_engine, file_dir):
    """attend_spilled: a two-level cache's unit, every other block on the spill file (fetched
    ahead, read where it landed) and the rest in DRAM (read where it lies): the reference's
    numbers; a spill fetch of other bytes is read again; rows on neither tier are refused."""
    e = make_engine()
    shape = dict(batch=3, unit_len=40, kv_heads=2, head_dim=16, dtype=np.float32, block_rows=8)
    dram = Pool(e, **shape)  # The same seed: both tiers hold the same rows in the same blocks.
    spill = file_pool(e, file_dir, **shape)
    valid = np.array([40, 0, 21], np.int32)
    segments = dram.segments(valid)
    mine, theirs = segments[0::2], segments[1::2]
    k_start = np.array([0, 7, 100], np.int32)
    q_start = k_start + valid
    q = jnp.asarray(np.random.default_rng(4).standard_normal((3, 1, 4, 16)), jnp.float32)
    positions = jnp.asarray(np.stack([k_start, valid, q_start]))

    def run(dram_rows, spill_rows, fetched_rows, **kw):
        def step(q):
            q, t = ops.start_fetch(
                e.id, spill.tier, q, spill.rows(fetched_rows), TAG, dst_bytes=unit_bytes(spill)
            )
            return ops.attend_spilled(
                e.id, dram.tier, q, t, dram.rows(dram_rows), spill.rows(spill_rows), positions,
                TAG, spill_tier=spill.tier, unit_len=40, kv_dtype=np.float32, num_kv_heads=2,
                scale=0.25, **kw,
            )  # fmt: skip

        return jax.jit(step)(q)

    want = dram.reference(q, k_start, valid, q_start, scale=0.25, window=30)
    for fetched in (theirs, theirs[1:]):  # The unit's spill rows; other rows (a miss).
        out, lse = run(mine, theirs, fetched, window=30)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), **EXACT_ORDER_APART)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want[1]), **EXACT_ORDER_APART)
    stats = e.stats()
    assert stats["prefetch_hits"] == 1 and stats["prefetch_misses"] == 1
    assert stats["in_place_reads"] == 2 and stats["landed_reads"] == 2
    with pytest.raises(XlaError, match=r"the K rows of sequence 0 skip to row 16"):
        jax.block_until_ready(run(mine, theirs[1:], theirs[1:]))
