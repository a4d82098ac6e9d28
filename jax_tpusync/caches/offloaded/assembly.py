"""Building an offloaded cache: its arguments checked, its engine, and the parts it opens.

:class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache` is assembled from parts that each live in
their own module (prefix levels, tier blocks, the slot table, a spill mover, row I/O).
What is kept here is the order they are made in, which is what makes a refused cache
leave nothing behind: every argument is checked before an engine, tier or file is made,
and everything that can fail for a reason of its own comes before the tier is opened.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core.config import CacheConfig, with_config
from jax_tpusync.core.host_io import HostRows
from jax_tpusync.core.levels import InPlaceRemoteLevel, SharedDirectoryLevel, TierBlocks
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.core.spill import SpillTier
from jax_tpusync.core.state import CacheSpec, staging_shape_of
from jax_tpusync.mooncake.level import make_level
from jax_tpusync.persist import commit as persistence
from jax_tpusync.persist.persisted_kv import PersistedKV, TierReader
from jax_tpusync.runtime import backend
from jax_tpusync.runtime.engine import Engine, EngineConfig

__all__ = ["OpenedTier", "checked_config", "engine_for", "open_tier", "persisted_kv_of"]


def checked_config(
    config: CacheConfig | None,
    options: dict[str, Any],
    *,
    engine: Any,
    mesh: Any,
    kv_heads_axis: str | None,
    batch_axis: str | None,
) -> CacheConfig:
    """The one-device cache's configuration, every argument checked (nothing is made).

    Raises:
      TypeError: a mesh (a mesh cache is another class), or ``engine`` of another type.
      ValueError: an argument out of its range; mesh axes without a mesh; a backend that
        does not run the engine's in-graph ops; ``debug_poison`` with an engine made
        without poisoned fetches.
    """
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
    config = CacheConfig.from_kwargs(**with_config(config, options))
    config.geometry.check_one_cache()
    if config.sparse is not None:
        refuse_sparse_combinations(config)
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
    if isinstance(engine, Engine) and config.staging.debug_poison:
        if not engine.config.poison_fetches:
            raise ValueError("debug_poison needs an engine made with poison_fetches=True")
    return config


def refuse_sparse_combinations(config: CacheConfig) -> None:
    """Refuses, by name, what a sparse engine cache does not run (yet)."""
    if config.staging.resident is True:
        raise ValueError(
            "sparse= with resident=True: a resident cache keeps every layer's KV on the "
            "device and reads it whole; drop resident= (sparse decode reads the selected "
            "blocks from the tier)"
        )
    if config.two_level:
        raise ValueError(
            "sparse= with spill_path: sparse decode does not run on a two-level cache yet "
            "(its spill moves blocks between tiers, and their summaries with them); drop "
            "one of them"
        )


def engine_for(engine: Engine | EngineConfig | None, config: CacheConfig) -> tuple[Engine, bool]:
    """``(the engine, whether the cache made it)``: ``engine`` itself, or a new one of its
    config (the default one for None), fetches poisoned where ``debug_poison`` asks."""
    if isinstance(engine, Engine):
        return engine, False
    engine_config = engine or EngineConfig()
    if config.staging.debug_poison and not engine_config.poison_fetches:
        engine_config = dataclasses.replace(engine_config, poison_fetches=True)
    return Engine(engine_config), True


@dataclasses.dataclass
class OpenedTier:
    """The parts of one cache that :func:`open_tier` made.

    Attributes:
      store: the cache's tier allocation (and spill tier).
      slots: block tables, allocators, the prefix index.
      rows: host-side row reads and writes through the tables.
      target: int64[6], what the state's ``target`` carries (see :class:`KVState`).
      first_staging: the first state's staging when the tier's data is aligned to it
        (None: made when needed).
      owned_levels: network prefix levels the cache made (and closes).
    """

    store: TierBlocks
    slots: SlotTable
    rows: HostRows
    target: np.ndarray
    first_staging: jax.Array | None
    owned_levels: list[Any]


def new_staging(spec: CacheSpec) -> jax.Array:
    """Zeroed staging of ``spec``: [num_slots, ...] units as the state carries them."""
    shape = staging_shape_of(spec.num_slots, spec.batch, spec.chunk_len, spec.row_shape)
    return jnp.zeros(shape, spec.staging_dtype)


def open_tier(
    engine: Engine,
    config: CacheConfig,
    spec: CacheSpec,
    persisted: persistence.Persistence | None,
    shard: int,
) -> OpenedTier:
    """Opens the tier(s), allocates the blocks and builds the slot table (with its prefix
    levels and spill mover) and the row I/O of one cache; ``persisted`` (None: not
    persistent) is told of evictions and releases."""
    g = config.geometry
    # Everything that can fail for a reason of its own comes before the tier is
    # opened, so that a refused cache leaves no tier file behind.
    root = config.prefix_root(persistence.LAYOUT_VERSION)
    level_layout = dict(
        root=root,
        num_layers=g.num_layers,
        block_tokens=g.block_tokens,
        block_bytes=spec.block_bytes,
    )
    remote = []
    if config.prefix.shared_dir is not None:
        remote.append(SharedDirectoryLevel(config.prefix.shared_dir, **level_layout))
    owned_levels: list[Any] = []
    if config.prefix.remote is not None:
        remote.append(make_level(config.prefix.remote, **level_layout))
        if remote[-1] is not config.prefix.remote:  # Made here (an address, a factory).
            owned_levels.append(remote[-1])
    # A file tier's first staging buffer is made now: its data is shifted to that
    # buffer's offset within a page, so fetches into it skip the bounce buffer.
    # (A state read in place has no staging: its units stay in engine memory.)
    first_staging = None
    if (config.tier.kind == "file" or spec.spill_blocks) and not (
        spec.resident or spec.reads_in_place
    ):
        first_staging = new_staging(spec)
    store = TierBlocks.open(engine, config, spec, first_staging)
    if store.memory is not None:  # Levels that can read blocks into it, in place.
        pool = store.memory
        for level in remote:
            if isinstance(level, InPlaceRemoteLevel):
                level.use_memory(pool.ctypes.data, pool.nbytes)
    target = np.asarray([engine.id, *store.target(shard)], np.int64)
    slots = SlotTable(
        batch=g.batch,
        max_len=g.max_len,
        block_tokens=g.block_tokens,
        num_blocks=g.num_blocks,
        root=root,
        spill_blocks=spec.spill_blocks,
        store=store,
        remote_levels=remote,
        before_reuse=None if persisted is None else persisted.note_evicted,
        before_release=None if persisted is None else persisted.note_release,
        ring_blocks=spec.ring_blocks,
        window=spec.windows[0] if spec.ring_blocks else None,
    )
    if spec.spill_blocks:
        mover = SpillTier(
            engine,
            dram_tier=store.tier,
            spill_tier=store.spill_tier,
            dram_first=store.first_block,
            spill_first=store.spill_first,
            allocators=slots.allocators,
            regions=g.num_layers * 2,
            block_bytes=spec.block_bytes,
            promote_after=config.tier.promote_after,
        )
        slots.use_mover(mover)
        store.spill = mover
    rows = HostRows(spec, engine, store, slots)
    return OpenedTier(store, slots, rows, target, first_staging, owned_levels)


def persisted_kv_of(engine: Engine, spec: CacheSpec, opened: OpenedTier) -> PersistedKV:
    """What the commit protocol reads and writes of an opened cache (and nothing more)."""
    slots, store = opened.slots, opened.store
    reader = TierReader(
        engine=engine, tier=store.tier, first_block=store.first_block, rows=opened.rows.tier_rows
    )
    return PersistedKV.of_slots(spec, reader, engine.drain, slots)
