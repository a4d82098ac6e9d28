"""Layer-ahead prediction: the blocks a layer's fetch starts with before its query exists,
what the exact selection adds when the query is known, and the counts that say how well the
prediction did.

A layer's prediction is the selection it made at the previous step with the blocks every
selection holds at this step's lengths (the recent window moves as tokens are written): a
decode row's important blocks change little from one step to the next. It never holds more
blocks than this step's exact selection will (its size follows from this step's lengths,
known before the layer walk): where the recent window moved on past a block, the previous
selection held that block for being recent, not for its score, and it is the one left out
(otherwise, with the new recent block added, one of the blocks read ahead would be wasted
for sure). What the exact
selection holds beyond the prediction is fetched late; what the prediction holds beyond the
exact selection was read for nothing (it is still attended to: the rows are real KV, and
attending to more of them only brings the output nearer the dense one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_tpusync.sparse import select as selection
from jax_tpusync.sparse.config import SparseConfig

# The order of a layer's counts (int32[4]).
COUNTS = ("predicted", "hits", "late", "wasted")


def _member(entries: jax.Array, of: jax.Array) -> jax.Array:  # bool like entries
    """Which of ``entries`` (int32[batch, S], -1: none) appear in ``of`` (int32[batch, T])."""
    return (entries[:, :, None] == of[:, None, :]).any(-1) & (entries >= 0)


def predict(
    config: SparseConfig,
    previous: jax.Array,  # int32[batch, S]: the layer's selection at the previous step
    lengths: jax.Array,  # int32[batch]: this step's cached tokens per slot
    block_tokens: int,
    num_blocks: int,  # logical blocks a slot holds at most
) -> jax.Array:  # int32[batch, S + config.always_read]
    """The blocks to fetch for a layer before its query exists: ``previous`` (entries past
    this step's context dropped) with this step's sink and recent blocks, ascending, -1s
    last; no more of them than this step's selection holds (``config.selected_count``),
    the previous recent blocks this step's recent window left behind dropped first."""
    nb = selection.context_blocks(lengths, block_tokens)[:, None]
    kept = jnp.where((previous >= 0) & (previous < nb), previous, num_blocks)
    index = jnp.arange(config.always_read, dtype=jnp.int32)[None, :]
    sinks = jnp.where(index < config.sink_blocks, index, num_blocks)
    recent = nb - config.recent_blocks + (index - config.sink_blocks)
    mandatory = jnp.where(index < config.sink_blocks, sinks, recent)
    mandatory = jnp.where((mandatory >= 0) & (mandatory < nb), mandatory, num_blocks)
    merged = jnp.sort(jnp.concatenate([kept, mandatory], axis=-1), axis=-1)
    # Drop repeats: an entry equal to the one before it.
    repeat = jnp.concatenate(
        [jnp.zeros_like(merged[:, :1], bool), merged[:, 1:] == merged[:, :-1]], axis=-1
    )
    merged = jnp.sort(jnp.where(repeat, num_blocks, merged), axis=-1)
    # The previous selection's last entry is its context's last block (select's rule), so
    # its recent window is known: the entries it held as recent that are no longer sink or
    # recent blocks are the ones to leave out where the prediction would outgrow the
    # selection (lowest first).
    previous_last = jnp.max(previous, axis=-1, keepdims=True)
    left_behind = (
        (merged < num_blocks)
        & (merged > previous_last - config.recent_blocks)
        & (merged >= config.sink_blocks)
        & (merged < nb - config.recent_blocks)
    )
    size = jnp.sum(merged < num_blocks, axis=-1, keepdims=True)
    excess = size - config.selected_count(nb[:, 0])[:, None]
    left_rank = jnp.cumsum(left_behind, axis=-1)  # merged is ascending
    merged = jnp.where(left_behind & (left_rank <= excess), num_blocks, merged)
    merged = jnp.sort(merged, axis=-1)
    return jnp.where(merged < num_blocks, merged, selection.NONE).astype(jnp.int32)


def late(
    predicted: jax.Array,  # int32[batch, P]: what was fetched ahead
    exact: jax.Array,  # int32[batch, S]: the exact selection
) -> jax.Array:  # int32[batch, S]
    """The exact selection's blocks the prediction missed: ascending, -1s last."""
    missed = (exact >= 0) & ~_member(exact, predicted)
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(missed, exact, big), axis=-1)
    return jnp.where(ordered < big, ordered, selection.NONE)


def counts(
    predicted: jax.Array,  # int32[batch, P]
    exact: jax.Array,  # int32[batch, S]
) -> jax.Array:  # int32[4]: COUNTS, summed over the batch
    """How the prediction did, in blocks: predicted, hits (predicted and exact), late
    (exact, not predicted), wasted (predicted, not exact)."""
    hits = jnp.sum(_member(predicted, exact))
    num_predicted = jnp.sum(predicted >= 0)
    num_exact = jnp.sum(exact >= 0)
    return jnp.stack([num_predicted, hits, num_exact - hits, num_predicted - hits]).astype(
        jnp.int32
    )
