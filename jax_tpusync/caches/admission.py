"""The admission transaction of one slot table, written once for every kind of storage:
:class:`AdmissionTransaction`.

A one-device cache (:class:`~jax_tpusync.OffloadedKVCache`, whose blocks are on its engine;
:class:`~jax_tpusync.HostPoolKVCache`, whose pool is in its state) admits a sequence in
the two halves of :class:`~jax_tpusync.caches.protocol.Reservable`:

* **reserve**: the slot table admits the slot (:meth:`~jax_tpusync.core.slots.SlotTable.admit`
  checks every argument and refuses, changing nothing, or maps the prefix and takes the
  blocks); no state changes, so a cache of parts can reserve in every part before it admits
  in any;
* **cancel**: the slot table releases the slot at length 0, as if it had never been reserved;
* **admitted**: cannot be refused (the caller checked the state first): the state holds the
  slot table's block tables and capacities, the slot at its mapped prefix, and the loads
  that grow its length start from there.

What a kind of storage adds is its :class:`AdmissionStorage`: where a reservation may read
the state (a host pool's spill tier demotes out of its pool), what a reservation writes
besides the tables and where that waits until a state takes it (a host pool's pending
prefix imports), and how its state holds a slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import numpy as np

from jax_tpusync.core.host_io import LoadedExtent
from jax_tpusync.core.slots import Admission, SlotTable

__all__ = ["AdmissionStorage", "AdmissionTransaction"]

S = TypeVar("S")


class AdmissionStorage(Protocol[S]):
    """The storage side of :class:`AdmissionTransaction`, for states of type ``S``.

    Subclass it for the defaults (every step but :meth:`with_slot` does nothing); a hook
    called before the slot table changes may refuse (raising), one called after may not.
    """

    def reserving_in(self, state: S) -> AbstractContextManager[None]:
        """A context in which a reservation may read ``state`` (see
        :meth:`~jax_tpusync.caches.protocol.Reservable.reserving_in`); default: none."""
        return contextlib.nullcontext()

    def reserving(self) -> None:
        """Before the slot table admits a slot (may refuse, changing nothing)."""

    def refused(self) -> None:
        """After the slot table refused a reservation (what it wrote before is settled)."""

    def reserved(self, reservation: Admission) -> None:
        """After the slot table made ``reservation`` (what it wrote is held until
        :meth:`admitting` or :meth:`cancelled`)."""

    def cancelled(self, reservation: Admission) -> None:
        """After the slot table released a reservation's slot (at length 0)."""

    def admitting(self, state: S, reservation: Admission) -> S:
        """``state`` holding what ``reservation`` wrote besides the slot table's tables;
        default: ``state``."""
        return state

    def with_slot(self, state: S, slot: int, length: int) -> S:
        """The live state: ``state`` holding the slot table's block tables and capacities
        now, ``slot`` at ``length`` tokens (a slot admitted at its mapped prefix, or
        released at 0)."""
        ...


class AdmissionTransaction:
    """reserve -> cancel | admitted over one slot table (see the module).

    Args:
      slots: the cache's slot table.
      loaded: the extent of the cache's host-side loads (an admitted slot's start at its
        mapped prefix).
      storage: what the cache's kind of storage adds.
    """

    def __init__(self, slots: SlotTable, loaded: LoadedExtent, storage: AdmissionStorage):
        self.slots = slots
        self.loaded = loaded
        self.storage = storage

    def reserving_in(self, state: Any) -> AbstractContextManager[None]:
        """The storage's context in which a reservation may read ``state``."""
        return self.storage.reserving_in(state)

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> Admission:
        """The slot table admits ``slot`` (or raises, changing nothing); no state changes.
        ``max_cached`` caps the mapped prefix (tokens)."""
        self.storage.reserving()
        try:
            reservation = self.slots.admit(slot, max_tokens, tokens, max_cached=max_cached)
        except Exception:
            self.storage.refused()
            raise
        self.storage.reserved(reservation)
        return reservation

    def cancel(self, reservation: Admission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        self.slots.release(reservation.slot, 0)
        self.storage.cancelled(reservation)

    def admitted(self, state: Any, reservation: Admission) -> Any:
        """The live state once :meth:`reserve` made ``reservation`` (cannot be refused)."""
        slot, cached = reservation.slot, reservation.cached
        state = self.storage.admitting(state, reservation)
        state = self.storage.with_slot(state, slot, cached)
        self.loaded.reset(slot, cached)
        return state
