"""The step of a mesh cache: one device's step per shard, inside ``shard_map``.

:func:`sharded_attention` runs the single-device step of each shard in ``shard_map``
(q/k/v split ``P(batch_axis, None, kv_heads_axis, None)``: with GQA a KV head's query heads
move with it; inputs sharded otherwise are resharded first). Inside the caller's own
``shard_map`` over the cache's axes it runs the device's shard directly. The device's shard
comes from ``lax.axis_index``, and every write-back leads with a guard row
(:func:`jax_tpusync.runtime.ops.shard_guard`) that refuses, before any byte moves, a state that is
another shard's. :func:`refuse_unsharded_cache` refuses the converse: a cache built without
a mesh used where several devices would each run its transfers.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.state import KVState
from jax_tpusync.runtime import ops
from jax_tpusync.step import device, plan


def _manual_axes() -> tuple[str, ...]:
    """The mesh axes of the enclosing ``shard_map`` (none outside one)."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def refuse_unsharded_cache(*xs: jax.Array) -> None:
    """Refuses, at trace time, a cache built without ``mesh=`` used where several devices
    would each run its transfers: inside a ``shard_map`` over axes of more than one device,
    under a mesh context (``jax.set_mesh``) of several devices, or on inputs that an
    explicit mesh shards.

    What tracing cannot see, it cannot refuse: ``jit`` of inputs placed with a
    ``NamedSharding`` outside any mesh context fails when XLA partitions the step
    ("Side-effect HLO must have sharding").
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = [a for a in _manual_axes() if mesh.shape[a] > 1]
    if manual:
        raise ValueError(
            f"prefetching_attention runs inside shard_map over mesh axes {tuple(manual)} with "
            f"a cache built without mesh=: every device would read and write the same tier "
            f"blocks. Build it with jax_tpusync.kv_cache(..., mesh=mesh, kv_heads_axis=..., "
            f"batch_axis=...)"
        )
    if not mesh.empty and mesh.size > 1:
        raise ValueError(
            f"prefetching_attention runs under a mesh of {mesh.size} devices "
            f"({_mesh_shape(mesh)}) with a cache built without mesh=: build it with "
            f"jax_tpusync.kv_cache(..., mesh=mesh, kv_heads_axis=..., batch_axis=...)"
        )
    for name, x in zip("qkv", xs):
        sharded = [a for a in _spec_axes(x) if a is not None]
        if sharded:
            raise ValueError(
                f"{name} is sharded over mesh axes {tuple(sharded)} but the cache was built "
                f"without mesh=: build it with jax_tpusync.kv_cache(..., mesh=mesh, "
                f"kv_heads_axis=..., batch_axis=...)"
            )


def _spec_axes(x: jax.Array) -> list:
    """Per dimension of ``x``, the mesh axes an explicit sharding splits it over (None)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return []
    out = []
    for entry in spec:
        if entry is None or entry == P.UNCONSTRAINED:
            out.append(None)
        else:
            out.append(entry)
    return out


def sharded_attention(
    q,
    k,
    v,
    state: KVState | PoolState,
    *,
    layer,
    query_seq_lengths=None,
    step_lengths=None,
    **options,
) -> tuple[jax.Array, KVState | PoolState]:
    """:func:`~jax_tpusync.prefetching_attention` of a mesh cache's global state (or, inside
    the caller's ``shard_map`` over the cache's axes, of the device's share): a
    :class:`~jax_tpusync.core.state.KVState`, or a host-pool cache's
    :class:`~jax_tpusync.core.pool_state.PoolState` (each shard's pool in its device's host
    memory, its step :func:`~jax_tpusync.step.device.pool_attention`).
    ``query_seq_lengths`` is split over the batch axis as ``q`` is (``P(batch_axis)``), so
    each shard takes its own slots' counts. With ``step_lengths`` ([shards, batch] like the
    state's lengths) each shard runs a layer that reads ``layer``'s KV instead
    (:func:`~jax_tpusync.step.device.device_read_attention`; ``k``/``v`` the rows that
    layer added this step)."""
    spec = state.spec
    layout: MeshLayout = spec.mesh
    shard_spec = dataclasses.replace(spec, mesh=None)
    pooled = isinstance(state, PoolState)  # A host-pool cache's (HostPoolKVCache).
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jax.numpy.ndim(x) != 4:
            raise ValueError(
                f"{name} must be rank 4 [batch, q_len, heads, head_dim]; got shape "
                f"{jax.numpy.shape(x)}"
            )
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and _mesh_shape(mesh) != _mesh_shape(layout.mesh):
            raise ValueError(
                f"{name} is on mesh {_mesh_shape(mesh)} but the cache was built for mesh "
                f"{_mesh_shape(layout.mesh)}"
            )
        axes = _spec_axes(x)
        if len(axes) == 4 and axes[3] is not None:
            raise ValueError(
                f"{name} is sharded over head_dim (mesh axis {axes[3]!r}): a shard holds "
                f"whole KV heads; split the heads over kv_heads_axis="
                f"{layout.kv_heads_axis!r} instead"
            )

    def body(q, k, v, leaves, layer, counts, shard_step_lengths=None):
        if pooled:
            whole = jax.tree_util.tree_unflatten(tree, [x[0] for x in leaves])
            part = whole.with_spec(shard_spec)
            out, part = device.pool_attention(
                q, k, v, part, layer=layer, query_seq_lengths=counts, **options
            )
            return out, [x[None] for x in jax.tree_util.tree_leaves(part)]
        part = KVState.from_leaves(shard_spec, [x[0] for x in leaves])
        if shard_step_lengths is not None:
            out, part = device.device_read_attention(
                q,
                k,
                v,
                part,
                layer=layer,
                step_lengths=shard_step_lengths[0],
                query_seq_lengths=counts,
                **options,
            )
        else:
            guard = ops.shard_guard(part.target[3], layout.device_shard())
            out, part = device.device_attention(
                q, k, v, part, layer=layer, shard_guard=guard, query_seq_lengths=counts, **options
            )
        return out, [x[None] for x in jax.tree_util.tree_leaves(part)]

    leaves, tree = jax.tree_util.tree_flatten(state)
    manual = set(_manual_axes())
    ours = set(layout.shard_axes)
    if ours <= manual:  # Inside the caller's shard_map: the device's share.
        if leaves[0].shape[0] != 1:
            raise ValueError(
                f"inside shard_map the state must be split as cache.state_sharding says "
                f"(in_specs {layout.state_spec} for every state leaf): its leading axis has "
                f"{leaves[0].shape[0]} shards here, not 1"
            )
        out, leaves = body(q, k, v, leaves, layer, query_seq_lengths, step_lengths)
        return out, jax.tree_util.tree_unflatten(tree, leaves)
    if manual:
        raise ValueError(
            f"prefetching_attention runs inside shard_map over {tuple(sorted(manual))}, which "
            f"does not cover the cache's mesh axes {layout.shard_axes}: map over all of "
            f"them, or call it outside shard_map"
        )
    want = (layout.dp * shard_spec.batch, layout.tp * shard_spec.num_kv_heads)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] != want[0]:
            raise ValueError(
                f"{name} has batch={x.shape[0]} but the mesh cache holds batch={want[0]} "
                f"({layout.dp} devices x {shard_spec.batch})"
            )
    if k.shape[2] != want[1] or v.shape[2] != want[1]:
        raise ValueError(
            f"k and v must have num_kv_heads={want[1]} (the mesh cache's {layout.tp} x "
            f"{shard_spec.num_kv_heads}); got {k.shape[2]} and {v.shape[2]}"
        )
    if q.shape[2] % want[1]:
        raise ValueError(f"num_q_heads={q.shape[2]} must be a multiple of num_kv_heads={want[1]}")
    query_seq_lengths = plan.check_query_seq_lengths(query_seq_lengths, want[0], q.shape[1])
    state_specs = [layout.state_spec] * len(leaves)
    # A static layer stays a Python int (the kernels take its window statically); a traced
    # one goes in replicated.
    traced = () if isinstance(layer, int) else (jax.numpy.asarray(layer, jax.numpy.int32),)
    # Per-slot counts go in split over the batch axis, as q's batch is.
    counts_spec = P(layout.batch_axis)
    counts = ()
    if query_seq_lengths is not None:
        counts = (_resharded(jax.numpy.asarray(query_seq_lengths), layout, counts_spec),)

    # The step's starting lengths of a reading layer go in split as the state's are.
    reads = () if step_lengths is None else (_resharded(step_lengths, layout, layout.state_spec),)

    def mapped(q, k, v, leaves, *rest):
        traced_layer = rest[: len(traced)]
        shard_counts = rest[len(traced) : len(traced) + len(counts)]
        shard_reads = rest[len(traced) + len(counts) :]
        return body(
            q,
            k,
            v,
            leaves,
            traced_layer[0] if traced_layer else layer,
            shard_counts[0] if shard_counts else None,
            shard_reads[0] if shard_reads else None,
        )

    fn = jax.shard_map(
        mapped,
        mesh=layout.mesh,
        in_specs=(layout.qkv_spec,) * 3
        + (state_specs,)
        + (P(),) * len(traced)
        + (counts_spec,) * len(counts)
        + (layout.state_spec,) * len(reads),
        out_specs=(layout.qkv_spec, state_specs),
        check_vma=False,
    )
    qkv = [_resharded(x, layout, layout.qkv_spec) for x in (q, k, v)]
    leaves = [_resharded(x, layout, layout.state_spec) for x in leaves]
    out, leaves = fn(*qkv, leaves, *traced, *counts, *reads)
    # Typed as q came in, as single-device attention returns; q typed without a mesh (an
    # Explicit mesh that no jax.set_mesh made current) has no sharding to keep.
    q_sharding = jax.typeof(q).sharding
    if _is_explicit(layout.mesh) and not q_sharding.mesh.empty:
        out = jax.sharding.reshard(out, q_sharding)
    return out, jax.tree_util.tree_unflatten(tree, leaves)


def _mesh_shape(mesh) -> dict:
    return dict(mesh.shape)


def _is_explicit(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _resharded(x: jax.Array, layout: MeshLayout, spec: P) -> jax.Array:
    """``x`` as ``spec`` splits it: explicit meshes reshard before ``shard_map`` (auto
    meshes let ``shard_map`` do it)."""
    if _is_explicit(layout.mesh):
        return jax.sharding.reshard(x, NamedSharding(layout.mesh, spec))
    return x
