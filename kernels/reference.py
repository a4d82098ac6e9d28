"""Plain-jnp reference implementation of per-chunk attention.

This module is the numerical oracle for the Pallas kernels. It favours clarity
over speed: everything is computed in f32 with explicit masks, and it runs on
any backend.

A KV cache is streamed through a fixed-size device buffer one chunk at a time.
Each chunk produces a partial result ``(out, lse)`` where ``out`` is normalized
within the chunk and ``lse`` is the log-sum-exp of the chunk's logits. Partial
results from different chunks are combined with :func:`merge_partials`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _common

__all__ = [
    "attention_reference",
    "chunk_attention_reference",
    "merge_partials",
    "visibility_mask",
]

_HIGHEST = jax.lax.Precision.HIGHEST


def visibility_mask(
    q_pos: jax.Array,  # int32[batch, q_len]: absolute query positions
    k_idx: jax.Array,  # int32[chunk_len]: key index inside the chunk
    k_start: jax.Array,  # int32[batch]
    k_valid: jax.Array,  # int32[batch]
    *,
    window: int | None,
) -> jax.Array:  # bool[batch, q_len, chunk_len]
    """Returns which keys each query may attend to.

    Key ``j`` (absolute position ``k_start + j``) is visible to a query at
    absolute position ``qp`` iff ``j < k_valid``, ``k_start + j <= qp``
    (causal) and, with a sliding window of ``W`` tokens, ``k_start + j > qp -
    W``. The window includes the query's own position (Mistral/Gemma
    convention).

    Args:
      q_pos: Absolute query positions.
      k_idx: Key indices within the chunk.
      k_start: Absolute position of key 0 per batch row.
      k_valid: Number of valid keys per batch row.
      window: Sliding-window size in tokens, or None for full causal attention.

    Returns:
      Boolean visibility mask.
    """
    qp = q_pos[:, :, None]
    kp = (k_start[:, None] + k_idx[None, :])[:, None, :]
    mask = (k_idx[None, None, :] < k_valid[:, None, None]) & (kp <= qp)
    if window is not None:
        mask &= kp > qp - window
    return mask


def chunk_attention_reference(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, chunk_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, chunk_len, num_kv_heads, head_dim]
    k_start: jax.Array,  # int32[batch]: absolute position of k[:, 0]
    k_valid: jax.Array,  # int32[batch]: keys at index >= k_valid are ignored
    q_start: jax.Array,  # int32[batch]: absolute position of q[:, 0]
    *,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
    k_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
    v_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
) -> tuple[jax.Array, jax.Array]:
    """Attention of ``q`` over one KV chunk, normalized within the chunk.

    Grouped-query attention: ``num_q_heads = G * num_kv_heads`` and query head
    ``h`` reads KV head ``h // G``. Keys at index ``>= k_valid`` may hold
    garbage (including NaN/inf); they never reach the result.

    Args:
      q: Queries; query ``i`` sits at absolute position ``q_start + i``.
      k: Keys of the chunk.
      v: Values of the chunk.
      k_start: Absolute position of ``k[:, 0]``.
      k_valid: Number of valid keys in the chunk per batch row.
      q_start: Absolute position of ``q[:, 0]``.
      scale: Multiplier applied to ``q . k``.
      soft_cap: If set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      window: Sliding-window size in tokens (including the query itself).
      k_scale: With quantized K/V (``k``/``v`` int8 or float8_e4m3fn codes): key
        ``t`` of head ``h`` stands for ``k[:, t, h] * k_scale[:, t, h]``. Applied to
        the logits, ``(q . k_code) * k_scale``, never as a dequantized copy of ``k``.
      v_scale: Likewise for values: the probabilities are scaled by ``v_scale``
        before ``P . V`` (the softmax's sum is not).

    Returns:
      ``(out, lse)``: ``out`` f32[batch, q_len, num_q_heads, head_dim] and
      ``lse`` f32[batch, q_len, num_q_heads]. A query that sees no key gets
      ``out = 0`` and ``lse = -inf``.

    Raises:
      ValueError: On inconsistent shapes, dtypes or knobs.
    """
    shape = _common.static_validate_inputs(
        q,
        k,
        v,
        k_start,
        k_valid,
        q_start,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        dtypes=_common.REFERENCE_DTYPES,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return _chunk_attention_reference(
        q,
        k,
        v,
        *_common.as_positions(k_start, k_valid, q_start),
        k_scale,
        v_scale,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if window is None else int(window),
        group=shape.group,
    )


# Jitted so that eager callers (tests, debugging) compile one program per
# shape instead of dispatching every op separately.
@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "window", "group"))
def _chunk_attention_reference(
    q, k, v, k_start, k_valid, q_start, k_scale, v_scale, *, scale, soft_cap, window, group
):
    b, t, hq, d = q.shape
    s, hkv, g = k.shape[1], k.shape[2], group
    # [batch, chunk_len, hkv] -> [batch, hkv, 1, 1, chunk_len], against the logits' axes.
    per_key = lambda x: jnp.transpose(x, (0, 2, 1))[:, :, None, None, :]

    q32 = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q32, k.astype(jnp.float32), precision=_HIGHEST)
    if k_scale is not None:
        logits = logits * per_key(k_scale)
    logits = scale * logits
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    q_pos = q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    k_idx = jnp.arange(s, dtype=jnp.int32)
    mask = visibility_mask(q_pos, k_idx, k_start, k_valid, window=window)
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)

    m = jnp.max(logits, axis=-1, keepdims=True)
    # A fully masked row has m = -inf; shifting it by 0 instead keeps exp() at
    # exactly 0 rather than exp(-inf - -inf) = NaN.
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)  # [batch, hkv, g, q_len, chunk_len]
    l = jnp.sum(p, axis=-1)  # [batch, hkv, g, q_len]
    # Invalid values may be NaN and 0 * NaN = NaN, so zero them explicitly.
    v_ok = (k_idx[None, :] < k_valid[:, None])[:, :, None, None]
    v32 = jnp.where(v_ok, v.astype(jnp.float32), 0.0)
    # Scales of invalid keys may be NaN too (0 * NaN = NaN).
    p_v = p if v_scale is None else p * per_key(jnp.where(v_ok[..., 0], v_scale, 0.0))
    acc = jnp.einsum("bkgts,bskd->bkgtd", p_v, v32, precision=_HIGHEST)

    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(seen, m[..., 0] + jnp.log(l_safe), -jnp.inf)
    # [batch, hkv, g, q_len, ...] -> [batch, q_len, hkv * g, ...]
    out = jnp.moveaxis(out, 3, 1).reshape(b, t, hq, d)
    lse = jnp.moveaxis(lse, 3, 1).reshape(b, t, hq)
    return out, lse


@jax.jit
def merge_partials(
    out_a: jax.Array,  # [..., head_dim]
    lse_a: jax.Array,  # [...]
    out_b: jax.Array,  # [..., head_dim]
    lse_b: jax.Array,  # [...]
) -> tuple[jax.Array, jax.Array]:
    """Merges two normalized partial attention results (online softmax).

    The partials must cover disjoint key sets. Either or both ``lse`` may be
    ``-inf`` (no visible key); the result is then the other partial, or zeros
    with ``lse = -inf``, and never NaN.

    Args:
      out_a: Normalized output of the first partial.
      lse_a: Log-sum-exp of the first partial.
      out_b: Normalized output of the second partial.
      lse_b: Log-sum-exp of the second partial.

    Returns:
      ``(out, lse)`` in f32 with the same shapes as the inputs.
    """
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    # exp(-inf - m) = 0, so an empty partial gets zero weight.
    w_a = jnp.exp(lse_a - m)
    w_b = jnp.exp(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    # where() rather than relying on a zero weight: an empty partial's out is
    # not guaranteed finite by every producer, and 0 * NaN = NaN.
    part_a = jnp.where((w_a > 0)[..., None], out_a.astype(jnp.float32), 0.0)
    part_b = jnp.where((w_b > 0)[..., None], out_b.astype(jnp.float32), 0.0)
    out = (part_a * w_a[..., None] + part_b * w_b[..., None]) / total_safe[..., None]
    lse = jnp.where(seen, m + jnp.log(total_safe), -jnp.inf)
    return out, lse


@jax.jit
def merge_many(
    outs: jax.Array,  # [num_parts, ..., head_dim]
    lses: jax.Array,  # [num_parts, ...]
) -> tuple[jax.Array, jax.Array]:
    """Merges partial results stacked along axis 0 (see merge_partials).

    Args:
      outs: Normalized partial outputs.
      lses: Partial log-sum-exps; ``-inf`` marks an empty partial.

    Returns:
      ``(out, lse)`` in f32 without the leading axis.
    """
    lses = lses.astype(jnp.float32)
    m = jnp.max(lses, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m)  # [num_parts, ...]
    total = jnp.sum(w, axis=0)
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    parts = jnp.where((w > 0)[..., None], outs.astype(jnp.float32), 0.0)
    out = jnp.sum(parts * w[..., None], axis=0) / total_safe[..., None]
    lse = jnp.where(seen, m + jnp.log(total_safe), -jnp.inf)
    return out, lse


def attention_reference(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, seq_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, seq_len, num_kv_heads, head_dim]
    q_start: jax.Array,  # int32[batch]: absolute position of q[:, 0]
    kv_len: jax.Array,  # int32[batch]: number of valid cache entries
    *,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [batch, q_len, num_q_heads, head_dim], q.dtype
    """Attention over a whole contiguous cache whose keys sit at 0..seq_len-1.

    Args:
      q: Queries.
      k: Full key cache; only the first ``kv_len[b]`` entries are valid.
      v: Full value cache.
      q_start: Absolute position of ``q[:, 0]``.
      kv_len: Number of valid cache entries per batch row.
      scale: Multiplier applied to ``q . k``.
      soft_cap: Optional logit soft cap.
      window: Optional sliding-window size in tokens.

    Returns:
      The normalized attention output cast to ``q.dtype``.
    """
    k_start = jnp.zeros(q.shape[:1], jnp.int32)
    out, _ = chunk_attention_reference(
        q,
        k,
        v,
        k_start,
        kv_len,
        q_start,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
    )
    return out.astype(q.dtype)
