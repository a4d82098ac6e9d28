"""sparse.measure against numpy: recall and relative error of a selection, the block mask,
the prediction's counts across two steps, and a full budget that is dense."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.sparse import SparseConfig, reference
from jax_tpusync.sparse import measure as sparse_measure
from jax_tpusync.sparse.prediction import COUNTS

BT = 8


def _case(seed=0, batch=2, tokens=70, heads=2, group=2, dim=16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads * group, dim)).astype(np.float32)
    keys = rng.standard_normal((batch, tokens, heads, dim)).astype(np.float32)
    values = rng.standard_normal((batch, tokens, heads, dim)).astype(np.float32)
    lengths = np.array([tokens, tokens - 13][:batch], np.int32)
    return q, keys, values, lengths


def _np_attention(q, keys, values, mask, scale):
    """Softmax attention of each row over its masked positions, in float64."""
    batch, nq, dim = q.shape
    group = nq // keys.shape[2]
    out = np.zeros((batch, nq, dim))
    for b in range(batch):
        for h in range(nq):
            s = keys[b, :, h // group].astype(np.float64) @ q[b, h] * scale
            s = np.where(mask[b], s, -np.inf)
            p = np.exp(s - s.max())
            out[b, h] = p @ values[b, :, h // group] / p.sum()
    return out


def test_a_full_budget_is_dense():
    q, keys, values, lengths = _case()
    got = sparse_measure.measure(SparseConfig(budget=1.0), q, keys, values, lengths, BT)
    np.testing.assert_allclose(np.asarray(got.recall), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.error), 0.0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.read_error), 0.0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.sparse), np.asarray(got.dense), atol=1e-6)
    # Every block of the positions cached before the step (its own row, the last one, is
    # attended from the step, as on an engine cache: slot 1's 56 cached rows are 7 blocks).
    blocks = -(-(lengths - 1) // BT)
    assert blocks.tolist() == [9, 7]
    assert np.asarray(got.read_blocks).tolist() == blocks.tolist()


def test_recall_and_error_match_numpy_on_the_selection():
    q, keys, values, lengths = _case(seed=1)
    scale = 1 / math.sqrt(q.shape[-1])
    config = SparseConfig(budget=3)
    got = sparse_measure.measure(config, q, keys, values, lengths, BT, scale=scale)
    selection = np.asarray(got.selection)
    tokens = keys.shape[1]
    mask = np.zeros((len(lengths), tokens), bool)
    for b, row in enumerate(selection):
        for block in row[row >= 0]:
            mask[b, block * BT : (block + 1) * BT] = True
        mask[b, lengths[b] :] = False
        mask[b, lengths[b] - 1] = True  # the step's own row: always attended
    valid = np.arange(tokens)[None] < lengths[:, None]
    dense = _np_attention(q, keys, values, valid, scale)
    sparse_out = _np_attention(q, keys, values, mask, scale)
    # Recall: the masked share of the dense softmax weight.
    want_recall = np.zeros(q.shape[:2])
    for b in range(len(lengths)):
        for h in range(q.shape[1]):
            s = keys[b, : lengths[b], h // 2] @ q[b, h] * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            want_recall[b, h] = p[mask[b, : lengths[b]]].sum()
    want_error = np.linalg.norm(sparse_out - dense, axis=-1) / np.linalg.norm(dense, axis=-1)
    np.testing.assert_allclose(np.asarray(got.recall), want_recall, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.error), want_error, rtol=1e-3, atol=1e-5)
    assert (np.asarray(got.recall) < 1).all()  # 3 of 9 blocks hold less than all of it
    np.testing.assert_allclose(np.asarray(got.dense), dense, rtol=1e-4, atol=1e-5)


def test_the_block_mask_is_the_references():
    rng = np.random.default_rng(2)
    selection = np.sort(rng.choice(9, (3, 4)), axis=1).astype(np.int32)
    selection[1, 2:] = -1
    lengths = np.array([70, 41, 9], np.int32)
    got = sparse_measure.blocks_mask(jnp.asarray(selection), lengths, 72, BT)
    want = reference.block_mask(jnp.asarray(selection), lengths, 72, BT)
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_the_next_step_predicted_by_this_one_hits_every_block():
    q, keys, values, lengths = _case(seed=3)
    config = SparseConfig(budget=4)
    first = sparse_measure.measure(config, q, keys, values, lengths, BT)
    counts = dict(zip(COUNTS, np.asarray(first.counts).tolist()))
    # No previous selection: only the sink and recent blocks are predicted.
    assert counts["predicted"] == 2 * len(lengths)
    assert counts["hits"] == 2 * len(lengths)
    assert counts["late"] == 2 * len(lengths)  # 4 exact blocks per slot
    again = sparse_measure.measure(config, q, keys, values, lengths, BT, previous=first.selection)
    counts = dict(zip(COUNTS, np.asarray(again.counts).tolist()))
    assert counts == {"predicted": 8, "hits": 8, "late": 0, "wasted": 0}
    assert np.array_equal(np.asarray(again.selection), np.asarray(first.selection))


@pytest.mark.parametrize("budget", [0.25, 2])
def test_reading_the_prediction_too_is_never_further_from_dense(budget):
    q, keys, values, lengths = _case(seed=4)
    config = SparseConfig(budget=budget)
    stale = np.full((len(lengths), config.max_selected(9)), -1, np.int32)
    stale[:, :2] = [3, 5]  # predicted blocks the exact selection may not hold
    got = sparse_measure.measure(config, q, keys, values, lengths, BT, previous=stale)
    assert (np.asarray(got.read_recall) >= np.asarray(got.recall) - 1e-6).all()
    assert (np.asarray(got.read_blocks) >= np.sum(np.asarray(got.selection) >= 0, -1)).all()
