"""Plain-jnp attention of decode rows over a selection of blocks, and the measures of how
near it comes to dense attention: what tests and the quality benchmark compare against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_mask(
    selection: jax.Array,  # int32[batch, S]: logical blocks (-1: none)
    lengths: jax.Array,  # int32[batch]
    tokens: int,
    block_tokens: int,
) -> jax.Array:  # bool[batch, tokens]
    """The cached positions a selection reads."""
    position = jnp.arange(tokens, dtype=jnp.int32)
    chosen = (position[None, :, None] // block_tokens == selection[:, None, :]).any(-1)
    return chosen & (position[None, :] < jnp.asarray(lengths)[:, None])


def logits(
    q: jax.Array,  # [batch, num_q_heads, head_dim]: one decode row per slot
    keys: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]
    scale: float,
) -> jax.Array:  # float32[batch, num_q_heads, tokens]
    batch, num_q_heads, dim = q.shape
    heads = keys.shape[2]
    qg = q.astype(jnp.float32).reshape(batch, heads, num_q_heads // heads, dim)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, keys.astype(jnp.float32)) * scale
    return s.reshape(batch, num_q_heads, -1)


def attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    keys: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]
    values: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]
    mask: jax.Array,  # bool[batch, tokens]: the positions attended to
    scale: float,
) -> jax.Array:  # float32[batch, num_q_heads, head_dim]
    """Softmax attention of each slot's row over its masked positions."""
    batch, num_q_heads, dim = q.shape
    heads = keys.shape[2]
    s = jnp.where(mask[:, None, :], logits(q, keys, scale), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).reshape(batch, heads, num_q_heads // heads, -1)
    out = jnp.einsum("bhgt,bthd->bhgd", p, values.astype(jnp.float32))
    return out.reshape(batch, num_q_heads, dim)


def recall(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    keys: jax.Array,  # [batch, tokens, num_kv_heads, head_dim]
    lengths: jax.Array,  # int32[batch]
    mask: jax.Array,  # bool[batch, tokens]: the positions a selection reads
    scale: float,
) -> jax.Array:  # float32[batch, num_q_heads]
    """The share of each head's dense softmax weight that the masked positions hold."""
    valid = jnp.arange(keys.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
    s = jnp.where(valid[:, None, :], logits(q, keys, scale), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(jnp.where(mask[:, None, :], p, 0.0), axis=-1)
