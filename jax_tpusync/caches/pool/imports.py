"""The blocks a host pool's reservations wrote that no pool holds yet: :class:`PendingImports`.

A reservation (:meth:`jax_tpusync.HostPoolKVCache.reserve`) takes no state, yet the slot
table may write blocks while it admits a slot: a prefix level's blocks it imports into the
prefix index, and for a pool of rings the copy of a cached window into the slot's fresh
ring. The block store keeps those writes (:class:`~jax_tpusync.caches.pool.blocks.PoolBlocks`);
this class holds them from the reservation until a pool takes them, and keeps the rules
that stop a slot from reading KV that is not its prefix's:

* **Every pending write goes into the first pool admitted.** A second reservation may map
  the blocks a first one imported (they are in the prefix index from the first one's
  reservation on) and be admitted before it, so :meth:`PendingImports.apply` writes all of
  them, not only the admitted slot's.
* **A cancelled reservation's imports leave the index** (:meth:`PendingImports.drop`):
  they were never written to a pool, and a later admission must not map them; unless
  another reservation maps them, whose admission will write them, or a spill tier takes
  them first (:meth:`~jax_tpusync.caches.pool.spill.PoolSpillTier.keep`, with their pending
  bytes).
* **A persistent tier is told at reservation time** (the ``imported`` callback): the
  blocks are indexed from then on, and a commit may checksum them before any admission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import numpy as np

from jax_tpusync.caches.pool.blocks import PoolBlocks
from jax_tpusync.caches.pool.windows import WindowCopyStore
from jax_tpusync.core.prefix import PrefixIndex

logger = logging.getLogger(__name__)

__all__ = ["PendingImports"]


class PendingImports:
    """The writes a host pool's reservations made (by block), until a pool takes them.

    Args:
      blocks: the pool's block store, whose writes a reservation makes.
      windows: a ring pool's store of cached windows (None: the pool keeps every
        position); the window copies it holds are pruned to the indexed ones around each
        reservation, since a ring's fill belongs to the pool, not to the index.
      imported: told the writes of each reservation as it records them (a persistent
        tier writes them; None: nothing to tell).
    """

    def __init__(
        self,
        blocks: PoolBlocks,
        windows: WindowCopyStore | None = None,
        imported: Callable[[dict[int, np.ndarray]], None] | None = None,
    ):
        self._blocks = blocks
        self._windows = windows
        self._imported = imported
        self._payloads: dict[int, np.ndarray] = {}  # block id -> payload, no pool holds it
        self._by_slot: dict[int, list[int]] = {}  # slot -> the block ids its reservation wrote

    def begin(self) -> None:
        """Before a reservation: forgets the writes no reservation took (a refused one's
        went through :meth:`refused`), so that :meth:`record` takes this one's alone."""
        self._blocks.take_writes()
        if self._windows is not None:
            self._windows.forget_unindexed()

    def record(self, slot: int) -> dict[int, np.ndarray]:
        """After the slot table admitted ``slot``: what it wrote since :meth:`begin` is
        pending, as ``slot``'s reservation's, and told to ``imported``; returns it."""
        imports = self._blocks.take_writes()
        if self._windows is not None:  # A ring's fill is in the imports: the pool's.
            self._windows.forget_unindexed()
        self._pend(imports)
        self._by_slot[slot] = list(imports)
        return imports

    def refused(self, prefix: PrefixIndex) -> None:
        """After the slot table refused a reservation: the blocks it imported before the
        refusal stay in ``prefix``, cached (a later admission may map them), so their
        writes are pending, as a cancelled reservation's that another maps, and the
        first admission's pool takes them; what else it wrote (blocks freed again) is
        forgotten. A ring pool's index holds its windows host-side: nothing is pending."""
        writes = self._blocks.take_writes()
        if self._windows is not None:
            self._windows.forget_unindexed()
            return
        self._pend({b: p for b, p in writes.items() if prefix.is_indexed(b)})

    def _pend(self, writes: dict[int, np.ndarray]) -> None:
        """``writes`` pending until a pool takes them, told to ``imported``."""
        if self._imported is not None and writes:  # Indexed now: a commit may hash them.
            self._imported(writes)
        self._payloads.update(writes)

    def drop(self, slot: int, prefix: PrefixIndex) -> None:
        """After ``slot``'s reservation was cancelled (its slot released): the blocks it
        wrote that no pool holds yet leave ``prefix`` (unpinned now, unless another slot
        maps them), and their payloads go with them once no slot maps them; a block
        another reservation maps stays pending for its admission."""
        pending = [b for b in self._by_slot.pop(slot, []) if b in self._payloads]
        if not pending:
            return
        dropped = set(pending)
        prefix.evict(len(dropped), where=lambda block: block in dropped)
        kept = 0
        for block in pending:
            if prefix.refs(block) == 0:  # Evicted and free (or a ring's): never written.
                del self._payloads[block]
            else:
                kept += 1
        logger.debug(
            "slot %d's reservation cancelled: %d of its pending blocks dropped, %d mapped "
            "by another reservation",
            slot,
            len(pending) - kept,
            kept,
        )

    def pending_of(self, slot: int) -> list[int]:
        """The blocks ``slot``'s reservation wrote that no pool holds yet, in the order it
        wrote them."""
        return [b for b in self._by_slot.get(slot, []) if b in self._payloads]

    def payloads_of(self, blocks: list[int]) -> dict[int, np.ndarray]:
        """The pending payloads of those of ``blocks`` that no pool holds yet (their bytes
        are these, not the pool's), by block."""
        return {b: self._payloads[b] for b in blocks if b in self._payloads}

    def forget(self, blocks: list[int]) -> None:
        """Drops the pending writes of ``blocks``: their bytes moved elsewhere (a spill
        tier) and the blocks are free, so no pool must receive them."""
        for block in blocks:
            self._payloads.pop(block, None)
        for slot, pending in self._by_slot.items():
            self._by_slot[slot] = [b for b in pending if b not in blocks]

    def apply(self, slot: int, pool: jax.Array) -> jax.Array:
        """At ``slot``'s admission: ``pool`` (donated) with every pending write in it, this
        reservation's and any other's (see the module); nothing is pending after."""
        self._by_slot.pop(slot, None)
        if not self._payloads:
            return pool
        payloads, self._payloads = self._payloads, {}
        return self._blocks.apply(pool, payloads)
