"""Sparse decode on the engine's caches (``OffloadedKVCache(sparse=...)``): a budget of 1.0
equals the dense path; a small budget equals masked attention over the exact and predicted
blocks (built from the tier's rows); the prediction counts are exact on a constructed case;
the summaries follow KV that enters by load, by admit of a cached prefix and by re-attach;
a prefill chunk reads densely; what is not supported is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.runtime import backend
from jax_tpusync.sparse import SparseConfig, prediction, reference, select, summaries

LAYERS, BATCH, MAX_LEN, KV_HEADS, Q_HEADS, HEAD_DIM, BT = 2, 2, 128, 2, 4, 16, 8
LENGTHS = np.array([70, 45])

# (tier, read_in_place): the CPU defaults (a host tier read in place, a file tier attended
# where it landed) and streaming through staging.
PATHS = [("host", "auto"), ("file", "auto"), ("host", False), ("file", False)]
in_place_only = pytest.mark.skipif(
    backend.in_place_blocker() is not None, reason="read in place on the CPU backend only"
)


def _cache(tmp_path, tier, read_in_place, sparse, **kw):
    options = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=np.float32,
        block_tokens=BT,
        # Units of 32 rows: several per layer, so the walk and its prefetch chain run.
        staging_bytes=3 * 2 * BATCH * 32 * KV_HEADS * HEAD_DIM * 4,
        prefetch_depth=2,
        read_in_place=read_in_place,
    )
    if tier == "file":
        path = tmp_path / ("sparse" if sparse is not None else "dense")
        path.mkdir(exist_ok=True)
        options.update(tier="file", path=path)
    if sparse is not None:
        options["sparse"] = sparse
    options.update(kw)
    return tps.OffloadedKVCache(**options)


def _loaded(cache, rng, lengths=LENGTHS):
    state = cache.init()
    for layer in range(LAYERS):
        k, v = rng.standard_normal((2, BATCH, int(lengths.max()), KV_HEADS, HEAD_DIM))
        state = cache.load(
            state, layer, k.astype(np.float32), v.astype(np.float32), lengths=lengths
        )
    return state


def _step_fn(layers=LAYERS):
    def step(q, k, v, state):
        outs = []
        for layer in range(layers):
            o, state = tps.prefetching_attention(q[layer], k[layer], v[layer], state, layer=layer)
            outs.append(o)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=(3,))


def _inputs(rng, q_len=1):
    q = rng.standard_normal((LAYERS, BATCH, q_len, Q_HEADS, HEAD_DIM)).astype(np.float32)
    k, v = rng.standard_normal((2, LAYERS, BATCH, q_len, KV_HEADS, HEAD_DIM)).astype(np.float32)
    return q, k, v


def _decode(tmp_path, tier, read_in_place, sparse, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    with _cache(tmp_path, tier, read_in_place, sparse) as cache:
        state = _loaded(cache, rng)
        step = _step_fn()
        outs = []
        for _ in range(steps):
            out, state = step(*_inputs(rng), state)
            outs.append(np.asarray(out))
        stats = cache.sparse_stats(state) if sparse is not None else None
    return np.stack(outs), stats


@pytest.mark.parametrize("tier, read_in_place", PATHS)
def test_a_budget_of_one_equals_the_dense_path(tmp_path, tier, read_in_place):
    if read_in_place == "auto" and backend.in_place_blocker() is not None:
        pytest.skip("read in place on the CPU backend only")
    dense, _ = _decode(tmp_path, tier, read_in_place, None)
    sparse, stats = _decode(tmp_path, tier, read_in_place, 1.0)
    np.testing.assert_allclose(sparse, dense, atol=1e-5, rtol=1e-5)
    # Step 1 predicted only the sink and recent blocks; the rest came late. After it,
    # every block is predicted and hit.
    context = sum(-(-(LENGTHS + s) // BT) for s in range(3)).sum()
    for row in stats["layers"]:
        assert row["context_blocks"] == context
        assert row["hits"] + row["late"] == context
        assert row["wasted"] == 0
        assert row["late"] == (-(-LENGTHS // BT) - 2).sum()


def _expected_output(cache, state_after, before, q, layer):
    """Masked reference attention over the blocks ``predicted | exact`` of each slot's
    context and the step's own row, from the tier's rows (``cache.read``)."""
    lengths, previous = before["lengths"], before["previous"][layer]
    keys = np.zeros((BATCH, MAX_LEN, KV_HEADS, HEAD_DIM), np.float32)
    values = np.zeros_like(keys)
    for b in range(BATCH):
        k, v = cache.read(state_after, layer, b)  # Includes the step's new row.
        keys[b, : len(k)], values[b, : len(v)] = k, v
    lo, hi = summaries.of_keys(jnp.asarray(keys), lengths, BT)
    bounds = summaries.score_bounds(jnp.asarray(q), lo, hi)
    config = cache.spec.sparse
    exact = select.select(config, bounds, lengths, BT)
    predicted = prediction.predict(config, previous, lengths, BT, cache.spec.max_blocks)
    mask = reference.block_mask(jnp.concatenate([exact, predicted], 1), lengths, MAX_LEN, BT)
    mask = np.asarray(mask) | (np.arange(MAX_LEN)[None, :] == lengths[:, None])
    out = reference.attention(
        jnp.asarray(q[:, 0]), keys, values, jnp.asarray(mask), 1 / np.sqrt(HEAD_DIM)
    )
    return np.asarray(out), np.asarray(exact)


@pytest.mark.parametrize("tier, read_in_place", [("host", "auto"), ("file", False)])
def test_a_small_budget_attends_to_the_exact_and_predicted_blocks(tmp_path, tier, read_in_place):
    if read_in_place == "auto" and backend.in_place_blocker() is not None:
        pytest.skip("read in place on the CPU backend only")
    rng = np.random.default_rng(1)
    config = SparseConfig(budget=0.25, sink_blocks=1, recent_blocks=1)
    with _cache(tmp_path, tier, read_in_place, config) as cache:
        state = _loaded(cache, rng)
        step = _step_fn()
        late_seen = 0
        for _ in range(3):
            before = dict(
                lengths=np.asarray(state.lengths), previous=np.asarray(state.sparse.previous)
            )
            q, k, v = _inputs(rng)
            out, state = step(q, k, v, state)
            state = cache.drain(state)
            for layer in range(LAYERS):
                want, exact = _expected_output(cache, state, before, q[layer], layer)
                np.testing.assert_allclose(np.asarray(out[layer, :, 0]), want, atol=1e-5)
                # The exact selection is the next prediction's source.
                np.testing.assert_array_equal(np.asarray(state.sparse.previous[layer]), exact)
        stats = cache.sparse_stats(state)
        late_seen = sum(row["late"] for row in stats["layers"])
        assert late_seen > 0  # Random queries move the selection: late blocks were read.
        assert stats["read_share"] < 1.0


def _constructed_cache(tmp_path, tier="host", read_in_place="auto"):
    return tps.OffloadedKVCache(
        num_layers=2,
        batch=1,
        max_len=64,
        num_kv_heads=1,
        head_dim=8,
        dtype=np.float32,
        block_tokens=4,
        sparse=SparseConfig(budget=3, sink_blocks=1, recent_blocks=1),
        read_in_place=read_in_place,
        **({"tier": "file", "path": tmp_path} if tier == "file" else {}),
    )


@pytest.mark.parametrize("tier, read_in_place", PATHS)
def test_the_prediction_counts_are_exact_on_a_constructed_case(tmp_path, tier, read_in_place):
    """Keys: zero but one row of block 2 (10 e0) and one of block 4 (10 e1), 22 tokens (6
    blocks). A budget of 3 blocks: the sink (0), the recent block (5) and the best one.
    Step 1 (q = e0) predicts {0, 5} and needs block 2: 2 predicted, 2 hits, 1 late. Step 2
    (q = e1) predicts {0, 2, 5} and needs block 4: 3 predicted, 2 hits, 1 late, 1 wasted."""
    if read_in_place == "auto" and backend.in_place_blocker() is not None:
        pytest.skip("read in place on the CPU backend only")
    with _constructed_cache(tmp_path, tier, read_in_place) as cache:
        state = cache.init()
        keys = np.zeros((1, 22, 1, 8), np.float32)
        keys[0, 9, 0, 0] = 10.0  # block 2
        keys[0, 17, 0, 1] = 10.0  # block 4
        values = np.arange(22 * 8, dtype=np.float32).reshape(1, 22, 1, 8) / 100
        for layer in range(2):
            state = cache.load(state, layer, keys, values)

        def step(q, state):
            zero = jnp.zeros((1, 1, 1, 8), jnp.float32)
            outs = []
            for layer in range(2):
                o, state = tps.prefetching_attention(q, zero, zero, state, layer=layer)
                outs.append(o)
            return outs, state

        step = jax.jit(step, donate_argnums=(1,))
        e = np.eye(8, dtype=np.float32)
        _, state = step(jnp.asarray(e[0]).reshape(1, 1, 1, 8), state)
        np.testing.assert_array_equal(np.asarray(state.sparse.previous[:, 0]), [[0, 2, 5]] * 2)
        _, state = step(jnp.asarray(e[1]).reshape(1, 1, 1, 8), state)
        np.testing.assert_array_equal(np.asarray(state.sparse.previous[:, 0]), [[0, 4, 5]] * 2)
        stats = cache.sparse_stats(state)
    assert stats["steps"] == 2
    for row in stats["layers"]:
        assert (row["predicted"], row["hits"], row["late"], row["wasted"]) == (5, 4, 2, 1)
        assert row["context_blocks"] == 12
        assert row["hit_rate"] == 4 / 5
    block = 2 * 4 * 8 * 4  # K and V of one block
    assert stats["bytes"]["predicted"] == 2 * 5 * block
    assert stats["bytes"]["late"] == 2 * 2 * block
    assert stats["bytes"]["dense"] == 2 * 12 * block
    assert stats["bytes"]["summaries"] == 2 * 12 * (2 * 8 * 4)


@pytest.mark.parametrize("tier, read_in_place", [("host", "auto"), ("file", False)])
def test_a_whole_block_context_counts_as_the_reference_and_wastes_nothing(
    tmp_path, tier, read_in_place
):
    """24 cached tokens: 6 whole blocks of 4. Keys zero but one row of block 2 (10 e0); q =
    e0 at both steps; a budget of 3 blocks. Step 1 (24 cached) selects {0, 2, 5}: the sink,
    block 2 and the last full block (its own row opens block 6, attended apart); 2
    predicted, 2 hits, 1 late. Step 2 (25 cached) selects {0, 2, 6}: block 5 was held for
    being recent and no longer is, so the prediction is {0, 2, 6}, not {0, 2, 5, 6} (whose
    block 5 would be wasted for sure): 3 predicted, 3 hits. The sparse reference
    (sparse.measure, the step's row included in its keys) counts the same, step by step,
    and attends to the same rows."""
    from jax_tpusync.sparse import measure as sparse_measure

    if read_in_place == "auto" and backend.in_place_blocker() is not None:
        pytest.skip("read in place on the CPU backend only")
    tokens, dim = 24, 8
    keys = np.zeros((1, tokens, 1, dim), np.float32)
    keys[0, 9, 0, 0] = 10.0  # block 2
    values = np.arange(tokens * dim, dtype=np.float32).reshape(1, tokens, 1, dim) / 100
    q = np.eye(dim, dtype=np.float32)[0].reshape(1, 1, 1, dim)
    new_v = np.stack([np.full((1, 1, 1, dim), 0.5 + i, np.float32) for i in range(2)])
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    engine_counts, engine_outs = [], []
    with _constructed_cache(tmp_path, tier, read_in_place) as cache:
        assert cache.spec.sparse == config
        state = cache.init()
        for layer in range(2):
            state = cache.load(state, layer, keys, values)

        def step(v, state):
            zero = jnp.zeros((1, 1, 1, dim), jnp.float32)
            outs = []
            for layer in range(2):
                o, state = tps.prefetching_attention(jnp.asarray(q), zero, v, state, layer=layer)
                outs.append(o)
            return outs, state

        step = jax.jit(step, donate_argnums=(1,))
        seen = np.zeros((2, 4), np.int64)
        for i in range(2):
            outs, state = step(jnp.asarray(new_v[i]), state)
            engine_outs.append(np.asarray(outs[0])[:, 0])
            stats = cache.sparse_stats(state)
            total = np.array([[row[name] for name in prediction.COUNTS] for row in stats["layers"]])
            engine_counts.append(total - seen)
            seen = total
        np.testing.assert_array_equal(np.asarray(state.sparse.previous[:, 0]), [[0, 2, 6]] * 2)
    np.testing.assert_array_equal(engine_counts[0], [[2, 2, 1, 0]] * 2)
    np.testing.assert_array_equal(engine_counts[1], [[3, 3, 0, 0]] * 2)
    # The reference: keys and values with the steps' rows written, the row included.
    all_k = np.zeros((1, tokens + 2, 1, dim), np.float32)
    all_v = np.zeros_like(all_k)
    all_k[:, :tokens], all_v[:, :tokens] = keys, values
    previous = None
    for i in range(2):
        all_v[:, tokens + i] = new_v[i][:, 0]
        got = sparse_measure.measure(
            config, jnp.asarray(q[:, 0]), all_k, all_v, np.array([tokens + i + 1]), 4, previous
        )
        previous = got.selection
        np.testing.assert_array_equal(np.asarray(got.counts), engine_counts[i][0])
        np.testing.assert_allclose(np.asarray(got.sparse), engine_outs[i], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(previous[0]), [0, 2, 6])


def _check_summaries(cache, state, slots=range(BATCH)):
    """The state's summaries of every block each slot maps below its length equal those of
    the keys the tier holds."""
    lengths = np.asarray(state.lengths)
    tables = cache.block_tables
    for layer in range(cache.spec.num_layers):
        for b in slots:
            n = int(lengths[b])
            if not n:
                continue
            k, _ = cache.read(state, layer, b)
            lo, hi = summaries.of_keys(jnp.asarray(k)[None], np.array([n]), cache.spec.block_tokens)
            blocks = tables[b, : lo.shape[1]]
            np.testing.assert_array_equal(np.asarray(state.sparse.lo)[layer, blocks], lo[0])
            np.testing.assert_array_equal(np.asarray(state.sparse.hi)[layer, blocks], hi[0])


def test_the_summaries_follow_loads_and_steps_and_a_prefill_chunk_reads_densely(tmp_path):
    rng = np.random.default_rng(2)
    with _cache(tmp_path, "host", False, 0.25) as cache:
        state = _loaded(cache, rng, lengths=np.array([13, 30]))
        _check_summaries(cache, state)
        # A load into the middle of a block (rows 20..27 of slot 1 overwritten).
        patch = rng.standard_normal((2, 8, KV_HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, 0, patch[0], patch[1], start=20, slot=1)
        _check_summaries(cache, state)
        # A prefill chunk (q_len 5): dense, counted nowhere, its rows summarized.
        prefill = _step_fn()
        counts_before = np.asarray(state.sparse.counts).copy()
        out, state = prefill(*_inputs(rng, q_len=5), state)
        state = cache.drain(state)
        np.testing.assert_array_equal(np.asarray(state.sparse.counts), counts_before)
        assert int(state.sparse.steps) == 0
        _check_summaries(cache, state)
        # Decode steps keep them too (one into a fresh block: 35 + 5 = 40 = 5 blocks).
        decode = _step_fn()
        for _ in range(2):
            _, state = decode(*_inputs(rng), state)
        state = cache.drain(state)
        _check_summaries(cache, state)
        assert int(state.sparse.steps) == 2


def test_the_summaries_of_an_admitted_cached_prefix_are_its_rows(tmp_path):
    rng = np.random.default_rng(3)
    with _cache(tmp_path, "host", "auto", 0.25, num_blocks=40) as cache:
        state = cache.init(admit=False)
        tokens = np.arange(40)
        state, cached = cache.admit(state, 0, max_tokens=64, tokens=tokens)
        assert cached == 0
        k, v = rng.standard_normal((2, 40, KV_HEADS, HEAD_DIM)).astype(np.float32)
        for layer in range(LAYERS):
            state = cache.load(state, layer, k, v, slot=0)
        state = cache.release(state, 0, tokens=tokens)
        # Slot 1 takes the same prompt: its full blocks (32 tokens) come from the index.
        state, cached = cache.admit(state, 1, max_tokens=64, tokens=tokens)
        assert cached == 32
        np.testing.assert_array_equal(np.asarray(state.sparse.previous[:, 1]), -1)
        _check_summaries(cache, state, slots=[1])


def test_a_sparse_cache_re_attaches_with_its_summaries(tmp_path):
    rng = np.random.default_rng(4)
    kw = dict(file_name="kv")
    with _cache(tmp_path, "file", "auto", 0.25, **kw) as cache:
        state = _loaded(cache, rng)
        (state,) = [_step_fn()(*_inputs(rng), state)[1]]
        state = cache.commit(state)
        lengths = np.asarray(state.lengths)
        expected = np.asarray(state.sparse.lo), np.asarray(state.sparse.hi)
        cache.close(state)
    with _cache(tmp_path, "file", "auto", 0.25, **kw) as cache:
        state = cache.init()
        np.testing.assert_array_equal(np.asarray(state.lengths), lengths)
        _check_summaries(cache, state)
        tables = cache.block_tables
        for b in range(BATCH):
            blocks = tables[b, : -(-lengths[b] // BT)]
            np.testing.assert_array_equal(
                np.asarray(state.sparse.lo)[:, blocks], expected[0][:, blocks]
            )
            np.testing.assert_array_equal(
                np.asarray(state.sparse.hi)[:, blocks], expected[1][:, blocks]
            )


def test_a_dense_cache_keeps_the_dense_state():
    with _cache(None, "host", "auto", None) as cache:
        state = cache.init()
        assert state.sparse is None and cache.spec.sparse is None
        assert len(jax.tree_util.tree_leaves(state)) == 9
        with pytest.raises(ValueError, match=r"sparse_stats\(\) needs a sparse cache"):
            cache.sparse_stats(state)
    with _cache(None, "host", "auto", 0.5) as cache:
        state = cache.init()
        assert len(jax.tree_util.tree_leaves(state)) == 9 + 5


def test_resident_auto_stays_streamed_and_resident_true_is_refused():
    with _cache(None, "host", False, 0.5, resident="auto", staging_bytes=1 << 26) as cache:
        assert not cache.spec.resident  # It would fit: "auto" chooses streamed for sparse.
    with pytest.raises(ValueError, match=r"sparse= with resident=True: a resident cache"):
        _cache(None, "host", False, 0.5, resident=True, staging_bytes=1 << 26)


def test_unsupported_sparse_combinations_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"sparse= with spill_path: sparse decode does not"):
        _cache(tmp_path, "host", False, 0.5, spill_path=tmp_path, spill_blocks=8)
    with pytest.raises(ValueError, match=r"every layer of this hybrid cache has a sliding"):
        tps.HybridKVCache(
            num_layers=2,
            batch=1,
            max_len=64,
            num_kv_heads=1,
            head_dim=8,
            sliding_window=16,
            sparse=0.5,
        )


def test_an_older_state_drained_gets_the_summaries_of_rows_written_since(tmp_path):
    """A state of an earlier epoch missed what the host wrote through later states: drain
    recomputes its summaries from the tier (and keeps them for the latest epoch's)."""
    rng = np.random.default_rng(5)
    with _cache(tmp_path, "host", "auto", 0.25) as cache:
        older = cache.init(LENGTHS)  # The tier holds nothing yet.
        for layer in range(LAYERS):
            k, v = rng.standard_normal((2, BATCH, int(LENGTHS.max()), KV_HEADS, HEAD_DIM))
            cache.load(cache.init(), layer, k.astype(np.float32), v.astype(np.float32))
        state = cache.drain(older)
        _check_summaries(cache, state)
        _, state = _step_fn()(*_inputs(rng), state)
        state = cache.drain(state)  # The latest epoch's: kept, with the step's rows.
        _check_summaries(cache, state)


needs_two_devices = pytest.mark.skipif(
    len(jax.devices()) < 2, reason="needs 2 devices (tests/conftest.py asks for 4 CPU ones)"
)


def _mesh_cache(sparse, **kw):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    return tps.ShardedKVCache(
        mesh=mesh,
        kv_heads_axis="model",
        num_layers=2,
        batch=1,
        max_len=64,
        num_kv_heads=2,
        head_dim=8,
        dtype=np.float32,
        block_tokens=4,
        sparse=sparse,
        **kw,
    )


@needs_two_devices
def test_each_head_shard_of_a_mesh_selects_over_its_own_heads():
    """Two KV heads over two devices. Head 0's keys point at q in block 2, head 1's in
    block 4: with a budget of 3 blocks, shard 0 reads {0, 2, 5}, shard 1 {0, 4, 5}; the
    output equals a one-device cache that reads each head's own blocks (the same cache,
    dense, with the other blocks' keys far from q: their weight underflows)."""
    keys = np.zeros((1, 22, 2, 8), np.float32)
    keys[0, 9, 0, 0] = 10.0  # head 0, block 2
    keys[0, 17, 1, 0] = 10.0  # head 1, block 4
    values = np.arange(22 * 2 * 8, dtype=np.float32).reshape(1, 22, 2, 8) / 100
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    with _mesh_cache(config) as cache:
        state = cache.init()
        for layer in range(2):
            state = cache.load(state, layer, keys, values)

        def step(q, state):
            zero = jnp.zeros((1, 1, 2, 8), jnp.float32)
            outs = []
            for layer in range(2):
                o, state = tps.prefetching_attention(q, zero, zero, state, layer=layer)
                outs.append(o)
            return outs, state

        q = jnp.zeros((1, 1, 2, 8), jnp.float32).at[0, 0, :, 0].set(1.0)
        outs, state = jax.jit(step, donate_argnums=(1,))(q, state)
        previous = np.asarray(state.sparse.previous)  # [shards, layers, batch, S]
        np.testing.assert_array_equal(previous[0, :, 0], [[0, 2, 5]] * 2)
        np.testing.assert_array_equal(previous[1, :, 0], [[0, 4, 5]] * 2)
        stats = cache.sparse_stats(state)
    # Per layer, over both shards: 2 x (2 predicted: the sink and recent blocks, both
    # hit) and 2 x 1 late block.
    for row in stats["layers"]:
        assert (row["predicted"], row["hits"], row["late"], row["wasted"]) == (4, 4, 2, 0)
        assert row["context_blocks"] == 12
    # The reference: each head over its own blocks and the step's own (zero) row.
    mask = np.zeros((2, 23), bool)
    for head, blocks in ((0, (0, 2, 5)), (1, (0, 4, 5))):
        for blk in blocks:
            mask[head, blk * 4 : min(blk * 4 + 4, 22)] = True
        mask[head, 22] = True
    k_all = np.concatenate([keys[0], np.zeros((1, 2, 8), np.float32)])  # [23, H, D]
    v_all = np.concatenate([values[0], np.zeros((1, 2, 8), np.float32)])
    for head in range(2):
        s = k_all[:, head] @ np.eye(8, dtype=np.float32)[0] / np.sqrt(8)
        s = np.where(mask[head], s, -np.inf)
        p = np.exp(s - s.max())
        want = (p / p.sum()) @ v_all[:, head]
        for layer in range(2):
            np.testing.assert_allclose(np.asarray(outs[layer])[0, 0, head], want, atol=1e-5)


@needs_two_devices
def test_a_mesh_cache_with_a_budget_of_one_equals_the_dense_one():
    rng = np.random.default_rng(6)
    k, v = rng.standard_normal((2, 1, 30, 2, 8)).astype(np.float32)
    q = rng.standard_normal((3, 1, 1, 4, 8)).astype(np.float32)
    new = rng.standard_normal((3, 2, 1, 1, 2, 8)).astype(np.float32)
    outs = {}
    for sparse in (None, 1.0):
        with _mesh_cache(sparse) as cache:
            state = cache.init()
            for layer in range(2):
                state = cache.load(state, layer, k, v)

            def step(q, nk, nv, state):
                out = []
                for layer in range(2):
                    o, state = tps.prefetching_attention(q, nk, nv, state, layer=layer)
                    out.append(o)
                return jnp.stack(out), state

            step = jax.jit(step, donate_argnums=(3,))
            got = []
            for i in range(3):
                o, state = step(q[i], new[i, 0], new[i, 1], state)
                got.append(np.asarray(o))
            outs[sparse] = np.stack(got)
    np.testing.assert_allclose(outs[1.0], outs[None], atol=1e-5, rtol=1e-5)


def _hybrid(sparse):
    return tps.HybridKVCache(
        num_layers=3,
        batch=1,
        max_len=64,
        num_kv_heads=[1, 2, 1],
        head_dim=8,
        sliding_window=[12, None, 12],
        block_tokens=4,
        max_step_tokens=4,
        dtype=np.float32,
        sparse=sparse,
    )


def test_a_hybrid_cache_reads_its_global_layers_sparsely_and_its_sliding_ones_whole():
    rng = np.random.default_rng(7)
    heads = [1, 2, 1]
    context = [rng.standard_normal((2, 1, 30, h, 8)).astype(np.float32) for h in heads]
    inputs = [
        [rng.standard_normal((1, 1, 2, 8)).astype(np.float32) for _ in range(3)]
        + [rng.standard_normal((2, 1, 1, h, 8)).astype(np.float32) for h in heads]
        for _ in range(3)
    ]

    def step(q0, q1, q2, kv0, kv1, kv2, state):
        outs = []
        for layer, (q, kv) in enumerate(((q0, kv0), (q1, kv1), (q2, kv2))):
            o, state = tps.prefetching_attention(q, kv[0], kv[1], state, layer=layer)
            outs.append(o)
        return jnp.stack(outs), state

    outs = {}
    for sparse in (None, 1.0, 2):
        with _hybrid(sparse) as cache:
            state = cache.init()
            for layer in range(3):
                state = cache.load(state, layer, context[layer][0], context[layer][1])
            run = jax.jit(step, donate_argnums=(6,))
            got = []
            for i in range(3):
                o, state = run(*inputs[i], state)
                got.append(np.asarray(o))
            outs[sparse] = np.stack(got)
            if sparse is not None:
                stats = cache.sparse_stats(state)
                assert [row["layer"] for row in stats["layers"]] == [0, 1, 2]
                assert [row["sparse"] for row in stats["layers"]] == [False, True, False]
                assert stats["layers"][1]["context_blocks"] == 8 + 8 + 8  # 30..32 tokens
                assert stats["layers"][0]["predicted"] == stats["layers"][2]["late"] == 0
            else:
                with pytest.raises(ValueError, match=r"sparse_stats\(\) needs a sparse cache"):
                    cache.sparse_stats(state)
    np.testing.assert_allclose(outs[1.0], outs[None], atol=1e-5, rtol=1e-5)
    # Two blocks of 8: the global layer reads less; the sliding layers read their window.
    np.testing.assert_allclose(outs[2][:, [0, 2]], outs[None][:, [0, 2]], atol=1e-5, rtol=1e-5)
    assert not np.allclose(outs[2][:, 1], outs[None][:, 1], atol=1e-3)


@pytest.mark.parametrize("tier, read_in_place", [("host", "auto"), ("file", False)])
def test_a_quantized_tier_reads_sparsely_with_the_summaries_of_its_codes(
    tmp_path, tier, read_in_place
):
    """int8 rows: a budget of 1.0 equals the dense quantized cache, and the summaries (of
    the dequantized keys) equal those of the rows read back, after loads and steps."""
    if read_in_place == "auto" and backend.in_place_blocker() is not None:
        pytest.skip("read in place on the CPU backend only")
    outs = {}
    for sparse in (None, 1.0):
        rng = np.random.default_rng(8)
        with _cache(tmp_path, tier, read_in_place, sparse, tier_dtype="int8") as cache:
            state = _loaded(cache, rng)
            step = _step_fn()
            got = []
            for _ in range(2):
                out, state = step(*_inputs(rng), state)
                got.append(np.asarray(out))
            outs[sparse] = np.stack(got)
            if sparse is not None:
                _check_summaries(cache, cache.drain(state))
    np.testing.assert_allclose(outs[1.0], outs[None], atol=1e-5, rtol=1e-5)


def _layers_step(layers: int, loop: str):
    """A decode step over ``layers`` layers, (q, k, v, state) -> (out, state), each of q, k, v
    [layers, batch, 1, heads, head_dim]: under lax.scan (a traced layer index) or unrolled."""

    def step(q, k, v, state):
        if loop == "scan":

            def body(state, xs):
                q, k, v, layer = xs
                out, state = tps.prefetching_attention(q, k, v, state, layer=layer)
                return state, out

            state, out = jax.lax.scan(body, state, (q, k, v, jnp.arange(layers)))
            return out, state
        outs = []
        for layer in range(layers):
            o, state = tps.prefetching_attention(q[layer], k[layer], v[layer], state, layer=layer)
            outs.append(o)
        return jnp.stack(outs), state

    return step


def test_a_scanned_layer_loop_with_a_sliding_layer():
    """lax.scan over the layers (a traced layer index), a sliding layer between two global
    ones: a budget of 1.0 equals dense; at 0.3 the sliding layer still reads its window
    whole (its output equals dense) and counts nothing."""
    layers, windows = 3, [None, 24, None]

    def decode(sparse):
        rng = np.random.default_rng(9)
        with _cache(None, "host", "auto", sparse, num_layers=layers, sliding_window=windows) as c:
            state = c.init()
            for layer in range(layers):
                k, v = rng.standard_normal((2, BATCH, 64, KV_HEADS, HEAD_DIM)).astype(np.float32)
                state = c.load(state, layer, k, v, lengths=np.array([60, 33]))

            step = jax.jit(_layers_step(layers, "scan"), donate_argnums=(3,))
            outs = []
            for _ in range(3):
                q = rng.standard_normal((layers, BATCH, 1, Q_HEADS, HEAD_DIM)).astype(np.float32)
                k, v = rng.standard_normal((2, layers, BATCH, 1, KV_HEADS, HEAD_DIM))
                out, state = step(q, k.astype(np.float32), v.astype(np.float32), state)
                outs.append(np.asarray(out))
            stats = c.sparse_stats(state) if sparse is not None else None
        return np.stack(outs), stats

    if backend.in_place_blocker() is not None:
        pytest.skip("read in place on the CPU backend only")
    dense, _ = decode(None)
    whole, _ = decode(1.0)
    np.testing.assert_allclose(whole, dense, atol=1e-5, rtol=1e-5)
    part, stats = decode(0.3)
    np.testing.assert_allclose(part[:, 1], dense[:, 1], atol=1e-5, rtol=1e-5)
    assert not np.allclose(part[:, 0], dense[:, 0], atol=1e-3)
    assert stats["layers"][1]["predicted"] == stats["layers"][1]["context_blocks"] == 0
    assert stats["layers"][0]["predicted"] > 0


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_a_decode_step_updates_the_summaries_in_place(loop):
    """The compiled decode step (state donated) writes its rows into the summary arrays in
    place: no copy of a whole [layers, num_blocks, heads, head_dim] array, neither with the
    layers unrolled nor under lax.scan (at 1M tokens they are 128 MiB: a copy per layer and
    step would cost more than the step's sparse reads)."""
    import re

    layers = 3
    with _cache(None, "host", False, 0.25, num_layers=layers) as cache:
        state = cache.init()
        shape = tuple(state.sparse.lo.shape)
        assert shape == tuple(state.sparse.hi.shape) == (layers, cache.spec.num_blocks, 2, 16)

        step = _layers_step(layers, loop)
        q = jnp.zeros((layers, BATCH, 1, Q_HEADS, HEAD_DIM), jnp.float32)
        k = jnp.zeros((layers, BATCH, 1, KV_HEADS, HEAD_DIM), jnp.float32)
        hlo = jax.jit(step, donate_argnums=(3,)).lower(q, k, k, state).compile().as_text()
    summary = re.escape("f32[" + ",".join(map(str, shape)) + "]")
    produced = re.findall(r"= " + summary + r"\{[^}]*\} (\S+?)\(", hlo)
    assert produced, "the summary arrays are not in the compiled step"
    copies = [op for op in produced if op.startswith("copy")]
    assert not copies, f"{len(copies)} whole-array copies of the summaries per step"
