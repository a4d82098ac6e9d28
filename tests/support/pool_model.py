"""A host-pool cache of a small shape, a jitted step of attention calls over given q/k/v,
and a run of such steps against resident attention: the host-pool tests' model
(test_pool_attention.py, test_pool_ring.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps

HEADS, Q_HEADS, HEAD_DIM = 2, 4, 16
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}


def make_cache(num_layers=3, batch=2, max_len=64, block_tokens=8, **options):
    options.setdefault("dtype", jnp.float32)
    # Two units of 16 tokens (two blocks of 8) per slot, K and V.
    itemsize = np.dtype(options["dtype"]).itemsize
    options.setdefault("staging_bytes", 2 * batch * 16 * 2 * HEADS * HEAD_DIM * itemsize)
    return tps.HostPoolKVCache(
        num_layers=num_layers,
        batch=batch,
        max_len=max_len,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        block_tokens=block_tokens,
        **options,
    )


def decode_step(num_layers, windows, dtype):
    """A jitted step of ``num_layers`` attention calls on given q/k/v (a model's shape
    without its weights), the state donated."""

    def step(state, qs, ks, vs, counts):
        outs = []
        for layer in range(num_layers):
            out, state = tps.prefetching_attention(
                qs[layer], ks[layer], vs[layer], state, layer=layer, query_seq_lengths=counts
            )
            outs.append(out)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=0)


def run_against_resident(cache, steps, windows, dtype, seed=0, tolerance=None):
    """Runs ``steps`` (q_len, counts or None) through the cache and resident attention
    from an empty context; returns the worst difference of real rows."""
    spec = cache.spec
    num_layers, batch, max_len = spec.num_layers, spec.batch, spec.max_len
    rng = np.random.default_rng(seed)
    state = cache.init()
    step = decode_step(num_layers, windows, dtype)
    cache_k = jnp.zeros((num_layers, batch, max_len, HEADS, HEAD_DIM), dtype)
    cache_v = jnp.zeros_like(cache_k)
    lengths = np.zeros(batch, np.int32)
    worst = 0.0
    for q_len, counts in steps:
        shape = (num_layers, batch, q_len)
        qs = jnp.asarray(rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)), dtype)
        ks = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), dtype)
        vs = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), dtype)
        counts_arg = None if counts is None else jnp.asarray(counts, jnp.int32)
        out, state = step(state, qs, ks, vs, counts_arg)
        real = np.ones((batch, q_len), bool)
        if counts is not None:
            real = np.arange(q_len)[None] < np.asarray(counts)[:, None]
        for layer in range(num_layers):
            ref, new_k, new_v = tps.resident_attention(
                qs[layer],
                ks[layer],
                vs[layer],
                cache_k[layer],
                cache_v[layer],
                jnp.asarray(lengths),
                window=windows[layer],
                query_seq_lengths=counts_arg,
            )
            cache_k = cache_k.at[layer].set(new_k)
            cache_v = cache_v.at[layer].set(new_v)
            diff = jnp.abs(out[layer].astype(jnp.float32) - ref.astype(jnp.float32))
            worst = max(worst, float(jnp.max(jnp.where(real[..., None, None], diff, 0))))
        lengths = lengths + (q_len if counts is None else np.asarray(counts, np.int32))
        np.testing.assert_array_equal(np.asarray(state.lengths), lengths)
    return state, worst, (cache_k, cache_v, lengths)


def unit_budget(depth, dtype=np.float32, batch=2, unit_tokens=16):
    """staging_bytes of ``depth + 1`` units of ``unit_tokens`` per slot (K and V)."""
    return (depth + 1) * batch * unit_tokens * 2 * HEADS * HEAD_DIM * np.dtype(dtype).itemsize
