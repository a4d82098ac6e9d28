"""Two-level KV store: the cache's DRAM tier in front of a file tier (the *spill* tier).

A cache made with ``tier="host", spill_path=DIR, spill_blocks=N`` keeps two tiers on its
engine. The DRAM tier holds ``num_blocks`` KV blocks per (layer, K|V); every sequence's own
blocks are there (a sequence writes only its own blocks, and only to DRAM). The spill
tier, a file in ``DIR`` (local SSD or shared storage), holds ``N`` more blocks per
(layer, K|V) for prefix blocks (:mod:`jax_tpusync.core.prefix`) that DRAM had no room for. One
id space covers both in the block tables::

    ids [0, num_blocks)                          DRAM blocks
    ids [num_blocks, num_blocks + spill_blocks)  spill blocks (spill block id - num_blocks)

A block's table entry therefore says where it lives, and the step reads each block from
the tier that holds it: every staging unit issues one fetch per tier (the DRAM fetch
moves the unit's DRAM rows, the spill fetch its spill rows, into the same staging slot;
rows of the other tier are zero-byte segments, which the engine drops). Reading a shared
prefix in place costs no copy at admission, and a unit whose blocks are all in DRAM
costs one more custom call with nothing to move.

Movement between the tiers happens on the host, between steps, and only for blocks no
slot maps (or, for promotion, that only the admitting slot maps), so no table of a live
state ever names a block that moved:

* **Demotion**: when an admission needs DRAM blocks and none is free, the least recently
  used cached prefix blocks in DRAM are copied to free spill blocks (one read and one
  write for the batch) and their index entries re-pointed, instead of being evicted.
  Space on the spill tier is made by evicting its least recently used cached blocks
  (with their descendants, unreachable without them). A block is written to the spill
  tier when it is demoted, not on every reuse. Only when neither tier has room is a
  DRAM block evicted outright.
* **Promotion**: a spill block that ``promote_after`` admissions mapped (counted since it
  was demoted) is copied back into a free DRAM block at the next admission that maps it,
  if that slot is its only user; it never evicts or demotes anything to make room.

Both tiers' rows are checked against their own tier: a write-back segment whose position
maps a spill block is refused by the engine before any byte moves
(:data:`jax_tpusync.core.blocks.OTHER_LEVEL`), and so is a fetch of an id of neither tier.

Which blocks move, and when, is :class:`SpillPolicy`; how they move is its subclass's:
:class:`SpillTier` here (both tiers on the cache's engine), and a host pool's
:class:`~jax_tpusync.caches.pool.spill.PoolSpillTier` (the pool in the state, the file on an
engine of its own; its step reads only the pool, so every spill block an admission maps is
promoted, with room made for it first: :meth:`SpillPolicy.promotion_room`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jax_tpusync.core.blocks import LevelAllocators

if TYPE_CHECKING:
    from jax_tpusync.core.prefix import PrefixIndex
    from jax_tpusync.runtime.engine import Engine


class SpillPolicy:
    """Which cached blocks move between the DRAM tier and the spill tier, and when: the
    part of a two-level cache's spill mover that does not depend on where the two tiers'
    bytes are (see the module docstring). A subclass copies the blocks (:meth:`_copy`).

    Args:
      allocators: the cache's :class:`LevelAllocators`.
      promote_after: admissions mapping a spill block before it is promoted (None: never).
    """

    def __init__(self, *, allocators: LevelAllocators, promote_after: int | None):
        self.allocators = allocators
        self.promote_after = promote_after
        self.demoted = 0  # Blocks copied DRAM -> spill.
        self.promoted = 0  # Blocks copied spill -> DRAM.
        self.spill_hits = 0  # Blocks admissions mapped on the spill tier.

    @property
    def num_dram(self) -> int:
        return self.allocators.dram.num_blocks

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every region of each (source id, destination id) block (table ids: one
        side of each pair a DRAM id, the other a spill id)."""
        raise NotImplementedError

    def promotion_room(self, shared: list[int]) -> int:
        """Free DRAM blocks an admission mapping ``shared`` needs besides its own, for the
        spill blocks it must promote (made free, by demotion or eviction, before the
        admission maps anything). 0: promotion takes only blocks that are free anyway."""
        return 0

    def intact(self, prefix: PrefixIndex, shared: list[int]) -> list[int]:
        """The leading blocks of ``shared`` (an admission's match, pinned, in sequence
        order) whose bytes can be mapped. A tier that checks its blocks stops before the
        first damaged or missing one, unpins the rest and drops that block and its
        descendants from the index (a miss: the caller recomputes those rows); any other
        failure raises, changing nothing. Here: all of them (both tiers on the cache's
        engine, read in place)."""
        return shared

    def can_demote(self) -> bool:
        """Whether DRAM blocks' bytes can be read now (False: :meth:`demote` moves nothing,
        and the slot table evicts instead)."""
        return True

    # -- moves --------------------------------------------------------------------------------

    def _spill_room(self, prefix: PrefixIndex, count: int) -> int:
        """Frees spill blocks (evicting cached ones, least recently used first) until
        ``count`` are free or none is left to evict; returns the free count."""
        spill = self.allocators.spill
        short = count - spill.free_blocks
        if short > 0:
            prefix.evict(short, where=self.allocators.is_spilled)
        return spill.free_blocks

    def demote(self, prefix: PrefixIndex, want_free: int) -> None:
        """Moves cached DRAM prefix blocks to the spill tier, least recently used first,
        until ``want_free`` DRAM blocks are free or nothing more can move."""
        dram, in_dram = self.allocators.dram, self.allocators.in_dram
        if not self.can_demote():
            return
        while dram.free_blocks < want_free:
            if not prefix.cached_where(in_dram, 1):
                return
            room = self._spill_room(prefix, want_free - dram.free_blocks)
            # Making room may have evicted DRAM blocks too (descendants of evicted ones).
            short = want_free - dram.free_blocks
            cached = prefix.cached_where(in_dram, min(short, room))
            if not cached or short <= 0:
                return
            # In DRAM id order: a sequence's blocks stay consecutive on the spill tier (one
            # segment per unit), whatever order the LRU list gives them.
            cached.sort(key=prefix.block_of)
            self.move_to_spill(prefix, cached)

    def move_to_spill(self, prefix: PrefixIndex, keys: list[bytes]) -> None:
        """Copies the cached DRAM blocks of ``keys`` to as many free spill blocks (there
        must be that many) and re-points their entries there; a failed copy moves none
        (raised). :meth:`demote` chooses the blocks; a subclass may move others (a host
        pool's cancelled reservation's)."""
        dst = self.allocators.spill.allocate(len(keys)) + self.num_dram
        src = [prefix.block_of(k) for k in keys]
        try:
            self._copy(list(zip(src, dst.tolist())))
        except Exception:
            self.allocators.spill.free(dst - self.num_dram)
            raise
        for key, block in zip(keys, dst.tolist()):
            prefix.move(key, block)
        self.allocators.dram.free(np.asarray(src, np.int64))
        self.demoted += len(keys)

    def admitted(self, prefix: PrefixIndex, shared: list[int]) -> list[int]:
        """Counts the spill blocks an admission maps and promotes those due (into free DRAM
        blocks, when the admitting slot is their only user); returns ``shared`` with the
        promoted blocks' new ids."""
        out = list(shared)
        spilled = [i for i, block in enumerate(out) if self.allocators.is_spilled(block)]
        due = []
        for i in spilled:
            entry = prefix.entry(out[i])
            if (
                self.promote_after is not None
                and entry.spill_hits + 1 >= self.promote_after  # Counting this admission.
                and entry.refs == 1
            ):
                due.append(i)
        due = due[: self.allocators.dram.free_blocks]
        if due:
            dst = self.allocators.dram.allocate(len(due))
            src = [out[i] for i in due]
            try:
                self._copy(list(zip(src, dst.tolist())))
            except Exception:
                self.allocators.dram.free(dst)
                raise  # Nothing counted: the admission is refused.
        # Counted once the copy is made (a promoted block's count restarts at its move).
        self.spill_hits += len(spilled)
        for i in spilled:
            prefix.entry(out[i]).spill_hits += 1
        if not due:
            return out
        for i, block in zip(due, dst.tolist()):
            prefix.move(prefix.key_of(out[i]), block)
            out[i] = block
        self.allocators.spill.free(np.asarray(src, np.int64) - self.num_dram)
        self.promoted += len(due)
        return out

    def stats(self) -> dict:
        return dict(
            spill_free_blocks=self.allocators.spill.free_blocks,
            demoted=self.demoted,
            promoted=self.promoted,
            spill_hits=self.spill_hits,
        )


class SpillTier(SpillPolicy):
    """The spill tier of one engine cache and the moves between it and the DRAM tier, both
    tiers on the cache's engine.

    Args:
      engine: the cache's engine.
      dram_tier, spill_tier: the two tiers' indices on it.
      dram_first, spill_first: the first tier block of the cache's allocation on each.
      allocators: the cache's :class:`LevelAllocators`.
      regions: (layer, K|V) regions per block (``num_layers * 2``).
      block_bytes: bytes of one block of one region.
      promote_after: admissions mapping a spill block before it is promoted (None: never).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        dram_tier: int,
        spill_tier: int,
        dram_first: int,
        spill_first: int,
        allocators: LevelAllocators,
        regions: int,
        block_bytes: int,
        promote_after: int | None,
    ):
        super().__init__(allocators=allocators, promote_after=promote_after)
        self.engine = engine
        self.dram_tier, self.spill_tier = dram_tier, spill_tier
        self.dram_first, self.spill_first = dram_first, spill_first
        self.regions = regions
        self.block_bytes = block_bytes

    def locate(self, region: int, block: int) -> tuple[int, int]:
        """(tier, tier byte offset) of table id ``block`` in ``region`` (layer * 2 + K|V)."""
        if block >= self.num_dram:
            local = block - self.num_dram
            n, first, tier = self.allocators.spill.num_blocks, self.spill_first, self.spill_tier
        else:
            local, n, first, tier = block, self.num_dram, self.dram_first, self.dram_tier
        return tier, (first + region * n + local) * self.block_bytes

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every region of each (source id, destination id) block, one read of all
        sources and one write of all destinations."""
        size = self.regions * self.block_bytes
        buf = np.empty(len(pairs) * size, np.uint8)
        reads, writes = [], []
        for j, (src, dst) in enumerate(pairs):
            for region in range(self.regions):
                mem = j * size + region * self.block_bytes
                reads.append((*self.locate(region, src), mem, self.block_bytes))
                writes.append((*self.locate(region, dst), mem, self.block_bytes))
        self.engine.transfer(reads, buf, write=False)
        self.engine.transfer(writes, buf, write=True)
