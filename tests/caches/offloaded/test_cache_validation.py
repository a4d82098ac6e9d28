"""Argument validation of OffloadedKVCache and prefetching_attention, each guard at its edge:
the largest accepted value works, one more is refused with a message naming the argument."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_tpusync.kernels import reference as kref

import jax_tpusync as tps
from jax_tpusync.caches.offloaded.cache import MAX_PREFETCH_DEPTH
from jax_tpusync.core.state import NO_WINDOW
from jax_tpusync.step import plan

XlaError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
INT32_MAX = 2**31 - 1
BASE = dict(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=8)


def _cache(**kwargs) -> tps.OffloadedKVCache:
    # The streamed path (staging units, prefetches) unless a test asks for in-place reads.
    return tps.OffloadedKVCache(**{**BASE, "dtype": jnp.float32, "read_in_place": False, **kwargs})


def _kv(n, dtype=np.float32, batch=1, heads=1, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, n, heads, dim)).astype(dtype)


def _step(layer=0):
    return jax.jit(functools.partial(tps.prefetching_attention, layer=layer), donate_argnums=(3,))


# -- A. dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache_dtype,src",
    [
        (jnp.bfloat16, np.float32),  # Rounds.
        (jnp.float32, np.float64),  # 1e300 would become inf.
        (jnp.float32, np.int8),  # Quantized data, not KV.
        (jnp.float32, np.complex64),
        (jnp.bfloat16, np.float16),
        (jnp.float16, jnp.bfloat16),
    ],
)
@pytest.mark.parametrize("bad", ["k", "v"])
def test_load_refuses_inexact_dtypes(cache_dtype, src, bad):
    with _cache(dtype=cache_dtype) as cache:
        good = _kv(4, cache_dtype)
        wrong = _kv(4, np.float32).astype(src)
        k, v = (wrong, good) if bad == "k" else (good, wrong)
        src_name, dst_name = np.dtype(src).name, np.dtype(cache_dtype).name
        with pytest.raises(
            ValueError,
            match=rf"{bad} has dtype {src_name} but the cache holds {dst_name}.*"
            rf"{bad}\.astype\({dst_name}\)",
        ):
            cache.load(cache.init(), 0, k, v)


def test_load_refuses_float64_that_would_overflow():
    with _cache() as cache:
        kv = np.full((1, 2, 1, 8), 1e300)
        with pytest.raises(ValueError, match="k has dtype float64 but the cache holds float32"):
            cache.load(cache.init(), 0, kv, kv)


@pytest.mark.parametrize("src", [jnp.bfloat16, np.float16, np.float32])
def test_load_converts_exact_dtypes(src):
    """bfloat16 and float16 go into a float32 cache exactly; the tier holds their values."""
    with _cache() as cache:
        kv = _kv(5).astype(src)
        state = cache.load(cache.init(), 0, kv, kv)
        k, v = cache.read_all(0, [5])
        np.testing.assert_array_equal(k[:, :5], kv.astype(np.float32))
        np.testing.assert_array_equal(v[:, :5], kv.astype(np.float32))
        assert int(state.lengths[0]) == 5


@pytest.mark.parametrize("bad", ["k", "v"])
def test_attention_refuses_float32_kv_into_a_bfloat16_cache(bad):
    with _cache(dtype=jnp.bfloat16) as cache:
        state = cache.init()
        q = jnp.zeros((1, 1, 1, 8), jnp.bfloat16)
        good = jnp.zeros((1, 1, 1, 8), jnp.bfloat16)
        wrong = jnp.zeros((1, 1, 1, 8), jnp.float32)
        k, v = (wrong, good) if bad == "k" else (good, wrong)
        with pytest.raises(
            ValueError,
            match=rf"{bad} has dtype float32 but the cache holds bfloat16.*"
            rf"{bad}\.astype\(bfloat16\)",
        ):
            jax.jit(functools.partial(tps.prefetching_attention, layer=0))(q, k, v, state)


def test_attention_converts_bfloat16_kv_into_a_float32_cache_exactly():
    """Exact conversions stay implicit: the output is the one of the same values in f32."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
    k16 = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.bfloat16)
    v16 = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.bfloat16)
    outs = []
    for k, v in ((k16, v16), (k16.astype(jnp.float32), v16.astype(jnp.float32))):
        with _cache() as cache:
            ctx = _kv(3, seed=2)
            state = cache.load(cache.init(), 0, ctx, ctx)
            out, state = _step()(q, k, v, state)
            outs.append(np.asarray(out))
            cache.drain(state)
            written, _ = cache.read_all(0, [4])
            np.testing.assert_array_equal(written[0, 3], np.asarray(k16[0, 0], np.float32))
    # Different programs (a convert in one), so float32 rounding rather than equality.
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


# -- B. load() and lengths -------------------------------------------------------------------


def _lengths(state) -> list[int]:
    return np.asarray(state.lengths).tolist()


def test_load_after_decode_never_shrinks_lengths():
    """Patching rows of every layer of a context that decode extended leaves its length."""
    with _cache(num_layers=2, batch=2, max_len=64) as cache:
        state = cache.init()
        for layer in range(2):
            state = cache.load(state, layer, *([_kv(20, batch=2)] * 2))
        assert _lengths(state) == [20, 20]
        q = jnp.zeros((2, 1, 1, 8), jnp.float32)
        kv = jnp.ones((2, 1, 1, 8), jnp.float32)
        for layer in range(2):
            _, state = _step(layer)(q, kv, kv, state)
        assert _lengths(state) == [21, 21]
        state = cache.load(state, 0, *([_kv(10, batch=2, seed=3)] * 2))
        assert _lengths(state) == [21, 21]
        state = cache.load(state, 1, *([_kv(10, batch=2, seed=4)] * 2))
        assert _lengths(state) == [21, 21]  # Was reset to 10 before.
        cache.drain(state)


def test_load_after_init_with_lengths_never_shrinks_them():
    with _cache(num_layers=2, batch=2, max_len=2048) as cache:
        state = cache.init(lengths=[1505, 7])
        for layer in range(2):
            state = cache.load(state, layer, *([_kv(10, batch=2)] * 2))
        assert _lengths(state) == [1505, 10]


def test_lengths_grow_to_what_every_layer_holds():
    """A length becomes the position every layer has been loaded up to, at that edge."""
    with _cache(num_layers=2, batch=1, max_len=64) as cache:
        state = cache.init()
        state = cache.load(state, 0, *([_kv(30)] * 2))
        assert _lengths(state) == [0]  # Layer 1 holds nothing yet.
        state = cache.load(state, 1, *([_kv(20)] * 2))
        assert _lengths(state) == [20]
        state = cache.load(state, 1, *([_kv(9)] * 2), start=20)
        assert _lengths(state) == [29]  # Layer 1 up to 29, layer 0 up to 30.
        state = cache.load(state, 1, *([_kv(1)] * 2), start=29)
        assert _lengths(state) == [30]
        state = cache.load(state, 1, *([_kv(1)] * 2), start=30)
        assert _lengths(state) == [30]  # Layer 0 still ends at 30.


def test_load_of_zero_rows_leaves_that_sequence():
    with _cache(num_layers=2, batch=2, max_len=64) as cache:
        state = cache.init()
        for layer in range(2):
            state = cache.load(state, layer, *([_kv(50, batch=2)] * 2), lengths=[0, 50])
        assert _lengths(state) == [0, 50]
        state = cache.init(lengths=[5, 0])
        for layer in range(2):
            state = cache.load(
                state, layer, *([_kv(50, batch=2)] * 2), start=[9, 0], lengths=[0, 50]
            )
        assert _lengths(state) == [5, 50]


def test_init_forgets_what_load_wrote():
    with _cache(num_layers=2, max_len=64) as cache:
        state = cache.load(cache.init(), 0, *([_kv(10)] * 2))
        state = cache.init()
        state = cache.load(state, 1, *([_kv(10)] * 2))
        assert _lengths(state) == [0]  # Layer 0's load belongs to the earlier state.


# -- C. prefetch_depth -----------------------------------------------------------------------


def _advance_unrolled(spec, layer, chunk, lengths, q_len: int):
    """The walk as it was: a trace-time loop of prefetch_depth iterations (the reference)."""
    cur_layer = jnp.asarray(layer, jnp.int32)
    l, c = cur_layer, jnp.asarray(chunk, jnp.int32)
    lens = lengths
    next_step = jnp.bool_(False)
    for _ in range(spec.prefetch_depth):
        wrap_chunk = c + 1 >= plan.num_units(spec, l, lens)
        c = jnp.where(wrap_chunk, 0, c + 1)
        l = jnp.where(wrap_chunk, l + 1, l)
        wrap_layer = l >= spec.num_layers
        l = jnp.where(wrap_layer, 0, l)
        lens = jnp.where(wrap_layer & ~next_step, lengths + q_len, lens)
        next_step = next_step | wrap_layer
    ok = ~next_step | (l <= cur_layer)
    if not spec.prefetch_across_steps:
        ok = ~next_step
    return l, c, lens, ok


@pytest.fixture(scope="module")
def base_spec():
    with _cache(num_layers=1, batch=2, max_len=64) as cache:
        return cache.spec


WALK_CASES = [
    # (windows, chunk_len, depths, across); depths past the units of a step wrap twice.
    ((None,), 8, (1, 2, 3, 9), True),
    ((None, 5, None), 8, (1, 2, 4, 7), True),
    ((None, 5, None), 3, (1, 2, 5, 11), False),
    ((4, 4), 1, (1, 2, 3, 6, 12), True),
    ((None, None, 2, None, 9), 4, (1, 3, 8), True),
    ((None, 64), 64, (1, 2, 3, 5), True),
]


@pytest.mark.parametrize("windows,chunk_len,depths,across", WALK_CASES)
def test_advance_matches_the_unrolled_walk(base_spec, windows, chunk_len, depths, across):
    """The closed-form walk gives the old unrolled walk's (layer, chunk, lengths, ok) on
    random lengths, every layer and every chunk of it (and one past), for q_len 1 and 3."""
    rng = np.random.default_rng(len(windows) * 100 + chunk_len)
    num_layers = len(windows)
    for depth, q_len in itertools.product(depths, (1, 3)):
        spec = dataclasses.replace(
            base_spec,
            num_layers=num_layers,
            windows=tuple(windows),
            chunk_len=chunk_len,
            prefetch_depth=depth,
            prefetch_across_steps=across,
        )
        n = 64
        lengths = rng.integers(0, spec.max_len - q_len + 1, size=(n, spec.batch)).astype(np.int32)
        lengths[:4] = [[0, 0], [spec.max_len - q_len] * 2, [chunk_len, 0], [1, chunk_len * 2]]
        layers = rng.integers(0, num_layers, size=n).astype(np.int32)
        units = np.asarray(
            jax.vmap(lambda l, lens: plan.num_units(spec, l, lens))(layers, lengths)
        )
        chunks = (rng.integers(0, 1 << 20, size=n) % (units + 1)).astype(np.int32)

        def both(layer, chunk, lens, spec=spec, q_len=q_len):
            return (
                plan.advance(spec, layer, chunk, lens, q_len),
                _advance_unrolled(spec, layer, chunk, lens, q_len),
            )

        new, old = jax.jit(jax.vmap(both))(layers, chunks, lengths)
        for name, got, want in zip(("layer", "chunk", "lengths", "ok"), new, old):
            np.testing.assert_array_equal(
                np.asarray(got), np.asarray(want), err_msg=f"{name}, depth={depth}"
            )


def test_units_per_layer_matches_num_units(base_spec):
    spec = dataclasses.replace(base_spec, num_layers=3, windows=(None, 5, 1), chunk_len=4)
    for lengths in ([0, 0], [1, 9], [63, 17], [64, 64]):
        lens = jnp.asarray(lengths, jnp.int32)
        got = plan.units_per_layer(spec, lens)
        want = [int(plan.num_units(spec, layer, lens)) for layer in range(3)]
        assert np.asarray(got).tolist() == want


def test_prefetch_depth_is_bounded():
    for depth in (1, MAX_PREFETCH_DEPTH):
        # Two rows per slot (of K, V x 32 bytes): eight tokens take four units.
        with _cache(prefetch_depth=depth, staging_bytes=(depth + 1) * 2 * 32 * 2) as cache:
            assert cache.spec.chunk_len == 2
            assert cache.spec.num_slots == depth + 1
    for depth in (0, MAX_PREFETCH_DEPTH + 1, 1000, 2.0, True):
        with pytest.raises(
            ValueError, match=rf"prefetch_depth={depth!r} must be an int in \[1, 64\]"
        ):
            _cache(prefetch_depth=depth)


@pytest.mark.parametrize(
    "where, depth", [(dict(), 1), (dict(tier="file"), 3), (dict(spill_path=True), 3)]
)
def test_auto_prefetch_depth_is_one_on_a_host_tier_and_three_from_a_file(tmp_path, where, depth):
    where = {k: tmp_path if v is True else v for k, v in where.items()}
    if where.get("tier") == "file":
        where["path"] = tmp_path
    # Room for 4 slots of 2 tokens, so that the depth is not cut to the layers' units.
    with _cache(prefetch_depth="auto", staging_bytes=4 * 2 * 32 * 2, **where) as cache:
        assert cache.spec.prefetch_depth == depth and cache.spec.num_slots == depth + 1
    with pytest.raises(
        ValueError, match=r"prefetch_depth='deep' must be an int in \[1, 64\] or 'auto'"
    ):
        _cache(prefetch_depth="deep")


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_single_unit_layers_prefetch_at_most_one_step_ahead(depth):
    """Every layer in one unit: a depth past num_layers (2) would fetch for the step after
    next and miss every time; the cache keeps num_layers and its prefetches hit."""
    with _cache(num_layers=2, prefetch_depth=depth, staging_bytes=1 << 20) as cache:
        assert cache.spec.single_unit
        assert cache.spec.prefetch_depth == min(depth, 2)
        assert cache.spec.num_slots == cache.spec.prefetch_depth + 1
        state = cache.load(cache.init(), 0, _kv(5), _kv(5))
        state = cache.load(state, 1, _kv(5, seed=1), _kv(5, seed=1))

        def step(state):
            x = jnp.ones((1, 1, 1, 8), jnp.float32)
            for layer in range(2):
                _, state = tps.prefetching_attention(x, x, x, state, layer=layer)
            return state

        step = jax.jit(step, donate_argnums=(0,))
        cache.engine.reset_stats()
        for _ in range(3):
            state = step(state)
        state = cache.drain(state)
        stats = cache.engine.stats()
        # Depth 1: the first step's layer 0 waits for its own fetch; deeper, one more.
        assert stats["prefetch_hits"] >= 6 - cache.spec.prefetch_depth
        assert stats["prefetch_misses"] <= cache.spec.prefetch_depth


def test_staging_must_hold_one_token_row_per_slot():
    """At least one row per slot: 2 slots x K, V x 32 bytes = 128 bytes, one less refused."""
    with _cache(prefetch_depth=1, staging_bytes=128) as cache:
        assert cache.spec.chunk_len == 1
    with pytest.raises(ValueError, match="staging_bytes=127 cannot hold one token per slot"):
        _cache(prefetch_depth=1, staging_bytes=127)


def test_the_largest_depth_compiles_in_seconds_and_matches_resident():
    """prefetch_depth=64 over 3 layers of 8-token units: compiles in seconds (the unrolled
    walk took 27.6 s at depth 50) and decodes the resident model's answer."""
    layers, max_len, n = 3, 256, 200
    rng = np.random.default_rng(7)
    ck = rng.standard_normal((layers, 1, max_len, 1, 8)).astype(np.float32)
    cv = rng.standard_normal((layers, 1, max_len, 1, 8)).astype(np.float32)
    row = 8 * 4
    staging = (MAX_PREFETCH_DEPTH + 1) * 2 * 8 * row  # 8-token units.
    with _cache(
        num_layers=layers, max_len=max_len, prefetch_depth=MAX_PREFETCH_DEPTH, staging_bytes=staging
    ) as cache:
        assert cache.spec.chunk_len == 8
        state = cache.init()
        for layer in range(layers):
            state = cache.load(state, layer, ck[layer, :, :n], cv[layer, :, :n])
        q = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)

        def step(q, k, state):
            outs = []
            for layer in range(layers):
                o, state = tps.prefetching_attention(q, k, k, state, layer=layer)
                outs.append(o)
            return outs, state

        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(2,)).lower(q, k, state).compile()
        seconds = time.perf_counter() - t0
        print(f"prefetch_depth={MAX_PREFETCH_DEPTH}: traced and compiled in {seconds:.2f} s")
        assert seconds < 30, seconds  # Generous: CI machines are shared.
        outs, state = compiled(q, k, state)
        for layer in range(layers):
            full_k = np.concatenate([ck[layer, :, :n], np.asarray(k)], axis=1)
            full_v = np.concatenate([cv[layer, :, :n], np.asarray(k)], axis=1)
            want = kref.attention_reference(
                q,
                jnp.asarray(full_k),
                jnp.asarray(full_v),
                jnp.asarray([n]),
                jnp.asarray([n + 1]),
                scale=1 / np.sqrt(8),
            )
            np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(want), atol=1e-5)
        assert cache.engine.stats()["prefetch_hits"] > 0
        cache.drain(state)


# -- D. ranges named in messages ---------------------------------------------------------------

# One layer, one sequence, 4-byte rows: the smallest tier rows, so max_len reaches int32.
TINY = dict(num_layers=1, batch=1, num_kv_heads=1, head_dim=1, dtype=jnp.float32)


def test_max_len_past_int32_is_refused():
    with pytest.raises(ValueError, match=r"max_len=2147483648 must be at most 2\*\*31 - 1"):
        tps.OffloadedKVCache(**TINY, max_len=2**31)


def test_num_blocks_at_the_tier_block_bound():
    """The cache's last tier block index, first_block + 2 * num_layers * num_blocks, must
    stay below 2**31 - 1 (the sentinel of a traced layer out of range). At the edge a step
    reads and writes the very last block (V of the last layer), and its neighbour in K is
    unchanged."""
    top = (2**31 - 2) // 2
    small = dict(TINY, max_len=4, block_tokens=2, sliding_window=2)
    with pytest.raises(ValueError, match=rf"the cache needs {2 * top + 2} tier blocks from block 0"):
        tps.OffloadedKVCache(**small, num_blocks=top + 1)
    with tps.OffloadedKVCache(**small, num_blocks=top) as cache:
        assert cache.first_block + 2 * cache.spec.num_blocks == 2**31 - 2
        # Point the slot at the last physical block (K: tier block top - 1, V: 2 * top - 1),
        # as an allocator that handed out everything else would.
        cache.slots.place(0, [top - 1], 2)
        state = cache.init(lengths=[0], admit=False)
        ctx = np.asarray([[[1.5]]], np.float32)
        state = cache.load(state, 0, ctx[None], -ctx[None])
        assert _lengths(state) == [1]
        q = jnp.ones((1, 1, 1, 1), jnp.float32)
        k = jnp.full((1, 1, 1, 1), 0.5, jnp.float32)
        v = jnp.full((1, 1, 1, 1), 2.0, jnp.float32)
        out, state = _step()(q, k, v, state)
        assert _lengths(state) == [2]
        want = kref.attention_reference(
            q,
            jnp.asarray([[[[1.5]], [[0.5]]]]),
            jnp.asarray([[[[-1.5]], [[2.0]]]]),
            jnp.asarray([1]),
            jnp.asarray([2]),
            scale=1.0,
        )
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6)
        state = cache.drain(state)
        got_k, got_v = cache.read(state, 0, 0)
        np.testing.assert_array_equal(got_k.ravel(), [1.5, 0.5])
        np.testing.assert_array_equal(got_v.ravel(), [-1.5, 2.0])


def test_max_len_at_the_unit_count_bound():
    """A global layer counts units as (span + chunk_len - 1) // chunk_len: with 1024-token
    units that fits int32 up to max_len = 2**31 - 1024."""
    top = 2**31 - 1024
    staging = 2 * 2 * 4 * 1024  # Two slots of 1024 4-byte rows of K and V.
    with pytest.raises(ValueError, match=rf"max_len={top + 1} is too large for a layer that reads"):
        tps.OffloadedKVCache(**TINY, max_len=top + 1, staging_bytes=staging)
    with tps.OffloadedKVCache(**TINY, max_len=top, staging_bytes=staging) as cache:
        assert cache.spec.chunk_len == 1024
        units = plan.num_units(cache.spec, 0, jnp.asarray([top], jnp.int32))
        assert int(units) == top // 1024
        state = cache.load(cache.init(), 0, np.ones((1, 3, 1, 1), np.float32), np.ones((1, 3, 1, 1), np.float32))
        out, state = _step()(jnp.ones((1, 1, 1, 1)), jnp.ones((1, 1, 1, 1)), jnp.ones((1, 1, 1, 1)), state)
        np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)
        assert _lengths(state) == [4]
        cache.drain(state)


def test_engine_must_be_an_engine_or_a_config():
    with pytest.raises(TypeError, match="engine must be an Engine, an EngineConfig or None; got str"):
        _cache(engine="foo")
    with _cache(engine=tps.EngineConfig()) as cache:
        assert cache.engine.id > 0


@pytest.mark.parametrize("value", [0, -1, 2**31, 1.5e6, True, "1M"])
def test_staging_bytes_range(value):
    with pytest.raises(
        ValueError, match=rf"staging_bytes={value!r} must be an int in \[1, 2\*\*31 - 1\]"
    ):
        _cache(staging_bytes=value)


def test_staging_bytes_largest_accepted():
    with _cache(staging_bytes=2**31 - 1) as cache:
        assert cache.spec.chunk_len == BASE["max_len"]  # No more than a layer holds.
        assert cache.spec.device_bytes < 1 << 20


@pytest.mark.parametrize("name", ["num_layers", "batch", "max_len", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_shape_arguments_are_positive_ints(name, value):
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be a positive int"):
        _cache(**{name: value})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tier="file"), "tier='file' needs path=<directory>"),
        (dict(tier="host", path="/tmp"), "path and file_name apply to tier='file' only"),
        (dict(file_name="kv"), "path and file_name apply to tier='file' only"),
        (dict(tier="file", path="/tmp", shm_name="x"), "shm_name applies to tier='host' only"),
        (dict(tier="ssd"), "tier='ssd' must be 'host' or 'file'"),
        (dict(dtype=np.float64), "dtype=float64 must be bfloat16, float16 or float32"),
    ],
)
def test_tier_and_path_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _cache(**kwargs)


@pytest.mark.parametrize(
    "window,match",
    [
        (0, r"sliding window 0 of layer 0 must be None or an int in \[1, 2\*\*31 - 1\]"),
        (2**31, r"sliding window 2147483648 of layer 0 must be None or an int in"),
        ([4, 2.5], r"sliding window 2.5 of layer 1 must be"),
        (True, r"sliding_window=True must be None, an int or a sequence"),
        ([None, False], r"sliding window False of layer 1 must be"),
        ("4", r"sliding_window='4' must be None, an int or a sequence"),
    ],
)
def test_sliding_window_range(window, match):
    layers = 2 if isinstance(window, list) else 1
    with pytest.raises(ValueError, match=match):
        _cache(num_layers=layers, sliding_window=window)


@pytest.mark.parametrize("window", [1, 2**31 - 1])
def test_sliding_window_edges_decode(window):
    """The smallest and the largest window run a step (the largest is global here)."""
    with _cache(sliding_window=window) as cache:
        ctx = _kv(3)
        state = cache.load(cache.init(), 0, ctx, ctx)
        q = jnp.asarray(_kv(1, seed=5)).reshape(1, 1, 1, 8)
        out, state = _step()(q, q, q, state)
        full = np.concatenate([ctx, np.asarray(q)], axis=1)
        want = kref.attention_reference(
            q,
            jnp.asarray(full),
            jnp.asarray(full),
            jnp.asarray([3]),
            jnp.asarray([4]),
            scale=1 / np.sqrt(8),
            window=None if window > NO_WINDOW else window,
        )
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
        cache.drain(state)


def test_read_validates_lengths():
    with _cache() as cache:
        kv = _kv(8)
        cache.load(cache.init(), 0, kv, kv)
        k, _ = cache.read_all(0, [8])  # max_len: the largest accepted.
        np.testing.assert_array_equal(k, kv)
        for lengths in ([9], [-1]):
            with pytest.raises(ValueError, match=r"lengths must be in \[0, max_len=8\]"):
                cache.read_all(0, lengths)
        with pytest.raises(ValueError, match=r"lengths must be an int or 1 ints"):
            cache.read_all(0, [1, 2])
        with pytest.raises(ValueError, match="lengths must hold ints"):
            cache.read_all(0, [1.5])
        with pytest.raises(ValueError, match="layer=1 is out of range"):
            cache.read_all(1)


def test_load_start_and_lengths_name_the_slot():
    with _cache(batch=2) as cache:
        kv = _kv(4, batch=2)
        state = cache.load(cache.init(), 0, kv, kv, start=[0, 4])  # Up to max_len exactly.
        assert _lengths(state) == [4, 8]
        with pytest.raises(ValueError, match=r"start=-1 of slot 1 must be >= 0"):
            cache.load(cache.init(), 0, kv, kv, start=[0, -1])
        with pytest.raises(
            ValueError, match=r"start \+ lengths = 9 of slot 1 would overflow its capacity of 8"
        ):
            cache.load(cache.init(), 0, kv, kv, start=[0, 5])
        with pytest.raises(ValueError, match=r"start must be an int or 2 ints"):
            cache.load(cache.init(), 0, kv, kv, start=[0, 1, 2])
        with pytest.raises(ValueError, match=r"lengths must be in \[0, n=4\]"):
            cache.load(cache.init(), 0, kv, kv, lengths=[5, 0])
        with pytest.raises(ValueError, match="layer=True is out of range"):
            cache.load(cache.init(), True, kv, kv)


@pytest.mark.parametrize("bad_layer", [-1, 1])
def test_traced_layer_out_of_range_is_refused_by_name(bad_layer):
    """A traced layer is checked where the step runs: its write-back addresses no region,
    before anything is queued; the engine keeps working."""
    with _cache(max_len=16) as cache:
        fn = jax.jit(tps.prefetching_attention, donate_argnums=(3,))
        q = jnp.ones((1, 1, 1, 8), jnp.float32)
        with pytest.raises(XlaError, match=r"addresses region \d+ of 2 \(layer out of range\?\)"):
            out, _ = fn(q, q, q, cache.init(lengths=[3]), layer=jnp.int32(bad_layer))
            jax.block_until_ready(out)
        # The largest accepted traced layer (0) runs, and nothing of the bad call landed.
        out, state = fn(q, q, q, cache.init(lengths=[3]), layer=jnp.int32(0))
        assert _lengths(state) == [4]
        cache.drain(state)
        k, _ = cache.read_all(0, [4])
        np.testing.assert_array_equal(k[0, :3], 0)
        np.testing.assert_array_equal(k[0, 3], 1)


# -- read_in_place -------------------------------------------------------------------------------


def test_read_in_place_auto_applies_where_it_can(tmp_path):
    """``"auto"`` (the default) reads a host tier of bf16 or f32 rows, or of a bf16 or f32
    cache's quantized rows, in place and anything else through staging."""
    base = {**BASE, "read_in_place": "auto"}
    for dtype, want in ((jnp.bfloat16, True), (jnp.float32, True), (np.float16, False)):
        with tps.OffloadedKVCache(**base, dtype=dtype) as cache:
            assert cache.spec.reads_in_place is want, dtype
        for tier_dtype in ("int8", "float8_e4m3fn"):
            with tps.OffloadedKVCache(**base, dtype=dtype, tier_dtype=tier_dtype) as cache:
                assert cache.spec.reads_in_place is want, (dtype, tier_dtype)
    with tps.OffloadedKVCache(**BASE) as cache:  # The default.
        assert cache.spec.reads_in_place
    landed = [  # Units fetched ahead and attended where they landed.
        dict(tier="file", path=tmp_path),
        dict(tier="file", path=tmp_path, tier_dtype="int8"),
        dict(spill_path=tmp_path, spill_blocks=1),
    ]
    for extra in landed:
        with tps.OffloadedKVCache(**{**base, **extra}) as cache:
            assert cache.spec.reads_in_place and cache.spec.attends_landed, extra
    others = [
        dict(tier="file", path=tmp_path, dtype=np.float16),
        dict(resident=True),
        dict(spill_path=tmp_path, spill_blocks=1, dtype=np.float16),
    ]
    for extra in others:
        with tps.OffloadedKVCache(**{**base, **extra}) as cache:
            assert not cache.spec.reads_in_place, extra


@pytest.mark.parametrize(
    "extra, why",
    [
        (dict(dtype=np.float16), r"dtype=float16 \(rows are read in place as bfloat16 or f"),
        (
            dict(dtype=np.float16, tier_dtype="int8"),
            r"dtype=float16 \(a quantized tier is read in place for bfloat16 or float32\)",
        ),
        (dict(resident=True), r"a resident cache reads no unit at all"),
    ],
)
def test_read_in_place_true_where_it_cannot_apply_is_refused(tmp_path, extra, why):
    extra = dict(extra)
    if extra.get("tier") == "file":
        extra["path"] = tmp_path
    if "spill_blocks" in extra:
        extra["spill_path"] = tmp_path
    with pytest.raises(ValueError, match=r"read_in_place=True cannot apply: " + why):
        _cache(**{"dtype": jnp.float32, **extra, "read_in_place": True})


@pytest.mark.parametrize("bad", ["yes", 1, None, "AUTO"])
def test_read_in_place_takes_true_false_or_auto(bad):
    with pytest.raises(ValueError, match=r"read_in_place=.* must be True, False or 'auto'"):
        _cache(read_in_place=bad)


def test_a_cache_read_in_place_holds_no_staging_and_refuses_pallas():
    """No unit lands on the device: the state's staging has no rows and device_bytes is 0
    (streamed, the same cache takes its budget's slots); the Pallas kernels, which read
    staging, are refused naming the way out."""
    with _cache(read_in_place=True, staging_bytes=4096) as cache:
        assert cache.spec.device_bytes == 0
        state = cache.init()
        assert state.staging.size == 0 and state.staging.shape[3] == 0
        x = jnp.ones((1, 1, 1, 8), jnp.float32)
        refused = r"implementation='pallas' attends over staging.*read_in_place=False"
        with pytest.raises(ValueError, match=refused):
            tps.prefetching_attention(x, x, x, state, layer=0, implementation="pallas")
        out, state = _step()(x, x, x, state)  # The default, "xla", reads in place.
        assert cache.engine.stats()["in_place_reads"] == 1
    with _cache(read_in_place=False, staging_bytes=4096) as cache:
        assert cache.spec.device_bytes == math.prod(cache.spec.unit_staging_shape) * 4 > 0
