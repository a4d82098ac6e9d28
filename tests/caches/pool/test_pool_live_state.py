"""A host-pool cache takes only its live state: the one its last host call (or a step on it)
returned. A state a later call superseded, whose block tables may name blocks other slots
hold now, and a state of another cache of the same shape are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

STALE = r"this PoolState is not the cache's live state: a later call returned another one"


def make_cache():
    return tps.HostPoolKVCache(
        num_layers=2, batch=2, max_len=32, num_kv_heads=2, head_dim=16, block_tokens=8,
        dtype=jnp.float32,
    )  # fmt: skip


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, 2, 16)).astype(np.float32) for _ in range(2)]


def test_a_superseded_state_is_refused_by_every_host_call_and_the_live_one_taken():
    cache = make_cache()
    first = cache.init(admit=False)
    live, _ = cache.admit(first, 0, max_tokens=16)  # first: superseded from here.
    calls = {
        "admit": lambda s: cache.admit(s, 1, max_tokens=8),
        "load": lambda s: cache.load(s, 0, *rows(4), slot=0),
        "read": lambda s: cache.read(s, 0, 0),
        "release": lambda s: cache.release(s, 0),
        "lengths": lambda s: cache.lengths(s),
        "read_stored_rows": lambda s: cache.read_stored_rows(s, 0, 0, 0),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=STALE):
            call(first)
    # Nothing changed: the live state is still the one admit returned.
    assert list(cache.lengths(live)) == [0, 0] and list(cache.capacity) == [16, 0]
    live = cache.load(live, 0, *rows(4), slot=0)
    live = cache.load(live, 1, *rows(4), slot=0)
    assert list(cache.lengths(live)) == [4, 0]
    cache.close(live)


def test_a_refused_call_leaves_the_state_live():
    cache = make_cache()
    state = cache.init(admit=False)
    with pytest.raises(ValueError, match=r"overflow its capacity"):
        cache.load(state, 0, *rows(4), slot=0)  # Slot 0 is inactive.
    state, _ = cache.admit(state, 0, max_tokens=8)  # The state is still live.
    cache.close(state)


def test_another_caches_state_of_the_same_shape_is_refused():
    cache, other = make_cache(), make_cache()
    state, foreign = cache.init(admit=False), other.init(admit=False)
    assert foreign.spec == state.spec
    with pytest.raises(ValueError, match=STALE):
        cache.admit(foreign, 0)
    with pytest.raises(ValueError, match=STALE):
        other.admit(state, 0)
    cache.close(state)
    other.close(foreign)


def test_a_steps_output_is_live_and_its_donated_input_refused():
    cache = make_cache()
    state, _ = cache.admit(cache.init(admit=False), 0, max_tokens=16)

    def step(state, q, kv):
        for layer in range(2):
            _, state = tps.prefetching_attention(q, kv, kv, state, layer=layer)
        return state

    step = jax.jit(step, donate_argnums=0)
    q = jnp.ones((2, 1, 4, 16), jnp.float32)
    kv = jnp.ones((2, 1, 2, 16), jnp.float32)
    out = step(state, q, kv)
    with pytest.raises(ValueError, match=r"was donated to a step"):
        cache.lengths(state)
    assert list(cache.lengths(out)) == [1, 0]
    cache.close(out)


def test_an_inert_state_leaves_the_live_one_live_and_is_taken_by_no_call():
    cache = make_cache()
    live = cache.init(admit=False)
    inert = cache.inert_state()
    with pytest.raises(ValueError, match=STALE):
        cache.admit(inert, 0)
    live, _ = cache.admit(live, 0, max_tokens=8)
    cache.close(live)
