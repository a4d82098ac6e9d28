"""ServingLoop: continuous batching through one compiled step, against a model with no cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync import serving
from jax_tpusync.bench import serving_model, tiny_decoder

CFG = tiny_decoder.Decoder(
    layers=2, d_model=32, q_heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=64, q_gain=2.0
)
CHUNK, BLOCK, MAX_LEN = 8, 8, 64
SYSTEM = list(range(1, 17))  # Two full blocks shared by every prompt.


def make_cache(tmp_path, tier="host", batch=3):
    extra = dict(path=str(tmp_path)) if tier == "file" else {}
    return tps.OffloadedKVCache(
        num_layers=CFG.layers,
        batch=batch,
        max_len=MAX_LEN,
        num_kv_heads=CFG.kv_heads,
        head_dim=CFG.head_dim,
        dtype=jnp.float32,
        block_tokens=BLOCK,
        num_blocks=batch * MAX_LEN // BLOCK + 8,
        staging_bytes=64 << 10,
        tier=tier,
        **extra,
    )


def counting_step(traces):
    def step(params, tokens, positions, counts, state):
        traces.append(tokens.shape)

        def attend(layer, q, k, v, state):
            return tps.prefetching_attention(q, k, v, state, layer=layer, query_seq_lengths=counts)

        return serving_model.forward(CFG, params, tokens, positions, state, attend)

    return jax.jit(step, donate_argnums=(4,))


@pytest.fixture(scope="module")
def params():
    return serving_model.init_params(CFG, 0, jnp.float32)


@pytest.mark.parametrize("tier", ["host", "file"])
def test_tokens_equal_a_model_without_cache(tier, tmp_path, params):
    """Five prompts (a shared system prompt, then 1-3 chunks each) through three slots:
    greedy tokens equal a full recompute per token, later prompts reuse the system prompt's
    blocks, and the loop ran steps of two widths only."""
    rng = np.random.default_rng(1)
    tails = [1, 9, 3, 20, 6]
    requests = [
        serving.Request(SYSTEM + rng.integers(0, CFG.vocab, n).tolist(), max_new_tokens=5)
        for n in tails
    ]
    with make_cache(tmp_path, tier) as cache:
        loop = serving.ServingLoop(cache, counting_step([]), params, chunk=CHUNK)
        done = loop.run(requests)
        state = loop.state
        assert np.all(cache.capacity == 0)  # Every slot released.
        cache.close(state)
    for c, r in zip(done, requests):
        want = serving_model.reference_generate(CFG, params, r.prompt, 5, pad_to=MAX_LEN)
        assert c.tokens == want, (c.index, c.tokens, want)
        assert c.finish_reason == "length" and c.ttft > 0 and c.time_per_output_token > 0
    assert done[0].cached == 0
    assert any(c.cached >= len(SYSTEM) for c in done[3:])  # Admitted after a release.
    assert set(loop.stats()["steps_by_width"]) == {1, CHUNK}


@pytest.mark.parametrize("decode_width, compiled", [(None, 1), (1, 2)])
def test_one_compiled_step_for_prompts_of_one_to_three_chunks(
    decode_width, compiled, tmp_path, params
):
    traces = []
    step = counting_step(traces)
    with make_cache(tmp_path) as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK, decode_width=decode_width)
        requests = [serving.Request(list(range(1, n + 1)), 3) for n in (5, 13, 20, 1, 24)]
        # Staggered: each joins while the others decode or prefill.
        done = loop.run(requests, arrivals=[0, 0, 0.05, 0.1, 0.1])
        assert all(c.done for c in done)
        cache.close(loop.state)
    assert len(traces) == compiled and step._cache_size() == compiled
    assert {t[1] for t in traces} == ({CHUNK} if decode_width is None else {1, CHUNK})


def test_history_holds_every_fed_token_but_the_last_sampled(tmp_path, params):
    """The off-by-one: after each step the slot's ids are the prompt plus the fed tokens,
    which are all generated tokens but the last; release publishes them."""
    prompt = SYSTEM + [5, 6, 7]
    with make_cache(tmp_path) as cache:
        loop = serving.ServingLoop(cache, counting_step([]), params, chunk=CHUNK)
        c = loop.submit(serving.Request(prompt, max_new_tokens=4))
        while not c.done:
            loop.step()
            if c.tokens and not c.done:
                np.testing.assert_array_equal(cache.tokens(c.slot), prompt + c.tokens[:-1])
                assert (
                    int(np.asarray(loop.state.lengths)[c.slot]) == len(prompt) + len(c.tokens) - 1
                )
        # A second request with the first's prompt and tokens maps its full blocks.
        again = loop.submit(serving.Request(prompt + c.tokens, max_new_tokens=1))
        loop.run()
        assert again.cached == (len(prompt) + 3) // BLOCK * BLOCK
        cache.close(loop.state)


def test_sampler_stop_tokens_and_refusals(tmp_path, params):
    seen = []

    def sample(logits, rng):
        seen.append((logits.shape, type(rng)))
        p = np.exp(logits - logits.max())
        return int(rng.choice(logits.size, p=p / p.sum()))

    with make_cache(tmp_path) as cache:
        loop = serving.ServingLoop(cache, counting_step([]), params, chunk=CHUNK, seed=3)
        a = loop.submit(serving.Request([1, 2, 3], 6, sampler=sample))
        b = loop.submit(serving.Request([1, 2, 3], 6, sampler=sample, seed=(3, 0)))
        loop.run()
        assert a.tokens == b.tokens and len(a.tokens) == 6  # Seeded per request.
        assert set(seen) == {((CFG.vocab,), np.random.Generator)}
        first = a.tokens[0]
        c = loop.submit(
            serving.Request([1, 2, 3], 6, sampler=sample, stop_tokens=(first,), seed=(3, 0))
        )
        loop.run()
        assert c.tokens == [first] and c.finish_reason == "stop"
        with pytest.raises(ValueError, match="needs 65 tokens of KV .*max_len is 64"):
            loop.submit(serving.Request(list(range(60)), 6))
        with pytest.raises(ValueError, match="prompt must hold at least one token id"):
            loop.submit(serving.Request([], 2))
        cache.close(loop.state)
