"""A host-pool cache whose slots are split over a mesh's ``batch_axis``: one
:class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` per batch shard, composed.

Layout (the engine mesh cache's, :mod:`jax_tpusync.caches.offloaded.mesh`). Along ``batch_axis`` (dp
devices) batch shard ``d`` holds slots ``[d * batch / dp, (d + 1) * batch / dp)``; its
cache is a host pool over the sub-mesh of that row of devices, with the heads split over
``kv_heads_axis`` (tp devices) as any host pool's (each device its heads' pool in its own
host memory). The device at mesh place ``(d, t)`` holds shard ``d * tp + t``.

State. The global state is a :class:`~jax_tpusync.core.pool_state.PoolState` whose every leaf
has a leading axis of ``dp * tp`` shards, split ``P((batch_axis, kv_heads_axis))``, and
whose spec is one shard's (``batch / dp`` slots, ``num_kv_heads / tp`` heads) with the
whole mesh: the step (:mod:`jax_tpusync.step.sharded`) runs each device's share in
``shard_map``, as for any mesh cache. A global leaf is assembled from the batch shards'
per-device buffers (``jax.make_array_from_single_device_arrays``) and split back into
them the same way: no bytes are copied either way.

Host calls take global slot ids: a call for slot ``b`` goes to batch shard ``b //
(batch / dp)`` with its slot id there. Every call checks every batch shard's part of the
state first (each shard's ``PoolState.epoch``): a state that is not the live one in any
shard, or another cache's, or whose shards' parts are not where their shard's are, is
refused, and a refusal changes no shard. Each batch shard has its own slot table,
prefix index and prefix-level connections (the blocks they publish are the same bytes,
so a shared directory or a Mooncake namespace may serve every shard).

Persistence (``shm_name=``, ``file_name=``): each batch shard persists under its own
name, ``<name>-batch<d>``, in a pool's tier layout (every head of its slots). The shards
hold disjoint slots, so there is no common commit to bring them to on re-attach: each
re-attaches its own last commit (a crash between two shards' commits leaves each slot at
a commit of its own rows), and a failed commit of one shard leaves the others' made.

What a host pool refuses is refused here by name too (a spill tier over a mesh, resident
mode, ...); ``restart_at`` (how a hybrid cache brings its groups to a common commit) is
not offered, and a hybrid cache's host-pool groups do not take ``batch_axis``; P/D
transfer takes one-slot-table caches only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_tpusync.caches.parts import reserving_in_each
from jax_tpusync.caches.pool.cache import HostPoolKVCache
from jax_tpusync.caches.protocol import admit_by_reservation
from jax_tpusync.core.config import CacheConfig, is_int, with_config
from jax_tpusync.core.host_io import as_cache_array, check_layer, check_load_rows, per_sequence
from jax_tpusync.core.mesh_layout import checked_layout
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.slots import Admission
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.persist import commit as persistence

logger = logging.getLogger(__name__)

__all__ = ["BatchShardAdmission", "BatchShardedPoolKVCache"]


@dataclasses.dataclass(frozen=True)
class BatchShardAdmission:
    """What :meth:`BatchShardedPoolKVCache.reserve` made: global ``slot``, held by batch
    shard ``shard``, and that shard's slot-table ``admission`` (of its own slot id)."""

    slot: int
    shard: int
    admission: Admission

    @property
    def cached(self) -> int:
        """Prefix tokens the reservation maps."""
        return self.admission.cached


class BatchShardedPoolKVCache:
    """A :class:`~jax_tpusync.HostPoolKVCache` with its slots split over ``mesh``'s
    ``batch_axis`` (and its heads over ``kv_heads_axis``, if given): what
    ``jax_tpusync.kv_cache(..., mesh=, batch_axis=)`` makes on the TPU backend.

    Takes :class:`~jax_tpusync.HostPoolKVCache`'s keywords (or ``config=``), with
    ``batch`` and ``num_kv_heads`` global (each a multiple of its axis' devices) and
    ``num_blocks`` and ``staging_bytes`` per device. The host methods are the pool's, on
    global slot ids and global states (see the module for the layout).

    Raises:
      ValueError: no ``batch_axis``, an axis not in the mesh, a ``batch`` its axis does
        not divide, or any refusal of a host pool's (named as it names it).
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        mesh: Mesh,
        batch_axis: str,
        kv_heads_axis: str | None = None,
        **options: Any,
    ):
        options = with_config(config, options)
        layout = checked_layout(mesh, kv_heads_axis, batch_axis)
        if batch_axis is None:
            raise ValueError(
                "batch_axis=None: this cache splits the slots over a mesh axis; a pool with "
                "only its heads split is a HostPoolKVCache(mesh=, kv_heads_axis=)"
            )
        batch = options.get("batch")
        if not is_int(batch) or batch <= 0 or batch % layout.dp:
            raise ValueError(
                f"batch={batch!r} must be a positive multiple of mesh axis {batch_axis!r}'s "
                f"{layout.dp} devices (each holds an equal share of the slots)"
            )
        self.mesh = layout
        self.batch = int(batch)
        self.parts: list[HostPoolKVCache] = []
        try:
            for d in range(layout.dp):
                with _outside_mesh():
                    self.parts.append(
                        HostPoolKVCache(
                            mesh=_row_mesh(mesh, batch_axis, d),
                            kv_heads_axis=kv_heads_axis,
                            batch_axis=batch_axis,
                            **_part_options(options, self.batch // layout.dp, d),
                        )
                    )
        except Exception:
            for part in self.parts:
                part.close()
            raise
        first = self.parts[0]
        self.config = CacheConfig.from_kwargs(**options)  # Global: every slot and head.
        self.spec: CacheSpec = dataclasses.replace(first.spec, mesh=layout)
        self.layout = first.layout  # One device's pool, alike in every shard.
        self.num_kv_heads = first.shards * first.spec.num_kv_heads
        self.state_sharding = NamedSharding(mesh, layout.state_spec)
        self.pool_sharding = NamedSharding(
            mesh, layout.state_spec, memory_kind=first.pool_sharding.memory_kind
        )
        self._closed = False

    # -- what the shards hold ---------------------------------------------------------------

    @property
    def shards(self) -> int:
        """Devices the cache is split over (``dp * tp``)."""
        return self.mesh.num_shards

    @property
    def slots_per_shard(self) -> int:
        """Slots each batch shard holds (``batch / dp``)."""
        return self.spec.batch

    @property
    def max_len(self) -> int:
        return self.spec.max_len

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each global slot may hold (0: inactive); a copy."""
        return np.concatenate([p.capacity for p in self.parts])

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """int32[batch]: every slot's length at its shard's last commit (None: not
        persistent)."""
        if self.parts[0].committed_lengths is None:
            return None
        return np.concatenate([p.committed_lengths for p in self.parts]).astype(np.int32)

    @property
    def kv_bytes(self) -> int:
        """Host memory of every device's pool."""
        return sum(p.kv_bytes for p in self.parts)

    @property
    def device_bytes(self) -> int:
        """Device memory the state's staging takes on each device (as a host pool's)."""
        return self.parts[0].device_bytes

    @property
    def prefix_stats(self) -> dict[int, dict]:
        """``{batch shard: its prefix index's counts}`` (each shard has its own index)."""
        return {d: p.prefix_stats for d, p in enumerate(self.parts)}

    def rows_of(self, d: int) -> slice:
        """The global slots batch shard ``d`` holds."""
        n = self.slots_per_shard
        return slice(d * n, (d + 1) * n)

    def _slot(self, slot: Any) -> tuple[int, int]:
        """``(batch shard, slot id there)`` of global ``slot``."""
        if not is_int(slot) or not 0 <= slot < self.batch:
            raise ValueError(f"slot={slot!r} must be an int in [0, batch={self.batch})")
        return divmod(int(slot), self.slots_per_shard)

    @contextlib.contextmanager
    def _in(self, d: int) -> Iterator[None]:
        """Work on batch shard ``d``: outside any mesh context (its programs run on its row
        of devices), its refusals naming the shard (its slot ids are its own)."""
        try:
            with _outside_mesh():
                yield
        except ValueError as e:
            if type(e) is not ValueError:
                raise
            rows = self.rows_of(d)
            raise ValueError(
                f"batch shard {d} (global slots [{rows.start}, {rows.stop}), numbered from 0 "
                f"there): {e}"
            ) from e

    # -- global states <-> the shards' states -----------------------------------------------

    def split(self, state: PoolState) -> list[PoolState]:
        """The batch shards' states of a global ``state`` (their buffers, not copies).

        Raises:
          TypeError: not a ``PoolState``.
          ValueError: another cache's structure, a state donated to a step, or leaves not
            split as :attr:`state_sharding` says.
        """
        self._check_open()
        if not isinstance(state, PoolState):
            raise TypeError(f"expected a PoolState, got {type(state).__name__}")
        if state.spec != self.spec:
            raise ValueError("state belongs to another cache (its spec differs)")
        leaves, tree = jax.tree_util.tree_flatten(state)
        tp, dp = self.mesh.tp, self.mesh.dp
        per_part: list[list[jax.Array]] = [[] for _ in range(dp)]
        for leaf in leaves:
            if leaf.is_deleted():
                raise ValueError(
                    "this PoolState was donated to a step (its pool is gone); use the state "
                    "that step returned"
                )
            want = NamedSharding(
                self.mesh.mesh, self.mesh.state_spec, memory_kind=leaf.sharding.memory_kind
            )
            if leaf.shape[:1] != (dp * tp,) or not leaf.sharding.is_equivalent_to(want, leaf.ndim):
                raise ValueError(
                    f"state is not split as cache.state_sharding says (a leaf of shape "
                    f"{leaf.shape} sharded {leaf.sharding})"
                )
            pieces = {int(p.index[0].start or 0): p.data for p in leaf.addressable_shards}
            for d, part in enumerate(self.parts):
                sharding = NamedSharding(
                    part.mesh.mesh, part.mesh.state_spec, memory_kind=leaf.sharding.memory_kind
                )
                order = sharding.addressable_devices_indices_map((tp, *leaf.shape[1:]))
                per_part[d].append(
                    jax.make_array_from_single_device_arrays(
                        (tp, *leaf.shape[1:]),
                        sharding,
                        [pieces[d * tp + int(ix[0].start or 0)] for ix in order.values()],
                    )
                )
        return [
            jax.tree_util.tree_unflatten(tree, part_leaves).with_spec(part.spec)
            for part, part_leaves in zip(self.parts, per_part)
        ]

    def _assemble(self, states: Sequence[PoolState]) -> PoolState:
        """The global state of the batch shards' ``states`` (their buffers, not copies)."""
        tp = self.mesh.tp
        per_part = [jax.tree_util.tree_flatten(s) for s in states]
        tree = per_part[0][1]
        leaves = []
        for i, first in enumerate(per_part[0][0]):
            memory_kind = first.sharding.memory_kind
            sharding = NamedSharding(self.mesh.mesh, self.mesh.state_spec, memory_kind=memory_kind)
            shape = (self.shards, *first.shape[1:])
            pieces = {}
            for d, (part_leaves, _) in enumerate(per_part):
                for p in part_leaves[i].addressable_shards:
                    pieces[d * tp + int(p.index[0].start or 0)] = p.data
            order = sharding.addressable_devices_indices_map(shape)
            leaves.append(
                jax.make_array_from_single_device_arrays(
                    shape, sharding, [pieces[int(ix[0].start or 0)] for ix in order.values()]
                )
            )
        return jax.tree_util.tree_unflatten(tree, leaves).with_spec(self.spec)

    def _checked(self, state: PoolState, releasing: int | None = None) -> list[PoolState]:
        """The shards' states of ``state``, each checked live by its shard (``releasing``:
        a global slot being released; if its steps were refused, no shard's refused slots
        refuse the call, as in a host pool's check)."""
        parts = self.split(state)
        held, clearing = None if releasing is None else self._slot(releasing), False
        if held is not None:
            d, local = held
            with self._in(d):
                self.parts[d].check(parts[d], releasing=local)
                clearing = self.parts[d].refused_tokens(parts[d])[local] > 0
        for d, (part, part_state) in enumerate(zip(self.parts, parts)):
            if held is not None and d == held[0]:
                continue  # Checked above, its refusals included.
            with self._in(d):
                part.check(part_state, refusals=not clearing)
        return parts

    def check(self, state: PoolState) -> None:
        """Refuses, changing nothing, a state that is not this cache's live one: not a
        ``PoolState`` (``TypeError``), or (``ValueError``) another cache's, one donated to
        a step, one split otherwise, one whose part in any batch shard is not that shard's
        live state, or whose steps were refused for a slot (see
        :meth:`jax_tpusync.HostPoolKVCache.check`)."""
        self._checked(state)

    # -- state ------------------------------------------------------------------------------

    def init(
        self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True
    ) -> PoolState:
        """The first global state, as :meth:`jax_tpusync.HostPoolKVCache.init` (``lengths``:
        int[batch] of global slots; default 0, or each shard's committed lengths). Every
        shard accepts the call (:meth:`jax_tpusync.HostPoolKVCache.check_init`: the
        lengths, and with ``admit`` the room for every inactive slot) before any shard
        makes its pool."""
        self._check_open()
        if lengths is not None:
            lengths = np.asarray(lengths)
            if lengths.shape != (self.batch,):
                raise ValueError(f"lengths must have shape ({self.batch},); got {lengths.shape}")
            if not np.issubdtype(lengths.dtype, np.integer):
                raise ValueError(f"lengths must hold ints; got {lengths.dtype}")
        for d, part in enumerate(self.parts):
            with self._in(d):
                part.check_init(None if lengths is None else lengths[self.rows_of(d)], admit=admit)
        states = []
        for d, part in enumerate(self.parts):
            with self._in(d):
                states.append(
                    part.init(None if lengths is None else lengths[self.rows_of(d)], admit=admit)
                )
        return self._assemble(states)

    def inert_state(self) -> PoolState:
        """A global state that moves no bytes anywhere the live state reads (see
        :meth:`jax_tpusync.HostPoolKVCache.inert_state`); the live state stays live."""
        self._check_open()
        states = []
        for d, part in enumerate(self.parts):
            with self._in(d):
                states.append(part.inert_state())
        return self._assemble(states)

    def lengths(self, state: PoolState) -> np.ndarray:
        """int32[batch]: the tokens each global slot holds in ``state``."""
        parts = self._checked(state)
        return np.concatenate([np.asarray(s.lengths)[0] for s in parts]).astype(np.int32)

    def kept_from(self, state: PoolState) -> np.ndarray:
        """int64[batch]: each global slot's first position the pools still hold (see
        :meth:`jax_tpusync.HostPoolKVCache.kept_from`)."""
        parts = self._checked(state)
        out = []
        for d, (part, part_state) in enumerate(zip(self.parts, parts)):
            with self._in(d):
                out.append(part.kept_from(part_state))
        return np.concatenate(out)

    def drain(self, state: PoolState) -> PoolState:
        """The state once the step that made it has finished; returns it as the live
        state."""
        self._checked(state)
        jax.block_until_ready(state)
        return state

    def commit(self, state: PoolState) -> PoolState:
        """Commits every batch shard's rows (see :meth:`jax_tpusync.HostPoolKVCache.commit`);
        returns the drained state.

        Raises:
          persistence.CommitError: naming the batch shard whose commit was not made (the
            shards before it committed: their slots are theirs alone).
        """
        parts = self._checked(state)
        for d, (part, part_state) in enumerate(zip(self.parts, parts)):
            try:
                with self._in(d):
                    part.commit(part_state)
            except persistence.CommitError as e:
                raise persistence.CommitError(
                    f"batch shard {d}: {e} (shards {list(range(d))} committed)"
                ) from e
        return state

    def verify(self, state: PoolState | None = None) -> dict[int, persistence.VerifyResult]:
        """Every batch shard's :meth:`jax_tpusync.HostPoolKVCache.verify`:
        ``{shard: result}``."""
        self._check_open()
        parts = [None] * len(self.parts) if state is None else self._checked(state)
        out = {}
        for d, (part, part_state) in enumerate(zip(self.parts, parts)):
            with self._in(d):
                out[d] = part.verify(part_state)
        return out

    def recover(self) -> PoolState:
        """Refused, as :meth:`jax_tpusync.HostPoolKVCache.recover` is: a state donated to a
        failed step took its pools with it."""
        return self.parts[0].recover()

    # -- slot lifecycle ---------------------------------------------------------------------

    def admit(
        self,
        state: PoolState,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[PoolState, int]:
        """Admits global ``slot`` in its batch shard; returns ``(state, cached)`` (see
        :meth:`jax_tpusync.HostPoolKVCache.admit`)."""
        return admit_by_reservation(self, state, slot, max_tokens, tokens)  # Checks state.

    @contextlib.contextmanager
    def reserving_in(self, state: PoolState) -> Iterator[None]:
        """Every shard's :meth:`~jax_tpusync.HostPoolKVCache.reserving_in` its part of
        ``state``."""
        with reserving_in_each(self.parts, self.split(state)):
            yield

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> BatchShardAdmission:
        """:meth:`admit`'s first half: ``slot``'s batch shard admits it (or raises, changing
        nothing); then :meth:`admitted` or :meth:`cancel`."""
        self._check_open()
        d, local = self._slot(slot)
        with self._in(d):
            admission = self.parts[d].reserve(local, max_tokens, tokens, max_cached=max_cached)
        return BatchShardAdmission(int(slot), d, admission)

    def cancel(self, reservation: BatchShardAdmission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        with self._in(reservation.shard):
            self.parts[reservation.shard].cancel(reservation.admission)

    def admitted(self, state: PoolState, reservation: BatchShardAdmission) -> PoolState:
        """The live global state once :meth:`reserve` made ``reservation``."""
        parts = self.split(state)
        d = reservation.shard
        with self._in(d):
            parts[d] = self.parts[d].admitted(parts[d], reservation.admission)
        return self._assemble(parts)

    def check_release(
        self, state: PoolState, slot: int, tokens: Sequence[int] | np.ndarray | None = None
    ) -> None:
        """Refuses, changing nothing, a :meth:`release` the cache would refuse."""
        d, local = self._slot(slot)
        parts = self._checked(state, releasing=slot)
        with self._in(d):
            self.parts[d].check_release(parts[d], local, tokens)

    def release(
        self, state: PoolState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> PoolState:
        """Frees global ``slot`` in its batch shard (see
        :meth:`jax_tpusync.HostPoolKVCache.release`); its full blocks enter that shard's
        prefix index."""
        d, local = self._slot(slot)
        parts = self._checked(state, releasing=slot)
        with self._in(d):
            parts[d] = self.parts[d].release(parts[d], local, tokens=tokens)
        return self._assemble(parts)

    def publish_windows(self, state: PoolState, slot: int) -> int:
        """Global ``slot``'s :meth:`jax_tpusync.HostPoolKVCache.publish_windows` in its
        batch shard; returns the blocks copied."""
        d, local = self._slot(slot)
        parts = self._checked(state)
        with self._in(d):
            return self.parts[d].publish_windows(parts[d], local)

    def share_computed(self, state: PoolState, slot: int) -> int:
        """Global ``slot``'s :meth:`jax_tpusync.HostPoolKVCache.share_computed` in its batch
        shard (its prefix index); returns the blocks indexed now."""
        d, local = self._slot(slot)
        parts = self._checked(state)
        with self._in(d):
            return self.parts[d].share_computed(parts[d], local)

    def tokens(self, slot: int) -> np.ndarray:
        """Global ``slot``'s recorded token ids."""
        d, local = self._slot(slot)
        with self._in(d):
            return self.parts[d].tokens(local)

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        """Records ``ids`` after global ``slot``'s token ids."""
        d, local = self._slot(slot)
        with self._in(d):
            self.parts[d].extend_tokens(local, ids)

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
        """Writes one layer's KV of global slots host-side, each batch shard its own
        slots' rows (see :meth:`jax_tpusync.HostPoolKVCache.load`: same arguments, on
        global slots). Every shard accepts its rows before any is written; a shard
        given no rows is left as it is.

        Raises:
          ValueError: as a host pool's load, naming the batch shard; nothing is written.
        """
        parts = self._checked(state)
        if slot is not None:
            d, local = self._slot(slot)
            with self._in(d):
                parts[d] = self.parts[d].load(
                    parts[d], layer, k, v, start=start, lengths=lengths, slot=local
                )
            return self._assemble(parts)
        spec = self.spec
        check_layer(layer, spec.num_layers)
        k = as_cache_array("k", k, spec.dtype)
        v = as_cache_array("v", v, spec.dtype)
        heads = (self.num_kv_heads, spec.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or x.shape[0] != self.batch or x.shape[2:] != heads:
                raise ValueError(
                    f"{name} must be [batch={self.batch}, n, num_kv_heads="
                    f"{self.num_kv_heads}, head_dim={spec.head_dim}]; got {x.shape}"
                )
        starts = per_sequence("start", start, self.batch)
        counts = None if lengths is None else per_sequence("lengths", lengths, self.batch)
        shares = []
        for d, part in enumerate(self.parts):
            rows = self.rows_of(d)
            share = {"start": starts[rows], "lengths": None if counts is None else counts[rows]}
            with self._in(d):  # Every shard's refusal before any shard writes.
                _, _, _, share_counts = check_load_rows(
                    part.slots, self.num_kv_heads, spec.head_dim, spec.dtype, k[rows], v[rows],
                    share["start"], share["lengths"],
                )  # fmt: skip
            shares.append((share, share_counts.any()))
        for d, (part, (share, any_rows)) in enumerate(zip(self.parts, shares)):
            if any_rows:
                rows = self.rows_of(d)
                with self._in(d):
                    parts[d] = part.load(parts[d], layer, k[rows], v[rows], **share)
        return self._assemble(parts)

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
        """Host copies of positions ``[start, stop)`` of global ``slot``'s K and V in
        ``layer`` (see :meth:`jax_tpusync.HostPoolKVCache.read`)."""
        d, local = self._slot(slot)
        parts = self._checked(state)
        with self._in(d):
            return self.parts[d].read(parts[d], layer, local, start, stop, raw=raw)

    def read_stored_rows(self, state: PoolState, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of global ``slot`` in every layer as its pool stores
        them: uint8[tp, num_layers, 2, stop - start, row_bytes] (see
        :meth:`jax_tpusync.HostPoolKVCache.read_stored_rows`)."""
        d, local = self._slot(slot)
        parts = self._checked(state)
        with self._in(d):
            return self.parts[d].read_stored_rows(parts[d], local, start, stop)

    def load_stored_rows(
        self,
        state: PoolState,
        slot: int,
        start: int,
        rows: np.ndarray,  # uint8[tp, num_layers, 2, n, row_bytes]: K rows, then V rows
    ) -> PoolState:
        """Writes positions ``[start, start + n)`` of global ``slot`` in every layer from
        the bytes its pool stores them as (see
        :meth:`jax_tpusync.HostPoolKVCache.load_stored_rows`)."""
        d, local = self._slot(slot)
        parts = self._checked(state)
        with self._in(d):
            parts[d] = self.parts[d].load_stored_rows(parts[d], local, start, rows)
        return self._assemble(parts)

    # -- lifetime ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this cache is closed")

    def close(self, state: PoolState | None = None) -> None:
        """Closes every batch shard, committing ``state``'s part in each if given (see
        :meth:`jax_tpusync.HostPoolKVCache.close`: never raises for a failed commit; a
        state that is not this cache's is logged and nothing is committed)."""
        if self._closed:
            return
        parts: list[PoolState | None] = [None] * len(self.parts)
        if state is not None:
            try:
                parts = list(self.split(state))
            except (TypeError, ValueError) as e:
                logger.error("close(): nothing committed, the state is not this cache's: %s", e)
        self._closed = True
        for d, (part, part_state) in enumerate(zip(self.parts, parts)):
            with _outside_mesh():
                part.close(part_state)

    def __enter__(self) -> BatchShardedPoolKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row_mesh(mesh: Mesh, batch_axis: str, d: int) -> Mesh:
    """The sub-mesh of ``mesh``'s devices at place ``d`` of ``batch_axis``: every axis
    kept, ``batch_axis`` of one device."""
    axis = mesh.axis_names.index(batch_axis)
    devices = np.take(mesh.devices, [d], axis=axis)
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _part_options(options: dict[str, Any], batch: int, d: int) -> dict[str, Any]:
    """Batch shard ``d``'s keywords: its share of the slots, its own persistent names."""
    out = dict(options, batch=batch)
    for name in ("shm_name", "file_name"):
        if out.get(name) is not None:
            out[name] = f"{out[name]}-batch{d}"
    return out


def _outside_mesh():
    """No mesh context: a batch shard's programs run on its own row of devices (under
    ``jax.set_mesh`` of the whole mesh jit refuses them)."""
    return jax.set_mesh(None) if hasattr(jax, "set_mesh") else contextlib.nullcontext()
