"""The README's Flax (Linen, NNX) and Equinox recipes run, agree with each other and with
``resident_attention``, and Linen's ``model.init`` writes nothing to the tier."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

pytest.importorskip("flax")
pytest.importorskip("equinox")

_PATH = Path(__file__).resolve().parents[2] / "examples" / "framework_recipes.py"
_spec = importlib.util.spec_from_file_location("framework_recipes", _PATH)
recipes = importlib.util.module_from_spec(_spec)
sys.modules["framework_recipes"] = recipes  # Its dataclasses look their module up.
_spec.loader.exec_module(recipes)

STEPS = 3


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, recipes.D_MODEL)), jnp.float32)


def _resident(params, x, steps):
    """The Linen stack's math with resident_attention over device arrays."""
    r = recipes
    batch = x.shape[0]
    caches = [
        (jnp.zeros((batch, 64, r.KV_HEADS, r.HEAD_DIM)), jnp.zeros((batch, 64, r.KV_HEADS, r.HEAD_DIM)))
        for _ in range(r.LAYERS)
    ]
    lengths = jnp.zeros((batch,), jnp.int32)
    ys = []
    for _ in range(steps):
        h = x
        for i in range(r.LAYERS):
            p = {n: jnp.asarray(params[f"layer_{i}"][n]["kernel"]) for n in "qkvo"}
            q, k, v = (r._heads(h @ p[n], hn) for n, hn in (("q", r.Q_HEADS), ("k", r.KV_HEADS), ("v", r.KV_HEADS)))
            out, ck, cv = tps.resident_attention(q, k, v, *caches[i], lengths)
            caches[i] = (ck, cv)
            h = h + out.reshape(*h.shape[:2], -1) @ p["o"]
        lengths = lengths + 1
        ys.append(np.asarray(h))
        x = h
    return ys


def test_linen_init_writes_nothing_and_decode_matches_resident():
    with recipes.new_cache() as cache:
        before = cache.engine.stats()["tiers"][cache.tier]["write_back"]["bytes"]
        model = recipes.linen_model()
        model.init(__import__("jax").random.key(0), _x(), cache.inert_state())
        cache.engine.drain()
        assert cache.engine.stats()["tiers"][cache.tier]["write_back"]["bytes"] == before == 0
        ys, state, params = recipes.linen_decode(cache, _x(), STEPS)
        assert np.asarray(state.lengths).tolist() == [STEPS, STEPS]
    want = _resident(params, _x(), STEPS)
    # Logits reach 14: float32 summed in another order (the host tier is attended to in
    # place) differs by about 1e-6 of them.
    for got, ref in zip(ys, want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["linen_collection_decode", "nnx_decode", "equinox_decode"])
def test_every_recipe_matches_linen(recipe):
    with recipes.new_cache() as cache:
        linen, _, params = recipes.linen_decode(cache, _x(), STEPS)
    with recipes.new_cache() as cache:
        ys, state = getattr(recipes, recipe)(cache, _x(), STEPS, params)
        assert np.asarray(state.lengths).tolist() == [STEPS, STEPS]
        stats = cache.engine.stats()  # Every unit through the engine: read in place here.
        assert stats["in_place_reads"] + stats["prefetch_hits"] > 0
    for got, ref in zip(ys, linen):
        np.testing.assert_allclose(got, ref, atol=1e-6)
