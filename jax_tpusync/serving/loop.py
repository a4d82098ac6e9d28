"""Continuous batching over an :class:`~jax_tpusync.OffloadedKVCache`: requests join and
leave between steps, one compiled step serves prefill and decode together.

The model stays the caller's own jitted function; :class:`ServingLoop` only drives it. The
contract of that function (the *step*)::

    step(params, tokens, positions, counts, state) -> (logits, state)

* ``tokens`` int32[batch, T]: each slot's input ids for this step, padded with 0;
* ``positions`` int32[batch, T]: ``state.positions(T)``, each row's position (RoPE);
* ``counts`` int32[batch]: how many of the slot's T rows are real, passed on as every
  layer's ``query_seq_lengths=`` of :func:`~jax_tpusync.prefetching_attention` (0: the slot
  takes nothing this step; rows past the count are padding: never written, never keys);
* ``state`` the cache's :class:`~jax_tpusync.KVState` (donate it);
* returns ``logits`` [batch, T, vocab] (row ``i`` of slot ``b``: the next-token logits after
  its ``i``-th input) and the new state.

T takes two values only, fixed when the loop is made: ``chunk`` while some slot is
prefilling (a prompt is fed ``chunk`` tokens a step, other slots decode one token in the
same step), and ``decode_width`` (default 1) when every slot decodes. A prompt of any
length is padded to the chunk bucket, so no prompt length compiles a new step.

Per request: admission with prefix reuse (``cache.admit(tokens=prompt)``; only
``prompt[cached:]`` is prefilled), sampling on the host (greedy, or the request's
``sampler(logits [vocab], numpy Generator) -> id``), release when it finishes
(``cache.release``: its full blocks are published under its token ids for later prompts),
and times: arrival, admission, first token, finish.

Prefix sharing (``share_prefixes=True``, the default): after each step, every block a
prompt chunk filled is indexed at once (``cache.share_computed``), so a request admitted a
step later maps it; and a waiting request whose prompt shares whole blocks with a prompt
still being prefilled is not admitted until that prefill has computed them (it would
compute them a second time): it waits behind the running prompt's chunks while requests
after it that share nothing in flight take the free slots. Each request's tokens are
those it would get alone. With False, blocks are shared at release only.

Admission order (``admission_order``): when a slot is free and several waiting requests
could take it, ``"cached_prefix_first"`` (the default) admits first the one whose prompt
has the longest prefix in the cache's prefix index now (whole blocks it would map, looked
up without pinning anything; under ``share_prefixes`` that includes the blocks a running
prefill has computed so far, and a request whose prefix is still being computed waits
behind it as above), in arrival order among equals: its prefill is shortest, and its
cached blocks are used before they can be evicted. No request starves: each time a request
admitted later than it is chosen ahead of it by this rule, a waiting request counts one
skip, and one skipped :data:`ADMISSION_SKIP_LIMIT` times goes before every request that was
not (in arrival order among those). ``"fifo"``: arrival order. Only the local index counts:
a prefix held in a remote level (``remote_prefix=``) or in a sliding-window ring is not
looked up beforehand. The order changes when requests run, never their tokens.

Token history: a slot's recorded ids (``cache.tokens(slot)``) are its prompt plus every
token fed back as an input (``cache.extend_tokens`` when fed). The cache therefore holds the
KV of the prompt and of every decode input, but not of the last sampled token, which is
never fed: a request of ``max_new_tokens`` tokens needs ``len(prompt) + max_new_tokens - 1``
tokens of capacity.

Guards: :meth:`ServingLoop.submit` checks every field of a request (ids are ints in
``[0, vocab_size)``, never truncated; the request must fit what the cache can ever give one
slot) and refuses a bad one with a ``TypeError`` / ``ValueError`` naming the field, queueing
nothing (:mod:`jax_tpusync.serving.checks`). What can still fail for one request at run
time (its sampler raises or returns no token id; its admission is refused with nothing
else running) ends that request only: ``finish_reason == "error"`` and ``error`` says why;
the others go on. A failure of the step itself concerns every slot and is raised.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core.config import is_int
from jax_tpusync.serving import checks, compiles

logger = logging.getLogger(__name__)

__all__ = [
    "ADMISSION_ORDERS",
    "ADMISSION_SKIP_LIMIT",
    "Completion",
    "Request",
    "Sampler",
    "ServingLoop",
    "greedy",
]

# What ServingLoop(admission_order=...) accepts.
ADMISSION_ORDERS = ("cached_prefix_first", "fifo")
# Times a waiting request may be passed over by the cached-prefix order (a request admitted
# later chosen ahead of it) before it goes first: a bound on its extra wait, small enough
# that a prompt nobody shares is admitted within a few admissions under a stream of cached
# ones, large enough that a burst of cached requests is not split by it.
ADMISSION_SKIP_LIMIT = 4

# sampler(logits f32[vocab], rng) -> token id.
Sampler = Callable[[np.ndarray, np.random.Generator], int]


def greedy(logits: np.ndarray, rng: np.random.Generator) -> int:
    """The most likely token (the default sampler; ``rng`` unused)."""
    del rng
    return int(np.argmax(logits))


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request (checked by :meth:`ServingLoop.submit`, not here).

    Attributes:
      prompt: the prompt's token ids (at least one): a 1-D sequence of ints or a 1-D
        integer array, each in ``[0, vocab_size)``.
      max_new_tokens: tokens to generate (an int >= 1), fewer if a stop token comes.
      sampler: ``sampler(logits f32[vocab], rng) -> id``; None: :func:`greedy`.
      stop_tokens: ids that end the request once sampled (kept in its output).
      seed: seeds the request's ``numpy.random.Generator`` (default: the loop's seed and the
        request's index), so its samples do not depend on what it is batched with.
    """

    prompt: Sequence[int] | np.ndarray
    max_new_tokens: int
    sampler: Sampler | None = None
    stop_tokens: tuple[int, ...] = ()
    seed: int | None = None


@dataclasses.dataclass
class Completion:
    """A submitted request's progress and result; times are the loop's clock (seconds).

    ``tokens``: the ids generated so far; ``cached``: prompt tokens whose KV the prefix
    index already held (not prefilled); ``slot``: where it ran (None before admission).
    ``finish_reason``: "length", "stop", or "error" for a request that failed on its own
    (its sampler raised or returned no token id, or its admission was refused with nothing
    else running): ``error`` says why, ``tokens`` holds what it generated before.
    """

    index: int
    request: Request
    arrival: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    cached: int = 0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None  # "length", "stop" or "error"
    error: str | None = None  # Why a request ended with finish_reason "error".

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds per generated token after the first (None with fewer than two)."""
        if self.finished is None or len(self.tokens) < 2:
            return None
        return (self.finished - self.first_token) / (len(self.tokens) - 1)

    def summary(self) -> dict[str, Any]:
        """JSON-ready fields: ids, counts and times."""
        return dict(
            index=self.index,
            prompt_tokens=len(self.request.prompt),
            cached_tokens=self.cached,
            tokens=list(self.tokens),
            finish_reason=self.finish_reason,
            queue_s=None if self.admitted is None else self.admitted - self.arrival,
            ttft_s=self.ttft,
            time_per_output_token_s=self.time_per_output_token,
            error=self.error,
        )


@dataclasses.dataclass
class _Active:
    completion: Completion
    checked: checks.CheckedRequest
    rng: np.random.Generator
    pending: np.ndarray  # Prompt ids still to prefill.
    next_input: int | None = None  # The last sampled id, fed by the next step.


@jax.jit
def _rows_at(logits: jax.Array, index: jax.Array) -> jax.Array:
    """logits [B, T, V], index int32[B] -> [B, V]: each slot's row ``index[b]``."""
    return jnp.take_along_axis(logits, index[:, None, None], axis=1)[:, 0]


class ServingLoop:
    """Drives a step function over a cache's slots with continuous batching.

    Args:
      cache: an :class:`~jax_tpusync.OffloadedKVCache` (or a sharded or hybrid cache) whose
        slots are all inactive (a fresh cache; ``cache.init(admit=False)`` makes the first
        state unless ``state`` is given).
      step: the jitted step (see the module's docstring for its contract).
      params: passed through as the step's first argument.
      chunk: prompt tokens fed per slot and step while prefilling (the prefill bucket), an
        int >= 1.
      decode_width: T of steps in which no slot prefills (default 1), an int in
        ``[1, chunk]``; None: every step has T = ``chunk`` (one compiled step in all, each
        decode step computing ``chunk`` rows per slot).
      state: the cache's live state to start from (every slot inactive).
      seed: the default seed of the requests' samplers, an int >= 0.
      clock: seconds, for the request times.
      vocab_size: the model's vocabulary: token ids (prompts, stop tokens, sampled ids)
        must be in ``[0, vocab_size)``. None: read from the step's logits.
      share_prefixes: share prompt blocks as soon as a step computed them, and hold back
        a request whose prompt a running prefill is computing (see the module); False (or
        a cache without ``share_computed``): blocks are shared at release only. The
        attribute of that name says which applies.
      admission_order: which waiting request a free slot takes: ``"cached_prefix_first"``
        (default: the longest prefix in the cache's prefix index first, arrival order among
        equals, a request passed over :data:`ADMISSION_SKIP_LIMIT` times first; see the
        module) or ``"fifo"`` (arrival order).

    The step is traced once here (``jax.eval_shape`` at the prefill width: no compile, and
    its first real call reuses the trace) to check its contract and read the vocabulary
    from its logits. :meth:`warmup` compiles it.

    Between steps, finished requests release their slots and waiting ones are admitted in
    ``admission_order`` (when the request chosen is refused for want of blocks, admission
    stops until running requests free some; one refused with nothing else running ends
    with an error), but for a request that waits behind a running prefill of its prefix
    (``share_prefixes``).

    Raises:
      TypeError, ValueError: an argument of the wrong kind or out of range (the message
        names it); a step that fails when traced with the loop's inputs or does not return
        ``(logits [batch, chunk, vocab], state)``; a ``vocab_size`` other than the
        logits'. A refused loop changes nothing (the step is traced on the cache's
        ``inert_state()``, or on the ``state`` given, which stays live).
    """

    def __init__(
        self,
        cache: Any,
        step: Callable,
        params: Any,
        *,
        chunk: int = 256,
        decode_width: int | None = 1,
        state: Any = None,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        vocab_size: int | None = None,
        share_prefixes: bool = True,
        admission_order: str = "cached_prefix_first",
    ):
        checks.check_cache(cache)
        if not isinstance(share_prefixes, (bool, np.bool_)):
            raise TypeError(f"share_prefixes must be a bool; got {type(share_prefixes).__name__}")
        checks.check_choice("admission_order", admission_order, ADMISSION_ORDERS)
        checks.check_callable("step", step, "step(params, tokens, positions, counts, state)")
        chunk = checks.check_int("chunk", chunk, 1)
        if decode_width is not None:
            if not is_int(decode_width) or not 1 <= decode_width <= chunk:
                raise (ValueError if is_int(decode_width) else TypeError)(
                    f"decode_width must be None or an int in [1, chunk={chunk}]; "
                    f"got {decode_width!r}"
                )
            decode_width = int(decode_width)
        seed = checks.check_int("seed", seed, 0)
        checks.check_callable("clock", clock, "clock() -> seconds")
        if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
            raise (ValueError if is_int(vocab_size) else TypeError)(
                f"vocab_size must be None or an int >= 1; got {vocab_size!r}"
            )
        if state is not None and not callable(getattr(state, "positions", None)):
            raise TypeError(
                "state must be None or the cache's live state (every slot inactive); "
                f"got {type(state).__name__}"
            )
        if np.any(np.asarray(cache.capacity) != 0):
            raise ValueError(
                "every slot of the cache must be inactive (a fresh cache, or one whose "
                "slots were released); active: "
                f"{np.flatnonzero(np.asarray(cache.capacity)).tolist()}"
            )
        self.batch = int(cache.batch)
        self.max_len = int(cache.max_len)
        # Traced on a state that is not live (a given state is not consumed), so that a
        # refused step or vocab_size leaves the cache as it was.
        live = state is not None or not hasattr(cache, "inert_state")
        if state is None and live:
            state = cache.init(admit=False)  # A cache with no inert state: traced on this.
        traced_vocab = _check_step(
            step, params, self.batch, chunk, state if live else cache.inert_state()
        )
        if vocab_size is not None and vocab_size != traced_vocab:
            raise ValueError(
                f"vocab_size={vocab_size} but the step's logits have {traced_vocab} entries "
                "per row"
            )
        if state is None:
            state = cache.init(admit=False)
        self.vocab_size = traced_vocab
        self.cache, self.step_fn, self.params = cache, step, params
        self.chunk, self.decode_width = chunk, decode_width or chunk
        self.seed, self.clock = seed, clock
        # A cache without share_computed shares blocks at release only: holding a request
        # behind a running prefill would then only delay it.
        self.share_prefixes = bool(share_prefixes) and hasattr(cache, "share_computed")
        # Tokens of the largest block of any part of the cache: the unit a prefix is
        # shared in (a prefix shorter than a whole block of every part is not mapped).
        self._share_unit = max(
            (int(table.block_tokens) for table, _ in checks.slot_tables(cache)), default=1
        )
        self.admission_order = admission_order
        # The parts whose prefix index a waiting prompt is looked up in (a ring's window
        # copies are not: see the module), and each waiting prompt's block keys in each,
        # computed once.
        self._prefix_tables = [
            table
            for table, _ in checks.slot_tables(cache)
            if callable(getattr(getattr(table, "prefix", None), "peek", None))
            and not getattr(table, "ring_blocks", 0)
        ]
        self._prefix_keys: dict[int, list[list[bytes]]] = {}
        self._skips: dict[int, int] = {}  # Of the waiting requests: times passed over.
        self.prefill_tokens = 0  # Prompt tokens the steps computed (not mapped from a cache).
        self.state = state
        # The most tokens of KV one request may need, and what sets it.
        self.max_request_tokens, self._limit_reason = checks.slot_limit(cache)
        self.waiting: collections.deque[Completion] = collections.deque()
        self._checked: dict[int, checks.CheckedRequest] = {}  # Of the waiting requests.
        self.slots: list[_Active | None] = [None] * self.batch
        self.completions: list[Completion] = []
        self.steps = 0
        self.step_widths: collections.Counter[int] = collections.Counter()
        self.step_seconds = 0.0
        # Seconds of each width's first call made by warmup() (compile included), and the
        # widths of the requests' steps that compiled something (their time holds it).
        self.warmup_seconds: dict[int, float] = {}
        self.compiled_in_steps: set[int] = set()

    # -- requests -----------------------------------------------------------------------

    def check(self, request: Request) -> checks.CheckedRequest:
        """Checks every field of ``request`` as :meth:`submit` does; queues nothing.

        Raises:
          TypeError, ValueError: naming the field and its value (ids must be ints in
            ``[0, vocab_size)``; a prompt 1-D and non-empty; ``max_new_tokens`` an int
            >= 1; ``stop_tokens`` a sequence of ids; ``sampler`` None or a callable;
            ``seed`` None, an int >= 0 or a sequence of them), or a request that needs
            more tokens of KV (``len(prompt) + max_new_tokens - 1``) than the cache can
            ever give one slot (:attr:`max_request_tokens`: its ``max_len``, or its pool).
        """
        if not isinstance(request, Request):
            raise TypeError(f"request must be a serving.Request; got {type(request).__name__}")
        return checks.check_request(
            request, self.vocab_size, (self.max_request_tokens, self._limit_reason)
        )

    def submit(self, request: Request, *, arrival: float | None = None) -> Completion:
        """Queues ``request``; returns its :class:`Completion` (filled in as it runs).

        ``arrival``: when it arrived on the loop's clock (default now), for its TTFT.

        Raises:
          TypeError, ValueError: a bad request (see :meth:`check`) or arrival; nothing
            is queued.
        """
        checked = self.check(request)
        if arrival is not None:
            arrival = checks.check_arrival("arrival", arrival, optional=True)
        return self._enqueue(request, checked, arrival)

    def _enqueue(
        self, request: Request, checked: checks.CheckedRequest, arrival: float | None
    ) -> Completion:
        done = Completion(
            len(self.completions), request, self.clock() if arrival is None else arrival
        )
        self.completions.append(done)
        self.waiting.append(done)
        self._checked[done.index] = checked
        return done

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def _fail(self, done: Completion, error: str, now: float | None = None) -> None:
        """Ends one request with ``error``; the others go on."""
        done.finished = self.clock() if now is None else now
        done.finish_reason, done.error = "error", error
        logger.warning("request %d ended with an error: %s", done.index, error)

    def _waits_for_prefill(self, prompt: np.ndarray) -> bool:
        """Whether a running prompt's prefill is still computing whole blocks of
        ``prompt``'s mappable prefix (all but its last token) that it has not computed yet:
        admitted now, ``prompt`` would compute them too; a step later it maps them."""
        unit = self._share_unit
        for s in self.slots:
            if s is None or not s.pending.size:
                continue
            running = s.checked.prompt
            n = min(len(prompt) - 1, len(running))
            differ = np.flatnonzero(prompt[:n] != running[:n])
            common = int(differ[0]) if differ.size else n
            computed = len(running) - s.pending.size
            if common // unit > computed // unit:
                return True
        return False

    def cached_prefix_tokens(self, completion: Completion) -> int:
        """Prompt tokens of a waiting request that admitting it now would map from the
        cache's prefix index (whole blocks, at most all but its last token; the fewest
        over the cache's parts); nothing is pinned. 0 for a request not waiting, or a cache
        whose parts all keep sliding-window rings."""
        checked = self._checked.get(completion.index)
        if checked is None or not self._prefix_tables:
            return 0
        prompt = checked.prompt.astype(np.int64)
        keys = self._prefix_keys.get(completion.index)
        if keys is None:
            keys = [table.prefix.keys(prompt) for table in self._prefix_tables]
            self._prefix_keys[completion.index] = keys
        return min(
            len(table.prefix.peek(prompt, (len(prompt) - 1) // table.block_tokens, k))
            * int(table.block_tokens)
            for table, k in zip(self._prefix_tables, keys)
        )

    def _next_to_admit(self) -> tuple[int | None, list[int]]:
        """``(position in waiting of the request a free slot takes now, or None where all
        wait behind running prefills; the indices of the requests it passes over)``."""
        candidates = (
            i
            for i, done in enumerate(self.waiting)
            if not (
                self.share_prefixes
                and self._waits_for_prefill(self._checked[done.index].prompt)
            )
        )
        if self.admission_order == "fifo":
            return next(candidates, None), []
        candidates = list(candidates)
        if len(candidates) <= 1:
            return (candidates[0] if candidates else None), []

        def rank(i: int) -> tuple[int, int, int]:
            done = self.waiting[i]
            if self._skips.get(done.index, 0) >= ADMISSION_SKIP_LIMIT:
                return (0, 0, i)  # Passed over enough: first, in arrival order.
            return (1, -self.cached_prefix_tokens(done), i)

        chosen = min(candidates, key=rank)
        return chosen, [self.waiting[i].index for i in candidates if i < chosen]

    def _forget_waiting(self, done: Completion) -> None:
        del self._checked[done.index]
        self._prefix_keys.pop(done.index, None)
        self._skips.pop(done.index, None)

    def _admit_waiting(self) -> None:
        while self.waiting:
            free = [b for b, s in enumerate(self.slots) if s is None]
            if not free:
                return
            at, passed_over = self._next_to_admit()
            if at is None:
                return
            done = self.waiting[at]
            req, checked = done.request, self._checked[done.index]
            try:
                self.state, cached = self.cache.admit(
                    self.state,
                    free[0],
                    tokens=checked.prompt.astype(np.int64),
                    max_tokens=checked.need,
                )
            except ValueError as e:
                if any(s is not None for s in self.slots):
                    return  # Blocks come back as running requests finish.
                # Refused with nothing else running: waiting would not change it.
                del self.waiting[at]
                self._forget_waiting(done)
                self._fail(done, f"admission refused: {e}")
                continue
            del self.waiting[at]
            self._forget_waiting(done)
            for index in passed_over:
                self._skips[index] = self._skips.get(index, 0) + 1
            seed = req.seed if req.seed is not None else (self.seed, done.index)
            done.slot, done.cached, done.admitted = free[0], int(cached), self.clock()
            self.prefill_tokens += len(checked.prompt) - int(cached)
            self.slots[free[0]] = _Active(
                done, checked, np.random.default_rng(seed), checked.prompt[cached:]
            )

    def _release(self, b: int) -> None:
        # Publishes the slot's full blocks under its recorded ids (prompt + fed tokens).
        self.state = self.cache.release(self.state, b)
        self.slots[b] = None

    def _sample(self, active: _Active, logits: np.ndarray) -> tuple[int | None, str | None]:
        """``(token, None)``, or ``(None, why)`` when the request's sampler fails."""
        sampler = active.completion.request.sampler or greedy
        try:
            token = sampler(logits, active.rng)
        except Exception as e:  # noqa: BLE001 - the request's own code: it alone ends.
            return None, f"sampler failed: {e!r}"
        if not is_int(token) or not 0 <= token < self.vocab_size:
            return None, f"sampler returned {token!r}, {checks.token_id_error(self.vocab_size)}"
        return int(token), None

    # -- the loop -----------------------------------------------------------------------

    def _run_step(self, tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Runs the step once; returns each slot's logits row ``counts[b] - 1``.

        tokens int32[batch, T], counts int32[batch] -> f32[batch, vocab] on the host.
        """
        width = tokens.shape[1]
        positions = self.state.positions(width)
        logits, self.state = self.step_fn(
            self.params, jnp.asarray(tokens), positions, jnp.asarray(counts), self.state
        )
        if width > 1:
            logits = _rows_at(logits, jnp.asarray(np.maximum(counts - 1, 0)))
        else:
            logits = logits[:, 0]
        return np.asarray(logits)  # Waits for the step.

    def warmup(self) -> dict[int, float]:
        """Compiles every step the loop will run, before the first request, so that the
        requests' TTFT and time per output token hold no compile.

        Runs the step once at each width the loop calls it with (``chunk``, and
        ``decode_width``) with every count 0 (no slot takes a token, nothing is written,
        the slots stay as they are), which also compiles the loop's own small functions
        (taking each slot's logits row). A width already run (by an earlier warm-up or a
        request's step) is not run again.

        Returns:
          ``{width: seconds}`` of each warm-up run (its compile, and one step that takes
          nothing), also in :meth:`stats` as ``warmup_seconds_by_width``, apart from the
          requests' steps.
        """
        for width in sorted({self.chunk, self.decode_width}, reverse=True):
            if width in self.warmup_seconds or width in self.step_widths:
                continue  # Compiled already.
            t0 = self.clock()
            self._run_step(
                np.zeros((self.batch, width), np.int32), np.zeros(self.batch, np.int32)
            )
            self.warmup_seconds[width] = self.clock() - t0
            logger.info("serving loop warm-up: T=%d in %.3f s", width, self.warmup_seconds[width])
        return dict(self.warmup_seconds)

    def step(self) -> bool:
        """Admits what it can, runs one step over the running requests, samples, releases
        the finished ones. Returns False if nothing was running (no step ran).

        A request whose sampler fails ends with ``finish_reason == "error"`` (its slot
        released); an exception of the step itself concerns every slot and is raised.
        """
        self._admit_waiting()
        active = [(b, s) for b, s in enumerate(self.slots) if s is not None]
        if not active:
            return False
        prefilling = any(s.pending.size for _, s in active)
        prompt_slots = [b for b, s in active if s.pending.size]
        width = self.chunk if prefilling else self.decode_width
        tokens = np.zeros((self.batch, width), np.int32)
        counts = np.zeros(self.batch, np.int32)
        for b, s in active:
            if s.pending.size:
                n = min(width, s.pending.size)
                tokens[b, :n], s.pending = s.pending[:n], s.pending[n:]
                counts[b] = n
            else:
                tokens[b, 0], counts[b] = s.next_input, 1
                # Recorded when fed: the slot's ids stay those of the KV it holds.
                self.cache.extend_tokens(b, [s.next_input])
        t0 = self.clock()
        # Counted, not inferred from the width's history in this loop: a step compiled by an
        # earlier loop (or anything else in this process) compiles nothing here.
        with compiles.counting_compiles() as compiled:
            logits = self._run_step(tokens, counts)
        now = self.clock()
        if compiled.compiled:
            self.compiled_in_steps.add(width)  # This step's time holds a compile.
        self.steps += 1
        self.step_widths[width] += 1
        self.step_seconds += now - t0
        # A cache that keeps only sliding windows copies the blocks a prompt chunk completed
        # while its ring still holds them, so that later prompts with this prefix find
        # their windows (see jax_tpusync.core.window_prefix).
        publish = getattr(self.cache, "publish_windows", None)
        if publish is not None:
            for b in prompt_slots:
                publish(self.state, b)
        # The blocks the prompt chunks filled become shareable now, not at release: a
        # request admitted a step later maps them (see jax_tpusync.core.prefix).
        share = getattr(self.cache, "share_computed", None) if self.share_prefixes else None
        if share is not None:
            for b in prompt_slots:
                share(self.state, b)
        for b, s in active:
            if s.pending.size:
                continue  # Mid-prompt: no token yet.
            done, checked = s.completion, s.checked
            token, error = self._sample(s, logits[b])
            if error is not None:
                self._fail(done, error, now)
                self._release(b)
                continue
            done.tokens.append(token)
            if done.first_token is None:
                done.first_token = now
            reason = (
                "stop"
                if token in checked.stop_tokens
                else "length"
                if len(done.tokens) >= checked.max_new_tokens
                else None
            )
            if reason:
                done.finished, done.finish_reason = now, reason
                self._release(b)
            else:
                s.next_input = token
        return True

    def run(
        self,
        requests: Iterable[Request] = (),
        *,
        arrivals: Sequence[float] | None = None,
        on_finish: Callable[[Completion], None] | None = None,
    ) -> list[Completion]:
        """Submits ``requests`` (each at its ``arrivals`` offset in seconds from now, if
        given; all now otherwise) and steps until every submitted request finished.

        ``on_finish(completion)`` is called once per finished request (a progress bar).
        Returns the completions of ``requests`` in order.

        Raises:
          TypeError, ValueError: a bad request (the message starts ``requests[i]:``), a
            bad arrival or ``on_finish``; checked before anything is submitted.
        """
        if isinstance(requests, Request):
            raise TypeError(
                "requests must be an iterable of Request; got one Request (pass [request])"
            )
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
            raise TypeError(
                f"requests must be an iterable of Request; got {type(requests).__name__}"
            )
        requests = list(requests)
        checked = []
        for i, request in enumerate(requests):
            try:
                checked.append(self.check(request))
            except (TypeError, ValueError) as e:
                raise type(e)(f"requests[{i}]: {e}") from e
        if arrivals is None:
            offsets = [0.0] * len(requests)
        else:
            if isinstance(arrivals, (str, bytes)) or not isinstance(arrivals, Iterable):
                raise TypeError(
                    f"arrivals must be None or a sequence of seconds; got {type(arrivals).__name__}"
                )
            offsets = [checks.check_arrival(f"arrivals[{i}]", a) for i, a in enumerate(arrivals)]
            if len(offsets) != len(requests):
                raise ValueError(
                    f"arrivals must have one offset per request; got {len(offsets)} for "
                    f"{len(requests)} requests"
                )
        checks.check_callable("on_finish", on_finish, "on_finish(completion)", optional=True)
        start = self.clock()
        order = sorted(range(len(requests)), key=offsets.__getitem__)
        mine: list[Completion | None] = [None] * len(requests)
        reported: set[int] = set()
        pos = 0
        while pos < len(order) or self.busy:
            now = self.clock()
            while pos < len(order) and start + offsets[order[pos]] <= now:
                i = order[pos]
                mine[i] = self._enqueue(requests[i], checked[i], start + offsets[i])
                pos += 1
            if not self.step() and pos < len(order):
                time.sleep(max(0.0, start + offsets[order[pos]] - self.clock()))
            if on_finish is not None:
                for done in self.completions:
                    if done.done and done.index not in reported:
                        reported.add(done.index)
                        on_finish(done)
        return mine  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        """Steps run, by width, and the seconds spent in them (dispatch to logits);
        :meth:`warmup`'s seconds by width apart (compile included, not in the steps'), and
        the widths whose compile fell in a request's step instead (no warm-up); prompt
        tokens the steps computed (``prefill_tokens``) and those admissions mapped from
        the cache instead (``cached_prompt_tokens``)."""
        return dict(
            steps=self.steps,
            steps_by_width={int(k): v for k, v in sorted(self.step_widths.items())},
            step_seconds=self.step_seconds,
            warmup_seconds_by_width={int(k): v for k, v in sorted(self.warmup_seconds.items())},
            compiled_in_steps=sorted(self.compiled_in_steps),
            requests=len(self.completions),
            prefill_tokens=self.prefill_tokens,
            cached_prompt_tokens=sum(c.cached for c in self.completions),
            finished=sum(c.done for c in self.completions),
            errors=sum(c.finish_reason == "error" for c in self.completions),
        )


def _describe(value: Any) -> str:
    """``value`` in a message: an array's dtype and shape, else its type."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{np.dtype(value.dtype).name}{list(value.shape)}"
    return type(value).__name__


def _check_step(step: Callable, params: Any, batch: int, chunk: int, state: Any) -> int:
    """Traces ``step`` at the prefill width (``jax.eval_shape``: nothing runs or compiles;
    a jitted step's first call reuses the trace) and checks what it returns; returns the
    vocabulary (the logits' last dimension)."""
    call = f"step(params, tokens int32[{batch}, {chunk}], positions, counts int32[{batch}], state)"
    tokens = jnp.asarray(np.zeros((batch, chunk), np.int32))  # As the loop makes them.
    counts = jnp.asarray(np.zeros(batch, np.int32))
    try:
        # params closed over: any pytree (or static config) the step takes, as it is.
        out = jax.eval_shape(
            lambda *inputs: step(params, *inputs), tokens, state.positions(chunk), counts, state
        )
    except Exception as e:
        raise TypeError(
            f"{call} failed when traced with the loop's inputs (jax.eval_shape): "
            f"{type(e).__name__}: {e}"
        ) from e
    expect = f"step must return (logits [{batch}, {chunk}, vocab], state)"
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"{expect}; {call} returned {_describe(out)}")
    logits, new_state = out
    shape = tuple(getattr(logits, "shape", ()))
    if (
        len(shape) != 3
        or shape[:2] != (batch, chunk)
        or shape[2] < 1
        or not jnp.issubdtype(logits.dtype, jnp.floating)
    ):
        raise TypeError(f"{expect} with float logits; its logits are {_describe(logits)}")
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise TypeError(
            f"{expect}; its state ({type(new_state).__name__}) is not of the structure of "
            f"the state it was given ({type(state).__name__})"
        )
    return int(shape[2])
