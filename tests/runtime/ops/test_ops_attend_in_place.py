"""attend_in_place: attention over a host tier's rows where they lie, against the jnp
reference; its ordering after write-backs; and every guard on what a segment may address,
tried at exactly its edge."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_tpusync.kernels import reference

from jax_tpusync.runtime import ops

from support import child_env
from support.attend_pool import (
    EXACT_ORDER_APART,
    QUANTIZED_APART,
    SHAPES,
    TAG,
    Pool,
    XlaError,
)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("split_read_bytes", [0, 1], ids=["one-thread", "two-threads"])
def test_matches_the_reference(make_engine, dtype, heads, split_read_bytes):
    """Three sequences (one with no key, one with a partial last block, one full unit whose
    queries sit among its keys) in shuffled blocks, on one thread and split with the copy
    helper: the reference's output and log-sum-exp, with a window and a soft cap or
    without."""
    q_heads, kv_heads, head_dim, q_len = heads
    e = make_engine(split_read_bytes=split_read_bytes)
    unit = 70
    pool = Pool(
        e, batch=3, unit_len=unit, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_rows=16
    )
    valid = np.array([0, 37, unit], np.int32)
    k_start = np.array([5, 0, 200], np.int32)
    # Sequence 2's queries sit among its keys: the keys after each query are masked.
    q_start = k_start + np.array([0, 37, 40], np.int32)
    q = jnp.asarray(
        np.random.default_rng(1).standard_normal((3, q_len, q_heads, head_dim)), jnp.float32
    )
    for window, soft_cap in ((None, None), (23, 30.0)):
        out, lse = pool.attend(
            q,
            pool.segments(valid),
            k_start,
            valid,
            q_start,
            scale=0.3,
            soft_cap=soft_cap,
            window=window,
        )
        want_out, want_lse = pool.reference(
            q, k_start, valid, q_start, scale=0.3, soft_cap=soft_cap, window=window
        )
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), **EXACT_ORDER_APART)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **EXACT_ORDER_APART)
        assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
    stats = e.stats()
    assert stats["in_place_reads"] == 2
    assert stats["tiers"][pool.tier]["fetch"]["bytes"] == 2 * 2 * int(valid.sum()) * pool.row_bytes


TIER_DTYPES = ["int8", "float8_e4m3fn"]


@pytest.mark.parametrize("tier_dtype", TIER_DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_quantized_rows_match_the_dequantized_reference(make_engine, tier_dtype, group, head_dim):
    """int8 and fp8 rows (codes and per-head scales, the scales applied in the kernel) give
    the reference's numbers over the dequantized rows: GQA groups 1 to 8, head_dim 64 to
    256, ragged sequences (no key, a partial last block and tile, a whole unit whose queries
    sit among its keys), with a window and a soft cap or without; the rows past each
    sequence's valid keys are NaN and never read."""
    kv_heads = 2
    e = make_engine()
    unit = 70
    pool = Pool(
        e,
        batch=3,
        unit_len=unit,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=jnp.bfloat16,
        block_rows=16,
        tier_dtype=tier_dtype,
        seed=group,
    )
    valid = np.array([0, 37, unit], np.int32)
    pool.poison_after(valid)
    k_start = np.array([5, 0, 200], np.int32)
    q_start = k_start + np.array([0, 37, 40], np.int32)
    rng = np.random.default_rng(head_dim)
    q = jnp.asarray(rng.standard_normal((3, 2, kv_heads * group, head_dim)), jnp.float32)
    scale = head_dim**-0.5
    for window, soft_cap in ((None, None), (23, 5.0)):
        kw = {"scale": scale, "soft_cap": soft_cap, "window": window}
        out, lse = pool.attend(q, pool.segments(valid), k_start, valid, q_start, **kw)
        want_out, want_lse = pool.reference(q, k_start, valid, q_start, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), **QUANTIZED_APART)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **QUANTIZED_APART)
        assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
    fetched = e.stats()["tiers"][pool.tier]["fetch"]["bytes"]
    assert fetched == 2 * 2 * int(valid.sum()) * pool.row_bytes


@pytest.mark.parametrize("tier_dtype", TIER_DTYPES)
@pytest.mark.parametrize("split_read_bytes", [0, 1], ids=["one-thread", "two-threads"])
@pytest.mark.parametrize(
    "kv_heads, head_dim, row_bytes", [(3, 12, 48), (1, 13, 32)], ids=["3x12", "1x13"]
)
def test_quantized_rows_off_the_vector_width_and_split_over_two_threads(
    make_engine, tier_dtype, split_read_bytes, kv_heads, head_dim, row_bytes
):
    """Rows of 3 heads x 12 codes (36: two vectors of sixteen, then four decoded one at a
    time) and of 1 x 13 (a vector of eight, then five), two query heads per kv head, on one
    thread and split with the copy helper."""
    e = make_engine(split_read_bytes=split_read_bytes)
    pool = Pool(
        e,
        batch=2,
        unit_len=50,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=np.float32,
        block_rows=8,
        tier_dtype=tier_dtype,
    )
    assert pool.row_bytes == row_bytes  # Codes, 4 scale bytes a head, padding to 16.
    valid = np.array([50, 19], np.int32)
    pool.poison_after(valid)
    start = np.array([0, 3], np.int32)
    shape = (2, 3, 2 * kv_heads, head_dim)
    q = jnp.asarray(np.random.default_rng(5).standard_normal(shape), jnp.float32)
    out, lse = pool.attend(q, pool.segments(valid), start, valid, start + valid - 2, scale=0.4)
    want, want_lse = pool.reference(q, start, valid, start + valid - 2, scale=0.4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **QUANTIZED_APART)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **QUANTIZED_APART)


def test_every_fp8_code_decodes_to_its_value(make_engine):
    """Rows of 4 heads x 64 codes hold every float8_e4m3fn code but its two NaNs (zeros,
    subnormals, the largest +-448), in turn as the only key with a nonzero weight: the op's
    output is each code's value times its scale, exactly as ml_dtypes converts it."""
    e = make_engine()
    heads, dim, unit = 4, 64, 8
    pool = Pool(
        e,
        batch=1,
        unit_len=unit,
        kv_heads=heads,
        head_dim=dim,
        dtype=np.float32,
        block_rows=unit,
        tier_dtype="float8_e4m3fn",
    )
    codes = np.arange(256, dtype=np.uint8)
    codes[0x7F], codes[0xFF] = 0x00, 0x80  # The NaNs: +0 and -0 instead.
    rng = np.random.default_rng(6)
    rows = np.zeros((unit, pool.row_bytes), np.uint8)
    for r in range(unit):
        rows[r, : heads * dim] = rng.permutation(codes)
        rows[r, heads * dim : heads * dim + 4 * heads] = (
            rng.uniform(0.5, 2.0, heads).astype(np.float32).view(np.uint8)
        )
    for kv in range(2):
        pool.write_rows(kv, 0, 0, rows)
    want_v = pool.dequantized(rows)  # [unit, heads, dim], via ml_dtypes.
    assert np.isfinite(want_v).all()
    # q = 0: every key weighs the same, so the output is the mean of the value rows.
    q = jnp.zeros((1, 1, heads, dim), jnp.float32)
    valid = np.array([unit], np.int32)
    zero = np.zeros(1, np.int32)
    out, _ = pool.attend(q, pool.segments(valid), zero, valid, valid, scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0, 0], want_v.mean(axis=0), rtol=1e-6, atol=1e-4)
    # One row at a time: a sequence of one valid key returns that row's values exactly.
    for r in range(unit):
        pool.write_rows(1, 0, 0, rows[r : r + 1])
        one = np.array([1], np.int32)
        out, _ = pool.attend(q, pool.segments(one), zero, one, one, scale=1.0)
        np.testing.assert_array_equal(np.asarray(out)[0, 0], want_v[r])


def test_a_segment_running_on_into_the_next_sequence_is_cut_there(make_engine):
    """Contiguous on the tier and in the unit's rows, one segment may hold the end of one
    sequence's K rows and the start of the next one's: each sequence attends to its own."""
    e = make_engine()
    unit = 8
    pool = Pool(
        e, batch=2, unit_len=unit, kv_heads=2, head_dim=8, dtype=np.float32, block_rows=unit
    )
    rb, bb = pool.row_bytes, pool.block_bytes
    # Rewrite the tier so that sequence 0's K block is followed by sequence 1's.
    for b in range(2):
        e.write(pool.tier, b * bb, pool.k[b].view(np.uint8))
        e.write(pool.tier, (2 + b) * bb, pool.v[b].view(np.uint8))
    segments = [[0, 0, 2 * unit * rb], [2 * bb, 2 * unit * rb, 2 * unit * rb]]
    valid = np.array([unit, unit], np.int32)
    zero = np.zeros(2, np.int32)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, 4, 8)), jnp.float32)
    out, lse = pool.attend(q, segments, zero, valid, valid, scale=1.0)
    want, want_lse = pool.reference(q, zero, valid, valid, scale=1.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **EXACT_ORDER_APART)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **EXACT_ORDER_APART)


def test_it_reads_after_an_earlier_write_back_of_its_rows(make_engine):
    """A write-back queued before the read (and slowed down) lands first: the read sees
    the new rows, never the old ones."""
    e = make_engine(debug_delay_us=50_000)
    unit = 16
    pool = Pool(
        e, batch=1, unit_len=unit, kv_heads=1, head_dim=8, dtype=np.float32, block_rows=unit
    )
    new_k = np.full((unit, 1, 8), 3.0, np.float32)
    new_k[5] = 9.0
    segments = pool.segments([unit])
    k_rows = pool.rows(segments[:1])  # The K block, from memory offset 0 of new_k.

    def step(q, src):
        token = ops.write_back(e.id, pool.tier, src, k_rows, TAG)
        positions = jnp.asarray([[0], [unit], [unit]], jnp.int32)
        return ops.attend_in_place(
            e.id,
            pool.tier,
            q,
            pool.rows(segments),
            positions,
            TAG,
            unit_len=unit,
            kv_dtype=np.float32,
            num_kv_heads=1,
            scale=1.0,
            deps=(token,),
        )

    q = jnp.ones((1, 1, 1, 8), jnp.float32)
    _, lse = jax.jit(step)(q, jnp.asarray(new_k))
    _, want = reference.chunk_attention_reference(
        q,
        jnp.asarray(new_k[None]),
        jnp.asarray(pool.v),
        jnp.zeros(1, jnp.int32),
        jnp.full(1, unit, jnp.int32),
        jnp.full(1, unit, jnp.int32),
        scale=1.0,
    )
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), rtol=1e-6)


def _refusal(pool, segments, valid, match):
    q = jnp.zeros((pool.batch, 1, 2, pool.head_dim), jnp.float32)
    zero = np.zeros(pool.batch, np.int32)
    with pytest.raises(XlaError, match=match):
        jax.block_until_ready(
            pool.attend(
                q, segments, zero, np.asarray(valid, np.int32), zero + pool.unit_len, scale=1.0
            )
        )


@pytest.fixture
def small_pool(make_engine):
    return Pool(
        make_engine(), batch=2, unit_len=8, kv_heads=2, head_dim=4, dtype=np.float32, block_rows=4
    )


def test_each_sequences_rows_must_be_exactly_its_valid_keys(small_pool):
    """K or V rows one short of, or one past, the valid keys; a gap; a row twice: refused,
    naming the sequence. Exactly the valid keys (a full unit included) pass."""
    p = small_pool
    q = jnp.zeros((2, 1, 2, 4), jnp.float32)
    zero = np.zeros(2, np.int32)
    for valid in ([8, 8], [5, 0]):  # At the edge: a whole unit; a partial block and none.
        jax.block_until_ready(
            p.attend(q, p.segments(valid), zero, np.asarray(valid, np.int32), zero + 8, scale=1.0)
        )
    segs = p.segments([5, 8])
    short = [list(s) for s in segs]
    short[1][2] -= p.row_bytes  # Sequence 0's K: rows [0, 4), valid 5.
    _refusal(p, short, [5, 8], r"tpusync: the K rows of sequence 0 cover 4 rows, but it has 5")
    _refusal(p, segs, [4, 8], r"the K rows of sequence 0 cover 5 rows, but it has 4 valid keys")
    gap = [s for i, s in enumerate(segs) if i != 2]  # Sequence 1's K rows [0, 4) missing.
    _refusal(p, gap, [5, 8], r"the K rows of sequence 1 skip to row 4")
    twice = segs + [segs[-1]]  # Sequence 1's last V block again.
    _refusal(p, twice, [5, 8], r"the V rows of sequence 1 overlap at row 4")
    v_short = [list(s) for s in segs]
    v_short[-1][2] -= p.row_bytes
    _refusal(p, v_short, [5, 8], r"the V rows of sequence 1 cover 7 rows, but it has 8")


def test_valid_keys_must_fit_the_unit_and_segments_whole_rows(small_pool):
    p = small_pool
    _refusal(p, p.segments([8, 8]), [9, 8], r"sequence 0 has 9 valid keys in a unit of 8 rows")
    _refusal(p, p.segments([8, 8]), [-1, 8], r"sequence 0 has -1 valid keys")
    partial = [list(s) for s in p.segments([5, 8])]
    partial[1][2] -= 1  # One byte short of a row.
    # (Segments are counted after the engine merges contiguous ones.)
    _refusal(p, partial, [5, 8], r"tpusync: segment \d+ is not whole rows of 32 bytes")


def test_quantized_rows_are_checked_as_rows_of_their_own_size(make_engine):
    """Quantized rows of 2 heads x 4 codes are 16 bytes (8 codes, 8 scale bytes): segments
    are whole rows of that, and each sequence's rows exactly its valid keys, as for values."""
    p = Pool(
        make_engine(),
        batch=2,
        unit_len=8,
        kv_heads=2,
        head_dim=4,
        dtype=np.float32,
        block_rows=4,
        tier_dtype="int8",
    )
    assert p.row_bytes == 16
    partial = [list(s) for s in p.segments([5, 8])]
    partial[1][2] -= 1
    _refusal(p, partial, [5, 8], r"tpusync: segment \d+ is not whole rows of 16 bytes")
    _refusal(p, p.segments([5, 8]), [6, 8], r"the K rows of sequence 0 cover 5 rows, but it has 6")
    end = 2 * p.batch * p.unit_len * p.row_bytes
    past = [list(s) for s in p.segments([8, 8])]
    past[-1][1] += p.row_bytes
    _refusal(p, past, [8, 8], rf"covers bytes \[{end - 4 * 16 + 16}, {end + 16}\) of a {end}-byte")


def test_a_segment_must_lie_inside_the_units_rows(small_pool):
    """The unit's rows are [2, batch, unit_len] rows: a segment ending exactly at their end
    passes, one row further is refused before anything is read."""
    p = small_pool
    end = 2 * p.batch * p.unit_len * p.row_bytes
    segs = p.segments([8, 8])
    assert max(m + n for _, m, n in segs) == end
    past = [list(s) for s in segs]
    past[-1][1] += p.row_bytes  # Sequence 1's last V block, one row later.
    _refusal(
        p, past, [8, 8], r"tpusync: segment \d+ covers bytes \[928, 1056\) of a 1024-byte buffer"
    )
    assert p.engine.stats()["in_place_reads"] == 0


def test_only_a_memory_tier_is_read_in_place(make_engine, file_dir):
    e = make_engine()
    tier = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=4)
    segs = jnp.asarray(ops.segment_rows([0, 4096], [0, 32], [32, 32], 4096))
    positions = jnp.asarray([[0], [1], [1]], jnp.int32)
    with pytest.raises(XlaError, match=r"tpusync: tier 0 \(.*\) is not in memory"):
        jax.block_until_ready(
            jax.jit(
                lambda q: ops.attend_in_place(
                    e.id,
                    tier,
                    q,
                    segs,
                    positions,
                    TAG,
                    unit_len=1,
                    kv_dtype=np.float32,
                    num_kv_heads=2,
                    scale=1.0,
                )
            )(jnp.zeros((1, 1, 2, 4), jnp.float32))
        )


def test_python_side_checks_name_the_argument(small_pool):
    p = small_pool
    q = jnp.zeros((2, 1, 2, 4), jnp.float32)
    segs = p.rows(p.segments([8, 8]))
    pos = jnp.zeros((3, 2), jnp.int32)

    def call(q=q, positions=pos, **kw):
        knobs = {"unit_len": 8, "kv_dtype": np.float32, "num_kv_heads": 2, "scale": 1.0, **kw}
        return ops.attend_in_place(p.engine.id, p.tier, q, segs, positions, TAG, **knobs)

    with pytest.raises(ValueError, match=r"kv_dtype=float16 must be float32 or bfloat16"):
        call(kv_dtype=np.float16)
    for bad in ("float8_e5m2", "float16", "int4", "nonsense"):
        with pytest.raises(
            ValueError, match=rf"tier_dtype='{bad}' must be None, int8 or float8_e4m3fn"
        ):
            call(tier_dtype=bad)
    with pytest.raises(ValueError, match=r"q must be f32\[batch, q_len, heads, head_dim\]"):
        call(q=q.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"positions must be int32\[3 or 4, batch=2\]"):
        call(positions=jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"unit_len=0 must be an int >= 1"):
        call(unit_len=0)
    with pytest.raises(ValueError, match=r"2 query heads are not a multiple of 4 kv heads"):
        call(num_kv_heads=4)


def test_the_baseline_build_matches_the_reference_too():
    """The kernel is compiled for AVX2 with FMA and for the baseline ISA, picked per CPU at
    load: the baseline one (forced by ``TPUSYNC_CPU_ISA=baseline``) gives the reference's
    numbers as well, on a head_dim off both vector widths, for bf16 values and for int8 and
    fp8 rows."""
    script = textwrap.dedent(
        """
        import sys
        import numpy as np, jax.numpy as jnp
        from jax_tpusync import Engine, _tpusync
        assert _tpusync.pool_attention_isa() == "baseline", _tpusync.pool_attention_isa()
        from support.attend_pool import Pool
        with Engine() as e:
            pool = Pool(e, batch=2, unit_len=45, kv_heads=2, head_dim=44, dtype=jnp.bfloat16,
                        block_rows=16)
            valid = np.array([45, 20], np.int32)
            start = np.zeros(2, np.int32)
            q = jnp.asarray(np.random.default_rng(4).standard_normal((2, 2, 6, 44)), jnp.float32)
            out, lse = pool.attend(q, pool.segments(valid), start, valid, valid - 1, scale=0.2)
            want, want_lse = pool.reference(q, start, valid, valid - 1, scale=0.2)
            print(float(np.max(np.abs(np.asarray(out) - np.asarray(want)))),
                  float(np.max(np.abs(np.asarray(lse) - np.asarray(want_lse)))))
            # Quantized rows of 3 heads x 44 codes (132: four past the vector loop), a
            # window and a soft cap.
            for tier_dtype in ("int8", "float8_e4m3fn"):
                pool = Pool(e, batch=2, unit_len=45, kv_heads=3, head_dim=44,
                            dtype=jnp.bfloat16, block_rows=16, tier_dtype=tier_dtype)
                pool.poison_after(valid)
                kw = dict(scale=0.2, window=30, soft_cap=4.0)
                out, lse = pool.attend(q, pool.segments(valid), start, valid, valid - 1, **kw)
                want, want_lse = pool.reference(q, start, valid, valid - 1, **kw)
                print(float(np.max(np.abs(np.asarray(out) - np.asarray(want))) / 10),
                      float(np.max(np.abs(np.asarray(lse) - np.asarray(want_lse))) / 10))
        """
    )
    env = child_env(TPUSYNC_CPU_ISA="baseline")
    run = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    errors = list(map(float, run.stdout.split()[-6:]))
    # (The quantized cases' errors are printed tenfold smaller: 1e-5 against their reference.)
    assert len(errors) == 6 and max(errors) <= 2e-6, run.stdout


def test_this_cpu_runs_the_build_it_supports():
    from jax_tpusync import _tpusync

    flags = pathlib.Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    has_avx2 = all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))
    has_avx512 = has_avx2 and " avx512f" in flags
    want = "avx512" if has_avx512 else "avx2" if has_avx2 else "baseline"
    assert _tpusync.pool_attention_isa() == want
