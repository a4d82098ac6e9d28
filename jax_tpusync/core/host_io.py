"""Host-side reads and writes of a cache's rows, through the slots' block tables.

What :meth:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache.load`, ``read``, ``read_all`` and resident
mode's device copy move: rows of one (layer, K|V, slot) located block by block
(:meth:`HostRows.runs`), batched into one engine request per tier, as the tier stores them
(values in the cache's dtype, or quantized rows: codes then scales). The calls' arguments
are checked here too (:meth:`HostRows.prepare_load`, :meth:`HostRows.checked_read`,
:meth:`HostRows.checked_read_all`), each refusal changing nothing, and so is the rule by
which loads grow a slot's length (:class:`LoadedExtent`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import blocks, quantize, window_ring
from jax_tpusync.core.config import is_int
from jax_tpusync.core.levels import TierBlocks
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.core.state import CacheSpec, dtype_error, exact_cast_allowed
from jax_tpusync.runtime.engine import Engine


class HostRows:
    """Row-level host I/O of one cache (its spec, engine, tier blocks and slot table)."""

    def __init__(self, spec: CacheSpec, engine: Engine, store: TierBlocks, slots: SlotTable):
        self.spec = spec
        self.engine = engine
        self.store = store
        self.slots = slots

    def runs(self, layer: int, kv: int, slot: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(tier, tier byte offset, bytes)`` runs holding positions ``[lo, hi)`` of
        ``slot``'s K (``kv=0``) or V (1) in ``layer``; consecutive blocks merged. Raises if
        a position has no block."""
        spec = self.spec
        out = []
        table = self.slots.table_row(slot)
        for block, row, n in blocks.row_runs(table, spec.block_tokens, lo, hi, spec.num_blocks):
            tier, offset = self.store.locate(layer * 2 + kv, block)
            out.append((tier, offset + row * spec.row_bytes, n * spec.row_bytes))
        return out

    def tier_rows(self, layer: int, kv: int, slot: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """:meth:`runs` without the tier: ``(tier byte offset, bytes)`` on the cache's DRAM
        tier. Raises if a position's block is on a two-level cache's spill tier."""
        runs = self.runs(layer, kv, slot, lo, hi)
        if any(tier != self.store.tier for tier, _, _ in runs):
            raise ValueError(
                f"positions [{lo}, {hi}) of slot {slot} include blocks on the spill tier: "
                f"use tier_runs(), which names each run's tier"
            )
        return [(offset, n) for _, offset, n in runs]

    def kept_from(self, lengths: np.ndarray) -> np.ndarray:
        """int64[batch]: each slot's first position the tier still holds for ``lengths``
        (int[batch]): 0, or for a ring of a bounded window the window's first cached key."""
        lengths = np.asarray(lengths)
        if not self.spec.ring_blocks:
            return np.zeros(lengths.shape, np.int64)
        return window_ring.kept_from(lengths, self.spec.windows[0])

    def check_layer(self, layer: Any) -> None:
        """Refuses a layer that is not an int in ``[0, num_layers)``, naming it."""
        check_layer(layer, self.spec.num_layers)

    def segments(self, layer: int, kv: int, start: np.ndarray, counts: np.ndarray):
        """(tier, tier offset, memory offset, bytes) of rows ``[start[b], start[b] +
        counts[b])`` of every slot, packed slot after slot in memory."""
        rows = []
        mem = 0
        for b in range(self.spec.batch):
            lo, hi = int(start[b]), int(start[b] + counts[b])
            for tier, offset, n in self.runs(layer, kv, b, lo, hi):
                rows.append((tier, offset, mem, n))
                mem += n
        return rows

    def check_load(self, k, v, start, lengths):
        """``(k, v, starts, counts)`` of a :meth:`OffloadedKVCache.load`, checked against
        the slots (capacity, read-only prefix); raises, changing nothing."""
        spec = self.spec
        return check_load_rows(
            self.slots, spec.num_kv_heads, spec.head_dim, spec.dtype, k, v, start, lengths
        )

    def prepare_load(
        self,
        layer: int,
        k: Any,  # [batch, n, num_kv_heads, head_dim] ([n, ...] with slot)
        v: Any,  # [batch, n, num_kv_heads, head_dim] ([n, ...] with slot)
        start: Any,
        lengths: Any,
        slot: Any,
        state_lengths: Any,  # int[batch]: the slots' lengths in the state loaded (read if needed)
        loaded: LoadedExtent,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """``(k, v, starts, counts, skip)`` of a cache's ``load`` (see
        :meth:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache.load`), checked: the rows :meth:`write`
        writes. Refused (raising), nothing changes. A ring of a bounded window writes only
        the rows its window can still read (:func:`~jax_tpusync.core.window_ring.clip_rows`;
        ``skip`` rows dropped at the front of each slot's), and the slot table is told that
        the positions before them are no longer the sequence's."""
        spec = self.spec
        self.check_layer(layer)
        if slot is not None:
            k, v, start, lengths = one_slot_load(spec.batch, slot, k, v, start, lengths)
        k, v, starts, counts = self.check_load(k, v, start, lengths)  # Refused: no change.
        skip = None
        if spec.ring_blocks:  # Only the rows the window can still read (and no two alike).
            furthest = loaded.furthest(layer, state_lengths)
            starts, counts, skip = window_ring.clip_rows(starts, counts, furthest, spec.windows[0])
            for b in np.flatnonzero(counts):  # Rows before them are not the sequence's now.
                self.slots.note_written(int(b), int(starts[b]))
        return k, v, starts, counts, skip

    def write(
        self,
        layer: int,
        k: np.ndarray,  # [batch, n, num_kv_heads, head_dim], the cache's dtype
        v: np.ndarray,  # [batch, n, num_kv_heads, head_dim]
        starts: np.ndarray,  # int64[batch]
        counts: np.ndarray,  # int64[batch]
        skip: np.ndarray | None = None,  # int64[batch]: rows of k/v before each slot's first
    ) -> None:
        """Writes rows ``[starts[b], starts[b] + counts[b])`` of every slot from rows
        ``skip[b]`` on of ``k``/``v`` (quantized on the way, as the step's write-back would)
        and waits for them."""
        spec = self.spec
        tickets = []
        for kv, x in enumerate((k, v)):
            first = np.zeros(spec.batch, np.int64) if skip is None else skip
            rows = [x[b, first[b] : first[b] + counts[b]] for b in range(spec.batch)]
            if spec.quantized:  # The bytes the step's write-back would write for them.
                rows = [quantize.quantize_host(r, spec.tier_dtype) for r in rows]
            packed = np.concatenate([r.reshape(-1) for r in rows])
            segments = self.segments(layer, kv, starts, counts)
            # A slot's own blocks are DRAM blocks (the caller refused its shared prefix).
            assert all(tier == self.store.tier for tier, *_ in segments)
            tickets.append(
                self.engine.submit_write(
                    self.store.tier, [r[1:] for r in segments], packed, layer=layer
                )
            )
        for t in tickets:
            self.engine.wait(t)

    def checked_read(
        self,
        lengths: np.ndarray,  # int[batch]: the slots' lengths in the state read
        layer: Any,
        slot: Any,
        start: Any,
        stop: Any,
        *,
        raw: bool = False,
    ):
        """:meth:`read` of a cache's ``read`` arguments (see
        :meth:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache.read`), once checked: ``stop`` defaults
        to the slot's length, ``0 <= start <= stop <= length``, ``raw`` needs a quantized
        tier, and a ring of a bounded window refuses positions it no longer keeps."""
        self.check_layer(layer)
        self.slots.check_slot(slot)
        length = int(lengths[slot])
        if stop is None:
            stop = length
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= length):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) must lie in [0, {length}] (slot {slot}'s "
                f"length)"
            )
        if raw and not self.spec.quantized:
            raise ValueError("raw=True reads codes and scales: this cache's tier is not quantized")
        if self.spec.ring_blocks and start < (kept := int(self.kept_from(lengths)[slot])):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) reaches before position {kept}: slot "
                f"{slot} keeps only its sliding window (max_step_tokens), positions [{kept}, "
                f"{length})"
            )
        return self.read(layer, slot, start, stop, raw=raw)

    def read(self, layer: int, slot: int, start: int, stop: int, *, raw: bool = False):
        """K and V of positions ``[start, stop)`` of ``slot`` (see ``cache.read``)."""
        out = []
        for kv in range(2):
            buf = self.row_buffer((stop - start,))
            rows, mem = [], 0
            for tier, offset, n in self.runs(layer, kv, slot, start, stop):
                rows.append((tier, offset, mem, n))
                mem += n
            self.engine.transfer(rows, buf, write=False)
            out.append(self.from_rows(buf, raw=raw))
        return out[0], out[1]

    def read_all(
        self, layer: int, counts: np.ndarray, starts: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """K and V of every slot's positions ``[starts[b], counts[b])`` (``starts``
        default 0), zeros elsewhere: two [batch, max_len, H, D] arrays."""
        spec = self.spec
        if starts is None:
            starts = np.zeros_like(counts)
        out = []
        for kv in range(2):
            buf = self.row_buffer((spec.batch, spec.max_len))
            rows = []
            for b in range(spec.batch):
                lo = int(starts[b])
                mem = (b * spec.max_len + lo) * spec.row_bytes
                for tier, offset, n in self.runs(layer, kv, b, lo, int(counts[b])):
                    rows.append((tier, offset, mem, n))
                    mem += n
            self.engine.transfer(rows, buf, write=False)
            out.append(self.from_rows(buf))
        return out[0], out[1]

    def checked_read_all(self, layer: Any, lengths: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read_all` of a cache's ``read_all`` arguments (see
        :meth:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache.read_all`), once checked: every slot's
        positions below ``lengths`` (an int or one per slot in ``[0, max_len]``; default
        max_len) that its capacity and, for a ring, its window keep."""
        spec = self.spec
        self.check_layer(layer)
        counts = per_sequence("lengths", spec.max_len if lengths is None else lengths, spec.batch)
        if (counts < 0).any() or (counts > spec.max_len).any():
            raise ValueError(f"lengths must be in [0, max_len={spec.max_len}]; got {counts}")
        counts = np.minimum(counts, self.slots.capacity)
        return self.read_all(layer, counts, self.kept_from(counts))

    def row_buffer(self, lead: tuple[int, ...]) -> np.ndarray:
        """Zeros for ``lead`` rows as the tier stores them: [*lead, H, D] in the cache's
        dtype, or uint8[*lead, row_bytes] quantized."""
        spec = self.spec
        if spec.quantized:
            return np.zeros((*lead, spec.row_bytes), np.uint8)
        return np.zeros((*lead, spec.num_kv_heads, spec.head_dim), spec.dtype)

    def from_rows(self, rows: np.ndarray, *, raw: bool = False):
        """Rows read from the tier as KV in the cache's dtype (or codes and scales)."""
        spec = self.spec
        if not spec.quantized:
            return rows
        stored = quantize.unpack_host(rows, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
        if raw:
            return stored
        return quantize.dequantize_host(stored, spec.dtype)

    def resident_copy(
        self,
        staging: jax.Array | None = None,  # spec.staging_shape; None: build it whole
        *,
        layer: int | None = None,
        slot: int | None = None,
    ) -> jax.Array:  # spec.staging_shape
        """Resident staging holding the tier's rows of ``layer`` and ``slot`` (None: every
        layer, every slot), the others kept from ``staging``.

        Copies every position a slot's blocks hold (up to its capacity, not only its
        length): a later load that extends the lengths refreshes only its own layer, so the
        other layers' rows past the old lengths must already be there.
        """
        spec = self.spec
        capacity = self.slots.capacity
        layers = range(spec.num_layers) if layer is None else [layer]
        slots: Sequence[int] = range(spec.batch) if slot is None else [slot]
        buf = np.zeros((len(layers), 2, len(slots), spec.max_len, spec.row_bytes), np.uint8)
        rows = []
        for i, l in enumerate(layers):
            for kv in range(2):
                for j, b in enumerate(slots):
                    mem = ((i * 2 + kv) * len(slots) + j) * spec.max_len * spec.row_bytes
                    for _, offset, n in self.runs(l, kv, b, 0, int(capacity[b])):
                        rows.append((offset, mem, n))
                        mem += n
        if rows:  # Ordered after the write-backs in flight to the same bytes.
            self.engine.wait(self.engine.submit_read(self.store.tier, rows, buf))
        # The tier's bytes as staging holds them (values, their uint16 words, or raw rows).
        values = buf.view(spec.staging_dtype).reshape(buf.shape[:4] + spec.row_shape)
        if layer is None and slot is None:
            return jnp.asarray(values)
        if layer is None:
            return staging.at[:, :, slot].set(values[:, :, 0])
        if slot is None:
            return staging.at[layer].set(values[0])
        return staging.at[layer, :, slot].set(values[0, :, 0])


class LoadedExtent:
    """How host-side loads grow the slots' lengths: per layer and slot, the end of the
    furthest row a load wrote since the slot's admission (or the cache's ``init``); a
    slot's length grows to the rows every layer holds, and never shrinks.

    Attributes:
      ends: int64[num_layers, batch] of those ends.
    """

    def __init__(self, num_layers: int, batch: int):
        self.ends = np.zeros((num_layers, batch), np.int64)

    def reset(self, slot: int | None = None, to: int = 0) -> None:
        """Every slot's ends (or ``slot``'s alone) at ``to`` rows, in every layer: a new
        state (0), an admitted slot (its mapped prefix), a released one (0)."""
        if slot is None:
            self.ends[:] = to
        else:
            self.ends[:, slot] = to

    def furthest(self, layer: int, lengths: np.ndarray) -> np.ndarray:
        """int64[batch]: per slot, its length in ``lengths`` or the end of the furthest
        row loaded into ``layer``, whichever is further."""
        return np.maximum(self.ends[layer], np.asarray(lengths))

    def record(self, layer: int, starts: np.ndarray, counts: np.ndarray) -> None:
        """Notes rows ``[starts[b], starts[b] + counts[b])`` written to ``layer`` (a slot
        with no rows keeps its end)."""
        ends = self.ends[layer]
        written = counts > 0
        ends[written] = np.maximum(ends[written], (starts + counts)[written])

    def grown(self, lengths: np.ndarray) -> np.ndarray:
        """int64[batch]: ``lengths`` grown to the rows every layer holds."""
        return np.maximum(np.asarray(lengths).astype(np.int64), self.ends.min(axis=0))


def check_layer(layer: Any, num_layers: int) -> None:
    """Refuses a ``layer`` that is not an int in ``[0, num_layers)``, naming it."""
    if not is_int(layer) or not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer!r} is out of range for a cache of {num_layers} layers")


def as_cache_array(name: str, x: Any, dtype: Any) -> np.ndarray:
    """``x`` as a numpy array of the cache's ``dtype``, converted only if exactly."""
    x = np.asarray(x)
    if not exact_cast_allowed(x.dtype, dtype):
        raise ValueError(dtype_error(name, x.dtype, dtype))
    return x.astype(dtype, copy=False)


def per_sequence(name: str, value: Any, batch: int) -> np.ndarray:
    """int64[batch] from an int or one int per sequence."""
    array = np.asarray(value)
    if array.ndim > 1 or (array.ndim == 1 and array.shape != (batch,)):
        raise ValueError(f"{name} must be an int or {batch} ints (one per sequence); got {value!r}")
    if array.size and not (
        np.issubdtype(array.dtype, np.integer) and not np.issubdtype(array.dtype, np.bool_)
    ):
        raise ValueError(f"{name} must hold ints; got {value!r}")
    return np.broadcast_to(array.astype(np.int64), (batch,))


def one_slot_load(batch: int, slot: Any, k: Any, v: Any, start: Any, lengths: Any):
    """``load(..., slot=)``'s arguments as a whole-batch load that writes ``slot`` only:
    ``k``/``v`` [n, H, D] seen as [batch, n, H, D] (no copy), counts n for ``slot`` and 0
    for every other slot."""
    if not (isinstance(slot, (int, np.integer)) and not isinstance(slot, bool)) or not (
        0 <= slot < batch
    ):
        raise ValueError(f"slot={slot!r} must be an int in [0, batch={batch})")
    if lengths is not None:
        raise ValueError("lengths= is per slot of a whole-batch load; with slot= pass k[:n]")
    if not (isinstance(start, (int, np.integer)) and not isinstance(start, bool)):
        raise ValueError(f"with slot=, start={start!r} must be an int (that slot's position)")
    k, v = np.asarray(k), np.asarray(v)
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(
                f"with slot=, {name} must be [n, num_kv_heads, head_dim]; got {x.shape}"
            )
    n = k.shape[0]
    counts = [n if b == slot else 0 for b in range(batch)]
    starts = [int(start) if b == slot else 0 for b in range(batch)]
    return (
        np.broadcast_to(k[None], (batch, *k.shape)),
        np.broadcast_to(v[None], (batch, *v.shape)),
        starts,
        counts,
    )


def check_load_rows(
    slots: SlotTable,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    k: Any,  # [batch, n, num_kv_heads, head_dim]
    v: Any,  # [batch, n, num_kv_heads, head_dim]
    start: Any,
    lengths: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(k, v, starts, counts)`` of a cache's whole-batch ``load``, checked against its
    slot table ``slots`` (capacity, read-only prefix); raises, changing nothing."""
    batch = slots.batch
    k = as_cache_array("k", k, dtype)
    v = as_cache_array("v", v, dtype)
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != batch or x.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [batch={batch}, n, num_kv_heads={num_kv_heads}, "
                f"head_dim={head_dim}]; got {x.shape}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    n = k.shape[1]
    starts = per_sequence("start", start, batch)
    counts = per_sequence("lengths", n if lengths is None else lengths, batch)
    if (counts < 0).any() or (counts > n).any():
        raise ValueError(f"lengths must be in [0, n={n}]; got {counts}")
    check_load_range(slots, starts, counts)
    return k, v, starts, counts


def check_load_range(slots: SlotTable, starts: np.ndarray, counts: np.ndarray) -> None:
    """Refuses rows ``[starts[b], starts[b] + counts[b])`` of a slot that are not its own
    to write: before position 0, in its read-only shared prefix, or past its capacity."""
    capacity = slots.capacity
    batch = slots.batch
    for b in range(batch):
        if starts[b] < 0:
            raise ValueError(f"start={int(starts[b])} of slot {b} must be >= 0")
        shared = slots.shared_tokens(b)
        if counts[b] and starts[b] < shared:
            raise ValueError(
                f"rows [{int(starts[b])}, {int(starts[b] + counts[b])}) of slot {b} "
                f"overlap its shared prefix [0, {shared}): those blocks are read-only"
            )
        if counts[b] and starts[b] + counts[b] > capacity[b]:
            raise ValueError(
                f"start + lengths = {int(starts[b] + counts[b])} of slot {b} would "
                f"overflow its capacity of {int(capacity[b])} tokens"
                + (" (the slot is inactive: admit it first)" if not capacity[b] else "")
            )
