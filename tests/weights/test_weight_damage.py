"""Bytes of the directory store changed after they were written (flipped in place in a part
file, its length kept) are never pulled as weights: the damaged version is refused by name,
``"latest"`` falls back to the newest intact version."""

from __future__ import annotations

import json
import logging
import re

import jax
import numpy as np
import pytest

from jax_tpusync.weights.records import DamagedVersionError, WeightSyncError
from jax_tpusync.weights.store import CHUNK_BYTES, WeightStore
from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

from support import weights_support as ws

P = jax.sharding.PartitionSpec


@pytest.fixture
def mesh():
    return ws.mesh_of(jax.devices()[:1], (1,), ("x",))


def host_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # "a" first in the part file, three chunks and a bit: boundaries inside one shard.
    return {
        "a": rng.standard_normal((3 * CHUNK_BYTES // 4 + 40,)).astype(np.float32),
        "b": rng.standard_normal((7, 5)).astype(np.float32),
    }


def targets_of(mesh) -> dict:
    return {"a": jax.sharding.NamedSharding(mesh, P()), "b": jax.sharding.NamedSharding(mesh, P())}


def publish(store_dir, mesh, versions=(1, 2)) -> dict:
    published = {}
    with WeightPublisher(store_dir, keep=5) as pub:
        for version in versions:
            published[version] = host_params(version)
            params = {
                k: jax.device_put(v, targets_of(mesh)[k]) for k, v in published[version].items()
            }
            pub.publish(params, version)
    return published


def part_file(store_dir, version: int):
    return store_dir / f"v{version:012d}" / "part-00000-of-00001.bin"


def flip(path, at: int, count: int = 1) -> None:
    """XORs ``count`` bytes of ``path`` from ``at`` in place (its length kept)."""
    with open(path, "r+b") as f:
        f.seek(at)
        data = bytearray(f.read(count))
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in data))


def assert_bitwise(pulled: dict, expected: dict) -> None:
    for key, value in expected.items():
        np.testing.assert_array_equal(ws.bits(pulled[key]), ws.bits(value))


POSITIONS = {
    "first_byte": lambda size: (0, 1),
    "last_byte": lambda size: (size - 1, 1),
    "before_chunk_boundary": lambda size: (CHUNK_BYTES - 1, 1),
    "at_chunk_boundary": lambda size: (CHUNK_BYTES, 1),
    "across_chunk_boundary": lambda size: (2 * CHUNK_BYTES - 32, 64),
    "middle_64_bytes": lambda size: (size // 2 - 32, 64),
}


@pytest.mark.parametrize("where", list(POSITIONS))
def test_flipped_bytes_are_refused_by_name_and_latest_falls_back(mesh, tmp_path, where):
    store_dir = tmp_path / "weights"
    published = publish(store_dir, mesh)
    path = part_file(store_dir, 2)
    size = path.stat().st_size
    at, count = POSITIONS[where](size)
    flip(path, at, count)
    assert path.stat().st_size == size
    puller = WeightPuller(store_dir, timeout_s=5)
    pulled = puller.pull(targets_of(mesh), "latest")
    assert puller.version == 1 and puller.stats.version == 1
    assert_bitwise(pulled, published[1])
    with pytest.raises(DamagedVersionError) as refused:
        puller.pull(targets_of(mesh), 2)
    message = str(refused.value)
    assert refused.value.version == 2
    assert message.startswith("weights version 2 is damaged: ") and str(path) in message
    lo, hi = map(int, re.search(r"bytes (\d+)-(\d+)", message).groups())
    assert lo <= at + count - 1 and at < hi  # The range named holds flipped bytes.
    assert re.search(r"leaf \['[ab]'\] shard \(", message)
    assert puller.version == 1 and puller.params is pulled  # Kept as they were.
    # The intact version still pulls bitwise equal, by number too.
    assert_bitwise(puller.pull(targets_of(mesh), 1), published[1])
    puller.close()


def test_latest_falls_back_past_several_damaged_versions_and_refuses_when_none_is_intact(
    mesh, tmp_path
):
    store_dir = tmp_path / "weights"
    published = publish(store_dir, mesh, versions=(1, 2, 3))
    flip(part_file(store_dir, 3), 10)
    flip(part_file(store_dir, 2), CHUNK_BYTES + 3)
    with WeightPuller(store_dir, timeout_s=5) as puller:
        assert_bitwise(puller.pull(targets_of(mesh), "latest"), published[1])
        assert puller.version == 1
        assert_bitwise(puller.pull(targets_of(mesh), "latest"), published[1])  # Held.
        assert puller.stats.reused
    flip(part_file(store_dir, 1), 0)
    with WeightPuller(store_dir, timeout_s=5) as puller:
        with pytest.raises(
            WeightSyncError, match=r"weights version 3 is damaged and no complete version older"
        ):
            puller.pull(targets_of(mesh), "latest")
        assert puller.version is None and puller.params is None


def test_a_read_of_a_byte_range_checks_only_the_chunks_it_reads(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    published = publish(store_dir, mesh, versions=(1,))
    store = WeightStore(store_dir)
    manifest = store.read_manifest(1)
    leaf = next(leaf for leaf in manifest.leaves if leaf.path == "['a']")
    assert leaf.shards[0].offset == 0
    flip(part_file(store_dir, 1), 2 * CHUNK_BYTES + 8)  # In chunk 2 of leaf a's shard.
    items = CHUNK_BYTES // 4
    with store.open_version(manifest) as opened:
        # Chunks 0 and 1 only: intact, read as written.
        (value,) = opened.read(leaf, [(0, (slice(0, 2 * items),))])
        np.testing.assert_array_equal(value, published[1]["a"][: 2 * items])
        with pytest.raises(DamagedVersionError, match=r"bytes 2097152-"):
            opened.read(leaf, [(0, (slice(2 * items - 1, 2 * items + 1),))])
        with pytest.raises(DamagedVersionError):
            opened.read_stacked(leaf, [0])


def test_a_manifest_written_before_checksums_is_read_unchecked_with_a_warning(
    mesh, tmp_path, caplog
):
    store_dir = tmp_path / "weights"
    published = publish(store_dir, mesh, versions=(1,))
    manifest_path = part_file(store_dir, 1).with_suffix(".json")
    doc = json.loads(manifest_path.read_text())
    del doc["chunks"], doc["chunk_bytes"]
    manifest_path.write_text(json.dumps(doc))
    with WeightPuller(store_dir, timeout_s=5) as puller, caplog.at_level(logging.WARNING):
        assert_bitwise(puller.pull(targets_of(mesh), "latest"), published[1])
    assert "weights version 1" in caplog.text and "without checksums" in caplog.text


def test_a_manifest_with_checksums_that_do_not_fit_its_shards_is_refused(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    publish(store_dir, mesh, versions=(1,))
    manifest_path = part_file(store_dir, 1).with_suffix(".json")
    doc = json.loads(manifest_path.read_text())
    doc["chunks"][0] = doc["chunks"][0][:-16]  # One chunk's checksum short.
    manifest_path.write_text(json.dumps(doc))
    with pytest.raises(
        WeightSyncError, match=r"weights version 1: leaf \['a'\] shard .* has 3 chunk"
    ):
        WeightStore(store_dir).read_manifest(1)
