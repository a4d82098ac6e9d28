"""Sparse decode on a host pool split over a mesh's kv_heads axis (two simulated CPU
devices): each head shard scores its own heads' summaries and selects its own blocks. A
full budget is the dense mesh step; a small one is, per shard, attention over the blocks
that shard attended; the per-shard counts exact on a constructed case where the shards
select different blocks; summaries per shard right after load and a prefix import; a
BatchShardedPoolKVCache (2 x 2 devices) decodes as the heads-only mesh pool does; a
host-pool hybrid over the mesh reads its global group sparse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_tpusync as tps
from jax_tpusync.core.pool_sparse import COUNTS, SummaryLayout
from jax_tpusync.sparse import SparseConfig, prediction, reference, select, summaries

from support.pool_mesh_model import HEAD_DIM, HEADS, Q_HEADS, make_cache, mesh_of, step_fn

SHARDS = 2
SHARD_HEADS, SHARD_Q_HEADS = HEADS // SHARDS, Q_HEADS // SHARDS


def random_steps(layers, batch, steps, seed):
    """Per step, (q_len, counts, qs, ks, vs) of random values in float32."""
    rng = np.random.default_rng(seed)
    out = []
    for q_len, counts in steps:
        shape = (layers, batch, q_len)
        qkv = [
            jnp.asarray(rng.standard_normal((*shape, heads, HEAD_DIM)), jnp.float32)
            for heads in (Q_HEADS, HEADS, HEADS)
        ]
        out.append((q_len, None if counts is None else jnp.asarray(counts, jnp.int32), *qkv))
    return out


@pytest.mark.slow
def test_a_full_budget_over_a_mesh_is_the_dense_mesh_pool_step():
    # Two step widths (a compile each): prefill chunks (one ragged), then decode rows (a
    # slot idle in one).
    steps = [(7, [7, 7]), (7, [7, 3]), (1, [1, 1]), (1, [1, 0]), (1, [1, 1])]
    inputs = random_steps(2, 2, steps, seed=0)
    mesh = mesh_of(SHARDS)

    def run(**options):
        cache = make_cache(mesh=mesh, kv_heads_axis="h", **options)
        state = cache.init()
        step = step_fn(2)
        outs = []
        for _, counts, qs, ks, vs in inputs:
            out, state = step(state, qs, ks, vs, counts)
            outs.append(np.asarray(out))
        return cache, state, outs

    _, dense_state, dense = run()
    cache, state, full = run(sparse=1.0)
    for a, b in zip(dense, full):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(dense_state.lengths))
    # Each shard's summaries in its own device's host memory, its counts its own.
    assert state.sparse.summaries.shape == (SHARDS, *SummaryLayout(cache.spec).shape)
    assert state.sparse.summaries.sharding.memory_kind == "pinned_host"
    assert {s.device for s in state.sparse.summaries.addressable_shards} == set(mesh.devices.flat)
    assert state.sparse.counts.shape == (SHARDS, 2, len(COUNTS))
    totals = cache.sparse_stats(state)["totals"]
    # Every decode step of every layer and shard selected every block of the contexts:
    # blocks summed over the shards, steps (and rows) counted once.
    assert totals["steps"] == 3 * 2 and totals["decode_rows"] == 2 * (2 + 1 + 2)
    assert totals["hits"] + totals["late"] == totals["context_blocks"] > 0
    assert totals["wasted"] == 0
    per_shard = np.asarray(state.sparse.counts)
    assert (
        per_shard[0, :, COUNTS.index("context_blocks")].sum() * SHARDS == (totals["context_blocks"])
    )
    summary = SummaryLayout(cache.spec)
    assert totals["summary_bytes"] == 6 * SHARDS * summary.layer_rows * summary.row_bytes
    cache.close()


def shard_reference(cache, state, q, lengths, attended, shard, layer):
    """Shard ``shard``'s reference: its query heads' attention over the blocks it
    ``attended`` (int32[batch, S]) and each slot's new row, from the cache's rows after
    the step; and the selection its heads' summaries of those rows make."""
    spec = cache.spec
    tokens = spec.max_len
    heads = slice(shard * SHARD_HEADS, (shard + 1) * SHARD_HEADS)
    keys = np.zeros((spec.batch, tokens, SHARD_HEADS, HEAD_DIM), np.float32)
    values = np.zeros_like(keys)
    for b in range(spec.batch):
        k, v = cache.read(state, layer, b, 0, int(lengths[b]) + 1)
        keys[b, : lengths[b] + 1], values[b, : lengths[b] + 1] = k[:, heads], v[:, heads]
    mask = reference.block_mask(attended, lengths, tokens, spec.block_tokens)
    mask |= jnp.arange(tokens)[None, :] == jnp.asarray(lengths)[:, None]
    q_shard = q[:, 0, shard * SHARD_Q_HEADS : (shard + 1) * SHARD_Q_HEADS]
    out = reference.attention(q_shard, jnp.asarray(keys), jnp.asarray(values), mask, HEAD_DIM**-0.5)
    lo, hi = summaries.of_keys(jnp.asarray(keys), jnp.asarray(lengths), spec.block_tokens)
    bounds = summaries.score_bounds(
        q[:, :, shard * SHARD_Q_HEADS : (shard + 1) * SHARD_Q_HEADS], lo, hi
    )
    want = select.select(state.sparse.config, bounds, jnp.asarray(lengths), spec.block_tokens)
    return np.asarray(out), np.asarray(want)


def check_against_shard_references(cache, state, before, out, qs, layers):
    """Every layer's and shard's decode rows of a step against :func:`shard_reference`,
    the shard's exact selection against its summaries' (``before``: the state's lengths
    and ``previous`` before the step); returns the worst difference."""
    spec = cache.spec
    lengths, previous = before
    worst = 0.0
    for layer in range(layers):
        for shard in range(SHARDS):
            predicted = prediction.predict(
                state.sparse.config, previous[shard, layer], lengths, spec.block_tokens,
                spec.max_blocks,
            )  # fmt: skip
            exact = np.asarray(state.sparse.previous)[shard, layer]
            attended = jnp.concatenate([predicted, jnp.asarray(exact)], axis=1)
            want, selection = shard_reference(
                cache, state, qs[layer], lengths, attended, shard, layer
            )
            np.testing.assert_array_equal(exact, selection)
            got = np.asarray(out[layer, :, 0, shard * SHARD_Q_HEADS : (shard + 1) * SHARD_Q_HEADS])
            worst = max(worst, float(np.abs(got - want).max()))
    return worst


def test_each_shard_selects_its_own_blocks_and_counts_them_exactly():
    # One slot, blocks of 8, three blocks a step: the sink, the last, and the block whose
    # keys point along the query, which is block 2 for shard 0's heads and block 4 for
    # shard 1's (of a 48-token context).
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    cache = tps.HostPoolKVCache(
        num_layers=1, batch=1, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=jnp.float32, sparse=config, mesh=mesh_of(SHARDS),
        kv_heads_axis="h",
    )  # fmt: skip
    state = cache.init()
    keys = np.zeros((1, 48, HEADS, HEAD_DIM), np.float32)
    keys[0, 16:24, :SHARD_HEADS, 0] = 10.0
    keys[0, 32:40, SHARD_HEADS:, 0] = 10.0
    values = np.random.default_rng(0).standard_normal(keys.shape).astype(np.float32)
    state = cache.load(state, 0, keys, values)
    step = step_fn(1)
    q = jnp.zeros((1, 1, 1, Q_HEADS, HEAD_DIM), jnp.float32).at[..., 0].set(1.0)
    zeros = jnp.zeros((1, 1, 1, HEADS, HEAD_DIM), jnp.float32)
    per_step = []
    worst = 0.0
    for _ in range(3):
        counts = np.asarray(state.sparse.counts)[:, 0].copy()
        before = (np.asarray(state.lengths)[0], np.asarray(state.sparse.previous))
        out, state = step(state, q, zeros, zeros, None)
        worst = max(worst, check_against_shard_references(cache, state, before, out, q, 1))
        per_step.append(
            [dict(zip(COUNTS, c)) for c in np.asarray(state.sparse.counts)[:, 0] - counts]
        )
    assert worst <= 1e-5
    # Per shard: step 1 (48 tokens): predicted {0, 5} (nothing selected before), exact
    # {0, 2, 5} on shard 0, {0, 4, 5} on shard 1. Step 2 (49): the recent block moves to
    # the new last block 6; block 5, held only for being recent, is left out of the
    # prediction (it would be wasted for sure): predicted = exact = {0, 2, 6} / {0, 4, 6}.
    # Step 3 (50): predicted = exact.
    for shard in range(SHARDS):
        assert [
            (s[shard]["predicted"], s[shard]["hits"], s[shard]["late"], s[shard]["wasted"])
            for s in per_step
        ] == [(2, 2, 1, 0), (3, 3, 0, 0), (3, 3, 0, 0)]
    previous = np.asarray(state.sparse.previous)
    np.testing.assert_array_equal(previous[0, 0, 0], [0, 2, 6])
    np.testing.assert_array_equal(previous[1, 0, 0], [0, 4, 6])
    layer = cache.sparse_stats(state)["layers"][0]
    assert (layer["predicted"], layer["hits"], layer["late"], layer["wasted"]) == (16, 16, 2, 0)
    assert layer["steps"] == 3 and layer["decode_rows"] == 3
    assert layer["context_blocks"] == SHARDS * (6 + 7 + 7)
    block_bytes = 8 * 2 * SHARD_HEADS * HEAD_DIM * 4  # One shard's heads of a block.
    assert layer["late_bytes"] == 2 * block_bytes and layer["predicted_bytes"] == 16 * block_bytes
    assert layer["hit_rate"] == pytest.approx(16 / 16)
    cache.close()


@pytest.mark.slow
def test_a_small_budget_over_a_mesh_attends_each_shards_blocks():
    # Contexts of 40 and 33 tokens (5 blocks): each shard's heads choose one block beside
    # the sink and the last.
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    cache = make_cache(mesh=mesh_of(SHARDS), kv_heads_axis="h", sparse=config)
    state = cache.init()
    rng = np.random.default_rng(1)
    for layer in range(2):
        kv = rng.standard_normal((2, 2, 40, HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, layer, kv[0], kv[1], lengths=[40, 33])
    step = step_fn(2)
    worst = 0.0
    for _, counts, qs, ks, vs in random_steps(2, 2, [(1, None)] * 3, seed=1):
        before = (np.asarray(state.lengths)[0], np.asarray(state.sparse.previous))
        out, state = step(state, qs, ks, vs, counts)
        worst = max(worst, check_against_shard_references(cache, state, before, out, qs, 2))
    assert worst <= 1e-5
    totals = cache.sparse_stats(state)["totals"]
    assert totals["hits"] + totals["late"] < totals["context_blocks"]
    # The shards' selections differ: each selected by its own heads.
    previous = np.asarray(state.sparse.previous)
    assert (previous[0] != previous[1]).any()
    cache.close()


def shard_summaries(cache, state, shard, layer, slot, length):
    """Shard ``shard``'s summaries of ``slot``'s blocks in ``layer``, by logical block."""
    summary = SummaryLayout(cache.spec)
    rows = np.asarray(state.sparse.summaries)[shard]
    table = cache.slots.table_row(slot)
    blocks = -(-length // cache.spec.block_tokens)
    lo, hi = summary.to_values(rows[[summary.row(layer, int(table[i])) for i in range(blocks)]])
    return np.asarray(lo), np.asarray(hi)


def check_shard_summaries(cache, state, slot, kv, length):
    for layer in range(kv.shape[0]):
        for shard in range(SHARDS):
            heads = slice(shard * SHARD_HEADS, (shard + 1) * SHARD_HEADS)
            keys = jnp.asarray(kv[layer, 0, :length, heads])[None]
            want = summaries.of_keys(keys, jnp.asarray([length]), 8)
            got = shard_summaries(cache, state, shard, layer, slot, length)
            np.testing.assert_array_equal(got[0], np.asarray(want[0][0]))
            np.testing.assert_array_equal(got[1], np.asarray(want[1][0]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_each_shard_summarizes_its_heads_after_a_load_and_a_prefix_import(tmp_path, dtype):
    options = dict(
        num_layers=2, batch=2, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=dtype, sparse=0.25, mesh=mesh_of(SHARDS), kv_heads_axis="h",
        shared_prefix_dir=str(tmp_path),
    )  # fmt: skip
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1000, 37)
    kv = rng.standard_normal((2, 2, 37, HEADS, HEAD_DIM)).astype(dtype)
    writer = tps.HostPoolKVCache(**options)
    state = writer.init(admit=False)
    state, _ = writer.admit(state, 1, max_tokens=48, tokens=prompt)
    for layer in range(2):
        state = writer.load(state, layer, kv[layer, 0], kv[layer, 1], slot=1)
    check_shard_summaries(writer, state, 1, kv, 37)
    writer.release(state, 1, tokens=prompt)  # Its 4 full blocks published.
    writer.close()

    reader = tps.HostPoolKVCache(**options)
    state = reader.init(admit=False)
    state, cached = reader.admit(state, 0, max_tokens=64, tokens=prompt)
    assert cached == 32  # Imported into the pool under summaries of their rows.
    check_shard_summaries(reader, state, 0, kv, 32)
    reader.close()


def test_what_a_sparse_pool_over_a_mesh_still_refuses_is_refused_by_name(tmp_path):
    mesh = mesh_of(SHARDS)
    options = dict(
        num_layers=2, batch=2, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, sparse=0.5, mesh=mesh, kv_heads_axis="h",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"sparse=.* with prefetch_depth=2: a sparse layer"):
        tps.HostPoolKVCache(**options, prefetch_depth=2)
    tps.HostPoolKVCache(**options, prefetch_depth=1).close()  # At the edge.
    with pytest.raises(ValueError, match=r"spill_path=.* with mesh=: spill_path"):
        tps.HostPoolKVCache(**options, spill_path=str(tmp_path), spill_blocks=4)


@pytest.mark.slow
def test_a_batch_sharded_pool_decodes_sparse_as_the_heads_mesh_pool():
    # A slot's selection on a device depends on its own keys and the device's heads only:
    # split over batch shards too (2 x 2 devices), the steps are those of the pool whose
    # heads alone are split (test_a_small_budget_over_a_mesh_attends_each_shards_blocks).
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    options = dict(
        num_layers=1, batch=4, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=jnp.float32, sparse=config, kv_heads_axis="h",
    )  # fmt: skip
    grid = Mesh(np.array(jax.devices()[:4]).reshape(2, SHARDS), ("b", "h"))
    batch_sharded = tps.BatchShardedPoolKVCache(**options, mesh=grid, batch_axis="b")
    heads_only = tps.HostPoolKVCache(**options, mesh=mesh_of(SHARDS))
    rng = np.random.default_rng(4)
    kv = rng.standard_normal((2, 4, 40, HEADS, HEAD_DIM)).astype(np.float32)
    inputs = random_steps(1, 4, [(1, None)] * 3, seed=5)
    step = step_fn(1)
    runs = []
    for cache in (batch_sharded, heads_only):
        state = cache.load(cache.init(), 0, kv[0], kv[1], lengths=[40, 33, 25, 38])
        outs = []
        for _, counts, qs, ks, vs in inputs:
            out, state = step(state, qs, ks, vs, counts)
            outs.append(np.asarray(out))
        runs.append((state, outs, cache.sparse_stats(state)))
    (state, outs, stats), (want_state, want_outs, want_stats) = runs
    for got, want in zip(outs, want_outs):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # Device (d, t) holds batch shard d's slots and head shard t's heads.
    previous = np.asarray(state.sparse.previous)
    previous = previous.reshape(2, SHARDS, *previous.shape[1:]).transpose(1, 2, 0, 3, 4)
    np.testing.assert_array_equal(
        previous.reshape(np.asarray(want_state.sparse.previous).shape),
        np.asarray(want_state.sparse.previous),
    )
    assert stats == want_stats
    assert stats["totals"]["decode_rows"] == 4 * 3
    assert stats["totals"]["hits"] + stats["totals"]["late"] < stats["totals"]["context_blocks"]
    batch_sharded.close()
    heads_only.close()


@pytest.mark.slow
def test_a_host_pool_hybrid_over_a_mesh_reads_its_global_layers_sparse():
    # Layers 0 and 2 slide (a dense group), layer 1 is global (a sparse group); each group
    # a host pool over the heads mesh. At a full budget the steps are the dense ones.
    options = dict(
        num_layers=3, batch=2, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=jnp.float32, sliding_window=[16, None, 16], host_pool=True,
        mesh=mesh_of(SHARDS), kv_heads_axis="h",
    )  # fmt: skip
    inputs = random_steps(3, 2, [(7, [7, 7]), (7, [7, 3]), (1, [1, 1]), (1, [1, 1])], seed=6)
    step = step_fn(3)
    runs = []
    for sparse in ({}, dict(sparse=1.0)):
        cache = tps.HybridKVCache(**options, **sparse)
        state = cache.init()
        outs = []
        for _, counts, qs, ks, vs in inputs:
            out, state = step(state, qs, ks, vs, counts)
            outs.append(np.asarray(out))
        runs.append(outs)
        if sparse:
            assert sorted(group.sparse is None for group in cache.groups) == [False, True]
        cache.close()
    for dense, full in zip(*runs):
        np.testing.assert_allclose(full, dense, atol=1e-5, rtol=0)
