"""Paged KV: fixed-size blocks, per-sequence block tables and the host-side allocator.

A cache's tier holds ``num_blocks`` physical **KV blocks** per (layer, K|V), each
``block_tokens`` token rows of all kv heads (``block_bytes = block_tokens * row_bytes``).
Physical block ``p`` addresses the same token rows in every layer, and each (layer, K|V)
keeps its blocks in one region of the cache's allocation::

    region(layer, kv)         = layer * 2 + kv
    tier block of (l, kv, p)  = first_block + region * num_blocks + p
    tier byte of row r of it  = tier_block * block_bytes + r * row_bytes

so a sequence whose blocks are consecutive reads a layer's unit in one segment per K|V
(the engine merges rows that continue one another).

A sequence (a batch *slot*) maps its positions through its row of the block table:
position ``pos`` is row ``pos % block_tokens`` of physical block
``block_table[slot, pos // block_tokens]`` (-1: none reserved). Tables and capacities are
decided on the host, between steps (:class:`BlockAllocator`); inside ``jit`` they are data,
so fetch and write-back segments are computed from them traced.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NO_BLOCK = -1
# A segment's block for a position whose block lives on the other level of a two-level
# cache (a write-back, which only writes its own tier, or an id of neither level): the
# engine refuses it by name before any byte moves.
OTHER_LEVEL = -4


class BlockAllocator:
    """Physical block ids ``[0, num_blocks)``, handed out in runs of consecutive ids.

    First fit over free extents, so a sequence admitted into an empty region gets
    consecutive blocks (one segment per unit); a fragmented region still serves a request
    from several extents.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[tuple[int, int]] = [(0, num_blocks)]  # (first, count), sorted.

    @property
    def free_blocks(self) -> int:
        return sum(n for _, n in self._free)

    def allocate(self, count: int) -> np.ndarray:
        """int32[count] block ids, as few runs as first fit finds; raises if too few are free."""
        if count > self.free_blocks:
            raise ValueError(
                f"needs {count} KV blocks but only {self.free_blocks} of {self.num_blocks} are "
                f"free (release a slot, or make the cache with more num_blocks)"
            )
        # One extent that holds all of it, if any; else take extents in order.
        for i, (first, n) in enumerate(self._free):
            if n >= count:
                self._free[i] = (first + count, n - count)
                if n == count:
                    del self._free[i]
                return np.arange(first, first + count, dtype=np.int32)
        pieces: list[np.ndarray] = []
        taken = 0
        while taken < count:
            first, n = self._free[0]
            take = min(n, count - taken)
            pieces.append(np.arange(first, first + take, dtype=np.int32))
            taken += take
            if take == n:
                del self._free[0]
            else:
                self._free[0] = (first + take, n - take)
        return np.concatenate(pieces)

    def reserve(self, ids: Sequence[int]) -> None:
        """Marks the specific block ids ``ids`` as allocated (e.g. blocks a re-attached
        cache's slots hold). All or nothing: raises, changing nothing, if an id is out of
        range, given twice or not free."""
        wanted = sorted(int(p) for p in ids)
        for a, b in zip(wanted, wanted[1:]):
            if a == b:
                raise ValueError(f"block {a} is given twice")
        if wanted and not (0 <= wanted[0] and wanted[-1] < self.num_blocks):
            bad = wanted[0] if wanted[0] < 0 else wanted[-1]
            raise ValueError(f"block {bad} is out of range [0, {self.num_blocks})")
        free = list(self._free)
        for first, n in _runs(wanted):
            # The extent holding ``first``: the last one starting at or before it.
            i = bisect.bisect_right(free, (first, self.num_blocks + 1)) - 1
            if i < 0 or free[i][0] + free[i][1] < first + n:
                held = first
                if i >= 0 and free[i][0] + free[i][1] > first:
                    held = free[i][0] + free[i][1]  # First id of the run past the extent.
                raise ValueError(f"block {held} is not free")
            start, count = free[i]
            pieces = [(start, first - start), (first + n, start + count - first - n)]
            free[i : i + 1] = [p for p in pieces if p[1] > 0]
        self._free = free

    def free(self, blocks: Sequence[int]) -> None:
        """Returns ``blocks`` (each allocated, none twice) to the free extents."""
        for first, n in _runs(np.sort(np.asarray(blocks, np.int64))):
            i = bisect.bisect_left(self._free, (first, 0))
            before = self._free[i - 1] if i else None
            after = self._free[i] if i < len(self._free) else None
            if (before and before[0] + before[1] > first) or (after and first + n > after[0]):
                raise ValueError(f"blocks [{first}, {first + n}) are not all allocated")
            if before and before[0] + before[1] == first:
                first, n = before[0], before[1] + n
                i -= 1
                del self._free[i]
            if i < len(self._free) and self._free[i][0] == first + n:
                n += self._free[i][1]
                del self._free[i]
            self._free.insert(i, (first, n))


class LevelAllocators:
    """The DRAM allocator and the spill allocator behind one id space (see the module
    docstring); what the prefix index frees evicted blocks through."""

    def __init__(self, dram: BlockAllocator, spill: BlockAllocator):
        self.dram = dram
        self.spill = spill

    def is_spilled(self, block: int) -> bool:
        return block >= self.dram.num_blocks

    def in_dram(self, block: int) -> bool:
        return block < self.dram.num_blocks

    def free(self, blocks: Sequence[int] | np.ndarray) -> None:
        ids = np.asarray(blocks, np.int64)
        nb = self.dram.num_blocks
        if (ids < 0).any() or (ids >= nb + self.spill.num_blocks).any():
            raise ValueError(f"blocks {ids.tolist()} are not all ids of the two levels")
        self.dram.free(ids[ids < nb])
        self.spill.free(ids[ids >= nb] - nb)


def _runs(ids: Sequence[int] | np.ndarray) -> Iterator[tuple[int, int]]:
    """(first, count) of each run of consecutive ids in sorted ``ids``."""
    ids = np.asarray(ids, np.int64)
    if not ids.size:
        return
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]])
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        yield int(ids[lo]), hi - lo


def row_runs(table_row: np.ndarray, block_tokens: int, lo: int, hi: int, boundary: int = 0):
    """Host-side: ``(physical block, first row in it, rows)`` covering positions [lo, hi),
    consecutive blocks merged into one run (never into block ``boundary``: a two-level
    cache's first spill id, on another tier). Raises if a position has no block."""
    out: list[list[int]] = []
    pos = lo
    while pos < hi:
        index = pos // block_tokens
        block = int(table_row[index]) if index < len(table_row) else NO_BLOCK
        if block < 0:
            raise ValueError(f"position {pos} has no KV block reserved")
        row = pos % block_tokens
        n = min(hi, (index + 1) * block_tokens) - pos
        if (
            out
            and row == 0
            and block != boundary
            and out[-1][0] * block_tokens + out[-1][1] + out[-1][2] == block * block_tokens
        ):
            out[-1][2] += n
        else:
            out.append([block, row, n])
        pos += n
    return [tuple(r) for r in out]


def block_segments(
    table: jax.Array,  # int32[batch, max_blocks]: physical block per position // block_tokens
    region_first_block: jax.Array,  # int32[2]: block of physical block 0, for K and V
    lo: jax.Array,  # int32[batch]: first position
    count: jax.Array,  # int32[batch]: positions (0: none)
    mem_base: jax.Array,  # int32[2, batch]: memory offset of position lo, K and V
    *,
    block_tokens: int,
    row_bytes: int,
    max_positions: int,  # static bound on count
    levels: tuple[int, ...] | None = None,  # block ids per level of a two-level cache
    level: int = 0,  # the level (tier) these segments are for
    fetch: bool = False,  # True: positions on another level move no bytes here
) -> jax.Array:  # int32[2 * batch * blocks, 4]
    """Segments (block, offset_in_block, memory_offset, nbytes) of positions
    ``[lo, lo + count)`` of each sequence, one row per block they touch (traced), K rows
    first. Blocks are relative to the cache's first block.

    A row never crosses its block's end (the engine checks every row against the block it
    names); rows of positions without a block (-1) keep block -1, which the engine refuses.
    The engine merges rows that are contiguous on the tier and in memory, so consecutive
    blocks cost one request.

    Two-level caches (see :mod:`jax_tpusync.core.spill`): table ids ``[0, levels[0])`` are the
    first tier's blocks, the next ``levels[1]`` the second's, and the segments are for
    ``level``'s tier, its blocks counted from 0. A position on another level's block is
    refused (block :data:`OTHER_LEVEL`, refused by the engine by name): a write-back writes
    its own tier only. With ``fetch`` it moves no bytes here instead (that level's fetch
    reads it); level 0's rows still refuse positions with no block or an id of no level.
    """
    n_blocks = -(-max_positions // block_tokens) + 1  # A misaligned range touches one more.
    i = jnp.arange(n_blocks, dtype=jnp.int32)  # [n]
    first = lo // block_tokens  # [batch]
    index = first[:, None] + i[None, :]  # [batch, n]
    start = jnp.maximum(lo[:, None], index * block_tokens)
    end = jnp.minimum((lo + count)[:, None], (index + 1) * block_tokens)
    rows = jnp.maximum(end - start, 0)
    max_blocks = table.shape[1]
    phys = jnp.take_along_axis(table, jnp.clip(index, 0, max_blocks - 1), axis=1)
    phys = jnp.where(index < max_blocks, phys, NO_BLOCK)
    missing = (rows > 0) & (phys < 0)
    bad = jnp.full(phys.shape, NO_BLOCK, jnp.int32)
    if levels is not None:
        level_first = sum(levels[:level])
        mine = (phys >= level_first) & (phys < level_first + levels[level])
        known = (phys >= 0) & (phys < sum(levels))
        refused = (rows > 0) & ~(mine | (known & fetch) | (fetch & (level > 0)))
        rows = jnp.where(mine, rows, 0)
        bad = jnp.where(phys < 0, NO_BLOCK, OTHER_LEVEL)
        missing = refused
        phys = phys - level_first
    block = jnp.where(
        missing, bad[None], region_first_block[:, None, None] + jnp.maximum(phys, 0)[None]
    )  # [2, batch, n]
    offset = jnp.broadcast_to((start % block_tokens) * row_bytes, block.shape)
    mem = mem_base[:, :, None] + ((start - lo[:, None]) * row_bytes)[None]
    nbytes = jnp.broadcast_to(rows * row_bytes, block.shape)
    segs = jnp.stack([block, jnp.where(rows > 0, offset, 0), mem, nbytes], axis=-1)
    return segs.reshape(-1, 4).astype(jnp.int32)
