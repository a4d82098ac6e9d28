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

What this cache does not do yet (each refused by name at construction): file tiers that
are not a persistent copy (``tier="file"`` without ``file_name``), a spill tier over a
mesh or with ``max_step_tokens``, and resident mode. (Slots split over a mesh's
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
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jax_tpusync.caches.parts import restart_part
from jax_tpusync.caches.pool import assembly as pool_assembly
from jax_tpusync.caches.pool import blocks as pool_blocks
from jax_tpusync.caches.pool import rows as pool_rows
from jax_tpusync.caches.pool import stored_rows as pool_stored_rows
from jax_tpusync.caches.pool.imports import PendingImports
from jax_tpusync.caches.pool.persistence import PoolTier
from jax_tpusync.caches.pool.spill import PoolSpillTier, check_pool_ids
from jax_tpusync.caches.pool.windows import WindowCopyStore
from jax_tpusync.caches.protocol import admit_by_reservation
from jax_tpusync.core import window_ring
from jax_tpusync.core.config import CacheConfig, is_int, with_config
from jax_tpusync.core.host_io import (
    LoadedExtent,
    check_layer,
    check_load_range,
    check_load_rows,
    one_slot_load,
)
from jax_tpusync.core.pool_state import (
    NOT_STAGED,
    PoolLayout,
    PoolState,
)
from jax_tpusync.core.slots import Admission, SlotTable
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.persist import commit as persistence

logger = logging.getLogger(__name__)

# Epochs of live states, unique across the process's caches (PoolState.epoch).
_EPOCHS = itertools.count(1)

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
        g = config.geometry
        root = config.prefix_root(pool_assembly.pool_prefix_layout(config, self.shards))
        self._blocks = pool_blocks.PoolBlocks(self.layout, self.mesh)
        # Network levels this cache opened (and closes) are in _owned_levels.
        remote, self._owned_levels = pool_assembly.open_levels(
            config,
            root=root,
            num_layers=g.num_layers,
            block_tokens=g.block_tokens,
            block_bytes=self._blocks.half_block_bytes,
        )
        p = self.persistence
        ring_blocks = self.spec.ring_blocks
        # A ring pool's cached windows are held host-side (see jax_tpusync.caches.pool.windows).
        self._windows = WindowCopyStore(self._blocks) if ring_blocks else None
        self.slots = SlotTable(
            batch=g.batch,
            max_len=g.max_len,
            block_tokens=g.block_tokens,
            num_blocks=g.num_blocks,
            root=root,
            spill_blocks=config.spill_blocks,
            store=self._blocks if self._windows is None else self._windows,
            remote_levels=remote,
            before_reuse=None if p is None else p.note_evicted,
            before_release=None if p is None else p.note_release,
            ring_blocks=ring_blocks,
            window=self.spec.windows[0] if ring_blocks else None,
        )
        if self._windows is not None:
            self._windows.index = self.slots.windows
        self._initialized = False  # init() makes the pool once.
        self._epoch = 0  # The live state's epoch (PoolState.epoch); 0: none yet.
        # Per (layer, slot): the end of the furthest load since init or admission; a slot's
        # length grows to the rows every layer holds.
        self._loaded = LoadedExtent(self.spec.num_layers, self.spec.batch)
        self._closed = False
        # The pool's persistent copy (None: not persistent), and init()'s default lengths
        # once it re-attached a commit.
        self._tier: PoolTier | None = None
        self._restored_lengths: np.ndarray | None = None
        if p is not None:
            try:
                self._tier = PoolTier.open(config, self.layout, self.slots, self.mesh)
                self._restored_lengths = p.attach(
                    self._tier.persisted_kv(),
                    attached=self._tier.attached,
                    verify=config.persistence.verify,
                )
            except Exception:
                if self._tier is not None:
                    self._tier.close()
                self._close_levels()
                raise
        # What reservations wrote (prefix imports, ring fills) until a pool holds it.
        self._imports = PendingImports(
            self._blocks,
            self._windows,
            imported=None if self._tier is None else self._tier.write_payloads,
        )
        # Cached prefix blocks the pool has no room for (None: evicted); see pool_spill.
        self._spill: PoolSpillTier | None = None
        if config.two_level:
            try:
                self._spill = PoolSpillTier.open(
                    config.tier.spill_path,
                    config.spill_blocks,
                    self.layout,
                    self._blocks,
                    self.slots.allocators,
                    pending=(self._imports.payloads_of, self._imports.forget),
                )
            except Exception:
                self._close_levels()
                raise
            self.slots.use_mover(self._spill)
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
    def prefix_stats(self) -> dict:
        """The prefix index's counts (``indexed_blocks``, ``cached_blocks``, ``hits``,
        ``evictions``), each prefix level's and, with a spill tier, its moves
        (``spill_free_blocks``, ``demoted``, ``promoted``, ``spill_hits``), as
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
        state = self._live(self._state(lengths, self._tables(), self.slots.capacity, pool))
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
        self._check_open()
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
        self._check_open()
        spec = self.spec
        return self._state(
            np.zeros(spec.batch, np.int32),
            np.full((spec.batch, spec.max_blocks), -1, np.int32),
            np.zeros(spec.batch, np.int32),
        )

    def _state(self, lengths, block_table, capacity, pool_rows=None) -> PoolState:
        """A state of these per-slot tables over a pool of ``pool_rows`` (a host array of
        the pool's shape; None: zeros), nothing staged."""
        if pool_rows is None:
            pool_rows = np.zeros(self._global(self.layout.pool_shape), self.layout.dtype)
        pool = jax.device_put(pool_rows, self.pool_sharding)
        local = PoolState.fresh(self.spec, lengths, block_table, capacity, pool)
        return local.replace(
            **{
                name: jax.tree.map(self._placed, getattr(local, name))
                for name in PoolState.FIELDS
                if name != "pool"
            }
        )

    def _global(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A state leaf's shape: one shard's, with a leading axis of shards over a mesh."""
        return shape if self.mesh is None else (self.shards, *shape)

    def _placed(self, x: Any) -> jax.Array:
        """One shard's value of a state leaf, as the state holds it: on the device, or
        the same value on every device of the mesh (a leading axis of shards)."""
        x = np.asarray(x)
        if self.mesh is not None:
            x = np.broadcast_to(x, (self.shards, *x.shape))
        return jax.device_put(x, self.state_sharding)

    def _host(self, x: jax.Array) -> np.ndarray:
        """A per-slot leaf of the state on the host (every shard holds the same)."""
        x = np.asarray(x)
        return x if self.mesh is None else x[0]

    def check(
        self, state: PoolState, *, releasing: int | None = None, refusals: bool = True
    ) -> None:
        """Refuses a state that is not this cache's live one, or whose steps were refused
        for a slot (a step that would have passed its capacity, or at a traced layer out of
        range), but for releasing a refused slot (``releasing``), the one way on: one at a
        time, each release of a refused slot is taken while others are refused too.
        ``refusals=False``: refused slots refuse nothing (a cache of parts releasing a
        refused slot of another part)."""
        self._check_open()
        if not isinstance(state, PoolState):
            raise TypeError(f"expected a PoolState, got {type(state).__name__}")
        if state.spec != self.spec:
            raise ValueError("state belongs to another cache (its spec differs)")
        if state.pool.is_deleted():
            raise ValueError(
                "this PoolState was donated to a step (its pool is gone); use the state "
                "that step returned"
            )
        if int(self._host(state.epoch)) != self._epoch:
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
                f"have passed its capacity of {int(self._host(state.capacity)[b])} tokens, or "
                f"came with a traced layer outside [0, {self.spec.num_layers})); its length "
                f"stayed at {int(self._host(state.lengths)[b])}. Release the slot (and admit "
                f"it with a larger max_tokens where its capacity was the cause)"
            )

    def refused_tokens(self, state: PoolState) -> np.ndarray:
        """int32[batch]: tokens of each slot's steps that ``state``'s steps refused (0:
        none); a slot with any is taken only by a release (:meth:`check`)."""
        return np.asarray(self._host(state.refused))

    def _tables(self) -> np.ndarray:
        """int32[batch, max_blocks]: the slot table's block tables, as a state carries
        them: ids of pool blocks only (a spill block there is a bug, refused)."""
        tables = np.asarray(self.slots.tables, np.int32)
        check_pool_ids(tables, self.spec.num_blocks)
        return tables

    def _with_slots(self, state: PoolState, lengths: np.ndarray) -> PoolState:
        return self._unstaged(
            state.replace(
                lengths=self._placed(np.asarray(lengths, np.int32)),
                block_table=self._placed(self._tables()),
                capacity=self._placed(np.asarray(self.slots.capacity, np.int32)),
            )
        )

    def _unstaged(self, state: PoolState) -> PoolState:
        """``state`` with nothing staged: what a host-side write to the pool returns (a
        staged unit may hold the rows it replaced); the live state from now on."""
        staged_at = self._placed(np.full(self.layout.staged_at_shape, NOT_STAGED, np.int32))
        return self._live(
            state.with_staged_units(
                (staging, tail, staged_at) for staging, tail, _ in state.staged_units
            )
        )

    def _live(self, state: PoolState) -> PoolState:
        """``state`` stamped as the one live state: any state made before is refused."""
        self._epoch = next(_EPOCHS) % np.iinfo(np.int32).max + 1
        return state.replace(epoch=self._placed(np.int32(self._epoch)))

    # -- slot lifecycle ---------------------------------------------------------------------

    def lengths(self, state: PoolState) -> np.ndarray:
        """int32[batch]: the tokens each slot holds in ``state`` (0: inactive)."""
        self.check(state)
        return self._host(state.lengths).astype(np.int32)

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
        p = self.persistence
        lengths = self._host(state.lengths)
        try:
            self._tier.flush(state.pool, lengths)
        except Exception as e:
            raise persistence.CommitError(
                f"commit {p.commit_number + 1} was not written (the tier keeps commit "
                f"{p.commit_number}, lengths {p.committed_lengths.tolist()}): {e}"
            ) from e
        p.commit(lengths, session=session)
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
        self._check_open()
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
        self._check_open()
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

    @contextlib.contextmanager
    def reserving_in(self, state: PoolState) -> Iterator[None]:
        """Within it, :meth:`reserve` demotes the cached blocks it needs room for out of
        ``state``'s pool to the spill tier (without one, or outside it, they are evicted);
        ``state`` must be the live one (checked first)."""
        if self._spill is None:
            yield
            return
        self.check(state)  # Before its pool is read.
        self._spill.reading(state.pool)
        try:
            yield
        finally:
            self._spill.reading(None)

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> Admission:
        """:meth:`admit`'s first half: the slot table admits ``slot`` (or raises, changing
        nothing), no state changes; then :meth:`admitted` or :meth:`cancel`."""
        self._check_open()
        self._imports.begin()  # Nothing of a refused call before.
        try:
            admission = self.slots.admit(slot, max_tokens, tokens, max_cached=max_cached)
        except Exception:
            self._imports.refused(self.slots.prefix)  # Blocks it imported stay indexed.
            raise
        self._imports.record(admission.slot)  # Pending until a pool is admitted.
        return admission

    def cancel(self, reservation: Admission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`. The blocks it imported
        from a prefix level, or promoted from the spill tier, that no pool holds yet go
        back to the spill tier while it has free blocks (their bytes are nowhere else);
        the rest leave the index, unless another reservation maps them (they stay pending
        for its :meth:`admitted`)."""
        self.slots.release(reservation.slot, 0)
        if self._spill is not None:
            self._spill.keep(self.slots.prefix, self._imports.pending_of(reservation.slot))
        self._imports.drop(reservation.slot, self.slots.prefix)

    def admitted(self, state: PoolState, reservation: Admission) -> PoolState:
        """The live state once :meth:`reserve` made ``reservation``: the blocks it imported
        from a prefix level are in its pool, and so are those any other reservation
        imported and this one may map."""
        slot = reservation.slot
        state = state.replace(pool=self._imports.apply(slot, state.pool))
        lengths = self._host(state.lengths).copy()
        lengths[slot] = reservation.cached
        self._loaded.reset(slot, reservation.cached)
        if self._tier is not None:
            self._tier.admitted(slot, reservation.cached)
        return self._with_slots(state, lengths)

    def check_release(
        self, state: PoolState, slot: int, tokens: Sequence[int] | np.ndarray | None = None
    ) -> None:
        """Refuses, changing nothing, a :meth:`release` of ``slot`` the cache would refuse."""
        self.slots.check_slot(slot)  # Before check() indexes the state by it.
        self.check(state, releasing=slot)
        self.slots.check_release(slot, int(self._host(state.lengths)[slot]), tokens)

    def release(
        self, state: PoolState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> PoolState:
        """Frees ``slot``; with ``tokens`` (or a recorded history) its full blocks enter the
        prefix index, as :meth:`jax_tpusync.OffloadedKVCache.release`. A slot whose steps
        were refused (past its capacity) may be released: its rows up to its length are
        whole, and the refusal goes with it."""
        self.check_release(state, slot, tokens)  # Refused: no change.
        length = int(self._host(state.lengths)[slot])
        jax.block_until_ready(state.pool)  # Its blocks are indexed once written.
        self._blocks.reading(state.pool)  # A prefix level publishes them from it.
        try:
            if self._tier is None:
                self.slots.release(slot, length, tokens)
            else:  # A commit of the slot released first flushes this state's pool.
                self._tier.releasing(slot, length)
                with self._tier.reading(state.pool, self._host(state.lengths)):
                    self.slots.release(slot, length, tokens)
                self._tier.released(slot)
        finally:
            self._blocks.reading(None)
        self._drop_window_writes()
        self._loaded.reset(slot)
        lengths = self._host(state.lengths).copy()
        lengths[slot] = 0
        refused = self._host(state.refused).copy()
        refused[slot] = 0
        return self._with_slots(state.replace(refused=self._placed(refused)), lengths)

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
            copied = self.slots.publish_window(slot, int(self._host(state.lengths)[slot]))
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
        lengths = self._host(state.lengths)
        if not self.spec.ring_blocks:
            return np.zeros(lengths.shape, np.int64)
        return window_ring.kept_from(lengths, self.spec.windows[0])

    def share_computed(self, state: PoolState, slot: int) -> int:
        """Indexes ``slot``'s full blocks computed so far, pinned by the slot, as
        :meth:`jax_tpusync.OffloadedKVCache.share_computed` (the step that wrote them is
        waited for first); returns the blocks indexed now."""
        self.check(state)
        self.slots.check_slot(slot)
        jax.block_until_ready(state.pool)  # Its blocks are indexed once written.
        return self.slots.share_computed(slot, int(self._host(state.lengths)[slot]))

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
        spec = self.spec
        self.check(state)
        check_layer(layer, spec.num_layers)
        if slot is not None:
            k, v, start, lengths = one_slot_load(spec.batch, slot, k, v, start, lengths)
        heads = self.shards * spec.num_kv_heads
        k, v, starts, counts = check_load_rows(
            self.slots, heads, spec.head_dim, spec.dtype, k, v, start, lengths
        )  # Refused: no change.
        skip = np.zeros(spec.batch, np.int64)
        if spec.ring_blocks:  # Only the rows the window can still read (and no two alike).
            furthest = self._loaded.furthest(layer, self._host(state.lengths))
            starts, counts, skip = window_ring.clip_rows(starts, counts, furthest, spec.windows[0])
            for b in np.flatnonzero(counts):  # Rows before them are not the sequence's now.
                self.slots.note_written(int(b), int(starts[b]))
        if self._tier is not None:  # Committed rows may change: commit them gone first.
            with self._tier.reading(state.pool, self._host(state.lengths)):
                self.persistence.note_rows_written(layer, starts, counts)
            self._tier.loaded(layer, starts, counts)
        for b in np.flatnonzero(counts):
            n, table = int(counts[b]), self.slots.table_row(int(b))
            rows = slice(int(skip[b]), int(skip[b]) + n)
            pool = pool_rows.write_slot_rows(
                self.layout, self.mesh, state.pool, table, layer, int(starts[b]), k[b, rows],
                v[b, rows],
            )
            state = state.replace(pool=pool)
        self._loaded.record(layer, starts, counts)
        grown = self._loaded.grown(self._host(state.lengths))
        return self._unstaged(state.replace(lengths=self._placed(grown.astype(np.int32))))

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
        spec = self.spec
        self.check(state)
        self.slots.check_slot(slot)
        if spec.ring_blocks:  # P/D transfer refuses such a cache before it gets here.
            raise ValueError(
                "load_stored_rows: this cache keeps only each slot's sliding window "
                "(max_step_tokens), whose ring does not hold every position: load its "
                "rows with load(), which keeps the window's"
            )
        if not is_int(start):
            raise ValueError(f"start={start!r} must be an int")
        n = np.shape(rows)[3] if np.ndim(rows) == 5 else -1
        want = pool_stored_rows.stored_shape(self.layout, self.shards, max(n, 0))
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.shape != want:
            raise ValueError(
                f"rows must be a uint8 array [shards={want[0]}, num_layers={want[1]}, 2, n, "
                f"row_bytes={want[4]}]; got {getattr(rows, 'dtype', type(rows).__name__)} "
                f"{np.shape(rows)}"
            )
        starts = np.zeros(spec.batch, np.int64)
        counts = np.zeros(spec.batch, np.int64)
        starts[slot], counts[slot] = int(start), n
        check_load_range(self.slots, starts, counts)  # Refused: no change.
        if n == 0:
            return state
        if self._tier is not None:  # Committed rows may change: commit them gone first.
            with self._tier.reading(state.pool, self._host(state.lengths)):
                for layer in range(spec.num_layers):
                    self.persistence.note_rows_written(layer, starts, counts)
            for layer in range(spec.num_layers):
                self._tier.loaded(layer, starts, counts)
        pool = pool_stored_rows.write_stored_rows(
            self.layout, self.mesh, state.pool, self.slots.table_row(slot), int(start), rows
        )
        state = state.replace(pool=pool)
        for layer in range(spec.num_layers):
            self._loaded.record(layer, starts, counts)
        grown = self._loaded.grown(self._host(state.lengths))
        return self._unstaged(state.replace(lengths=self._placed(grown.astype(np.int32))))

    def read_stored_rows(self, state: PoolState, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of ``slot`` in every layer as the pool stores them:
        uint8[shards, num_layers, 2, stop - start, row_bytes] (see
        :meth:`load_stored_rows`), a host copy.

        Raises:
          ValueError: a bad slot, or a range outside ``[0, length]`` (for a cache that
            keeps only its window, outside ``[kept_from, length]``).
        """
        self.check(state)
        self.slots.check_slot(slot)
        length = int(self._host(state.lengths)[slot])
        self._check_range(slot, start, stop, length)
        return pool_stored_rows.read_stored_rows(
            self.layout, self.mesh, state.pool, self.slots.table_row(slot), int(start), int(stop)
        )

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
        spec = self.spec
        self.check(state)
        check_layer(layer, spec.num_layers)
        self.slots.check_slot(slot)
        if raw and not spec.quantized:
            raise ValueError("raw=True reads codes and scales: this cache's tier is not quantized")
        length = int(self._host(state.lengths)[slot])
        stop = length if stop is None else stop
        self._check_range(slot, start, stop, length)
        table = self.slots.table_row(slot)
        return pool_rows.read_slot_rows(
            self.layout, self.mesh, state.pool, table, layer, int(start), int(stop), raw
        )

    def _check_range(self, slot: int, start: Any, stop: Any, length: int) -> None:
        """Refuses a range of ``slot``'s positions that is not ints with ``0 <= start <=
        stop <= length``, or that reaches before the window a ring still holds."""
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= length):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) must lie in [0, {length}] (slot {slot}'s "
                f"length)"
            )
        spec = self.spec
        kept = int(window_ring.kept_from(length, spec.windows[0])) if spec.ring_blocks else 0
        if start < kept:
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) reaches before position {kept}: slot "
                f"{slot} keeps only its sliding window (max_step_tokens), positions [{kept}, "
                f"{length})"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this cache is closed")

    def close(self, state: PoolState | None = None) -> None:
        """Closes the cache: every later call is refused. The pool is the state's (freed
        with the last state that holds it). On a persistent tier ``state``, if given, is
        committed first; never raises for a failed commit (it is logged, and the cache made
        again over the tier re-attaches the last commit that succeeded); without a state
        nothing is committed. Closes the network levels the cache opened."""
        if self._closed:
            return
        if state is not None and self._tier is not None:
            try:
                self._commit(state, session="closed")
            except Exception as e:  # noqa: BLE001 - reported; the last commit stands.
                logger.error("final commit failed; the last successful commit stands: %s", e)
        self._closed = True
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
        self._close_levels()

    def _close_levels(self) -> None:
        for level in self._owned_levels:
            try:
                level.close()
            except Exception as e:  # noqa: BLE001 - closing must not raise.
                logger.warning("closing %s failed: %s", level.describe(), e)

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
