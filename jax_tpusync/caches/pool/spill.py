"""A spill tier behind a host pool: cached prefix blocks kept in a file when the pool is full.

A :class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` made with ``spill_path=DIR`` (and
``spill_blocks=N``, default ``4 * num_blocks``) keeps two tiers, as a two-level engine cache
does (:mod:`jax_tpusync.core.spill`): the pool (``num_blocks`` blocks per (layer, K|V), in the
state) and a file in ``DIR`` on an engine of its own (``N`` more, for cached prefix blocks
the pool had no room for). One id space covers both in the slot table::

    ids [0, num_blocks)                          pool blocks
    ids [num_blocks, num_blocks + spill_blocks)  spill blocks (spill block id - num_blocks)

What differs from the engine cache is where a step reads: a host-pool step reads only the
pool (no custom call reads a file inside a TPU step), so a spill block never reaches a
block table that a state carries (:func:`check_pool_ids` refuses one). Hence:

* **Demotion** (as on the engine cache): when an admission needs pool blocks and none is
  free, the least recently used cached prefix blocks of the pool are read out of the
  state's pool (:func:`~jax_tpusync.caches.pool.blocks.gather_blocks`) and written to free spill
  blocks, their index entries re-pointed; only when neither tier has room is a block
  evicted. The bytes come from the pool of the call under way (:meth:`PoolSpillTier.reading`,
  set by :meth:`~jax_tpusync.caches.pool.cache.HostPoolKVCache.reserving_in`, in which
  ``admit``, hybrid admissions and P/D receives reserve): a reservation made outside it
  (``reserve()`` on its own) has no pool to read and evicts instead.
* **Promotion**: every spill block an admission maps is copied back into a free pool block
  at that admission (the slot table makes room for it first:
  :meth:`PoolSpillTier.promotion_room`), read from the file at once and written into the
  pool with the reservation's other imports (:class:`~jax_tpusync.caches.pool.imports.PendingImports`),
  before the slot's first step. It never evicts or demotes a block a slot maps (those are
  pinned); an admission that cannot get the room is refused, changing nothing. A
  reservation cancelled before its admission puts the blocks it promoted (and imported)
  back on the spill tier while it has free blocks (:meth:`PoolSpillTier.keep`): their
  pending bytes are their only copy.

The file holds each block's rows as a persistent pool tier does
(:mod:`jax_tpusync.caches.pool.persistence`): one region of ``spill_blocks`` blocks per (layer,
K|V), a block ``block_tokens`` rows of K or V of every head. Not over a mesh, and not with
persistence (refused at construction, as on the engine cache).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import numpy as np

from jax_tpusync.caches.pool import blocks as pool_blocks
from jax_tpusync.core.blocks import LevelAllocators
from jax_tpusync.core.levels import TierBlocks
from jax_tpusync.core.pool_state import PoolLayout
from jax_tpusync.core.prefix import PrefixIndex
from jax_tpusync.core.spill import SpillPolicy
from jax_tpusync.runtime.engine import Engine

logger = logging.getLogger(__name__)

__all__ = ["PoolSpillTier", "check_pool_ids"]


def check_pool_ids(
    tables: np.ndarray,  # int[batch, max_blocks]: every slot's blocks (-1: none)
    num_blocks: int,
) -> None:
    """Refuses block tables that name an id past the pool's ``num_blocks`` (a spill
    block): a state carries only tables whose every block the pool holds.

    Raises:
      RuntimeError: naming the slot, the position's block index and the id.
    """
    tables = np.asarray(tables)
    beyond = np.argwhere(tables >= num_blocks)
    if len(beyond):
        slot, index = (int(i) for i in beyond[0])
        raise RuntimeError(
            f"tpusync: slot {slot}'s block table names block {int(tables[slot, index])} at "
            f"index {index}, past the pool's num_blocks={num_blocks} (a spill block): a "
            f"step reads only the pool, so a spill block must be promoted before any "
            f"table holds it"
        )


class PoolSpillTier(SpillPolicy):
    """The spill file of one host pool and the moves between it and the pool.

    Made by :meth:`open`. Not thread-safe: used from the thread that drives the cache.

    Args:
      engine: the engine the spill file is on (this object's: :meth:`close` closes it).
      store: the cache's spill blocks on it (block ids ``[0, spill_blocks)``).
      layout: the pool's layout.
      blocks: the pool's block store, where promoted blocks are written (pending until the
        admission's pool takes them).
      allocators: the slot table's :class:`~jax_tpusync.core.blocks.LevelAllocators`.
      pending: the payloads of pool blocks that no pool holds yet, by block
        (:meth:`PendingImports.payloads_of`), and what forgets them once they moved
        (:meth:`PendingImports.forget`).
    """

    def __init__(
        self,
        engine: Engine,
        store: TierBlocks,
        layout: PoolLayout,
        blocks: pool_blocks.PoolBlocks,
        allocators: LevelAllocators,
        pending: tuple[Callable[[list[int]], dict[int, np.ndarray]], Callable[[list[int]], None]],
    ):
        # Every spill block an admission maps is promoted at that admission.
        super().__init__(allocators=allocators, promote_after=1)
        self.engine = engine
        self.store = store
        self.layout = layout
        self.blocks = blocks
        self._pending_payloads, self._forget_pending = pending
        self._pool: jax.Array | None = None

    @classmethod
    def open(
        cls,
        spill_path: str,
        spill_blocks: int,
        layout: PoolLayout,
        blocks: pool_blocks.PoolBlocks,
        allocators: LevelAllocators,
        pending: tuple[Callable[[list[int]], dict[int, np.ndarray]], Callable[[list[int]], None]],
    ) -> PoolSpillTier:
        """Opens an anonymous file (deleted on close) of ``spill_blocks`` blocks per (layer,
        K|V) in directory ``spill_path`` on an engine of its own."""
        spec = layout.spec
        regions = spec.num_layers * 2
        engine = Engine()
        try:
            tier = engine.add_file_tier(
                spill_path, block_bytes=spec.block_bytes, num_blocks=regions * spill_blocks
            )
            first = engine.allocate(tier, regions * spill_blocks)
            store = TierBlocks(
                engine,
                tier=tier,
                first_block=first,
                num_blocks=spill_blocks,
                regions=regions,
                block_bytes=spec.block_bytes,
            )
        except Exception:
            engine.close()
            raise
        logger.info(
            "host-pool spill tier: %d blocks (%.1f MiB) in %s",
            spill_blocks,
            regions * spill_blocks * spec.block_bytes / 2**20,
            spill_path,
        )
        return cls(engine, store, layout, blocks, allocators, pending)

    def close(self) -> None:
        """Closes the engine (the anonymous spill file goes with it)."""
        self.engine.close()

    def reading(self, pool: jax.Array | None) -> None:
        """The pool that demotions read blocks from, the state's of the host call under
        way (None: the call is over; demotion then moves nothing and blocks are evicted)."""
        self._pool = pool

    # -- SpillPolicy ------------------------------------------------------------------------

    def can_demote(self) -> bool:
        return self._pool is not None

    def promotion_room(self, shared: list[int]) -> int:
        """Every spill block of ``shared`` is promoted: one free pool block each."""
        return sum(1 for block in shared if self.allocators.is_spilled(block))

    def admitted(self, prefix: PrefixIndex, shared: list[int]) -> list[int]:
        """Promotes every spill block of ``shared`` (the admitting slot its only user, with
        a free pool block for each); returns ``shared`` with their pool ids.

        Raises:
          RuntimeError: a spill block that could not be promoted (another slot maps it, or
            no pool block is free): it would reach a block table; nothing moved.
        """
        spilled = [b for b in shared if self.allocators.is_spilled(b)]
        shared_by_others = [b for b in spilled if prefix.refs(b) != 1]
        if shared_by_others or len(spilled) > self.allocators.dram.free_blocks:
            raise RuntimeError(
                f"tpusync: cannot promote spill blocks {spilled} into the pool (mapped by "
                f"other slots: {shared_by_others}; free pool blocks: "
                f"{self.allocators.dram.free_blocks}): a step reads only the pool"
            )
        return super().admitted(prefix, shared)

    def keep(self, prefix: PrefixIndex, blocks: list[int]) -> int:
        """Demotes those of pool ``blocks`` (a cancelled reservation's, in sequence order)
        that are indexed, mapped by no slot, and whose bytes no pool holds yet (promoted
        or imported by it: pending) to free spill blocks, with those pending bytes, instead
        of their leaving the index with the only copy; returns how many moved. Evicts
        nothing to make room (the first blocks of a chain move first); a failed write
        moves none (logged: the caller drops them, as without a spill tier)."""
        pending = self._pending_payloads(blocks)
        keys = [
            prefix.key_of(b)
            for b in blocks
            if b in pending and prefix.is_indexed(b) and prefix.refs(b) == 0
        ][: self.allocators.spill.free_blocks]
        if not keys:
            return 0
        try:
            self.move_to_spill(prefix, keys)
        except Exception as e:  # noqa: BLE001 - a cache's loss: the blocks are dropped.
            logger.warning(
                "keeping %d cancelled pending blocks in the spill tier: %s", len(keys), e
            )
            return 0
        return len(keys)

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if self.allocators.is_spilled(pairs[0][0]):
            self._promote(pairs)
        else:
            self._demote(pairs)

    # -- moves ------------------------------------------------------------------------------

    @property
    def _payload_bytes(self) -> int:
        return self.store.payload_bytes

    def _demote(self, pairs: list[tuple[int, int]]) -> None:
        """Pool blocks (from the pool under way, or their pending payloads) to spill
        blocks: one gather from the pool, one write to the file."""
        spec, layout = self.layout.spec, self.layout
        bt, rb, num_layers = spec.block_tokens, spec.row_bytes, spec.num_layers
        src = [s for s, _ in pairs]
        pending = self._pending_payloads(src)
        from_pool = [s for s in src if s not in pending]
        by_block = {}
        if from_pool:
            if self._pool is None:
                raise RuntimeError("tpusync: a host-pool block was demoted outside a host call")
            starts = np.asarray(
                [layout.block_row(layer, b) for b in from_pool for layer in range(num_layers)],
                np.int64,
            )
            rows = pool_blocks.gather_blocks(layout, None, self._pool, starts)
            # [n, layer, token, K|V, row bytes]: each block's rows as the pool holds them.
            pooled = rows[0].view(np.uint8).reshape(len(from_pool), num_layers, bt, 2, rb)
            by_block = dict(zip(from_pool, pooled))
        for block, payload in pending.items():
            by_block[block] = payload.reshape(num_layers, bt, 2, rb)
        size = self._payload_bytes
        buf = np.empty(len(pairs) * size, np.uint8)
        writes = []
        for j, (s, d) in enumerate(pairs):
            # -> [layer, K|V, token, row bytes]: the file's regions, in region order.
            buf[j * size : (j + 1) * size] = by_block[s].transpose(0, 2, 1, 3).reshape(-1)
            writes += self.store.block_rows(d - self.num_dram, j * size)
        self.engine.transfer(writes, buf, write=True)
        self._forget_pending(list(pending))

    def _promote(self, pairs: list[tuple[int, int]]) -> None:
        """Spill blocks to pool blocks: one read of the file; each block handed to the
        pool's block store, whose writes the admission's pool takes."""
        spec = self.layout.spec
        size = self._payload_bytes
        buf = np.empty(len(pairs) * size, np.uint8)
        reads = []
        for j, (s, _) in enumerate(pairs):
            reads += self.store.block_rows(s - self.num_dram, j * size)
        self.engine.transfer(reads, buf, write=False)
        regions = buf.reshape(len(pairs), spec.num_layers, 2, spec.block_tokens, spec.row_bytes)
        for (_, d), block in zip(pairs, regions):
            # -> [layer, token, K|V, row bytes]: a pool block's payload.
            self.blocks.write_block(d, np.ascontiguousarray(block.transpose(0, 2, 1, 3)))
