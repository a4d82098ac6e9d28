"""Quantized tier rows: int8 or fp8 KV with one float32 scale per token per KV head.

A decode step over a long context is bound by the bytes it streams; a quantized tier
halves them. Each token's K (or V) row of ``H`` heads x ``D`` values is stored as

    [H * D one-byte codes][H float32 scales][zero padding to a multiple of 16 bytes]

so a row stays one contiguous run of bytes: the engine, the block tables, the segments
and the prefix store see rows of :func:`row_bytes` bytes and nothing else changes. The
padding keeps 256-token blocks whole 4 KiB pages (O_DIRECT reads land in place) for any
head count, and the scales at a 4-byte offset whenever ``D`` is a multiple of 4.

Scales are per (token, head) absmax: ``scale = max|x| / code_max`` with ``code_max`` 127
for int8 (codes ``round(x / scale)``, so ``|x - code * scale| <= scale / 2``) and 448 for
``float8_e4m3fn`` (codes ``x / scale`` rounded to the nearest fp8 value: 3 mantissa bits,
a relative error of at most 2**-4). A row of zeros gets scale 0 and codes 0.

Quantization runs inside the jitted step (fused before the write-back) and host-side in
:meth:`OffloadedKVCache.load`, through the same jitted function, so the two write the
same bytes for the same KV. Attention never dequantizes a unit as a separate pass: the
kernels take codes and scales (``score = (q . k_code) * s_k``, probabilities times
``s_v`` before ``P . V``; see :func:`jax_tpusync.kernels.chunk_attention_reference`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# What ``OffloadedKVCache(tier_dtype=...)`` accepts (None: rows in the KV dtype itself).
TIER_DTYPES = ("int8", "float8_e4m3fn")
SCALE_DTYPE = np.dtype(np.float32)
# Rows are padded to this many bytes: 256 such rows fill whole 4 KiB pages.
ROW_ALIGN = 16
_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


class QuantizedRows(NamedTuple):
    """Codes and scales of rows read raw from a quantized tier."""

    codes: np.ndarray  # [..., num_kv_heads, head_dim] int8 or float8_e4m3fn
    scales: np.ndarray  # [..., num_kv_heads] float32


def join_head_shards(pieces: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """K and V of several head shards' reads (``(k, v)`` each, in head order) joined along
    the heads: arrays [n, heads, head_dim], or :class:`QuantizedRows` (codes [n, heads,
    head_dim] and scales [n, heads] both join there)."""

    def join(parts: list[Any]) -> Any:
        if isinstance(parts[0], QuantizedRows):
            return QuantizedRows(*(np.concatenate([p[i] for p in parts], axis=1) for i in (0, 1)))
        return np.concatenate(parts, axis=1)

    return join([p[0] for p in pieces]), join([p[1] for p in pieces])


def join_row_shards(
    rows: np.ndarray,  # uint8[..., shards, row_bytes(num_kv_heads, head_dim)]
    num_kv_heads: int,
    head_dim: int,
) -> np.ndarray:  # uint8[..., row_bytes(shards * num_kv_heads, head_dim)]
    """Quantized rows of head shards (each of ``num_kv_heads`` heads, in head order) as
    the rows of every head: every shard's codes, then every shard's scales, then zero
    padding, as :func:`quantize` of every head lays out one row. (Concatenating the
    shards' rows would interleave codes and scales, and pad each.)"""
    *lead, shards, _ = rows.shape
    codes_end = num_kv_heads * head_dim
    scales_end = codes_end + num_kv_heads * SCALE_DTYPE.itemsize
    out = np.zeros((*lead, row_bytes(shards * num_kv_heads, head_dim)), np.uint8)
    out[..., : shards * codes_end] = rows[..., :codes_end].reshape(*lead, -1)
    out[..., shards * codes_end : shards * scales_end] = rows[..., codes_end:scales_end].reshape(
        *lead, -1
    )
    return out


def split_row_shards(
    rows: np.ndarray,  # uint8[..., row_bytes(shards * num_kv_heads, head_dim)]
    shards: int,
    num_kv_heads: int,
    head_dim: int,
) -> np.ndarray:  # uint8[..., shards, row_bytes(num_kv_heads, head_dim)]
    """:func:`join_row_shards` undone: rows of every head as ``shards`` head shards' rows
    of ``num_kv_heads`` heads each (codes, scales, zero padding apiece)."""
    *lead, _ = rows.shape
    codes_end = num_kv_heads * head_dim
    scales_end = codes_end + num_kv_heads * SCALE_DTYPE.itemsize
    out = np.zeros((*lead, shards, row_bytes(num_kv_heads, head_dim)), np.uint8)
    out[..., :codes_end] = rows[..., : shards * codes_end].reshape(*lead, shards, codes_end)
    out[..., codes_end:scales_end] = rows[..., shards * codes_end : shards * scales_end].reshape(
        *lead, shards, scales_end - codes_end
    )
    return out


def tier_dtype_of(tier_dtype: Any) -> np.dtype | None:
    """``tier_dtype`` as a numpy dtype (None stays None); refuses anything else by name."""
    if tier_dtype is None:
        return None
    try:
        dtype = np.dtype(tier_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in TIER_DTYPES:
        raise ValueError(
            f"tier_dtype={tier_dtype!r} must be None, 'int8' or 'float8_e4m3fn' (codes with "
            f"one float32 scale per token per KV head)"
        )
    return dtype


def code_max(tier_dtype: np.dtype) -> float:
    """The largest code magnitude a scale maps a row's absmax to."""
    return _CODE_MAX[np.dtype(tier_dtype).name]


def row_bytes(num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one quantized token row (codes, scales, padding)."""
    raw = num_kv_heads * head_dim + num_kv_heads * SCALE_DTYPE.itemsize
    return -(-raw // ROW_ALIGN) * ROW_ALIGN


def quantize(
    x: jax.Array,  # [..., num_kv_heads, head_dim] float
    tier_dtype: np.dtype,
) -> jax.Array:  # uint8[..., row_bytes(num_kv_heads, head_dim)]
    """Rows of ``x`` as tier bytes: codes, per-head scales, padding."""
    tier_dtype = np.dtype(tier_dtype)
    *lead, h, d = x.shape
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)  # [..., H]
    limit = code_max(tier_dtype)
    scale = absmax / limit
    # x * (limit / absmax), not x / scale: the largest value maps to exactly +-limit.
    inverse = jnp.where(absmax > 0, limit / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    scaled = x * inverse[..., None]
    if tier_dtype == np.dtype(np.int8):
        codes = jnp.clip(jnp.round(scaled), -limit, limit).astype(jnp.int8)
    else:
        # Clipped first: a value rounding just past the largest fp8 would become NaN.
        codes = jnp.clip(scaled, -limit, limit).astype(tier_dtype)
    code_bytes = lax.bitcast_convert_type(codes, jnp.uint8).reshape(*lead, h * d)
    scale_bytes = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)
    scale_bytes = scale_bytes.reshape(*lead, h * SCALE_DTYPE.itemsize)
    pad = row_bytes(h, d) - h * d - h * SCALE_DTYPE.itemsize
    parts = [code_bytes, scale_bytes]
    if pad:
        parts.append(jnp.zeros((*lead, pad), jnp.uint8))
    return jnp.concatenate(parts, axis=-1)


def unpack(
    rows: jax.Array,  # uint8[..., row_bytes]
    tier_dtype: np.dtype,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[jax.Array, jax.Array]:  # codes [..., H, D] tier_dtype, scales f32[..., H]
    """Codes and scales of quantized rows (views of their bytes; no arithmetic)."""
    h, d = num_kv_heads, head_dim
    lead = rows.shape[:-1]
    codes = lax.bitcast_convert_type(rows[..., : h * d], np.dtype(tier_dtype))
    scale_bytes = rows[..., h * d : h * d + h * SCALE_DTYPE.itemsize]
    scales = lax.bitcast_convert_type(
        scale_bytes.reshape(*lead, h, SCALE_DTYPE.itemsize), jnp.float32
    )
    return codes.reshape(*lead, h, d), scales


def dequantize(
    codes: jax.Array,  # [..., H, D] int8 or float8_e4m3fn
    scales: jax.Array,  # f32[..., H]
    dtype: Any = jnp.float32,
) -> jax.Array:  # [..., H, D] dtype
    """``codes * scales`` in ``dtype``: what the tier's rows stand for."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


# Host-side (load, read): the same functions, jitted on the CPU device so that a bulk load
# never takes accelerator memory and writes exactly the bytes the in-graph path would.
@functools.partial(jax.jit, static_argnames=("tier_dtype",))
def _quantize_jit(x, tier_dtype):
    return quantize(x, np.dtype(tier_dtype))


@functools.partial(jax.jit, static_argnames=("tier_dtype", "num_kv_heads", "head_dim"))
def _unpack_jit(rows, tier_dtype, num_kv_heads, head_dim):
    return unpack(rows, np.dtype(tier_dtype), num_kv_heads, head_dim)


def quantize_host(x: np.ndarray, tier_dtype: np.dtype) -> np.ndarray:
    """:func:`quantize` of a host array, computed on the CPU device: uint8 rows."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return np.asarray(_quantize_jit(jnp.asarray(x), np.dtype(tier_dtype).name))


def unpack_host(
    rows: np.ndarray, tier_dtype: np.dtype, num_kv_heads: int, head_dim: int
) -> QuantizedRows:
    """:func:`unpack` of host rows (uint8[..., row_bytes])."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        codes, scales = _unpack_jit(
            jnp.asarray(rows), np.dtype(tier_dtype).name, num_kv_heads, head_dim
        )
    return QuantizedRows(np.asarray(codes), np.asarray(scales))


def dequantize_host(stored: QuantizedRows, dtype: Any) -> np.ndarray:
    """:func:`dequantize` of host codes and scales, in numpy: [..., H, D] ``dtype``."""
    values = stored.codes.astype(np.float32) * stored.scales[..., None]
    return values.astype(dtype)
