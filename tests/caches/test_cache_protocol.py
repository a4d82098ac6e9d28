"""Every cache keeps one protocol (jax_tpusync.caches.protocol.KVCache): the same calls, the
same parameter names, the same meaning of a refusal, of admit's result and of lengths()."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.caches import protocol as cache_protocol
from jax_tpusync.caches.protocol import KVCache

CLASSES = (
    tps.OffloadedKVCache,
    tps.ShardedKVCache,
    tps.HybridKVCache,
    tps.HostPoolKVCache,
    tps.BatchShardedPoolKVCache,
)
ARGS = dict(num_layers=2, batch=2, max_len=32, block_tokens=8, dtype=jnp.float32)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_class_keeps_the_protocols_calls_and_parameter_names(cls):
    assert cache_protocol.mismatches(cls) == []


def test_the_check_finds_a_renamed_a_missing_and_a_reordered_parameter():
    class Drifted(tps.OffloadedKVCache):
        def cancel(self, admission):  # Renamed.
            pass

        def lengths(self):  # A parameter missing.
            pass

        def read(self, state, layer, start=0, slot=0, stop=None, *, raw=False):  # Reordered.
            pass

        def tokens(self, slot, extra):  # An extra parameter without a default.
            pass

    problems = "\n".join(cache_protocol.mismatches(Drifted))
    assert "Drifted.cancel: parameter 1 is admission" in problems
    assert "Drifted.lengths: parameter 1 is missing, KVCache has state" in problems
    assert "Drifted.read: parameter 3 is start" in problems
    assert "Drifted.tokens: extra parameter extra has no default" in problems
    del Drifted.lengths  # Back to its base's: the check names the others only.
    assert "lengths" not in "\n".join(cache_protocol.mismatches(Drifted))


def _offloaded():
    return tps.OffloadedKVCache(num_kv_heads=2, head_dim=4, **ARGS)


def _hybrid():
    return tps.HybridKVCache(
        num_kv_heads=[2, 2], head_dim=[4, 4], sliding_window=[8, None], max_step_tokens=4, **ARGS
    )


def _sharded():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    return tps.ShardedKVCache(mesh=mesh, kv_heads_axis="model", num_kv_heads=2, head_dim=4, **ARGS)


@pytest.mark.parametrize("make", [_offloaded, _sharded, _hybrid], ids=["one", "mesh", "hybrid"])
def test_every_cache_is_a_kvcache_and_answers_alike(make):
    """The same calls on every cache: isinstance of the protocol, lengths() after admit and
    load, refused admits (an active slot, a state that is not this cache's) that change
    nothing, and a release."""
    with make() as cache:
        assert isinstance(cache, KVCache)
        state = cache.init(admit=False)
        np.testing.assert_array_equal(cache.lengths(state), [0, 0])
        assert cache.lengths(state).dtype == np.int32
        state, cached = cache.admit(state, 1, max_tokens=16, tokens=np.arange(10))
        assert cached == 0
        rows = np.ones((5, 2, 4), np.float32)
        for layer in range(2):  # A length counts the rows every layer holds.
            state = cache.load(state, layer, rows, rows, slot=1)
        np.testing.assert_array_equal(cache.lengths(state), [0, 5])
        before = cache.capacity
        with pytest.raises(ValueError, match="active"):
            cache.admit(state, 1, max_tokens=16)
        np.testing.assert_array_equal(cache.capacity, before)
        # Not a state, or another cache's of the same structure: refused before any slot
        # table (any shard's, any group's) reserves.
        with pytest.raises((TypeError, ValueError), match=r"expected a \w+State"):
            cache.admit("not a state", 0, max_tokens=16)
        with make() as other:
            with pytest.raises(ValueError, match="belongs to another cache"):
                cache.admit(other.init(admit=False), 0, max_tokens=16)
        np.testing.assert_array_equal(cache.capacity, before)
        np.testing.assert_array_equal(cache.lengths(state), [0, 5])
        k, _ = cache.read(state, 0, 1)
        np.testing.assert_array_equal(k, rows)
        state = cache.release(state, 1)
        np.testing.assert_array_equal(cache.lengths(state), [0, 0])
        assert cache.kv_bytes > 0 and cache.committed_lengths is None
