"""Per-slot token counts (``query_seq_lengths``): one step in which each slot takes its own
number of rows (a decode token, a prompt chunk, nothing), on every path, against attention
computed per slot in NumPy over what the tier holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import quantize

LAYERS, BATCH, MAX_LEN, KV_HEADS, Q_HEADS, HEAD_DIM, Q_LEN = 2, 4, 32, 2, 4, 8, 8
SCALE = 1 / np.sqrt(HEAD_DIM)
START = np.array([10, 0, 27, 2])
# Real rows per slot and step: ragged, 0s, a whole prompt chunk, and slot 2 filled to exactly
# its capacity (27 + 5 = 32 = max_len) by a padded chunk, which q_len alone would refuse.
COUNTS = [np.array([1, 8, 5, 3]), np.array([0, 3, 0, 1]), np.array([1, 8, 0, 0])]
ROW_BYTES = KV_HEADS * HEAD_DIM * 4
CHUNKED = 2 * 2 * BATCH * 8 * ROW_BYTES  # Two staging slots of 8-token units.
UNCHUNKED = 1 << 20

PATHS = {
    # name: (cache options, step options, steps run)
    "streamed-host": (dict(read_in_place=False, staging_bytes=CHUNKED), {}, 3),
    "in-place-host": (dict(read_in_place=True, staging_bytes=CHUNKED), {}, 3),
    "file": (dict(tier="file", staging_bytes=CHUNKED, prefetch_depth=2), {}, 3),
    "file-staged": (
        dict(tier="file", read_in_place=False, staging_bytes=CHUNKED, prefetch_depth=2),
        {},
        3,
    ),
    "resident": (dict(resident=True), {}, 3),
    "int8": (dict(tier_dtype="int8", read_in_place=False, staging_bytes=CHUNKED // 2), {}, 3),
    "int8-in-place": (dict(tier_dtype="int8", read_in_place=True, block_tokens=8), {}, 2),
    "two-level": (
        dict(block_tokens=4, num_blocks=32, spill_blocks=8, staging_bytes=CHUNKED),
        {},
        3,
    ),
    "pallas": (
        dict(read_in_place=False, staging_bytes=UNCHUNKED),
        dict(implementation="pallas"),
        1,
    ),
    "mesh-2x2": (dict(staging_bytes=CHUNKED // 2), {}, 2),
    "scan": (dict(read_in_place=False, staging_bytes=CHUNKED), dict(scan=True), 3),
    "window": (dict(read_in_place=False, staging_bytes=CHUNKED, sliding_window=[None, 6]), {}, 3),
    "window-in-place": (dict(read_in_place=True, sliding_window=[6, None]), dict(scan=True), 2),
    "prefetch-across-steps": (
        dict(tier="file", staging_bytes=CHUNKED, prefetch_across_steps=True),
        {},
        3,
    ),
}


def make_cache(path, tmp_path, **overrides):
    options = dict(PATHS[path][0], **overrides)
    for key, wanted in (
        ("path", options.get("tier") == "file"),
        ("spill_path", "spill_blocks" in options),
    ):
        if wanted:
            (tmp_path / key).mkdir(exist_ok=True)
            options[key] = str(tmp_path / key)
    args = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        **options,
    )
    if path.startswith("mesh"):
        mesh = jax.make_mesh((2, 2), ("data", "model"))
        return tps.kv_cache(mesh=mesh, batch_axis="data", kv_heads_axis="model", **args)
    return tps.OffloadedKVCache(**args)


def lengths_of(cache, state) -> np.ndarray:
    return cache.lengths(state)


def as_tier_holds(x: np.ndarray, cache) -> np.ndarray:
    """What the tier gives back for KV ``x`` [..., H, D] (dequantized rows if quantized)."""
    tier_dtype = cache.spec.tier_dtype
    if tier_dtype is None:
        return x
    rows = quantize.quantize_host(x, np.dtype(tier_dtype))
    return quantize.dequantize_host(
        quantize.unpack_host(rows, np.dtype(tier_dtype), KV_HEADS, HEAD_DIM), np.float32
    )


def make_step(*, scan=False, **options):
    """jit(step)(q, k, v, counts, state): every layer's attention, inputs stacked by layer."""

    def step(q, k, v, counts, state):
        if scan:

            def body(state, xs):
                q, k, v, layer = xs
                o, state = tps.prefetching_attention(
                    q, k, v, state, layer=layer, query_seq_lengths=counts, **options
                )
                return state, o

            state, outs = jax.lax.scan(body, state, (q, k, v, jnp.arange(LAYERS)))
            return outs, state
        outs = []
        for layer in range(LAYERS):
            o, state = tps.prefetching_attention(
                q[layer],
                k[layer],
                v[layer],
                state,
                layer=layer,
                query_seq_lengths=counts,
                **options,
            )
            outs.append(o)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=(4,))


def expected(q, k, v, held_k, held_v, lengths, counts, window):
    """Per slot in NumPy (f64): query row i of slot b at position lengths[b] + i over the
    cached rows [0, lengths[b]) and the step's rows j <= i, j < counts[b]; rows < counts."""
    out = np.zeros(q.shape, np.float64)
    group = Q_HEADS // KV_HEADS
    for b in range(q.shape[0]):
        n, c = int(lengths[b]), int(counts[b])
        keys = np.concatenate([held_k[b, :n], k[b, :c]]).astype(np.float64)
        values = np.concatenate([held_v[b, :n], v[b, :c]]).astype(np.float64)
        pos = np.arange(n + c)
        for i in range(c):
            seen = pos <= n + i
            if window is not None:
                seen &= pos > n + i - window
            for h in range(Q_HEADS):
                logits = keys[seen, h // group] @ q[b, i, h].astype(np.float64) * SCALE
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ values[seen, h // group]
    return out


def loaded(cache, rng, lengths=START):
    """A state with ``lengths`` of random context; (state, held [L, 2, B, MAX_LEN, H, D])."""
    state = cache.init()
    held = rng.standard_normal((LAYERS, 2, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
    n = int(max(lengths))
    for layer in range(LAYERS):
        state = cache.load(
            state, layer, held[layer, 0, :, :n], held[layer, 1, :, :n], lengths=lengths
        )
        held[layer] = as_tier_holds(held[layer], cache)
    return state, held


def snapshot(cache):
    """Every layer's K and V of every slot, up to its capacity: [L, 2, B, MAX_LEN, H, D]."""
    return np.stack([np.stack(cache.read_all(layer)) for layer in range(LAYERS)])


@pytest.mark.parametrize("path", list(PATHS))
def test_ragged_steps_match_per_slot_attention(path, tmp_path):
    if path.startswith("mesh") and len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    rng = np.random.default_rng(sum(map(ord, path)))
    cache_options, step_options, steps = PATHS[path]
    windows = cache_options.get("sliding_window", [None] * LAYERS)
    tol = 1e-4 if path != "in-place-host" else 2e-4
    with make_cache(path, tmp_path) as cache:
        state, held = loaded(cache, rng)
        before = snapshot(cache)
        step = make_step(**step_options)
        lengths = START.copy()
        for counts in COUNTS[:steps]:
            q = rng.standard_normal((LAYERS, BATCH, Q_LEN, Q_HEADS, HEAD_DIM)).astype(np.float32)
            k = rng.standard_normal((LAYERS, BATCH, Q_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal((LAYERS, BATCH, Q_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
            outs, state = step(q, k, v, jnp.asarray(counts, jnp.int32), state)
            outs = np.asarray(outs)
            assert np.isfinite(outs).all()  # Padding rows' outputs too.
            for layer in range(LAYERS):
                want = expected(
                    q[layer],
                    k[layer],
                    v[layer],
                    held[layer, 0],
                    held[layer, 1],
                    lengths,
                    counts,
                    windows[layer],
                )
                for b in range(BATCH):
                    c = counts[b]
                    np.testing.assert_allclose(
                        outs[layer, b, :c],
                        want[b, :c],
                        rtol=tol,
                        atol=tol,
                        err_msg=f"layer {layer} slot {b}",
                    )
                for b in range(BATCH):  # The real rows land at the slot's length.
                    n, c = lengths[b], counts[b]
                    held[layer, 0, b, n : n + c] = as_tier_holds(k[layer, b, :c], cache)
                    held[layer, 1, b, n : n + c] = as_tier_holds(v[layer, b, :c], cache)
            lengths = lengths + counts
            np.testing.assert_array_equal(lengths_of(cache, state), lengths)
        if path in ("prefetch-across-steps", "file", "file-staged"):
            stats = cache.engine.stats()
            # A file tier read in place attends each unit where it landed; staged, none.
            assert (stats["landed_reads"] > 0) == (path != "file-staged"), stats
            # The next step's units were walked at the per-slot lengths: only the first
            # prefetch_depth units were cold (a walk at lengths + q_len misses every step's).
            depth = cache.spec.prefetch_depth
            assert stats["prefetch_hits"] > 0 and stats["prefetch_misses"] == depth, stats
        state = cache.drain(state)
        after = snapshot(cache)
        for b in range(BATCH):
            n = lengths[b]
            # Every real row, and nothing past the slot's length: padding rows never landed.
            np.testing.assert_allclose(after[:, :, b, :n], held[:, :, b, :n], rtol=1e-6, atol=0)
            np.testing.assert_array_equal(after[:, :, b, n:], before[:, :, b, n:])


@pytest.mark.parametrize("path", ["streamed-host", "in-place-host", "resident"])
def test_capacity_is_checked_on_each_slots_count(path, tmp_path):
    """count == capacity - length passes (a padded chunk of q_len would not); one more real
    row is refused by name, before any byte moves, and recover() keeps the counts."""
    rng = np.random.default_rng(7)
    with make_cache(path, tmp_path) as cache:
        state, _ = loaded(cache, rng)
        step = make_step()
        qkv = [
            jnp.asarray(rng.standard_normal((LAYERS, BATCH, Q_LEN, h, HEAD_DIM)), jnp.float32)
            for h in (Q_HEADS, KV_HEADS, KV_HEADS)
        ]
        _, state = step(*qkv, jnp.asarray([1, 2, 5, 0], jnp.int32), state)  # 27 + 5 = 32.
        np.testing.assert_array_equal(np.asarray(state.lengths), [11, 2, 32, 2])
        state = cache.drain(state)
        before = snapshot(cache)
        with pytest.raises(
            Exception, match="slot 2 holds 32 tokens and cannot take 1 more: its capacity is 32"
        ):
            jax.block_until_ready(step(*qkv, jnp.asarray([1, 0, 1, 0], jnp.int32), state))
        np.testing.assert_array_equal(snapshot(cache), before)  # Nothing was written.
        state = cache.recover()
        np.testing.assert_array_equal(np.asarray(state.lengths), [11, 2, 32, 2])
        # Concrete counts outside [0, q_len] are refused at trace time.
        with pytest.raises(ValueError, match=r"query_seq_lengths\[1\]=9 must be in \[0, q_len=8\]"):
            tps.prefetching_attention(
                qkv[0][0],
                qkv[1][0],
                qkv[2][0],
                state,
                layer=0,
                query_seq_lengths=np.array([1, 9, 0, 0]),
            )
        cache.drain(state)


def test_a_prompt_beside_a_decoding_slot_leaves_its_kv_alone(tmp_path):
    """One [2, 8] step: slot 0 decoding takes no token (count 0), slot 1 its 8-token prompt.
    Slot 0's KV and length are untouched (without counts it took 8 junk rows)."""
    rng = np.random.default_rng(8)
    with tps.OffloadedKVCache(
        num_layers=LAYERS,
        batch=2,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        read_in_place=False,
        staging_bytes=UNCHUNKED,
    ) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0)
        context = rng.standard_normal((2, 2, 10, KV_HEADS, HEAD_DIM)).astype(np.float32)
        for layer in range(LAYERS):
            state = cache.load(state, layer, context[0], context[1], lengths=[10, 0])
        state, cached = cache.admit(state, 1)
        assert cached == 0
        a_before = [cache.read(state, layer, 0) for layer in range(LAYERS)]
        a_all = [cache.read_all(layer)[0][0] for layer in range(LAYERS)]

        def step(q, k, v, counts, state):
            for layer in range(LAYERS):
                _, state = tps.prefetching_attention(
                    q, k * (layer + 1), v, state, layer=layer, query_seq_lengths=counts
                )
            return state

        step = jax.jit(step, donate_argnums=(4,))
        q = jnp.asarray(rng.standard_normal((2, 8, Q_HEADS, HEAD_DIM)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((2, 8, KV_HEADS, HEAD_DIM)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((2, 8, KV_HEADS, HEAD_DIM)), jnp.float32)
        state = cache.drain(step(q, k, v, jnp.asarray([0, 8], jnp.int32), state))
        np.testing.assert_array_equal(np.asarray(state.lengths), [10, 8])
        for layer in range(LAYERS):
            got_k, got_v = cache.read(state, layer, 0)
            np.testing.assert_array_equal(got_k, a_before[layer][0])
            np.testing.assert_array_equal(got_v, a_before[layer][1])
            np.testing.assert_array_equal(cache.read_all(layer)[0][0], a_all[layer])
            b_k, b_v = cache.read(state, layer, 1)
            np.testing.assert_array_equal(b_k, np.asarray(k[1]) * (layer + 1))
            np.testing.assert_array_equal(b_v, np.asarray(v[1]))


def test_one_compiled_step_serves_prompts_of_one_to_three_chunks(tmp_path):
    """Slot 0 decodes while slots 1-3 prefill prompts of 5, 13 and 20 tokens (1, 2 and 3
    chunks of 8), all through one compiled step."""
    rng = np.random.default_rng(9)
    prompts = {1: 5, 2: 13, 3: 20}
    with make_cache("streamed-host", tmp_path) as cache:
        state, held = loaded(cache, rng, lengths=np.array([10, 0, 0, 0]))
        traces = []

        def step(q, k, v, counts, state):
            traces.append(1)
            for layer in range(LAYERS):
                _, state = tps.prefetching_attention(
                    q, k, v, state, layer=layer, query_seq_lengths=counts
                )
            return state

        step = jax.jit(step, donate_argnums=(4,))
        rows = {
            b: rng.standard_normal((2, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
            for b, n in prompts.items()
        }
        done = dict.fromkeys(prompts, 0)
        while any(done[b] < n for b, n in prompts.items()):
            counts = np.zeros(BATCH, np.int32)
            k = np.zeros((BATCH, Q_LEN, KV_HEADS, HEAD_DIM), np.float32)
            v = np.zeros_like(k)
            counts[0] = 1
            k[0, 0], v[0, 0] = rng.standard_normal((2, KV_HEADS, HEAD_DIM))
            for b, n in prompts.items():
                c = min(Q_LEN, n - done[b])
                counts[b] = c
                k[b, :c], v[b, :c] = rows[b][:, done[b] : done[b] + c]
                done[b] += c
            q = rng.standard_normal((BATCH, Q_LEN, Q_HEADS, HEAD_DIM)).astype(np.float32)
            state = step(q, k, v, jnp.asarray(counts), state)
        assert len(traces) == 1 and step._cache_size() == 1
        state = cache.drain(state)
        np.testing.assert_array_equal(np.asarray(state.lengths), [13, 5, 13, 20])
        for layer in range(LAYERS):
            for b in prompts:
                got_k, got_v = cache.read(state, layer, b)
                np.testing.assert_array_equal(got_k, rows[b][0])
                np.testing.assert_array_equal(got_v, rows[b][1])
            got_k, _ = cache.read(state, layer, 0, 0, 10)
            np.testing.assert_array_equal(got_k, held[layer, 0, 0, :10])


def test_resident_attention_takes_per_slot_counts():
    """The device-resident baseline: padding rows are neither written nor keys, and a row
    filled to max_len by a padded chunk keeps its cached keys (no clamped slice update)."""
    rng = np.random.default_rng(10)
    cache_k = rng.standard_normal((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache_v = rng.standard_normal((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((BATCH, Q_LEN, Q_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((BATCH, Q_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((BATCH, Q_LEN, KV_HEADS, HEAD_DIM)).astype(np.float32)
    counts = COUNTS[0]
    fn = jax.jit(
        lambda q, k, v, ck, cv, lengths, counts: tps.resident_attention(
            q, k, v, ck, cv, lengths, window=6, query_seq_lengths=counts
        )
    )
    out, new_k, new_v = fn(q, k, v, cache_k, cache_v, START, counts)
    want = expected(q, k, v, cache_k, cache_v, START, counts, 6)
    for b in range(BATCH):
        c, n = counts[b], START[b]
        np.testing.assert_allclose(np.asarray(out)[b, :c], want[b, :c], rtol=1e-5, atol=1e-5)
        for got, old, new in ((new_k, cache_k, k), (new_v, cache_v, v)):
            got = np.asarray(got)
            np.testing.assert_array_equal(got[b, :n], old[b, :n])
            np.testing.assert_array_equal(got[b, n : n + c], new[b, :c])
            np.testing.assert_array_equal(got[b, n + c :], old[b, n + c :])
    assert np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match=r"lengths \+ query_seq_lengths = 33 exceeds max_len=32"):
        tps.resident_attention(q, k, v, cache_k, cache_v, START, query_seq_lengths=[1, 1, 6, 1])


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernels_mask_a_steps_padding_rows(kernel):
    """The step's own rows through a Pallas kernel (interpret mode), as the step calls it:
    keys at the queries' own positions (k_start == q_start), k_valid the slot's count (0:
    no key at all). Real rows match the reference; every row is finite."""
    from jax_tpusync import kernels

    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((BATCH, Q_LEN, Q_HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((BATCH, Q_LEN, KV_HEADS, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((BATCH, Q_LEN, KV_HEADS, HEAD_DIM)), jnp.float32)
    start = jnp.asarray(START, jnp.int32)
    counts = jnp.asarray([1, 8, 5, 0], jnp.int32)
    args = (q, k, v, start, counts, start)
    want, want_lse = kernels.chunk_attention_reference(*args, scale=SCALE, window=3)
    got, lse = kernels.chunk_attention(
        *args,
        scale=SCALE,
        window=3,
        backend=kernel,
        block_kv=8 if kernel == "tpu" else 16,
        interpret=True,
    )
    assert np.isfinite(np.asarray(got)).all()
    for b, c in enumerate(np.asarray(counts)):
        np.testing.assert_allclose(np.asarray(got)[b, :c], np.asarray(want)[b, :c], atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse)[b, :c], np.asarray(want_lse)[b, :c], atol=1e-5)
    assert np.isneginf(np.asarray(lse)[3]).all()  # Count 0: the slot's rows see no key here.
