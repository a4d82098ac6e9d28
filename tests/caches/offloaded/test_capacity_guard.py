"""A sequence that would outgrow its capacity is refused by name, before any byte of any
layer is written: the write-back's guard rows are checked first, and layer 0's write-back
is the step's first engine op. (Before, a full sequence's new token landed in its
neighbour's K[0] with no error, or the step failed with a misleading "layer out of range?"
after two layers had already written.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

KV_HEADS, Q_HEADS, HEAD_DIM = 2, 4, 16


def _cache(tier, tmp_path, *, layers, batch, max_len):
    extra = dict(path=tmp_path) if tier == "file" else {}
    return tps.OffloadedKVCache(
        num_layers=layers,
        batch=batch,
        max_len=max_len,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        tier=tier,
        staging_bytes=1 << 20,
        **extra,
    )


def _filled(cache, lengths, rng):
    spec = cache.spec
    state = cache.init()
    n = int(max(lengths))
    for layer in range(spec.num_layers):
        kv = rng.standard_normal((2, spec.batch, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, layer, kv[0], kv[1], lengths=lengths)
    return state


def _step(layers, q_len=1):
    def step(x, state):
        for layer in range(layers):
            q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], q_len, Q_HEADS, HEAD_DIM))
            kv = q[:, :, :KV_HEADS]
            o, state = tps.prefetching_attention(q, kv, kv, state, layer=layer)
            x = x + o[:, :, 0]
        return x, state

    return jax.jit(step, donate_argnums=(1,))


def _snapshot(cache):
    return [cache.read_all(layer) for layer in range(cache.spec.num_layers)]


def _assert_unchanged(before, after):
    for (k0, v0), (k1, v1) in zip(before, after):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)


@pytest.mark.parametrize("tier", ("host", "file"))
def test_a_full_sequence_never_writes_into_its_neighbour(tier, tmp_path):
    rng = np.random.default_rng(0)
    with _cache(tier, tmp_path, layers=2, batch=2, max_len=4) as cache:
        state = _filled(cache, [4, 1], rng)
        before = _snapshot(cache)
        x = jnp.ones((2, 1, HEAD_DIM), jnp.float32)
        with pytest.raises(
            Exception,
            match="slot 0 holds 4 tokens and cannot take 1 more: its capacity is 4 tokens",
        ):
            jax.block_until_ready(_step(2)(x, state))
        _assert_unchanged(before, _snapshot(cache))  # Every slot, every layer.
        # The cache stays usable: the live state is recovered, the full slot released,
        # and the neighbour decodes on.
        state = cache.recover()
        np.testing.assert_array_equal(np.asarray(state.lengths), [4, 1])
        state = cache.release(state, 0)
        _, state = _step(2)(x, state)
        np.testing.assert_array_equal(np.asarray(state.lengths), [0, 2])
        state = cache.drain(state)


@pytest.mark.parametrize("tier", ("host", "file"))
def test_the_last_row_is_writable(tier, tmp_path):
    """The edge: length max_len - 1 takes one more token (into its own last row)."""
    rng = np.random.default_rng(1)
    with _cache(tier, tmp_path, layers=2, batch=2, max_len=4) as cache:
        state = _filled(cache, [3, 1], rng)
        before = _snapshot(cache)
        _, state = _step(2)(jnp.ones((2, 1, HEAD_DIM), jnp.float32), state)
        state = cache.drain(state)
        after = _snapshot(cache)
        for (k0, v0), (k1, v1) in zip(before, after):
            np.testing.assert_array_equal(k0[0, :3], k1[0, :3])
            np.testing.assert_array_equal(k0[1, :1], k1[1, :1])
            np.testing.assert_array_equal(k0[1, 2:], k1[1, 2:])  # Past the neighbour's new row.
            assert not np.array_equal(k0[0, 3], k1[0, 3])  # Its own last row was written.


def test_a_full_single_sequence_is_refused_before_any_layer_writes(tmp_path):
    rng = np.random.default_rng(2)
    with _cache("host", tmp_path, layers=2, batch=1, max_len=8) as cache:
        state = _filled(cache, [8], rng)
        before = _snapshot(cache)
        with pytest.raises(Exception, match="slot 0 holds 8 tokens .* capacity is 8 tokens"):
            jax.block_until_ready(_step(2)(jnp.ones((1, 1, HEAD_DIM), jnp.float32), state))
        _assert_unchanged(before, _snapshot(cache))


@pytest.mark.parametrize("length,ok", [(5, True), (6, False)])
def test_a_prefill_chunk_is_guarded_at_its_edge(length, ok, tmp_path):
    """q_len 3 into max_len 8: from length 5 it fills the sequence exactly; from 6 it is refused."""
    rng = np.random.default_rng(3)
    with _cache("host", tmp_path, layers=1, batch=1, max_len=8) as cache:
        state = _filled(cache, [length], rng)
        step = _step(1, q_len=3)
        x = jnp.ones((1, 3, HEAD_DIM), jnp.float32)
        if ok:
            _, state = step(x, state)
            assert int(state.lengths[0]) == 8
            cache.drain(state)
        else:
            with pytest.raises(Exception, match="holds 6 tokens and cannot take 3 more"):
                jax.block_until_ready(step(x, state))
