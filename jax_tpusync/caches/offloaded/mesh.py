"""Offloaded KV caches sharded over a device mesh: KV heads over a tensor-parallel axis,
sequences over a data-parallel one.

Layout. A mesh cache is ``num_shards = dp * tp`` single-device caches
(:attr:`ShardedKVCache.shards`), one per device. The shard at mesh place ``(d, t)`` (``d``
along ``batch_axis``, of size dp; ``t`` along ``kv_heads_axis``, of size tp) is shard
``d * tp + t``: it holds sequences ``[d * batch / dp, (d + 1) * batch / dp)`` and KV heads
``[t * H / tp, (t + 1) * H / tp)``, in a tier allocation, engine stream, block allocator
and prefix index of its own. A block id is therefore per shard, and no two devices can
address the same tier bytes: each shard's ops carry its own target, and the engine checks
every row against that allocation.

One engine per process serves all of its local shards: they share its workers and its
throttle (``EngineConfig.max_inflight_bytes`` bounds the bytes in flight of the process).
A multi-process run (``jax.distributed``) makes the shards of each process's own devices;
the file tier may be one directory, with a file per shard.

State. The global state is a :class:`~jax_tpusync.KVState` whose every field has a leading
axis of ``num_shards``, sharded ``P((batch_axis, kv_heads_axis))``
(:attr:`ShardedKVCache.state_sharding`), so shard ``s`` lives on its own device. The
host-side methods take and return global states and act on this process's shards (in a
multi-process run every process calls them with the same arguments, as SPMD programs do).

Attention. :func:`~jax_tpusync.prefetching_attention` with a mesh cache runs the
single-device attention of each shard in ``shard_map`` (q/k/v split
``P(batch_axis, None, kv_heads_axis, None)``: with GQA a KV head's query heads move with
it; inputs sharded otherwise are resharded first). Inside the caller's own ``shard_map``
over the cache's axes it runs the device's shard directly. The device's shard comes from
``lax.axis_index``, and every write-back leads with a guard row
(:func:`jax_tpusync.runtime.ops.shard_guard`) that refuses, before any byte moves, a state that is
another shard's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_tpusync.caches.capabilities import TierPart
from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.caches.parts import bring_to_common_commit, each_or_none, reserve_agreed
from jax_tpusync.caches.protocol import admit_by_reservation
from jax_tpusync.core.config import CacheConfig, with_config
from jax_tpusync.core.host_io import one_slot_load
from jax_tpusync.core.mesh_layout import MeshLayout, checked_layout
from jax_tpusync.core.quantize import join_head_shards
from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.runtime.engine import Engine, EngineConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MeshAdmission:
    """What :meth:`ShardedKVCache.reserve` made: each holder shard's slot-table admission
    of global ``slot`` (``local`` within its shards) and the prefix tokens they all map
    (None: this process holds none of the slot's shards)."""

    slot: int
    local: int
    admissions: dict
    cached: int | None


class ShardedKVCache:
    """An :class:`~jax_tpusync.OffloadedKVCache` split over the devices of a mesh (or
    ``jax_tpusync.kv_cache(..., mesh=mesh, kv_heads_axis=..., batch_axis=...)``).

    Takes :class:`~jax_tpusync.OffloadedKVCache`'s arguments (or ``config=`` a
    :class:`~jax_tpusync.core.config.CacheConfig` of them), with ``batch`` and
    ``num_kv_heads`` global (each a multiple of its axis' size) and ``num_blocks`` and
    ``staging_bytes`` per shard (each device's tier blocks and staging). ``engine``: one
    engine (or its config) for all of this process's shards. Persistent tiers name one
    shm object or file per shard (``<name>-shard<s>``); a shared prefix directory holds a
    directory per head range, and ``remote_prefix`` must be a ``"mooncake://"`` address
    (each head range gets a namespace of its own; a level object is refused by name).

    Raises:
      ValueError: an axis not in the mesh, an axis of the mesh the cache is not split
        over with more than one device, a batch or head count its axis does not divide,
        or any single-device argument error.
    """

    def __init__(
        self,
        *,
        mesh: Mesh,
        kv_heads_axis: str | None = None,
        batch_axis: str | None = None,
        config: CacheConfig | None = None,
        engine: Engine | EngineConfig | None = None,
        **options: Any,
    ):
        self._open(mesh, kv_heads_axis, batch_axis, engine, **with_config(config, options))

    def _open(
        self,
        mesh: Mesh,
        kv_heads_axis: str | None,
        batch_axis: str | None,
        engine: Engine | EngineConfig | None,
        *,
        batch: int,
        num_kv_heads: int,
        shm_name: str | None = None,
        file_name: str | None = None,
        shared_prefix_dir: str | os.PathLike | None = None,
        remote_prefix: str | None = None,
        **options: Any,
    ) -> None:
        if remote_prefix is not None and not isinstance(remote_prefix, str):
            raise ValueError(
                f"remote_prefix={remote_prefix!r}: a mesh cache's remote_prefix must be a "
                f"'mooncake://host:port' address (each head range gets a namespace of its "
                f"own), not a level object or factory (it would hold every head range's "
                f"blocks under one key)"
            )
        if options.get("spill_path") is not None:
            raise ValueError(
                "spill_path (a two-level cache) is not supported on a mesh yet: use one tier "
                "per shard (tier='host' or 'file')"
            )
        layout = checked_layout(mesh, kv_heads_axis, batch_axis)
        for name, value, axis, size in (
            ("batch", batch, batch_axis, layout.dp),
            ("num_kv_heads", num_kv_heads, kv_heads_axis, layout.tp),
        ):
            if not isinstance(value, (int, np.integer)) or value <= 0 or value % size:
                raise ValueError(
                    f"{name}={value!r} must be a positive multiple of mesh axis {axis!r}'s "
                    f"{size} devices (each holds an equal share)"
                    if axis
                    else f"{name}={value!r} must be a positive int"
                )
        if engine is not None and not isinstance(engine, (Engine, EngineConfig)):
            raise TypeError(
                f"engine must be an Engine, an EngineConfig or None; got {type(engine).__name__}"
            )
        self.layout = layout
        self.state_sharding = NamedSharding(mesh, layout.state_spec)
        self._owns_engine = not isinstance(engine, Engine)
        self.engine = engine if isinstance(engine, Engine) else Engine(engine or EngineConfig())
        # Shard of each of this process's devices, from the sharding itself.
        index = self.state_sharding.addressable_devices_indices_map((layout.num_shards,))
        self._devices = {int(ix[0].start or 0): d for d, ix in index.items()}
        self.shards: dict[int, OffloadedKVCache] = {}
        try:
            for s in sorted(self._devices):
                with self._on(s):
                    cache = OffloadedKVCache(
                        shard=s,
                        batch=int(batch) // layout.dp,
                        num_kv_heads=int(num_kv_heads) // layout.tp,
                        engine=self.engine,
                        shm_name=None if shm_name is None else f"{shm_name}-shard{s}",
                        file_name=None if file_name is None else f"{file_name}-shard{s}",
                        # A head shard's blocks hold only its heads: a directory per range.
                        shared_prefix_dir=None
                        if shared_prefix_dir is None
                        else os.path.join(shared_prefix_dir, _heads_dir(s, layout, num_kv_heads)),
                        # Likewise a namespace per head range on a network level.
                        remote_prefix=_heads_address(
                            remote_prefix, _heads_dir(s, layout, num_kv_heads)
                        ),
                        **options,
                    )
                self.shards[s] = cache
        except Exception:
            self._close_shards()
            raise
        self.shard_spec: CacheSpec = next(iter(self.shards.values())).spec
        self.spec = dataclasses.replace(self.shard_spec, mesh=layout)
        self.batch = int(batch)
        self.num_kv_heads = int(num_kv_heads)
        if shm_name is not None or file_name is not None:
            self._reconcile_commits()

    @property
    def max_len(self) -> int:
        """Tokens one slot may hold at most."""
        return self.spec.max_len

    @property
    def kv_bytes(self) -> int:
        """Bytes the tiers of every shard hold for their blocks (a spec describes one)."""
        return self.shard_spec.kv_bytes * self.layout.num_shards

    @property
    def device_bytes(self) -> int:
        """Device memory of every shard's staging."""
        return self.shard_spec.device_bytes * self.layout.num_shards

    def _reconcile_commits(self) -> None:
        """Re-attach: brings the head shards of every slot to their common commit.

        Each shard commits on its own, so a crash between two shards' manifest writes (in
        a commit, or in the commit a release makes) leaves the head shards of a slot at
        different commits. Their common state is the shorter one, every part of it: a slot
        that one head shard holds released is released in all (its KV is dropped), and a
        slot's rows and token ids end at the smallest length any head shard committed (the
        rows below it are committed, and checksummed, in every shard; ids past it are not
        its KV's). Logged as a warning naming the shards.
        """
        for d in range(self.layout.dp):
            holders = [s for s in self.shards if self._place(s)[0] == d]
            if len(holders) < 2:
                continue

            def warn(i, committed, common, torn, holders=holders):
                s = holders[i]
                logger.warning(
                    "re-attach: head shards %s of slots %s were left at different commits "
                    "(shard %d: lengths %s); bringing them to their common lengths %s%s",
                    holders,
                    [self.rows_of(s).start + b for b in range(len(common))],
                    s,
                    committed.tolist(),
                    common.tolist(),
                    f", releasing slots {np.flatnonzero(torn).tolist()} of shard {s}"
                    if torn.any()
                    else "",
                )

            bring_to_common_commit([self.shards[s] for s in holders], warn)

    # -- global states <-> shard states -----------------------------------------------------

    def _place(self, s: int) -> tuple[int, int]:
        return divmod(s, self.layout.tp)

    def rows_of(self, s: int) -> slice:
        """The global slots shard ``s`` holds."""
        n = self.shard_spec.batch
        d = self._place(s)[0]
        return slice(d * n, (d + 1) * n)

    def heads_of(self, s: int) -> slice:
        """The KV heads shard ``s`` holds."""
        n = self.shard_spec.num_kv_heads
        t = self._place(s)[1]
        return slice(t * n, (t + 1) * n)

    @contextlib.contextmanager
    def _on(self, s: int):
        """Host-side work on shard ``s``: its device's arrays, outside any mesh context
        (eager ops on one device's arrays under ``jax.set_mesh`` of the whole mesh are
        refused by jit)."""
        with _outside_mesh(), jax.default_device(self._devices[s]):
            yield

    def _assemble(self, states: dict[int, KVState]) -> KVState:
        """The global state of this process's shard states."""
        n = self.layout.num_shards
        per_leaf = [jax.tree_util.tree_leaves(states[s]) for s in sorted(states)]
        leaves = []
        for i, first in enumerate(per_leaf[0]):
            parts = []
            for s, leaves_of in zip(sorted(states), per_leaf):
                with self._on(s):
                    parts.append(jax.device_put(leaves_of[i][None], self._devices[s]))
            leaves.append(
                jax.make_array_from_single_device_arrays(
                    (n, *first.shape), self.state_sharding, parts
                )
            )
        return KVState(self.spec, *leaves)

    def split(self, state: KVState) -> dict[int, KVState]:
        """This process's shards of a global ``state``: ``{shard: its KVState}``."""
        if not isinstance(state, KVState):
            raise TypeError(f"expected a KVState, got {type(state).__name__}")
        if state.spec != self.spec:
            raise ValueError("state belongs to another cache (its spec differs)")
        per_shard: dict[int, list] = {s: [] for s in self.shards}
        for leaf in jax.tree_util.tree_leaves(state):
            if leaf.is_deleted():
                raise ValueError(
                    "this KVState was donated to a step (its buffers are gone); use the "
                    "state that step returned, or cache.recover() if the step failed"
                )
            if leaf.size == 0:  # No bytes to split (a cache read in place has no staging),
                # and JAX reports such an array's pieces whole: each shard's is empty too.
                for s in per_shard:
                    with self._on(s):
                        per_shard[s].append(jnp.zeros(leaf.shape[1:], leaf.dtype))
                continue
            for piece in leaf.addressable_shards:  # One per shard: no axis replicates.
                s = int(piece.index[0].start or 0)
                if piece.data.shape[0] != 1 or s not in per_shard:
                    raise ValueError(
                        f"state is not sharded as cache.state_sharding says (a piece of shape "
                        f"{piece.data.shape} at {piece.index})"
                    )
                with self._on(s):
                    per_shard[s].append(piece.data[0])
        return {s: KVState(self.shard_spec, *leaves) for s, leaves in per_shard.items()}

    def _each(self, state: KVState | None, fn, shards=None) -> KVState:
        """The global state after ``fn(shard, cache, shard_state)`` on each local shard
        (``shards``: those only, the others kept)."""
        parts = self.split(state) if state is not None else {}
        for s, cache in self.shards.items():
            if shards is None or s in shards:
                with self._on(s):
                    parts[s] = fn(s, cache, parts.get(s))
        return self._assemble(parts)

    # -- state ------------------------------------------------------------------------------

    def init(
        self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True
    ) -> KVState:
        """A fresh global state; ``lengths``: int[batch] (global slots), see
        :meth:`OffloadedKVCache.init`."""
        if lengths is not None:
            lengths = np.asarray(lengths)
            if lengths.shape != (self.batch,):
                raise ValueError(f"lengths must have shape ({self.batch},); got {lengths.shape}")
        return self._each(
            None,
            lambda s, c, _: c.init(
                None if lengths is None else lengths[self.rows_of(s)], admit=admit
            ),
        )

    def inert_state(self) -> KVState:
        """A global state that moves no bytes (see :meth:`OffloadedKVCache.inert_state`)."""
        return self._each(None, lambda s, c, _: c.inert_state())

    def drain(self, state: KVState) -> KVState:
        """Discards the prefetches of every shard (see :meth:`OffloadedKVCache.drain`)."""
        return self._each(state, lambda s, c, part: c.drain(part))

    def recover(self) -> KVState:
        """Every shard's live state after a failed step (see
        :meth:`OffloadedKVCache.recover`)."""
        return self._each(None, lambda s, c, _: c.recover())

    def commit(self, state: KVState) -> KVState:
        """Commits every shard (persistent tiers; see :meth:`OffloadedKVCache.commit`)."""
        return self._each(state, lambda s, c, part: c.commit(part))

    def check(self, state: KVState) -> None:
        """Refuses, changing nothing, what is not a state of this cache: not a ``KVState``
        (``TypeError``), or one whose structure or any of this process's shards is not
        this cache's (``ValueError``, as :meth:`OffloadedKVCache.check`)."""
        for s, part in self.split(state).items():
            with self._on(s):
                self.shards[s].check(part)

    def lengths(self, state: KVState) -> np.ndarray:
        """int32[batch]: the global slots' lengths in ``state`` (this process's shards);
        refuses head shards of one slot that disagree."""
        parts = self.split(state)
        return self._gather(lambda s, c: parts[s].lengths)

    # -- slot lifecycle ---------------------------------------------------------------------

    def _slot(self, slot: Any) -> tuple[int, list[int]]:
        """(slot within its shards, the local shards holding global ``slot``)."""
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.batch:
            raise ValueError(f"slot={slot!r} must be an int in [0, batch={self.batch})")
        d, local = divmod(int(slot), self.shard_spec.batch)
        return local, [s for s in self.shards if self._place(s)[0] == d]

    def admit(
        self,
        state: KVState,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ):
        """Admits global ``slot`` in each of its shards (every head shard of its batch
        share); returns ``(state, cached)`` (``cached`` None where this process holds none
        of them). See :meth:`OffloadedKVCache.admit`.

        All shards or none: every holder's slot table admits first (a refusal in one undoes
        the others' and raises, the state untouched); head shards whose prefix stores
        differ (a block one of them lacks) all map the prefix the shortest one has (the
        rule of :func:`jax_tpusync.caches.parts.reserve_agreed`)."""
        return admit_by_reservation(self, state, slot, max_tokens, tokens)  # Checks state.

    def reserving_in(self, state: KVState) -> contextlib.AbstractContextManager[None]:
        """Nothing to set: the shards' blocks are on their engines, not in ``state``
        (:meth:`jax_tpusync.caches.protocol.Reservable.reserving_in`)."""
        return contextlib.nullcontext()

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> MeshAdmission:
        """:meth:`admit`'s first half: every holder shard's slot table admits ``slot`` (all
        or none, raising), changing no state; then :meth:`admitted` (which cannot be
        refused) or :meth:`cancel`. ``max_cached`` caps the mapped prefix (tokens)."""
        local, holders = self._slot(slot)
        admitted = reserve_agreed(
            lambda cap: self._admit_all(holders, local, max_tokens, tokens, cap),
            lambda done: self._undo_admissions(dict(done), local),
            lambda pair: pair[1].cached,
            max_cached,
        )
        admissions = dict(admitted)
        cached = {a.cached for a in admissions.values()}
        return MeshAdmission(slot, local, admissions, cached.pop() if cached else None)

    def cancel(self, reservation: MeshAdmission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        self._undo_admissions(reservation.admissions, reservation.local)

    def admitted(self, state: KVState, reservation: MeshAdmission) -> KVState:
        """The live state once :meth:`reserve` made ``reservation``."""
        parts = self.split(state)
        for s, admission in reservation.admissions.items():
            with self._on(s):
                parts[s] = self.shards[s].admitted(parts[s], admission)
        return self._assemble(parts)

    def check_release(self, state: KVState, slot: int, tokens=None) -> None:
        """Refuses, changing nothing, a :meth:`release` that a shard would refuse."""
        local, holders = self._slot(slot)
        parts = self.split(state)
        for s in holders:
            length = int(np.asarray(parts[s].lengths)[local])
            self.shards[s].slots.check_release(local, length, tokens)

    def _admit_all(self, holders, local, max_tokens, tokens, max_cached) -> list:
        """Each holder's ``(shard, slot-table admission)``, or none (undone, then raised)."""
        return each_or_none(
            holders,
            lambda s: (
                s,
                self.shards[s].slots.admit(local, max_tokens, tokens, max_cached=max_cached),
            ),
            lambda s, _: self.shards[s].slots.release(local, 0),
        )

    def _undo_admissions(self, admissions: dict, local: int) -> None:
        for s in admissions:
            self.shards[s].slots.release(local, 0)

    def release(
        self, state: KVState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> KVState:
        """Releases global ``slot`` in each of its shards (see
        :meth:`OffloadedKVCache.release`), after every shard has accepted the arguments:
        a refusal changes no shard."""
        local, holders = self._slot(slot)
        self.check_release(state, slot, tokens)
        parts = self.split(state)
        for s in holders:
            with self._on(s):
                parts[s] = self.shards[s].release(parts[s], local, tokens=tokens)
        return self._assemble(parts)

    def publish_windows(self, state: KVState, slot: int) -> int:
        """Each of global ``slot``'s shards' :meth:`OffloadedKVCache.publish_windows` (a
        cache that keeps only its sliding window: each head shard copies, and publishes,
        its own heads' window blocks); returns the blocks copied, summed over shards."""
        local, holders = self._slot(slot)
        parts = self.split(state)
        copied = 0
        for s in holders:
            with self._on(s):
                copied += self.shards[s].publish_windows(parts[s], local)
        return copied

    def share_computed(self, state: KVState, slot: int) -> int:
        """Each of global ``slot``'s shards' :meth:`OffloadedKVCache.share_computed`: every
        head shard indexes its own heads' computed blocks (an admission maps the prefix
        every shard holds); returns the blocks indexed, summed over shards."""
        local, holders = self._slot(slot)
        parts = self.split(state)
        for s in holders:  # Refused in every shard or in none.
            self.shards[s].lengths(parts[s])  # A state of another cache is refused here.
            if not self.shards[s].capacity[local]:
                raise ValueError(f"slot {slot} is not active (nothing to share)")
        indexed = 0
        for s in holders:
            with self._on(s):
                indexed += self.shards[s].share_computed(parts[s], local)
        return indexed

    def tokens(self, slot: int) -> np.ndarray:
        """Global ``slot``'s recorded token ids (see :meth:`OffloadedKVCache.tokens`)."""
        local, holders = self._slot(slot)
        if not holders:
            raise ValueError(f"slot {slot} is held by no shard of this process")
        return self.shards[holders[0]].tokens(local)

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        """Records ``ids`` after global ``slot``'s token ids in each of its shards, after
        every shard has accepted them (see :meth:`OffloadedKVCache.extend_tokens`)."""
        local, holders = self._slot(slot)
        for s in holders:  # Checked everywhere first: the same checks in every shard.
            self.shards[s].slots.check_slot(local)
            if not self.shards[s].capacity[local]:
                raise ValueError(f"slot {slot} is not active (admit it first)")
        for s in holders:
            self.shards[s].extend_tokens(local, ids)

    # -- what the shards hold ---------------------------------------------------------------

    def _gather(self, per_shard) -> np.ndarray:
        """A [batch, ...] array of a per-slot quantity that head shards must agree on,
        from ``per_shard(cache) -> [shard batch, ...]`` of every local shard; refuses head
        shards of one slot that disagree (a torn host call) instead of picking one."""
        out: dict[int, np.ndarray] = {}
        for s, cache in self.shards.items():
            value = np.asarray(per_shard(s, cache))
            rows = self.rows_of(s)
            for i, b in enumerate(range(rows.start, rows.stop)):
                if b in out and not np.array_equal(out[b], value[i]):
                    raise ValueError(
                        f"the head shards of slot {b} disagree ({out[b].tolist()} vs "
                        f"{value[i].tolist()} in shard {s}): a host call was torn"
                    )
                out.setdefault(b, value[i])
        first = next(iter(out.values()))
        full = np.zeros((self.batch, *first.shape), first.dtype)
        for b, value in out.items():
            full[b] = value
        return full

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each global slot may hold (0: inactive)."""
        return self._gather(lambda s, c: c.capacity)

    @property
    def block_tables(self) -> dict[int, np.ndarray]:
        """``{shard: int32[shard batch, max_blocks]}``: each local shard's block tables
        (block ids are per shard)."""
        return {s: c.block_tables for s, c in self.shards.items()}

    @property
    def free_blocks(self) -> int:
        """Free blocks of the local shard with the fewest (what an admission can count on)."""
        return min(c.free_blocks for c in self.shards.values())

    @property
    def prefix_stats(self) -> dict[int, dict]:
        """``{shard: its prefix_stats}`` for the local shards."""
        return {s: c.prefix_stats for s, c in self.shards.items()}

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """int32[batch] of the last commit (None: not persistent); head shards must agree."""
        if next(iter(self.shards.values())).committed_lengths is None:
            return None
        return self._gather(lambda s, c: c.committed_lengths)

    def verify(self, state: KVState | None = None) -> dict[int, Any]:
        """Every local shard's :meth:`OffloadedKVCache.verify`: ``{shard: result}``."""
        parts = self.split(state) if state is not None else {}
        out = {}
        for s, c in self.shards.items():
            with self._on(s):
                out[s] = c.verify(parts.get(s))
        return out

    # -- host-side bulk access --------------------------------------------------------------

    def load(
        self,
        state: KVState,
        layer: int,
        k: Any,
        v: Any,
        *,
        start: int | Sequence[int] = 0,
        lengths: Sequence[int] | None = None,
        slot: int | None = None,
    ) -> KVState:
        """Bulk-writes one layer's global KV, ``k``/``v`` [batch, n, num_kv_heads,
        head_dim] (with ``slot``: that global slot's [n, num_kv_heads, head_dim]), each
        shard its share (see :meth:`OffloadedKVCache.load`)."""
        if slot is not None:
            k, v, start, lengths = one_slot_load(self.batch, slot, k, v, start, lengths)
        k, v = np.asarray(k), np.asarray(v)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or x.shape[0] != self.batch or x.shape[2] != self.num_kv_heads:
                raise ValueError(
                    f"{name} must be [batch={self.batch}, n, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim]; got {list(x.shape)}"
                )
        start = np.broadcast_to(np.asarray(start), (self.batch,))
        if lengths is not None:
            lengths = np.broadcast_to(np.asarray(lengths), (self.batch,))

        def load(s, c, part):
            rows, heads = self.rows_of(s), self.heads_of(s)
            return c.load(
                part,
                layer,
                k[rows, :, heads],
                v[rows, :, heads],
                start=start[rows],
                lengths=None if lengths is None else lengths[rows],
            )

        return self._each(state, load)

    def read(
        self,
        state: KVState,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ) -> tuple[Any, Any]:
        """K and V [stop - start, num_kv_heads, head_dim] of global ``slot``, its head
        shards joined (all of them must be this process's); ``raw=True`` (quantized tiers)
        their codes and scales, two :class:`~jax_tpusync.QuantizedRows` joined the same
        way. See :meth:`OffloadedKVCache.read`."""
        local, holders = self._slot(slot)
        if len(holders) < self.layout.tp:
            raise ValueError(
                f"slot {slot}'s KV heads are split over {self.layout.tp} devices, of which "
                f"this process holds {len(holders)}: read it in each process"
            )
        parts = self.split(state)
        pieces = []
        for s in holders:
            with self._on(s):
                pieces.append(self.shards[s].read(parts[s], layer, local, start, stop, raw=raw))
        return join_head_shards(pieces)

    def read_all(self, layer: int, lengths=None) -> tuple[np.ndarray, np.ndarray]:
        """K and V [batch, max_len, num_kv_heads, head_dim] of every global slot (this
        process must hold every shard). See :meth:`OffloadedKVCache.read_all`."""
        if len(self.shards) < self.layout.num_shards:
            raise ValueError("read_all needs every shard in this process; use read()")
        lengths = None if lengths is None else np.broadcast_to(np.asarray(lengths), (self.batch,))
        spec = self.shard_spec
        out = [np.zeros((self.batch, spec.max_len, self.num_kv_heads, spec.head_dim), spec.dtype)]
        out.append(out[0].copy())
        for s, cache in self.shards.items():
            rows, heads = self.rows_of(s), self.heads_of(s)
            with self._on(s):
                k, v = cache.read_all(layer, None if lengths is None else lengths[rows])
            out[0][rows, :, heads], out[1][rows, :, heads] = k, v
        return out[0], out[1]

    # -- lifetime ---------------------------------------------------------------------------

    def _close_shards(self, parts: dict[int, KVState] | None = None) -> None:
        for s, cache in getattr(self, "shards", {}).items():
            cache.close(None if parts is None else parts.get(s))
        if self._owns_engine:
            self.engine.close()

    def close(self, state: KVState | None = None) -> None:
        """Closes every shard (committing ``state``'s, if given) and the engine if the cache
        made it."""
        self._close_shards(None if state is None else self.split(state))

    def __enter__(self) -> ShardedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- capabilities (jax_tpusync.caches.capabilities) --------------------------------------

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """The head range of each device of ``kv_heads_axis``, in head order (those of
        shards other processes hold too)."""
        n = self.shard_spec.num_kv_heads
        return [(t * n, (t + 1) * n) for t in range(self.layout.tp)]

    def tier_parts(self) -> list[TierPart]:
        """Each shard this process holds: its heads and its global slots."""
        return [
            TierPart(s, self.shards[s], self.heads_of(s), self.rows_of(s))
            for s in sorted(self.shards)
        ]


def _heads_address(remote: str | None, heads: str) -> str | None:
    """A ``mooncake://`` address whose namespace names the head range ``heads`` (a head
    shard's blocks hold its heads only); a level object cannot be split so."""
    if remote is None:
        return None
    url = urllib.parse.urlsplit(remote)
    query = dict(urllib.parse.parse_qsl(url.query))
    query["namespace"] = f"{query.get('namespace', 'tpusync')}-{heads}"
    return urllib.parse.urlunsplit(url._replace(query=urllib.parse.urlencode(query)))


def _heads_dir(s: int, layout: MeshLayout, num_kv_heads: int) -> str:
    per = num_kv_heads // layout.tp
    t = s % layout.tp
    return f"heads{t * per}-{(t + 1) * per}"


def _outside_mesh():
    return jax.set_mesh(None) if hasattr(jax, "set_mesh") else contextlib.nullcontext()
