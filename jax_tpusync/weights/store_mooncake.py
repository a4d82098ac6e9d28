"""A weight store in a Mooncake Store: versions of the params moved between hosts, each
publishing process's shards held in the DRAM it gives the store's pool, read by pullers
anywhere that reaches the pool's master.

The same interface as the directory store
(:class:`~jax_tpusync.weights.records.WeightStoreBackend`), the same manifests and plans; the
objects, for version ``V`` (12 digits) under ``namespace``:

* ``<ns>/v<V>/p<p>/l<leaf>/s<shard>``: one shard of publishing process ``p`` (5 digits
  each: the leaf's index in the manifest, the shard's index in the process's list), raw
  bytes in C order;
* ``<ns>/v<V>/part-<p>``: process ``p``'s manifest, put after all its shards: the
  directory store's part manifest plus, per shard, its object's name and the xxh3-64 of
  each chunk of its bytes (``chunk_bytes``); the manifest carries its own checksum;
* ``<ns>/v<V>/begun``: the number of publishing processes, put by each process before its
  shards (the first put stays): a version with it but without every part is incomplete, a
  version without it was never begun;
* ``<ns>/versions``: the versions process 0 has begun and not retired (JSON), replaced by
  process 0 only (the store has no listing of its own).

The small objects are checksummed JSON, the shards checksummed per chunk
(:mod:`jax_tpusync.weights.mooncake_objects`). A process's part is put by a
:class:`~jax_tpusync.weights.mooncake_writer.MooncakePartWriter`. A puller
(:class:`~jax_tpusync.weights.mooncake_reader.MooncakeVersionReader`) reads only the byte
ranges its pieces need (``get_into_ranges``), widened to whole chunks so that every chunk
read is checked against its checksum; a chunk that does not match, or an object of another
size than its manifest says, is refused naming the object. This module holds the store
itself: its calls to the client, the list of versions, manifests, retiring. Process 0 retires old versions: their manifests first (a puller then finds the
version gone, never half of it), then their shards.

Every call to the store runs on one worker thread and is waited for at most
``deadline_s`` (:class:`~jax_tpusync.runtime.deadline_worker.DeadlineWorker`); before the client
connects or closes (both hold the interpreter's lock while they wait for the master), the
master is asked with a plain socket whether it answers
(:func:`~jax_tpusync.mooncake.client.probe_master`). A master that does not answer, a
holder that is gone, a call past its deadline: a :class:`WeightSyncError` that says so.

A publisher's shards live in its own segment: it must stay up (with its
:class:`~jax_tpusync.weights.sync.WeightPublisher` open) while they are pulled.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Self

import numpy as np

from jax_tpusync.mooncake.client import (
    ALREADY_EXISTS,
    LOCAL_BUFFER_BYTES,
    MAX_DEADLINE_S,
    MIN_SEGMENT_BYTES,
    NOT_FOUND,
    REPLICA_NOT_READY,
    abandon,
    import_store,
    meaning,
    probe_master,
    setup_within,
    split_master,
)
from jax_tpusync.mooncake.url import kilobytes, megabytes, open_url
from jax_tpusync.runtime.deadline_worker import DeadlinePassed, DeadlineWorker
from jax_tpusync.weights.mooncake_objects import checksummed_json, read_checksummed_json
from jax_tpusync.weights.mooncake_reader import MooncakeVersionReader
from jax_tpusync.weights.mooncake_writer import MooncakePartWriter
from jax_tpusync.weights.records import (
    IncompleteVersionError,
    VersionManifest,
    VersionNotFoundError,
    WeightSyncError,
)
from jax_tpusync.weights.store import (
    FORMAT_VERSION,
    complete,
    manifest_from_parts,
    newest_complete,
    wait_for_manifest,
)

logger = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 10.0
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_REQUEST_BYTES = 64 << 20

# A call to the store made more than this after the last answer first asks the master with
# a plain socket whether it is there: a call into a client whose master is gone does not
# return for seconds (5-10 s measured), far past the deadline.
PROBE_AFTER_S = 0.25
# An object being replaced (the list of versions) is read again every SETTLE_POLL_S until
# it is readable, for at most SETTLE_MAX_S (or the deadline if shorter): its put takes
# milliseconds, and a call that waits longer must still end near its deadline.
SETTLE_POLL_S = 0.02
SETTLE_MAX_S = 0.25
# The longest the interpreter's exit waits for calls that passed their deadline and still
# run: a process that exits while the client is inside one is aborted by the client's
# library ("terminate called without an active exception").
EXIT_WAIT_S = 30.0
_STORES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _wait_for_running_calls() -> None:
    """At exit, waits (at most ``EXIT_WAIT_S``) for calls still running past their
    deadline."""
    until = time.monotonic() + EXIT_WAIT_S
    for store in list(_STORES):
        if store.call_running():
            logger.warning(
                "waiting up to %.0f s for a call to %s that passed its deadline",
                max(0.0, until - time.monotonic()),
                store.describe(),
            )
        while store.call_running() and time.monotonic() < until:
            time.sleep(0.05)


class RemovalNotReady(WeightSyncError):
    """A removal the store cannot do yet: an object of the version is still being put (a
    put the master started after a fault and never finished; it discards it later)."""


class MooncakeWeightStore:
    """Versions of the params in a Mooncake Store (see the module's docstring).

    Args:
      master: ``host:port`` of the store's master.
      namespace: the first part of every object's name (publishers and pullers of one
        stream of versions use the same).
      segment_bytes: DRAM this process gives the pool, which holds the objects put into
        it: a publisher's must hold ``keep + 1`` versions of its part (the pool places
        objects in any member's segment); 0 (a puller that gives none) or at least 16 MiB.
      local_host: the address other clients reach this one at (its NIC's address across
        hosts).
      deadline_s: the longest any call to the store is waited for.
      chunk_bytes: the checksummed unit of the shards this store publishes; reads are
        widened to whole chunks of the publisher's unit (its manifest says which).
      request_bytes: the most bytes one get or put request moves.

    Raises ImportError (naming the package extra) without the Mooncake client. The client
    connects at the first call, not here.
    """

    def __init__(
        self,
        master: str = "127.0.0.1:50051",
        *,
        namespace: str = "weights",
        segment_bytes: int = 512 << 20,
        local_host: str = "127.0.0.1",
        deadline_s: float = DEFAULT_DEADLINE_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        request_bytes: int = DEFAULT_REQUEST_BYTES,
    ):
        host, port = split_master(master)
        if not isinstance(namespace, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", namespace):
            raise ValueError(
                f"namespace={namespace!r} must be a non-empty name of letters, digits, '_', "
                f"'.' or '-'"
            )
        if (
            isinstance(segment_bytes, bool)
            or not isinstance(segment_bytes, int)
            or not (segment_bytes == 0 or segment_bytes >= MIN_SEGMENT_BYTES)
        ):
            raise ValueError(
                f"segment_bytes={segment_bytes!r} must be 0 or at least {MIN_SEGMENT_BYTES} "
                f"(16 MiB, the client's smallest segment)"
            )
        if (
            not isinstance(local_host, str)
            or not local_host
            or any(c.isspace() or c == "/" for c in local_host)
        ):
            raise ValueError(f"local_host={local_host!r} must be this host's name or address")
        if (
            isinstance(deadline_s, bool)
            or not isinstance(deadline_s, (int, float))
            or not 0 < deadline_s <= MAX_DEADLINE_S
        ):
            raise ValueError(
                f"deadline_s={deadline_s!r} must be a number of seconds > 0 and at most "
                f"{MAX_DEADLINE_S:g}"
            )
        for name, value in (("chunk_bytes", chunk_bytes), ("request_bytes", request_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 4096:
                raise ValueError(f"{name}={value!r} must be an int >= 4096")
        self._store_class = import_store("a mooncake:// weight store")
        from mooncake.store import ReplicateConfig  # Imported above when it is installed.

        # Hard-pinned: the master never evicts a version's objects to make room (a full
        # pool refuses a put instead, by name); retiring removes them.
        self._pinned = ReplicateConfig()
        self._pinned.with_hard_pin = True
        # The engine reads these when it starts: a hung peer then ends a transfer in about
        # the deadline instead of 30 s. A user's own settings win.
        seconds = str(max(1, math.ceil(deadline_s)))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds)
        os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", seconds)
        self.master = master
        self.host, self.port = host, port
        self.namespace = namespace
        self.segment_bytes = segment_bytes
        self.local_host = local_host
        self.deadline_s = float(deadline_s)
        self.chunk_bytes = chunk_bytes
        self.request_bytes = request_bytes
        self.bytes_fetched = 0  # Bytes read from the store (whole chunks), all pulls.
        self._client: Any = None
        self._closed = False
        self._lock = threading.Lock()  # One call at a time (the publisher's writer thread).
        self._worker = DeadlineWorker(f"weight-store-{master}")
        self._answered_at = -math.inf  # When a call last returned.
        _STORES.add(self)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this MooncakeWeightStore is closed")

    def call_running(self) -> bool:
        """Whether a call that passed its deadline still runs (later calls are refused)."""
        return self._worker.busy

    @classmethod
    def from_url(cls, url: str) -> MooncakeWeightStore:
        """A store from ``"mooncake://host:port[?option=value&...]"``; options
        ``segment_mb``, ``deadline_s``, ``namespace``, ``local_host``, ``chunk_kb``,
        ``request_mb``. A ValueError names the URL and what is wrong in it."""
        return open_url(
            url,
            "weight store",
            {
                "segment_mb": ("segment_bytes", megabytes),
                "deadline_s": ("deadline_s", float),
                "namespace": ("namespace", str),
                "local_host": ("local_host", str),
                "chunk_kb": ("chunk_bytes", kilobytes),
                "request_mb": ("request_bytes", megabytes),
            },
            cls,
        )

    def describe(self) -> str:
        return f"the Mooncake store at {self.master} (namespace {self.namespace!r})"

    # -- object names -----------------------------------------------------------------------

    def version_prefix(self, version: int) -> str:
        return f"{self.namespace}/v{version:012d}/"

    def begun_key(self, version: int) -> str:
        return self.version_prefix(version) + "begun"

    def part_key(self, version: int, process: int) -> str:
        return self.version_prefix(version) + f"part-{process:05d}"

    def shard_key(self, version: int, process: int, leaf: int, shard: int) -> str:
        return self.version_prefix(version) + f"p{process:05d}/l{leaf:05d}/s{shard:05d}"

    @property
    def index_key(self) -> str:
        return f"{self.namespace}/versions"

    # -- calls, deadlines -------------------------------------------------------------------

    def call(self, fn: Callable[[Any], Any], what: str) -> Any:
        """``fn(client)`` on the worker, waited for at most ``deadline_s`` in all (the wait
        for an earlier call and the connection included); WeightSyncError naming ``what``
        if the store does not answer in time or cannot be reached."""
        start = time.monotonic()
        if not self._lock.acquire(timeout=self.deadline_s):
            raise WeightSyncError(
                f"{what}: {self.describe()} is busy with an earlier call past {self.deadline_s:g} s"
            )
        try:
            if self._closed:
                raise WeightSyncError(f"{what}: {self.describe()} was closed")
            if self._worker.busy:  # Refused at once, before the probe waits for a master.
                raise DeadlinePassed("an earlier call to the store has not returned yet")
            if self._client is None:
                self._connect(what, self.deadline_s - (time.monotonic() - start))
            elif time.monotonic() - self._answered_at > PROBE_AFTER_S:
                left = self.deadline_s - (time.monotonic() - start)
                why = probe_master(self.host, self.port, max(left, 1e-3))
                if why is not None:
                    raise WeightSyncError(f"{what}: the Mooncake master at {self.master}: {why}")
            left = self.deadline_s - (time.monotonic() - start)
            value = self._worker.call(lambda: fn(self._client), left)
            self._answered_at = time.monotonic()
            return value
        except DeadlinePassed as e:
            raise WeightSyncError(
                f"{what}: {self.describe()} did not answer within {self.deadline_s:g} s ({e})"
            ) from None
        except WeightSyncError:
            raise
        except Exception as e:  # The client's own errors, named.
            raise WeightSyncError(
                f"{what}: {self.describe()} failed ({type(e).__name__}: {e})"
            ) from e
        finally:
            self._lock.release()

    def _connect(self, what: str, left: float) -> None:
        """Probes the master (a plain socket, bounded), then sets the client up on the
        worker: ``setup()`` holds the interpreter's lock while it waits for a master, so
        each of its requests is limited to the deadline
        (:func:`~jax_tpusync.mooncake.client.setup_within`). A setup that passed its
        deadline keeps its client once it succeeds (the next call uses it); one that
        failed is never freed (freeing it closes it, waiting for the master)."""
        why = probe_master(self.host, self.port, max(left, 1e-3))
        if why is not None:
            raise WeightSyncError(f"{what}: the Mooncake master at {self.master}: {why}")
        client = self._store_class()

        def setup() -> int:
            rc = setup_within(
                client,
                self.deadline_s,
                self.local_host,
                "P2PHANDSHAKE",
                self.segment_bytes,
                LOCAL_BUFFER_BYTES,
                "tcp",
                "",
                self.master,
            )
            if rc != 0 or self._closed:
                abandon(client)
            else:
                self._client = client
            return rc

        rc = self._worker.call(setup, left)
        if rc != 0:
            raise WeightSyncError(f"{what}: connecting to {self.describe()} returned {rc}")

    def close(self) -> None:
        """Leaves the pool (the objects in this process's segment go with it). Returns within
        about the deadline; a client whose master does not answer is left open. Every later
        call of a method that uses the store is refused (a ValueError); :meth:`close` again
        is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
            if client is not None:
                why = (
                    None
                    if self._worker.busy
                    else probe_master(self.host, self.port, self.deadline_s)
                )
                if self._worker.busy or why is not None:
                    abandon(client)
                    logger.warning(
                        "%s does not answer (%s): its client is left open, not closed",
                        self.describe(),
                        why or "a call is still running",
                    )
                else:
                    try:
                        self._worker.call(client.close, self.deadline_s)
                    except DeadlinePassed as e:
                        logger.warning("closing the client of %s: %s", self.describe(), e)
            self._worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get_object(
        self,
        key: str,
        what: str,
        absent: tuple[int, ...] = (NOT_FOUND,),
        settle_s: float = 0.0,
    ) -> bytes | None:
        """A small object's bytes (manifests, the index), None if it is not there (its
        code in ``absent``). An object its writer is replacing reads "not readable yet"
        until the put ends: read again for up to ``settle_s`` seconds before that is an
        error (a writer that died while putting leaves it so for the master's discard
        timeout)."""

        def get(client: Any) -> tuple[bytes, int] | int:
            size = client.get_size(key)
            if size < 0:
                return size
            return bytes(client.get(key)), size

        settled_by = time.monotonic() + settle_s
        value = self.call(get, what)
        while value == REPLICA_NOT_READY and time.monotonic() < settled_by:
            time.sleep(min(SETTLE_POLL_S, max(0.0, settled_by - time.monotonic())))
            value = self.call(get, what)
        if isinstance(value, int):
            if value in absent:
                return None
            raise WeightSyncError(f"{what}: getting {key!r} returned {meaning(value)}")
        data, size = value
        if size and not data:
            # The client's get returns no bytes when it fails (a master killed during it):
            # a failed read, not a damaged object. (Every object read here is checksummed
            # JSON, never empty; one replaced in between, of another size, is checked.)
            raise WeightSyncError(
                f"{what}: getting {key!r} ({size} bytes) from {self.describe()} failed: the "
                f"Mooncake master or the process holding it did not answer"
            )
        return data

    def put_objects(
        self, keys: list[str], arrays: list[np.ndarray], what: str, *, exists_ok: bool = False
    ) -> None:
        """Puts each ``uint8`` array as its object, from its own memory (registered for the
        call), at most ``request_bytes`` per request. ``exists_ok``: an object another
        client put first (or is putting) is not an error."""
        self._check_open()
        batches: list[list[int]] = [[]]
        size = 0
        for i, array in enumerate(arrays):
            if batches[-1] and size + array.nbytes > self.request_bytes:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += array.nbytes
        for batch in batches:
            if not batch:
                continue
            chosen = [arrays[i] for i in batch]  # Kept alive by the call, even a late one.

            def put(client: Any, batch: list[int] = batch, chosen: list = chosen) -> list[int]:
                registered = []
                try:
                    for array in chosen:
                        rc = client.register_buffer(array.ctypes.data, array.nbytes)
                        if rc != 0:
                            return [rc] * len(batch)
                        registered.append(array.ctypes.data)
                    return list(
                        client.batch_put_from(
                            [keys[i] for i in batch],
                            [a.ctypes.data for a in chosen],
                            [a.nbytes for a in chosen],
                            self._pinned,
                        )
                    )
                finally:
                    for address in registered:
                        client.unregister_buffer(address)

            for i, code in zip(batch, self.call(put, what), strict=True):
                if code < 0 and not (exists_ok and code == ALREADY_EXISTS):
                    raise WeightSyncError(f"{what}: putting {keys[i]!r} returned {meaning(code)}")

    # -- versions ---------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """The versions process 0 has begun and not retired, oldest first."""
        self._check_open()
        # Process 0 replaces the list at every publish and retirement: a reader may meet
        # the put in flight.
        data = self._get_object(
            self.index_key,
            "reading the list of weight versions",
            settle_s=min(self.deadline_s, SETTLE_MAX_S),
        )
        if data is None:
            return []
        index = read_checksummed_json(data, self.index_key)
        if not isinstance(index, list) or not all(isinstance(v, int) for v in index):
            raise WeightSyncError(f"object {self.index_key!r} is not a list of versions")
        return sorted(index)

    def write_versions(self, versions: list[int]) -> None:
        """Replaces the list of versions (process 0 only: one writer, no race)."""
        self._check_open()
        body = np.frombuffer(checksummed_json(sorted(set(versions))), np.uint8).copy()

        def upsert(client: Any) -> int:
            rc = client.register_buffer(body.ctypes.data, body.nbytes)
            if rc != 0:
                return rc
            try:
                return client.upsert_from(
                    self.index_key, body.ctypes.data, body.nbytes, self._pinned
                )
            finally:
                client.unregister_buffer(body.ctypes.data)

        rc = self.call(upsert, "writing the list of weight versions")
        if rc < 0:
            raise WeightSyncError(
                f"writing the list of weight versions {self.index_key!r} returned {meaning(rc)}"
            )

    def parts(self, version: int) -> tuple[int | None, set[int]]:
        self._check_open()
        what = f"weights version {version}"
        # Read while its first writer is putting it: not there yet (a reader waits for it
        # until its deadline, as for one that is not there).
        data = self._get_object(
            self.begun_key(version), what, absent=(NOT_FOUND, REPLICA_NOT_READY)
        )
        if data is None:
            return None, set()
        begun = read_checksummed_json(data, self.begun_key(version))
        n = begun.get("num_processes") if isinstance(begun, dict) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WeightSyncError(f"object {self.begun_key(version)!r} names no process count")
        keys = [self.part_key(version, p) for p in range(n)]
        codes = self.call(lambda client: list(client.batch_is_exist(keys)), what)
        for key, code in zip(keys, codes, strict=True):
            if code < 0:
                raise WeightSyncError(f"{what}: asking for {key!r} returned {meaning(code)}")
        return n, {p for p, code in enumerate(codes) if code == 1}

    def is_complete(self, version: int) -> bool:
        self._check_open()
        return complete(*self.parts(version))

    def latest_complete(self) -> int | None:
        self._check_open()
        return newest_complete(self)

    def read_manifest(self, version: int) -> VersionManifest:
        """The checked manifest of a complete version (see
        :meth:`~jax_tpusync.weights.store.WeightStore.read_manifest`)."""
        self._check_open()
        n, present = self.parts(version)
        if n is None:
            # Waiters poll on this error: the list in its message must not raise another.
            try:
                present = str(self.versions())
            except WeightSyncError as e:
                present = f"unknown: {e}"
            raise VersionNotFoundError(
                f"weights version {version} not found in {self.describe()} (versions "
                f"present: {present})"
            )
        missing = tuple(sorted(set(range(n)) - present))
        if missing:
            raise IncompleteVersionError(
                f"weights version {version} is incomplete: no part from process(es) "
                f"{list(missing)} of {n} publishing processes",
                version=version,
                missing=missing,
            )
        docs = []
        for p in range(n):
            key = self.part_key(version, p)
            data = self._get_object(key, f"weights version {version}")
            if data is None:
                raise WeightSyncError(
                    f"weights version {version} was retired while reading it: pull again"
                )
            doc = read_checksummed_json(data, key)
            if (
                not isinstance(doc, dict)
                or doc.get("format") != FORMAT_VERSION
                or doc.get("version") != version
                or doc.get("process") != p
            ):
                raise WeightSyncError(
                    f"weights version {version}: object {key!r} is not process {p}'s "
                    f"format-{FORMAT_VERSION} manifest of this version"
                )
            docs.append(doc)
        manifest = manifest_from_parts(version, docs)
        chunk = manifest.chunk_bytes
        if chunk < 1:
            raise WeightSyncError(
                f"weights version {version}: its manifests name no checksum chunk size"
            )
        for leaf in manifest.leaves:
            for shard in leaf.shards:
                want = math.ceil(shard.nbytes / chunk) if shard.nbytes else 0
                if (shard.nbytes and not shard.key) or len(shard.checksums) != want:
                    raise WeightSyncError(
                        f"weights version {version}: leaf {leaf.path} shard {shard.box} "
                        f"names no object or {len(shard.checksums)} chunk checksums, not "
                        f"{want} of {chunk} bytes"
                    )
        return manifest

    def wait_manifest(
        self, version: int, timeout_s: float, poll_s: float = 0.01
    ) -> VersionManifest:
        self._check_open()
        return wait_for_manifest(self.read_manifest, version, timeout_s, poll_s)

    def part_writer(
        self, version: int, process: int, num_processes: int, *, fsync: bool = False
    ) -> MooncakePartWriter:
        """``fsync`` has no meaning here (the objects are in memory) and is ignored."""
        self._check_open()
        return MooncakePartWriter(self, version, process, num_processes)

    def open_version(self, manifest: VersionManifest) -> MooncakeVersionReader:
        self._check_open()
        return MooncakeVersionReader(self, manifest)

    def remove_version(self, version: int) -> None:
        """Removes a version: its manifests first (a puller then finds it gone, never
        half of it), then the rest of its objects. Forced: the store keeps a lease on an
        object after every put and get, which would refuse the removal for seconds; a
        puller still reading the version gets an error naming an object that is gone (or,
        if its memory was reused already, one whose checksum does not match). An object the
        store cannot remove yet (still being put) raises :class:`RemovalNotReady`."""
        self._check_open()
        n, _ = self.parts(version)
        what = f"retiring weights version {version}"
        if n is not None:
            keys = [self.part_key(version, p) for p in range(n)]
            codes = self.call(lambda client: list(client.batch_remove(keys, True)), what)
            for key, code in zip(keys, codes, strict=True):
                if code < 0 and code != NOT_FOUND:
                    error = RemovalNotReady if code == REPLICA_NOT_READY else WeightSyncError
                    raise error(f"{what}: removing {key!r} returned {meaning(code)}")
        pattern = "^" + re.escape(self.version_prefix(version))
        count = self.call(lambda client: client.remove_by_regex(pattern, True), what)
        if count < 0:
            error = RemovalNotReady if count == REPLICA_NOT_READY else WeightSyncError
            raise error(f"{what}: removing its objects returned {meaning(count)}")

    def retire(self, keep: int) -> list[int]:
        """Removes every listed version older than the ``keep`` newest complete ones."""
        self._check_open()
        listed = self.versions()
        complete = [v for v in listed if self.is_complete(v)]
        if len(complete) <= keep:
            return []
        removed = []
        for version in listed:
            if version >= complete[-keep]:
                break
            try:
                self.remove_version(version)
            except RemovalNotReady as e:
                # A put the master started after a fault and never finished: the object
                # cannot be removed until the master discards the put. Retiring is
                # housekeeping; the version stays listed and the next publish retries.
                logger.warning("weight version %d kept for now: %s", version, e)
                break
            removed.append(version)
        if removed:
            self.write_versions([v for v in listed if v not in removed])
            logger.debug("retired weight versions %s", removed)
        return removed
