"""The host-pool cache: the paged KV cache of the TPU data path, whose pool is a JAX array
in ``pinned_host`` memory (:mod:`jax_tpusync.core.pool_state`) that every step carries.

The host side is the one every cache uses (:class:`~jax_tpusync.core.slots.SlotTable`: block
tables, capacities, the prefix index), over a pool that lives in the state instead of in
the C++ engine: no in-graph custom call is involved, so the step compiles for TPUs (and
runs on any backend with ``pinned_host`` memory; the CPU backend is how it is tested).
Host-side writes and reads of the pool (:meth:`HostPoolKVCache.load`,
:meth:`HostPoolKVCache.read`) are small jitted programs that move whole blocks, between
steps; they take the state and return the new one, as the step does.

Prefix levels (``shared_prefix_dir``, ``remote_prefix``) import into the pool and publish
from it through :class:`~jax_tpusync.caches.pool.blocks.PoolBlocks`, between steps.

Persistence (``shm_name=``, or ``tier="file", path=, file_name=``): the pool is copied to a
shm or file tier by the commit protocol every cache uses (:mod:`jax_tpusync.persist.commit`):
:meth:`HostPoolKVCache.commit` gathers the blocks written since the last commit from the
state's pool (one jitted program), writes them to the tier, then commits (sync, checksums,
manifest); a cache made over an existing tier re-attaches to its last commit, and its first
:meth:`~HostPoolKVCache.init` reads the committed blocks into the new pool (at the
lengths :meth:`~HostPoolKVCache.restart_at` sets, if called before: how a hybrid cache
brings its groups to their common commit). Over a mesh the tier holds every head (the
devices' rows joined; quantized rows by part, every head's codes, then every scale). See
:mod:`jax_tpusync.caches.pool.persistence`.
The tier is in the engine cache's byte layout, so an :class:`~jax_tpusync.OffloadedKVCache`
of the same geometry re-attaches to it too.

A spill tier (``spill_path=``, ``spill_blocks=``): cached prefix blocks the pool has no room
for are demoted to a file instead of evicted, and promoted back into the pool by the
admission that maps them, before any step reads them (a step reads only the pool; see
:mod:`jax_tpusync.caches.pool.spill`). :attr:`HostPoolKVCache.prefix_stats` counts the moves.

Sparse decode (``sparse=``, a :class:`~jax_tpusync.sparse.SparseConfig` or its budget):
global layers' decode rows read only the blocks their query selects, from block summaries
the state keeps beside the pool in host memory (:mod:`jax_tpusync.step.pool_sparse`,
:mod:`jax_tpusync.core.pool_sparse`); :meth:`HostPoolKVCache.sparse_stats` reports how the
layer-ahead prediction did and the bytes copied. Over a mesh each device keeps its own
heads' summaries beside its pool and selects its own blocks (a selection per head shard).

What this cache does not do yet (each refused by name at construction): file tiers that
are not a persistent copy (``tier="file"`` without ``file_name``), a spill tier over a
mesh or with ``max_step_tokens``, resident mode, and sparse decode with a spill tier or
at ``prefetch_depth`` above 1. (Slots split over a mesh's
``batch_axis`` are a :class:`~jax_tpusync.BatchShardedPoolKVCache`, one such cache per
batch shard; this one takes a ``batch_axis`` of one device. Models whose layers differ are served
by a :class:`~jax_tpusync.HybridKVCache` whose groups are host pools, ``host_pool=True``;
they persist as one-geometry pools do.)

P/D transfer moves a slot's rows through a staging buffer
(:mod:`jax_tpusync.pd.pool_staging`): :meth:`~HostPoolKVCache.read_stored_rows` and
:meth:`~HostPoolKVCache.load_stored_rows` give and take them in an engine cache's byte
order. Every host call takes only the cache's live state (``PoolState.epoch``).

``prefetch_depth`` and ``staging_bytes`` mean what they mean on the engine cache: a step
keeps ``prefetch_depth`` units in flight ahead of the one it attends, and the staging
budget holds ``prefetch_depth + 1`` units (whole blocks each). ``"auto"`` is 1 here: the
TPU compiler waits for each copy within the loop iteration that starts it, so a deeper
prefetch overlaps no more copying and only shrinks every unit
(:mod:`jax_tpusync.step.host_pool`).

Sliding windows kept bounded (``max_step_tokens``, every layer of one window): each slot
keeps a ring of blocks covering its window and one step's rows
(:mod:`jax_tpusync.core.window_ring`, the engine cache's ring), so the pool, the bytes a step
copies and the host-side rows do not grow with the context. The slot table tiles each
slot's table row over its ring, so the step indexes the ring as any block table; loads
keep only the rows the window can still read, reads refuse older positions, and cached
windows are reused as the engine cache's are (:mod:`jax_tpusync.core.window_prefix`; the
copies held host-side, :mod:`jax_tpusync.caches.pool.windows`). Persistence and resident mode
are refused with rings, as on the engine cache.

Over a mesh (``mesh=``, ``kv_heads_axis=``) each device keeps its own heads' pool in its
own host memory: every state leaf has a leading axis of shards split over the mesh, as a
mesh cache's does (:mod:`jax_tpusync.caches.offloaded.mesh`), and the step runs each device's share inside
``shard_map`` (:mod:`jax_tpusync.step.sharded`). The slot table is one: every device
holds every slot's blocks, each for its heads.

The class wires parts that each live in their own module: its arguments and the order its
parts open in (:mod:`jax_tpusync.caches.pool.assembly`), which state is live
(:mod:`jax_tpusync.caches.pool.live_state`), the admission transaction every one-device
cache shares (:mod:`jax_tpusync.caches.admission`) with the pool's side of it
(:mod:`jax_tpusync.caches.pool.admission`), and the host-side row calls
(:mod:`jax_tpusync.caches.pool.host_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jax_tpusync.caches.admission import AdmissionTransaction
from jax_tpusync.caches.parts import restart_part
from jax_tpusync.caches.pool import assembly as pool_assembly
from jax_tpusync.caches.pool import summaries as pool_summaries
from jax_tpusync.caches.pool.admission import PoolAdmission
from jax_tpusync.caches.pool.host_rows import PoolHostRows
from jax_tpusync.caches.pool.live_state import PoolLiveState
from jax_tpusync.caches.protocol import admit_by_reservation
from jax_tpusync.core.config import CacheConfig, with_config
from jax_tpusync.core.host_io import LoadedExtent
from jax_tpusync.core.pool_state import PoolLayout, PoolState
from jax_tpusync.core.slots import Admission
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.persist import commit as persistence
from jax_tpusync.sparse.config import SparseConfig

logger = logging.getLogger(__name__)


class HostPoolKVCache:
    """A paged KV cache in a ``pinned_host`` pool, streamed to the device by unit.

    Takes :meth:`jax_tpusync.core.config.CacheConfig.from_kwargs`'s keywords (geometry,
    ``block_tokens``/``num_blocks``, ``staging_bytes``, ``tier_dtype``, ``sliding_window``,
    ``prefetch_across_steps``, ``prefix_salt``), plus ``device``: where the pool's host
    memory and the staging are (default: the first device), or ``mesh`` and
    ``kv_heads_axis``: the heads split over that axis's devices, each with its own pool in
    its host memory and its own staging. ``config``: a
    :class:`~jax_tpusync.core.config.CacheConfig` instead of (not beside) its keywords.
    ``staging_bytes`` bounds the device memory the state's units take on each device:
    ``prefetch_depth + 1`` units (those staged ahead and the one in flight), each of whole
    blocks, and no more blocks a unit than a TPU's compiled schedule overlaps copies
    (:func:`~jax_tpusync.core.pool_state.unit_block_limit`). ``prefetch_depth``: units in flight
    ahead of the one attended, an int in ``[1, 64]`` (at most ``num_layers``) or
    ``"auto"``, which is 1 on this path (a deeper prefetch overlaps no more copying on a
    TPU; see :func:`~jax_tpusync.caches.pool.assembly.pool_spec`).

    Raises:
      ValueError: an argument out of range, or one of the features this path does not
        have yet (named with the reason).
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        device: jax.Device | None = None,
        mesh: Mesh | None = None,
        kv_heads_axis: str | None = None,
        batch_axis: str | None = None,
        **options: Any,
    ):
        config, placement = pool_assembly.checked_config(
            with_config(config, options),
            device=device,
            mesh=mesh,
            kv_heads_axis=kv_heads_axis,
            batch_axis=batch_axis,
        )
        device, mesh_layout, kind = placement.device, placement.mesh, placement.device_kind
        self.spec = pool_assembly.pool_spec(config, mesh_layout, kind)
        # Checked before anything is opened, so that a mismatch touches nothing.
        self.persistence = persistence.Persistence.prepare_for(config)
        self.config = config
        self.layout = PoolLayout(self.spec)
        self.mesh = mesh_layout
        self.device = device
        self.state_sharding = placement.state_sharding
        self.pool_sharding = placement.pool_sharding
        opened = pool_assembly.open_pool(
            config, self.spec, self.layout, mesh_layout, self.persistence
        )
        self.slots = opened.slots
        self._blocks, self._windows = opened.blocks, opened.windows
        self._owned_levels = opened.owned_levels  # Network levels this cache closes.
        self._tier = opened.tier  # The pool's persistent copy (None: not persistent).
        self._restored_lengths = opened.restored_lengths  # init()'s default once re-attached.
        self._imports, self._spill = opened.imports, opened.spill
        self._initialized = False  # init() makes the pool once.
        # Per (layer, slot): the end of the furthest load since init or admission; a slot's
        # length grows to the rows every layer holds.
        self._loaded = LoadedExtent(self.spec.num_layers, self.spec.batch)
        self._live = PoolLiveState(
            self.spec,
            self.layout,
            mesh_layout,
            self.slots,
            self.state_sharding,
            self.pool_sharding,
            config.sparse,
        )
        self._rows = PoolHostRows(self._live, self._loaded, self._tier, self.persistence)
        self._admission = AdmissionTransaction(
            self.slots,
            self._loaded,
            PoolAdmission(self._live, self._imports, self._spill, self._tier),
        )
        logger.info(
            "host-pool KV cache: %.1f MiB pool, %.1f MiB staging, chunk_len=%d (per device of %d)",
            self.layout.pool_bytes / 2**20,
            self.layout.device_bytes / 2**20,
            self.spec.chunk_len,
            self.shards,
        )

    @property
    def shards(self) -> int:
        """Devices the heads are split over (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.tp

    # -- state ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self.spec.batch

    @property
    def max_len(self) -> int:
        return self.spec.max_len

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each slot may hold (0: inactive); a copy."""
        return np.asarray(self.slots.capacity, np.int32).copy()

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """int32[batch]: every slot's length at the last commit (None: not persistent)."""
        return None if self.persistence is None else self.persistence.committed_lengths

    @property
    def device_bytes(self) -> int:
        """Device memory the state's staging takes on each device: ``prefetch_depth + 1``
        units and their tails."""
        return self.layout.device_bytes

    @property
    def all_device_bytes(self) -> int:
        """Device memory of the state's staging over every device (its heads' shards)."""
        return self.device_bytes * self.shards

    @property
    def kv_bytes(self) -> int:
        """Host memory of the pool (every layer's blocks and the sink), all devices'."""
        return self.shards * self.layout.pool_bytes

    @property
    def sparse(self) -> SparseConfig | None:
        """The sparse decode setting (None: every decode row reads its whole context)."""
        return self.config.sparse

    def sparse_stats(self, state: PoolState) -> dict:
        """Per layer, what sparse decode did since the cache was made: blocks predicted
        (copied a unit ahead, before the query), hits (predicted and selected), late
        (selected, not predicted: copied once the query was known), wasted (predicted, not
        selected; attended all the same), the sparse decode steps and rows, and the bytes
        copied to the device (summaries, predicted and late blocks) against a dense step's
        (:func:`jax_tpusync.caches.pool.summaries.sparse_stats`). Over a mesh each head
        shard selects its own blocks: blocks and bytes are summed over the shards, steps
        and rows counted once. Host-side: the step that made ``state`` is waited for.

        Raises:
          ValueError: the cache was made without ``sparse=``.
        """
        self.check(state)
        if state.sparse is None:
            raise ValueError("sparse_stats(): this cache was made without sparse=")
        return pool_summaries.sparse_stats(self.layout, np.asarray(state.sparse.counts))

    @property
    def prefix_stats(self) -> dict:
        """The prefix index's counts (``indexed_blocks``, ``cached_blocks``, ``hits``,
        ``evictions``), each prefix level's and, with a spill tier, its moves
        (``spill_free_blocks``, ``demoted``, ``promoted``, ``spill_hits``) and the spilled
        blocks found damaged or missing on promotion, each a miss (``spill_damaged``), as
        :attr:`jax_tpusync.OffloadedKVCache.prefix_stats`."""
        return self.slots.stats()

    def init(
        self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True
    ) -> PoolState:
        """The first state: a zeroed pool in the device's pinned host memory (a cache that
        re-attached a commit: its committed blocks, read from the tier); ``lengths`` and
        ``admit`` as :meth:`jax_tpusync.OffloadedKVCache.init`'s (default: 0, or the
        committed lengths, which a re-attached cache's ``lengths`` may not pass). Once
        only: later states come from the step and this cache's methods. Refused, changing
        nothing, as :meth:`check_init` says."""
        lengths = self.check_init(lengths, admit=admit)
        if admit:
            self.slots.admit_all()
        pool = None
        if self._tier is not None:
            self.persistence.note_init(lengths)  # Below the commit: commits that first.
            if self._restored_lengths is not None:
                pool = self._tier.restored_pool(self.persistence.committed_lengths)
            self._tier.started(lengths, self._restored_lengths)
        state = self._live.state(lengths, self._live.tables(), self.slots.capacity, pool)
        state = self._live.stamped(state)
        self._initialized = True
        self._loaded.reset()
        return state

    def check_init(
        self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True
    ) -> np.ndarray:
        """The lengths (int[batch]) :meth:`init` would start from, refused as it refuses
        them; changes nothing.

        Raises:
          ValueError: a second ``init()``; with ``admit``, too few blocks for every
            inactive slot's ``max_len`` tokens; ``lengths`` of another shape, below a slot's
            shared prefix or past its capacity (every inactive slot ``max_len`` with
            ``admit``); for a cache that re-attached a commit, past a slot's committed
            length (the pool is restored at the committed lengths: rows past them were
            never committed, or :meth:`restart_at` cut them).
        """
        self._live.check_open()
        if self._initialized:
            raise ValueError("init() was called already: use the state the last call returned")
        spec = self.spec
        if lengths is None:
            lengths = self._restored_lengths
        lengths = np.zeros(spec.batch, np.int64) if lengths is None else np.asarray(lengths)
        if lengths.shape != (spec.batch,):
            raise ValueError(f"lengths must have shape ({spec.batch},); got {lengths.shape}")
        capacity = self.slots.capacity
        if admit:
            self.slots.check_admit_all()
            capacity = np.where(capacity > 0, capacity, self.max_len)
        self.slots.check_lengths(lengths, capacity)
        if self._restored_lengths is not None:
            committed = self.persistence.committed_lengths
            for b in np.flatnonzero(lengths > committed):
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} is past slot {b}'s committed length "
                    f"{int(committed[b])}: the pool is restored at the committed lengths "
                    f"(rows past them were never committed, or restart_at() cut them)"
                )
        return lengths

    def inert_state(self) -> PoolState:
        """A state of this cache's structure that moves no bytes anywhere the live state
        reads: every slot inactive, so a step on it writes only to its own pool's sink. It
        has a pool of its own (host memory of :attr:`kv_bytes`, freed with it; for shapes
        alone, ``jax.eval_shape`` of a step needs none). The live state stays live."""
        self._live.check_open()
        spec = self.spec
        return self._live.state(
            np.zeros(spec.batch, np.int32),
            np.full((spec.batch, spec.max_blocks), -1, np.int32),
            np.zeros(spec.batch, np.int32),
        )

    def check(
        self, state: PoolState, *, releasing: int | None = None, refusals: bool = True
    ) -> None:
        """Refuses a state that is not this cache's live one, or whose steps were refused
        for a slot (a step that would have passed its capacity, or at a traced layer out of
        range), but for releasing a refused slot (``releasing``), the one way on: one at a
        time, each release of a refused slot is taken while others are refused too.
        ``refusals=False``: refused slots refuse nothing (a cache of parts releasing a
        refused slot of another part)."""
        self._live.check(state, releasing=releasing, refusals=refusals)

    def refused_tokens(self, state: PoolState) -> np.ndarray:
        """int32[batch]: tokens of each slot's steps that ``state``'s steps refused (0:
        none); a slot with any is taken only by a release (:meth:`check`)."""
        return self._live.refused_tokens(state)

    # -- slot lifecycle ---------------------------------------------------------------------

    def lengths(self, state: PoolState) -> np.ndarray:
        """int32[batch]: the tokens each slot holds in ``state`` (0: inactive)."""
        self.check(state)
        return self._live.host(state.lengths).astype(np.int32)

    def drain(self, state: PoolState) -> PoolState:
        """The state once the step that made it has finished (nothing of it is in flight
        outside the state: its staging is its own); returns it as the live state."""
        self.check(state)
        jax.block_until_ready(state)
        return state

    def commit(self, state: PoolState) -> PoolState:
        """Makes ``state``'s rows durable and records its lengths, per-slot tables, token
        ids and prefix index; call between steps. On a persistent tier: the blocks written
        since the last commit are gathered from the state's pool and written to the tier,
        which is synced, checksummed and recorded in a new manifest (see
        :mod:`jax_tpusync.persist.commit`). Otherwise it only drains.

        Returns:
          The drained state: continue with it.

        Raises:
          persistence.CommitError: the commit was not made (a tier write failed, say); the
            manifest still holds the previous commit.
        """
        return self._commit(state, session="open")

    def _commit(self, state: PoolState, *, session: str) -> PoolState:
        state = self.drain(state)
        if self._tier is None:
            return state
        lengths = self._live.host(state.lengths)
        flush = functools.partial(self._tier.flush, state.pool, lengths)
        self.persistence.commit_after(flush, lengths, session=session)
        return state

    def restart_at(self, lengths: np.ndarray, tokens: Sequence[np.ndarray] | None = None) -> None:
        """A re-attached cache starts (``init()``'s default) from ``lengths`` (int[batch]),
        at most the committed ones and at least each slot's shared prefix, committed now,
        as :meth:`jax_tpusync.OffloadedKVCache.restart_at`: what a hybrid cache does to
        bring the groups that a crash left at different commits to their common rows.
        Each slot's token ids are cut at its new length, or set to ``tokens[b]`` (at most
        ``lengths[b]`` ids). Only before the first :meth:`init`, which reads the committed
        rows into the new pool: a pool that exists already holds the rows past them.

        Raises:
          ValueError: called after :meth:`init`, a cache that is not persistent, lengths
            out of that range, or tokens longer than them.
          persistence.CommitError: the commit was not made. Either way nothing changes.
        """
        self._live.check_open()
        if self._initialized:
            raise ValueError(
                "restart_at() after init(): the pool holds the rows past the new lengths "
                "already; restart a re-attached cache before its first init()"
            )
        self._restored_lengths = restart_part(
            self.persistence, self.slots, self.spec.block_tokens, lengths, tokens
        )

    def verify(self, state: PoolState | None = None) -> persistence.VerifyResult:
        """Re-reads the committed rows and indexed blocks from the tier and checks them
        against the manifest's checksums (as :meth:`jax_tpusync.OffloadedKVCache.verify`).

        Raises:
          persistence.ChecksumMismatchError: naming the chunk or block that differs.
          ValueError: the cache is not on a persistent tier.
        """
        self._live.check_open()
        if self.persistence is None:
            raise ValueError("verify() needs a persistent tier (shm_name= or file_name=)")
        if state is not None:
            self.check(state)
        return self.persistence.verify()

    def recover(self) -> PoolState:
        """Refused: a host-pool step never fails on its own (a step past a slot's capacity
        writes to the sink and is refused for that slot; see :meth:`check`), and the pool
        of a state donated to a step that failed otherwise went with it. A persistent
        cache's last commit comes back by closing the cache (without a state) and making it
        again over the same tier."""
        raise ValueError(
            "a host-pool cache cannot recover a state lost with a failed step: its pool was "
            "donated to the step. Keep the state a step returned; a step past a slot's "
            "capacity does not fail (see HostPoolKVCache.check). A persistent cache: "
            "close() it and make it again over the same tier to re-attach its last commit"
        )

    def admit(
        self,
        state: PoolState,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[PoolState, int]:
        """Reserves blocks for a new sequence in ``slot``; returns ``(state, cached)``, as
        :meth:`jax_tpusync.OffloadedKVCache.admit` does (a prefix of ``tokens`` that the
        prefix index holds is mapped read-only). With a spill tier, cached blocks the
        admission needs room for are demoted out of ``state``'s pool, and spill blocks it
        maps are promoted into it (:mod:`jax_tpusync.caches.pool.spill`)."""
        return admit_by_reservation(self, state, slot, max_tokens, tokens)  # Checks state.

    def reserving_in(self, state: PoolState) -> contextlib.AbstractContextManager[None]:
        """Within it, :meth:`reserve` demotes the cached blocks it needs room for out of
        ``state``'s pool to the spill tier (without one, or outside it, they are evicted);
        ``state`` must be the live one (checked first)."""
        return self._admission.reserving_in(state)

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> Admission:
        """:meth:`admit`'s first half: the slot table admits ``slot`` (or raises, changing
        nothing), no state changes; then :meth:`admitted` or :meth:`cancel`. What the slot
        table imports meanwhile waits for the admitted state's pool
        (:class:`~jax_tpusync.caches.pool.admission.PoolAdmission`)."""
        return self._admission.reserve(slot, max_tokens, tokens, max_cached=max_cached)

    def cancel(self, reservation: Admission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`. The blocks it imported
        from a prefix level, or promoted from the spill tier, that no pool holds yet go
        back to the spill tier while it has free blocks (their bytes are nowhere else);
        the rest leave the index, unless another reservation maps them (they stay pending
        for its :meth:`admitted`)."""
        self._admission.cancel(reservation)

    def admitted(self, state: PoolState, reservation: Admission) -> PoolState:
        """The live state once :meth:`reserve` made ``reservation``: the blocks it imported
        from a prefix level are in its pool, and so are those any other reservation
        imported and this one may map."""
        return self._admission.admitted(state, reservation)

    def check_release(
        self, state: PoolState, slot: int, tokens: Sequence[int] | np.ndarray | None = None
    ) -> None:
        """Refuses, changing nothing, a :meth:`release` of ``slot`` the cache would refuse."""
        self.slots.check_slot(slot)  # Before check() indexes the state by it.
        self.check(state, releasing=slot)
        self.slots.check_release(slot, int(self._live.host(state.lengths)[slot]), tokens)

    def release(
        self, state: PoolState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> PoolState:
        """Frees ``slot``; with ``tokens`` (or a recorded history) its full blocks enter the
        prefix index, as :meth:`jax_tpusync.OffloadedKVCache.release`. A slot whose steps
        were refused (past its capacity) may be released: its rows up to its length are
        whole, and the refusal goes with it."""
        self.check_release(state, slot, tokens)  # Refused: no change.
        length = int(self._live.host(state.lengths)[slot])
        jax.block_until_ready(state.pool)  # Its blocks are indexed once written.
        self._blocks.reading(state.pool)  # A prefix level publishes them from it.
        try:
            if self._tier is None:
                self.slots.release(slot, length, tokens)
            else:  # A commit of the slot released first flushes this state's pool.
                self._tier.releasing(slot, length)
                with self._tier.reading(state.pool, self._live.host(state.lengths)):
                    self.slots.release(slot, length, tokens)
                self._tier.released(slot)
        finally:
            self._blocks.reading(None)
        self._drop_window_writes()
        self._loaded.reset(slot)
        refused = self._live.host(state.refused).copy()
        refused[slot] = 0
        return self._live.with_slot(state.replace(refused=self._live.placed(refused)), slot, 0)

    def publish_windows(self, state: PoolState, slot: int) -> int:
        """A cache that keeps only its sliding window (``max_step_tokens``): copies the full
        blocks ``slot`` completed since its last call, while its ring still holds them, into
        the index of cached windows, as
        :meth:`jax_tpusync.OffloadedKVCache.publish_windows` (the copies are held host-side:
        :mod:`jax_tpusync.caches.pool.windows`); returns the blocks copied. 0 for a cache that
        keeps every position (its full blocks enter the prefix index at :meth:`release`).
        The state stays live (the step that made it is waited for first)."""
        self.check(state)
        self.slots.check_slot(slot)
        if self._windows is None:
            return 0
        jax.block_until_ready(state.pool)  # Its blocks are copied once written.
        self._blocks.take_writes()  # Nothing of a refused call before.
        self._windows.forget_unindexed()
        self._blocks.reading(state.pool)
        try:
            copied = self.slots.publish_window(slot, int(self._live.host(state.lengths)[slot]))
        finally:
            self._blocks.reading(None)
        self._drop_window_writes()
        return copied

    def _drop_window_writes(self) -> None:
        """Forgets the pool writes of window copies: the index's blocks are read from their
        host-side payloads, never from the pool."""
        if self._windows is not None:
            self._blocks.take_writes()
            self._windows.forget_unindexed()

    def kept_from(self, state: PoolState) -> np.ndarray:
        """int64[batch]: each slot's first position the pool still holds: 0, or for a cache
        that keeps only its window (``max_step_tokens``) the window's first cached key
        (:func:`jax_tpusync.core.window_ring.kept_from`)."""
        self.check(state)
        return self._rows.kept_from(self._live.host(state.lengths))

    def share_computed(self, state: PoolState, slot: int) -> int:
        """Indexes ``slot``'s full blocks computed so far, pinned by the slot, as
        :meth:`jax_tpusync.OffloadedKVCache.share_computed` (the step that wrote them is
        waited for first); returns the blocks indexed now."""
        self.check(state)
        self.slots.check_slot(slot)
        jax.block_until_ready(state.pool)  # Its blocks are indexed once written.
        return self.slots.share_computed(slot, int(self._live.host(state.lengths)[slot]))

    def tokens(self, slot: int) -> np.ndarray:
        self.slots.check_slot(slot)
        return self.slots.history.ids(slot)

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        self.slots.extend_history(slot, ids)

    # -- host-side rows ---------------------------------------------------------------------

    def load(
        self,
        state: PoolState,
        layer: int,
        k: jax.Array | np.ndarray,  # [batch, n, num_kv_heads, head_dim] ([n, ...] with slot)
        v: jax.Array | np.ndarray,  # [batch, n, num_kv_heads, head_dim] ([n, ...] with slot)
        *,
        start: int | Sequence[int] = 0,
        lengths: Sequence[int] | None = None,
        slot: int | None = None,
    ) -> PoolState:
        """Writes KV of one layer host-side, as :meth:`jax_tpusync.OffloadedKVCache.load`
        (same arguments, same lengths rule: a slot's length grows to the rows every layer
        holds; a cache that keeps only its window writes only the rows the window can still
        read, :func:`~jax_tpusync.core.window_ring.clip_rows`). Whole blocks move: a block the
        rows fill in part is read first and written back with the rows in it.

        Raises:
          ValueError: a bad layer or slot, rows past a slot's capacity, shapes that are not
            the cache's, a dtype that does not convert exactly, rows into blocks a slot
            shares with the prefix index; nothing is written.
        """
        self.check(state)
        return self._rows.load(state, layer, k, v, start, lengths, slot)

    def load_stored_rows(
        self,
        state: PoolState,
        slot: int,
        start: int,
        rows: np.ndarray,  # uint8[shards, num_layers, 2, n, row_bytes]: K rows, then V rows
    ) -> PoolState:
        """Writes positions ``[start, start + n)`` of ``slot`` in every layer from the
        bytes the pool stores them as (:mod:`jax_tpusync.caches.pool.stored_rows`: per head
        shard and layer, the K rows then the V rows; quantized: codes and scales as they
        are), as :meth:`load` of every layer would: the same checks, and the slot's
        length grows to ``start + n``. What P/D transfer received goes in this way.

        Raises:
          ValueError: a bad slot or start, rows of another shape or dtype, rows past the
            slot's capacity or into blocks it shares with the prefix index, a cache that
            keeps only its window; nothing is written.
        """
        self.check(state)
        return self._rows.load_stored_rows(state, slot, start, rows)

    def read_stored_rows(self, state: PoolState, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of ``slot`` in every layer as the pool stores them:
        uint8[shards, num_layers, 2, stop - start, row_bytes] (see
        :meth:`load_stored_rows`), a host copy.

        Raises:
          ValueError: a bad slot, or a range outside ``[0, length]`` (for a cache that
            keeps only its window, outside ``[kept_from, length]``).
        """
        self.check(state)
        return self._rows.read_stored_rows(state, slot, start, stop)

    def read(
        self,
        state: PoolState,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ) -> tuple[Any, Any]:
        """Host copies of positions ``[start, stop)`` of one slot's K and V in ``layer``:
        two [stop - start, num_kv_heads, head_dim] arrays in the cache's dtype (decoded
        from a quantized pool; ``raw``: its codes and scales, two
        :class:`~jax_tpusync.core.quantize.QuantizedRows`). A cache that keeps only its window
        refuses positions before :meth:`kept_from`, as the engine cache does."""
        self.check(state)
        return self._rows.read(state, layer, slot, start, stop, raw)

    def close(self, state: PoolState | None = None) -> None:
        """Closes the cache: every later call is refused. The pool is the state's (freed
        with the last state that holds it). On a persistent tier ``state``, if given, is
        committed first; never raises for a failed commit (it is logged, and the cache made
        again over the tier re-attaches the last commit that succeeded); without a state
        nothing is committed. Closes the network levels the cache opened."""
        if self._live.closed:
            return
        if state is not None and self._tier is not None:
            try:
                self._commit(state, session="closed")
            except Exception as e:  # noqa: BLE001 - reported; the last commit stands.
                logger.error("final commit failed; the last successful commit stands: %s", e)
        self._live.closed = True
        if self._spill is not None:
            try:
                self._spill.close()
            except Exception as e:  # noqa: BLE001 - closing must not raise.
                logger.error("closing the spill tier's engine: %s", e)
        if self._tier is not None:
            try:
                self._tier.close()
            except Exception as e:  # noqa: BLE001 - a failed engine still has to close.
                logger.error("closing the persistent tier's engine: %s", e)
        pool_assembly.close_levels(self._owned_levels)

    def __enter__(self) -> HostPoolKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- capabilities (jax_tpusync.caches.capabilities) --------------------------------------

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """The head range of each device the heads are split over, in head order (one,
        every head, without a mesh)."""
        n = self.spec.num_kv_heads
        return [(s * n, (s + 1) * n) for s in range(self.shards)]

    @property
    def shard_spec(self) -> CacheSpec:
        """The spec of one head range's pool: the cache's spec describes one already."""
        return self.spec
