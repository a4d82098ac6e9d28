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

Every block written to the file gets an xxh3-64 checksum of its bytes (kept in memory: the
file is this cache's alone and dies with it), checked when the block is read back for
promotion, before any of its bytes reach the pool. A spilled block whose bytes do not match,
or that a truncated file no longer holds, is a miss (:meth:`PoolSpillTier.intact`): it and
the chain after it leave the index, ``spill_damaged`` in the prefix stats counts it, and the
admission maps the shorter prefix before it (the caller computes the rest); any other read
failure refuses the admission, changing nothing.

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
import xxhash

from jax_tpusync.caches.pool import blocks as pool_blocks
from jax_tpusync.core.blocks import LevelAllocators
from jax_tpusync.core.levels import TierBlocks
from jax_tpusync.core.pool_state import PoolLayout
from jax_tpusync.core.prefix import PrefixIndex
from jax_tpusync.core.spill import SpillPolicy
from jax_tpusync.runtime.engine import Engine, TierDataLossError

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
        # xxh3-64 of each spill block's bytes as written (by spill block id).
        self._sums = np.zeros(store.num_blocks, np.uint64)
        # Bytes of spill blocks :meth:`intact` read and checked, for the promotion that
        # follows (by spill block id; a block written since is taken out).
        self._checked: dict[int, np.ndarray] = {}
        self.damaged = 0  # Spilled blocks found damaged or missing: misses.
        # The file was found truncated: no block is written to it again (evicted instead).
        self.truncated = False

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
        return self._pool is not None and not self.truncated

    def demote(self, prefix: PrefixIndex, want_free: int) -> None:
        """As :meth:`SpillPolicy.demote`; a write that meets a truncated file moves nothing
        and ends demotion for good (the slot table evicts instead)."""
        try:
            super().demote(prefix, want_free)
        except TierDataLossError as e:  # The file no longer holds the bytes.
            self._lost(e)

    def _lost(self, error: Exception) -> None:
        if not self.truncated:
            logger.warning("host-pool spill file truncated (%s): no more demotion", error)
        self.truncated = True

    def intact(self, prefix: PrefixIndex, shared: list[int]) -> list[int]:
        """Reads and checks every spill block of ``shared`` (one read); returns ``shared``
        up to its first block that is damaged (its checksum does not match) or missing (the
        file was truncated), that block and the chain after it unpinned and dropped from
        the index (counted in ``spill_damaged``). The bytes read are kept for the promotion.

        Raises:
          Exception: a read that failed otherwise (the engine's error); nothing changed.
        """
        self._checked = {}
        spilled = [(i, b - self.num_dram) for i, b in enumerate(shared) if b >= self.num_dram]
        if not spilled:
            return shared
        payloads = self._read([b for _, b in spilled])
        good = {}
        damaged_at = None
        for (i, block), payload in zip(spilled, payloads):
            if payload is None or xxhash.xxh3_64_intdigest(payload) != int(self._sums[block]):
                damaged_at = i
                break
            good[block] = payload
        self._checked = good
        if damaged_at is None:
            return shared
        key = prefix.key_of(shared[damaged_at])
        prefix.unpin(shared[damaged_at:])
        # Pinned by no one else (a pool's mapped blocks are promoted, never spilled): if
        # another call pins it still, it stays indexed for that call to find it damaged.
        dropped = prefix.drop(key) if prefix.refs(shared[damaged_at]) == 0 else []
        for block in dropped:
            self._checked.pop(block - self.num_dram, None)
        self.damaged += 1
        logger.warning(
            "host-pool spill block %d is damaged or missing (%s): dropped with the %d "
            "blocks chained after it; a miss",
            shared[damaged_at] - self.num_dram,
            "missing" if payloads[len(good)] is None else "checksum mismatch",
            max(len(dropped) - 1, 0),
        )
        return shared[:damaged_at]

    def _read(self, spill_ids: list[int]) -> list[np.ndarray | None]:
        """The file's bytes of each spill block (None: past the end of a truncated file),
        in one read; block by block, in order, after a read that met a truncation."""
        size = self._payload_bytes
        buf = np.empty(len(spill_ids) * size, np.uint8)
        reads = []
        for j, block in enumerate(spill_ids):
            reads += self.store.block_rows(block, j * size)
        try:
            self.engine.transfer(reads, buf, write=False)
            return [buf[j * size : (j + 1) * size] for j in range(len(spill_ids))]
        except TierDataLossError:
            pass  # Some block is past the file's end: find which, one by one.
        out: list[np.ndarray | None] = []
        for block in spill_ids:
            one = np.empty(size, np.uint8)
            try:
                self.engine.transfer(self.store.block_rows(block, 0), one, write=False)
            except TierDataLossError as e:
                self._lost(e)
                out.append(None)
                break  # The chain after a missing block is dropped with it.
            out.append(one)
        return out

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

    def stats(self) -> dict:
        return dict(super().stats(), spill_damaged=self.damaged)

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
            payload = buf[j * size : (j + 1) * size]
            payload[:] = by_block[s].transpose(0, 2, 1, 3).reshape(-1)
            self._sums[d - self.num_dram] = xxhash.xxh3_64_intdigest(payload)
            self._checked.pop(d - self.num_dram, None)
            writes += self.store.block_rows(d - self.num_dram, j * size)
        self.engine.transfer(writes, buf, write=True)
        self._forget_pending(list(pending))

    def _promote(self, pairs: list[tuple[int, int]]) -> None:
        """Spill blocks to pool blocks: the bytes :meth:`intact` read and checked (the rest
        read now, in one read, and checked); each block handed to the pool's block store,
        whose writes the admission's pool takes.

        Raises:
          RuntimeError: a block read now whose checksum does not match; nothing moved.
        """
        spec = self.layout.spec
        src = [s - self.num_dram for s, _ in pairs]
        unread = [b for b in src if b not in self._checked]
        payloads = dict(self._checked)
        if unread:
            for block, payload in zip(unread, self._read(unread)):
                if payload is None or xxhash.xxh3_64_intdigest(payload) != int(self._sums[block]):
                    raise RuntimeError(
                        f"tpusync: host-pool spill block {block} is damaged or missing: not "
                        f"promoted"
                    )
                payloads[block] = payload
        for block in src:
            self._checked.pop(block, None)
        for (_, d), block in zip(pairs, src):
            # -> [layer, token, K|V, row bytes]: a pool block's payload.
            regions = payloads[block].reshape(spec.num_layers, 2, spec.block_tokens, spec.row_bytes)
            self.blocks.write_block(d, np.ascontiguousarray(regions.transpose(0, 2, 1, 3)))
