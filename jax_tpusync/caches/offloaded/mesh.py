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
multi-process run every process calls them with the same arguments, as SPMD programs do):
they are the composite of parts' (:class:`~jax_tpusync.caches.composite.PartsKVCache`),
whose parts here are the shards.

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_tpusync.caches.capabilities import TierPart
from jax_tpusync.caches.composite import PartsAdmission, PartsKVCache, outside_mesh
from jax_tpusync.caches.offloaded import sparse_summaries
from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.core.config import CacheConfig, with_config
from jax_tpusync.core.host_io import one_slot_load
from jax_tpusync.core.mesh_layout import MeshLayout, checked_layout
from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.runtime.engine import Engine, EngineConfig

logger = logging.getLogger(__name__)


# What ShardedKVCache.reserve makes: each holder shard's slot-table admission (the one
# admission type of a cache of parts).
MeshAdmission = PartsAdmission


class ShardedKVCache(PartsKVCache):
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
        self.parts: dict[int, OffloadedKVCache] = {}
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
                self.parts[s] = cache
        except Exception:
            self.close()
            raise
        self.shard_spec: CacheSpec = next(iter(self.parts.values())).spec
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

    @property
    def all_device_bytes(self) -> int:
        """Device memory of the state's staging over every device (every shard's)."""
        return self.device_bytes

    @property
    def shards(self) -> dict[int, OffloadedKVCache]:
        """``{shard: its cache}`` of this process's shards."""
        return self.parts

    # -- global states <-> shard states -----------------------------------------------------

    part_noun = "head shards"
    _log = logger

    def _part_name(self, s: int) -> str:
        return f"shard {s}"

    def _running(self, s: int) -> contextlib.AbstractContextManager[None]:
        return self._on(s)

    def _close_own(self) -> None:
        if self._owns_engine:
            self.engine.close()

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
        with outside_mesh(), jax.default_device(self._devices[s]):
            yield

    def _assemble(self, states: dict[int, KVState], state: KVState | None = None) -> KVState:
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
        return KVState.from_leaves(self.spec, leaves)

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
        return {s: KVState.from_leaves(self.shard_spec, leaves) for s, leaves in per_shard.items()}

    def _split(self, state: KVState, *, check=True, releasing=None) -> dict[int, KVState]:
        return self.split(state)

    # -- slot lifecycle ---------------------------------------------------------------------

    def reserving_in(self, state: KVState) -> contextlib.AbstractContextManager[None]:
        """Nothing to set: the shards' blocks are on their engines, not in ``state``
        (:meth:`jax_tpusync.caches.protocol.Reservable.reserving_in`)."""
        return contextlib.nullcontext()

    # -- what the shards hold ---------------------------------------------------------------

    @property
    def block_tables(self) -> dict[int, np.ndarray]:
        """``{shard: int32[shard batch, max_blocks]}``: each local shard's block tables
        (block ids are per shard)."""
        return {s: c.block_tables for s, c in self.shards.items()}

    @property
    def free_blocks(self) -> int:
        """Free blocks of the local shard with the fewest (what an admission can count on)."""
        return min(c.free_blocks for c in self.shards.values())

    # -- host-side bulk access --------------------------------------------------------------

    def _load_shares(self, layer, k, v, start, lengths, slot) -> dict:
        """Each shard loads its slots' rows of its heads of one layer's global KV, ``k``/``v``
        [batch, n, num_kv_heads, head_dim] (with ``slot``: that global slot's [n,
        num_kv_heads, head_dim])."""
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
        shares = {}
        for s in self.shards:
            rows, heads = self.rows_of(s), self.heads_of(s)
            shares[s] = dict(
                layer=layer,
                k=k[rows, :, heads],
                v=v[rows, :, heads],
                start=start[rows],
                lengths=self._share(lengths, s),
            )
        return shares

    def _read_parts(self, layer: Any, slot: Any) -> list[tuple[int, int, int]]:
        """Global ``slot``'s head shards, all of which must be this process's."""
        holders = self._holders(slot)
        if len(holders) < self.layout.tp:
            raise ValueError(
                f"slot {slot}'s KV heads are split over {self.layout.tp} devices, of which "
                f"this process holds {len(holders)}: read it in each process"
            )
        return [(s, layer, local) for s, local in holders]

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

    # -- capabilities (jax_tpusync.caches.capabilities) --------------------------------------

    def sparse_stats(self, state: KVState) -> dict:
        """:meth:`OffloadedKVCache.sparse_stats` over every shard of this process: each
        shard selects over its own KV heads (and slots), so its blocks and bytes add up.

        Raises:
          ValueError: the cache is not sparse (``sparse=``), or ``state`` is not its own.
        """
        parts = self.split(state)
        return sparse_summaries.combined_stats(
            [self.parts[s].sparse_stats(part) for s, part in sorted(parts.items())]
        )

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
