"""The decode side's quarantine in P/D transfer (:mod:`jax_tpusync.pd.transfer`): writes
already in flight when a receive fails can still land (the engine's TCP timeouts end them),
so the blocks the request named are held out of the cache's allocator until a time on the
receiver's clock has passed, and only then freed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

import numpy as np

from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.pd.channel import engine_tcp_timeout_s


def default_quarantine_s() -> float:
    """How long a failed transfer's blocks are held aside by default: twice the engine's
    longest TCP timeout (:func:`~jax_tpusync.pd.channel.engine_tcp_timeout_s`: a write in
    progress when the decode side gave up, and one the prefill side submitted just before
    it noticed, each end within it) plus 1 s."""
    return 2 * engine_tcp_timeout_s() + 1.0


def sleep_until(clock: Callable[[], float], times: Iterable[float]) -> None:
    """Sleeps until ``clock()`` has reached the last of ``times`` (none: at once)."""
    times = list(times)
    if times:
        time.sleep(max(0.0, *(until - clock() for until in times)))


def written_blocks(
    parts: Iterable[tuple[OffloadedKVCache, int]], lo: int, hi: int
) -> tuple[tuple[OffloadedKVCache, np.ndarray], ...]:
    """Per ``(cache, slot within it)`` of a slot's head ranges: the cache and the DRAM block
    ids (int64[k]) that hold positions ``[lo, hi)`` of the slot, leaving out the blocks of
    its mapped prefix (shared with other slots; no write was asked into them). Read before
    the reservation is cancelled: the cancel frees them."""
    out = []
    for cache, local in parts:
        slots = cache.slots
        first = max(lo // slots.block_tokens, slots.shared_tokens(local) // slots.block_tokens)
        ids = slots.held_blocks(local)[first : -(-hi // slots.block_tokens)]
        out.append((cache, np.asarray(ids[ids < slots.dram.num_blocks], np.int64)))
    return tuple(out)


@dataclasses.dataclass
class Quarantine:
    """A failed transfer's blocks held aside (:meth:`BlockQuarantine.reclaim` frees them
    once ``until``, on the receiver's clock, has passed): per pool, the block ids writes may
    still land in."""

    slot: int
    until: float
    blocks: tuple  # ((OffloadedKVCache, int64[k] block ids), ...)
    passed: bool = False  # Reclaimed (with wait=True: before its time).


class BlockQuarantine:
    """The quarantines of one receiver, one per slot, counted on ``clock``."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._held: dict[int, Quarantine] = {}

    def left(self) -> dict[int, float]:
        """``{slot: seconds until its blocks are freed}``."""
        now = self.clock()
        return {slot: max(0.0, q.until - now) for slot, q in self._held.items()}

    def hold(self, slot: int, blocks: tuple, until: float) -> None:
        """Holds ``blocks`` (from :func:`written_blocks`, freed by the reservation's cancel
        just before) out of their caches' allocators until ``until``."""
        q = Quarantine(slot, until, blocks)
        for cache, ids in blocks:  # Just freed by the cancel: cannot be refused.
            cache.slots.hold_aside(ids, lambda q=q: q.passed or self.clock() >= q.until)
        self._held[slot] = q

    def reclaim(self, wait: bool = False) -> list[int]:
        """Frees the blocks of every quarantine whose time has passed (with ``wait``: of
        every quarantine, after sleeping until the last one's time); returns their slots."""
        if wait:
            sleep_until(self.clock, (q.until for q in self._held.values()))
        now = self.clock()
        freed = []
        for slot, q in list(self._held.items()):
            if wait or now >= q.until:
                q.passed = True
                for cache, _ in q.blocks:
                    cache.slots.free_settled()
                del self._held[slot]
                freed.append(slot)
        return freed
