"""share_computed on every kind of cache: a slot's whole blocks, written and computed,
become mappable by the next admission at once (one device, the host pool, a mesh's head
shards, a hybrid model's layer groups); the reader sees the writer's rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

BLOCK, MAX_LEN, LAYERS = 8, 32, 2
PROMPT = np.arange(100, 120)  # 20 ids: two full blocks and four ids of a third.


def offloaded():
    return tps.OffloadedKVCache(
        num_layers=LAYERS, batch=2, max_len=MAX_LEN, num_kv_heads=2, head_dim=8,
        dtype=jnp.float32, block_tokens=BLOCK, num_blocks=16, staging_bytes=32 << 10,
    )  # fmt: skip


def host_pool():
    return tps.HostPoolKVCache(
        num_layers=LAYERS, batch=2, max_len=MAX_LEN, num_kv_heads=2, head_dim=8,
        dtype=jnp.float32, block_tokens=BLOCK, staging_bytes=2 * 2 * 16 * 2 * 2 * 8 * 4,
    )  # fmt: skip


def sharded():
    mesh = jax.make_mesh((2,), ("model",))
    return tps.kv_cache(
        num_layers=LAYERS, batch=2, max_len=MAX_LEN, num_kv_heads=2, head_dim=8,
        dtype=jnp.float32, block_tokens=BLOCK, num_blocks=16, staging_bytes=32 << 10,
        mesh=mesh, kv_heads_axis="model",
    )  # fmt: skip


def hybrid():
    return tps.HybridKVCache(
        num_layers=LAYERS, batch=2, max_len=MAX_LEN, num_kv_heads=2, head_dim=[8, 16],
        dtype=jnp.float32, block_tokens=BLOCK, max_step_tokens=16,
    )  # fmt: skip


@pytest.mark.parametrize(
    "make, parts",
    [(offloaded, 1), (host_pool, 1), (sharded, 2), (hybrid, 2)],
    ids=["offloaded", "host_pool", "sharded", "hybrid"],
)
def test_computed_blocks_are_mapped_by_the_next_admission(make, parts):
    if make is sharded and len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    rng = np.random.default_rng(0)
    with make() as cache:
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, max_tokens=24, tokens=PROMPT)
        assert cached == 0
        rows = {}
        for layer in range(LAYERS):
            k, _ = cache.read(state, layer, 0, 0, 0)  # Empty: each layer's row shape.
            shape = (13, *k.shape[1:])  # One whole block and five rows of the next.
            rows[layer] = rng.standard_normal(shape).astype(np.float32)
            state = cache.load(state, layer, rows[layer], -rows[layer], slot=0)
        assert cache.share_computed(state, 0) == parts  # One block in every part.
        assert cache.share_computed(state, 0) == 0
        state, cached = cache.admit(state, 1, max_tokens=24, tokens=PROMPT)
        assert cached == BLOCK  # The whole block only: the second is being filled.
        for layer in range(LAYERS):
            k, v = cache.read(state, layer, 1, 0, BLOCK)
            np.testing.assert_array_equal(k, rows[layer][:BLOCK])
            np.testing.assert_array_equal(v, -rows[layer][:BLOCK])
        # The writer goes on past its shared block; the block it shares is read-only.
        with pytest.raises(ValueError, match=r"overlap its shared prefix \[0, 8\)"):
            cache.load(state, 0, rows[0][:1], rows[0][:1], start=7, slot=0)
        state = cache.release(state, 0)
        k, _ = cache.read(state, LAYERS - 1, 1, 0, BLOCK)  # Still mapped by slot 1.
        np.testing.assert_array_equal(k, rows[LAYERS - 1][:BLOCK])
        state = cache.release(state, 1)
        cache.close(state)


@pytest.mark.parametrize(
    "make",
    [offloaded, host_pool, sharded, hybrid],
    ids=["offloaded", "host_pool", "sharded", "hybrid"],
)
def test_an_inactive_slot_is_refused_in_every_part(make):
    if make is sharded and len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    with make() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=24, tokens=PROMPT)
        with pytest.raises(ValueError, match="slot 1 is not active"):
            cache.share_computed(state, 1)
        with pytest.raises(ValueError, match=r"slot=2 must be an int in \[0, batch=2\)"):
            cache.share_computed(state, 2)
        assert cache.share_computed(state, 0) == 0  # Nothing computed yet.
        cache.close(state)
