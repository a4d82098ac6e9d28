"""Which state of an offloaded cache is live: the epochs of its engine stream.

Every state an :class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache` hands out (``init``,
``drain``, ``recover``, the host-side calls) starts a new epoch of the cache's stream, so
that the engine refuses the ops of every earlier state and discards their unconsumed
prefetches. :class:`LiveState` keeps what that takes: the stream, the host's record of the
latest state's lengths (what a recovery starts from when no step ran since), and in
resident mode the epoch whose device copy of the tier is current.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.caches.offloaded import sparse_summaries
from jax_tpusync.core import blocks
from jax_tpusync.core.host_io import HostRows
from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.runtime import ops
from jax_tpusync.runtime.engine import Engine

__all__ = ["LiveState"]


class LiveState:
    """The live state's bookkeeping for one cache.

    Args:
      spec: the cache's layout.
      engine: the cache's engine; a stream of it is opened here (see :meth:`close`).
      target: int64[6], what every state's ``target`` carries.
      rows: the cache's row I/O (its slot table's tables and capacities, its tier blocks,
        resident copies).
      first_staging: staging for the first fresh state (None: zeros made then).

    Attributes:
      stream: the engine stream whose epochs the states are.
      lengths: int32[batch], the lengths of the latest state the host made or saw.
      resident_epoch: resident mode, the epoch of the latest state whose copy matches
        the tier (None: none yet).
      summaries_epoch: sparse, the epoch of the latest state whose block summaries match
        the tier (None: none yet).
    """

    def __init__(
        self,
        spec: CacheSpec,
        engine: Engine,
        target: np.ndarray,
        rows: HostRows,
        first_staging: jax.Array | None,
    ):
        self.spec = spec
        self.engine = engine
        self.target = target
        self.rows = rows
        self.first_staging = first_staging  # Handed to the first fresh state.
        self.lengths = np.zeros(spec.batch, np.int32)
        self.resident_epoch: int | None = None
        self.summaries_epoch: int | None = None
        self.stream = engine.open_stream()

    def check(self, state: KVState) -> None:
        """Refuses what is not a state of this cache, or a state donated to a step."""
        if not isinstance(state, KVState):
            raise TypeError(f"expected a KVState, got {type(state).__name__}")
        if state.lengths.is_deleted():
            raise ValueError(
                "this KVState was donated to a step (its buffers are gone); use the state "
                "that step returned, or cache.recover() if the step failed"
            )
        if state.spec != self.spec or not np.array_equal(np.asarray(state.target), self.target):
            raise ValueError(
                f"state belongs to another cache (target {np.asarray(state.target).tolist()}, "
                f"this cache's is {self.target.tolist()})"
            )

    def new_owner(self) -> jax.Array:
        """Starts a new epoch of the stream: every earlier state becomes stale and their
        unconsumed prefetches are discarded."""
        epoch = self.engine.begin_epoch(self.stream)
        return jnp.asarray([self.stream, epoch, 1], jnp.int32)

    def fresh(self, lengths: np.ndarray) -> KVState:
        """A state of the slot table's tables and ``lengths`` (int[batch]), fresh staging,
        a new epoch."""
        spec, slots = self.spec, self.rows.slots
        staging, self.first_staging = self.first_staging, None
        if spec.resident:
            staging = self.rows.resident_copy()
        elif staging is None:
            staging = jnp.zeros(spec.staging_shape, spec.staging_dtype)
        if not spec.resident:
            self.rows.store.note_staging_phase(staging)
        self.lengths = np.asarray(lengths, np.int32).copy()
        owner = self.new_owner()
        self.resident_epoch = self.summaries_epoch = int(np.asarray(owner)[1])
        tables = slots.tables
        sparse = None
        if spec.sparse is not None:  # Summaries of the rows the tier holds now.
            sparse = sparse_summaries.fresh_sparse(spec, self.rows, tables, self.lengths)
        return KVState.fresh(
            spec, lengths, tables, slots.capacity, staging, owner, self.target, sparse
        )

    def inert(self) -> KVState:
        """A state of the cache's structure that moves no bytes: every slot inactive, an
        unchecked owner, no epoch started."""
        spec = self.spec
        return KVState.fresh(
            spec,
            np.zeros(spec.batch, np.int32),
            np.full((spec.batch, spec.max_blocks), blocks.NO_BLOCK, np.int32),
            np.zeros(spec.batch, np.int32),
            jnp.zeros(spec.staging_shape, spec.staging_dtype),
            jnp.zeros((3,), jnp.int32),  # An unchecked owner.
            self.target,
        )

    def with_lengths(self, state: KVState, lengths: np.ndarray) -> KVState:
        """``state`` holding ``lengths`` (int[batch]), the host's record of them too."""
        self.lengths = np.asarray(lengths, np.int32).copy()
        return state.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def with_slots(self, state: KVState, lengths: np.ndarray) -> KVState:
        """:meth:`with_lengths`, and the slot table's block tables and capacities now."""
        slots = self.rows.slots
        return self.with_lengths(state, lengths).replace(
            block_table=jnp.asarray(slots.tables), capacity=jnp.asarray(slots.capacity)
        )

    def with_slot(self, state: KVState, slot: int, length: int) -> KVState:
        """:meth:`with_slots` of ``state``'s lengths with ``slot``'s set to ``length``: a
        slot admitted (at its mapped prefix) or released (0)."""
        lengths = np.asarray(state.lengths).copy()
        lengths[slot] = length
        state = self.with_slots(state, lengths)
        if self.spec.sparse is not None:
            # A new sequence (or none): no prediction; a mapped prefix's blocks get their
            # summaries from the tier (they may have been imported into it just now).
            sparse = sparse_summaries.with_slot_reset(state.sparse, slot)
            valid = np.broadcast_to(lengths, (self.spec.num_layers, self.spec.batch))
            spans = [(layer, slot, 0, length) for layer in range(self.spec.num_layers)]
            sparse = sparse_summaries.refreshed(
                self.spec, self.rows, sparse, self.rows.slots.tables, spans, valid
            )
            state = state.replace(sparse=sparse)
        return state

    def drain(self, state: KVState) -> KVState:
        """``state`` as the live one, in a new epoch, carrying no prefetches (see
        :meth:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache.drain`); resident mode: with a fresh
        copy of the tier unless it is the latest epoch's."""
        self.check(state)
        jax.block_until_ready(state)  # The step that made it has finished with the engine.
        self.lengths = np.asarray(state.lengths).copy()
        owner = self.new_owner()
        staging = state.staging
        if self.spec.resident:
            # Only the latest epoch's copy is known to match the tier: the host may have
            # changed the tier through a later state (load, admit) since an older one's.
            if int(np.asarray(state.owner)[1]) != self.resident_epoch:
                staging = self.rows.resident_copy()
            self.resident_epoch = int(np.asarray(owner)[1])
        sparse = state.sparse
        if self.spec.sparse is not None:
            # Likewise the summaries: an older epoch's may miss rows the host wrote since
            # through a later state; its predictions and counts stay.
            if int(np.asarray(state.owner)[1]) != self.summaries_epoch:
                tables = self.rows.slots.tables
                fresh = sparse_summaries.fresh_sparse(self.spec, self.rows, tables, self.lengths)
                sparse = sparse.replace(lo=fresh.lo, hi=fresh.hi)
            self.summaries_epoch = int(np.asarray(owner)[1])
        return state.replace(
            tickets=jnp.full((self.spec.num_tickets,), ops.NO_TICKET, jnp.int32),
            owner=owner,
            staging=staging,
            sparse=sparse,
        )

    def recovered_lengths(self) -> np.ndarray:
        """int32[batch]: the lengths after a failed step (see
        :meth:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache.recover`): the engine's record of the
        latest write-back's capacity guards in the current epoch, with the tokens of a
        step whose last layer's write-back was accepted; without a record, the host's."""
        lengths = self.lengths.copy()
        record = self.engine.last_guards(self.stream)
        if record is not None and len(record["lengths"]) == self.spec.batch:
            lengths = np.asarray(record["lengths"], np.int32)
            if record["accepted"] and record["layer"] == self.spec.num_layers - 1:
                lengths = lengths + np.asarray(record["counts"], np.int32)
        return lengths

    def close(self) -> None:
        """Closes the stream (unless the engine is closed already)."""
        if not self.engine.closed:
            self.engine.close_stream(self.stream)
