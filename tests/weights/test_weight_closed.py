"""Closed publishers, pullers and weight stores refuse every call by name; closing twice
is a no-op."""

from __future__ import annotations

import sys
import types

import jax
import numpy as np
import pytest

from jax_tpusync.weights.records import VersionNotFoundError
from jax_tpusync.weights.store import WeightStore
from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

from support import weights_support as ws

P = jax.sharding.PartitionSpec


@pytest.fixture
def mesh():
    return ws.mesh_of(jax.devices()[:1], (1,), ("x",))


def host_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((64,)).astype(np.float32), "b": np.arange(6.0).reshape(2, 3)}


def targets_of(mesh) -> dict:
    return {"a": jax.sharding.NamedSharding(mesh, P()), "b": jax.sharding.NamedSharding(mesh, P())}


def publish(store_dir, mesh, versions=(1,)) -> None:
    with WeightPublisher(store_dir, keep=5) as pub:
        for version in versions:
            params = {
                k: jax.device_put(v, targets_of(mesh)[k]) for k, v in host_params(version).items()
            }
            pub.publish(params, version)


def test_a_closed_publisher_refuses_every_call_by_name(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    pub = WeightPublisher(store_dir, keep=2)
    params = {k: jax.device_put(v, targets_of(mesh)[k]) for k, v in host_params(1).items()}
    pub.publish(params, 1)
    pub.close()
    pub.close()  # Twice: a no-op.
    for call in (
        lambda: pub.publish(params, 2),
        lambda: pub.wait(),
        lambda: pub.wait_complete(1),
    ):
        with pytest.raises(ValueError, match=r"^this WeightPublisher is closed$"):
            call()
    with pub:  # Closing again on exit: still a no-op.
        pass
    assert WeightStore(store_dir).versions() == [1]  # Nothing more was written.


def test_a_closed_puller_refuses_to_pull_by_name(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    publish(store_dir, mesh, versions=(1,))
    puller = WeightPuller(store_dir, timeout_s=5)
    pulled = puller.pull(targets_of(mesh))
    puller.close()
    puller.close()
    for version in ("latest", 1):
        with pytest.raises(ValueError, match=r"^this WeightPuller is closed$"):
            puller.pull(targets_of(mesh), version)
    assert puller.params is pulled and np.isfinite(np.asarray(pulled["b"])).all()


def test_a_closed_directory_store_refuses_every_public_method_by_name(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    publish(store_dir, mesh, versions=(1,))
    store = WeightStore(store_dir)
    manifest = store.read_manifest(1)
    store.close()
    store.close()
    assert store.describe() == str(store_dir)  # Kept for messages.
    calls = {
        "version_dir": lambda: store.version_dir(1),
        "part_writer": lambda: store.part_writer(2, 0, 1),
        "open_version": lambda: store.open_version(manifest),
        "versions": store.versions,
        "parts": lambda: store.parts(1),
        "is_complete": lambda: store.is_complete(1),
        "latest_complete": store.latest_complete,
        "read_manifest": lambda: store.read_manifest(1),
        "wait_manifest": lambda: store.wait_manifest(1, 0.1),
        "retire": lambda: store.retire(1),
    }
    public = {
        name
        for name in dir(WeightStore)
        if not name.startswith("_") and callable(getattr(WeightStore, name))
    }
    assert public - set(calls) == {"close", "describe"}
    for call in calls.values():
        with pytest.raises(ValueError, match=r"^this WeightStore is closed$"):
            call()
    assert not (store_dir / "v000000000002").exists()
    with pytest.raises(VersionNotFoundError):  # Another store of the directory still reads.
        WeightStore(store_dir).read_manifest(2)


def test_a_closed_mooncake_store_refuses_every_method_that_uses_the_store(monkeypatch):
    # A stand-in client module: the store connects at its first call, never made here.
    fake = types.ModuleType("mooncake.store")
    fake.MooncakeDistributedStore = object
    fake.ReplicateConfig = types.SimpleNamespace
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.store", fake)
    from jax_tpusync.weights.store_mooncake import MooncakeWeightStore

    store = MooncakeWeightStore("127.0.0.1:1", deadline_s=0.5)
    store.close()
    store.close()
    assert "127.0.0.1:1" in store.describe()
    calls = {
        "put_objects": lambda: store.put_objects([], [], "a test"),
        "versions": store.versions,
        "write_versions": lambda: store.write_versions([1]),
        "parts": lambda: store.parts(1),
        "is_complete": lambda: store.is_complete(1),
        "latest_complete": store.latest_complete,
        "read_manifest": lambda: store.read_manifest(1),
        "wait_manifest": lambda: store.wait_manifest(1, 0.1),
        "part_writer": lambda: store.part_writer(1, 0, 1),
        "open_version": lambda: store.open_version(None),
        "remove_version": lambda: store.remove_version(1),
        "retire": lambda: store.retire(1),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=r"^this MooncakeWeightStore is closed$"):
            call()
