"""How the Mooncake weight store's objects hold their bytes
(:mod:`jax_tpusync.weights.store_mooncake`): its small objects (the ``begun`` marker, each
process's part manifest, the list of versions) as checksummed JSON, and its shards' bytes
checksummed per chunk.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from jax_tpusync.weights.records import WeightSyncError, chunk_checksums

__all__ = ["checksummed_json", "chunk_checksums", "read_checksummed_json"]


def checksummed_json(doc: Any) -> bytes:
    """``doc`` as JSON after a line holding the xxh3-64 of that JSON (16 hex digits)."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    return f"{xxhash.xxh3_64_intdigest(body):016x}\n".encode() + body


def read_checksummed_json(data: bytes, name: str) -> Any:
    """The JSON of a :func:`checksummed_json` object, or WeightSyncError naming the object
    (``name``) when its checksum does not match or it is not one."""
    head, _, body = data.partition(b"\n")
    try:
        ok = int(head, 16) == xxhash.xxh3_64_intdigest(body)
        value = json.loads(body) if ok else None
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise WeightSyncError(f"object {name!r} is damaged: its checksum does not match")
    return value
