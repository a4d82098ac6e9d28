"""The offloaded KV cache: one object that owns an engine stream, a tier allocation, the
slot table and the persistence of one cache, and hands out the state a jitted step carries.

What each part does lives in its own module; this class wires them together and keeps the
host-side calls' rules (refuse before changing anything, drain before moving bytes under a
live state, a new epoch for every state it hands out):

* :mod:`jax_tpusync.config` — the keyword arguments as checked values;
* :mod:`jax_tpusync.layout` — staging units, slots and modes (the :class:`CacheSpec`);
* :mod:`jax_tpusync.slots` — block tables, allocators, the prefix index, eviction;
* :mod:`jax_tpusync.levels` — where block bytes live (tiers, the shared directory);
* :mod:`jax_tpusync.host_io` — host-side row reads and writes through the tables;
* :mod:`jax_tpusync.persistence` — commits, re-attach, verification.

Tier layout: paged. The cache owns one allocation of a tier holding ``num_blocks`` KV
blocks of ``block_tokens`` token rows per (layer, K|V) (see :mod:`jax_tpusync.blocks`).
A batch *slot* holds a sequence; its row of the state's block table maps its positions to
physical blocks, consecutive where it can. Device side: the state carries
``prefetch_depth + 1`` staging slots of one *unit* each (``chunk_len`` tokens of one layer,
K and V, all sequences), bounded by ``staging_bytes`` whatever the context length; or the
whole cache (resident mode); or nothing (read in place, CPU).

(Length: under 800 lines, a third of them the docstrings that are the cache's API reference;
what is left is wiring, each decision living in the modules above.)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync import backend, blocks, effects, layout, ops, persistence, window_ring
from jax_tpusync.config import CacheConfig, is_int, with_config
from jax_tpusync.engine import Engine, EngineConfig
from jax_tpusync.host_io import HostRows, one_slot_load, per_sequence
from jax_tpusync.levels import InPlaceRemoteLevel, SharedDirectoryLevel, TierBlocks
from jax_tpusync.mooncake_level import make_level
from jax_tpusync.persisted_kv import PersistedKV, TierReader
from jax_tpusync.slots import Admission, SlotTable
from jax_tpusync.spill import SpillTier
from jax_tpusync.state import KVState, staging_shape_of

logger = logging.getLogger(__name__)

# Re-exported: where users and the benchmarks have found them.
from jax_tpusync.config import MAX_PREFETCH_DEPTH  # noqa: E402
from jax_tpusync.layout import auto_prefetch_depth  # noqa: E402

__all__ = ["MAX_PREFETCH_DEPTH", "OffloadedKVCache", "auto_prefetch_depth"]


class OffloadedKVCache:
    """A KV cache kept in a host tier and streamed through fixed device staging buffers.

    Takes the keyword arguments :meth:`jax_tpusync.config.CacheConfig.from_kwargs`
    documents (geometry, tier, staging, prefix store, persistence), or ``config=`` a
    :class:`~jax_tpusync.config.CacheConfig` of them (a keyword the config holds too is
    refused by name), plus:

      engine: an :class:`Engine` to use, an :class:`EngineConfig` for a new one, or None
        (a new engine with the default config).
      shard: which shard of a mesh cache this is (0 on one device; set by
        :class:`jax_tpusync.mesh.ShardedKVCache`, which is what a mesh takes).

    Persistence (``shm_name`` or ``file_name``): see :mod:`jax_tpusync.persistence`. A new
    cache writes a manifest (commit 0); :meth:`commit` records the state's lengths and the
    prefix index; a re-attached cache restores the last commit's lengths as :meth:`init`'s
    default, and its prefix index (shared blocks stay pinned by the slots that map them).

    Raises:
      ValueError: an argument out of its range; the message names it and the range.
      TypeError: ``engine`` of another type.
    """

    def __init__(
        self,
        *,
        config: CacheConfig | None = None,
        engine: Engine | EngineConfig | None = None,
        mesh: None = None,
        kv_heads_axis: str | None = None,
        batch_axis: str | None = None,
        shard: int = 0,
        **options: Any,
    ):
        if mesh is not None:
            raise TypeError(
                "OffloadedKVCache is one device's cache: for a mesh use "
                "jax_tpusync.ShardedKVCache(mesh=..., ...) or jax_tpusync.kv_cache(mesh=..., ...)"
            )
        if kv_heads_axis is not None or batch_axis is not None:
            raise ValueError(
                f"kv_heads_axis={kv_heads_axis!r} and batch_axis={batch_axis!r} name axes of "
                f"a mesh: pass mesh= too"
            )
        # Every argument is checked before anything (engine, tier, file) is made.
        config = CacheConfig.from_kwargs(**with_config(config, options))
        config.geometry.check_one_cache()
        if not backend.runs_engine_ops():
            raise ValueError(
                f"the {backend.name()} backend does not run this cache's in-graph ops (XLA "
                f"custom calls, on CPU and CUDA only): use jax_tpusync.kv_cache(...), which "
                f"makes a HostPoolKVCache there"
            )
        if engine is not None and not isinstance(engine, (Engine, EngineConfig)):
            raise TypeError(
                f"engine must be an Engine, an EngineConfig or None; got {type(engine).__name__}"
            )
        debug_poison = config.staging.debug_poison
        if isinstance(engine, Engine) and debug_poison and not engine.config.poison_fetches:
            raise ValueError("debug_poison needs an engine made with poison_fetches=True")
        spec = layout.plan(config)
        tier = config.tier
        # Checked before the tier opens, so that a mismatch touches nothing.
        self.persistence = persistence.Persistence.prepare_for(config)
        self.config = config
        self.spec = spec
        self._restored_lengths: np.ndarray | None = None  # init()'s default once re-attached.
        self._closed = False
        self._first_staging: jax.Array | None = None  # Handed to the first init().
        self._owns_engine = not isinstance(engine, Engine)
        if isinstance(engine, Engine):
            self.engine = engine
        else:
            engine_config = engine or EngineConfig()
            if debug_poison and not engine_config.poison_fetches:
                engine_config = dataclasses.replace(engine_config, poison_fetches=True)
            self.engine = Engine(engine_config)
        try:
            self._open(config, shard)
        except Exception:
            if self._owns_engine:
                self.engine.close()
            raise
        logger.info(
            "offloaded KV cache: %s tier, %.1f MiB of KV, %.1f MiB staging%s, chunk_len=%d",
            tier.kind,
            spec.kv_bytes / 2**20,
            spec.device_bytes / 2**20,
            " (resident)" if spec.resident else "",
            spec.chunk_len,
        )

    def _open(self, config: CacheConfig, shard: int) -> None:
        """Opens the tier(s), allocates the blocks, builds the slot table and re-attaches
        persisted KV."""
        spec, g = self.spec, config.geometry
        engine = self.engine
        # Everything that can fail for a reason of its own comes before the tier is
        # opened, so that a refused cache leaves no tier file behind.
        root = config.prefix_root(persistence.LAYOUT_VERSION)
        remote = []
        if config.prefix.shared_dir is not None:
            remote.append(
                SharedDirectoryLevel(
                    config.prefix.shared_dir,
                    root=root,
                    num_layers=g.num_layers,
                    block_tokens=g.block_tokens,
                    block_bytes=spec.block_bytes,
                )
            )
        self._owned_levels: list[Any] = []  # Network levels this cache opened (and closes).
        if config.prefix.remote is not None:
            remote.append(
                make_level(
                    config.prefix.remote,
                    root=root,
                    num_layers=g.num_layers,
                    block_tokens=g.block_tokens,
                    block_bytes=spec.block_bytes,
                )
            )
            if remote[-1] is not config.prefix.remote:  # Made here (an address, a factory).
                self._owned_levels.append(remote[-1])
        # A file tier's first staging buffer is made now: its data is shifted to that
        # buffer's offset within a page, so fetches into it skip the bounce buffer.
        # (A state read in place has no staging: its units stay in engine memory.)
        if (config.tier.kind == "file" or spec.spill_blocks) and not (
            spec.resident or spec.reads_in_place
        ):
            self._first_staging = self._new_staging()
        self.store = TierBlocks.open(engine, config, spec, self._first_staging)
        if self.store.memory is not None:  # Levels that can read blocks into it, in place.
            pool = self.store.memory
            for level in remote:
                if isinstance(level, InPlaceRemoteLevel):
                    level.use_memory(pool.ctypes.data, pool.nbytes)
        self.tier = self.store.tier
        self.first_block = self.store.first_block
        self._target = np.asarray([engine.id, *self.store.target(shard)], np.int64)
        p = self.persistence
        self.slots = SlotTable(
            batch=g.batch,
            max_len=g.max_len,
            block_tokens=g.block_tokens,
            num_blocks=g.num_blocks,
            root=root,
            spill_blocks=spec.spill_blocks,
            store=self.store,
            remote_levels=remote,
            before_reuse=None if p is None else p.note_evicted,
            before_release=None if p is None else p.note_release,
            ring_blocks=spec.ring_blocks,
            window=spec.windows[0] if spec.ring_blocks else None,
        )
        if spec.spill_blocks:
            mover = SpillTier(
                engine,
                dram_tier=self.tier,
                spill_tier=self.store.spill_tier,
                dram_first=self.first_block,
                spill_first=self.store.spill_first,
                allocators=self.slots.allocators,
                regions=g.num_layers * 2,
                block_bytes=spec.block_bytes,
                promote_after=config.tier.promote_after,
            )
            self.slots.use_mover(mover)
            self.store.spill = mover
        self.rows = HostRows(spec, engine, self.store, self.slots)
        # Per layer and sequence, the end of the furthest row load() wrote since init().
        self._loaded_extent = np.zeros((g.num_layers, g.batch), np.int64)
        # The lengths of the latest state the host made or saw (see recover()).
        self._live_lengths = np.zeros(g.batch, np.int32)
        # Resident mode: the epoch of the latest state whose copy matches the tier.
        self._resident_epoch: int | None = None
        self._stream = engine.open_stream()
        if p is not None:
            self._restored_lengths = p.attach(
                self._persisted_kv(),
                attached=engine.tier_info(self.tier).attached,
                verify=config.persistence.verify,
            )

    def _persisted_kv(self) -> PersistedKV:
        """What the commit protocol reads and writes of this cache (and nothing more)."""
        slots = self.slots
        return PersistedKV(
            spec=self.spec,
            reader=TierReader(
                engine=self.engine,
                tier=self.tier,
                first_block=self.first_block,
                rows=self.tier_rows,
            ),
            drain=self.engine.drain,
            block_tables=lambda: slots.tables,
            capacity=lambda: slots.capacity,
            shared=lambda: slots.shared,
            index=slots.prefix,
            history=slots.history,
            restore=slots.restore,
        )

    def _new_staging(self) -> jax.Array:
        spec = self.spec
        shape = staging_shape_of(spec.num_slots, spec.batch, spec.chunk_len, spec.row_shape)
        return jnp.zeros(shape, spec.staging_dtype)

    @property
    def batch(self) -> int:
        """Slots (sequences) of the cache."""
        return self.spec.batch

    @property
    def max_len(self) -> int:
        """Tokens one slot may hold at most."""
        return self.spec.max_len

    @property
    def kv_bytes(self) -> int:
        """Bytes the tier holds for the cache's blocks (K and V, every layer; spill blocks
        not counted)."""
        return self.spec.kv_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory of the state's staging (0 for a state read in place)."""
        return self.spec.device_bytes

    @property
    def target(self) -> np.ndarray:
        """int64[6]: (engine id, tier, first block, shard, spill tier, spill first block),
        what the state's ``target`` carries (see :class:`KVState`); a copy."""
        return self._target.copy()

    # -- state ------------------------------------------------------------------------------

    def init(
        self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True
    ) -> KVState:
        """A fresh state; ``lengths`` says how many tokens each slot holds.

        Args:
          lengths: per slot; default 0, or the last commit's lengths for a cache that
            re-attached persisted KV. Must be 0 for an inactive slot and at most an active
            slot's capacity.
          admit: admit every slot that has no blocks yet for ``max_len`` tokens (the
            default: a batch of sequences that all may grow to max_len). With False, slots
            keep what they have (a fresh cache: all inactive, for :meth:`admit`).

        Also forgets what :meth:`load` wrote so far (see its Returns). Every earlier state
        of this cache becomes stale.

        Raises:
          ValueError: lengths out of range, or too few free blocks to admit every slot.
        """
        spec = self.spec
        if lengths is None:
            lengths = self._restored_lengths
        if lengths is None:
            lengths = np.zeros(spec.batch, np.int32)
        lengths = np.asarray(lengths)
        if lengths.shape != (spec.batch,):
            raise ValueError(f"lengths must have shape ({spec.batch},); got {lengths.shape}")
        if admit:
            self.slots.admit_all()
        capacity = self.slots.capacity
        for b in range(spec.batch):
            shared = self.slots.shared_tokens(b)
            if lengths[b] < shared:
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} is below slot {b}'s shared prefix of "
                    f"{shared} tokens (blocks other sequences read: decode would write them)"
                )
            if not 0 <= lengths[b] <= capacity[b]:
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} must be in [0, {int(capacity[b])}]"
                    f" (slot {b}'s capacity"
                    + (", inactive: admit it first)" if capacity[b] == 0 else ")")
                )
        self._loaded_extent[:] = 0
        if self.persistence is not None:
            self.persistence.note_init(lengths)
        return self._fresh_state(lengths)

    def _fresh_state(self, lengths: np.ndarray) -> KVState:
        """A state of the host's tables and ``lengths``, fresh staging, a new epoch."""
        spec = self.spec
        staging, self._first_staging = self._first_staging, None
        if spec.resident:
            staging = self.rows.resident_copy()
        elif staging is None:
            staging = jnp.zeros(spec.staging_shape, spec.staging_dtype)
        if not spec.resident:
            self.store.note_staging_phase(staging)
        self._live_lengths = np.asarray(lengths, np.int32).copy()
        owner = self._new_owner()
        self._resident_epoch = int(np.asarray(owner)[1])
        return KVState.fresh(
            spec, lengths, self.slots.tables, self.slots.capacity, staging, owner, self._target
        )

    def inert_state(self) -> KVState:
        """A state of this cache's structure that moves no bytes: every slot inactive, an
        unchecked owner, no epoch started.

        For code that must run the model once without decoding: Flax Linen's
        ``model.init`` (which runs the forward pass), tracing, shape checks. A step on it
        computes every slot's new tokens alone and writes nothing to the tier; the live
        state (from :meth:`init`) stays live. (``jax.eval_shape`` of a step runs nothing
        at all, for shapes alone.)
        """
        spec = self.spec
        return KVState.fresh(
            spec,
            np.zeros(spec.batch, np.int32),
            np.full((spec.batch, spec.max_blocks), blocks.NO_BLOCK, np.int32),
            np.zeros(spec.batch, np.int32),
            jnp.zeros(spec.staging_shape, spec.staging_dtype),
            jnp.zeros((3,), jnp.int32),  # An unchecked owner.
            self._target,
        )

    # -- slot lifecycle ---------------------------------------------------------------------

    def admit(
        self,
        state: KVState,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ):
        """Reserves KV blocks for a new sequence in ``slot``; returns ``(state, cached)``.

        Args:
          state: the cache's live state (drained first).
          slot: an inactive slot, in ``[0, batch)``.
          max_tokens: the most tokens the sequence may hold, in ``[1, max_len]`` (default
            max_len); its capacity. A write past it is refused before any byte moves.
          tokens: the sequence's prompt token ids (ints), at most ``max_tokens`` of them.
            Its longest prefix of full blocks that the prefix index holds (blocks released
            by earlier sequences with the same tokens, see :meth:`release`) is mapped into
            the slot's table instead of fresh blocks, read-only; at most ``len(tokens) - 1``
            tokens, so the prompt's last token is always computed (its logits are needed).

        Returns:
          The state with the slot active at length ``cached``, and ``cached``: tokens of
          the sequence already on the tier (prefill only ``tokens[cached:]``).

        Raises:
          ValueError: a bad slot, max_tokens or tokens, an active slot, or too few blocks
            (free, or cached in the prefix index and not mapped by any slot).
        """
        self._check_state(state)
        admission = self.reserve(slot, max_tokens, tokens)  # All or nothing.
        return self.admitted(state, admission), admission.cached

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> Admission:
        """:meth:`admit`'s first half: the slot table admits ``slot`` (or raises, changing
        nothing), no state changes; then :meth:`admitted` (which cannot be refused) or
        :meth:`cancel`. ``max_cached`` caps the mapped prefix (tokens): a cache made of
        several (mesh shards, a hybrid model's layer groups) maps what all of them have."""
        return self.slots.admit(slot, max_tokens, tokens, max_cached=max_cached)

    def cancel(self, reservation: Admission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        self.slots.release(reservation.slot, 0)

    def check_release(self, state: KVState, slot: int, tokens=None) -> None:
        """Refuses, changing nothing, a :meth:`release` of ``slot`` the cache would refuse."""
        self._check_state(state)
        self.slots.check_slot(slot)
        self.slots.check_release(slot, int(np.asarray(state.lengths)[slot]), tokens)

    def admitted(self, state: KVState, reservation: Admission) -> KVState:
        """The live state once the slot table made ``reservation`` (:meth:`admit`'s second
        half, which cannot be refused; a mesh cache admits every shard's slot first)."""
        admission = reservation
        slot = admission.slot
        state = self.drain(state)
        lengths = np.asarray(state.lengths).copy()
        lengths[slot] = admission.cached
        self._loaded_extent[:, slot] = admission.cached
        state = self._with_slots(state, lengths)
        if self.spec.resident and admission.cached:  # The prefix's rows, as the tier has them.
            state = state.replace(staging=self.rows.resident_copy(state.staging, slot=slot))
        return state

    def release(
        self, state: KVState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> KVState:
        """Frees ``slot``; the slot becomes inactive (length 0, no I/O).

        Args:
          tokens: the sequence's token ids (at least its length of them: the tokens whose
            KV the slot holds; they must agree with its recorded ids, :meth:`tokens`).
            Given, or recorded for its whole length (its prompt and
            :meth:`extend_tokens`), the slot's full blocks enter the prefix index (after
            its write-backs have completed: the engine is drained first) and stay on the
            tier, cached, for later sequences with the same prefix, until their space is
            needed. Otherwise the slot's own blocks are freed at once. On a
            persistent tier the slot is committed released first (its private blocks may
            be rewritten); the blocks it indexes join the committed index at the next
            commit.

        Raises:
          ValueError: a bad slot, one that is not active, or too few tokens.
        """
        self._check_state(state)
        self.slots.check_slot(slot)
        length = int(np.asarray(state.lengths)[slot])
        publishes = self.slots.check_release(slot, length, tokens)  # Refused: no change.
        state = self.drain(state)
        if publishes is not None:
            self.engine.drain()  # Its blocks are published only once fully written.
        self.slots.release(slot, length, tokens)
        lengths = np.asarray(state.lengths).copy()
        lengths[slot] = 0
        self._loaded_extent[:, slot] = 0
        return self._with_slots(state, lengths)

    def publish_windows(self, state: KVState, slot: int) -> int:
        """A cache that keeps only its sliding window (``max_step_tokens``): copies the full
        blocks ``slot`` completed since its last call, while its ring still holds them, into
        the index of cached windows (:mod:`jax_tpusync.window_prefix`), keyed by its
        recorded token ids; a later :meth:`admit` whose prompt starts with them copies the
        window of the longest such prefix into its ring. Call it between the steps of a
        prompt's chunked prefill (:class:`~jax_tpusync.serving.ServingLoop` does): a ring
        overwrites a block once the window has passed it, so by :meth:`release` (which
        publishes the last windows too) the blocks of a shared document's end are gone.
        Returns the blocks copied (0 for a cache that keeps every position: its blocks
        enter the prefix index at release). The state stays live (the engine orders the
        copies after the step's write-backs).
        """
        self._check_state(state)
        self.slots.check_slot(slot)
        jax.block_until_ready(state.lengths)  # The step's write-backs are submitted.
        return self.slots.publish_window(slot, int(np.asarray(state.lengths)[slot]))

    def share_computed(self, state: KVState, slot: int) -> int:
        """Makes ``slot``'s full blocks that the steps so far computed shareable now: each
        whole block of its rows in ``state`` enters the prefix index under its recorded
        token ids (:meth:`tokens`), pinned by the slot, so that an :meth:`admit` a step
        later whose prompt starts with them maps them instead of computing them again.
        Call it between the steps of a prompt's chunked prefill
        (:class:`~jax_tpusync.serving.ServingLoop` does). The slot's read-only prefix
        grows over them (it only appends past them; :meth:`release` unpins them, cached).
        A block being filled is never indexed; a cache that keeps only its sliding window
        indexes none (see :meth:`publish_windows`). Shared directories and remote levels
        get the blocks at :meth:`release`. Returns the blocks indexed now. The state stays
        live: the step that made it has finished (waited for here), and the engine orders
        later reads of those rows after its write-backs.

        Raises:
          ValueError: a bad or inactive slot, or a state of another cache (TypeError: not
            a state); nothing changes.
        """
        self._check_state(state)
        self.slots.check_slot(slot)
        jax.block_until_ready(state)  # The step that wrote the rows has finished.
        return self.slots.share_computed(slot, int(np.asarray(state.lengths)[slot]))

    def tokens(self, slot: int) -> np.ndarray:
        """int64[n]: ``slot``'s recorded token ids: its prompt (:meth:`admit`), then what
        :meth:`extend_tokens` added; restored by a re-attach up to the committed length."""
        self.slots.check_slot(slot)
        return self.slots.history.ids(slot)

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        """Records ``ids`` after ``slot``'s token ids (a serving loop's sampled tokens, fed
        back as the next step's inputs), so that :meth:`release` publishes its blocks and
        :meth:`commit` persists its ids without the caller keeping them. Refused past the
        slot's capacity, or for an inactive slot."""
        self.slots.extend_history(slot, ids)

    @property
    def prefix_stats(self) -> dict:
        """The prefix index: indexed blocks, cached (unmapped) ones, hits, evictions; with
        a shared directory, the blocks this cache published there, imported from it,
        refused as damaged, and failed publishes; with a spill tier, its moves."""
        return self.slots.stats()

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each slot may hold (0: inactive); a copy."""
        return self.slots.capacity

    @property
    def block_tables(self) -> np.ndarray:
        """int32[batch, max_blocks]: the slots' physical KV blocks (-1: none); a copy."""
        return self.slots.tables

    @property
    def free_blocks(self) -> int:
        """Physical KV blocks that neither a slot nor the prefix index holds."""
        return self.slots.free_blocks

    def _with_slots(self, state: KVState, lengths: np.ndarray) -> KVState:
        self._live_lengths = np.asarray(lengths, np.int32).copy()
        return state.replace(
            lengths=jnp.asarray(lengths, jnp.int32),
            block_table=jnp.asarray(self.slots.tables),
            capacity=jnp.asarray(self.slots.capacity),
        )

    def _new_owner(self) -> jax.Array:
        """Starts a new epoch of the cache's stream: every earlier state becomes stale and
        their unconsumed prefetches are discarded."""
        epoch = self.engine.begin_epoch(self._stream)
        return jnp.asarray([self._stream, epoch, 1], jnp.int32)

    def _check_state(self, state: KVState) -> None:
        if not isinstance(state, KVState):
            raise TypeError(f"expected a KVState, got {type(state).__name__}")
        if state.lengths.is_deleted():
            raise ValueError(
                "this KVState was donated to a step (its buffers are gone); use the state "
                "that step returned, or cache.recover() if the step failed"
            )
        if state.spec != self.spec or not np.array_equal(np.asarray(state.target), self._target):
            raise ValueError(
                f"state belongs to another cache (target {np.asarray(state.target).tolist()}, "
                f"this cache's is {self._target.tolist()})"
            )

    def lengths(self, state: KVState) -> np.ndarray:
        """int32[batch]: the tokens each slot holds in ``state`` (0: inactive)."""
        self._check_state(state)
        return np.asarray(state.lengths).astype(np.int32)

    def drain(self, state: KVState) -> KVState:
        """Discards the prefetches ``state`` carries; returns it as the cache's live state.

        Fetches land in engine-owned memory, so a state may be dropped with fetches in
        flight; call this before handing a state to host-side methods or re-using one whose
        successor was lost (e.g. after a failed step). Every other state of this cache
        becomes stale: the engine refuses its ops. Resident mode: a state from before the
        latest host-side change gets a fresh copy of the tier.
        """
        self._check_state(state)
        jax.block_until_ready(state)  # The step that made it has finished with the engine.
        self._live_lengths = np.asarray(state.lengths).copy()
        owner = self._new_owner()
        staging = state.staging
        if self.spec.resident:
            # Only the latest epoch's copy is known to match the tier: the host may have
            # changed the tier through a later state (load, admit) since an older one's.
            if int(np.asarray(state.owner)[1]) != self._resident_epoch:
                staging = self.rows.resident_copy()
            self._resident_epoch = int(np.asarray(owner)[1])
        return state.replace(
            tickets=jnp.full((self.spec.num_tickets,), ops.NO_TICKET, jnp.int32),
            owner=owner,
            staging=staging,
        )

    def recover(self) -> KVState:
        """The cache's live state after a step failed with its state donated.

        A failed step (a slot past its capacity, a stale state, an engine error) leaves the
        caller without a state: the one it passed was donated. The block tables and
        capacities are the host's; the lengths come from the engine's record of the latest
        write-back's capacity guards in the current epoch: a step whose last layer's
        write-back was accepted added its tokens, any other step added none (rows an
        unfinished step wrote past the lengths are never read, and the next step
        overwrites them). Without such a record (no step ran since the state the host last
        saw), the lengths are that state's.

        The returned state starts a new epoch (every other state becomes stale) and has
        fresh staging. Also clears the failed step's error from JAX's record of effects,
        which would otherwise raise again at interpreter exit.
        """
        effects.settle_failed_steps()
        lengths = self._live_lengths.copy()
        record = self.engine.last_guards(self._stream)
        if record is not None and len(record["lengths"]) == self.spec.batch:
            lengths = np.asarray(record["lengths"], np.int32)
            if record["accepted"] and record["layer"] == self.spec.num_layers - 1:
                lengths = lengths + np.asarray(record["counts"], np.int32)
        self._loaded_extent[:] = 0
        return self._fresh_state(lengths)

    # -- host-side bulk access --------------------------------------------------------------

    def tier_runs(
        self, layer: int, kv: int, slot: int, lo: int, hi: int
    ) -> list[tuple[int, int, int]]:
        """``(tier, tier byte offset, bytes)`` runs holding positions ``[lo, hi)`` of
        ``slot``'s K (``kv=0``) or V (1) in ``layer``, through its block table; consecutive
        blocks merged. ``tier`` is :attr:`tier`, or a two-level cache's spill tier for
        blocks on it. Raises if a position has no block."""
        return self.rows.runs(layer, kv, slot, lo, hi)

    def tier_rows(self, layer: int, kv: int, slot: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """:meth:`tier_runs` without the tier: ``(tier byte offset, bytes)`` on
        :attr:`tier`. Raises if a position's block is on a two-level cache's spill tier."""
        runs = self.tier_runs(layer, kv, slot, lo, hi)
        if any(tier != self.tier for tier, _, _ in runs):
            raise ValueError(
                f"positions [{lo}, {hi}) of slot {slot} include blocks on the spill tier: "
                f"use tier_runs(), which names each run's tier"
            )
        return [(offset, n) for _, offset, n in runs]

    def load(
        self,
        state: KVState,
        layer: int,
        k: jax.Array | np.ndarray,
        v: jax.Array | np.ndarray,
        *,
        start: int | Sequence[int] = 0,
        lengths: Sequence[int] | None = None,
        slot: int | None = None,
    ) -> KVState:
        """Bulk-writes existing KV of one layer to the tier, host-side.

        For experiments that synthesize or load a long context without a prefill.

        Args:
          state: the cache's state; it is drained first (its prefetches may have read
            bytes this call overwrites) and the returned state is the live one.
          layer: which layer.
          k: [batch, n, num_kv_heads, head_dim] keys (after RoPE, as the model caches them),
            of the cache's dtype or one that converts to it exactly
            (:func:`jax_tpusync.state.exact_cast_allowed`; cast it yourself otherwise).
          v: [batch, n, num_kv_heads, head_dim] values, same rule.
          start: first position written, per slot or for all; ``>= 0``.
          lengths: per-slot count of rows of ``k``/``v`` to write (ragged), in
            ``[0, n]``; default n. ``start + lengths`` must not exceed the slot's capacity
            (a slot with rows to write must be active).
          slot: one slot's rows only: ``k``/``v`` are then [n, num_kv_heads, head_dim],
            written from position ``start`` (an int) of that slot; no other slot changes.

        Returns:
          The state, whose lengths never shrink: sequence ``b``'s length becomes the
          largest of its current length and the position every layer has been loaded up
          to (per layer, the end of its furthest load of ``b`` since :meth:`init`; a load
          of 0 rows leaves it as it was). So loading every layer up to ``start +
          lengths`` sets the lengths there, and patching rows of a context that decode has
          already extended leaves them as they are.

        Raises:
          ValueError: an argument out of range, or a dtype that would not convert exactly.
        """
        spec = self.spec
        self._check_state(state)
        self._check_layer(layer)
        if slot is not None:
            k, v, start, lengths = one_slot_load(self.spec.batch, slot, k, v, start, lengths)
        k, v, starts, counts = self.rows.check_load(k, v, start, lengths)  # Refused: no change.
        skip = None
        if spec.ring_blocks:  # Only the rows the window can still read (and no two alike).
            furthest = np.maximum(self._loaded_extent[layer], np.asarray(state.lengths))
            starts, counts, skip = window_ring.clip_rows(starts, counts, furthest, spec.windows[0])
            for b in np.flatnonzero(counts):  # Rows before them are not the sequence's now.
                self.slots.note_written(int(b), int(starts[b]))
        if self.persistence is not None:  # Committed rows may change: commit them gone.
            jax.block_until_ready(state)  # The step that made it has finished writing.
            self.persistence.note_rows_written(layer, starts, counts)
        state = self.drain(state)
        self.rows.write(layer, k, v, starts, counts, skip)
        extent = self._loaded_extent[layer]
        written = counts > 0
        extent[written] = np.maximum(extent[written], (starts + counts)[written])
        # Only rows every layer holds count; a length already past them stays.
        lengths_now = np.asarray(state.lengths).astype(np.int64)
        grown = np.maximum(lengths_now, self._loaded_extent.min(axis=0))
        if (grown != lengths_now).any():
            state = state.replace(lengths=jnp.asarray(grown, jnp.int32))
            self._live_lengths = grown.astype(np.int32)
        if spec.resident:
            state = state.replace(staging=self.rows.resident_copy(state.staging, layer=layer))
        return state

    def read(
        self,
        state: KVState,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ):
        """Host-side copy of positions ``[start, stop)`` of one slot's K and V in ``layer``:
        two [stop - start, num_kv_heads, head_dim] arrays in the cache's dtype (dequantized
        from a quantized tier).

        ``stop`` defaults to the slot's length in ``state``; ``0 <= start <= stop <=
        length``. Drain the state first if it may have write-backs in flight (the engine
        orders this read after them either way). ``raw=True`` (quantized tiers only)
        returns the stored codes and scales instead, as two :class:`QuantizedRows`.
        """
        self._check_state(state)
        self._check_layer(layer)
        self.slots.check_slot(slot)
        length = int(np.asarray(state.lengths)[slot])
        if stop is None:
            stop = length
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= length):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) must lie in [0, {length}] (slot {slot}'s "
                f"length)"
            )
        if raw and not self.spec.quantized:
            raise ValueError("raw=True reads codes and scales: this cache's tier is not quantized")
        if self.spec.ring_blocks and start < (kept := int(self.kept_from(state)[slot])):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) reaches before position {kept}: slot "
                f"{slot} keeps only its sliding window (max_step_tokens), positions [{kept}, "
                f"{length})"
            )
        return self.rows.read(layer, slot, start, stop, raw=raw)

    def kept_from(self, state: KVState) -> np.ndarray:
        """int64[batch]: each slot's first position the tier still holds: 0, or for a
        cache that keeps only its window (``max_step_tokens``) the window's first cached
        key (:func:`jax_tpusync.window_ring.kept_from`)."""
        lengths = np.asarray(state.lengths)
        if not self.spec.ring_blocks:
            return np.zeros(lengths.shape, np.int64)
        return window_ring.kept_from(lengths, self.spec.windows[0])

    def read_all(
        self,
        layer: int,
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host-side copy of one layer's K and V of every slot: two [batch, max_len, H, D]
        arrays, through the slots' block tables.

        Positions at or past ``lengths[b]`` (if given; an int or one per slot, in
        ``[0, max_len]``) or past a slot's capacity are zero; so are, in a cache that keeps
        only its window (``max_step_tokens``), the positions before the window of a slot
        of ``lengths[b]`` tokens. For checks and debugging.
        """
        spec = self.spec
        self._check_layer(layer)
        counts = per_sequence("lengths", spec.max_len if lengths is None else lengths, spec.batch)
        if (counts < 0).any() or (counts > spec.max_len).any():
            raise ValueError(f"lengths must be in [0, max_len={spec.max_len}]; got {counts}")
        counts = np.minimum(counts, self.slots.capacity)
        starts = np.zeros_like(counts)
        if spec.ring_blocks:
            starts = window_ring.kept_from(counts, spec.windows[0])
        return self.rows.read_all(layer, counts, starts)

    def _check_layer(self, layer: Any) -> None:
        if not is_int(layer) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(
                f"layer={layer!r} is out of range for a cache of {self.spec.num_layers} layers"
            )

    # -- persistence ------------------------------------------------------------------------

    def commit(self, state: KVState) -> KVState:
        """Makes ``state``'s rows durable and records its lengths; call between steps.

        Drains the state's fetches and the engine (raising a failed write-back's error),
        syncs the data (file tier), checksums the newly committed rows and atomically
        replaces the manifest. A re-attached cache starts from the last commit. On a
        non-persistent tier it only drains.

        Returns:
          The drained state: continue with it (the state passed in must not be reused).

        Raises:
          persistence.CommitError: the commit was not made (e.g. a write-back failed); the
            manifest still holds the previous commit.
        """
        return self._commit(state, session="open")

    def _commit(self, state: KVState, *, session: str) -> KVState:
        state = self.drain(state)
        if self.persistence is None:
            self.engine.drain()
            return state
        try:
            self.engine.drain()
        except Exception as e:
            p = self.persistence
            raise persistence.CommitError(
                f"commit {p.commit_number + 1} was not written (the tier keeps commit "
                f"{p.commit_number}, lengths {p.committed_lengths.tolist()}): {e}"
            ) from e
        self.persistence.commit(np.asarray(state.lengths), session=session)
        return state

    def verify(self, state: KVState | None = None) -> persistence.VerifyResult:
        """Re-reads the committed rows and the committed prefix index's blocks and checks
        them against the manifest's checksums.

        Args:
          state: optional; when given it must belong to this cache, and the engine is
            drained first so that transfers in flight have ended.

        Raises:
          persistence.ChecksumMismatchError: naming the chunk (layer, K|V, sequence, rows)
            or the indexed block (layer, K|V, physical block).
          ValueError: the cache is not on a persistent tier.
        """
        if self.persistence is None:
            raise ValueError("verify() needs a persistent tier (shm_name= or file_name=)")
        if state is not None:
            self._check_state(state)
            self.engine.drain()
        return self.persistence.verify()

    def restart_at(self, lengths: np.ndarray, tokens: Sequence[np.ndarray] | None = None) -> None:
        """A re-attached cache starts (``init()``'s default) from ``lengths``, at most the
        committed ones and at least each slot's shared prefix, committed now: what a mesh
        or hybrid cache does to bring the parts that a crash left at different commits to
        their common rows (shorter committed rows stay covered by the checksums). Each
        slot's token ids are cut at its new length, or set to ``tokens[b]`` (at most
        ``lengths[b]`` ids: the ids every part agrees on), so that no id past the rows kept
        is taken for theirs. Raises (ValueError, CommitError), changing nothing."""
        p = self.persistence
        lengths = np.asarray(lengths, np.int32)
        if (
            p is None
            or lengths.shape != (self.spec.batch,)
            or (lengths > p.committed_lengths).any()
            or (lengths < 0).any()
        ):
            raise ValueError(
                f"lengths {lengths.tolist()} must be in [0, committed lengths] of a persistent tier"
            )
        shared = self.slots.shared.astype(np.int64) * self.spec.block_tokens
        for b in np.flatnonzero(lengths < shared):
            raise ValueError(
                f"lengths[{b}]={int(lengths[b])} ends inside slot {b}'s shared prefix of "
                f"{int(shared[b])} tokens (mapped blocks are committed whole): release it first"
            )
        if tokens is not None and (
            len(tokens) != self.spec.batch
            or any(len(t) > n for t, n in zip(tokens, lengths.tolist()))
        ):
            raise ValueError("tokens must hold, per slot, at most lengths[b] token ids")
        history = self.slots.history
        before = [history.ids(b) for b in range(self.spec.batch)]
        for b in range(self.spec.batch):
            if tokens is None:
                history.truncate(b, int(lengths[b]))
            else:
                history.set(b, tokens[b])
        try:
            p.commit(lengths)
        except Exception:
            for b, ids in enumerate(before):
                history.set(b, ids)
            raise
        self._restored_lengths = lengths

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """Per-sequence lengths of the last commit (None: not a persistent tier)."""
        return None if self.persistence is None else self.persistence.committed_lengths

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, state: KVState | None = None) -> None:
        """Commits ``state`` if given (persistent tiers), then closes the engine if the
        cache made it (waits for running transfers).

        Never raises for a failed engine or commit: it logs the error, and a re-opened cache
        restores the last commit that succeeded. Without a state nothing is committed, and
        the next session is told that rows past the last commit were dropped.
        """
        if self._closed:
            return
        self._closed = True
        effects.settle_failed_steps()
        if state is not None:
            try:
                self._commit(state, session="closed")
            except Exception as e:  # noqa: BLE001 - reported; the last commit stands.
                logger.error("final commit failed; the last successful commit stands: %s", e)
        for level in getattr(self, "_owned_levels", ()):
            level.close()
        if not self.engine.closed:
            self.engine.close_stream(self._stream)
        if self._owns_engine:
            try:
                self.engine.close()
            except Exception as e:  # noqa: BLE001 - a failed engine still has to close.
                logger.error("closing the engine: %s", e)

    def __enter__(self) -> OffloadedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
