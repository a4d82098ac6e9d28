"""Resident mode: a cache whose whole KV fits the staging budget keeps it on device in the
state. Steps fetch nothing, still write back (guards, stale-state refusal), and must read
exactly what the tier holds, including after host-side changes of the tier (load, admit of
a shared prefix, init, recover)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

LAYERS, BATCH, MAX_LEN, KV_HEADS, Q_HEADS, HEAD_DIM, BT = 2, 2, 32, 2, 4, 8, 4


def _cache(tier="host", path=None, **kw):
    args = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        tier=tier,
        block_tokens=BT,
        staging_bytes=1 << 20,
        resident=True,
    )
    if tier == "file":
        args["path"] = path
    args.update(kw)
    return tps.OffloadedKVCache(**args)


def _qkv(x, layer, dtype):
    """The step's q [batch, 1, Q_HEADS, D] and k, v [batch, 1, KV_HEADS, D] of a layer."""
    q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], x.shape[1], Q_HEADS, HEAD_DIM))
    q = q * (jnp.asarray(layer, jnp.float32) + 1)
    return q, (q[:, :, :KV_HEADS] * 0.5).astype(dtype), (-q[:, :, :KV_HEADS]).astype(dtype)


def _step(dtype=jnp.float32, use_scan=False, implementation="xla", donate=True):
    """A jitted step over every layer; returns (outs per layer, state)."""

    def step(x, state):
        if use_scan:

            def body(state, layer):
                o, state = tps.prefetching_attention(
                    *_qkv(x, layer, dtype), state, layer=layer, implementation=implementation
                )
                return state, o

            state, outs = jax.lax.scan(body, state, jnp.arange(LAYERS))
            return list(outs), state
        outs = []
        for layer in range(LAYERS):
            o, state = tps.prefetching_attention(
                *_qkv(x, layer, dtype), state, layer=layer, implementation=implementation
            )
            outs.append(o)
        return outs, state

    return jax.jit(step, donate_argnums=(1,) if donate else ())


def _reference(cache, lengths, x):
    """Outputs of the same step by resident_attention over what the tier holds."""
    spec = cache.spec
    outs = []
    for layer in range(spec.num_layers):
        k_all, v_all = cache.read_all(layer, lengths)
        q, k, v = _qkv(x, layer, spec.dtype)
        out, _, _ = tps.resident_attention(
            q,
            k,
            v,
            jnp.asarray(k_all),
            jnp.asarray(v_all),
            jnp.asarray(lengths),
            window=spec.windows[layer],
        )
        outs.append(np.asarray(out, np.float32))
    return outs


def _fill(cache, state, lengths, seed=0, start=0):
    rng = np.random.default_rng(seed)
    n = max(max(lengths), 1)
    for layer in range(cache.spec.num_layers):
        kv = rng.standard_normal((2, BATCH, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
        kv = kv.astype(cache.spec.dtype)
        state = cache.load(state, layer, kv[0], kv[1], start=start, lengths=lengths)
    return state


def _lengths(state):
    return np.asarray(state.lengths).tolist()


def _x(seed):
    x = np.random.default_rng(seed).standard_normal((BATCH, 1, HEAD_DIM))
    return jnp.asarray(x, jnp.float32)


def _fetch_requests(cache):
    return sum(t["fetch"]["requests"] for t in cache.engine.stats()["tiers"])


def _decode_and_check(cache, state, step, steps, *, seed=1):
    """``steps`` steps, each checked against the tier's KV; the steps fetch nothing."""
    for i in range(steps):
        before = _lengths(state)
        x = _x(seed + i)
        want = _reference(cache, before, x)
        fetches = _fetch_requests(cache)
        outs, state = step(x, state)
        jax.block_until_ready(outs)
        assert _fetch_requests(cache) == fetches  # Reads of the tier are read_all's only.
        for layer in range(LAYERS):
            np.testing.assert_allclose(np.asarray(outs[layer], np.float32), want[layer], atol=1e-5)
        active = cache.capacity > 0
        assert _lengths(state) == [b + int(a) for b, a in zip(before, active)]
        state = cache.drain(state)  # read_all reads the tier: no write may be in flight.
    return state


# -- decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tier,use_scan,dtype,window",
    [
        ("host", False, jnp.float32, None),
        ("host", True, jnp.float32, None),
        ("file", False, jnp.bfloat16, [None, 5]),
        ("file", True, jnp.float32, [None, 5]),
    ],
)
def test_decode_matches_resident_attention_over_the_tier(tier, use_scan, dtype, window, tmp_path):
    with _cache(tier, str(tmp_path), dtype=dtype, sliding_window=window) as cache:
        spec = cache.spec
        assert spec.resident
        assert spec.staging_shape == (LAYERS, 2, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)
        row_bytes = KV_HEADS * HEAD_DIM * np.dtype(dtype).itemsize
        assert spec.device_bytes == LAYERS * 2 * BATCH * MAX_LEN * row_bytes
        state = _fill(cache, cache.init(), [9, 6])
        cache.engine.drain()
        writes = cache.engine.stats()["tiers"][cache.tier]["write_back"]["requests"]
        state = _decode_and_check(cache, state, _step(dtype, use_scan), 4)
        cache.engine.drain()  # Write-backs are detached: a step may return before its last ends.
        stats = cache.engine.stats()
        assert stats["prefetch_hits"] == 0 and stats["prefetch_misses"] == 0
        # Every layer of every step wrote back.
        assert stats["tiers"][cache.tier]["write_back"]["requests"] == writes + 4 * LAYERS


# With codes and scales (the harder case); plain rows take the same path in the xla tests.
@pytest.mark.parametrize("tier_dtype", ("int8",))
def test_pallas_implementation(tier_dtype):
    with _cache(tier_dtype=tier_dtype) as cache:
        state = _fill(cache, cache.init(), [7, 12])
        _decode_and_check(cache, state, _step(implementation="pallas"), 2)


def test_a_quantized_resident_cache_reads_its_codes_like_the_tier():
    with _cache(tier_dtype="int8") as cache:
        assert cache.spec.staging_shape == (LAYERS, 2, BATCH, MAX_LEN, cache.spec.row_bytes)
        assert cache.spec.staging_dtype == np.uint8
        state = _fill(cache, cache.init(), [9, 6])
        _decode_and_check(cache, state, _step(), 3)


def test_the_tier_holds_what_the_streaming_path_writes():
    """Same loads and steps on a resident and a streaming cache (3-token units): the same
    outputs and the same tier contents, byte for byte."""
    unit_bytes = 2 * 2 * BATCH * 3 * KV_HEADS * HEAD_DIM * 4
    with _cache() as resident, _cache(resident=False, staging_bytes=unit_bytes) as streaming:
        assert resident.spec.resident and not streaming.spec.resident
        assert streaming.spec.chunk_len == 3
        states = [_fill(c, c.init(), [9, 6]) for c in (resident, streaming)]
        step = _step()
        for i in range(5):
            x = _x(10 + i)
            outs = []
            for j, c in enumerate((resident, streaming)):
                o, states[j] = step(x, states[j])
                outs.append(o)
            for a, b in zip(*outs):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        states = [c.drain(s) for c, s in zip((resident, streaming), states)]
        assert _lengths(states[0]) == _lengths(states[1]) == [14, 11]
        for layer in range(LAYERS):
            for a, b in zip(resident.read_all(layer), streaming.read_all(layer)):
                np.testing.assert_array_equal(a, b)


# -- host-side changes of the tier ----------------------------------------------------------


def test_load_mid_way_is_seen_by_the_next_step():
    with _cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=24)  # Slot 1 stays inactive.
        state = _fill(cache, state, [8, 0])
        step = _step()
        state = _decode_and_check(cache, state, step, 2)
        # Overwrite rows the steps wrote, in one layer only.
        patch = np.full((BATCH, 3, KV_HEADS, HEAD_DIM), 0.25, np.float32)
        state = cache.load(state, 1, patch, -patch, start=[7, 0], lengths=[3, 0])
        state = _decode_and_check(cache, state, step, 1, seed=5)
        # Extend the context host-side in every layer: the lengths grow with it.
        state = _fill(cache, state, [4, 0], seed=3, start=[11, 0])
        assert _lengths(state) == [15, 0]
        _decode_and_check(cache, state, step, 2, seed=7)


def test_draining_an_older_state_refreshes_its_copy():
    """A state kept from before a load through another state holds an old copy: drain()
    makes it live with the tier's rows."""
    with _cache() as cache:
        old = cache.init([6, 4])  # Its copy: the tier's rows before the load below.
        newer = _fill(cache, cache.drain(old), [6, 4], seed=2)
        del newer
        _decode_and_check(cache, cache.drain(old), _step(), 2)


PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4, then 2 more.


def _prompt_kv(tokens, layer):
    """Deterministic KV of token ids: [2, n, H, D]."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    base = np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32).reshape(1, KV_HEADS, HEAD_DIM)
    k = np.sin(t * 0.37 + base * 0.11 + layer)
    return np.stack([k, -k])


def test_admit_of_a_shared_prefix_brings_its_rows_into_the_resident_copy():
    with _cache() as cache:
        state = cache.init(admit=False)
        a_tokens = PROMPT + [7, 8]
        state, _ = cache.admit(state, 0, tokens=a_tokens, max_tokens=16)
        for layer in range(LAYERS):
            full = np.zeros((2, BATCH, len(a_tokens), KV_HEADS, HEAD_DIM), np.float32)
            full[:, 0] = _prompt_kv(a_tokens, layer)
            state = cache.load(state, layer, full[0], full[1], lengths=[len(a_tokens), 0])
        state = cache.release(state, 0, tokens=a_tokens)
        # Slot 1 maps the two shared blocks (written through slot 0) and decodes at once.
        state, cached = cache.admit(state, 1, tokens=PROMPT + [9], max_tokens=20)
        assert cached == 8 and _lengths(state) == [0, 8]
        _decode_and_check(cache, state, _step(), 3)


def test_recover_after_a_refused_step_at_the_capacity_edge():
    """max_tokens=6: length 5 takes one more token (the last row of its capacity), length
    6 is refused before any byte moves; recover() continues from the tier."""
    with _cache(num_blocks=8) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=6)
        state, _ = cache.admit(state, 1, max_tokens=8)
        state = _fill(cache, state, [5, 2])
        step = _step()
        state = _decode_and_check(cache, state, step, 1)
        assert _lengths(state) == [6, 3]
        before = [cache.read_all(layer) for layer in range(LAYERS)]
        refused = "slot 0 holds 6 tokens and cannot take 1 more: its capacity is 6 tokens"
        with pytest.raises(Exception, match=refused + "; nothing was written"):
            jax.block_until_ready(step(_x(0), state))
        for layer in range(LAYERS):
            for a, b in zip(before[layer], cache.read_all(layer)):
                np.testing.assert_array_equal(a, b)
        state = cache.recover()
        assert _lengths(state) == [6, 3]
        state = cache.release(state, 0)
        state = _decode_and_check(cache, state, step, 2, seed=3)
        # A state lost after good steps: the recovered copy is rebuilt from the tier.
        _, state = step(_x(9), state)
        jax.block_until_ready(state)
        del state
        state = cache.recover()
        assert _lengths(state) == [0, 6]
        _decode_and_check(cache, state, step, 1, seed=11)


def test_a_stale_state_is_refused():
    with _cache() as cache:
        state = _fill(cache, cache.init(), [3, 3])
        step = _step(donate=False)  # The parent stays usable.
        _, child = step(_x(0), state)
        jax.block_until_ready(child)
        with pytest.raises(Exception, match="stale"):
            jax.block_until_ready(step(_x(1), state))
        cache.drain(child)


# -- choosing the mode ----------------------------------------------------------------------


def test_resident_true_must_fit_the_staging_budget_to_the_byte():
    row_bytes = KV_HEADS * HEAD_DIM * 4
    whole = LAYERS * 2 * BATCH * MAX_LEN * row_bytes
    with _cache(staging_bytes=whole) as cache:
        assert cache.spec.resident and cache.spec.device_bytes == whole
    with pytest.raises(ValueError, match=rf"= {whole} bytes, more than staging_bytes={whole - 1}"):
        _cache(staging_bytes=whole - 1)
    with _cache(staging_bytes=whole, resident="auto") as cache:
        assert cache.spec.resident
    with _cache(staging_bytes=whole - 1, resident="auto") as cache:
        assert not cache.spec.resident
    with _cache(resident=False) as cache:
        assert not cache.spec.resident
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="must be True, False or 'auto'"):
            _cache(resident=bad)


def test_the_default_streams_even_a_small_cache():
    args = dict(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=8)
    with tps.OffloadedKVCache(**args) as cache:
        assert not cache.spec.resident
        assert cache.spec.staging_shape[0] == cache.spec.num_slots


def test_an_inert_state_moves_no_bytes():
    with _cache() as cache:
        state = _fill(cache, cache.init(), [4, 4])
        state = cache.drain(state)
        before = [cache.read_all(layer) for layer in range(LAYERS)]
        outs, inert = _step()(_x(0), cache.inert_state())
        jax.block_until_ready(outs)
        assert _lengths(inert) == [0, 0]
        for layer in range(LAYERS):
            for a, b in zip(before[layer], cache.read_all(layer)):
                np.testing.assert_array_equal(a, b)
