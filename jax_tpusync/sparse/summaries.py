"""Block summaries: per KV block and KV head, the channel-wise minimum and maximum of its keys.

For a query ``q`` and any key ``k`` of the block, ``q . k <= sum_d max(q_d * lo_d, q_d *
hi_d)`` (each term bounds ``q_d * k_d`` because ``k_d`` lies in ``[lo_d, hi_d]``): the block's
scores are bounded without reading its rows. Two rows per block and head (``2 * head_dim``
values against ``block_tokens * head_dim`` keys) make the summaries ``1 / block_tokens`` of
the KV bytes (K and V).

Summaries are kept per *physical* block, so blocks a prefix shares between slots share
them. They are exact in the key dtype (a minimum or maximum of values is one of them); a
quantized tier's keys are summarized after dequantization, in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def summary_dtype(key_dtype) -> np.dtype:
    """The dtype summaries are kept in: the key dtype where it is a float, else float32."""
    dtype = np.dtype(key_dtype)
    return (
        dtype
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2
        else np.dtype(np.float32)
    )


def empty(shape: tuple[int, ...], dtype) -> tuple[jax.Array, jax.Array]:
    """``(lo, hi)`` of ``shape`` (``[..., num_blocks, num_kv_heads, head_dim]``) for blocks
    with no rows yet: ``lo`` at the dtype's largest value, ``hi`` at its smallest."""
    finfo = jnp.finfo(dtype)
    return jnp.full(shape, finfo.max, dtype), jnp.full(shape, finfo.min, dtype)


def of_keys(
    keys: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]
    lengths: jax.Array,  # int32[batch]: valid tokens of each slot
    block_tokens: int,
    dtype=None,
) -> tuple[jax.Array, jax.Array]:  # 2 x [batch, ceil(tokens / block_tokens), H, D]
    """Summaries of every block of each slot's first ``lengths`` keys, by logical block
    (blocks past a slot's length stay empty)."""
    batch, tokens, heads, dim = keys.shape
    dtype = summary_dtype(keys.dtype) if dtype is None else dtype
    nb = -(-tokens // block_tokens)
    pad = nb * block_tokens - tokens
    keys = jnp.pad(keys.astype(dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
    valid = jnp.arange(nb * block_tokens)[None, :] < jnp.asarray(lengths)[:, None]
    valid = valid[:, :, None, None]
    finfo = jnp.finfo(dtype)
    lo = jnp.where(valid, keys, finfo.max).reshape(batch, nb, block_tokens, heads, dim)
    hi = jnp.where(valid, keys, finfo.min).reshape(batch, nb, block_tokens, heads, dim)
    return lo.min(axis=2), hi.max(axis=2)


def update(
    lo: jax.Array,  # [num_blocks, H, D] (or [num_layers, num_blocks, H, D] with layer)
    hi: jax.Array,
    physical: jax.Array,  # int32[rows]: the physical block each new row lands in (-1: none)
    offsets: jax.Array,  # int32[rows]: the row's offset in its block
    keys: jax.Array,  # [rows, H, D]
    layer=None,  # int or int32[]: index of the layer axis, or None (no layer axis)
) -> tuple[jax.Array, jax.Array]:
    """The summaries after writing ``keys`` into their blocks.

    A block whose offset-0 row is among the new rows starts afresh (its previous summary
    belonged to a block freed and reused), so what it summarizes is exactly its rows. Rows
    with ``physical < 0`` (padding, inactive slots) change nothing.
    """
    num_blocks = lo.shape[0 if layer is None else 1]
    keys = keys.astype(lo.dtype)
    # Out-of-range indices are dropped by the scatters below.
    target = jnp.where(physical >= 0, physical, num_blocks)
    fresh = jnp.where(offsets == 0, target, num_blocks)
    finfo = jnp.finfo(lo.dtype)
    where = (lambda idx: (idx,)) if layer is None else (lambda idx: (layer, idx))
    lo = lo.at[where(fresh)].set(finfo.max, mode="drop")
    hi = hi.at[where(fresh)].set(finfo.min, mode="drop")
    lo = lo.at[where(target)].min(keys, mode="drop")
    hi = hi.at[where(target)].max(keys, mode="drop")
    return lo, hi


def score_bounds(
    q: jax.Array,  # [batch, q_rows, num_q_heads, head_dim]
    lo: jax.Array,  # [batch, blocks, num_kv_heads, head_dim]
    hi: jax.Array,  # [batch, blocks, num_kv_heads, head_dim]
    rows: jax.Array | None = None,  # bool[batch, q_rows]: real query rows (None: all)
) -> jax.Array:  # float32[batch, num_kv_heads, blocks]
    """An upper bound of ``q . k`` over every key of each block, per KV head: the largest
    over the head's group of query heads and the real query rows."""
    batch, q_rows, num_q_heads, dim = q.shape
    heads = lo.shape[2]
    group = num_q_heads // heads
    qf = q.astype(jnp.float32).reshape(batch, q_rows, heads, group, dim)
    lof, hif = lo.astype(jnp.float32), hi.astype(jnp.float32)
    # max(q * lo, q * hi) == q * (hi where q > 0 else lo): one product per channel.
    pos = jnp.einsum("brhgd,bnhd->brhgn", jnp.maximum(qf, 0.0), hif)
    neg = jnp.einsum("brhgd,bnhd->brhgn", jnp.minimum(qf, 0.0), lof)
    bound = pos + neg  # [batch, q_rows, heads, group, blocks]
    if rows is not None:
        bound = jnp.where(rows[:, :, None, None, None], bound, -jnp.inf)
    return bound.max(axis=(1, 3))
