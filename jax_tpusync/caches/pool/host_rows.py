"""A host pool's host-side row calls, between steps: :class:`PoolHostRows`.

:meth:`~jax_tpusync.HostPoolKVCache.load`, :meth:`~jax_tpusync.HostPoolKVCache.read` and the
stored-row calls P/D transfer uses (:meth:`~jax_tpusync.HostPoolKVCache.load_stored_rows`,
:meth:`~jax_tpusync.HostPoolKVCache.read_stored_rows`): their arguments checked before any
byte moves (a refusal changes nothing), the persistent tier told before committed rows
change, the rows moved by whole blocks (:mod:`jax_tpusync.caches.pool.rows`,
:mod:`jax_tpusync.caches.pool.stored_rows`), and the slots' lengths grown to the rows every
layer holds (:class:`~jax_tpusync.core.host_io.LoadedExtent`). A pool of rings (a cache that
keeps only its sliding window) writes only the rows its window can still read and refuses
reads before it (:mod:`jax_tpusync.core.window_ring`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_tpusync.caches.pool import rows as pool_rows
from jax_tpusync.caches.pool import stored_rows as pool_stored_rows
from jax_tpusync.caches.pool.live_state import PoolLiveState
from jax_tpusync.caches.pool.persistence import PoolTier
from jax_tpusync.core import window_ring
from jax_tpusync.core.config import is_int
from jax_tpusync.core.host_io import (
    LoadedExtent,
    check_layer,
    check_load_range,
    check_load_rows,
    one_slot_load,
)
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.persist.commit import Persistence

__all__ = ["PoolHostRows"]


class PoolHostRows:
    """The host-side row calls of one host-pool cache (each takes the live state, checked
    by the caller).

    Args:
      live: the cache's live state (its placement, slot table, spec and layout).
      loaded: the extent of the host-side loads since each slot's admission.
      tier: the pool's persistent copy (None: not persistent).
      persistence: its commit protocol (None: not persistent).
    """

    def __init__(
        self,
        live: PoolLiveState,
        loaded: LoadedExtent,
        tier: PoolTier | None,
        persistence: Persistence | None,
    ):
        self.live = live
        self.loaded = loaded
        self.tier = tier
        self.persistence = persistence

    def load(
        self,
        state: PoolState,
        layer: int,
        k: jax.Array | np.ndarray,
        v: jax.Array | np.ndarray,
        start: int | Sequence[int],
        lengths: Sequence[int] | None,
        slot: int | None,
    ) -> PoolState:
        """:meth:`jax_tpusync.HostPoolKVCache.load`."""
        live, spec = self.live, self.live.spec
        slots = live.slots
        check_layer(layer, spec.num_layers)
        if slot is not None:
            k, v, start, lengths = one_slot_load(spec.batch, slot, k, v, start, lengths)
        heads = live.shards * spec.num_kv_heads
        k, v, starts, counts = check_load_rows(
            slots, heads, spec.head_dim, spec.dtype, k, v, start, lengths
        )  # Refused: no change.
        skip = np.zeros(spec.batch, np.int64)
        if spec.ring_blocks:  # Only the rows the window can still read (and no two alike).
            furthest = self.loaded.furthest(layer, live.host(state.lengths))
            starts, counts, skip = window_ring.clip_rows(starts, counts, furthest, spec.windows[0])
            for b in np.flatnonzero(counts):  # Rows before them are not the sequence's now.
                slots.note_written(int(b), int(starts[b]))
        self._writing(state, [layer], starts, counts)
        for b in np.flatnonzero(counts):
            n, table = int(counts[b]), slots.table_row(int(b))
            rows = slice(int(skip[b]), int(skip[b]) + n)
            pool = pool_rows.write_slot_rows(
                live.layout,
                live.mesh,
                state.pool,
                table,
                layer,
                int(starts[b]),
                k[b, rows],
                v[b, rows],
            )
            state = state.replace(pool=pool)
        state = live.summarized(state, [layer], starts, starts + counts)
        return self._grown(state, [layer], starts, counts)

    def load_stored_rows(
        self, state: PoolState, slot: int, start: int, rows: np.ndarray
    ) -> PoolState:
        """:meth:`jax_tpusync.HostPoolKVCache.load_stored_rows`."""
        live, spec = self.live, self.live.spec
        live.slots.check_slot(slot)
        if spec.ring_blocks:  # P/D transfer refuses such a cache before it gets here.
            raise ValueError(
                "load_stored_rows: this cache keeps only each slot's sliding window "
                "(max_step_tokens), whose ring does not hold every position: load its "
                "rows with load(), which keeps the window's"
            )
        if not is_int(start):
            raise ValueError(f"start={start!r} must be an int")
        n = np.shape(rows)[3] if np.ndim(rows) == 5 else -1
        want = pool_stored_rows.stored_shape(live.layout, live.shards, max(n, 0))
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.shape != want:
            raise ValueError(
                f"rows must be a uint8 array [shards={want[0]}, num_layers={want[1]}, 2, n, "
                f"row_bytes={want[4]}]; got {getattr(rows, 'dtype', type(rows).__name__)} "
                f"{np.shape(rows)}"
            )
        starts = np.zeros(spec.batch, np.int64)
        counts = np.zeros(spec.batch, np.int64)
        starts[slot], counts[slot] = int(start), n
        check_load_range(live.slots, starts, counts)  # Refused: no change.
        if n == 0:
            return state
        layers = range(spec.num_layers)
        self._writing(state, layers, starts, counts)
        pool = pool_stored_rows.write_stored_rows(
            live.layout, live.mesh, state.pool, live.slots.table_row(slot), int(start), rows
        )
        state = live.summarized(state.replace(pool=pool), layers, starts, starts + counts)
        return self._grown(state, layers, starts, counts)

    def _writing(
        self, state: PoolState, layers: Sequence[int], starts: np.ndarray, counts: np.ndarray
    ) -> None:
        """Before rows ``[starts, starts + counts)`` of ``layers`` are written: committed
        rows may change, so a persistent tier commits them gone first."""
        if self.tier is None:
            return
        with self.tier.reading(state.pool, self.live.host(state.lengths)):
            for layer in layers:
                self.persistence.note_rows_written(layer, starts, counts)
        for layer in layers:
            self.tier.loaded(layer, starts, counts)

    def _grown(
        self, state: PoolState, layers: Sequence[int], starts: np.ndarray, counts: np.ndarray
    ) -> PoolState:
        """The live state once rows ``[starts, starts + counts)`` of ``layers`` were
        written: each slot's length grown to the rows every layer holds."""
        for layer in layers:
            self.loaded.record(layer, starts, counts)
        grown = self.loaded.grown(self.live.host(state.lengths))
        return self.live.with_lengths(state, grown.astype(np.int32))

    def read_stored_rows(self, state: PoolState, slot: int, start: int, stop: int) -> np.ndarray:
        """:meth:`jax_tpusync.HostPoolKVCache.read_stored_rows`."""
        live = self.live
        live.slots.check_slot(slot)
        length = int(live.host(state.lengths)[slot])
        self._check_range(slot, start, stop, length)
        return pool_stored_rows.read_stored_rows(
            live.layout, live.mesh, state.pool, live.slots.table_row(slot), int(start), int(stop)
        )

    def read(
        self, state: PoolState, layer: int, slot: int, start: int, stop: int | None, raw: bool
    ) -> tuple[Any, Any]:
        """:meth:`jax_tpusync.HostPoolKVCache.read`."""
        live, spec = self.live, self.live.spec
        check_layer(layer, spec.num_layers)
        live.slots.check_slot(slot)
        if raw and not spec.quantized:
            raise ValueError("raw=True reads codes and scales: this cache's tier is not quantized")
        length = int(live.host(state.lengths)[slot])
        stop = length if stop is None else stop
        self._check_range(slot, start, stop, length)
        table = live.slots.table_row(slot)
        return pool_rows.read_slot_rows(
            live.layout, live.mesh, state.pool, table, layer, int(start), int(stop), raw
        )

    def kept_from(self, lengths: np.ndarray) -> np.ndarray:
        """int64[batch]: each slot of ``lengths`` its first position the pool still holds
        (0 but in a pool of rings)."""
        spec = self.live.spec
        if not spec.ring_blocks:
            return np.zeros(np.shape(lengths), np.int64)
        return window_ring.kept_from(lengths, spec.windows[0])

    def _check_range(self, slot: int, start: Any, stop: Any, length: int) -> None:
        """Refuses a range of ``slot``'s positions that is not ints with ``0 <= start <=
        stop <= length``, or that reaches before the window a ring still holds."""
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= length):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) must lie in [0, {length}] (slot {slot}'s "
                f"length)"
            )
        spec = self.live.spec
        kept = int(window_ring.kept_from(length, spec.windows[0])) if spec.ring_blocks else 0
        if start < kept:
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) reaches before position {kept}: slot "
                f"{slot} keeps only its sliding window (max_step_tokens), positions [{kept}, "
                f"{length})"
            )
