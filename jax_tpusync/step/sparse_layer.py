"""One layer of a sparse decode step: the blocks a decode row reads, chosen in-graph and
walked through a compacted block table (``CacheSpec.sparse``).

Attention over a decode row's cached positions needs no position order (keys are stored
after RoPE, and no causal mask applies inside the cache), so a sparse layer is the dense
unit walk of :func:`jax_tpusync.step.streamed.streamed_layer` over a table that holds only
the selected blocks (:func:`jax_tpusync.sparse.select.compact`): every path (streamed via
staging, a host tier read in place, a file tier attended where it landed) reads just those
blocks, with no new kernel. Per global layer of a decode step:

1. the layer's **prediction** (its selection at the previous step, with this step's sink
   and recent blocks, never more blocks than this step's selection will hold:
   :func:`jax_tpusync.sparse.prediction.predict`) is the table the
   walk reads first; its first units were fetched ahead, during the previous layer (the
   prefetch ahead follows every layer's predicted table: :class:`~jax_tpusync.step.plan.Walk`);
2. the **exact selection** comes from the query and the layer's block summaries
   (:func:`jax_tpusync.sparse.summaries.score_bounds`, :func:`jax_tpusync.sparse.select.select`);
   the blocks it holds that the prediction missed are read **late**, in a second walk,
   merged by online softmax. Predicted blocks the exact selection does not hold (wasted)
   are still attended: real KV, which only brings the output nearer the dense one. So a
   row attends to exactly the blocks of ``predicted | exact``;
3. the exact selection becomes the layer's next prediction, and the counts (predicted,
   hits, late, wasted, and the blocks a dense step would read) add up in the state;
4. the step's new keys update their blocks' summaries (every step, dense ones too), in
   place, after the exact selection has read them.

A step whose rows are not one decode row per slot (``q_len > 1``: a prefill chunk, or a
ragged step with one) reads densely: its rows' queries would each select, and a chunk
attends to most of its context anyway. Sliding-window layers always read their window
densely.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_tpusync.core import quantize
from jax_tpusync.core.state import NO_WINDOW, CacheSpec, KVState, SparseState
from jax_tpusync.sparse import prediction, select, summaries
from jax_tpusync.step import plan, streamed


def sparse_layer(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,
    state: KVState,
    token: jax.Array,  # the write-back's token
    grow: jax.Array,  # int32[batch]: tokens each slot takes this step
    *,
    layer,
    counts: jax.Array | None = None,  # int32[batch]: real rows per slot (None: q_len)
    **options,
) -> tuple[jax.Array, KVState]:
    """Steps 2 and 3 of one layer of a sparse cache (see the module doc), its write-back
    queued (``token``): ``(out, state)``."""
    spec = state.spec
    q_len = q.shape[1]
    sparse = state.sparse
    real = plan.step_grow(state, q_len, counts)  # Rows each active slot writes.
    if q_len != 1:  # A prefill chunk (or a ragged step with one): dense.
        lo, hi = summaries_after(spec, sparse, state, layer, k, real)
        state = state.replace(sparse=sparse.replace(lo=lo, hi=hi))
        return streamed.streamed_layer(
            q, k, v, state, token, grow, layer=layer, counts=counts, **options
        )
    lengths, table = state.lengths, state.block_table
    deciding = (real > 0)[:, None]  # Slots with a decode row this step.
    is_global = spec.windows_array() >= NO_WINDOW  # bool[num_layers]
    here_global = is_global[layer]

    # The exact selection from the query and the summaries (as they were before this
    # step's rows: they describe exactly the cached positions).
    exact = exact_selection(spec, sparse, layer, q, lengths, table)
    # Then the step's rows enter the summaries, in place. The update depends on the
    # selection by data (a test that never holds: a selection's entries are never below
    # NONE, which XLA cannot prove), so the old summaries are read before they are
    # overwritten; without it XLA copies both whole summary arrays, every layer's, per
    # layer and step (an optimization_barrier does not order them on CPU).
    real_after = jnp.where(exact[:, 0] < select.NONE, 0, real)
    lo, hi = summaries_after(spec, sparse, state, layer, k, real_after)
    predicted = predicted_blocks(spec, sparse.previous[layer], lengths)
    # The walk reads the prediction of every slot, as the prefetch ahead did; a slot
    # without a decode row reads no late block and counts nothing.
    walk_table, walk_lengths = compacted(spec, predicted, table, lengths)
    counted = deciding & here_global
    none = jnp.full_like(exact, select.NONE)
    exact = jnp.where(counted, exact, none)
    late = jnp.where(counted, prediction.late(predicted, exact), none)
    predicted = jnp.where(counted, predicted, jnp.full_like(predicted, select.NONE))
    late_table, late_lengths = compacted(spec, late, table, lengths)
    # A sliding layer walks its own table densely (its window).
    walk_table = jnp.where(here_global, walk_table, table)
    walk_lengths = jnp.where(here_global, walk_lengths, lengths)

    previous = sparse.previous.at[layer].set(jnp.where(counted, exact, sparse.previous[layer]))
    context = jnp.sum(
        jnp.where(deciding[:, 0], select.context_blocks(lengths, spec.block_tokens), 0)
    )
    layer_counts = jnp.concatenate(
        [prediction.counts(predicted, exact), context[None].astype(jnp.int32)]
    )
    layer_counts = jnp.where(here_global, layer_counts, 0)
    new_sparse = SparseState(
        lo=lo,
        hi=hi,
        previous=previous,
        counts=sparse.counts.at[layer].add(layer_counts),
        steps=sparse.steps + jnp.asarray(layer == spec.num_layers - 1, jnp.int32),
    )

    next_lengths = lengths + grow

    def table_ahead(p_layer, next_step):
        # This step: the layer's prediction from the state it entered with; the next
        # step's: from the selections this step has made so far.
        source = jnp.where(next_step, previous[p_layer], sparse.previous[p_layer])
        lens = jnp.where(next_step, next_lengths, lengths)
        blocks = predicted_blocks(spec, source, lens)
        ahead, _ = compacted(spec, blocks, table, lens)
        return jnp.where(is_global[p_layer], ahead, table)

    walk = plan.Walk(
        table=walk_table,
        lengths=walk_lengths,
        layer_lengths=walk_lengths_of(spec, sparse.previous, lengths, table, is_global),
        next_layer_lengths=walk_lengths_of(spec, previous, next_lengths, table, is_global),
        table_ahead=table_ahead,
        late_table=late_table,
        late_lengths=jnp.where(here_global, late_lengths, 0),
    )
    out, state = streamed.streamed_layer(
        q, k, v, state, token, grow, layer=layer, counts=counts, walk=walk, **options
    )
    return out, state.replace(sparse=new_sparse)


def summaries_after(
    spec: CacheSpec,
    sparse: SparseState,
    state: KVState,
    layer,
    k: jax.Array,  # [batch, q_len, H, D]: the step's new keys
    real: jax.Array,  # int32[batch]: the rows each slot writes (0: none)
) -> tuple[jax.Array, jax.Array]:
    """``(lo, hi)`` with the step's written keys of ``layer`` in their blocks' summaries."""
    batch, q_len = k.shape[:2]
    positions = state.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    index = positions // spec.block_tokens
    physical = jnp.take_along_axis(
        state.block_table, jnp.clip(index, 0, spec.max_blocks - 1), axis=1
    )
    written = (jnp.arange(q_len)[None, :] < real[:, None]) & (index < spec.max_blocks)
    physical = jnp.where(written, physical, -1)
    keys = k.astype(spec.dtype)
    if spec.quantized:  # What the tier's rows stand for, as the host reads them back.
        rows = streamed.new_rows(spec, k, k)[0]
        codes, scales = quantize.unpack(rows, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
        keys = quantize.dequantize(codes, scales, spec.dtype)
    keys = keys.reshape(batch * q_len, spec.num_kv_heads, spec.head_dim)
    return summaries.update(
        sparse.lo,
        sparse.hi,
        physical.reshape(-1),
        (positions % spec.block_tokens).reshape(-1),
        keys,
        layer=layer,
    )


def exact_selection(
    spec: CacheSpec,
    sparse: SparseState,
    layer,
    q: jax.Array,  # [batch, 1, num_q_heads, head_dim]
    lengths: jax.Array,
    table: jax.Array,  # int32[batch, max_blocks]
) -> jax.Array:  # int32[batch, max_selected]
    """Each slot's selection for ``q`` from ``layer``'s summaries of its blocks."""
    safe = jnp.clip(table, 0, spec.num_blocks - 1)
    bounds = summaries.score_bounds(q, sparse.lo[layer][safe], sparse.hi[layer][safe])
    return select.select(spec.sparse, bounds, lengths, spec.block_tokens)


def predicted_blocks(spec: CacheSpec, previous: jax.Array, lengths: jax.Array) -> jax.Array:
    """int32[batch, max_blocks]: a layer's prediction at ``lengths`` from its previous
    selection (ascending, -1 padded; never more than the blocks of a slot)."""
    blocks = prediction.predict(spec.sparse, previous, lengths, spec.block_tokens, spec.max_blocks)
    return fit(blocks, spec.max_blocks)


def fit(blocks: jax.Array, width: int) -> jax.Array:
    """``blocks`` (ascending, -1s last) cut or -1 padded to ``width`` columns."""
    if blocks.shape[1] >= width:
        return blocks[:, :width]
    pad = jnp.full((blocks.shape[0], width - blocks.shape[1]), select.NONE, blocks.dtype)
    return jnp.concatenate([blocks, pad], axis=1)


def compacted(
    spec: CacheSpec, blocks: jax.Array, table: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(table int32[batch, max_blocks], lengths int32[batch])`` a dense walk reads
    exactly ``blocks`` (logical, ascending) through."""
    compact_table, compact_lengths = select.compact(blocks, table, lengths, spec.block_tokens)
    return fit(compact_table, spec.max_blocks), compact_lengths


def walk_lengths_of(
    spec: CacheSpec,
    previous: jax.Array,  # int32[num_layers, batch, S]
    lengths: jax.Array,  # int32[batch]
    table: jax.Array,
    is_global: jax.Array,  # bool[num_layers]
) -> jax.Array:  # int32[num_layers, batch]
    """Every layer's predicted walk lengths at ``lengths`` (a sliding layer's: its own)."""

    def one(prev):
        return compacted(spec, predicted_blocks(spec, prev, lengths), table, lengths)[1]

    predicted = jax.vmap(one)(previous)
    return jnp.where(is_global[:, None], predicted, lengths[None, :])
