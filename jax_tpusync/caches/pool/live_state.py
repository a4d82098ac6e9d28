"""Which state of a host-pool cache is live, and how its per-slot leaves are placed:
:class:`PoolLiveState`.

A host-pool cache takes only its live state (``PoolState.epoch``): every state one of its
host calls hands out is stamped with a new epoch, unique across the process's caches, so a
state a later call superseded (whose block tables may name blocks other slots hold now)
and another cache's state of the same shape are refused by name. Over a mesh every
per-slot leaf has a leading axis of shards, the same value on every device; the helpers
here place a host value so and read one back.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np

from jax_tpusync.caches.pool import summaries as pool_summaries
from jax_tpusync.caches.pool.spill import check_pool_ids
from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_sparse import PoolSparseState, SummaryLayout
from jax_tpusync.core.pool_state import NOT_STAGED, PoolLayout, PoolState
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.sparse.config import SparseConfig

__all__ = ["PoolLiveState"]

# Epochs of live states, unique across the process's caches (PoolState.epoch).
EPOCHS = itertools.count(1)


class PoolLiveState:
    """The live state's bookkeeping for one host-pool cache.

    Args:
      spec: the cache's spec (one shard's, over a mesh).
      layout: the pool's layout.
      mesh: the heads' mesh (None: one device).
      slots: the cache's slot table, whose tables and capacities the states carry.
      state_sharding: where the state's small leaves and its staging live.
      pool_sharding: where the pool lives.
      sparse: the cache's sparse setting (None: dense): its states carry block summaries
        (beside the pool, in its memory), recomputed where a host call writes KV.

    Attributes:
      epoch: the live state's epoch (0: none yet).
      closed: the cache was closed: every later call is refused.
    """

    def __init__(
        self,
        spec: CacheSpec,
        layout: PoolLayout,
        mesh: MeshLayout | None,
        slots: SlotTable,
        state_sharding: jax.sharding.Sharding,
        pool_sharding: jax.sharding.Sharding,
        sparse: SparseConfig | None = None,
    ):
        self.spec = spec
        self.sparse = sparse
        self.layout = layout
        self.mesh = mesh
        self.slots = slots
        self.state_sharding = state_sharding
        self.pool_sharding = pool_sharding
        self.shards = 1 if mesh is None else mesh.tp
        self.epoch = 0
        self.closed = False

    def check_open(self) -> None:
        """Refuses every call once the cache is closed."""
        if self.closed:
            raise ValueError("this cache is closed")

    def state(self, lengths, block_table, capacity, pool_rows=None) -> PoolState:
        """A state of these per-slot tables over a pool of ``pool_rows`` (a host array of
        the pool's shape; None: zeros), nothing staged."""
        restored = pool_rows is not None
        if pool_rows is None:
            pool_rows = np.zeros(self.global_shape(self.layout.pool_shape), self.layout.dtype)
        pool = jax.device_put(pool_rows, self.pool_sharding)
        local = PoolState.fresh(self.spec, lengths, block_table, capacity, pool)
        state = local.replace(
            **{
                name: jax.tree.map(self.placed, getattr(local, name))
                for name in PoolState.FIELDS
                if name not in ("pool", "sparse")
            }
        )
        if self.sparse is None:
            return state
        summary = SummaryLayout(self.spec)
        state = state.replace(
            sparse=PoolSparseState(
                self.sparse,
                summaries=jax.device_put(
                    self.per_shard(summary.empty_rows(summary.shape[0])), self.pool_sharding
                ),
                previous=self.placed(self.no_previous()),
                counts=self.placed(np.zeros(PoolSparseState.counts_shape(self.spec), np.int32)),
                staged_chunk=self.placed(
                    np.zeros(PoolSparseState.staged_chunk_shape(self.spec), summary.dtype)
                ),
                staged_layer=self.placed(np.int32(NOT_STAGED)),
            )
        )
        if restored:  # The committed rows came in under empty summaries.
            lengths = np.asarray(lengths, np.int64)
            state = self.summarized(
                state, range(self.spec.num_layers), np.zeros_like(lengths), lengths
            )
        return state

    def no_previous(self) -> np.ndarray:
        """A sparse state's ``previous`` with no selection (every layer's prediction is
        its sink and recent blocks until it selects)."""
        shape = PoolSparseState.previous_shape(self.sparse, self.spec)
        return np.full(shape, -1, np.int32)

    def summarized(self, state: PoolState, layers, starts: np.ndarray, stops: np.ndarray):
        """``state`` with the summaries of the blocks positions ``[starts[b], stops[b])``
        of each slot touch in ``layers`` recomputed from its pool (KV a host call wrote);
        ``state`` itself without a sparse part."""
        if state.sparse is None:
            return state
        blocks = pool_summaries.blocks_of_ranges(
            self.spec, np.asarray(self.slots.tables), layers, starts, stops
        )
        return pool_summaries.summarize(self.layout, state, blocks, self.mesh)

    def global_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A state leaf's shape: one shard's, with a leading axis of shards over a mesh."""
        return shape if self.mesh is None else (self.shards, *shape)

    def per_shard(self, x: Any) -> np.ndarray:
        """One shard's value of a state leaf, the same on every shard (a leading axis of
        shards over a mesh)."""
        x = np.asarray(x)
        return x if self.mesh is None else np.broadcast_to(x, (self.shards, *x.shape))

    def placed(self, x: Any) -> jax.Array:
        """One shard's value of a state leaf, as the state holds it: on the device, or
        the same value on every device of the mesh (a leading axis of shards)."""
        return jax.device_put(self.per_shard(x), self.state_sharding)

    def host(self, x: jax.Array) -> np.ndarray:
        """A per-slot leaf of the state on the host (every shard holds the same)."""
        x = np.asarray(x)
        return x if self.mesh is None else x[0]

    def check(
        self, state: PoolState, *, releasing: int | None = None, refusals: bool = True
    ) -> None:
        """Refuses a state that is not the live one, or whose steps were refused for a
        slot, as :meth:`jax_tpusync.HostPoolKVCache.check` says."""
        self.check_open()
        if not isinstance(state, PoolState):
            raise TypeError(f"expected a PoolState, got {type(state).__name__}")
        if state.spec != self.spec:
            raise ValueError("state belongs to another cache (its spec differs)")
        if state.pool.is_deleted():
            raise ValueError(
                "this PoolState was donated to a step (its pool is gone); use the state "
                "that step returned"
            )
        if int(self.host(state.epoch)) != self.epoch:
            raise ValueError(
                "this PoolState is not the cache's live state: a later call returned another "
                "one (its block tables may name blocks other slots hold now), or it is another "
                "cache's; use the state the last call or step returned"
            )
        refused = self.refused_tokens(state)
        if not refusals or (releasing is not None and refused[releasing] > 0):
            return  # Releasing a refused slot: the way on for each of them.
        for b in np.flatnonzero(refused):
            raise ValueError(
                f"slot {b}: {int(refused[b])} tokens of its steps were refused (they would "
                f"have passed its capacity of {int(self.host(state.capacity)[b])} tokens, or "
                f"came with a traced layer outside [0, {self.spec.num_layers})); its length "
                f"stayed at {int(self.host(state.lengths)[b])}. Release the slot (and admit "
                f"it with a larger max_tokens where its capacity was the cause)"
            )

    def refused_tokens(self, state: PoolState) -> np.ndarray:
        """int32[batch]: tokens of each slot's steps that ``state``'s steps refused."""
        return np.asarray(self.host(state.refused))

    def tables(self) -> np.ndarray:
        """int32[batch, max_blocks]: the slot table's block tables, as a state carries
        them: ids of pool blocks only (a spill block there is a bug, refused)."""
        tables = np.asarray(self.slots.tables, np.int32)
        check_pool_ids(tables, self.spec.num_blocks)
        return tables

    def with_slots(self, state: PoolState, lengths: np.ndarray) -> PoolState:
        """The live state: ``state`` with ``lengths`` and the slot table's block tables and
        capacities now, nothing staged."""
        return self.unstaged(
            state.replace(
                lengths=self.placed(np.asarray(lengths, np.int32)),
                block_table=self.placed(self.tables()),
                capacity=self.placed(np.asarray(self.slots.capacity, np.int32)),
            )
        )

    def with_slot(self, state: PoolState, slot: int, length: int) -> PoolState:
        """:meth:`with_slots` of ``state``'s lengths with ``slot``'s set to ``length``: a
        slot admitted (at its mapped prefix) or released (0)."""
        lengths = self.host(state.lengths).copy()
        lengths[slot] = length
        state = self.with_slots(state, lengths)
        if length > 0:  # An admission: its mapped prefix may have come in by a host copy.
            starts, stops = np.zeros(self.spec.batch, np.int64), np.zeros(self.spec.batch, np.int64)
            stops[slot] = length
            state = self.summarized(state, range(self.spec.num_layers), starts, stops)
        return state

    def with_lengths(self, state: PoolState, lengths: np.ndarray) -> PoolState:
        """The live state: ``state`` with ``lengths`` (int[batch]), nothing staged (what a
        host-side write to the pool returns)."""
        return self.unstaged(state.replace(lengths=self.placed(np.asarray(lengths, np.int32))))

    def unstaged(self, state: PoolState) -> PoolState:
        """``state`` with nothing staged: what a host-side write to the pool returns (a
        staged unit may hold the rows it replaced); the live state from now on."""
        staged_at = self.placed(np.full(self.layout.staged_at_shape, NOT_STAGED, np.int32))
        state = state.with_staged_units(
            (staging, tail, staged_at) for staging, tail, _ in state.staged_units
        )
        if state.sparse is not None:  # Selections (and summaries) of changed rows.
            state = state.replace(
                sparse=state.sparse.replace(
                    previous=self.placed(self.no_previous()),
                    staged_layer=self.placed(np.int32(NOT_STAGED)),
                )
            )
        return self.stamped(state)

    def stamped(self, state: PoolState) -> PoolState:
        """``state`` stamped as the one live state: any state made before is refused."""
        self.epoch = next(EPOCHS) % np.iinfo(np.int32).max + 1
        return state.replace(epoch=self.placed(np.int32(self.epoch)))
