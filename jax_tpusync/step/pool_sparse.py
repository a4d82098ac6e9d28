"""The host-pool step with sparse decode: a global layer's decode rows read only the blocks
their query selects (:mod:`jax_tpusync.sparse`), copied to the device by the compiled step
itself, a unit ahead, from the ``pinned_host`` pool (:mod:`jax_tpusync.step.host_pool`).

A sparse layer of a decode step (one row per slot) walks units of a *compacted* block
table instead of the slot's (:func:`jax_tpusync.sparse.select.compact`: the selected
physical blocks packed to the front, the partly filled last block last), with the same
unit copies, staging and online-softmax merge as the dense walk:

1. The layer's first unit was copied by the layer before (or the step before), from the
   layer's *prediction* (:func:`jax_tpusync.sparse.prediction.predict`: its selection at the
   previous step with this step's sink and recent blocks), before its query existed; it is
   used where its pool rows are the ones needed (``staged_at``), as on the dense path.
2. The new rows go into the pool, and their keys into the layer's block summaries, which
   live beside the pool in host memory (:mod:`jax_tpusync.core.pool_sparse`).
3. With the query known, the layer's summaries are copied to the device chunk by chunk
   (each chunk copied while the one before is scored; the first a layer ahead, like a
   unit: while the layer before scores its last chunk) and bound every block's scores
   (:func:`score_blocks`); the exact selection follows (:func:`jax_tpusync.sparse.select.select`),
   and the blocks it holds beyond the prediction are *late*
   (:func:`jax_tpusync.sparse.prediction.late`).
4. The walk attends the predicted units, then the late blocks' units (a second compacted
   table, whole blocks), each unit copied while the one before is attended, all merged by
   online softmax. The first unit's attention does not wait for the scoring: only the
   late units need it, so the summaries' copies and the scoring can overlap it. The
   predicted blocks the exact selection does not hold (*wasted*) are attended too: they
   are real KV, and attending more of it only brings the output nearer the dense one.
5. The exact selection is the layer's prediction at the next step, and the unit after the
   layer's last is the next layer's first *predicted* unit. The layer's counts
   (:data:`~jax_tpusync.core.pool_sparse.COUNTS`) are added to the state's.

Dense where sparse does not apply: a step of more than one row per slot (a prefill chunk,
or a ragged step of any slot prefilling: every layer reads its whole context, and the
summaries take the written keys), and sliding-window layers (their window). A dense
layer copies the next layer's first unit densely ahead, so a sparse layer after a sliding
one (a model of mixed windows in one cache) copies its first predicted unit again, not
overlapped; a hybrid cache's groups each hold one kind of layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_tpusync.core.pool_sparse import (
    SummaryLayout,
    masked_bounds,
    merge_summary_row,
    stored_keys,
)
from jax_tpusync.core.pool_state import (
    NOT_STAGED,
    PoolLayout,
    PoolState,
    pool_rows_of,
    to_device,
)
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.kernels import reference as kernel_reference
from jax_tpusync.sparse import prediction
from jax_tpusync.sparse import select as selection
from jax_tpusync.step import host_pool, plan
from jax_tpusync.step.unit import attend_valid_rows, block_len_for, layer_attend

# Name scopes of the summaries' copies and their scoring, and of the read-modify-write of
# the written blocks' summaries (the compiled schedule is checked by them).
SUMMARY_FETCH_SCOPE = "tpusync_fetch_summaries"
SCORE_SCOPE = "tpusync_score_blocks"
SUMMARY_WRITE_SCOPE = "tpusync_write_summaries"


def layer_is_global(spec: CacheSpec, layer) -> bool:
    """Whether ``layer`` reads its whole context (sparse applies) rather than a window.

    Raises:
      ValueError: a traced layer of a cache whose layers differ in window.
    """
    if isinstance(layer, int):
        return spec.windows[layer] is None
    kinds = {w is None for w in spec.windows}
    if len(kinds) > 1:
        raise ValueError(
            "sparse= with a traced layer over layers of different windows: the sparse and "
            "the dense walk differ in shape; pass each layer as a Python int (or a "
            "HybridKVCache, whose groups each hold one kind of layer)"
        )
    return kinds.pop()


def step_grow(spec: CacheSpec, state: PoolState, q_len: int, counts, layer):
    """``(wanted, over, grow, bad_layer)`` as :func:`host_pool.pool_layer` computes them:
    the rows each slot asks for, whether its step is refused, the rows it takes."""
    lengths = state.lengths
    active = state.capacity > 0
    wanted = jnp.where(active, q_len if counts is None else counts, 0).astype(jnp.int32)
    layer_id = jnp.asarray(layer, jnp.int32)
    bad_layer = (layer_id < 0) | (layer_id >= spec.num_layers)
    over = active & ((lengths + wanted > state.capacity) | bad_layer)
    return wanted, over, jnp.where(over, 0, wanted), bad_layer


def written_summaries(
    spec: CacheSpec,
    state: PoolState,
    summaries: jax.Array,
    layer,
    k: jax.Array,  # [batch, q_len, H, D]: the step's new keys
    grow: jax.Array,  # int32[batch]: rows each slot takes (0: none)
) -> jax.Array:
    """The summaries once each slot's first ``grow[b]`` keys are written at its length in
    ``layer``: every block they land in merged with them (a block they start: set to
    them); a slot with no block there writes the sink row."""
    layout = SummaryLayout(spec)
    bt = spec.block_tokens
    batch, q_len = k.shape[:2]
    keys = stored_keys(spec, k)
    lengths = state.lengths
    position = lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)
    taken = jnp.arange(q_len, dtype=jnp.int32)[None, :] < grow[:, None]
    layer_id = jnp.clip(jnp.asarray(layer, jnp.int32), 0, spec.num_layers - 1)
    touched = (q_len + bt - 2) // bt + 1  # Blocks a slot's rows may land in.

    def write_block(j, summaries):
        block = lengths // bt + j
        inside = taken & (position // bt == block[:, None])
        clipped = jnp.clip(block, 0, spec.max_blocks - 1)
        physical = jnp.take_along_axis(state.block_table, clipped[:, None], axis=1)[:, 0]
        has = inside.any(axis=1) & (block < spec.max_blocks) & (physical >= 0)
        has &= block * bt < state.capacity
        row = jnp.where(has, layout.row(layer_id, physical), layout.sink_row)
        lo, hi = masked_bounds(keys, inside[:, :, None, None], axis=1)
        fresh = block * bt >= lengths
        for b in range(batch):
            summaries = merge_summary_row(layout, summaries, row[b], lo[b], hi[b], fresh[b])
        return summaries

    with jax.named_scope(SUMMARY_WRITE_SCOPE):
        if touched <= 2:
            for j in range(touched):
                summaries = write_block(j, summaries)
            return summaries
        return lax.fori_loop(0, touched, write_block, summaries)


def summary_chunk(spec: CacheSpec, summaries: jax.Array, layer, c) -> jax.Array:
    """Chunk ``c`` of ``layer``'s summary rows, copied to the device."""
    layout = SummaryLayout(spec)
    chunk = layout.chunk_blocks
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, spec.num_layers - 1)
    with jax.named_scope(SUMMARY_FETCH_SCOPE):
        start = layer * layout.layer_rows + c * chunk
        return to_device(lax.dynamic_slice(summaries, (start, 0), (chunk, layout.row_width)))


def score_blocks(
    spec: CacheSpec,
    summaries: jax.Array,  # host array, SummaryLayout.shape
    q: jax.Array,  # [batch, 1, num_q_heads, head_dim]
    layer,
    block_table: jax.Array,  # int32[batch, max_blocks]
    first_chunk: jax.Array,  # the layer's chunk 0 on the device (copied a layer ahead)
    next_layer=None,  # the layer whose first chunk to copy ahead (None: none)
) -> tuple[jax.Array, jax.Array | None]:
    """``(bounds, next_chunk)``: each slot's score bound of every logical block (-inf where
    it has none; float32[batch, num_kv_heads, max_blocks]), from the layer's summaries
    (:func:`jax_tpusync.sparse.summaries.score_bounds`' bound), copied to the device a chunk
    of physical blocks at a time, each while the one before is scored (the first a layer
    ahead); and ``next_layer``'s first chunk, copied while the last is scored (None without
    ``next_layer``). The device holds two chunks and the bounds, not the layer's summaries.

    Each copy is made in the loop iteration that scores the chunk before it and used in
    the next (the last one's, the next layer's first chunk, after the loop), so that it
    spans a scoring by construction: copied in the step's top-level program instead, after
    the layer's summary write, the compiler started the next layer's first chunk after the
    walk the write overlaps (compiled for a v5e at 32K tokens, 8 layers: 2 of 8 such
    copies spanned an attention or a scoring; chunks copied in the loop: all)."""
    layout = SummaryLayout(spec)
    chunk, num_chunks = layout.chunk_blocks, layout.num_chunks
    batch, _, num_q_heads, dim = q.shape
    heads = spec.num_kv_heads
    qf = q[:, 0].astype(jnp.float32).reshape(batch, heads, num_q_heads // heads, dim)
    q_pos, q_neg = jnp.maximum(qf, 0.0), jnp.minimum(qf, 0.0)

    def fetch(c):
        """Chunk ``c + 1`` of the layer; past its last, the next layer's first."""
        if next_layer is None:
            return summary_chunk(spec, summaries, layer, jnp.minimum(c + 1, num_chunks - 1))
        inside = c + 1 < num_chunks
        return summary_chunk(
            spec, summaries, jnp.where(inside, layer, next_layer), jnp.where(inside, c + 1, 0)
        )

    def place(c, rows, bounds):
        with jax.named_scope(SCORE_SCOPE):
            lo, hi = layout.to_values(rows)
            lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
            # max(q * lo, q * hi) per channel == q * (hi where q > 0 else lo).
            chunk_bounds = jnp.einsum("bhgd,nhd->bhgn", q_pos, hi)
            chunk_bounds += jnp.einsum("bhgd,nhd->bhgn", q_neg, lo)
            chunk_bounds = chunk_bounds.max(axis=2)  # [batch, heads, chunk]
            local = block_table - c * chunk
            inside = (block_table >= 0) & (local >= 0) & (local < chunk)
            index = jnp.broadcast_to(jnp.clip(local, 0, chunk - 1)[:, None, :], bounds.shape)
            got = jnp.take_along_axis(chunk_bounds, index, axis=2)
            return jnp.where(inside[:, None, :], got, bounds)

    bounds = jnp.full((batch, heads, spec.max_blocks), -jnp.inf, jnp.float32)
    if num_chunks == 1:  # No loop: the next layer's chunk copied beside the scoring.
        following = None if next_layer is None else fetch(0)
        return place(0, first_chunk, bounds), following

    def one_chunk(c, carry):
        bounds, rows = carry
        following = fetch(c)
        return place(c, rows, bounds), following

    bounds, following = lax.fori_loop(0, num_chunks, one_chunk, (bounds, first_chunk))
    return bounds, None if next_layer is None else following


def table_rows(
    layout: PoolLayout,
    table: jax.Array,  # int32[batch, n]: physical blocks (-1: none)
    layer,
    unit,
) -> jax.Array:  # int32[batch, blocks_per_unit]
    """Pool rows of unit ``unit`` of a walk over ``table`` in ``layer`` (the sink's where
    the table has no block).

    The unit's columns are a slice of the table padded to whole units, not a ``take``: the
    TPU compiler rewrote a take of a selection of up to 4 blocks but kept it a gather from
    5 up (40K tokens at a 3% budget), and with those gathers in the walk TPU7x's
    memory-space assignment no longer kept the walk's units in its on-chip memory (2
    layers: 30.5 MiB more device memory from 40K tokens up than at 32K). A slice is the
    same op at every selection size, so the walk compiles alike at every context."""
    n, per_unit = table.shape[1], layout.blocks_per_unit
    width = max(1, -(-n // per_unit)) * per_unit
    padded = jnp.pad(table, ((0, 0), (0, width - n)), constant_values=-1)
    first = jnp.asarray(unit, jnp.int32) * per_unit
    index = first + jnp.arange(per_unit, dtype=jnp.int32)
    ids = lax.dynamic_slice_in_dim(padded, first, per_unit, axis=1)
    ids = jnp.where(index[None, :] < n, ids, -1)
    return jnp.where(
        ids >= 0, layout.block_row(jnp.asarray(layer, jnp.int32), ids), layout.sink_row
    )


def predicted_table(
    spec: CacheSpec,
    state: PoolState,
    previous: jax.Array,  # int32[batch, S]: the layer's last selection
    lengths: jax.Array,
    reads: jax.Array,  # bool[batch]: slots whose rows read keys
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(prediction, table, lengths)``: a layer's predicted blocks (logical), and their
    compacted physical table and lengths (a dense walk over it reads them)."""
    bt = spec.block_tokens
    predicted = prediction.predict(state.sparse.config, previous, lengths, bt, spec.max_blocks)
    predicted = jnp.where(reads[:, None], predicted, selection.NONE)
    table, compact_lengths = selection.compact(predicted, state.block_table, lengths, bt)
    return predicted, table, compact_lengths


def sparse_pool_layer(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,
    state: PoolState,
    *,
    layer,
    implementation: str,
    scale: float,
    soft_cap: float | None,
    kernel_options: dict,
    counts: jax.Array | None = None,
) -> tuple[jax.Array, PoolState]:
    """One layer of a step over a host pool with sparse decode (see the module doc)."""
    spec = state.spec
    sparse = state.sparse
    batch, q_len = q.shape[:2]
    _, over, grow, bad_layer = step_grow(spec, state, q_len, counts, layer)
    if q_len > 1 or not layer_is_global(spec, layer):
        out, after = host_pool.pool_layer(
            q,
            k,
            v,
            state.replace(sparse=None),
            layer=layer,
            implementation=implementation,
            scale=scale,
            soft_cap=soft_cap,
            kernel_options=kernel_options,
            counts=counts,
        )
        summaries = written_summaries(spec, state, sparse.summaries, layer, k, grow)
        # A staged summary chunk may miss the rows a dense step wrote into its blocks.
        unstaged = jnp.full_like(sparse.staged_layer, NOT_STAGED)
        return out, after.replace(sparse=sparse.replace(summaries=summaries, staged_layer=unstaged))

    layout = PoolLayout(spec)
    bt = spec.block_tokens
    lengths = state.lengths
    active = state.capacity > 0
    wanted = jnp.where(active, 1 if counts is None else counts, 0).astype(jnp.int32)
    layer_id = jnp.asarray(layer, jnp.int32)
    safe_layer = jnp.clip(layer_id, 0, spec.num_layers - 1)
    last_layer = layer_id == spec.num_layers - 1
    reads = grow > 0 if counts is not None else active

    # 1. The predicted walk's first unit: staged by the layer (or step) before, if it came
    # from the rows needed now.
    previous = sparse.previous[safe_layer]
    predicted, pred_table, pred_lengths = predicted_table(spec, state, previous, lengths, reads)
    tail_at = host_pool.tail_row(layout, state, layer, lengths)[:, None]
    need = jnp.concatenate([table_rows(layout, pred_table, layer, 0), tail_at], axis=1)
    staging, tail, staged_at = state.staged_units[0]
    staging, tail = lax.cond(
        jnp.all(staged_at == need),
        lambda: (staging, tail),
        lambda: host_pool.fetch(layout, state.pool, need),
    )

    # 2. The new rows into the pool, their keys into the summaries.
    pool = host_pool.write_rows(
        layout, state, state.pool, layer, pool_rows_of(layout, k, v), tail, grow
    )
    summaries = written_summaries(spec, state, sparse.summaries, layer, k, grow)

    # 3. The exact selection, and what it adds to the prediction. The first summary chunk
    # was copied a layer ahead (the rows this layer wrote since are in its last context
    # block, always selected, or past its context: the selection is the same).
    first_chunk = lax.cond(
        sparse.staged_layer == layer_id,
        lambda: sparse.staged_chunk,
        lambda: summary_chunk(spec, summaries, layer, 0),
    )
    # The next layer's first summary chunk is copied a layer ahead, while this layer's last
    # chunk is scored (a sliding layer has none).
    next_layer = jnp.where(last_layer, 0, layer_id + 1)
    stages_next = not (
        isinstance(layer, int) and spec.windows[(layer + 1) % spec.num_layers] is not None
    )
    bounds, next_chunk = score_blocks(
        spec,
        summaries,
        q,
        layer,
        state.block_table,
        first_chunk,
        next_layer if stages_next else None,
    )
    next_staged = next_layer
    if not stages_next:
        next_chunk, next_staged = sparse.staged_chunk, jnp.int32(NOT_STAGED)
    exact = selection.select(sparse.config, bounds, lengths, bt)
    exact = jnp.where(reads[:, None], exact, selection.NONE)
    late = prediction.late(predicted, exact)
    late_table, late_lengths = selection.compact(late, state.block_table, lengths, bt)
    chunk_len = spec.chunk_len
    pred_units = jnp.maximum(1, (jnp.max(pred_lengths) + chunk_len - 1) // chunk_len)
    num_units = pred_units + (jnp.max(late_lengths) + chunk_len - 1) // chunk_len

    # 5. (Needed by the walk's last unit.) The next layer's prediction and first unit.
    new_previous = sparse.previous.at[safe_layer].set(
        jnp.where(bad_layer, previous, jnp.where(reads[:, None], exact, previous))
    )
    next_rows = next_layer_rows(
        spec, state, new_previous, layer, jnp.where(last_layer, active, reads), grow
    )

    # 4. The walk: the predicted units, then the late ones.
    attend = layer_attend(spec, layer, scale, soft_cap, implementation, kernel_options)
    block_len = (
        block_len_for(chunk_len, batch * spec.num_kv_heads * spec.head_dim)
        if implementation == "xla"
        else chunk_len
    )

    def source(unit):
        """(rows, valid lengths, first position) of the walk's unit ``unit``."""
        is_late = unit >= pred_units
        local = jnp.where(is_late, unit - pred_units, unit)
        rows = jnp.where(
            is_late,
            table_rows(layout, late_table, layer, local),
            table_rows(layout, pred_table, layer, local),
        )
        first = jnp.full((batch,), local * chunk_len, jnp.int32)
        return rows, jnp.where(is_late, late_lengths, pred_lengths), first

    def unit_step(unit, carry):
        out, lse, staged = carry
        more = unit + 1 < num_units
        following = jnp.concatenate([source(unit + 1)[0], tail_at], axis=1)
        n_rows = jnp.where(more, following, next_rows)
        with jax.named_scope(host_pool.FETCH_SCOPE):
            n_staging, n_tail = host_pool.fetch(layout, pool, n_rows)
        _, walk_lengths, k_start = source(unit)
        valid = jnp.where(reads, jnp.clip(walk_lengths - k_start, 0, chunk_len), 0)
        with jax.named_scope(host_pool.ATTEND_SCOPE):
            o, l = attend_valid_rows(
                lambda start, n, valid_rows: attend(
                    q,
                    k_start=k_start + start,
                    k_valid=valid_rows,
                    q_start=lengths,
                    **host_pool.unit_kv(
                        layout, lax.dynamic_slice_in_dim(staged[0], start, n, axis=1)
                    ),
                ),
                valid,
                chunk_len,
                block_len,
                q.shape,
            )
        out, lse = kernel_reference.merge_partials(out, lse, o, l)
        return out, lse, (n_staging, n_tail, n_rows)

    out0 = jnp.zeros(q.shape, jnp.float32)
    lse0 = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    # The first unit outside the loop: its attention needs no scoring.
    carry = unit_step(jnp.int32(0), (out0, lse0, (staging, tail, need)))
    out, lse, staged = lax.fori_loop(1, num_units, unit_step, carry)

    # The new tokens attend to themselves (a slot's padding rows are no keys).
    own = plan.own_rows(batch, q_len, counts)
    o, l = attend(q, k.astype(spec.dtype), v.astype(spec.dtype), lengths, own, lengths)
    out, _ = kernel_reference.merge_partials(out, lse, o, l)

    context = selection.context_blocks(lengths, bt)
    layer_counts = jnp.concatenate(
        [
            prediction.counts(predicted, exact),
            jnp.ones((1,), jnp.int32),
            jnp.sum(reads & (lengths > 0), dtype=jnp.int32)[None],
            jnp.sum(jnp.where(reads, context, 0), dtype=jnp.int32)[None],
        ]
    )
    counts_now = sparse.counts.at[safe_layer].add(jnp.where(bad_layer, 0, layer_counts))
    state = state.with_staged_units([staged]).replace(
        lengths=jnp.where(last_layer, lengths + grow, lengths),
        pool=pool,
        refused=state.refused + jnp.where((last_layer | bad_layer) & over, wanted, 0),
        sparse=sparse.replace(
            summaries=summaries,
            previous=new_previous,
            counts=counts_now,
            staged_chunk=next_chunk,
            staged_layer=next_staged.astype(jnp.int32),
        ),
    )
    return out.astype(q.dtype), state


def next_layer_rows(
    spec: CacheSpec,
    state: PoolState,
    previous: jax.Array,  # int32[num_layers, batch, S]: the selections after this layer's
    layer,
    reads: jax.Array,  # bool[batch]: slots whose rows the next layer's walk reads
    grow: jax.Array,
) -> jax.Array:  # int32[batch, blocks_per_unit + 1]
    """Pool rows of the unit after this layer's last: the next layer's first predicted unit
    (a sliding layer's: its first dense unit), or past the last layer the next step's
    layer 0's, at the lengths it will have."""
    layout = PoolLayout(spec)
    layer_id = jnp.asarray(layer, jnp.int32)
    last_layer = layer_id == spec.num_layers - 1
    lengths = jnp.where(last_layer, state.lengths + grow, state.lengths)
    if isinstance(layer, int):
        following = (layer + 1) % spec.num_layers
        if spec.windows[following] is not None:
            return host_pool.unit_rows(layout, state, following, 0, lengths)
    else:
        following = jnp.where(last_layer, 0, layer_id + 1)
    _, table, _ = predicted_table(spec, state, previous[following], lengths, reads)
    tail_at = host_pool.tail_row(layout, state, following, lengths)[:, None]
    return jnp.concatenate([table_rows(layout, table, following, 0), tail_at], axis=1)
