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

Host calls take global slot ids (the composite of parts',
:class:`~jax_tpusync.caches.composite.PartsKVCache`, whose parts here are the batch
shards): a call for slot ``b`` goes to batch shard ``b // (batch / dp)`` with its slot id
there. Every call checks every batch shard's part of the
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

Sparse decode (``sparse=``): each device selects, for its slots and heads, from its own
summaries, as over a host pool's heads mesh; :meth:`BatchShardedPoolKVCache.sparse_stats`
sums the shards'.

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

from jax_tpusync.caches.composite import PartsAdmission, PartsKVCache, outside_mesh
from jax_tpusync.caches.pool import summaries as pool_summaries
from jax_tpusync.caches.pool.cache import HostPoolKVCache
from jax_tpusync.core.config import CacheConfig, is_int, with_config
from jax_tpusync.core.host_io import as_cache_array, check_layer, check_load_rows, per_sequence
from jax_tpusync.core.mesh_layout import checked_layout
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.persist import commit as persistence
from jax_tpusync.sparse.config import SparseConfig

logger = logging.getLogger(__name__)

__all__ = ["BatchShardAdmission", "BatchShardedPoolKVCache"]


# What BatchShardedPoolKVCache.reserve makes: the batch shard's slot-table admission (the
# one admission type of a cache of parts).
BatchShardAdmission = PartsAdmission


class BatchShardedPoolKVCache(PartsKVCache):
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
        self.parts: dict[int, HostPoolKVCache] = {}
        try:
            for d in range(layout.dp):
                with outside_mesh():
                    self.parts[d] = HostPoolKVCache(
                        mesh=_row_mesh(mesh, batch_axis, d),
                        kv_heads_axis=kv_heads_axis,
                        batch_axis=batch_axis,
                        **_part_options(options, self.batch // layout.dp, d),
                    )
        except Exception:
            for part in self.parts.values():
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

    # -- what the shards hold ---------------------------------------------------------------

    part_noun = "batch shards"
    _log = logger

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
    def device_bytes(self) -> int:
        """Device memory the state's staging takes on each device (as a host pool's)."""
        return self.parts[0].device_bytes

    def rows_of(self, d: int) -> slice:
        """The global slots batch shard ``d`` holds."""
        n = self.slots_per_shard
        return slice(d * n, (d + 1) * n)

    def _part_name(self, d: int) -> str:
        return f"batch shard {d}"

    @contextlib.contextmanager
    def _in(self, d: int) -> Iterator[None]:
        """Work on batch shard ``d``: outside any mesh context (its programs run on its row
        of devices), its refusals naming the shard (its slot ids are its own), a commit
        not made naming the shards before it, which committed (their slots are theirs
        alone)."""
        try:
            with outside_mesh():
                yield
        except persistence.CommitError as e:
            raise persistence.CommitError(
                f"batch shard {d}: {e} (shards {list(range(d))} committed)"
            ) from e
        except ValueError as e:
            if type(e) is not ValueError:
                raise
            rows = self.rows_of(d)
            raise ValueError(
                f"batch shard {d} (global slots [{rows.start}, {rows.stop}), numbered from 0 "
                f"there): {e}"
            ) from e

    def _running(self, d: int) -> contextlib.AbstractContextManager[None]:
        return self._in(d)

    @property
    def sparse(self) -> SparseConfig | None:
        """The sparse decode setting (None: every decode row reads its whole context)."""
        return self.config.sparse

    def sparse_stats(self, state: PoolState) -> dict:
        """:meth:`jax_tpusync.HostPoolKVCache.sparse_stats` over every batch shard: each
        device selects its own blocks for its slots and heads; blocks, decode rows and
        bytes summed (:func:`~jax_tpusync.caches.pool.summaries.combined_stats`).

        Raises:
          ValueError: the cache was made without ``sparse=``.
        """
        if self.sparse is None:
            raise ValueError("sparse_stats(): this cache was made without sparse=")
        states = self.split(state)
        return pool_summaries.combined_stats(
            [part.sparse_stats(states[d]) for d, part in self.parts.items()]
        )

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
            for d, part in self.parts.items():
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
            for part, part_leaves in zip(self.parts.values(), per_part)
        ]

    def _split(self, state: PoolState, *, check=True, releasing=None) -> dict[int, PoolState]:
        """Every call checks every shard's part of the state first (the live one there, no
        refused slot but the one being released), unless it only reads the structure."""
        return dict(enumerate(self._checked(state, releasing) if check else self.split(state)))

    def _assemble(self, states: dict[int, PoolState], state=None) -> PoolState:
        """The global state of the batch shards' ``states`` (their buffers, not copies)."""
        tp = self.mesh.tp
        per_part = [jax.tree_util.tree_flatten(s) for s in states.values()]
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
        held, clearing = None if releasing is None else self._holders(releasing)[0], False
        if held is not None:
            d, local = held
            with self._in(d):
                self.parts[d].check(parts[d], releasing=local)
                clearing = self.parts[d].refused_tokens(parts[d])[local] > 0
        for d, (part, part_state) in enumerate(zip(self.parts.values(), parts)):
            if held is not None and d == held[0]:
                continue  # Checked above, its refusals included.
            with self._in(d):
                part.check(part_state, refusals=not clearing)
        return parts

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
        for d, part in self.parts.items():
            with self._in(d):
                part.check_init(self._share(lengths, d), admit=admit)
        return super().init(lengths, admit=admit)

    def kept_from(self, state: PoolState) -> np.ndarray:
        """int64[batch]: each global slot's first position the pools still hold (see
        :meth:`jax_tpusync.HostPoolKVCache.kept_from`)."""
        states = self._split(state)
        return self._gather(lambda d, part: part.kept_from(states[d]))

    def recover(self) -> PoolState:
        """Refused, as :meth:`jax_tpusync.HostPoolKVCache.recover` is: a state donated to a
        failed step took its pools with it."""
        return self.parts[0].recover()

    # -- host-side rows ---------------------------------------------------------------------

    def _load_shares(self, layer, k, v, start, lengths, slot) -> dict:
        """Each batch shard loads its own slots' rows (one slot's: its shard alone); every
        shard accepts its rows before any is written, and a shard given no rows is left
        as it is."""
        if slot is not None:
            ((d, local),) = self._holders(slot)
            return {d: dict(layer=layer, k=k, v=v, start=start, lengths=lengths, slot=local)}
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
        shares = {}
        for d, part in self.parts.items():
            rows = self.rows_of(d)
            share = dict(layer=layer, k=k[rows], v=v[rows], start=starts[rows])
            share["lengths"] = self._share(counts, d)
            with self._in(d):  # Every shard's refusal before any shard writes.
                _, _, _, share_counts = check_load_rows(
                    part.slots, self.num_kv_heads, spec.head_dim, spec.dtype, k[rows], v[rows],
                    share["start"], share["lengths"],
                )  # fmt: skip
            if share_counts.any():
                shares[d] = share
        return shares

    def _read_parts(self, layer: Any, slot: Any) -> list[tuple[int, int, int]]:
        return [(d, layer, local) for d, local in self._holders(slot)]

    def read_stored_rows(self, state: PoolState, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of global ``slot`` in every layer as its pool stores
        them: uint8[tp, num_layers, 2, stop - start, row_bytes] (see
        :meth:`jax_tpusync.HostPoolKVCache.read_stored_rows`)."""
        ((d, local),) = self._holders(slot)
        states = self._split(state)
        with self._in(d):
            return self.parts[d].read_stored_rows(states[d], local, start, stop)

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
        ((d, local),) = self._holders(slot)
        states = self._split(state)
        with self._in(d):
            states[d] = self.parts[d].load_stored_rows(states[d], local, start, rows)
        return self._assemble(states, state)


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
