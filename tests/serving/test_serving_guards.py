"""ServingLoop's guards: a bad request or argument is refused, naming the field, before
anything changes; a request that fails only at run time ends with an error while the
others finish as if served alone.

Every bad request is submitted between two good ones, which must then generate exactly
the tokens they generate served alone; every guard is crossed at its edge (the last
accepted value is served, the first refused one is refused with its message)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync import serving
from jax_tpusync.bench import serving_model, tiny_decoder
from jax_tpusync.serving import checks

VOCAB = 64
CFG = tiny_decoder.Decoder(
    layers=2, d_model=32, q_heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=VOCAB, q_gain=2.0
)
CHUNK, BLOCK, MAX_LEN = 8, 8, 48
POOL_BLOCKS = 4  # A 32-token pool: smaller than max_len, so the pool is the binding limit.
POOL = POOL_BLOCKS * BLOCK

GOOD_A = serving.Request([3, 1, 4, 1, 5], 3)
GOOD_B = serving.Request([2, 7, 1, 8, 2, 8, 1, 8, 2], 4)  # Two prefill chunks.


def _step(params, tokens, positions, counts, state):
    def attend(layer, q, k, v, state):
        return tps.prefetching_attention(q, k, v, state, layer=layer, query_seq_lengths=counts)

    return serving_model.forward(CFG, params, tokens, positions, state, attend)


STEP = jax.jit(_step, donate_argnums=(4,))  # One for the module: compiled once per cache.


def make_cache(num_blocks=POOL_BLOCKS, batch=2):
    return tps.OffloadedKVCache(
        num_layers=CFG.layers,
        batch=batch,
        max_len=MAX_LEN,
        num_kv_heads=CFG.kv_heads,
        head_dim=CFG.head_dim,
        dtype=jnp.float32,
        block_tokens=BLOCK,
        num_blocks=num_blocks,
        staging_bytes=64 << 10,
    )


@pytest.fixture(scope="module")
def params():
    return serving_model.init_params(CFG, 0, jnp.float32)


_ALONE: dict = {}


@pytest.fixture(scope="module")
def alone(params):
    """Tokens of a request served by itself (in a loop of its own)."""

    def tokens(request: serving.Request) -> list[int]:
        key = (tuple(int(t) for t in request.prompt), int(request.max_new_tokens))
        key += (tuple(int(t) for t in request.stop_tokens),)
        if key not in _ALONE:
            with make_cache() as cache:
                loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
                (done,) = loop.run([request])
                cache.close(loop.state)
            assert done.finish_reason in ("length", "stop")
            _ALONE[key] = done.tokens
        return _ALONE[key]

    return tokens


def check_good(a, b, alone, cache):
    assert a.tokens == alone(GOOD_A) and a.finish_reason == "length"
    assert b.tokens == alone(GOOD_B) and b.finish_reason == "length"
    assert np.all(cache.capacity == 0)  # Every slot released.


def _sampler(logits, rng):
    return int(np.argmax(logits))


# (request or other object, exception, message): each is the first refused value of its guard
# where it has an edge (the last accepted one is in ACCEPTED).
REFUSED = {
    "not-a-request": ([1, 2, 3], TypeError, r"request must be a serving\.Request.*list"),
    "prompt-None": (serving.Request(None, 2), TypeError, r"prompt must be .*got None"),
    "prompt-set": (serving.Request({1, 2}, 2), TypeError, r"prompt must be a 1-D sequence .*got set"),
    "prompt-str": (serving.Request("123", 2), TypeError, r"prompt must be .*got str"),
    "prompt-int": (serving.Request(5, 2), TypeError, r"prompt must be .*got int"),
    "prompt-empty": (serving.Request([], 2), ValueError, r"prompt must hold at least one"),
    "prompt-2d": (serving.Request([[1, 2], [3, 4]], 2), ValueError, r"prompt must be 1-D"),
    "prompt-2d-array": (
        serving.Request(np.ones((2, 2), np.int32), 2),
        ValueError,
        r"prompt must be 1-D.*\(2, 2\)",
    ),
    "id-str": (serving.Request([1, "3"], 2), TypeError, r"prompt\[1\]='3' is not an int"),
    "id-float": (serving.Request([1.0, 2.0], 2), TypeError, r"prompt\[0\]=1\.0 is not an int"),
    "id-float-array": (
        serving.Request(np.array([1.0, 2.0]), 2),
        TypeError,
        r"prompt must hold int token ids.*float64",
    ),
    "id-bool": (serving.Request([True, 2], 2), TypeError, r"prompt\[0\]=True is not an int"),
    "id-negative": (
        serving.Request([1, -1, 2], 2),
        ValueError,
        r"prompt\[1\]=-1 is not a token id in \[0, vocab_size=64\)",
    ),
    "id-vocab": (
        serving.Request([1, VOCAB], 2),
        ValueError,
        r"prompt\[1\]=64 is not a token id in \[0, vocab_size=64\)",
    ),
    "id-million": (serving.Request([10**6], 2), ValueError, r"prompt\[0\]=1000000 is not"),
    "id-2**32+5": (serving.Request([1, 2**32 + 5], 2), ValueError, r"prompt\[1\]=4294967301"),
    "id-2**63": (serving.Request([2**63], 2), ValueError, r"prompt\[0\]=9223372036854775808"),
    "id-2**64": (serving.Request([1, 2**64], 2), ValueError, r"prompt\[1\]=18446744073709551616"),
    # Arrays: never cast to int32 first (2**32 + 5 would become 5).
    "id-int64-array-2**32+5": (
        serving.Request(np.array([1, 2**32 + 5], np.int64), 2),
        ValueError,
        r"prompt\[1\]=4294967301 is not a token id in \[0, vocab_size=64\)",
    ),
    "id-uint64-array-2**63": (serving.Request(np.array([2**63], np.uint64), 2), ValueError, r"prompt\[0\]=9223372036854775808"),
    "id-int8-array-negative": (serving.Request(np.array([3, -1], np.int8), 2), ValueError, r"prompt\[1\]=-1 is not"),
    "id-array-vocab": (serving.Request(np.array([0, 63, 64]), 2), ValueError, r"prompt\[2\]=64 is not"),
    "id-bool-array": (serving.Request(np.array([True, False]), 2), TypeError, r"prompt must hold int token ids; got an array of bool"),
    "id-jax-float-array": (serving.Request(jnp.array([1.0, 2.0]), 2), TypeError, r"prompt must hold int token ids; got an array of float32"),
    "id-None": (serving.Request([1, None], 2), TypeError, r"prompt\[1\]=None is not an int"),
    "id-0d-array": (serving.Request([1, np.array(5)], 2), TypeError, r"prompt\[1\]=array\(5\) is not an int"),
    "prompt-nested-array": (serving.Request([1, np.array([5])], 2), ValueError, r"prompt must be 1-D .*prompt\[1\] is a ndarray"),
    "max_new_tokens-0": (serving.Request([1], 0), ValueError, r"max_new_tokens must be an int >= 1; got 0"),
    "max_new_tokens-2.5": (serving.Request([1], 2.5), TypeError, r"max_new_tokens must be an int >= 1; got 2\.5"),
    "max_new_tokens-1.5": (serving.Request([1], 1.5), TypeError, r"max_new_tokens must be an int >= 1; got 1\.5"),
    "max_new_tokens-None": (serving.Request([1], None), TypeError, r"max_new_tokens must be an int >= 1; got None"),
    "max_new_tokens-str": (serving.Request([1], "3"), TypeError, r"max_new_tokens must be an int >= 1; got '3'"),
    "max_new_tokens-bool": (serving.Request([1], True), TypeError, r"max_new_tokens must be an int >= 1; got True"),
    # 40 tokens of KV in a 32-token pool (max_len 48 would take it).
    "larger-than-pool": (
        serving.Request(list(range(1, 37)), 5),
        ValueError,
        r"needs 40 tokens of KV \(prompt 36 \+ max_new_tokens 5 - 1\) but the pool \(4 blocks "
        r"of 8 tokens\) holds at most 32: it could never be admitted",
    ),
    "pool+1": (
        serving.Request(list(range(1, 30)), 5),
        ValueError,
        r"needs 33 tokens of KV .*at most 32",
    ),
    "sampler-int": (serving.Request([1], 2, sampler=3), TypeError, r"sampler must be None or a callable.*got int"),
    "stop_tokens-int": (
        serving.Request([1], 2, stop_tokens=5),
        TypeError,
        r"stop_tokens must be a sequence of token ids.*got int",
    ),
    "stop_tokens-str": (serving.Request([1], 2, stop_tokens="5"), TypeError, r"stop_tokens must be a sequence"),
    "stop_tokens-vocab": (
        serving.Request([1], 2, stop_tokens=(1, VOCAB)),
        ValueError,
        r"stop_tokens\[1\]=64 is not a token id in \[0, vocab_size=64\)",
    ),
    "stop_tokens-negative": (serving.Request([1], 2, stop_tokens=(-1,)), ValueError, r"stop_tokens\[0\]=-1"),
    "stop_tokens-float": (serving.Request([1], 2, stop_tokens=(2.0,)), TypeError, r"stop_tokens\[0\]=2\.0 is not an int"),
    "stop_tokens-None": (serving.Request([1], 2, stop_tokens=None), TypeError, r"stop_tokens must be a sequence .*got NoneType"),
    "seed-negative": (serving.Request([1], 2, seed=-1), ValueError, r"seed must be None, an int >= 0.*got -1"),
    "seed-str": (serving.Request([1], 2, seed="7"), TypeError, r"seed must be None, an int >= 0.*got '7'"),
    "seed-float": (serving.Request([1], 2, seed=1.5), TypeError, r"seed must be None.*got 1\.5"),
    "seed-sequence-negative": (serving.Request([1], 2, seed=(3, -1)), ValueError, r"seed must be None.*got \(3, -1\)"),
}  # fmt: skip


@pytest.mark.parametrize("bad, error, match", REFUSED.values(), ids=REFUSED.keys())
def test_a_bad_request_is_refused_between_two_good_ones(bad, error, match, params, alone):
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a = loop.submit(GOOD_A)
        with pytest.raises(error, match=match):
            loop.submit(bad)
        # Nothing changed: the good request alone is queued.
        assert [c is a for c in loop.completions] == [True] == [c is a for c in loop.waiting]
        b = loop.submit(GOOD_B)
        loop.run()
        check_good(a, b, alone, cache)
        assert [c.index for c in loop.completions] == [0, 1]
        cache.close(loop.state)


# The last accepted value of each guard above, served between the same two good requests.
ACCEPTED = {
    "ids-0-and-63": serving.Request([0, VOCAB - 1, 5], 2),
    "ids-int32-array": serving.Request(np.array([1, 2, 3], np.int32), 2),
    "ids-uint8-array": serving.Request(np.array([1, 2, 63], np.uint8), 2),
    "ids-numpy-ints": serving.Request([np.int64(1), np.int16(2)], 2),
    "ids-uint64-63": serving.Request(np.array([1, VOCAB - 1], np.uint64), 2),
    "ids-jax-int32": serving.Request(jnp.array([4, 5, 6], jnp.int32), 2),
    "ids-tuple": serving.Request((7, 8, 9), 2),
    "ids-range": serving.Request(range(10, 20), 2),
    "max_new_tokens-1": serving.Request([1, 2], 1),
    "max_new_tokens-numpy": serving.Request([1, 2], np.int32(2)),
    "stop_tokens-63-list": serving.Request([1, 2, 3], 3, stop_tokens=[0, VOCAB - 1]),
    "stop_tokens-empty-set": serving.Request([1, 2, 3], 2, stop_tokens=set()),
    "stop_tokens-array": serving.Request([1, 2, 3], 2, stop_tokens=np.array([0, VOCAB - 1])),
    "sampler-callable": serving.Request([1, 2, 3], 2, sampler=_sampler),
    "seed-0": serving.Request([1, 2], 2, seed=0),
    "seed-sequence": serving.Request([1, 2], 2, seed=(3, 0)),
}


@pytest.mark.parametrize("edge", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_last_accepted_value_is_served(edge, params, alone):
    with make_cache(num_blocks=2 * POOL_BLOCKS) as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a, c, b = (loop.submit(r) for r in (GOOD_A, edge, GOOD_B))
        loop.run()
        check_good(a, b, alone, cache)
        assert c.finish_reason in ("length", "stop") and c.error is None
        assert c.tokens == alone(edge)
        cache.close(loop.state)


@pytest.mark.parametrize(
    "prompt_len, new", [(28, 5), (32, 1), (1, 32)], ids=["28+5-1", "32+1-1", "1+32-1"]
)
def test_a_request_that_exactly_fits_the_pool_runs_between_two_good_ones(
    prompt_len, new, params, alone
):
    """32 tokens of KV in the 32-token pool (max_len 48 would take more): accepted, it
    waits for the blocks of the request before it, runs, and the one after it runs."""
    exact = serving.Request([(7 * i + 3) % VOCAB for i in range(prompt_len)], new)
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        assert loop.max_request_tokens == POOL
        a, c, b = (loop.submit(r) for r in (GOOD_A, exact, GOOD_B))
        loop.run()
        check_good(a, b, alone, cache)
        assert c.finish_reason == "length" and c.error is None
        assert c.tokens == alone(exact) and len(c.tokens) == new
        assert c.admitted >= a.finished  # The pool held both only one after the other.
        cache.close(loop.state)


def test_max_len_binds_where_the_pool_is_larger(params):
    with make_cache(num_blocks=4 * POOL_BLOCKS) as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        loop.submit(serving.Request(list(range(1, 45)), 5))  # 48 = max_len.
        with pytest.raises(ValueError, match=r"needs 49 tokens of KV .*max_len is 48"):
            loop.submit(serving.Request(list(range(1, 46)), 5))
        assert len(loop.completions) == 1
        loop.run()
        assert loop.completions[0].finish_reason == "length"
        cache.close(loop.state)


def test_two_requests_that_each_take_the_pool_run_one_after_the_other(params, alone):
    """A request the pool cannot hold beside a running one waits (it is not failed)."""
    full = serving.Request(list(range(1, 29)), 5)  # 32 tokens: the whole pool.
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        x, y = loop.run([full, full])
        assert x.tokens == y.tokens == alone(full) and y.admitted >= x.finished
        cache.close(loop.state)


# -- run-time failures: the request ends with an error, the others go on -----------------


def _raises(logits, rng):
    raise RuntimeError("sampler broke")


def _returns(value):
    def sample(logits, rng):
        return value

    return sample


@pytest.mark.parametrize(
    "sampler, match",
    [
        (_raises, r"sampler failed: RuntimeError\('sampler broke'\)"),
        (_returns(VOCAB), r"sampler returned 64, not a token id in \[0, vocab_size=64\)"),
        (_returns(-1), r"sampler returned -1, not a token id"),
        (_returns(2.5), r"sampler returned 2\.5, not a token id"),
        (_returns(None), r"sampler returned None, not a token id"),
    ],
    ids=["raises", "vocab", "negative", "float", "None"],
)
def test_a_failing_sampler_ends_its_request_only(sampler, match, params, alone):
    with make_cache(num_blocks=2 * POOL_BLOCKS) as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a = loop.submit(GOOD_A)
        bad = loop.submit(serving.Request([9, 9, 9], 4, sampler=sampler))
        b = loop.submit(GOOD_B)
        loop.run()
        check_good(a, b, alone, cache)
        assert bad.done and bad.finish_reason == "error" and bad.tokens == []
        assert bad.error is not None and re.search(match, bad.error)
        assert bad.summary()["error"] == bad.error
        cache.close(loop.state)


def test_a_sampler_that_returns_the_last_id_is_served(params):
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        (c,) = loop.run([serving.Request([9, 9, 9], 3, sampler=_returns(np.int64(VOCAB - 1)))])
        assert c.tokens == [VOCAB - 1] * 3 and c.finish_reason == "length"
        cache.close(loop.state)


class RefusingCache:
    """A cache whose admission refuses prompts starting with ``refused`` (what a cache says
    only at admission, such as a shared prefix store it cannot import from)."""

    def __init__(self, cache, refused: int):
        self.inner, self.refused = cache, refused

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def admit(self, state, slot, *, max_tokens=None, tokens=None):
        if int(tokens[0]) == self.refused:
            raise ValueError("refused for this test")
        return self.inner.admit(state, slot, max_tokens=max_tokens, tokens=tokens)


def test_an_admission_refused_with_nothing_running_ends_that_request(params, alone):
    with make_cache() as inner:
        cache = RefusingCache(inner, refused=11)
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a = loop.submit(GOOD_A)
        bad = loop.submit(serving.Request([11, 1, 2], 2))
        b = loop.submit(GOOD_B)
        loop.run()
        check_good(a, b, alone, inner)
        assert bad.finish_reason == "error" and bad.slot is None and bad.tokens == []
        assert bad.error == "admission refused: refused for this test"
        # Refused while GOOD_A ran (it waited, holding up GOOD_B), ended once nothing ran.
        assert bad.finished >= a.finished and b.admitted >= bad.finished
        assert loop.step() is False and not loop.busy
        inner.close(loop.state)


# -- the loop's own arguments --------------------------------------------------------------

# (ServingLoop keyword arguments, exception, message); first refused values of their edges.
BAD_LOOP_ARGS = {
    "cache-None": (dict(cache=None), TypeError, r"cache must be .*KVCache.*got NoneType"),
    "cache-object": (dict(cache=object()), TypeError, r"cache must be .*got object"),
    "step-None": (dict(step=None), TypeError, r"step must be a callable.*got None"),
    "step-int": (dict(step=3), TypeError, r"step must be a callable.*got 3"),
    "chunk-0": (dict(chunk=0), ValueError, r"chunk must be an int >= 1; got 0"),
    "chunk-2.5": (dict(chunk=2.5), TypeError, r"chunk must be an int >= 1; got 2\.5"),
    "chunk-str": (dict(chunk="8"), TypeError, r"chunk must be an int >= 1; got '8'"),
    "chunk-None": (dict(chunk=None), TypeError, r"chunk must be an int >= 1; got None"),
    "decode_width-0": (dict(decode_width=0), ValueError, r"decode_width must be None or an int in \[1, chunk=8\]; got 0"),
    "decode_width-chunk+1": (dict(decode_width=CHUNK + 1), ValueError, r"decode_width .*got 9"),
    "decode_width-str": (dict(decode_width="1"), TypeError, r"decode_width .*got '1'"),
    "seed-negative": (dict(seed=-1), ValueError, r"seed must be an int >= 0; got -1"),
    "seed-str": (dict(seed="0"), TypeError, r"seed must be an int >= 0; got '0'"),
    "seed-tuple": (dict(seed=(1, 2)), TypeError, r"seed must be an int >= 0; got \(1, 2\)"),
    "clock-None": (dict(clock=None), TypeError, r"clock must be a callable.*got None"),
    "vocab_size-0": (dict(vocab_size=0), ValueError, r"vocab_size must be None or an int >= 1; got 0"),
    "vocab_size-float": (dict(vocab_size=64.0), TypeError, r"vocab_size must be None or an int >= 1; got 64\.0"),
    "vocab_size-str": (dict(vocab_size="64"), TypeError, r"vocab_size .*got '64'"),
    "vocab_size-not-the-logits'": (
        dict(vocab_size=VOCAB - 1),
        ValueError,
        r"vocab_size=63 but the step's logits have 64",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kwargs, error, match", BAD_LOOP_ARGS.values(), ids=BAD_LOOP_ARGS.keys())
def test_bad_loop_arguments_are_refused(kwargs, error, match, params, alone):
    with make_cache() as cache:
        args = dict(cache=cache, step=STEP, params=params, chunk=CHUNK) | kwargs
        with pytest.raises(error, match=match):
            serving.ServingLoop(**args)
        # The cache is as it was: a loop made right after serves as usual.
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a, b = loop.run([GOOD_A, GOOD_B])
        check_good(a, b, alone, cache)
        cache.close(loop.state)


def test_edges_of_the_loop_arguments_are_accepted(params, alone):
    with make_cache() as cache:
        for kwargs in (dict(chunk=1), dict(decode_width=CHUNK), dict(decode_width=None)):
            loop = serving.ServingLoop(cache, STEP, params, **(dict(chunk=CHUNK) | kwargs))
            (a,) = loop.run([GOOD_A])
            assert a.tokens == alone(GOOD_A)
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK, seed=0, vocab_size=VOCAB)
        assert loop.vocab_size == VOCAB
        cache.close(loop.state)


def test_the_vocabulary_is_read_from_the_step_logits(params):
    traces = []

    def counting(params, tokens, positions, counts, state):
        traces.append(tokens.shape)
        return _step(params, tokens, positions, counts, state)

    step = jax.jit(counting, donate_argnums=(4,))
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, step, params, chunk=CHUNK)
        assert loop.vocab_size == VOCAB
        with pytest.raises(ValueError, match=r"prompt\[0\]=64"):
            loop.submit(serving.Request([VOCAB], 2))
        loop.run([GOOD_A])
        # Read by tracing at the prefill width: the first step reuses that trace.
        assert traces == [(2, CHUNK), (2, 1)]
        cache.close(loop.state)


def test_a_step_that_breaks_the_contract_is_refused(params):
    def no_state(params, tokens, positions, counts, state):
        return _step(params, tokens, positions, counts, state)[0]

    with make_cache() as cache:
        with pytest.raises(TypeError, match=r"step must return \(logits \[2, 8, vocab\], state\)"):
            serving.ServingLoop(cache, no_state, params, chunk=CHUNK)


# -- run() ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "requests, kwargs, error, match",
    [
        ([GOOD_A, serving.Request([1], 2.5), GOOD_B], {}, TypeError, r"requests\[1\]: max_new_tokens"),
        (GOOD_A, {}, TypeError, r"requests must be an iterable of Request; got one Request"),
        ([GOOD_A, GOOD_B], dict(arrivals=[0.0]), ValueError, r"arrivals must have one offset per request"),
        ([GOOD_A, GOOD_B], dict(arrivals=[0.0, "soon"]), TypeError, r"arrivals\[1\] must be a finite number of seconds; got 'soon'"),
        ([GOOD_A, GOOD_B], dict(arrivals=[0.0, math.nan]), ValueError, r"arrivals\[1\] must be a finite number of seconds; got nan"),
        ([GOOD_A], dict(on_finish=3), TypeError, r"on_finish must be None or a callable on_finish\(completion\); got 3"),
    ],
    ids=["bad-request", "one-request", "arrivals-length", "arrival-str", "arrival-nan", "on_finish"],
)  # fmt: skip
def test_run_refuses_before_submitting_anything(requests, kwargs, error, match, params, alone):
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        with pytest.raises(error, match=match):
            loop.run(requests, **kwargs)
        assert loop.completions == [] and not loop.busy and loop.steps == 0
        a, b = loop.run([GOOD_A, GOOD_B], arrivals=[0, 0.01])
        check_good(a, b, alone, cache)
        cache.close(loop.state)


@pytest.mark.parametrize(
    "arrival, error, match",
    [("now", TypeError, r"arrival must be None or a finite number of seconds; got 'now'"),
     (math.inf, ValueError, r"arrival must be None or a finite number of seconds; got inf")],
)  # fmt: skip
def test_submit_refuses_a_bad_arrival(arrival, error, match, params):
    with make_cache() as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        with pytest.raises(error, match=match):
            loop.submit(GOOD_A, arrival=arrival)
        assert loop.completions == []
        loop.submit(GOOD_A, arrival=0)
        cache.close(loop.state)


# -- more run-time failures and the step's contract ----------------------------------------


def test_a_sampler_that_fails_mid_request_keeps_its_tokens(params, alone):
    """The third sample raises: the request ends with its first two tokens and the error,
    its slot is released (its blocks published), and the others are as if alone."""
    calls = []

    def third_breaks(logits, rng):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("no third")
        return int(np.argmax(logits))

    prompt = [9, 8, 7, 6]
    with make_cache(num_blocks=2 * POOL_BLOCKS) as cache:
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a = loop.submit(GOOD_A)
        bad = loop.submit(serving.Request(prompt, 5, sampler=third_breaks))
        b = loop.submit(GOOD_B)
        loop.run()
        check_good(a, b, alone, cache)
        assert bad.finish_reason == "error" and bad.error == "sampler failed: ValueError('no third')"
        assert bad.tokens == alone(serving.Request(prompt, 5))[:2]
        assert loop.stats()["errors"] == 1 and loop.stats()["finished"] == 3
        cache.close(loop.state)


def test_the_step_is_traced_on_a_state_that_is_not_live(params):
    """A refused step leaves the cache's slots and states as they were: a state made
    before the refusal is still the live one."""

    def no_state(params, tokens, positions, counts, state):
        return _step(params, tokens, positions, counts, state)[0]

    with make_cache() as cache:
        live = cache.init(admit=False)
        with pytest.raises(TypeError, match=r"step must return"):
            serving.ServingLoop(cache, no_state, params, chunk=CHUNK)
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK, state=live)
        (a,) = loop.run([GOOD_A])
        assert a.finish_reason == "length"
        cache.close(loop.state)


def _int_logits(params, tokens, positions, counts, state):
    logits, state = _step(params, tokens, positions, counts, state)
    return logits.astype(jnp.int32), state


def _wrong_width(params, tokens, positions, counts, state):
    logits, state = _step(params, tokens, positions, counts, state)
    return logits[:, :1], state


def _raises_in_trace(params, tokens, positions, counts, state):
    raise KeyError("embed")


def _other_state(params, tokens, positions, counts, state):
    logits, _ = _step(params, tokens, positions, counts, state)
    return logits, None


@pytest.mark.parametrize(
    "step, match",
    [
        (_int_logits, r"step must return \(logits \[2, 8, vocab\], state\) with float logits; "
                      r"its logits are int32\[2, 8, 64\]"),
        (_wrong_width, r"with float logits; its logits are float32\[2, 1, 64\]"),
        (_raises_in_trace, r"step\(params, tokens int32\[2, 8\], positions, counts int32\[2\], "
                           r"state\) failed when traced .*KeyError: 'embed'"),
        (_other_state, r"its state \(NoneType\) is not of the structure of the state it was given"),
    ],
    ids=["int-logits", "wrong-width", "raises", "no-state"],
)  # fmt: skip
def test_a_step_that_breaks_its_contract_is_refused_by_name(step, match, params, alone):
    with make_cache() as cache:
        with pytest.raises(TypeError, match=match):
            serving.ServingLoop(cache, jax.jit(step), params, chunk=CHUNK)
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK)
        a, b = loop.run([GOOD_A, GOOD_B])
        check_good(a, b, alone, cache)
        cache.close(loop.state)


def test_a_cache_with_an_active_slot_is_refused(params):
    with make_cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, max_tokens=8)
        with pytest.raises(ValueError, match=r"every slot of the cache must be inactive .*active: \[1\]"):
            serving.ServingLoop(cache, STEP, params, chunk=CHUNK, state=state)
        state = cache.release(state, 1)
        loop = serving.ServingLoop(cache, STEP, params, chunk=CHUNK, state=state)  # The edge.
        (a,) = loop.run([GOOD_A])
        assert a.finish_reason == "length"
        cache.close(loop.state)


def test_a_state_of_the_wrong_kind_is_refused(params):
    with make_cache() as cache:
        with pytest.raises(TypeError, match=r"state must be None or the cache's live state .*got dict"):
            serving.ServingLoop(cache, STEP, params, chunk=CHUNK, state={})
        cache.close()


# -- the limit a slot can ever get, for caches of other kinds -------------------------------


def test_a_sliding_window_slot_is_limited_by_its_ring_not_the_context():
    """A slot that keeps only its window holds its ring's blocks whatever its length: a
    pool smaller than max_len holds a max_len request; a pool smaller than the ring
    limits it to what its blocks hold."""
    common = dict(
        num_layers=CFG.layers, batch=2, max_len=MAX_LEN, num_kv_heads=CFG.kv_heads,
        head_dim=CFG.head_dim, dtype=jnp.float32, block_tokens=BLOCK,
        staging_bytes=64 << 10, sliding_window=8, max_step_tokens=CHUNK,
    )  # fmt: skip
    with tps.OffloadedKVCache(num_blocks=3, **common) as cache:  # The ring: 3 blocks.
        assert checks.slot_limit(cache) == (MAX_LEN, "the cache's max_len is 48")
        cache.close()
    with tps.OffloadedKVCache(num_blocks=2, **common) as cache:
        assert checks.slot_limit(cache) == (16, "the pool (2 blocks of 8 tokens) holds at most 16")
        cache.close()


def test_a_mesh_cache_is_limited_by_one_shards_pool():
    from jax.sharding import Mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (tests/conftest.py makes four CPU devices)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    cache = tps.ShardedKVCache(
        mesh=mesh, kv_heads_axis="model", num_layers=CFG.layers, batch=2, max_len=MAX_LEN,
        num_kv_heads=CFG.kv_heads, head_dim=CFG.head_dim, dtype=jnp.float32,
        block_tokens=BLOCK, num_blocks=3, staging_bytes=64 << 10,
    )  # fmt: skip
    try:
        assert checks.slot_limit(cache) == (
            24,
            "the pool of shard 0 (3 blocks of 8 tokens) holds at most 24",
        )
    finally:
        cache.close()


def test_a_hybrid_cache_sizes_its_groups_pools_for_max_len():
    """A hybrid cache gives each layer group a pool for every slot at max_len (a sliding
    group: its rings): max_len binds, the groups' pools never refuse a request."""
    cache = tps.HybridKVCache(
        num_layers=2, batch=2, max_len=MAX_LEN, block_tokens=BLOCK, dtype=jnp.float32,
        num_kv_heads=[2, 2], head_dim=[8, 8], sliding_window=[8, None], max_step_tokens=CHUNK,
        staging_bytes=64 << 10,
    )  # fmt: skip
    try:
        assert checks.slot_limit(cache) == (MAX_LEN, "the cache's max_len is 48")
        assert [t.num_blocks for t, _ in checks.slot_tables(cache)] == [
            g.slots.num_blocks for g in cache.groups
        ]
    finally:
        cache.close()
