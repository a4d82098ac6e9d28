"""Compiles a Gemma-4-like hybrid model's decode step over a hybrid cache of host-pool
groups (``HybridKVCache(host_pool=True)``) for a TPU (libtpu's compiler; nothing runs) and
prints one JSON line per context: the step's device bytes, the weights', every group's
staging and the rows kept for the reading layers. Run by tests/tpu/test_tpu_compile_hybrid.py
in a child process (libtpu reads its settings when JAX starts).

The model: sliding layers of 4 KV heads x 128 (window 1024) beside global layers of 2 x 256,
a late sliding and a late global layer reading an earlier layer's KV; the state's shapes
come from the hybrid cache's own plan of its groups (nothing of a pool is allocated)."""

from __future__ import annotations

import json
import sys

from jax_tpusync.tpu import target

target.prepare_compile_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_tpusync as tps  # noqa: E402
from jax_tpusync.caches.hybrid.config import group_arguments  # noqa: E402
from jax_tpusync.core.config import CacheConfig  # noqa: E402
from jax_tpusync.core.hybrid_state import HybridState, plan_groups  # noqa: E402
from jax_tpusync.core.pool_state import PoolLayout  # noqa: E402
from jax_tpusync.tpu.abstract_state import abstract_pool_state  # noqa: E402

W, D_MODEL, Q_HEADS = 1024, 2048, 8
KV_HEADS = (4, 4, 2, 4, 4, 2)
HEAD_DIMS = (128, 128, 256, 128, 128, 256)
WINDOWS = (W, W, None, W, W, None)
SHARING = (None, None, None, None, 3, 2)


def abstract_state(context: int, device, rings: bool = False) -> HybridState:
    """The hybrid cache's state at ``context`` tokens as shapes on ``device`` (``rings``:
    the sliding group keeps a ring of its window per slot)."""
    plan = plan_groups(len(KV_HEADS), list(KV_HEADS), list(HEAD_DIMS), list(WINDOWS), SHARING)
    made = group_arguments(
        plan,
        batch=1,
        max_len=context,
        max_step_tokens=1,
        bound_windows=rings,
        window_cache_blocks=None,
        staging_bytes=64 << 20,
        shm_name=None,
        file_name=None,
        options=dict(dtype=jnp.bfloat16, block_tokens=256),
        host_pool=True,
    )
    parts = [
        abstract_pool_state(CacheConfig.from_kwargs(**kwargs), [device])[0]
        for kwargs in made
    ]
    on_device = jax.sharding.SingleDeviceSharding(device)
    pending = [
        jax.ShapeDtypeStruct(
            (2, 1, 1, KV_HEADS[s], HEAD_DIMS[s]), jnp.bfloat16, sharding=on_device
        )
        for s in plan.sources
    ]
    step_lengths = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=on_device)
    return HybridState(plan, parts, step_lengths, pending)


def abstract_params(sharding) -> list[dict]:
    def w(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)

    params = []
    for layer, (h, d) in enumerate(zip(KV_HEADS, HEAD_DIMS)):
        p = dict(wq=w(D_MODEL, Q_HEADS * d), wo=w(Q_HEADS * d, D_MODEL))
        if SHARING[layer] is None:
            p.update(wk=w(D_MODEL, h * d), wv=w(D_MODEL, h * d))
        params.append(p)
    return params


def step(params, x, state):
    """One decode token through every layer (a reading layer passes k=v=None)."""
    for layer, p in enumerate(params):
        b, t, _ = x.shape
        d = HEAD_DIMS[layer]
        q = (x @ p["wq"]).reshape(b, t, Q_HEADS, d)
        k = v = None
        if "wk" in p:
            k = (x @ p["wk"]).reshape(b, t, KV_HEADS[layer], d)
            v = (x @ p["wv"]).reshape(b, t, KV_HEADS[layer], d)
        out, state = tps.prefetching_attention(
            q, k, v, state, layer=layer, implementation="pallas", interpret=False
        )
        x = x + out.reshape(b, t, -1) @ p["wo"]
    return x, state


def main(topology: str, contexts: list[int], rings: bool = False) -> None:
    device = target.topology_devices(topology)[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    for context in contexts:
        state = abstract_state(context, device, rings)
        params = abstract_params(on_device)
        x = jax.ShapeDtypeStruct((1, 1, D_MODEL), jnp.bfloat16, sharding=on_device)
        args = (params, x, state)
        shardings = jax.tree.map(lambda a: a.sharding, args)
        jitted = jax.jit(
            step, in_shardings=shardings, out_shardings=(on_device, shardings[2]), donate_argnums=2
        )
        with target.tracing_for_tpu():
            compiled = jitted.trace(*args).lower().compile()
        weights = sum(int(np.prod(a.shape)) * 2 for a in jax.tree_util.tree_leaves(params))
        staging = sum(PoolLayout(part.spec).device_bytes for part in state.groups)
        pending = sum(int(np.prod(a.shape)) * 2 for a in state.pending)
        pool = sum(PoolLayout(part.spec).pool_bytes for part in state.groups)
        print(json.dumps(dict(
            context=context,
            groups=len(state.groups),
            chunk_lens=[part.spec.chunk_len for part in state.groups],
            device_mib=target.device_bytes(compiled) / 2**20,
            weights_mib=weights / 2**20,
            staging_mib=staging / 2**20,
            pending_mib=pending / 2**20,
            pool_mib=pool / 2**20,
        )), flush=True)  # fmt: skip


if __name__ == "__main__":
    # compile_hybrid_pool.py TOPOLOGY CONTEXT... [rings]
    arguments = sys.argv[2:]
    rings = arguments[-1:] == ["rings"]
    main(sys.argv[1], [int(c) for c in arguments[: len(arguments) - rings]], rings)
