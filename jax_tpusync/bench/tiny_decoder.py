"""The benchmarks' small decoders: random weights, the attention a callback or offloaded.

Both forms share their weights (:func:`init_layers`: per layer ``wq``, ``wk``, ``wv``,
``wo`` and, with an MLP, ``w1``, ``w2``, scaled-normal draws of one seed) and their layer
math (:func:`run_layers`: q/k/v projections, the attention, an output projection, a SiLU MLP,
each with a residual):

* :class:`Decoder` (``prefix``, ``quality``): token in, logits out. Token embedding (unit
  variance), then per layer an RMS norm before the projections and before the MLP,
  :func:`jax_tpusync.prefetching_attention`, and logits of the last token: its normalized
  state times an untied output matrix (logits of unit spread; a tied one would let every
  token's own embedding decide the next token, whatever the context). Small enough to
  prefill tens of thousands of tokens on a CPU, real enough that its KV is the model's own
  projections of its hidden states.
* :class:`Shape` (``decode``, ``decode --devices``): one decode step's hidden states in and
  out, no norms, ``d_model = q_heads * head_dim``, an MLP only with ``ffn > 0`` (compute that
  reads no KV), in any dtype, with the attention passed in (:func:`step`); :func:`fill`
  writes the same random KV into its caches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

# ``--dtype`` names of the decode step's KV and weights.
DTYPES = ("bf16", "f32", "f16")


def jnp_dtype(name: str):
    """The JAX dtype of a ``--dtype`` name."""
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}[name]


# -- shared weights and layer math ---------------------------------------------------------------


def init_layers(rng, layers: int, d_model: int, q_dim: int, kv_dim: int, ffn: int, dtype):
    """Per-layer weights, each drawn normal and divided by the square root of its fan-in."""

    def w(*dims):
        return weight(rng, dims, dtype)

    out = []
    for _ in range(layers):
        p = dict(wq=w(d_model, q_dim), wk=w(d_model, kv_dim), wv=w(d_model, kv_dim))
        p["wo"] = w(q_dim, d_model)
        if ffn:
            p.update(w1=w(d_model, ffn), w2=w(ffn, d_model))
        out.append(p)
    return out


def weight(rng, dims: tuple[int, ...], dtype, fan_in: int | None = None):
    """A standard-normal draw over ``sqrt(fan_in)`` (default ``dims[0]``) as ``dtype``."""
    import jax.numpy as jnp

    fan_in = dims[0] if fan_in is None else fan_in
    return jnp.asarray(rng.standard_normal(dims, dtype=np.float32) / math.sqrt(fan_in), dtype)


def run_layers(
    layers,
    x,
    state,
    attend: Callable,
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_gain: float = 1.0,
    norm: Callable | None = None,
    mark: Callable | None = None,
):
    """x [B, T, d_model] -> (x, state) through every layer of ``layers``.

    ``attend(layer, q, k, v, state) -> (out, state)``; ``norm`` (if any) is applied before
    the projections and before the MLP; ``mark(begin, x, layer) -> x`` brackets each layer.
    """
    import jax

    b, t = x.shape[:2]
    for layer, p in enumerate(layers):
        if mark is not None:
            x = mark(True, x, layer)
        h = x if norm is None else norm(x)
        q = (h @ p["wq"]).reshape(b, t, q_heads, head_dim)
        if q_gain != 1.0:
            q = q * q_gain
        k = (h @ p["wk"]).reshape(b, t, kv_heads, head_dim)
        v = (h @ p["wv"]).reshape(b, t, kv_heads, head_dim)
        o, state = attend(layer, q, k, v, state)
        x = x + o.reshape(b, t, -1) @ p["wo"]
        if "w1" in p:
            x = x + jax.nn.silu((x if norm is None else norm(x)) @ p["w1"]) @ p["w2"]
        if mark is not None:
            x = mark(False, x, layer)
    return x, state


def prefetch_attend(layer: int, q, k, v, state):
    """The offloaded attention of ``layer``: :func:`jax_tpusync.prefetching_attention`."""
    import jax_tpusync as tps

    return tps.prefetching_attention(q, k, v, state, layer=layer)


def rms_norm(x):
    """RMS norm without a weight, computed in float32."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


# -- token in, logits out ------------------------------------------------------------------------


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
    d, bf16 = cfg.d_model, jnp.bfloat16
    layers = init_layers(
        rng, cfg.layers, d, cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn, bf16
    )
    embed = weight(rng, (cfg.vocab, d), bf16, fan_in=1)  # Unit variance.
    return dict(embed=embed, layers=layers, unembed=weight(rng, (d, cfg.vocab), bf16))


def forward(cfg: Decoder, params: dict, tokens, state):
    """tokens int32[batch, T] -> (logits f32[batch, vocab] of each last token, state)."""
    import jax.numpy as jnp

    x, state = run_layers(
        params["layers"],
        params["embed"][tokens],  # [batch, T, d]
        state,
        prefetch_attend,
        q_heads=cfg.q_heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        q_gain=cfg.q_gain,
        norm=rms_norm,
    )
    return (rms_norm(x[:, -1]) @ params["unembed"]).astype(jnp.float32), state


# -- the decode benchmark's step -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int
    dtype: Any

    @property
    def d_model(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def kv_bytes_per_step(self) -> int:
        """Cached KV bytes one step reads (all layers, K and V, all sequences)."""
        return self.layers * 2 * self.batch * self.context * self.row_bytes


def init_step_params(shape: Shape, seed: int) -> list[dict]:
    """The decode step's per-layer weights in ``shape.dtype``, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    d, kv = shape.d_model, shape.kv_heads * shape.head_dim
    return init_layers(rng, shape.layers, d, d, kv, shape.ffn, shape.dtype)


def step(params, shape: Shape, x, cache, attend: Callable, mark: Callable | None = None):
    """x [B, 1, d_model] -> (x, cache); ``attend(layer, q, k, v, cache) -> (out, cache)``."""
    return run_layers(
        params,
        x,
        cache,
        attend,
        q_heads=shape.q_heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        mark=mark,
    )


def fill(shape: Shape, max_len: int, caches, seed: int, keep: bool):
    """Writes the same random KV into each cache; returns per-layer [B, max_len, H, D] (k, v)
    (with ``keep``; else an empty list)."""
    rng = np.random.default_rng(seed + 1)
    n = shape.context
    dims = (shape.batch, n, shape.kv_heads, shape.head_dim)
    # One random pool, sliced at random offsets: random enough for attention, fast to make.
    pool_n = min(math.prod(dims), 1 << 24)
    pool = rng.standard_normal(2 * pool_n, dtype=np.float32)
    pool = pool.astype(shape.dtype)
    out = []
    for layer in range(shape.layers):
        kv = []
        for _ in range(2):
            x = np.empty(math.prod(dims), shape.dtype)
            for lo in range(0, x.size, pool_n):
                hi = min(x.size, lo + pool_n)
                off = int(rng.integers(0, pool.size - (hi - lo) + 1))
                x[lo:hi] = pool[off : off + hi - lo]
            kv.append(x.reshape(dims))
        for c in caches:
            st = c.load(c.init(), layer, kv[0], kv[1])
            del st
        if keep:
            pad = ((0, 0), (0, max_len - n), (0, 0), (0, 0))
            out.append((np.pad(kv[0], pad), np.pad(kv[1], pad)))
    return out
