"""Prefix reuse for a cache that keeps only its sliding window (:mod:`jax_tpusync.core.window_ring`).

A sliding layer of a sequence that starts with a cached prefix of ``P`` tokens needs only
the rows ``[P - W + 1, P)`` of that prefix: the blocks its window can still see. So, as
vLLM's sliding-window prefix caching does, a window index keeps blocks by their chained key
(the same key the prefix index gives a block: the token ids up to its end, see
:func:`jax_tpusync.core.prefix.chain_key`) *without* the chain: a block stays findable when the
blocks before it are gone, and a lookup asks, for each candidate length ``P`` (longest
first), whether the blocks covering ``[P - W + 1, P)`` are all there.

A ring's blocks are overwritten as the window moves, so they cannot be shared in place:
blocks enter the index as copies (a slot's ring block copied into a free block while the
ring still holds it, :meth:`SlotTable.publish_window`), and an admission copies the window's
blocks into the slot's fresh ring. Cached blocks are evicted least recently used first,
none of them mapped by any slot.

Every entry keeps its block's token ids and parent key, and a lookup compares them, so a
digest collision never serves another prefix's rows.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class WindowEntry:
    parent: bytes  # The key before it (the index's root for a first block).
    tokens: np.ndarray  # int64[block_tokens]
    block: int


class WindowIndex:
    """Blocks of cached windows by chained key, least recently used first."""

    def __init__(self, block_tokens: int, window: int):
        self.block_tokens = block_tokens
        self.window = window
        self._entries: collections.OrderedDict[bytes, WindowEntry] = collections.OrderedDict()
        self.hits = 0  # Blocks copied into admitted slots.
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def blocks(self) -> list[int]:
        return [e.block for e in self._entries.values()]

    def put(self, key: bytes, parent: bytes, tokens: np.ndarray, block: int) -> None:
        """Indexes ``block`` (a copy the index owns) under ``key``, most recently used."""
        if key in self._entries:
            raise ValueError("put(): the key is indexed already")
        self._entries[key] = WindowEntry(parent, np.array(tokens, np.int64), int(block))

    def lookup(
        self, keys: list[bytes], parents: list[bytes], ids: np.ndarray, limit_blocks: int
    ) -> tuple[int, list[int]]:
        """``(P, blocks)``: the longest cached prefix of ``P`` tokens (``P`` a multiple of
        the block size, at most ``limit_blocks`` blocks) whose window's blocks are all
        indexed, and those blocks (the ones covering ``[max(0, P - W + 1), P)``, in
        order); ``(0, [])`` if none. ``keys[i]`` / ``parents[i]`` are block ``i``'s key and
        its parent's. The blocks found become the most recently used."""
        t = self.block_tokens

        def holds(i: int) -> bool:
            entry = self._entries.get(keys[i])
            return (
                entry is not None
                and entry.parent == parents[i]
                and np.array_equal(entry.tokens, ids[i * t : (i + 1) * t])
            )

        for n in range(min(limit_blocks, len(keys)), 0, -1):
            first = max(0, n * t - self.window + 1) // t
            if all(holds(i) for i in range(first, n)):
                for i in range(first, n):
                    self._entries.move_to_end(keys[i])
                self.hits += n - first
                return n * t, [self._entries[keys[i]].block for i in range(first, n)]
        return 0, []

    def evict(self, count: int) -> list[int]:
        """Drops the ``count`` least recently used entries (fewer if fewer are cached);
        returns their blocks, now the caller's to free."""
        out = []
        while self._entries and len(out) < count:
            _, entry = self._entries.popitem(last=False)
            out.append(entry.block)
        self.evictions += len(out)
        return out
