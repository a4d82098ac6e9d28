"""A quantized tier end to end: decode against the resident attention over what the tier
holds, the bytes the step and ``load`` write, ``read``, persistence and the guards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import quantize
from jax_tpusync.persist import commit as persistence

LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_LEN = 2, 2, 2, 4, 16, 96


def _cache(tier_dtype="int8", tier="host", path=None, **kw):
    args = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        tier_dtype=tier_dtype,
        tier=tier,
        path=path,
        block_tokens=8,
        # Three slots of 24 tokens: a 61-token context takes three units a layer.
        staging_bytes=3 * 2 * BATCH * quantize.row_bytes(KV_HEADS, HEAD_DIM) * 24,
        prefetch_depth=2,
    )
    args.update(kw)
    return tps.OffloadedKVCache(**args)


def _new_kv(rng, q_len=1):
    """Per layer (q, k, v) of one step, float32."""

    def draw(heads):
        return jnp.asarray(rng.standard_normal((BATCH, q_len, heads, HEAD_DIM)), jnp.float32)

    return [(draw(Q_HEADS), draw(KV_HEADS), draw(KV_HEADS)) for _ in range(LAYERS)]


def _as_tier_holds(x: np.ndarray, tier_dtype: str) -> np.ndarray:
    """What a quantized tier gives back for KV ``x`` [..., H, D]: its dequantized rows."""
    rows = quantize.quantize_host(x, np.dtype(tier_dtype))
    return quantize.dequantize_host(
        quantize.unpack_host(rows, np.dtype(tier_dtype), KV_HEADS, HEAD_DIM), np.float32
    )


def _decode_against_resident(cache, tier_dtype, *, implementation, use_scan, steps=3, seed=0):
    """Loads a ragged context, decodes ``steps`` steps; returns the largest difference
    from resident attention over the dequantized tier contents (new tokens exact)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([61, 23])
    state = cache.init(np.zeros(BATCH, np.int32))
    held = []  # Per layer, [2, batch, max_len, H, D]: what the tier holds, dequantized.
    for layer in range(LAYERS):
        kv = rng.standard_normal((2, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, layer, kv[0, :, :61], kv[1, :, :61], lengths=lengths)
        held.append(np.stack([_as_tier_holds(kv[i], tier_dtype) for i in range(2)]))

    def step(xs, state):
        if use_scan:
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)

            def body(state, layer_xs):
                (q, k, v), layer = layer_xs
                o, state = tps.prefetching_attention(
                    q, k, v, state, layer=layer, implementation=implementation
                )
                return state, o

            state, outs = jax.lax.scan(body, state, (stacked, jnp.arange(LAYERS)))
            return list(outs), state
        outs = []
        for layer, (q, k, v) in enumerate(xs):
            o, state = tps.prefetching_attention(
                q, k, v, state, layer=layer, implementation=implementation
            )
            outs.append(o)
        return outs, state

    step = jax.jit(step, donate_argnums=(1,))
    worst = 0.0
    for _ in range(steps):
        xs = _new_kv(rng)
        outs, state = step(xs, state)
        for layer, (q, k, v) in enumerate(xs):
            ref, _, _ = tps.resident_attention(
                q,
                k,
                v,
                jnp.asarray(held[layer][0]),
                jnp.asarray(held[layer][1]),
                jnp.asarray(lengths),
            )
            worst = max(worst, float(jnp.max(jnp.abs(ref - outs[layer]))))
            for i, x in enumerate((k, v)):
                for b in range(BATCH):
                    held[layer][i][b, lengths[b]] = _as_tier_holds(np.asarray(x[b]), tier_dtype)[0]
        lengths = lengths + 1
    return worst, cache.drain(state), held, lengths


@pytest.mark.parametrize(
    "tier_dtype,tier,implementation,use_scan",
    [
        ("int8", "file", "xla", True),
        ("float8_e4m3fn", "host", "xla", True),
        ("float8_e4m3fn", "file", "pallas", False),
    ],
)
def test_decode_matches_resident_attention_over_the_dequantized_tier(
    tier_dtype, tier, implementation, use_scan, file_dir
):
    # The Pallas kernels read staging units: a file tier then skips its in-place reads.
    in_place = dict(read_in_place=False) if implementation == "pallas" else {}
    with _cache(tier_dtype, tier, file_dir if tier == "file" else None, **in_place) as cache:
        worst, state, held, lengths = _decode_against_resident(
            cache, tier_dtype, implementation=implementation, use_scan=use_scan
        )
        assert worst < 1e-5
        # The tier holds the step's tokens quantized exactly as load() would have.
        for layer in range(LAYERS):
            k, v = cache.read(state, layer, 0)
            np.testing.assert_array_equal(k, held[layer][0][0, : lengths[0]])
            np.testing.assert_array_equal(v, held[layer][1][0, : lengths[0]])


def _decode_outputs(cache, *, steps=3, seed=0, soft_cap=None):
    """Loads a ragged context (one slot's context longer than a unit, one shorter), decodes
    ``steps`` steps of fixed new tokens; returns every step's per-layer outputs."""
    rng = np.random.default_rng(seed)
    dtype = cache.spec.dtype
    lengths = np.array([61, 23])
    state = cache.init(np.zeros(BATCH, np.int32))
    for layer in range(LAYERS):
        kv = rng.standard_normal((2, BATCH, 61, KV_HEADS, HEAD_DIM)).astype(np.float32)
        kv *= rng.uniform(0.1, 3.0, (2, BATCH, 61, KV_HEADS, 1)).astype(np.float32)
        kv = kv.astype(dtype)
        state = cache.load(state, layer, kv[0], kv[1], lengths=lengths)

    def step(xs, state):
        outs = []
        for layer, (q, k, v) in enumerate(xs):
            o, state = tps.prefetching_attention(q, k, v, state, layer=layer, soft_cap=soft_cap)
            outs.append(o)
        return outs, state

    step = jax.jit(step, donate_argnums=(1,))
    outs = []
    for _ in range(steps):
        xs = jax.tree.map(lambda x: x.astype(dtype), _new_kv(rng))
        o, state = step(xs, state)
        outs.append(np.stack([np.asarray(x).astype(np.float32) for x in o]))
    return np.stack(outs)


@pytest.mark.parametrize("tier_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize(
    "extra",
    [{}, {"sliding_window": (None, 17), "soft_cap": 3.0}, {"dtype": jnp.bfloat16}],
    ids=["full", "window-softcap", "bf16"],
)
def test_read_in_place_equals_the_staged_path(tier_dtype, extra):
    """A host tier of quantized rows attended to where it lies (codes and scales read by
    the native kernel, no staging) decodes as the staged path does (the same rows copied
    into staging, then XLA's attention over codes and scales): within 1e-5 in f32, also
    with a sliding layer and a soft cap; bf16 KV as well (to bf16's rounding)."""
    extra = dict(extra)
    soft_cap = extra.pop("soft_cap", None)
    outs = {}
    for in_place in (True, False):
        with _cache(tier_dtype, read_in_place=in_place, **extra) as cache:
            assert cache.spec.reads_in_place is in_place
            if in_place:
                assert cache.spec.device_bytes == 0
            outs[in_place] = _decode_outputs(cache, soft_cap=soft_cap)
            reads = cache.engine.stats()["in_place_reads"]
            assert (reads > 0) if in_place else (reads == 0)
    got, want = outs[True], outs[False]
    assert np.isfinite(got).all()
    if extra.get("dtype") == jnp.bfloat16:
        # Both round the same f32 partials to bf16 at the end of a layer.
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    else:
        assert float(np.max(np.abs(got - want))) < 1e-5


def test_load_then_read_raw_is_byte_exact_and_read_dequantizes_it():
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((2, BATCH, 40, KV_HEADS, HEAD_DIM)).astype(np.float32)
    with _cache("int8") as cache:
        state = cache.load(cache.init(np.zeros(BATCH, np.int32)), 0, kv[0], kv[1])
        state = cache.load(state, 1, kv[1], kv[0])
        k_raw, v_raw = cache.read(state, 0, 1, 3, 37, raw=True)
        for got, x in ((k_raw, kv[0]), (v_raw, kv[1])):
            want = quantize.unpack_host(
                quantize.quantize_host(x[1, 3:37], np.dtype("int8")),
                np.dtype("int8"),
                KV_HEADS,
                HEAD_DIM,
            )
            assert got.codes.dtype == np.int8 and got.scales.shape == (34, KV_HEADS)
            np.testing.assert_array_equal(got.codes, want.codes)
            np.testing.assert_array_equal(got.scales, want.scales)
        k, _ = cache.read(state, 0, 1, 3, 37)
        np.testing.assert_array_equal(k, quantize.dequantize_host(k_raw, np.float32))
        k_all, _ = cache.read_all(0)
        np.testing.assert_array_equal(k_all[1, 3:37], k)
        assert not k_all[:, 40:].any()


def test_staging_holds_quantized_rows_so_the_same_budget_stages_more_tokens():
    budget = 1 << 20
    with (
        _cache(None, staging_bytes=budget, max_len=4096) as plain,
        _cache("int8", staging_bytes=budget, max_len=4096) as quantized,
    ):
        assert quantized.spec.row_bytes == 48  # 2 x 16 codes + 2 x 4 scale bytes, padded to 16.
        assert plain.spec.row_bytes == KV_HEADS * HEAD_DIM * 4
        assert quantized.spec.staging_dtype == np.uint8
        assert quantized.spec.chunk_len >= 1.5 * plain.spec.chunk_len
        assert quantized.spec.device_bytes <= budget
        assert quantized.spec.kv_bytes * 1.5 < plain.spec.kv_bytes


def test_raw_reads_of_an_unquantized_tier_are_refused():
    with _cache(None) as cache:
        state = cache.init(np.full(BATCH, 4, np.int32))
        with pytest.raises(
            ValueError, match="raw=True reads codes and scales: this cache's tier is not quantized"
        ):
            cache.read(state, 0, 0, raw=True)


@pytest.mark.parametrize("bad", ["float8_e5m2", "int4", "float16"])
def test_a_cache_refuses_other_tier_dtypes(bad):
    with pytest.raises(
        ValueError, match=rf"tier_dtype='{bad}' must be None, 'int8' or 'float8_e4m3fn'"
    ):
        _cache(bad)


def test_the_capacity_guard_holds_at_its_edge_with_quantized_rows():
    with _cache("int8", num_blocks=2 * 12) as cache:
        state = cache.init(np.array([0, 0]), admit=False)
        state, _ = cache.admit(state, 0, max_tokens=16)  # Two 8-token blocks.
        state, _ = cache.admit(state, 1, max_tokens=16)
        rng = np.random.default_rng(5)
        kv = rng.standard_normal((2, BATCH, 15, KV_HEADS, HEAD_DIM)).astype(np.float32)
        for layer in range(LAYERS):
            state = cache.load(state, layer, kv[0], kv[1], lengths=[15, 3])

        def step(xs, state):
            for layer, (q, k, v) in enumerate(xs):
                _, state = tps.prefetching_attention(q, k, v, state, layer=layer)
            return state

        step = jax.jit(step, donate_argnums=(1,))
        state = step(_new_kv(rng), state)  # Slot 0 reaches exactly its capacity: 16.
        state = cache.drain(state)
        neighbour = cache.read(state, 0, 1, raw=True)
        assert list(np.asarray(state.lengths)) == [16, 4]
        with pytest.raises(
            Exception,
            match="slot 0 holds 16 tokens and cannot take 1 more: its capacity is 16 tokens",
        ):
            jax.block_until_ready(step(_new_kv(rng), state))
        state = cache.recover()
        after = cache.read(state, 0, 1, raw=True)
        np.testing.assert_array_equal(after[0].codes, neighbour[0].codes)
        np.testing.assert_array_equal(after[0].scales, neighbour[0].scales)


def test_a_quantized_tier_reattaches_and_refuses_a_cache_of_another_tier_dtype(tmp_path):
    rng = np.random.default_rng(7)
    kv = rng.standard_normal((2, BATCH, 20, KV_HEADS, HEAD_DIM)).astype(np.float32)
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", model_id="m")
    with _cache("int8", **opts) as cache:
        state = cache.init(np.zeros(BATCH, np.int32))
        for layer in range(LAYERS):
            state = cache.load(state, layer, kv[0], kv[1])
        state = cache.commit(state)
        before = cache.read(state, 1, 1, raw=True)
    with _cache("int8", **opts) as cache:
        state = cache.init()
        after = cache.read(state, 1, 1, raw=True)
        np.testing.assert_array_equal(after[1].codes, before[1].codes)
        np.testing.assert_array_equal(after[1].scales, before[1].scales)
    for other in (None, "float8_e4m3fn"):
        with pytest.raises(
            persistence.LayoutMismatchError,
            match=rf"tier_dtype: the tier holds 'int8', this cache has {other!r}",
        ):
            _cache(other, **opts)


def test_quantized_and_plain_caches_never_share_prefix_keys():
    with (
        _cache("int8", prefix_salt="m") as a,
        _cache(None, prefix_salt="m") as b,
        _cache("float8_e4m3fn", prefix_salt="m") as c,
    ):
        roots = {a.slots.prefix.root, b.slots.prefix.root, c.slots.prefix.root}
        assert len(roots) == 3


@pytest.mark.parametrize("tier_dtype", ["int8", "float8_e4m3fn"])
def test_head_shards_rows_join_into_the_row_of_every_head_and_split_back(tier_dtype):
    # Two shards of two heads of 8: 24 bytes of codes and scales, padded to 32 each; the
    # row of all four heads: 48 bytes, padded to 48. Joined, the shards' rows are what
    # quantizing every head writes (a host pool over a mesh persists its rows so).
    x = np.random.default_rng(4).standard_normal((3, 5, 4, 8)).astype(np.float32)
    whole = quantize.quantize_host(x, np.dtype(tier_dtype))
    shards = np.stack(
        [
            quantize.quantize_host(x[..., s * 2 : s * 2 + 2, :], np.dtype(tier_dtype))
            for s in (0, 1)
        ],
        axis=-2,
    )  # [3, 5, shards, 32]
    assert whole.shape == (3, 5, 48) and shards.shape == (3, 5, 2, 32)
    np.testing.assert_array_equal(quantize.join_row_shards(shards, 2, 8), whole)
    np.testing.assert_array_equal(quantize.split_row_shards(whole, 2, 2, 8), shards)
