"""One layer of a hybrid model's step: the layer's group, then that group's attention.

A :class:`~jax_tpusync.core.hybrid_state.HybridState` holds one state per geometry group (see
:mod:`jax_tpusync.core.hybrid_state`). A model layer that stores KV runs the ordinary
single-device (or mesh) step on its group's state, as that group's layer ``local_of[l]``: so
each group keeps its own layer-ahead prefetch chain, from one of its layers to its next one
(several model layers later: more compute to hide the fetch behind). A layer some other
layer reads also leaves its new rows in the state. A layer that reads another layer's KV
(``kv_sharing``) attends over its source's rows as of the step's start plus the rows the
source left, with no write-back (:func:`jax_tpusync.step.device.device_read_attention`).

``layer`` may be traced (``lax.scan`` over a repeating block of layers): the groups whose
KV shapes match the call's ``k`` (or, for ``k=None``, the groups with reading layers) are
switched over; in each, a model layer of another group maps to layer -1, which the engine
refuses when the step runs ("layer out of range?").

Groups that are host pools (``HybridKVCache(host_pool=True)``, the TPU data path; their
states :class:`~jax_tpusync.core.pool_state.PoolState`) run the pool's step
(:mod:`jax_tpusync.step.host_pool`, in ``shard_map`` on a mesh). Each group's unit chain
runs from one of its layers to its next one, and from its last layer to the next step's
first, as an engine group's does: the unit stays staged in the group's state through the
other groups' layers in between. A pool layer read by another (``kv_sharing``) is
attended as of the step's start by running the pool's step of the source layer again at
the step's starting lengths with the rows the source left: it writes those same bytes
where the source wrote them, and only the pool, the staging and what it was copied from
are kept (the state's lengths and refusals stay the step's); its prefetch replaces the
group's staged unit, which the group's next layer then copies itself (``staged_at``: a
prefetch is never a source of data). A traced ``layer`` switches over pool groups as over
engine groups; a layer of another group maps to layer -1 there, which the pool step
refuses for every active slot (writing nothing outside its sink).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tpusync.core.hybrid_state import HybridState, LayerGroups
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.state import KVState
from jax_tpusync.step import device, sharded


def hybrid_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array | None,  # [batch, q_len, num_kv_heads, head_dim], or None: a reading layer
    v: jax.Array | None,
    state: HybridState,
    *,
    layer: int | jax.Array,
    query_seq_lengths: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, HybridState]:
    """:func:`~jax_tpusync.prefetching_attention` of a hybrid cache's state."""
    plan = state.plan
    if (k is None) != (v is None):
        raise ValueError("pass both k and v, or (a layer that reads another's KV) neither")
    if isinstance(layer, np.integer):
        layer = int(layer)
    options = dict(options, query_seq_lengths=query_seq_lengths)
    if isinstance(layer, int):
        if not 0 <= layer < plan.num_layers:
            raise ValueError(
                f"layer={layer} is out of range for a cache of {plan.num_layers} layers"
            )
        source = plan.source_of[layer]
        if source is None and k is None:
            raise ValueError(
                f"{plan.describe_layer(layer)} stores its own KV: pass its k and v (only a "
                f"layer that reads another's KV, kv_sharing, passes None)"
            )
        if source is not None and k is not None:
            raise ValueError(
                f"layer {layer} reads layer {source}'s KV (kv_sharing): call it with k=None, "
                f"v=None (it writes nothing)"
            )
        if source is None:
            return _store_layer(q, k, v, state, layer, plan.group_of[layer], options)
        return _read_layer(q, state, layer, plan.group_of[layer], options)
    layer = jnp.asarray(layer, jnp.int32)
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must be an int or an integer scalar; got {layer!r}")
    return _traced_layer(q, k, v, state, layer, options)


def _group_attention(q, k, v, gs: KVState | PoolState, layer, options):
    """One stored layer of a group: its cache's own step (host pool or engine, on one
    device or a mesh)."""
    if gs.spec.mesh is not None:
        return sharded.sharded_attention(q, k, v, gs, layer=layer, **options)
    if isinstance(gs, PoolState):
        return device.pool_attention(q, k, v, gs, layer=layer, **options)
    return device.device_attention(q, k, v, gs, layer=layer, **options)


def _pool_read_attention(q, k, v, gs: PoolState, layer, step_lengths, options):
    """A reading layer over a host-pool group: ``layer``'s step again at the step's
    starting lengths, its new rows ``k``/``v`` (the source's, written again where the
    source wrote them: the same bytes); the pool, staging and ``staged_at`` it leaves are
    kept, the lengths and refusals stay ``gs``'s."""
    view = gs.replace(lengths=jnp.asarray(step_lengths, jnp.int32))
    out, after = _group_attention(q, k, v, view, layer, options)
    return out, gs.with_staged_units(after.staged_units).replace(pool=after.pool)


def _store_layer(q, k, v, state: HybridState, layer, g: int, options, local=None):
    """A layer that stores its KV (``layer`` static, or traced with ``local`` given)."""
    plan = state.plan
    gs = state.groups[g]
    if local is None:
        local = plan.local_of[layer]
    out, after = _group_attention(q, k, v, gs, local, options)
    # Layer 0 opens the step: its lengths are every slot's as the step began.
    step_lengths = jnp.where(jnp.asarray(layer) == 0, gs.lengths, state.step_lengths)
    state = state.with_group(g, after).replace(step_lengths=step_lengths)
    pending = list(state.pending)
    for i, source in enumerate(plan.sources):
        if plan.group_of[source] != g:
            continue
        if isinstance(layer, int) and layer != source:
            continue
        pending[i] = _kept_rows(pending[i], k, v, jnp.asarray(layer) == source, source)
    return out, state.replace(pending=tuple(pending))


def _kept_rows(buffer, k, v, is_source, source: int):
    """``buffer`` ([2, batch, max_step_tokens, H, D]) with ``k``/``v`` in its first rows
    where ``is_source``."""
    q_len, most = k.shape[1], buffer.shape[2]
    if q_len > most:
        raise ValueError(
            f"q_len={q_len} exceeds max_step_tokens={most}: the rows of layer {source}, "
            f"which another layer reads, are kept for at most that many"
        )
    rows = _typed_like(jnp.stack([k, v]).astype(buffer.dtype), buffer)
    updated = lax.dynamic_update_slice(buffer, rows, (0, 0, 0, 0, 0))
    return jnp.where(is_source, updated, buffer)


def _typed_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """``x`` resharded as ``ref`` is, where ``ref``'s type carries an (explicit) sharding:
    such arrays combine only when their shardings are equal."""
    sharding = jax.typeof(ref).sharding
    if sharding.mesh.empty or jax.typeof(x).sharding == sharding:
        return x
    return jax.sharding.reshard(x, sharding)


def _read_layer(q, state: HybridState, layer, g: int, options, local=None, rows=None):
    """A layer that reads its source's KV (static, or traced with ``local``/``rows``)."""
    plan = state.plan
    gs = state.groups[g]
    q_len = q.shape[1]
    if local is None:
        source = plan.source_of[layer]
        local = plan.local_of[layer]
        rows = state.pending[plan.pending_index(source)]
    if q_len > rows.shape[2]:
        raise ValueError(f"q_len={q_len} exceeds max_step_tokens={rows.shape[2]}")
    k, v = rows[0, :, :q_len], rows[1, :, :q_len]
    if isinstance(gs, PoolState):
        out, after = _pool_read_attention(q, k, v, gs, local, state.step_lengths, options)
    elif gs.spec.mesh is not None:
        out, after = sharded.sharded_attention(
            q, k, v, gs, layer=local, step_lengths=state.step_lengths, **options
        )
    else:
        out, after = device.device_read_attention(
            q, k, v, gs, layer=local, step_lengths=state.step_lengths, **options
        )
    return out, state.with_group(g, after)


def _traced_layer(q, k, v, state: HybridState, layer: jax.Array, options):
    """A traced ``layer``: switch over the groups that can serve this call's shapes."""
    plan: LayerGroups = state.plan
    reading = k is None
    if reading:
        candidates = [
            g
            for g, grp in enumerate(plan.groups)
            if grp.head_dim == q.shape[3]
            and q.shape[2] % grp.num_kv_heads == 0
            and any(
                plan.group_of[l] == g and plan.source_of[l] is not None
                for l in range(plan.num_layers)
            )
        ]
    else:
        candidates = [
            g
            for g, grp in enumerate(plan.groups)
            if (grp.num_kv_heads, grp.head_dim) == tuple(k.shape[2:])
        ]
    if not candidates:
        what = (
            "reads another layer's KV"
            if reading
            else f"has KV heads x head_dim {tuple(k.shape[2:])}"
        )
        raise ValueError(
            f"no layer group of this cache {what}: groups are {[g.describe() for g in plan.groups]}"
        )

    def member(l: int, g: int) -> bool:
        return plan.group_of[l] == g and (plan.source_of[l] is not None) == reading

    which = np.zeros(plan.num_layers, np.int32)
    for l in range(plan.num_layers):
        for c, g in enumerate(candidates):
            if member(l, g):
                which[l] = c

    def branch(g: int):
        local = jnp.asarray(
            [plan.local_of[l] if member(l, g) else -1 for l in range(plan.num_layers)], jnp.int32
        )[layer]
        if not reading:
            return lambda: _store_layer(q, k, v, state, layer, g, options, local=local)
        # The rows its source left: the source of this layer, among the group's sources.
        mine = [i for i, s in enumerate(plan.sources) if plan.group_of[s] == g]
        source = jnp.asarray(
            [
                -1 if plan.source_of[l] is None else plan.source_of[l]
                for l in range(plan.num_layers)
            ],
            jnp.int32,
        )[layer]
        rows = state.pending[mine[0]]
        for i in mine[1:]:
            rows = jnp.where(source == plan.sources[i], state.pending[i], rows)
        return lambda: _read_layer(q, state, layer, g, options, local=local, rows=rows)

    branches = [branch(g) for g in candidates]
    if len(branches) == 1:
        return branches[0]()
    return lax.switch(jnp.asarray(which)[layer], branches)
