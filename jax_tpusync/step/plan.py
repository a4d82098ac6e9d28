"""The unit walk of a step: which cached positions each unit of a layer covers, where they
lie in the tier, and which unit comes ``prefetch_depth`` after another.

A layer's cached KV (all of it, or its sliding window) is read in units of
``spec.chunk_len`` positions, layers in order, and past the last layer the walk enters the
next step. Everything here is jnp, so the layer index may be traced (``lax.scan`` over
stacked weights). A step's per-slot counts (``query_seq_lengths``: how many of its rows
each slot takes) decide its write-back segments and the lengths the walk enters the next
step at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import blocks
from jax_tpusync.core.state import INT32_MAX, NO_WINDOW, CacheSpec, KVState


@dataclasses.dataclass(frozen=True)
class Walk:
    """The block tables a layer's unit walk reads through when they are not the state's
    own: a sparse decode step's compacted tables (see :mod:`jax_tpusync.step.sparse_layer`).

    A dense walk over ``table`` with ``lengths`` reads exactly the blocks packed into it;
    attention over cached positions needs no position order (keys are stored after RoPE),
    so every path (streamed, read in place, landed) reads only those blocks, unchanged.

    Attributes:
      table: int32[batch, max_blocks]: this layer's walk (physical blocks, -1 padded).
      lengths: int32[batch]: the tokens ``table`` holds per slot.
      layer_lengths: int32[num_layers, batch]: every layer's walk lengths this step (what
        the prefetch ahead counts units by).
      next_layer_lengths: int32[num_layers, batch]: the next step's (an estimate for the
        layers after this one: a prefetch that differs is read again, never trusted).
      table_ahead: ``(layer, next_step) -> int32[batch, max_blocks]``: the table a
        prefetch of ``layer``'s units reads through (this step's or the next one's).
      late_table: int32[batch, max_blocks]: a second walk after the first (blocks the
        prediction missed, fetched late), or None.
      late_lengths: int32[batch]: its tokens per slot.
    """

    table: jax.Array
    lengths: jax.Array
    layer_lengths: jax.Array
    next_layer_lengths: jax.Array
    table_ahead: Callable[[Any, jax.Array], jax.Array]
    late_table: jax.Array | None = None
    late_lengths: jax.Array | None = None


def window_of(spec: CacheSpec, layer) -> jax.Array:
    """int32[]: ``layer``'s sliding window in tokens (``NO_WINDOW``: none)."""
    if isinstance(layer, int):
        w = spec.windows[layer]
        return jnp.int32(NO_WINDOW if w is None else w)
    return spec.windows_array()[layer]


def layer_start(spec: CacheSpec, layer, lengths: jax.Array) -> jax.Array:
    """int32[batch]: first cached position a layer reads (0, or the window's start)."""
    window = window_of(spec, layer)
    return jnp.where(window >= NO_WINDOW, 0, jnp.maximum(lengths - window + 1, 0))


def num_units(spec: CacheSpec, layer, lengths: jax.Array) -> jax.Array:
    """int32[]: units a layer takes (at least 1, possibly empty)."""
    span = jnp.max(lengths - layer_start(spec, layer, lengths))
    return jnp.maximum(1, (span + spec.chunk_len - 1) // spec.chunk_len)


def unit_range(spec: CacheSpec, layer, chunk, lengths) -> tuple[jax.Array, jax.Array]:
    """(first position int32[batch], valid tokens int32[batch]) of unit (layer, chunk)."""
    lo = layer_start(spec, layer, lengths) + chunk * spec.chunk_len
    return lo, jnp.clip(lengths - lo, 0, spec.chunk_len)


def segments(
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


def fetch_segments(
    spec: CacheSpec, state: KVState, layer, lo, count, slot, level: int = 0
) -> jax.Array:
    """Segments of a unit landing in staging slot ``slot`` ([2, batch, chunk_len] rows),
    from ``level``'s tier."""
    b = jnp.arange(spec.batch, dtype=jnp.int32)
    kv = jnp.arange(2, dtype=jnp.int32)[:, None]
    mem = ((slot * 2 + kv) * spec.batch + b) * (spec.chunk_len * spec.row_bytes)
    return segments(spec, state, layer, lo, count, mem, spec.chunk_len, level, fetch=True)


def fetch_levels(spec: CacheSpec, state: KVState) -> list[tuple[jax.Array, jax.Array, Any]]:
    """(tier, first block, regions) of every tier a unit is fetched from: the cache's, and
    a two-level cache's spill tier (see :mod:`jax_tpusync.core.spill`)."""
    levels = [(state.target[1], state.target[2], spec.regions)]
    if spec.spill_blocks:
        levels.append((state.target[4], state.target[5], spec.spill_regions))
    return levels


def check_query_seq_lengths(query_seq_lengths, batch: int, q_len: int):
    """Refuses ``query_seq_lengths`` (see :func:`~jax_tpusync.prefetching_attention`) that
    is not int[batch], or, when concrete, has a value outside ``[0, q_len]``; returns it.
    Traced values cannot be checked: the step clips them to ``[0, q_len]``."""
    if query_seq_lengths is None:
        return None
    if isinstance(query_seq_lengths, (list, tuple)):
        query_seq_lengths = np.asarray(query_seq_lengths)
    shape = jnp.shape(query_seq_lengths)
    if shape != (batch,):
        raise ValueError(
            f"query_seq_lengths must have shape (batch,) = ({batch},): the real rows of each "
            f"slot; got shape {shape}"
        )
    if not jnp.issubdtype(jnp.result_type(query_seq_lengths), jnp.integer):
        raise ValueError(
            f"query_seq_lengths must be an integer array; got {jnp.result_type(query_seq_lengths)}"
        )
    try:
        values = np.asarray(query_seq_lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return query_seq_lengths
    bad = np.flatnonzero((values < 0) | (values > q_len))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"query_seq_lengths[{b}]={int(values[b])} must be in [0, q_len={q_len}]")
    return query_seq_lengths


def real_rows(q_len: int, query_seq_lengths) -> jax.Array | None:
    """int32[batch]: a step's real rows per slot, ``query_seq_lengths`` clipped to ``[0,
    q_len]`` (None stays None: every row of every slot, the step's graph as it was before
    per-slot counts)."""
    if query_seq_lengths is None:
        return None
    return jnp.clip(jnp.asarray(query_seq_lengths, jnp.int32), 0, q_len)


def step_grow(state: KVState, q_len: int, counts: jax.Array | None) -> jax.Array:
    """int32[batch]: the tokens each slot takes this step: its real rows (``counts``, from
    :func:`real_rows`; None: ``q_len``), 0 for an inactive slot."""
    if counts is None:
        return jnp.where(state.capacity > 0, q_len, 0).astype(jnp.int32)
    return jnp.where(state.capacity > 0, counts, 0)


def own_rows(batch: int, q_len: int, counts: jax.Array | None) -> jax.Array:
    """int32[batch]: the step's own rows each slot's queries attend to (``k_valid`` of the
    attention over the step's new K/V): its real rows; padding rows are never keys."""
    return jnp.full((batch,), q_len, jnp.int32) if counts is None else counts


def write_segments(
    spec: CacheSpec, state: KVState, layer, q_len: int, counts: jax.Array | None = None
) -> jax.Array:
    """Segments writing [2, batch, q_len, H, D] new rows at each active slot's length: the
    first ``counts[b]`` rows of slot ``b`` (None: all ``q_len``); its padding rows move no
    byte."""
    b = jnp.arange(spec.batch, dtype=jnp.int32)
    kv = jnp.arange(2, dtype=jnp.int32)[:, None]
    mem = (kv * spec.batch + b) * (q_len * spec.row_bytes)
    if counts is None:
        counts = jnp.full((spec.batch,), q_len, jnp.int32)
    return segments(spec, state, layer, state.lengths, counts, mem, q_len)


def units_per_layer(spec: CacheSpec, lengths: jax.Array, align: int = 1) -> jax.Array:
    """int32[num_layers]: :func:`num_units` of every layer at ``lengths``, at once; with
    ``align``, units that start at a multiple of it (a host pool's whole blocks), which a
    window's span may need one more of. ``lengths`` is int32[batch], or int32[num_layers,
    batch]: each layer's own (a sparse step's walk lengths, see :class:`Walk`)."""
    windows = spec.windows_array()[:, None]  # [num_layers, 1]
    per_layer = lengths if lengths.ndim == 2 else lengths[None, :]
    start = jnp.where(windows >= NO_WINDOW, 0, jnp.maximum(per_layer - windows + 1, 0))
    start = start // align * align
    span = jnp.max(per_layer - start, axis=1)
    return jnp.maximum(1, (span + spec.chunk_len - 1) // spec.chunk_len)


def locate(units: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(layer, chunk) of unit ``index`` in the layer-major order of ``units`` per layer.

    ``index`` must be below ``sum(units)``; layers with 0 units are passed over.
    """
    ends = jnp.cumsum(units)  # Exclusive end of each layer's units.
    layer = jnp.sum(ends <= index).astype(jnp.int32)
    chunk = index - (ends[layer] - units[layer])
    return layer, chunk.astype(jnp.int32)


def refuse_bad_layer(spec: CacheSpec, layer: jax.Array, segments: jax.Array) -> jax.Array:
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


def advance(spec: CacheSpec, layer, chunk, lengths, grow: jax.Array, align: int = 1):
    """The unit ``prefetch_depth`` after (layer, chunk): (layer, chunk, lengths, ok), over
    units that start at a multiple of ``align`` (:func:`units_per_layer`).

    Past the last layer the walk enters the next step, whose lengths are ``lengths + grow``
    (``grow``: int32[batch], the tokens each slot takes this step: its count of real rows
    (q_len when the step has no per-slot counts) for active slots, 0 for inactive ones)
    (and keeps them if it wraps again: a depth above the units of a step). ``ok`` is False
    where prefetching that unit could read bytes this step has not written yet (a
    next-step unit of a layer after the current one: only with tiny models) or where
    cross-step prefetch is off.
    """
    next_lengths = lengths + grow
    l, c, next_step, ok = advance_over(
        spec,
        layer,
        chunk,
        units_per_layer(spec, lengths, align),  # This step.
        units_per_layer(spec, next_lengths, align),  # The next one.
    )
    return l, c, jnp.where(next_step, next_lengths, lengths), ok


def advance_over(spec: CacheSpec, layer, chunk, units: jax.Array, next_units: jax.Array):
    """:func:`advance` over given units per layer (int32[num_layers], this step's and the
    next one's): ``(layer, chunk, next_step, ok)``, ``next_step`` True where the unit is
    the next step's.

    Computed in closed form from the units of every layer (no trace-time loop over the
    depth, whose unrolling made compile time grow with it): a step of the walk from the
    last unit of a layer (or from a chunk past it) goes to the next layer's first unit.
    """
    depth = spec.prefetch_depth
    cur_layer = jnp.asarray(layer, jnp.int32)
    c = jnp.asarray(chunk, jnp.int32)
    here = units[cur_layer]
    # Steps from (layer, chunk) to the next layer's first unit.
    to_next_layer = jnp.maximum(here - c, 1)
    # Past it: the units of this step's later layers, then the next steps' (cyclically).
    rest = depth - to_next_layer
    later = jnp.where(jnp.arange(spec.num_layers) > cur_layer, units, 0)
    in_this_step = rest < jnp.sum(later)
    this_l, this_c = locate(later, jnp.clip(rest, 0, jnp.sum(later) - 1))
    wrapped = jnp.maximum(rest - jnp.sum(later), 0) % jnp.sum(next_units)
    next_l, next_c = locate(next_units, wrapped)

    same_layer = depth < to_next_layer
    next_step = ~same_layer & ~in_this_step
    l = jnp.where(same_layer, cur_layer, jnp.where(in_this_step, this_l, next_l))
    c = jnp.where(same_layer, c + depth, jnp.where(in_this_step, this_c, next_c))
    ok = ~next_step | (l <= cur_layer)
    if not spec.prefetch_across_steps:
        ok = ~next_step
    return l, c, next_step, ok


def tag(layer, chunk) -> jax.Array:
    """int32[2]: the (layer, chunk) an op names, for its checks and its errors (chunk -1:
    the write-back)."""
    return jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(chunk, jnp.int32)])
