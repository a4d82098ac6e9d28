"""A cache whose layers share one sliding window keeps only that window (``max_step_tokens``):
a ring of blocks per slot, reused as the sequence advances. Attention through many wraps
against the whole history in NumPy, exactly at the window's edges, on every path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import window_ring

LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 3, 2, 4, 8
WINDOW, BLOCK, STEP = 6, 4, 4  # Ring: (6 + 4 - 3) // 4 + 2 = 3 blocks = 12 tokens.
MAX_LEN = 256
SCALE = 1 / np.sqrt(HEAD_DIM)
ROW_BYTES = KV_HEADS * HEAD_DIM * 4

PATHS = {
    "in-place-host": dict(read_in_place=True),
    "streamed-host": dict(read_in_place=False, staging_bytes=2 * 2 * BATCH * 2 * ROW_BYTES),
    "file": dict(tier="file", prefetch_depth=2),
    "file-staged": dict(tier="file", read_in_place=False),
    "int8": dict(tier_dtype="int8", read_in_place=False),
}


def make_cache(path, tmp_path, **overrides):
    options = dict(PATHS.get(path, {}), **overrides)
    if options.get("tier") == "file":
        options["path"] = str(tmp_path)
    return tps.OffloadedKVCache(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        block_tokens=BLOCK,
        sliding_window=WINDOW,
        max_step_tokens=STEP,
        **options,
    )


def make_step(q_len):
    def step(q, k, v, counts, state):
        outs = []
        for layer in range(LAYERS):
            o, state = tps.prefetching_attention(
                q[layer], k[layer], v[layer], state, layer=layer, query_seq_lengths=counts
            )
            outs.append(o)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=(4,))


def windowed(q, keys, values, position, window):
    """f64 attention of one query row (at ``position``) over ``keys[: position + 1]``,
    those within ``window`` of it."""
    group = Q_HEADS // KV_HEADS
    lo = max(0, position - window + 1)
    out = np.zeros((Q_HEADS, HEAD_DIM))
    for h in range(Q_HEADS):
        kk = keys[lo : position + 1, h // group].astype(np.float64)
        logits = kk @ q[h].astype(np.float64) * SCALE
        p = np.exp(logits - logits.max())
        out[h] = (p / p.sum()) @ values[lo : position + 1, h // group].astype(np.float64)
    return out


def run_against_history(cache, rng, schedule, start=None, tol=2e-5):
    """Runs the steps of ``schedule`` (per step, int[BATCH] real rows) and checks every
    real row against the whole history; returns the history [L, 2, B, n, H, D]."""
    history = np.zeros((LAYERS, 2, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM), np.float32)
    lengths = np.zeros(BATCH, np.int64)
    state = cache.init()
    if start is not None:  # A long context loaded first: only its window is written.
        n = int(start)
        for layer in range(LAYERS):
            history[layer, :, :, :n] = rng.standard_normal((2, BATCH, n, KV_HEADS, HEAD_DIM))
            state = cache.load(state, layer, history[layer, 0, :, :n], history[layer, 1, :, :n])
        lengths[:] = n
    step = make_step(STEP)
    for counts in schedule:
        counts = np.asarray(counts)
        shape = (LAYERS, BATCH, STEP)
        q = rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)).astype(np.float32)
        k = rng.standard_normal((*shape, KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((*shape, KV_HEADS, HEAD_DIM)).astype(np.float32)
        outs, state = step(q, k, v, jnp.asarray(counts, jnp.int32), state)
        outs = np.asarray(outs)
        for layer in range(LAYERS):
            for b in range(BATCH):
                n, c = int(lengths[b]), int(counts[b])
                history[layer, 0, b, n : n + c] = k[layer, b, :c]
                history[layer, 1, b, n : n + c] = v[layer, b, :c]
                for i in range(c):
                    want = windowed(
                        q[layer, b, i], history[layer, 0, b], history[layer, 1, b], n + i, WINDOW
                    )
                    np.testing.assert_allclose(
                        outs[layer, b, i],
                        want,
                        rtol=tol,
                        atol=tol,
                        err_msg=f"layer {layer} slot {b} position {n + i}",
                    )
        lengths += counts
        np.testing.assert_array_equal(np.asarray(state.lengths), lengths)
    return cache.drain(state), history, lengths


# Lengths walk through W-1, W, W+1, every block boundary and many ring wraps (the ring is
# 12 tokens: 70 tokens wrap it 5 times); slot 1 takes whole steps that cross the wrap, slot
# 2 is idle some steps.
SCHEDULE = [[1, 4, 0]] * 3 + [[1, 3, 2], [2, 4, 4], [1, 1, 0], [4, 4, 3]] * 7


@pytest.mark.parametrize("path", list(PATHS))
def test_ring_matches_the_whole_history(path, tmp_path):
    rng = np.random.default_rng(sum(map(ord, path)))
    tol = 0.06 if path == "int8" else 2e-5
    with make_cache(path, tmp_path) as cache:
        ring = window_ring.ring_blocks(WINDOW, STEP, BLOCK)
        assert cache.spec.ring_blocks == ring == 3
        # The tier holds each slot's ring, whatever max_len.
        assert cache.spec.num_blocks == BATCH * ring
        state, history, lengths = run_against_history(cache, rng, SCHEDULE, tol=tol)
        assert lengths.max() > 4 * ring * BLOCK  # Several wraps.
        if path != "int8":
            for layer in range(LAYERS):
                for b in range(BATCH):
                    lo = int(window_ring.kept_from(lengths[b], WINDOW))
                    k, v = cache.read(state, layer, b, lo)
                    np.testing.assert_array_equal(k, history[layer, 0, b, lo : lengths[b]])
                    np.testing.assert_array_equal(v, history[layer, 1, b, lo : lengths[b]])


@pytest.mark.parametrize("length", [WINDOW - 1, WINDOW, WINDOW + 1, 2 * BLOCK, 11, 12, 13])
def test_window_edges_after_a_loaded_context(length, tmp_path):
    """A loaded context of exactly W-1, W, W+1 tokens, a block boundary and the ring's own
    size (12) +-1, then steps: only the window's rows were written, and they are right."""
    rng = np.random.default_rng(length)
    with make_cache("in-place-host", tmp_path) as cache:
        run_against_history(cache, rng, [[1, 4, 2], [4, 1, 3], [2, 2, 4]], start=length)


def test_a_long_load_writes_only_the_window(tmp_path):
    """A 200-token load into a 12-token ring: the kept rows are the last W - 1."""
    rng = np.random.default_rng(1)
    with make_cache("in-place-host", tmp_path) as cache:
        state = cache.init()
        k = rng.standard_normal((BATCH, 200, KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((BATCH, 200, KV_HEADS, HEAD_DIM)).astype(np.float32)
        for layer in range(LAYERS):
            state = cache.load(state, layer, k, v)
        np.testing.assert_array_equal(np.asarray(state.lengths), [200] * BATCH)
        lo = 200 - WINDOW + 1
        got_k, got_v = cache.read(state, 1, 2, lo)
        np.testing.assert_array_equal(got_k, k[2, lo:])
        np.testing.assert_array_equal(got_v, v[2, lo:])
        # One position before the window is refused, by name.
        with pytest.raises(ValueError, match=r"reaches before position 195: slot 2 keeps only"):
            cache.read(state, 1, 2, lo - 1)
        full_k, _ = cache.read_all(1, lengths=200)
        np.testing.assert_array_equal(full_k[2, lo:200], k[2, lo:])
        assert not full_k[2, :lo].any()


def test_a_step_longer_than_max_step_tokens_is_refused(tmp_path):
    with make_cache("in-place-host", tmp_path) as cache:
        state = cache.init()
        x = jnp.zeros((BATCH, STEP + 1, Q_HEADS, HEAD_DIM), jnp.float32)
        kv = jnp.zeros((BATCH, STEP + 1, KV_HEADS, HEAD_DIM), jnp.float32)
        with pytest.raises(ValueError, match=r"q_len=5 exceeds max_step_tokens=4"):
            tps.prefetching_attention(x, kv, kv, state, layer=0)
        # Exactly max_step_tokens passes.
        out, _ = tps.prefetching_attention(x[:, :STEP], kv[:, :STEP], kv[:, :STEP], state, layer=0)
        assert out.shape == (BATCH, STEP, Q_HEADS, HEAD_DIM)


def test_refusals_name_the_problem():
    common = dict(num_layers=2, batch=1, max_len=64, num_kv_heads=1, head_dim=8, block_tokens=4)
    with pytest.raises(ValueError, match=r"needs every layer to share one sliding window"):
        tps.OffloadedKVCache(sliding_window=[4, None], max_step_tokens=2, **common)
    with pytest.raises(ValueError, match=r"needs every layer to share one sliding window"):
        tps.OffloadedKVCache(max_step_tokens=2, **common)
    with pytest.raises(ValueError, match=r"max_step_tokens=0 must be an int in \[1, max_len=64\]"):
        tps.OffloadedKVCache(sliding_window=4, max_step_tokens=0, **common)
    with pytest.raises(ValueError, match=r"resident=True copies every position"):
        tps.OffloadedKVCache(sliding_window=4, max_step_tokens=2, resident=True, **common)


def test_ring_blocks_arithmetic_at_its_edges():
    """The ring covers every span of W + step - 1 positions, wherever it starts in a block,
    and one block fewer would not (a span starting on a block's last row needs them all)."""
    for window in range(1, 20):
        for step in range(1, 10):
            for bt in (1, 2, 4, 8):
                r = window_ring.ring_blocks(window, step, bt)
                span = window + step - 1
                worst = max((s + span - 1) // bt - s // bt + 1 for s in range(bt))
                assert worst == r, (window, step, bt)


@pytest.mark.parametrize("max_tokens", [1, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 1, MAX_LEN])
def test_admit_and_release_at_every_ring_size(max_tokens, tmp_path):
    """A slot admitted for fewer tokens than the ring holds gets fewer blocks (it never
    wraps); one admitted for more gets the ring; release frees each block once."""
    with make_cache("in-place-host", tmp_path) as cache:
        state = cache.init(admit=False)
        free = cache.free_blocks
        state, _ = cache.admit(state, 1, max_tokens=max_tokens)
        held = min(-(-max_tokens // BLOCK), cache.spec.ring_blocks)
        assert cache.free_blocks == free - held
        table = cache.block_tables[1]
        assert len(set(table.tolist())) == held
        np.testing.assert_array_equal(table, table[np.arange(len(table)) % held])
        state = cache.release(state, 1)
        assert cache.free_blocks == free


def _steps(cache, state, slot, rows, history, lengths, rng, step):
    """Feeds ``rows`` rows to ``slot`` (chunks of STEP; the other slots idle) and checks
    every output against ``history`` (the slot's whole KV, extended here); publishes the
    completed windows after each step."""
    fed = 0
    while fed < rows:
        n = min(STEP, rows - fed)
        counts = np.zeros(BATCH, np.int64)
        counts[slot] = n
        shape = (LAYERS, BATCH, STEP)
        q = rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)).astype(np.float32)
        k = rng.standard_normal((*shape, KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((*shape, KV_HEADS, HEAD_DIM)).astype(np.float32)
        outs, state = step(q, k, v, jnp.asarray(counts, jnp.int32), state)
        outs = np.asarray(outs)
        p0 = int(lengths[slot])
        for layer in range(LAYERS):
            history[layer, 0, p0 : p0 + n] = k[layer, slot, :n]
            history[layer, 1, p0 : p0 + n] = v[layer, slot, :n]
            for i in range(n):
                want = windowed(
                    q[layer, slot, i], history[layer, 0], history[layer, 1], p0 + i, WINDOW
                )
                np.testing.assert_allclose(outs[layer, slot, i], want, rtol=2e-5, atol=2e-5)
        lengths[slot] += n
        fed += n
        cache.publish_windows(state, slot)
    return state


@pytest.mark.parametrize(
    "full_pool, shared, expect",
    [
        (False, 17, 16),  # The longest block-aligned common prefix.
        (False, 16, 16),  # Exactly at a block boundary.
        (False, 8, 8),  # A window reaching back to position 3: blocks 0 and 1.
        (False, 3, 0),  # Less than a block in common.
        (True, 17, 0),  # No free block for copies: nothing cached, nothing found.
    ],
)
def test_a_prompts_windows_are_found_by_the_next_prompt(full_pool, shared, expect, tmp_path):
    """A's prompt is prefilled in steps, its completed blocks copied as it goes; B, whose
    prompt shares A's first ``shared`` tokens, starts from the longest prefix whose window
    blocks are all cached, with A's rows there, and attends exactly as over the whole
    history. With no room for copies, B starts from 0 (never from stale rows)."""
    rng = np.random.default_rng(shared + full_pool)
    with make_cache("in-place-host", tmp_path) as cache:  # One ring per slot, no spare.
        step = make_step(STEP)
        state = cache.init(admit=False)
        if full_pool:  # The other slots hold the rest of the pool.
            state, _ = cache.admit(state, 1)
            state, _ = cache.admit(state, 2)
        prompt_a = np.arange(100, 123)
        state, cached = cache.admit(state, 0, tokens=prompt_a)
        assert cached == 0
        history_a = np.zeros((LAYERS, 2, MAX_LEN, KV_HEADS, HEAD_DIM), np.float32)
        lengths = np.zeros(BATCH, np.int64)
        state = _steps(cache, state, 0, 23, history_a, lengths, rng, step)
        state = cache.release(state, 0)
        if full_pool:
            state = cache.release(state, 1)
        prompt_b = np.concatenate([prompt_a[:shared], 900 + np.arange(19 - shared)])
        state, cached = cache.admit(state, 1, tokens=prompt_b)
        assert cached == expect
        np.testing.assert_array_equal(np.asarray(state.lengths)[1], expect)
        lengths[:] = 0
        lengths[1] = cached
        history_b = np.zeros_like(history_a)
        history_b[:, :, :cached] = history_a[:, :, :cached]  # The same tokens' KV.
        _steps(cache, state, 1, len(prompt_b) - cached + 5, history_b, lengths, rng, step)
        assert (cache.prefix_stats["window_hits"] > 0) == (expect > 0)


@pytest.mark.parametrize(
    "damaged, expect",
    [
        (None, 16),  # Blocks 4-5 are the reader's own tokens: 16's window (2-3) is whole.
        (3, 12),  # The last block of 16's window is damaged: 12's (blocks 1-2) is whole.
        (2, 8),  # 16's and 12's windows both need block 2: 8's (blocks 0-1) is whole.
    ],
)
def test_a_fresh_cache_maps_the_longest_prefix_whose_window_a_directory_holds_whole(
    damaged, expect, tmp_path
):
    """A publishes its 23-token prompt's windows to a shared directory. A fresh cache
    admits a prompt sharing A's first 16 tokens and going on with others: the window of
    its longest candidate prefix is not in the directory, nor is, with a damaged block,
    the window of every prefix that needs that block; it maps the longest prefix whose
    window blocks are all there and whole, and attends as over the whole history."""
    rng = np.random.default_rng(40 + (damaged or 0))
    shared = dict(shared_prefix_dir=str(tmp_path / "shared"))
    step = make_step(STEP)
    prompt_a = np.arange(100, 123)
    history_a = np.zeros((LAYERS, 2, MAX_LEN, KV_HEADS, HEAD_DIM), np.float32)
    with make_cache("in-place-host", tmp_path, **shared) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=prompt_a)
        state = _steps(cache, state, 0, 23, history_a, np.zeros(BATCH, np.int64), rng, step)
        cache.close(cache.release(state, 0))
        if damaged is not None:
            key = cache.slots.prefix.keys(prompt_a[: 4 * (damaged + 1)])[damaged]
            path = cache.slots.remote_levels[0].directory.file_of(key)
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.write_bytes(bytes(data))
    prompt_b = np.concatenate([prompt_a[:16], 900 + np.arange(10)])
    with make_cache("in-place-host", tmp_path, **shared) as cache:
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 1, tokens=prompt_b)
        assert cached == expect
        assert cache.prefix_stats["shared_damaged"] == (damaged is not None)
        lengths = np.zeros(BATCH, np.int64)
        lengths[1] = cached
        history_b = np.zeros_like(history_a)
        history_b[:, :, :cached] = history_a[:, :, :cached]  # The same tokens' KV.
        _steps(cache, state, 1, len(prompt_b) - cached + 3, history_b, lengths, rng, step)
