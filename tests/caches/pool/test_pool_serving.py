"""The serving loop over the host pool (the TPU data path), run on the CPU backend: the
same requests generate the tokens a model without a cache does, the shared system prompt is
mapped from the prefix index, and every slot is released at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps
from jax_tpusync import serving
from jax_tpusync.bench import serving_model, tiny_decoder

CFG = tiny_decoder.Decoder(
    layers=2, d_model=32, q_heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=64, q_gain=2.0
)
CHUNK, BLOCK, MAX_LEN = 8, 8, 64
SYSTEM = list(range(1, 17))  # Two full blocks shared by every prompt.


def step_fn():
    def step(params, tokens, positions, counts, state):
        def attend(layer, q, k, v, state):
            return tps.prefetching_attention(q, k, v, state, layer=layer, query_seq_lengths=counts)

        return serving_model.forward(CFG, params, tokens, positions, state, attend)

    return jax.jit(step, donate_argnums=(4,))


def test_the_serving_loop_over_the_host_pool_generates_the_reference_tokens():
    params = serving_model.init_params(CFG, 0, jnp.float32)
    rng = np.random.default_rng(1)
    requests = [
        serving.Request(SYSTEM + rng.integers(0, CFG.vocab, n).tolist(), max_new_tokens=5)
        for n in (1, 9, 3, 20, 6)
    ]
    cache = tps.HostPoolKVCache(
        num_layers=CFG.layers, batch=3, max_len=MAX_LEN, num_kv_heads=CFG.kv_heads,
        head_dim=CFG.head_dim, dtype=jnp.float32, block_tokens=BLOCK,
        num_blocks=3 * MAX_LEN // BLOCK + 8, staging_bytes=64 << 10,
    )  # fmt: skip
    with cache:
        loop = serving.ServingLoop(cache, step_fn(), params, chunk=CHUNK)
        done = loop.run(requests)
        assert np.all(cache.capacity == 0)  # Every slot released.
    for c, r in zip(done, requests):
        want = serving_model.reference_generate(CFG, params, r.prompt, 5, pad_to=MAX_LEN)
        assert c.tokens == want, (c.index, c.tokens, want)
        assert c.finish_reason == "length"
    assert done[0].cached == 0
    assert any(c.cached >= len(SYSTEM) for c in done[3:])  # Mapped from the prefix index.
