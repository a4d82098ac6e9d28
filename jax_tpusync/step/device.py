"""One layer of one device's step: the checks, the write-back, then the cached KV.

What :func:`~jax_tpusync.prefetching_attention` runs for a single-device cache, and for
each shard of a mesh cache inside ``shard_map`` (:mod:`jax_tpusync.step.sharded`, whose
write-backs lead with the shard's guard). The write-back goes first (see
:mod:`jax_tpusync.step.streamed`); a resident cache then attends over its device copy
(:mod:`jax_tpusync.step.resident`), any other streams its units or reads them in place
(:func:`jax_tpusync.step.streamed.streamed_layer`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.state import CacheSpec, KVState, dtype_error, exact_cast_allowed
from jax_tpusync.runtime import backend
from jax_tpusync.step import host_pool, plan, pool_sparse, resident, sparse_layer, streamed

IMPLEMENTATIONS = ("xla", "pallas")


def device_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState,
    *,
    layer: int | jax.Array,
    implementation: str | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
    shard_guard: jax.Array | None = None,  # int32[1, 4]: ops.shard_guard() of a mesh shard
    query_seq_lengths: jax.Array | None = None,  # int32[batch]: real rows per slot
) -> tuple[jax.Array, KVState]:
    """:func:`~jax_tpusync.prefetching_attention` of one device's cache (or one shard of a
    mesh cache, whose write-backs lead with ``shard_guard``)."""
    spec = state.spec
    _validate(q, k, v, spec, layer)
    layer, counts, options = _step_options(
        q, spec, layer, implementation, scale, soft_cap, block_kv, interpret, query_seq_lengths
    )

    # 1. New tokens go out first: later fetches of this layer are queued behind them.
    token, new_kv, grow = streamed.write_back(spec, state, layer, k, v, shard_guard, counts)
    if spec.resident:
        return resident.resident_layer(q, k, v, state, new_kv, token, grow, **options)
    if spec.sparse is not None:
        return sparse_layer.sparse_layer(q, k, v, state, token, grow, **options)
    return streamed.streamed_layer(q, k, v, state, token, grow, **options)


def pool_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: PoolState,
    *,
    layer: int | jax.Array,
    implementation: str | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
    query_seq_lengths: jax.Array | None = None,  # int32[batch]: real rows per slot
) -> tuple[jax.Array, PoolState]:
    """:func:`~jax_tpusync.prefetching_attention` of a host-pool cache (the TPU data path:
    :mod:`jax_tpusync.step.host_pool`; with ``sparse=``, :mod:`jax_tpusync.step.pool_sparse`)."""
    spec = state.spec
    _validate(q, k, v, spec, layer)
    _, _, options = _step_options(
        q, spec, layer, implementation, scale, soft_cap, block_kv, interpret, query_seq_lengths
    )
    if state.sparse is not None:
        return pool_sparse.sparse_pool_layer(q, k, v, state, **options)
    return host_pool.pool_layer(q, k, v, state, **options)


def device_read_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]: the source layer's new rows
    v: jax.Array,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState,
    *,
    layer: int | jax.Array,
    step_lengths: jax.Array,  # int32[batch]: the lengths the step began with
    implementation: str | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
    query_seq_lengths: jax.Array | None = None,
) -> tuple[jax.Array, KVState]:
    """A layer that reads ``layer``'s KV instead of storing its own (a hybrid model's
    ``kv_sharing``): the attention of that layer as of the step's start (``step_lengths``,
    its cached rows; ``k``/``v``, the rows it added this step), with no write-back.

    It walks ``layer``'s units again (on a host tier read in place that reads them where
    they lie; a fetched tier fetches the ones its prefetch chain does not hold, so the
    following layers' prefetches stay as they were). Only the state's staging, tickets and
    slot change: its lengths, token and owner stay the step's.
    """
    spec = state.spec
    _validate(q, k, v, spec, layer)
    layer, counts, options = _step_options(
        q, spec, layer, implementation, scale, soft_cap, block_kv, interpret, query_seq_lengths
    )
    view = state.replace(lengths=jnp.asarray(step_lengths, jnp.int32))
    grow = plan.step_grow(view, q.shape[1], counts)
    if spec.resident:
        # The rows go into the device copy again where the source put them: the same bytes.
        new_kv = streamed.new_rows(spec, k, v)
        out, after = resident.resident_layer(q, k, v, view, new_kv, state.token, grow, **options)
    else:
        out, after = streamed.streamed_layer(q, k, v, view, state.token, grow, **options)
    return out, state.replace(staging=after.staging, tickets=after.tickets, slot=after.slot)


def _step_options(
    q, spec: CacheSpec, layer, implementation, scale, soft_cap, block_kv, interpret, counts
):
    """``(layer, counts, options)``: the layer as an int or int32 scalar, the real rows per
    slot (:func:`plan.real_rows`) and the keyword options of a layer's attention."""
    counts = plan.real_rows(
        q.shape[1], plan.check_query_seq_lengths(counts, spec.batch, q.shape[1])
    )
    if implementation is None:
        implementation = backend.default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    if scale is None:
        scale = 1.0 / math.sqrt(spec.head_dim)
    kernel_options = {}
    if implementation == "pallas":
        kernel_options = backend.pallas_options(block_kv, interpret)
    if spec.reads_in_place and implementation != "xla":
        raise ValueError(
            f"implementation={implementation!r} attends over staging units, and this cache "
            f"reads its tier in place (read_in_place='auto' on the CPU backend), so its "
            f"state has no staging: make it with read_in_place=False"
        )
    if isinstance(layer, np.integer):
        layer = int(layer)
    if not isinstance(layer, int):
        layer = jnp.asarray(layer, jnp.int32)
    options = dict(
        layer=layer,
        implementation=implementation,
        scale=scale,
        soft_cap=soft_cap,
        kernel_options=kernel_options,
        counts=counts,
    )
    return layer, counts, options


def _validate(q, k, v, spec: CacheSpec, layer) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(
                f"{name} must be rank 4 [batch, q_len, heads, head_dim]; got shape {jnp.shape(x)}"
            )
        if jnp.dtype(x.dtype) not in (
            jnp.dtype(jnp.bfloat16),
            jnp.dtype(jnp.float32),
            jnp.dtype(jnp.float16),
        ):
            raise ValueError(f"{name}.dtype must be bfloat16, float16 or float32; got {x.dtype}")
    b, t, hq, d = q.shape
    want_kv = (spec.batch, t, spec.num_kv_heads, spec.head_dim)
    if b != spec.batch:
        raise ValueError(f"q has batch={b} but the cache was made for batch={spec.batch}")
    if d != spec.head_dim:
        raise ValueError(f"q has head_dim={d} but the cache has head_dim={spec.head_dim}")
    for name, x in (("k", k), ("v", v)):
        # Checked on dtypes at trace time: a rounding cast into the cache is the caller's.
        if not exact_cast_allowed(x.dtype, spec.dtype):
            raise ValueError(dtype_error(name, x.dtype, spec.dtype))
        if tuple(x.shape) != want_kv:
            raise ValueError(
                f"{name} must be [batch, q_len, num_kv_heads, head_dim] = "
                f"{list(want_kv)}; got {list(x.shape)}"
            )
    if hq % spec.num_kv_heads:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={spec.num_kv_heads}")
    if t > spec.max_len:
        raise ValueError(f"q_len={t} exceeds max_len={spec.max_len}")
    if spec.step_tokens and t > spec.step_tokens:
        # Its rows would overwrite ring entries that this step's window still reads.
        raise ValueError(
            f"q_len={t} exceeds max_step_tokens={spec.step_tokens}: the cache keeps only "
            f"each slot's window plus that many new rows (make it with a larger "
            f"max_step_tokens, or split the step)"
        )
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < spec.num_layers:
            raise ValueError(
                f"layer={layer} is out of range for a cache of {spec.num_layers} layers"
            )
    elif jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an int or an integer scalar; got {layer!r}")
