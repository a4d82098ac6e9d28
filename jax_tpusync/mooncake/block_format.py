"""How a prefix block is laid out as objects in a Mooncake Store, and how a stored block
is checked before any of it is used (:mod:`jax_tpusync.mooncake.level` moves the objects).

A block (``num_layers * 2 * block_bytes`` bytes: every (layer, K|V) region in region
order) is stored as

* one object per *layer range* (whole layers, about ``object_bytes`` each; a range's
  regions are contiguous in the payload), named by the block's key, the range and the
  xxh3-64 checksum of its bytes: ``<namespace>/<key hex>/<first>-<end>/<checksum hex>``;
* one small *header* object, ``<namespace>/<key hex>/head``: a preamble (magic, format
  version, length) and JSON naming the key, its parent, the index root, the geometry, the
  block's token ids and each range's (first layer, end layer, checksum).

Range names carry their checksum, so two writers of the same block (whose KV may differ
in the last bits) never name the same object for different bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

MAGIC = b"TPSYNCMC"
FORMAT_VERSION = 1
HEADER_PREAMBLE = struct.Struct("<8sII")  # magic, format version, JSON bytes

# A layer range as a header names it: (first layer, end layer, xxh3-64 of its bytes).
LayerRange = tuple[int, int, int]


class DamagedBlock(Exception):
    """A block in the store that must not be used (corrupt, foreign, a collision)."""


class BlockFormat:
    """The objects of one cache's blocks: their names, the header's bytes and its checks,
    the layer ranges and their checksums.

    Args:
      namespace: the first part of every object name.
      root: the prefix index's root key, written in every header and checked on every hit.
      num_layers, block_tokens, block_bytes: the cache's geometry (``block_bytes``: one
        block of one layer's K or V); checked by the caller.
      object_bytes: about the size of one layer range's object: whole layers per object,
        at least one.
    """

    def __init__(
        self,
        namespace: str,
        root: bytes,
        num_layers: int,
        block_tokens: int,
        block_bytes: int,
        object_bytes: int,
    ):
        self.namespace = namespace
        self.root = bytes(root)
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        per_object = max(1, object_bytes // (2 * block_bytes))
        self.layer_ranges = [
            (lo, min(lo + per_object, num_layers)) for lo in range(0, num_layers, per_object)
        ]
        # The longest header accepted (the fixed fields, then 24 bytes a token id): the
        # reader's buffer for one header is this long.
        self.header_capacity = 4096 + 24 * block_tokens

    @property
    def payload_bytes(self) -> int:
        """A block's bytes: every (layer, K|V) region."""
        return self.num_layers * 2 * self.block_bytes

    def header_key(self, key: bytes) -> str:
        return f"{self.namespace}/{key.hex()}/head"

    def range_key(self, key: bytes, first: int, end: int, checksum: int) -> str:
        return f"{self.namespace}/{key.hex()}/{first}-{end}/{checksum:016x}"

    def layer_span(self, first: int, end: int) -> slice:
        """The bytes of layers [first, end) in a payload."""
        return slice(first * 2 * self.block_bytes, end * 2 * self.block_bytes)

    def regions(self, payload: Any) -> list[np.ndarray]:
        """``payload`` (``uint8[payload_bytes]``, or its ``2 * num_layers`` regions of
        ``block_bytes`` each, in region order) as its regions, checked; a ValueError says
        what does not fit."""
        size = self.block_bytes
        if isinstance(payload, np.ndarray):
            payload = np.ascontiguousarray(payload, np.uint8).reshape(-1)
            if payload.size != self.payload_bytes:
                raise ValueError(f"payload has {payload.size} bytes, not {self.payload_bytes}")
            return [payload[r * size : (r + 1) * size] for r in range(2 * self.num_layers)]
        regions = [np.asarray(region).reshape(-1) for region in payload]
        if len(regions) != 2 * self.num_layers or any(
            r.dtype != np.uint8 or r.size != size for r in regions
        ):
            raise ValueError(
                f"a payload given as regions needs {2 * self.num_layers} uint8 views of "
                f"{size} bytes, not {[(str(r.dtype), r.size) for r in regions]}"
            )
        return regions

    @staticmethod
    def range_checksum(regions: Sequence[np.ndarray], first: int, end: int) -> int:
        """xxh3-64 of layers [first, end)'s regions (``uint8[block_bytes]`` each, every
        region of the block in order), their bytes joined."""
        digest = xxhash.xxh3_64()
        for region in regions[2 * first : 2 * end]:
            digest.update(region)
        return digest.intdigest()

    def checksummed_ranges(self, regions: Sequence[np.ndarray]) -> list[LayerRange]:
        """Every layer range of a block's regions with its checksum."""
        return [(lo, hi, self.range_checksum(regions, lo, hi)) for lo, hi in self.layer_ranges]

    def encode_header(
        self, key: bytes, parent: bytes | None, tokens: list[int], ranges: list[LayerRange]
    ) -> bytes:
        """The header object's bytes; a ValueError if they pass ``header_capacity``."""
        body = json.dumps(
            {
                "key": key.hex(),
                "parent": None if parent is None else parent.hex(),
                "root": self.root.hex(),
                "num_layers": self.num_layers,
                "block_tokens": self.block_tokens,
                "block_bytes": self.block_bytes,
                "tokens": tokens,
                "ranges": [list(r) for r in ranges],
            },
            separators=(",", ":"),
        ).encode()
        header = HEADER_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(body)) + body
        if len(header) > self.header_capacity:
            raise ValueError(
                f"a header of {len(header)} bytes is longer than {self.header_capacity}"
            )
        return header

    def checked_header(
        self, data: bytes, name: str, key: bytes, parent: bytes | None, tokens: list[int]
    ) -> list[LayerRange]:
        """The ranges of a header, after every check: its preamble, then that it was
        written for ``key``, this root and geometry, ``parent`` and ``tokens``, and that its
        ranges partition the layers. Raises :class:`DamagedBlock` naming (``name``) the
        block and what does not match."""
        try:
            magic, version, length = HEADER_PREAMBLE.unpack_from(data)
            if magic != MAGIC or version != FORMAT_VERSION:
                raise ValueError(f"not a version-{FORMAT_VERSION} block header")
            if HEADER_PREAMBLE.size + length != len(data):
                raise ValueError(
                    f"{len(data)} bytes, the preamble says {HEADER_PREAMBLE.size + length}"
                )
            header = json.loads(data[HEADER_PREAMBLE.size :])
            if not isinstance(header, dict):
                raise ValueError(f"a {type(header).__name__}, not an object")
        except (struct.error, ValueError, RecursionError) as e:
            raise DamagedBlock(f"{name}: unreadable header ({e})") from None
        for field, want in (
            ("key", key.hex()),
            ("root", self.root.hex()),
            ("num_layers", self.num_layers),
            ("block_tokens", self.block_tokens),
            ("block_bytes", self.block_bytes),
        ):
            if header.get(field) != want:
                raise DamagedBlock(
                    f"{name}: {field} is {header.get(field)!r}, this cache's is {want!r}"
                )
        want_parent = None if parent is None else parent.hex()
        if header.get("parent") != want_parent or header.get("tokens") != tokens:
            raise DamagedBlock(
                f"{name}: written for other tokens or another parent under the same key "
                f"(a digest collision)"
            )
        ranges = header.get("ranges")
        end = 0
        out = []
        for r in ranges if isinstance(ranges, list) else [None]:
            if not (
                isinstance(r, list)
                and len(r) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
                and r[0] == end < r[1] <= self.num_layers
                and 0 <= r[2] < 2**64
            ):
                raise DamagedBlock(
                    f"{name}: header field 'ranges' is not a partition of the layers"
                )
            out.append((r[0], r[1], r[2]))
            end = r[1]
        if end != self.num_layers:
            raise DamagedBlock(f"{name}: header field 'ranges' is not a partition of the layers")
        return out
