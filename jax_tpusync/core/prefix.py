"""Prefix store: content-addressed KV blocks shared between sequences.

A *full* block of a sequence (``block_tokens`` tokens) is named by a chained key: the
xxh3-128 digest of the previous block's key and this block's token ids, starting from a
root digest of the cache's geometry, dtype, layout version and a user salt (model id,
weights version). So a key stands for the whole token prefix up to the end of its block,
and two models (or two cache layouts) never share a key. The index also keeps each block's
token ids and its parent, and a lookup compares them: a digest collision can never map the
wrong KV into a sequence.

Lifecycle of an indexed block:

* **pinned** while one or more slots map it (``refs > 0``); a pinned block is never evicted
  and never written (a slot only writes positions past its shared prefix, and a shared
  prefix is whole blocks);
* **cached** when no slot maps it: kept, and reused by the next sequence that starts with
  the same prefix, until its physical block is needed; then evicted least recently used
  first, a released sequence's last block before its first (a block's descendants go with
  it: without their parent they are unreachable).

A block enters the index when the sequence that wrote it is released and its write-backs
have completed (the cache drains the engine first), or earlier, as soon as a step has
filled it and finished (:meth:`PrefixIndex.share`, a cache's ``share_computed``): then it
is pinned by its writer until that one's release, which only appends past it. A block
still being filled is never indexed, so no reader can map a half-written block.

On a persistent tier each commit records the index (:meth:`PrefixIndex.entries_in_order`,
with a checksum of every block's bytes) and a re-attached cache restores it
(:meth:`PrefixIndex.restore`); see :mod:`jax_tpusync.persist.commit`.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from jax_tpusync.core.blocks import BlockAllocator, LevelAllocators

# Bumped when the key derivation changes: keys of another version never match.
KEY_VERSION = 1

# Token ids are hashed (and stored) as int64: an id is an int in [0, TOKEN_ID_LIMIT).
TOKEN_ID_LIMIT = 2**63


@dataclasses.dataclass
class Entry:
    """One indexed block: its chained key, parent, token ids and physical block."""

    key: bytes
    # None: the first block of a sequence, chained from the index's root. A first block
    # chained from another root (restored from a tier written with another salt, kept only
    # while a slot maps it) has that root here: no key of the index, so no lookup reaches it.
    parent: bytes | None
    tokens: np.ndarray  # int64[block_tokens]: the block's token ids.
    block: int  # Physical block id.
    refs: int = 0
    children: set[bytes] = dataclasses.field(default_factory=set)
    # Persistent tiers: xxh3-64 of the block's bytes per (layer, K|V), index layer * 2 + kv;
    # None until the first commit after it was published hashes it.
    sums: list[int] | None = None
    # Two-level caches: admissions that mapped it since it moved to the spill tier.
    spill_hits: int = 0


class PrefixIndex:
    """Indexed blocks of one cache, with reference counts and LRU eviction.

    Args:
      allocator: the cache's block allocator (indexed blocks are allocated in it; eviction
        frees them back).
      block_tokens: tokens per block.
      root: the digest every chain starts from (see :func:`root_key`).
    """

    def __init__(self, allocator: BlockAllocator | LevelAllocators, block_tokens: int, root: bytes):
        self.allocator = allocator
        self.block_tokens = block_tokens
        self.root = root
        self._entries: dict[bytes, Entry] = {}
        self._by_block: dict[int, bytes] = {}
        # Unpinned entries, least recently used first.
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.hits = 0  # Blocks mapped from the index by lookups.
        self.evictions = 0

    # -- keys ------------------------------------------------------------------------------------

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        """Chained keys of the full blocks of ``tokens``."""
        out = []
        key = self.root
        t = self.block_tokens
        for i in range(len(tokens) // t):
            key = chain_key(key, tokens[i * t : (i + 1) * t])
            out.append(key)
        return out

    # -- queries ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_blocks(self) -> int:
        """Indexed blocks no slot maps (evictable)."""
        return len(self._lru)

    def is_indexed(self, block: int) -> bool:
        return block in self._by_block

    def block_of(self, key: bytes) -> int:
        return self._entries[key].block

    def key_of(self, block: int) -> bytes:
        return self._by_block[int(block)]

    def cached_where(self, where: Callable[[int], bool], limit: int) -> list[bytes]:
        """Keys of up to ``limit`` cached (unpinned) entries whose block satisfies
        ``where``, least recently used first."""
        out = []
        for key in self._lru:
            if len(out) >= limit:
                break
            if where(self._entries[key].block):
                out.append(key)
        return out

    def move(self, key: bytes, block: int) -> None:
        """Re-points ``key`` at physical ``block``, which holds a copy of its bytes (a
        two-level cache moving it between tiers, see :mod:`jax_tpusync.core.spill`); the old
        block is the caller's to free."""
        entry = self._entries[key]
        del self._by_block[entry.block]
        entry.block = int(block)
        entry.spill_hits = 0
        self._by_block[entry.block] = key

    def holds(self, entry: Entry) -> bool:
        """Whether ``entry`` (this index's object) is still indexed: not evicted since."""
        return self._entries.get(entry.key) is entry

    def refs(self, block: int) -> int:
        key = self._by_block.get(block)
        return 0 if key is None else self._entries[key].refs

    # -- lookup and pinning ----------------------------------------------------------------------

    def match(self, tokens: np.ndarray, limit_blocks: int) -> list[int]:
        """Physical blocks of the longest indexed prefix of ``tokens`` (at most
        ``limit_blocks`` blocks), pinned; each verified against its tokens and parent."""
        out = self.peek(tokens, limit_blocks)
        for block in out:
            self._pin(self._by_block[block])
        self.hits += len(out)
        return out

    def peek(
        self, tokens: np.ndarray, limit_blocks: int, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        """The blocks :meth:`match` would map now, neither pinned nor counted as hits: what
        a scheduler asks before it chooses whom to admit. ``keys``: ``keys(tokens)``, where
        the caller kept them (a waiting prompt asked about step after step)."""
        out: list[int] = []
        parent = None
        t = self.block_tokens
        for i, key in enumerate((self.keys(tokens) if keys is None else keys)[:limit_blocks]):
            entry = self._entries.get(key)
            block_tokens = tokens[i * t : (i + 1) * t]
            if (
                entry is None
                or entry.parent != parent
                or not np.array_equal(entry.tokens, block_tokens)
            ):
                break
            out.append(entry.block)
            parent = key
        return out

    def _pin(self, key: bytes) -> None:
        entry = self._entries[key]
        if entry.refs == 0:
            del self._lru[key]
        entry.refs += 1

    def unpin(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each of ``blocks`` (indexed, in sequence order). A block
        left unpinned becomes cached as the most recently used, its sequence's later
        blocks ahead of its earlier ones in line for eviction."""
        for block in reversed(list(blocks)):
            key = self._by_block[int(block)]
            entry = self._entries[key]
            if entry.refs <= 0:
                raise ValueError(f"block {block} is not pinned")
            entry.refs -= 1
            if entry.refs == 0:
                self._lru[key] = None  # Appended: the tail first, then the blocks before it.

    # -- publishing --------------------------------------------------------------------------------

    def publish(self, tokens: np.ndarray, blocks: Sequence[int], shared: int) -> list[int]:
        """Indexes a released sequence's full blocks; returns the blocks to free.

        ``blocks[i]`` holds ``tokens``' block ``i`` (full blocks only); the first ``shared``
        came from the index (pinned by this sequence: unpinned here). A private block whose
        key is already indexed (another sequence wrote the same prefix meanwhile) is a
        duplicate: returned to be freed. The others are indexed, unpinned.
        """
        keys = self.keys(tokens)[: len(blocks)]
        if len(keys) < len(blocks):
            raise ValueError(f"{len(blocks)} full blocks but tokens cover only {len(keys)}")
        duplicates: list[int] = []
        release: list[int] = []  # Indexed blocks this sequence pins, in order.
        parent = None
        t = self.block_tokens
        for i, (key, block) in enumerate(zip(keys, blocks)):
            block = int(block)
            if i < shared:
                release.append(block)
                parent = key
                continue
            if key in self._entries or (parent is not None and parent not in self._entries):
                duplicates.append(block)  # Indexed already, or its parent was evicted.
                parent = key
                continue
            entry = Entry(key, parent, np.array(tokens[i * t : (i + 1) * t], np.int64), block)
            self._entries[key] = entry
            self._by_block[block] = key
            if parent is not None:
                self._entries[parent].children.add(key)
            entry.refs = 1  # Released just below, with the shared ones, in order.
            release.append(block)
            parent = key
        self.unpin(release)
        return duplicates

    def share(self, tokens: np.ndarray, blocks: Sequence[int], start: int) -> int:
        """Indexes a running sequence's full blocks ``start ..`` as soon as they are
        computed; returns how many were indexed, each pinned once (by that sequence).

        ``blocks[i]`` holds ``tokens``' block ``i`` (full blocks, rows written); the first
        ``start`` are indexed already under ``tokens``' keys and pinned by the sequence.
        Stops at the first block whose key is indexed already (another sequence computed
        the same prefix meanwhile: this sequence keeps its own copy, freed as a duplicate
        at release), or when block ``start - 1`` is not indexed as ``blocks[start - 1]``
        (a chain this index cannot extend).
        """
        keys = self.keys(tokens)[: len(blocks)]
        if len(keys) < len(blocks):
            raise ValueError(f"{len(blocks)} full blocks but tokens cover only {len(keys)}")
        parent = None
        if start > 0:
            parent = keys[start - 1]
            entry = self._entries.get(parent)
            if entry is None or entry.block != int(blocks[start - 1]) or entry.refs <= 0:
                return 0
        t = self.block_tokens
        shared = 0
        for i in range(start, len(blocks)):
            key, block = keys[i], int(blocks[i])
            if key in self._entries or block in self._by_block:
                break
            entry = Entry(key, parent, np.array(tokens[i * t : (i + 1) * t], np.int64), block)
            entry.refs = 1  # The sequence that wrote it maps it: never evicted before release.
            self._entries[key] = entry
            self._by_block[block] = key
            if parent is not None:
                self._entries[parent].children.add(key)
            parent = key
            shared += 1
        return shared

    def adopt(self, key: bytes, parent: bytes | None, tokens: np.ndarray, block: int) -> None:
        """Indexes a block whose bytes came from elsewhere (a shared directory, see
        :mod:`jax_tpusync.core.shared_blocks`) and already sit in physical ``block``, pinned
        once (by the slot admitting it). ``parent`` must be indexed (None: a first block)."""
        if key in self._entries:
            raise ValueError("adopt(): the key is indexed already")
        if parent is not None and parent not in self._entries:
            raise ValueError("adopt(): the parent block is not indexed")
        entry = Entry(key, parent, np.array(tokens, np.int64), int(block), refs=1)
        self._entries[key] = entry
        self._by_block[int(block)] = key
        if parent is not None:
            self._entries[parent].children.add(key)

    # -- persistence -------------------------------------------------------------------------------

    def entry(self, block: int) -> Entry | None:
        """The entry indexing physical ``block`` (None: not indexed)."""
        key = self._by_block.get(int(block))
        return None if key is None else self._entries[key]

    def entries_in_order(self) -> list[Entry]:
        """Every entry, the cached ones first in eviction order (least recently used
        first), then the pinned ones, a chain's later blocks before its earlier ones (the
        order in which :meth:`unpin` would make them cached). What a commit records."""
        depth: dict[bytes, int] = {}

        def depth_of(key: bytes) -> int:
            path, k = [], key
            while k in self._entries and k not in depth:
                path.append(k)
                k = self._entries[k].parent
            d = depth.get(k, -1)  # A known depth, or past a first block.
            for p in reversed(path):
                d += 1
                depth[p] = d
            return depth[key]

        cached = [self._entries[k] for k in self._lru]
        pinned = [e for e in self._entries.values() if e.refs > 0]
        pinned.sort(key=lambda e: -depth_of(e.key))
        return cached + pinned

    def restore(self, entries: Sequence[Entry]) -> None:
        """Re-attach: fills an empty index with ``entries`` (each with its ``refs``: the
        slots mapping it), the unpinned ones cached in the given order (least recently
        used first). Their blocks must already be allocated (the cache reserves them).
        The entries must form whole chains: every parent that is a key is among them."""
        if self._entries:
            raise ValueError("restore() needs an empty index")
        if len({e.key for e in entries}) < len(entries) or len(
            {e.block for e in entries}
        ) < len(entries):
            raise ValueError("restore(): a key or a block is indexed twice")
        for e in entries:
            e.children = set()
            self._entries[e.key] = e
            self._by_block[e.block] = e.key
        for e in entries:
            if e.parent is not None and e.parent in self._entries:
                self._entries[e.parent].children.add(e.key)
            if e.refs == 0:
                self._lru[e.key] = None

    # -- eviction ---------------------------------------------------------------------------------

    def evict(self, count: int, where: Callable[[int], bool] | None = None) -> int:
        """Frees at least ``count`` cached blocks (fewer if not that many are cached),
        least recently used first; returns how many were freed. ``where``: only blocks
        satisfying it are chosen and counted (a two-level cache evicting from one tier);
        their descendants go too, wherever they are."""
        where = where or (lambda block: True)
        freed = 0
        while freed < count and (keys := self.cached_where(where, 1)):
            freed += sum(map(where, self._drop(keys[0])))
        return freed

    def drop(self, key: bytes) -> list[int]:
        """Removes ``key`` and its descendants (all unpinned) from the index, not as an
        eviction (a block whose bytes were found damaged: no later lookup may reach it or
        the chain after it); frees their blocks and returns them."""
        return self._drop(key, evicted=False)

    def _drop(self, key: bytes, evicted: bool = True) -> list[int]:
        """Removes ``key`` and its descendants (all unpinned: a pinned block's ancestors are
        pinned too) from the index; frees their blocks and returns them."""
        entry = self._entries.pop(key)
        freed: list[int] = []
        for child in list(entry.children):
            freed += self._drop(child, evicted)
        if entry.refs:
            raise AssertionError("evicting a pinned block")
        del self._lru[key]
        del self._by_block[entry.block]
        if entry.parent is not None and entry.parent in self._entries:
            self._entries[entry.parent].children.discard(key)
        self.allocator.free(np.asarray([entry.block]))
        self.evictions += evicted
        return freed + [entry.block]


def root_key(salt: str | bytes, geometry: dict) -> bytes:
    """The digest every chain of one cache starts from: the key version, the user's salt
    and the cache's geometry (layers, heads, head size, dtype, block size, layout)."""
    h = xxhash.xxh3_128()
    h.update(f"tpusync-prefix-v{KEY_VERSION}\0".encode())
    h.update(salt if isinstance(salt, bytes) else str(salt).encode())
    h.update(b"\0")
    for name in sorted(geometry):
        h.update(f"{name}={geometry[name]}\0".encode())
    return h.digest()


def chain_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The key of a block holding token ids ``tokens`` after the block keyed ``parent`` (a
    first block: ``parent`` is the index's root): the xxh3-128 digest of the parent's key
    and the ids as int64."""
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def token_ids(tokens: Any) -> np.ndarray:
    """``tokens`` (a 1-D sequence or array of ints) as int64[n] token ids.

    Raises:
      ValueError: not a 1-D sequence of ints (floats, bools, other ranks), or an id outside
        [0, 2**63) (keys hash ids as int64: a larger one would wrap onto another id).
    """
    array = np.asarray(tokens)
    python_ints = False
    if array.ndim == 1 and array.dtype.kind in "fO" and not hasattr(tokens, "dtype"):
        # NumPy widens a list of ints past int64 beside others to float, past uint64 to
        # objects: the Python values themselves say whether they are ints.
        values = np.asarray(tokens, dtype=object)
        if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in values):
            array, python_ints = values, True
    if array.ndim != 1 or not (
        python_ints or (np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_)
    ):
        raise ValueError(
            f"tokens must be a 1-D sequence of ints; got {array.dtype} of shape {array.shape}"
        )
    if array.size == 0:
        return np.zeros(0, np.int64)
    low, high = int(array.min()), int(array.max())  # Python ints: exact for any dtype.
    if low < 0 or high >= TOKEN_ID_LIMIT:
        i = int(np.argmax(array < 0)) if low < 0 else int(np.argmax(array == array.max()))
        bad = low if low < 0 else high
        raise ValueError(
            f"token id {bad} (tokens[{i}]) is not in [0, 2**63 - 1 = {TOKEN_ID_LIMIT - 1}]: "
            "ids are hashed as int64"
        )
    return array.astype(np.int64)

