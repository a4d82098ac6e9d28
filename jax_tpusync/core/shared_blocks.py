"""Prefix blocks published to a directory that several processes share (a local disk, NFS,
Lustre): the prefix store's first path between processes and hosts.

One file per block, named by its chained key (:mod:`jax_tpusync.core.prefix`):
``<dir>/<key hex>.kvblock``. A file holds a header (format version, the key, its parent,
the index root, geometry, the block's token ids, an xxh3-64 checksum of the payload) and
the payload: the block's rows of every layer, K then V, as the tier stores them
(``num_layers * 2 * block_bytes`` bytes).

* **Publish** (a cache's :meth:`~jax_tpusync.OffloadedKVCache.release` with ``tokens``):
  each full block of the sequence that has no file yet is read from the tier (its
  write-backs completed: the cache drains the engine first), written to a temporary file
  in the directory, fsynced, renamed to its name, and the directory fsynced.
* **Import** (:meth:`~jax_tpusync.OffloadedKVCache.admit` with ``tokens``): past the
  blocks its own index holds, the cache looks up the next keys' files; each one found is
  checked (header against the key, parent, root, geometry and tokens expected; payload
  against its checksum), written into a free block of the cache's tier and indexed there,
  pinned by the slot. The first missing file ends the match.

Crash consistency. A block's file appears under its name only by ``rename`` of a complete,
fsynced temporary file, which POSIX makes atomic: a reader sees the whole file or none (a
crash leaves at most a ``.tmp-*`` file, never read and removable). Two processes that
publish one key race harmlessly: either file is the KV of the same tokens under the same
model and geometry, and the rename leaves one of them whole. A file whose checksum does not
match (a flipped bit, a truncated copy made by other tools) is an error naming it, never
KV; one whose header names other tokens (a digest collision, however unlikely) is not
used. Files are never deleted by the cache: the directory only grows (remove files by
age, e.g. ``find -mmin``, when no process is admitting from it).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"TPSYNCKB"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
_PREAMBLE = struct.Struct("<8sII")  # magic, version, header bytes


class SharedBlockError(RuntimeError):
    """A shared block file that cannot be used (corrupt, or written for other geometry)."""


class SharedBlockDirectory:
    """The published blocks of one cache geometry in a shared directory.

    Args:
      path: the directory (created if missing).
      root: the prefix index's root key (salt, geometry, dtype, layout).
      num_layers: layers of the cache.
      block_tokens: tokens per block.
      block_bytes: bytes of one block of one layer's K (or V).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        root: bytes,
        num_layers: int,
        block_tokens: int,
        block_bytes: int,
    ):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.published = 0  # Files this process wrote.
        self.imported = 0  # Blocks this process read from files.

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * 2 * self.block_bytes

    def file_of(self, key: bytes) -> Path:
        return self.path / (key.hex() + SUFFIX)

    def has(self, key: bytes) -> bool:
        return self.file_of(key).exists()

    def _header(self, key: bytes, parent: bytes | None, tokens: np.ndarray, checksum: int) -> dict:
        return {
            "key": key.hex(),
            "parent": None if parent is None else parent.hex(),
            "root": self.root.hex(),
            "num_layers": self.num_layers,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "tokens": [int(t) for t in tokens],
            "xxh3_64": checksum,
        }

    def publish(
        self, key: bytes, parent: bytes | None, tokens: np.ndarray, payload: np.ndarray
    ) -> bool:
        """Writes one block's file unless it exists; returns whether it wrote it.

        ``payload``: uint8[payload_bytes], the block's rows of every layer, K then V."""
        final = self.file_of(key)
        if final.exists():
            return False
        payload = np.ascontiguousarray(payload, np.uint8).reshape(-1)
        if payload.size != self.payload_bytes:
            raise ValueError(f"payload has {payload.size} bytes, not {self.payload_bytes}")
        header = json.dumps(
            self._header(key, parent, tokens, xxhash.xxh3_64_intdigest(payload))
        ).encode()
        tmp = self.path / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)))
                f.write(header)
                f.write(payload.data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)  # Atomic: the name shows the whole file or none.
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_directory(self.path)
        self.published += 1
        return True

    def load(self, key: bytes, parent: bytes | None, tokens: np.ndarray) -> np.ndarray | None:
        """The payload of ``key``'s file, checked; None if there is no file, or if it holds
        other tokens or parent (a digest collision: not this prefix's KV).

        Raises:
          SharedBlockError: the file is corrupt (checksum, size, format) or was written for
            another geometry under this key.
        """
        path = self.file_of(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            magic, version, header_bytes = _PREAMBLE.unpack_from(data)
            if magic != MAGIC or version != FORMAT_VERSION:
                raise ValueError(f"not a version-{FORMAT_VERSION} block file")
            start = _PREAMBLE.size + header_bytes
            if start > len(data):
                raise ValueError(
                    f"a header of {header_bytes} bytes runs past the end of the file "
                    f"({len(data)} bytes)"
                )
            header = json.loads(data[_PREAMBLE.size : start])
            _check_header(header)
        except (struct.error, ValueError, RecursionError) as e:
            raise SharedBlockError(f"shared block {path}: unreadable header ({e})") from None
        expected = self._header(key, parent, tokens, 0)
        for field in ("key", "root", "num_layers", "block_tokens", "block_bytes"):
            if header.get(field) != expected[field]:
                raise SharedBlockError(
                    f"shared block {path}: {field} is {header.get(field)!r}, this cache's is "
                    f"{expected[field]!r}"
                )
        if header.get("parent") != expected["parent"] or header.get("tokens") != expected["tokens"]:
            return None  # Another prefix under the same digest: never its KV.
        payload = np.frombuffer(data, np.uint8, offset=start).copy()  # Writable, for the engine.
        if payload.size != self.payload_bytes:
            raise SharedBlockError(
                f"shared block {path}: {payload.size} payload bytes, expected {self.payload_bytes}"
            )
        if xxhash.xxh3_64_intdigest(payload) != header.get("xxh3_64"):
            raise SharedBlockError(f"shared block {path}: checksum mismatch (corrupt file)")
        self.imported += 1
        return payload


# The header's fields and what each must be (a file whose header is not of this shape is
# corrupt: never compared, never used).
_HEADER_FIELDS = {
    "key": "a string",
    "parent": "a string or null",
    "root": "a string",
    "num_layers": "an int",
    "block_tokens": "an int",
    "block_bytes": "an int",
    "tokens": "a list of ints",
    "xxh3_64": "an int",
}


def _check_header(header: object) -> None:
    """Raises ValueError naming the first field of ``header`` that is not of its shape."""

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(header, dict):
        raise ValueError(f"the header is {type(header).__name__}, not an object")
    for field, want in _HEADER_FIELDS.items():
        v = header.get(field)
        ok = {
            "a string": isinstance(v, str),
            "a string or null": v is None or isinstance(v, str),
            "an int": is_int(v),
            "a list of ints": isinstance(v, list) and all(is_int(t) for t in v),
        }[want]
        if not ok:
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            raise ValueError(f"header field {field!r} is {shown}, not {want}")


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
