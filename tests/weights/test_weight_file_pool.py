"""The directory store writes later versions over retired versions' data files, never over
one a puller still reads or holds arrays of (read leases), and a killed puller or publisher
blocks nothing and leaves nothing torn."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import subprocess
import sys
import textwrap
import weakref

import jax
import numpy as np
import pytest

from jax_tpusync.weights.file_pool import FilePool, FileRetiredError, MappingCache
from jax_tpusync.weights.records import IncompleteVersionError, WeightSyncError
from jax_tpusync.weights.store import WeightStore
from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

from support import weights_support as ws

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")


fsdp, tp = ws.fsdp, ws.tp


@pytest.fixture
def mesh():
    return ws.mesh_of(jax.devices()[:4], (4,), ("fsdp",))


def trained(mesh, seed: int):
    params = ws.host_params(seed)
    return params, ws.shard(params, mesh, ws.specs_like(params, fsdp))


def data_file(store_dir, version: int):
    return store_dir / f"v{version:012d}" / "part-00000-of-00001.bin"


def pooled(store_dir) -> list[int]:
    pool = store_dir / ".free"
    return sorted(os.stat(pool / n).st_ino for n in os.listdir(pool)) if pool.exists() else []


@pytest.mark.parametrize("same_layout", [True, False], ids=["fsdp4->fsdp4", "fsdp4->tp2"])
def test_a_retired_versions_file_is_written_over_and_pulls_stay_exact(mesh, tmp_path, same_layout):
    store_dir = tmp_path / "weights"
    targets_mesh = mesh if same_layout else ws.mesh_of(jax.devices()[2:4], (2,), ("tp",))
    params, _ = trained(mesh, 0)
    targets = ws.shardings(targets_mesh, ws.specs_like(params, fsdp if same_layout else tp))
    puller = WeightPuller(store_dir, timeout_s=5)
    inodes = {}
    with WeightPublisher(store_dir, keep=1) as pub:
        for version in (1, 2, 3):
            params, sharded = trained(mesh, version)
            pub.publish(sharded, version)
            pub.wait()
            inodes[version] = os.stat(data_file(store_dir, version)).st_ino
            if version == 2:  # Version 1 retired, its file pooled.
                assert pooled(store_dir) == [inodes[1]]
            if version == 3:  # Written over version 1's file; version 2's pooled.
                assert inodes[3] == inodes[1] and pooled(store_dir) == [inodes[2]]
                hits = puller.store.mappings.hits
            pulled = puller.pull(targets, version)
            ws.check_pulled(pulled, params, targets, puller.stats)
            if version == 3:  # Read through the mapping kept from version 1's pull.
                assert puller.store.mappings.hits == hits + 1
            for x in jax.tree.leaves(pulled):
                x.delete()
            del pulled
            puller.params = None
            gc.collect()


def test_a_file_whose_arrays_a_puller_holds_is_not_written_over(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    params1, sharded1 = trained(mesh, 1)
    targets = ws.shardings(mesh, ws.specs_like(params1, fsdp))  # Views of the store.
    puller = WeightPuller(store_dir, timeout_s=5)
    with WeightPublisher(store_dir, keep=1) as pub:
        pub.publish(sharded1, 1)
        pub.wait()
        held = puller.pull(targets, 1)
        held_inode = os.stat(data_file(store_dir, 1)).st_ino
        for version in (2, 3, 4):
            pub.publish(trained(mesh, version)[1], version)
            pub.wait()
            # Version 1 retired while held: unlinked, never pooled, never written over.
            assert held_inode not in pooled(store_dir)
        ws.check_pulled(held, params1, targets, puller.stats)
        # Version 4 held when 5 retires it: unlinked too (5 was written over 3's file).
        held4 = puller.pull(targets, 4)
        pub.publish(trained(mesh, 5)[1], 5)
        pub.wait()
        assert pooled(store_dir) == []
        # Once no array views it, a retired file is pooled again.
        puller.pull(targets, 5)
        five_inode = os.stat(data_file(store_dir, 5)).st_ino
        for x in [*jax.tree.leaves(held), *jax.tree.leaves(held4)]:
            x.delete()
        del held, held4
        puller.params = None
        gc.collect()
        pub.publish(trained(mesh, 6)[1], 6)
        pub.wait()
    assert pooled(store_dir) == [five_inode]


def test_a_file_being_written_over_is_refused_as_retired(tmp_path):
    path = tmp_path / "part.bin"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # What a writer holds.
        with pytest.raises(FileRetiredError, match=r"being reused for a newer version"):
            MappingCache().lease(path)
    finally:
        os.close(fd)
    mapped = MappingCache().lease(path)  # Free again: mapped, and pooled only once released.
    assert not FilePool(tmp_path).give(path, capacity=1) and not path.exists()
    del mapped
    path.write_bytes(b"y" * 4096)
    assert FilePool(tmp_path).give(path, capacity=1)
    # The pool holds at most `capacity` files: the edge, then one more is unlinked.
    path.write_bytes(b"z" * 4096)
    assert not FilePool(tmp_path).give(path, capacity=1) and not path.exists()


def test_a_retired_version_is_refused_by_name_when_opened(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    store = WeightStore(store_dir)
    with WeightPublisher(store_dir, keep=1) as pub:
        pub.publish(trained(mesh, 1)[1], 1)
        pub.wait()
        manifest = store.read_manifest(1)
        pub.publish(trained(mesh, 2)[1], 2)
    with pytest.raises(
        WeightSyncError, match=r"weights version 1 was retired while opening it .*pull again"
    ):
        store.open_version(manifest)


def test_a_killed_puller_blocks_no_reuse(tmp_path):
    path = tmp_path / "part.bin"
    path.write_bytes(b"x" * 8192)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from jax_tpusync.weights.file_pool import MappingCache
                mapped = MappingCache().lease({str(path)!r})
                print("mapped", flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,  # Import the installed package, not the source tree.
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        fd = os.open(path, os.O_RDWR)
        try:  # Its lease holds against any writer.
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    assert FilePool(tmp_path).give(path, capacity=1)


def test_a_publisher_killed_writing_over_a_pooled_file_leaves_its_version_incomplete(
    mesh, tmp_path
):
    store_dir = tmp_path / "weights"
    params2, sharded2 = trained(mesh, 2)
    targets = ws.shardings(mesh, ws.specs_like(params2, fsdp))
    with WeightPublisher(store_dir, keep=1) as pub:
        pub.publish(trained(mesh, 1)[1], 1)
        pub.wait()
        pub.publish(sharded2, 2)
    assert len(pooled(store_dir)) == 1
    # Version 3 of two processes: process 0 wrote half of its part over the pooled file and
    # died (no commit, no abort: its descriptor and lock went with it).
    writer = WeightStore(store_dir).part_writer(3, 0, 2)
    assert writer.reused_file and pooled(store_dir) == []
    leaf = ws.flat_with_paths(params2)[0]
    writer.add(leaf[0], leaf[1].shape, leaf[1].dtype.name, [])
    del writer  # Its file closed (and its lock dropped) as a killed process's would be.
    gc.collect()
    puller = WeightPuller(store_dir, timeout_s=5)
    with pytest.raises(IncompleteVersionError, match=r"weights version 3 is incomplete"):
        puller.pull(targets, 3, timeout_s=0.1)
    ws.check_pulled(puller.pull(targets), params2, targets, puller.stats)
    assert puller.version == 2


@pytest.mark.parametrize(
    "sizes", [(1000, 3000, 5000), (5000, 3000, 1000), (4096, 4096, 4096)], ids=str
)
def test_a_reused_file_holds_exactly_each_parts_bytes_whatever_its_size(tmp_path, sizes):
    # Longer than the file it reuses (past its end by write calls), shorter (truncated),
    # or the same (all through the kept mapping); shards at unaligned sizes (padding).
    store = WeightStore(tmp_path / "weights")
    rng = np.random.default_rng(0)
    for version, size in enumerate(sizes, start=1):
        shards = [rng.integers(0, 255, n, dtype=np.uint8) for n in (size, 7, size // 3)]
        writer = store.part_writer(version, 0, 1)
        assert writer.reused_file == (version > 2)
        for i, a in enumerate(shards):
            writer.add(f"['l{i}']", a.shape, "uint8", [(((0, a.size),), a)])
        writer.commit()
        manifest = store.read_manifest(version)
        opened = store.open_version(manifest)
        for leaf, a in zip(manifest.leaves, shards, strict=True):
            np.testing.assert_array_equal(opened.shard(leaf, 0), a)
        opened.close()
        store.retire(1)


def test_a_kept_mapping_of_an_unlinked_file_is_dropped_at_the_next_lease(tmp_path):
    cache = MappingCache(capacity=2)
    first, second, third = (tmp_path / f"{n}.bin" for n in "abc")
    for path in (first, second, third):
        path.write_bytes(b"x" * 4096)
    view = cache.lease(first)
    assert cache.kept == 1 and bytes(view[:2]) == b"xx"
    del view
    first.unlink()  # Retired while its mapping was kept: its pages go at the next lease.
    cache.lease(second)
    assert cache.kept == 1
    cache.lease(third)
    cache.lease(second)  # A hit; at capacity 2 nothing is evicted.
    assert (cache.kept, cache.hits) == (2, 1)


def test_a_manifest_like_the_last_one_read_is_not_parsed_again_but_still_checked(mesh, tmp_path):
    store_dir = tmp_path / "weights"
    store = WeightStore(store_dir)
    with WeightPublisher(store_dir, keep=3) as pub:
        for version in (1, 2, 3):
            pub.publish(trained(mesh, version)[1], version)
    first = store.read_manifest(1)
    second = store.read_manifest(2)  # The same layout: the first's leaves, its own version.
    assert second.leaves is first.leaves and second.fingerprint == first.fingerprint
    assert second.version == 2 and second.data_files[0] == data_file(store_dir, 2)
    # Its chunk checksums are its own, read from its manifest as a fresh store reads them.
    assert second.shard_checksums == WeightStore(store_dir).read_manifest(2).shard_checksums
    assert second.shard_checksums != first.shard_checksums
    # Its data file is still checked: one byte short is refused by name.
    path = data_file(store_dir, 3)
    size = path.stat().st_size
    os.truncate(path, size - 1)
    with pytest.raises(
        WeightSyncError, match=rf"weights version 3: .* has {size - 1} bytes, its manifest says "
    ):
        store.read_manifest(3)


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_shards_over_the_streaming_threshold_land_exactly_in_a_reused_file(tmp_path, copy_threads):
    # Into a reused file's mapping, shards are copied together at flush or commit: over
    # threads, those of 256 KiB and more with streaming stores, split into 1 MiB pieces.
    store = WeightStore(tmp_path / "weights", copy_threads=copy_threads)
    rng = np.random.default_rng(copy_threads)
    sizes = ((3 << 20) + 5, (256 << 10) + 1, 7, (1 << 20) - 1)
    for version in (1, 2, 3):
        shards = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
        writer = store.part_writer(version, 0, 1)
        assert writer.reused_file == (version == 3)
        for i, a in enumerate(shards):
            writer.add(f"['l{i}']", a.shape, "uint8", [(((0, a.size),), a)])
        writer.commit()
        manifest = store.read_manifest(version)
        with store.open_version(manifest) as opened:
            for leaf, a in zip(manifest.leaves, shards, strict=True):
                np.testing.assert_array_equal(opened.shard(leaf, 0), a)
        store.retire(1)


def test_a_reused_files_copies_wait_for_flush_and_an_abort_drops_them(tmp_path):
    store = WeightStore(tmp_path / "weights")
    for version in (1, 2):
        writer = store.part_writer(version, 0, 1)
        writer.add("['a']", (8192,), "uint8", [(((0, 8192),), np.full(8192, version, np.uint8))])
        writer.commit()
        store.retire(1)
    writer = store.part_writer(3, 0, 1)  # Over version 1's file (8192 bytes, all 1).
    assert writer.reused_file
    (written,) = store.version_dir(3).glob("part-00000-of-00001.bin.tmp-*")
    writer.add("['a']", (4096,), "uint8", [(((0, 4096),), np.full(4096, 3, np.uint8))])
    # Not copied yet (the caller keeps the shard unchanged until flush or commit).
    assert (np.fromfile(written, np.uint8, count=4096) == 1).all()
    writer.flush()
    assert (np.fromfile(written, np.uint8, count=4096) == 3).all()
    pending = np.full(4096, 4, np.uint8)
    dropped = weakref.ref(pending)
    writer.add("['b']", (4096,), "uint8", [(((0, 4096),), pending)])
    del pending
    assert dropped() is not None  # Held for the copy.
    writer.abort()  # The copy is dropped with the part, and its source let go.
    gc.collect()
    assert dropped() is None
    assert store.versions() == [2, 3] and not list(store.version_dir(3).iterdir())


def test_a_store_refuses_copy_threads_below_one():
    with pytest.raises(ValueError, match=r"copy_threads=0 must be >= 1"):
        WeightStore("/nonexistent-never-created", copy_threads=0)
    with pytest.raises(TypeError, match=r"copy_threads=True must be an int"):
        WeightStore("/nonexistent-never-created", copy_threads=True)
    assert not os.path.exists("/nonexistent-never-created")


def test_an_empty_store_directory_is_refused_by_name(tmp_path, monkeypatch):
    """An empty path would be the current directory: refused before anything is made
    there; a one-character path is a directory (the edge)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"directory='' must be a non-empty path \(a directory\)"):
        WeightStore("")
    for role in (WeightPublisher, WeightPuller):
        with pytest.raises(
            ValueError,
            match=r"store='' must be a non-empty directory path, a 'mooncake://host:port' "
            r"address or a weight store object",
        ):
            role("")
    assert not list(tmp_path.iterdir())
    WeightStore("w").close()
    assert [p.name for p in tmp_path.iterdir()] == ["w"]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_a_same_layout_pull_puts_views_of_the_store_and_copies_no_byte(mesh, tmp_path):
    # On the CPU backend every pulled shard's buffer lies inside the store's mapped data
    # file: the publish's copy into the store is the only copy of the params.
    store_dir = tmp_path / "weights"
    params, sharded = trained(mesh, 0)
    targets = ws.shardings(mesh, ws.specs_like(params, fsdp))
    with WeightPublisher(store_dir) as pub:
        pub.publish(sharded, 1)
    puller = WeightPuller(store_dir, timeout_s=5)
    pulled = puller.pull(targets, 1)
    ws.check_pulled(pulled, params, targets, puller.stats)
    path = str(data_file(store_dir, 1))
    with open("/proc/self/maps") as maps:
        mapped = [
            tuple(int(a, 16) for a in line.split()[0].split("-"))
            for line in maps
            if line.rstrip().endswith(path)
        ]
    assert mapped
    # Every shard of the sharded leaves (the replicated scalar's 4 copies are JAX's own).
    sharded_leaves = [x for x in jax.tree.leaves(pulled) if x.ndim]
    pointers = [
        s.data.unsafe_buffer_pointer() for x in sharded_leaves for s in x.addressable_shards
    ]
    assert len(pointers) == 4 * len(sharded_leaves) == 4 * 7
    assert all(any(lo <= p < hi for lo, hi in mapped) for p in pointers)
    assert puller.staging.max_free_bytes == 0  # Nothing staged.


def test_a_publish_over_a_reused_file_survives_a_donating_step_right_after(mesh, tmp_path):
    # The copy into the reused file (threads, streaming stores) ends before publish
    # returns, and until then the writer holds the shards: a step that donates the params
    # at once cannot change what was published.
    store_dir = tmp_path / "weights"
    step = jax.jit(lambda p: jax.tree.map(lambda x: x + x, p), donate_argnums=0)
    params, sharded = trained(mesh, 3)
    targets = ws.shardings(mesh, ws.specs_like(params, fsdp))
    with WeightPublisher(store_dir, keep=1) as pub:
        pub.publish(trained(mesh, 1)[1], 1)
        pub.wait()
        first_file = os.stat(data_file(store_dir, 1)).st_ino
        pub.publish(trained(mesh, 2)[1], 2)
        pub.wait()
        pub.publish(sharded, 3)
        doubled = step(sharded)  # Donates (or, where JAX cannot, copies) the published params.
        pub.wait()
    assert os.stat(data_file(store_dir, 3)).st_ino == first_file  # Written over version 1's.
    jax.block_until_ready(doubled)
    puller = WeightPuller(store_dir, timeout_s=5)
    ws.check_pulled(puller.pull(targets, 3), params, targets, puller.stats)
