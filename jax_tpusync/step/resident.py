"""Resident mode: the step over a device copy of the whole cache, and the device-resident
baseline (:func:`resident_attention`).

A resident cache (``spec.resident``: the state's staging holds every layer's KV) keeps the
write-back to its tier as a streamed one does, writes the new rows into its device copy
too, and replaces the units' fetches by attention over that copy (:func:`resident_layer`).
:func:`resident_attention` is the same attention over caches the caller keeps on the
device: a model's baseline without offload, and the streamed step's oracle.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.kernels import reference as kernel_reference
from jax_tpusync.step import plan
from jax_tpusync.step.unit import (
    as_bits,
    attend_valid_rows,
    block_len_for,
    from_bits,
    layer_attend,
    rows_as_kv,
)


def resident_layer(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState,
    new_kv: jax.Array,  # [2, batch, q_len, *row_shape]: the rows the write-back writes
    token: jax.Array,  # the write-back's token
    grow: jax.Array,  # int32[batch]: tokens each slot takes this step
    *,
    layer,
    implementation: str,
    scale: float,
    soft_cap: float | None,
    kernel_options: dict,
    counts: jax.Array | None = None,  # int32[batch]: real rows per slot (None: q_len)
) -> tuple[jax.Array, KVState]:
    """One layer of a step on a resident cache (``spec.resident``), its write-back queued.

    The new rows go into the state's copy of the layer at each active slot's length (the
    same rows the tier gets: a slot's first ``counts[b]``), then ``q`` attends over the
    copy's rows of the layer (its window) and the new tokens (a slot's real ones), in the
    operations of :func:`resident_attention` with ``unit_len=None``. No fetch: the copy
    is the tier's rows (see ``OffloadedKVCache``).
    """
    spec = state.spec
    batch, q_len = q.shape[:2]
    lengths = state.lengths
    staging = _resident_insert(
        spec, state.staging, layer, new_kv, lengths, state.capacity > 0, counts
    )
    attend = layer_attend(spec, layer, scale, soft_cap, implementation, kernel_options)
    # The layer's rows as one unit: its own span when the layer is static; a traced layer
    # reads up to the longest (spec.chunk_len), its blocks bounded by the valid rows.
    span = spec.layer_span(spec.windows[layer]) if isinstance(layer, int) else spec.chunk_len
    lo = plan.layer_start(spec, layer, lengths)
    count = jnp.clip(lengths - lo, 0, span)
    if implementation == "xla":
        block_len = block_len_for(span, batch * spec.num_kv_heads * spec.head_dim)
    else:
        block_len = span
    windows = [spec.windows[layer]] if isinstance(layer, int) else spec.windows
    whole_context = all(w is None for w in windows)  # Every slot reads from position 0.
    out, lse = attend_valid_rows(
        lambda start, n, valid: attend(
            q,
            k_start=lo + start,
            k_valid=valid,
            q_start=lengths,
            **_resident_rows(spec, staging, layer, lo + start, n, whole_context),
        ),
        count,
        span,
        block_len,
        q.shape,
    )
    # The new tokens attend to themselves (causally; padding rows are no keys) and merge in.
    o, l = attend(
        q,
        k.astype(spec.dtype),
        v.astype(spec.dtype),
        lengths,
        plan.own_rows(batch, q_len, counts),
        lengths,
    )
    out, _ = kernel_reference.merge_partials(out, lse, o, l)
    last = layer == spec.num_layers - 1
    state = state.replace(
        lengths=jnp.where(last, lengths + grow, lengths),
        staging=staging,
        token=token,
        owner=state.owner.at[2].add(jnp.asarray(last, jnp.int32)),
    )
    return out.astype(q.dtype), state


def _resident_insert(
    spec: CacheSpec,
    staging: jax.Array,  # [num_layers, 2, batch, max_len, *row_shape]
    layer,
    new_kv: jax.Array,  # [2, batch, q_len, *row_shape]
    lengths: jax.Array,  # int32[batch]
    active: jax.Array,  # bool[batch]
    counts: jax.Array | None = None,  # int32[batch]: real rows per slot (None: q_len)
) -> jax.Array:  # like staging
    """``staging`` with ``new_kv`` at rows ``[lengths[b], lengths[b] + q_len)`` of ``layer``
    for each active slot (its first ``counts[b]`` rows only); an inactive slot's rows, and
    the positions of padding rows, are left as they are."""
    q_len = new_kv.shape[2]
    rows = new_kv
    if rows.dtype != staging.dtype:  # 16-bit KV staged as its uint16 words.
        rows = lax.bitcast_convert_type(rows, staging.dtype)
    # Inactive slots (and padding rows) point past max_len, where the scatter drops them.
    at = lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)  # [batch, q_len]
    keep = active[:, None]
    if counts is not None:
        keep = keep & (jnp.arange(q_len, dtype=jnp.int32)[None, :] < counts[:, None])
    at = jnp.where(keep, at, spec.max_len)
    b = jnp.arange(spec.batch, dtype=jnp.int32)[:, None]
    for kv in range(2):
        staging = staging.at[layer, kv, b, at].set(rows[kv], mode="drop")
    return staging


def _resident_rows(
    spec: CacheSpec,
    staging: jax.Array,  # [num_layers, 2, batch, max_len, *row_shape]
    layer,
    start: jax.Array,  # int32[batch]: first position per slot
    n: int,  # rows to read (static)
    whole_context: bool,  # every slot reads from the same position (no window)
) -> dict[str, jax.Array]:
    """:func:`rows_as_kv` of positions ``[start[b], start[b] + n)`` of ``layer``."""
    if whole_context:
        # One start for every slot: a slice, as staging is read in the streaming path.
        zero = jnp.int32(0)
        index = (jnp.asarray(layer, jnp.int32), zero, zero, start[0])
        index += (zero,) * (staging.ndim - 4)
        block = lax.dynamic_slice(staging, index, (1, 2, spec.batch, n, *staging.shape[4:]))
        return rows_as_kv(spec, block[0, 0], block[0, 1])
    at = jnp.clip(start[:, None] + jnp.arange(n, dtype=jnp.int32), 0, spec.max_len - 1)
    b = jnp.arange(spec.batch, dtype=jnp.int32)[:, None]
    return rows_as_kv(spec, staging[layer, 0, b, at], staging[layer, 1, b, at])


def resident_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    cache_k: jax.Array,  # [batch, max_len, num_kv_heads, head_dim]
    cache_v: jax.Array,  # [batch, max_len, num_kv_heads, head_dim]
    lengths: jax.Array,  # int32[batch]
    *,
    window: int | None = None,
    unit_len: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    kv_dtype: Any = None,
    query_seq_lengths: jax.Array | None = None,  # int32[batch]: real rows per slot
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same attention as :func:`~jax_tpusync.prefetching_attention` over a device-resident cache.

    The baseline a model without offload runs, and the oracle of the offloaded path: with
    ``unit_len`` equal to the offloaded cache's ``spec.chunk_len`` it performs the same
    operations in the same order, so with ``implementation="xla"`` the two agree to float32
    rounding (the offloaded path slices its blocks out of staging, the resident one gathers
    them from the cache, and XLA may fuse the two differently; measured differences stay
    below 1e-5).

    Args:
      cache_k, cache_v: The caches, in ``kv_dtype``, or, for a 16-bit float ``kv_dtype``,
        as ``uint16`` words holding its bits (``lax.bitcast_convert_type(c, jnp.uint16)``,
        ``np_array.view(np.uint16)``). Words are the form to keep between steps on XLA's
        CPU backend: it has no 16-bit float gather or update, so a ``bfloat16`` cache is
        copied whole around them every call (measured at 32K tokens, 4 layers: about 300 ms
        per step with ``bfloat16`` caches, 70 ms with words), while words are read and
        updated in place.
      lengths: Cached tokens per batch row; ``lengths + q_len`` must not exceed
        ``max_len`` (checked when concrete; under ``jit`` the caller's duty, as the update
        would otherwise overwrite the cache's last rows). With ``query_seq_lengths``,
        ``lengths + query_seq_lengths`` must not (padding rows are dropped, never written).
      kv_dtype: The dtype the caches hold; required for ``uint16`` caches, else it must be
        theirs (default).
      query_seq_lengths: int32[batch] or None, as in
        :func:`~jax_tpusync.prefetching_attention`: how many of the ``q_len`` rows are real
        for each batch row (clipped to ``[0, q_len]``). Only those are written to the
        caches and attended to as keys; the outputs of the other rows are unspecified but
        finite. None: all of them.

    Returns:
      ``(out, cache_k, cache_v)``: ``out`` like ``q``; the caches, in the form given, with
      ``k``/``v`` written at ``lengths`` (the caller advances ``lengths`` once per step, by
      ``q_len`` or by ``query_seq_lengths``).
    """
    kv_dtype = _resident_kv_dtype(cache_k, cache_v, kv_dtype)
    batch, q_len, _, head_dim = q.shape
    max_len = cache_k.shape[1]
    counts = plan.real_rows(q_len, plan.check_query_seq_lengths(query_seq_lengths, batch, q_len))
    _check_room(lengths, q_len if counts is None else counts, max_len)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    lengths = jnp.asarray(lengths, jnp.int32)
    span = max_len if window is None else min(max_len, max(window - 1, 1))
    unit = unit_len or span
    layer_start = (
        jnp.zeros_like(lengths) if window is None else jnp.maximum(lengths - window + 1, 0)
    )
    num_units = jnp.maximum(1, (jnp.max(lengths - layer_start) + unit - 1) // unit)
    attend = functools.partial(
        kernel_reference.chunk_attention_reference, scale=scale, soft_cap=soft_cap, window=window
    )
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)

    # Rows move as raw words: no 16-bit float gather or update on XLA's CPU backend (see
    # kv_dtype). The new rows go in first and the caches ride through the loop, so the
    # update and the loop both work on the caller's (donated) buffers: updating after a
    # loop that read them made XLA copy each cache first. Rows at >= lengths are masked.
    if counts is None:
        insert = jax.vmap(lambda c, x, at: lax.dynamic_update_slice_in_dim(c, x, at, axis=0))
        words_k = insert(as_bits(cache_k), as_bits(k), lengths)
        words_v = insert(as_bits(cache_v), as_bits(v), lengths)
    else:
        # Real rows only: padding rows point past max_len, where the scatter drops them (a
        # slice update would clamp its start and shift a full row's chunk over cached keys).
        i = jnp.arange(q_len, dtype=jnp.int32)[None, :]
        at = jnp.where(i < counts[:, None], lengths[:, None] + i, max_len)
        b = jnp.arange(batch, dtype=jnp.int32)[:, None]
        words_k = as_bits(cache_k).at[b, at].set(as_bits(k), mode="drop")
        words_v = as_bits(cache_v).at[b, at].set(as_bits(v), mode="drop")

    block_len = block_len_for(unit, batch * cache_k.shape[2] * head_dim)

    def unit_step(chunk, carry):
        out, lse, words_k, words_v = carry
        lo = layer_start + chunk * unit
        count = jnp.clip(lengths - lo, 0, unit)

        def rows(start, n):
            at = jnp.clip(lo[:, None] + start + jnp.arange(n, dtype=jnp.int32), 0, max_len - 1)
            k_rows = jnp.take_along_axis(words_k, at[:, :, None, None], axis=1)
            v_rows = jnp.take_along_axis(words_v, at[:, :, None, None], axis=1)
            return from_bits(k_rows, kv_dtype), from_bits(v_rows, kv_dtype)

        o, l = attend_valid_rows(
            lambda start, n, valid: attend(q, *rows(start, n), lo + start, valid, lengths),
            count,
            unit,
            block_len,
            q.shape,
        )
        return (*kernel_reference.merge_partials(out, lse, o, l), words_k, words_v)

    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full(q.shape[:3], -jnp.inf, jnp.float32),
        words_k,
        words_v,
    )
    if unit >= span:
        carry = unit_step(jnp.int32(0), carry)
    else:
        carry = lax.fori_loop(0, num_units, unit_step, carry)
    out, lse, words_k, words_v = carry
    o, l = attend(q, k, v, lengths, plan.own_rows(batch, q_len, counts), lengths)
    out, _ = kernel_reference.merge_partials(out, lse, o, l)
    # Back in the form given: a no-op for words.
    return (
        out.astype(q.dtype),
        from_bits(words_k, cache_k.dtype),
        from_bits(words_v, cache_v.dtype),
    )


def _check_room(lengths, count, max_len: int) -> None:
    """Refuses concrete ``lengths`` that leave no room for the new tokens (``count``: q_len,
    or the real rows per batch row).

    Traced lengths cannot be checked here; past the end, the update would land on the last
    rows (XLA clamps its start) and overwrite cached tokens.
    """
    try:
        longest = int(np.max(np.asarray(lengths) + np.asarray(count)))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if longest > max_len:
        what = "q_len" if isinstance(count, int) else "query_seq_lengths"
        raise ValueError(
            f"lengths + {what} = {longest} exceeds max_len={max_len}: no room in the "
            f"cache for the new tokens"
        )


def _resident_kv_dtype(cache_k: jax.Array, cache_v: jax.Array, kv_dtype: Any) -> np.dtype:
    """The float dtype ``resident_attention``'s caches hold (see its ``kv_dtype``)."""
    if cache_k.dtype != cache_v.dtype:
        raise ValueError(
            f"cache_k and cache_v must have one dtype; got {cache_k.dtype} and {cache_v.dtype}"
        )
    stored = jnp.dtype(cache_k.dtype)
    if stored == jnp.dtype(jnp.uint16):
        if kv_dtype is None:
            raise ValueError(
                "the caches are uint16 words: pass kv_dtype (bfloat16 or float16), the "
                "dtype whose bits they hold"
            )
        kv_dtype = jnp.dtype(kv_dtype)
        if not (jnp.issubdtype(kv_dtype, jnp.floating) and kv_dtype.itemsize == 2):
            raise ValueError(
                f"uint16 caches hold a 16-bit float dtype (bfloat16 or float16); got "
                f"kv_dtype={kv_dtype}"
            )
        return kv_dtype
    if kv_dtype is not None and jnp.dtype(kv_dtype) != stored:
        raise ValueError(
            f"kv_dtype={jnp.dtype(kv_dtype)} does not match the caches' dtype {stored} "
            f"(pass uint16 words to keep 16-bit floats as raw bits)"
        )
    return stored
