"""Weight sync in one process (4 simulated CPU devices): a pull returns the published params
bitwise in the target layout, reads exactly what each destination shard holds, reuses its
plan, never returns an incomplete version, and refuses bad input by name."""

from __future__ import annotations

import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_tpusync.weights.plan import PlanCache, SourceLayout
from jax_tpusync.weights.records import (
    IncompleteVersionError,
    VersionNotFoundError,
    WeightSyncError,
)
from jax_tpusync.weights.staging import StagingBuffers
from jax_tpusync.weights.store import OpenVersion, PartWriter, WeightStore
from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

from support import weights_support as ws

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")


fsdp, tp = ws.fsdp, ws.tp


@pytest.fixture
def layouts():
    devices = jax.devices()
    train_mesh = ws.mesh_of(devices[:4], (4,), ("fsdp",))
    sample_mesh = ws.mesh_of(devices[2:4], (2,), ("tp",))
    params = ws.host_params(1)
    trained = ws.shard(params, train_mesh, ws.specs_like(params, fsdp))
    targets = ws.shardings(sample_mesh, ws.specs_like(params, tp))
    return params, trained, targets


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "weights"


def publish(directory, params, version, **kwargs):
    with WeightPublisher(directory, **kwargs) as pub:
        pub.publish(params, version)
    return pub.stats


def test_pull_returns_the_published_params_in_the_target_layout(layouts, store_dir):
    params, trained, targets = layouts
    stats = publish(store_dir, trained, 1)
    # Each unique shard once: every leaf's bytes (a scalar and replicated vectors once).
    assert stats.nbytes == sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    puller = WeightPuller(store_dir, timeout_s=5)
    pulled = puller.pull(targets)
    ws.check_pulled(pulled, params, targets, puller.stats)
    assert puller.version == 1 and puller.params is pulled
    # Ready for a jitted step on the sampler's mesh.
    out = jax.jit(lambda p: p["embed"] @ p["layers"][0]["wq"])(pulled)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(jnp.asarray(params["embed"]) @ params["layers"][0]["wq"])
    )


def test_plan_reads_exactly_each_destination_shards_ranges(layouts, store_dir):
    _, trained, targets = layouts
    publish(store_dir, trained, 1)
    puller = WeightPuller(store_dir, timeout_s=5)
    puller.pull(targets)
    (plan,) = puller.plans.plans().values()
    embed = next(leaf for leaf in plan.leaves if leaf.path == "['embed']")
    # embed [32, 16] bf16: rows over 4 (8 rows each) -> columns over 2 (8 columns each):
    # each destination shard reads an 8 x 8 piece of each of the 4 sources, nothing more.
    assert [b.box for b in embed.blocks] == [((0, 32), (0, 8)), ((0, 32), (8, 16))]
    for block in embed.blocks:
        assert sorted(p.source for p in block.pieces) == [0, 1, 2, 3]
        assert [p.elements for p in block.pieces] == [64] * 4
    assert embed.bytes_read == 32 * 16 * 2
    assert puller.stats.device_bytes == {d.id: n for d, n in plan.device_bytes().items()}


def test_plan_is_built_once_per_pair_of_layouts(layouts, store_dir):
    params, trained, targets = layouts
    puller = WeightPuller(store_dir, timeout_s=5)
    with WeightPublisher(store_dir) as pub:
        pub.publish(trained, 1)
        pub.wait()
        puller.pull(targets)
        assert (puller.plans.misses, puller.plans.hits, puller.stats.plan_cached) == (1, 0, False)
        first = next(iter(puller.plans.plans().values()))
        pub.publish(trained, 2)
        pub.wait()
    pulled = puller.pull(targets)
    assert (puller.plans.misses, puller.plans.hits, puller.stats.plan_cached) == (1, 1, True)
    assert puller.stats.plan_seconds == 0.0
    assert next(iter(puller.plans.plans().values())) is first
    ws.check_pulled(pulled, params, targets, puller.stats)
    # Another target layout is another plan.
    other = ws.shardings(
        ws.mesh_of(jax.devices()[:1], (1,), ("x",)), ws.specs_like(params, lambda p, n: P())
    )
    puller.pull(other)
    assert (puller.plans.misses, len(puller.plans)) == (2, 2)


def test_the_held_version_is_not_read_again(layouts, store_dir):
    _, trained, targets = layouts
    publish(store_dir, trained, 1)
    puller = WeightPuller(store_dir, timeout_s=5)
    first = puller.pull(targets)
    again = puller.pull(targets, "latest")
    assert again is first and puller.stats.reused and puller.stats.bytes_read == 0
    # Params the sampler deleted (donated) are read again, not handed back.
    first["embed"].delete()
    third = puller.pull(targets)
    assert third is not first and not puller.stats.reused
    assert not third["embed"].is_deleted()


def test_empty_and_scalar_leaves(store_dir):
    mesh = ws.mesh_of(jax.devices()[:4], (4,), ("fsdp",))
    params = {
        "empty": np.zeros((0, 8), np.float32),
        "scalar": np.float32(2.5),
        "bool": np.array([True, False, True, True]),
    }
    specs = {"empty": P(None, "fsdp"), "scalar": P(), "bool": P("fsdp")}
    publish(store_dir, ws.shard(params, mesh, specs), 1)
    other = ws.mesh_of(jax.devices()[1:3], (2,), ("x",))
    targets = ws.shardings(other, {"empty": P(None, "x"), "scalar": P(), "bool": P()})
    puller = WeightPuller(store_dir, timeout_s=5)
    ws.check_pulled(puller.pull(targets), jax.tree.map(np.asarray, params), targets, puller.stats)


def test_cast_on_the_way_floating_leaves_only(layouts, store_dir):
    params, trained, targets = layouts
    publish(store_dir, trained, 1)
    puller = WeightPuller(store_dir, timeout_s=5)
    pulled = puller.pull(targets, dtypes=jnp.float8_e4m3fn)
    want = jax.tree.map(
        lambda x: x.astype(jnp.float8_e4m3fn) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        params,
    )
    ws.check_pulled(pulled, want, targets, puller.stats, published=params)
    assert pulled["ids"].dtype == np.int32
    # Per-leaf dtypes: one leaf cast to f32, the rest kept.
    per_leaf = jax.tree.map(lambda s: None, targets)
    per_leaf["embed"] = jnp.float32
    pulled = puller.pull(targets, dtypes=per_leaf)
    assert pulled["embed"].dtype == np.float32 and pulled["experts"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pulled["embed"]), params["embed"].astype(np.float32))


class _StoreObject:
    """A directory store behind another object: the publisher then snapshots by a device
    copy, as for any store but a directory with params on the CPU backend."""

    def __init__(self, directory):
        self._store = WeightStore(directory)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("snapshot", ["write into the store", "device copy"])
def test_publish_snapshots_so_the_caller_may_delete_params(layouts, store_dir, snapshot):
    params, trained, targets = layouts
    store = store_dir if snapshot == "write into the store" else _StoreObject(store_dir)
    with WeightPublisher(store) as pub:
        pub.publish(trained, 1)
        for x in jax.tree.leaves(trained):  # As a donating train step would.
            x.delete()
    puller = WeightPuller(store_dir, timeout_s=5)
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)


def _writer_class(cls):
    """A ``WeightStore.part_writer`` that makes ``cls`` writers (to fail or slow a write)."""

    def part_writer(store, version, process, num_processes, *, fsync=False):
        return cls(store, version, process, num_processes, fsync=fsync)

    return part_writer


def write_part_of(store_dir, version, process, num_processes, params):
    """Process ``process``'s part of a version of ``num_processes`` publishers (host
    params, one shard per leaf: only process 0 writes data)."""
    writer = PartWriter(WeightStore(store_dir), version, process, num_processes)
    for path, x in ws.flat_with_paths(params):
        box = tuple((0, n) for n in x.shape)
        writer.add(path, x.shape, x.dtype.name, [(box, x)] if process == 0 else [])
    writer.commit()


def test_an_incomplete_version_is_refused_and_the_previous_params_kept(layouts, store_dir):
    params, trained, targets = layouts
    publish(store_dir, trained, 1)
    puller = WeightPuller(store_dir, timeout_s=5)
    held = puller.pull(targets)
    # Version 2 of two publishing processes: process 1 died before writing its part.
    write_part_of(store_dir, 2, 0, 2, ws.host_params(2))
    start = time.monotonic()
    with pytest.raises(
        IncompleteVersionError,
        match=r"weights version 2 is incomplete: no part from process\(es\) \[1\] of 2 "
        r"publishing processes after waiting 0.3 s .*previous params \(version 1\) kept",
    ) as info:
        puller.pull(targets, 2, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 3
    assert (info.value.version, info.value.missing) == (2, (1,))
    assert puller.version == 1 and puller.params is held
    # "latest" is the newest complete version: still 1.
    assert puller.pull(targets) is held
    # The next version works.
    publish(
        store_dir,
        ws.shard(ws.host_params(3), trained["embed"].sharding.mesh, ws.specs_like(params, fsdp)),
        3,
    )
    ws.check_pulled(puller.pull(targets), ws.host_params(3), targets, puller.stats)
    assert puller.version == 3


def test_a_version_whose_write_failed_stays_incomplete(layouts, store_dir, monkeypatch):
    params, trained, targets = layouts

    class FailingWriter(PartWriter):
        def add(self, path, shape, dtype, shards):
            if path == "['experts']":
                raise OSError(28, "No space left on device")
            super().add(path, shape, dtype, shards)

    pub = WeightPublisher(store_dir)
    pub.publish(trained, 1)
    pub.wait()
    monkeypatch.setattr(WeightStore, "part_writer", _writer_class(FailingWriter))
    pub.publish(trained, 2)
    with pytest.raises(
        WeightSyncError,
        match=r"weights version 2: writing this process's part "
        r"failed \(OSError: .*No space left on device\); the version stays "
        r"incomplete",
    ):
        pub.wait()
    assert sorted(p.name for p in (store_dir / "v000000000002").iterdir()) == []
    puller = WeightPuller(store_dir, timeout_s=5)
    with pytest.raises(
        IncompleteVersionError,
        match="weights version 2 is incomplete: no process has finished its part",
    ):
        puller.pull(targets, 2, timeout_s=0)
    assert puller.pull(targets) is not None and puller.version == 1
    monkeypatch.setattr(WeightStore, "part_writer", _writer_class(PartWriter))
    pub.publish(trained, 3)
    pub.close()
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)
    assert puller.version == 3


def test_missing_and_damaged_versions(layouts, store_dir):
    _, trained, targets = layouts
    puller = WeightPuller(store_dir, timeout_s=5)
    with pytest.raises(WeightSyncError, match=r"no complete weights version in .* after 0.05 s"):
        puller.pull(targets, timeout_s=0.05)
    publish(store_dir, trained, 1)
    with pytest.raises(
        VersionNotFoundError,
        match=r"weights version 9 not found in .*"
        r"\(versions present: \[1\]\) after waiting 0 s",
    ):
        puller.pull(targets, 9, timeout_s=0)
    data = store_dir / "v000000000001" / "part-00000-of-00001.bin"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(
        WeightSyncError,
        match=rf"weights version 1: process 0's data file .* has "
        rf"{size - 1} bytes, its manifest says {size} \(damaged\)",
    ):
        puller.pull(targets, 1)
    assert puller.version is None and puller.params is None


def test_old_versions_are_retired_and_an_open_one_stays_readable(layouts, store_dir):
    params, trained, _ = layouts
    store = WeightStore(store_dir)
    with WeightPublisher(store_dir, keep=1) as pub:
        pub.publish(trained, 1)
        pub.wait()
        opened = OpenVersion(store.read_manifest(1))
        pub.publish(trained, 2)
    assert store.versions() == [2]
    leaf = next(x for x in opened.manifest.leaves if x.path == "['embed']")
    view = opened.shard(leaf, 0)
    np.testing.assert_array_equal(ws.bits(view), ws.bits(params["embed"][:8]))
    del view
    opened.close()


# --- guards --------------------------------------------------------------------------


def test_publisher_guards(layouts, store_dir):
    params, trained, _ = layouts
    for bad, err, msg in [
        ({"keep": 0}, ValueError, r"keep=0 must be an int >= 1"),
        ({"keep": True}, ValueError, r"keep=True must be an int >= 1"),
        ({"copy": 1}, TypeError, r"copy=1 must be a bool"),
        ({"fsync": "no"}, TypeError, r"fsync='no' must be a bool"),
    ]:
        with pytest.raises(err, match=msg):
            WeightPublisher(store_dir, **bad)
    WeightPublisher(store_dir, keep=1).close()  # The edge itself is accepted.
    pub = WeightPublisher(store_dir)
    for version, err, msg in [
        (-1, ValueError, r"version=-1 must be in \[0, 999999999999\]"),
        (10**12, ValueError, r"version=1000000000000 must be in"),
        (1.0, TypeError, r"version=1.0 must be an int, got float"),
        (True, TypeError, r"version=True must be an int, got bool"),
    ]:
        with pytest.raises(err, match=msg):
            pub.publish(trained, version)
    with pytest.raises(
        TypeError, match=r"params leaf \['embed'\] is ndarray, expected a jax.Array"
    ):
        pub.publish(dict(trained, embed=params["embed"]), 0)
    with pytest.raises(ValueError, match="params has no leaves"):
        pub.publish({}, 0)
    assert WeightStore(store_dir).versions() == []  # Nothing refused was written.
    pub.publish(trained, 0)
    pub.wait()
    with pytest.raises(
        ValueError,
        match=r"version=0 must be above the last version published "
        r"here \(0\)",
    ):
        pub.publish(trained, 0)
    pub.publish(trained, 1)
    pub.close()
    with (
        WeightPublisher(store_dir) as other,
        pytest.raises(
            ValueError,
            match=r"version 1 was already published by process 0: "
            r"versions are immutable",
        ),
    ):
        other.publish(trained, 1)
    deleted = jax.tree.map(lambda x: x.copy(), trained)
    deleted["step"].delete()
    with (
        WeightPublisher(store_dir) as other,
        pytest.raises(ValueError, match=r"params leaf \['step'\] was deleted"),
    ):
        other.publish(deleted, 5)


def test_puller_guards(layouts, store_dir):
    params, trained, targets = layouts
    publish(store_dir, trained, 1)
    for kwargs, err, msg in [
        ({"timeout_s": -1}, ValueError, r"timeout_s=-1 must be a finite number of seconds >= 0"),
        ({"timeout_s": float("inf")}, ValueError, r"timeout_s=inf must be a finite"),
        ({"poll_s": 0}, ValueError, r"poll_s=0 must be > 0"),
        ({"plan_cache_size": 0}, ValueError, r"capacity=0 must be an int >= 1"),
    ]:
        with pytest.raises(err, match=msg):
            WeightPuller(store_dir, **kwargs)
    puller = WeightPuller(store_dir, timeout_s=0)  # The edge: no wait at all.
    bad = dict(targets, embed="replicated")
    with pytest.raises(
        TypeError,
        match=r"target_shardings leaf \['embed'\] is str, expected a "
        r"jax.sharding.Sharding",
    ):
        puller.pull(bad)
    fewer = {k: v for k, v in targets.items() if k != "experts"}
    with pytest.raises(
        ValueError,
        match=r"target_shardings does not match weights version 1: "
        r"published leaves without a target \[\"\['experts'\]\"\]",
    ):
        puller.pull(fewer)
    mesh3 = ws.mesh_of(jax.devices()[:3], (3,), ("x",))
    uneven = dict(targets, embed=jax.sharding.NamedSharding(mesh3, P("x")))
    with pytest.raises(
        ValueError,
        match=r"leaf \['embed'\]: target sharding .* does not split "
        r"shape \(32, 16\) evenly",
    ):
        puller.pull(uneven)
    per_leaf = jax.tree.map(lambda s: None, targets)
    per_leaf["ids"] = jnp.float32
    with pytest.raises(ValueError, match=r"leaf \['ids'\]: cast from int32 to float32 refused"):
        puller.pull(targets, dtypes=per_leaf)
    with pytest.raises(ValueError, match=r"dtypes=int8: a single dtype must be floating"):
        puller.pull(targets, dtypes=jnp.int8)
    with pytest.raises(
        ValueError,
        match=r"dtypes must be one dtype or a pytree like "
        r"target_shardings",
    ):
        puller.pull(targets, dtypes={"embed": jnp.float32})
    with pytest.raises(TypeError, match=r"version='newest' must be an int"):
        puller.pull(targets, "newest")
    assert puller.version is None  # Nothing refused changed the puller.
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)


def test_a_published_layout_that_does_not_tile_is_refused(store_dir):
    gap = SourceLayout("['w']", (4, 4), "float32", (((0, 2), (0, 4)),))
    with pytest.raises(
        ValueError,
        match=r"leaf \['w'\]: the published shards hold 8 elements of "
        r"16 \(shape \(4, 4\)\): the shards do not tile the array",
    ):
        gap.check()
    overlap = SourceLayout("['w']", (4,), "float32", (((0, 3),), ((2, 3),)))
    with pytest.raises(
        ValueError, match=r"published shards \(\(0, 3\),\) and \(\(2, 3\),\) overlap"
    ):
        overlap.check()
    SourceLayout("['w']", (4,), "float32", (((0, 2),), ((2, 4),))).check()
    # A part whose manifest disagrees with another's on the leaves is refused by name.
    store = WeightStore(store_dir)
    for process, shape in ((0, (4,)), (1, (5,))):
        writer = PartWriter(store, 7, process, 2)
        writer.add("['w']", shape, "float32", [])
        writer.commit()
    with pytest.raises(
        WeightSyncError,
        match=r"weights version 7: process 1's part names other "
        r"leaves",
    ):
        store.read_manifest(7)
    doc = json.loads((store.version_dir(7) / "part-00000-of-00002.json").read_text())
    assert doc["leaves"][0]["shards"] == []


def test_plan_cache_guard_and_bound():
    with pytest.raises(ValueError, match=r"capacity=0 must be an int >= 1"):
        PlanCache(0)
    cache = PlanCache(1)
    layout = SourceLayout("['w']", (4,), "float32", (((0, 4),),))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    cache.get("a", [layout], [one], [np.float32])
    cache.get("b", [layout], [one], [np.float32])
    assert len(cache) == 1 and cache.misses == 2


def test_wait_guards_and_a_slow_write(layouts, store_dir, monkeypatch):
    _, trained, _ = layouts

    class SlowWriter(PartWriter):
        def commit(self):
            time.sleep(0.5)
            super().commit()

    with pytest.raises(TypeError, match=r"store=123 must be a directory path, a 'mooncake://"):
        WeightPublisher(123)
    pub = WeightPublisher(store_dir)
    assert pub.wait(timeout_s=0) is None  # Nothing published: the edge returns at once.
    with pytest.raises(ValueError, match=r"timeout_s=-0.1 must be a finite number of seconds"):
        pub.wait(timeout_s=-0.1)
    monkeypatch.setattr(WeightStore, "part_writer", _writer_class(SlowWriter))
    pub.publish(trained, 1)
    with pytest.raises(
        WeightSyncError,
        match=r"weights version 1: its write did not end "
        r"within 0.05 s",
    ):
        pub.wait(timeout_s=0.05)
    assert pub.wait().version == 1  # Still running after the refusal; then done.
    with pytest.raises(ValueError, match=r"version=-1 must be in"):
        pub.wait_complete(-1)
    with pytest.raises(ValueError, match=r"timeout_s=nan must be a finite"):
        pub.wait_complete(1, timeout_s=float("nan"))
    assert pub.wait_complete(1, timeout_s=0).version == 1
    pub.close()


def test_part_writer_guards(store_dir):
    writer = PartWriter(WeightStore(store_dir), 1, 0, 1)
    writer.add("['a']", (2,), "float32", [(((0, 2),), np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match=r"leaf \['a'\] added twice to version 1's part"):
        writer.add("['a']", (2,), "float32", [])
    with pytest.raises(
        ValueError,
        match=r"leaf \['b'\]: shard \(\(0, 2\),\) data is "
        r"float32\[3\], expected float32 of its box",
    ):
        writer.add("['b']", (2,), "float32", [(((0, 2),), np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match=r"data is float64\[2\], expected float32"):
        writer.add("['c']", (2,), "float32", [(((0, 2),), np.zeros(2, np.float64))])
    # A refused leaf left nothing behind: it can be added right.
    writer.add("['b']", (2,), "float32", [(((0, 2),), np.ones(2, np.float32))])
    assert writer.nbytes == 16
    writer.abort()
    assert list((store_dir / "v000000000001").iterdir()) == []


def test_a_mooncake_store_without_its_client_is_refused_naming_the_extra(monkeypatch):
    import sys

    from jax_tpusync.weights.sync import open_weight_store

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # As if not installed.
    with pytest.raises(ImportError, match=r"needs the Mooncake Store client: pip install"):
        open_weight_store("mooncake://127.0.0.1:1")
    with pytest.raises(ImportError, match=r"jax-tpusync\[mooncake\]"):
        WeightPuller("mooncake://127.0.0.1:1")


def test_whole_shards_back_to_back_are_put_from_one_view_the_rest_staged(layouts, store_dir):
    # fsdp4 -> fsdp2: each destination block is two whole source shards along rows. Those
    # whose bytes are multiples of 64 lie back to back in the data file: one view of the
    # store, no staging copy; the others (16-byte and 8-byte shards: padding between them)
    # are copied into staging buffers.
    params, trained, _ = layouts
    mesh2 = ws.mesh_of(jax.devices()[:2], (2,), ("fsdp",))
    targets = ws.shardings(mesh2, ws.specs_like(params, fsdp))
    publish(store_dir, trained, 1)
    puller = WeightPuller(store_dir, timeout_s=5)
    pulled = puller.pull(targets)
    ws.check_pulled(pulled, params, targets, puller.stats)
    staged = sum(
        np.asarray(x).nbytes
        for path, x in ws.flat_with_paths(params)
        if np.ndim(x) and (np.asarray(x).nbytes // 4) % 64
    )
    assert staged == 16 * 4 * 2 + 8 * 4  # The two norms and the ids.
    assert puller.staging.max_free_bytes == staged
    # Staging buffers are lent again once the arrays holding them are gone.
    del pulled
    puller.params = None
    gc.collect()
    assert puller.staging.free_bytes == staged
    with WeightPublisher(store_dir) as pub:
        pub.publish(trained, 2)
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)
    assert puller.staging.reused == 3 * 2 and puller.staging.free_bytes == 0


def test_staging_buffers_guard_and_bound():
    with pytest.raises(ValueError, match=r"max_free_bytes=-1 must be >= 0"):
        StagingBuffers(-1)
    with pytest.raises(TypeError, match=r"max_free_bytes=True must be an int"):
        StagingBuffers(True)
    staging = StagingBuffers(4096)  # At the edge: one 4096-byte buffer kept, no more.
    a = staging.empty((1024,), np.float32)
    b = staging.empty((1024,), np.float32)
    assert a.ctypes.data % 4096 == 0 and a.flags.c_contiguous and a.flags.writeable
    del a, b
    gc.collect()
    assert staging.free_bytes == 4096
    assert staging.empty((2048,), np.uint16).nbytes == 4096 and staging.reused == 1
