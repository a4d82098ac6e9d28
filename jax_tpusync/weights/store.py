"""A weight store in a directory that publishers and pullers share on one host (``/dev/shm``
for memory speed, or any local or shared file system): one subdirectory per version, one
data file and one part manifest per publishing process.

Layout of ``<directory>/v<version, 12 digits>/``:

* ``part-<p>-of-<n>.bin``: process ``p``'s unique shards (of ``n`` publishing processes),
  raw bytes in C order, each starting at a 64-byte aligned offset;
* ``part-<p>-of-<n>.json``: its manifest: every leaf's path, shape and dtype, and for each
  shard this process wrote, its index box, where its bytes lie and the xxh3-64 of each
  ``chunk_bytes`` (:data:`CHUNK_BYTES`) of them.

Each file is written under a temporary name and renamed into place (``os.replace``), the
manifest after its data, so a manifest that can be read names bytes that are all there.
A version is *complete* when the manifests of all ``n`` processes are present; a puller
reads only complete versions, so it never sees a mix of two versions, and a version a
killed publisher left without some process's manifest is refused by name
(:class:`IncompleteVersionError`). Versions are immutable once written: publishing a
process's part of a version twice is refused.

Every byte a read hands out is first checked against its chunks' checksums (each chunk
once per opened version): a version whose bytes changed after they were written is refused
by name (:class:`DamagedVersionError`, naming the version, the data file and the byte
range), and a puller asking for ``"latest"`` falls back to the newest intact version. A
manifest written before checksums were recorded (no ``chunk_bytes``) is still read, its
bytes unchecked, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

import numpy as np
import xxhash

from jax_tpusync.runtime.host_copy import DEFAULT_COPY_THREADS, copy_arrays
from jax_tpusync.weights.file_pool import (
    FilePool,
    FileRetiredError,
    MappingCache,
    WriteMappings,
)
from jax_tpusync.weights.plan import Box, box_volume, layout_fingerprint
from jax_tpusync.weights.records import (  # The store interface; imported from here too.
    DamagedVersionError,
    IncompleteVersionError,
    StoredLeaf,
    StoredShard,
    VersionManifest,
    VersionNotFoundError,
    WeightStoreBackend,
    WeightSyncError,
    checked_shards,
    chunk_checksums,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ALIGNMENT = 64  # Each shard's bytes start at a multiple of this in its data file.
_VERSION_DIR = re.compile(r"^v(\d{12})$")
_PART_MANIFEST = re.compile(r"^part-(\d{5})-of-(\d{5})\.json$")
_VERSION_FIELD = re.compile(rb'"version": (\d+)')  # The first: the part's own (json.dump order).
_CHUNKS_FIELD = b', "chunks": '  # The last field of a part manifest (json.dumps order).
MAX_PROCESSES = 10**5 - 1
CHUNK_BYTES = 1 << 20  # The checksummed unit of a shard's bytes in the directory store.




class PartWriter:
    """Writes one process's part of a version: :meth:`add` each leaf, then :meth:`commit`
    (the manifest goes in last) or :meth:`abort` (nothing of this part stays).

    Shards added into a reused file's mapping are copied together, over the store's
    ``copy_threads`` threads with streaming stores (:mod:`jax_tpusync.runtime.host_copy`), by
    :meth:`flush` or :meth:`commit`: until then the arrays given to :meth:`add` must stay
    unchanged (the writer holds references to them)."""

    def __init__(
        self,
        store: WeightStore,
        version: int,
        process: int,
        num_processes: int,
        *,
        fsync: bool = False,
    ):
        self.version = version
        self.process = process
        self.num_processes = num_processes
        self.fsync = fsync
        self.directory = store.version_dir(version)
        stem = f"part-{process:05d}-of-{num_processes:05d}"
        self.data_path = self.directory / f"{stem}.bin"
        self.manifest_path = self.directory / f"{stem}.json"
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.manifest_path.exists():
            raise ValueError(
                f"version {version}: process {process} already published its part "
                f"({self.manifest_path}); versions are immutable, publish a new version"
            )
        suffix = f".tmp-{os.getpid()}-{id(self):x}"
        self._data_tmp = self.data_path.with_name(self.data_path.name + suffix)
        self._manifest_tmp = self.manifest_path.with_name(self.manifest_path.name + suffix)
        # A retired version's file, written over (its pages are already there), else a new
        # one. A reused file stays locked (exclusive) until commit or abort closes it.
        taken = store.pool.take(self._data_tmp)
        self.reused_file = taken is not None
        self._mapped: np.ndarray | None = None  # The reused file's bytes, where mapped.
        if taken is not None:
            self._file = os.fdopen(taken[0], "r+b")
            try:
                self._mapped = store.write_mappings.get(self._data_tmp, taken[0])
            except BaseException:
                self._file.close()
                self._data_tmp.unlink(missing_ok=True)
                raise
        else:
            self._file = open(self._data_tmp, "wb")  # noqa: SIM115 - closed by commit/abort.
        self.copy_threads = store.copy_threads
        # (destination in the mapping, source) of the copies add() left to flush().
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._offset = 0
        self._leaves: list[dict] = []
        self._paths: set[str] = set()
        # Per shard record (in order), the xxh3-64 of each CHUNK_BYTES of it, 16 hex digits each.
        self._chunks: list[str] = []
        self.nbytes = 0

    def add(
        self,
        path: str,
        shape: tuple[int, ...],
        dtype: str,
        shards: Sequence[tuple[Box, np.ndarray]],
    ) -> None:
        """Appends a leaf: ``shards`` are this process's unique shards of it as (box, data),
        possibly none (its shards are replicas another process writes)."""
        if path in self._paths:
            raise ValueError(f"leaf {path} added twice to version {self.version}'s part")
        checked = checked_shards(path, dtype, shards)
        self._paths.add(path)
        records = []
        for box, data in checked:
            raw = data.reshape(-1).view(np.uint8)
            pad = -self._offset % ALIGNMENT
            start, end = self._offset, self._offset + pad + raw.nbytes
            if self._mapped is not None and end <= self._mapped.nbytes:
                # Into the reused file's pages (zeros in the gap, as the other way).
                self._mapped[start : start + pad] = 0
                self._pending.append((self._mapped[start + pad : end], raw))
            else:
                self._file.seek(start)
                self._file.write(b"\0" * pad)
                self._file.write(memoryview(raw))
            self._offset += pad
            records.append(
                {
                    "box": [list(r) for r in box],
                    "offset": self._offset,
                    "nbytes": raw.nbytes,
                }
            )
            self._chunks.append("".join(f"{c:016x}" for c in chunk_checksums(raw, CHUNK_BYTES)))
            self._offset += raw.nbytes
            self.nbytes += raw.nbytes
        self._leaves.append({"path": path, "shape": list(shape), "dtype": dtype, "shards": records})

    def flush(self) -> None:
        """Copies the shards :meth:`add` left in the reused file's mapping (the arrays given
        to it may change once this returns)."""
        pending, self._pending = self._pending, []
        if pending:
            copy_arrays(pending, threads=self.copy_threads)

    def commit(self) -> None:
        """Renames the data file into place, then writes the manifest (atomically, last)."""
        self.flush()
        self._file.flush()
        if self._mapped is not None and self.fsync:
            mmap_flush = self._mapped.base  # The mapping: its pages to the file first.
            mmap_flush.flush()
        self._mapped = None
        self._file.truncate(self._offset)  # A reused file may have been longer (or shorter).
        if self.fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._data_tmp, self.data_path)
        doc = {
            "format": FORMAT_VERSION,
            "version": self.version,
            "process": self.process,
            "num_processes": self.num_processes,
            "data_bytes": self._offset,
            "chunk_bytes": CHUNK_BYTES,
            "leaves": self._leaves,
            "chunks": self._chunks,  # Last: the rest is alike from version to version.
        }
        with open(self._manifest_tmp, "w") as f:
            f.write(json.dumps(doc))  # One write (json.dump writes piece by piece).
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(self._manifest_tmp, self.manifest_path)
        if self.fsync:
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self) -> None:
        """Removes what this part wrote (its manifest was never written)."""
        self._pending = []
        self._mapped = None
        self._file.close()
        for p in (self._data_tmp, self._manifest_tmp):
            p.unlink(missing_ok=True)


class OpenVersion:
    """A complete version's data files, mapped read-only (pages mapped up front where Linux
    allows: ``MAP_POPULATE``; a copy out of a fresh mapping otherwise takes a page fault
    per 4 KiB, which made reads of ``/dev/shm`` five times slower here; ``mappings`` keeps
    them for the next versions written over the same files), each under a read lease
    (:mod:`jax_tpusync.weights.file_pool`): no publisher writes over a file while an array
    viewing it is alive. So the views :meth:`read` returns stay valid and unchanged as long
    as they are referenced, after :meth:`close` too, even once the version is retired."""

    def __init__(self, manifest: VersionManifest, mappings: MappingCache | None = None):
        self.manifest = manifest
        self._maps: list = []
        mappings = MappingCache() if mappings is None else mappings
        try:
            for path in manifest.data_files:
                self._maps.append(mappings.lease(path))
        except (FileNotFoundError, FileRetiredError) as e:
            self.close()
            raise WeightSyncError(
                f"weights version {manifest.version} was retired while opening it "
                f"({e.filename}: {e.strerror or 'gone'}): pull again (or keep more versions)"
            ) from None
        # (process, file offset of the chunk) of the chunks checked already: each once.
        self._checked: set[tuple[int, int]] = set()

    def check_bytes(self, leaf: StoredLeaf, index: int, lo: int, hi: int) -> None:
        """Checks bytes ``[lo, hi)`` of ``leaf``'s shard ``index`` (the whole chunks that
        hold them) against their checksums; DamagedVersionError naming the version, the
        data file, the shard and the byte range where one does not match. Nothing is
        checked in a version written without checksums (``chunk_bytes`` 0)."""
        chunk = self.manifest.chunk_bytes
        s = leaf.shards[index]
        if not chunk or hi <= lo:
            return
        sums = self.manifest.shard_checksums.get((s.process, s.offset), s.checksums)
        data = self._maps[s.process]
        for c in range(lo // chunk, (hi - 1) // chunk + 1):
            start = s.offset + c * chunk
            if (s.process, start) in self._checked:
                continue
            end = s.offset + min((c + 1) * chunk, s.nbytes)
            if xxhash.xxh3_64_intdigest(data[start:end]) != sums[c]:
                version = self.manifest.version
                raise DamagedVersionError(
                    f"weights version {version} is damaged: "
                    f"{self.manifest.data_files[s.process]} bytes {start}-{end} (leaf "
                    f"{leaf.path} shard {s.box}, its chunk {c}) do not match their checksum",
                    version=version,
                )
            self._checked.add((s.process, start))

    def shard(self, leaf: StoredLeaf, index: int) -> np.ndarray:
        """A read-only view of ``leaf``'s shard number ``index`` (shape of its box),
        unchecked: :meth:`read` checks what it hands out."""
        s = leaf.shards[index]
        dtype = np.dtype(leaf.dtype)
        shape = tuple(b - a for a, b in s.box)
        data = self._maps[s.process]
        if data is None:  # An empty data file holds only empty shards.
            return np.empty(shape, dtype)
        return data[s.offset : s.offset + s.nbytes].view(dtype).reshape(shape)

    def read(
        self, leaf: StoredLeaf, wanted: Sequence[tuple[int, tuple[slice, ...]]]
    ) -> list[np.ndarray]:
        """Views of the mapped files: per (shard number, slices), those values, their
        bytes checked (:meth:`check_bytes`: the chunks that hold them)."""
        out = []
        for index, slices in wanted:
            whole = self.shard(leaf, index)
            view = whole[slices]
            if isinstance(view, np.ndarray) and view.ndim:
                base = byte_bounds(whole)[0] if whole.size else 0
                lo, hi = byte_bounds(view) if view.size else (base, base)
                self.check_bytes(leaf, index, lo - base, hi - base)
            else:  # One element of a 0-d shard: a scalar.
                self.check_bytes(leaf, index, 0, leaf.shards[index].nbytes)
            out.append(view)
        return out

    def read_stacked(self, leaf: StoredLeaf, shards: Sequence[int]) -> np.ndarray | None:
        """One view of whole shards that lie back to back in one data file (a process
        writes a leaf's shards in box order, each at a 64-byte aligned offset: those whose
        byte counts are multiples of 64 follow each other), stacked along the first axis;
        None otherwise."""
        first = [leaf.shards[i] for i in shards]
        if not first or not leaf.shape:
            return None
        rows = first[0].box[0][0]
        offset = first[0].offset
        for s in first:
            if (
                s.process != first[0].process
                or s.offset != offset
                or s.box[0][0] != rows
                or s.box[1:] != first[0].box[1:]
            ):
                return None
            rows = s.box[0][1]
            offset += s.nbytes
        data = self._maps[first[0].process]
        if data is None:
            return None
        for i in shards:
            self.check_bytes(leaf, i, 0, leaf.shards[i].nbytes)
        shape = (rows - first[0].box[0][0], *(b - a for a, b in first[0].box[1:]))
        nbytes = sum(s.nbytes for s in first)
        view = data[first[0].offset : first[0].offset + nbytes]
        return view.view(np.dtype(leaf.dtype)).reshape(shape)

    def close(self) -> None:
        """Drops this reader's leases; a file an array still views stays leased until the
        last such array is gone."""
        self._maps = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def byte_bounds(view: np.ndarray) -> tuple[int, int]:
    """The addresses of the first byte of ``view`` (not empty) and one past its last."""
    lo = hi = view.__array_interface__["data"][0]
    for n, stride in zip(view.shape, view.strides, strict=True):
        (lo, hi) = (lo + (n - 1) * stride, hi) if stride < 0 else (lo, hi + (n - 1) * stride)
    return lo, hi + view.itemsize


def manifest_from_parts(
    version: int, docs: Sequence[dict], data_files: tuple = ()
) -> VersionManifest:
    """The checked manifest of a complete version from its part manifests (``docs[p]``:
    process ``p``'s, parsed): every part names the same leaves, their shards tile each
    array, each shard's byte count fits its box. Shard records may name their object
    (``key``) and the xxh3-64 of each chunk (``chunks``, hex). Raises WeightSyncError."""
    leaves = []
    first = docs[0]["leaves"]
    try:
        for p, doc in enumerate(docs):
            if [(leaf["path"], leaf["shape"], leaf["dtype"]) for leaf in doc["leaves"]] != [
                (leaf["path"], leaf["shape"], leaf["dtype"]) for leaf in first
            ]:
                raise WeightSyncError(
                    f"weights version {version}: process {p}'s part names other leaves (paths, "
                    f"shapes or dtypes) than process 0's"
                )
        for i, leaf in enumerate(first):
            shards = []
            for p, doc in enumerate(docs):
                for s in doc["leaves"][i]["shards"]:
                    box = tuple((int(a), int(b)) for a, b in s["box"])
                    shards.append(
                        StoredShard(
                            box,
                            p,
                            int(s["offset"]),
                            int(s["nbytes"]),
                            str(s.get("key", "")),
                            tuple(int(c, 16) for c in s.get("chunks", ())),
                        )
                    )
            shards.sort(key=lambda s: s.box)
            stored = StoredLeaf(leaf["path"], tuple(leaf["shape"]), leaf["dtype"], tuple(shards))
            try:
                stored.layout().check()
            except ValueError as e:
                raise WeightSyncError(f"weights version {version}: {e}") from None
            item = np.dtype(stored.dtype).itemsize
            for s in shards:
                if s.nbytes != box_volume(s.box) * item:
                    raise WeightSyncError(
                        f"weights version {version}: leaf {stored.path} shard {s.box} has "
                        f"{s.nbytes} bytes, its box holds {box_volume(s.box) * item}"
                    )
            leaves.append(stored)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, WeightSyncError):
            raise
        raise WeightSyncError(
            f"weights version {version}: a part manifest is malformed ({type(e).__name__}: {e})"
        ) from None
    leaves = tuple(leaves)
    fingerprint = layout_fingerprint([leaf.layout() for leaf in leaves])
    chunk_bytes = {doc.get("chunk_bytes", 0) for doc in docs}
    if len(chunk_bytes) != 1 or not isinstance(next(iter(chunk_bytes)), int):
        raise WeightSyncError(
            f"weights version {version}: its parts disagree on the checksum chunk size "
            f"({sorted(map(str, chunk_bytes))})"
        )
    return VersionManifest(
        version, len(docs), leaves, tuple(data_files), fingerprint, chunk_bytes.pop()
    )


class WeightStore:
    """The versions in ``directory`` (created when missing).

    Args:
      directory: where the versions go (``/dev/shm/...`` for memory speed on one host).
      copy_threads: threads that copy a part's shards into a reused data file (>= 1;
        default: the usable cores, at most
        :data:`~jax_tpusync.runtime.host_copy.MAX_DEFAULT_THREADS`).
    """

    def __init__(self, directory: str | os.PathLike, *, copy_threads: int = DEFAULT_COPY_THREADS):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory={directory!r} must be a path")
        if not os.fspath(directory):  # Path("") is the current directory, by accident.
            raise ValueError(f"directory={directory!r} must be a non-empty path (a directory)")
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int):
            raise TypeError(f"copy_threads={copy_threads!r} must be an int")
        if copy_threads < 1:
            raise ValueError(f"copy_threads={copy_threads} must be >= 1")
        self.copy_threads = copy_threads
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pool = FilePool(self.directory)
        self.mappings = MappingCache()
        self.write_mappings = WriteMappings()
        # (parts without their version number, data bytes, manifest) of the last read.
        self._last_manifest: tuple | None = None
        self._unchecked: set[int] = set()  # Versions without checksums, warned of once.
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this WeightStore is closed")

    def describe(self) -> str:
        return str(self.directory)

    def version_dir(self, version: int) -> Path:
        self._check_open()
        return self.directory / f"v{version:012d}"

    def part_writer(
        self, version: int, process: int, num_processes: int, *, fsync: bool = False
    ) -> PartWriter:
        self._check_open()
        return PartWriter(self, version, process, num_processes, fsync=fsync)

    def open_version(self, manifest: VersionManifest) -> OpenVersion:
        self._check_open()
        unchecked = not manifest.chunk_bytes and manifest.nbytes
        if unchecked and manifest.version not in self._unchecked:
            # Written before checksums were recorded: still read (old stores stay readable).
            self._unchecked.add(manifest.version)
            logger.warning(
                "weights version %d in %s was written without checksums: its bytes are read "
                "unchecked",
                manifest.version,
                self.directory,
            )
        return OpenVersion(manifest, self.mappings)

    def close(self) -> None:
        """Forgets the mappings kept for later pulls and publishes (arrays that view them
        keep theirs). Every later call but :meth:`describe` and :meth:`close` (a no-op) is
        refused."""
        self._closed = True
        self.mappings.clear()
        self.write_mappings.clear()

    def versions(self) -> list[int]:
        """Every version with a directory, complete or not, oldest first."""
        self._check_open()
        out = []
        for entry in os.scandir(self.directory):
            m = _VERSION_DIR.match(entry.name)
            if m and entry.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def parts(self, version: int) -> tuple[int | None, set[int]]:
        """``(number of publishing processes, the processes whose manifest is present)``;
        ``(None, set())`` for a version with no manifest yet."""
        self._check_open()
        try:
            names = os.listdir(self.version_dir(version))
        except FileNotFoundError:
            return None, set()
        counts, present = set(), set()
        for name in names:
            m = _PART_MANIFEST.match(name)
            if m:
                present.add(int(m.group(1)))
                counts.add(int(m.group(2)))
        if len(counts) > 1:
            raise WeightSyncError(
                f"weights version {version}: its parts disagree on the number of publishing "
                f"processes ({sorted(counts)})"
            )
        return (counts.pop() if counts else None), present

    def is_complete(self, version: int) -> bool:
        self._check_open()
        return complete(*self.parts(version))

    def latest_complete(self) -> int | None:
        """The newest complete version, or None."""
        self._check_open()
        return newest_complete(self)

    def read_manifest(self, version: int) -> VersionManifest:
        """The manifest of a complete version, checked: every part names the same leaves,
        their shards tile each array, each data file has its full length. Raises
        IncompleteVersionError or WeightSyncError."""
        self._check_open()
        n, present = self.parts(version)
        if n is None:
            if not self.version_dir(version).exists():
                raise VersionNotFoundError(
                    f"weights version {version} not found in {self.directory} "
                    f"(versions present: {self.versions()})"
                )
            raise IncompleteVersionError(
                f"weights version {version} is incomplete: no process has finished its part",
                version=version,
                missing=(),
            )
        missing = tuple(sorted(set(range(n)) - present))
        if missing:
            raise IncompleteVersionError(
                f"weights version {version} is incomplete: no part from process(es) "
                f"{list(missing)} of {n} publishing processes",
                version=version,
                missing=missing,
            )
        directory = self.version_dir(version)
        texts = []
        for p in range(n):
            path = directory / f"part-{p:05d}-of-{n:05d}.json"
            try:
                texts.append(path.read_bytes())
            except FileNotFoundError:
                raise WeightSyncError(
                    f"weights version {version} was retired while reading it: pull again"
                ) from None
        data_files = tuple(directory / f"part-{p:05d}-of-{n:05d}.bin" for p in range(n))
        # Parts that differ from the last version read only by their version number (the
        # same layout, the same offsets) need no parsing nor checking again: at 1 GB that
        # was two thirds of a pull that put views of the store.
        # Their chunk checksums (the last field) are read on their own.
        found = [_VERSION_FIELD.search(t) for t in texts]
        tails = [t.rfind(_CHUNKS_FIELD) for t in texts]
        if all(m is not None and int(m.group(1)) == version for m in found):
            key = tuple(
                t[: m.start()] + t[m.end() : tail if tail >= 0 else len(t)]
                for t, m, tail in zip(texts, found, tails, strict=True)
            )
            if self._last_manifest is not None and self._last_manifest[0] == key:
                _, data_bytes, last, offsets = self._last_manifest
                self._check_data_files(version, data_files, data_bytes)
                sums = {}
                if last.chunk_bytes:
                    try:
                        chunks = [
                            json.loads(t[tail + len(_CHUNKS_FIELD) : -1])
                            for t, tail in zip(texts, tails, strict=True)
                        ]
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise WeightSyncError(
                            f"weights version {version}: a part manifest's chunk checksums are "
                            f"malformed ({e})"
                        ) from None
                    sums = self._shard_checksums(version, last, offsets, chunks)
                return dataclasses.replace(
                    last, version=version, data_files=data_files, shard_checksums=sums
                )
        else:
            key = None
        docs = []
        for p, text in enumerate(texts):
            path = directory / f"part-{p:05d}-of-{n:05d}.json"
            try:
                doc = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightSyncError(
                    f"weights version {version}: {path} is not JSON: {e}"
                ) from None
            if doc.get("format") != FORMAT_VERSION or doc.get("version") != version:
                raise WeightSyncError(
                    f"weights version {version}: {path} has format {doc.get('format')!r} and "
                    f"version {doc.get('version')!r}, expected {FORMAT_VERSION} and {version}"
                )
            docs.append(doc)
        try:
            data_bytes = tuple(int(doc["data_bytes"]) for doc in docs)
        except (KeyError, TypeError, ValueError) as e:
            raise WeightSyncError(
                f"weights version {version}: a part manifest is malformed ({type(e).__name__}: {e})"
            ) from None
        self._check_data_files(version, data_files, data_bytes)
        manifest = manifest_from_parts(version, docs, data_files)
        try:
            offsets = [
                [int(s["offset"]) for leaf in doc["leaves"] for s in leaf["shards"]] for doc in docs
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise WeightSyncError(
                f"weights version {version}: a part manifest is malformed ({type(e).__name__}: {e})"
            ) from None
        if manifest.chunk_bytes:
            chunks = [doc.get("chunks") for doc in docs]
            sums = self._shard_checksums(version, manifest, offsets, chunks)
            manifest = dataclasses.replace(manifest, shard_checksums=sums)
        if key is not None:
            self._last_manifest = (key, data_bytes, manifest, offsets)
        return manifest

    @staticmethod
    def _shard_checksums(
        version: int, manifest: VersionManifest, offsets: list, chunks: list
    ) -> dict[tuple[int, int], tuple[int, ...]]:
        """``(process, offset) -> chunk checksums`` of every shard, from each part's
        ``chunks`` (a string of 16 hex digits per chunk, per shard record in order),
        each checked to hold one checksum per chunk (WeightSyncError naming the shard)."""
        chunk = manifest.chunk_bytes
        sums = {}
        try:
            for p, (part_offsets, part_chunks) in enumerate(zip(offsets, chunks, strict=True)):
                if len(part_chunks) != len(part_offsets):
                    raise ValueError(
                        f"process {p}'s part has {len(part_chunks)} checksum records for "
                        f"{len(part_offsets)} shards"
                    )
                for offset, text in zip(part_offsets, part_chunks, strict=True):
                    sums[(p, offset)] = tuple(
                        int(text[at : at + 16], 16) for at in range(0, len(text), 16)
                    )
        except (TypeError, ValueError) as e:
            raise WeightSyncError(
                f"weights version {version}: a part manifest's chunk checksums are malformed "
                f"({type(e).__name__}: {e})"
            ) from None
        for leaf in manifest.leaves:
            for s in leaf.shards:
                got = len(sums.get((s.process, s.offset), ()))
                if s.nbytes and got != -(-s.nbytes // chunk):
                    raise WeightSyncError(
                        f"weights version {version}: leaf {leaf.path} shard {s.box} has {got} "
                        f"chunk checksums, not one per {chunk} bytes of its {s.nbytes} (a "
                        f"malformed manifest)"
                    )
        return sums

    @staticmethod
    def _check_data_files(version: int, data_files: tuple, data_bytes: tuple) -> None:
        """Each data file is there with the length its manifest says (WeightSyncError)."""
        for p, (data, nbytes) in enumerate(zip(data_files, data_bytes, strict=True)):
            try:
                size = data.stat().st_size
            except FileNotFoundError:
                raise WeightSyncError(f"weights version {version}: {data} is missing") from None
            if size != nbytes:
                raise WeightSyncError(
                    f"weights version {version}: process {p}'s data file {data} has {size} "
                    f"bytes, its manifest says {nbytes} (damaged)"
                )

    def wait_manifest(
        self, version: int, timeout_s: float, poll_s: float = 0.01
    ) -> VersionManifest:
        """:meth:`read_manifest`, once the version is complete or the deadline has passed
        (then its error says how long was waited)."""
        self._check_open()
        return wait_for_manifest(self.read_manifest, version, timeout_s, poll_s)

    def retire(self, keep: int) -> list[int]:
        """Removes every version older than the ``keep`` newest complete ones (complete or
        not); returns them. A version is renamed aside first, so no reader sees it half
        removed; a reader that has it open keeps reading it."""
        self._check_open()
        complete = [v for v in self.versions() if self.is_complete(v)]
        if len(complete) <= keep:
            return []
        oldest_kept = complete[-keep]
        removed = []
        for v in self.versions():
            if v >= oldest_kept:
                break
            src = self.version_dir(v)
            aside = self.directory / f".retired-{src.name}-{os.getpid()}"
            try:
                os.replace(src, aside)
            except FileNotFoundError:
                continue
            # Its data files are written over by later versions (the pool holds at most
            # one version's worth); a file a reader still maps is unlinked instead.
            data_files = sorted(aside.glob("part-*.bin"))
            for data in data_files:
                self.pool.give(data, capacity=len(data_files))
            shutil.rmtree(aside, ignore_errors=True)
            removed.append(v)
        if removed:
            logger.debug("retired weight versions %s", removed)
        return removed


def wait_for_manifest(
    read_manifest: Callable[[int], VersionManifest],
    version: int,
    timeout_s: float,
    poll_s: float = 0.01,
) -> VersionManifest:
    """``read_manifest(version)`` (a store's), asked again until the version is complete or
    ``timeout_s`` has passed (then its error says how long was waited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return read_manifest(version)
        except IncompleteVersionError as e:
            if time.monotonic() >= deadline:
                raise IncompleteVersionError(
                    f"{e} after waiting {timeout_s:g} s (a publishing process died, or has "
                    f"not finished)",
                    version=version,
                    missing=e.missing,
                ) from None
        except VersionNotFoundError as e:
            if time.monotonic() >= deadline:
                raise VersionNotFoundError(f"{e} after waiting {timeout_s:g} s") from None
        time.sleep(poll_s)


def complete(num_processes: int | None, present: set[int]) -> bool:
    """Whether a version whose parts are ``(num_processes, present)`` (a store's
    ``parts(version)``) has every process's part."""
    return num_processes is not None and present == set(range(num_processes))


def newest_complete(store: WeightStoreBackend) -> int | None:
    """The newest complete version of ``store``, or None."""
    for version in reversed(store.versions()):
        if store.is_complete(version):
            return version
    return None
