"""The slot table: which blocks each sequence holds, and every decision about blocks.

Host-side only (no jit, no engine): per slot a block table row, a capacity and a count of
leading blocks mapped read-only from the prefix index; the allocators of every level; the
prefix index; and the eviction policy, in one place:

* **Demote before evicting.** When a reservation needs more DRAM blocks than are free, a
  two-level cache first moves cached prefix blocks to its spill level (least recently used
  first, through the ``mover``), and only then evicts cached blocks (least recently used
  first, leaves before their parents) — never a block a slot maps.
* **Validate and reserve first, then apply.** :meth:`SlotTable.admit` and
  :meth:`SlotTable.release` check every argument and reserve every block before they change
  a table; a refused call leaves the tables, capacities, allocators and pins as they were.
  (Blocks imported from a remote level during a refused admit stay indexed as cached
  blocks: content, not a slot's state.)

The bytes behind the blocks are the caller's: the slot table reaches them only through the
small interfaces of :mod:`jax_tpusync.core.levels` (a ``BlockStore`` that reads and writes whole
blocks, ``RemoteLevel`` s holding published blocks by key, a ``SpillMover``), so it is tested
with fakes of those, without an engine (``tests/core/test_slot_table.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_tpusync.core import blocks, prefix, window_ring
from jax_tpusync.core.history import TokenHistory
from jax_tpusync.core.levels import BlockStore, InPlaceRemoteLevel, RemoteLevel, SpillMover
from jax_tpusync.core.window_prefix import WindowIndex

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Admission:
    """What :meth:`SlotTable.admit` gave a slot: ``cached`` tokens already on the tier
    (its mapped prefix), out of a ``capacity`` of tokens."""

    slot: int
    cached: int
    capacity: int


class SlotTable:
    """Block tables, capacities, allocators, the prefix index and the eviction policy.

    Args:
      batch: slots.
      max_len: tokens a slot may hold at most.
      block_tokens: token rows per block.
      num_blocks: DRAM (first-level) blocks per (layer, K|V).
      root: the prefix index's root key (salt, geometry, dtype, layout).
      spill_blocks: blocks of a second level behind DRAM (0: none).
      store: reads and writes whole blocks (for remote imports and exports); None: no
        remote level may be used.
      remote_levels: levels past the local index that hold published blocks by key (a
        shared directory, ...), searched in order by :meth:`admit` and published to by
        :meth:`release`.
      before_reuse: called before a block that the last commit may index is handed out
        (a persistent cache writes that commit again without the evicted blocks: see
        :meth:`jax_tpusync.persist.commit.Persistence.note_evicted` for why it cannot wait).
      before_release: called with a slot before its private blocks are freed.
      ring_blocks: a cache of one sliding window whose slots keep only it: each slot
        holds this many blocks whatever its capacity, its table row tiled over them (see
        :mod:`jax_tpusync.core.window_ring`); its blocks are never shared with the prefix index.
        0: a slot holds the blocks of its capacity.
      window: a ring cache's sliding window: its cached prefixes are kept as the blocks
        their windows can see, copies in a :class:`~jax_tpusync.core.window_prefix.WindowIndex`
        (:meth:`publish_window`), which an admission copies into its ring.
    """

    def __init__(
        self,
        *,
        batch: int,
        max_len: int,
        block_tokens: int,
        num_blocks: int,
        root: bytes,
        spill_blocks: int = 0,
        store: BlockStore | None = None,
        remote_levels: Sequence[RemoteLevel] = (),
        before_reuse: Callable[[], None] | None = None,
        before_release: Callable[[int], None] | None = None,
        ring_blocks: int = 0,
        window: int | None = None,
    ):
        self.batch = batch
        self.ring_blocks = ring_blocks
        self.windows = WindowIndex(block_tokens, window) if ring_blocks else None
        # A ring slot's blocks published so far, and its first row ever written (rows
        # before it were not, and a block holding one is never published).
        self._published = np.zeros(batch, np.int64)
        self._written_from = np.zeros(batch, np.int64)
        self.max_len = max_len
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.max_blocks = -(-max_len // block_tokens)
        self.dram = blocks.BlockAllocator(num_blocks)
        self.allocators: Any = self.dram
        if spill_blocks:
            self.allocators = blocks.LevelAllocators(self.dram, blocks.BlockAllocator(spill_blocks))
        self.prefix = prefix.PrefixIndex(self.allocators, block_tokens, root)
        self.store = store
        self.remote_levels = tuple(remote_levels)
        self.mover: SpillMover | None = None
        self._before_reuse = before_reuse or (lambda: None)
        self._before_release = before_release or (lambda slot: None)
        self._tables = np.full((batch, self.max_blocks), blocks.NO_BLOCK, np.int32)
        self._capacity = np.zeros(batch, np.int32)
        self._shared = np.zeros(batch, np.int32)  # Leading blocks mapped from the index.
        self.history = TokenHistory(batch)  # Each slot's token ids (see jax_tpusync.core.history).
        self.publish_failures = 0  # Remote publishes that failed (release went on).
        # Blocks something outside this table may still write (a remote level's call that
        # passed its deadline, a peer's late writes), each run with the test that says it
        # no longer can: freed once it passes.
        self._held_aside: list[tuple[np.ndarray, Callable[[], bool]]] = []

    def use_mover(self, mover: SpillMover) -> None:
        """The mover of blocks between the two levels of a two-level cache."""
        self.mover = mover

    # -- reading ----------------------------------------------------------------------------

    @property
    def tables(self) -> np.ndarray:
        """int32[batch, max_blocks]: each slot's blocks (-1: none); a copy."""
        return self._tables.copy()

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each slot may hold (0: inactive); a copy."""
        return self._capacity.copy()

    @property
    def shared(self) -> np.ndarray:
        """int32[batch]: leading blocks each slot maps read-only from the prefix index."""
        return self._shared.copy()

    @property
    def free_blocks(self) -> int:
        """DRAM blocks that neither a slot nor the prefix index holds."""
        return self.dram.free_blocks

    def blocks_for(self, max_tokens: int) -> int:
        """Blocks a slot admitted for ``max_tokens`` tokens holds."""
        n = -(-max_tokens // self.block_tokens)
        return min(n, self.ring_blocks) if self.ring_blocks else n

    def held_blocks(self, slot: int) -> np.ndarray:
        """The distinct blocks ``slot``'s table names, in table order (a ring's once)."""
        row = self._tables[slot]
        row = row[row >= 0]
        if self.ring_blocks:  # The table repeats the ring; a short slot's ring is shorter.
            return row[: self.blocks_for(int(self._capacity[slot]))]
        return row

    def _set_row(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        self._tables[slot] = blocks.NO_BLOCK
        if self.ring_blocks and len(ids):
            self._tables[slot] = window_ring.tiled_table(np.asarray(ids), self.max_blocks)
        else:
            self._tables[slot, : len(ids)] = ids

    def table_row(self, slot: int) -> np.ndarray:
        """int32[max_blocks]: ``slot``'s blocks (a view: do not modify)."""
        return self._tables[slot]

    def is_active(self, slot: int) -> bool:
        return bool(self._capacity[slot] > 0)

    def shared_tokens(self, slot: int) -> int:
        """Tokens of ``slot``'s read-only prefix: rows a step or load must not write."""
        return int(self._shared[slot]) * self.block_tokens

    def check_slot(self, slot: Any) -> None:
        if not _is_int(slot) or not 0 <= slot < self.batch:
            raise ValueError(f"slot={slot!r} must be an int in [0, batch={self.batch})")

    def check_lengths(self, lengths: np.ndarray, capacity: np.ndarray | None = None) -> None:
        """Refuses ``lengths`` (int[batch]) that a fresh state of the slots cannot hold:
        each at least its slot's shared prefix (blocks other sequences read: decode would
        write them) and in ``[0, capacity]`` (0 for an inactive slot). ``capacity``
        (int[batch]): the slots' capacities once admitted as a caller will (default: as
        they are)."""
        capacity = self._capacity if capacity is None else capacity
        for b in range(self.batch):
            shared = self.shared_tokens(b)
            if lengths[b] < shared:
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} is below slot {b}'s shared prefix of "
                    f"{shared} tokens (blocks other sequences read: decode would write them)"
                )
            if not 0 <= lengths[b] <= capacity[b]:
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} must be in [0, {int(capacity[b])}]"
                    f" (slot {b}'s capacity"
                    + (", inactive: admit it first)" if capacity[b] == 0 else ")")
                )

    def stats(self) -> dict:
        """The prefix index's counts, each remote level's and the spill mover's."""
        p = self.prefix
        out = dict(
            indexed_blocks=len(p), cached_blocks=p.cached_blocks, hits=p.hits, evictions=p.evictions
        )
        for level in self.remote_levels:
            out.update(level.stats())
        if self.remote_levels:
            out["shared_publish_failures"] = self.publish_failures
            out["blocks_held_aside"] = sum(len(held) for held, _ in self._held_aside)
        if self.mover is not None:
            out.update(self.mover.stats())
        if self.windows is not None:
            w = self.windows
            out.update(window_blocks=len(w), window_hits=w.hits, window_evictions=w.evictions)
        return out

    # -- the eviction policy ----------------------------------------------------------------

    def can_make_room(self, count: int) -> bool:
        """Whether :meth:`make_room` of ``count`` would succeed: that many DRAM blocks are
        free, or cached ones (window copies in a ring cache) make up the rest. Moves no
        block (it frees the blocks held aside that may be freed, as any allocation does)."""
        if self._held_aside:
            self.free_settled()
        short = count - self.dram.free_blocks
        if short <= 0:
            return True
        if self.windows is not None:  # A ring cache's cached blocks are window copies.
            return len(self.windows) >= short
        return len(self._evictable(short)) >= short

    def make_room(self, count: int) -> bool:
        """Whether ``count`` DRAM blocks are free, after demoting (two-level) or evicting
        cached prefix blocks if not. When even that would not free enough, nothing is
        demoted or evicted (a refused admission leaves the index as it was)."""
        if not self.can_make_room(count):
            return False
        short = count - self.dram.free_blocks
        if short <= 0:
            return True
        if self.windows is not None:
            self.dram.free(np.asarray(self.windows.evict(short), np.int64))
            return True
        if self.mover is not None:
            self.mover.demote(self.prefix, count)
        short = count - self.dram.free_blocks
        if short > 0:
            self.prefix.evict(short, where=self._in_dram)
        return count <= self.dram.free_blocks

    def _in_dram(self, block: int) -> bool:
        return self.mover is None or self.allocators.in_dram(block)

    def _evictable(self, limit: int) -> list[bytes]:
        """Keys of up to ``limit`` cached DRAM blocks that eviction (or demotion) can free."""
        return self.prefix.cached_where(self._in_dram, limit)

    def _allocate(self, count: int, keep_free: int = 0) -> np.ndarray:
        """``count`` fresh DRAM blocks, room made first for them and ``keep_free`` more
        (left free for the caller); raises naming the shortfall."""
        if not self.make_room(count + keep_free):
            cached = self.prefix.cached_blocks
            evictable = (
                "none is left to evict"
                if not cached
                else f"evicting all {cached} cached prefix blocks would not make up the rest"
            )
            raise ValueError(
                f"needs {count + keep_free} KV blocks but only {self.dram.free_blocks} of "
                f"{self.num_blocks} are free and {evictable} (the others are "
                f"held by active slots{', or pinned prefix blocks' if len(self.prefix) else ''}); "
                f"release a slot, or make the cache with more num_blocks"
            )
        self._before_reuse()  # An evicted block the last commit indexes: commit it gone.
        return self.dram.allocate(count)

    # -- transactions -----------------------------------------------------------------------

    def check_admit(self, slot: Any, max_tokens: Any, tokens: Any) -> tuple[int, np.ndarray | None]:
        """``(max_tokens, token ids)`` of an admission, checked; changes nothing."""
        self.check_slot(slot)
        if max_tokens is None:
            max_tokens = self.max_len
        if not _is_int(max_tokens) or not 1 <= max_tokens <= self.max_len:
            raise ValueError(
                f"max_tokens={max_tokens!r} must be an int in [1, max_len={self.max_len}]"
            )
        if self._capacity[slot] > 0:
            raise ValueError(
                f"slot {slot} is active (capacity {int(self._capacity[slot])} tokens); "
                f"release it before admitting another sequence"
            )
        ids = None
        if tokens is not None:
            ids = prefix.token_ids(tokens)
            if len(ids) > max_tokens:
                raise ValueError(f"tokens has {len(ids)} ids, more than max_tokens={max_tokens}")
        return int(max_tokens), ids

    def admit(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Any = None,
        *,
        max_cached: int | None = None,
    ) -> Admission:
        """Gives ``slot`` blocks for ``max_tokens`` tokens, its longest cached prefix of
        ``tokens`` (at most ``len(tokens) - 1`` tokens, whole blocks) mapped read-only
        from the local index, then from the remote levels; the rest fresh. ``max_cached``
        caps the mapped prefix (tokens; a mesh cache gives every head shard the same).

        All or nothing: a refusal (bad argument, active slot, too few blocks, a failed
        import) unpins what it pinned and frees what it took.
        """
        max_tokens, ids = self.check_admit(slot, max_tokens, tokens)
        if self.ring_blocks:
            return self._admit_ring(slot, max_tokens, ids, max_cached)
        shared: list[int] = []
        hits = 0  # Counted by the index's lookup: not hits if the admission is refused.
        try:
            if ids is not None and not self.ring_blocks:  # A ring's blocks are its own.
                limit = max(len(ids) - 1, 0) // self.block_tokens
                if max_cached is not None:
                    limit = min(limit, max_cached // self.block_tokens)
                shared = self.prefix.match(ids, limit)
                hits = len(shared)
                if self.mover is not None and shared:
                    # A damaged spilled block is a miss: the prefix stops before it.
                    intact = self.mover.intact(self.prefix, shared)
                    self.prefix.hits -= hits - len(intact)
                    shared = intact
                    hits = len(shared)
                shared += self._import(ids, len(shared), limit)
            n = self.blocks_for(max_tokens)
            # Blocks the mover must promote take free DRAM blocks too (made free here, so
            # that a refusal comes before anything maps or moves).
            promoting = 0 if self.mover is None else self.mover.promotion_room(shared)
            fresh = self._allocate(n - len(shared), keep_free=promoting)
        except Exception:
            self.prefix.unpin(shared)
            self.prefix.hits -= hits
            raise
        if self.mover is not None and shared:
            try:
                shared = self.mover.admitted(self.prefix, shared)
            except Exception:
                self.prefix.unpin(shared)
                self.prefix.hits -= hits
                self.dram.free(fresh)
                raise
        self._set_row(slot, np.concatenate([np.asarray(shared, np.int32), fresh]).astype(np.int32))
        self._capacity[slot] = max_tokens
        self._shared[slot] = len(shared)
        self.history.set(slot, [] if ids is None else ids)
        return Admission(slot, len(shared) * self.block_tokens, max_tokens)

    def _admit_ring(
        self, slot: int, max_tokens: int, ids: np.ndarray | None, max_cached: int | None
    ) -> Admission:
        """A ring slot: fresh blocks; with ``ids``, the window of their longest cached
        prefix (:class:`WindowIndex`) copied in, so the slot starts at that length."""
        cached, payloads, first = 0, [], 0
        if ids is not None and self.store is not None:
            t = self.block_tokens
            limit = max(len(ids) - 1, 0) // t
            if max_cached is not None:
                limit = min(limit, max_cached // t)
            keys = self.prefix.keys(ids)
            parents = [self.prefix.root, *keys[:-1]]
            cached, found = self.windows.lookup(keys, parents, ids, limit)
            if cached < limit * t and self._import_window(keys, ids, limit):
                cached, found = self.windows.lookup(keys, parents, ids, limit)
            if found:  # Read before allocating: the allocation may evict them.
                payloads = self.store.read_blocks(found)
                first = cached // t - len(found)
        n = self.blocks_for(max_tokens)
        try:
            fresh = self._allocate(n)  # Raises, changing no table.
        except Exception:
            self.windows.hits -= len(payloads)  # Not hits: the admission is refused.
            raise
        for j, payload in enumerate(payloads):
            self.store.write_block(int(fresh[(first + j) % n]), payload)
        self._set_row(slot, fresh)
        self._capacity[slot] = max_tokens
        self._shared[slot] = 0
        self._published[slot] = cached // self.block_tokens
        self._written_from[slot] = first * self.block_tokens
        self.history.set(slot, [] if ids is None else ids)
        return Admission(slot, cached, max_tokens)

    def publish_window(self, slot: int, length: int, ids: np.ndarray | None = None) -> int:
        """Copies ``slot``'s full blocks that it completed since its last publish (of its
        ``length`` rows, the tokens ``ids`` or its recorded history) into the window index,
        while its ring still holds them; returns the blocks copied. A block whose rows the
        ring no longer holds (or never had) is passed over; one indexed already is kept.
        Stops quietly when no block is free (publishing is a courtesy to later requests).
        The caller has let the slot's write-backs be submitted (the engine orders this
        read after them)."""
        if not self.ring_blocks or self.store is None or not self.is_active(slot):
            return 0
        if ids is None:
            ids = self.history.ids(slot)
        t = self.block_tokens
        full = min(length, len(ids)) // t
        start = int(self._published[slot])
        if full <= start:
            return 0
        keys = self.prefix.keys(ids[: full * t])
        oldest = (length - 1) // t - self.blocks_for(int(self._capacity[slot])) + 1
        fresh = [
            i
            for i in range(start, full)
            if keys[i] not in self.windows and i >= oldest and i * t >= self._written_from[slot]
        ]
        self._published[slot] = full
        if not fresh:
            return 0
        # One read for all of them (the ring's own blocks: no eviction below touches them).
        payloads = self.store.read_blocks([int(self._tables[slot, i]) for i in fresh])
        copied = []
        for i, payload in zip(fresh, payloads):
            if not self.make_room(1):
                break
            block = int(self.dram.allocate(1)[0])
            self.store.write_block(block, payload)
            parent = keys[i - 1] if i else self.prefix.root
            self.windows.put(keys[i], parent, ids[i * t : (i + 1) * t], block)
            copied.append((keys[i], keys[i - 1] if i else None, ids[i * t : (i + 1) * t], block))
        self._export_blocks(copied)  # Whole blocks of the chain, as a release publishes them.
        return len(copied)

    def share_computed(self, slot: int, length: int) -> int:
        """Indexes active ``slot``'s full blocks below its ``length`` rows (whose writes have
        completed) under its recorded token ids, as soon as they are computed instead of at
        :meth:`release`; returns how many blocks were indexed now.

        Each block indexed is pinned by the slot and joins its read-only shared prefix
        (:meth:`shared_tokens`): a later :meth:`admit` of the same prefix maps it, eviction
        never takes it while a slot maps it, and its writer only appends past it (its
        release unpins it, as it unpins the blocks it mapped). Only whole blocks of rows
        the slot holds and ids it recorded are indexed: a block being filled never is.
        Stops at a block another sequence indexed first (this slot keeps its copy, freed
        at release as a duplicate). A ring slot's blocks are never shared (0; see
        :meth:`publish_window`). Remote levels get the blocks at release, as before.

        Raises:
          ValueError: a bad slot, an inactive one, or a ``length`` that is not an int in
            ``[0, capacity]``; nothing changes.
        """
        self.check_slot(slot)
        capacity = int(self._capacity[slot])
        if capacity == 0:
            raise ValueError(f"slot {slot} is not active (nothing to share)")
        if not _is_int(length) or not 0 <= length <= capacity:
            raise ValueError(
                f"length={length!r} must be an int in [0, capacity={capacity}] of slot {slot}"
            )
        if self.ring_blocks:
            return 0
        t = self.block_tokens
        ids = self.history.ids(slot)
        full = min(int(length), len(ids)) // t
        start = int(self._shared[slot])
        if full <= start:
            return 0
        count = self.prefix.share(ids[: full * t], self._tables[slot, :full], start)
        self._shared[slot] = start + count
        return count

    def note_written(self, slot: int, start: int) -> None:
        """A host-side write put rows from ``start`` into ring ``slot`` (rows before it are
        no longer known to be the sequence's: they are not published)."""
        if self.ring_blocks and start > self._written_from[slot]:
            self._written_from[slot] = start

    def place(self, slot: int, block_ids: Sequence[int], capacity: int) -> None:
        """Admits inactive ``slot`` onto exactly ``block_ids`` (taken from the free DRAM
        blocks; refused, changing nothing, if one is not free) for ``capacity`` tokens:
        tables an allocator with another history would have made (tests, tools)."""
        self.check_slot(slot)
        ids = [int(b) for b in block_ids]
        if self._capacity[slot] > 0:
            raise ValueError(f"slot {slot} is active; release it first")
        if self.ring_blocks and len(ids) != self.blocks_for(capacity):
            raise ValueError(
                f"{len(ids)} blocks given for a ring of {self.blocks_for(capacity)} blocks "
                f"(capacity {capacity})"
            )
        if len(ids) > self.max_blocks:
            raise ValueError(
                f"{len(ids)} blocks given, more than a slot's table holds "
                f"(max_blocks={self.max_blocks})"
            )
        most = self.max_len if self.ring_blocks else len(ids) * self.block_tokens
        if not 1 <= capacity <= min(self.max_len, most):
            raise ValueError(
                f"capacity={capacity} must be in [1, {min(self.max_len, most)}]"
                f" (max_len, and the {len(ids)} blocks given)"
            )
        self.dram.reserve(ids)
        self._set_row(slot, ids)
        self._capacity[slot] = capacity
        self._shared[slot] = 0
        self.history.clear(slot)

    def check_admit_all(self) -> None:
        """Refuses, changing nothing, an :meth:`admit_all` that could not make room for
        every inactive slot's ``max_len`` tokens (raises naming the blocks it needs)."""
        empty = np.count_nonzero(self._capacity == 0)
        need = int(empty) * self.blocks_for(self.max_len)
        if not self.can_make_room(need):
            raise ValueError(
                f"init() admits every slot for max_len={self.max_len} tokens, which needs "
                f"{need} KV blocks, but {self.dram.free_blocks} of "
                f"{self.num_blocks} are free; call init(admit=False) and admit() "
                f"slots with smaller max_tokens"
            )

    def admit_all(self) -> None:
        """Admits every inactive slot for ``max_len`` tokens, or none (raises naming the
        blocks it would need)."""
        self.check_admit_all()
        for b in np.flatnonzero(self._capacity == 0).tolist():
            self.admit(b, self.max_len)

    def check_release(self, slot: Any, length: int, tokens: Any) -> np.ndarray | None:
        """The token ids a release publishes under, checked; changes nothing.

        ``tokens`` given: at least ``length`` ids, agreeing with the slot's history where
        both have ids. None: the slot's history if it holds all ``length`` ids (nothing is
        published otherwise)."""
        self.check_slot(slot)
        if self._capacity[slot] == 0:
            raise ValueError(f"slot {slot} is not active (nothing to release)")
        if tokens is None:
            if length and self.history.count(slot) >= length:
                return self.history.ids(slot, length)
            return None
        ids = prefix.token_ids(tokens)
        if len(ids) < length:
            raise ValueError(
                f"tokens has {len(ids)} ids but slot {slot} holds {length} tokens: "
                f"pass the ids of every token whose KV it holds"
            )
        at = self.history.first_difference(slot, ids[:length])
        if at is not None:
            raise ValueError(
                f"tokens[{at}]={int(ids[at])} differs from slot {slot}'s recorded token "
                f"{int(self.history.ids(slot)[at])} (its prompt and the tokens it was "
                f"extended with): its KV is not that token's"
            )
        return ids

    def release(self, slot: int, length: int, tokens: Any = None) -> None:
        """Frees ``slot``. With ``tokens`` (the ids of at least its ``length`` tokens, whose
        blocks' writes have completed) its full blocks enter the prefix index, cached, and
        are published to the remote levels that lack them; a failed publish is logged and
        counted, never an error (publishing helps other processes; the slot is released)."""
        ids = self.check_release(slot, length, tokens)
        self._before_release(slot)
        if ids is not None and self.ring_blocks:  # Its last windows, before the ring goes.
            self.publish_window(slot, length, ids)
        held = self.held_blocks(slot)
        shared = int(self._shared[slot])
        if ids is not None and not self.ring_blocks:  # A ring's blocks hold no prefix.
            full = length // self.block_tokens
            covered = ids[: full * self.block_tokens]
            self._export(covered, held[:full])
            # Mapped blocks past the tokens given (a length below the shared prefix) are
            # indexed: unpinned (the later ones first, as the index orders eviction), never
            # freed here.
            self.prefix.unpin(held[full:shared])
            duplicates = self.prefix.publish(covered, held[:full], min(shared, full))
            self.allocators.free(
                np.asarray(duplicates + held[max(full, shared) :].tolist(), np.int64)
            )
        else:
            self.prefix.unpin(held[:shared])
            self.allocators.free(held[shared:])
        self._tables[slot] = blocks.NO_BLOCK
        self._capacity[slot] = 0
        self._shared[slot] = 0
        self.history.clear(slot)

    def extend_history(self, slot: int, ids: Any) -> None:
        """Appends ``ids`` to active ``slot``'s token history, up to its capacity."""
        self.check_slot(slot)
        if self._capacity[slot] == 0:
            raise ValueError(f"slot {slot} is not active (admit it first)")
        ids = prefix.token_ids(ids)
        if self.history.count(slot) + len(ids) > self._capacity[slot]:
            raise ValueError(
                f"slot {slot} would record {self.history.count(slot) + len(ids)} token ids, "
                f"more than its capacity of {int(self._capacity[slot])} tokens"
            )
        self.history.extend(slot, ids)

    def restore(
        self,
        tables: np.ndarray,
        capacity: np.ndarray,
        shared: np.ndarray | None = None,
        entries: Sequence[prefix.Entry] = (),
    ) -> None:
        """Re-attach: the slots hold the blocks, capacities and shared prefixes a commit
        recorded (int32[batch, max_blocks], int32[batch], int32[batch], validated by the
        manifest's reader), and the prefix index its ``entries`` (with their reference
        counts). Raises, changing nothing, if a block is not free."""
        tables = np.asarray(tables, np.int32).reshape(self._tables.shape)
        capacity = np.asarray(capacity, np.int32).reshape(self._capacity.shape)
        shared = np.zeros_like(self._shared) if shared is None else np.asarray(shared, np.int32)
        # A block several slots map (indexed) is reserved once.
        held = sorted({int(p) for p in tables[tables >= 0]} | {int(e.block) for e in entries})
        self.dram.reserve(held)
        try:
            self.prefix.restore(entries)
        except Exception:
            self.dram.free(np.asarray(held, np.int64))
            raise
        self._tables[:] = tables
        self._capacity[:] = capacity
        self._shared[:] = shared.reshape(self._shared.shape)

    # -- remote levels ----------------------------------------------------------------------

    def _import(self, ids: np.ndarray, start: int, limit: int) -> list[int]:
        """Blocks ``start`` .. of ``ids`` (at most ``limit`` in all) found in a remote level,
        each written into a fresh block and indexed, pinned; stops at the first block no
        level has (or when no block is free)."""
        if not self.remote_levels or start >= limit:
            return []
        self.free_settled()
        keys = self.prefix.keys(ids)[:limit]
        t = self.block_tokens
        wanted = [
            (keys[i], keys[i - 1] if i else None, ids[i * t : (i + 1) * t])
            for i in range(start, len(keys))
        ]
        out: list[int] = []
        try:
            while len(out) < len(wanted):
                run = self._import_run(wanted, len(out), self.prefix.adopt)
                if not run:
                    break
                out += run
        except Exception:
            self.prefix.unpin(out)  # Those imported stay indexed, cached.
            raise
        return out

    def _import_window(self, keys: list[bytes], ids: np.ndarray, limit: int) -> int:
        """The window blocks of the longest cached prefix, at most ``limit`` blocks, whose
        window (the blocks covering ``[P - W + 1, P)``) the window index holds or a remote
        level has whole, imported into the index as window copies; returns how many were
        imported. A block that no level has, or none has whole (damaged), rules out every
        prefix whose window covers it, and the search goes on with the prefixes below it:
        a damaged last block costs the prompt that block, not its whole prefix. Blocks
        imported stay cached. Stops when no block is free."""
        if not self.remote_levels or limit <= 0:
            return 0
        self.free_settled()
        t, window = self.block_tokens, self.windows.window
        held: dict[int, bool] = {}  # Block -> indexed here or found in a level.

        def window_of(n: int) -> range:
            return range(max(0, n * t - window + 1) // t, n)

        def adopt(key: bytes, parent: bytes | None, tokens: np.ndarray, block: int) -> None:
            self.windows.put(key, self.prefix.root if parent is None else parent, tokens, block)

        self._find_remote(keys, window_of(limit), held)
        done, n = 0, limit
        while n > 0:
            span = window_of(n)
            gaps = [i for i in span if not held[i]]
            if gaps:  # Every prefix between the gap and n needs the gap's block.
                n = gaps[-1]
                self._find_remote(keys, range(n), held)  # Once: every window below.
                continue
            need = [i for i in span if keys[i] not in self.windows]
            wanted = [(keys[i], keys[i - 1] if i else None, ids[i * t : (i + 1) * t]) for i in need]
            got = 0
            while got < len(wanted):
                run = self._import_run(wanted, got, adopt)
                if not run:
                    break
                got += len(run)
            done += got
            if got == len(wanted):
                return done
            if not self.dram.free_blocks and not len(self.windows):
                return done  # No room for another block.
            n = need[got]  # Damaged (or gone since it was found): the prefixes below it.
            held[n] = False
            self._find_remote(keys, range(n), held)
        return done

    def _find_remote(self, keys: list[bytes], blocks: range, held: dict[int, bool]) -> None:
        """Records in ``held`` whether each of ``blocks`` not recorded yet is in the window
        index or in some remote level (a level that answers for many keys at once is asked
        once for all of them)."""
        ask = [i for i in blocks if i not in held]
        for i in ask:
            held[i] = keys[i] in self.windows
        for level in self.remote_levels:
            ask = [i for i in ask if not held[i]]
            if not ask:
                return
            if isinstance(level, InPlaceRemoteLevel):
                missing = set(level.missing([keys[i] for i in ask]))
                for j, i in enumerate(ask):
                    held[i] = j not in missing
            else:
                for i in ask:
                    held[i] = level.has(keys[i])

    def _import_run(self, wanted: list, pos: int, adopt: Callable[..., None]) -> list[int]:
        """Blocks ``wanted[pos:]`` ((key, parent, token ids) each) from the first level that
        has ``wanted[pos]``: a run of them from a level that reads in place (when the tier
        is in memory), else that one block; each handed to ``adopt(key, parent, tokens,
        block)`` (the prefix index's, or the window index's)."""
        in_memory = self.store is not None and self.store.block_memory(0) is not None
        for level in self.remote_levels:
            if in_memory and isinstance(level, InPlaceRemoteLevel):
                found = level.lookup(wanted[pos:])
                if found:
                    run = wanted[pos : pos + self._room_up_to(found)]
                    return self._import_in_place(level, run, adopt)
                continue
            payload = level.load(*wanted[pos])
            if payload is None:
                continue
            if not self.make_room(1):
                return []
            self._before_reuse()
            block = int(self.dram.allocate(1)[0])
            try:
                self.store.write_block(block, payload)
            except Exception:
                self.dram.free(np.asarray([block], np.int64))
                raise
            adopt(*wanted[pos], block)
            return [block]
        return []

    def _import_in_place(
        self, level: InPlaceRemoteLevel, wanted: list, adopt: Callable[..., None]
    ) -> list[int]:
        """``wanted``'s blocks read by ``level`` straight into fresh blocks (room made);
        those it checked are handed to ``adopt``. Blocks a stuck call may still write are
        held aside until the level has settled (:meth:`hold_aside`), the rest freed."""
        if not wanted:
            return []
        self._before_reuse()
        fresh = self.dram.allocate(len(wanted))
        try:
            self.store.quiesce()
            result = level.load_into(wanted, [self.store.block_memory(int(b)) for b in fresh])
        except Exception:
            self.dram.free(fresh)
            raise
        loaded = fresh[: result.loaded]
        for (key, parent, tokens), block in zip(wanted, loaded):
            adopt(key, parent, tokens, int(block))
        busy = fresh[result.loaded : max(result.busy_until, result.loaded)]
        if len(busy):
            self._held_aside.append((busy, level.settled))
        self.dram.free(fresh[result.loaded + len(busy) :])
        return [int(b) for b in loaded]

    def hold_aside(self, blocks: Sequence[int] | np.ndarray, settled: Callable[[], bool]) -> None:
        """Takes free DRAM ``blocks`` out of the allocator until ``settled()`` is true: blocks
        just freed that something outside this table may still write (a peer's writes in
        flight after a transfer failed). Refused (ValueError) if one is not free."""
        held = np.asarray(blocks, np.int64).reshape(-1)
        self.dram.reserve(held)
        self._held_aside.append((held, settled))

    def free_settled(self) -> int:
        """Frees the blocks held aside whose test now passes; returns how many. (Also runs
        whenever blocks are needed.)"""
        freed, still = 0, []
        for held, settled in self._held_aside:
            if settled():
                self.dram.free(held)
                freed += len(held)
            else:
                still.append((held, settled))
        self._held_aside = still
        return freed

    def _room_up_to(self, count: int) -> int:
        """The most blocks, up to ``count``, that :meth:`make_room` can free; made free."""
        free = self.dram.free_blocks
        if count > free:
            evictable = (
                len(self.windows)
                if self.windows is not None
                else len(self._evictable(count - free))
            )
            count = free + min(evictable, count - free)
        return count if count and self.make_room(count) else 0

    def _export(self, ids: np.ndarray, held: np.ndarray) -> None:
        """Publishes the full blocks ``held`` (holding ``ids``) to every remote level that
        lacks them; failures are logged once per release and counted."""
        if not self.remote_levels or not len(held):
            return
        keys = self.prefix.keys(ids)
        t = self.block_tokens
        self._export_blocks(
            [
                (keys[i], keys[i - 1] if i else None, ids[i * t : (i + 1) * t], int(held[i]))
                for i in range(len(held))
            ]
        )

    def _export_blocks(self, entries: list[tuple[bytes, bytes | None, np.ndarray, int]]) -> None:
        """Publishes blocks ``(key, parent or None for a first block, token ids, block)`` to
        every remote level that lacks them; failures are logged and counted, never raised
        (publishing is a courtesy to others)."""
        if not self.remote_levels or not entries:
            return
        keys = [key for key, _, _, _ in entries]
        for level in self.remote_levels:
            try:
                if isinstance(level, InPlaceRemoteLevel):  # A request per run, not per block.
                    missing = level.missing(keys)
                else:
                    missing = [i for i, key in enumerate(keys) if not level.has(key)]
                if not missing:
                    continue
                payloads = self._payloads([entries[i][3] for i in missing], level)
                items = [(*entries[i][:3], payloads[j]) for j, i in enumerate(missing)]
                if isinstance(level, InPlaceRemoteLevel):
                    level.publish_many(items)
                    continue
                for item in items:
                    level.publish(*item)
            except Exception as e:  # noqa: BLE001 - publishing is a courtesy to others.
                self.publish_failures += 1
                logger.warning(
                    "publishing prefix blocks to %s failed (others miss them; nothing here "
                    "changes): %s",
                    level.describe(),
                    e,
                )

    def _payloads(self, block_ids: list[int], level: Any) -> list[Any]:
        """What ``level`` publishes of blocks ``block_ids``: views of their bytes where the
        tier is in memory and the level takes regions (no copy; the engine is drained first,
        so no write to them is in flight), else their bytes read through the engine."""
        if isinstance(level, InPlaceRemoteLevel):
            views = [self.store.block_memory(b) for b in block_ids]
            if all(v is not None for v in views):
                self.store.quiesce()
                return views
        return self.store.read_blocks(block_ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
