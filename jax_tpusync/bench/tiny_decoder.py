"""The benchmarks' token-in, logits-out decoder: random weights, attention offloaded.

Token embedding (unit variance), then per layer: RMS norm, q/k/v projections,
:func:`jax_tpusync.prefetching_attention`, an output projection; RMS norm and a SiLU MLP
(each with a residual); and logits of the last token: its normalized state times an
untied output matrix (logits of unit spread; a tied one would let every token's own
embedding decide the next token, whatever the context).
Small enough to prefill tens of thousands of tokens on a CPU, real enough that its KV is
the model's own projections of its hidden states.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Decoder:
    layers: int = 4
    d_model: int = 512
    q_heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    ffn: int = 1024
    vocab: int = 1024
    # Multiplies the queries. At 1, attention over a long random-weight context is nearly
    # uniform (logits of unit spread), so the output hardly depends on which tokens are
    # there; a larger gain makes a few keys win, as retrieval heads of trained models do.
    q_gain: float = 1.0

    @classmethod
    def of(cls, args: Any) -> Decoder:
        """The decoder an argparse namespace with these field names describes."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def add_arguments(p, *, defaults: Decoder = Decoder()) -> None:
    """``--layers``, ``--d-model``, ... for every field of :class:`Decoder`."""
    for f in dataclasses.fields(Decoder):
        default = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default)


def init_params(cfg: Decoder, seed: int) -> dict:
    """Scaled-normal bfloat16 weights drawn from ``seed``."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    d, hd = cfg.d_model, cfg.head_dim

    def w(*shape, gain=None):
        gain = 1 / math.sqrt(shape[0]) if gain is None else gain
        return jnp.asarray(rng.standard_normal(shape, np.float32) * gain, jnp.bfloat16)

    layers = [
        dict(
            wq=w(d, cfg.q_heads * hd),
            wk=w(d, cfg.kv_heads * hd),
            wv=w(d, cfg.kv_heads * hd),
            wo=w(cfg.q_heads * hd, d),
            w1=w(d, cfg.ffn),
            w2=w(cfg.ffn, d),
        )
        for _ in range(cfg.layers)
    ]
    return dict(embed=w(cfg.vocab, d, gain=1.0), layers=layers, unembed=w(d, cfg.vocab))


def forward(cfg: Decoder, params: dict, tokens, state):
    """tokens int32[batch, T] -> (logits f32[batch, vocab] of each last token, state)."""
    import jax
    import jax.numpy as jnp

    import jax_tpusync as tps

    def norm(x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    x = params["embed"][tokens]  # [batch, T, d]
    b, t = tokens.shape
    for layer, p in enumerate(params["layers"]):
        h = norm(x)
        q = (h @ p["wq"]).reshape(b, t, cfg.q_heads, cfg.head_dim)
        if cfg.q_gain != 1.0:
            q = q * cfg.q_gain
        k = (h @ p["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = (h @ p["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        o, state = tps.prefetching_attention(q, k, v, state, layer=layer)
        x = x + o.reshape(b, t, -1) @ p["wo"]
        x = x + jax.nn.silu(norm(x) @ p["w1"]) @ p["w2"]
    logits = (norm(x[:, -1]) @ params["unembed"]).astype(jnp.float32)
    return logits, state
