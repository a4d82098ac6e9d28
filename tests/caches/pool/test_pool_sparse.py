"""Sparse decode on the host pool (the TPU data path, emulated on the CPU backend): a full
budget is the dense path; a small one is attention over the blocks it attends, selected
from summaries that match the rows; the prediction's counts exact on a constructed case;
summaries recomputed on re-attach; what is not supported refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import pool_sparse
from jax_tpusync.core.pool_sparse import COUNTS, SummaryLayout
from jax_tpusync.sparse import SparseConfig, prediction, reference, select, summaries

from support.pool_model import HEAD_DIM, HEADS, Q_HEADS, decode_step, make_cache

PREFILL = [(7, None), (7, None), (7, [7, 3])]  # Dense steps (more than one row per slot).


def run_steps(cache, steps, seed=0, before_step=None):
    """Runs ``steps`` (q_len, counts) of random q/k/v; returns the state and each step's
    outputs [layers, batch, q_len, Q_HEADS, HEAD_DIM]."""
    spec = cache.spec
    rng = np.random.default_rng(seed)
    state = cache.init()
    step = decode_step(spec.num_layers, None, jnp.float32)
    outs = []
    for q_len, counts in steps:
        shape = (spec.num_layers, spec.batch, q_len)
        qs = jnp.asarray(rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)), jnp.float32)
        ks = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), jnp.float32)
        vs = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), jnp.float32)
        counts_arg = None if counts is None else jnp.asarray(counts, jnp.int32)
        if before_step is not None:
            before_step(state, qs)
        out, state = step(state, qs, ks, vs, counts_arg)
        outs.append(np.asarray(out))
    return state, outs


@pytest.mark.slow
def test_a_full_budget_is_the_dense_pool_path():
    steps = PREFILL + [(1, None)] * 5 + [(1, [1, 0])] + [(1, None)] * 2
    dense_state, dense = run_steps(make_cache(), steps)
    cache = make_cache(sparse=1.0)
    state, sparse = run_steps(cache, steps)
    for a, b in zip(dense, sparse):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(dense_state.lengths))
    stats = cache.sparse_stats(state)["totals"]
    # Every decode step of every layer selected every block of its slots' contexts.
    assert stats["steps"] == 3 * 8 and stats["hits"] + stats["late"] == stats["context_blocks"]
    assert stats["wasted"] == 0
    assert stats["read_bytes"] > stats["dense_bytes"]  # The summaries come on top.


def attended_reference(cache, state, q, lengths, predicted, exact):
    """Per layer, the reference attention of each slot's decode row over the blocks a
    sparse step attended (predicted and exact) and its own new row, from the cache's rows
    after the step."""
    spec = cache.spec
    tokens = spec.max_len
    outs = []
    for layer in range(spec.num_layers):
        keys = np.zeros((spec.batch, tokens, HEADS, HEAD_DIM), np.float32)
        values = np.zeros_like(keys)
        for b in range(spec.batch):
            k, v = cache.read(state, layer, b, 0, int(lengths[b]) + 1)
            keys[b, : lengths[b] + 1], values[b, : lengths[b] + 1] = k, v
        both = jnp.concatenate([predicted[layer], exact[layer]], axis=1)
        mask = reference.block_mask(both, lengths, tokens, spec.block_tokens)
        mask |= jnp.arange(tokens)[None, :] == jnp.asarray(lengths)[:, None]
        outs.append(
            reference.attention(
                q[layer][:, 0], jnp.asarray(keys), jnp.asarray(values), mask, HEAD_DIM**-0.5
            )
        )
        # The exact selection is the one the rows' summaries make.
        lo, hi = summaries.of_keys(jnp.asarray(keys), jnp.asarray(lengths), spec.block_tokens)
        bounds = summaries.score_bounds(q[layer], lo, hi)
        want = select.select(state.sparse.config, bounds, jnp.asarray(lengths), spec.block_tokens)
        np.testing.assert_array_equal(np.asarray(exact[layer]), np.asarray(want))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("chunk_blocks", [4, 512], ids=["chunks-of-4", "one-chunk"])
def test_a_small_budget_attends_the_predicted_and_the_selected_blocks(monkeypatch, chunk_blocks):
    # 16 physical blocks: four summary chunks, or one.
    monkeypatch.setattr(pool_sparse, "SUMMARY_CHUNK_BLOCKS", chunk_blocks)
    config = SparseConfig(budget=0.3, sink_blocks=1, recent_blocks=1)
    cache = make_cache(sparse=config)
    assert SummaryLayout(cache.spec).num_chunks == 16 // min(chunk_blocks, 16)
    state = cache.init()
    step = decode_step(3, None, jnp.float32)
    rng = np.random.default_rng(1)
    worst = 0.0
    for q_len, counts in PREFILL + [(1, None)] * 4:
        shape = (3, 2, q_len)
        qs = jnp.asarray(rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)), jnp.float32)
        ks = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), jnp.float32)
        vs = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), jnp.float32)
        counts_arg = None if counts is None else jnp.asarray(counts, jnp.int32)
        lengths = np.asarray(state.lengths)
        predicted = [
            prediction.predict(
                config, state.sparse.previous[layer], lengths, 8, cache.spec.max_blocks
            )
            for layer in range(3)
        ]
        out, state = step(state, qs, ks, vs, counts_arg)
        if q_len != 1:
            continue
        exact = [state.sparse.previous[layer] for layer in range(3)]
        want = attended_reference(cache, state, qs, lengths, predicted, exact)
        for layer in range(3):
            diff = np.abs(np.asarray(out[layer, :, 0]) - np.asarray(want[layer]))
            worst = max(worst, float(diff.max()))
    assert worst <= 1e-5
    # Fewer blocks than the contexts hold were attended.
    totals = cache.sparse_stats(state)["totals"]
    assert totals["hits"] + totals["late"] < totals["context_blocks"]
    cache.close()


@pytest.mark.slow
def test_the_counts_are_exact_on_a_constructed_case():
    # One slot, blocks of 8, three blocks a step: the sink, the last, and the block whose
    # keys point along the query (block 2 of a 48-token context).
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    cache = tps.HostPoolKVCache(
        num_layers=1, batch=1, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=jnp.float32, sparse=config,
    )  # fmt: skip
    state = cache.init()
    keys = np.zeros((1, 48, HEADS, HEAD_DIM), np.float32)
    keys[0, 16:24, :, 0] = 10.0
    values = np.random.default_rng(0).standard_normal(keys.shape).astype(np.float32)
    state = cache.load(state, 0, keys, values)
    step = decode_step(1, None, jnp.float32)
    q = jnp.zeros((1, 1, 1, Q_HEADS, HEAD_DIM), jnp.float32).at[..., 0].set(1.0)
    zeros = jnp.zeros((1, 1, 1, HEADS, HEAD_DIM), jnp.float32)
    per_step = []
    for _ in range(3):
        before = np.asarray(state.sparse.counts)[0].copy()
        _, state = step(state, q, zeros, zeros, None)
        per_step.append(dict(zip(COUNTS, np.asarray(state.sparse.counts)[0] - before)))
    # Step 1 (48 tokens): predicted {0, 5} (nothing selected before), exact {0, 2, 5}.
    # Step 2 (49): the last block is now 6; 5 was held for being the last one, and with it
    # the prediction would hold 4 blocks for a selection of 3 (one wasted for sure): it is
    # left out. Predicted {0, 2, 6}, exact {0, 2, 6}.
    # Step 3 (50): predicted {0, 2, 6}, exact the same.
    assert [(s["predicted"], s["hits"], s["late"], s["wasted"]) for s in per_step] == [
        (2, 2, 1, 0),
        (3, 3, 0, 0),
        (3, 3, 0, 0),
    ]
    np.testing.assert_array_equal(np.asarray(state.sparse.previous)[0, 0], [0, 2, 6])
    stats = cache.sparse_stats(state)
    layer = stats["layers"][0]
    assert (layer["predicted"], layer["hits"], layer["late"], layer["wasted"]) == (8, 8, 1, 0)
    assert layer["steps"] == 3 and layer["decode_rows"] == 3
    assert layer["context_blocks"] == 6 + 7 + 7
    block_bytes = 8 * 2 * HEADS * HEAD_DIM * 4
    assert layer["late_bytes"] == block_bytes and layer["predicted_bytes"] == 8 * block_bytes
    assert layer["hit_rate"] == pytest.approx(1.0)


def summaries_of(cache, state, layer, slot, length):
    """The state's summaries of ``slot``'s blocks in ``layer``, by logical block."""
    summary = SummaryLayout(cache.spec)
    rows = np.asarray(state.sparse.summaries)
    table = cache.slots.table_row(slot)
    blocks = -(-length // cache.spec.block_tokens)
    lo, hi = summary.to_values(rows[[summary.row(layer, int(table[i])) for i in range(blocks)]])
    return np.asarray(lo), np.asarray(hi)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_a_reattached_pool_summarizes_its_committed_rows(tmp_path, dtype):
    options = dict(
        num_layers=2, batch=1, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=dtype, sparse=0.25, tier="file", path=str(tmp_path),
        file_name="pool",
    )  # fmt: skip
    cache = tps.HostPoolKVCache(**options)
    state = cache.init()
    rng = np.random.default_rng(2)
    kv = rng.standard_normal((2, 2, 1, 37, HEADS, HEAD_DIM)).astype(dtype)
    for layer in range(2):
        state = cache.load(state, layer, kv[layer, 0], kv[layer, 1])
    # A step writes row 37 (into block 4, merged with its five rows).
    step = decode_step(2, None, dtype)
    new = jnp.asarray(rng.standard_normal((2, 1, 1, HEADS, HEAD_DIM)), dtype)
    q = jnp.asarray(rng.standard_normal((2, 1, 1, Q_HEADS, HEAD_DIM)), dtype)
    _, state = step(state, q, new, new, None)
    keys = [np.concatenate([kv[layer, 0, 0], np.asarray(new[layer, 0])]) for layer in range(2)]
    for layer in range(2):
        want = summaries.of_keys(jnp.asarray(keys[layer])[None], jnp.asarray([38]), 8)
        got = summaries_of(cache, state, layer, 0, 38)
        np.testing.assert_array_equal(got[0], np.asarray(want[0][0]))
        np.testing.assert_array_equal(got[1], np.asarray(want[1][0]))
    cache.commit(state)
    cache.close()

    again = tps.HostPoolKVCache(**options)
    state = again.init()
    assert int(np.asarray(state.lengths)[0]) == 38
    for layer in range(2):
        want = summaries.of_keys(jnp.asarray(keys[layer])[None], jnp.asarray([38]), 8)
        got = summaries_of(again, state, layer, 0, 38)
        np.testing.assert_array_equal(got[0], np.asarray(want[0][0]))
        np.testing.assert_array_equal(got[1], np.asarray(want[1][0]))
    again.close()


GEOMETRY = dict(num_layers=2, batch=2, max_len=64, num_kv_heads=2, head_dim=8, block_tokens=8)


def test_sparse_with_what_it_does_not_support_yet_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"sparse=.* with prefetch_depth=2: a sparse layer"):
        tps.HostPoolKVCache(**GEOMETRY, sparse=0.5, prefetch_depth=2)
    # At the edge: depth 1 and "auto" are taken.
    tps.HostPoolKVCache(**GEOMETRY, sparse=0.5, prefetch_depth=1).close()
    tps.HostPoolKVCache(**GEOMETRY, sparse=0.5, prefetch_depth="auto").close()
    with pytest.raises(ValueError, match=r"sparse=.* with spill_path=.*not supported yet"):
        tps.HostPoolKVCache(
            **GEOMETRY, sparse=0.5, spill_path=str(tmp_path), spill_blocks=4
        )
    # Over a mesh each head shard selects its own blocks (test_pool_mesh_sparse.py).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("heads",))
    tps.HostPoolKVCache(**GEOMETRY, sparse=0.5, mesh=mesh, kv_heads_axis="heads").close()


def test_sparse_stats_of_a_dense_cache_is_refused():
    cache = tps.HostPoolKVCache(**GEOMETRY)
    state = cache.init()
    assert cache.sparse is None and state.sparse is None
    with pytest.raises(ValueError, match=r"sparse_stats\(\): this cache was made without sparse="):
        cache.sparse_stats(state)
    cache.close()


def test_a_traced_layer_over_layers_of_different_windows_is_refused():
    cache = tps.HostPoolKVCache(
        **GEOMETRY, sparse=0.5, sliding_window=[None, 16], dtype=jnp.float32
    )
    state = cache.init()
    q = jnp.zeros((2, 1, 4, 8), jnp.float32)
    k = jnp.zeros((2, 1, 2, 8), jnp.float32)

    def step(state, layer):
        return tps.prefetching_attention(q, k, k, state, layer=layer)

    with pytest.raises(ValueError, match="sparse= with a traced layer over layers of different"):
        jax.eval_shape(step, state, jnp.int32(0))
    # Python int layers are taken.
    jax.eval_shape(lambda s: step(s, 0), state)
    jax.eval_shape(lambda s: step(s, 1), state)
    cache.close()


def test_a_dense_pool_state_has_no_sparse_leaves():
    cache = tps.HostPoolKVCache(**GEOMETRY)
    sparse = tps.HostPoolKVCache(**GEOMETRY, sparse=0.5)
    dense_leaves = jax.tree.leaves(cache.init())
    sparse_state = sparse.init()
    assert len(jax.tree.leaves(sparse_state)) == len(dense_leaves) + 5
    assert sparse_state.sparse.summaries.sharding.memory_kind == "pinned_host"
    assert sparse_state.sparse.summaries.shape == SummaryLayout(sparse.spec).shape
    cache.close()
    sparse.close()


def test_a_batch_sharded_pool_refuses_what_a_sparse_host_pool_refuses_by_name():
    # Sparse decode over batch shards is taken (test_pool_mesh_sparse.py); what a sparse
    # host pool refuses, each shard's pool refuses, named as it names it.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
    options = dict(GEOMETRY, sparse=0.5, mesh=mesh, batch_axis="batch")
    with pytest.raises(ValueError, match=r"sparse=.* with prefetch_depth=2: a sparse layer"):
        tps.BatchShardedPoolKVCache(**options, prefetch_depth=2)
    tps.BatchShardedPoolKVCache(**options, prefetch_depth=1).close()  # At the edge.
    dense = tps.BatchShardedPoolKVCache(**dict(options, sparse=None))
    with pytest.raises(ValueError, match=r"sparse_stats\(\): this cache was made without sparse="):
        dense.sparse_stats(dense.init())
    dense.close()


@pytest.mark.slow
def test_a_host_pool_hybrid_reads_its_global_layers_sparse_and_its_windows_whole():
    options = dict(GEOMETRY, num_layers=3, head_dim=HEAD_DIM, dtype=jnp.float32)
    windows = [16, None, 16]
    rng = np.random.default_rng(0)
    steps = [
        tuple(
            jnp.asarray(rng.standard_normal((3, 2, q_len, heads, HEAD_DIM)), jnp.float32)
            for heads in (Q_HEADS, HEADS, HEADS)
        )
        for q_len in (7, 7, 7, 1, 1, 1, 1)
    ]

    def run(**sparse):
        cache = tps.HybridKVCache(**options, sliding_window=windows, host_pool=True, **sparse)
        state = cache.init()

        @jax.jit
        def step(state, qs, ks, vs):
            outs = []
            for layer in range(3):
                out, state = tps.prefetching_attention(
                    qs[layer], ks[layer], vs[layer], state, layer=layer
                )
                outs.append(out)
            return jnp.stack(outs), state

        outs = []
        for qs, ks, vs in steps:
            out, state = step(state, qs, ks, vs)
            outs.append(np.asarray(out))
        return cache, state, outs

    _, _, dense = run()
    cache, state, full = run(sparse=1.0)
    # The global group is sparse, the sliding one (layers 0 and 2) dense.
    assert sorted(group.sparse is None for group in cache.groups) == [False, True]
    for a, b in zip(dense, full):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    _, _, small = run(sparse=SparseConfig(budget=2, recent_blocks=1))
    # The sliding layers read their window whole either way; the global one did not.
    for a, b in zip(dense[3:], small[3:]):
        np.testing.assert_allclose(b[[0, 2]], a[[0, 2]], atol=1e-5, rtol=0)
    assert max(float(np.abs(a[1] - b[1]).max()) for a, b in zip(dense[3:], small[3:])) > 1e-3


@pytest.mark.parametrize("width", [1, 2, 3, 5])
def test_a_units_pool_rows_are_its_columns_of_the_table_and_the_sink_past_them(width):
    """Unit ``u`` of a walk over a compacted table reads the table's columns ``[u * n, (u +
    1) * n)`` (``n`` blocks a unit), the sink's row where a column is -1 or past the table
    (a unit past the table's last: every row the sink's), for tables narrower than a unit,
    one unit wide and wider; the same with the unit traced."""
    from jax_tpusync.core.pool_state import PoolLayout
    from jax_tpusync.step.pool_sparse import table_rows

    cache = make_cache()
    layout = PoolLayout(cache.spec)
    per_unit, sink, layer = layout.blocks_per_unit, layout.sink_row, 2
    assert per_unit == 2
    rng = np.random.default_rng(width)
    table = rng.integers(0, cache.spec.num_blocks, (2, width)).astype(np.int32)
    table[1, -1] = -1
    traced = jax.jit(lambda unit: table_rows(layout, jnp.asarray(table), layer, unit))
    for unit in range(-(-width // per_unit) + 2):
        want = np.full((2, per_unit), sink)
        for j in range(per_unit):
            column = unit * per_unit + j
            if column < width:
                block = table[:, column]
                want[:, j] = np.where(block >= 0, layout.block_row(layer, block), sink)
        got = table_rows(layout, jnp.asarray(table), layer, unit)
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(traced(jnp.int32(unit))), want)
    cache.close()
