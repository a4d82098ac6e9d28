"""Persistence of a host pool: its copy on an engine tier, under the commit protocol.

A :class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` keeps its KV in a JAX array in pinned
host memory that every step carries (:mod:`jax_tpusync.core.pool_state`). The commit protocol
(:mod:`jax_tpusync.persist.commit`) makes rows durable on an engine tier, checksums them by
reading them back from it, and re-attaches a tier's blocks after a restart. So a persistent
host-pool cache (``shm_name=`` or ``file_name=``) keeps a copy of its pool on a shm or file
tier of an engine of its own, in the byte layout of the engine cache's tier
(:class:`~jax_tpusync.core.levels.TierBlocks`: one region of ``num_blocks`` blocks per (layer,
K|V), a block ``block_tokens`` rows of one K or V row each), and :class:`PoolTier` moves
blocks between the two, between steps:

* **flush** (:meth:`PoolTier.flush`, what the protocol's ``drain`` does, and the first half
  of a commit): the blocks written in the pool since the last flush are gathered from the
  state's pool by jitted programs of a few blocks each
  (:func:`~jax_tpusync.caches.pool.blocks.gather_blocks`), in batches of
  :data:`FLUSH_BATCH_BYTES`, each written to the tier by the engine while the next is
  gathered; the commit then syncs and checksums them. Written
  since the last flush: each active slot's blocks from its flushed length to its length
  (steps only append past a slot's length), blocks :meth:`load
  <jax_tpusync.caches.pool.cache.HostPoolKVCache.load>` wrote, and a released slot's blocks past
  its flushed length (its full ones enter the prefix index). Writing a block the last
  commit covers is harmless: its committed rows hold the same bytes in the pool (decode
  never rewrites them, and a ``load`` or ``init`` below the committed lengths commits them
  away first).
* **restore** (:meth:`PoolTier.restored_pool`): on re-attach the protocol restores the slot
  table and the prefix index; the first ``init()`` reads the committed blocks (each slot's
  up to its committed length, every indexed block) from the tier into the new pool.

Over a mesh (``kv_heads_axis``) each device's pool holds its own heads: the tier holds every
head, as a one-device cache's does (a token's K row is the shards' K rows in head order),
so a flush joins the shards' rows of each block and a restore splits them again. A
quantized row (every head's codes, then every scale, then padding) is joined by part: the
shards' codes in head order, then their scales, padded as one row of every head
(:func:`~jax_tpusync.core.quantize.join_row_shards`), so the tier is the one-device layout
here too, and a restore splits codes and scales back per shard.

Blocks a prefix level imports (into the pool only once the admission is applied to a state)
are written to the tier at once (:meth:`PoolTier.write_payloads`), since the index holds
them from the reservation on and a commit may hash them before.

The protocol's ``drain`` has no state argument: the cache names the state of the host call
under way with :meth:`PoolTier.reading` (a release, a load, an init).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from jax_tpusync.caches.pool import blocks as pool_blocks
from jax_tpusync.core import quantize
from jax_tpusync.core.host_io import HostRows
from jax_tpusync.core.levels import TierBlocks
from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_state import PoolLayout
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.persist.persisted_kv import PersistedKV, TierReader
from jax_tpusync.runtime.engine import Engine

logger = logging.getLogger(__name__)

__all__ = ["FLUSH_BATCH_BYTES", "RESTORE_BATCH_BYTES", "PoolTier", "tier_spec"]

# Bytes of blocks gathered from the pool per engine write while flushing: the host memory a
# flush takes (twice: the batch being written and the next one being gathered), however
# many blocks it moves.
FLUSH_BATCH_BYTES = 32 << 20
# Bytes of tier blocks read per engine request while a re-attached pool is rebuilt.
RESTORE_BATCH_BYTES = 64 << 20


class PoolTier:
    """The copy of one host pool on a persistent engine tier (see the module docstring).

    Made by :meth:`open`; :meth:`persisted_kv` is what the commit protocol is given. Not
    thread-safe: used from the thread that drives the cache.
    """

    def __init__(
        self,
        engine: Engine,
        store: TierBlocks,
        layout: PoolLayout,
        slots: SlotTable,
        mesh: MeshLayout | None = None,
    ):
        self.engine = engine
        self.store = store
        self.layout = layout
        self.slots = slots
        self.mesh = mesh
        self.shards = 1 if mesh is None else mesh.num_shards
        spec = layout.spec
        self.spec = tier_spec(layout, mesh)
        self._rows = HostRows(self.spec, engine, store, slots)
        # Per slot: rows below this are on the tier as the pool holds them (or need not be).
        self._flushed = np.zeros(spec.batch, np.int64)
        # (layer, block) pairs written in the pool since the last flush, besides the ranges.
        self._marked: set[tuple[int, int]] = set()
        # (pool, int[batch] lengths) of the host call under way (see reading()).
        self._current: tuple[Any, np.ndarray] | None = None

    @classmethod
    def open(
        cls, config: Any, layout: PoolLayout, slots: SlotTable, mesh: MeshLayout | None = None
    ) -> PoolTier:
        """Opens the persistent tier ``config`` names (``shm_name`` or ``file_name``) on an
        engine of its own, with the cache's blocks (every head's) allocated as an engine
        cache's are."""
        engine = Engine()
        try:
            store = TierBlocks.open(engine, config, tier_spec(layout, mesh), None)
        except Exception:
            engine.close()
            raise
        return cls(engine, store, layout, slots, mesh)

    @property
    def attached(self) -> bool:
        """Whether the tier existed before it was opened (persisted KV to re-attach)."""
        return bool(self.engine.tier_info(self.store.tier).attached)

    def persisted_kv(self) -> PersistedKV:
        """What the commit protocol reads and writes: the tier, this flush as its drain,
        the slot table's tables, index, history and restore."""
        reader = TierReader(
            engine=self.engine,
            tier=self.store.tier,
            first_block=self.store.first_block,
            rows=self.tier_rows,
        )
        return PersistedKV.of_slots(self.spec, reader, self._drain, self.slots)

    def tier_rows(self, layer: int, kv: int, slot: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """``(tier byte offset, bytes)`` runs of positions ``[lo, hi)`` of ``slot``'s K
        (``kv=0``) or V (1) in ``layer``, through its block table."""
        return [(offset, n) for _, offset, n in self._rows.runs(layer, kv, slot, lo, hi)]

    def close(self) -> None:
        """Closes the engine (waits for its writes; the tier's data stays)."""
        self.engine.close()

    # -- what the pool's host calls tell ----------------------------------------------------

    @contextlib.contextmanager
    def reading(self, pool: Any, lengths: np.ndarray) -> Iterator[None]:
        """The pool (and its slots' lengths) that a flush inside this block reads: the
        state of the host call under way."""
        self._current = (pool, np.asarray(lengths, np.int64).copy())
        try:
            yield
        finally:
            self._current = None

    def started(self, lengths: np.ndarray, restored: np.ndarray | None) -> None:
        """A first state of ``lengths`` was made: rows below the restored lengths are the
        tier's (read from it); any others the pool holds are zeros still to be flushed."""
        held = np.zeros_like(self._flushed) if restored is None else np.asarray(restored)
        self._flushed = np.minimum(np.asarray(lengths, np.int64), held.astype(np.int64))
        self._marked.clear()

    def admitted(self, slot: int, cached: int) -> None:
        """``slot`` was admitted with ``cached`` tokens mapped from the index (on the tier
        already, or marked with the slot that wrote them)."""
        self._flushed[slot] = cached

    def releasing(self, slot: int, length: int) -> None:
        """``slot`` of ``length`` tokens is about to be released: its unflushed blocks stay
        to be flushed (the full ones enter the index), and it holds no rows after."""
        self._mark_range(slot, int(self._flushed[slot]), length)

    def released(self, slot: int) -> None:
        self._flushed[slot] = 0

    def loaded(self, layer: int, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[b], starts[b] + counts[b])`` of ``layer`` were written host-side."""
        bt = self.layout.spec.block_tokens
        for b in np.flatnonzero(np.asarray(counts) > 0):
            lo, hi = int(starts[b]), int(starts[b] + counts[b])
            table = self.slots.table_row(int(b))
            self._marked.update((layer, int(p)) for p in table[lo // bt : -(-hi // bt)])

    def write_payloads(self, payloads: dict[int, np.ndarray]) -> None:
        """Writes blocks a prefix level imported (:class:`~jax_tpusync.caches.pool.blocks.PoolBlocks`
        payloads: every layer's rows, K then V per row, each shard's) to the tier, in its
        layout."""
        spec = self.layout.spec
        for block, payload in payloads.items():
            rows = np.asarray(payload).reshape(
                spec.num_layers, spec.block_tokens, 2, self.shards, spec.row_bytes
            )
            # -> [layer, K|V, block_tokens, row bytes of every head]: the tier's regions.
            tier = self._joined(rows.transpose(0, 2, 1, 3, 4))
            self.store.write_block(int(block), np.ascontiguousarray(tier).reshape(-1))

    def _joined(self, rows: np.ndarray) -> np.ndarray:
        """uint8[..., shards, row bytes of one shard] -> uint8[..., the tier's row bytes]:
        the shards' rows of one token as the tier's row of every head (see the module)."""
        spec = self.layout.spec
        if self.shards > 1 and spec.quantized:
            return quantize.join_row_shards(rows, spec.num_kv_heads, spec.head_dim)
        return rows.reshape(*rows.shape[:-2], -1)

    def _split(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`_joined` undone: uint8[..., the tier's row bytes] -> uint8[..., shards,
        row bytes of one shard]."""
        spec = self.layout.spec
        if self.shards > 1 and spec.quantized:
            return quantize.split_row_shards(rows, self.shards, spec.num_kv_heads, spec.head_dim)
        return rows.reshape(*rows.shape[:-1], self.shards, spec.row_bytes)

    # -- flush and restore ------------------------------------------------------------------

    def _drain(self) -> None:
        """The protocol's drain: flushes the pool of the host call under way. Outside one
        (before the first state, or a cancelled reservation, whose slot holds no committed
        rows) there is nothing the commit reads that is not on the tier already."""
        if self._current is None:
            if self._marked:
                raise RuntimeError(
                    "tpusync: a host-pool commit outside a host call with blocks to flush"
                )
            return
        self.flush(*self._current)

    def flush(self, pool: Any, lengths: np.ndarray) -> int:
        """Writes the blocks written in ``pool`` since the last flush (slots at ``lengths``)
        to the tier, and waits for the writes; returns the blocks written (per layer).

        Raises:
          TpusyncError: a write failed (nothing is marked flushed).
        """
        lengths = np.asarray(lengths, np.int64)
        pairs = set(self._marked)
        bt = self.layout.spec.block_tokens
        for b in np.flatnonzero(lengths > self._flushed):
            table = self.slots.table_row(int(b))
            blocks = table[int(self._flushed[b]) // bt : -(-int(lengths[b]) // bt)]
            pairs.update(
                (layer, int(p)) for p in blocks for layer in range(self.layout.spec.num_layers)
            )
        ordered = sorted(pairs)
        per_batch = max(1, FLUSH_BATCH_BYTES // (2 * self.spec.block_bytes))
        tickets: list[int] = []
        try:
            # Each batch is gathered while the engine writes the one before.
            for at in range(0, len(ordered), per_batch):
                batch = ordered[at : at + per_batch]
                starts = np.asarray([self.layout.block_row(layer, p) for layer, p in batch])
                rows = pool_blocks.gather_blocks(self.layout, self.mesh, pool, starts)
                tickets.append(self._submit_write(batch, rows))
                if len(tickets) > 1:
                    self.engine.wait(tickets.pop(0))
            while tickets:
                self.engine.wait(tickets.pop(0))
        finally:
            for ticket in tickets:  # An error: the writes in flight still land first.
                try:
                    self.engine.wait(ticket)
                except Exception:  # noqa: BLE001, S110 - the first error is the one raised.
                    pass
        self._flushed = lengths.copy()
        self._marked.clear()
        return len(ordered)

    def _submit_write(self, pairs: list[tuple[int, int]], rows: np.ndarray) -> int:
        """Queues the tier writes of pool ``rows`` ([shards, len(pairs) * block_tokens,
        row_width]) of the (layer, block) ``pairs``: each block's K rows and V rows (every
        shard's heads joined) to their regions. Returns the engine's ticket."""
        store, bb = self.store, self.spec.block_bytes
        bt, rb = self.layout.spec.block_tokens, self.layout.spec.row_bytes
        rows = rows.view(np.uint8).reshape(self.shards, len(pairs), bt, 2, rb)
        # [n, K|V, block_tokens, tier row]: each (block, K|V) one tier block's bytes.
        data = np.ascontiguousarray(self._joined(rows.transpose(1, 3, 2, 0, 4)))
        segments = [
            (store.locate(layer * 2 + kv, block)[1], (i * 2 + kv) * bb, bb)
            for i, (layer, block) in enumerate(pairs)
            for kv in range(2)
        ]
        return self.engine.submit_write(store.tier, segments, data)

    def _mark_range(self, slot: int, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        bt = self.layout.spec.block_tokens
        blocks = self.slots.table_row(slot)[lo // bt : -(-hi // bt)]
        layers = range(self.layout.spec.num_layers)
        self._marked.update((layer, int(p)) for p in blocks for layer in layers)

    def restored_pool(self, lengths: np.ndarray) -> np.ndarray:
        """A host copy of a pool (the state's shape: [pool_rows, row_width], with a leading
        axis of shards over a mesh; the pool's dtype) holding the committed blocks: each
        slot's below ``lengths`` (the committed ones) and every block the prefix index
        holds, read from the tier; zeros elsewhere."""
        spec, layout = self.layout.spec, self.layout
        bt = spec.block_tokens
        tables = self.slots.tables
        held: set[int] = {int(e.block) for e in self.slots.prefix.entries_in_order()}
        for b, n in enumerate(np.asarray(lengths, np.int64).tolist()):
            held.update(int(p) for p in tables[b, : -(-n // bt)])
        pool = np.zeros((self.shards, *layout.pool_shape), layout.dtype)
        as_bytes = pool.view(np.uint8)  # [shards, pool_rows, 2 * row_bytes]: K then V a row
        blocks = sorted(held)
        per_read = max(1, RESTORE_BATCH_BYTES // self.store.payload_bytes)
        for at in range(0, len(blocks), per_read):
            batch = blocks[at : at + per_read]
            for block, payload in zip(batch, self.store.read_blocks(batch)):
                # Regions (layer, K|V) of block_tokens rows of every shard's heads -> per
                # shard and layer, rows of K then V.
                rows = self._split(payload.reshape(spec.num_layers, 2, bt, -1))
                rows = rows.transpose(3, 0, 2, 1, 4).reshape(self.shards, spec.num_layers, bt, -1)
                for layer in range(spec.num_layers):
                    first = layout.block_row(layer, block)
                    as_bytes[:, first : first + bt] = rows[:, layer]
        logger.info("restored %d committed blocks of every layer into the pool", len(blocks))
        return pool if self.mesh is not None else pool[0]


def tier_spec(layout: PoolLayout, mesh: MeshLayout | None) -> Any:
    """The :class:`~jax_tpusync.core.state.CacheSpec` of a pool's tier: the pool's, with every
    head (a mesh pool's spec describes one shard's)."""
    spec = layout.spec
    if mesh is None:
        return spec
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * mesh.num_shards, mesh=None)
