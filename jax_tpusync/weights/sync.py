"""Weight sync for reinforcement learning: a trainer publishes versions of its sharded
parameters, samplers pull them laid out their own way.

* :class:`WeightPublisher` (trainer side, one per process): :meth:`~WeightPublisher.publish`
  snapshots the process's own unique shards (``replica_id == 0`` among its addressable
  shards) and writes them to a :class:`~jax_tpusync.weights.store.WeightStore` on a
  background thread, so the training step waits only for the snapshot.
* :class:`WeightPuller` (sampler side, one per process): :meth:`~WeightPuller.pull` reads a
  complete version, and only the index ranges each of its destination shards needs (a
  :class:`~jax_tpusync.weights.plan.WeightPlan`, computed once per pair of layouts), casts
  on the way if asked, and returns jax arrays with the target shardings.

Publisher and puller need not share a mesh, a PartitionSpec or a process count: the store
records each shard's index box, not devices. A puller never returns a mix of versions; a
version a publisher left incomplete is refused by name and the puller keeps what it had;
so is a version whose stored bytes do not match their checksums (``"latest"`` then falls
back to the newest intact complete version).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.weights.plan import PlanCache, WeightPlan, box_of_index, box_volume
from jax_tpusync.weights.records import (
    DamagedVersionError,
    IncompleteVersionError,
    PartWriting,
    VersionManifest,
    WeightStoreBackend,
    WeightSyncError,
    check_timeout,
    check_version,
)
from jax_tpusync.weights.staging import StagingBuffers
from jax_tpusync.weights.store import WeightStore, complete

logger = logging.getLogger(__name__)

__all__ = [
    "DamagedVersionError",
    "IncompleteVersionError",
    "PublishStats",
    "PullStats",
    "WeightPublisher",
    "WeightPuller",
    "WeightSyncError",
    "open_weight_store",
]


def open_weight_store(store: Any) -> WeightStoreBackend:
    """The store named by ``store``: a directory path (:class:`WeightStore`), a
    ``"mooncake://host:port[?option=value&...]"`` address (a
    :class:`~jax_tpusync.weights.store_mooncake.MooncakeWeightStore`; options in
    :meth:`~jax_tpusync.weights.store_mooncake.MooncakeWeightStore.from_url`, the address
    read by :func:`~jax_tpusync.mooncake.url.open_url`), or a store object (anything
    with the :class:`~jax_tpusync.weights.records.WeightStoreBackend` methods), returned as
    it is."""
    if isinstance(store, str) and store.startswith("mooncake:"):
        from jax_tpusync.weights.store_mooncake import MooncakeWeightStore

        return MooncakeWeightStore.from_url(store)
    if isinstance(store, (str, os.PathLike)):
        if not os.fspath(store):  # Path("") is the current directory, by accident.
            raise ValueError(
                f"store={store!r} must be a non-empty directory path, a "
                f"'mooncake://host:port' address or a weight store object"
            )
        return WeightStore(store)
    if isinstance(store, WeightStoreBackend):
        return store
    raise TypeError(
        f"store={store!r} must be a directory path, a 'mooncake://host:port' address or a "
        f"weight store object"
    )


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """One publish on this process.

    Attributes:
      version: the version published.
      snapshot_seconds: how long :meth:`WeightPublisher.publish` blocked the caller (checks,
        the device copy's dispatch, waiting for the previous write if still running).
      write_seconds: the write (device to host, into the store, the commit), in the
        background; for a directory store and params on JAX's CPU backend with
        ``copy=True``, its copy into the store ran in :meth:`WeightPublisher.publish`
        (counted in ``snapshot_seconds`` too).
      nbytes: bytes this process wrote (its unique shards).
      shards: how many shards it wrote.
    """

    version: int
    snapshot_seconds: float
    write_seconds: float
    nbytes: int
    shards: int


@dataclasses.dataclass(frozen=True)
class PullStats:
    """One pull on this process.

    Attributes:
      version: the version returned.
      bytes_read: source bytes read from the store (each distinct destination shard once).
      device_bytes: ``{device id: bytes of the shards it received}`` (target dtypes).
      plan_cached: whether the plan came from the cache.
      plan_seconds: time to build the plan (0 when cached).
      wait_seconds: time waiting for the version to be complete and checking its manifest.
      read_seconds: time copying the planned ranges out of the store.
      put_seconds: time putting them on the devices and assembling the arrays.
      reused: the version and layout were what the puller already held (nothing read).
    """

    version: int
    bytes_read: int
    device_bytes: dict[int, int]
    plan_cached: bool
    plan_seconds: float
    wait_seconds: float
    read_seconds: float
    put_seconds: float
    reused: bool = False

    @property
    def total_seconds(self) -> float:
        return self.plan_seconds + self.wait_seconds + self.read_seconds + self.put_seconds


def _leaf_paths(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(jax.tree_util.keystr(p), x) for p, x in flat], treedef


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 4096) -> np.ndarray:
    """An uninitialized array whose data starts at a multiple of ``alignment`` bytes: JAX's
    CPU backend adopts such a host array as a device buffer without copying it (on other
    backends ``device_put`` copies it to the device either way)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _stacked_view(opened: Any, leaf: Any, block: Any) -> np.ndarray | None:
    """The store's one view of ``block`` where its pieces are whole source shards stacked
    along the first axis that the store holds back to back (``read_stacked``); None
    otherwise (then its pieces are read and copied)."""
    if len(block.pieces) < 2 or not block.box:
        return None
    pieces = sorted(block.pieces, key=lambda p: leaf.shards[p.source].box)
    for p in pieces:
        box = leaf.shards[p.source].box
        if p.elements != box_volume(box) or box[1:] != block.box[1:]:
            return None
    if leaf.shards[pieces[0].source].box[0][0] != block.box[0][0]:
        return None
    view = opened.read_stacked(leaf, [p.source for p in pieces])
    if view is None or view.shape != block.shape or not view.flags.c_contiguous:
        return None
    return view


def _whole_view(opened: Any, leaf: Any, leaf_plan: Any) -> np.ndarray | None:
    """The store's one view of the whole array where every destination block is whole
    along all axes but the first (row shards, or replicas) and the store holds all of the
    array's shards back to back (``read_stacked``): ``device_put`` of it with the target
    sharding puts each device's rows from it, one call per array instead of one per
    shard. None otherwise."""
    if not leaf.shape or not leaf_plan.blocks:
        return None
    rest = tuple((0, n) for n in leaf.shape[1:])
    if any(block.box[1:] != rest for block in leaf_plan.blocks):
        return None
    view = opened.read_stacked(leaf, list(range(len(leaf.shards))))
    if view is None or view.shape != tuple(leaf.shape) or not view.flags.c_contiguous:
        return None
    return view


def _copy_tree(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


_jitted_copy = jax.jit(_copy_tree)

# A pull puts its buffers on the devices in groups of leaves that staged (copied) at most
# about this many bytes (views of the store are not staged).
STAGED_BYTES_PER_PUT = 256 << 20


class WeightPublisher:
    """Publishes versions of a pytree of sharded jax arrays into a store.

    Every process of the trainer makes one and publishes every version (each writes only its
    own unique shards; the version is complete when all have). Process 0 retires old
    versions, keeping the ``keep`` newest complete ones.

    Args:
      store: where versions go, shared with the pullers (:func:`open_weight_store`): a
        directory (``/dev/shm/...`` for memory speed on one host) or
        ``"mooncake://host:port?..."`` (across hosts; this process's shards then live in
        the DRAM it gives the Mooncake pool, so it must stay up while they are pulled).
      keep: complete versions kept (>= 1); a puller that is reading a retired version keeps
        reading it.
      copy: ``True``: :meth:`publish` dispatches a device copy of ``params`` (asynchronous:
        the caller waits for its dispatch only; it costs device memory of one copy of the
        params until the write ends), so the caller may donate or delete ``params`` at once.
        ``False``: no copy; the caller must keep ``params`` alive and undonated until
        :meth:`wait` returns.
      fsync: flush each part to stable storage before it counts (for a disk directory that
        must survive a machine crash; not needed on ``/dev/shm``).
    """

    def __init__(
        self,
        store: str | os.PathLike | WeightStoreBackend,
        *,
        keep: int = 2,
        copy: bool = True,
        fsync: bool = False,
    ):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1")
        for name, value in (("copy", copy), ("fsync", fsync)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be a bool")
        self.store = open_weight_store(store)
        self.keep = keep
        self.copy = copy
        self.fsync = fsync
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self.last_version: int | None = None
        self.stats: PublishStats | None = None
        self._pending: concurrent.futures.Future | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="weight-publish"
        )
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this WeightPublisher is closed")

    def publish(self, params: Any, version: int) -> None:
        """Publishes ``params`` (a pytree of jax arrays) as ``version``.

        Blocks only for the snapshot (see the class's ``copy``) and, if the previous
        version's write is still running, until it ends; the write itself runs in the
        background (:meth:`wait` for it). The version becomes visible to pullers when every
        process's part is written.

        Raises:
          TypeError / ValueError: a leaf that is not a jax array, a version that is not an
            int above the last one published here (nothing is written).
          WeightSyncError: the previous version's write failed (that version stays
            incomplete; this one is not published), or the store did not answer (a
            Mooncake master that is down: within its deadline).
        """
        self._check_open()
        start = time.perf_counter()
        version = check_version(version)
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"version={version} must be above the last version published here "
                f"({self.last_version})"
            )
        leaves, _ = _leaf_paths(params)
        if not leaves:
            raise ValueError("params has no leaves: nothing to publish")
        for path, x in leaves:
            if not isinstance(x, jax.Array):
                raise TypeError(
                    f"params leaf {path or '<root>'} is {type(x).__name__}, expected a jax.Array"
                )
            if x.is_deleted():
                raise ValueError(f"params leaf {path or '<root>'} was deleted (donated?)")
        _, present = self.store.parts(version)
        if self.process_index in present:
            raise ValueError(
                f"version {version} was already published by process {self.process_index}: "
                f"versions are immutable, publish a new one"
            )
        self.wait()  # The previous write: its error, if any, surfaces here.
        on_host = all(d.platform == "cpu" for _, x in leaves for d in x.sharding.device_set)
        host_snapshot = self.copy and self._snapshot_is_the_write(on_host)
        if self.copy and not host_snapshot:
            try:
                params = _jitted_copy(params)
            except ValueError:  # Leaves on different device sets: copy them one by one.
                params = jax.tree.map(jnp.copy, params)
        leaves, _ = _leaf_paths(params)
        snapshot = []
        for path, x in leaves:
            shards = [s for s in x.addressable_shards if s.replica_id == 0]
            snapshot.append(
                (
                    path,
                    tuple(x.shape),
                    np.dtype(x.dtype).name,
                    [(box_of_index(s.index, x.shape), s.data) for s in shards],
                )
            )
        written = None
        if host_snapshot:
            # The shards' bytes go into the store now (the params may be donated as soon as
            # publish returns); the commit and retiring stay in the background.
            try:
                written = self._fill(version, snapshot, on_host)
            except Exception as e:  # noqa: BLE001 - raised by wait(), as from the thread.
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(e)
                self.last_version, self._pending = version, failed
                return
        snapshot_seconds = time.perf_counter() - start
        self.last_version = version
        self._pending = self._executor.submit(
            self._write, version, snapshot, snapshot_seconds, on_host, written
        )

    def _snapshot_is_the_write(self, on_host: bool) -> bool:
        """Whether ``copy=True`` takes its snapshot by writing into the store in the calling
        thread: for a directory store and params on JAX's CPU backend, where a device copy
        is a host copy into fresh memory (its pages faulted in one by one) and the write is
        a host copy into the store's reused files: the same bytes copied once instead of
        twice, and no slower to block for."""
        return isinstance(self.store, WeightStore) and on_host

    def _fill(self, version: int, snapshot: list, on_host: bool) -> tuple[PartWriting, int, float]:
        """Opens this process's part of ``version`` and adds every leaf's shards (``on_host``:
        all of them on JAX's CPU backend): ``(writer, shards added, seconds)``; on failure
        nothing of the part stays."""
        start = time.perf_counter()
        for _, _, _, shards in snapshot:  # Start every device-to-host copy first.
            for _, data in shards:
                if not on_host:  # (On the CPU backend a shard is on the host already.)
                    data.copy_to_host_async()
        writer = self.store.part_writer(
            version, self.process_index, self.process_count, fsync=self.fsync
        )
        count = 0
        try:
            for path, shape, dtype, shards in snapshot:
                writer.add(path, shape, dtype, [(box, np.asarray(data)) for box, data in shards])
                count += len(shards)
            # A directory store's writer copies what add() left in a reused file all at once
            # (threads, streaming stores): done here, before publish may return.
            flush = getattr(writer, "flush", None)
            if flush is not None:
                flush()
        except BaseException:
            writer.abort()
            raise
        return writer, count, time.perf_counter() - start

    def _write(
        self,
        version: int,
        snapshot: list,
        snapshot_seconds: float,
        on_host: bool,
        written: tuple[PartWriting, int, float] | None = None,
    ) -> PublishStats:
        start = time.perf_counter()
        filled_before = written is not None  # In publish (then not in this thread's time).
        if written is None:
            written = self._fill(version, snapshot, on_host)
        writer, count, fill_seconds = written
        try:
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        snapshot.clear()  # Drop the device copies now.
        if self.process_index == 0:
            self.store.retire(self.keep)
        stats = PublishStats(
            version,
            snapshot_seconds,
            time.perf_counter() - start + (fill_seconds if filled_before else 0.0),
            writer.nbytes,
            count,
        )
        logger.debug(
            "published weights version %d: %d bytes in %.3f s",
            version,
            writer.nbytes,
            stats.write_seconds,
        )
        return stats

    def wait(self, timeout_s: float | None = None) -> PublishStats | None:
        """Waits for the last publish's write; returns its stats (None if none ran).

        Raises:
          WeightSyncError: the write failed (its version stays incomplete) or did not end
            within ``timeout_s``.
        """
        self._check_open()
        if timeout_s is not None:
            timeout_s = check_timeout("timeout_s", timeout_s)
        if self._pending is None:
            return self.stats
        try:
            self.stats = self._pending.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(
                f"weights version {self.last_version}: its write did not end within {timeout_s:g} s"
            ) from None
        except Exception as e:
            self._pending = None
            raise WeightSyncError(
                f"weights version {self.last_version}: writing this process's part failed "
                f"({type(e).__name__}: {e}); the version stays incomplete"
            ) from e
        self._pending = None
        return self.stats

    def wait_complete(self, version: int, timeout_s: float = 60.0) -> VersionManifest:
        """Waits until every publishing process has written ``version``.

        Raises:
          IncompleteVersionError: some process's part is still missing at the deadline,
            naming the processes.
        """
        self._check_open()
        version = check_version(version)
        return self.store.wait_manifest(version, check_timeout("timeout_s", timeout_s))

    def close(self) -> None:
        """Waits for the last write, then stops the writer thread and closes the store (a
        Mooncake store's objects in this process's memory go with it). Every later call
        but :meth:`close` (a no-op) is refused."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WeightPuller:
    """Pulls versions from a store laid out as this process wants them.

    Every process of the sampler makes one and calls :meth:`pull` together (with several
    processes, process 0 picks ``"latest"`` and they agree on it, and all refuse a version
    any of them cannot read).

    Args:
      store: the publishers' store (:func:`open_weight_store`: a directory, a
        ``"mooncake://host:port?..."`` address or a store object).
      timeout_s: default deadline of a pull (waiting for a version to be complete).
      poll_s: how often a waiting pull looks again.
      plan_cache_size: how many plans (pairs of layouts) are kept.

    Attributes:
      version: the version last pulled (None before the first).
      params: the params last pulled; a pull that fails leaves both as they were.
      plans: the plan cache (``plans.hits``, ``plans.misses``).
      stats: the last pull's :class:`PullStats`.
      staging: the host buffers pieces are copied into before ``device_put``, reused by
        later pulls once unreferenced (:class:`~jax_tpusync.weights.staging.StagingBuffers`;
        it keeps at most one pull's worth unused).
    """

    def __init__(
        self,
        store: str | os.PathLike | WeightStoreBackend,
        *,
        timeout_s: float = 60.0,
        poll_s: float = 0.01,
        plan_cache_size: int = 16,
    ):
        self.timeout_s = check_timeout("timeout_s", timeout_s)
        self.poll_s = check_timeout("poll_s", poll_s)
        if self.poll_s <= 0:
            raise ValueError(f"poll_s={poll_s!r} must be > 0")
        self.store = open_weight_store(store)
        self.plans = PlanCache(plan_cache_size)
        self.version: int | None = None
        self.params: Any = None
        self.stats: PullStats | None = None
        self.staging = StagingBuffers(0)
        self._held_plan_key: Any = None
        self._closed = False
        self._damaged: set[int] = set()  # Versions found damaged: "latest" passes them by.

    def pull(
        self,
        target_shardings: Any,
        version: int | str = "latest",
        *,
        dtypes: Any = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The params of ``version`` with ``target_shardings``.

        Args:
          target_shardings: a pytree of :class:`jax.sharding.Sharding` with the published
            params' structure (the same leaf paths); the result has this structure.
          version: an int, or ``"latest"`` (the newest complete version).
          dtypes: None (keep the published dtypes), one floating dtype (floating leaves are
            cast to it, others kept), or a pytree like ``target_shardings`` of dtypes or
            None per leaf. Only floating to floating casts.
          timeout_s: how long to wait for the version to be complete (default: the
            puller's).

        Returns:
          The pytree of jax arrays, each made by ``jax.make_array_from_single_device_arrays``
          with its target sharding.

        Raises:
          IncompleteVersionError: the version is still incomplete at the deadline (a
            publishing process died); ``self.params`` is kept.
          VersionNotFoundError / WeightSyncError: no such version, or a damaged one.
          TypeError / ValueError: targets or dtypes that do not fit the published params,
            naming the leaf; ValueError once the puller is closed.
        """
        if self._closed:
            raise ValueError("this WeightPuller is closed")
        timeout = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        targets, treedef = _leaf_paths(target_shardings)
        if not targets:
            raise ValueError("target_shardings has no leaves")
        for path, s in targets:
            if not isinstance(s, jax.sharding.Sharding):
                raise TypeError(
                    f"target_shardings leaf {path or '<root>'} is {type(s).__name__}, "
                    f"expected a jax.sharding.Sharding"
                )
        target_dtypes = self._dtype_per_leaf(dtypes, treedef, len(targets))
        if version != "latest":
            version = check_version(version)
        while True:
            start = time.perf_counter()
            manifest = self._resolve(version, timeout)
            wait_seconds = time.perf_counter() - start
            try:
                return self._pull(manifest, targets, treedef, target_dtypes, wait_seconds)
            except DamagedVersionError as e:
                # Versions are immutable: a damaged one stays so, "latest" skips it from now.
                self._damaged.add(manifest.version)
                if version != "latest":
                    raise
                logger.warning("%s; pulling the newest intact complete version", e)

    def _pull(
        self,
        manifest: VersionManifest,
        targets: list,
        treedef: Any,
        target_dtypes: list,
        wait_seconds: float,
    ) -> Any:
        """:meth:`pull` of ``manifest``'s version once resolved; DamagedVersionError (on
        every process) where any process read bytes that do not match their checksums."""
        by_path = {leaf.path: leaf for leaf in manifest.leaves}
        paths = [p for p, _ in targets]
        if set(paths) != set(by_path):
            missing = sorted(set(by_path) - set(paths))
            extra = sorted(set(paths) - set(by_path))
            raise ValueError(
                f"target_shardings does not match weights version {manifest.version}: "
                f"published leaves without a target {missing[:8]}, targets not published "
                f"{extra[:8]}"
            )
        stored = [by_path[p] for p in paths]
        casts = []
        for leaf, (want, floating_only) in zip(stored, target_dtypes, strict=True):
            source = np.dtype(leaf.dtype)
            is_float = jnp.issubdtype(source, jnp.floating)
            if want is None or want == source or (floating_only and not is_float):
                casts.append(source)
            elif is_float and jnp.issubdtype(want, jnp.floating):
                casts.append(want)
            else:
                raise ValueError(
                    f"leaf {leaf.path}: cast from {source.name} to {want.name} refused (only "
                    f"floating to floating)"
                )
        plan_start = time.perf_counter()
        misses = self.plans.misses
        plan = self.plans.get(
            manifest.fingerprint,
            lambda: [leaf.layout() for leaf in stored],  # Only to build a new plan.
            [s for _, s in targets],
            casts,
        )
        cached = self.plans.misses == misses
        plan_seconds = 0.0 if cached else time.perf_counter() - plan_start
        if (
            manifest.version == self.version
            and plan.key == self._held_plan_key
            and not any(x.is_deleted() for x in jax.tree.leaves(self.params))
        ):
            self.stats = PullStats(
                manifest.version, 0, {}, cached, plan_seconds, wait_seconds, 0.0, 0.0, reused=True
            )
            return self.params
        damaged: DamagedVersionError | None = None
        try:
            arrays, read_seconds, put_seconds = self._read(manifest, stored, plan)
        except DamagedVersionError as e:
            damaged = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.int32(damaged is None))
            if damaged is None and not np.all(flags):
                bad = [int(i) for i in np.flatnonzero(np.asarray(flags) == 0)]
                damaged = DamagedVersionError(
                    f"weights version {manifest.version} is damaged: sampler process(es) "
                    f"{bad} read bytes that do not match their checksums",
                    version=manifest.version,
                )
        if damaged is not None:
            raise damaged
        params = jax.tree_util.tree_unflatten(treedef, arrays)
        self.version, self.params, self._held_plan_key = manifest.version, params, plan.key
        self.stats = PullStats(
            manifest.version,
            plan.bytes_read,
            {d.id: n for d, n in plan.device_bytes().items()},
            cached,
            plan_seconds,
            wait_seconds,
            read_seconds,
            put_seconds,
        )
        return params

    @staticmethod
    def _dtype_per_leaf(dtypes: Any, treedef: Any, count: int) -> list[tuple[Any, bool]]:
        """``(dtype or None, whether it applies to floating leaves only)`` per leaf."""
        if dtypes is None:
            return [(None, False)] * count
        if isinstance(dtypes, (str, type, np.dtype)):  # One dtype (jnp.bfloat16 is a type).
            try:
                one = np.dtype(dtypes)
            except TypeError:
                raise TypeError(
                    f"dtypes={dtypes!r} must be None, a dtype or a pytree of dtypes"
                ) from None
            if not jnp.issubdtype(one, jnp.floating):
                raise ValueError(f"dtypes={one.name}: a single dtype must be floating")
            return [(one, True)] * count
        flat, structure = jax.tree_util.tree_flatten(dtypes, is_leaf=lambda x: x is None)
        if structure != treedef:
            raise ValueError(
                f"dtypes must be one dtype or a pytree like target_shardings; got structure "
                f"{structure}, expected {treedef}"
            )
        out = []
        for d in flat:
            try:
                out.append((None if d is None else np.dtype(d), False))
            except TypeError:
                raise TypeError(f"dtypes leaf {d!r} is not a dtype") from None
        return out

    def _resolve(self, version: int | str, timeout: float) -> VersionManifest:
        """The manifest of the version to pull, agreed by every process (for ``"latest"``
        the newest complete one not found damaged)."""
        multi = jax.process_count() > 1
        error: Exception | None = None
        if version == "latest":
            chosen = -1
            if jax.process_index() == 0 or not multi:
                try:
                    chosen = self._wait_latest(timeout)
                except WeightSyncError as e:
                    error = e
            if multi:
                from jax.experimental import multihost_utils

                chosen = int(multihost_utils.broadcast_one_to_all(np.int64(chosen)))
            if chosen < 0:
                raise error or WeightSyncError(
                    f"no complete weights version in {self.store.describe()} after {timeout:g} s "
                    f"(process 0 found none)"
                )
            version = chosen
        manifest = None
        try:
            manifest = self.store.wait_manifest(version, timeout, self.poll_s)
        except WeightSyncError as e:
            error = e
        if multi:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.int32(manifest is not None))
            if not np.all(flags) and manifest is not None:
                bad = [int(i) for i in np.flatnonzero(np.asarray(flags) == 0)]
                raise WeightSyncError(
                    f"weights version {version}: sampler process(es) {bad} could not read it; "
                    f"every process keeps its previous params (version {self.version})"
                )
        if manifest is None:
            assert error is not None
            if isinstance(error, IncompleteVersionError):
                raise IncompleteVersionError(
                    f"{error}; previous params (version {self.version}) kept",
                    version=error.version,
                    missing=error.missing,
                ) from None
            raise error
        return manifest

    def _wait_latest(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            if not self._damaged:
                v = self.store.latest_complete()
            else:
                newest = None
                for v in reversed(self.store.versions()):
                    if complete(*self.store.parts(v)):
                        newest = v if newest is None else newest
                        if v not in self._damaged:
                            break
                else:
                    v = None
                if v is None and newest is not None:
                    raise WeightSyncError(
                        f"weights version {newest} is damaged and no complete version older "
                        f"than it is intact in {self.store.describe()} (damaged: "
                        f"{sorted(self._damaged)})"
                    )
            if v is not None:
                return v
            if time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"no complete weights version in {self.store.describe()} after "
                    f"{timeout:g} s (versions present, none complete: {self.store.versions()})"
                )
            time.sleep(self.poll_s)

    def close(self) -> None:
        """Closes the store (the params already pulled stay valid); a later :meth:`pull` is
        refused, a later :meth:`close` is a no-op."""
        if self._closed:
            return
        self._closed = True
        self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, manifest: VersionManifest, stored: list, plan: WeightPlan):
        read_seconds = put_seconds = 0.0
        arrays = []
        # Leaves whose buffers are ready, put together (one device_put per group: a call per
        # leaf cost more than the zero-copy puts themselves); a group ends once it has staged
        # STAGED_BYTES_PER_PUT of copies, so the host holds at most that much more. A leaf
        # is either its blocks' buffers and devices, or (`whole`) one view of the whole
        # array that device_put splits by the target sharding itself.
        group: list[tuple[Any, list, list, np.ndarray | None]] = []
        staged = staged_total = 0

        def put_group() -> None:
            bufs = [b for _, leaf_bufs, _, _ in group for b in leaf_bufs]
            devices = [d for _, _, leaf_devices, _ in group for d in leaf_devices]
            shards = iter(jax.device_put(bufs, devices))
            wholes = [(w, lp.sharding) for lp, _, _, w in group if w is not None]
            put_wholes = iter(
                jax.device_put([w for w, _ in wholes], [s for _, s in wholes]) if wholes else []
            )
            for leaf_plan, leaf_bufs, _, whole in group:
                if whole is not None:
                    arrays.append(next(put_wholes))
                    continue
                arrays.append(
                    jax.make_array_from_single_device_arrays(
                        leaf_plan.shape,
                        leaf_plan.sharding,
                        [next(shards) for _ in leaf_bufs],
                    )
                )
            group.clear()

        opened = self.store.open_version(manifest)
        try:
            for leaf, leaf_plan in zip(stored, plan.leaves, strict=True):
                t0 = time.perf_counter()
                bufs, devices = [], []
                same_dtype = leaf_plan.target_dtype == leaf_plan.source_dtype
                whole = _whole_view(opened, leaf, leaf_plan) if same_dtype else None
                if whole is not None:
                    group.append((leaf_plan, [], [], whole))
                    read_seconds += time.perf_counter() - t0
                    continue
                stacked, wanted = {}, []
                for i, block in enumerate(leaf_plan.blocks):
                    view = _stacked_view(opened, leaf, block) if same_dtype else None
                    if view is not None:
                        stacked[i] = view
                    else:
                        wanted.extend((p.source, p.source_slices) for p in block.pieces)
                values = iter(opened.read(leaf, wanted))
                for i, block in enumerate(leaf_plan.blocks):
                    if i in stacked:
                        # Whole source shards back to back in the store: one view of them.
                        bufs.extend([stacked[i]] * len(block.devices))
                        devices.extend(block.devices)
                        continue
                    if len(block.pieces) == 1 and same_dtype:
                        # One contiguous range of one source shard: put the store's view as
                        # it is (no staging copy; the store keeps it unchanged while it is
                        # referenced, and JAX's CPU backend adopts an aligned one in place).
                        value = next(values)
                        if value.shape == block.shape and value.flags.c_contiguous:
                            bufs.extend([value] * len(block.devices))
                            devices.extend(block.devices)
                            continue
                        values = itertools.chain([value], values)
                    buf = self.staging.empty(block.shape, leaf_plan.target_dtype)
                    for piece in block.pieces:
                        # Assignment casts (bf16 -> fp8 rounds to nearest, as astype does).
                        buf[piece.dest_slices] = next(values)
                    staged += buf.nbytes
                    staged_total += buf.nbytes
                    # Room for this pull's buffers (device_put may be done with one already).
                    self.staging.max_free_bytes = max(self.staging.max_free_bytes, staged_total)
                    for device in block.devices:
                        bufs.append(buf)
                        devices.append(device)
                group.append((leaf_plan, bufs, devices, None))
                t1 = time.perf_counter()
                if staged >= STAGED_BYTES_PER_PUT:
                    put_group()
                    staged = 0
                read_seconds += t1 - t0
                put_seconds += time.perf_counter() - t1
            t1 = time.perf_counter()
            if group:
                put_group()
            put_seconds += time.perf_counter() - t1
        finally:
            opened.close()
        # Keep (once the arrays that hold them are gone) up to one pull's staged buffers.
        self.staging.max_free_bytes = staged_total
        return arrays, read_seconds, put_seconds
