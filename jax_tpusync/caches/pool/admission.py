"""A host pool's side of the admission transaction (:mod:`jax_tpusync.caches.admission`):
:class:`PoolAdmission`.

The pool is in the state, and a reservation takes none, so what the slot table writes while
it admits a slot (a prefix level's blocks it imports, a ring's cached window) waits in the
cache's :class:`~jax_tpusync.caches.pool.imports.PendingImports` until the admitted state's
pool takes it; a spill tier demotes the blocks a reservation needs room for out of the
state's pool (:meth:`PoolAdmission.reserving_in`), and takes back what a cancelled one
imported while it has room; a persistent tier is told the mapped prefix of a slot admitted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax_tpusync.caches.admission import AdmissionStorage
from jax_tpusync.caches.pool.imports import PendingImports
from jax_tpusync.caches.pool.live_state import PoolLiveState
from jax_tpusync.caches.pool.persistence import PoolTier
from jax_tpusync.caches.pool.spill import PoolSpillTier
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.slots import Admission

__all__ = ["PoolAdmission"]


class PoolAdmission(AdmissionStorage[PoolState]):
    """A host pool's reservations: their pending writes, its spill tier, its persistent tier.

    Args:
      live: the cache's live state (refuses a closed cache, or a state not the live one).
      imports: the writes reservations made that no pool holds yet.
      spill: the cache's spill tier (None: cached blocks are evicted).
      tier: the pool's persistent copy (None: not persistent).
    """

    def __init__(
        self,
        live: PoolLiveState,
        imports: PendingImports,
        spill: PoolSpillTier | None,
        tier: PoolTier | None,
    ):
        self.live = live
        self.imports = imports
        self.spill = spill
        self.tier = tier

    @contextlib.contextmanager
    def reserving_in(self, state: PoolState) -> Iterator[None]:
        """With a spill tier, a reservation demotes the cached blocks it needs room for
        out of ``state``'s pool (checked first: the live one)."""
        if self.spill is None:
            yield
            return
        self.live.check(state)  # Before its pool is read.
        self.spill.reading(state.pool)
        try:
            yield
        finally:
            self.spill.reading(None)

    def reserving(self) -> None:
        self.live.check_open()
        self.imports.begin()  # Nothing of a refused call before.

    def refused(self) -> None:
        self.imports.refused(self.live.slots.prefix)  # Blocks it imported stay indexed.

    def reserved(self, reservation: Admission) -> None:
        self.imports.record(reservation.slot)  # Pending until a pool is admitted.

    def cancelled(self, reservation: Admission) -> None:
        """What the reservation imported, or promoted from the spill tier, that no pool
        holds yet goes back to the spill tier while it has free blocks (its bytes are
        nowhere else); the rest leaves the index, unless another reservation maps it."""
        prefix = self.live.slots.prefix
        if self.spill is not None:
            self.spill.keep(prefix, self.imports.pending_of(reservation.slot))
        self.imports.drop(reservation.slot, prefix)

    def admitting(self, state: PoolState, reservation: Admission) -> PoolState:
        """``state`` whose pool holds every pending write (this reservation's, and any
        other's that this one may map); the persistent tier told the mapped prefix."""
        state = state.replace(pool=self.imports.apply(reservation.slot, state.pool))
        if self.tier is not None:
            self.tier.admitted(reservation.slot, reservation.cached)
        return state

    def with_slot(self, state: PoolState, slot: int, length: int) -> PoolState:
        return self.live.with_slot(state, slot, length)
