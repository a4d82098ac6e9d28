"""Quantized K/V: the round trip's error bounds, and every attention path that applies
scales (the jnp reference, the TPU kernel in TPU interpret mode, the GPU kernel in the
Pallas interpreter) against a reference that dequantizes first."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync import kernels
from jax_tpusync.core import quantize

CODES = ("int8", "float8_e4m3fn")


def _quantized(x: np.ndarray, tier_dtype: str):
    """(codes, scales) of x [..., H, D] through the tier's byte rows."""
    h, d = x.shape[-2:]
    rows = quantize.quantize_host(x, np.dtype(tier_dtype))
    stored = quantize.unpack_host(rows, np.dtype(tier_dtype), h, d)
    return stored.codes, stored.scales


# -- round trip -------------------------------------------------------------------------------


def test_int8_round_trip_is_within_half_a_step_of_absmax_scaling():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 33, 3, 64)).astype(np.float32) * rng.uniform(
        0.01, 50, (4, 33, 3, 1)
    )
    x[1, 2, 0] = 0.0  # An all-zero row: scale 0, codes 0.
    x[2, 5, 1, 7] = 1e4  # An outlier: its row's step grows, the bound with it.
    codes, scales = _quantized(x, "int8")
    absmax = np.abs(x).max(-1)
    # XLA may divide by the constant as a multiply: within an ulp.
    np.testing.assert_allclose(scales, absmax / np.float32(127), rtol=2.5e-7, atol=0)
    err = np.abs(quantize.dequantize_host(quantize.QuantizedRows(codes, scales), np.float32) - x)
    # |x - c * s| <= s / 2, plus float32 rounding of the product.
    bound = scales[..., None] / 2 * (1 + 1e-6) + np.abs(x) * 2**-23
    assert (err <= bound).all(), float((err - bound).max())
    assert (np.abs(codes.astype(np.int32)).max(-1)[absmax > 0] == 127).all()
    assert not codes[1, 2, 0].any() and scales[1, 2, 0] == 0


def test_fp8_round_trip_keeps_three_mantissa_bits():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 40, 2, 32)).astype(np.float32) * 7
    codes, scales = _quantized(x, "float8_e4m3fn")
    assert codes.dtype == np.dtype(jnp.float8_e4m3fn)
    assert not np.isnan(codes.astype(np.float32)).any()  # The absmax maps to 448, not past it.
    back = quantize.dequantize_host(quantize.QuantizedRows(codes, scales), np.float32)
    # Relative 2**-4 for normal codes; subnormals (below 2**-6) have absolute steps of 2**-9.
    bound = np.maximum(np.abs(x) * 2**-4, scales[..., None] * 2**-10) * (1 + 1e-5)
    assert (np.abs(back - x) <= bound).all()


def test_rows_are_sixteen_byte_multiples_so_blocks_are_whole_pages():
    for heads in (1, 2, 3, 8):
        for head_dim in (8, 64, 128):
            size = quantize.row_bytes(heads, head_dim)
            assert size % 16 == 0 and size >= heads * (head_dim + 4)
            assert (256 * size) % 4096 == 0


def test_in_graph_and_host_quantization_write_the_same_bytes():
    x = np.random.default_rng(2).standard_normal((2, 5, 2, 16)).astype(jnp.bfloat16)
    for tier_dtype in CODES:
        in_graph = jax.jit(lambda a: quantize.quantize(a, np.dtype(tier_dtype)))(jnp.asarray(x))
        np.testing.assert_array_equal(
            np.asarray(in_graph), quantize.quantize_host(x, np.dtype(tier_dtype))
        )


@pytest.mark.parametrize("bad", ["float8_e5m2", "int4", "bfloat16", 3])
def test_unknown_tier_dtypes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"tier_dtype=.* must be None, 'int8' or 'float8_e4m3fn'"):
        quantize.tier_dtype_of(bad)


# -- attention with scales --------------------------------------------------------------------


def _case(
    seed,
    tier_dtype,
    *,
    batch=2,
    q_len=2,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    chunk=40,
    k_valid=(40, 13),
    k_start=(0, 7),
    q_start=(40, 30),
    q_dtype=jnp.float32,
):
    """Quantized inputs whose padding (past k_valid) holds NaN scales (and NaN fp8 codes),
    and the dequantized K/V a reference attends to (padding zeroed: never visible)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, q_len, q_heads, head_dim)), q_dtype)
    kv = rng.standard_normal((2, batch, chunk, kv_heads, head_dim)).astype(np.float32) * 3
    codes, scales = _quantized(kv, tier_dtype)
    valid = np.arange(chunk)[None, :] < np.asarray(k_valid)[:, None]  # [batch, chunk]
    deq = np.where(
        valid[None, :, :, None, None],
        quantize.dequantize_host(quantize.QuantizedRows(codes, scales), np.float32),
        0,
    )
    scales = np.where(valid[None, :, :, None], scales, np.nan).astype(np.float32)
    if tier_dtype != "int8":
        codes = np.where(valid[None, :, :, None, None], codes.astype(np.float32), np.nan).astype(
            codes.dtype
        )
    pos = [jnp.asarray(p, jnp.int32) for p in (k_start, k_valid, q_start)]
    quantized = (q, jnp.asarray(codes[0]), jnp.asarray(codes[1]), *pos)
    scale_kw = dict(k_scale=jnp.asarray(scales[0]), v_scale=jnp.asarray(scales[1]))
    dequantized = (q, jnp.asarray(deq[0]), jnp.asarray(deq[1]), *pos)
    return quantized, scale_kw, dequantized


KNOBS = {
    "plain": dict(window=None, soft_cap=None),
    "window": dict(window=9, soft_cap=None),
    "soft_cap_window": dict(window=25, soft_cap=4.0),
}
GROUPS = {
    "mha": dict(q_heads=2, kv_heads=2),
    "gqa2": dict(q_heads=4, kv_heads=2),
    "gqa4": dict(q_heads=4, kv_heads=1),
}


def _check(actual, expected, tol):
    out, lse = (np.asarray(x) for x in actual)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, np.asarray(expected[0]), atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, np.asarray(expected[1]), atol=tol, rtol=tol)


# Each code dtype with each GQA ratio and each set of knobs (a Latin square, not all 18).
@pytest.mark.parametrize(
    "tier_dtype,group,knobs",
    [
        ("int8", "mha", "plain"),
        ("int8", "gqa2", "window"),
        ("int8", "gqa4", "soft_cap_window"),
        ("float8_e4m3fn", "mha", "soft_cap_window"),
        ("float8_e4m3fn", "gqa2", "plain"),
        ("float8_e4m3fn", "gqa4", "window"),
    ],
)
def test_reference_applies_scales_like_dequantizing_first(tier_dtype, group, knobs):
    args, scales, deq = _case(0, tier_dtype, **GROUPS[group])
    kw = dict(scale=0.3, **KNOBS[knobs])
    fused = kernels.chunk_attention_reference(*args, **kw, **scales)
    _check(fused, kernels.chunk_attention_reference(*deq, **kw), 1e-5)


KERNEL_CASES = [
    ("int8", jnp.float32, 2e-5),
    ("float8_e4m3fn", jnp.float32, 2e-5),
    ("int8", jnp.bfloat16, 3e-2),
]


@pytest.mark.parametrize("tier_dtype,q_dtype,tol", KERNEL_CASES)
def test_tpu_kernel_applies_scales(tier_dtype, q_dtype, tol, tpu_race_check):
    args, scales, deq = _case(1, tier_dtype, q_dtype=q_dtype)
    kw = dict(scale=0.3, window=25, soft_cap=4.0)
    params, races_found = tpu_race_check
    actual = kernels.chunk_attention_tpu(*args, **kw, **scales, block_kv=32, interpret=params)
    assert not races_found()
    _check(actual, kernels.chunk_attention_reference(*deq, **kw), tol)


@pytest.mark.parametrize("tier_dtype,q_dtype,tol", KERNEL_CASES)
def test_gpu_kernel_applies_scales(tier_dtype, q_dtype, tol):
    args, scales, deq = _case(2, tier_dtype, q_dtype=q_dtype, **GROUPS["gqa4"])
    kw = dict(scale=0.3, window=None, soft_cap=4.0)
    actual = kernels.chunk_attention_gpu(
        *args, **kw, **scales, block_kv=16, num_splits=2, interpret=True
    )
    _check(actual, kernels.chunk_attention_reference(*deq, **kw), tol)


def test_dispatch_passes_scales_and_defaults_block_kv_to_the_code_tiling():
    args, scales, deq = _case(3, "int8")
    kw = dict(scale=0.3, window=None, soft_cap=None)
    actual = kernels.chunk_attention(*args, **kw, **scales, backend="tpu", interpret=True)
    _check(actual, kernels.chunk_attention_reference(*deq, **kw), 2e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("tier_dtype", CODES)
def test_quantized_kernels_lower_for_hardware(platform, tier_dtype):
    """The Mosaic / Triton lowering rules accept one-byte codes and scale rows (no
    hardware here: the compilers after lowering do not run)."""
    b, t, hq, hkv, d, s = 2, 3, 8, 2, 128, 200
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.dtype(tier_dtype))
    sc = jax.ShapeDtypeStruct((b, s, hkv), jnp.float32)
    pos = jax.ShapeDtypeStruct((b,), jnp.int32)
    if platform == "tpu":
        fn, target = functools.partial(kernels.chunk_attention_tpu, block_kv=64), "tpu_custom_call"
    else:
        fn = functools.partial(kernels.chunk_attention_gpu, block_kv=32, num_splits=4)
        target = "__gpu$xla.gpu.triton"

    def call(q, k, v, a, b_, c, ks, vs):
        return fn(q, k, v, a, b_, c, scale=0.1, soft_cap=30.0, window=64, k_scale=ks, v_scale=vs)

    lowered = (
        jax.jit(call).trace(q, kv, kv, pos, pos, pos, sc, sc).lower(lowering_platforms=(platform,))
    )
    assert target in lowered.as_text()


# -- validation -------------------------------------------------------------------------------

OPS = {
    "reference": kernels.chunk_attention_reference,
    "tpu": functools.partial(kernels.chunk_attention_tpu, interpret=True),
    "gpu": functools.partial(kernels.chunk_attention_gpu, interpret=True),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_scale_errors_name_the_problem(op):
    (q, k, v, *pos), scales, (_, k_float, v_float, *_) = _case(4, "int8")
    fn = functools.partial(OPS[op], scale=0.3)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        fn(q, k, v, *pos, k_scale=scales["k_scale"])
    with pytest.raises(ValueError, match=r"k.dtype must be .* got int8"):
        fn(q, k, v, *pos)  # Codes without their scales.
    with pytest.raises(ValueError, match=r"k.dtype must be int8 or float8_e4m3fn \(codes"):
        fn(q, k_float, v_float, *pos, **scales)
    with pytest.raises(
        ValueError,
        match=r"k_scale must be \[batch, chunk_len, num_kv_heads\] = \[2, 40, 2\], "
        r"got \[2, 39, 2\]",
    ):
        fn(q, k, v, *pos, k_scale=scales["k_scale"][:, :39], v_scale=scales["v_scale"])
    with pytest.raises(ValueError, match="v_scale.dtype must be float32, got bfloat16"):
        fn(q, k, v, *pos, k_scale=scales["k_scale"], v_scale=scales["v_scale"].astype(jnp.bfloat16))
