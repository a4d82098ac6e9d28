"""The manifest of a persistent KV tier: what it records, and how it is read and checked.

A manifest is one JSON object beside the tier's data (see :mod:`jax_tpusync.persist.commit`
for where, and for the commit protocol that writes it)::

    format          MANIFEST_FORMAT
    format_version  an int in READABLE_MANIFEST_VERSIONS
    geometry        Geometry.to_json(): what must match for a cache to re-attach
    model_id, tier, data, timestamp, time     informative
    session         "open" while a session runs, else how the last one ended
    commit          the commit number (an int >= 0)
    lengths         int[batch]: committed rows per sequence
    block_tables    int[batch][max_blocks]: each sequence's physical blocks (-1: none)
    capacity        int[batch]: tokens each sequence's blocks hold
    checksum        {"algorithm": CHECKSUM_ALGORITHM, "chunk_rows": int >= 1}
    checksums       [layer][K|V][sequence] lists of 16-hex-digit xxh3-64 digests, one per
                    chunk of chunk_rows committed rows
    prefix          (version 2) the prefix index: {"root", "foreign_roots", "checksum",
                    "shared": int[batch], "entries": [{"key", "parent", "tokens", "block",
                    "checksums": [layer][K|V] digests}, ...]}
    tokens          (optional) per sequence, base64 of its committed token ids (int64,
                    little-endian; at most its length of them; see jax_tpusync.core.history)

:func:`read_manifest` loads one and checks its envelope, :func:`checked_commit` checks the
commit it describes against its geometry; both raise :class:`MissingManifestError` naming
the file and what is wrong, whatever the JSON holds. Errors are :class:`PersistenceError`,
a subclass of :class:`jax_tpusync.TpusyncError`.

(Length: a little over 800 lines, because every field of the schema has its own checks and its own
error message naming the file and the field; splitting them would scatter one schema.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jax_tpusync.core import prefix
from jax_tpusync.core.blocks import NO_BLOCK
from jax_tpusync.core.config import KVGeometry
from jax_tpusync.core.history import decode_ids
from jax_tpusync.runtime.engine import TpusyncError

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
# Geometry fields a cache may not know before its tier is opened (None: not compared).
PAGING_FIELDS = ("block_tokens", "num_blocks")
# Ints of the commit (lengths, tables, capacities) are read only in this range, so that
# arithmetic on them cannot overflow int64.
INT_LIMIT = 2**62

__all__ = [
    "CHECKSUM_ALGORITHM",
    "INT_LIMIT",
    "LAYOUT_VERSION",
    "MANIFEST_FORMAT",
    "MANIFEST_SUFFIX",
    "MANIFEST_VERSION",
    "PAGING_FIELDS",
    "READABLE_MANIFEST_VERSIONS",
    "SHM_DIRECTORY",
    "UNSPECIFIED_MODEL",
    "ChecksumMismatchError",
    "CommitError",
    "Geometry",
    "LayoutMismatchError",
    "MissingManifestError",
    "PersistenceError",
    "check_shared_block",
    "checked_commit",
    "checked_prefix",
    "entry_json",
    "hex_digest",
    "hex_sum",
    "int_array",
    "is_json_int",
    "manifest_json",
    "prefix_section",
    "read_manifest",
    "region_name",
    "region_of",
    "sums_from_json",
    "sums_to_json",
    "tier_paths",
    "write_json_atomically",
]


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
    def of_kv(cls, kv: KVGeometry, model_id: str | None) -> Geometry:
        """What a persisted cache of ``kv``'s geometry records, and must match to re-attach
        (at this layout version; ``model_id`` None: unspecified)."""
        return cls.of(
            kv.num_layers,
            kv.batch,
            kv.max_len,
            kv.num_kv_heads,
            kv.head_dim,
            kv.dtype,
            model_id,
            block_tokens=kv.block_tokens,
            num_blocks=kv.num_blocks,
            tier_dtype=kv.tier_dtype,
        )

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
    def from_json(cls, d: Any) -> Geometry:
        """The geometry a manifest records (fields it lacks are None; the values are not
        checked here: :meth:`differences` and :func:`checked_commit` do).

        Raises:
          ValueError: ``d`` is not a JSON object.
        """
        if not isinstance(d, dict):
            raise ValueError(f"geometry is {_json_kind(d)}, not an object")
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})

    def differences(self, ours: Geometry) -> list[str]:
        """One ``"field: the tier holds X, this cache has Y"`` per differing field; paging
        fields that ``ours`` does not know yet (None) are not compared."""
        out = []
        for f in dataclasses.fields(self):
            held, have = getattr(self, f.name), getattr(ours, f.name)
            if have is None and f.name in PAGING_FIELDS:
                continue
            if held != have:
                out.append(f"{f.name}: the tier holds {held!r}, this cache has {have!r}")
        return out


# -- where a manifest lives ----------------------------------------------------------------


def tier_paths(
    tier: str,
    path: str | os.PathLike | None,
    shm_name: str | None,
    file_name: str | None,
) -> tuple[Path, Path] | None:
    """(data, manifest) paths of a persistent tier; None for a tier that is not one.

    File tier: ``<path>/<file_name>.tpusync`` and ``<path>/<file_name>`` + MANIFEST_SUFFIX.
    Shm tier: the segment ``/dev/shm/<shm_name>`` and ``/dev/shm/<shm_name>`` +
    MANIFEST_SUFFIX (the manifest lives and dies with the segment)."""
    if tier == "file" and file_name:
        directory = Path(os.fspath(path))
        return directory / f"{file_name}.tpusync", directory / f"{file_name}{MANIFEST_SUFFIX}"
    if tier == "host" and shm_name:
        return Path(SHM_DIRECTORY) / shm_name, Path(SHM_DIRECTORY) / f"{shm_name}{MANIFEST_SUFFIX}"
    return None


# -- regions and checksums -----------------------------------------------------------------


def region_name(layer: int, kv: int, b: int) -> str:
    return f"layer {layer} {'KV'[kv]} sequence {b}"


def region_of(region: int, batch: int) -> tuple[int, int, int]:
    """(layer, kv, sequence) of logical region ``(layer * 2 + kv) * batch + sequence``."""
    return region // (2 * batch), region // batch % 2, region % batch


def sums_to_json(sums: list[list[int]], num_layers: int, batch: int) -> list:
    """Per-region chunk checksums -> [layer][kv][sequence] lists of 16-digit hex digests."""
    return [
        [
            [[f"{s:016x}" for s in sums[(layer * 2 + kv) * batch + b]] for b in range(batch)]
            for kv in range(2)
        ]
        for layer in range(num_layers)
    ]


def sums_from_json(nested: Any, num_layers: int, batch: int) -> list[list[int]]:
    """[layer][kv][sequence] lists of hex digests -> per-region chunk checksums.

    Raises:
      ValueError: naming the first entry that is not of that shape or not a digest.
    """
    _check_list(nested, num_layers, "checksums")
    out: list[list[int]] = []
    for layer in range(num_layers):
        _check_list(nested[layer], 2, f"checksums[{layer}]")
    for layer in range(num_layers):
        for kv in range(2):
            _check_list(nested[layer][kv], batch, f"checksums[{layer}][{kv}]")
            for b in range(batch):
                chunks = nested[layer][kv][b]
                where = f"checksums[{layer}][{kv}][{b}]"
                _check_list(chunks, None, where)
                out.append([hex_sum(s, f"{where}[{c}]") for c, s in enumerate(chunks)])
    # Region order: (layer * 2 + kv) * batch + b, which the loops above follow.
    return out


def hex_sum(value: Any, name: str) -> int:
    """A 64-bit checksum from 16 hex digits; raises ValueError naming ``name``."""
    try:
        if not isinstance(value, str) or len(value) != 16:
            raise ValueError
        raw = bytes.fromhex(value)
        if len(raw) != 8:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{name} is {_short(value)}, not a 64-bit digest (16 hex digits)"
        ) from None
    return int.from_bytes(raw, "big")


def hex_digest(value: Any, name: str) -> bytes:
    """A 16-byte digest from 32 hex digits; raises ValueError naming ``name``."""
    try:
        if not isinstance(value, str) or len(value) != 32:
            raise ValueError
        raw = bytes.fromhex(value)
        if len(raw) != 16:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{name} is {_short(value)}, not a 128-bit digest (32 hex digits)"
        ) from None
    return raw


def is_json_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_array(
    value: Any,
    shape: tuple[int, ...],
    name: str,
    *,
    low: int = -INT_LIMIT,
    high: int = INT_LIMIT,
) -> np.ndarray:
    """``value`` (nested lists of ints in ``[low, high)``) as an int64 array of ``shape``;
    raises ValueError naming the first entry that is not."""

    def check(v: Any, depth: int, where: str) -> None:
        if depth == len(shape):
            if not is_json_int(v) or not low <= v < high:
                raise ValueError(f"{name}{where} is {_short(v)}, not an int in [{low}, {high})")
            return
        if not isinstance(v, list) or len(v) != shape[depth]:
            got = (
                f"has {len(v)} entries, not {shape[depth]}"
                if isinstance(v, list)
                else f"is {_json_kind(v)}, not a list of {shape[depth]}"
            )
            raise ValueError(f"{name} must have shape {list(shape)}; {name}{where} {got}")
        for i, x in enumerate(v):
            check(x, depth + 1, f"{where}[{i}]")

    check(value, 0, "")
    return np.asarray(value, np.int64).reshape(shape)


# -- reading -------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, Any]:
    """Loads a manifest and checks its envelope: a JSON object of this format and a
    readable version, with a ``geometry`` object and the commit's fields.

    Raises:
      MissingManifestError: it cannot be read or is not a manifest of this format (naming
        ``path`` and what is wrong).
    """
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError(f"it holds {_json_kind(manifest)}, not an object")
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {_short(manifest.get('format'))}, not {MANIFEST_FORMAT!r}")
        version = manifest.get("format_version")
        if not is_json_int(version) or version not in READABLE_MANIFEST_VERSIONS:
            raise ValueError(
                f"format_version {_short(version)}; this build reads "
                f"{', '.join(map(str, READABLE_MANIFEST_VERSIONS))}"
            )
        for key in ("geometry", "commit", "lengths", "checksum", "checksums"):
            if key not in manifest:
                raise ValueError(f"no {key!r}")
        Geometry.from_json(manifest["geometry"])  # An object, or ValueError.
    except (OSError, ValueError, RecursionError) as e:
        raise MissingManifestError(
            f"cannot use manifest {path}: {e}. Pass overwrite=True to discard the cache."
        ) from e
    return manifest


def checked_commit(manifest: Any, held: Geometry, path: Path) -> dict[str, Any]:
    """The commit a manifest describes, checked against its geometry ``held``: lengths,
    block tables and capacities (int arrays), chunk_rows and checksums, and the prefix
    index (see :func:`checked_prefix`).

    Each sequence holds blocks in the first ``ceil(capacity / block_tokens)`` entries of its
    table row and none after them, every id in ``[0, num_blocks)``, and its length is at
    most its capacity (0 for an inactive sequence) and at least its shared prefix. Its first
    ``shared`` blocks are indexed, one chain from a first block; a block is held once,
    except an indexed block, which any number of sequences may map within their shared
    prefixes; an indexed block is never a sequence's private block.

    Returns a dict: commit, session, lengths (int64[batch]), block_tables
    (int32[batch, max_blocks]), capacity (int32[batch]), chunk_rows, sums (per region, see
    :func:`sums_from_json`), root (bytes or None), shared (int32[batch]) and entries (see
    :func:`checked_prefix`).

    Raises:
      MissingManifestError: naming ``path`` and what is inconsistent.
    """
    try:
        if not isinstance(manifest, dict):
            raise ValueError(f"it holds {_json_kind(manifest)}, not an object")
        for name in ("num_layers", "batch", "max_len", "block_tokens", "num_blocks"):
            value = getattr(held, name)
            if not is_json_int(value) or not 1 <= value < INT_LIMIT:
                raise ValueError(f"geometry.{name} is {_short(value)}, not a positive int")
        batch, max_blocks = held.batch, held.max_blocks
        for key in ("commit", "lengths", "block_tables", "capacity", "checksum", "checksums"):
            if key not in manifest:
                raise ValueError(f"no {key!r}")
        commit = manifest["commit"]
        if not is_json_int(commit) or not 0 <= commit < INT_LIMIT:
            raise ValueError(f"commit is {_short(commit)}, not an int >= 0")
        lengths = int_array(manifest["lengths"], (batch,), "lengths")
        tables = int_array(manifest["block_tables"], (batch, max_blocks), "block_tables")
        capacity = int_array(manifest["capacity"], (batch,), "capacity")
        version = manifest.get("format_version", MANIFEST_VERSION)
        if not is_json_int(version) or version not in READABLE_MANIFEST_VERSIONS:
            raise ValueError(f"format_version {_short(version)} is not readable")
        if version >= 2 and "prefix" not in manifest:
            raise ValueError("no 'prefix'")
        session = manifest.get("session")
        if session is not None and not isinstance(session, str):
            raise ValueError(f"session is {_json_kind(session)}, not a string")
        index = checked_prefix(manifest.get("prefix"), held)
        shared_counts, entries = index["shared"], index["entries"]
        by_block = {e["block"]: i for i, e in enumerate(entries)}
        keys = {e["key"] for e in entries}
        holder: dict[int, int] = {}  # Private blocks: their sequence.
        for b in range(batch):
            row, cap, n = tables[b], int(capacity[b]), int(lengths[b])
            shared = int(shared_counts[b])
            if not 0 <= shared <= max_blocks:
                raise ValueError(
                    f"prefix.shared[{b}] = {shared} is not in [0, {max_blocks}] (block table "
                    "entries per sequence)"
                )
            for i, p in enumerate(row.tolist()):
                if p != NO_BLOCK and not 0 <= p < held.num_blocks:
                    raise ValueError(
                        f"block_tables[{b}][{i}] = {p} is not a block id (-1 or in [0, "
                        f"num_blocks={held.num_blocks}))"
                    )
                if i < shared:
                    check_shared_block(b, i, row, entries, by_block, keys)
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
                raise ValueError(f"capacity[{b}] = {cap} is not in [0, max_len={held.max_len}]")
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
        if not isinstance(checksum, dict):
            raise ValueError(f"checksum is {_json_kind(checksum)}, not an object")
        chunk_rows = checksum.get("chunk_rows")
        if not is_json_int(chunk_rows) or not 1 <= chunk_rows < INT_LIMIT:
            raise ValueError(f"checksum.chunk_rows is {_short(chunk_rows)}, not a positive int")
        if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
            raise ValueError(
                f"checksum.algorithm is {_short(checksum.get('algorithm'))}, not "
                f"{CHECKSUM_ALGORITHM!r}"
            )
        try:
            sums = sums_from_json(manifest["checksums"], held.num_layers, batch)
        except ValueError as e:
            raise ValueError(f"checksums are not [layer][K|V][sequence] hex lists ({e})") from e
        for region, chunks in enumerate(sums):
            layer, kv, b = region_of(region, batch)
            want = -(-int(lengths[b]) // chunk_rows)
            if len(chunks) != want:
                raise ValueError(
                    f"{region_name(layer, kv, b)} has {len(chunks)} checksums for "
                    f"{int(lengths[b])} rows of {chunk_rows}-row chunks ({want})"
                )
        tokens = checked_tokens(manifest.get("tokens"), lengths)
    except ValueError as e:
        raise MissingManifestError(
            f"cannot use manifest {path}: {e}. Pass overwrite=True to discard the cache."
        ) from e
    return {
        "tokens": tokens,
        "commit": int(commit),
        "session": session,
        "lengths": lengths.astype(np.int64),
        "block_tables": tables.astype(np.int32),
        "capacity": capacity.astype(np.int32),
        "chunk_rows": int(chunk_rows),
        "sums": sums,
        "root": index["root"],
        "shared": index["shared"].astype(np.int32),
        "entries": entries,
    }


def checked_tokens(raw: Any, lengths: np.ndarray) -> list[np.ndarray]:
    """Each sequence's committed token ids (``"tokens"``: one base64 string of int64 ids per
    sequence, at most its length of them; absent in older manifests: none recorded).
    Raises ValueError naming the sequence and what is wrong."""
    if raw is None:
        return [np.zeros(0, np.int64) for _ in lengths]
    if not isinstance(raw, list) or len(raw) != len(lengths):
        raise ValueError(f"'tokens' is {_json_kind(raw)}, not a list of {len(lengths)} strings")
    out = []
    for b, text in enumerate(raw):
        try:
            ids = decode_ids(text)
        except ValueError as e:
            raise ValueError(f"tokens of sequence {b}: {e}") from None
        if len(ids) > lengths[b]:
            raise ValueError(
                f"sequence {b} records {len(ids)} token ids, more than its length {int(lengths[b])}"
            )
        out.append(ids)
    return out


def checked_prefix(raw: Any, held: Geometry) -> dict[str, Any]:
    """The manifest's prefix index, checked (raises ValueError naming what is wrong).

    ``raw`` None (a version 1 manifest): an empty index. Each entry's key is 16 bytes (hex),
    its parent null, an indexed key or one of ``foreign_roots``, its tokens
    ``block_tokens`` token ids (ints in ``[0, prefix.TOKEN_ID_LIMIT)``), its block an id in
    ``[0, num_blocks)`` indexed once, its checksums one hex digest per (layer, K|V); and its
    key is the chained digest of its parent (the root for null) and its tokens
    (:func:`jax_tpusync.core.prefix.chain_key`), so a token or parent changed since the commit
    is caught here.

    Returns a dict: root (bytes, None for an empty version 1 index), shared (int64[batch]:
    each sequence's indexed leading blocks) and entries (dicts of key, parent, tokens,
    block and sums: per (layer, K|V), index layer * 2 + kv), in the recorded order.
    """
    batch, t = held.batch, held.block_tokens
    if raw is None:
        return dict(root=None, shared=np.zeros(batch, np.int64), entries=[])
    if not isinstance(raw, dict):
        raise ValueError(f"prefix is {_json_kind(raw)}, not an object")
    root = hex_digest(raw.get("root"), "prefix.root")
    if raw.get("checksum") != CHECKSUM_ALGORITHM:
        raise ValueError(
            f"prefix.checksum is {_short(raw.get('checksum'))}, not {CHECKSUM_ALGORITHM!r}"
        )
    foreign_raw = raw.get("foreign_roots")
    if not isinstance(foreign_raw, list):
        raise ValueError(f"prefix.foreign_roots is {_json_kind(foreign_raw)}, not a list")
    foreign = {hex_digest(r, f"prefix.foreign_roots[{i}]") for i, r in enumerate(foreign_raw)}
    shared = int_array(raw.get("shared"), (batch,), "prefix.shared")
    recorded = raw.get("entries")
    if not isinstance(recorded, list):
        raise ValueError(f"prefix.entries is {_json_kind(recorded)}, not a list")
    entries: list[dict[str, Any]] = []
    keys: dict[bytes, int] = {}
    blocks: dict[int, int] = {}
    for i, e in enumerate(recorded):
        where = f"prefix.entries[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where} is {_json_kind(e)}, not an object")
        key = hex_digest(e.get("key"), f"{where}.key")
        parent = e.get("parent")
        parent = None if parent is None else hex_digest(parent, f"{where}.parent")
        tokens = int_array(
            e.get("tokens"), (t,), f"{where}.tokens", low=0, high=prefix.TOKEN_ID_LIMIT
        )
        block = e.get("block")
        if not is_json_int(block) or not 0 <= block < held.num_blocks:
            raise ValueError(
                f"{where}.block = {_short(block)} is not a block id in [0, num_blocks="
                f"{held.num_blocks})"
            )
        if block in blocks:
            raise ValueError(
                f"block {block} is indexed twice (prefix.entries[{blocks[block]}] and {where})"
            )
        if key in keys:
            raise ValueError(f"{where}.key is also prefix.entries[{keys[key]}]'s")
        digests = e.get("checksums")
        try:
            _check_list(digests, held.num_layers, f"{where}.checksums")
            sums = []
            for layer in range(held.num_layers):
                _check_list(digests[layer], 2, f"{where}.checksums[{layer}]")
                for kv in range(2):
                    sums.append(hex_sum(digests[layer][kv], f"{where}.checksums[{layer}][{kv}]"))
        except ValueError as err:
            raise ValueError(f"{where}.checksums are not [layer][K|V] hex digests ({err})") from err
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
        if prefix.chain_key(root if parent is None else parent, e["tokens"]) != e["key"]:
            raise ValueError(
                f"{where}.key does not match its parent and tokens (the xxh3-128 digest of "
                f"the parent's key, or the root, and the block's token ids): block "
                f"{e['block']}'s tokens or parent changed since the commit"
            )
    return dict(root=root, shared=shared, entries=entries)


def check_shared_block(
    b: int,
    i: int,
    row: np.ndarray,
    entries: list[dict[str, Any]],
    by_block: dict[int, int],
    keys: set[bytes],
) -> None:
    """Table entry ``i`` of sequence ``b`` lies in its shared prefix: it must be an indexed
    block, a first block for ``i = 0``, else the child of entry ``i - 1``'s (checked
    before it). Raises ValueError naming what is wrong."""
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


# -- writing -------------------------------------------------------------------------------


def entry_json(entry: prefix.Entry, num_layers: int) -> dict[str, Any]:
    """One entry of the manifest's ``prefix.entries`` (``entry.sums`` set)."""
    return {
        "key": entry.key.hex(),
        "parent": None if entry.parent is None else entry.parent.hex(),
        "tokens": [int(t) for t in entry.tokens],
        "block": int(entry.block),
        "checksums": [
            [f"{entry.sums[layer * 2 + kv]:016x}" for kv in range(2)] for layer in range(num_layers)
        ],
    }


def prefix_section(
    root: bytes, foreign_roots: Any, shared: Any, entries: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest's ``prefix`` section: the index's root, the roots of first blocks
    chained from another one, each sequence's shared blocks and the entries
    (:func:`entry_json`, in eviction order)."""
    return {
        "root": root.hex(),
        "foreign_roots": [r.hex() for r in foreign_roots],
        "checksum": CHECKSUM_ALGORITHM,
        "shared": [int(n) for n in shared],
        "entries": entries,
    }


def manifest_json(
    *,
    geometry: Geometry,
    tier: str,
    data: Path,
    commit: int,
    session: str,
    timestamp: float,
    time_text: str,
    lengths: Any,
    tables: Any,
    capacity: Any,
    chunk_rows: int,
    sums: list[list[int]],
    prefix_json: dict[str, Any],
    tokens: list[str] | None = None,
) -> dict[str, Any]:
    """A manifest of this format and version (see the module's docstring)."""
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "geometry": geometry.to_json(),
        "model_id": geometry.model_id,
        "tier": tier,
        "data": str(data),
        "commit": commit,
        "timestamp": timestamp,
        "time": time_text,
        "session": session,
        "lengths": [int(n) for n in lengths],
        "block_tables": np.asarray(tables).tolist(),
        "capacity": [int(n) for n in capacity],
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_rows": chunk_rows},
        "checksums": sums_to_json(sums, geometry.num_layers, geometry.batch),
        "prefix": prefix_json,
        **({} if tokens is None else {"tokens": tokens}),
    }


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


# -- helpers -------------------------------------------------------------------------------


def _check_list(value: Any, length: int | None, name: str) -> None:
    """Raises ValueError unless ``value`` is a list (of ``length`` entries, if given)."""
    if not isinstance(value, list):
        raise ValueError(f"{name} is {_json_kind(value)}, not a list")
    if length is not None and len(value) != length:
        raise ValueError(f"{name} has {len(value)} entries, not {length}")


def _json_kind(value: Any) -> str:
    """What a JSON value is, for messages: ``a list``, ``a string ('abc')``, ``null``..."""
    if value is None:
        return "null"
    kind = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an int",
        float: "a number",
    }.get(type(value), f"a {type(value).__name__}")
    return kind if isinstance(value, (dict, list)) else f"{kind} ({_short(value)})"


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message never quotes a whole file)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
