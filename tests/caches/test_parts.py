"""A cache made of parts (jax_tpusync.caches.parts): all or none, one prefix, one rule for the
head shards of a mesh slot and the layer groups of a hybrid model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.caches import parts

ARGS = dict(num_layers=2, batch=2, max_len=32, block_tokens=8, dtype=jnp.float32)


class FakePart:
    """A part that maps at most ``held`` prefix tokens (less after ``loses`` tries), or
    refuses every reservation."""

    def __init__(self, held: int, refuses: bool = False, loses: dict | None = None):
        self.held, self.refuses, self.loses = held, refuses, dict(loses or {})
        self.reserved: list[int] = []
        self.tries = 0

    def reserve(self, cap):
        self.tries += 1
        self.held = self.loses.get(self.tries, self.held)
        if self.refuses:
            raise ValueError("the last part refuses")
        cached = self.held if cap is None else min(self.held, cap)
        self.reserved.append(cached)
        return cached

    def cancel(self, cached):
        self.reserved.remove(cached)


def _reserve_all(fakes):
    return lambda cap: parts.each_or_none(fakes, lambda p: p.reserve(cap), FakePart.cancel)


def _cancel_all(fakes):
    return lambda done: [p.cancel(r) for p, r in zip(fakes, done)]


def test_each_or_none_undoes_the_parts_done_when_the_last_refuses():
    fakes = [FakePart(8), FakePart(8), FakePart(8, refuses=True)]
    undone = []
    with pytest.raises(ValueError, match="the last part refuses"):
        parts.each_or_none(fakes, lambda p: p.reserve(None), lambda p, r: undone.append(p))
    assert undone == [fakes[1], fakes[0]]  # Last first.


def test_reserve_agreed_maps_the_prefix_every_part_holds():
    fakes = [FakePart(16), FakePart(8), FakePart(24)]
    done = parts.reserve_agreed(_reserve_all(fakes), _cancel_all(fakes), lambda c: c)
    assert list(done) == [8, 8, 8] and [f.reserved for f in fakes] == [[8], [8], [8]]
    capped = [FakePart(16), FakePart(24)]
    done = parts.reserve_agreed(_reserve_all(capped), _cancel_all(capped), lambda c: c, 4)
    assert list(done) == [4, 4]


def test_reserve_agreed_keeps_trying_while_a_part_loses_blocks_between_tries():
    """A store that loses a block between two tries (an eviction, a network level's miss)
    costs another try, not a refusal: each try maps less, down to what all hold."""
    fakes = [FakePart(24), FakePart(16, loses={2: 8, 3: 0})]
    done = parts.reserve_agreed(_reserve_all(fakes), _cancel_all(fakes), lambda c: c)
    assert list(done) == [0, 0] and [f.reserved for f in fakes] == [[0], [0]]


def test_reserve_agreed_refuses_a_part_that_ignores_its_cap():
    class Greedy(FakePart):
        def reserve(self, cap):
            return FakePart.reserve(self, None)

    fakes = [FakePart(8), Greedy(16)]
    with pytest.raises(RuntimeError, match=r"mapped 16 prefix tokens past its cap of 8"):
        parts.reserve_agreed(_reserve_all(fakes), _cancel_all(fakes), lambda c: c)
    assert [f.reserved for f in fakes] == [[], []]  # Nothing stays reserved.


def _mesh_cache():
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    return tps.ShardedKVCache(mesh=mesh, kv_heads_axis="model", num_kv_heads=2, head_dim=4, **ARGS)


def _hybrid_cache():
    return tps.HybridKVCache(
        num_kv_heads=[2, 2], head_dim=[4, 4], sliding_window=[8, None], max_step_tokens=4, **ARGS
    )


def _refuse_in_the_last_part(cache, monkeypatch):
    """Replaces the last part's reservation by one that refuses; returns the parts' slot
    tables (what an admission changes)."""

    def refuse(*args, **kwargs):
        raise ValueError("the last part refuses")

    if isinstance(cache, tps.ShardedKVCache):
        tables = [c.slots for c in cache.shards.values()]
        monkeypatch.setattr(tables[-1], "admit", refuse)
    else:
        tables = [g.slots for g in cache.groups]
        monkeypatch.setattr(cache.groups[-1], "reserve", refuse)
    return tables


@pytest.mark.parametrize("make", [_mesh_cache, _hybrid_cache], ids=["mesh", "hybrid"])
def test_a_refusal_in_the_last_part_leaves_every_part_as_it_was(make, monkeypatch):
    """The same all-or-none result on a mesh (head shards) and a hybrid model (layer
    groups): the admission raises the last part's refusal, no part keeps the slot or a
    block, the state is as it was, and the next admission succeeds."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    with make() as cache:
        state = cache.init(admit=False)
        tables = _refuse_in_the_last_part(cache, monkeypatch)
        free = [t.free_blocks for t in tables]
        with pytest.raises(ValueError, match="the last part refuses"):
            cache.admit(state, 1, max_tokens=16, tokens=np.arange(10))
        assert [t.free_blocks for t in tables] == free
        assert all(not t.capacity.any() for t in tables)
        np.testing.assert_array_equal(cache.lengths(state), [0, 0])
        monkeypatch.undo()
        state, cached = cache.admit(state, 1, max_tokens=16, tokens=np.arange(10))
        assert cached == 0 and cache.capacity[1] == 16
