"""Where a slot's rows land (the decode side) or come from (the prefill side) in P/D
transfer (:mod:`jax_tpusync.pd.transfer`): one interface, :class:`SlotRowsEndpoint`, chosen
once per role by what the cache can do (:func:`slot_rows_endpoint`, by its capabilities in
:mod:`jax_tpusync.caches.capabilities`), so the two roles never ask which kind they hold.

* An engine cache (:class:`~jax_tpusync.OffloadedKVCache`, a
  :class:`~jax_tpusync.ShardedKVCache`; :class:`~jax_tpusync.caches.capabilities.EngineTierRows`):
  its host pools are registered memory; the rows land in and leave from the slot's blocks
  (:class:`~jax_tpusync.pd.tier_endpoint.EngineTierEndpoint`).
* A host-pool cache (:class:`~jax_tpusync.HostPoolKVCache`;
  :class:`~jax_tpusync.caches.capabilities.StagedRows`): its pool moves with every step, so
  the rows pass through a registered staging buffer, loaded into or read out of the pool
  between steps (:class:`~jax_tpusync.pd.pool_staging.PoolStagingEndpoint`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from jax_tpusync.caches.capabilities import StagedRows
from jax_tpusync.pd.pool_staging import PoolStaging, PoolStagingEndpoint
from jax_tpusync.pd.tier_endpoint import EngineTierEndpoint


class SlotRowsEndpoint(Protocol):
    """A role's side of the transfer of a slot's rows, for one cache.

    Runs are per head range, in head order: ``{"heads": [lo, hi], "runs": per region (layer
    * 2 + K|V) [[address, bytes], ...]}`` in memory registered with the role's engine.
    """

    staging: PoolStaging | None  # The buffer a host-pool cache's rows pass through.

    def register(self, engine: Any) -> None:
        """Registers the memory the rows pass through with ``engine`` (all or none)."""
        ...

    def unregister(self) -> None:
        """Unregisters (and unmaps what was mapped here); the caller waited out the
        quarantines."""
        ...

    def check_slot(self, slot: Any) -> None:
        """Refuses, by name, a slot that is not the cache's or not all in this process."""
        ...

    def slot_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        """The runs of positions ``[lo, hi)`` of ``slot`` in the cache's own registered
        memory; ValueError where the cache has none (the rows pass through staging)."""
        ...

    # -- the decode side -----------------------------------------------------------------------

    def landing_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        """The runs the prefill side is to write positions ``[lo, hi)`` of ``slot`` into."""
        ...

    def admit(self, state: Any, reservation: Any, lo: int, hi: int) -> Any:
        """The live state with ``reservation`` (which mapped ``lo`` tokens) admitted at
        ``hi``, the rows received in it."""
        ...

    def set_aside(self, reservation: Any, lo: int, hi: int, seconds: float) -> str:
        """After a failed receive whose writes may still land: cancels ``reservation`` and
        holds what those writes of positions ``[lo, hi)`` can land in aside for ``seconds``;
        returns what was held, for the error (", its blocks held aside for ...")."""
        ...

    def quarantined(self) -> dict[int, float]:
        """``{slot: seconds until it is freed}`` of the slots held aside."""
        ...

    def reclaim(self, wait: bool) -> list[int]:
        """Frees what was held aside and whose time has passed (``wait``: all of it, after
        sleeping until the last one's time); returns the slots freed."""
        ...

    # -- the prefill side ----------------------------------------------------------------------

    def source_runs(self, state: Any, slot: int, lo: int, hi: int) -> list[dict]:
        """The runs positions ``[lo, hi)`` of ``slot`` are written from, the rows of
        ``state`` (the live state, drained) in them."""
        ...


def slot_rows_endpoint(
    cache: Any,
    role: str,
    *,
    populate_pools: bool,
    populate_staging: bool,
    clock: Callable[[], float] = time.monotonic,
) -> SlotRowsEndpoint:
    """The endpoint of ``cache``'s kind, after refusing a cache that cannot take part: a
    cache whose rows pass through staging (:class:`~jax_tpusync.caches.capabilities.StagedRows`)
    gets a :class:`~jax_tpusync.pd.pool_staging.PoolStagingEndpoint`, any other an
    :class:`~jax_tpusync.pd.tier_endpoint.EngineTierEndpoint` (which refuses a cache that is
    not :class:`~jax_tpusync.caches.capabilities.EngineTierRows`).

    Args:
      cache: the role's cache (an OffloadedKVCache, a ShardedKVCache or a HostPoolKVCache).
      role: "KVReceiver" or "KVSender", for messages.
      populate_pools: fault an engine cache's pools in when they are registered.
      populate_staging: fault a staging buffer's pages in when it is mapped.
      clock: the time quarantines are counted in.

    Raises:
      TypeError, ValueError: a cache that cannot take part (the message says why).
    """
    if isinstance(cache, StagedRows):
        return PoolStagingEndpoint(cache, role, populate=populate_staging, clock=clock)
    return EngineTierEndpoint(cache, role, populate=populate_pools, clock=clock)
