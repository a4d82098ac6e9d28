"""A host-pool cache split over a mesh's kv_heads axis, its jitted step and a run of steps:
the mesh host-pool tests' model (test_pool_mesh.py, test_pool_ring.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jax_tpusync as tps

HEADS, Q_HEADS, HEAD_DIM, LAYERS, BATCH = 4, 8, 16, 2, 2


def mesh_of(*shape, names=("h",)):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def make_cache(heads=HEADS, **options):
    options.setdefault("dtype", jnp.float32)
    itemsize = np.dtype(options["dtype"]).itemsize
    mesh = options.get("mesh")
    shards = mesh.shape.get(options.get("kv_heads_axis"), 1) if isinstance(mesh, Mesh) else 1
    # Two units of two blocks per slot on each device: several units per layer.
    options.setdefault("staging_bytes", 2 * BATCH * 16 * 2 * heads // shards * HEAD_DIM * itemsize)
    return tps.HostPoolKVCache(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=64,
        num_kv_heads=heads,
        head_dim=HEAD_DIM,
        block_tokens=8,
        **options,
    )


def step_fn(num_layers):
    def step(state, qs, ks, vs, counts):
        outs = []
        for layer in range(num_layers):
            out, state = tps.prefetching_attention(
                qs[layer], ks[layer], vs[layer], state, layer=layer, query_seq_lengths=counts
            )
            outs.append(out)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=0)


# Two step widths (each compiles once), past a unit of 16 tokens at the end.
STEPS = [(7, None), (1, None), (7, [7, 3]), (7, None), (1, None), (7, [0, 3]), (1, None)]


def run(cache, steps, dtype, seed=0):
    rng = np.random.default_rng(seed)
    state = cache.init()
    step = step_fn(LAYERS)
    outs = []
    for q_len, counts in steps:
        shape = (LAYERS, BATCH, q_len)
        qs = jnp.asarray(rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)), dtype)
        ks = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), dtype)
        vs = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), dtype)
        counts = None if counts is None else jnp.asarray(counts, jnp.int32)
        out, state = step(state, qs, ks, vs, counts)
        outs.append(np.asarray(out.astype(jnp.float32)))
    return state, outs
