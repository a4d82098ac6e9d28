"""The streamed step: one layer's write-back, then its cached KV unit by unit, each unit
fetched into staging ``prefetch_depth`` units ahead of its attention.

1. :func:`write_back` queues the new tokens' K/V to the tier (in the background);
2. for each unit (a staging-sized chunk) of this layer's cached KV, :func:`streamed_layer`
   starts the fetch of the unit ``prefetch_depth`` ahead (the next chunk, the next layer's
   first chunk, or, from the last layer, the next step's first chunk; see
   :func:`~jax_tpusync.step.plan.advance`), then waits for this unit (usually fetched
   during the previous layer's compute) and attends to it;
3. the new tokens attend to themselves and merge in (online softmax).

The write-back comes first so that every later fetch of the same layer, including the
next step's prefetch, is queued after it: the engine orders overlapping transfers by
submission, so no fetch can see a cache without its newest tokens. Every wait checks that
its unit's fetch is exactly the one needed (same tier bytes, same staging slot) and fetches
it itself otherwise, so a skipped layer or a changed state costs time, never correctness.

A host tier read in place (``spec.reads_in_place``) replaces each unit's fetch, wait and
attention by one call that attends to the unit's rows where the pool holds them
(:mod:`jax_tpusync.step.in_place`); nothing is prefetched then. A file tier read in place
(``spec.attends_landed``) still starts each fetch ``prefetch_depth`` units ahead, into the
engine's landing memory, and replaces the wait and the attention by one call that waits
and attends where the unit landed: nothing is copied into staging.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_tpusync.core import quantize
from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.kernels import reference as kernel_reference
from jax_tpusync.runtime import ops
from jax_tpusync.step import in_place, plan
from jax_tpusync.step.unit import (
    attend_valid_rows,
    layer_attend,
    staged_block_len,
    staged_unit_rows,
)


def write_back(
    spec: CacheSpec,
    state: KVState,
    layer,
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    shard_guard: jax.Array | None = None,  # int32[1, 4], leading the guards of a mesh shard
    counts: jax.Array | None = None,  # int32[batch]: real rows per slot (plan.real_rows)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queues the new tokens' write-back at each active slot's length; returns ``(token,
    new_kv, grow)``: the op's token, the rows ([2, batch, q_len, H, D] in the cache's
    dtype, or uint8[2, batch, q_len, row_bytes] quantized; of slot ``b`` only the first
    ``counts[b]`` are written, None: all) and int32[batch], the tokens each slot takes
    this step (its count, or q_len; 0 inactive), which its capacity guard checks."""
    eid, tier, first_block = state.target[0], state.target[1], state.target[2]
    q_len = k.shape[1]
    lengths = state.lengths
    grow = plan.step_grow(state, q_len, counts)
    # Layer 0's write-back is the step's first engine op (every other op depends on it):
    # it claims the state's step, so a second step from the same state is refused.
    claim = jnp.concatenate([state.owner, jnp.asarray(layer == 0, jnp.int32)[None]])

    write_segments = plan.write_segments(spec, state, layer, q_len, counts)
    if not isinstance(layer, int):
        # The first engine call of the layer refuses an out-of-range traced layer.
        write_segments = plan.refuse_bad_layer(spec, layer, write_segments)
    # Capacity guards first (see ops.CAPACITY_GUARD): the write-back refuses the whole step,
    # before any byte moves, if a slot would pass its capacity, naming it, instead of
    # writing into whatever block lies next to its last one.
    guards = [ops.capacity_guards(lengths, grow, state.capacity)]
    if shard_guard is not None:  # First of all: the state must be this device's shard.
        guards.insert(0, shard_guard)
    write_segments = jnp.concatenate([*guards, write_segments])
    new_kv = new_rows(spec, k, v)
    token = ops.write_back(
        eid,
        tier,
        new_kv,
        write_segments,
        plan.tag(layer, -1),
        deps=(state.token,),
        regions=spec.regions,
        owner=claim,
        first_block=first_block,
    )
    return token, new_kv, grow


def new_rows(spec: CacheSpec, k: jax.Array, v: jax.Array) -> jax.Array:
    """The rows a write-back writes for ``k``/``v`` ([batch, q_len, H, D]): [2, batch,
    q_len, H, D] in the cache's dtype, or uint8[2, batch, q_len, row_bytes] quantized
    (fused into the step; the tokens themselves attend in full precision)."""
    new_kv = jnp.stack([k, v]).astype(spec.dtype)
    if spec.quantized:
        new_kv = quantize.quantize(new_kv, spec.tier_dtype)
    return new_kv


def streamed_layer(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState,
    token: jax.Array,  # the write-back's token
    grow: jax.Array,  # int32[batch]: tokens each slot takes this step
    *,
    layer,
    implementation: str,
    scale: float,
    soft_cap: float | None,
    kernel_options: dict,
    counts: jax.Array | None = None,  # int32[batch]: real rows per slot (None: q_len)
    walk: plan.Walk | None = None,
) -> tuple[jax.Array, KVState]:
    """Steps 2 and 3 of one layer of a streamed cache, its write-back queued (``token``):
    ``(out, state)``, ``out`` like ``q``. Query row ``i`` of slot ``b`` sits at
    ``lengths[b] + i`` and attends to the cached keys and to the step's rows ``j <= i``
    with ``j < counts[b]``; the next step's prefetch walks ``lengths + grow``.

    With ``walk`` (a sparse decode step) the units are those of ``walk``'s tables instead
    of the state's, the prefetch ahead follows ``walk.table_ahead``, and a second walk
    over ``walk.late_table`` (no prefetch: its fetches are started by the waits
    themselves) merges in before the new tokens."""
    spec = state.spec
    eid = state.target[0]
    batch, q_len = q.shape[:2]
    lengths = state.lengths
    owner = jnp.concatenate([state.owner, jnp.zeros((1,), jnp.int32)])
    # The state the units are read through: the step's own, or the walk's tables.
    walked = state if walk is None else state.replace(block_table=walk.table, lengths=walk.lengths)

    def ahead(chunk):
        """(layer, chunk, state to read it through, ok) of the unit prefetch_depth ahead."""
        if walk is None:
            p_layer, p_chunk, p_lens, ok = plan.advance(spec, layer, chunk, lengths, grow)
            return p_layer, p_chunk, state.replace(lengths=p_lens), ok
        p_layer, p_chunk, next_step, ok = plan.advance_over(
            spec,
            layer,
            chunk,
            plan.units_per_layer(spec, walk.layer_lengths),
            plan.units_per_layer(spec, walk.next_layer_lengths),
        )
        p_lens = jnp.where(next_step, walk.next_layer_lengths[p_layer], walk.layer_lengths[p_layer])
        p_state = state.replace(block_table=walk.table_ahead(p_layer, next_step), lengths=p_lens)
        return p_layer, p_chunk, p_state, ok

    num_units = plan.num_units(spec, layer, walked.lengths)
    attend = layer_attend(spec, layer, scale, soft_cap, implementation, kernel_options)

    block_len = staged_block_len(spec) if implementation == "xla" else spec.chunk_len

    levels = plan.fetch_levels(spec, state)
    # A slot without real rows this step attends to no cached key: the blocked XLA
    # attention then stops at the last block another slot needs.
    keys_for = (
        (lambda count: count) if counts is None else (lambda count: jnp.where(counts > 0, count, 0))
    )

    def unit_in_place(chunk, carry):
        # The unit's rows where the host tier holds them (jax_tpusync.step.in_place): no
        # fetch, no staging, so nothing to prefetch either.
        q_, out, lse, staging, tickets, slot = carry
        o, l = in_place.unit(
            spec,
            walked,
            layer,
            chunk,
            q_,
            deps=(token, k, v, out),
            owner=owner,
            scale=scale,
            soft_cap=soft_cap,
            counts=counts,
        )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        return q_, out, lse, staging, tickets, slot

    def unit_staged(chunk, carry):
        q_, out, lse, staging, tickets, slot = carry
        # Start the unit `prefetch_depth` ahead into the slot consumed last (free now:
        # `out` depends on its contents having been read). A two-level cache fetches
        # each unit from both tiers, into the same slot (ticket level * num_slots + slot).
        p_layer, p_chunk, p_state, ok = ahead(chunk)
        p_slot = (slot + spec.prefetch_depth) % spec.num_slots
        p_lo, p_count = plan.unit_range(spec, p_layer, p_chunk, p_state.lengths)
        p_count = jnp.where(ok, p_count, 0)
        lo, count = plan.unit_range(spec, layer, chunk, walked.lengths)
        for level, (tier, first_block, regions) in enumerate(levels):
            q_, p_ticket = ops.start_fetch(
                eid,
                tier,
                q_,
                plan.fetch_segments(spec, p_state, p_layer, p_lo, p_count, p_slot, level),
                plan.tag(p_layer, p_chunk),
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
                plan.fetch_segments(spec, walked, layer, lo, count, slot, level),
                plan.tag(layer, chunk),
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
            keys_for(count),
            spec.chunk_len,
            block_len,
            q.shape,
        )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        return q_, out, lse, staging, tickets, (slot + 1) % spec.num_slots

    def unit_landed(chunk, carry):
        # A file tier read in place (jax_tpusync.step.in_place): the unit `prefetch_depth`
        # ahead is started as into staging, but lands in the engine's memory only, and this
        # unit is waited for and attended where it landed in one op: no copy into staging.
        # Every unit's segments address staging slot 0 (no slot is allocated); the tickets
        # still rotate over the slots.
        # A two-level cache fetches ahead from its spill tier only (level 1's tickets); its
        # memory tier's rows are read where they lie.
        q_, out, lse, staging, tickets, slot = carry
        p_layer, p_chunk, p_state, ok = ahead(chunk)
        p_slot = (slot + spec.prefetch_depth) % spec.num_slots
        p_lo, p_count = plan.unit_range(spec, p_layer, p_chunk, p_state.lengths)
        p_count = jnp.where(ok, p_count, 0)
        level = 1 if spec.spill_blocks else 0
        tier, first_block, regions = levels[level]
        at = level * spec.num_slots
        q_, p_ticket = ops.start_fetch(
            eid,
            tier,
            q_,
            plan.fetch_segments(spec, p_state, p_layer, p_lo, p_count, 0, level),
            plan.tag(p_layer, p_chunk),
            dst_bytes=in_place.landed_bytes(spec),
            deps=(token, out),
            regions=regions,
            retire=tickets[at + p_slot],
            owner=owner,
            first_block=first_block,
        )
        o, l = in_place.unit(
            spec,
            walked,
            layer,
            chunk,
            q_,
            tickets[at + slot],
            deps=(token, k, v, out),
            owner=owner,
            scale=scale,
            soft_cap=soft_cap,
            counts=counts,
        )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        tickets = tickets.at[at + slot].set(ops.NO_TICKET).at[at + p_slot].set(p_ticket)
        return q_, out, lse, staging, tickets, (slot + 1) % spec.num_slots

    if spec.attends_landed:
        unit_step = unit_landed
    else:
        unit_step = unit_in_place if spec.reads_in_place else unit_staged
    out0 = jnp.zeros(q.shape, jnp.float32)
    lse0 = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    carry = (q, out0, lse0, state.staging, state.tickets, state.slot)
    if spec.single_unit:
        carry = unit_step(jnp.int32(0), carry)
    else:
        carry = lax.fori_loop(0, num_units, unit_step, carry)
    q_, out, lse, staging, tickets, slot = carry
    if walk is not None and walk.late_table is not None:
        late = state.replace(block_table=walk.late_table, lengths=walk.late_lengths)
        out, lse, staging = late_walk(
            spec,
            late,
            layer,
            q_,
            out,
            lse,
            staging,
            slot,
            token,
            k,
            v,
            owner,
            counts,
            **(
                dict(
                    attend=attend,
                    block_len=block_len,
                    keys_for=keys_for,
                    scale=scale,
                    soft_cap=soft_cap,
                    first_chunk=num_units,
                )
            ),
        )

    # 3. The new tokens attend to themselves (causally; a slot's padding rows are no keys)
    # and merge in.
    new_start = lengths
    o, l = attend(
        q_,
        k.astype(spec.dtype),
        v.astype(spec.dtype),
        new_start,
        plan.own_rows(batch, q_len, counts),
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


def late_walk(
    spec: CacheSpec,
    late: KVState,  # the state with the late walk's table and lengths
    layer,
    q: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    staging: jax.Array,
    slot: jax.Array,  # the staging slot a staged late unit lands in (copied by its wait)
    token: jax.Array,
    k: jax.Array,
    v: jax.Array,
    owner: jax.Array,
    counts: jax.Array | None,
    *,
    attend,
    block_len: int,
    keys_for,
    scale: float,
    soft_cap: float | None,
    first_chunk: jax.Array,  # the main walk's units: late units are tagged after them
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(out, lse, staging)`` with the units of ``late``'s table merged in: blocks the
    prediction missed, read when the query is known. Nothing was fetched ahead for them:
    each unit's wait (or in-place call) is given no ticket and reads its bytes itself; the
    prefetch chain's tickets stay as they are."""
    eid = late.target[0]
    no_ticket = jnp.int32(ops.NO_TICKET)

    def one_unit(chunk, carry):
        out, lse, staging = carry
        tag = plan.tag(layer, first_chunk + chunk)
        lo, count = plan.unit_range(spec, layer, chunk, late.lengths)
        if spec.reads_in_place:
            o, l = in_place.attend_unit(
                spec,
                late,
                layer,
                q,
                plan.fetch_segments(spec, late, layer, lo, count, 0),
                lo,
                count,
                tag=tag,
                deps=(token, k, v, out),
                owner=owner,
                scale=scale,
                soft_cap=soft_cap,
                ticket=no_ticket if spec.attends_landed else None,
                counts=counts,
            )
        else:
            staging = ops.wait_fetch(
                eid,
                late.target[1],
                staging,
                no_ticket,
                plan.fetch_segments(spec, late, layer, lo, count, slot),
                tag,
                deps=(q, k, v, out),
                regions=spec.regions,
                owner=owner,
                first_block=late.target[2],
            )
            o, l = attend_valid_rows(
                lambda start, n, valid: attend(
                    q,
                    k_start=lo + start,
                    k_valid=valid,
                    q_start=late.lengths,
                    **staged_unit_rows(spec, staging, slot, start, n),
                ),
                keys_for(count),
                spec.chunk_len,
                block_len,
                q.shape,
            )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        return out, lse, staging

    carry = (out, lse, staging)
    if spec.single_unit:
        return one_unit(jnp.int32(0), carry)
    return lax.fori_loop(0, plan.num_units(spec, layer, late.lengths), one_unit, carry)
