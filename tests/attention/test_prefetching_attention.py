"""prefetching_attention against resident attention, on every tier and schedule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_tpusync.kernels import reference as kref

import jax_tpusync as tps

# Small shapes: 3 layers (one sliding), ragged batch of 2, GQA 2:1.
LAYERS, BATCH, MAX_LEN, KV_HEADS, Q_HEADS, HEAD_DIM = 3, 2, 64, 2, 4, 16
WINDOWS = (None, 5, None)
CONTEXT = np.array([20, 13])


class TinyDecoder:
    """Projections only: enough structure for layer-to-layer dependencies."""

    def __init__(self, seed: int, dtype=jnp.float32, q_heads=Q_HEADS, kv_heads=KV_HEADS):
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.q_heads, self.kv_heads = q_heads, kv_heads
        width = q_heads * HEAD_DIM

        def w(*shape):
            return jnp.asarray(rng.standard_normal(shape) * 0.2, dtype)

        self.wq = w(LAYERS, width, q_heads * HEAD_DIM)
        self.wk = w(LAYERS, width, kv_heads * HEAD_DIM)
        self.wv = w(LAYERS, width, kv_heads * HEAD_DIM)

    def qkv(self, x, layer):
        b, t, _ = x.shape
        return (
            (x @ self.wq[layer]).reshape(b, t, self.q_heads, HEAD_DIM),
            (x @ self.wk[layer]).reshape(b, t, self.kv_heads, HEAD_DIM),
            (x @ self.wv[layer]).reshape(b, t, self.kv_heads, HEAD_DIM),
        )

    def offloaded_step(self, *, scan: bool, windows=WINDOWS, **attn_kwargs):
        def layer_fn(x, state, layer):
            q, k, v = self.qkv(x, layer)
            o, state = tps.prefetching_attention(q, k, v, state, layer=layer, **attn_kwargs)
            return x + o.reshape(x.shape).astype(x.dtype), state

        def step(x, state):
            if scan:

                def body(carry, layer):
                    return layer_fn(*carry, layer), None

                (x, state), _ = jax.lax.scan(body, (x, state), jnp.arange(LAYERS))
                return x, state
            for layer in range(LAYERS):
                x, state = layer_fn(x, state, layer)
            return x, state

        return jax.jit(step, donate_argnums=(1,))

    def resident_step(self, unit_len, *, scan: bool, windows=WINDOWS, **attn_kwargs):
        def layer_fn(x, ck, cv, lengths, layer, window):
            q, k, v = self.qkv(x, layer)
            o, ck, cv = tps.resident_attention(
                q, k, v, ck, cv, lengths, window=window, unit_len=unit_len, **attn_kwargs
            )
            return x + o.reshape(x.shape), ck, cv

        def step(x, cache_k, cache_v, lengths):
            if scan and len(set(windows)) == 1:

                def body(x, inputs):
                    layer, ck, cv = inputs
                    x, ck, cv = layer_fn(x, ck, cv, lengths, layer, windows[0])
                    return x, (ck, cv)

                x, (cache_k, cache_v) = jax.lax.scan(
                    body, x, (jnp.arange(LAYERS), cache_k, cache_v)
                )
            else:
                for layer in range(LAYERS):
                    x, ck, cv = layer_fn(
                        x, cache_k[layer], cache_v[layer], lengths, layer, windows[layer]
                    )
                    cache_k, cache_v = cache_k.at[layer].set(ck), cache_v.at[layer].set(cv)
            return x, cache_k, cache_v, lengths + x.shape[1]

        return jax.jit(step)


def make_cache(
    tier,
    tmp_path,
    *,
    staging_bytes,
    dtype=jnp.float32,
    windows=WINDOWS,
    kv_heads=KV_HEADS,
    **kwargs,
):
    """``tier="host-in-place"``: a host tier read in place; ``"host"`` streams its units
    through staging."""
    extra = dict(path=tmp_path) if tier == "file" else {}
    extra.setdefault("read_in_place", tier == "host-in-place")
    tier = "host" if tier == "host-in-place" else tier
    return tps.OffloadedKVCache(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        dtype=dtype,
        tier=tier,
        staging_bytes=staging_bytes,
        sliding_window=list(windows),
        **extra,
        **kwargs,
    )


def preload(cache, rng, dtype=np.float32, kv_heads=KV_HEADS):
    """Loads a ragged random context into `cache`; returns (state, cache_k, cache_v)."""
    shape = (LAYERS, BATCH, MAX_LEN, kv_heads, HEAD_DIM)
    cache_k = rng.standard_normal(shape).astype(dtype)
    cache_v = rng.standard_normal(shape).astype(dtype)
    state = cache.init()
    n = int(CONTEXT.max())
    for layer in range(LAYERS):
        state = cache.load(
            state, layer, cache_k[layer, :, :n], cache_v[layer, :, :n], lengths=CONTEXT
        )
    return state, jnp.asarray(cache_k), jnp.asarray(cache_v)


# staging_bytes: whole layers fit one unit / a layer takes several 8-token units.
UNCHUNKED = 1 << 20
CHUNKED = 2 * 2 * BATCH * 8 * KV_HEADS * HEAD_DIM * 4


@pytest.mark.parametrize(
    "tier,staging_bytes,scan",
    [
        ("host", UNCHUNKED, False),
        ("file", CHUNKED, False),
        ("host", CHUNKED, True),
        ("file", UNCHUNKED, True),
        ("host-in-place", UNCHUNKED, False),
        ("host-in-place", CHUNKED, True),
    ],
    ids=[
        "host-unchunked-unrolled",
        "file-chunked-unrolled",
        "host-chunked-scan",
        "file-unchunked-scan",
        "in-place-unchunked-unrolled",
        "in-place-chunked-scan",
    ],
)
def test_decoder_matches_resident(tier, staging_bytes, scan, tmp_path):
    """N steps (a 3-token prefill chunk, then decode) give the resident model's logits."""
    windows = WINDOWS if not scan else (None,) * LAYERS  # scan+mixed windows: see below
    rng = np.random.default_rng(0)
    model = TinyDecoder(seed=1)
    with make_cache(tier, tmp_path, staging_bytes=staging_bytes, windows=windows) as cache:
        assert cache.spec.single_unit == (staging_bytes == UNCHUNKED)
        state, ck, cv = preload(cache, rng)
        lengths = jnp.asarray(CONTEXT, jnp.int32)
        offloaded = model.offloaded_step(scan=scan, windows=windows)
        resident = model.resident_step(cache.spec.chunk_len, scan=scan, windows=windows)
        for step in range(5):
            x = jnp.asarray(
                rng.standard_normal((BATCH, 3 if step == 0 else 1, Q_HEADS * HEAD_DIM)), jnp.float32
            )
            got, state = offloaded(x, state)
            want, ck, cv, lengths = resident(x, ck, cv, lengths)
            np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(lengths))
            # Same operations in the same order; XLA may fuse a block read from staging and
            # one gathered from the cache differently, hence float32 rounding, not equality.
            # In place, the engine's attention sums in another order (and exponentiates to
            # 2 ulp), which the 2 layers and 5 steps carry on: 1.4e-5 of logits up to 4 seen.
            # A stale or missing row moves the output by far more (units are 8 tokens here).
            tol = 4e-5 if tier == "host-in-place" else 1e-5
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        stats = cache.engine.stats()
        if tier == "host-in-place":
            assert stats["in_place_reads"] > 0 and stats["prefetch_hits"] == 0
        else:
            assert stats["prefetch_hits"] > 0
            # Only the first units are cold: those fetched before any prefetch ran ahead.
            assert stats["prefetch_misses"] == cache.spec.prefetch_depth
        # The tier holds what the resident cache holds (new tokens' K/V come from activations
        # that carry the rounding above; write-back itself is byte-exact, tests/runtime/engine).
        state = cache.drain(state)
        for layer in range(LAYERS):
            k_tier, v_tier = cache.read_all(layer, np.asarray(state.lengths))
            for b in range(BATCH):
                n = int(state.lengths[b])
                for got_kv, want_kv in ((k_tier, ck), (v_tier, cv)):
                    np.testing.assert_allclose(
                        got_kv[b, :n], np.asarray(want_kv[layer, b, :n]), rtol=1e-5, atol=1e-5
                    )


def read_in_blocks_of(monkeypatch, rows: int, kv_heads: int = KV_HEADS) -> None:
    """Makes the plain-XLA attention read units in blocks of ``rows`` rows (as at scale)."""
    from jax_tpusync.step import unit

    monkeypatch.setattr(unit, "attends_in_blocks", lambda: True)
    monkeypatch.setattr(unit, "ROW_BLOCK_BYTES", 4 * rows * BATCH * kv_heads * HEAD_DIM)


@pytest.mark.parametrize("tier,scan", [("file", False), ("host", True)])
def test_decoder_in_row_blocks_matches_resident(tier, scan, tmp_path, monkeypatch):
    """8-token units read in 2-row blocks, ragged rows skipping empty blocks: the offloaded
    and resident steps (both in blocks) agree with each other and with the oracle."""
    read_in_blocks_of(monkeypatch, 2)
    windows = WINDOWS if not scan else (None,) * LAYERS
    rng = np.random.default_rng(5)
    model = TinyDecoder(seed=6)
    with make_cache(tier, tmp_path, staging_bytes=CHUNKED, windows=windows) as cache:
        state, ck, cv = preload(cache, rng)
        lengths = jnp.asarray(CONTEXT, jnp.int32)
        offloaded = model.offloaded_step(scan=scan, windows=windows)
        resident = model.resident_step(cache.spec.chunk_len, scan=scan, windows=windows)
        unblocked = model.resident_step(None, scan=scan, windows=windows)  # One unit, whole.
        ck2, cv2, lengths2 = ck, cv, lengths
        for step in range(4):
            x = jnp.asarray(
                rng.standard_normal((BATCH, 3 if step == 0 else 1, Q_HEADS * HEAD_DIM)), jnp.float32
            )
            got, state = offloaded(x, state)
            want, ck, cv, lengths = resident(x, ck, cv, lengths)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
            with monkeypatch.context() as m:
                from jax_tpusync.step import unit

                m.setattr(unit, "attends_in_blocks", lambda: False)
                oracle, ck2, cv2, lengths2 = unblocked(x, ck2, cv2, lengths2)
            np.testing.assert_allclose(np.asarray(got), np.asarray(oracle), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("staging_bytes", [UNCHUNKED, CHUNKED], ids=["unchunked", "chunked"])
def test_scan_with_mixed_windows_matches(staging_bytes, tmp_path):
    """A traced layer index with per-layer windows switches kernels; results agree."""
    rng = np.random.default_rng(2)
    model = TinyDecoder(seed=3)
    with make_cache("host", tmp_path, staging_bytes=staging_bytes) as cache:
        state, ck, cv = preload(cache, rng)
        lengths = jnp.asarray(CONTEXT, jnp.int32)
        offloaded = model.offloaded_step(scan=True)
        resident = model.resident_step(cache.spec.chunk_len, scan=False)
        for _ in range(3):
            x = jnp.asarray(rng.standard_normal((BATCH, 1, Q_HEADS * HEAD_DIM)), jnp.float32)
            got, state = offloaded(x, state)
            want, ck, cv, lengths = resident(x, ck, cv, lengths)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype,kv_heads,soft_cap,block_rows",
    [
        (jnp.float32, 2, None, None),
        (jnp.bfloat16, 1, 5.0, None),
        (jnp.float32, 4, 5.0, 1),
        (jnp.bfloat16, 2, None, 2),
        (jnp.float16, 2, None, 2),
    ],
    ids=[
        "f32-gqa",
        "bf16-mqa-softcap",
        "f32-mha-softcap-1-row-blocks",
        "bf16-gqa-2-row-blocks",
        "f16-gqa-2-row-blocks",
    ],
)
def test_against_plain_softmax(dtype, kv_heads, soft_cap, block_rows, tmp_path, monkeypatch):
    """One chunked-prefill call equals one-shot softmax attention over cache + new tokens."""
    if block_rows:
        read_in_blocks_of(monkeypatch, block_rows, kv_heads)
    rng = np.random.default_rng(4)
    q_len = 4
    with make_cache(
        "host",
        tmp_path,
        staging_bytes=CHUNKED // 2 * kv_heads // KV_HEADS,
        dtype=dtype,
        kv_heads=kv_heads,
    ) as cache:
        state, ck, cv = preload(cache, rng, dtype=jnp.dtype(dtype), kv_heads=kv_heads)
        q = jnp.asarray(rng.standard_normal((BATCH, q_len, Q_HEADS, HEAD_DIM)), dtype)
        k = jnp.asarray(rng.standard_normal((BATCH, q_len, kv_heads, HEAD_DIM)), dtype)
        v = jnp.asarray(rng.standard_normal((BATCH, q_len, kv_heads, HEAD_DIM)), dtype)
        # One compilation for all layers: the layer index is traced.
        fn = jax.jit(
            lambda q, k, v, state, layer: tps.prefetching_attention(
                q, k, v, state, layer=layer, soft_cap=soft_cap
            ),
            donate_argnums=(3,),
        )
        for layer in range(LAYERS):
            got, state = fn(q, k, v, state, layer)
            # Oracle: write the new tokens into a resident cache, attend in one shot.
            full_k = ck[layer].at[:, :].get()
            full_v = cv[layer]
            for b in range(BATCH):
                n = CONTEXT[b]
                full_k = full_k.at[b, n : n + q_len].set(k[b])
                full_v = full_v.at[b, n : n + q_len].set(v[b])
            want = kref.attention_reference(
                q,
                full_k,
                full_v,
                jnp.asarray(CONTEXT),
                jnp.asarray(CONTEXT + q_len),
                scale=1 / np.sqrt(HEAD_DIM),
                soft_cap=soft_cap,
                window=WINDOWS[layer],
            )
            tol = 2e-5 if dtype == jnp.float32 else 2e-2
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
            )
        np.testing.assert_array_equal(np.asarray(state.lengths), CONTEXT + q_len)


def test_out_of_order_layers_are_refetched_never_stale(tmp_path):
    """Leaving the schedule (layer 1 before 0) costs misses, not wrong answers, and the new
    tokens' K/V reach the tier unchanged.

    Lengths advance after the last layer (2), so layers 1 and 0 both see CONTEXT.
    """
    rng = np.random.default_rng(5)
    model = TinyDecoder(seed=6)
    with make_cache("file", tmp_path, staging_bytes=UNCHUNKED) as cache:
        state, ck, cv = preload(cache, rng)
        x = jnp.asarray(rng.standard_normal((BATCH, 1, Q_HEADS * HEAD_DIM)), jnp.float32)
        fn = jax.jit(
            lambda q, k, v, state, layer: tps.prefetching_attention(q, k, v, state, layer=layer),
            donate_argnums=(3,),
        )
        oracle = jax.jit(tps.resident_attention, static_argnames=("window", "unit_len"))
        written = {}
        for layer in (1, 0, 2):
            q, k, v = model.qkv(x, layer)
            got, state = fn(q, k, v, state, layer)
            want, _, _ = oracle(
                q,
                k,
                v,
                ck[layer],
                cv[layer],
                jnp.asarray(CONTEXT),
                window=WINDOWS[layer],
                unit_len=cache.spec.chunk_len,
            )
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
            written[layer] = (np.asarray(k), np.asarray(v))
        assert cache.engine.stats()["prefetch_misses"] >= 2
        # Each layer's new token went out byte for byte, behind the context it extends.
        state = cache.drain(state)
        for layer, (k, v) in written.items():
            k_tier, v_tier = cache.read_all(layer, np.asarray(state.lengths))
            for b in range(BATCH):
                at = int(CONTEXT[b])
                np.testing.assert_array_equal(k_tier[b, at], k[b, 0])
                np.testing.assert_array_equal(v_tier[b, at], v[b, 0])
                np.testing.assert_array_equal(k_tier[b, :at], np.asarray(ck[layer, b, :at]))


def test_device_bytes_do_not_grow_with_context(tmp_path):
    sizes = []
    for max_len in (1 << 10, 1 << 20):
        with tps.OffloadedKVCache(
            num_layers=2,
            batch=1,
            max_len=max_len,
            num_kv_heads=1,
            head_dim=8,
            dtype=jnp.float32,
            tier="file",
            path=tmp_path,
            staging_bytes=1 << 16,
        ) as cache:
            sizes.append(cache.spec.device_bytes)
            assert cache.spec.device_bytes <= 1 << 16
    assert sizes[0] == sizes[1]


def test_million_token_context_decodes_on_file_tier(tmp_path):
    """1M cached tokens stream through a 1 MiB staging budget; output matches the oracle."""
    max_len, n = 1 << 20, (1 << 20) - 8
    rng = np.random.default_rng(9)
    with tps.OffloadedKVCache(
        num_layers=1,
        batch=1,
        max_len=max_len,
        num_kv_heads=1,
        head_dim=8,
        dtype=jnp.float32,
        tier="file",
        path=tmp_path,
        staging_bytes=1 << 20,
    ) as cache:
        k_all = rng.standard_normal((1, n, 1, 8)).astype(np.float32)
        v_all = rng.standard_normal((1, n, 1, 8)).astype(np.float32)
        state = cache.load(cache.init(), 0, k_all, v_all)
        assert int(state.lengths[0]) == n
        assert not cache.spec.single_unit
        q = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
        fn = jax.jit(functools.partial(tps.prefetching_attention, layer=0), donate_argnums=(3,))
        got, state = fn(q, k, v, state)
        full_k = np.concatenate([k_all, np.asarray(k)], axis=1)
        full_v = np.concatenate([v_all, np.asarray(v)], axis=1)
        want = kref.attention_reference(
            q,
            jnp.asarray(full_k),
            jnp.asarray(full_v),
            jnp.asarray([n]),
            jnp.asarray([n + 1]),
            scale=1 / np.sqrt(8),
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-4)
        assert int(state.lengths[0]) == n + 1
        cache.drain(state)


def test_persistent_file_cache_reattaches(tmp_path):
    rng = np.random.default_rng(10)
    kv = rng.standard_normal((2, BATCH, 7, KV_HEADS, HEAD_DIM)).astype(np.float32)
    kwargs = dict(
        num_layers=1,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        tier="file",
        path=tmp_path,
        file_name="kv",
    )
    with tps.OffloadedKVCache(**kwargs) as cache:
        cache.close(cache.load(cache.init(), 0, kv[0], kv[1]))  # Commits the state.
    with tps.OffloadedKVCache(**kwargs) as cache:
        assert cache.engine.tier_info(cache.tier).attached
        assert cache.committed_lengths.tolist() == [7] * BATCH
        k, v = cache.read_all(0, [7] * BATCH)
        np.testing.assert_array_equal(k[:, :7], kv[0])
        np.testing.assert_array_equal(v[:, :7], kv[1])
    with pytest.raises(tps.TpusyncError, match="layout mismatch"):
        tps.OffloadedKVCache(**{**kwargs, "max_len": MAX_LEN * 2})


# Tolerances of the Pallas path against the "xla" path, by cache dtype.
PALLAS_TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


# bfloat16 only: the kernel's float32 path is checked against its reference in
# tests/kernels; this test is the kernel's wiring into the offloaded decoder.
@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_pallas_implementation_matches_xla(dtype, tmp_path):
    """The Pallas kernel (TPU interpret mode on CPU) inside the offloaded decoder."""
    rng = np.random.default_rng(11)
    model = TinyDecoder(seed=12, dtype=dtype)
    x = jnp.asarray(rng.standard_normal((BATCH, 1, Q_HEADS * HEAD_DIM)), dtype)
    outs = {}
    for implementation in ("xla", "pallas"):
        with make_cache("host", tmp_path, staging_bytes=UNCHUNKED, dtype=dtype) as cache:
            state, _, _ = preload(cache, np.random.default_rng(13), dtype=jnp.dtype(dtype))
            step = model.offloaded_step(scan=False, implementation=implementation, block_kv=16)
            outs[implementation], state = step(x, state)
            cache.drain(state)
    tol = PALLAS_TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(outs["pallas"], np.float32),
        np.asarray(outs["xla"], np.float32),
        atol=tol,
        rtol=tol,
    )


def test_pallas_implementation_names_float16_as_unsupported(tmp_path):
    """float16 KV runs with the plain-XLA attention; the Pallas kernels say they do not
    take it, before anything runs."""
    with make_cache("host", tmp_path, staging_bytes=UNCHUNKED, dtype=jnp.float16) as cache:
        state = cache.init()
        q, k, v = _qkv(dtype=jnp.float16)
        with pytest.raises(ValueError, match="q.dtype must be float32 or bfloat16, got float16"):
            tps.prefetching_attention(q, k, v, state, layer=0, implementation="pallas")
        cache.drain(state)


def _qkv(
    q_heads=Q_HEADS, kv_heads=KV_HEADS, q_len=1, batch=BATCH, head_dim=HEAD_DIM, dtype=jnp.float32
):
    q = jnp.zeros((batch, q_len, q_heads, head_dim), dtype)
    kv = jnp.zeros((batch, q_len, kv_heads, head_dim), dtype)
    return q, kv, kv


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (_qkv(q_heads=3), {}, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
        (_qkv(kv_heads=1), {}, r"k must be \[batch, q_len, num_kv_heads, head_dim\]"),
        (_qkv(batch=3), {}, "q has batch=3 but the cache was made for batch=2"),
        (_qkv(head_dim=8), {}, "q has head_dim=8 but the cache has head_dim=16"),
        (_qkv(dtype=jnp.int32), {}, "q.dtype must be bfloat16, float16 or float32"),
        ((jnp.zeros((BATCH, Q_HEADS, HEAD_DIM)),) + _qkv()[1:], {}, "q must be rank 4"),
        (_qkv(), {"layer": LAYERS}, "layer=3 is out of range for a cache of 3 layers"),
        (_qkv(), {"layer": -1}, "layer=-1 is out of range"),
        (_qkv(), {"implementation": "cuda"}, "implementation='cuda' must be one of"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, match, tmp_path):
    with make_cache("host", tmp_path, staging_bytes=UNCHUNKED) as cache:
        kwargs = {"layer": 0, **kwargs}
        with pytest.raises(ValueError, match=match):
            tps.prefetching_attention(*args, cache.init(), **kwargs)


def test_state_must_be_a_kvstate():
    with pytest.raises(TypeError, match="state must be a KVState"):
        tps.prefetching_attention(*_qkv(), {"lengths": 0}, layer=0)


def test_state_from_another_cache_is_refused(tmp_path):
    with (
        make_cache("host", tmp_path, staging_bytes=UNCHUNKED) as a,
        make_cache("host", tmp_path, staging_bytes=UNCHUNKED) as b,
    ):
        kv = np.zeros((BATCH, 4, KV_HEADS, HEAD_DIM), np.float32)
        with pytest.raises(ValueError, match="state belongs to another cache"):
            b.load(a.init(), 0, kv, kv)
        with pytest.raises(ValueError, match="state belongs to another cache"):
            b.drain(a.init())


def test_context_overflow_past_max_len_is_an_error(tmp_path):
    """Appending past max_len inside jit fails in the engine (the write-back's capacity
    guard) instead of corrupting KV."""
    with make_cache("host", tmp_path, staging_bytes=UNCHUNKED) as cache:
        state = cache.init(lengths=[MAX_LEN - 2, 0])
        fn = jax.jit(functools.partial(tps.prefetching_attention, layer=0), donate_argnums=(3,))
        with pytest.raises(
            Exception, match=f"slot 0 holds {MAX_LEN - 2} tokens and cannot take 4 more"
        ):
            out, state = fn(*_qkv(q_len=4), state)
            out.block_until_ready()
        cache.engine.close()


def test_cache_arguments_are_validated(tmp_path):
    base = dict(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="max_len=0 must be a positive int"):
        tps.OffloadedKVCache(**{**base, "max_len": 0})
    with pytest.raises(ValueError, match="tier='file' needs path"):
        tps.OffloadedKVCache(**base, tier="file")
    with pytest.raises(ValueError, match="tier='ssd' must be 'host' or 'file'"):
        tps.OffloadedKVCache(**base, tier="ssd")
    with pytest.raises(ValueError, match="staging_bytes=16 cannot hold one token"):
        tps.OffloadedKVCache(**base, staging_bytes=16)
    with pytest.raises(ValueError, match="sliding_window has 2 entries for 1 layers"):
        tps.OffloadedKVCache(**base, sliding_window=[4, None])
    with pytest.raises(ValueError, match=r"lengths\[0\]=9 must be in \[0, 8\] \(slot 0.s capacity\)"):
        with tps.OffloadedKVCache(**base) as cache:
            cache.init(lengths=[9])
    with tps.OffloadedKVCache(**base) as cache:
        kv = np.zeros((1, 9, 1, 8), jnp.bfloat16)  # The cache dtype: no implicit cast.
        with pytest.raises(ValueError, match="overflow its capacity of 8 tokens"):
            cache.load(cache.init(), 0, kv, kv)


def test_file_tier_fetches_land_straight_in_staging(file_dir):
    """The file tier's data sits at the staging buffer's offset within a page, so a decode
    step's fetches go by O_DIRECT straight into staging (only partial sectors bounce), and
    the answer is still the resident one."""
    max_len, kv_heads, head_dim = 4096, 2, 64  # 512-byte rows: 2 MiB per layer's K.
    rng = np.random.default_rng(3)
    with tps.OffloadedKVCache(
        num_layers=2,
        batch=1,
        max_len=max_len,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=jnp.float32,
        tier="file",
        path=file_dir,
        staging_bytes=4 << 20,  # Two slots of 1024-token units: a chunk loop.
    ) as cache:
        n = 3000
        ck = rng.standard_normal((2, 1, n, kv_heads, head_dim)).astype(np.float32)
        cv = rng.standard_normal((2, 1, n, kv_heads, head_dim)).astype(np.float32)
        state = cache.init()
        for layer in range(2):
            state = cache.load(state, layer, ck[layer], cv[layer], lengths=[n])
        before = cache.engine.tier_info(cache.tier)

        def step(q, k, v, state):
            outs = []
            for layer in range(2):
                o, state = tps.prefetching_attention(q, k, v, state, layer=layer)
                outs.append(o)
            return outs, state

        q = jnp.asarray(rng.standard_normal((1, 1, 4, head_dim)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, 1, kv_heads, head_dim)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((1, 1, kv_heads, head_dim)), jnp.float32)
        outs, state = jax.jit(step, donate_argnums=(3,))(q, k, v, state)
        state = cache.drain(state)
        info = cache.engine.tier_info(cache.tier)
        direct = info.direct_read_bytes - before.direct_read_bytes
        bounced = info.bounced_read_bytes - before.bounced_read_bytes
        assert direct > 0.95 * (direct + bounced), (direct, bounced)
        for layer in range(2):
            room = ((0, 0), (0, 1), (0, 0), (0, 0))  # For the new token.
            want, _, _ = tps.resident_attention(
                q,
                k,
                v,
                jnp.asarray(np.pad(ck[layer], room)),
                jnp.asarray(np.pad(cv[layer], room)),
                jnp.asarray([n]),
            )
            np.testing.assert_allclose(
                np.asarray(outs[layer]), np.asarray(want), rtol=1e-5, atol=1e-5
            )


def _resident_inputs(rng, cache_dtype, kv_dtype):
    """Random (q, k, v, cache_k, cache_v) for one decode token; q in the caches' dtype."""
    shape = (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)
    cache_k = jnp.asarray(rng.standard_normal(shape), cache_dtype)
    cache_v = jnp.asarray(rng.standard_normal(shape), cache_dtype)
    q = jnp.asarray(rng.standard_normal((BATCH, 1, Q_HEADS, HEAD_DIM)), cache_dtype)
    k = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS, HEAD_DIM)), kv_dtype)
    v = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS, HEAD_DIM)), kv_dtype)
    return q, k, v, cache_k, cache_v


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("window,unit_len", [(None, 8), (None, None), (5, 4)])
def test_resident_attention_matches_reference_and_inserts_exactly(dtype, window, unit_len):
    """Units gathered as raw bits for 16-bit caches: same attention, untouched neighbours."""
    rng = np.random.default_rng(12)
    q, k, v, cache_k, cache_v = _resident_inputs(rng, dtype, dtype)
    lengths = jnp.asarray(CONTEXT, jnp.int32)
    fn = jax.jit(tps.resident_attention, static_argnames=("window", "unit_len"))
    out, new_k, new_v = fn(q, k, v, cache_k, cache_v, lengths, window=window, unit_len=unit_len)

    want_k, want_v = np.array(cache_k), np.array(cache_v)  # Writable copies.
    for b, at in enumerate(CONTEXT):
        want_k[b, at], want_v[b, at] = np.asarray(k[b, 0]), np.asarray(v[b, 0])
    np.testing.assert_array_equal(np.asarray(new_k), want_k)
    np.testing.assert_array_equal(np.asarray(new_v), want_v)
    want = kref.attention_reference(
        q,
        jnp.asarray(want_k),
        jnp.asarray(want_v),
        lengths,
        lengths + 1,
        scale=1 / np.sqrt(HEAD_DIM),
        window=window,
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )


def test_staged_rows_reads_words_and_floats():
    """A traced slot and first row read the same rows from float staging and its words."""
    from jax_tpusync.step import unit

    rng = np.random.default_rng(13)
    staging = jnp.asarray(rng.standard_normal((3, 2, BATCH, 8, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    words = jax.lax.bitcast_convert_type(staging, jnp.uint16)
    read = jax.jit(lambda st, slot, start: unit.staged_rows(st, slot, start, 3, jnp.bfloat16))
    for slot, start in [(0, 0), (2, 5), (1, 2)]:
        for source in (staging, words):
            k, v = read(source, jnp.int32(slot), jnp.int32(start))
            assert k.dtype == v.dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                np.asarray(k), np.asarray(staging[slot, 0, :, start : start + 3])
            )
            np.testing.assert_array_equal(
                np.asarray(v), np.asarray(staging[slot, 1, :, start : start + 3])
            )


@pytest.mark.parametrize(
    "unit_len,row_elements,want",
    [
        (4096, 8 * 64, 512),  # 1 MiB of f32 K per block
        (4096, 1, 4096),  # A small unit is one block
        (3000, 8 * 64, 500),  # The largest divisor that fits
        (7, 1 << 20, 1),  # A row above the budget: one row per block
        (4093, 8 * 64, 4093),  # No divisor near the budget (a prime): the whole unit
    ],
)
def test_row_block_len(unit_len, row_elements, want):
    from jax_tpusync.step import unit

    got = unit.row_block_len(unit_len, row_elements)
    assert got == want
    assert unit_len % got == 0


def test_attend_valid_rows_attends_only_blocks_with_keys():
    """Blocks past every batch row's last key are skipped; the merge equals one call."""
    from jax_tpusync.step import unit

    rng = np.random.default_rng(14)
    unit_len, block = 16, 4
    q = jnp.asarray(rng.standard_normal((BATCH, 1, Q_HEADS, HEAD_DIM)), jnp.float32)
    k = np.asarray(rng.standard_normal((BATCH, unit_len, KV_HEADS, HEAD_DIM)), np.float32)
    v = np.asarray(rng.standard_normal((BATCH, unit_len, KV_HEADS, HEAD_DIM)), np.float32)
    k[:, 10:], v[:, 10:] = np.nan, np.nan  # Past every row's keys: must never matter.
    count = jnp.asarray([10, 3], jnp.int32)
    starts = []

    def attend_rows(start, n, valid):
        jax.debug.callback(lambda s: starts.append(int(s)), start, ordered=True)
        rows = (jax.lax.dynamic_slice_in_dim(jnp.asarray(x), start, n, axis=1) for x in (k, v))
        return kref.chunk_attention_reference(
            q,
            *rows,
            jnp.zeros((BATCH,), jnp.int32) + start,
            valid,
            jnp.full((BATCH,), 99),
            scale=0.25,
        )

    out, lse = jax.jit(
        lambda: unit.attend_valid_rows(attend_rows, count, unit_len, block, q.shape)
    )()
    assert starts == [0, 4, 8]  # Rows 12..15 hold no key of either batch row.
    want_out, want_lse = kref.chunk_attention_reference(
        q,
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.zeros((BATCH,), jnp.int32),
        count,
        jnp.full((BATCH,), 99),
        scale=0.25,
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-6)


def test_cpu_stages_16_bit_kv_as_words(tmp_path):
    """16-bit KV is staged as uint16 words where the attention reads blocks (CPU)."""
    for dtype, want in [(jnp.bfloat16, np.uint16), (jnp.float32, np.float32)]:
        with make_cache("host", tmp_path, staging_bytes=CHUNKED, dtype=dtype) as cache:
            on_cpu = jax.default_backend() == "cpu"
            assert cache.spec.staging_dtype == np.dtype(want if on_cpu else dtype)
            state = cache.init()
            assert state.staging.dtype == cache.spec.staging_dtype
            assert cache.spec.device_bytes == state.staging.nbytes


@pytest.mark.parametrize("window,unit_len", [(None, 8), (5, 4)])
def test_resident_attention_on_uint16_words_matches_bfloat16_caches(window, unit_len):
    """Caches kept as raw words give the same output and the same bytes as bf16 caches."""
    rng = np.random.default_rng(14)
    q, k, v, cache_k, cache_v = _resident_inputs(rng, jnp.bfloat16, jnp.float32)
    lengths = jnp.asarray(CONTEXT, jnp.int32)
    fn = jax.jit(tps.resident_attention, static_argnames=("window", "unit_len", "kv_dtype"))
    out, new_k, new_v = fn(q, k, v, cache_k, cache_v, lengths, window=window, unit_len=unit_len)

    words = [jnp.asarray(np.asarray(c).view(np.uint16)) for c in (cache_k, cache_v)]
    out_w, words_k, words_v = fn(
        q, k, v, *words, lengths, window=window, unit_len=unit_len, kv_dtype=jnp.bfloat16
    )
    assert words_k.dtype == words_v.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(out_w), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(words_k), np.asarray(new_k).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(words_v), np.asarray(new_v).view(np.uint16))


@pytest.mark.parametrize(
    "caches,kv_dtype,match",
    [
        ((jnp.uint16, jnp.uint16), None, "uint16 words: pass kv_dtype"),
        ((jnp.uint16, jnp.uint16), jnp.float32, "16-bit float dtype .* kv_dtype=float32"),
        ((jnp.float32, jnp.float32), jnp.bfloat16, "kv_dtype=bfloat16 does not match .* float32"),
        ((jnp.float32, jnp.bfloat16), None, "one dtype; got float32 and bfloat16"),
    ],
)
def test_resident_attention_rejects_cache_dtypes(caches, kv_dtype, match):
    shape = (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)
    cache_k, cache_v = (jnp.zeros(shape, d) for d in caches)
    q = jnp.zeros((BATCH, 1, Q_HEADS, HEAD_DIM), jnp.float32)
    kv = jnp.zeros((BATCH, 1, KV_HEADS, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match=match):
        tps.resident_attention(
            q, kv, kv, cache_k, cache_v, jnp.asarray(CONTEXT, jnp.int32), kv_dtype=kv_dtype
        )


def test_resident_attention_rejects_concrete_lengths_past_the_cache():
    shape = (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)
    cache = jnp.zeros(shape, jnp.float32)
    q = jnp.zeros((BATCH, 2, Q_HEADS, HEAD_DIM), jnp.float32)
    kv = jnp.zeros((BATCH, 2, KV_HEADS, HEAD_DIM), jnp.float32)
    lengths = jnp.full((BATCH,), MAX_LEN - 1, jnp.int32)
    with pytest.raises(ValueError, match=f"lengths \\+ q_len = {MAX_LEN + 1} exceeds max_len"):
        tps.resident_attention(q, kv, kv, cache, cache, lengths)


def test_page_offset_reads_the_buffer_address():
    from jax_tpusync.runtime.engine import page_offset

    x = jnp.zeros((1000,), jnp.float32)
    assert page_offset(x) == x.unsafe_buffer_pointer() % 4096
    assert page_offset(np.zeros(4)) is None  # Not a jax.Array: not known.


@pytest.mark.parametrize("shift,logged", [(0, False), (64, True), (None, False)])
def test_staging_out_of_phase_with_the_file_tier_is_logged(
    file_dir, monkeypatch, caplog, shift, logged
):
    """A staging buffer whose page offset differs from the tier's data says it will bounce."""
    from jax_tpusync.core import levels

    with tps.OffloadedKVCache(
        num_layers=1,
        batch=1,
        max_len=64,
        num_kv_heads=1,
        head_dim=8,
        dtype=jnp.float32,
        tier="file",
        path=file_dir,
    ) as cache:
        info = cache.engine.tier_info(cache.tier)
        if not info.dio_alignment:
            pytest.skip("the file tier has no O_DIRECT here")
        at = None if shift is None else (info.alignment_offset + shift) % 4096
        monkeypatch.setattr(levels, "page_offset", lambda array: at)
        with caplog.at_level("INFO", logger=levels.logger.name):
            cache.init()
        phase_logs = [r for r in caplog.records if "out of phase" in r.getMessage()]
        assert bool(phase_logs) == logged
        if logged:
            assert f"{shift} bytes out of phase" in phase_logs[0].getMessage()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA CPU's buffer plan")
def test_resident_step_on_words_updates_the_donated_caches_in_place():
    """A donated decode step over word caches holds no copy of a cache: each would cost a
    pass over the whole KV every step (updating the caches after the unit loop made XLA copy
    every one of them)."""
    shape = (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)

    def step(q, caches, lengths):
        out = q
        caches = list(caches)
        for layer in range(2):
            ck, cv = caches[2 * layer : 2 * layer + 2]
            out, ck, cv = tps.resident_attention(
                out,
                q[:, :, :KV_HEADS],
                q[:, :, :KV_HEADS],
                ck,
                cv,
                lengths,
                unit_len=8,
                kv_dtype=jnp.bfloat16,
            )
            caches[2 * layer : 2 * layer + 2] = ck, cv
        return out, caches

    q = jnp.zeros((BATCH, 1, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    caches = [jnp.zeros(shape, jnp.uint16) for _ in range(4)]
    hlo = (
        jax.jit(step, donate_argnums=(1,))
        .lower(q, caches, jnp.asarray(CONTEXT, jnp.int32))
        .compile()
        .as_text()
    )
    cache_shape = "u16[" + ",".join(map(str, shape)) + "]"
    lines = [line for line in hlo.splitlines() if f"= {cache_shape}" in line]
    assert any(" parameter(" in line for line in lines), hlo  # The pattern matches.
    copies = [line for line in lines if " copy(" in line]
    assert not copies, "\n".join(copies)
