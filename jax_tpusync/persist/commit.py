"""Crash-consistent persistence of an offloaded KV cache: the commit protocol.

A cache on a persistent tier (``shm_name=`` or ``file_name=``) keeps a *manifest* beside its
data:

* file tier: ``<directory>/<file_name>.tpusync.manifest.json`` (the data is
  ``<directory>/<file_name>.tpusync``);
* shm tier: ``/dev/shm/<shm_name>.tpusync.manifest.json`` (the data is the segment
  ``/dev/shm/<shm_name>``), so the manifest lives and dies with the segment (a reboot
  clears both).

The manifest records the cache's geometry, its ``model_id``, a commit number, the committed
length, block table row and capacity of every sequence (batch slot), and an xxh3-64
checksum per *chunk* of committed rows (a run of up to ``chunk_rows`` positions of one
logical (layer, K|V, sequence) region, read through the sequence's block table: see
:mod:`jax_tpusync.persist.checksums`, which computes and checks them). A re-attached cache restores
the tables and capacities (its slots hold the same blocks, which the allocator no longer
hands out) with the lengths.

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

Prefix index (:mod:`jax_tpusync.core.prefix`). Each commit also records the cache's prefix index
(``"prefix"``): its root digest, every entry (key, parent key, token ids, physical block, and
an xxh3-64 checksum of the block's bytes in every layer and K|V) with the cached ones in
eviction order, and per sequence how many leading blocks of its table are shared (mapped
from the index, read-only). A block is indexed only after the write-backs of the sequence
that wrote it have completed, and it is hashed by the first commit that records it, after
that commit made the data durable, so a manifest indexes only durable blocks; indexed
blocks are never written. Before a block the last commit indexes is handed out again (an
eviction freed it), :meth:`Persistence.note_evicted` writes that commit again without the
evicted entries (nothing else changes, so nothing is drained, synced or hashed): it cannot
wait for the next commit, since the block's new sequence overwrites it asynchronously and a
crash before that commit would re-attach an entry whose block holds other KV. A
re-attached cache restores the entries (reference counts: the sequences that map each
block; the unpinned ones cached, least recently used first as recorded), and with
``verify`` checks every indexed block against its checksums. Entries chained from another
root (a cache of another ``prefix_salt``) are never looked up: the unmapped ones are
dropped on re-attach, the mapped ones stay until their sequences release them.

The protocol sees the cache only through a :class:`~jax_tpusync.persist.persisted_kv.PersistedKV`
(its layout, tier reads, drain, the slot table's tables, capacities and shared prefixes, the
prefix index, the token history, and the slot table's ``restore``), never the cache object.

What a manifest holds, and how one is read and checked, is :mod:`jax_tpusync.persist.manifest`;
the checksums of rows and blocks are :mod:`jax_tpusync.persist.checksums`; this module is the
protocol that writes the manifest. Errors are :class:`PersistenceError`, a
subclass of :class:`jax_tpusync.TpusyncError` (defined there, and importable from here).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_tpusync.core import prefix
from jax_tpusync.core.blocks import NO_BLOCK
from jax_tpusync.persist.checksums import Checksums, VerifyResult
from jax_tpusync.persist.manifest import (
    CHECKSUM_ALGORITHM,
    LAYOUT_VERSION,
    MANIFEST_FORMAT,
    MANIFEST_SUFFIX,
    MANIFEST_VERSION,
    READABLE_MANIFEST_VERSIONS,
    SHM_DIRECTORY,
    UNSPECIFIED_MODEL,
    ChecksumMismatchError,
    CommitError,
    Geometry,
    LayoutMismatchError,
    MissingManifestError,
    PersistenceError,
    checked_commit,
    entry_json,
    manifest_json,
    prefix_section,
    read_manifest,
    tier_paths,
    write_json_atomically,
)
from jax_tpusync.persist.persisted_kv import PersistedKV
from jax_tpusync.runtime.engine import Engine

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHUNK_TARGET_BYTES",
    "LAYOUT_VERSION",
    "MANIFEST_FORMAT",
    "MANIFEST_SUFFIX",
    "MANIFEST_VERSION",
    "READABLE_MANIFEST_VERSIONS",
    "READ_BATCH_BYTES",
    "SHM_DIRECTORY",
    "UNSPECIFIED_MODEL",
    "ChecksumMismatchError",
    "CommitError",
    "Geometry",
    "LayoutMismatchError",
    "MissingManifestError",
    "Persistence",
    "PersistenceError",
    "VerifyResult",
    "fault_hook",
    "read_manifest",
    "write_json_atomically",
]

# A chunk of about 4 MiB keeps the manifest small (a 1 GiB region is 256 checksums) while a
# flipped bit is still located to a few thousand rows.
CHUNK_TARGET_BYTES = 4 << 20
# Bytes read per engine request while hashing; two such buffers alternate, so the disk reads
# one while the CPU hashes the other. Both are read when used (a test may set them).
READ_BATCH_BYTES = 32 << 20

# Test hook: called with a stage name ("before_manifest_write") during a commit; a hook that
# raises simulates a crash or failure at that point.
fault_hook: Callable[[str], None] | None = None


def _read_batch_bytes() -> int:
    return READ_BATCH_BYTES


class Persistence:
    """The manifest and commits of one cache on a persistent tier (its checksums: a
    :class:`~jax_tpusync.persist.checksums.Checksums`).

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
        # The committed chunk checksums (and the rows rewritten since): set by attach().
        self._held_checksums: Checksums | None = None
        # The committed prefix index: per sequence its shared (indexed) leading blocks, the
        # manifest's "prefix" section, and the entries it records (the index's own objects:
        # one that is no longer the index's was evicted since).
        self._shared = np.zeros(geometry.batch, np.int32)
        self._prefix_json: dict[str, Any] = {}
        self._tokens_json: list[str] | None = None  # The committed token ids per slot.
        self._committed_entries: dict[bytes, prefix.Entry] = {}
        self._evictions_seen = 0  # The index's eviction count when that was last checked.
        self._entry_json: dict[bytes, tuple[prefix.Entry, dict[str, Any]]] = {}
        # What the protocol reads and writes of the cache: set by attach().
        self._attached_kv: PersistedKV | None = None

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def prepare_for(cls, config: Any) -> Persistence | None:
        """:meth:`prepare` of a :class:`~jax_tpusync.core.config.CacheConfig`'s tier and
        geometry (None: not a persistent tier)."""
        tier = config.tier
        return cls.prepare(
            tier=tier.kind,
            path=getattr(tier, "path", None),
            shm_name=tier.shm_name if tier.kind == "host" else None,
            file_name=getattr(tier, "file_name", None),
            geometry=Geometry.of_kv(config.geometry, config.persistence.model_id),
            overwrite=config.persistence.overwrite,
        )

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
        paths = tier_paths(tier, path, shm_name, file_name)
        if paths is None:
            return None
        data_path, manifest_path = paths

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
            restored = checked_commit(restored, held, manifest_path)
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

    def attach(self, kv: PersistedKV, *, attached: bool, verify: bool) -> np.ndarray | None:
        """Binds to the opened cache (``kv``: what of it the protocol reads and writes);
        returns the restored lengths (None: a new cache).

        A new cache writes its first manifest (commit 0, lengths 0, no slot active). A
        re-attached one restores the last commit (its slots hold the committed blocks,
        capacities and shared prefixes again, its prefix index the committed entries:
        ``kv.restore``), verifies its checksums (rows and indexed blocks) if
        ``verify``, and records that a session is open (so the next one can tell whether
        this one committed at the end).
        """
        self._attached_kv = kv
        spec = kv.spec
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
            self._held_checksums = Checksums.empty(
                spec,
                kv.reader,
                chunk_target_bytes=CHUNK_TARGET_BYTES,
                read_batch_bytes=_read_batch_bytes,
            )
            self._tables = kv.block_tables()
            self._capacity = kv.capacity()
            self._shared = kv.shared()
            self._prefix_json = self._prefix_section([], self._shared)
            self._tokens_json = kv.history.to_json(self._lengths)
            self._write_manifest(session="open")
            logger.info("new persistent KV cache; manifest %s", self.manifest_path)
            return None

        self._commit = manifest["commit"]
        self._lengths = manifest["lengths"]
        self._tables = manifest["block_tables"]
        self._capacity = manifest["capacity"]
        self._held_checksums = Checksums(
            spec,
            kv.reader,
            chunk_rows=manifest["chunk_rows"],
            sums=manifest["sums"],
            read_batch_bytes=_read_batch_bytes,
        )
        self._shared = manifest["shared"]
        entries = self._restored_entries(manifest, kv.index.root)
        # The slots hold their committed blocks again, the index its blocks (the ones a
        # slot maps pinned); later admits get other ones.
        kv.restore(self._tables, self._capacity, self._shared, entries)
        for b, ids in enumerate(manifest["tokens"]):
            kv.history.set(b, ids)
        self._tokens_json = kv.history.to_json(self._lengths)
        self._committed_entries = {e.key: e for e in entries}
        self._prefix_json = self._prefix_section(kv.index.entries_in_order(), self._shared)
        if manifest["session"] == "open":
            logger.warning(
                "%s: the previous session ended without a final commit (a crash, a failed "
                "write-back, or close() without a state); restored commit %d, which ends "
                "at %s. Rows written past those since, if any, were not committed and are "
                "not used (none are lost if the session stopped right after that commit)",
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
                "verified %d chunks and %d prefix blocks (%.1f MiB) of committed KV at %.2f GB/s",
                result.chunks,
                result.prefix_blocks,
                result.bytes / 2**20,
                result.gb_per_s,
            )
        # Also drops from the manifest entries of another root that were not restored
        # (their blocks are free now), before any of those blocks can be handed out.
        self._write_manifest(session="open")
        return self._lengths.astype(np.int32)

    def _restored_entries(self, manifest: dict[str, Any], root: bytes) -> list[prefix.Entry]:
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
                prefix.Entry(e["key"], parent, e["tokens"], e["block"], refs=count, sums=e["sums"])
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

    def note_rows_written(self, layer: int, starts: np.ndarray, counts: np.ndarray) -> None:
        """Call before a host-side write (``load``) of rows ``[starts[b], starts[b] +
        counts[b])``: if it rewrites committed rows, commits each such sequence shortened
        to its first rewritten row first (a crash before the next commit then re-attaches
        to KV the checksums still cover), and marks the touched chunks for a new checksum."""
        starts = np.asarray(starts, np.int64)
        rewrites = (np.asarray(counts) > 0) & (starts < self._lengths)
        if rewrites.any():
            shortened = np.where(rewrites, starts, self._lengths)
            logger.info(
                "load() rewrites committed rows: committing lengths %s first", shortened.tolist()
            )
            self._kv.drain()
            self.commit(shortened)
        self._checksums.mark_rewritten(layer, starts, counts)

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
            self._kv.drain()
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
        kv = self._kv
        lengths = self._lengths.copy()
        lengths[slot] = 0
        tables = kv.block_tables()
        tables[slot] = NO_BLOCK
        capacity = kv.capacity()
        capacity[slot] = 0
        shared = kv.shared()
        shared[slot] = 0
        logger.info("releasing sequence %d: committing it released first", slot)
        kv.drain()
        self.commit(lengths, tables=tables, capacity=capacity, shared=shared)

    def note_evicted(self) -> None:
        """Call before the cache hands out free blocks: if an eviction since the last
        commit freed a block that commit indexes, writes that commit again without the
        entries the index no longer holds, so that no manifest indexes a block another
        sequence may be given and overwrite.

        The rewritten commit (the next commit number) keeps the last one's lengths, block
        tables, capacities, shared prefixes, token ids and chunk checksums: it records
        nothing that was not durable at that commit, so nothing is drained, synced or
        hashed, and the slot table that is allocating is not read. Only the prefix index
        is asked which committed entries it still holds.

        Why before the blocks are handed out, and not at the next commit: once handed
        out, a block is overwritten by a step's write-backs, which land on the tier
        asynchronously and cannot be ordered after a later commit. A crash between such
        a write and the next commit would re-attach to a manifest that still indexes the
        block under the evicted prefix's tokens: with ``verify=False`` a new sequence with
        that prompt would map another sequence's KV (stale KV served); with ``verify`` the
        whole re-attach would be refused by a checksum mismatch. Holding evicted blocks
        back until the next commit would refuse (or stall) the admission that needed
        them, and checking every indexed block on each re-attach is the read that
        ``verify=False`` exists to skip; so this one manifest write stays, made as small
        as the rule needs.

        Raises:
          CommitError: the manifest was not written; the blocks must not be handed out
            (the next call tries again).
        """
        index = self._kv.index
        evictions = index.evictions
        if evictions == self._evictions_seen:
            return
        kept = [e for e in self._committed_entries.values() if index.holds(e)]
        if len(kept) == len(self._committed_entries):
            self._evictions_seen = evictions
            return
        logger.info(
            "evicted %d prefix blocks that commit %d indexes: writing it again without them",
            len(self._committed_entries) - len(kept),
            self._commit,
        )
        prefix_json = self._prefix_section(kept, self._shared)
        try:
            if fault_hook is not None:
                fault_hook("before_manifest_write")
            self._write_manifest(session="open", commit=self._commit + 1, prefix_json=prefix_json)
        except Exception as e:
            raise CommitError(
                f"commit {self._commit + 1} (commit {self._commit} without its evicted prefix "
                f"blocks) was not written; the evicted blocks stay unused: {e}"
            ) from e
        self._commit += 1
        self._prefix_json = prefix_json
        self._committed_entries = {e.key: e for e in kept}
        self._evictions_seen = evictions

    @property
    def _kv(self) -> PersistedKV:
        assert self._attached_kv is not None, "attach() first"
        return self._attached_kv

    @property
    def _spec(self) -> Any:
        return self._kv.spec

    @property
    def _checksums(self) -> Checksums:
        assert self._held_checksums is not None, "attach() first"
        return self._held_checksums

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
        kv = self._kv
        lengths = np.asarray(lengths, np.int64).reshape(spec.batch)
        tables = kv.block_tables() if tables is None else np.array(tables, np.int32)
        capacity = kv.capacity() if capacity is None else np.array(capacity, np.int32)
        shared = kv.shared() if shared is None else np.array(shared, np.int32)
        lengths = np.maximum(lengths, shared.astype(np.int64) * spec.block_tokens)
        index = kv.index
        try:
            for b in range(spec.batch):
                if not 0 <= lengths[b] <= capacity[b]:
                    raise ValueError(
                        f"sequence {b}'s length {int(lengths[b])} is not in [0, "
                        f"{int(capacity[b])}] (its capacity)"
                    )
            self._sync_data()
            update = self._checksums.updated(self._lengths, self._tables, lengths, tables)
            entries = index.entries_in_order()
            evictions = index.evictions
            # Blocks indexed since the last commit: durable now (synced above), hashed once.
            self._hash_blocks([e for e in entries if e.sums is None])
            prefix_json = self._prefix_section(entries, shared)
            tokens_json = kv.history.to_json(lengths)
            if fault_hook is not None:
                fault_hook("before_manifest_write")
            self._write_manifest(
                session=session,
                commit=self._commit + 1,
                lengths=lengths,
                sums=update.sums,
                tables=tables,
                capacity=capacity,
                prefix_json=prefix_json,
                tokens_json=tokens_json,
            )
        except Exception as e:
            raise self._not_written(e) from e
        self._commit += 1
        self._lengths = lengths
        self._tables, self._capacity = tables, capacity
        self._checksums.adopt(update)
        self._shared = shared
        self._prefix_json = prefix_json
        self._tokens_json = tokens_json
        self._committed_entries = {e.key: e for e in entries}
        self._evictions_seen = evictions
        return self._commit

    def commit_after(
        self, flush: Callable[[], object], lengths: Sequence[int] | np.ndarray, *, session: str
    ) -> int:
        """:meth:`commit` once ``flush()`` has brought the rows to the tier (drained the
        engine's write-backs, written a pool's blocks); returns the commit number.

        Raises:
          CommitError: ``flush`` failed (naming the commit the tier keeps), or the commit.
        """
        try:
            flush()
        except Exception as e:
            raise self._not_written(e) from e
        return self.commit(lengths, session=session)

    def _not_written(self, e: Exception) -> CommitError:
        """The error of a commit that was not written, naming the one the tier keeps."""
        return CommitError(
            f"commit {self._commit + 1} was not written (the tier keeps commit "
            f"{self._commit}, lengths {self._lengths.tolist()}): {e}"
        )

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
        tables = self._kv.block_tables()
        for b in range(spec.batch):
            used = -(-int(self._lengths[b]) // spec.block_tokens)
            if not np.array_equal(tables[b, :used], self._tables[b, :used]):
                raise PersistenceError(
                    f"sequence {b} no longer holds the KV blocks commit {self._commit} "
                    f"recorded (it holds {tables[b, :used].tolist()}, the commit "
                    f"{self._tables[b, :used].tolist()}): it was released or re-admitted "
                    "without a commit, so its committed rows cannot be checked; commit first"
                )
        return self._checksums.verify(
            self._lengths,
            list(self._committed_entries.values()),
            data_path=self.data_path,
            commit=self._commit,
        )

    def _hash_blocks(self, entries: Sequence[prefix.Entry]) -> None:
        """Sets each entry's ``sums``: xxh3-64 of its block in every (layer, K|V)."""
        self._checksums.hash_blocks(entries)

    def _prefix_section(self, entries: Sequence[prefix.Entry], shared: np.ndarray) -> dict:
        """The manifest's "prefix": the index's root, the roots of first blocks chained
        from another one, the block checksum algorithm, each sequence's shared blocks and
        the entries in ``entries``' order (each with its block's checksums)."""
        index = self._kv.index
        keys = {e.key for e in entries}
        foreign = sorted(
            {e.parent for e in entries if e.parent is not None and e.parent not in keys}
        )
        num_layers = self._spec.num_layers
        cache: dict[bytes, tuple[prefix.Entry, dict[str, Any]]] = {}
        out = []
        for e in entries:
            held = self._entry_json.get(e.key)
            if held is None or held[0] is not e:  # Made once per entry (its fields are fixed).
                held = (e, entry_json(e, num_layers))
            cache[e.key] = held
            out.append(held[1])
        self._entry_json = cache
        return prefix_section(index.root, foreign, shared, out)

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
        tokens_json: list[str] | None = None,
    ) -> None:
        now = time.time()
        manifest = manifest_json(
            geometry=self.geometry,
            tier=self.tier_kind,
            data=self.data_path,
            commit=self._commit if commit is None else commit,
            session=session,
            timestamp=now,
            time_text=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
            lengths=self._lengths if lengths is None else lengths,
            tables=self._tables if tables is None else tables,
            capacity=self._capacity if capacity is None else capacity,
            chunk_rows=self._checksums.chunk_rows,
            sums=self._checksums.sums if sums is None else sums,
            prefix_json=self._prefix_json if prefix_json is None else prefix_json,
            tokens=self._tokens_json if tokens_json is None else tokens_json,
        )
        write_json_atomically(self.manifest_path, manifest)


def common_commit(
    capacities: Sequence[np.ndarray],
    lengths: Sequence[np.ndarray],
    shared: Sequence[np.ndarray] | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The commit that parts committing on their own (a slot's head shards, a hybrid
    cache's layer groups) all hold, after a crash between their commits: a slot is active
    only if every part holds it, at the shortest length any part committed (the rows below
    it are committed, and checksummed, in every part). Returns int[batch] of those lengths
    and, per part, bool[batch] of the slots it holds active that must be released.

    ``capacities``, ``lengths``: per part, int[batch] of its slots' capacities and
    committed lengths. ``shared``: per part, int[batch] of the tokens each slot maps
    read-only from the prefix index; a slot whose common length ends inside such a prefix
    is released in every part (a mapped prefix is committed whole, so that part cannot be
    brought below it: a crash between a release's and the next admission's commits can
    leave one part holding the new sequence's prefix and another the old one at 0 rows)."""
    active = np.logical_and.reduce([c > 0 for c in capacities])
    common = np.where(active, np.minimum.reduce(list(lengths)), 0)
    if shared is not None:
        active &= common >= np.maximum.reduce(list(shared))
        common = np.where(active, common, 0)
    return common, [(c > 0) & ~active for c in capacities]


def agree_tokens(histories: Sequence[Any], lengths: np.ndarray) -> list[np.ndarray]:
    """Per slot, the token ids that parts of one cache (see :func:`common_commit`) all
    record for its first ``lengths[b]`` positions: each part's ids cut at the common
    length, then at the first position where two parts differ (ids past the common commit
    are not the KV's: a slot published under them would index blocks under other tokens).
    ``histories``: per part, its :class:`~jax_tpusync.core.history.TokenHistory`."""
    out = []
    for b, n in enumerate(np.asarray(lengths).tolist()):
        ids = [h.ids(b, int(n)) for h in histories]
        agreed = min(len(i) for i in ids)
        for other in ids[1:]:
            differ = np.flatnonzero(other[:agreed] != ids[0][:agreed])
            if len(differ):
                agreed = int(differ[0])
        out.append(ids[0][:agreed])
    return out
