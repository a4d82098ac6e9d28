"""What the commit protocol reads and writes of a cache: a narrow interface, not the cache.

:class:`~jax_tpusync.persist.commit.Persistence` and :class:`~jax_tpusync.persist.checksums.Checksums`
are given a :class:`PersistedKV` when the cache has opened its tier: the cache's layout, how
to read committed bytes back from the tier (:class:`TierReader`), how to wait for write-backs
in flight, the slot table's tables, capacities and shared prefixes (read), the prefix index
and token history (read, and written once on re-attach), and the slot table's ``restore``.
Nothing else of the cache is reachable from the protocol, so it can be tested, and reasoned
about, from these fields alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_tpusync.core.history import TokenHistory
from jax_tpusync.core.prefix import Entry, PrefixIndex
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.runtime.engine import Engine

__all__ = ["PersistedKV", "TierReader"]


@dataclasses.dataclass(frozen=True)
class TierReader:
    """Reads committed KV back from the tier (for checksums).

    Attributes:
      engine: submits the reads and waits for them.
      tier: the engine's id of the tier holding the cache's DRAM blocks.
      first_block: the tier block of the cache's physical block 0 of layer 0's K.
      rows: ``rows(layer, kv, slot, lo, hi)``: ``(tier byte offset, bytes)`` runs holding
        positions ``[lo, hi)`` of ``slot``'s K (``kv=0``) or V (1), through its block table.
    """

    engine: Engine
    tier: int
    first_block: int
    rows: Callable[[int, int, int, int, int], list[tuple[int, int]]]


@dataclasses.dataclass(frozen=True)
class PersistedKV:
    """Everything the commit protocol reads and writes of one opened cache.

    Attributes:
      spec: the cache's layout (a :class:`~jax_tpusync.core.state.CacheSpec`: batch, layers,
        ``max_len``, ``block_tokens``, ``num_blocks``, ``block_bytes``, ``row_bytes``).
      reader: reads committed bytes back for checksums.
      drain: waits until every write-back in flight has landed (or failed, raising).
      block_tables: int32[batch, max_blocks] of the slots' blocks now (a copy).
      capacity: int32[batch] of the slots' capacities now (a copy).
      shared: int32[batch] of each slot's leading blocks mapped from the index (a copy).
      index: the prefix index (its root, entries in eviction order, eviction count).
      history: each slot's token ids (recorded by commits, restored on re-attach).
      restore: ``restore(tables, capacity, shared, entries)``: the slot table holds a
        commit's blocks and the index its entries again (re-attach only).
    """

    spec: CacheSpec
    reader: TierReader
    drain: Callable[[], None]
    block_tables: Callable[[], np.ndarray]
    capacity: Callable[[], np.ndarray]
    shared: Callable[[], np.ndarray]
    index: PrefixIndex
    history: TokenHistory
    restore: Callable[[np.ndarray, np.ndarray, np.ndarray, Sequence[Entry]], None]

    @classmethod
    def of_slots(
        cls, spec: CacheSpec, reader: TierReader, drain: Callable[[], None], slots: Any
    ) -> PersistedKV:
        """The view of a cache whose host side is the slot table ``slots`` (a
        :class:`~jax_tpusync.core.slots.SlotTable`: its tables, capacities, shared prefixes,
        index, token history and restore)."""
        return cls(
            spec=spec,
            reader=reader,
            drain=drain,
            block_tables=lambda: slots.tables,
            capacity=lambda: slots.capacity,
            shared=lambda: slots.shared,
            index=slots.prefix,
            history=slots.history,
            restore=slots.restore,
        )
