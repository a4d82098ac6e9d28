"""``prefetching_attention``: causal attention over an offloaded KV cache, layer-ahead.

One call handles one layer of one decode (or prefill-chunk) step:

1. write the new tokens' K/V back to the tier (in the background);
2. for each unit (a staging-sized chunk) of this layer's cached KV:
   start the fetch of the unit ``prefetch_depth`` ahead (the next chunk, the next layer's
   first chunk, or, from the last layer, the next step's first chunk), then wait for this
   unit (usually fetched during the previous layer's compute) and attend to it;
3. attend to the new tokens themselves and merge (online softmax).

The write-back comes first so that every later fetch of the same layer, including the
next step's prefetch, is queued after it: the engine orders overlapping transfers by
submission, so no fetch can see a cache without its newest tokens. Every wait checks that
its unit's fetch is exactly the one needed (same tier bytes, same staging slot) and fetches
it itself otherwise, so a skipped layer or a changed state costs time, never correctness.

A resident cache (``spec.resident``: the state's staging holds every layer's KV) keeps
step 1 as it is, writes the new rows into its device copy too, and replaces step 2 by
attention over that copy: no fetch at all (see :func:`_resident_layer`). A host tier read
in place (``spec.reads_in_place``, the CPU backend's default) replaces each unit's fetch,
wait and attention of step 2 by one call that attends to the unit's rows where the pool
holds them (see :mod:`jax_tpusync.in_place`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tpusync import backend, blocks, in_place, ops, quantize
from jax_tpusync.backend import attends_in_blocks
from jax_tpusync.state import (
    INT32_MAX,
    NO_WINDOW,
    CacheSpec,
    KVState,
    dtype_error,
    exact_cast_allowed,
)
from jax_tpusync.kernels import reference as kernel_reference
from jax_tpusync.step import sharded

IMPLEMENTATIONS = ("xla", "pallas")


# -- unit planning (all jnp, so the layer index may be traced) -------------------------------


def _window_of(spec: CacheSpec, layer) -> jax.Array:
    if isinstance(layer, int):
        w = spec.windows[layer]
        return jnp.int32(NO_WINDOW if w is None else w)
    return spec.windows_array()[layer]


def _layer_start(spec: CacheSpec, layer, lengths: jax.Array) -> jax.Array:
    """int32[batch]: first cached position a layer reads (0, or the window's start)."""
    window = _window_of(spec, layer)
    return jnp.where(window >= NO_WINDOW, 0, jnp.maximum(lengths - window + 1, 0))


def _num_units(spec: CacheSpec, layer, lengths: jax.Array) -> jax.Array:
    """int32[]: units a layer takes (at least 1, possibly empty)."""
    span = jnp.max(lengths - _layer_start(spec, layer, lengths))
    return jnp.maximum(1, (span + spec.chunk_len - 1) // spec.chunk_len)


def _unit_range(spec: CacheSpec, layer, chunk, lengths) -> tuple[jax.Array, jax.Array]:
    """(first position int32[batch], valid tokens int32[batch]) of unit (layer, chunk)."""
    lo = _layer_start(spec, layer, lengths) + chunk * spec.chunk_len
    return lo, jnp.clip(lengths - lo, 0, spec.chunk_len)


def _segments(
    spec: CacheSpec,
    state: KVState,
    layer,
    lo: jax.Array,  # int32[batch]: first position
    count: jax.Array,  # int32[batch]: positions (0: none)
    mem_base: jax.Array,  # int32[2, batch]: memory offset of position lo, K and V
    max_positions: int,  # static bound on count
    level: int = 0,  # two-level caches: 0 the DRAM tier, 1 the spill tier
    fetch: bool = False,
) -> jax.Array:  # int32[2 * batch * blocks touched, 4]
    """Segments of positions ``[lo, lo + count)`` of every slot of ``layer``, through the
    state's block table; only active slots move bytes. A two-level cache's segments are
    ``level``'s tier's (see :func:`blocks.block_segments`)."""
    count = jnp.where(state.capacity > 0, count, 0)
    per_region = (spec.num_blocks, spec.spill_blocks)[level]
    region = (jnp.asarray(layer, jnp.int32) * 2 + jnp.arange(2, dtype=jnp.int32)) * per_region
    return blocks.block_segments(
        state.block_table,
        region,
        lo,
        count,
        mem_base,
        block_tokens=spec.block_tokens,
        row_bytes=spec.row_bytes,
        max_positions=max_positions,
        levels=spec.levels,
        level=level,
        fetch=fetch,
    )


def _fetch_segments(
    spec: CacheSpec, state: KVState, layer, lo, count, slot, level: int = 0
) -> jax.Array:
    """Segments of a unit landing in staging slot ``slot`` ([2, batch, chunk_len] rows),
    from ``level``'s tier."""
    b = jnp.arange(spec.batch, dtype=jnp.int32)
    kv = jnp.arange(2, dtype=jnp.int32)[:, None]
    mem = ((slot * 2 + kv) * spec.batch + b) * (spec.chunk_len * spec.row_bytes)
    return _segments(spec, state, layer, lo, count, mem, spec.chunk_len, level, fetch=True)


def _fetch_levels(spec: CacheSpec, state: KVState) -> list[tuple[jax.Array, jax.Array, Any]]:
    """(tier, first block, regions) of every tier a unit is fetched from: the cache's, and
    a two-level cache's spill tier (see :mod:`jax_tpusync.spill`)."""
    levels = [(state.target[1], state.target[2], spec.regions)]
    if spec.spill_blocks:
        levels.append((state.target[4], state.target[5], spec.spill_regions))
    return levels


def _write_segments(spec: CacheSpec, state: KVState, layer, q_len: int) -> jax.Array:
    """Segments writing [2, batch, q_len, H, D] new rows at each active slot's length."""
    b = jnp.arange(spec.batch, dtype=jnp.int32)
    kv = jnp.arange(2, dtype=jnp.int32)[:, None]
    mem = (kv * spec.batch + b) * (q_len * spec.row_bytes)
    count = jnp.full((spec.batch,), q_len, jnp.int32)
    return _segments(spec, state, layer, state.lengths, count, mem, q_len)


def _units_per_layer(spec: CacheSpec, lengths: jax.Array) -> jax.Array:
    """int32[num_layers]: :func:`_num_units` of every layer at ``lengths``, at once."""
    windows = spec.windows_array()[:, None]  # [num_layers, 1]
    start = jnp.where(windows >= NO_WINDOW, 0, jnp.maximum(lengths[None, :] - windows + 1, 0))
    span = jnp.max(lengths[None, :] - start, axis=1)
    return jnp.maximum(1, (span + spec.chunk_len - 1) // spec.chunk_len)


def _locate(units: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(layer, chunk) of unit ``index`` in the layer-major order of ``units`` per layer.

    ``index`` must be below ``sum(units)``; layers with 0 units are passed over.
    """
    ends = jnp.cumsum(units)  # Exclusive end of each layer's units.
    layer = jnp.sum(ends <= index).astype(jnp.int32)
    chunk = index - (ends[layer] - units[layer])
    return layer, chunk.astype(jnp.int32)


def _refuse_bad_layer(spec: CacheSpec, layer: jax.Array, segments: jax.Array) -> jax.Array:
    """``segments`` of a traced ``layer``, pointed past every region if it is out of range.

    A traced layer cannot be checked at trace time. Block ``2**31 - 1`` (which the cache's
    layout keeps past its last block) with offset 0 lies beyond the cache's regions, so the
    engine refuses the call naming it ("addresses region R of N (layer out of range?)")
    before anything is queued, where a negative layer's own segments would only say
    "negative field" and a layer past the end could address another cache's bytes.
    """
    bad = (layer < 0) | (layer >= spec.num_layers)
    block = jnp.where(bad, INT32_MAX, segments[:, 0])
    offset = jnp.where(bad, 0, segments[:, 1])
    return segments.at[:, 0].set(block).at[:, 1].set(offset)


def _advance(spec: CacheSpec, layer, chunk, lengths, grow: jax.Array):
    """The unit ``prefetch_depth`` after (layer, chunk): (layer, chunk, lengths, ok).

    Past the last layer the walk enters the next step, whose lengths are ``lengths + grow``
    (``grow``: int32[batch], q_len for active slots, 0 for inactive ones)
    (and keeps them if it wraps again: a depth above the units of a step). ``ok`` is False
    where prefetching that unit could read bytes this step has not written yet (a
    next-step unit of a layer after the current one: only with tiny models) or where
    cross-step prefetch is off.

    Computed in closed form from the units of every layer (no trace-time loop over the
    depth, whose unrolling made compile time grow with it): a step of the walk from the
    last unit of a layer (or from a chunk past it) goes to the next layer's first unit.
    """
    depth = spec.prefetch_depth
    cur_layer = jnp.asarray(layer, jnp.int32)
    c = jnp.asarray(chunk, jnp.int32)
    next_lengths = lengths + grow
    units = _units_per_layer(spec, lengths)  # This step.
    next_units = _units_per_layer(spec, next_lengths)  # The next one.
    here = units[cur_layer]
    # Steps from (layer, chunk) to the next layer's first unit.
    to_next_layer = jnp.maximum(here - c, 1)
    # Past it: the units of this step's later layers, then the next steps' (cyclically).
    rest = depth - to_next_layer
    later = jnp.where(jnp.arange(spec.num_layers) > cur_layer, units, 0)
    in_this_step = rest < jnp.sum(later)
    this_l, this_c = _locate(later, jnp.clip(rest, 0, jnp.sum(later) - 1))
    wrapped = jnp.maximum(rest - jnp.sum(later), 0) % jnp.sum(next_units)
    next_l, next_c = _locate(next_units, wrapped)

    same_layer = depth < to_next_layer
    next_step = ~same_layer & ~in_this_step
    l = jnp.where(same_layer, cur_layer, jnp.where(in_this_step, this_l, next_l))
    c = jnp.where(same_layer, c + depth, jnp.where(in_this_step, this_c, next_c))
    lens = jnp.where(next_step, next_lengths, lengths)
    ok = ~next_step | (l <= cur_layer)
    if not spec.prefetch_across_steps:
        ok = ~next_step
    return l, c, lens, ok


# -- attention over one unit -----------------------------------------------------------------


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
    return _from_bits(block[0, 0], kv_dtype), _from_bits(block[0, 1], kv_dtype)


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
    return _rows_as_kv(spec, *staged_rows(staging, slot, start, n, staging.dtype))


def _rows_as_kv(
    spec: CacheSpec,
    k_rows: jax.Array,  # [batch, n, *row_shape] in spec.staging_dtype
    v_rows: jax.Array,  # [batch, n, *row_shape] in spec.staging_dtype
) -> dict[str, jax.Array]:
    """Staged rows as :func:`_attend`'s ``k``/``v`` (and scales): values in the cache's
    dtype, or the codes and f32[batch, n, H] scales of quantized rows."""
    if not spec.quantized:
        return dict(k=_from_bits(k_rows, spec.dtype), v=_from_bits(v_rows, spec.dtype))
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


def _attend(
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


def _layer_attend(spec: CacheSpec, layer, scale, soft_cap, implementation, kernel_options):
    """:func:`_attend` bound to one layer's knobs: ``attend(q, k, v, k_start, k_valid,
    q_start, **scales)``."""
    return functools.partial(
        _attend,
        spec=spec,
        layer=layer,
        scale=scale,
        soft_cap=soft_cap,
        implementation=implementation,
        kernel_options=kernel_options,
    )


# -- the write-back (both modes) --------------------------------------------------------------


def _tag(layer, chunk) -> jax.Array:
    return jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(chunk, jnp.int32)])


def _write_back(
    spec: CacheSpec,
    state: KVState,
    layer,
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    shard_guard: jax.Array | None = None,  # int32[1, 4], leading the guards of a mesh shard
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queues the new tokens' write-back at each active slot's length; returns ``(token,
    new_kv, grow)``: the op's token, the rows written ([2, batch, q_len, H, D] in the
    cache's dtype, or uint8[2, batch, q_len, row_bytes] quantized) and int32[batch], the
    tokens each slot takes this step (q_len active, 0 inactive)."""
    eid, tier, first_block = state.target[0], state.target[1], state.target[2]
    q_len = k.shape[1]
    lengths = state.lengths
    grow = jnp.where(state.capacity > 0, q_len, 0).astype(jnp.int32)
    # Layer 0's write-back is the step's first engine op (every other op depends on it):
    # it claims the state's step, so a second step from the same state is refused.
    claim = jnp.concatenate([state.owner, jnp.asarray(layer == 0, jnp.int32)[None]])

    write_segments = _write_segments(spec, state, layer, q_len)
    if not isinstance(layer, int):
        # The first engine call of the layer refuses an out-of-range traced layer.
        write_segments = _refuse_bad_layer(spec, layer, write_segments)
    # Capacity guards first (see ops.CAPACITY_GUARD): the write-back refuses the whole step,
    # before any byte moves, if a slot would pass its capacity, naming it, instead of
    # writing into whatever block lies next to its last one.
    guards = [ops.capacity_guards(lengths, grow, state.capacity)]
    if shard_guard is not None:  # First of all: the state must be this device's shard.
        guards.insert(0, shard_guard)
    write_segments = jnp.concatenate([*guards, write_segments])
    new_kv = jnp.stack([k, v]).astype(spec.dtype)  # [2, batch, q_len, H, D]
    if spec.quantized:
        # Quantized here, fused into the step; the tokens themselves attend in full
        # precision.
        new_kv = quantize.quantize(new_kv, spec.tier_dtype)  # uint8[2, batch, q_len, row_bytes]
    token = ops.write_back(
        eid,
        tier,
        new_kv,
        write_segments,
        _tag(layer, -1),
        deps=(state.token,),
        regions=spec.regions,
        owner=claim,
        first_block=first_block,
    )
    return token, new_kv, grow


# -- the public op ---------------------------------------------------------------------------


def prefetching_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState,
    *,
    layer: int | jax.Array,
    implementation: str | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, KVState]:
    """Causal attention of ``q`` over the offloaded cache plus the new tokens.

    Appends ``k``/``v`` at each sequence's current length (writing them back to the tier),
    attends over positions ``[0, length + q_len)`` (or the layer's sliding window), and
    starts fetching the KV the next call will need while this one computes. On a resident
    cache (``OffloadedKVCache(resident=True)``) it fetches nothing: it attends over the
    state's device copy of the KV, which it updates alongside the write-back. On a host
    tier read in place (``read_in_place``, the CPU backend's default) it fetches nothing
    either: each unit is attended to where the host pool holds it.

    Call it once per layer, layers in order 0..num_layers-1, every step; from a Python loop
    inside ``jit`` (``layer`` an int) or from ``lax.scan`` over stacked weights (``layer``
    traced). Donate the state into the jitted step (``donate_argnums``): the waits write
    its staging buffers in place (without donation XLA copies them every step). Use only
    the state the last call returned: the engine refuses a superseded one.

    Args:
      q: queries, after RoPE.
      k: the new tokens' keys, after RoPE (stored as given), in the cache's dtype or one
        that converts to it exactly (see :meth:`OffloadedKVCache.load`: bfloat16 or
        float16 into a float32 cache); float32 into a 16-bit cache is refused at trace
        time, cast it with ``.astype(...)``.
      v: the new tokens' values, same rule.
      state: the cache state from :meth:`OffloadedKVCache.init` or the previous call.
      layer: the layer index, in ``[0, num_layers)``. A traced layer out of range fails
        when the step runs (the engine refuses its write-back: "layer out of range?").
      implementation: ``"xla"`` (plain jnp; default on CPU) or ``"pallas"`` (the decode
        kernel; default on GPU/TPU; TPU interpret mode on CPU).
      scale: softmax scale; default ``1 / sqrt(head_dim)`` (a model that pre-scales q
        passes 1.0).
      soft_cap: logits soft cap (``cap * tanh(logits / cap)``), or None.
      block_kv: Pallas KV block size (default: tuned per device).
      interpret: Pallas interpret mode (default: on when the backend is CPU).

    A mesh cache (``OffloadedKVCache(mesh=...)``) takes the global ``q``/``k``/``v``
    (sharded or not: they are resharded as the cache's mesh says) and runs each shard's
    attention on its own device inside ``shard_map``; called inside the caller's own
    ``shard_map`` over the cache's axes it takes each device's share (see
    :mod:`jax_tpusync.mesh`).

    Returns:
      ``(out, state)``: ``out`` shaped and typed like ``q``; the updated state (lengths grow
      by ``q_len`` after the last layer).
    """
    spec = state.spec if isinstance(state, KVState) else None
    if spec is None:
        raise TypeError(
            f"state must be a KVState (from OffloadedKVCache.init()), got {type(state).__name__}"
        )
    options = dict(
        layer=layer,
        implementation=implementation,
        scale=scale,
        soft_cap=soft_cap,
        block_kv=block_kv,
        interpret=interpret,
    )
    if spec.mesh is not None:
        return sharded.sharded_attention(q, k, v, state, **options)
    sharded.refuse_unsharded_cache(q, k, v)
    return shard_attention(q, k, v, state, **options)


def shard_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState,
    *,
    layer: int | jax.Array,
    implementation: str | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
    shard_guard: jax.Array | None = None,  # int32[1, 4]: ops.shard_guard() of a mesh shard
) -> tuple[jax.Array, KVState]:
    """:func:`prefetching_attention` of one device's cache (or one shard of a mesh cache,
    whose write-backs lead with ``shard_guard``)."""
    spec = state.spec
    _validate(q, k, v, spec, layer)
    if implementation is None:
        implementation = backend.default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    if scale is None:
        scale = 1.0 / math.sqrt(spec.head_dim)
    kernel_options = {}
    if implementation == "pallas":
        kernel_options = backend.pallas_options(block_kv, interpret)
    if spec.reads_in_place and implementation != "xla":
        raise ValueError(
            f"implementation={implementation!r} attends over staging units, and this cache "
            f"reads its host tier in place (read_in_place='auto' on the CPU backend), so its "
            f"state has no staging: make it with read_in_place=False"
        )
    if isinstance(layer, np.integer):
        layer = int(layer)
    if not isinstance(layer, int):
        layer = jnp.asarray(layer, jnp.int32)

    eid = state.target[0]
    batch, q_len = q.shape[:2]
    lengths = state.lengths
    owner = jnp.concatenate([state.owner, jnp.zeros((1,), jnp.int32)])

    # 1. New tokens go out first: later fetches of this layer are queued behind them.
    token, new_kv, grow = _write_back(spec, state, layer, k, v, shard_guard)
    if spec.resident:
        return _resident_layer(
            q,
            k,
            v,
            state,
            new_kv,
            token,
            grow,
            layer=layer,
            implementation=implementation,
            scale=scale,
            soft_cap=soft_cap,
            kernel_options=kernel_options,
        )

    num_units = _num_units(spec, layer, lengths)
    attend = _layer_attend(spec, layer, scale, soft_cap, implementation, kernel_options)

    block_len = staged_block_len(spec) if implementation == "xla" else spec.chunk_len

    levels = _fetch_levels(spec, state)

    def unit_in_place(chunk, carry):
        # The unit's rows where the host tier holds them (jax_tpusync.in_place): no fetch,
        # no staging, so nothing to prefetch either.
        q_, out, lse, staging, tickets, slot = carry
        lo, count = _unit_range(spec, layer, chunk, lengths)
        o, l = in_place.attend_unit(
            spec,
            state,
            layer,
            q_,
            _fetch_segments(spec, state, layer, lo, count, 0),
            lo,
            count,
            tag=_tag(layer, chunk),
            deps=(token, k, v, out),
            owner=owner,
            scale=scale,
            soft_cap=soft_cap,
        )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        return q_, out, lse, staging, tickets, slot

    def unit_step(chunk, carry):
        q_, out, lse, staging, tickets, slot = carry
        # Start the unit `prefetch_depth` ahead into the slot consumed last (free now:
        # `out` depends on its contents having been read). A two-level cache fetches
        # each unit from both tiers, into the same slot (ticket level * num_slots + slot).
        p_layer, p_chunk, p_lens, ok = _advance(spec, layer, chunk, lengths, grow)
        p_slot = (slot + spec.prefetch_depth) % spec.num_slots
        p_lo, p_count = _unit_range(spec, p_layer, p_chunk, p_lens)
        p_count = jnp.where(ok, p_count, 0)
        lo, count = _unit_range(spec, layer, chunk, lengths)
        for level, (tier, first_block, regions) in enumerate(levels):
            q_, p_ticket = ops.start_fetch(
                eid,
                tier,
                q_,
                _fetch_segments(spec, state, p_layer, p_lo, p_count, p_slot, level),
                _tag(p_layer, p_chunk),
                dst_bytes=spec.device_bytes,
                deps=(token, out),
                regions=regions,
                retire=tickets[level * spec.num_slots + p_slot],
                owner=owner,
                first_block=first_block,
            )
            # Wait for this unit; q_ carries the previous layer's compute, `out` the last
            # chunk's.
            staging = ops.wait_fetch(
                eid,
                tier,
                staging,
                tickets[level * spec.num_slots + slot],
                _fetch_segments(spec, state, layer, lo, count, slot, level),
                _tag(layer, chunk),
                deps=(q_, k, v, out),
                regions=regions,
                owner=owner,
                first_block=first_block,
            )
            at = level * spec.num_slots
            tickets = tickets.at[at + slot].set(ops.NO_TICKET).at[at + p_slot].set(p_ticket)
        o, l = attend_valid_rows(
            lambda start, n, valid: attend(
                q_,
                k_start=lo + start,
                k_valid=valid,
                q_start=lengths,
                **staged_unit_rows(spec, staging, slot, start, n),
            ),
            count,
            spec.chunk_len,
            block_len,
            q.shape,
        )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        return q_, out, lse, staging, tickets, (slot + 1) % spec.num_slots

    out0 = jnp.zeros(q.shape, jnp.float32)
    lse0 = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    carry = (q, out0, lse0, state.staging, state.tickets, state.slot)
    if spec.reads_in_place:
        unit_step = unit_in_place
    if spec.single_unit:
        carry = unit_step(jnp.int32(0), carry)
    else:
        carry = lax.fori_loop(0, num_units, unit_step, carry)
    q_, out, lse, staging, tickets, slot = carry

    # 3. The new tokens attend to themselves (causally) and merge in.
    new_start = lengths
    o, l = attend(
        q_,
        k.astype(spec.dtype),
        v.astype(spec.dtype),
        new_start,
        jnp.full((batch,), q_len, jnp.int32),
        lengths,
    )
    out, _ = kernel_reference.merge_partials(out, lse, o, l)

    new_lengths = jnp.where(layer == spec.num_layers - 1, lengths + grow, lengths)
    state = state.replace(
        lengths=new_lengths,
        staging=staging,
        tickets=tickets,
        slot=slot,
        token=token,
        # Past the last layer the state is the next step's.
        owner=state.owner.at[2].add(jnp.asarray(layer == spec.num_layers - 1, jnp.int32)),
    )
    return out.astype(q.dtype), state


# -- resident mode ---------------------------------------------------------------------------


def _resident_layer(
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
) -> tuple[jax.Array, KVState]:
    """One layer of a step on a resident cache (``spec.resident``), its write-back queued.

    The new rows go into the state's copy of the layer at each active slot's length (the
    same rows the tier gets), then ``q`` attends over the copy's rows of the layer (its
    window) and the new tokens, in the operations of :func:`resident_attention` with
    ``unit_len=None``. No fetch: the copy is the tier's rows (see ``OffloadedKVCache``).
    """
    spec = state.spec
    batch, q_len = q.shape[:2]
    lengths = state.lengths
    staging = _resident_insert(spec, state.staging, layer, new_kv, lengths, state.capacity > 0)
    attend = _layer_attend(spec, layer, scale, soft_cap, implementation, kernel_options)
    # The layer's rows as one unit: its own span when the layer is static; a traced layer
    # reads up to the longest (spec.chunk_len), its blocks bounded by the valid rows.
    span = spec.layer_span(spec.windows[layer]) if isinstance(layer, int) else spec.chunk_len
    lo = _layer_start(spec, layer, lengths)
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
    # The new tokens attend to themselves (causally) and merge in.
    o, l = attend(
        q,
        k.astype(spec.dtype),
        v.astype(spec.dtype),
        lengths,
        jnp.full((batch,), q_len, jnp.int32),
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
) -> jax.Array:  # like staging
    """``staging`` with ``new_kv`` at rows ``[lengths[b], lengths[b] + q_len)`` of ``layer``
    for each active slot; an inactive slot's rows are left as they are."""
    q_len = new_kv.shape[2]
    rows = new_kv
    if rows.dtype != staging.dtype:  # 16-bit KV staged as its uint16 words.
        rows = lax.bitcast_convert_type(rows, staging.dtype)
    # Inactive slots point past max_len, where the scatter drops them.
    at = lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)  # [batch, q_len]
    at = jnp.where(active[:, None], at, spec.max_len)
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
    """:func:`_rows_as_kv` of positions ``[start[b], start[b] + n)`` of ``layer``."""
    if whole_context:
        # One start for every slot: a slice, as staging is read in the streaming path.
        zero = jnp.int32(0)
        index = (jnp.asarray(layer, jnp.int32), zero, zero, start[0])
        index += (zero,) * (staging.ndim - 4)
        block = lax.dynamic_slice(staging, index, (1, 2, spec.batch, n, *staging.shape[4:]))
        return _rows_as_kv(spec, block[0, 0], block[0, 1])
    at = jnp.clip(start[:, None] + jnp.arange(n, dtype=jnp.int32), 0, spec.max_len - 1)
    b = jnp.arange(spec.batch, dtype=jnp.int32)[:, None]
    return _rows_as_kv(spec, staging[layer, 0, b, at], staging[layer, 1, b, at])


def _validate(q, k, v, spec: CacheSpec, layer) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(
                f"{name} must be rank 4 [batch, q_len, heads, head_dim]; got shape {jnp.shape(x)}"
            )
        if jnp.dtype(x.dtype) not in (
            jnp.dtype(jnp.bfloat16),
            jnp.dtype(jnp.float32),
            jnp.dtype(jnp.float16),
        ):
            raise ValueError(f"{name}.dtype must be bfloat16, float16 or float32; got {x.dtype}")
    b, t, hq, d = q.shape
    want_kv = (spec.batch, t, spec.num_kv_heads, spec.head_dim)
    if b != spec.batch:
        raise ValueError(f"q has batch={b} but the cache was made for batch={spec.batch}")
    if d != spec.head_dim:
        raise ValueError(f"q has head_dim={d} but the cache has head_dim={spec.head_dim}")
    for name, x in (("k", k), ("v", v)):
        # Checked on dtypes at trace time: a rounding cast into the cache is the caller's.
        if not exact_cast_allowed(x.dtype, spec.dtype):
            raise ValueError(dtype_error(name, x.dtype, spec.dtype))
        if tuple(x.shape) != want_kv:
            raise ValueError(
                f"{name} must be [batch, q_len, num_kv_heads, head_dim] = "
                f"{list(want_kv)}; got {list(x.shape)}"
            )
    if hq % spec.num_kv_heads:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={spec.num_kv_heads}")
    if t > spec.max_len:
        raise ValueError(f"q_len={t} exceeds max_len={spec.max_len}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < spec.num_layers:
            raise ValueError(
                f"layer={layer} is out of range for a cache of {spec.num_layers} layers"
            )
    elif jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an int or an integer scalar; got {layer!r}")


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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same attention as :func:`prefetching_attention` over a device-resident cache.

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
        would otherwise overwrite the cache's last rows).
      kv_dtype: The dtype the caches hold; required for ``uint16`` caches, else it must be
        theirs (default).

    Returns:
      ``(out, cache_k, cache_v)``: ``out`` like ``q``; the caches, in the form given, with
      ``k``/``v`` written at ``lengths`` (the caller advances ``lengths`` once per step).
    """
    kv_dtype = _resident_kv_dtype(cache_k, cache_v, kv_dtype)
    batch, q_len, _, head_dim = q.shape
    max_len = cache_k.shape[1]
    _check_room(lengths, q_len, max_len)
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
    insert = jax.vmap(lambda c, x, at: lax.dynamic_update_slice_in_dim(c, x, at, axis=0))
    words_k = insert(_as_bits(cache_k), _as_bits(k), lengths)
    words_v = insert(_as_bits(cache_v), _as_bits(v), lengths)

    block_len = block_len_for(unit, batch * cache_k.shape[2] * head_dim)

    def unit_step(chunk, carry):
        out, lse, words_k, words_v = carry
        lo = layer_start + chunk * unit
        count = jnp.clip(lengths - lo, 0, unit)

        def rows(start, n):
            at = jnp.clip(lo[:, None] + start + jnp.arange(n, dtype=jnp.int32), 0, max_len - 1)
            k_rows = jnp.take_along_axis(words_k, at[:, :, None, None], axis=1)
            v_rows = jnp.take_along_axis(words_v, at[:, :, None, None], axis=1)
            return _from_bits(k_rows, kv_dtype), _from_bits(v_rows, kv_dtype)

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
    o, l = attend(q, k, v, lengths, jnp.full((batch,), q_len, jnp.int32), lengths)
    out, _ = kernel_reference.merge_partials(out, lse, o, l)
    # Back in the form given: a no-op for words.
    return (
        out.astype(q.dtype),
        _from_bits(words_k, cache_k.dtype),
        _from_bits(words_v, cache_v.dtype),
    )


def _check_room(lengths, q_len: int, max_len: int) -> None:
    """Refuses concrete ``lengths`` that leave no room for the new tokens.

    Traced lengths cannot be checked here; past the end, the update would land on the last
    rows (XLA clamps its start) and overwrite cached tokens.
    """
    try:
        longest = int(np.max(np.asarray(lengths)))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if longest + q_len > max_len:
        raise ValueError(
            f"lengths + q_len = {longest + q_len} exceeds max_len={max_len}: no room in the "
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


def _as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array viewed as uint16 (other arrays unchanged): the same bytes."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_bits(x: jax.Array, dtype) -> jax.Array:
    """Undoes :func:`_as_bits`."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)
