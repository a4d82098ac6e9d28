"""ServingLoop with share_prefixes: prompt blocks are shared as soon as a step computed them,
and a request waits behind a running prefill of its prefix instead of computing it again;
every request's tokens equal the model's without a cache."""

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
SYSTEM = list(range(1, 33))  # Four full blocks shared by every prompt.


def make_cache(batch=4):
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
    )


def make_step():
    def step(params, tokens, positions, counts, state):
        def attend(layer, q, k, v, state):
            return tps.prefetching_attention(q, k, v, state, layer=layer, query_seq_lengths=counts)

        return serving_model.forward(CFG, params, tokens, positions, state, attend)

    return jax.jit(step, donate_argnums=(4,))


@pytest.fixture(scope="module")
def params():
    return serving_model.init_params(CFG, 0, jnp.float32)


@pytest.fixture(scope="module")
def step():
    return make_step()


def alone(params, prompt, n):
    return serving_model.reference_generate(CFG, params, prompt, n, pad_to=MAX_LEN)


def test_a_block_shared_mid_prefill_is_mapped_a_step_later_and_the_owner_goes_on(params, step):
    owner_prompt = SYSTEM + [40, 41, 42]  # Five chunks of prefill.
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        owner = loop.submit(serving.Request(owner_prompt, 4))
        loop.step()  # One chunk: block 0 written, and shared at once.
        assert cache.prefix_stats["indexed_blocks"] == 1
        loop.step()  # Block 1 too.
        # A prompt sharing the two computed blocks, then another tail: admitted at once
        # (nothing it needs is still being computed), its two blocks mapped.
        reader_prompt = SYSTEM[:16] + [50, 51, 52, 53, 54]
        reader = loop.submit(serving.Request(reader_prompt, 4))
        loop.step()
        assert reader.cached == 16
        assert loop.stats()["prefill_tokens"] == len(owner_prompt) + len(reader_prompt) - 16
        loop.run()
        cache.close(loop.state)
    assert owner.tokens == alone(params, owner_prompt, 4)
    assert reader.tokens == alone(params, reader_prompt, 4)


def test_a_partially_filled_block_is_never_mapped(params, step):
    prompt = SYSTEM[:12] + [60]  # Chunks of 4: the first fills half a block.
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=4, share_prefixes=False)
        loop.submit(serving.Request(prompt, 2))
        loop.step()  # Four rows of block 0.
        assert cache.share_computed(loop.state, 0) == 0
        reader = loop.submit(serving.Request(prompt, 2))
        loop.step()  # The reader is admitted on half a block: it maps nothing.
        assert reader.cached == 0
        assert cache.share_computed(loop.state, 0) == 1  # Block 0 is whole now.
        assert cache.share_computed(loop.state, 0) == 0
        loop.run()
        cache.close(loop.state)
    assert reader.tokens == alone(params, prompt, 2)


@pytest.mark.parametrize("share", [True, False])
def test_six_requests_sharing_a_prompt_on_four_slots(share, params, step):
    """All six at once: with sharing, the first computes the shared prompt and each of the
    five others maps it (waiting behind the first's chunks); without, the first four all
    compute it. Tokens equal each request alone either way."""
    rng = np.random.default_rng(7)
    prompts = [SYSTEM + rng.integers(0, CFG.vocab, 3 + i).tolist() for i in range(6)]
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK, share_prefixes=share)
        done = loop.run([serving.Request(p, 3) for p in prompts])
        stats = loop.stats()
        cache.close(loop.state)
    for c, p in zip(done, prompts):
        assert c.tokens == alone(params, p, 3), c.index
    total = sum(len(p) for p in prompts)
    assert stats["prefill_tokens"] == total - stats["cached_prompt_tokens"]
    if share:
        assert done[0].cached == 0
        assert all(c.cached == len(SYSTEM) for c in done[1:])
        assert stats["prefill_tokens"] == total - 5 * len(SYSTEM)
    else:
        assert [c.cached for c in done[:4]] == [0, 0, 0, 0]  # Admitted together.
        assert stats["prefill_tokens"] > total - 5 * len(SYSTEM) + 2 * len(SYSTEM)


def test_a_request_sharing_nothing_in_flight_takes_a_free_slot_ahead_of_one_that_waits(
    params, step
):
    other = [9] * 20
    with make_cache(batch=2) as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        first, second, third = (
            loop.submit(serving.Request(p, 2)) for p in (SYSTEM + [1], SYSTEM + [2], other)
        )
        loop.step()
        assert first.slot == 0 and second.slot is None and third.slot == 1
        loop.run()
        cache.close(loop.state)
    assert second.cached == len(SYSTEM)
    assert second.tokens == alone(params, SYSTEM + [2], 2)
    assert third.tokens == alone(params, other, 2)


def test_share_prefixes_must_be_a_bool(params, step):
    with make_cache() as cache:
        with pytest.raises(TypeError, match="share_prefixes must be a bool; got int"):
            serving.ServingLoop(cache, step, params, chunk=CHUNK, share_prefixes=1)
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK, share_prefixes=False)
        assert loop.share_prefixes is False


def test_share_computed_refuses_an_inactive_slot_changing_nothing(params, step):
    with make_cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=SYSTEM[:10], max_tokens=20)
        before = (cache.block_tables.tolist(), cache.prefix_stats, cache.free_blocks)
        with pytest.raises(ValueError, match="slot 1 is not active"):
            cache.share_computed(state, 1)
        with pytest.raises(ValueError, match=r"slot=4 must be an int in \[0, batch=4\)"):
            cache.share_computed(state, 4)
        assert (cache.block_tables.tolist(), cache.prefix_stats, cache.free_blocks) == before
        assert cache.share_computed(state, 0) == 0  # Length 0: nothing computed yet.
        cache.close(state)


class WithoutShareComputed:
    """A cache that shares blocks at release only (no share_computed)."""

    def __init__(self, cache):
        self.inner = cache

    def __getattr__(self, name):
        if name == "share_computed":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_cache_without_share_computed_is_served_in_arrival_order(params, step):
    prompt = SYSTEM + [3]
    with make_cache() as cache:
        loop = serving.ServingLoop(WithoutShareComputed(cache), step, params, chunk=CHUNK)
        assert loop.share_prefixes is False  # Holding requests back would only delay them.
        done = loop.run([serving.Request(prompt, 2), serving.Request(prompt, 2)])
        cache.close(loop.state)
    assert [c.cached for c in done] == [0, 0]  # Admitted together, each computed it.
    assert done[1].tokens == alone(params, prompt, 2)


# -- admission order ---------------------------------------------------------------------


def publish_system_prompt(loop):
    """One request of the shared prompt run to its end: its blocks are in the index."""
    loop.run([serving.Request(SYSTEM + [1], 1)])


@pytest.mark.parametrize("order", ["cached_prefix_first", "fifo"])
def test_a_free_slot_takes_the_longest_cached_prefix_first(order, params, step):
    """Two slots, three waiting: two that share nothing, then one whose prompt is cached.
    Cached-prefix-first admits the cached one and the first other (arrival order among
    the equal); fifo the first two. Tokens equal each request alone either way."""
    plain_a, plain_b, cached_prompt = [9] * 20, [10] * 20, SYSTEM + [2]
    with make_cache(batch=2) as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK, admission_order=order)
        publish_system_prompt(loop)
        a, b, c = (loop.submit(serving.Request(p, 2)) for p in (plain_a, plain_b, cached_prompt))
        assert [loop.cached_prefix_tokens(x) for x in (a, b, c)] == [0, 0, len(SYSTEM)]
        loop.step()
        if order == "fifo":
            assert (a.slot, b.slot, c.slot) == (0, 1, None)
        else:
            assert (a.slot, b.slot, c.slot) == (1, None, 0)
            assert c.cached == len(SYSTEM)
        loop.run()
        cache.close(loop.state)
    assert loop.cached_prefix_tokens(c) == 0  # Not waiting any more.
    for done, prompt in ((a, plain_a), (b, plain_b), (c, cached_prompt)):
        assert done.tokens == alone(params, prompt, 2), prompt


def test_looking_up_a_cached_prefix_pins_and_counts_nothing(params, step):
    with make_cache(batch=2) as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        publish_system_prompt(loop)
        before = (cache.prefix_stats, cache.free_blocks)
        waiting = loop.submit(serving.Request(SYSTEM + [3], 1))
        assert loop.cached_prefix_tokens(waiting) == len(SYSTEM)
        assert loop.cached_prefix_tokens(waiting) == len(SYSTEM)  # Its keys kept.
        assert (cache.prefix_stats, cache.free_blocks) == before
        loop.run()
        cache.close(loop.state)


def test_a_request_passed_over_the_skip_limit_times_goes_first(params, step):
    """One prompt that shares nothing, then more cached ones than the limit: the cached
    ones go ahead of it exactly ADMISSION_SKIP_LIMIT times, then it is admitted."""
    limit = serving.ADMISSION_SKIP_LIMIT
    ticks = iter(range(10**6))
    with make_cache(batch=2) as cache:
        loop = serving.ServingLoop(
            cache, step, params, chunk=CHUNK, clock=lambda: float(next(ticks))
        )
        publish_system_prompt(loop)
        plain = loop.submit(serving.Request([9] * 20, 1))
        cached = [loop.submit(serving.Request(SYSTEM + [20 + i], 1)) for i in range(limit + 2)]
        loop.run()
        cache.close(loop.state)
    ahead = [c for c in cached if c.admitted < plain.admitted]
    assert len(ahead) == limit
    assert ahead == cached[:limit]  # Arrival order among the equal.
    assert all(c.cached == len(SYSTEM) for c in cached)
    assert plain.tokens == alone(params, [9] * 20, 1)
    assert cached[-1].tokens == alone(params, SYSTEM + [20 + limit + 1], 1)


@pytest.mark.parametrize(
    "order, error, match",
    [
        ("lifo", ValueError, "must be one of 'cached_prefix_first', 'fifo'; got 'lifo'"),
        ("FIFO", ValueError, "admission_order must be one of .*; got 'FIFO'"),
        (None, TypeError, "admission_order must be one of .*; got None"),
    ],
)  # fmt: skip
def test_an_unknown_admission_order_is_refused_changing_nothing(order, error, match, params, step):
    with make_cache() as cache:
        with pytest.raises(error, match=match):
            serving.ServingLoop(cache, step, params, chunk=CHUNK, admission_order=order)
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK, admission_order="fifo")
        assert loop.admission_order == "fifo"
        done = loop.run([serving.Request(SYSTEM + [4], 1)])
        cache.close(loop.state)
    assert done[0].tokens == alone(params, SYSTEM + [4], 1)
