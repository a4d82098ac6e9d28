"""How near a sparse decode row comes to dense attention, measured in one call: the exact
selection's share of the dense softmax weight (recall), the output's relative error, and
how the layer-ahead prediction did.

:func:`measure` takes one layer's decode query and the KV of every cached position (the
step's own new row included), makes the summaries and the selection as a sparse step does,
and attends three ways: densely, over the exact selection, and over what a layer-ahead step
reads (the prediction plus the late blocks: the exact selection with the predicted blocks it
does not need, which are attended too). The quality benchmarks and
:func:`jax_tpusync.quality.compare_sparse` are built on it.

As on an engine cache, the blocks are chosen among the positions cached before the step
(its own row excluded: the summaries, the selection's size, its sink and recent blocks and
the prediction all follow from them), and the step's own row is always attended. So where
the context before the step is whole blocks, the recent block is the last full one, not the
new block the row opens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_tpusync.sparse import prediction, reference, select, summaries
from jax_tpusync.sparse.config import SparseConfig


class Measures(NamedTuple):
    """One layer's decode row against dense attention (per slot and query head where the
    shape says so)."""

    dense: jax.Array  # float32[batch, num_q_heads, head_dim]: dense attention's output
    sparse: jax.Array  # float32[batch, num_q_heads, head_dim]: over what the step reads
    selection: jax.Array  # int32[batch, S]: the exact selection (next step's prediction)
    recall: jax.Array  # float32[batch, num_q_heads]: dense weight the exact selection holds
    read_recall: jax.Array  # float32[batch, num_q_heads]: ... that what the step reads holds
    error: jax.Array  # float32[batch, num_q_heads]: |exact-selection out - dense| / |dense|
    read_error: jax.Array  # float32[batch, num_q_heads]: |sparse - dense| / |dense|
    counts: jax.Array  # int32[4]: prediction.COUNTS, summed over the batch
    read_blocks: jax.Array  # int32[batch]: cached blocks the step reads (prediction and late)


def blocks_mask(
    selection: jax.Array,  # int32[batch, S]: logical blocks (-1: none)
    lengths: jax.Array,  # int32[batch]
    tokens: int,
    block_tokens: int,
) -> jax.Array:  # bool[batch, tokens]
    """The cached positions the blocks of ``selection`` hold (as :func:`.reference.block_mask`,
    by a scatter over blocks rather than a comparison of every position with every entry:
    it stays small at long contexts)."""
    batch = selection.shape[0]
    num_blocks = -(-tokens // block_tokens)
    target = jnp.where(selection >= 0, selection, num_blocks)
    chosen = jnp.zeros((batch, num_blocks + 1), bool)
    chosen = chosen.at[jnp.arange(batch)[:, None], target].set(True)[:, :num_blocks]
    mask = jnp.repeat(chosen, block_tokens, axis=1)[:, :tokens]
    return mask & (jnp.arange(tokens)[None, :] < jnp.asarray(lengths)[:, None])


def _softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax of scores [batch, num_q_heads, tokens] over the masked positions."""
    return jax.nn.softmax(jnp.where(mask[:, None, :], scores, -jnp.inf), axis=-1)


def _attend(weights: jax.Array, values: jax.Array) -> jax.Array:
    """weights [batch, num_q_heads, tokens] times values [batch, tokens, H, D]."""
    batch, num_q_heads, _ = weights.shape
    heads = values.shape[2]
    w = weights.reshape(batch, heads, num_q_heads // heads, -1)
    out = jnp.einsum("bhgt,bthd->bhgd", w, values.astype(jnp.float32))
    return out.reshape(batch, num_q_heads, -1)


def _relative(out: jax.Array, dense: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(dense, axis=-1)
    return jnp.linalg.norm(out - dense, axis=-1) / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)


def measure(
    config: SparseConfig,
    q: jax.Array,  # [batch, num_q_heads, head_dim]: one decode row per slot
    keys: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]: the step's new row included
    values: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]
    lengths: jax.Array,  # int32[batch]: valid rows of each slot (the new row included)
    block_tokens: int,
    previous: jax.Array | None = None,  # int32[batch, S]: last step's selection (None: none)
    scale: float | None = None,
) -> Measures:
    """One layer's decode row, dense and sparse (see the module doc).

    ``keys`` may be longer than any slot's context (rows past ``lengths`` are ignored); the
    selection's width follows from its length in blocks (``config.max_selected``), so pass
    arrays sized to the longest context, not to a cache's capacity, for a share budget.
    """
    batch, tokens = keys.shape[:2]
    lengths = jnp.asarray(lengths, jnp.int32)
    cached = jnp.maximum(lengths - 1, 0)  # positions before the step's own row
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    lo, hi = summaries.of_keys(keys, cached, block_tokens)
    bounds = summaries.score_bounds(q[:, None], lo, hi)
    exact = select.select(config, bounds, cached, block_tokens)
    if previous is None:
        previous = jnp.full(exact.shape, select.NONE, jnp.int32)
    predicted = prediction.predict(config, previous, cached, block_tokens, lo.shape[1])
    counts = prediction.counts(predicted, exact)
    position = jnp.arange(tokens)[None, :]
    own_row = (position == cached[:, None]) & (lengths[:, None] > 0)
    exact_mask = blocks_mask(exact, cached, tokens, block_tokens) | own_row
    read_mask = exact_mask | blocks_mask(predicted, cached, tokens, block_tokens)
    valid = position < lengths[:, None]
    scores = reference.logits(q, keys, scale)  # once: every attention below reuses them
    dense_p = _softmax(scores, valid)
    dense = _attend(dense_p, values)
    exact_out = _attend(_softmax(scores, exact_mask), values)
    read_out = _attend(_softmax(scores, read_mask), values)
    read_blocks = _blocks_read(exact, predicted, lo.shape[1])
    return Measures(
        dense=dense,
        sparse=read_out,
        selection=exact,
        recall=jnp.sum(jnp.where(exact_mask[:, None], dense_p, 0.0), axis=-1),
        read_recall=jnp.sum(jnp.where(read_mask[:, None], dense_p, 0.0), axis=-1),
        error=_relative(exact_out, dense),
        read_error=_relative(read_out, dense),
        counts=counts,
        read_blocks=read_blocks,
    )


def _blocks_read(exact: jax.Array, predicted: jax.Array, num_blocks: int) -> jax.Array:
    """int32[batch]: the blocks in the exact selection or the prediction."""
    batch = exact.shape[0]
    both = jnp.concatenate([exact, predicted], axis=-1)
    target = jnp.where(both >= 0, both, num_blocks)
    chosen = jnp.zeros((batch, num_blocks + 1), bool)
    chosen = chosen.at[jnp.arange(batch)[:, None], target].set(True)[:, :num_blocks]
    return jnp.sum(chosen, axis=-1).astype(jnp.int32)


def with_row(
    kv: tuple[Sequence[jax.Array], Sequence[jax.Array]],  # per layer [batch, tokens, H, D]
    layer: int,
    k: jax.Array,  # [batch, 1, H, D]: the decode row's key
    v: jax.Array,  # [batch, 1, H, D]
    at,  # int or int32[]: its position
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Every layer's keys and values with the decode row written at ``at`` of ``layer``
    (what a measured decode step's attention sees)."""
    keys, values = list(kv[0]), list(kv[1])
    where = (0, at, 0, 0)
    keys[layer] = jax.lax.dynamic_update_slice(keys[layer], k.astype(keys[layer].dtype), where)
    values[layer] = jax.lax.dynamic_update_slice(
        values[layer], v.astype(values[layer].dtype), where
    )
    return tuple(keys), tuple(values)
