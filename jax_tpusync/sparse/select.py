"""Which blocks a decode row reads: the highest score bounds under the budget, plus the sink
and recent blocks, per slot.

The blocks are fetched whole (a block's rows hold every KV head of the shard), so one
selection serves all of a slot's KV heads: a block ranks by the largest, over the heads, of
its bound relative to that head's best block (a log-space bound on the share of the head's
softmax weight it can hold against the head's strongest block), so that a block any head
needs ranks high. Ties go to the lower block.

A selection is int32[batch, max_selected]: logical block indices, ascending, then -1s. The
last block of the context (partly filled, being written) is always selected and always the
last entry, which :func:`compact` relies on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_tpusync.sparse.config import SparseConfig

NONE = -1  # an empty entry of a selection


def context_blocks(lengths: jax.Array, block_tokens: int) -> jax.Array:
    """int32[batch]: blocks holding each slot's cached positions ``[0, length)``."""
    return (jnp.asarray(lengths, jnp.int32) + block_tokens - 1) // block_tokens


def always_read(
    config: SparseConfig, lengths: jax.Array, block_tokens: int, num_blocks: int
) -> jax.Array:  # bool[batch, num_blocks]
    """The sink and recent blocks of each slot's context (where it has them)."""
    nb = context_blocks(lengths, block_tokens)[:, None]
    index = jnp.arange(num_blocks, dtype=jnp.int32)[None, :]
    return (index < nb) & ((index < config.sink_blocks) | (index >= nb - config.recent_blocks))


def select(
    config: SparseConfig,
    bounds: jax.Array,  # float32[batch, num_kv_heads, num_blocks]: score_bounds by logical block
    lengths: jax.Array,  # int32[batch]: cached tokens per slot
    block_tokens: int,
) -> jax.Array:  # int32[batch, max_selected]
    """Each slot's selection (see the module doc)."""
    num_blocks = bounds.shape[-1]
    size = config.max_selected(num_blocks)
    nb = context_blocks(lengths, block_tokens)
    index = jnp.arange(num_blocks, dtype=jnp.int32)[None, :]
    in_context = index < nb[:, None]
    bounds = jnp.where(in_context[:, None, :], bounds.astype(jnp.float32), -jnp.inf)
    best = jnp.max(bounds, axis=-1, keepdims=True)
    relative = jnp.where(jnp.isfinite(best), bounds - best, -jnp.inf).max(axis=1)
    mandatory = always_read(config, lengths, block_tokens, num_blocks)
    rank_key = jnp.where(mandatory, jnp.inf, jnp.where(in_context, relative, -jnp.inf))
    # A block no bound ranks (nan from inf - inf) ranks last among the context's blocks.
    rank_key = jnp.where(jnp.isnan(rank_key), jnp.finfo(jnp.float32).min, rank_key)
    _, top = jax.lax.top_k(rank_key, size)  # stable: ties to the lower index
    count = config.selected_count(nb)
    keep = jnp.arange(size, dtype=jnp.int32)[None, :] < count[:, None]
    chosen = jnp.where(keep, top.astype(jnp.int32), num_blocks)
    chosen = jnp.sort(chosen, axis=-1)
    return jnp.where(chosen < num_blocks, chosen, NONE)


def physical(
    selection: jax.Array,  # int32[batch, S]: logical blocks (-1: none)
    block_table: jax.Array,  # int32[batch, max_blocks]: physical block of each logical one
) -> jax.Array:  # int32[batch, S]
    """The physical blocks of a selection (-1 where it has none)."""
    safe = jnp.clip(selection, 0, block_table.shape[1] - 1)
    return jnp.where(selection >= 0, jnp.take_along_axis(block_table, safe, axis=1), NONE)


def compact(
    selection: jax.Array,  # int32[batch, S]: ascending logical blocks, then -1s
    block_table: jax.Array,  # int32[batch, max_blocks]
    lengths: jax.Array,  # int32[batch]: cached tokens per slot
    block_tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """A block table and lengths under which a dense walk reads exactly the selection:
    ``(table int32[batch, S], lengths int32[batch])``, the selected physical blocks packed
    to the front in order. Every selected block is full but the context's last, which (if
    selected, as every selection from :func:`select` has it) comes last; a selection
    without it holds full blocks only."""
    lengths = jnp.asarray(lengths, jnp.int32)
    table = physical(selection, block_table)
    count = jnp.sum(selection >= 0, axis=-1).astype(jnp.int32)
    last_block = context_blocks(lengths, block_tokens) - 1
    tail = lengths - last_block * block_tokens  # rows of the last context block
    has_last = jnp.any(selection == last_block[:, None], axis=-1) & (lengths > 0)
    compact_len = jnp.where(has_last, (count - 1) * block_tokens + tail, count * block_tokens)
    return table, jnp.where(count > 0, compact_len, 0).astype(jnp.int32)
