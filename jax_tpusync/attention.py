"""``prefetching_attention``: causal attention over an offloaded KV cache, layer-ahead.

One call handles one layer of one decode (or prefill-chunk) step:

1. write the new tokens' K/V back to the tier (in the background);
2. for each unit (a staging-sized chunk) of this layer's cached KV:
   start the fetch of the unit ``prefetch_depth`` ahead (the next chunk, the next layer's
   first chunk, or, from the last layer, the next step's first chunk), then wait for this
   unit (usually fetched during the previous layer's compute) and attend to it;
3. attend to the new tokens themselves and merge (online softmax).

The write-back comes first so that every later fetch of the same layer, including the
next step's prefetch, is queued after it: the engine orders overlapping transfers by
submission, so no fetch can see a cache without its newest tokens. Every wait checks that
its unit's fetch is exactly the one needed (same tier bytes, same staging slot) and fetches
it itself otherwise, so a skipped layer or a changed state costs time, never correctness.

A resident cache (``spec.resident``: the state's staging holds every layer's KV) keeps
step 1 as it is, writes the new rows into its device copy too, and replaces step 2 by
attention over that copy: no fetch at all. A host tier read in place
(``spec.reads_in_place``, the CPU backend's default) replaces each unit's fetch, wait and
attention of step 2 by one call that attends to the unit's rows where the pool holds them.

This module is the entry point; the step itself lives in :mod:`jax_tpusync.step` (the unit
walk, one unit's attention, the streamed, in-place, resident and mesh variants).
"""

from __future__ import annotations

import jax

from jax_tpusync.core.hybrid_state import HybridState
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.state import KVState
from jax_tpusync.step import device, hybrid, sharded
from jax_tpusync.step.device import IMPLEMENTATIONS
from jax_tpusync.step.resident import resident_attention

__all__ = ["IMPLEMENTATIONS", "prefetching_attention", "resident_attention"]


def prefetching_attention(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array | None,  # [batch, q_len, num_kv_heads, head_dim]
    v: jax.Array | None,  # [batch, q_len, num_kv_heads, head_dim]
    state: KVState | HybridState | PoolState,
    *,
    layer: int | jax.Array,
    query_seq_lengths: jax.Array | None = None,
    implementation: str | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, KVState]:
    """Causal attention of ``q`` over the offloaded cache plus the new tokens.

    Appends ``k``/``v`` at each sequence's current length (writing them back to the tier),
    attends over positions ``[0, length + q_len)`` (or the layer's sliding window), and
    starts fetching the KV the next call will need while this one computes. On a resident
    cache (``OffloadedKVCache(resident=True)``) it fetches nothing: it attends over the
    state's device copy of the KV, which it updates alongside the write-back. On a tier
    read in place (``read_in_place``, the CPU backend's default) nothing is copied into
    staging: a host tier's units are attended to where the pool holds them, a file tier's
    where their fetch (started layer-ahead, as always) landed in engine memory.

    Call it once per layer, layers in order 0..num_layers-1, every step; from a Python loop
    inside ``jit`` (``layer`` an int) or from ``lax.scan`` over stacked weights (``layer``
    traced). Donate the state into the jitted step (``donate_argnums``): the waits write
    its staging buffers in place (without donation XLA copies them every step). Use only
    the state the last call returned: the engine refuses a superseded one.

    Args:
      q: queries, after RoPE.
      k: the new tokens' keys, after RoPE (stored as given), in the cache's dtype or one
        that converts to it exactly (see :meth:`OffloadedKVCache.load`: bfloat16 or
        float16 into a float32 cache); float32 into a 16-bit cache is refused at trace
        time, cast it with ``.astype(...)``.
      v: the new tokens' values, same rule.
      state: the cache state from :meth:`OffloadedKVCache.init` (or
        :meth:`~jax_tpusync.caches.hybrid.cache.HybridKVCache.init`) or the previous call.
      layer: the layer index, in ``[0, num_layers)``. A traced layer out of range fails
        when the step runs (the engine refuses its write-back: "layer out of range?").
      query_seq_lengths: int32[batch] (may be traced) or None: how many of the step's
        ``q_len`` rows are real for each slot ("ragged steps": one slot decoding 1 token
        beside another prefilling a chunk of its prompt, in one compiled step; 0: the slot
        takes no token this step and moves no byte). Query row ``i`` of slot ``b`` sits at
        position ``lengths[b] + i`` (:meth:`KVState.positions`) and attends causally to the
        cached keys and to the step's rows ``j <= i`` with ``j < query_seq_lengths[b]``
        (sliding windows relative to that position). Rows past a slot's count are
        padding: never written to the tier, never attended to as keys; their outputs are
        unspecified but finite. Slot ``b``'s length grows by its count, and its capacity
        guard checks ``length + count <= capacity``. Concrete values outside ``[0,
        q_len]`` are refused; traced ones are clipped to it. Pass the same value to every
        layer of a step. None (the default): every active slot takes all ``q_len`` rows.
      implementation: ``"xla"`` (plain jnp; default on CPU) or ``"pallas"`` (the decode
        kernel; default on GPU/TPU; TPU interpret mode on CPU).
      scale: softmax scale; default ``1 / sqrt(head_dim)`` (a model that pre-scales q
        passes 1.0).
      soft_cap: logits soft cap (``cap * tanh(logits / cap)``), or None.
      block_kv: Pallas KV block size (default: tuned per device).
      interpret: Pallas interpret mode (default: on when the backend is CPU).

    A mesh cache (:class:`~jax_tpusync.caches.offloaded.mesh.ShardedKVCache`, what
    ``jax_tpusync.kv_cache(mesh=...)`` makes) takes the global ``q``/``k``/``v``
    (sharded or not: they are resharded as the cache's mesh says) and runs each shard's
    attention on its own device inside ``shard_map``; called inside the caller's own
    ``shard_map`` over the cache's axes it takes each device's share (see
    :mod:`jax_tpusync.caches.offloaded.mesh` and :mod:`jax_tpusync.step.sharded`).

    A host-pool cache (:class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache`, the TPU data
    path: the pool a ``pinned_host`` array the state carries) copies each layer's units to
    the device one unit ahead with JAX memory kinds, no custom call
    (:mod:`jax_tpusync.step.host_pool`).

    A hybrid cache (:class:`~jax_tpusync.caches.hybrid.cache.HybridKVCache`: layers of several KV
    geometries, sliding layers that keep only their window, layers that read another
    layer's KV) takes each layer's own shapes; a layer that reads another layer's KV
    (``kv_sharing``) passes ``k=None, v=None`` (see :mod:`jax_tpusync.step.hybrid`).

    Returns:
      ``(out, state)``: ``out`` shaped and typed like ``q``; the updated state (lengths grow
      by ``q_len``, or by ``query_seq_lengths``, after the last layer).
    """
    options = dict(
        layer=layer,
        query_seq_lengths=query_seq_lengths,
        implementation=implementation,
        scale=scale,
        soft_cap=soft_cap,
        block_kv=block_kv,
        interpret=interpret,
    )
    if isinstance(state, HybridState):
        return hybrid.hybrid_attention(q, k, v, state, **options)
    if isinstance(state, PoolState):
        if k is None or v is None:
            raise ValueError("k and v are None: a host-pool cache stores every layer's own KV")
        if state.spec.mesh is not None:
            return sharded.sharded_attention(q, k, v, state, **options)
        return device.pool_attention(q, k, v, state, **options)
    spec = state.spec if isinstance(state, KVState) else None
    if spec is None:
        raise TypeError(
            f"state must be a KVState (from OffloadedKVCache.init()), got {type(state).__name__}"
        )
    if k is None or v is None:
        raise ValueError(
            "k and v are None: only a layer of a hybrid cache that reads another layer's KV "
            "(HybridKVCache's kv_sharing) passes None"
        )
    if spec.mesh is not None:
        return sharded.sharded_attention(q, k, v, state, **options)
    sharded.refuse_unsharded_cache(q, k, v)
    return device.device_attention(q, k, v, state, **options)
