"""How a host-pool cache is put together: its arguments checked (what the host-pool path
does not do yet is refused by name, with why), its spec (the units a device stages) and
prefix salt, the prefix levels it opens, and the parts it opens in order
(:func:`open_pool`: block store, slot table, persistent tier, pending imports, spill tier).

:class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache` checks its arguments before it opens
anything, and :func:`open_pool` closes what it opened if a later part fails, so a refused
construction leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_tpusync.caches.pool.blocks import PoolBlocks
from jax_tpusync.caches.pool.imports import PendingImports
from jax_tpusync.caches.pool.persistence import PoolTier
from jax_tpusync.caches.pool.spill import PoolSpillTier
from jax_tpusync.caches.pool.windows import WindowCopyStore
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.levels import SharedDirectoryLevel
from jax_tpusync.core.mesh_layout import MeshLayout, checked_layout
from jax_tpusync.core.pool_state import (
    POOL_MEMORY_KIND,
    PoolLayout,
    pool_dtype,
    pool_sharding,
    unit_block_limit,
    unit_slots,
)
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.mooncake.level import make_level
from jax_tpusync.persist.commit import Persistence

logger = logging.getLogger(__name__)

# Keywords of CacheConfig a host-pool cache takes at their defaults only, with why.
# (``tier="file"`` and ``path`` are taken with ``file_name`` alone: the file is the pool's
# persistent copy.)
NOT_YET = {
    "resident": (False, "a resident cache needs no pool"),
    "read_in_place": ("auto", "the pool is always copied to the device by unit"),
    "debug_poison": (False, "poisoned fetches are an engine feature"),
}

# Keywords the other caches (OffloadedKVCache, ShardedKVCache, kv_cache) take beyond
# CacheConfig's, taken here at their defaults only (and dropped), with why.
OTHER_CACHES_ONLY = {
    "engine": (None, "the host pool moves its bytes in the compiled step, with no engine"),
    "shard": (0, "a host pool over a mesh splits itself (mesh=, kv_heads_axis=)"),
    "kv_sharing": (
        None,
        "layers that read another's KV need a hybrid cache "
        "(jax_tpusync.kv_cache(..., kv_sharing=) or HybridKVCache(host_pool=True))",
    ),
    "bound_windows": (
        None,
        "it chooses which cache jax_tpusync.kv_cache() makes; a host pool bounds its "
        "sliding windows with max_step_tokens=",
    ),
    "window_cache_blocks": (
        None,
        "a hybrid cache's spare blocks per sliding group "
        "(jax_tpusync.kv_cache(..., window_cache_blocks=) or HybridKVCache(host_pool=True))",
    ),
}


@dataclass(frozen=True)
class Placement:
    """Where a host-pool cache's pools live: one ``device``, or a ``mesh`` of them (the
    heads split over its ``kv_heads_axis``); ``device_kind`` names the chip."""

    device: jax.Device | None
    mesh: MeshLayout | None
    device_kind: str

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        """Where the state's small leaves and its staging live."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh.mesh, self.mesh.state_spec)

    @property
    def pool_sharding(self) -> jax.sharding.Sharding:
        """Where the pool lives: the devices' host memory."""
        if self.mesh is None:
            return pool_sharding(self.device)
        return NamedSharding(self.mesh.mesh, self.mesh.state_spec, memory_kind=POOL_MEMORY_KIND)


def checked_config(
    options: dict[str, Any],
    *,
    device: jax.Device | None,
    mesh: Mesh | None,
    kv_heads_axis: str | None,
    batch_axis: str | None,
) -> tuple[CacheConfig, Placement]:
    """The cache's config from its keywords (:func:`~jax_tpusync.core.config.with_config`'s
    merge of ``config=`` and the keywords) and where its pools go.

    Raises:
      ValueError, TypeError: a keyword the host-pool path does not take yet (named with
        why), or a placement that does not hold together.
    """
    for name, (default, why) in NOT_YET.items():
        if name in options and options[name] != default:
            raise ValueError(f"{name}={options[name]!r}: {why} (host-pool cache)")
    for name, (default, why) in OTHER_CACHES_ONLY.items():
        # None or 0 (not False, nor an array compared element by element) is the default.
        value = options.get(name, default)
        if value is not default and not (type(value) is type(default) and value == default):
            raise ValueError(f"{name}={value!r}: {why} (host-pool cache)")
    options = {k: v for k, v in options.items() if k not in OTHER_CACHES_ONLY}
    if options.get("tier", "host") != "host" and options.get("file_name") is None:
        raise ValueError(
            f"tier={options['tier']!r} without file_name: the pool is host memory; a "
            f"file tier only holds its persistent copy (pass file_name=) (host-pool cache)"
        )
    config = CacheConfig.from_kwargs(**options)
    config.geometry.check_one_cache()  # A ring needs every layer to share one window.
    if config.two_level:
        check_spill(config, options, mesh)
    if config.sparse is not None:
        check_sparse(config)
    if mesh is None:
        if kv_heads_axis is not None or batch_axis is not None:
            raise ValueError("kv_heads_axis and batch_axis need mesh= (host-pool cache)")
        if device is None:
            device = jax.devices()[0]
        if not isinstance(device, jax.Device):
            raise TypeError(f"device must be a jax.Device; got {type(device).__name__}")
        return config, Placement(device, None, device.device_kind)
    if device is not None:
        raise ValueError(
            "device= and mesh= both given: a mesh cache's pools are on the mesh's "
            "devices (host-pool cache)"
        )
    mesh_layout = checked_layout(mesh, kv_heads_axis, batch_axis)
    if mesh_layout.dp > 1:  # One slot table per batch shard: a cache of such pools.
        raise ValueError(
            f"batch_axis={batch_axis!r} of {mesh_layout.dp} devices: a HostPoolKVCache "
            f"holds one slot table; slots split over devices are a BatchShardedPoolKVCache "
            f"(or jax_tpusync.kv_cache(..., batch_axis=)) (host-pool cache)"
        )
    return config, Placement(None, mesh_layout, mesh.devices.flat[0].device_kind)


def check_spill(config: CacheConfig, options: dict[str, Any], mesh: Mesh | None) -> None:
    """Refuses, by name, what a host pool's spill tier (``spill_path``) does not go with
    (see :mod:`jax_tpusync.caches.pool.spill`). (Persistence with it is refused by the config, as
    on the engine cache.)"""
    path = config.tier.spill_path
    if mesh is not None:
        raise ValueError(
            f"spill_path={path!r} with mesh=: spill_path (a two-level cache) is not "
            f"supported on a mesh yet, as on the engine cache; drop one of them (host-pool "
            f"cache)"
        )
    if config.geometry.bounds_windows:
        raise ValueError(
            f"spill_path={path!r} with max_step_tokens={config.geometry.step_tokens}: a pool "
            f"that keeps only each slot's sliding window caches windows host-side, never "
            f"prefix blocks, so nothing would spill; drop one of them (host-pool cache)"
        )
    promote_after = options.get("promote_after", 2)
    if promote_after != 2:
        raise ValueError(
            f"promote_after={promote_after!r}: a host pool promotes every spill block at "
            f"the admission that maps it (its step reads only the pool); leave "
            f"promote_after out (host-pool cache)"
        )


def check_sparse(config: CacheConfig) -> None:
    """Refuses, by name, what a host pool's sparse decode (``sparse=``; see
    :mod:`jax_tpusync.step.pool_sparse`) does not go with yet. (Over a mesh each head
    shard selects its own blocks; a spill tier there is refused by :func:`check_spill`.)"""
    sparse = config.sparse
    if config.two_level:
        raise ValueError(
            f"sparse={sparse!r} with spill_path={config.tier.spill_path!r}: a spill tier's "
            f"promoted blocks would need their summaries carried through the spill file; "
            f"not supported yet, drop one of them (host-pool cache)"
        )
    depth = config.staging.prefetch_depth
    if not isinstance(depth, str) and int(depth) > 1:
        raise ValueError(
            f"sparse={sparse!r} with prefetch_depth={depth}: a sparse layer walks its "
            f"predicted blocks one unit ahead (the units further ahead are not known before "
            f"the query); use prefetch_depth=1 or 'auto' (host-pool cache)"
        )


def open_levels(config: CacheConfig, **level_layout: Any) -> tuple[list[Any], list[Any]]:
    """The prefix levels ``config`` names, opened with ``level_layout`` (root,
    num_layers, block_tokens, block_bytes): ``(levels, owned)``, ``owned`` those opened
    here that the cache closes (a level object the caller passed stays the caller's)."""
    levels: list[Any] = []
    owned: list[Any] = []
    if config.prefix.shared_dir is not None:
        levels.append(SharedDirectoryLevel(config.prefix.shared_dir, **level_layout))
    if config.prefix.remote is not None:
        levels.append(make_level(config.prefix.remote, **level_layout))
        if levels[-1] is not config.prefix.remote:  # Made here (an address, a factory).
            owned.append(levels[-1])
    return levels, owned


# Salts the prefix index's root key: blocks of this layout are this layout's alone.
POOL_LAYOUT_VERSION = 1


def pool_prefix_layout(config: CacheConfig, shards: int) -> int:
    """The layout number a host pool's prefix root is salted with: blocks are published
    with every head's rows joined (:class:`~jax_tpusync.caches.pool.blocks.PoolBlocks`), the same
    bytes on one device and over a mesh, except quantized rows over several devices
    (each device's codes and scales, not one row's), which are keyed apart by their
    device count."""
    if shards > 1 and config.geometry.quantized:
        return POOL_LAYOUT_VERSION * 1000 + shards
    return POOL_LAYOUT_VERSION


def pool_spec(
    config: CacheConfig, mesh: MeshLayout | None = None, device_kind: str = ""
) -> CacheSpec:
    """The :class:`CacheSpec` of a host-pool cache: units of whole blocks,
    ``prefetch_depth + 1`` of them on the device at a time (those staged ahead and the one
    in flight) within ``staging_bytes`` (per device), and at most as many blocks as the
    device's compiler overlaps copies of a unit's group of slots
    (:func:`~jax_tpusync.core.pool_state.unit_block_limit` and
    :func:`~jax_tpusync.core.pool_state.unit_slots` of ``device_kind`` and the batch;
    above 16 slots on a TPU the spec's ``unit_slots`` names the group).
    ``prefetch_depth="auto"`` is 1, and a depth above ``num_layers`` is ``num_layers``
    (every layer has a unit at least, and further ahead lies the step after next). Over a
    mesh the spec describes one shard: the heads of one device of ``kv_heads_axis``."""
    g, staging = config.geometry, config.staging
    shards = 1 if mesh is None else mesh.tp
    if g.num_kv_heads % shards:
        raise ValueError(
            f"num_kv_heads={g.num_kv_heads} must be a multiple of the {shards} devices of "
            f"kv_heads_axis={mesh.kv_heads_axis!r}"
        )
    # "auto": 1, since one unit's copy overlaps each attention at any depth (see
    # jax_tpusync.step.host_pool); StagingConfig checked an int's range.
    depth = staging.prefetch_depth
    depth = 1 if isinstance(depth, str) else min(int(depth), g.num_layers)
    num_slots = depth + 1
    probe = CacheSpec(
        **{**g.spec_fields(), "num_kv_heads": g.num_kv_heads // shards},
        chunk_len=g.block_tokens,
        num_slots=num_slots,
        prefetch_depth=depth,
        prefetch_across_steps=staging.prefetch_across_steps,
        staging_dtype=pool_dtype(g.dtype, g.quantized),
    )
    layout = PoolLayout(probe)
    row_bytes = layout.row_width * layout.dtype.itemsize
    unit_block_bytes = num_slots * g.batch * g.block_tokens * row_bytes
    units = staging.staging_bytes // unit_block_bytes
    if units < 1:
        raise ValueError(
            f"staging_bytes={staging.staging_bytes} cannot hold {num_slots} units of one "
            f"block (prefetch_depth={depth} ahead and the one in flight): {num_slots} x "
            f"batch {g.batch} x block_tokens {g.block_tokens} x {row_bytes} bytes per "
            f"token row (K and V) = {unit_block_bytes} bytes at least"
        )
    longest = max(probe.layer_span(w) for w in probe.windows)
    needed = -(-longest // g.block_tokens) + 1  # A window's span may straddle one more block.
    limit = unit_block_limit(device_kind, g.batch)
    chunk_len = min(units, needed, limit) * g.block_tokens
    slots = unit_slots(device_kind, g.batch)
    return dataclasses.replace(
        probe, chunk_len=chunk_len, mesh=mesh, unit_slots=0 if slots == g.batch else slots
    )


@dataclass
class OpenedPool:
    """The parts :func:`open_pool` opened for a host-pool cache.

    Attributes:
      blocks: the pool's block store (what prefix levels import into and publish from).
      windows: a pool of rings' cached windows, held host-side (None: the pool keeps every
        position; see :mod:`jax_tpusync.caches.pool.windows`).
      slots: the slot table.
      owned_levels: the network levels opened here, which the cache closes.
      tier: the pool's persistent copy (None: not persistent).
      restored_lengths: the lengths of the commit the tier re-attached (None: none).
      imports: what reservations wrote (prefix imports, ring fills) until a pool holds it.
      spill: cached prefix blocks the pool has no room for (None: they are evicted).
    """

    blocks: PoolBlocks
    windows: WindowCopyStore | None
    slots: SlotTable
    owned_levels: list[Any]
    tier: PoolTier | None
    restored_lengths: np.ndarray | None
    imports: PendingImports
    spill: PoolSpillTier | None


def open_pool(
    config: CacheConfig,
    spec: CacheSpec,
    layout: PoolLayout,
    mesh: MeshLayout | None,
    persistence: Persistence | None,
) -> OpenedPool:
    """Opens a host-pool cache's parts, in the order each needs the ones before: the block
    store, the prefix levels, the slot table over them, the persistent tier (re-attaching
    its last commit), the pending imports and the spill tier. If one fails, the levels and
    tier opened here are closed and the error raised."""
    g = config.geometry
    shards = 1 if mesh is None else mesh.tp
    root = config.prefix_root(pool_prefix_layout(config, shards))
    blocks = PoolBlocks(layout, mesh)
    remote, owned = open_levels(
        config,
        root=root,
        num_layers=g.num_layers,
        block_tokens=g.block_tokens,
        block_bytes=blocks.half_block_bytes,
    )
    p = persistence
    ring_blocks = spec.ring_blocks
    windows = WindowCopyStore(blocks) if ring_blocks else None
    slots = SlotTable(
        batch=g.batch,
        max_len=g.max_len,
        block_tokens=g.block_tokens,
        num_blocks=g.num_blocks,
        root=root,
        spill_blocks=config.spill_blocks,
        store=blocks if windows is None else windows,
        remote_levels=remote,
        before_reuse=None if p is None else p.note_evicted,
        before_release=None if p is None else p.note_release,
        ring_blocks=ring_blocks,
        window=spec.windows[0] if ring_blocks else None,
    )
    if windows is not None:
        windows.index = slots.windows
    tier: PoolTier | None = None
    try:
        restored = None
        if p is not None:
            tier = PoolTier.open(config, layout, slots, mesh)
            restored = p.attach(
                tier.persisted_kv(), attached=tier.attached, verify=config.persistence.verify
            )
        imports = PendingImports(
            blocks, windows, imported=None if tier is None else tier.write_payloads
        )
        spill = None
        if config.two_level:
            spill = PoolSpillTier.open(
                config.tier.spill_path,
                config.spill_blocks,
                layout,
                blocks,
                slots.allocators,
                pending=(imports.payloads_of, imports.forget),
            )
            slots.use_mover(spill)
    except Exception:
        if tier is not None:
            tier.close()
        close_levels(owned)
        raise
    return OpenedPool(blocks, windows, slots, owned, tier, restored, imports, spill)


def close_levels(levels: list[Any]) -> None:
    """Closes the network levels a cache opened; a level that fails to close is logged."""
    for level in levels:
        try:
            level.close()
        except Exception as e:  # noqa: BLE001 - closing must not raise.
            logger.warning("closing %s failed: %s", level.describe(), e)
