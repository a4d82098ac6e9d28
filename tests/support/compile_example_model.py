"""Compiles examples/model.py's jitted decode step, unchanged, for a TPU with a host-pool
cache (libtpu's compiler; nothing runs) and prints one JSON line per context: the step's
device bytes, the weights' and the staging's. Run by tests/tpu/test_tpu_compile.py in a
child process (libtpu reads its settings when JAX starts)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from jax_tpusync.tpu import target

target.prepare_compile_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_tpusync.core.config import CacheConfig  # noqa: E402
from jax_tpusync.core.pool_state import PoolLayout  # noqa: E402
from jax_tpusync.tpu.abstract_state import abstract_pool_state  # noqa: E402

_PATH = Path(__file__).parents[2] / "examples" / "model.py"
_spec = importlib.util.spec_from_file_location("example_model", _PATH)
model = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = model
_spec.loader.exec_module(model)


def abstract_params(cfg, sharding):
    """init_params's pytree as shapes (drawing the weights would take gigabytes here)."""
    d, a, kv, f = cfg.d_model, cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn

    def w(*shape):
        return jax.ShapeDtypeStruct(shape, cfg.dtype, sharding=sharding)

    layer = dict(attn_norm=w(d), wq=w(d, a), wk=w(d, kv), wv=w(d, kv), wo=w(a, d),
                 mlp_norm=w(d), w1=w(d, f), w3=w(d, f), w2=w(f, d))  # fmt: skip
    return dict(embed=w(cfg.vocab, d), layers=[dict(layer) for _ in range(cfg.layers)],
                final_norm=w(d), lm_head=w(d, cfg.vocab))  # fmt: skip


def main(topology: str, contexts: list[int]) -> None:
    devices = target.topology_devices(topology)
    cfg = model.ModelConfig(layers=4, d_model=2048, q_heads=16, kv_heads=8, head_dim=128,
                            ffn=5632, vocab=32000, dtype=jnp.bfloat16)  # fmt: skip
    for context in contexts:
        config = CacheConfig.from_kwargs(
            num_layers=cfg.layers, batch=1, max_len=context, num_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, dtype=cfg.dtype, block_tokens=256, staging_bytes=64 << 20,
        )  # fmt: skip
        state, on_device = abstract_pool_state(config, devices)
        params = abstract_params(cfg, on_device)
        tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=on_device)
        # The example's own function, jitted as it jits it, plus where the state's outputs
        # live: traced from shapes, the pool's host memory is known from its sharding only
        # (a call with the live state traces it as host memory by itself).
        step = model.make_offloaded_step(cfg).__wrapped__
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        jitted = jax.jit(step, donate_argnums=(2,), out_shardings=(on_device, state_shardings))
        with target.tracing_for_tpu():
            compiled = jitted.trace(params, tokens, state).lower().compile()
        weights = sum(
            int(np.prod(x.shape)) * 2 for x in jax.tree_util.tree_leaves(params)
        )
        print(json.dumps(dict(
            context=context,
            device_mib=target.device_bytes(compiled) / 2**20,
            weights_mib=weights / 2**20,
            staging_mib=PoolLayout(state.spec).device_bytes / 2**20,
        )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], [int(c) for c in sys.argv[2:]])
