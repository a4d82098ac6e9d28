"""The host-pool step: one layer over a paged pool in host memory, each unit copied to the
device ``prefetch_depth`` units ahead of its attention, with plain JAX memory kinds (the
TPU data path).

The pool is a ``pinned_host`` array the state carries (:mod:`jax_tpusync.core.pool_state`). One
layer of a step:

1. the new rows go into the pool: each slot's aligned write group at its length (the
   group's older rows, fetched with the layer's first unit, then the new rows) is copied
   to host memory and written in place;
2. for each unit (``chunk_len`` positions of every slot, whole blocks) of the layer's
   cached KV: copy the unit ``prefetch_depth`` ahead (in the layer, or among the next
   layer's first units, or past the last layer the next step's first ones;
   :func:`jax_tpusync.step.plan.advance`) from the updated pool to the device, then attend
   to this one. The layer's first ``prefetch_depth`` units were copied by the layers (or
   step) before; each is used only if the pool rows it came from are the rows this layer
   needs (``staged_at``), else it is copied again here;
3. the new tokens attend to themselves and merge in (online softmax).

Why this bounds device memory and overlaps: every copy reads the pool *after* the write of
the layer that issues it (the pool is threaded through the step), and that write needs the
layer's new K/V, which need the previous layer's output. So the compiler cannot start
layer L+1's copy before layer L's projections, nor keep more than the units staged ahead
and the unit in flight: the device holds ``prefetch_depth + 1`` units, at any context
length. Inside a layer the units go through a loop whose carry is the units staged ahead,
the next one attended first (each iteration attends it, shifts the others up and appends
the one it copied), the same bound. A unit ahead of a later layer of the next step would
be copied before this step's write of that layer: it is marked ``NOT_STAGED``, so that
layer copies it again (only where a step has fewer units than ``prefetch_depth`` past the
current layer; the cache keeps the depth at most ``num_layers``, so the walk never passes
the next step).

Each copy is started and waited for within one loop iteration (a loop iteration is one
program; the compiler cannot carry a copy into the next), so at any depth one unit's copy
overlaps each attention: a deeper prefetch adds device memory without more overlap, which
is why ``prefetch_depth="auto"`` is 1 on this path.

The copies of a unit fetched in a loop iteration go into the loop's carry as they arrive,
one array per block and per tail (:func:`fetch_pieces`), and are joined into the unit's
``[batch, chunk_len, row_width]`` only in the iteration that attends to it
(:func:`join_pieces`). Nothing in the copying iteration reads them, so the compiler may wait
for each copy after the attention, whatever the batch and the unit size: joined in the
copying iteration instead (the join a device copy of the unit), TPU v6e's schedule waited
for every block copy of units of five or more blocks per slot before the attention, for
any slot count above one (compiled: 4 of 24 copies overlapped, batch 2, 5 blocks of 256
rows). What bounds a unit then is how many host copies the compiler keeps in flight at
once (:func:`jax_tpusync.core.pool_state.unit_block_limit`). Past 16 slots a device even one
block a slot passes it, so the walk goes a group of slots at a time
(:func:`jax_tpusync.core.pool_state.unit_slots`): an iteration attends one group's rows of a
unit while it copies the same group's rows of the unit ahead, and the carry holds each
group's pieces apart (the last group padded with the sink's rows, its attention dropped).
A layer's staged first units (whole units in the state) are split into pieces for the
loop, and the units it leaves staged joined again after it.

A cache that keeps only its sliding window (``max_step_tokens``) needs nothing here: the
block table a state carries repeats each slot's ring of blocks
(:func:`jax_tpusync.core.window_ring.tiled_table`), so position ``p`` finds ring entry ``(p //
block_tokens) % ring_blocks`` through the table as any cache's, and the ring is sized so
that a step's new rows never land on rows this step's layers still read
(:func:`jax_tpusync.core.window_ring.ring_blocks`; a step of more rows is refused at trace
time, :func:`jax_tpusync.step.device.pool_attention`).

Writes are whole aligned groups (:attr:`~jax_tpusync.core.pool_state.PoolLayout.write_rows`
rows): the compiler slices host memory in 32-bit sublanes. A write past a slot's capacity
goes to the pool's sink block instead, and the slot's step is refused (its length does not
grow; ``state.refused`` counts the tokens, and the cache refuses the state afterwards). A
traced ``layer`` (``lax.scan`` over the layers) outside ``[0, num_layers)`` is refused the
same way for every active slot: its block rows would be another layer's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_tpusync.core.pool_state import (
    NOT_STAGED,
    PoolLayout,
    PoolState,
    into_pool,
    pool_rows_of,
    to_device,
)
from jax_tpusync.kernels import reference as kernel_reference
from jax_tpusync.step import plan
from jax_tpusync.step.unit import attend_valid_rows, block_len_for, layer_attend, rows_as_kv

# Name scopes of a layer's unit copies and attention: the compiled program's schedule is
# checked by them (which copy starts before which attention, and ends after it).
FETCH_SCOPE = "tpusync_fetch_unit"
ATTEND_SCOPE = "tpusync_attend_unit"


def block_rows(
    layout: PoolLayout,
    block_table: jax.Array,  # int32[batch, max_blocks]
    capacity: jax.Array,  # int32[batch]
    layer,
    index: jax.Array,  # int32[batch, n]: block index within each slot
) -> jax.Array:  # int32[batch, n]
    """Pool row of each slot's block ``index`` in ``layer``; the sink's where the slot has
    no such block (past its capacity, an inactive slot, an empty table entry)."""
    spec = layout.spec
    clipped = jnp.clip(index, 0, spec.max_blocks - 1)
    block = jnp.take_along_axis(block_table, clipped, axis=1)
    has = (index < spec.max_blocks) & (index * spec.block_tokens < capacity[:, None])
    has &= block >= 0
    return jnp.where(has, layout.block_row(jnp.asarray(layer, jnp.int32), block), layout.sink_row)


def unit_rows(
    layout: PoolLayout, state: PoolState, layer, unit, lengths: jax.Array
) -> jax.Array:  # int32[batch, blocks_per_unit + 1]
    """Pool rows of unit ``unit`` of ``layer`` at ``lengths``: each block's first row, then
    the write group at each slot's length (its tail)."""
    spec = layout.spec
    bt = spec.block_tokens
    first = plan.layer_start(spec, layer, lengths) // bt + unit * layout.blocks_per_unit
    index = first[:, None] + jnp.arange(layout.blocks_per_unit, dtype=jnp.int32)
    rows = block_rows(layout, state.block_table, state.capacity, layer, index)
    return jnp.concatenate([rows, tail_row(layout, state, layer, lengths)[:, None]], axis=1)


def tail_row(layout: PoolLayout, state: PoolState, layer, lengths: jax.Array) -> jax.Array:
    """int32[batch]: pool row of each slot's write group at its length in ``layer`` (the
    sink's where the slot has no block there)."""
    bt = layout.spec.block_tokens
    tail_at = lengths - lengths % layout.write_rows
    tail_block = block_rows(
        layout, state.block_table, state.capacity, layer, (tail_at // bt)[:, None]
    )
    return jnp.where(
        tail_block[:, 0] == layout.sink_row, layout.sink_row, tail_block[:, 0] + tail_at % bt
    )


def fetch_pieces(
    layout: PoolLayout,
    pool: jax.Array,  # [pool_rows, row_width], host memory
    rows: jax.Array,  # int32[batch, blocks_per_unit + 1]: from unit_rows
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """(blocks, tails): the unit's copies to the device, unjoined: for each of the slots
    ``rows`` names (every slot, or a group of them), ``blocks_per_unit`` blocks of
    ``[block_tokens, row_width]`` (slot by slot), then a tail of ``[write_rows,
    row_width]`` each."""
    spec = layout.spec
    width = layout.row_width
    blocks, tails = [], []
    for b in range(rows.shape[0]):
        blocks += [
            to_device(lax.dynamic_slice(pool, (rows[b, j], 0), (spec.block_tokens, width)))
            for j in range(layout.blocks_per_unit)
        ]
        tails.append(
            to_device(lax.dynamic_slice(pool, (rows[b, -1], 0), (layout.write_rows, width)))
        )
    return tuple(blocks), tuple(tails)


def join_pieces(
    layout: PoolLayout, pieces: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]
) -> tuple[jax.Array, jax.Array]:
    """(staging [slots, chunk_len, row_width], tail [slots, write_rows, row_width]) of a
    unit's pieces (:func:`fetch_pieces`), of every slot or a group of them."""
    blocks, tails = pieces
    n = layout.blocks_per_unit
    slots = [
        jnp.concatenate(blocks[b * n : (b + 1) * n], axis=0) if n > 1 else blocks[b * n]
        for b in range(len(tails))
    ]
    return jnp.stack(slots), jnp.stack(tails)


def split_unit(
    layout: PoolLayout, staging: jax.Array, tail: jax.Array
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """A staged unit as :func:`fetch_pieces` gives one (the inverse of :func:`join_pieces`)."""
    n, bt = layout.blocks_per_unit, layout.spec.block_tokens
    batch = staging.shape[0]
    blocks = tuple(staging[b, j * bt : (j + 1) * bt] for b in range(batch) for j in range(n))
    return blocks, tuple(tail[b] for b in range(batch))


def fetch(
    layout: PoolLayout,
    pool: jax.Array,  # [pool_rows, row_width], host memory
    rows: jax.Array,  # int32[batch, blocks_per_unit + 1]: from unit_rows
) -> tuple[jax.Array, jax.Array]:
    """(staging [batch, chunk_len, row_width], tail [batch, write_rows, row_width]): the
    unit's blocks and tails copied to the device, one copy per block, joined."""
    return join_pieces(layout, fetch_pieces(layout, pool, rows))


def write_rows(
    layout: PoolLayout,
    state: PoolState,
    pool: jax.Array,  # [pool_rows, row_width], host memory
    layer,
    rows: jax.Array,  # [batch, q_len, row_width]: the step's new rows
    tail: jax.Array,  # [batch, write_rows, row_width]: each slot's group at its length
    grow: jax.Array,  # int32[batch]: rows each slot takes (0: none written)
) -> jax.Array:
    """The pool with each slot's first ``grow[b]`` rows written at its length, in aligned
    groups (the group's rows before the length rewritten with ``tail``'s values)."""
    spec = layout.spec
    group = layout.write_rows
    batch, q_len, width = rows.shape
    num_groups = -(-(group - 1 + q_len) // group)
    lengths = state.lengths
    offset = lengths % group
    buffer = jnp.zeros((batch, num_groups * group, width), rows.dtype).at[:, :group].set(tail)
    buffer = jax.vmap(lambda buf, new, at: lax.dynamic_update_slice(buf, new, (at, 0)))(
        buffer, rows, offset
    )
    used = jnp.where(grow > 0, (offset + grow + group - 1) // group, 0)
    first = lengths - offset
    bt = spec.block_tokens

    def write_group(j, pool):
        at = first + j * group
        start = block_rows(layout, state.block_table, state.capacity, layer, (at // bt)[:, None])
        start = start[:, 0]
        row = jnp.where((j < used) & (start != layout.sink_row), start + at % bt, layout.sink_row)
        for b in range(batch):
            piece = lax.dynamic_slice(buffer[b], (j * group, 0), (group, width))
            pool = lax.dynamic_update_slice(pool, into_pool(pool, piece), (row[b], 0))
        return pool

    if num_groups <= 2:
        for j in range(num_groups):
            pool = write_group(j, pool)
        return pool
    return lax.fori_loop(0, jnp.max(used), write_group, pool)


def unit_kv(layout: PoolLayout, staging: jax.Array) -> dict[str, jax.Array]:
    """Staged rows [batch, n, row_width] as the attention's ``k``/``v`` (and scales)."""
    spec = layout.spec
    half = layout.half_width
    lead = staging.shape[:2]
    k_rows = staging[..., :half].reshape(*lead, *spec.row_shape)
    v_rows = staging[..., half:].reshape(*lead, *spec.row_shape)
    return rows_as_kv(spec, k_rows, v_rows)


def pool_layer(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: PoolState,
    *,
    layer,
    implementation: str,
    scale: float,
    soft_cap: float | None,
    kernel_options: dict,
    counts: jax.Array | None = None,  # int32[batch]: real rows per slot (None: q_len)
) -> tuple[jax.Array, PoolState]:
    """One layer of a step over a host pool: ``(out, state)``, ``out`` like ``q`` (a
    dense one: a sparse state's step is :mod:`jax_tpusync.step.pool_sparse`'s)."""
    spec = state.spec
    layout = PoolLayout(spec)
    batch, q_len = q.shape[:2]
    lengths = state.lengths
    active = state.capacity > 0
    wanted = jnp.where(active, q_len if counts is None else counts, 0).astype(jnp.int32)
    # A step that would pass a slot's capacity is refused for that slot: nothing of it is
    # written where anything reads, and its length stays. So is every slot's step at a
    # traced layer out of range, whose rows would land in another layer's blocks.
    layer_id = jnp.asarray(layer, jnp.int32)
    bad_layer = (layer_id < 0) | (layer_id >= spec.num_layers)
    over = active & ((lengths + wanted > state.capacity) | bad_layer)
    grow = jnp.where(over, 0, wanted)
    last_layer = layer_id == spec.num_layers - 1

    bt = spec.block_tokens
    # The walk to the unit `prefetch_depth` ahead; the pool always chains into the next
    # step (staged_at, not the option, decides whether a staged unit is used).
    walk = dataclasses.replace(spec, prefetch_across_steps=True)
    # Units start at a block boundary, so a window's keys may need one more than its span.
    first_block = plan.layer_start(spec, layer, lengths) // bt
    span = jnp.max(lengths - first_block * bt)
    num_units = jnp.maximum(1, (span + spec.chunk_len - 1) // spec.chunk_len)

    # The layer's first units: staged before if they came from the rows needed now. A unit
    # past the layer's last belongs to a later layer, which checks it.
    staged = []
    for ahead, (staging, tail, staged_at) in enumerate(state.staged_units):
        need = unit_rows(layout, state, layer, ahead, lengths)
        keep = jnp.all(staged_at == need)
        if ahead > 0:
            keep |= ahead >= num_units
        staging, tail = lax.cond(
            keep,
            lambda staging=staging, tail=tail: (staging, tail),
            lambda need=need: fetch(layout, state.pool, need),
        )
        # The first unit holds `need` now, staged before or copied here.
        staged.append((staging, tail, need if ahead == 0 else jnp.where(keep, staged_at, need)))
    tail = staged[0][1]

    # 1. The new rows go into the pool; every later copy reads the pool after them.
    pool = write_rows(layout, state, state.pool, layer, pool_rows_of(layout, k, v), tail, grow)

    # 2. The layer's units, each attended while the next one is copied.
    attend = layer_attend(spec, layer, scale, soft_cap, implementation, kernel_options)
    block_len = (  # The attention is of a unit's group of slots (one group: every slot).
        block_len_for(spec.chunk_len, layout.group_slots * spec.num_kv_heads * spec.head_dim)
        if implementation == "xla"
        else spec.chunk_len
    )
    takes_keys = grow > 0 if counts is not None else active

    def unit_ahead(unit):
        """(layer, unit, lengths, ok) of the unit ``prefetch_depth`` after ``unit`` of this
        layer: this layer's, a next layer's, or the next step's (``ok`` False: it would be
        copied before this step writes its layer)."""
        if spec.prefetch_depth > 1:
            return plan.advance(walk, layer, unit, lengths, grow, bt)
        # The next unit, in closed form: the walk's general arithmetic compiled to a
        # schedule holding 1.15 MiB more device memory (a v6e mesh step's 134.3 MiB).
        more = unit + 1 < num_units
        next_layer = jnp.where(last_layer, 0, jnp.asarray(layer, jnp.int32) + 1)
        return (
            jnp.where(more, jnp.asarray(layer, jnp.int32), next_layer),
            jnp.where(more, unit + 1, 0),
            jnp.where(more | ~last_layer, lengths, lengths + grow),
            True,
        )

    # The unit walk goes a group of slots at a time where a unit's copies of every slot
    # would pass the copies the compiler keeps in flight (PoolLayout.group_slots); one
    # group: every slot, and the walk is the unit walk.
    group = layout.group_slots
    groups = layout.slot_groups
    padded = group * groups

    def padded_slots(x, fill):
        """``x`` [batch, ...] as [padded, ...]: the slots past the batch hold ``fill``."""
        if padded == batch:
            return x
        return jnp.concatenate([x, jnp.full((padded - batch, *x.shape[1:]), fill, x.dtype)])

    def of_group(x, g):
        """Group ``g``'s slots of ``x`` [padded, ...]."""
        return x if groups == 1 else lax.dynamic_slice_in_dim(x, g * group, group, axis=0)

    def into_group(x, part, g):
        return part if groups == 1 else lax.dynamic_update_slice_in_dim(x, part, g * group, 0)

    q_slots = padded_slots(q, 0)
    lengths_slots = padded_slots(lengths, 0)

    def unit_step(step_index, carry):
        out, lse, staged = carry
        # Step ``step_index`` attends group g of unit `unit` while it copies the same group
        # of the unit ahead: every piece in the carry is one group's unit.
        unit, g = (step_index, 0) if groups == 1 else (step_index // groups, step_index % groups)
        staging, _ = join_pieces(layout, staged[0][0])
        n_layer, n_unit, n_lengths, ok = unit_ahead(unit)
        n_rows = unit_rows(layout, state, n_layer, n_unit, n_lengths)
        n_rows = of_group(padded_slots(n_rows, layout.sink_row), g)
        with jax.named_scope(FETCH_SCOPE):
            n_pieces = fetch_pieces(layout, pool, n_rows)
        k_start = (first_block + unit * layout.blocks_per_unit) * spec.block_tokens
        valid = jnp.where(takes_keys, jnp.clip(lengths - k_start, 0, spec.chunk_len), 0)
        k_start, valid = (of_group(padded_slots(x, 0), g) for x in (k_start, valid))
        q_group = of_group(q_slots, g)
        with jax.named_scope(ATTEND_SCOPE):
            o, l = attend_valid_rows(
                lambda start, n, valid_rows: attend(
                    q_group,
                    k_start=k_start + start,
                    k_valid=valid_rows,
                    q_start=of_group(lengths_slots, g),
                    **unit_kv(layout, lax.dynamic_slice_in_dim(staging, start, n, axis=1)),
                ),
                valid,
                spec.chunk_len,
                block_len,
                q_group.shape,
            )
        merged = kernel_reference.merge_partials(of_group(out, g), of_group(lse, g), o, l)
        out, lse = into_group(out, merged[0], g), into_group(lse, merged[1], g)
        # Not ok: copied before this step wrote its layer; that layer copies it again.
        n_at = n_rows if ok is True else jnp.where(ok, n_rows, NOT_STAGED)
        return out, lse, (*staged[1:], (n_pieces, n_at))

    out0 = jnp.zeros(q_slots.shape, jnp.float32)
    lse0 = jnp.full(q_slots.shape[:3], -jnp.inf, jnp.float32)
    # The loop carries units as pieces (see the module's docstring), each group's apart, in
    # the order they are attended; the state carries whole units.
    pieces = []
    for unit in staged:
        unit_staging, unit_tail, unit_at = (padded_slots(x, 0) for x in unit)
        for g in range(groups):
            part = slice(g * group, (g + 1) * group)
            pieces.append((split_unit(layout, unit_staging[part], unit_tail[part]), unit_at[part]))
    # A loop even where every layer's keys fit one unit (a ring of a sliding window): its
    # iteration is where the compiler must start and wait for the copy, around the
    # attention; inline in the step, TPU v6e's schedule waited for 24 of a sliding group's
    # 40 copies before any attention (a hybrid cache, 5 sliding layers of one unit).
    out, lse, pieces = lax.fori_loop(0, num_units * groups, unit_step, (out0, lse0, tuple(pieces)))
    out, lse = out[:batch], lse[:batch]
    staged = []
    for unit in range(len(pieces) // groups):
        joined = [join_pieces(layout, p) for p, _ in pieces[unit * groups : (unit + 1) * groups]]
        ats = [at for _, at in pieces[unit * groups : (unit + 1) * groups]]
        staged.append(
            tuple(
                parts[0] if groups == 1 else jnp.concatenate(parts)[:batch]
                for parts in ([j[0] for j in joined], [j[1] for j in joined], ats)
            )
        )

    # 3. The new tokens attend to themselves (a slot's padding rows are no keys).
    own = plan.own_rows(batch, q_len, counts)
    o, l = attend(q, k.astype(spec.dtype), v.astype(spec.dtype), lengths, own, lengths)
    out, _ = kernel_reference.merge_partials(out, lse, o, l)

    state = state.with_staged_units(staged).replace(
        lengths=jnp.where(last_layer, lengths + grow, lengths),
        pool=pool,
        refused=state.refused + jnp.where((last_layer | bad_layer) & over, wanted, 0),
    )
    return out.astype(q.dtype), state
