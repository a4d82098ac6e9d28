"""Tests for the per-chunk attention reference and its Pallas kernels.

Everything runs on CPU: the TPU kernel in TPU interpret mode (which simulates
DMAs and semaphores and runs a happens-before race detector), the GPU kernel
in the generic Pallas interpreter. Interpreted grid steps are slow, so shapes
are kept tiny. A few tests additionally lower the kernels for the real
platforms, which exercises the Mosaic / Triton lowering rules without needing
the hardware.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax_tpusync.kernels import _common

from jax_tpusync import kernels

# Per-dtype tolerances for kernel-vs-reference comparisons. bf16 kernels feed
# the softmax weights to the p @ v matmul in bf16 (as flash attention does on
# real hardware), which costs ~3 significant digits.
TOLERANCES = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def make_inputs(
    seed: int,
    *,
    batch: int,
    q_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    chunk_len: int,
    dtype=jnp.float32,
    q_dtype=None,
    k_valid=None,
    k_start=None,
    q_start=None,
    poison: bool = True,
):
    """Random inputs; keys/values past k_valid are NaN/inf when ``poison``.

    ``q_dtype`` defaults to ``dtype`` (the K/V dtype).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_len, num_q_heads, head_dim))
    k = rng.standard_normal((batch, chunk_len, num_kv_heads, head_dim))
    v = rng.standard_normal((batch, chunk_len, num_kv_heads, head_dim))
    k_valid = np.full(batch, chunk_len) if k_valid is None else k_valid
    k_start = np.zeros(batch) if k_start is None else k_start
    # Default: decode-style queries right after the chunk's valid keys.
    q_start = np.asarray(k_start) + np.asarray(k_valid) if q_start is None else q_start
    k_valid, k_start, q_start = (np.asarray(x, np.int32) for x in (k_valid, k_start, q_start))
    if poison:
        for b in range(batch):
            k[b, k_valid[b] :] = np.nan
            v[b, k_valid[b] :] = np.inf if b % 2 else np.nan
    return (
        jnp.asarray(q, q_dtype or dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(k_start),
        jnp.asarray(k_valid),
        jnp.asarray(q_start),
    )


def naive_attention(q, k, v, k_start, k_valid, q_start, *, scale, soft_cap=None, window=None):
    """Loop-based float64 softmax attention: the spec, written out."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    k_start, k_valid, q_start = (np.asarray(x) for x in (k_start, k_valid, q_start))
    b_, t_, hq, d = q.shape
    s_, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b_, t_, hq, d))
    lse = np.full((b_, t_, hq), -np.inf)
    for b in range(b_):
        for i in range(t_):
            qp = q_start[b] + i
            keys = [
                j
                for j in range(s_)
                if j < k_valid[b]
                and k_start[b] + j <= qp
                and (window is None or k_start[b] + j > qp - window)
            ]
            if not keys:
                continue
            for h in range(hq):
                logits = np.array([scale * q[b, i, h] @ k[b, j, h // g] for j in keys])
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                m = logits.max()
                w = np.exp(logits - m)
                vals = v[b, keys, h // g]
                out[b, i, h] = (w[:, None] * vals).sum(0) / w.sum()
                lse[b, i, h] = m + np.log(w.sum())
    return out, lse


def assert_matches(actual, expected, dtype):
    """Kernel output vs reference: finite where expected, close everywhere."""
    out, lse = (np.asarray(x) for x in actual)
    ref_out, ref_lse = (np.asarray(x, np.float32) for x in expected)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert not np.isnan(out).any(), "NaN in out"
    assert not np.isnan(lse).any(), "NaN in lse"
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(out, ref_out, **tol)
    # assert_allclose also requires the -inf entries to coincide.
    np.testing.assert_allclose(lse, ref_lse, **tol)


def tpu_races_found() -> bool:
    """Whether the race detector flagged the last TPU-interpreted kernel.

    jax 0.10 exposes the detector's state only as a module global that is
    replaced at the start of every interpreted kernel.
    """
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = interpret_pallas_call.races
    assert races is not None, "TPU interpret mode did not run"
    return races.races_found


RACE_CHECK = pltpu.InterpretParams(detect_races=True)


@pytest.fixture
def tpu_interpret():
    """TPU interpret params with race detection; resets state afterwards.

    A failing interpreted kernel leaves global simulator state behind that
    would break the next test, so always reset it.
    """
    yield RACE_CHECK
    pltpu.reset_tpu_interpret_mode_state()


# ----------------------------------------------------------------------------
# Reference: hand-computed cases
# ----------------------------------------------------------------------------


def _one(x):
    return jnp.asarray([x], jnp.int32)


def test_reference_two_keys_by_hand():
    # One query, two keys, head_dim 2: logits = [1, 0].
    q = jnp.asarray([[[[1.0, 0.0]]]])
    k = jnp.asarray([[[[1.0, 0.0]], [[0.0, 1.0]]]])
    v = jnp.asarray([[[[2.0, 0.0]], [[0.0, 4.0]]]])
    out, lse = kernels.chunk_attention_reference(q, k, v, _one(0), _one(2), _one(1), scale=1.0)
    e = math.e
    np.testing.assert_allclose(out[0, 0, 0], [2 * e / (1 + e), 4 / (1 + e)], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(e + 1), rtol=1e-6)


def test_reference_scale_and_soft_cap_by_hand():
    # q . k = [4, 0]; scale 0.5 -> [2, 0]; soft cap 1 -> [tanh(2), 0].
    q = jnp.asarray([[[[2.0, 0.0]]]])
    k = jnp.asarray([[[[2.0, 0.0]], [[0.0, 2.0]]]])
    v = jnp.asarray([[[[1.0, 0.0]], [[0.0, 1.0]]]])
    out, lse = kernels.chunk_attention_reference(
        q, k, v, _one(0), _one(2), _one(1), scale=0.5, soft_cap=1.0
    )
    a = math.tanh(2.0)
    w0 = math.exp(a) / (math.exp(a) + 1)
    np.testing.assert_allclose(out[0, 0, 0], [w0, 1 - w0], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(math.exp(a) + 1), rtol=1e-6)


def test_reference_window_and_causality_by_hand():
    # Keys at positions 3, 4, 5, 6; query at 5 with a 2-token window sees
    # positions 4 and 5 only (6 is in the future, 3 is outside the window).
    q = jnp.zeros((1, 1, 1, 1))  # All logits 0 -> uniform over visible keys.
    k = jnp.zeros((1, 4, 1, 1))
    v = jnp.asarray([10.0, 20.0, 40.0, 80.0]).reshape(1, 4, 1, 1)
    out, lse = kernels.chunk_attention_reference(
        q, k, v, _one(3), _one(4), _one(5), scale=1.0, window=2
    )
    np.testing.assert_allclose(out[0, 0, 0, 0], 30.0, rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(2.0), rtol=1e-6)


@pytest.mark.parametrize(
    "k_start,k_valid,q_start",
    [
        (0, 0, 10),  # Empty chunk.
        (5, 4, 4),  # Every key is in the query's future.
        (0, 4, 20),  # Every key is behind the window (set below).
    ],
)
def test_reference_fully_masked_query_is_zero_with_neg_inf_lse(k_start, k_valid, q_start):
    q, k, v, *_ = make_inputs(
        0, batch=1, q_len=1, num_q_heads=2, num_kv_heads=1, head_dim=4, chunk_len=4
    )
    k = k.at[:, k_valid:].set(jnp.nan)
    v = v.at[:, k_valid:].set(jnp.nan)
    out, lse = kernels.chunk_attention_reference(
        q,
        k,
        v,
        _one(k_start),
        _one(k_valid),
        _one(q_start),
        scale=1.0,
        window=8,
    )
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)


def test_reference_ignores_poisoned_keys():
    args = make_inputs(
        1, batch=2, q_len=3, num_q_heads=4, num_kv_heads=2, head_dim=8, chunk_len=10, k_valid=[6, 3]
    )
    out, lse = kernels.chunk_attention_reference(*args, scale=0.3)
    clean = make_inputs(
        1,
        batch=2,
        q_len=3,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        chunk_len=10,
        k_valid=[6, 3],
        poison=False,
    )
    ref_out, ref_lse = kernels.chunk_attention_reference(*clean, scale=0.3)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)


# ----------------------------------------------------------------------------
# Reference vs naive numpy
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,group,window,soft_cap",
    [
        (jnp.float32, 1, None, None),
        (jnp.bfloat16, 1, 7, 20.0),
        (jnp.float32, 2, 5, None),
        (jnp.bfloat16, 2, None, 3.0),
        (jnp.float32, 4, None, 3.0),
        (jnp.bfloat16, 4, 5, None),
    ],
)
def test_reference_matches_naive(dtype, group, window, soft_cap):
    args = make_inputs(
        group,
        batch=2,
        q_len=4,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=8,
        chunk_len=12,
        dtype=dtype,
        k_valid=[12, 7],
        k_start=[3, 20],
        q_start=[12, 22],
    )
    out, lse = kernels.chunk_attention_reference(*args, scale=0.4, soft_cap=soft_cap, window=window)
    ref_out, ref_lse = naive_attention(*args, scale=0.4, soft_cap=soft_cap, window=window)
    # Both sides see the same (bf16-rounded) inputs, so f32 tolerances hold.
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attention_reference_full_cache():
    q, k, v, _, _, _ = make_inputs(
        3,
        batch=2,
        q_len=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        chunk_len=9,
        k_valid=[9, 5],
        dtype=jnp.bfloat16,
    )
    kv_len = jnp.asarray([9, 5], jnp.int32)
    q_start = kv_len - 2  # The two newest tokens attend causally.
    out = kernels.attention_reference(q, k, v, q_start, kv_len, scale=0.5, window=4)
    assert out.dtype == jnp.bfloat16
    ref_out, _ = naive_attention(
        q, k, v, jnp.zeros(2, jnp.int32), kv_len, q_start, scale=0.5, window=4
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------
# merge_partials
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("cuts", [(7,), (4, 10), (0, 13)])
def test_merged_chunks_equal_whole_cache(cuts, window):
    """Chunked attention + merge == attention over the whole cache.

    Chunks are carved out of one cache, including an empty chunk (cut at 0)
    and chunks that are fully masked for some queries (via the window).
    """
    s = 16
    q, k, v, _, _, _ = make_inputs(
        4, batch=2, q_len=3, num_q_heads=4, num_kv_heads=2, head_dim=8, chunk_len=s, poison=False
    )
    kv_len = jnp.asarray([16, 11], jnp.int32)
    q_start = kv_len - 3
    whole_out, whole_lse = kernels.chunk_attention_reference(
        q,
        k,
        v,
        jnp.zeros(2, jnp.int32),
        kv_len,
        q_start,
        scale=0.3,
        window=window,
    )

    out = jnp.zeros_like(whole_out)
    lse = jnp.full_like(whole_lse, -jnp.inf)
    bounds = (0, *cuts, s)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        chunk_valid = jnp.clip(kv_len - lo, 0, hi - lo)
        # Poison everything the chunk says is invalid.
        idx = jnp.arange(hi - lo)[None, :, None, None]
        bad = idx >= chunk_valid[:, None, None, None]
        kc = jnp.where(bad, jnp.nan, k[:, lo:hi])
        vc = jnp.where(bad, jnp.nan, v[:, lo:hi])
        part = (
            kernels.chunk_attention_reference(
                q,
                kc,
                vc,
                jnp.full(2, lo, jnp.int32),
                chunk_valid,
                q_start,
                scale=0.3,
                window=window,
            )
            if hi > lo
            else (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))
        )
        out, lse = kernels.merge_partials(out, lse, *part)

    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, whole_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_merge_partials_with_empty_sides():
    out_a = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [jnp.nan, 0.0]])
    lse_a = jnp.asarray([0.5, -jnp.inf, -jnp.inf])
    out_b = jnp.asarray([[5.0, 6.0], [7.0, 8.0], [0.0, jnp.nan]])
    lse_b = jnp.asarray([-jnp.inf, 1.5, -jnp.inf])
    out, lse = kernels.merge_partials(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(out, [[1.0, 2.0], [7.0, 8.0], [0.0, 0.0]])
    np.testing.assert_array_equal(lse, [0.5, 1.5, -np.inf])


def test_merge_partials_weights():
    out, lse = kernels.merge_partials(
        jnp.asarray([[1.0]]),
        jnp.asarray([0.0]),
        jnp.asarray([[3.0]]),
        jnp.asarray([math.log(3.0)]),
    )
    # Weights 1 : 3 -> (1 * 1 + 3 * 3) / 4.
    np.testing.assert_allclose(out, [[2.5]], rtol=1e-6)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-6)


# ----------------------------------------------------------------------------
# Block skipping
# ----------------------------------------------------------------------------


@st.composite
def block_range_cases(draw):
    block_kv = draw(st.sampled_from([1, 4, 8]))
    num_blocks = draw(st.integers(1, 6))
    return dict(
        k_start=draw(st.integers(0, 40)),
        k_valid=draw(st.integers(0, num_blocks * block_kv)),
        q_start=draw(st.integers(0, 60)),
        q_len=draw(st.integers(1, 5)),
        block_kv=block_kv,
        num_blocks=num_blocks,
        window=draw(st.one_of(st.none(), st.integers(1, 30))),
    )


@settings(max_examples=max(settings().max_examples, 50))
@given(block_range_cases())
def test_block_range_is_exactly_the_blocks_with_visible_keys(case):
    bk = case["block_kv"]
    n = case["num_blocks"]
    t = case["q_len"]
    q_pos = case["q_start"] + np.arange(t)[:, None]
    k_idx = np.arange(n * bk)[None, :]
    k_pos = case["k_start"] + k_idx
    visible = (k_idx < case["k_valid"]) & (k_pos <= q_pos)
    if case["window"] is not None:
        visible &= k_pos > q_pos - case["window"]
    blocks = np.flatnonzero(visible.any(0).reshape(n, bk).any(1))
    lo, hi = _common.block_range(
        jnp.int32(case["k_start"]),
        jnp.int32(case["k_valid"]),
        jnp.int32(case["q_start"]),
        q_len=t,
        block_kv=bk,
        num_blocks=n,
        window=case["window"],
    )
    lo, hi = int(lo), int(hi)
    assert 0 <= lo <= hi <= n
    if blocks.size:
        # Visible keys form one interval, so their blocks are contiguous.
        assert (lo, hi) == (blocks[0], blocks[-1] + 1)
    else:
        assert lo == hi


# ----------------------------------------------------------------------------
# Hypothesis: reference vs naive numpy on random shapes
# ----------------------------------------------------------------------------


@st.composite
def attention_cases(draw, *, max_chunk_len=24, head_dims=(4, 8, 16)):
    batch = draw(st.integers(1, 2))
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    chunk_len = draw(st.integers(1, max_chunk_len))
    k_start = draw(st.lists(st.integers(0, 30), min_size=batch, max_size=batch))
    return dict(
        batch=batch,
        q_len=draw(st.integers(1, 4)),
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(head_dims)),
        chunk_len=chunk_len,
        dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        k_valid=draw(st.lists(st.integers(0, chunk_len), min_size=batch, max_size=batch)),
        k_start=k_start,
        q_start=[s + draw(st.integers(-4, chunk_len + 4)) for s in k_start],
        window=draw(st.one_of(st.none(), st.integers(1, 12))),
        soft_cap=draw(st.one_of(st.none(), st.floats(2.0, 50.0))),
        seed=draw(st.integers(0, 2**16)),
    )


def _split_case(case):
    case = dict(case)
    knobs = dict(window=case.pop("window"), soft_cap=case.pop("soft_cap"))
    return make_inputs(case.pop("seed"), **case), knobs


@settings(max_examples=max(settings().max_examples, 10))
@given(attention_cases())
def test_reference_matches_naive_hypothesis(case):
    args, knobs = _split_case(case)
    out, lse = kernels.chunk_attention_reference(*args, scale=0.35, **knobs)
    ref_out, ref_lse = naive_attention(*args, scale=0.35, **knobs)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# TPU kernel (TPU interpret mode with race detection)
# ----------------------------------------------------------------------------

KERNEL_CASES = {
    # Ragged k_valid: 0 (nothing to fetch) and 37 (not a multiple of 16).
    "f32_mha_ragged": dict(
        shape=dict(
            batch=2,
            q_len=2,
            num_q_heads=2,
            num_kv_heads=2,
            head_dim=32,
            chunk_len=48,
            k_valid=[37, 0],
            k_start=[10, 0],
            q_start=[47, 3],
        ),
        dtype=jnp.float32,
        window=None,
        soft_cap=None,
        block_kv=16,
    ),
    # GQA 2 with a window (skips leading blocks) and a soft cap.
    "bf16_gqa2_window_softcap": dict(
        shape=dict(
            batch=2,
            q_len=3,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=32,
            chunk_len=48,
            k_valid=[48, 21],
            k_start=[0, 100],
            q_start=[46, 119],
        ),
        dtype=jnp.bfloat16,
        window=20,
        soft_cap=30.0,
        block_kv=16,
    ),
    # Prefill-style chunk: queries overlap the keys, causal inside the chunk
    # (skips trailing blocks); chunk_len not a multiple of block_kv.
    "f32_gqa4_prefill": dict(
        shape=dict(
            batch=1,
            q_len=8,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=16,
            chunk_len=20,
            k_valid=[19],
            k_start=[4],
            q_start=[6],
        ),
        dtype=jnp.float32,
        window=None,
        soft_cap=None,
        block_kv=8,
    ),
    # Through jit(chunk_attention(backend="auto")): on CPU with interpret set
    # this picks the TPU kernel, with block_kv from the table ("cpu" entry,
    # 16) clamped to the chunk. f32 queries over bf16 K/V are promoted.
    "mixed_dispatch_default_block": dict(
        shape=dict(
            batch=1,
            q_len=1,
            num_q_heads=2,
            num_kv_heads=1,
            head_dim=32,
            chunk_len=40,
            k_valid=[33],
            q_dtype=jnp.float32,
        ),
        dtype=jnp.bfloat16,
        window=None,
        soft_cap=None,
        block_kv=None,
        op=lambda *args, **kw: jax.jit(functools.partial(kernels.chunk_attention, **kw))(*args),
    ),
    # Gemma 4's global layers: head_dim 512, GQA 4 (a VMEM tile of 512 lanes).
    "bf16_gqa4_head_dim_512": dict(
        shape=dict(
            batch=1,
            q_len=2,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=512,
            chunk_len=32,
            k_valid=[27],
            k_start=[3],
            q_start=[30],
        ),
        dtype=jnp.bfloat16,
        window=None,
        soft_cap=None,
        block_kv=16,
    ),
    # Sliding window plus causality leaves some queries with nothing visible.
    "bf16_gqa2_masked_rows": dict(
        shape=dict(
            batch=1,
            q_len=4,
            num_q_heads=2,
            num_kv_heads=1,
            head_dim=16,
            chunk_len=32,
            k_valid=[32],
            k_start=[30],
            q_start=[28],
        ),
        dtype=jnp.bfloat16,
        window=2,
        soft_cap=5.0,
        block_kv=16,
    ),
}


def _run_case(fn, case, seed=0, **kwargs):
    fn = case.get("op", fn)
    args = make_inputs(seed, dtype=case["dtype"], **case["shape"])
    knobs = dict(scale=0.3, window=case["window"], soft_cap=case["soft_cap"])
    actual = fn(*args, block_kv=case["block_kv"], **knobs, **kwargs)
    expected = kernels.chunk_attention_reference(*args, **knobs)
    assert_matches(actual, expected, case["dtype"])


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_tpu_kernel_matches_reference(name, tpu_interpret):
    _run_case(kernels.chunk_attention_tpu, KERNEL_CASES[name], interpret=tpu_interpret)
    assert not tpu_races_found()


def test_tpu_kernel_with_eager_dmas(tpu_interpret):
    # The default "on_wait" mode runs a DMA only when it is waited on; "eager"
    # runs it at start(), so a prefetch that clobbered a slot still in use
    # would corrupt the result here.
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    _run_case(kernels.chunk_attention_tpu, KERNEL_CASES["f32_mha_ragged"], interpret=params)
    assert not tpu_races_found()


def test_tpu_race_detector_is_live(tpu_interpret):
    """Negative control: a kernel that reads a DMA target before waiting.

    Guards against the no-race assertions above passing vacuously (e.g. if
    the detector's reporting moved in a jax upgrade).
    """

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]  # Read before wait: a data race.
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    pl.pallas_call(
        racy,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        interpret=tpu_interpret,
    )(x).block_until_ready()
    assert tpu_races_found()


@settings(max_examples=2)
@given(attention_cases(max_chunk_len=40, head_dims=(8, 32)))
def test_tpu_kernel_matches_reference_hypothesis(case):
    args, knobs = _split_case(case)
    dtype = case["dtype"]
    try:
        actual = kernels.chunk_attention_tpu(
            *args, scale=0.35, block_kv=16, interpret=RACE_CHECK, **knobs
        )
        assert not tpu_races_found()
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    expected = kernels.chunk_attention_reference(*args, scale=0.35, **knobs)
    assert_matches(actual, expected, dtype)


# ----------------------------------------------------------------------------
# GPU kernel (generic Pallas interpreter)
# ----------------------------------------------------------------------------

GPU_CASES = {
    # Two splits; the second split is empty for batch row 0 (k_valid=10)
    # and both are empty for row 1.
    "f32_gqa2_splits": dict(
        case=dict(
            shape=dict(
                batch=2,
                q_len=2,
                num_q_heads=4,
                num_kv_heads=2,
                head_dim=16,
                chunk_len=64,
                k_valid=[10, 0],
                k_start=[0, 0],
                q_start=[40, 3],
            ),
            dtype=jnp.float32,
            window=None,
            soft_cap=None,
            block_kv=16,
        ),
        num_splits=2,
    ),
    # head_dim 24 and 3 * 4 rows are padded up to Triton-friendly sizes;
    # chunk_len 40 is padded to 2 splits x 2 blocks x 16.
    "bf16_gqa4_window_softcap_padded": dict(
        case=dict(
            shape=dict(
                batch=1,
                q_len=3,
                num_q_heads=4,
                num_kv_heads=1,
                head_dim=24,
                chunk_len=40,
                k_valid=[39],
                k_start=[5],
                q_start=[40],
            ),
            dtype=jnp.bfloat16,
            window=25,
            soft_cap=10.0,
            block_kv=16,
        ),
        num_splits=2,
    ),
    # Gemma 4's global layers: head_dim 512.
    "bf16_head_dim_512": dict(
        case=dict(
            shape=dict(
                batch=1,
                q_len=1,
                num_q_heads=2,
                num_kv_heads=1,
                head_dim=512,
                chunk_len=32,
                k_valid=[29],
            ),
            dtype=jnp.bfloat16,
            window=None,
            soft_cap=None,
            block_kv=16,
        ),
        num_splits=2,
    ),
    # Through chunk_attention(backend="gpu") with default block/splits.
    "f32_dispatch_defaults": dict(
        case=dict(
            shape=dict(
                batch=1,
                q_len=1,
                num_q_heads=2,
                num_kv_heads=2,
                head_dim=16,
                chunk_len=16,
                k_valid=[11],
            ),
            dtype=jnp.float32,
            window=None,
            soft_cap=None,
            block_kv=None,
            op=functools.partial(kernels.chunk_attention, backend="gpu"),
        ),
        num_splits=None,
    ),
}


@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_kernel_matches_reference(name):
    spec = GPU_CASES[name]
    extra = {} if spec["num_splits"] is None else dict(num_splits=spec["num_splits"])
    _run_case(kernels.chunk_attention_gpu, spec["case"], interpret=True, **extra)


@settings(max_examples=2)
@given(attention_cases(max_chunk_len=40, head_dims=(8, 16)))
def test_gpu_kernel_matches_reference_hypothesis(case):
    args, knobs = _split_case(case)
    actual = kernels.chunk_attention_gpu(
        *args, scale=0.35, block_kv=16, num_splits=2, interpret=True, **knobs
    )
    expected = kernels.chunk_attention_reference(*args, scale=0.35, **knobs)
    assert_matches(actual, expected, case["dtype"])


# ----------------------------------------------------------------------------
# Lowering for the real platforms (no hardware needed)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "platform,dtype,head_dim",
    [
        ("tpu", jnp.bfloat16, 128),
        ("tpu", jnp.float32, 64),
        ("cuda", jnp.bfloat16, 128),
        ("cuda", jnp.float32, 40),
    ],
)
def test_kernels_lower_for_hardware(platform, dtype, head_dim):
    """Runs the Mosaic / Triton lowering rules on CPU.

    This catches unsupported primitives and block shapes early; it does not
    run the TPU/GPU compilers that follow, so it is no substitute for a test
    on hardware.
    """
    b, t, hq, hkv, s = 2, 3, 8, 2, 200
    q = jax.ShapeDtypeStruct((b, t, hq, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((b, s, hkv, head_dim), dtype)
    pos = jax.ShapeDtypeStruct((b,), jnp.int32)
    if platform == "tpu":
        fn = functools.partial(kernels.chunk_attention_tpu, block_kv=64)
        target = "tpu_custom_call"
    else:
        fn = functools.partial(kernels.chunk_attention_gpu, block_kv=32, num_splits=4)
        target = "__gpu$xla.gpu.triton"
    fn = functools.partial(fn, scale=0.1, soft_cap=30.0, window=64)
    lowered = jax.jit(fn).trace(q, kv, kv, pos, pos, pos).lower(lowering_platforms=(platform,))
    assert target in lowered.as_text()


# ----------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------


def _valid_args(**overrides):
    shape = dict(batch=1, q_len=2, num_q_heads=4, num_kv_heads=2, head_dim=8, chunk_len=16)
    shape.update(overrides)
    return make_inputs(0, **shape)


ALL_OPS = {
    "reference": kernels.chunk_attention_reference,
    "dispatch": functools.partial(kernels.chunk_attention, backend="tpu"),
    "tpu": kernels.chunk_attention_tpu,
    "gpu": kernels.chunk_attention_gpu,
}


@pytest.mark.parametrize("op", sorted(ALL_OPS))
def test_rejects_heads_not_multiple(op):
    q, *rest = _valid_args()
    q = q[:, :, :3]
    with pytest.raises(
        ValueError,
        match=r"num_q_heads=3 must be a multiple of "
        r"num_kv_heads=2",
    ):
        ALL_OPS[op](q, *rest, scale=1.0)


@pytest.mark.parametrize("op", sorted(ALL_OPS))
def test_rejects_wrong_rank(op):
    q, k, *rest = _valid_args()
    with pytest.raises(ValueError, match=r"k must have rank 4"):
        ALL_OPS[op](q, k[0], *rest, scale=1.0)


@pytest.mark.parametrize("op", sorted(ALL_OPS))
def test_rejects_mismatched_head_dim(op):
    q, k, v, *rest = _valid_args()
    with pytest.raises(
        ValueError,
        match=r"head_dim mismatch: q has "
        r"head_dim=8, k/v have head_dim=4",
    ):
        ALL_OPS[op](q, k[..., :4], v[..., :4], *rest, scale=1.0)


def test_rejects_other_shape_and_dtype_errors():
    q, k, v, k_start, k_valid, q_start = _valid_args()
    op = kernels.chunk_attention_reference
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        op(q, k, v[:, :8], k_start, k_valid, q_start, scale=1.0)
    with pytest.raises(ValueError, match=r"k_valid must have shape"):
        op(q, k, v, k_start, jnp.zeros((2,), jnp.int32), q_start, scale=1.0)
    with pytest.raises(
        ValueError,
        match=r"q.dtype must be float32 or "
        r"bfloat16",
    ):
        op(q.astype(jnp.int32), k, v, k_start, k_valid, q_start, scale=1.0)
    with pytest.raises(ValueError, match=r"q_start must be an integer"):
        op(q, k, v, k_start, k_valid, q_start.astype(jnp.float32), scale=1.0)
    with pytest.raises(ValueError, match=r"window must be None or an int"):
        op(q, k, v, k_start, k_valid, q_start, scale=1.0, window=0)
    with pytest.raises(
        ValueError,
        match=r"soft_cap must be None or a "
        r"positive",
    ):
        op(q, k, v, k_start, k_valid, q_start, scale=1.0, soft_cap=-1.0)


@pytest.mark.parametrize(
    "backend,block_kv,match",
    [
        ("tpu", 0, r"block_kv must be a positive int, got 0"),
        ("tpu", -16, r"block_kv must be a positive int, got -16"),
        ("tpu", 12, r"block_kv=12 must be a multiple of 8"),
        ("gpu", 24, r"block_kv=24 must be a power of two >= 16"),
        ("gpu", 8, r"block_kv=8 must be a power of two >= 16"),
    ],
)
def test_rejects_bad_block_kv(backend, block_kv, match):
    with pytest.raises(ValueError, match=match):
        kernels.chunk_attention(
            *_valid_args(), scale=1.0, backend=backend, block_kv=block_kv, interpret=True
        )


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'"):
        kernels.chunk_attention(*_valid_args(), scale=1.0, backend="cuda")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only rule")
def test_auto_backend_on_cpu_needs_interpret():
    with pytest.raises(
        ValueError,
        match=r"backend='auto' found platform "
        r"'cpu'",
    ):
        kernels.chunk_attention(*_valid_args(), scale=1.0)


def test_block_kv_table_lookup():
    assert kernels.default_block_kv("tpu", "TPU v5 lite") == 512
    assert kernels.default_block_kv("gpu", "NVIDIA H200") == 64
    assert kernels.default_block_kv("tpu", "cpu") == 16
    assert kernels.default_block_kv("gpu", "Some Future GPU") == kernels.DEFAULT_BLOCK_KV["gpu"]


def test_gpu_kernel_silences_only_the_triton_deprecation():
    """jax 0.11 warns at every lowering of a Pallas Triton kernel; the kernel silences that
    message alone (others still reach the caller)."""
    import warnings

    case = GPU_CASES["f32_dispatch_defaults"]["case"]
    args = make_inputs(0, dtype=case["dtype"], **case["shape"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.chunk_attention_gpu(*args, scale=0.3, interpret=True)
        warnings.warn(
            "The Pallas Triton backend is deprecated and will be removed in a future JAX version.",
            DeprecationWarning,
        )
        warnings.warn("another deprecation", DeprecationWarning)
    assert [str(w.message) for w in caught] == ["another deprecation"]
