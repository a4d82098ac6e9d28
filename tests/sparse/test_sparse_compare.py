"""compare_sparse on a tiny model: a full budget is the dense step, a small one moves the
logits and holds less weight, and every bad argument is refused by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.bench import tiny_decoder
from jax_tpusync.sparse import SparseConfig
from jax_tpusync.sparse.prediction import COUNTS

MODEL = tiny_decoder.Decoder(
    layers=2, d_model=64, q_heads=4, kv_heads=2, head_dim=16, ffn=64, vocab=48, q_gain=4.0
)
CACHE = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype=jnp.float32, block_tokens=16)
CONTEXT = np.random.default_rng(0).integers(0, MODEL.vocab, (2, 200))


@pytest.fixture(scope="module")
def params():
    return tiny_decoder.init_params(MODEL, 0)


def step(params, tokens, state, attention=tps.prefetching_attention):
    """The user's step: attention passed in, called once per layer with an int layer."""
    x, state = tiny_decoder.run_layers(
        params["layers"],
        params["embed"][tokens],
        state,
        lambda layer, q, k, v, s: attention(q, k, v, s, layer=layer),
        q_heads=MODEL.q_heads,
        kv_heads=MODEL.kv_heads,
        head_dim=MODEL.head_dim,
        q_gain=MODEL.q_gain,
        norm=tiny_decoder.rms_norm,
    )
    return (tiny_decoder.rms_norm(x[:, -1]) @ params["unembed"]).astype(jnp.float32), state


def test_a_full_budget_is_the_dense_step(params):
    got = tps.compare_sparse(
        step, params, CONTEXT, sparse=1.0, decode_steps=3, prefill_chunk=128, **CACHE
    )
    assert got.top1_agreement == 1.0
    assert got.max_abs_logit_diff < 1e-4
    np.testing.assert_allclose(got.recall, 1.0, atol=1e-5)
    np.testing.assert_allclose(got.error, 0.0, atol=1e-5)
    assert got.dense_logits.shape == (3, 2, MODEL.vocab)
    assert got.dense_tokens.shape == (3, 2)
    assert "layer 1: recall 1.0000" in got.summary()


def test_a_small_budget_holds_less_and_moves_the_logits(params):
    config = SparseConfig(budget=3, sink_blocks=1, recent_blocks=1)
    got = tps.compare_sparse(
        step, params, CONTEXT[:1], sparse=config, decode_steps=3, prefill_chunk=128, **CACHE
    )
    assert got.budget == 3
    assert (got.recall < 1).all() and (got.recall_min <= got.recall).all()
    assert got.max_abs_logit_diff > 0
    counts = dict(zip(COUNTS, got.counts.T))
    # 3 blocks a step; the first step predicts only its sink and recent blocks.
    assert (counts["hits"] + counts["late"] == 3 * 3).all()
    np.testing.assert_allclose(got.coverage, counts["hits"] / 9)
    np.testing.assert_allclose(got.hit_rate, counts["hits"] / counts["predicted"])
    assert "sparse at 3 blocks against dense over 3 decode steps" in got.summary()


def test_a_traced_layer_is_refused(params):
    def scanned(params, tokens, state, attention=tps.prefetching_attention):
        def traced(layer, q, k, v, s):
            return attention(q, k, v, s, layer=jnp.int32(layer))

        x, state = tiny_decoder.run_layers(
            params["layers"],
            params["embed"][tokens],
            state,
            traced,
            q_heads=MODEL.q_heads,
            kv_heads=MODEL.kv_heads,
            head_dim=MODEL.head_dim,
        )
        return x[:, -1, : MODEL.vocab], state

    with pytest.raises(ValueError, match=r"each layer's index as a Python int"):
        tps.compare_sparse(scanned, params, CONTEXT[:1, :20], decode_steps=1, **CACHE)


def test_bad_arguments_are_refused_by_name(params):
    def compare(**kw):
        args = dict(sparse=0.5, decode_steps=1, **CACHE)
        args.update(kw)
        return tps.compare_sparse(step, params, args.pop("context", CONTEXT[:1, :20]), **args)

    for name in ("resident", "batch"):
        with pytest.raises(ValueError, match=rf"compare_sparse sets {name}= itself"):
            compare(**{name: True})
    with pytest.raises(ValueError, match=r"context must be int tokens \[batch, T\] or \[T\]"):
        compare(context=np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"context must be int tokens .* got int64\[1, 0\]"):
        compare(context=np.zeros((1, 0), np.int64))
    with pytest.raises(ValueError, match=r"decode_steps=0 must be an int >= 1"):
        compare(decode_steps=0)
    with pytest.raises(ValueError, match=r"prefill_chunk=0 must be an int >= 1"):
        compare(prefill_chunk=0)
    with pytest.raises(
        ValueError, match=r"max_len=20 is less than the context \(20\) plus decode_steps \(1\)"
    ):
        compare(max_len=20)
    with pytest.raises(ValueError, match=r"sparse budget=0.0 must be a share in \(0, 1\]"):
        compare(sparse=0.0)
    with pytest.raises(ValueError, match=r"drop sliding_window"):
        compare(sliding_window=8, max_len=21)
    with pytest.raises(ValueError, match=r"drop tier_dtype"):
        compare(tier_dtype="int8", dtype=jnp.bfloat16)
