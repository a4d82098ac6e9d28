"""Mesh caches on simulated CPU devices (tests/conftest.py asks for 4): tensor parallel over
KV heads, data parallel over the batch, both; against one device's resident model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpusync as tps
from jax_tpusync.caches.offloaded.mesh import ShardedKVCache

from support.mesh_model import CONTEXT, HEAD_DIM, KV_HEADS, LAYERS, Q_HEADS, MeshTestModel

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4,
    reason="needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)",
)

MESHES = {"tp2": (1, 2), "tp4": (1, 4), "dp2": (2, 1), "dp4": (4, 1), "2x2": (2, 2)}


def make_mesh(name: str, axis_types=AxisType.Auto):
    return jax.make_mesh(MESHES[name], ("data", "model"), axis_types=(axis_types,) * 2)


def axes_of(name: str) -> dict:
    dp, tp = MESHES[name]
    return dict(batch_axis="data" if dp > 1 else None, kv_heads_axis="model" if tp > 1 else None)


@pytest.fixture(scope="module")
def model():
    return MeshTestModel()


@pytest.fixture(scope="module")
def resident_logits(model):
    return model.run_resident()


def mesh_cache(name, tmp_path=None, tier="host", axis_types=AxisType.Auto, **overrides):
    extra = dict(tier="file", path=str(tmp_path)) if tier == "file" else {}
    return tps.kv_cache(
        **MeshTestModel.cache_args(**overrides),
        mesh=make_mesh(name, axis_types),
        **axes_of(name),
        **extra,
    )


@pytest.mark.parametrize(
    "mesh_name, tier, scan",
    [
        ("tp2", "host", False),
        ("tp4", "file", True),
        ("2x2", "file", False),
    ],
)
def test_sharded_decode_matches_the_resident_model(
    model, resident_logits, tmp_path, mesh_name, tier, scan
):
    with mesh_cache(mesh_name, tmp_path, tier) as cache:
        assert isinstance(cache, ShardedKVCache)
        assert sorted(cache.shards) == list(range(cache.layout.num_shards))
        state = model.load_context(cache, cache.init())
        logits, written, state = model.run_offloaded(cache, state, scan=scan)
        for got, want in zip(logits, resident_logits):
            # f32 rounding of two summation orders (tp4 partitions the projections 4 ways;
            # tp2 and 2x2 came out exact): up to 1.7e-6 of the largest logit was seen, and
            # the logits grow with each step (6.9, 10.6, 23.3); a wrong KV row is far above.
            np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
        state = cache.drain(state)
        np.testing.assert_array_equal(cache.lengths(state), CONTEXT + len(logits))
        # Each shard holds exactly its sequences' and heads' rows, byte for byte.
        assert model.tier_matches(cache, state, written)
        # The staging buffers are sharded arrays: one shard per device.
        assert state.staging.sharding == cache.state_sharding
        assert len({p.device for p in state.staging.addressable_shards}) == cache.layout.num_shards


def test_explicit_mesh_decodes_and_returns_outputs_typed_like_q(model, resident_logits):
    mesh = make_mesh("2x2", AxisType.Explicit)
    cache = mesh_cache("2x2", axis_types=AxisType.Explicit)
    with jax.set_mesh(mesh):
        state = model.load_context(cache, cache.init())
        x = jax.device_put(model.x0, NamedSharding(mesh, P("data")))
        step = model.step(scan=True)  # scan: its carry must keep x's sharding.
        y, state, _, _ = step(x, state)
        assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec
    np.testing.assert_allclose(np.asarray(y), resident_logits[0], atol=1e-5, rtol=0)
    cache.close()


def test_inside_the_callers_shard_map_each_device_runs_its_share(model, resident_logits):
    mesh = make_mesh("2x2")
    cache = mesh_cache("2x2")
    heads_q, heads_kv = Q_HEADS // 2, KV_HEADS // 2

    def inner(x, state):  # x: [batch / 2, 1, width] on each device, its heads' weights.
        t = jax.lax.axis_index("model")
        for layer in range(LAYERS):

            def cols(w, h, layer=layer):  # The device's heads' columns of w[layer].
                return jax.lax.dynamic_slice_in_dim(w[layer], t * h * HEAD_DIM, h * HEAD_DIM, 1)

            q, k, v = model.qkv(
                x,
                layer,
                cols(model.wq, heads_q),
                cols(model.wk, heads_kv),
                cols(model.wv, heads_kv),
            )
            o, state = tps.prefetching_attention(q, k, v, state, layer=layer)
            x = x + jax.lax.all_gather(o, "model", axis=2, tiled=True).reshape(x.shape)
        return x, state

    specs = jax.tree_util.tree_map(lambda _: cache.state_sharding.spec, cache.inert_state())
    step = jax.jit(
        jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(P("data"), specs),
            out_specs=(P("data"), specs),
            check_vma=False,
        ),
        donate_argnums=(1,),
    )
    state = model.load_context(cache, cache.init())
    y, state = step(jnp.asarray(model.x0), state)
    np.testing.assert_allclose(np.asarray(y), resident_logits[0], atol=1e-5, rtol=0)
    cache.close()


def _first_layer_in_shard_map(model, mesh, state_spec):
    """A step of layer 0 inside shard_map with the state split by ``state_spec``."""

    def inner(x, state):
        q, k, v = model.qkv(x, 0)
        o, state = tps.prefetching_attention(
            q[:, :, : Q_HEADS // 2],
            k[:, :, : KV_HEADS // 2],
            v[:, :, : KV_HEADS // 2],
            state,
            layer=0,
        )
        return o, state

    def step(x, state):
        specs = jax.tree_util.tree_map(lambda _: state_spec, state)
        return jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(P("data"), specs),
            out_specs=(P("data", None, "model"), specs),
            check_vma=False,
        )(x, state)

    return jax.jit(step, donate_argnums=(1,))


def test_a_state_on_another_shards_device_is_refused_before_any_byte(model):
    """The shard guard at its edge: shards 1 and 2 swapped (state specs with the mesh axes
    reversed) are refused; the same step with the cache's own specs runs."""
    mesh = make_mesh("2x2")
    cache = mesh_cache("2x2")
    state = model.load_context(cache, cache.init())
    before = {s: [c.read_all(layer) for layer in range(LAYERS)] for s, c in cache.shards.items()}
    swapped = _first_layer_in_shard_map(model, mesh, P(("model", "data")))
    with pytest.raises(
        Exception,
        match=r"this state is shard [12] of its mesh cache but runs on the device of shard [21] "
        r"\(shard the state as cache.state_sharding says\); nothing was written",
    ):
        jax.block_until_ready(swapped(jnp.asarray(model.x0), state))
    state = cache.recover()
    # The swapped shards wrote nothing at all; the others (in place) wrote only past their
    # lengths, which the failed step did not advance.
    for s, shard in cache.shards.items():
        lengths = None if s in (1, 2) else CONTEXT[cache.rows_of(s)]
        for layer in range(LAYERS):
            want = before[s][layer]
            if lengths is not None:
                want = [
                    np.where(
                        np.arange(want[0].shape[1])[None, :, None, None]
                        < lengths[:, None, None, None],
                        w,
                        0,
                    )
                    for w in want
                ]
            for got, w in zip(shard.read_all(layer, lengths), want):
                np.testing.assert_array_equal(got, w)
    np.testing.assert_array_equal(cache.lengths(state), CONTEXT)
    own = _first_layer_in_shard_map(model, mesh, cache.state_sharding.spec)
    _, state = own(jnp.asarray(model.x0), state)
    jax.block_until_ready(state)
    cache.close()


def test_a_cache_without_mesh_inside_shard_map_is_refused(model):
    """The silent-corruption case: a cache sized for one device's share, used inside
    shard_map, would have every device write the same tier blocks."""
    mesh = make_mesh("dp2")
    cache = tps.OffloadedKVCache(**MeshTestModel.cache_args(batch=2))

    def inner(x, state):
        q, k, v = model.qkv(x, 0)
        return tps.prefetching_attention(q, k, v, state, layer=0)

    step = jax.jit(
        jax.shard_map(
            inner, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()), check_vma=False
        )
    )
    with pytest.raises(
        ValueError,
        match=r"inside shard_map over mesh axes \('data',\) with a cache built without mesh=",
    ):
        step(jnp.asarray(model.x0), cache.init())
    cache.close()


def test_a_cache_without_mesh_on_sharded_inputs_is_refused(model):
    cache = tps.OffloadedKVCache(**MeshTestModel.cache_args())

    def step(x, state):
        q, k, v = model.qkv(x, 0)
        return tps.prefetching_attention(q, k, v, state, layer=0)

    auto = make_mesh("2x2")
    x = jax.device_put(model.x0, NamedSharding(auto, P("data")))
    with (
        jax.set_mesh(auto),
        pytest.raises(
            ValueError,
            match=r"runs under a mesh of 4 devices \(\{'data': 2, 'model': 2\}\) with a cache built without mesh=",
        ),
    ):
        jax.jit(step)(x, cache.inert_state())
    explicit = make_mesh("2x2", AxisType.Explicit)
    x = jax.device_put(model.x0, NamedSharding(explicit, P("data")))
    with jax.set_mesh(explicit), pytest.raises(ValueError, match=r"under a mesh of 4 devices"):
        jax.jit(step)(x, cache.inert_state())
    # Outside any mesh context tracing sees no sharding: XLA's partitioner refuses it.
    x = jax.device_put(model.x0, NamedSharding(auto, P("data")))
    with pytest.raises(Exception, match=r"Side-effect HLO must have sharding"):
        jax.jit(step)(x, cache.inert_state())
    cache.close()


def test_trace_time_errors_name_the_mismatch(model):
    explicit = make_mesh("2x2", AxisType.Explicit)
    cache = mesh_cache("2x2", axis_types=AxisType.Explicit)
    state = cache.inert_state()

    def attend(q, k, v, state):
        return tps.prefetching_attention(q, k, v, state, layer=0)

    q = np.zeros((4, 1, Q_HEADS, HEAD_DIM), np.float32)
    kv = np.zeros((4, 1, KV_HEADS, HEAD_DIM), np.float32)
    with jax.set_mesh(explicit):
        over_head_dim = jax.device_put(q, NamedSharding(explicit, P("data", None, None, "model")))
        with pytest.raises(ValueError, match=r"q is sharded over head_dim \(mesh axis 'model'\)"):
            jax.jit(attend)(over_head_dim, kv, kv, state)
    other = jax.make_mesh((4, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(other):
        elsewhere = jax.device_put(q, NamedSharding(other, P("data")))
        with pytest.raises(
            ValueError,
            match=r"q is on mesh \{'data': 4, 'model': 1\} but the cache was built for mesh",
        ):
            jax.jit(attend)(elsewhere, kv, kv, state)
    with pytest.raises(
        ValueError, match=r"q has batch=2 but the mesh cache holds batch=4 \(2 devices x 2\)"
    ):
        jax.jit(attend)(q[:2], kv[:2], kv[:2], state)
    with pytest.raises(ValueError, match=r"k and v must have num_kv_heads=4"):
        jax.jit(attend)(q, kv[:, :, :2], kv[:, :, :2], state)
    cache.close()


def test_shard_map_over_part_of_the_cache_axes_or_with_a_whole_state_is_refused(model):
    mesh = make_mesh("2x2")
    cache = mesh_cache("2x2")
    specs = jax.tree_util.tree_map(lambda _: P("data"), cache.inert_state())

    def inner(q, k, v, state):
        return tps.prefetching_attention(q, k, v, state, layer=0)

    q = jnp.zeros((4, 1, Q_HEADS, HEAD_DIM))
    kv = jnp.zeros((4, 1, KV_HEADS, HEAD_DIM))
    part = jax.shard_map(
        inner,
        mesh=mesh,
        in_specs=(P("data"),) * 3 + (specs,),
        out_specs=(P("data"), specs),
        axis_names={"data"},
        check_vma=False,
    )
    with pytest.raises(
        ValueError, match=r"does not cover the cache's mesh axes \('data', 'model'\)"
    ):
        jax.jit(part)(q, kv, kv, cache.inert_state())
    whole = jax.shard_map(
        inner,
        mesh=mesh,
        in_specs=(P("data", None, "model"),) * 3 + (P(),),
        out_specs=(P("data", None, "model"), P()),
        check_vma=False,
    )
    with pytest.raises(ValueError, match=r"its leading axis has 4 shards here, not 1"):
        jax.jit(whole)(q, kv, kv, cache.inert_state())
    cache.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(kv_heads_axis="heads"),
            r"kv_heads_axis='heads' is not an axis of the mesh \(its axes: \('data', 'model'\)\)",
        ),
        (
            dict(kv_heads_axis="model"),
            r"mesh axis 'data' has 2 devices but is neither kv_heads_axis nor batch_axis",
        ),
        (dict(), r"a mesh cache needs kv_heads_axis, batch_axis or both"),
        (
            dict(kv_heads_axis="model", batch_axis="model"),
            r"kv_heads_axis and batch_axis are both 'model'",
        ),
        (
            dict(kv_heads_axis="model", batch_axis="data", batch=3),
            r"batch=3 must be a positive multiple of mesh axis 'data''s 2 devices",
        ),
        (dict(kv_heads_axis="model", batch_axis="data", num_kv_heads=6), None),
        (
            dict(kv_heads_axis="model", batch_axis="data", num_kv_heads=3),
            r"num_kv_heads=3 must be a positive multiple of mesh axis 'model''s 2 devices",
        ),
    ],
)
def test_mesh_arguments_are_checked(kwargs, message):
    args = MeshTestModel.cache_args()
    args.update(kwargs)
    if message is None:  # The edge: 6 heads split 3 per device is fine.
        tps.kv_cache(mesh=make_mesh("2x2"), **args).close()
        return
    with pytest.raises(ValueError, match=message):
        tps.kv_cache(mesh=make_mesh("2x2"), **args)


def test_axes_without_a_mesh_are_refused():
    with pytest.raises(ValueError, match=r"name axes of a mesh: pass mesh= too"):
        tps.OffloadedKVCache(**MeshTestModel.cache_args(), kv_heads_axis="model")
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh; got str"):
        tps.kv_cache(**MeshTestModel.cache_args(), mesh="2x2", kv_heads_axis="model")
    with pytest.raises(TypeError, match=r"for a mesh use jax_tpusync.ShardedKVCache"):
        tps.OffloadedKVCache(**MeshTestModel.cache_args(), mesh=make_mesh("2x2"))


def test_shards_own_disjoint_tier_blocks_and_share_one_engine():
    with mesh_cache("2x2") as cache:
        engines = {c.engine for c in cache.shards.values()}
        assert engines == {cache.engine}
        targets = [tuple(c.target[:3]) for c in cache.shards.values()]
        assert len(set(targets)) == 4  # Each shard: its own tier allocation.
        assert [int(c.target[3]) for c in cache.shards.values()] == [0, 1, 2, 3]


def test_prefix_blocks_are_shared_per_shard(model):
    """admit(tokens=) on a mesh cache: each head shard of the slot maps the same prefix
    blocks from its own index; block ids are per shard."""
    cache = mesh_cache("2x2", block_tokens=8)
    tokens = np.arange(40)
    state = cache.init(admit=False)
    state, cached = cache.admit(state, 0, tokens=tokens, max_tokens=48)
    assert cached == 0
    state = cache.load(
        state, 0, model.context_k[0, :, :40], model.context_v[0, :, :40], lengths=[40, 0, 0, 0]
    )
    state = cache.load(
        state, 1, model.context_k[1, :, :40], model.context_v[1, :, :40], lengths=[40, 0, 0, 0]
    )
    state = cache.release(state, 0, tokens=tokens)
    state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=48)
    assert cached == 32  # 4 full blocks of 8 (the last prompt token is always computed).
    k, _ = cache.read(state, 0, 1, 0, 32)
    np.testing.assert_array_equal(k, model.context_k[0, 0, :32])
    cache.close()
