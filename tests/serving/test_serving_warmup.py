"""ServingLoop.warmup(): every step shape the loop calls is compiled before the first
request, so that no request's step compiles anything; the warm-up's seconds are reported
apart from the steps'."""

from __future__ import annotations

import logging

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
CHUNK, BLOCK, MAX_LEN = 8, 8, 48
REQUEST = serving.Request(list(range(1, 12)), 4)  # Two prefill chunks, then decode.


def make_step():
    """A step of its own per test: its executables start empty whatever ran before."""

    def step(params, tokens, positions, counts, state):
        def attend(layer, q, k, v, state):
            return tps.prefetching_attention(q, k, v, state, layer=layer, query_seq_lengths=counts)

        return serving_model.forward(CFG, params, tokens, positions, state, attend)

    return jax.jit(step, donate_argnums=(4,))


def make_cache():
    return tps.OffloadedKVCache(
        num_layers=CFG.layers,
        batch=2,
        max_len=MAX_LEN,
        num_kv_heads=CFG.kv_heads,
        head_dim=CFG.head_dim,
        dtype=jnp.float32,
        block_tokens=BLOCK,
        num_blocks=12,
        staging_bytes=64 << 10,
    )


@pytest.fixture(scope="module")
def params():
    return serving_model.init_params(CFG, 0, jnp.float32)


class Compiles(logging.Handler):
    """The names JAX logs as compiled (``jax.log_compiles``) while attached."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of "):
            self.names.append(message.removeprefix("Finished XLA compilation of ").split(" in ")[0])


def serve_counting_compiles(loop: serving.ServingLoop) -> tuple[list[int], list[str]]:
    """Runs REQUEST; returns its tokens and what JAX compiled meanwhile."""
    handler = Compiles()
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            (done,) = loop.run([REQUEST])
    finally:
        jax_logger.removeHandler(handler)
    assert done.finish_reason == "length"
    return done.tokens, handler.names


def warm_the_cache_admission(cache) -> None:
    """The cache's own host calls (admit, release) compile small copies once per process:
    done here, so that what the test counts is the loop's and the step's."""
    state = cache.init(admit=False)
    state, _ = cache.admit(state, 0, max_tokens=MAX_LEN, tokens=[1, 2])
    cache.release(state, 0)


@pytest.mark.parametrize("decode_width, widths", [(1, [1, CHUNK]), (None, [CHUNK])])
def test_after_warmup_no_request_step_compiles(decode_width, widths, params):
    step = make_step()
    with make_cache() as cache:
        warm_the_cache_admission(cache)
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK, decode_width=decode_width)
        assert step._cache_size() == 0  # Traced at construction, not compiled.
        seconds = loop.warmup()
        assert sorted(seconds) == widths and all(s > 0 for s in seconds.values())
        assert step._cache_size() == len(widths)
        tokens, compiled = serve_counting_compiles(loop)
        assert compiled == []
        assert step._cache_size() == len(widths)
        stats = loop.stats()
        assert stats["warmup_seconds_by_width"] == seconds and stats["compiled_in_steps"] == []
        assert set(stats["steps_by_width"]) == set(widths)  # The warm-up runs are not steps.
        assert stats["steps"] == sum(stats["steps_by_width"].values())
        # A second warm-up runs nothing: the widths are compiled.
        assert loop.warmup() == seconds and step._cache_size() == len(widths)
        cache.close(loop.state)
    want = serving_model.reference_generate(CFG, params, REQUEST.prompt, 4, pad_to=MAX_LEN)
    assert tokens == want


def test_without_warmup_the_first_steps_compile(params):
    """The same request with no warm-up: its steps compile the step at both widths (and
    the loop's row-taking functions), and stats say which steps held a compile."""
    step = make_step()
    with make_cache() as cache:
        warm_the_cache_admission(cache)
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        tokens, compiled = serve_counting_compiles(loop)
        assert sum("step" in name for name in compiled) == 2, compiled
        assert loop.stats()["compiled_in_steps"] == [1, CHUNK]
        assert loop.stats()["warmup_seconds_by_width"] == {}
        # Warming up afterwards runs nothing: both widths ran already.
        assert loop.warmup() == {} and step._cache_size() == 2
        cache.close(loop.state)


def test_a_warmup_in_the_middle_of_a_prompt_changes_nothing(params):
    """A warm-up while a slot is half-way through its prompt (its run takes no token for
    it: every count 0) leaves the slot's length and ids as they were, and the request
    generates what a model without cache generates."""
    step = make_step()
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        done = loop.submit(REQUEST)
        assert loop.step() and done.tokens == []  # The first chunk of the prompt.
        assert int(np.asarray(loop.state.lengths)[done.slot]) == CHUNK
        assert list(loop.warmup()) == [1]  # The chunk width ran already.
        assert int(np.asarray(loop.state.lengths)[done.slot]) == CHUNK
        assert list(cache.tokens(done.slot)) == REQUEST.prompt
        loop.run()
        assert loop.stats()["compiled_in_steps"] == [CHUNK]
        cache.close(loop.state)
    want = serving_model.reference_generate(CFG, params, REQUEST.prompt, 4, pad_to=MAX_LEN)
    assert done.tokens == want


def test_a_step_compiled_by_an_earlier_loop_is_not_counted_as_compiled(params):
    """A second loop over the same step (compiled by the first loop's steps) compiles
    nothing in its steps, and its stats say so."""
    step = make_step()
    with make_cache() as cache:
        warm_the_cache_admission(cache)
        first = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        first.run([REQUEST])
        assert first.stats()["compiled_in_steps"] == [1, CHUNK]
        cache.close(first.state)
    with make_cache() as cache:
        warm_the_cache_admission(cache)
        second = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        tokens, compiled = serve_counting_compiles(second)
        assert compiled == [] and step._cache_size() == 2
        assert second.stats()["compiled_in_steps"] == []
        assert second.stats()["warmup_seconds_by_width"] == {}
        cache.close(second.state)
    want = serving_model.reference_generate(CFG, params, REQUEST.prompt, 4, pad_to=MAX_LEN)
    assert tokens == want
