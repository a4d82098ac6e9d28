"""What a cache can do beyond :class:`~jax_tpusync.caches.protocol.KVCache`: one small
protocol per optional capability, so that a caller asks ``isinstance(cache, Capability)``
(or asks the cache) rather than which class it is.

* :class:`Verifiable`, :class:`PrefixStats`, :class:`KeptFrom`: a persistent tier's
  checksums, the prefix index's counters, a window ring's first kept position.
* :class:`SplitState`: a cache of parts (mesh shards, batch shards, layer groups) whose
  state splits into its parts' states.
* :class:`StoredRows`: a slot's rows of every layer as the bytes the cache stores them in.
* :class:`HeadSplit`: how the cache's KV heads are split over equal head ranges, each in a
  pool of its own; P/D transfer needs the same split on both sides.
* :class:`EngineTierRows`: the rows lie in engine host pools that stay where they are, one
  one-device cache per head range (:class:`TierPart`): P/D transfer registers them and moves
  a slot's rows in place.
* :class:`StagedRows`: the rows lie in a pool the state carries, which moves with every
  step: P/D transfer moves them through a staging buffer, as stored rows.

Every protocol is ``runtime_checkable``: ``isinstance`` checks that the members exist (a
property is read to check it), not their signatures; ``tests/caches/test_capabilities.py``
checks which cache claims which, with the protocols' parameters, and that no module but
:mod:`jax_tpusync.factory` (which builds the caches) checks a concrete cache class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from jax_tpusync.core.state import CacheSpec

__all__ = [
    "EngineTierRows",
    "HeadSplit",
    "KeptFrom",
    "PrefixStats",
    "SplitState",
    "StagedRows",
    "StoredRows",
    "TierPart",
    "Verifiable",
]


@runtime_checkable
class Verifiable(Protocol):
    """A cache whose committed rows and indexed prefix blocks carry checksums (a persistent
    tier): :meth:`verify` re-reads and checks them."""

    def verify(self, state: Any = None) -> Any:
        """Re-reads the last commit's rows and indexed prefix blocks and checks their
        checksums (``state`` given: its transfers in flight ended first); returns what was
        checked (a cache of parts: ``{part: result}``). Raises ValueError for a cache that
        is not on a persistent tier, ``ChecksumMismatchError`` naming what differs."""
        ...


@runtime_checkable
class PrefixStats(Protocol):
    """A cache with a prefix index (a cache of parts: one per part)."""

    @property
    def prefix_stats(self) -> dict:
        """The prefix index's counters (hits, blocks, evictions, ...); a cache of parts:
        ``{part: counters}``."""
        ...


@runtime_checkable
class KeptFrom(Protocol):
    """A cache whose slots may keep only their sliding window (a ring of blocks)."""

    def kept_from(self, state: Any) -> np.ndarray:
        """int[batch]: the first position each slot still holds in ``state`` (0 where it
        holds every position)."""
        ...


@runtime_checkable
class SplitState(Protocol):
    """A cache made of parts (a mesh's shards, batch shards, layer groups): its state is
    assembled from its parts' states and splits back into them."""

    def split(self, state: Any) -> Mapping[int, Any] | Sequence[Any]:
        """The parts' states of ``state`` (a mesh cache: ``{shard: state}`` of this
        process's shards; batch shards and layer groups: in order)."""
        ...


@runtime_checkable
class StoredRows(Protocol):
    """A cache that reads and writes a slot's rows of every layer as the bytes it stores
    them in (:mod:`jax_tpusync.caches.pool.stored_rows`: ``uint8[shards, num_layers, 2, n,
    row_bytes]``, per head shard and layer the K rows then the V rows), the byte order of an
    engine cache's tier runs."""

    def read_stored_rows(self, state: Any, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of ``slot``, every layer, as stored (a host copy)."""
        ...

    def load_stored_rows(self, state: Any, slot: int, start: int, rows: np.ndarray) -> Any:
        """The live state with ``rows`` (as :meth:`read_stored_rows` gives them) written at
        ``start`` of ``slot``, its length grown as :meth:`KVCache.load` of every layer
        would."""
        ...


@runtime_checkable
class HeadSplit(Protocol):
    """A cache whose KV heads are split over equal head ranges, each range's rows in a
    pool of its own (one range, every head, on one device). Two caches exchange rows byte
    for byte only if they split the heads alike and share one range's row layout."""

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """``[(lo, hi), ...]``: the KV heads of each range, in head order (every range of
        the model, also those another process holds)."""
        ...

    @property
    def shard_spec(self) -> CacheSpec:
        """The spec of one head range's pool: its row layout (``num_kv_heads`` one
        range's)."""
        ...


class TierPart(NamedTuple):
    """One head range's one-device cache in this process, of an :class:`EngineTierRows`
    cache: ``cache`` (the cache itself, or mesh shard ``shard``) holds KV heads ``heads``
    of global slots ``rows``, as its own slots ``0 .. rows.stop - rows.start``."""

    shard: int | None
    cache: Any  # A one-device engine cache: its spec, engine and tier hold its pool.
    heads: slice
    rows: slice


@runtime_checkable
class EngineTierRows(HeadSplit, Protocol):
    """A cache whose rows lie on engine tiers whose host pools stay where they are: P/D
    transfer registers each head range's pool once and moves a slot's rows in place, in
    and out of the slot's blocks."""

    def tier_parts(self) -> list[TierPart]:
        """This process's one-device caches, one per head range and group of slots, in
        shard order."""
        ...


@runtime_checkable
class StagedRows(StoredRows, HeadSplit, Protocol):
    """A cache whose pool is an array its state carries, moved by every step (no address
    stays its own long enough to register): P/D transfer moves a slot's rows through a
    staging buffer of its own, read and loaded as stored rows, one per head range, between
    steps."""
