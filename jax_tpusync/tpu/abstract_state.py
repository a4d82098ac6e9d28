"""A host-pool cache's state as shapes (:class:`jax.ShapeDtypeStruct`), placed on a TPU
topology's devices: what a step is traced and compiled with when nothing is allocated (the
pool of a 1M-token context is gigabytes of host memory)."""

from __future__ import annotations

from typing import Any

from jax_tpusync.caches.pool.assembly import pool_spec
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.hybrid_state import HybridState, LayerGroups
from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_state import PoolLayout, PoolState

__all__ = ["abstract_hybrid_state", "abstract_pool_state"]


def abstract_pool_state(
    config: CacheConfig, devices: list, layout: MeshLayout | None = None
) -> tuple[PoolState, Any]:
    """(state, replicated sharding): a host-pool cache's :class:`PoolState` of ``config`` as
    shapes, on the first of ``devices`` or over ``layout``'s mesh (a leading axis of ``dp *
    tp`` shards, each device's pool in its host memory; ``config`` one batch shard's, its
    ``batch`` the slots of one), and where the step's other inputs go. The units are the
    ones the cache makes for these devices (:func:`~jax_tpusync.caches.pool.assembly.pool_spec`
    of their device kind); a cache made with ``sparse=`` carries its
    :class:`~jax_tpusync.core.pool_sparse.PoolSparseState` (the block summaries in host
    memory)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    if layout is not None:
        spec = pool_spec(config, layout, devices[0].device_kind)
        on_device = NamedSharding(layout.mesh, P())
        state_on = NamedSharding(layout.mesh, layout.state_spec)
        on_host = NamedSharding(layout.mesh, layout.state_spec, memory_kind="pinned_host")
        lead: tuple[int, ...] = (layout.num_shards,)  # A mesh state's leading axis of shards.
    else:
        spec = pool_spec(config, device_kind=devices[0].device_kind)
        on_device = state_on = SingleDeviceSharding(devices[0])
        on_host = SingleDeviceSharding(devices[0], memory_kind="pinned_host")
        lead = ()
    pool = PoolLayout(spec)

    def sds(dims, dtype, sharding=state_on):
        return jax.ShapeDtypeStruct((*lead, *dims), dtype, sharding=sharding)

    b = spec.batch

    def staged():
        return (
            sds(pool.staging_shape, pool.dtype),
            sds(pool.tail_shape, pool.dtype),
            sds(pool.staged_at_shape, jnp.int32),
        )

    sparse = None
    if config.sparse is not None:  # Its summaries in host memory, beside the pool.
        from jax_tpusync.core.pool_sparse import PoolSparseState, SummaryLayout

        summary = SummaryLayout(spec)
        sparse = PoolSparseState(
            config.sparse,
            sds(summary.shape, summary.dtype, on_host),
            sds(PoolSparseState.previous_shape(config.sparse, spec), jnp.int32),
            sds(PoolSparseState.counts_shape(spec), jnp.int32),
            sds(PoolSparseState.staged_chunk_shape(spec), summary.dtype),
            sds((), jnp.int32),
        )
    state = PoolState(
        spec,
        sds((b,), jnp.int32),
        sds((b, spec.max_blocks), jnp.int32),
        sds((b,), jnp.int32),
        sds(pool.pool_shape, pool.dtype, on_host),
        *staged(),
        sds((b,), jnp.int32),
        sds((), jnp.int32),
        ahead=tuple(staged() for _ in range(spec.prefetch_depth - 1)),
        sparse=sparse,
    )
    return state, on_device


def abstract_hybrid_state(
    plan: LayerGroups,
    configs: list[CacheConfig],
    max_step_tokens: int,
    dtype: Any,
    device,
) -> tuple[HybridState, Any]:
    """(state, sharding): a hybrid cache of host-pool groups
    (``HybridKVCache(host_pool=True)``) as shapes on ``device``: one :func:`abstract_pool_state`
    per group of ``plan`` (``configs``: each group's, as
    :func:`~jax_tpusync.caches.hybrid.config.host_pool_groups` plans them), the step's
    starting lengths and, per layer another reads, its ``max_step_tokens`` new rows."""
    import jax
    import jax.numpy as jnp

    parts = [abstract_pool_state(config, [device])[0] for config in configs]
    on_device = jax.sharding.SingleDeviceSharding(device)
    batch = parts[0].spec.batch
    pending = [
        jax.ShapeDtypeStruct(
            (2, batch, max_step_tokens, plan.group(s).num_kv_heads, plan.group(s).head_dim),
            dtype,
            sharding=on_device,
        )
        for s in plan.sources
    ]
    step_lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=on_device)
    return HybridState(plan, parts, step_lengths, pending), on_device
