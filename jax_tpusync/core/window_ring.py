"""Sliding-window layers that keep only their window: a ring of blocks per slot.

A layer with sliding window ``W`` attends, from query position ``p``, to keys ``[p - W + 1,
p]``. Of a sequence of any length it therefore needs only the last ``W - 1`` cached tokens
plus the rows a step appends, so a cache whose layers share one window (and whose steps
add at most ``step_tokens`` rows) keeps, per slot, a *ring* of :func:`ring_blocks` blocks
instead of ``max_len / block_tokens``: logical block ``i`` of the sequence (positions
``[i * block_tokens, (i + 1) * block_tokens)``) lives in ring entry ``i % ring_blocks``,
and block ``i + ring_blocks`` overwrites it once the window has moved past it.

The block table a state carries keeps its shape (``max_len / block_tokens`` entries per
slot): entry ``i`` is the ring's entry ``i % ring_blocks`` (:func:`tiled_table`). So every
in-graph path (fetches, write-backs, the reads in place) maps positions to blocks exactly
as for any other cache, and the ring costs the step nothing. What the ring must guarantee
is that no write lands on a row some read still needs; :func:`ring_blocks` is the
arithmetic of that guarantee, and the step refuses (at trace time) a ``q_len`` above
``step_tokens``, the only way to break it.

Host-side, a ring holds the rows ``[kept_from(length), length)`` of a slot
(:func:`kept_from`); older positions were overwritten. Loads write only the rows a ring
keeps (:func:`clip_rows`), reads refuse older positions.
"""

from __future__ import annotations

import numpy as np


def ring_blocks(window: int, step_tokens: int, block_tokens: int) -> int:
    """Blocks a slot's ring needs so that a step never overwrites a row it or a later
    layer still reads.

    A step of ``q`` <= ``step_tokens`` rows at length ``n`` reads positions ``[n - W + 1,
    n)`` and writes ``[n, n + q)``: a span of at most ``W + step_tokens - 1`` positions,
    which touches at most ``(W + step_tokens - 3) // block_tokens + 2`` consecutive logical
    blocks (when it starts on a block's last row). Consecutive
    logical blocks fall on distinct ring entries as long as there are no more of them than
    entries, so the write overwrites only positions before ``n - W + 1``. The prefetch of
    the next step's first unit reads ``[n' - W + 1, n')`` with ``n' = n + q``: inside the
    same span.
    """
    if window < 1 or step_tokens < 1 or block_tokens < 1:
        raise ValueError(
            f"window={window}, step_tokens={step_tokens} and block_tokens={block_tokens} "
            f"must be positive"
        )
    return (window + step_tokens - 3) // block_tokens + 2


def kept_from(length: np.ndarray | int, window: int) -> np.ndarray:
    """First position a ring still holds for every slot of ``length`` tokens: the window's
    first cached key, ``max(0, length - W + 1)`` (older rows may be overwritten)."""
    return np.maximum(np.asarray(length, np.int64) - window + 1, 0)


def tiled_table(ring: np.ndarray, max_blocks: int) -> np.ndarray:
    """int32[max_blocks]: a slot's block-table row over its ``ring`` (int[ring_blocks]):
    entry ``i`` is ``ring[i % len(ring)]``."""
    ring = np.asarray(ring, np.int32)
    return ring[np.arange(max_blocks) % len(ring)]


def clip_rows(
    starts: np.ndarray,  # int64[batch]: first position of each slot's rows
    counts: np.ndarray,  # int64[batch]: rows
    furthest: np.ndarray,  # int64[batch]: each slot's length, or further rows written
    window: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, counts, skip)`` of the rows a ring keeps of a host-side write of rows
    ``[starts, starts + counts)``: only those the window can still read once the slot
    holds ``max(furthest, starts + counts)`` tokens; ``skip`` rows are dropped at the front
    of each slot's rows.

    Within one write the kept rows then span fewer than ``W`` positions, so no two of them
    share a ring entry (the engine may write them in any order); a write of older rows
    than the ring keeps writes nothing.
    """
    ends = np.asarray(starts, np.int64) + counts
    keep = kept_from(np.maximum(furthest, ends), window)
    new_starts = np.minimum(np.maximum(starts, keep), ends)
    skip = new_starts - starts
    return new_starts, counts - skip, skip
