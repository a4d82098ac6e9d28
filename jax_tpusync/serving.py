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

Token history: a slot's recorded ids (``cache.tokens(slot)``) are its prompt plus every
token fed back as an input (``cache.extend_tokens`` when fed). The cache therefore holds the
KV of the prompt and of every decode input, but not of the last sampled token, which is
never fed: a request of ``max_new_tokens`` tokens needs ``len(prompt) + max_new_tokens - 1``
tokens of capacity.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Completion", "Request", "Sampler", "ServingLoop", "greedy"]

# sampler(logits f32[vocab], rng) -> token id.
Sampler = Callable[[np.ndarray, np.random.Generator], int]


def greedy(logits: np.ndarray, rng: np.random.Generator) -> int:
    """The most likely token (the default sampler; ``rng`` unused)."""
    del rng
    return int(np.argmax(logits))


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
      prompt: the prompt's token ids (at least one).
      max_new_tokens: tokens to generate (at least one), fewer if a stop token comes.
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
    finish_reason: str | None = None  # "length" or "stop"

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
        )


@dataclasses.dataclass
class _Active:
    completion: Completion
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
        slots are all inactive (a
        fresh cache; ``cache.init(admit=False)`` makes the first state unless ``state`` is
        given).
      step: the jitted step (see the module's docstring for its contract).
      params: passed through as the step's first argument.
      chunk: prompt tokens fed per slot and step while prefilling (the prefill bucket).
      decode_width: T of steps in which no slot prefills (default 1); None: every step
        has T = ``chunk`` (one compiled step in all, each decode step computing ``chunk``
        rows per slot).
      state: the cache's live state to start from (every slot inactive).
      seed: the default seed of the requests' samplers.
      clock: seconds, for the request times.

    Between steps, finished requests release their slots and waiting ones are admitted in
    arrival order (a request the pool has no blocks for waits while others run; with no
    request running it is refused).
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
    ):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1; got {chunk}")
        if decode_width is not None and not 1 <= decode_width <= chunk:
            raise ValueError(f"decode_width must be in [1, chunk={chunk}] or None")
        if np.any(np.asarray(cache.capacity) != 0):
            raise ValueError(
                "every slot of the cache must be inactive (a fresh cache, or one whose "
                "slots were released); active: "
                f"{np.flatnonzero(np.asarray(cache.capacity)).tolist()}"
            )
        self.cache, self.step_fn, self.params = cache, step, params
        self.chunk, self.decode_width = chunk, decode_width or chunk
        self.seed, self.clock = seed, clock
        self.state = cache.init(admit=False) if state is None else state
        self.batch = int(cache.batch)
        self.max_len = int(cache.max_len)
        self.waiting: collections.deque[Completion] = collections.deque()
        self.slots: list[_Active | None] = [None] * self.batch
        self.completions: list[Completion] = []
        self.steps = 0
        self.step_widths: collections.Counter[int] = collections.Counter()
        self.step_seconds = 0.0

    # -- requests -----------------------------------------------------------------------

    def submit(self, request: Request, *, arrival: float | None = None) -> Completion:
        """Queues ``request``; returns its :class:`Completion` (filled in as it runs).

        ``arrival``: when it arrived on the loop's clock (default now), for its TTFT.
        """
        prompt = np.asarray(request.prompt, np.int64).reshape(-1)
        if prompt.size < 1 or request.max_new_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_new_tokens >= 1")
        need = prompt.size + request.max_new_tokens - 1
        if need > self.max_len:
            raise ValueError(
                f"request needs {need} tokens of KV (prompt {prompt.size} + max_new_tokens "
                f"{request.max_new_tokens} - 1); the cache's max_len is {self.max_len}"
            )
        done = Completion(
            len(self.completions), request, self.clock() if arrival is None else arrival
        )
        self.completions.append(done)
        self.waiting.append(done)
        return done

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def _admit_waiting(self) -> None:
        while self.waiting:
            free = [b for b, s in enumerate(self.slots) if s is None]
            if not free:
                return
            done = self.waiting[0]
            req = done.request
            prompt = np.asarray(req.prompt, np.int64).reshape(-1)
            try:
                self.state, cached = self.cache.admit(
                    self.state,
                    free[0],
                    tokens=prompt,
                    max_tokens=prompt.size + req.max_new_tokens - 1,
                )
            except ValueError:
                if any(s is not None for s in self.slots):
                    return  # Blocks come back as running requests finish.
                raise
            self.waiting.popleft()
            seed = req.seed if req.seed is not None else (self.seed, done.index)
            done.slot, done.cached, done.admitted = free[0], int(cached), self.clock()
            self.slots[free[0]] = _Active(done, np.random.default_rng(seed), prompt[cached:])

    def _release(self, b: int) -> None:
        # Publishes the slot's full blocks under its recorded ids (prompt + fed tokens).
        self.state = self.cache.release(self.state, b)
        self.slots[b] = None

    # -- the loop -----------------------------------------------------------------------

    def step(self) -> bool:
        """Admits what it can, runs one step over the running requests, samples, releases
        the finished ones. Returns False if nothing was running (no step ran)."""
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
        positions = self.state.positions(width)
        logits, self.state = self.step_fn(
            self.params, jnp.asarray(tokens), positions, jnp.asarray(counts), self.state
        )
        if width > 1:
            logits = _rows_at(logits, jnp.asarray(np.maximum(counts - 1, 0)))
        else:
            logits = logits[:, 0]
        logits = np.asarray(logits)  # Waits for the step.
        now = self.clock()
        self.steps += 1
        self.step_widths[width] += 1
        self.step_seconds += now - t0
        # A cache that keeps only sliding windows copies the blocks a prompt chunk completed
        # while its ring still holds them, so that later prompts with this prefix find
        # their windows (see jax_tpusync.window_prefix).
        publish = getattr(self.cache, "publish_windows", None)
        if publish is not None:
            for b in prompt_slots:
                publish(self.state, b)
        for b, s in active:
            if s.pending.size:
                continue  # Mid-prompt: no token yet.
            done, req = s.completion, s.completion.request
            token = int((req.sampler or greedy)(logits[b], s.rng))
            done.tokens.append(token)
            if done.first_token is None:
                done.first_token = now
            reason = (
                "stop"
                if token in req.stop_tokens
                else "length"
                if len(done.tokens) >= req.max_new_tokens
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
        """
        requests = list(requests)
        offsets = [0.0] * len(requests) if arrivals is None else [float(a) for a in arrivals]
        if len(offsets) != len(requests):
            raise ValueError("arrivals must have one offset per request")
        start = self.clock()
        order = sorted(range(len(requests)), key=offsets.__getitem__)
        mine: list[Completion | None] = [None] * len(requests)
        reported: set[int] = set()
        pos = 0
        while pos < len(order) or self.busy:
            now = self.clock()
            while pos < len(order) and start + offsets[order[pos]] <= now:
                i = order[pos]
                mine[i] = self.submit(requests[i], arrival=start + offsets[i])
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
        """Steps run, by width, and the seconds spent in them (dispatch to logits)."""
        return dict(
            steps=self.steps,
            steps_by_width={int(k): v for k, v in sorted(self.step_widths.items())},
            step_seconds=self.step_seconds,
            requests=len(self.completions),
            finished=sum(c.done for c in self.completions),
        )
