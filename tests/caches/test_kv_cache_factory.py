"""tps.kv_cache(): one entry point that gives every model the cache that serves it, from a
CacheConfig or the same keywords; the constructors take config= too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_tpusync as tps
from jax_tpusync import factory as cache_factory
from jax_tpusync.core import layout
from jax_tpusync.core.config import CacheConfig, to_kwargs

MiB = 1 << 20
SMALL = dict(num_layers=6, batch=2, max_len=64, num_kv_heads=2, head_dim=4, block_tokens=8,
             dtype=jnp.float32, staging_bytes=1 << 20)
GEMMA3_WINDOWS = [16] * 5 + [None]

# docs/hybrid.md's Gemma-3 shape at 128K (python -m jax_tpusync.bench hybrid): 6 layers, five
# sliding (window 1024) per global one, 2 KV heads x 64, bf16, batch 1, 256-token blocks,
# max_len 128K + 64; its bounded cache's tier bytes, measured with max_step_tokens=1.
GEMMA3_128K = dict(num_layers=6, batch=1, max_len=131072 + 64, num_kv_heads=2, head_dim=64,
                   dtype=jnp.bfloat16, sliding_window=[1024] * 5 + [None], block_tokens=256,
                   staging_bytes=32 * MiB)
DOCS_BOUNDED_TIER_BYTES = 70 * MiB


@pytest.mark.parametrize("as_config", [False, True], ids=["keywords", "config"])
def test_a_gemma3_like_model_gets_the_bounded_hybrid_cache(as_config):
    """Per-layer windows with the same heads on every layer: the hybrid cache, whose tier
    bytes at 128K are within 1.1x of docs/hybrid.md's bounded figure (the cache that keeps
    every position would hold 5.5x that)."""
    made = tps.kv_cache(CacheConfig.from_kwargs(**GEMMA3_128K)) if as_config else tps.kv_cache(
        **GEMMA3_128K
    )
    with made as cache:
        assert isinstance(cache, tps.HybridKVCache) and isinstance(cache, tps.KVCache)
        assert cache.kv_bytes <= 1.1 * DOCS_BOUNDED_TIER_BYTES
    unbounded = layout.plan(CacheConfig.from_kwargs(**GEMMA3_128K)).kv_bytes
    assert unbounded > 5 * DOCS_BOUNDED_TIER_BYTES


def test_max_step_tokens_of_mixed_windows_gets_the_class_that_takes_it():
    with tps.kv_cache(**SMALL, sliding_window=GEMMA3_WINDOWS, max_step_tokens=4) as cache:
        assert isinstance(cache, tps.HybridKVCache) and cache.max_step_tokens == 4
    config = CacheConfig.from_kwargs(**SMALL, sliding_window=GEMMA3_WINDOWS, max_step_tokens=4)
    with tps.kv_cache(config) as cache:
        assert isinstance(cache, tps.HybridKVCache) and cache.max_step_tokens == 4
    # The one-geometry class still says which cache serves such a model.
    one_window = r"needs every layer to share one sliding window.*kv_cache"
    with pytest.raises(ValueError, match=one_window):
        tps.OffloadedKVCache(config=config)


def test_one_shared_window_keeps_a_ring_unless_told_to_keep_every_position():
    with tps.kv_cache(**SMALL, sliding_window=16) as cache:
        assert isinstance(cache, tps.OffloadedKVCache)
        assert cache.spec.ring_blocks > 0 and cache.config.geometry.step_tokens == 64  # max_len
    with tps.kv_cache(**dict(SMALL, max_len=1024), sliding_window=16) as cache:
        assert cache.config.geometry.step_tokens == 512  # The default of a longer cache.
    with tps.kv_cache(**SMALL, sliding_window=16, max_step_tokens=2) as cache:
        assert cache.config.geometry.step_tokens == 2 and cache.spec.ring_blocks > 0
    with tps.kv_cache(**SMALL, sliding_window=16, bound_windows=False) as cache:
        assert isinstance(cache, tps.OffloadedKVCache) and cache.spec.ring_blocks == 0
    with tps.kv_cache(**SMALL, sliding_window=GEMMA3_WINDOWS, bound_windows=False) as cache:
        assert isinstance(cache, tps.OffloadedKVCache) and cache.spec.ring_blocks == 0
    with tps.kv_cache(**SMALL) as cache:  # No window: nothing to bound.
        assert isinstance(cache, tps.OffloadedKVCache) and cache.config.geometry.step_tokens is None


@pytest.mark.parametrize(
    "extra, name",
    [
        (dict(tier="file", file_name="kv"), "file_name"),
        (dict(shm_name="tpusync-factory-test"), "shm_name"),
        (dict(resident=True), "resident"),
        (dict(num_blocks=64), "num_blocks"),
    ],
)
def test_what_rules_out_a_bounded_cache_is_refused_by_name(tmp_path, extra, name):
    """A windowed model never silently gets the cache that keeps every position: a keyword
    a bounded cache cannot take is refused, naming it and bound_windows=False, and nothing
    is made (no file in the tier's directory)."""
    if extra.get("tier") == "file":
        extra = dict(extra, path=str(tmp_path))
    with pytest.raises(ValueError, match=rf"{name}=.*pass bound_windows=False"):
        tps.kv_cache(**SMALL, sliding_window=GEMMA3_WINDOWS, **extra)
    assert list(tmp_path.iterdir()) == []
    if name in ("file_name", "num_blocks"):  # Asked for, every position it is.
        unbounded = dict(SMALL, sliding_window=GEMMA3_WINDOWS, bound_windows=False, **extra)
        with tps.kv_cache(**unbounded) as c:
            assert isinstance(c, tps.OffloadedKVCache) and c.spec.ring_blocks == 0


def test_contradictions_are_refused_by_name():
    with pytest.raises(ValueError, match=r"bound_windows='yes' must be None, True or False"):
        tps.kv_cache(**SMALL, bound_windows="yes")
    with pytest.raises(ValueError, match=r"max_step_tokens=4 keeps only .* drop one of them"):
        tps.kv_cache(**SMALL, sliding_window=16, max_step_tokens=4, bound_windows=False)
    with pytest.raises(ValueError, match=r"max_step_tokens=4 sizes the rings.*has neither"):
        tps.kv_cache(**SMALL, max_step_tokens=4)
    with pytest.raises(ValueError, match=r"kv_heads_axis='model' .* pass mesh= too"):
        tps.kv_cache(**SMALL, kv_heads_axis="model")


def test_config_and_the_same_keyword_are_refused_by_name_in_every_constructor():
    config = CacheConfig.from_kwargs(**SMALL)
    with pytest.raises(ValueError, match=r"^batch given with config="):
        tps.kv_cache(config, batch=4)
    with pytest.raises(ValueError, match=r"^batch, max_len given with config="):
        tps.OffloadedKVCache(config=config, max_len=32, batch=4)
    with pytest.raises(ValueError, match=r"^sliding_window given with config="):
        tps.HybridKVCache(config=config, sliding_window=4)
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"^num_kv_heads given with config="):
        tps.ShardedKVCache(mesh=mesh, kv_heads_axis="model", config=config, num_kv_heads=4)
    with pytest.raises(TypeError, match=r"config must be a CacheConfig or None; got dict"):
        tps.kv_cache(dict(SMALL))


def test_the_constructors_take_a_config_as_they_take_its_keywords():
    config = CacheConfig.from_kwargs(**SMALL, sliding_window=GEMMA3_WINDOWS)
    with tps.OffloadedKVCache(config=config) as one:
        assert one.config == config
    bounded = CacheConfig.from_kwargs(**SMALL, sliding_window=GEMMA3_WINDOWS, max_step_tokens=4)
    with tps.HybridKVCache(config=bounded) as hybrid:
        assert len(hybrid.groups) == 2 and hybrid.max_step_tokens == 4
    if len(jax.devices()) >= 2:
        mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
        with tps.ShardedKVCache(mesh=mesh, kv_heads_axis="model", config=config) as sharded:
            assert sharded.shard_spec.num_kv_heads == 1 and sharded.batch == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        SMALL,
        dict(SMALL, sliding_window=GEMMA3_WINDOWS, max_step_tokens=3, tier_dtype="int8"),
        dict(SMALL, tier="file", path="/tmp/x", file_name="f", verify=False, model_id="m"),
        dict(SMALL, spill_path="/tmp/s", spill_blocks=7, promote_after=None, num_blocks=9),
        dict(SMALL, resident=True, prefetch_depth=2, read_in_place=False, prefix_salt=b"s",
             shared_prefix_dir="/tmp/d", overwrite=True, debug_poison=True),
    ],
    ids=["plain", "windows", "file", "spill", "staging"],
)
def test_to_kwargs_gives_back_the_same_config(kwargs):
    config = CacheConfig.from_kwargs(**kwargs)
    assert CacheConfig.from_kwargs(**to_kwargs(config)) == config
    assert "num_blocks" not in to_kwargs(CacheConfig.from_kwargs(**SMALL))  # Defaults left out.


def test_a_mesh_refuses_a_remote_level_object_before_making_anything():
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"remote_prefix=<object .*must be a 'mooncake://"):
        tps.ShardedKVCache(mesh=mesh, kv_heads_axis="model", remote_prefix=object(), **SMALL)


# -- the TPU backend ------------------------------------------------------------------------


@pytest.fixture
def on_tpu(monkeypatch):
    monkeypatch.setattr(cache_factory, "backend_name", lambda: "tpu")


def test_on_tpu_a_supported_config_gets_the_host_pool(on_tpu):
    cache = tps.kv_cache(**SMALL)
    assert isinstance(cache, tps.HostPoolKVCache)
    cache.close()
    config = CacheConfig.from_kwargs(**SMALL, sliding_window=GEMMA3_WINDOWS)
    cache = tps.kv_cache(config, bound_windows=False)  # Every position kept: the pool does.
    assert isinstance(cache, tps.HostPoolKVCache) and cache.spec.windows == config.geometry.windows
    cache.close()


def test_on_tpu_the_engine_caches_are_refused_at_construction(monkeypatch):
    from jax_tpusync.runtime import backend

    monkeypatch.setattr(backend, "name", lambda: "tpu")
    with pytest.raises(ValueError, match=r"the tpu backend does not run this cache's in-graph"):
        tps.OffloadedKVCache(**SMALL)
    monkeypatch.setattr(backend, "name", lambda: "gpu")
    tps.OffloadedKVCache(**SMALL).close()  # CUDA runs them: only construction is checked.


def test_on_tpu_a_mesh_splits_the_host_pools_heads(on_tpu):
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    cache = tps.kv_cache(**SMALL, mesh=mesh, kv_heads_axis="model")
    assert isinstance(cache, tps.HostPoolKVCache) and cache.shards == 2
    assert cache.spec.num_kv_heads == SMALL["num_kv_heads"] // 2
    cache.close()


def test_on_tpu_what_the_host_pool_lacks_is_named(on_tpu):
    with pytest.raises(ValueError, match=r"not supported on the TPU backend yet.*engine= \(the"):
        tps.kv_cache(**SMALL, engine=tps.EngineConfig())


def test_on_tpu_batch_axis_splits_the_host_pools_slots(on_tpu):
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    with tps.kv_cache(**SMALL, mesh=mesh, batch_axis="data", kv_heads_axis="model") as cache:
        assert isinstance(cache, tps.BatchShardedPoolKVCache)
        assert cache.spec.batch == SMALL["batch"] // 2
        assert cache.spec.num_kv_heads == SMALL["num_kv_heads"] // 2
    with pytest.raises(ValueError, match=r"kv_heads_axis and batch_axis need mesh="):
        tps.kv_cache(**SMALL, batch_axis="data")


@pytest.mark.parametrize(
    "extra",
    [
        dict(num_kv_heads=[2, 2, 1, 2, 2, 1]),
        dict(kv_sharing=[None] * 5 + [4], max_step_tokens=4),
        dict(sliding_window=GEMMA3_WINDOWS),
    ],
    ids=["per-layer", "kv_sharing", "bounded"],
)
def test_on_tpu_a_hybrid_model_gets_a_hybrid_cache_of_host_pools(on_tpu, extra):
    with tps.kv_cache(**dict(SMALL, **extra)) as cache:
        assert isinstance(cache, tps.HybridKVCache) and cache.host_pool
        assert all(isinstance(g, tps.HostPoolKVCache) for g in cache.groups)
        # Layers of different windows kept bounded: each sliding group a pool of rings.
        windowed = "sliding_window" in extra
        assert any(g.spec.ring_blocks for g in cache.groups) == windowed
    with pytest.raises(ValueError, match=r"engine=EngineConfig: host-pool groups"):
        tps.kv_cache(**dict(SMALL, **extra), engine=tps.EngineConfig())


def test_on_tpu_the_host_pools_own_refusals_name_the_keyword(on_tpu, tmp_path):
    with pytest.raises(ValueError, match=r"tier='file' without file_name: the pool is host memory"):
        tps.kv_cache(**SMALL, tier="file", path=str(tmp_path))
    with pytest.raises(ValueError, match=r"max_step_tokens=4 keeps only each slot's window"):
        tps.kv_cache(**SMALL, max_step_tokens=4)  # No sliding layer: nothing to bound.


def test_a_hybrid_model_keeps_its_step_rows_with_every_position_kept():
    """Layers that read another's KV keep one step's rows (max_step_tokens) whether or not
    the sliding layers are bounded: both keywords together are a hybrid cache's, not a
    contradiction; its own refusals (persistence of bounded windows) stand."""
    hybrid = dict(SMALL, num_kv_heads=[2, 2, 1, 2, 2, 1], kv_sharing=[None] * 5 + [2],
                  sliding_window=[16, 16, None, 16, 16, None], max_step_tokens=4)
    with tps.kv_cache(**hybrid, bound_windows=False) as cache:
        assert isinstance(cache, tps.HybridKVCache) and cache.max_step_tokens == 4
        assert all(g.spec.ring_blocks == 0 for g in cache.groups)
    with pytest.raises(ValueError, match=r"bound_windows=True keeps only each sliding group"):
        tps.kv_cache(**hybrid, shm_name="tpusync-factory-hybrid")


EMPTY_NAMES = [
    (dict(shm_name=""), r"shm_name='' must be a non-empty str or None"),
    (dict(tier="file", path="TMP", file_name=""), r"file_name='' must be a non-empty str or None"),
    (dict(tier="file", path=""), r"path='' must be a non-empty path \(a directory\) or None"),
    (dict(spill_path=""), r"spill_path='' must be a non-empty path \(a directory\) or None"),
    (
        dict(shared_prefix_dir=""),
        r"shared_prefix_dir='' must be a non-empty path \(a directory\) or None",
    ),
    (dict(model_id=""), r"model_id='' must be a non-empty str or None \(None: unspecified\)"),
    (dict(model_id=" \t"), r"model_id=' \\t' must be a non-empty str or None"),
    (dict(prefix_salt=""), r"prefix_salt='' must be a non-empty str or bytes, or None"),
    (dict(prefix_salt=b""), r"prefix_salt=b'' must be a non-empty str or bytes, or None"),
]


@pytest.mark.parametrize(
    "constructor", ["kv_cache", "OffloadedKVCache", "HostPoolKVCache", "HybridKVCache"]
)
@pytest.mark.parametrize(
    "names, message",
    EMPTY_NAMES,
    ids=[
        "shm_name",
        "file_name",
        "path",
        "spill_path",
        "shared_prefix_dir",
        "model_id",
        "model_id-blank",
        "prefix_salt",
        "prefix_salt-bytes",
    ],
)
def test_an_empty_name_or_path_is_refused_by_name_in_every_constructor(
    constructor, names, message, tmp_path, monkeypatch
):
    """An empty shm or file name, or an empty directory (which would be the current one),
    names nothing, nor does a blank model id or an empty prefix salt: every constructor
    refuses it before it makes anything."""
    monkeypatch.chdir(tmp_path)  # An empty path taken for "." would write here.
    names = {k: str(tmp_path) if v == "TMP" else v for k, v in names.items()}
    args = dict(SMALL, **names)
    if constructor == "HostPoolKVCache" and args.get("tier") == "file":
        args.setdefault("file_name", "pool")  # A host pool's file tier is its copy alone.
    if constructor == "HybridKVCache":
        args.update(sliding_window=GEMMA3_WINDOWS, max_step_tokens=4)
    make = getattr(tps, constructor)
    with pytest.raises(ValueError, match=message):
        make(**args).close()
    assert not list(tmp_path.iterdir())
    if constructor == "HybridKVCache":  # And a hybrid whose groups are host pools.
        with pytest.raises(ValueError, match=message):
            make(**args, host_pool=True).close()


@pytest.mark.parametrize("constructor", ["OffloadedKVCache", "HostPoolKVCache"])
def test_one_character_is_enough_for_a_model_id_or_a_prefix_salt(constructor):
    """The edge of the two refusals above: a model id with one character besides blanks,
    and a one-byte salt, are names."""
    for names in (dict(model_id=" m"), dict(prefix_salt="s"), dict(prefix_salt=b"s")):
        with getattr(tps, constructor)(**SMALL, **names) as cache:
            assert cache.batch == SMALL["batch"]
