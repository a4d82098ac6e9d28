"""An offloaded cache's side of the admission transaction
(:mod:`jax_tpusync.caches.admission`): :class:`OffloadedAdmission`.

The blocks are on the cache's engine, not in its state: a reservation reads no state and
writes nothing a state must take. An admitted state is drained (a new epoch of the stream,
its prefetches discarded: they may have read the tables it replaces) and holds the slot
table's tables; a resident state copies the rows of the mapped prefix, as the tier has them.
"""

from __future__ import annotations

from jax_tpusync.caches.admission import AdmissionStorage
from jax_tpusync.caches.offloaded.live_state import LiveState
from jax_tpusync.core.slots import Admission
from jax_tpusync.core.state import KVState

__all__ = ["OffloadedAdmission"]


class OffloadedAdmission(AdmissionStorage[KVState]):
    """How an offloaded cache's state holds an admitted slot.

    Args:
      live: the cache's live state (its stream's epochs, its row I/O).
    """

    def __init__(self, live: LiveState):
        self.live = live

    def admitting(self, state: KVState, reservation: Admission) -> KVState:
        """``state`` drained: the live one, in a new epoch."""
        return self.live.drain(state)

    def with_slot(self, state: KVState, slot: int, length: int) -> KVState:
        state = self.live.with_slot(state, slot, length)
        if self.live.spec.resident and length:  # The prefix's rows, as the tier has them.
            state = state.replace(staging=self.live.rows.resident_copy(state.staging, slot=slot))
        return state
