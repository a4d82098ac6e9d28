"""One unit's attention: ``q`` over a block of cached rows, as ``(out, lse)`` partials that
the step merges (online softmax).

The rows come from a staging slot (:func:`staged_unit_rows`), a resident copy, or anywhere
a caller gathers them; :func:`attend_valid_rows` walks a unit's rows in blocks where that
pays (:func:`block_len_for`: on the CPU backend, see :mod:`jax_tpusync.runtime.backend`), and
:func:`attend` runs the plain-XLA reference or the Pallas kernel with the layer's window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_tpusync.core import quantize
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.kernels import reference as kernel_reference
from jax_tpusync.runtime.backend import attends_in_blocks


def staged_rows(
    staging: jax.Array,  # [num_slots, 2, batch, chunk_len, *row_shape]
    slot,  # int or int32[]: the slot to read
    start,  # int or int32[]: its first row to read
    n: int,  # rows to read (static)
    kv_dtype,  # what the rows hold (staging may be its uint16 words)
) -> tuple[jax.Array, jax.Array]:  # k, v: [batch, n, *row_shape] in kv_dtype
    """K and V rows ``[start, start + n)`` of one staging slot.

    A slice with traced indices is a copy. On CPU the attention reads blocks of
    :func:`row_block_len` rows, whose copies stay in cache (a whole 8 MiB unit's copy and
    the page faults of its fresh temporary had made the attention 2.6x slower); on
    accelerators the copy of a unit costs microseconds of device bandwidth.
    """
    zero = jnp.int32(0)
    index = (jnp.asarray(slot, jnp.int32), zero, zero, jnp.asarray(start, jnp.int32))
    index += (zero,) * (staging.ndim - 4)  # [H, D], or a quantized row's [row_bytes].
    block = lax.dynamic_slice(staging, index, (1, *staging.shape[1:3], n, *staging.shape[4:]))
    return from_bits(block[0, 0], kv_dtype), from_bits(block[0, 1], kv_dtype)


def staged_unit_rows(
    spec: CacheSpec,
    staging: jax.Array,  # spec.staging_shape
    slot,  # int or int32[]: the slot to read
    start,  # int or int32[]: its first row to read
    n: int,  # rows to read (static)
) -> dict[str, jax.Array]:
    """``k``, ``v`` [batch, n, H, D] of one staging slot's rows ``[start, start + n)``; of
    a quantized cache the codes, with ``k_scale``/``v_scale`` f32[batch, n, H] (views of
    the staged bytes: the attention applies the scales, nothing dequantizes here)."""
    return rows_as_kv(spec, *staged_rows(staging, slot, start, n, staging.dtype))


def rows_as_kv(
    spec: CacheSpec,
    k_rows: jax.Array,  # [batch, n, *row_shape] in spec.staging_dtype
    v_rows: jax.Array,  # [batch, n, *row_shape] in spec.staging_dtype
) -> dict[str, jax.Array]:
    """Staged rows as :func:`attend`'s ``k``/``v`` (and scales): values in the cache's
    dtype, or the codes and f32[batch, n, H] scales of quantized rows."""
    if not spec.quantized:
        return dict(k=from_bits(k_rows, spec.dtype), v=from_bits(v_rows, spec.dtype))
    k, k_scale = quantize.unpack(k_rows, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
    v, v_scale = quantize.unpack(v_rows, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
    return dict(k=k, v=v, k_scale=k_scale, v_scale=v_scale)


# The plain-XLA attention reads a unit in blocks of about this many bytes of f32 K.
ROW_BLOCK_BYTES = 1 << 20


def row_block_len(unit_len: int, row_elements: int) -> int:
    """Rows per block of a unit of ``unit_len`` rows of ``row_elements`` values each.

    The largest divisor of ``unit_len`` whose f32 rows take at most ``ROW_BLOCK_BYTES``
    (at least one row), unless that takes more than twice the blocks the budget asks for
    (a unit of a prime number of rows): then the whole unit, as blocks must tile it.
    """
    want = max(1, ROW_BLOCK_BYTES // (4 * row_elements))
    fewest = -(-unit_len // want)
    for count in range(fewest, 2 * fewest + 1):
        if unit_len % count == 0:
            return unit_len // count
    return unit_len


def block_len_for(unit_len: int, row_elements: int) -> int:
    """Rows per block in which the plain-XLA attention reads a unit (whole off CPU)."""
    return row_block_len(unit_len, row_elements) if attends_in_blocks() else unit_len


def staged_block_len(spec: CacheSpec) -> int:
    """:func:`block_len_for` a unit of ``spec``'s staging."""
    return block_len_for(spec.chunk_len, spec.batch * spec.num_kv_heads * spec.head_dim)


def attend_valid_rows(
    attend_rows: Callable[[Any, int, jax.Array], tuple[jax.Array, jax.Array]],
    count: jax.Array,  # int32[batch]: valid rows (a prefix) of the unit per batch row
    unit_len: int,
    block_len: int,
    out_shape: tuple[int, ...],  # [batch, q_len, num_q_heads, head_dim]
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of attention over the rows of one unit that hold keys.

    ``attend_rows(start, n, valid)`` attends to the unit's rows ``[start, start + n)``
    (``n`` static), of which the first ``valid[b]`` hold keys. With ``block_len <
    unit_len`` the unit goes in blocks of ``block_len`` rows, up to the last block that holds
    a key, the partials merged (online softmax); else in one call. On XLA's CPU backend
    blocks pay twice: each block's f32 copy of its K and V (XLA converts and transposes an
    operand before a batched dot) stays in cache instead of taking four times the unit's
    bf16 size, and the tokens past the last full unit, which decode keeps at the end of
    every layer (at 32K + n tokens in 4096-token units, one unit in nine), cost their
    blocks instead of a unit. (The Pallas kernels bound their own block loops by
    ``k_valid``.) Accelerators keep one call: a loop's trip count would wait on the host.
    """
    if block_len >= unit_len:
        return attend_rows(0, unit_len, count)

    def one_block(i, carry):
        start = i * block_len
        o, l = attend_rows(start, block_len, jnp.clip(count - start, 0, block_len))
        return kernel_reference.merge_partials(*carry, o, l)

    used_blocks = (jnp.max(count) + block_len - 1) // block_len
    carry = (jnp.zeros(out_shape, jnp.float32), jnp.full(out_shape[:3], -jnp.inf, jnp.float32))
    return lax.fori_loop(0, used_blocks, one_block, carry)


def attend(
    q,
    k,
    v,
    k_start,
    k_valid,
    q_start,
    *,
    spec: CacheSpec,
    layer,
    scale,
    soft_cap,
    implementation: str,
    kernel_options: dict,
    k_scale=None,
    v_scale=None,
):
    """(out f32[B, T, Hq, D], lse f32[B, T, Hq]) over one chunk, with the layer's window;
    ``k``/``v`` are codes when ``k_scale``/``v_scale`` are given."""
    scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)

    def run(window):
        if implementation == "xla":
            return kernel_reference.chunk_attention_reference(
                q,
                k,
                v,
                k_start,
                k_valid,
                q_start,
                scale=scale,
                soft_cap=soft_cap,
                window=window,
                **scales,
            )
        from jax_tpusync import kernels

        return kernels.chunk_attention(
            q,
            k,
            v,
            k_start,
            k_valid,
            q_start,
            scale=scale,
            soft_cap=soft_cap,
            window=window,
            **scales,
            **kernel_options,
        )

    return spec.with_layer_window(layer, run)


def layer_attend(spec: CacheSpec, layer, scale, soft_cap, implementation, kernel_options):
    """:func:`attend` bound to one layer's knobs: ``attend(q, k, v, k_start, k_valid,
    q_start, **scales)``."""
    return functools.partial(
        attend,
        spec=spec,
        layer=layer,
        scale=scale,
        soft_cap=soft_cap,
        implementation=implementation,
        kernel_options=kernel_options,
    )


def as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array viewed as uint16 (other arrays unchanged): the same bytes."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Undoes :func:`as_bits`."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)
