"""The sparse core against numpy: summaries, score bounds, the selection, the prediction's
counts, and a compacted table's dense walk against attention over the selection."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.sparse import SparseConfig, prediction, reference, select, summaries

# --- numpy references -------------------------------------------------------------------


def np_select(config: SparseConfig, bounds, lengths, block_tokens):
    """Per slot: mandatory blocks, then the rest by relative bound (ties: lower index)."""
    batch, heads, num_blocks = bounds.shape
    size = config.max_selected(num_blocks)
    out = np.full((batch, size), -1, np.int32)
    for b in range(batch):
        nb = -(-int(lengths[b]) // block_tokens)
        if nb == 0:
            continue
        if isinstance(config.budget, int):
            count = min(nb, config.budget)
        else:
            wanted = math.ceil(float(np.float32(config.budget) * np.float32(nb)))
            count = min(nb, max(wanted, config.always_read))
        rel = (bounds[b, :, :nb] - bounds[b, :, :nb].max(axis=1, keepdims=True)).max(axis=0)
        mandatory = [
            i for i in range(nb) if i < config.sink_blocks or i >= nb - config.recent_blocks
        ]
        rest = sorted((i for i in range(nb) if i not in mandatory), key=lambda i: (-rel[i], i))
        chosen = sorted((mandatory + rest)[:count])
        out[b, : len(chosen)] = chosen
    return out


def np_summaries(keys, lengths, block_tokens):
    batch, tokens, heads, dim = keys.shape
    nb = -(-tokens // block_tokens)
    lo = np.full((batch, nb, heads, dim), np.finfo(keys.dtype).max, keys.dtype)
    hi = np.full((batch, nb, heads, dim), np.finfo(keys.dtype).min, keys.dtype)
    for b in range(batch):
        for blk in range(nb):
            rows = keys[b, blk * block_tokens : min((blk + 1) * block_tokens, lengths[b])]
            if len(rows):
                lo[b, blk], hi[b, blk] = rows.min(0), rows.max(0)
    return lo, hi


# --- the config -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=0.0), r"budget=0.0 must be a share in \(0, 1\]"),
        (dict(budget=1.0000001), r"budget=1.0000001 must be a share in \(0, 1\]"),
        (dict(budget=float("nan")), r"budget=nan must be a share"),
        (dict(budget=True), r"budget=True must be a float in \(0, 1\]"),
        (dict(budget="5%"), r"budget='5%' must be a float"),
        (dict(budget=0), r"budget=0 blocks must be at least 1"),
        (
            dict(budget=1),
            r"budget=1 blocks is fewer than the blocks always read: "
            r"sink_blocks \+ recent_blocks = 2",
        ),
        (dict(recent_blocks=0), r"recent_blocks=0 must be an int >= 1: the block being written"),
        (dict(sink_blocks=-1), r"sink_blocks=-1 must be an int >= 0"),
        (dict(sink_blocks=1.0), r"sink_blocks=1.0 must be an int >= 0"),
    ],
)
def test_a_bad_sparse_setting_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(**kwargs)


def test_the_settings_at_their_edges_are_accepted():
    assert SparseConfig(budget=1.0).budget == 1.0
    assert SparseConfig(budget=2).budget == 2  # exactly sink + recent
    assert SparseConfig(budget=1, sink_blocks=0).budget == 1
    assert SparseConfig(budget=np.float32(0.25)).budget == 0.25


@pytest.mark.parametrize("budget", [0.01, 0.03, 0.05, 0.1, 0.333, 1.0, 2, 7, 64])
def test_the_static_bound_holds_every_count(budget):
    config = SparseConfig(budget=budget)
    for max_blocks in (1, 2, 3, 17, 100, 4096, 65536):
        counts = np.asarray(config.selected_count(jnp.arange(max_blocks + 1)))
        assert counts.max() <= config.max_selected(max_blocks)
        assert (counts <= np.arange(max_blocks + 1)).all()


# --- summaries and bounds ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_summaries_equal_numpy_and_bound_every_score(dtype):
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((3, 70, 2, 8)).astype(dtype)
    lengths = np.array([70, 33, 0])
    lo, hi = summaries.of_keys(jnp.asarray(keys), jnp.asarray(lengths), 16)
    want_lo, want_hi = np_summaries(keys, lengths, 16)
    np.testing.assert_array_equal(np.asarray(lo), want_lo)
    np.testing.assert_array_equal(np.asarray(hi), want_hi)
    q = rng.standard_normal((3, 1, 4, 8)).astype(np.float32)  # 2 query heads per KV head
    bounds = np.asarray(summaries.score_bounds(jnp.asarray(q), lo, hi))
    scores = np.einsum("bhgd,bthd->bhgt", q[:, 0].reshape(3, 2, 2, 8), keys.astype(np.float32))
    for b in range(3):
        for t in range(lengths[b]):
            assert (scores[b, :, :, t].max(-1) <= bounds[b, :, t // 16] + 1e-4).all()


def test_update_keeps_summaries_equal_to_the_rows_written():
    """Rows written a few at a time into physical blocks, one block freed and reused: the
    summaries equal those of each block's rows as they stand."""
    rng = np.random.default_rng(1)
    heads, dim, num_blocks = 2, 3, 5
    lo, hi = summaries.empty((2, num_blocks, heads, dim), jnp.float32)
    blocks = {}  # physical block -> rows, per layer 1
    order = [(2, 0), (2, 1), (2, 2), (0, 0), (0, 1), (2, 3), (0, 2), (2, 0), (2, 1)]
    for i in range(0, len(order), 2):
        batch = order[i : i + 2]
        keys = rng.standard_normal((len(batch), heads, dim)).astype(np.float32)
        phys = np.array([p for p, _ in batch] + [-1], np.int32)
        offs = np.array([o for _, o in batch] + [0], np.int32)
        keys_padded = np.concatenate([keys, 9 * np.ones((1, heads, dim), np.float32)])
        lo, hi = summaries.update(
            lo, hi, jnp.asarray(phys), jnp.asarray(offs), jnp.asarray(keys_padded), layer=1
        )
        for (p, o), k in zip(batch, keys):
            rows = blocks.setdefault(p, [])
            if o == 0:
                rows.clear()
            rows.append(k)
    for p, rows in blocks.items():
        np.testing.assert_array_equal(np.asarray(lo[1, p]), np.min(rows, 0))
        np.testing.assert_array_equal(np.asarray(hi[1, p]), np.max(rows, 0))
    assert (np.asarray(lo[0]) == np.finfo(np.float32).max).all()  # layer 0 untouched
    untouched = [p for p in range(num_blocks) if p not in blocks]
    assert (np.asarray(hi[1, untouched]) == np.finfo(np.float32).min).all()


# --- the selection ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        SparseConfig(budget=0.05),
        SparseConfig(budget=0.25, sink_blocks=2, recent_blocks=3),
        SparseConfig(budget=1.0),
        SparseConfig(budget=5),
        SparseConfig(budget=3, sink_blocks=0, recent_blocks=1),
    ],
)
def test_the_selection_equals_numpy(config):
    rng = np.random.default_rng(2)
    bt, num_blocks = 16, 40
    lengths = np.array([0, 1, 16, 17, 300, 640, 639, 100])
    bounds = rng.standard_normal((len(lengths), 4, num_blocks)).astype(np.float32)
    bounds[3, :, 0] = bounds[3, :, 1]  # a tie
    got = np.asarray(select.select(config, jnp.asarray(bounds), jnp.asarray(lengths), bt))
    np.testing.assert_array_equal(got, np_select(config, bounds, lengths, bt))
    nb = -(-lengths // bt)
    for b in range(len(lengths)):  # the last context block is the last entry
        picked = got[b][got[b] >= 0]
        if nb[b]:
            assert picked[-1] == nb[b] - 1 and picked[0] == (0 if config.sink_blocks else picked[0])


def test_a_full_budget_selects_every_block_of_the_context():
    lengths = np.array([5, 64, 65])
    bounds = jnp.zeros((3, 2, 9))
    got = np.asarray(select.select(SparseConfig(budget=1.0), bounds, jnp.asarray(lengths), 8))
    for b, n in enumerate(-(-lengths // 8)):
        assert list(got[b][got[b] >= 0]) == list(range(n))


def test_a_head_that_needs_a_block_gets_it():
    """Head 1's only strong block is weak for head 0: the ranking across heads keeps it."""
    bounds = np.zeros((1, 2, 10), np.float32)
    bounds[0, 0, 4] = 50.0  # head 0 prefers block 4 by far
    bounds[0, 1, :] = -100.0
    bounds[0, 1, 7] = -1.0  # head 1's best block, weak in absolute terms
    got = np.asarray(select.select(SparseConfig(budget=4), jnp.asarray(bounds), jnp.array([80]), 8))
    assert list(got[0]) == [0, 4, 7, 9]


# --- the compacted table ----------------------------------------------------------------


@pytest.mark.parametrize("budget", [0.2, 1.0])
def test_a_dense_walk_of_the_compacted_table_is_attention_over_the_selection(budget):
    rng = np.random.default_rng(3)
    batch, heads, group, dim, bt, max_blocks = 3, 2, 2, 8, 8, 12
    lengths = np.array([96, 41, 8])
    num_physical = batch * max_blocks
    table = rng.permutation(num_physical).reshape(batch, max_blocks).astype(np.int32)
    pool_k = rng.standard_normal((num_physical, bt, heads, dim)).astype(np.float32)
    pool_v = rng.standard_normal((num_physical, bt, heads, dim)).astype(np.float32)
    keys = pool_k[table].reshape(batch, -1, heads, dim)  # by logical position
    values = pool_v[table].reshape(batch, -1, heads, dim)
    q = rng.standard_normal((batch, heads * group, dim)).astype(np.float32)
    lo, hi = summaries.of_keys(jnp.asarray(keys), jnp.asarray(lengths), bt)
    bounds = summaries.score_bounds(jnp.asarray(q)[:, None], lo, hi)
    config = SparseConfig(budget=budget)
    chosen = select.select(config, bounds, jnp.asarray(lengths), bt)
    ctable, clen = select.compact(chosen, jnp.asarray(table), jnp.asarray(lengths), bt)
    ctable, clen = np.asarray(ctable), np.asarray(clen)
    # The dense walk: positions [0, clen) through the compacted table.
    walked_k = pool_k[np.maximum(ctable, 0)].reshape(batch, -1, heads, dim)
    walked_v = pool_v[np.maximum(ctable, 0)].reshape(batch, -1, heads, dim)
    dense_mask = np.arange(walked_k.shape[1])[None] < clen[:, None]
    walked = reference.attention(
        jnp.asarray(q), jnp.asarray(walked_k), jnp.asarray(walked_v), jnp.asarray(dense_mask), 0.3
    )
    mask = reference.block_mask(chosen, jnp.asarray(lengths), keys.shape[1], bt)
    want = reference.attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), mask, 0.3)
    np.testing.assert_allclose(np.asarray(walked), np.asarray(want), rtol=1e-5, atol=1e-5)
    if budget == 1.0:
        full = np.arange(keys.shape[1])[None] < lengths[:, None]
        dense = reference.attention(
            jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(full), 0.3
        )
        np.testing.assert_allclose(np.asarray(walked), np.asarray(dense), rtol=1e-5, atol=1e-5)
        recall = reference.recall(
            jnp.asarray(q), jnp.asarray(keys), jnp.asarray(lengths), mask, 0.3
        )
        np.testing.assert_allclose(np.asarray(recall), 1.0, rtol=1e-6)


# --- the prediction ---------------------------------------------------------------------


def test_the_counts_are_exact_on_a_constructed_case():
    predicted = jnp.array([[0, 3, 5, 9, -1], [0, 1, 2, -1, -1]], jnp.int32)
    exact = jnp.array([[0, 4, 5, 9], [0, 1, 2, -1]], jnp.int32)
    # slot 0: predicted 4, hits {0, 5, 9}, late {4}, wasted {3}; slot 1: all hits.
    assert list(np.asarray(prediction.counts(predicted, exact))) == [7, 6, 1, 1]
    np.testing.assert_array_equal(
        np.asarray(prediction.late(predicted, exact)), [[4, -1, -1, -1], [-1, -1, -1, -1]]
    )


def test_the_prediction_adds_this_steps_recent_blocks_and_drops_repeats():
    config = SparseConfig(budget=4, sink_blocks=1, recent_blocks=2)
    previous = jnp.array([[0, 2, 6, 7], [0, 1, -1, -1]], jnp.int32)
    # slot 0: 64 tokens at bt 8 (blocks 0..7): recent 6, 7 already there; slot 1: 17 tokens
    # (blocks 0..2): recent 1, 2.
    got = np.asarray(prediction.predict(config, previous, jnp.array([64, 17]), 8, 8))
    np.testing.assert_array_equal(got, [[0, 2, 6, 7, -1, -1, -1], [0, 1, 2, -1, -1, -1, -1]])
    # Entries past a context that shrank (a slot reset) are dropped.
    got = np.asarray(prediction.predict(config, previous, jnp.array([9, 0]), 8, 8))
    np.testing.assert_array_equal(got, [[0, 1, -1, -1, -1, -1, -1], [-1] * 7])


@pytest.mark.parametrize(
    "budget, recent, previous, tokens, want",
    [
        # 24 tokens (blocks 0..5) selected {0, 2, 5}; at 25 the recent block is 6: with 5
        # kept the prediction would hold 4 blocks for a selection of 3, one wasted for sure.
        (3, 1, [0, 2, 5], 25, [0, 2, 6]),
        # A share of 0.5: the selection grows to 4 blocks at 7; 5 stays (it may be needed).
        (0.5, 1, [0, 2, 5], 25, [0, 2, 5, 6]),
        # Every block selected (8 of 8 allowed): nothing is left out.
        (8, 1, [0, 1, 2, 3, 4, 5], 25, [0, 1, 2, 3, 4, 5, 6]),
        # Two recent blocks {6, 7} at 32 tokens move to {7, 8}: 6 is left out, 3 stays.
        (4, 2, [0, 3, 6, 7], 33, [0, 3, 7, 8]),
        # No boundary crossed (22 to 23 tokens): the previous selection as it was.
        (3, 1, [0, 2, 5], 23, [0, 2, 5]),
    ],
)
def test_the_prediction_never_outgrows_the_selection(budget, recent, previous, tokens, want):
    config = SparseConfig(budget=budget, sink_blocks=1, recent_blocks=recent)
    width = config.max_selected(16)
    prev = np.full((1, width), -1, np.int32)
    prev[0, : len(previous)] = previous
    got = np.asarray(prediction.predict(config, jnp.asarray(prev), jnp.array([tokens]), 4, 16))
    assert got[0][got[0] >= 0].tolist() == want
    count = int(config.selected_count(jnp.array([-(-tokens // 4)]))[0])
    assert len(want) <= count
