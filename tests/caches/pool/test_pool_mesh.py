"""A host-pool cache split over a mesh's kv_heads axis (each device's heads in its own
pinned_host pool), on four simulated CPU devices: its steps against the one-device cache
of the same inputs, its host-side rows byte-exact, its guards at their edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_tpusync as tps

from support.pool_mesh_model import (
    BATCH,
    HEAD_DIM,
    HEADS,
    LAYERS,
    Q_HEADS,
    STEPS,
    make_cache,
    mesh_of,
    run,
    step_fn,
)


@pytest.mark.parametrize("dtype, devices", [(np.float32, 4)], ids=["f32-4"])
@pytest.mark.slow
def test_steps_over_a_mesh_equal_the_one_device_cache(dtype, devices):
    mesh = mesh_of(devices)
    # Over the mesh two units in flight (three of 16 tokens staged per device), on one
    # device one: each unit's copies and attention the same.
    three_units = 3 * BATCH * 16 * 2 * (HEADS // devices) * HEAD_DIM * np.dtype(dtype).itemsize
    sharded = make_cache(
        dtype=dtype,
        mesh=mesh,
        kv_heads_axis="h",
        sliding_window=[None, 12],
        prefetch_depth=2,
        staging_bytes=three_units,
    )
    single = make_cache(dtype=dtype, sliding_window=[None, 12])
    assert sharded.spec.num_kv_heads == HEADS // devices
    assert sharded.spec.chunk_len == single.spec.chunk_len == 16
    assert not sharded.layout.single_unit
    assert len(sharded.inert_state().staged_units) == 2
    state, outs = run(sharded, STEPS, dtype)
    ref_state, ref_outs = run(single, STEPS, dtype)
    for got, want in zip(outs, ref_outs):
        np.testing.assert_allclose(got, want, atol=1e-6 if dtype == np.float32 else 1e-2)
    # Each device's pool is in its own host memory, the state split as the cache says.
    assert state.pool.sharding.memory_kind == "pinned_host"
    assert state.pool.shape == (devices, *sharded.layout.pool_shape)
    assert {s.device for s in state.pool.addressable_shards} == set(mesh.devices.flat)
    assert state.staging.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(state.lengths), np.broadcast_to(
        np.asarray(ref_state.lengths), (devices, BATCH)
    ))  # fmt: skip
    for layer in range(LAYERS):
        for slot in range(BATCH):
            got = sharded.read(state, layer, slot)
            for part, want in zip(got, single.read(ref_state, layer, slot)):
                np.testing.assert_array_equal(part, want)
    assert sharded.kv_bytes == single.kv_bytes  # The heads split, not copied.
    assert 2 * sharded.device_bytes * devices == 3 * single.device_bytes


def test_load_over_a_mesh_round_trips_and_feeds_the_step():
    mesh = mesh_of(4)
    cache = make_cache(mesh=mesh, kv_heads_axis="h", tier_dtype="int8")
    single = make_cache(tier_dtype="int8")
    state, ref = cache.init(), single.init()
    rng = np.random.default_rng(3)
    for layer in range(LAYERS):
        for slot in range(BATCH):
            k = rng.standard_normal((21, HEADS, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal((21, HEADS, HEAD_DIM)).astype(np.float32)
            state = cache.load(state, layer, k, v, slot=slot)
            ref = single.load(ref, layer, k, v, slot=slot)
            # Patched in the middle of a block: the block's other rows stay.
            patch_k, patch_v = k[10:13] * 2, v[10:13] * 2
            state = cache.load(state, layer, patch_k, patch_v, start=10, slot=slot)
            ref = single.load(ref, layer, patch_k, patch_v, start=10, slot=slot)
    for layer in range(LAYERS):
        for slot in range(BATCH):
            for got, want in zip(cache.read(state, layer, slot), single.read(ref, layer, slot)):
                np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="raw=True reads codes and scales: this cache's tier"):
        plain = make_cache()
        plain.read(plain.init(), 0, 0, raw=True)
    # Raw: the int8 codes and per-head scales of every device's heads, joined.
    for got, want in zip(cache.read(state, 1, 0, raw=True), single.read(ref, 1, 0, raw=True)):
        assert got.codes.dtype == np.int8 and got.scales.shape == (21, HEADS)
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.scales, want.scales)
    step = step_fn(LAYERS)
    q = jnp.asarray(rng.standard_normal((LAYERS, BATCH, 1, Q_HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((LAYERS, BATCH, 1, HEADS, HEAD_DIM)), jnp.float32)
    out, state = step(state, q, k, k, None)
    want, ref = step(ref, q, k, k, None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)


def test_inside_the_callers_shard_map_each_device_runs_its_share():
    mesh = mesh_of(2)
    cache = make_cache(mesh=mesh, kv_heads_axis="h")
    single = make_cache()
    specs = jax.tree_util.tree_map(lambda _: P("h"), cache.init())
    cache = make_cache(mesh=mesh, kv_heads_axis="h")  # init() is once per cache.
    qkv = P(None, None, "h", None)

    def layer0(q, k, v, state):
        return tps.prefetching_attention(q, k, v, state, layer=0)

    mapped = jax.jit(
        jax.shard_map(
            layer0, mesh=mesh, in_specs=(qkv, qkv, qkv, specs), out_specs=(qkv, specs),
            check_vma=False,
        )
    )  # fmt: skip
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((BATCH, 3, Q_HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((BATCH, 3, HEADS, HEAD_DIM)), jnp.float32)
    out, _ = mapped(q, k, k, cache.init())
    want, _ = jax.jit(layer0)(q, k, k, single.init())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)


def test_mesh_guards_name_the_argument_at_their_edge():
    mesh = mesh_of(4)
    make_cache(mesh=mesh, kv_heads_axis="h")  # 4 heads over 4 devices: one each.
    with pytest.raises(ValueError, match=r"num_kv_heads=6 must be a multiple of the 4 devices"):
        make_cache(heads=6, mesh=mesh, kv_heads_axis="h")
    with pytest.raises(ValueError, match=r"kv_heads_axis='x' is not an axis of the mesh"):
        make_cache(mesh=mesh, kv_heads_axis="x")
    with pytest.raises(ValueError, match=r"batch_axis='b' of 2 devices: a HostPoolKVCache"):
        make_cache(mesh=mesh_of(2, 2, names=("b", "h")), kv_heads_axis="h", batch_axis="b")
    with pytest.raises(ValueError, match=r"mesh axis 'b' has 2 devices but is neither"):
        make_cache(mesh=mesh_of(2, 2, names=("b", "h")), kv_heads_axis="h")
    with pytest.raises(ValueError, match=r"device= and mesh= both given"):
        make_cache(mesh=mesh, kv_heads_axis="h", device=jax.devices()[0])
    with pytest.raises(ValueError, match=r"kv_heads_axis and batch_axis need mesh="):
        make_cache(kv_heads_axis="h")
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh; got str"):
        make_cache(mesh="h", kv_heads_axis="h")
    # The step refuses q/k/v of another head count by name.
    cache = make_cache(mesh=mesh_of(2), kv_heads_axis="h")
    state = cache.init()
    q = jnp.zeros((BATCH, 1, Q_HEADS, HEAD_DIM))
    k = jnp.zeros((BATCH, 1, 2, HEAD_DIM))
    with pytest.raises(ValueError, match=r"num_kv_heads=4 \(the mesh cache's 2 x 2\)"):
        tps.prefetching_attention(q, k, k, state, layer=0)
    # load refuses rows of one device's heads.
    one_device = np.zeros((3, 2, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match=r"k must be \[batch=2, n, num_kv_heads=4, head_dim=16\]"):
        cache.load(state, 0, one_device, one_device, slot=0)
