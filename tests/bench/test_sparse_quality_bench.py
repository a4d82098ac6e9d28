"""The sparse quality benchmarks at tiny sizes: the hand-built retrieval model (its context
KV is the causal forward's, it answers right densely, its guards), ``bench retrieval`` and
``bench sparse`` (a full budget holds all the weight with no error)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import retrieval_model as rm
from jax_tpusync.sparse import SparseConfig

MODEL = rm.RetrievalModel(families=4, noise_words=64)


@pytest.fixture(scope="module")
def params():
    return rm.build(MODEL)


def _causal(q, k, v):
    """Plain causal attention [B, T, 1, D] (scale 1/sqrt(D))."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def test_the_context_kv_is_the_causal_forwards(params):
    trial = rm.make_trial(MODEL, 256, 0.5, 64, seed=0, records=4)
    tokens = np.concatenate([trial.tokens, [MODEL.ask(trial.key)]])[None]
    seen = []

    def attend(layer, q, k, v, state):
        seen.append((np.asarray(k), np.asarray(v)))
        return _causal(q, k, v), state

    rm.forward(MODEL, params, jnp.asarray(tokens), None, attend)
    for (k, v), (want_k, want_v) in zip(seen, rm.context_kv(params, tokens)):
        np.testing.assert_allclose(k, want_k, atol=1e-5)
        np.testing.assert_allclose(v, want_v, atol=1e-5)
    # Why: no key or value projection reads what an attention output writes.
    for p in params.layers:
        for reader in params.layers:
            assert not (p["wo"] @ reader["wk"]).any()
            assert not (p["wo"] @ reader["wv"]).any()


def test_sibling_keys_have_the_cosine_asked(params):
    dirs = params.key_directions
    np.testing.assert_allclose(np.linalg.norm(dirs, axis=1), 1.0, atol=1e-5)
    family = dirs[: MODEL.siblings]
    cos = family @ family.T
    off = ~np.eye(MODEL.siblings, dtype=bool)
    np.testing.assert_allclose(cos[off], MODEL.sibling_cos, atol=1e-5)


def test_the_model_answers_right_densely_and_sparse_at_a_full_budget(params):
    trials = [
        rm.make_trial(MODEL, 1024, d, 64, seed=i, records=8) for i, d in enumerate(rm.depths(3))
    ]
    dense = rm.decode_reference(MODEL, params, trials, 64)
    assert rm.correct(MODEL, trials, dense.answers).all()
    full = rm.decode_reference(MODEL, params, trials, 64, SparseConfig(budget=1.0), sparse=True)
    assert rm.correct(MODEL, trials, full.answers).all()
    np.testing.assert_allclose(full.recall, 1.0, atol=1e-6)
    # Two blocks (the first and the last) never hold the needle: the answer is wrong.
    two = rm.decode_reference(MODEL, params, trials, 64, SparseConfig(budget=2), sparse=True)
    assert not rm.correct(MODEL, trials, two.answers).any()


def test_the_engine_cache_answers_as_the_reference(params):
    trials = [
        rm.make_trial(MODEL, 1024, d, 64, seed=i, records=8) for i, d in enumerate(rm.depths(2))
    ]
    dense = rm.decode_engine(MODEL, params, trials, 64)
    assert rm.correct(MODEL, trials, dense.answers).all() and dense.stats is None
    sparse = rm.decode_engine(MODEL, params, trials, 64, SparseConfig(budget=4))
    reference = rm.decode_reference(MODEL, params, trials, 64, SparseConfig(budget=4), sparse=True)
    assert np.array_equal(sparse.answers, reference.answers)
    assert sparse.counts.shape == (MODEL.answer_tokens, 2, 4)
    assert sparse.stats["steps"] == MODEL.answer_tokens


def test_retrieval_model_guards():
    with pytest.raises(ValueError, match=r"families=0 must be at least 1"):
        rm.RetrievalModel(families=0)
    with pytest.raises(ValueError, match=r"sibling_cos=1.0 must be in \[0, 1\)"):
        rm.RetrievalModel(sibling_cos=1.0)
    rm.RetrievalModel(sibling_cos=0.0)
    with pytest.raises(
        ValueError,
        match=r"head_dim=12 less answer_tokens=8 leaves 4 key channels; a family of "
        r"siblings=4 needs 5",
    ):
        rm.RetrievalModel(head_dim=12, answer_tokens=8)
    rm.RetrievalModel(head_dim=13, answer_tokens=8)  # the edge: 5 key channels
    with pytest.raises(ValueError, match=r"block_tokens=12 must be a multiple of answer_tokens=8"):
        rm.make_trial(MODEL, 1024, 0.5, 12, seed=0)
    with pytest.raises(
        ValueError,
        match=r"context=88 holds 11 records of 8 tokens; the needle, its 3 siblings and "
        r"records=8 others need 12",
    ):
        rm.make_trial(MODEL, 88, 0.5, 64, seed=0, records=8)
    rm.make_trial(MODEL, 96, 0.5, 64, seed=0, records=8)  # the edge: 12 places


@pytest.mark.parametrize("path", ["engine", "reference", "pool"])
def test_bench_retrieval_tiny(tmp_path, capsys, path):
    """``pool``: the engine path with ``--tier pool``, through a HostPoolKVCache."""
    out = tmp_path / "retrieval.json"
    args = bench_main.build_parser().parse_args(
        [
            "retrieval",
            "--contexts",
            "1024",
            "--depths",
            "2",
            "--block-tokens",
            "64",
            "--records",
            "8",
            "--families",
            "4",
            "--noise-words",
            "64",
            "--budgets",
            "0.25",
            "--path",
            "engine" if path == "pool" else path,
            *(["--tier", "pool"] if path == "pool" else []),
            "--json",
            str(out),
        ]
    )
    rows = args.run(args)
    printed = capsys.readouterr().out
    named = {"engine": "engine cache", "reference": "sparse reference", "pool": "host pool"}[path]
    assert named in printed and "dense answers 100.0% right" in printed
    dense, sparse = rows
    assert dense["budget"] == "dense" and dense["accuracy"] == 1.0 and dense["trials"] == 2
    assert sparse["budget"] == "25%" and len(sparse["hit_rate_per_layer"]) == 2
    assert all(0 <= h <= 1 for h in sparse["hit_rate_per_layer"] + sparse["coverage_per_layer"])
    assert 0 < sparse["read_share"] < 1  # bytes (engine, summaries included) or blocks
    if path == "reference":
        assert len(sparse["recall_per_layer"]) == 2
        assert dense["recall_per_layer"] == pytest.approx([1.0, 1.0])  # budget 1.0: all
    bench_main.common.report_json(args, "retrieval", rows)
    assert json.loads(out.read_text())["results"][0]["path"].startswith(named)


def test_bench_sparse_tiny_full_budget_holds_everything(capsys):
    args = bench_main.build_parser().parse_args(
        [
            "sparse",
            "--context",
            "256",
            "--block-tokens",
            "32",
            "--steps",
            "3",
            "--batch",
            "2",
            "--budgets",
            "1.0",
            "0.25",
            "--prefill-window",
            "64",
            "--chunk",
            "128",
            "--retrieval-trials",
            "2",
            "--retrieval-records",
            "8",
            "--layers",
            "2",
            "--d-model",
            "64",
            "--q-heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--ffn",
            "64",
            "--vocab",
            "64",
        ]
    )
    rows = args.run(args)
    assert "random-q4" in capsys.readouterr().out
    for row in rows:
        if row["budget_share"] == 1.0:
            assert row["recall"] == pytest.approx(1.0, abs=1e-5), row
            assert row["error"] == pytest.approx(0.0, abs=1e-5), row
        else:
            assert 0 < row["recall"] <= 1 + 1e-6
    layers = {m: {r["layer"] for r in rows if r["model"] == m} for m in ("random", "retrieval")}
    assert layers == {"random": {0, 1}, "retrieval": {0, 1}}
    # A quarter of the random model's 9 blocks holds less than all its flat weight.
    assert any(r["recall"] < 0.99 for r in rows if r["model"] == "random")
