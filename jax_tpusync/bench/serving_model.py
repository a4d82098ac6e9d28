"""The ``serve`` and ``prefill`` benchmarks' model, as a serving step.

:mod:`.tiny_decoder`'s decoder (token embedding, per layer an RMS norm, q/k/v projections,
attention, output projection, a SiLU MLP) with rotary position embeddings on q and k, logits
of every row, and the step contract of :class:`jax_tpusync.serving.ServingLoop`::

    step(params, tokens int32[B, T], positions int32[B, T], counts int32[B], state)
        -> (logits f32[B, T, vocab], state)

Three attentions over the same layer math:

* :func:`make_step`: :func:`jax_tpusync.prefetching_attention` with the counts;
* :func:`make_plain_prefill`: plain JAX, one sequence's KV resident in device arrays
  ``[layers, 2, max_len, kv_heads, head_dim]`` (16-bit floats kept as ``uint16`` words, which
  XLA's CPU backend updates in place), each chunk inserted at its position and attended
  in ``block_len``-row slices up to the chunk's end (a ``fori_loop`` of
  :func:`jax_tpusync.kernels.reference.chunk_attention_reference`, merged online);
* :func:`full_logits`: no cache at all, every row over the whole sequence (tests).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jax_tpusync.bench import tiny_decoder


def init_params(cfg: tiny_decoder.Decoder, seed: int, dtype) -> dict:
    """:func:`.tiny_decoder.init_params`'s weights, in ``dtype``."""
    rng = np.random.default_rng(seed)
    d = cfg.d_model
    layers = tiny_decoder.init_layers(
        rng, cfg.layers, d, cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn, dtype
    )
    embed = tiny_decoder.weight(rng, (cfg.vocab, d), dtype, fan_in=1)
    return dict(embed=embed, layers=layers, unembed=tiny_decoder.weight(rng, (d, cfg.vocab), dtype))


def rope(x, positions, theta: float = 10000.0):
    """Rotary embedding (rotate-half) of x [B, T, H, D] at int32 positions [B, T]."""
    import jax.numpy as jnp

    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def forward(cfg: tiny_decoder.Decoder, params, tokens, positions, state, attend):
    """Logits f32[B, T, vocab] of every row; ``attend(layer, q, k, v, state)`` gets q and k
    rotated to ``positions``."""
    import jax.numpy as jnp

    def rotated(layer, q, k, v, state):
        return attend(layer, rope(q, positions), rope(k, positions), v, state)

    x, state = tiny_decoder.run_layers(
        params["layers"],
        params["embed"][tokens],
        state,
        rotated,
        q_heads=cfg.q_heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        q_gain=cfg.q_gain,
        norm=tiny_decoder.rms_norm,
    )
    return (tiny_decoder.rms_norm(x) @ params["unembed"]).astype(jnp.float32), state


def make_step(cfg: tiny_decoder.Decoder, **attention_options):
    """The offloaded serving step (jitted, the state donated)."""
    import jax

    import jax_tpusync as tps

    def step(params, tokens, positions, counts, state):
        def attend(layer, q, k, v, state):
            return tps.prefetching_attention(
                q, k, v, state, layer=layer, query_seq_lengths=counts, **attention_options
            )

        return forward(cfg, params, tokens, positions, state, attend)

    return jax.jit(step, donate_argnums=(4,))


def make_plain_prefill(cfg: tiny_decoder.Decoder, dtype, block_len: int = 512):
    """``prefill(params, tokens [1, T], start int32, kv) -> (logits [1, T, vocab], kv)``,
    jitted, ``kv`` donated: :func:`new_resident_kv`'s arrays holding rows ``[0, start)``."""
    import jax
    import jax.numpy as jnp

    from jax_tpusync.kernels import reference as kref

    words = np.dtype(dtype).itemsize == 2
    scale = 1.0 / math.sqrt(cfg.head_dim)

    def prefill(params, tokens, start, kv):
        t = tokens.shape[1]
        positions = start + jnp.arange(t, dtype=jnp.int32)[None]
        starts = jnp.reshape(start, (1,))

        def attend(layer, q, k, v, kv):
            new = jnp.stack([k[0], v[0]]).astype(dtype)  # [2, T, H, D]
            if words:
                new = jax.lax.bitcast_convert_type(new, jnp.uint16)
            kv = kv.at[layer].set(jax.lax.dynamic_update_slice_in_dim(kv[layer], new, start, 1))
            end = start + t

            def unit(u, carry):
                lo = u * block_len
                rows = jax.lax.dynamic_slice_in_dim(kv[layer], lo, block_len, axis=1)
                if words:
                    rows = jax.lax.bitcast_convert_type(rows, dtype)
                o, lse = kref.chunk_attention_reference(
                    q,
                    rows[0][None],
                    rows[1][None],
                    jnp.reshape(lo, (1,)),
                    jnp.reshape(jnp.clip(end - lo, 0, block_len), (1,)),
                    starts,
                    scale=scale,
                )
                return kref.merge_partials(*carry, o, lse)

            carry = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf))
            o, _ = jax.lax.fori_loop(0, (end + block_len - 1) // block_len, unit, carry)
            return o.astype(q.dtype), kv

        return forward(cfg, params, tokens, positions, kv, attend)

    return jax.jit(prefill, donate_argnums=(3,))


def new_resident_kv(cfg: tiny_decoder.Decoder, max_len: int, dtype, block_len: int = 512):
    """Zeroed ``[layers, 2, max_len rounded up to block_len, kv_heads, head_dim]`` (``uint16``
    words for 16-bit ``dtype``) for :func:`make_plain_prefill`."""
    import jax.numpy as jnp

    rows = -(-max_len // block_len) * block_len
    store = jnp.uint16 if np.dtype(dtype).itemsize == 2 else dtype
    return jnp.zeros((cfg.layers, 2, rows, cfg.kv_heads, cfg.head_dim), store)


@functools.cache
def _full_logits_fn(cfg: tiny_decoder.Decoder):
    import jax
    import jax.numpy as jnp

    scale = 1.0 / math.sqrt(cfg.head_dim)
    group = cfg.q_heads // cfg.kv_heads

    def attend(layer, q, k, v, state):
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
        t = q.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype), state

    def run(params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return forward(cfg, params, tokens, positions, None, attend)[0]

    return jax.jit(run)


def full_logits(cfg: tiny_decoder.Decoder, params, tokens) -> np.ndarray:
    """f32[T, vocab]: every row's logits of one sequence (int ids [T]) with no cache."""
    import jax.numpy as jnp

    return np.asarray(
        _full_logits_fn(cfg)(params, jnp.asarray(np.asarray(tokens)[None], jnp.int32))
    )[0]


def reference_generate(cfg, params, prompt, max_new_tokens: int, pad_to: int) -> list[int]:
    """Greedy tokens of one prompt with no cache: each token recomputes the sequence
    (padded to ``pad_to`` tokens at the end, so that one compiled function serves all)."""
    ids = [int(t) for t in prompt]
    out = []
    for _ in range(max_new_tokens):
        padded = np.zeros(pad_to, np.int32)
        padded[: len(ids)] = ids
        token = int(np.argmax(full_logits(cfg, params, padded)[len(ids) - 1]))
        out.append(token)
        ids.append(token)
    return out
