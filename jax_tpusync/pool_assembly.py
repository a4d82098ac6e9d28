"""How a host-pool cache is put together: its arguments checked (what the host-pool path
does not do yet is refused by name, with why) and the prefix levels it opens.

:class:`~jax_tpusync.pool_cache.HostPoolKVCache` calls these before it opens anything
else, so a refused construction leaves nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jax_tpusync.config import CacheConfig
from jax_tpusync.host_pool import POOL_MEMORY_KIND, pool_sharding
from jax_tpusync.levels import SharedDirectoryLevel
from jax_tpusync.mesh_layout import MeshLayout, checked_layout
from jax_tpusync.mooncake_level import make_level

# Keywords of CacheConfig a host-pool cache takes at their defaults only, with why.
# (``tier="file"`` and ``path`` are taken with ``file_name`` alone: the file is the pool's
# persistent copy.)
NOT_YET = {
    "resident": (False, "a resident cache needs no pool"),
    "read_in_place": ("auto", "the pool is always copied to the device by unit"),
    "debug_poison": (False, "poisoned fetches are an engine feature"),
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
    """The cache's config from its keywords (:func:`~jax_tpusync.config.with_config`'s
    merge of ``config=`` and the keywords) and where its pools go.

    Raises:
      ValueError, TypeError: a keyword the host-pool path does not take yet (named with
        why), or a placement that does not hold together.
    """
    for name, (default, why) in NOT_YET.items():
        if name in options and options[name] != default:
            raise ValueError(f"{name}={options[name]!r}: {why} (host-pool cache)")
    if options.get("tier", "host") != "host" and options.get("file_name") is None:
        raise ValueError(
            f"tier={options['tier']!r} without file_name: the pool is host memory; a "
            f"file tier only holds its persistent copy (pass file_name=) (host-pool cache)"
        )
    config = CacheConfig.from_kwargs(**options)
    config.geometry.check_one_cache()  # A ring needs every layer to share one window.
    if config.two_level:
        check_spill(config, options, mesh)
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
    (see :mod:`jax_tpusync.pool_spill`). (Persistence with it is refused by the config, as
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
