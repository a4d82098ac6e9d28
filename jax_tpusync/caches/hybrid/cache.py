"""The KV cache of a hybrid model: one offloaded cache per geometry group of layers.

:class:`HybridKVCache` takes per-layer ``num_kv_heads``, ``head_dim`` and ``sliding_window``
(an int for every layer, or one value per layer) and ``kv_sharing`` (per layer, None or an
earlier layer whose KV it reads), groups the layers by geometry
(:func:`jax_tpusync.core.hybrid_state.plan_groups`) and makes one
:class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache` per group, all on one engine:

* a **global** group holds every slot's whole context, as any cache does;
* a **sliding** group keeps, per slot, only a ring of blocks covering its window plus one
  step's rows (``max_step_tokens``; :mod:`jax_tpusync.core.window_ring`): its tier bytes, the
  bytes a step fetches from it and its host-side rows are independent of the context
  length (``bound_windows=False`` keeps every position instead);
* a layer that **reads another layer's KV** has no group, tier bytes or write-back: it
  attends over its source's rows.

The state (:class:`~jax_tpusync.core.hybrid_state.HybridState`) carries every group's state;
:func:`~jax_tpusync.prefetching_attention` takes it as it takes a
:class:`~jax_tpusync.KVState`, each layer with its own shapes. The host-side methods act on
every group at once, all of them or none: an admission that one group refuses is undone in
the others, and a refused call changes nothing (the composite of parts,
:class:`~jax_tpusync.caches.composite.PartsKVCache`, whose parts here are the groups).

On the TPU data path (``host_pool=True``, what :func:`jax_tpusync.kv_cache` makes on the TPU
backend) each group is a :class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` instead: a pool
in ``pinned_host`` memory that the step carries, a bounded sliding group's pool a ring per
slot, no engine; over a mesh its KV heads split over ``kv_heads_axis``. The host-side
semantics are the same (:func:`group_cache_class` is where the class is chosen).

On a device mesh each group is a :class:`~jax_tpusync.ShardedKVCache`, its KV heads split
over the mesh. Prefix reuse works across the groups: a sliding group finds a cached
prefix's window among copies made as prompts were prefilled (:meth:`publish_windows`,
:mod:`jax_tpusync.core.window_prefix`); on a mesh each head shard of a sliding group copies and
publishes its own heads' windows. What a hybrid cache does not do (yet): persistence with
bounded windows (a ring overwrites committed rows) or on a mesh (refused by name).
:func:`jax_tpusync.kv_cache` makes a hybrid cache for every model whose layers differ (in
KV geometry, in sliding window, or reading another's KV).

What each group's cache is made with (its blocks, its share of the device budget, its
persistence names and prefix salt) is planned in :mod:`jax_tpusync.caches.hybrid.config`, before
anything is made; a persistent cache's record of its layers is :mod:`jax_tpusync.caches.hybrid.record`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_tpusync.caches.composite import PartsAdmission, PartsKVCache
from jax_tpusync.caches.hybrid.config import (
    DEFAULT_STEP_TOKENS,
    check_arguments,
    group_arguments,
)
from jax_tpusync.caches.hybrid.record import (
    LAYERS_SUFFIX,
    check_layers_record,
    put_back,
    write_layers_record,
)
from jax_tpusync.caches.offloaded import sparse_summaries
from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.caches.offloaded.mesh import ShardedKVCache
from jax_tpusync.caches.pool.cache import HostPoolKVCache
from jax_tpusync.caches.protocol import KVCache
from jax_tpusync.core.config import CacheConfig, is_int, normalize_windows, with_config
from jax_tpusync.core.hybrid_state import HybridState, LayerGroups, plan_groups
from jax_tpusync.core.state import KVState
from jax_tpusync.runtime.engine import Engine, EngineConfig

logger = logging.getLogger(__name__)


__all__ = [
    "DEFAULT_STEP_TOKENS",
    "LAYERS_SUFFIX",
    "HybridAdmission",
    "HybridKVCache",
    "group_cache_class",
]

# What a group's cache is: any KV cache (the class is chosen in group_cache_class).
GroupCache = KVCache
# What HybridKVCache.reserve makes: every group's reservation (the one admission type of
# a cache of parts).
HybridAdmission = PartsAdmission


def group_cache_class(*, host_pool: bool, mesh: Any) -> type:
    """The class of every group's cache: a host pool (the TPU data path,
    :class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache`, on one device or over ``mesh``'s
    ``kv_heads_axis``), else an engine cache (:class:`~jax_tpusync.OffloadedKVCache`, or
    :class:`~jax_tpusync.ShardedKVCache` on a mesh). The one place it is chosen."""
    if host_pool:
        return HostPoolKVCache
    return OffloadedKVCache if mesh is None else ShardedKVCache


class HybridKVCache(PartsKVCache):
    """A KV cache for a model whose layers differ in KV geometry (see the module).

    Takes the keywords below, or ``config=`` a :class:`~jax_tpusync.core.config.CacheConfig`
    (one KV geometry, per-layer ``sliding_window``; its ``max_step_tokens`` if given) and
    the keywords a CacheConfig does not hold (``kv_sharing``, ``bound_windows``,
    ``window_cache_blocks``, ``engine``, ``mesh``...); a keyword the config holds too is
    refused by name.

    Args:
      num_layers, batch, max_len: as :class:`~jax_tpusync.OffloadedKVCache`.
      num_kv_heads, head_dim: an int (every layer) or one per layer.
      sliding_window: None, an int, or one ``int | None`` per layer.
      kv_sharing: None, or per layer None (it stores its KV) or the index of an earlier
        layer of the same geometry and window whose KV it reads; such a layer calls
        ``prefetching_attention(q, None, None, state, layer=l)``.
      max_step_tokens: the most rows one step appends to a slot (1 for decode; the chunk of
        a chunked prefill). Sizes the sliding groups' rings and the rows kept for reading
        layers; a step of more rows is refused when traced. Default (None): 512
        (:data:`DEFAULT_STEP_TOKENS`), or ``max_len`` where that is smaller (no step
        appends more rows than a slot holds).
      bound_windows: a bool: sliding groups keep only their window (default True). Their
        cached prefixes are window copies, which ``shared_prefix_dir`` / ``remote_prefix``
        publish and import block by block. A persistent cache needs False.
      window_cache_blocks: blocks per bounded sliding group (per layer, K and V) beyond
        the slots' rings, for cached prefixes' windows (:meth:`publish_windows`); default
        one ring per slot (``batch`` rings: a window per slot's prompt). 0: none.
      engine: an :class:`Engine`, an :class:`EngineConfig` for a new one, or None (with
        ``host_pool``: None only).
      host_pool: a bool: every group is a
        :class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` (a pool in ``pinned_host``
        memory that the step carries and copies to the device by unit: the TPU data
        path; :func:`jax_tpusync.kv_cache` picks it on the TPU backend), on one device or
        its KV heads split over ``mesh``'s ``kv_heads_axis``; a bounded sliding group is a
        pool of rings, as an engine group is. Default False: engine caches. Persists as
        engine groups do (below). Not yet with ``batch_axis``.
      staging_bytes: the device budget, split over the groups: a sliding group takes what
        whole units of its window need, the global groups the rest, in proportion to the
        bytes one token of their layers takes.
      shm_name / file_name: persistence; each group persists under ``<name>.g<i>``, and a
        ``<name>.tpusync.layers.json`` beside it records every layer's geometry, which a
        re-attach compares layer by layer. A re-attach brings groups that a crash left at
        different commits to their common one (rows and token ids alike; a host-pool
        group restarts there before its first ``init()`` reads its tier). Not on a mesh.
        A refused construction leaves nothing on disk.
      **options: every other :class:`~jax_tpusync.OffloadedKVCache` argument (tier, path,
        dtype, tier_dtype, block_tokens, read_in_place, prefetch_depth, model_id, ...),
        given to every group.
    """

    def __init__(self, *, config: CacheConfig | None = None, **keywords: Any):
        self._build(**with_config(config, keywords))

    def _build(
        self,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int | Sequence[int],
        head_dim: int | Sequence[int],
        sliding_window: int | Sequence[int | None] | None = None,
        kv_sharing: Sequence[int | None] | None = None,
        max_step_tokens: int | None = None,
        bound_windows: bool = True,
        window_cache_blocks: int | None = None,
        engine: Engine | EngineConfig | None = None,
        staging_bytes: int = 256 << 20,
        shm_name: str | None = None,
        file_name: str | None = None,
        mesh: Any = None,
        kv_heads_axis: str | None = None,
        batch_axis: str | None = None,
        host_pool: bool = False,
        **options: Any,
    ) -> None:
        if max_step_tokens is None:  # The default fits the cache; a value given is checked.
            max_step_tokens = (
                min(DEFAULT_STEP_TOKENS, max_len) if is_int(max_len) else DEFAULT_STEP_TOKENS
            )
        # Every argument is checked, and every group's configuration planned, before
        # anything (engine, record, tier) is made: a refused cache changes nothing.
        self.dtype = check_arguments(
            num_layers=num_layers,
            batch=batch,
            max_len=max_len,
            max_step_tokens=max_step_tokens,
            bound_windows=bound_windows,
            window_cache_blocks=window_cache_blocks,
            staging_bytes=staging_bytes,
            engine=engine,
            shm_name=shm_name,
            file_name=file_name,
            mesh=mesh,
            kv_heads_axis=kv_heads_axis,
            batch_axis=batch_axis,
            options=options,
            host_pool=host_pool,
        )
        windows = normalize_windows(sliding_window, num_layers)
        self.plan: LayerGroups = plan_groups(
            num_layers, num_kv_heads, head_dim, windows, kv_sharing
        )
        self.batch = batch
        self.max_len = max_len
        self.max_step_tokens = int(max_step_tokens)
        self.mesh = mesh
        self.host_pool = bool(host_pool)
        self.parts: dict[int, GroupCache] = {}
        made = group_arguments(
            self.plan,
            batch=batch,
            max_len=max_len,
            max_step_tokens=self.max_step_tokens,
            bound_windows=bool(bound_windows),
            window_cache_blocks=window_cache_blocks,
            staging_bytes=staging_bytes,
            shm_name=shm_name,
            file_name=file_name,
            options=options,
            mesh=mesh,
            axes=(kv_heads_axis, batch_axis),
            host_pool=self.host_pool,
        )
        record = check_layers_record(self.plan, shm_name, file_name, options)
        group_cache = group_cache_class(host_pool=self.host_pool, mesh=mesh)
        # A host pool needs no engine: its bytes move in the step.
        self.engine: Engine | None = None
        self._owns_engine = not self.host_pool and not isinstance(engine, Engine)
        if not self.host_pool:
            self.engine = engine if isinstance(engine, Engine) else Engine(engine or EngineConfig())
        on_engine = {} if self.engine is None else {"engine": self.engine}
        undo: list = []  # What a failed construction puts back on disk.
        try:
            undo = write_layers_record(record, self.plan, shm_name, file_name, options)
            for i, kwargs in enumerate(made):
                self.parts[i] = group_cache(**on_engine, **kwargs)
            self._reconcile_commits()
        except Exception:
            self.close()
            put_back(undo)
            raise

    @property
    def groups(self) -> list[GroupCache]:
        """Every layer group's cache, in group order (the plan's)."""
        return list(self.parts.values())

    # -- the parts: layer groups, each holding every slot -----------------------------------

    part_noun = "layer groups"
    _log = logger

    def rows_of(self, key: int) -> slice:
        """The global slots layer group ``key`` holds: every slot."""
        return slice(0, self.batch)

    def _part_name(self, key: int) -> str:
        return f"layer group {key}"

    def _split(self, state, *, check=True, releasing=None) -> dict[int, KVState]:
        return dict(enumerate(self.split(state)))

    def _assemble(self, states: dict[int, KVState], state=None) -> HybridState:
        return self._state(list(states.values()), None if state is None else state.pending)

    def _reserve_order(self, keys: list) -> list:
        """Groups that keep every position reserve first, and a group that keeps only its
        window looks for no longer prefix than they all map (the prefix every group maps
        is the shortest one anyway, and a window's search asks its levels about every
        block it considers)."""
        return sorted(keys, key=lambda i: bool(self.parts[i].spec.ring_blocks))

    def _search_cap(self, key: int, cap: int | None, found: list[int]) -> int | None:
        if self.parts[key].spec.ring_blocks and found:
            return min(found) if cap is None else min(cap, *found)
        return cap

    def _close_own(self) -> None:
        if self._owns_engine and self.engine is not None and not self.engine.closed:
            self.engine.close()

    # -- state ------------------------------------------------------------------------------

    def _state(self, parts: Sequence[KVState], pending=None) -> HybridState:
        if pending is None:
            pending = []
            for source in self.plan.sources:
                g = self.plan.group(source)
                rows = jnp.zeros(
                    (2, self.batch, self.max_step_tokens, g.num_kv_heads, g.head_dim), self.dtype
                )
                if self.mesh is not None:  # Split as the step's k/v are: slots, KV heads.
                    layout = self.groups[0].spec.mesh
                    spec = PartitionSpec(None, layout.batch_axis, None, layout.kv_heads_axis)
                    rows = jax.device_put(rows, NamedSharding(self.mesh, spec))
                elif self.host_pool:
                    # On the device the pool's state is placed on, as the step returns it
                    # (placed elsewhere, the step would compile again for its own output).
                    rows = jax.device_put(rows, parts[0].lengths.sharding)
                pending.append(rows)
        # A buffer of its own: the state is donated, and one buffer cannot be donated twice.
        step_lengths = jnp.array(parts[0].lengths, jnp.int32, copy=True)
        return HybridState(self.plan, parts, step_lengths, pending)

    def split(self, state: HybridState) -> list[KVState]:
        """Every group's state of ``state`` (refusing one of another cache)."""
        if not isinstance(state, HybridState) or state.plan != self.plan:
            raise ValueError(f"expected a HybridState of this cache; got {type(state).__name__}")
        return list(state.groups)

    def sparse_stats(self, state: HybridState) -> dict:
        """The sparse groups' :meth:`OffloadedKVCache.sparse_stats` (their layers the
        model's: ``layers`` has a row per model layer that stores its KV, ``sparse`` False
        for a sliding layer, which reads its window densely), summed over the groups.

        Raises:
          ValueError: no group is sparse (the cache was made without ``sparse=``), or
            ``state`` is not this cache's.
        """
        parts = self.split(state)
        per_group = [
            (group, self.parts[i].sparse_stats(part))
            for i, (group, part) in enumerate(zip(self.plan.groups, parts))
            if getattr(self.parts[i].shard_spec, "sparse", None) is not None
        ]
        if not per_group:
            raise ValueError("sparse_stats() needs a sparse cache (made with sparse=...)")
        zero = {name: 0 for name in ("predicted", "hits", "late", "wasted", "context_blocks")}
        no_bytes = dict.fromkeys(per_group[0][1]["layers"][0]["bytes"], 0)
        layers = {  # A dense group's layers (sliding ones): nothing selected, nothing counted.
            layer: dict(zero, sparse=False, hit_rate=None, bytes=dict(no_bytes), layer=layer)
            for group in self.plan.groups
            for layer in group.layers
        }
        for group, stats in per_group:
            for layer, row in zip(group.layers, stats["layers"]):
                layers[layer] = dict(row, layer=layer)
        combined = sparse_summaries.combined_stats([stats for _, stats in per_group])
        combined["layers"] = [layers[layer] for layer in sorted(layers)]
        return combined

    def recover(self) -> HybridState:
        """The live state after a failed step (see :meth:`OffloadedKVCache.recover`); the
        groups' lengths are brought to their common ones (a step that failed after some
        groups' last layers added its tokens to those only)."""
        parts = [g.recover() for g in self.groups]
        lengths = np.minimum.reduce([np.asarray(p.lengths) for p in parts])
        if any((np.asarray(p.lengths) != lengths).any() for p in parts):
            parts = [g.init(lengths, admit=False) for g in self.groups]
        return self._state(parts)

    # -- host-side rows: a layer's group ----------------------------------------------------

    def _stored(self, layer: Any, what: str) -> tuple[int, int]:
        """``(group, layer there)`` of ``layer``'s stored KV (its source's, for a reading
        layer; a load of a reading layer is refused)."""
        if not is_int(layer) or not 0 <= layer < self.plan.num_layers:
            raise ValueError(
                f"layer={layer!r} is out of range for a cache of {self.plan.num_layers} layers"
            )
        source = self.plan.source_of[layer]
        if source is not None and what == "load":
            raise ValueError(
                f"layer {layer} reads layer {source}'s KV (kv_sharing) and stores none: load "
                f"layer {source}"
            )
        return self.plan.group_of[layer], self.plan.local_of[layer]

    def _load_shares(self, layer, k, v, start, lengths, slot) -> dict:
        """The layer's group loads it whole (a sliding group that keeps only its window
        writes the rows the window keeps)."""
        group, local = self._stored(layer, "load")
        return {group: dict(layer=local, k=k, v=v, start=start, lengths=lengths, slot=slot)}

    def _read_parts(self, layer: Any, slot: Any) -> list[tuple[int, int, int]]:
        group, local = self._stored(layer, "read")
        return [(group, local, slot)]

    @property
    def device_bytes(self) -> int:
        """Device memory of every group's staging (every device's, on a mesh)."""
        return self.all_device_bytes


def describe_bytes(cache: HybridKVCache) -> dict:
    """Per group: its layers, geometry and tier bytes (for benchmarks and logs)."""
    return {
        f"group {i}": {
            "layers": list(group.layers),
            "geometry": group.describe(),
            "kv_bytes": cache.groups[i].kv_bytes,
            "ring_blocks": cache.groups[i].spec.ring_blocks,
        }
        for i, group in enumerate(cache.plan.groups)
    }
