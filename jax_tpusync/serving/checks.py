"""The serving loop's checks: what a request, a token id, a seed or a loop argument must be,
and the most tokens a cache can ever give one slot.

Every check here raises ``TypeError`` (a value of the wrong kind) or ``ValueError`` (the
right kind, out of range) with a message naming the field and the value, and changes
nothing. :class:`~jax_tpusync.serving.ServingLoop` runs them before a request is queued,
so that a request it accepted cannot stop the loop later.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jax_tpusync.core.config import is_int

__all__ = [
    "CheckedRequest",
    "INT32_IDS",
    "check_arrival",
    "check_cache",
    "check_callable",
    "check_int",
    "check_request",
    "check_request_seed",
    "check_token_ids",
    "slot_limit",
    "slot_tables",
    "token_id_error",
]

# The step takes int32 token ids: without a known vocabulary, ids must fit int32.
INT32_IDS = 2**31

# What the loop calls on a cache (OffloadedKVCache, ShardedKVCache and HybridKVCache have
# them all).
CACHE_ATTRIBUTES = ("batch", "max_len", "capacity", "init", "admit", "release", "extend_tokens")


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request's fields once checked, as the loop uses them (copies: a caller changing
    its prompt list after submitting changes nothing).

    Attributes:
      prompt: int32[n] token ids, n >= 1, each in [0, vocab_size).
      max_new_tokens: at least 1.
      stop_tokens: ids in [0, vocab_size).
      need: tokens of KV the request needs (``n + max_new_tokens - 1``).
    """

    prompt: np.ndarray
    max_new_tokens: int
    stop_tokens: frozenset[int]
    need: int


def _id_range(vocab_size: int | None) -> str:
    if vocab_size is None:
        return "[0, 2**31) (int32; the loop's vocab_size is unknown)"
    return f"[0, vocab_size={vocab_size})"


def token_id_error(vocab_size: int | None) -> str:
    """The end of a message refusing a token id: ``"not a token id in [0, vocab_size=V)"``."""
    return f"not a token id in {_id_range(vocab_size)}"


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices`` (strings)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (numpy ints too, never a bool)."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if not is_int(value):
        raise TypeError(f"{name} must be an int {bounds}; got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an int {bounds}; got {value!r}")
    return int(value)


def check_token_ids(name: str, ids: Any, vocab_size: int | None) -> np.ndarray:
    """int32[n]: ``ids`` (a 1-D sequence or integer array of token ids) checked.

    Each id must be an int (Python or numpy, not a bool) in ``[0, vocab_size)``; an id is
    never truncated to int32. ``name`` names the field (``prompt``, ``stop_tokens``).
    """
    limit = INT32_IDS if vocab_size is None else vocab_size
    if isinstance(ids, np.ndarray) or (hasattr(ids, "__array__") and hasattr(ids, "dtype")):
        array = np.asarray(ids)  # A numpy or JAX array.
        if array.ndim != 1:
            raise ValueError(
                f"{name} must be 1-D (one token id per element); got shape {array.shape}"
            )
        if array.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold int token ids; got an array of {array.dtype}")
        bad = np.flatnonzero((array < 0) | (array >= limit))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}]={int(array[i])} is {token_id_error(vocab_size)}")
        return array.astype(np.int32)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, range)):
        raise TypeError(
            f"{name} must be a 1-D sequence or integer array of token ids; "
            f"got {'None' if ids is None else type(ids).__name__}"
        )
    out = np.empty(len(ids), np.int32)
    for i, token in enumerate(ids):
        nested = isinstance(token, Sequence) and not isinstance(token, (str, bytes))
        if nested or (isinstance(token, np.ndarray) and token.ndim > 0):
            raise ValueError(
                f"{name} must be 1-D (one token id per element); {name}[{i}] is a "
                f"{type(token).__name__}"
            )
        if not is_int(token):
            raise TypeError(f"{name}[{i}]={token!r} is not an int token id")
        if not 0 <= token < limit:
            raise ValueError(f"{name}[{i}]={int(token)} is {token_id_error(vocab_size)}")
        out[i] = token
    return out


def check_request_seed(seed: Any) -> None:
    """A request's seed: None, an int >= 0, a non-empty sequence of them, or a
    ``numpy.random.SeedSequence`` (what ``numpy.random.default_rng`` takes)."""
    what = "seed must be None, an int >= 0, a sequence of them or a numpy SeedSequence"
    if seed is None or isinstance(seed, np.random.SeedSequence):
        return
    items = seed if isinstance(seed, (tuple, list)) and seed else [seed]
    for item in items:
        if not is_int(item):
            raise TypeError(f"{what}; got {seed!r}")
        if item < 0:
            raise ValueError(f"{what}; got {seed!r}")


def check_request(request: Any, vocab_size: int | None, limit: tuple[int, str]) -> CheckedRequest:
    """Checks every field of ``request`` (a :class:`~jax_tpusync.serving.Request`).

    Args:
      request: the request.
      vocab_size: token ids must be below it (None: below 2**31).
      limit: ``(tokens, why)``: the most tokens of KV one slot can ever hold, and what
        sets it (:func:`slot_limit`).

    Raises:
      TypeError, ValueError: naming the field and its value; a request that could never
        be admitted (it needs more KV than ``limit``) is a ValueError.
    """
    prompt = check_token_ids("prompt", request.prompt, vocab_size)
    if prompt.size < 1:
        raise ValueError("prompt must hold at least one token id; got an empty prompt")
    max_new_tokens = check_int("max_new_tokens", request.max_new_tokens, 1)
    if request.sampler is not None and not callable(request.sampler):
        raise TypeError(
            "sampler must be None or a callable sampler(logits, rng) -> token id; "
            f"got {type(request.sampler).__name__}"
        )
    stop = request.stop_tokens
    if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
        raise TypeError(
            f"stop_tokens must be a sequence of token ids (a tuple, list or set); "
            f"got {type(stop).__name__}"
        )
    if not isinstance(stop, (Sequence, np.ndarray)):
        stop = list(stop)  # A set: checked in its iteration order.
    stop_tokens = frozenset(int(t) for t in check_token_ids("stop_tokens", stop, vocab_size))
    check_request_seed(request.seed)
    need = int(prompt.size) + max_new_tokens - 1
    most, why = limit
    if need > most:
        raise ValueError(
            f"request needs {need} tokens of KV (prompt {prompt.size} + max_new_tokens "
            f"{max_new_tokens} - 1) but {why}: it could never be admitted"
        )
    return CheckedRequest(prompt, max_new_tokens, stop_tokens, need)


def check_arrival(name: str, value: Any, *, optional: bool = False) -> float:
    """A time in seconds: a finite int or float (not a bool); None too where ``optional``
    (the message then says so; the caller handles None)."""
    what = f"{name} must be {'None or ' if optional else ''}a finite number of seconds"
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{what}; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what}; got {value!r}")
    return float(value)


def check_cache(cache: Any) -> None:
    """Refuses an object that is not a KV cache the loop can drive."""
    kinds = "a KV cache (an OffloadedKVCache, ShardedKVCache or HybridKVCache)"
    if cache is None:
        raise TypeError(f"cache must be {kinds}; got NoneType")
    missing = [a for a in CACHE_ATTRIBUTES if not hasattr(cache, a)]
    if missing:
        raise TypeError(
            f"cache must be {kinds}; got {type(cache).__name__}, which has no "
            f"{', '.join(missing)}"
        )


def slot_tables(cache: Any, where: str = "") -> Iterable[tuple[Any, str]]:
    """``(slot table, where)`` of every part of ``cache`` that gives a slot its blocks: a
    hybrid cache's layer groups, a mesh cache's shards, a single cache's own table."""
    groups = getattr(cache, "groups", None)
    if isinstance(groups, list):
        for i, group in enumerate(groups):
            yield from slot_tables(group, f"{where} of layer group {i}")
        return
    shards = getattr(cache, "shards", None)
    if isinstance(shards, dict):
        for s, shard in shards.items():
            yield from slot_tables(shard, f"{where} of shard {s}")
        return
    table = getattr(cache, "slots", None)
    if all(hasattr(table, a) for a in ("blocks_for", "num_blocks", "block_tokens")):
        yield table, where


def slot_limit(cache: Any) -> tuple[int, str]:
    """``(tokens, why)``: the most tokens of KV the cache can ever give one slot, with
    nothing else running, and what sets it: its ``max_len``, or the pool of blocks of one
    of its parts (a slot that keeps every position needs a block per ``block_tokens``
    tokens; one that keeps a sliding window, its ring's blocks)."""
    max_len = int(cache.max_len)
    most, why = max_len, f"the cache's max_len is {max_len}"
    for table, where in slot_tables(cache):
        pool, block = int(table.num_blocks), int(table.block_tokens)
        if table.blocks_for(most) <= pool:
            continue
        lo, hi = 0, most  # blocks_for grows with the tokens: the largest that fits.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if table.blocks_for(mid) <= pool:
                lo = mid
            else:
                hi = mid - 1
        most = lo
        why = f"the pool{where} ({pool} blocks of {block} tokens) holds at most {lo}"
    return most, why


def check_callable(name: str, value: Any, what: str, *, optional: bool = False) -> Callable | None:
    """``value`` if it is callable (or None where ``optional``)."""
    if value is None and optional:
        return None
    if not callable(value):
        prefix = "None or " if optional else ""
        raise TypeError(f"{name} must be {prefix}a callable {what}; got {value!r}")
    return value
