"""Crash-consistent persistence of an offloaded KV cache: manifest, commits, checksums.

A cache on a persistent tier (``shm_name=`` or ``file_name=``) keeps a *manifest* beside its
data:

* file tier: ``<directory>/<file_name>.tpusync.manifest.json`` (the data is
  ``<directory>/<file_name>.tpusync``);
* shm tier: ``/dev/shm/<shm_name>.tpusync.manifest.json`` (the data is the segment
  ``/dev/shm/<shm_name>``), so the manifest lives and dies with the segment (a reboot
  clears both).

The manifest records the cache's geometry, its ``model_id``, a commit number, the committed
length, block table row and capacity of every sequence (batch slot), and an xxh3-64
checksum per *chunk* of committed rows. A chunk is a run of up to ``chunk_rows`` positions of
one logical (layer, K|V, sequence) region, read through the sequence's block table (the KV
is paged, see :mod:`jax_tpusync.blocks`: consecutive positions may live in blocks anywhere
in the layer's region); chunk ``c`` covers positions ``[c * chunk_rows, min((c + 1) *
chunk_rows, length))``, so the last chunk of a sequence may be partial and grows as decode
appends. A re-attached cache restores the tables and capacities (its slots hold the same
blocks, which the allocator no longer hands out) with the lengths.

Protocol. :meth:`Persistence.commit` runs between steps, after the engine has drained (so
every write-back has landed or failed): it makes the data durable (``fsync`` of the file;
nothing for shm, which outlives the process but not a reboot), hashes the rows committed
since the last commit (and chunks that :meth:`OffloadedKVCache.load` rewrote), then writes the
manifest atomically (temporary file, ``fsync``, ``os.replace``, ``fsync`` of the directory).
A crash at any point leaves either the old or the new manifest, and each describes rows that
were durable before it was written. Decode only appends past the committed lengths, so rows a
manifest covers are not rewritten by later steps; a re-attached cache starts from the
committed lengths, and anything past them (a half-written step) is dropped. Before a slot's
blocks are freed (and may be handed to another sequence), :meth:`Persistence.note_release`
commits the slot as released, so that no manifest names rows in blocks that later writes
may reuse.

Prefix index (:mod:`jax_tpusync.prefix`). Each commit also records the cache's prefix index
(``"prefix"``): its root digest, every entry (key, parent key, token ids, physical block, and
an xxh3-64 checksum of the block's bytes in every layer and K|V) with the cached ones in
eviction order, and per sequence how many leading blocks of its table are shared (mapped
from the index, read-only). A block is indexed only after the write-backs of the sequence
that wrote it have completed, and it is hashed by the first commit that records it, after
that commit made the data durable, so a manifest indexes only durable blocks; indexed
blocks are never written. Before a block the last commit indexes is handed out again (an
eviction freed it), :meth:`Persistence.note_evicted` commits the index without it. A
re-attached cache restores the entries (reference counts: the sequences that map each
block; the unpinned ones cached, least recently used first as recorded), and with
``verify`` checks every indexed block against its checksums. Entries chained from another
root (a cache of another ``prefix_salt``) are never looked up: the unmapped ones are
dropped on re-attach, the mapped ones stay until their sequences release them.

Errors are :class:`PersistenceError`, a subclass of :class:`jax_tpusync.TpusyncError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from jax_tpusync import prefix
from jax_tpusync.blocks import NO_BLOCK
from jax_tpusync.engine import Engine, TpusyncError

if TYPE_CHECKING:
    from jax_tpusync.cache import OffloadedKVCache

logger = logging.getLogger(__name__)

# Version of the tier byte layout that cache.py and blocks.py document (one region of KV
# blocks per (layer, K|V), block tables mapping positions to blocks). Bump it when that
# layout changes: a manifest of another version never attaches.
LAYOUT_VERSION = 2

MANIFEST_FORMAT = "jax_tpusync.kv_manifest"
# 2: the manifest records the prefix index ("prefix"); version 1 manifests (no index) are
# still read.
MANIFEST_VERSION = 2
READABLE_MANIFEST_VERSIONS = (1, 2)
MANIFEST_SUFFIX = ".tpusync.manifest.json"
SHM_DIRECTORY = "/dev/shm"
CHECKSUM_ALGORITHM = "xxh3_64"
UNSPECIFIED_MODEL = "unspecified"

# A chunk of about 4 MiB keeps the manifest small (a 1 GiB region is 256 checksums) while a
# flipped bit is still located to a few thousand rows.
CHUNK_TARGET_BYTES = 4 << 20
# Bytes read per engine request while hashing; two such buffers alternate, so the disk reads
# one while the CPU hashes the other.
READ_BATCH_BYTES = 32 << 20

# Test hook: called with a stage name ("before_manifest_write") during a commit; a hook that
# raises simulates a crash or failure at that point.
fault_hook: Callable[[str], None] | None = None


class PersistenceError(TpusyncError):
    """Base class of persistence errors (a :class:`jax_tpusync.TpusyncError`)."""


class LayoutMismatchError(PersistenceError):
    """The persisted KV was written by a cache of another geometry or model."""


class MissingManifestError(PersistenceError):
    """A persistent tier holds data but no (readable) manifest says what it is."""


class ChecksumMismatchError(PersistenceError):
    """A chunk of committed rows, or an indexed prefix block, does not match its checksum.

    Attributes:
      layer, kv ("K" or "V"): the region; sequence and rows: the chunk's sequence and its
      [start, stop) rows (None for a prefix block); block: the physical block of a prefix
      block (None for a chunk of rows).
    """

    def __init__(
        self,
        message: str,
        *,
        layer: int,
        kv: str,
        sequence: int | None = None,
        rows: tuple[int, int] | None = None,
        block: int | None = None,
    ):
        super().__init__(message)
        self.layer, self.kv, self.sequence, self.rows = layer, kv, sequence, rows
        self.block = block


class CommitError(PersistenceError):
    """A commit could not be made; the manifest still describes the previous commit."""


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What must match for a cache to re-attach to persisted KV."""

    num_layers: int
    batch: int
    max_len: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int | None  # None: not known yet (see ``of``)
    num_blocks: int | None
    layout_version: int
    model_id: str
    tier_dtype: str | None = None  # Quantized rows' code dtype; None: rows in ``dtype``.

    @classmethod
    def of(
        cls,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        model_id: str | None,
        *,
        block_tokens: int | None = None,
        num_blocks: int | None = None,
        tier_dtype: Any = None,
    ) -> Geometry:
        """The geometry of a cache made with these arguments, at this LAYOUT_VERSION.

        ``block_tokens`` and ``num_blocks`` are the cache's resolved values (after its
        defaults). Left None, :meth:`Persistence.prepare` does not compare them (the
        engine still refuses a tier of another byte layout) and :meth:`Persistence.attach`
        takes them from the opened cache's spec.
        """
        return cls(
            num_layers=int(num_layers),
            batch=int(batch),
            max_len=int(max_len),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            dtype=np.dtype(dtype).name,
            block_tokens=None if block_tokens is None else int(block_tokens),
            num_blocks=None if num_blocks is None else int(num_blocks),
            layout_version=LAYOUT_VERSION,
            model_id=UNSPECIFIED_MODEL if model_id is None else model_id,
            tier_dtype=None if tier_dtype is None else np.dtype(tier_dtype).name,
        )

    def completed(self, spec: Any) -> Geometry:
        """This geometry with the paging fields of a cache's spec filled in."""
        return dataclasses.replace(self, block_tokens=spec.block_tokens, num_blocks=spec.num_blocks)

    @property
    def max_blocks(self) -> int:
        """Block table entries per sequence."""
        assert self.block_tokens, "paging fields unknown"
        return -(-self.max_len // self.block_tokens)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Geometry:
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})

    def differences(self, ours: Geometry) -> list[str]:
        """One ``"field: the tier holds X, this cache has Y"`` per differing field; paging
        fields that ``ours`` does not know yet (None) are not compared."""
        out = []
        for f in dataclasses.fields(self):
            held, have = getattr(self, f.name), getattr(ours, f.name)
            if have is None and f.name in _PAGING_FIELDS:
                continue
            if held != have:
                out.append(f"{f.name}: the tier holds {held!r}, this cache has {have!r}")
        return out


_PAGING_FIELDS = ("block_tokens", "num_blocks")


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What :meth:`Persistence.verify` checked."""

    chunks: int
    bytes: int
    seconds: float
    skipped_chunks: int  # rewritten by load() since the last commit: no checksum yet
    prefix_blocks: int = 0  # indexed prefix blocks checked (every layer, K and V)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _region_name(layer: int, kv: int, b: int) -> str:
    return f"layer {layer} {'KV'[kv]} sequence {b}"


def _region_of(region: int, batch: int) -> tuple[int, int, int]:
    """(layer, kv, sequence) of logical region ``(layer * 2 + kv) * batch + sequence``."""
    return region // (2 * batch), region // batch % 2, region % batch


class Persistence:
    """The manifest and checksums of one cache on a persistent tier.

    Made by :meth:`prepare` before the tier is opened, bound to the cache by :meth:`attach`
    once it is. Not thread-safe: commit from the thread that drives the cache.
    """

    def __init__(
        self,
        *,
        geometry: Geometry,
        manifest_path: Path,
        data_path: Path,
        tier_kind: str,
        restored: dict[str, Any] | None,
    ):
        self.geometry = geometry
        self.manifest_path = manifest_path
        self.data_path = data_path
        self.tier_kind = tier_kind
        self._restored = restored
        self._commit = 0
        self._lengths = np.zeros(geometry.batch, np.int64)
        # The committed block tables (int32[batch, max_blocks]) and capacities (int32[batch]).
        self._tables = np.zeros((geometry.batch, 0), np.int32)
        self._capacity = np.zeros(geometry.batch, np.int32)
        self._chunk_rows = 1
        # Per logical region (layer * 2 + kv) * batch + b: checksums of its committed chunks.
        self._sums: list[list[int]] = []
        # Per region: (chunk, rows hashed, hasher) of its partial last chunk, so that the next
        # commit hashes only the appended rows. Lost on restart (rebuilt by verify).
        self._tails: dict[int, tuple[int, int, Any]] = {}
        # Per region: chunks that load() rewrote since the last commit.
        self._stale: dict[int, set[int]] = {}
        # The committed prefix index: per sequence its shared (indexed) leading blocks, the
        # manifest's "prefix" section, and the entries it records (the index's own objects:
        # one that is no longer the index's was evicted since).
        self._shared = np.zeros(geometry.batch, np.int32)
        self._prefix_json: dict[str, Any] = {}
        self._committed_entries: dict[bytes, prefix._Entry] = {}
        self._evictions_seen = 0  # The index's eviction count when that was last checked.
        self._entry_json: dict[bytes, tuple[prefix._Entry, dict[str, Any]]] = {}
        self._cache: OffloadedKVCache | None = None

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def prepare(
        cls,
        *,
        tier: str,
        path: str | os.PathLike | None,
        shm_name: str | None,
        file_name: str | None,
        geometry: Geometry,
        overwrite: bool,
    ) -> Persistence | None:
        """Checks persisted KV against ``geometry`` before the tier is opened.

        Returns None for a non-persistent tier. With ``overwrite``, existing data and
        manifest are deleted instead of checked, so the tier starts empty.

        Raises:
          LayoutMismatchError: the manifest's geometry or model_id differs.
          MissingManifestError: the data exists but its manifest does not, is unreadable, or
            describes an inconsistent commit (block tables, capacities, lengths, checksums).
        """
        if tier == "file" and file_name:
            directory = Path(os.fspath(path))
            data_path = directory / f"{file_name}.tpusync"
            manifest_path = directory / f"{file_name}{MANIFEST_SUFFIX}"
        elif tier == "host" and shm_name:
            data_path = Path(SHM_DIRECTORY) / shm_name
            manifest_path = Path(SHM_DIRECTORY) / f"{shm_name}{MANIFEST_SUFFIX}"
        else:
            return None

        restored = None
        if overwrite:
            for p in (data_path, manifest_path):
                if p.exists():
                    logger.warning("overwrite=True: discarding %s", p)
                    if p == data_path and tier == "host":
                        Engine.unlink_shm(shm_name)
                    else:
                        p.unlink()
        elif data_path.exists():
            if not manifest_path.exists():
                raise MissingManifestError(
                    f"{data_path} holds KV but has no manifest ({manifest_path}): nothing says "
                    "which model, geometry or lengths it holds, or whether its last step was "
                    "complete. Pass overwrite=True to discard it and start empty."
                )
            restored = read_manifest(manifest_path)
            held = Geometry.from_json(restored["geometry"])
            diffs = held.differences(geometry)
            if diffs:
                raise LayoutMismatchError(
                    f"layout mismatch: the KV in {data_path} does not belong to this cache: "
                    + "; ".join(diffs)
                    + ". Use another name, or pass overwrite=True to discard it."
                )
            restored = _checked_commit(restored, held, manifest_path)
        elif manifest_path.exists():
            # The data went (a reboot cleared shm, or the file was deleted): what the
            # manifest describes is lost, and the new tier starts empty.
            logger.warning(
                "%s has no data beside it (%s): starting empty", manifest_path, data_path
            )
            manifest_path.unlink()
        return cls(
            geometry=geometry,
            manifest_path=manifest_path,
            data_path=data_path,
            tier_kind=tier,
            restored=restored,
        )

    def attach(self, cache: OffloadedKVCache, *, attached: bool, verify: bool) -> np.ndarray | None:
        """Binds to the opened cache; returns the restored lengths (None: a new cache).

        A new cache writes its first manifest (commit 0, lengths 0, no slot active). A
        re-attached one restores the last commit (its slots hold the committed blocks,
        capacities and shared prefixes again, its prefix index the committed entries:
        ``cache._restore_slots``), verifies its checksums (rows and indexed blocks) if
        ``verify``, and records that a session is open (so the next one can tell whether
        this one committed at the end).
        """
        self._cache = cache
        spec = cache.spec
        manifest = self._restored
        if manifest is not None and not attached:
            logger.warning("%s vanished before it was opened: starting empty", self.data_path)
            manifest = None
        if manifest is None and attached:
            raise MissingManifestError(
                f"{self.data_path} appeared while this cache was opening, without a manifest; "
                "pass overwrite=True to discard it"
            )
        # What the manifest records (prepare() had the paging fields if the cache gave them).
        self.geometry = self.geometry.completed(spec)
        if manifest is None:
            self._chunk_rows = max(1, min(spec.max_len, CHUNK_TARGET_BYTES // spec.row_bytes))
            self._sums = [[] for _ in range(self._num_regions)]
            self._tables = cache.block_tables
            self._capacity = cache.capacity
            self._shared = cache._shared.copy()
            self._prefix_json = self._prefix_section([], self._shared)
            self._write_manifest(session="open")
            logger.info("new persistent KV cache; manifest %s", self.manifest_path)
            return None

        self._commit = manifest["commit"]
        self._lengths = manifest["lengths"]
        self._tables = manifest["block_tables"]
        self._capacity = manifest["capacity"]
        self._chunk_rows = manifest["chunk_rows"]
        self._sums = manifest["sums"]
        self._shared = manifest["shared"]
        entries = self._restored_entries(manifest, cache._prefix.root)
        # The slots hold their committed blocks again, the index its blocks (the ones a
        # slot maps pinned); later admits get other ones.
        cache._restore_slots(self._tables, self._capacity, self._shared, entries)
        self._committed_entries = {e.key: e for e in entries}
        self._prefix_json = self._prefix_section(cache._prefix.entries_in_order(), self._shared)
        if manifest["session"] == "open":
            logger.warning(
                "%s: the previous session ended without a final commit (a crash, a failed "
                "write-back, or close() without a state); restored commit %d. Rows from "
                "these lengths on were not committed and are dropped: %s",
                self.data_path,
                self._commit,
                ", ".join(f"sequence {b} from row {n}" for b, n in enumerate(self._lengths)),
            )
        else:
            logger.info(
                "%s: restored commit %d, lengths %s",
                self.data_path,
                self._commit,
                self._lengths.tolist(),
            )
        if verify:
            result = self.verify()
            logger.info(
                "verified %d chunks and %d prefix blocks (%.1f MiB) of committed KV at "
                "%.2f GB/s",
                result.chunks,
                result.prefix_blocks,
                result.bytes / 2**20,
                result.gb_per_s,
            )
        # Also drops from the manifest entries of another root that were not restored
        # (their blocks are free now), before any of those blocks can be handed out.
        self._write_manifest(session="open")
        return self._lengths.astype(np.int32)

    def _restored_entries(self, manifest: dict[str, Any], root: bytes) -> list[prefix._Entry]:
        """The committed index as entries of this cache's index, in the recorded order,
        each with its reference count (the sequences whose shared prefix maps its block).

        Entries chained from another root than ``root`` (a cache of another salt wrote
        them) are never looked up: their first block's parent becomes that root (no key),
        and the ones no sequence maps are dropped (their blocks are free)."""
        recorded = manifest["entries"]
        if not recorded:
            return []
        refs: dict[int, int] = {}
        for b, count in enumerate(self._shared.tolist()):
            for p in self._tables[b, :count].tolist():
                refs[p] = refs.get(p, 0) + 1
        by_key = {e["key"]: e for e in recorded}
        origin: dict[bytes, bytes] = {}  # Each entry's chain's root.

        def origin_of(key: bytes) -> bytes:
            path, k = [], key
            while k not in origin:
                path.append(k)
                parent = by_key[k]["parent"]
                if parent is None:
                    found = manifest["root"]
                    break
                if parent not in by_key:  # A first block chained from another root.
                    found = parent
                    break
                k = parent
            else:
                found = origin[k]
            for q in path:
                origin[q] = found
            return found

        out, dropped, foreign = [], 0, 0
        for e in recorded:
            chain_root = origin_of(e["key"])
            count = refs.get(e["block"], 0)
            if chain_root != root:
                if count == 0:
                    dropped += 1
                    continue
                foreign += 1
            parent = e["parent"]
            if parent is None or parent not in by_key:  # A first block.
                parent = None if chain_root == root else chain_root
            out.append(
                prefix._Entry(
                    e["key"], parent, e["tokens"], e["block"], refs=count, sums=e["sums"]
                )
            )
        if dropped or foreign:
            logger.info(
                "%s: %d prefix blocks are indexed under another root (another prefix_salt "
                "or key version): never looked up; %d dropped, %d kept while restored "
                "sequences map them",
                self.data_path,
                dropped + foreign,
                dropped,
                foreign,
            )
        return out

    # -- bookkeeping from the cache ---------------------------------------------------------

    @property
    def commit_number(self) -> int:
        return self._commit

    @property
    def committed_lengths(self) -> np.ndarray:
        return self._lengths.copy()

    @property
    def committed_block_tables(self) -> np.ndarray:
        return self._tables.copy()

    @property
    def committed_capacity(self) -> np.ndarray:
        return self._capacity.copy()

    @property
    def _num_regions(self) -> int:
        """Logical (layer, K|V, sequence) regions, each with its own chunks."""
        spec = self._spec
        return spec.num_layers * 2 * spec.batch

    def note_rows_written(self, layer: int, starts: np.ndarray, counts: np.ndarray) -> None:
        """Marks chunks that a host-side write (``load``) touches as needing a new checksum."""
        spec = self._spec
        r_rows = self._chunk_rows
        for kv in range(2):
            for b in range(spec.batch):
                s, n = int(starts[b]), int(counts[b])
                if n <= 0:
                    continue
                region = (layer * 2 + kv) * spec.batch + b
                chunks = range(s // r_rows, (s + n - 1) // r_rows + 1)
                self._stale.setdefault(region, set()).update(chunks)

    def note_init(self, lengths: np.ndarray) -> None:
        """A state starting below the committed lengths will overwrite committed rows:
        commit the shorter lengths first, so that a crash cannot leave a manifest whose
        checksums cover rows decode has rewritten."""
        lengths = np.asarray(lengths, np.int64)
        if (lengths < self._lengths).any():
            logger.info(
                "init() below the committed lengths %s: committing %s first",
                self._lengths.tolist(),
                lengths.tolist(),
            )
            self._spec_engine.drain()
            self.commit(np.minimum(lengths, self._lengths))

    def note_release(self, slot: int) -> None:
        """Call before ``slot``'s blocks are freed: if the last commit holds rows of it,
        commits it released first (length 0, no blocks; the other sequences at their
        committed lengths), so that no manifest names rows in blocks another sequence may
        be given and overwrite.

        Raises:
          CommitError: that commit failed; the slot must keep its blocks.
        """
        if self._lengths[slot] == 0:
            return  # No committed row lives in its blocks.
        cache = self._cache
        assert cache is not None, "attach() first"
        lengths = self._lengths.copy()
        lengths[slot] = 0
        tables = cache.block_tables
        tables[slot] = NO_BLOCK
        capacity = cache.capacity
        capacity[slot] = 0
        shared = cache._shared.copy()
        shared[slot] = 0
        logger.info("releasing sequence %d: committing it released first", slot)
        self._spec_engine.drain()
        self.commit(lengths, tables=tables, capacity=capacity, shared=shared)

    def note_evicted(self) -> None:
        """Call before the cache hands out free blocks: if an eviction since the last
        commit freed a block that commit indexes, commits the index without it first (the
        sequences at their committed lengths), so that no manifest indexes a block another
        sequence may be given and overwrite.

        Raises:
          CommitError: that commit failed; the blocks must not be handed out (the next
            call tries again).
        """
        index = self._cache._prefix
        if index.evictions == self._evictions_seen:
            return
        live = index._entries
        if all(live.get(k) is e for k, e in self._committed_entries.items()):
            self._evictions_seen = index.evictions
            return
        logger.info("evicted prefix blocks that the last commit indexes: committing first")
        self._spec_engine.drain()
        self.commit(self._lengths)

    @property
    def _spec(self):
        assert self._cache is not None, "attach() first"
        return self._cache.spec

    @property
    def _spec_engine(self) -> Engine:
        assert self._cache is not None, "attach() first"
        return self._cache.engine

    # -- commit -----------------------------------------------------------------------------

    def commit(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        session: str = "open",
        tables: np.ndarray | None = None,
        capacity: np.ndarray | None = None,
        shared: np.ndarray | None = None,
    ) -> int:
        """Makes rows below ``lengths`` durable and records them with the block tables,
        capacities and shared prefixes (default: the cache's) and the cache's prefix
        index; returns the commit number.

        The engine must have drained (every write-back landed). Nothing in memory changes
        unless the new manifest is in place (but for the checksums of newly indexed
        blocks, which the entries keep). ``tables`` may differ from the cache's only in
        sequences committed at length 0 (rows are read through the cache's tables). A
        sequence's length is committed at least at its shared prefix (indexed blocks:
        durable, recorded by this same commit).

        Raises:
          CommitError: a length past its sequence's capacity, or syncing, reading or
            writing the manifest failed.
        """
        spec = self._spec
        cache = self._cache
        lengths = np.asarray(lengths, np.int64).reshape(spec.batch)
        tables = cache.block_tables if tables is None else np.array(tables, np.int32)
        capacity = cache.capacity if capacity is None else np.array(capacity, np.int32)
        shared = cache._shared.copy() if shared is None else np.array(shared, np.int32)
        lengths = np.maximum(lengths, shared.astype(np.int64) * spec.block_tokens)
        index = cache._prefix
        try:
            for b in range(spec.batch):
                if not 0 <= lengths[b] <= capacity[b]:
                    raise ValueError(
                        f"sequence {b}'s length {int(lengths[b])} is not in [0, "
                        f"{int(capacity[b])}] (its capacity)"
                    )
            self._sync_data()
            sums, tails = self._updated_checksums(lengths, tables)
            entries = index.entries_in_order()
            evictions = index.evictions
            # Blocks indexed since the last commit: durable now (synced above), hashed once.
            self._hash_blocks([e for e in entries if e.sums is None])
            prefix_json = self._prefix_section(entries, shared)
            if fault_hook is not None:
                fault_hook("before_manifest_write")
            self._write_manifest(
                session=session,
                commit=self._commit + 1,
                lengths=lengths,
                sums=sums,
                tables=tables,
                capacity=capacity,
                prefix_json=prefix_json,
            )
        except Exception as e:
            raise CommitError(
                f"commit {self._commit + 1} was not written (the tier keeps commit "
                f"{self._commit}, lengths {self._lengths.tolist()}): {e}"
            ) from e
        self._commit += 1
        self._lengths = lengths
        self._tables, self._capacity = tables, capacity
        self._sums, self._tails = sums, tails
        self._stale.clear()
        self._shared = shared
        self._prefix_json = prefix_json
        self._committed_entries = {e.key: e for e in entries}
        self._evictions_seen = evictions
        return self._commit

    def mark_session(self, session: str) -> None:
        """Rewrites the manifest's session state only (same commit)."""
        self._write_manifest(session=session)

    def _sync_data(self) -> None:
        if self.tier_kind != "file":
            return  # shm: the bytes are in the kernel's memory once written; no device.
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _updated_checksums(
        self, lengths: np.ndarray, tables: np.ndarray
    ) -> tuple[list[list[int]], dict[int, tuple[int, int, Any]]]:
        """New per-chunk checksums for ``lengths`` (rows in the blocks of ``tables``);
        hashes only chunks that changed."""
        spec = self._spec
        rr = self._chunk_rows
        sums = [list(s) for s in self._sums]
        tails: dict[int, tuple[int, int, Any]] = {}
        work: list[tuple[int, int, int, Any]] = []  # (region, lo, hi, hasher)
        finish: list[tuple[int, int, Any, int]] = []  # (region, chunk, hasher, rows)
        old_lengths = self._lengths.copy()
        for b in range(spec.batch):
            # Rows kept from the last commit must still be in the blocks it named; a
            # sequence whose blocks moved is hashed afresh.
            kept_blocks = -(-int(min(old_lengths[b], lengths[b])) // spec.block_tokens)
            if not np.array_equal(self._tables[b, :kept_blocks], tables[b, :kept_blocks]):
                old_lengths[b] = 0
        for region in range(self._num_regions):
            b = region % spec.batch
            old, new = int(old_lengths[b]), int(lengths[b])
            stale = self._stale.get(region, set())
            nchunks = -(-new // rr)
            kept = min(old, new) // rr  # Chunks below this are full and were committed.
            del sums[region][nchunks:]
            sums[region].extend([0] * (nchunks - len(sums[region])))
            todo = sorted({c for c in stale if c < kept} | set(range(kept, nchunks)))
            tail = self._tails.get(region) if old else None
            if tail is not None and tail[0] not in todo and tail[0] * rr + tail[1] == new:
                tails[region] = tail  # Unchanged partial last chunk.
            for c in todo:
                lo, hi = c * rr, min((c + 1) * rr, new)
                if (
                    tail is not None
                    and c not in stale
                    and tail[0] == c
                    and lo + tail[1] == old
                    and old <= hi
                ):
                    hasher, feed_lo = tail[2].copy(), old  # Continue: hash the appended rows.
                else:
                    hasher, feed_lo = xxhash.xxh3_64(), lo
                work.append((region, feed_lo, hi, hasher))
                finish.append((region, c, hasher, hi - lo))
        self._hash_rows(work)
        for region, c, hasher, rows in finish:
            sums[region][c] = hasher.intdigest()
            if rows < rr:
                tails[region] = (c, rows, hasher)
        return sums, tails

    # -- verify -----------------------------------------------------------------------------

    def verify(self) -> VerifyResult:
        """Re-reads every committed chunk and every block the committed prefix index
        holds, and compares them with their checksums.

        Chunks that ``load()`` rewrote since the last commit are skipped (their checksum is
        recomputed at the next commit), and so are blocks indexed since (hashed by the next
        commit).

        Raises:
          ChecksumMismatchError: naming the first indexed block that differs (layer, K|V,
            physical block), else the first chunk (layer, K|V, sequence, rows), with the
            number of others.
        """
        spec = self._spec
        rr = self._chunk_rows
        t0 = time.perf_counter()
        tables = self._cache.block_tables
        for b in range(spec.batch):
            used = -(-int(self._lengths[b]) // spec.block_tokens)
            if not np.array_equal(tables[b, :used], self._tables[b, :used]):
                raise PersistenceError(
                    f"sequence {b} no longer holds the KV blocks commit {self._commit} "
                    f"recorded (it holds {tables[b, :used].tolist()}, the commit "
                    f"{self._tables[b, :used].tolist()}): it was released or re-admitted "
                    "without a commit, so its committed rows cannot be checked; commit first"
                )
        work, checks = [], []
        skipped = 0
        for region in range(self._num_regions):
            b = region % spec.batch
            n = int(self._lengths[b])
            stale = self._stale.get(region, set())
            for c in range(-(-n // rr)):
                if c in stale:
                    skipped += 1
                    continue
                lo, hi = c * rr, min((c + 1) * rr, n)
                hasher = xxhash.xxh3_64()
                work.append((region, lo, hi, hasher))
                checks.append((region, c, lo, hi, hasher))
        # Indexed blocks, checked first: a bad shared block also fails its sequences' chunks.
        entries = list(self._committed_entries.values())
        block_hashers = [[xxhash.xxh3_64() for _ in range(2 * spec.num_layers)] for _ in entries]
        spans = [
            item
            for e, hashers in zip(entries, block_hashers)
            for item in self._block_spans(e.block, hashers)
        ]
        nbytes = self._hash_spans(spans) + self._hash_rows(work)
        bad_blocks = [
            (e, i)
            for e, hashers in zip(entries, block_hashers)
            for i, h in enumerate(hashers)
            if h.intdigest() != e.sums[i]
        ]
        if bad_blocks:
            e, i = bad_blocks[0]
            layer, kv = divmod(i, 2)
            more = f" (and {len(bad_blocks) - 1} more)" if len(bad_blocks) > 1 else ""
            raise ChecksumMismatchError(
                f"committed KV is corrupt in {self.data_path}: layer {layer} {'KV'[kv]} "
                f"prefix block {e.block} (indexed, shared between sequences) does not match "
                f"commit {self._commit}'s checksum{more}. Pass overwrite=True to discard the "
                "cache (verify=False would map the corrupt block into later sequences).",
                layer=layer,
                kv="KV"[kv],
                block=e.block,
            )
        bad = []
        for region, c, lo, hi, hasher in checks:
            if hasher.intdigest() != self._sums[region][c]:
                bad.append((region, lo, hi))
            elif hi - lo < rr:
                # A verified partial chunk: the next commit continues from it.
                self._tails[region] = (c, hi - lo, hasher)
        if bad:
            region, lo, hi = bad[0]
            layer, kv, b = _region_of(region, spec.batch)
            more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
            raise ChecksumMismatchError(
                f"committed KV is corrupt in {self.data_path}: {_region_name(layer, kv, b)}, "
                f"rows [{lo}, {hi}) do not match commit {self._commit}'s checksum{more}. "
                "Pass overwrite=True to discard the cache, or verify=False to open it anyway.",
                layer=layer,
                kv="KV"[kv],
                sequence=b,
                rows=(lo, hi),
            )
        return VerifyResult(
            chunks=len(checks),
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            skipped_chunks=skipped,
            prefix_blocks=len(entries),
        )

    # -- reading and hashing ----------------------------------------------------------------

    def _hash_rows(self, work: Iterable[tuple[int, int, int, Any]]) -> int:
        """Feeds positions [lo, hi) of each logical region to its hasher, reading them
        through the sequence's block table (the cache's) with the engine; returns the
        bytes hashed."""
        spec = self._spec
        cache = self._cache
        spans = []
        for region, lo, hi, hasher in work:
            if hi <= lo:
                continue
            layer, kv, b = _region_of(region, spec.batch)
            spans.append((cache.tier_rows(layer, kv, b, lo, hi), hasher))
        return self._hash_spans(spans)

    def _block_spans(self, block: int, hashers: Sequence[Any]) -> list[tuple[list, Any]]:
        """Work for :meth:`_hash_spans`: physical ``block`` in each (layer, K|V), fed to
        ``hashers[layer * 2 + kv]``."""
        spec = self._spec
        first = self._cache.first_block
        return [
            (
                [((first + region * spec.num_blocks + block) * spec.block_bytes, spec.block_bytes)],
                hashers[region],
            )
            for region in range(2 * spec.num_layers)
        ]

    def _hash_blocks(self, entries: Sequence[prefix._Entry]) -> None:
        """Sets each entry's ``sums``: xxh3-64 of its block in every (layer, K|V)."""
        if not entries:
            return
        n = 2 * self._spec.num_layers
        hashers = [[xxhash.xxh3_64() for _ in range(n)] for _ in entries]
        self._hash_spans(
            [item for e, h in zip(entries, hashers) for item in self._block_spans(e.block, h)]
        )
        for e, h in zip(entries, hashers):
            e.sums = [x.intdigest() for x in h]

    def _hash_spans(self, work: Sequence[tuple[list[tuple[int, int]], Any]]) -> int:
        """Feeds each item's tier byte runs ``[(offset, bytes), ...]``, in order, to its
        hasher, reading them with the engine.

        Reads go in batches of up to READ_BATCH_BYTES into two alternating buffers: the next
        batch is read while this one is hashed. Returns the bytes hashed.
        """
        cache = self._cache
        engine = self._spec_engine
        batches: list[list[tuple[list[tuple[int, int]], int, Any]]] = []
        size = 0
        for runs, hasher in work:
            n = sum(m for _, m in runs)
            if n <= 0:
                continue
            if not batches or size + n > READ_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append((runs, n, hasher))
            size += n
        if not batches:
            return 0
        biggest = max(sum(n for _, n, _ in batch) for batch in batches)
        phase = engine.tier_info(cache.tier).alignment_offset
        buffers = [_phased_buffer(biggest, phase) for _ in range(min(2, len(batches)))]

        def submit(i: int) -> int:
            segments, mem = [], 0
            for runs, _, _ in batches[i]:
                for offset, n in runs:
                    segments.append((offset, mem, n))
                    mem += n
            return engine.submit_read(cache.tier, segments, buffers[i % 2])

        total = 0
        ticket: int | None = submit(0)
        try:
            for i, batch in enumerate(batches):
                upcoming = submit(i + 1) if i + 1 < len(batches) else None
                current, ticket = ticket, upcoming
                engine.wait(current)
                buf, mem = buffers[i % 2], 0
                for _, n, hasher in batch:
                    hasher.update(buf[mem : mem + n])
                    mem += n
                total += mem
        finally:
            if ticket is not None:  # An error mid-way: the read in flight still lands first.
                try:
                    engine.wait(ticket)
                except Exception:  # noqa: BLE001 - the first error is the one raised.
                    pass
        return total

    def _prefix_section(self, entries: Sequence[prefix._Entry], shared: np.ndarray) -> dict:
        """The manifest's "prefix": the index's root, the roots of first blocks chained
        from another one, the block checksum algorithm, each sequence's shared blocks and
        the entries in ``entries``' order (each with its block's checksums)."""
        index = self._cache._prefix
        keys = {e.key for e in entries}
        foreign = sorted(
            {e.parent for e in entries if e.parent is not None and e.parent not in keys}
        )
        num_layers = self._spec.num_layers
        cache: dict[bytes, tuple[prefix._Entry, dict[str, Any]]] = {}
        out = []
        for e in entries:
            held = self._entry_json.get(e.key)
            if held is None or held[0] is not e:  # Made once per entry (its fields are fixed).
                held = (
                    e,
                    {
                        "key": e.key.hex(),
                        "parent": None if e.parent is None else e.parent.hex(),
                        "tokens": [int(t) for t in e.tokens],
                        "block": int(e.block),
                        "checksums": [
                            [f"{e.sums[layer * 2 + kv]:016x}" for kv in range(2)]
                            for layer in range(num_layers)
                        ],
                    },
                )
            cache[e.key] = held
            out.append(held[1])
        self._entry_json = cache
        return {
            "root": index.root.hex(),
            "foreign_roots": [r.hex() for r in foreign],
            "checksum": CHECKSUM_ALGORITHM,
            "shared": [int(n) for n in shared],
            "entries": out,
        }

    # -- manifest ---------------------------------------------------------------------------

    def _write_manifest(
        self,
        *,
        session: str,
        commit: int | None = None,
        lengths: np.ndarray | None = None,
        sums: list[list[int]] | None = None,
        tables: np.ndarray | None = None,
        capacity: np.ndarray | None = None,
        prefix_json: dict[str, Any] | None = None,
    ) -> None:
        spec = self._spec
        commit = self._commit if commit is None else commit
        lengths = self._lengths if lengths is None else lengths
        sums = self._sums if sums is None else sums
        tables = self._tables if tables is None else tables
        capacity = self._capacity if capacity is None else capacity
        prefix_json = self._prefix_json if prefix_json is None else prefix_json
        now = time.time()
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "geometry": self.geometry.to_json(),
            "model_id": self.geometry.model_id,
            "tier": self.tier_kind,
            "data": str(self.data_path),
            "commit": commit,
            "timestamp": now,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
            "session": session,
            "lengths": [int(n) for n in lengths],
            "block_tables": np.asarray(tables).tolist(),
            "capacity": [int(n) for n in capacity],
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_rows": self._chunk_rows},
            "checksums": _sums_to_json(sums, spec.num_layers, spec.batch),
            "prefix": prefix_json,
        }
        write_json_atomically(self.manifest_path, manifest)


def _phased_buffer(nbytes: int, phase: int) -> np.ndarray:
    """A uint8 buffer starting ``phase`` bytes past a page: in the file tier's phase, so
    O_DIRECT reads land in it directly instead of through a bounce buffer and a copy."""
    raw = np.empty(nbytes + 8192, np.uint8)
    start = (phase - raw.ctypes.data) % 4096
    return raw[start : start + nbytes]


def _sums_to_json(sums: list[list[int]], num_layers: int, batch: int) -> list:
    """[layer][kv][sequence] -> list of 16-digit hex checksums, one per chunk."""
    return [
        [[[f"{s:016x}" for s in sums[(layer * 2 + kv) * batch + b]] for b in range(batch)]
         for kv in range(2)]
        for layer in range(num_layers)
    ]


def _sums_from_json(nested: list, num_layers: int, batch: int) -> list[list[int]]:
    return [
        [int(s, 16) for s in nested[layer][kv][b]]
        for layer in range(num_layers)
        for kv in range(2)
        for b in range(batch)
    ]


def read_manifest(path: Path) -> dict[str, Any]:
    """Loads and sanity-checks a manifest.

    Raises:
      MissingManifestError: it cannot be read or is not a manifest of this format.
    """
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}")
        if manifest.get("format_version") not in READABLE_MANIFEST_VERSIONS:
            raise ValueError(
                f"format_version {manifest.get('format_version')!r}; this build reads "
                f"{', '.join(map(str, READABLE_MANIFEST_VERSIONS))}"
            )
        for key in ("geometry", "commit", "lengths", "checksum", "checksums"):
            if key not in manifest:
                raise ValueError(f"no {key!r}")
    except (OSError, ValueError) as e:
        raise MissingManifestError(
            f"cannot use manifest {path}: {e}. Pass overwrite=True to discard the cache."
        ) from e
    return manifest


def _checked_commit(manifest: dict[str, Any], held: Geometry, path: Path) -> dict[str, Any]:
    """The commit a manifest describes, checked against its geometry ``held``: lengths,
    block tables and capacities (int arrays), chunk_rows and checksums, and the prefix
    index (see :func:`_checked_prefix`).

    Each sequence holds blocks in the first ``ceil(capacity / block_tokens)`` entries of its
    table row and none after them, every id in ``[0, num_blocks)``, and its length is at
    most its capacity (0 for an inactive sequence) and at least its shared prefix. Its first
    ``shared`` blocks are indexed, one chain from a first block; a block is held once,
    except an indexed block, which any number of sequences may map within their shared
    prefixes; an indexed block is never a sequence's private block.

    Raises:
      MissingManifestError: naming what is inconsistent.
    """
    try:
        for name in ("block_tokens", "num_blocks"):
            value = getattr(held, name)
            if not _is_json_int(value) or value < 1:
                raise ValueError(f"geometry.{name} is {value!r}, not a positive int")
        batch, max_blocks = held.batch, held.max_blocks
        commit = manifest["commit"]
        if not _is_json_int(commit) or commit < 0:
            raise ValueError(f"commit is {commit!r}, not an int >= 0")
        lengths = _int_array(manifest["lengths"], (batch,), "lengths")
        for key in ("block_tables", "capacity"):
            if key not in manifest:
                raise ValueError(f"no {key!r}")
        tables = _int_array(manifest["block_tables"], (batch, max_blocks), "block_tables")
        capacity = _int_array(manifest["capacity"], (batch,), "capacity")
        if manifest.get("format_version", MANIFEST_VERSION) >= 2 and "prefix" not in manifest:
            raise ValueError("no 'prefix'")
        index = _checked_prefix(manifest.get("prefix"), held)
        shared_counts, entries = index["shared"], index["entries"]
        by_block = {e["block"]: i for i, e in enumerate(entries)}
        keys = {e["key"] for e in entries}
        holder: dict[int, int] = {}  # Private blocks: their sequence.
        for b in range(batch):
            row, cap, n = tables[b], int(capacity[b]), int(lengths[b])
            shared = int(shared_counts[b])
            for i, p in enumerate(row.tolist()):
                if p != NO_BLOCK and not 0 <= p < held.num_blocks:
                    raise ValueError(
                        f"block_tables[{b}][{i}] = {p} is not a block id (-1 or in [0, "
                        f"num_blocks={held.num_blocks}))"
                    )
                if i < shared:
                    _check_shared_block(b, i, row, entries, by_block, keys)
                    if p in holder:
                        raise ValueError(
                            f"block {p} is held twice (by sequence {holder[p]}, as a private "
                            f"block, and sequence {b}); only an indexed block in each one's "
                            "shared prefix may be"
                        )
                elif p >= 0:
                    if p in by_block:
                        raise ValueError(
                            f"block {p} is indexed (prefix.entries[{by_block[p]}]) but "
                            f"sequence {b} holds it as a private block (table entry {i}, past "
                            f"its shared prefix of {shared} blocks)"
                        )
                    if p in holder:
                        raise ValueError(
                            f"block {p} is held twice (by sequence {holder[p]} and sequence "
                            f"{b}); only an indexed block in each one's shared prefix may be"
                        )
                    holder[p] = b
            if not 0 <= cap <= held.max_len:
                raise ValueError(
                    f"capacity[{b}] = {cap} is not in [0, max_len={held.max_len}]"
                )
            need = -(-cap // held.block_tokens)
            if not ((row[:need] >= 0).all() and (row[need:] == NO_BLOCK).all()):
                raise ValueError(
                    f"sequence {b}'s capacity of {cap} tokens needs blocks in exactly its "
                    f"first {need} table entries, but its table row is {row.tolist()}"
                )
            if not 0 <= n <= cap:
                raise ValueError(
                    f"lengths[{b}] = {n} is not in [0, {cap}] (sequence {b}'s capacity)"
                )
            if n < shared * held.block_tokens:
                raise ValueError(
                    f"lengths[{b}] = {n} is below sequence {b}'s shared prefix of "
                    f"{shared * held.block_tokens} tokens ({shared} indexed blocks)"
                )
        checksum = manifest["checksum"]
        chunk_rows = checksum.get("chunk_rows") if isinstance(checksum, dict) else None
        if not _is_json_int(chunk_rows) or chunk_rows < 1:
            raise ValueError(f"checksum.chunk_rows is {chunk_rows!r}, not a positive int")
        if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
            raise ValueError(
                f"checksum.algorithm is {checksum.get('algorithm')!r}, not {CHECKSUM_ALGORITHM!r}"
            )
        try:
            sums = _sums_from_json(manifest["checksums"], held.num_layers, batch)
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise ValueError(f"checksums are not [layer][K|V][sequence] hex lists ({e})") from e
        for region, chunks in enumerate(sums):
            layer, kv, b = _region_of(region, batch)
            want = -(-int(lengths[b]) // chunk_rows)
            if len(chunks) != want:
                raise ValueError(
                    f"{_region_name(layer, kv, b)} has {len(chunks)} checksums for "
                    f"{int(lengths[b])} rows of {chunk_rows}-row chunks ({want})"
                )
    except ValueError as e:
        raise MissingManifestError(
            f"cannot use manifest {path}: {e}. Pass overwrite=True to discard the cache."
        ) from e
    return {
        "commit": int(commit),
        "session": manifest.get("session"),
        "lengths": lengths.astype(np.int64),
        "block_tables": tables.astype(np.int32),
        "capacity": capacity.astype(np.int32),
        "chunk_rows": int(chunk_rows),
        "sums": sums,
        "root": index["root"],
        "shared": index["shared"].astype(np.int32),
        "entries": entries,
    }


def _checked_prefix(raw: Any, held: Geometry) -> dict[str, Any]:
    """The manifest's prefix index, checked (raises ValueError naming what is wrong).

    ``raw`` None (a version 1 manifest): an empty index. Each entry's key is 16 bytes (hex),
    its parent null, an indexed key or one of ``foreign_roots``, its tokens
    ``block_tokens`` ints, its block an id in ``[0, num_blocks)`` indexed once, its
    checksums one hex digest per (layer, K|V); and its key is the chained digest of its
    parent (the root for null) and its tokens, so a token or parent changed since the
    commit is caught here.
    """
    batch, t = held.batch, held.block_tokens
    if raw is None:
        return dict(root=None, shared=np.zeros(batch, np.int64), entries=[])
    if not isinstance(raw, dict):
        raise ValueError(f"prefix is {type(raw).__name__}, not an object")
    root = _hex_digest(raw.get("root"), "prefix.root")
    if raw.get("checksum") != CHECKSUM_ALGORITHM:
        raise ValueError(f"prefix.checksum is {raw.get('checksum')!r}, not {CHECKSUM_ALGORITHM!r}")
    foreign_raw = raw.get("foreign_roots")
    if not isinstance(foreign_raw, list):
        raise ValueError(f"prefix.foreign_roots is {foreign_raw!r}, not a list")
    foreign = {_hex_digest(r, f"prefix.foreign_roots[{i}]") for i, r in enumerate(foreign_raw)}
    shared = _int_array(raw.get("shared"), (batch,), "prefix.shared")
    recorded = raw.get("entries")
    if not isinstance(recorded, list):
        raise ValueError(f"prefix.entries is {type(recorded).__name__}, not a list")
    entries: list[dict[str, Any]] = []
    keys: dict[bytes, int] = {}
    blocks: dict[int, int] = {}
    for i, e in enumerate(recorded):
        where = f"prefix.entries[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where} is {type(e).__name__}, not an object")
        key = _hex_digest(e.get("key"), f"{where}.key")
        parent = e.get("parent")
        parent = None if parent is None else _hex_digest(parent, f"{where}.parent")
        tokens = _int_array(e.get("tokens"), (t,), f"{where}.tokens")
        block = e.get("block")
        if not _is_json_int(block) or not 0 <= block < held.num_blocks:
            raise ValueError(
                f"{where}.block = {block!r} is not a block id in [0, num_blocks="
                f"{held.num_blocks})"
            )
        if block in blocks:
            raise ValueError(
                f"block {block} is indexed twice (prefix.entries[{blocks[block]}] and {where})"
            )
        if key in keys:
            raise ValueError(f"{where}.key is also prefix.entries[{keys[key]}]'s")
        try:
            sums = [
                int(e["checksums"][layer][kv], 16)
                for layer in range(held.num_layers)
                for kv in range(2)
            ]
            if len(e["checksums"]) != held.num_layers or any(len(x) != 2 for x in e["checksums"]):
                raise ValueError("wrong shape")
        except (TypeError, ValueError, IndexError, KeyError) as err:
            raise ValueError(
                f"{where}.checksums are not [layer][K|V] hex digests ({err})"
            ) from err
        keys[key] = i
        blocks[block] = i
        entries.append(dict(key=key, parent=parent, tokens=tokens, block=block, sums=sums))
    for i, e in enumerate(entries):
        where = f"prefix.entries[{i}]"
        parent = e["parent"]
        if parent is not None and parent not in keys and parent not in foreign:
            raise ValueError(
                f"{where}.parent {parent.hex()} is neither an indexed key nor a root in "
                "prefix.foreign_roots (a block's parent is indexed as long as it is)"
            )
        if prefix._chain(root if parent is None else parent, e["tokens"]) != e["key"]:
            raise ValueError(
                f"{where}.key does not match its parent and tokens (the xxh3-128 digest of "
                f"the parent's key, or the root, and the block's token ids): block "
                f"{e['block']}'s tokens or parent changed since the commit"
            )
    return dict(root=root, shared=shared, entries=entries)


def _check_shared_block(
    b: int,
    i: int,
    row: np.ndarray,
    entries: list[dict[str, Any]],
    by_block: dict[int, int],
    keys: set[bytes],
) -> None:
    """Table entry ``i`` of sequence ``b`` lies in its shared prefix: it must be an indexed
    block, a first block for ``i = 0``, else the child of entry ``i - 1``'s (checked
    before it)."""
    p = int(row[i])
    if p < 0:
        raise ValueError(
            f"sequence {b}'s shared prefix covers table entry {i}, which holds no block"
        )
    if p not in by_block:
        raise ValueError(
            f"sequence {b} maps block {p} (table entry {i}) as shared, but no prefix entry "
            "indexes it"
        )
    parent = entries[by_block[p]]["parent"]
    if i == 0:
        if parent is not None and parent in keys:
            raise ValueError(
                f"sequence {b}'s shared prefix starts at block {p}, which is not the first "
                "block of a chain"
            )
    elif parent != entries[by_block[int(row[i - 1])]]["key"]:
        raise ValueError(
            f"sequence {b}'s shared prefix is not one chain: block {p} (table entry {i}) is "
            f"not the child of block {int(row[i - 1])} (table entry {i - 1})"
        )


def _hex_digest(value: Any, name: str) -> bytes:
    """A 16-byte digest from 32 hex digits; raises ValueError naming ``name``."""
    try:
        if not isinstance(value, str) or len(value) != 32:
            raise ValueError
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{name} is {value!r}, not a 128-bit digest (32 hex digits)") from None


def _is_json_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_array(value: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    """``value`` (nested lists of ints) as an int64 array of ``shape``; raises ValueError."""

    def check(v: Any, depth: int, where: str) -> None:
        if depth == len(shape):
            if not _is_json_int(v) or not -(2**62) <= v < 2**62:
                raise ValueError(f"{name}{where} is {v!r}, not an int (of 63 bits)")
            return
        if not isinstance(v, list) or len(v) != shape[depth]:
            got = len(v) if isinstance(v, list) else type(v).__name__
            raise ValueError(
                f"{name} must have shape {list(shape)}; {name}{where} has {got} entries, not "
                f"{shape[depth]}"
            )
        for i, x in enumerate(v):
            check(x, depth + 1, f"{where}[{i}]")

    check(value, 0, "")
    return np.asarray(value, np.int64).reshape(shape)


def write_json_atomically(path: Path, obj: Any) -> None:
    """Replaces ``path`` by ``obj`` as JSON so that a crash leaves the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory is.
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
