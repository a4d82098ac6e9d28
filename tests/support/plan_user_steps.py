"""Plans decode steps written here, not the bench's, with ``jax_tpusync.tpu.plan_step`` for
one TPU topology (libtpu's compiler; nothing runs) and prints one JSON line per model:
its name and the plan's ``to_dict()``. Run by tests/tpu/test_plan_step.py in a child
process (libtpu reads its settings when JAX starts).

The models differ from the bench's decoder (32 query / 8 KV heads of 128, one slot, no
norms, no MLP) and from each other in layer count, head counts and GQA ratio, head size,
batch, block size, staging budget, window pattern and mesh split; each is a
``jax.jit``-wrapped step with RMS norms and a SwiGLU MLP around
``prefetching_attention``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_tpusync as tps  # First: libtpu's settings before JAX starts a backend.


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int
    block_tokens: int
    staging_mib: int
    window: int | None = None  # Sliding layers' window; every `global_every`th layer global.
    global_every: int = 0
    ffn: int = 256
    mesh: tuple[tuple[str, int], ...] = ()  # ("batch", 2), ("heads", 2)
    hybrid: bool = False  # A HybridKVCache(host_pool=True): sliding groups keep a ring.

    @property
    def d_model(self) -> int:
        return self.q_heads * self.head_dim // 2  # Unlike the bench: d_model != q_dim.

    @property
    def windows(self) -> list[int | None] | None:
        if self.window is None:
            return None
        return [
            None if self.global_every and (i + 1) % self.global_every == 0 else self.window
            for i in range(self.layers)
        ]


MODELS = {
    # The step: 6 layers, GQA 16 / 4 heads of 128, batch 2, blocks of 256, 32 MiB.
    "issue": Model("issue", 6, 16, 4, 128, 2, 256, 32),
    # One KV head of 256 for 8 query heads (MQA-like), 4 slots, blocks of 128, 16 MiB.
    "mqa": Model("mqa", 2, 8, 1, 256, 4, 128, 16),
    # GQA 12 / 2 heads of 64, an odd batch of 3, blocks of 512, 24 MiB.
    "odd_batch": Model("odd_batch", 2, 12, 2, 64, 3, 512, 24),
    # 8 slots of GQA 8 / 2 heads of 128 (a unit of 3 blocks), 64 MiB.
    "wide_batch": Model("wide_batch", 2, 8, 2, 128, 8, 256, 64),
    # Gemma-3-like: two sliding layers of 1024 tokens to one global, GQA 8 / 4 heads of
    # 128, 4 slots over a 2 x 2 mesh (slots over one axis, KV heads over the other).
    "gemma_mesh": Model(
        "gemma_mesh", 3, 8, 4, 128, 4, 256, 32, window=1024, global_every=3,
        mesh=(("batch", 2), ("heads", 2)),
    ),  # fmt: skip
    # More slots than one unit's copies hold (16 a chip), one layer each (a small
    # compile): 24 slots walked in two groups of 12, GQA 4 / 2 heads of 64; 32 in two of
    # 16, MQA-like 4 / 1 of 128, blocks of 128.
    "slots_24": Model("slots_24", 1, 4, 2, 64, 24, 256, 16),
    "slots_32": Model("slots_32", 1, 4, 1, 128, 32, 128, 16),
    # Gemma-3-like as a hybrid cache of host pools: five sliding layers of 512 tokens to
    # one global, GQA 8 / 2 heads of 128, 2 slots; the sliding group keeps a ring per slot.
    "gemma_hybrid": Model(
        "gemma_hybrid", 6, 8, 2, 128, 2, 256, 32, window=512, global_every=6, hybrid=True,
    ),  # fmt: skip
}


def params_of(m: Model):
    """The weights as shapes (nothing is allocated)."""
    d, qd, kvd = m.d_model, m.q_heads * m.head_dim, m.kv_heads * m.head_dim

    def w(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    layer = dict(norm=w(d), wq=w(d, qd), wk=w(d, kvd), wv=w(d, kvd), wo=w(qd, d),
                 mlp_norm=w(d), w_gate=w(d, m.ffn), w_up=w(d, m.ffn),
                 w_down=w(m.ffn, d))  # fmt: skip
    return [dict(layer) for _ in range(m.layers)]


def specs_of(m: Model):
    """Tensor parallelism over the mesh's heads axis: projections by heads, MLP by columns."""
    h = "heads"
    layer = dict(norm=P(), wq=P(None, h), wk=P(None, h), wv=P(None, h), wo=P(h, None),
                 mlp_norm=P(), w_gate=P(None, h), w_up=P(None, h), w_down=P(h, None))  # fmt: skip
    return [dict(layer) for _ in range(m.layers)]


def step_of(m: Model):
    def rms(x, g):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(
            x.dtype
        ) * g

    @jax.jit
    def step(params, x, state):
        b, t, _ = x.shape
        for layer, p in enumerate(params):
            h = rms(x, p["norm"])
            q = (h @ p["wq"]).reshape(b, t, m.q_heads, m.head_dim)
            k = (h @ p["wk"]).reshape(b, t, m.kv_heads, m.head_dim)
            v = (h @ p["wv"]).reshape(b, t, m.kv_heads, m.head_dim)
            out, state = tps.prefetching_attention(q, k, v, state, layer=layer)
            x = x + out.reshape(b, t, -1) @ p["wo"]
            h = rms(x, p["mlp_norm"])
            x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        return x, state

    return step


def plan(m: Model, topology: str, contexts: tuple[int, ...]):
    mesh = dict(m.mesh)
    cache = dict(
        num_layers=m.layers, batch=m.batch, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
        dtype=jnp.bfloat16, block_tokens=m.block_tokens, staging_bytes=m.staging_mib << 20,
        sliding_window=m.windows,
    )  # fmt: skip
    if m.hybrid:  # Decode steps of one row: the rings hold the window and one row.
        cache.update(host_pool=True, max_step_tokens=1)
    return tps.tpu.plan_step(
        step_of(m),
        params_of(m),
        cache,
        topology=topology,
        inputs=(jax.ShapeDtypeStruct((m.batch, 1, m.d_model), jnp.bfloat16),),
        mesh_axes=mesh or None,
        kv_heads_axis="heads" if "heads" in mesh else None,
        batch_axis="batch" if "batch" in mesh else None,
        param_specs=specs_of(m) if "heads" in mesh else None,
        contexts=contexts,
    )


def main(topology: str, requests: list[str]) -> None:
    """Each request is ``NAME`` (at 32K tokens) or ``NAME@CONTEXT,CONTEXT...``."""
    for request in requests:
        name, _, at = request.partition("@")
        contexts = tuple(int(c) for c in at.split(",")) if at else (32768,)
        result = plan(MODELS[name], topology, contexts)
        print(json.dumps(dict(name=name, plan=result.to_dict(), summary=result.summary())))
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
