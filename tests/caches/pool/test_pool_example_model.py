"""The example model (examples/model.py, a Llama-style decoder) on the host pool, the TPU
data path, run on the CPU backend: its logits equal the resident model's through a
prefill and decode steps, unchanged model code (the state is a PoolState)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

_PATH = Path(__file__).parents[3] / "examples" / "model.py"
_spec = importlib.util.spec_from_file_location("example_model", _PATH)
model = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = model  # Its dataclasses resolve their module while it loads.
_spec.loader.exec_module(model)


@pytest.mark.slow
def test_the_example_models_logits_on_the_host_pool_equal_the_resident_models():
    cfg = model.ModelConfig(
        layers=2, d_model=64, q_heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=97,
        dtype=jnp.float32,
    )  # fmt: skip
    batch, max_len = 2, 64
    params = model.init_params(cfg, seed=3)
    cache = tps.HostPoolKVCache(
        num_layers=cfg.layers, batch=batch, max_len=max_len, num_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, dtype=cfg.dtype, block_tokens=8,
        staging_bytes=2 * batch * 16 * 2 * cfg.kv_heads * cfg.head_dim * 4,  # 2-block units
    )  # fmt: skip
    assert cache.spec.chunk_len == 16  # Several units a layer at the end: the loop runs.
    state = cache.init()
    offloaded = model.make_offloaded_step(cfg)
    resident = model.make_resident_step(cfg)
    shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
    ref = tuple([jnp.zeros(shape, cfg.dtype) for _ in range(cfg.layers)] for _ in "kv")
    ref = (*ref, jnp.zeros(batch, jnp.int32))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (batch, 21)), jnp.int32)  # A prefill.
    for _ in range(8):
        logits, state = offloaded(params, tokens, state)
        want, ref = resident(params, tokens, ref)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5, rtol=1e-5)
        tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)  # Greedy decode.
    np.testing.assert_array_equal(cache.lengths(state), [28, 28])
