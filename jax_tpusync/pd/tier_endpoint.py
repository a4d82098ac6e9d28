"""How an engine cache (:class:`~jax_tpusync.OffloadedKVCache`, or a
:class:`~jax_tpusync.ShardedKVCache` of them) takes part in P/D transfer
(:mod:`jax_tpusync.pd.transfer`): its host pools (one per head range,
:mod:`jax_tpusync.pd.pools`) are registered with the TransferEngine once, so a slot's rows
land in, and are sent from, the blocks of the slot themselves (no copy on either side).

Late writes: after a failed receive, writes already in flight may still land in the blocks
the request named; those are held out of the allocator until the quarantine has passed
(:mod:`jax_tpusync.pd.quarantine`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax_tpusync.caches.capabilities import EngineTierRows
from jax_tpusync.caches.offloaded.mesh import MeshAdmission
from jax_tpusync.core.state import KVState
from jax_tpusync.mooncake import transfer_memory
from jax_tpusync.pd.pools import (
    head_pools,
    pool_runs,
    register_pools,
    slot_pools,
    unregister_pools,
)
from jax_tpusync.pd.quarantine import BlockQuarantine, written_blocks


class EngineTierEndpoint:
    """A slot's rows in an engine cache's registered host pools (a
    :class:`~jax_tpusync.pd.endpoint.SlotRowsEndpoint`).

    Args:
      cache: the engine cache, on a host tier (an
        :class:`~jax_tpusync.caches.capabilities.EngineTierRows`; another is refused).
      role: "KVReceiver" or "KVSender", for messages.
      populate: fault the pools' pages in when they are registered.
      clock: the time quarantines are counted in.

    Raises:
      TypeError, ValueError: a cache that cannot take part (the message says why).
    """

    staging = None  # The rows land in the cache's own pools.

    def __init__(
        self,
        cache: EngineTierRows,
        role: str,
        *,
        populate: bool,
        clock: Callable[[], float],
    ):
        self.cache = cache
        self.role = role
        self.pools = head_pools(cache, role)
        self.populate = populate
        self.engine: Any = None
        self.quarantine = BlockQuarantine(clock)

    def register(self, engine: Any) -> None:
        register_pools(engine, self.pools, self.role)
        self.engine = engine
        if self.populate:
            for pool in self.pools:
                transfer_memory.populate(pool.address, pool.nbytes)

    def unregister(self) -> None:
        unregister_pools(self.engine, self.pools)

    def check_slot(self, slot: Any) -> None:
        slot_pools(self.cache, self.pools, slot)

    def slot_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        return [
            {"heads": list(pool.heads), "runs": pool_runs(pool.cache, pool.address, local, lo, hi)}
            for pool, local in slot_pools(self.cache, self.pools, slot)
        ]

    def landing_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        return self.slot_runs(slot, lo, hi)

    def admit(self, state: KVState, reservation: Any, lo: int, hi: int) -> KVState:
        # The rows are in the slot's blocks already: admitted at once at their length.
        return self.cache.admitted(state, _admitted_at(reservation, hi))

    def set_aside(self, reservation: Any, lo: int, hi: int, seconds: float) -> str:
        parts = [
            (pool.cache, local)
            for pool, local in slot_pools(self.cache, self.pools, reservation.slot)
        ]
        blocks = written_blocks(parts, lo, hi)  # Before the cancel frees them.
        self.cache.cancel(reservation)
        self.quarantine.hold(reservation.slot, blocks, self.quarantine.clock() + seconds)
        return f", its blocks held aside for {seconds:.3g} s (writes may still land in them)"

    def quarantined(self) -> dict[int, float]:
        return self.quarantine.left()

    def reclaim(self, wait: bool) -> list[int]:
        return self.quarantine.reclaim(wait)

    def source_runs(self, state: KVState, slot: int, lo: int, hi: int) -> list[dict]:
        self.cache.engine.drain()  # The step's write-backs are on the tier.
        return self.slot_runs(slot, lo, hi)


def _admitted_at(reservation: Any, n: int) -> Any:
    """``reservation`` (a cache's Admission or a mesh cache's MeshAdmission) admitted at
    ``n`` tokens."""
    if isinstance(reservation, MeshAdmission):
        return dataclasses.replace(
            reservation,
            cached=n,
            admissions={
                s: dataclasses.replace(a, cached=n) for s, a in reservation.admissions.items()
            },
        )
    return dataclasses.replace(reservation, cached=n)
