"""The copies of cached windows of a host pool whose slots keep rings, held host-side.

A host-pool cache made with ``max_step_tokens`` keeps a ring of blocks per slot
(:mod:`jax_tpusync.core.window_ring`) and reuses prefixes as the engine cache's rings do
(:mod:`jax_tpusync.core.window_prefix`): the blocks a slot's window can see are copied into
blocks a window index owns, and an admission copies the window of its longest cached
prefix into its fresh ring. Those copies are read where no pool is at hand: an admission's
reservation takes no state, and :meth:`~jax_tpusync.HostPoolKVCache.publish_windows` keeps
the state it is given live (it returns no new one). So the window index's blocks are kept
here, as the payloads they were written with (a window copy never changes while indexed),
and read from here; every other block (a ring's) is read from the pool of the host call
under way, and every write also goes to the pool's store, whose writes the cache applies
to the state it returns (a ring filled at admission).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_tpusync.caches.pool.blocks import PoolBlocks
from jax_tpusync.core.window_prefix import WindowIndex


class WindowCopyStore:
    """The slot table's block store of a ring host pool
    (:class:`jax_tpusync.core.levels.BlockStore`): :class:`~jax_tpusync.caches.pool.blocks.PoolBlocks`
    with the window index's blocks held host-side.

    Args:
      pool_blocks: the pool's block store.
    """

    def __init__(self, pool_blocks: PoolBlocks):
        self.pool_blocks = pool_blocks
        # The slot table's window index (set once the table exists: it takes this store).
        self.index: WindowIndex | None = None
        self._copies: dict[int, np.ndarray] = {}  # block id -> the payload written to it

    @property
    def held_blocks(self) -> int:
        """Blocks whose payloads are held here."""
        return len(self._copies)

    def forget_unindexed(self) -> None:
        """Drops the payloads of blocks the window index no longer holds (evicted, or never
        indexed: a ring filled at admission). Called between the slot table's calls, never
        between a block's write and its entry into the index."""
        indexed = set(self._indexed())
        self._copies = {b: p for b, p in self._copies.items() if b in indexed}

    def _indexed(self) -> list[int]:
        return [] if self.index is None else self.index.blocks

    # -- the BlockStore interface -----------------------------------------------------------

    def read_blocks(self, blocks: Sequence[int]) -> list[np.ndarray]:
        """Payloads of ``blocks``: an indexed window copy's from here, a ring block's from
        the pool being read."""
        indexed = set(self._indexed())
        held = {int(b) for b in blocks if int(b) in indexed and int(b) in self._copies}
        rest = [int(b) for b in blocks if int(b) not in held]
        from_pool = dict(zip(rest, self.pool_blocks.read_blocks(rest))) if rest else {}
        return [self._copies[int(b)] if int(b) in held else from_pool[int(b)] for b in blocks]

    def write_block(self, block: int, payload: np.ndarray) -> None:
        self.pool_blocks.write_block(block, payload)  # Checks the payload first.
        self._copies[int(block)] = np.array(np.asarray(payload).reshape(-1), copy=True)

    def block_memory(self, block: int) -> None:
        """None: the pool is not memory a level may write in place."""
        return None

    def quiesce(self) -> None:
        """Nothing in flight: the pool moves only in steps and the cache's calls."""
