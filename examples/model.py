"""A small Llama-style decoder in plain JAX, with the attention call as a parameter.

RMSNorm, rotary position embeddings (RoPE), grouped-query attention and a SwiGLU MLP, with
random weights drawn from a seed. :func:`forward` takes the attention as a callback, so the
offloaded model and the resident one below share every line except that call:

* :func:`make_offloaded_step` attends with :func:`jax_tpusync.prefetching_attention` over an
  :class:`jax_tpusync.OffloadedKVCache` kept in host DRAM or in a file;
* :func:`make_resident_step` attends with :func:`jax_tpusync.resident_attention` over per-layer
  ``[batch, max_len, kv_heads, head_dim]`` arrays in device memory.

Both steps are ``jax.jit`` functions that donate their cache argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model sizes. ``d_model`` is free; attention projects it to ``q_heads * head_dim``."""

    layers: int = 4
    d_model: int = 512
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    ffn: int = 1024
    vocab: int = 512
    dtype: Any = jnp.bfloat16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")

    @property
    def num_params(self) -> int:
        d, a, kv = self.d_model, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * d + d * a + 2 * d * kv + a * d + 3 * d * self.ffn
        return self.layers * per_layer + 2 * self.vocab * d + d


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random weights (scaled normal), as a pytree of ``cfg.dtype`` arrays."""
    rng = np.random.default_rng(seed)
    d, a, kv = cfg.d_model, cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def w(fan_in, *shape):
        x = rng.standard_normal(shape, dtype=np.float32) / math.sqrt(fan_in)
        return jnp.asarray(x, cfg.dtype)

    layers = [
        dict(
            attn_norm=jnp.ones((d,), cfg.dtype),
            wq=w(d, d, a),
            wk=w(d, d, kv),
            wv=w(d, d, kv),
            wo=w(a, a, d),
            mlp_norm=jnp.ones((d,), cfg.dtype),
            w1=w(d, d, cfg.ffn),
            w3=w(d, d, cfg.ffn),
            w2=w(cfg.ffn, cfg.ffn, d),
        )
        for _ in range(cfg.layers)
    ]
    return dict(
        embed=w(1, cfg.vocab, d),
        layers=layers,
        final_norm=jnp.ones((d,), cfg.dtype),
        lm_head=w(d, d, cfg.vocab),
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half form) of ``x`` [B, T, heads, D] at int32 ``positions`` [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# attend(layer, q, k, v, cache) -> (out [B, T, q_heads, D], cache)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: Any,
    attend: Attend,
) -> tuple[jax.Array, Any]:
    """Logits [B, T, vocab] (f32) of ``tokens`` [B, T] at ``positions`` [B, T]."""
    b, t = tokens.shape
    x = params["embed"][tokens]  # [B, T, d_model]
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
        q = (h @ p["wq"]).reshape(b, t, cfg.q_heads, cfg.head_dim)
        k = (h @ p["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = (h @ p["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        o, cache = attend(i, q, k, v, cache)  # The one line that differs between the models.
        x = x + o.reshape(b, t, -1) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        x = x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    return (x @ params["lm_head"]).astype(jnp.float32), cache


def _positions(lengths: jax.Array, t: int) -> jax.Array:
    return lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def make_offloaded_step(cfg: ModelConfig):
    """``step(params, tokens, state) -> (logits, state)``; ``state`` (a KVState) is donated."""

    def attend(layer, q, k, v, state):
        return tps.prefetching_attention(q, k, v, state, layer=layer)

    def step(params, tokens, state):
        positions = _positions(state.lengths, tokens.shape[1])
        return forward(params, cfg, tokens, positions, state, attend)

    return jax.jit(step, donate_argnums=(2,))


def as_resident_words(kv: np.ndarray) -> np.ndarray:
    """16-bit float KV viewed as ``uint16`` words (the same bytes); other dtypes unchanged."""
    kv = np.asarray(kv)
    return kv.view(np.uint16) if kv.dtype.itemsize == 2 else kv


def make_resident_step(cfg: ModelConfig, unit_len: int | None = None):
    """``step(params, tokens, (ks, vs, lengths)) -> (logits, (ks, vs, lengths))``.

    ``ks``/``vs`` are per-layer [B, max_len, kv_heads, head_dim] arrays (donated), in
    ``cfg.dtype`` or, for 16-bit dtypes, as the ``uint16`` words :func:`as_resident_words`
    makes (XLA's CPU backend updates those in place; bf16 caches it copies every step).
    ``unit_len``: process the cache in units of this many tokens, like the offloaded cache
    does with ``spec.chunk_len`` (same operations, so the results agree to rounding).
    """

    def attend(layer, q, k, v, cache):
        ks, vs, lengths = cache
        out, ks[layer], vs[layer] = tps.resident_attention(
            q, k, v, ks[layer], vs[layer], lengths, unit_len=unit_len, kv_dtype=cfg.dtype
        )
        return out, (ks, vs, lengths)

    def step(params, tokens, cache):
        ks, vs, lengths = cache
        positions = _positions(lengths, tokens.shape[1])
        logits, (ks, vs, _) = forward(
            params, cfg, tokens, positions, (list(ks), list(vs), lengths), attend
        )
        return logits, (ks, vs, lengths + tokens.shape[1])

    return jax.jit(step, donate_argnums=(2,))
