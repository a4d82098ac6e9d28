"""Checksums of a persisted cache's committed KV: xxh3-64 per chunk of rows, per indexed block.

A chunk is a run of up to ``chunk_rows`` positions of one logical (layer, K|V, sequence)
region, read through the sequence's block table (the KV is paged, see
:mod:`jax_tpusync.core.blocks`: consecutive positions may live in blocks anywhere in the layer's
region); chunk ``c`` covers positions ``[c * chunk_rows, min((c + 1) * chunk_rows, length))``,
so the last chunk of a sequence may be partial and grows as decode appends. A block of the
prefix index is hashed whole, once per (layer, K|V).

:class:`Checksums` owns the committed chunk checksums of one cache, the partial last chunks'
hashers (so that a commit hashes only the appended rows) and the chunks ``load()`` rewrote
since the last commit; it reads the tier with the cache's engine, a batch while the previous
one is hashed (through a :class:`~jax_tpusync.persist.persisted_kv.TierReader`, not the cache).
When a commit hashes, what it records and when its checksums become the
committed ones is :mod:`jax_tpusync.persist.commit`'s protocol; what the manifest holds is
:mod:`jax_tpusync.persist.manifest`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from jax_tpusync.core import prefix
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.persist.manifest import ChecksumMismatchError, region_name, region_of
from jax_tpusync.persist.persisted_kv import TierReader

__all__ = ["Checksums", "ChunkUpdate", "VerifyResult"]

# A hasher fed the rows [lo, hi) of a region: (region, lo, hi, hasher).
_RowWork = tuple[int, int, int, Any]
# A region's partial last chunk: (chunk, rows hashed, hasher).
_Tail = tuple[int, int, Any]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What :meth:`Persistence.verify <jax_tpusync.persist.commit.Persistence.verify>` checked."""

    chunks: int
    bytes: int
    seconds: float
    skipped_chunks: int  # rewritten by load() since the last commit: no checksum yet
    prefix_blocks: int = 0  # indexed prefix blocks checked (every layer, K and V)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class ChunkUpdate:
    """The chunk checksums of a commit being made (:meth:`Checksums.updated`): ``sums`` go
    into its manifest; :meth:`Checksums.adopt` makes them the committed ones once that
    manifest is in place."""

    sums: list[list[int]]
    tails: dict[int, _Tail]


class Checksums:
    """The committed chunk checksums of one cache, and the reads that compute them.

    ``spec`` is the cache's layout, ``reader`` reads its tier; ``read_batch_bytes`` is
    asked at each read for the bytes one engine request reads. Not thread-safe.
    """

    def __init__(
        self,
        spec: CacheSpec,
        reader: TierReader,
        *,
        chunk_rows: int,
        sums: list[list[int]],
        read_batch_bytes: Callable[[], int],
    ):
        self._spec = spec
        self._reader = reader
        self._chunk_rows = chunk_rows
        self._read_batch_bytes = read_batch_bytes
        # Per logical region (layer * 2 + kv) * batch + b: checksums of its committed chunks.
        self._sums = sums
        # Per region: its partial last chunk, so that the next commit hashes only the
        # appended rows. Lost on restart (rebuilt by verify).
        self._tails: dict[int, _Tail] = {}
        # Per region: chunks that load() rewrote since the last commit.
        self._stale: dict[int, set[int]] = {}

    @classmethod
    def empty(
        cls,
        spec: CacheSpec,
        reader: TierReader,
        *,
        chunk_target_bytes: int,
        read_batch_bytes: Callable[[], int],
    ) -> Checksums:
        """Nothing committed yet; chunks of about ``chunk_target_bytes`` (at least a row,
        at most a sequence)."""
        chunk_rows = max(1, min(spec.max_len, chunk_target_bytes // spec.row_bytes))
        n = spec.num_layers * 2 * spec.batch
        sums: list[list[int]] = [[] for _ in range(n)]
        return cls(
            spec, reader, chunk_rows=chunk_rows, sums=sums, read_batch_bytes=read_batch_bytes
        )

    @property
    def chunk_rows(self) -> int:
        return self._chunk_rows

    @property
    def sums(self) -> list[list[int]]:
        """The committed checksums per region (the manifest's ``sums``; read only)."""
        return self._sums

    @property
    def num_regions(self) -> int:
        """Logical (layer, K|V, sequence) regions, each with its own chunks."""
        return self._spec.num_layers * 2 * self._spec.batch

    def mark_rewritten(self, layer: int, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[b], starts[b] + counts[b])`` of ``layer`` (K and V) are being
        rewritten: their chunks get a new checksum at the next commit, and are skipped by
        :meth:`verify` until then."""
        spec = self._spec
        rr = self._chunk_rows
        for kv in range(2):
            for b in range(spec.batch):
                s, n = int(starts[b]), int(counts[b])
                if n <= 0:
                    continue
                region = (layer * 2 + kv) * spec.batch + b
                chunks = range(s // rr, (s + n - 1) // rr + 1)
                self._stale.setdefault(region, set()).update(chunks)

    def updated(
        self,
        old_lengths: np.ndarray,
        old_tables: np.ndarray,
        lengths: np.ndarray,
        tables: np.ndarray,
    ) -> ChunkUpdate:
        """New per-chunk checksums for ``lengths`` (rows in the blocks of ``tables``), from
        the committed ones (``old_lengths`` in ``old_tables``); hashes only chunks that
        changed. Changes nothing here until :meth:`adopt`."""
        spec = self._spec
        rr = self._chunk_rows
        sums = [list(s) for s in self._sums]
        tails: dict[int, _Tail] = {}
        work: list[_RowWork] = []
        finish: list[tuple[int, int, Any, int]] = []  # (region, chunk, hasher, rows)
        old_lengths = np.array(old_lengths, np.int64)
        for b in range(spec.batch):
            # Rows kept from the last commit must still be in the blocks it named; a
            # sequence whose blocks moved is hashed afresh.
            kept_blocks = -(-int(min(old_lengths[b], lengths[b])) // spec.block_tokens)
            if not np.array_equal(old_tables[b, :kept_blocks], tables[b, :kept_blocks]):
                old_lengths[b] = 0
        for region in range(self.num_regions):
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
        return ChunkUpdate(sums=sums, tails=tails)

    def adopt(self, update: ChunkUpdate) -> None:
        """``update``'s commit is in place: its checksums are the committed ones (and no
        chunk is rewritten since)."""
        self._sums, self._tails = update.sums, update.tails
        self._stale.clear()

    def hash_blocks(self, entries: Sequence[prefix.Entry]) -> None:
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

    def verify(
        self,
        lengths: np.ndarray,
        entries: Sequence[prefix.Entry],
        *,
        data_path: Path,
        commit: int,
    ) -> VerifyResult:
        """Re-reads every chunk below ``lengths`` and the block of every entry of
        ``entries`` (commit number ``commit`` of ``data_path``, both named in errors), and
        compares them with their checksums. Chunks marked rewritten are skipped.

        Raises:
          ChecksumMismatchError: naming the first entry's block that differs (layer, K|V,
            physical block), else the first chunk (layer, K|V, sequence, rows), with the
            number of others.
        """
        spec = self._spec
        rr = self._chunk_rows
        t0 = time.perf_counter()
        work: list[_RowWork] = []
        checks = []
        skipped = 0
        for region in range(self.num_regions):
            b = region % spec.batch
            n = int(lengths[b])
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
        entries = list(entries)
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
                f"committed KV is corrupt in {data_path}: layer {layer} {'KV'[kv]} "
                f"prefix block {e.block} (indexed, shared between sequences) does not match "
                f"commit {commit}'s checksum{more}. Pass overwrite=True to discard the "
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
            layer, kv, b = region_of(region, spec.batch)
            more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
            raise ChecksumMismatchError(
                f"committed KV is corrupt in {data_path}: {region_name(layer, kv, b)}, "
                f"rows [{lo}, {hi}) do not match commit {commit}'s checksum{more}. "
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

    def _hash_rows(self, work: Iterable[_RowWork]) -> int:
        """Feeds positions [lo, hi) of each logical region to its hasher, reading them
        through the sequence's block table (the cache's) with the engine; returns the
        bytes hashed."""
        spec = self._spec
        spans = []
        for region, lo, hi, hasher in work:
            if hi <= lo:
                continue
            layer, kv, b = region_of(region, spec.batch)
            spans.append((self._reader.rows(layer, kv, b, lo, hi), hasher))
        return self._hash_spans(spans)

    def _block_spans(self, block: int, hashers: Sequence[Any]) -> list[tuple[list, Any]]:
        """Work for :meth:`_hash_spans`: physical ``block`` in each (layer, K|V), fed to
        ``hashers[layer * 2 + kv]``."""
        spec = self._spec
        first = self._reader.first_block
        return [
            (
                [((first + region * spec.num_blocks + block) * spec.block_bytes, spec.block_bytes)],
                hashers[region],
            )
            for region in range(2 * spec.num_layers)
        ]

    def _hash_spans(self, work: Sequence[tuple[list[tuple[int, int]], Any]]) -> int:
        """Feeds each item's tier byte runs ``[(offset, bytes), ...]``, in order, to its
        hasher, reading them with the engine.

        Reads go in batches of up to ``read_batch_bytes()`` into two alternating buffers:
        the next batch is read while this one is hashed. Returns the bytes hashed.
        """
        reader = self._reader
        engine = reader.engine
        limit = self._read_batch_bytes()
        batches: list[list[tuple[list[tuple[int, int]], int, Any]]] = []
        size = 0
        for runs, hasher in work:
            n = sum(m for _, m in runs)
            if n <= 0:
                continue
            if not batches or size + n > limit:
                batches.append([])
                size = 0
            batches[-1].append((runs, n, hasher))
            size += n
        if not batches:
            return 0
        biggest = max(sum(n for _, n, _ in batch) for batch in batches)
        phase = engine.tier_info(reader.tier).alignment_offset
        buffers = [_phased_buffer(biggest, phase) for _ in range(min(2, len(batches)))]

        def submit(i: int) -> int:
            segments, mem = [], 0
            for runs, _, _ in batches[i]:
                for offset, n in runs:
                    segments.append((offset, mem, n))
                    mem += n
            return engine.submit_read(reader.tier, segments, buffers[i % 2])

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
                except Exception:  # noqa: BLE001, S110 - the first error is the one raised.
                    pass
        return total


def _phased_buffer(nbytes: int, phase: int) -> np.ndarray:
    """A uint8 buffer starting ``phase`` bytes past a page: in the file tier's phase, so
    O_DIRECT reads land in it directly instead of through a bounce buffer and a copy."""
    raw = np.empty(nbytes + 8192, np.uint8)
    start = (phase - raw.ctypes.data) % 4096
    return raw[start : start + nbytes]
