"""A remote prefix level on a Mooncake Store: published prefix blocks in the DRAM of a pool
of processes, found by their chained key from any host that reaches the pool's master.

One more :class:`~jax_tpusync.core.levels.RemoteLevel` (the shape :class:`SharedDirectoryLevel`
has): the slot table looks blocks up here past its own index on ``admit(tokens=...)``,
stopping at the first block that no level has, and publishes full blocks here on
``release(tokens=...)``.

Objects. A block is stored as one object per *layer range* and one small *header* object
naming them (:mod:`jax_tpusync.mooncake.block_format` lays them out and checks them). The
header is written after every range it names, so a header that can be read names
ranges that were complete. Put never replaces an existing object (the first writer's value
stays), and range names carry their checksum, so two processes publishing the same block
at once (their KV may differ in the last bits) never mix one's ranges with the other's
header.

Every hit is checked like a shared directory's file: a header that cannot be parsed, was
written for another root or geometry, or names other tokens or another parent (a digest
collision), a range that is gone (evicted) or whose bytes do not match its checksum, is a
miss and a warning naming the block, never KV.

Faults. Every call to the store runs on one worker thread and is waited for at most
``deadline_s`` (:class:`~jax_tpusync.mooncake.level_calls.StoreCalls`); a fault is a miss (``load`` returns None, ``has`` False, ``publish`` False),
counted in :meth:`MooncakeStoreLevel.stats` and logged once per kind:

* the master down or restarted (a restarted master has lost every object: its metadata is
  the only record of them), killed or stopped at any moment of a call: calls fail
  (``unreachable``), or wait and pass the deadline (``timeout``, also the client's own
  -901: unless the environment sets ``MC_RPC_TIMEOUT_MS`` / ``MC_RPC_CONNECT_TIMEOUT_MS``,
  each request of the client to its master is limited to the deadline, so a call stuck
  on a dead master ends by itself); either pauses the level for ``retry_after_s`` (calls
  are misses at once, counted as ``skipped``), after which it tries again: the client
  finds a restarted master by itself;
* a peer that holds an object was killed (``transfer``, code -800);
* a hung peer (``timeout``): unless the environment sets them, the engine's TCP timeouts
  ``MC_TCP_PROGRESS_TIMEOUT_SEC`` / ``MC_TCP_STATUS_TIMEOUT_SEC`` default to the deadline,
  so a stuck transfer ends; until the worker's call returns, later calls are misses at once;
* a writer killed while putting (``not_ready``, -703): its objects never become readable;
* a missing header (-704): a plain miss, not a fault; a missing range: ``evicted``;
* a full pool (``full``, -200 on put): the master evicts old objects by itself and does not
  tell clients, so a block's parent may go before the block: the slot table stops at the
  first block no level has.

Never fork a process after this level connected (the engine runs some thirty threads):
start helper processes with ``subprocess`` or the ``spawn`` start method.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
from typing import Any

import numpy as np

from jax_tpusync.core.levels import InPlaceLoad
from jax_tpusync.mooncake import transfer_memory
from jax_tpusync.mooncake.block_format import BlockFormat, DamagedBlock
from jax_tpusync.mooncake.client import (
    INVALID,
    MAX_DEADLINE_S,
    MIN_SEGMENT_BYTES,
    NOT_FOUND,
    TRANSFER_FAILED,
    import_store,
    split_master,
)
from jax_tpusync.mooncake.level_calls import PAUSING, StoreCalls, StoreFault, code_fault
from jax_tpusync.mooncake.url import kilobytes, megabytes, open_url

logger = logging.getLogger(__name__)

# Headers looked up in one request, and the most bytes of layer ranges read into the pool in
# one request (each request has its own deadline: a long prefix is many requests).
HEADER_BATCH = 32
LOAD_BATCH_BYTES = 64 << 20
PUBLISH_BATCH_BYTES = 16 << 20  # Blocks put in one request (copied into the level's buffer).


def _is_seconds(value: Any) -> bool:
    """A real number, not a bool or NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


class MooncakeStoreLevel:
    """Published prefix blocks in a Mooncake Store (see the module's docstring).

    Args:
      master: ``host:port`` of the store's master (``mooncake_master --rpc_port``).
      root: the prefix index's root key (salt, geometry, dtype, layout): written in every
        header and checked on every hit.
      num_layers, block_tokens, block_bytes: the cache's geometry (``block_bytes``: one
        block of one layer's K or V).
      local_host: the address other clients reach this one at (its NIC's address when the
        pool spans hosts).
      segment_bytes: DRAM this process gives the pool (at least 16 MiB; 0: none, a client
        that only reads and puts into the others' segments).
      object_bytes: about the size of one object: whole layers per object, at least one.
      deadline_s: the longest any call waits for the store.
      retry_after_s: how long the level stays a miss after the master could not be reached
        or a call passed its deadline, before it tries again.
      namespace: the first part of every object name.
      transfer_engine: a started ``mooncake.engine.TransferEngine`` for the client to use
        (one engine per process serves this level and P/D transfer,
        :mod:`jax_tpusync.pd.transfer`); None: the client starts its own.

    A cache on a host tier gives the level its pool (:meth:`use_memory`): blocks are then
    looked up a run at a time and read straight into free tier blocks, checked where they
    landed (:meth:`lookup`, :meth:`load_into`); otherwise through :meth:`load`, one block
    at a time via a buffer of the level's own.

    The client connects at the first call (within its deadline), not here. Raises
    ImportError (naming the package extra) if the Mooncake client is not installed.
    """

    def __init__(
        self,
        master: str = "127.0.0.1:50051",
        *,
        root: bytes,
        num_layers: int,
        block_tokens: int,
        block_bytes: int,
        local_host: str = "127.0.0.1",
        segment_bytes: int = 256 << 20,
        object_bytes: int = 1 << 20,
        deadline_s: float = 3.0,
        retry_after_s: float = 2.0,
        namespace: str = "tpusync",
        transfer_engine: Any = None,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("block_tokens", block_tokens),
            ("block_bytes", block_bytes),
            ("object_bytes", object_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not isinstance(segment_bytes, int) or not (
            segment_bytes == 0 or segment_bytes >= MIN_SEGMENT_BYTES
        ):
            raise ValueError(
                f"segment_bytes={segment_bytes!r} must be 0 or at least {MIN_SEGMENT_BYTES} "
                f"(16 MiB, the client's smallest segment)"
            )
        if not _is_seconds(deadline_s) or not 0 < deadline_s <= MAX_DEADLINE_S:
            raise ValueError(
                f"deadline_s={deadline_s!r} must be a number of seconds > 0 and at most "
                f"{MAX_DEADLINE_S:g}"
            )
        if not _is_seconds(retry_after_s) or not 0 <= retry_after_s < math.inf:
            raise ValueError(
                f"retry_after_s={retry_after_s!r} must be a finite number of seconds >= 0"
            )
        split_master(master)
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ValueError(f"namespace={namespace!r} must be a non-empty name without '/'")
        if (
            not isinstance(local_host, str)
            or not local_host
            or any(c.isspace() or c == "/" for c in local_host)
        ):
            raise ValueError(
                f"local_host={local_host!r} must be this host's name or address (non-empty, "
                f"no spaces or '/')"
            )
        store_class = import_store("the Mooncake remote level")
        # The engine reads these when it starts: a hung peer then ends a transfer in about
        # the deadline instead of 30 s. A user's own settings win.
        seconds = str(max(1, math.ceil(deadline_s)))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds)
        os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", seconds)

        self.master = master
        self.root = bytes(root)
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.local_host = local_host
        self.segment_bytes = segment_bytes
        self.deadline_s = float(deadline_s)
        self.retry_after_s = float(retry_after_s)
        self.namespace = namespace
        self.block_format = BlockFormat(
            namespace, self.root, num_layers, block_tokens, block_bytes, object_bytes
        )
        self.layer_ranges = self.block_format.layer_ranges
        # Registered with the client once; a call that passed its deadline may still write
        # here, so it lives as long as this level and nothing returned is a view of it.
        self._header_capacity = self.block_format.header_capacity
        # Header slots, then payloads: as many as one publish request takes (at least one).
        self._payload_at = HEADER_BATCH * self._header_capacity
        self._payload_slots = max(1, min(HEADER_BATCH, PUBLISH_BATCH_BYTES // self.payload_bytes))
        self._scratch = np.zeros(
            self._payload_at + self._payload_slots * self.payload_bytes, np.uint8
        )
        self._calls = StoreCalls(
            master,
            local_host=local_host,
            segment_bytes=segment_bytes,
            deadline_s=self.deadline_s,
            retry_after_s=self.retry_after_s,
            transfer_engine=transfer_engine,
            store_class=store_class,
            buffer=self._scratch,
            log=logger,
        )
        self._ranges: dict[bytes, list] = {}  # Checked ranges of the last lookup()'s blocks.
        self.imported = 0  # Blocks this process loaded, checked.
        self.misses = 0  # Loads of a block that is not there (no header).
        self.damaged = 0  # Blocks refused on load (corrupt, foreign, collision, size).
        self.bytes_loaded = 0
        self.faults = self._calls.faults  # By kind (FAULT_KINDS), counted by the calls.
        # Publishes: [blocks put, blocks not put, bytes put], counted by the caller's thread
        # and (for a request that passed its deadline, once it returned) by the worker's;
        # each list has one writer, so no count is lost. ``_in_flight``: blocks of requests
        # that passed their deadline, less those the worker has counted since.
        self._put_here = [0, 0, 0]
        self._put_late = [0, 0, 0]
        self._in_flight_sent = 0
        self._in_flight_done = 0

    @property
    def skipped(self) -> int:
        """Calls answered as misses while paused, or once closed."""
        return self._calls.skipped

    @property
    def published(self) -> int:
        """Blocks this process put (a request that passed its deadline counts once it
        returned)."""
        return self._put_here[0] + self._put_late[0]

    @property
    def publish_failures(self) -> int:
        """Blocks a publish did not put: a fault stopped it, it was never sent (paused, a
        call still stuck), or a request that passed its deadline returned without them."""
        return self._put_here[1] + self._put_late[1]

    @property
    def bytes_published(self) -> int:
        return self._put_here[2] + self._put_late[2]

    @property
    def publishes_in_flight(self) -> int:
        """Blocks of publish requests that passed their deadline and have not returned: in
        neither count above until they do (they may still reach the store)."""
        return self._in_flight_sent - self._in_flight_done

    # -- the RemoteLevel interface ----------------------------------------------------------

    @property
    def payload_bytes(self) -> int:
        return self.block_format.payload_bytes

    def describe(self) -> str:
        return f"Mooncake store at {self.master}"

    def header_key(self, key: bytes) -> str:
        return self.block_format.header_key(key)

    def range_key(self, key: bytes, first: int, end: int, checksum: int) -> str:
        return self.block_format.range_key(key, first, end, checksum)

    def has(self, key: bytes) -> bool:
        """Whether ``key``'s header is in the store (False on any fault)."""
        hkey = self.header_key(key)
        return bool(self._calls.run(lambda client: self._exists(client, hkey), False))

    def load(self, key: bytes, parent: bytes | None, tokens: np.ndarray) -> np.ndarray | None:
        """``key``'s payload (a fresh ``uint8[payload_bytes]``), checked against ``parent``,
        ``tokens``, the root, the geometry and the checksums; None if it is not there, is
        damaged or foreign (a warning names it), or on a fault (counted)."""
        # The in-place path with the level's own buffer as the destination: one set of
        # checks for both.
        wanted = [(key, parent, tokens)]
        if not self.lookup(wanted):
            return None
        body = self._scratch[self._payload_at : self._payload_at + self.payload_bytes]
        views = [
            body[r * self.block_bytes : (r + 1) * self.block_bytes]
            for r in range(2 * self.num_layers)
        ]
        if self.load_into(wanted, [views]).loaded != 1:
            return None
        return body.copy()

    def publish(
        self, key: bytes, parent: bytes | None, tokens: np.ndarray, payload: np.ndarray
    ) -> bool:
        """Puts one block (its ranges, then its header) unless its header is there; returns
        whether it did. A fault is False, counted in ``publish_failures``, never raised."""
        prepared = self._prepare(key, parent, tokens, payload)  # Refused before any call.
        missing = self._calls.run(
            lambda client: self._missing(client, [self.header_key(key)]), None
        )
        if missing is None:  # A fault: counted as a publish that did not happen.
            self._put_here[1] += 1
            return False
        return bool(missing) and self._put_prepared([prepared]) == 1

    def missing(self, keys: list[bytes]) -> list[int]:
        """Indexes of ``keys`` whose headers are not in the store, asked in one request;
        every index on a fault (counted): publishing them again is harmless."""
        names = [self.header_key(key) for key in keys]
        return self._calls.run(lambda client: self._missing(client, names), list(range(len(keys))))

    def publish_many(self, items: list[tuple[bytes, bytes | None, np.ndarray, Any]]) -> int:
        """Puts blocks ``(key, parent, tokens, payload)`` (those :meth:`missing` named):
        per batch of at most ``HEADER_BATCH`` blocks and ``PUBLISH_BATCH_BYTES`` (at least
        one block), one request puts their layer ranges, then one their headers (a header
        only after all its ranges went in). Returns how many blocks it put; a fault ends
        it (the rest counted in ``publish_failures``), never raised.

        ``payload``: the block's bytes (``uint8[payload_bytes]``) or its regions (views of
        a pool, as ``block_memory`` gives them); read only during this call, on this
        thread (checksummed, then copied batch by batch into the level's buffer)."""
        return self._put_prepared([self._prepare(*item) for item in items])

    def _put_prepared(self, prepared: list) -> int:
        """:meth:`publish_many` of blocks :meth:`_prepare` checked."""
        put = 0
        per = self._payload_slots
        for first in range(0, len(prepared), per):
            batch = prepared[first : first + per]
            result = self._calls.run(
                functools.partial(self._publish_batch, batch=batch),
                (0, len(batch), "fault"),
                stage=functools.partial(self._stage, batch),
                late=functools.partial(self._count_late_publish, len(batch)),
                in_flight=(0, 0, "in flight"),
            )
            wrote, failed, fault = result
            put += wrote
            self._put_here[0] += wrote
            self._put_here[2] += wrote * self.payload_bytes
            if fault is not None:
                if fault == "in flight":  # Counted by _count_late_publish once it returns.
                    self._in_flight_sent += len(batch)
                elif fault != "fault":
                    self._calls.fault(*fault, pause=fault[0] in PAUSING)
                # This batch's blocks that did not go in, and the later batches, never sent.
                self._put_here[1] += failed + len(prepared) - first - len(batch)
                return put
        return put

    def _count_late_publish(self, blocks: int, ok: bool, value: Any) -> None:
        """On the worker: what a publish request that passed its deadline did, once it
        returned."""
        wrote = value[0] if ok else 0
        self._put_late[0] += wrote
        self._put_late[1] += blocks - wrote
        self._put_late[2] += wrote * self.payload_bytes
        self._in_flight_done += blocks

    def _prepare(
        self, key: bytes, parent: bytes | None, tokens: np.ndarray, payload: Any
    ) -> tuple[bytes, list[np.ndarray], list, bytes]:
        """(key, the payload's regions, checksummed ranges, header) of a block to publish,
        checked. ``payload``: ``uint8[payload_bytes]``, or the block's ``2 * num_layers``
        regions of ``block_bytes`` each (views of a pool, in region order)."""
        regions = self.block_format.regions(payload)
        ranges = self.block_format.checksummed_ranges(regions)
        token_ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
        header = self.block_format.encode_header(key, parent, token_ids, ranges)
        return key, regions, ranges, header

    # -- reading blocks straight into a pool (the InPlaceRemoteLevel interface) -------------

    def use_memory(self, address: int, nbytes: int) -> None:
        """Registers a pool (a host tier's memory) that :meth:`load_into` reads into: now if
        connected, else at the connection. Its pages are faulted in here, in the caller's
        thread (:func:`jax_tpusync.mooncake.transfer_memory.populate`): a virtual machine's first
        touch of a fresh 512 MiB pool took 3.5 s, which inside a call would pass its
        deadline and turn the first admissions into misses. A fault registering is logged,
        counted and leaves the pool unregistered (loads into it then fail: misses)."""
        transfer_memory.populate(address, nbytes)
        self._calls.use_memory(address, nbytes)

    def settled(self) -> bool:
        """Whether no call that passed its deadline is still running (one may still write
        into the destinations of a :meth:`load_into`)."""
        return not self._calls.busy

    def lookup(self, wanted: list[tuple[bytes, bytes | None, np.ndarray]]) -> int:
        """How many of ``wanted``'s blocks, from the first, have a header in the store that
        passes every check (``HEADER_BATCH`` headers per request); 0 on a fault. A damaged
        header ends the run with a warning naming the block."""
        self._ranges = {}
        items = [(k, p, [int(t) for t in np.asarray(ids).reshape(-1)]) for k, p, ids in wanted]
        result = self._calls.run(lambda client: self._lookup(client, items), (0, None))
        found, damaged = result
        if damaged is not None:
            self.damaged += 1
            logger.warning("%s; treated as a miss", damaged)
        elif found < len(items):
            self.misses += 1
        return found

    def load_into(
        self,
        wanted: list[tuple[bytes, bytes | None, np.ndarray]],
        destinations: list[list[np.ndarray]],
    ) -> InPlaceLoad:
        """Reads ``wanted``'s blocks (found by the last :meth:`lookup`) into
        ``destinations`` (per block, ``uint8[block_bytes]`` views of its regions in a pool
        given to :meth:`use_memory`), each layer range scattered into its regions with no
        copy, at most ``LOAD_BATCH_BYTES`` per request; then checks each range's checksum
        where it landed. Stops at the first block that is gone, damaged (a warning) or hit
        by a fault (counted); destinations of a request that passed its deadline are
        reported busy until :meth:`settled`."""
        if len(destinations) != len(wanted):
            raise ValueError(f"{len(destinations)} destinations for {len(wanted)} blocks")
        for key, _, _ in wanted:
            if key not in self._ranges:
                raise ValueError(f"block {key.hex()} was not found by the last lookup()")
        regions = 2 * self.num_layers
        for views in destinations:
            if len(views) != regions or any(v.nbytes != self.block_bytes for v in views):
                raise ValueError(
                    f"a destination must be {regions} views of {self.block_bytes} bytes"
                )
        loaded = 0
        for first, end in self._load_batches(len(wanted)):
            requests = [
                (
                    self.range_key(wanted[j][0], lo, hi, checksum),
                    [v.ctypes.data for v in destinations[j][2 * lo : 2 * hi]],
                    [self.block_bytes] * (2 * (hi - lo)),
                )
                for j in range(first, end)
                for lo, hi, checksum in self._ranges[wanted[j][0]]
            ]
            began: list[bool] = []
            failed = object()
            codes = self._calls.run(
                functools.partial(self._get_ranges, requests=requests, began=began), failed
            )
            if codes is failed:
                busy = end if began and not self.settled() else 0
                return InPlaceLoad(loaded, busy)
            codes, stored = codes
            at = 0
            for j in range(first, end):
                ranges = self._ranges[wanted[j][0]]
                sizes = [stored.get(at + r) for r in range(len(ranges))]
                problem = self._check_landed(
                    wanted[j][0], ranges, codes[at:], sizes, destinations[j]
                )
                at += len(ranges)
                if problem is not None:
                    return InPlaceLoad(loaded)
                loaded += 1
                self.imported += 1
                self.bytes_loaded += self.payload_bytes
        return InPlaceLoad(loaded)

    def _load_batches(self, count: int) -> list[tuple[int, int]]:
        """[first, end) runs of blocks, each at most LOAD_BATCH_BYTES (at least one block)."""
        per = max(1, LOAD_BATCH_BYTES // self.payload_bytes)
        return [(i, min(i + per, count)) for i in range(0, count, per)]

    def _check_landed(
        self,
        key: bytes,
        ranges: list,
        codes: list[int],
        stored: list[int | None],
        views: list[np.ndarray],
    ) -> str | None:
        """None if every range of ``key`` arrived whole and matches its checksum where it
        landed; else counts the fault or the damage, logs it, and says what. ``stored``:
        per range, the object's size in the store where its code may mean another size
        (see :meth:`_get_ranges`), else None."""
        name = f"block {key.hex()} in the {self.describe()}"
        for (lo, hi, checksum), code, size in zip(ranges, codes, stored):
            want = 2 * (hi - lo) * self.block_bytes
            if size is not None and size >= 0 and size != want:
                code = size  # Another size: damaged, whatever the read returned.
            elif size == NOT_FOUND:
                code = NOT_FOUND  # Gone between the read and the size.
            if code == NOT_FOUND:
                self._calls.fault("evicted", f"{name}: layers {lo}-{hi} are gone", pause=False)
                return "evicted"
            if code >= 0 and code != want:
                object_name = self.range_key(key, lo, hi, checksum)
                problem = (
                    f"{name}: object {object_name!r} (layers {lo}-{hi}) holds {code} bytes, "
                    f"not {want}: {'truncated' if code < want else 'size mismatch'}"
                )
            elif code == INVALID:
                problem = f"{name}: layers {lo}-{hi} do not hold {want} bytes ({code})"
            elif code < 0:
                fault = code_fault(code, f"getting layers {lo}-{hi} of {name}")
                self._calls.fault(fault.kind, str(fault), pause=fault.kind in PAUSING)
                return fault.kind
            else:
                if self.block_format.range_checksum(views, lo, hi) == checksum:
                    continue
                problem = f"{name}: layers {lo}-{hi}: checksum mismatch (corrupt object)"
            self.damaged += 1
            logger.warning("%s; treated as a miss", problem)
            return problem
        return None

    def stats(self) -> dict:
        out = dict(
            mooncake_published=self.published,
            mooncake_imported=self.imported,
            mooncake_misses=self.misses,
            mooncake_damaged=self.damaged,
            mooncake_publish_failures=self.publish_failures,
            mooncake_publish_in_flight=self.publishes_in_flight,
            mooncake_skipped=self.skipped,
            mooncake_bytes_loaded=self.bytes_loaded,
            mooncake_bytes_published=self.bytes_published,
            mooncake_faults=sum(self.faults.values()),
        )
        out.update({f"mooncake_fault_{kind}": n for kind, n in self.faults.items()})
        return out

    def close(self) -> None:
        """Leaves the pool (its objects in this process's segment go with it); every later
        call is a miss (counted as ``skipped``). Returns within about the deadline: a
        client stuck in a call is left to its daemon thread, and one whose master does not
        answer is left open (closing it would hold the GIL until the master answers; the
        client's own exit handler closes it when the interpreter exits)."""
        self._calls.close()

    def __enter__(self) -> MooncakeStoreLevel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the work itself (on the worker thread) ---------------------------------------------

    def _exists(self, client: Any, hkey: str) -> bool:
        rc = client.is_exist(hkey)
        if rc < 0:
            raise code_fault(rc, "is_exist")
        return rc == 1

    def _missing(self, client: Any, names: list[str]) -> list[int]:
        found = client.batch_is_exist(names)
        for code in found:
            if code < 0:
                raise code_fault(code, "batch_is_exist")
        return [i for i, code in enumerate(found) if code != 1]

    def _stage(self, batch: list) -> None:
        """Copies the batch's payloads into the level's registered buffer (block ``j`` at
        payload slot ``j``), on the caller's thread: the caller's memory (the pool's
        blocks, which may be reused once the call returns) is read only here."""
        size = self.block_bytes
        for j, (_, regions, _, _) in enumerate(batch):
            at = self._payload_at + j * self.payload_bytes
            for r, region in enumerate(regions):
                self._scratch[at + r * size : at + (r + 1) * size] = region

    def _publish_batch(self, client: Any, batch: list) -> tuple[int, int, tuple | None]:
        """(blocks put, blocks not put, (fault kind, detail) or None): the batch's ranges
        (staged by :meth:`_stage`) in one request, then the headers of the blocks whose
        ranges all went in."""
        base = self._scratch.ctypes.data
        keys, pointers, sizes, owner = [], [], [], []
        for j, (key, _, ranges, _) in enumerate(batch):
            at = self._payload_at + j * self.payload_bytes
            for lo, hi, checksum in ranges:
                span = self.block_format.layer_span(lo, hi)
                keys.append(self.range_key(key, lo, hi, checksum))
                pointers.append(base + at + span.start)
                sizes.append(span.stop - span.start)
                owner.append(j)
        codes = client.batch_put_from(keys, pointers, sizes)
        whole = [True] * len(batch)
        fault = None
        for j, code in zip(owner, codes):
            if code < 0:
                whole[j] = False
                fault = fault or code_fault(code, "putting a layer range")
        # A put the client gave up on (-901) while the master was stopped may still start
        # on the master once it resumes, and then never end: the object stays unreadable
        # (-703) until the master discards it, and a later put of it returns 0. So a
        # header is put only over ranges the store says are there, readable.
        sent = [i for i, j in enumerate(owner) if whole[j]]
        there = client.batch_is_exist([keys[i] for i in sent]) if sent else []
        for i, code in zip(sent, there):
            if code != 1:
                whole[owner[i]] = False
                fault = fault or (
                    code_fault(code, "asking for a layer range just put")
                    if code < 0
                    else StoreFault(
                        "not_ready", f"layer range {keys[i]!r} was put but is not there"
                    )
                )
        cap = self._header_capacity
        names, pointers, sizes = [], [], []
        for j, (key, _, _, header) in enumerate(batch):
            if whole[j]:
                self._scratch[j * cap : j * cap + len(header)] = np.frombuffer(header, np.uint8)
                names.append(self.header_key(key))
                pointers.append(base + j * cap)
                sizes.append(len(header))
        put = 0
        for code in client.batch_put_from(names, pointers, sizes) if names else []:
            if code < 0:
                fault = fault or code_fault(code, "putting a header")
            else:
                put += 1
        return put, len(batch) - put, None if fault is None else (fault.kind, str(fault))

    def _lookup(self, client: Any, items: list) -> tuple[int, str | None]:
        """(blocks found, from the first, whose headers pass every check; why the run
        ended if a header was damaged). A fault before the first block is raised; after
        it, the run ends there (the next lookup meets it again)."""
        found = 0
        base = self._scratch.ctypes.data
        cap = self._header_capacity
        for first in range(0, len(items), HEADER_BATCH):
            batch = items[first : first + HEADER_BATCH]
            sizes = client.batch_get_into(
                [self.header_key(key) for key, _, _ in batch],
                [base + j * cap for j in range(len(batch))],
                [cap] * len(batch),
            )
            for j, ((key, parent, tokens), size) in enumerate(zip(batch, sizes)):
                if size == NOT_FOUND:
                    return found, None
                if size < 0:
                    if found:
                        return found, None
                    raise code_fault(size, "getting a header")
                name = f"block {key.hex()} in the {self.describe()}"
                data = bytes(self._scratch[j * cap : j * cap + size])
                try:
                    self._ranges[key] = self.block_format.checked_header(
                        data, name, key, parent, tokens
                    )
                except DamagedBlock as e:
                    return found, str(e)
                found += 1
        return found, None

    def _get_ranges(
        self, client: Any, requests: list, began: list[bool]
    ) -> tuple[list[int], dict[int, int]]:
        """One request reading each (object, region pointers, region sizes) in place: its
        codes, and the stored size of each object whose code may mean another size than
        asked for (the client fails a shorter object as a failed transfer, a longer one as
        invalid), so that a truncated object is not taken for a holder that is gone."""
        began.append(True)
        keys, pointers, sizes = (list(x) for x in zip(*requests))
        codes = list(client.batch_get_into_multi_buffers(keys, pointers, sizes))
        stored = {
            i: int(client.get_size(keys[i]))
            for i, code in enumerate(codes)
            if code in (TRANSFER_FAILED, INVALID)
        }
        return codes, stored


def make_level(
    spec: Any, *, root: bytes, num_layers: int, block_tokens: int, block_bytes: int
) -> Any:
    """A remote level from ``spec``: a level object (anything with ``has`` / ``load`` /
    ``publish`` / ``stats`` / ``describe``), returned as it is; a factory (any other
    callable, e.g. ``functools.partial(MooncakeStoreLevel, "host:port",
    transfer_engine=engine)``), called with the cache's ``root``, ``num_layers``,
    ``block_tokens`` and ``block_bytes``; or a ``"mooncake://host:port"`` address,
    optionally with ``?segment_mb=``, ``object_kb=``, ``deadline_s=``, ``retry_after_s=``,
    ``local_host=``, ``namespace=``: a :class:`MooncakeStoreLevel` for the cache's root and
    geometry."""
    geometry = dict(
        root=root, num_layers=num_layers, block_tokens=block_tokens, block_bytes=block_bytes
    )
    if not isinstance(spec, str):
        missing = [
            m for m in ("has", "load", "publish", "stats", "describe") if not hasattr(spec, m)
        ]
        if missing and callable(spec):
            return make_level(spec(**geometry), **geometry)
        if missing:
            raise TypeError(
                f"remote level {spec!r} lacks {', '.join(missing)}: give a level object, a "
                f"factory of one, or 'mooncake://host:port'"
            )
        return spec
    return open_url(
        spec,
        "remote level",
        {
            "segment_mb": ("segment_bytes", megabytes),
            "object_kb": ("object_bytes", kilobytes),
            "deadline_s": ("deadline_s", float),
            "retry_after_s": ("retry_after_s", float),
            "local_host": ("local_host", str),
            "namespace": ("namespace", str),
        },
        functools.partial(MooncakeStoreLevel, **geometry),
    )
