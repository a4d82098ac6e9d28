"""A unit of KV attended to where it lies (a host tier) or where its fetch landed (a file
tier): no copy into the step's buffers (CPU backend).

On the CPU backend a host tier's pool and the compiled step share one memory. A fetch from
the pool can only run inside the op that needs its bytes (an XLA buffer is ours only while
an op holds it, see :mod:`jax_tpusync.runtime.ops`), so there the copy stops the compute it was
meant to overlap, and the attention then reads every copied byte back. Reading the pool
in place removes both: one custom call per unit attends to the unit's rows through the
state's block table, where the engine keeps them (``engine/pool_attention.cc``, f32
arithmetic with the same masks as :func:`~jax_tpusync.kernels.reference.chunk_attention_reference`).

Ordering is a fetch's: the call is registered with the engine's scoreboard as a read of
those tier bytes, so it starts after every earlier write-back of them (a failed one fails
it) and later writes wait for it. Nothing lands in staging, so nothing is prefetched.

A file tier's unit (``spec.attends_landed``) is read where its fetch *landed*: the step
still starts each unit's fetch ``prefetch_depth`` units ahead, into the engine's landing
memory, and :func:`unit` with a ticket is one custom call that waits for the unit's ticket,
compares the fetch with the one it needs (a different, failed or missing fetch is read
again, never trusted) and attends over the landing buffer, which the engine holds until
the attention ends. No XLA buffer but the call's own outputs is written. A two-level
cache's unit is attended over both tiers in one call: its DRAM rows where they lie, its
spill file's rows where their fetch landed.

It applies to rows of bfloat16 or float32 values, or a quantized tier's int8 or
float8_e4m3fn codes with their scales (applied inside the kernel; not float16 values),
streamed (not resident), on the CPU backend (:func:`jax_tpusync.core.layout.in_place_blocker`
says why not elsewhere); anywhere else units go through staging. Such a cache's state
holds no staging at all, so it takes the plain-XLA attention only (the Pallas kernels read
units from staging). The step only follows ``spec.reads_in_place`` and
``spec.attends_landed``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.runtime import ops
from jax_tpusync.step import plan


def unit(
    spec: CacheSpec,
    state: KVState,
    layer,
    chunk,  # int or int32[]: the unit of the layer
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    ticket: jax.Array | None = None,  # int32[]: the unit's fetch ahead (a file tier's)
    *,
    deps,
    owner: jax.Array,
    scale: float,
    soft_cap: float | None,
    counts: jax.Array | None = None,  # int32[batch]: real query rows per slot (None: q_len)
) -> tuple[jax.Array, jax.Array]:  # out f32[batch, q_len, num_q_heads, head_dim], lse f32[...]
    """``(out, lse)`` of ``q`` over unit ``(layer, chunk)`` of this step: its range, its
    segments (as a fetch into staging slot 0 would move them) and :func:`attend_unit`.
    Only slot ``b``'s first ``counts[b]`` query rows attend (the rest are padding).

    Without ``ticket`` the rows are read where a memory tier holds them. With it (a file
    tier, or a two-level cache's spill tier) they are attended where that fetch, started
    ahead with these segments and :func:`landed_bytes`, landed in the engine's memory; a
    fetch that is not this unit's is read again, never trusted."""
    lo, count = plan.unit_range(spec, layer, chunk, state.lengths)
    spill = None
    if ticket is not None and spec.spill_blocks:  # The fetch ahead was the spill tier's.
        spill = plan.fetch_segments(spec, state, layer, lo, count, 0, level=1)
    return attend_unit(
        spec,
        state,
        layer,
        q,
        plan.fetch_segments(spec, state, layer, lo, count, 0),
        lo,
        count,
        tag=plan.tag(layer, chunk),
        deps=deps,
        owner=owner,
        scale=scale,
        soft_cap=soft_cap,
        ticket=ticket,
        spill_segments=spill,
        counts=counts,
    )


def landed_bytes(spec: CacheSpec) -> int:
    """Bytes of the one staging slot that a landed unit's segments address (never
    allocated: the fetch lands in the engine's memory): ``start_fetch``'s ``dst_bytes``."""
    return 2 * spec.batch * spec.chunk_len * spec.row_bytes


def attend_unit(
    spec: CacheSpec,
    state: KVState,
    layer,
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    segments: jax.Array,  # int32[n, 4]: the unit's fetch segments into staging slot 0
    lo: jax.Array,  # int32[batch]: the unit's first position
    count: jax.Array,  # int32[batch]: its cached tokens per slot
    *,
    tag: jax.Array,
    deps,
    owner: jax.Array,
    scale: float,
    soft_cap: float | None,
    ticket: jax.Array | None = None,  # int32[]: the unit's fetch ahead (a file tier's)
    spill_segments: jax.Array | None = None,  # int32[m, 4]: a two-level cache's spill rows
    counts: jax.Array | None = None,  # int32[batch]: real query rows per slot (None: q_len)
) -> tuple[jax.Array, jax.Array]:  # out f32[batch, q_len, num_q_heads, head_dim], lse f32[...]
    """``(out, lse)`` of ``q`` over one unit's cached rows, read where the tier holds them
    (or, with ``ticket``, where that fetch of ``segments`` landed in the engine's memory;
    with ``spill_segments`` too, ``segments`` where the memory tier holds them and
    ``spill_segments`` where ``ticket``, the spill tier's fetch, landed): what
    ``wait_fetch`` of ``segments`` and the attention over the staged unit compute, for
    the real rows (``counts``); padding rows cost nothing (out 0, lse -inf)."""
    # An inactive slot's segments move no bytes (see plan.segments): nor may it attend.
    valid = jnp.where(state.capacity > 0, count, 0).astype(jnp.int32)
    rows = [lo, valid, state.lengths]
    if counts is not None:
        rows.append(counts)
    positions = jnp.stack(rows).astype(jnp.int32)
    q = q.astype(jnp.float32)
    eid, tier = state.target[0], state.target[1]
    rows = (segments,)
    if spill_segments is not None:
        op = functools.partial(
            ops.attend_spilled,
            eid,
            tier,
            q,
            ticket,
            spill_tier=state.target[4],
            spill_first_block=state.target[5],
            spill_regions=spec.spill_regions,
        )
        rows = (segments, spill_segments)
    elif ticket is None:
        op = functools.partial(ops.attend_in_place, eid, tier, q)
    else:
        op = functools.partial(ops.attend_landed, eid, tier, q, ticket)
    call = functools.partial(
        op,
        *rows,
        positions,
        tag,
        unit_len=spec.chunk_len,
        kv_dtype=spec.dtype,
        tier_dtype=spec.tier_dtype,
        num_kv_heads=spec.num_kv_heads,
        scale=scale,
        soft_cap=soft_cap,
        deps=deps,
        regions=spec.regions,
        owner=owner,
        first_block=state.target[2],
    )
    return spec.with_layer_window(layer, lambda window: call(window=window))
