"""Host-side reads and writes of a cache's rows, through the slots' block tables.

What :meth:`~jax_tpusync.cache.OffloadedKVCache.load`, ``read``, ``read_all`` and resident
mode's device copy move: rows of one (layer, K|V, slot) located block by block
(:meth:`HostRows.runs`), batched into one engine request per tier, as the tier stores them
(values in the cache's dtype, or quantized rows: codes then scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync import blocks, quantize
from jax_tpusync.engine import Engine
from jax_tpusync.levels import TierBlocks
from jax_tpusync.slots import SlotTable
from jax_tpusync.state import CacheSpec, dtype_error, exact_cast_allowed


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
    capacity = slots.capacity
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
    return k, v, starts, counts
