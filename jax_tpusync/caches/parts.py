"""A cache made of parts: the head shards of a mesh slot, the layer groups of a hybrid model.

A host-side call on such a cache must act on every part or on none, and the parts must
agree on what they hold. The rules, kept once here for the composite of parts
(:mod:`jax_tpusync.caches.composite`: mesh shards, batch shards, layer groups):

* **All or none** (:func:`each_or_none`): each part does its share in turn; a refusal in
  any part undoes the shares already done, in reverse order, and raises the refusal.
* **Reserving in the state** (:func:`reserving_in_each`): a reservation reads each part's
  share of the state it is made for (a host pool's spill tier demotes out of its pool).
* **One prefix** (:func:`reserve_agreed`): parts whose prefix stores differ (a block one of
  them lacks or lost) map the prefix every one of them holds. The parts' reservations are
  retried, each time capped at the shortest prefix one of them mapped, until they agree.
  A part maps at most its cap, so each retry maps strictly less than the one before: it
  ends, at the latest where every part maps nothing. (Retrying once and then refusing, as
  a mesh cache did, refused an admission whenever a store lost a block between two tries.)
* **One commit** (:func:`bring_to_common_commit`): each part commits on its own, so a crash
  between two parts' manifest writes leaves them at different commits; a re-attach brings
  them to their common one, every part of a slot's state alike (each part restarted at
  it by :func:`restart_part`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from jax_tpusync.persist import commit as persistence

__all__ = [
    "bring_to_common_commit",
    "each_or_none",
    "reserve_agreed",
    "reserving_in_each",
    "restart_part",
]

P = TypeVar("P")
R = TypeVar("R")


def each_or_none(parts: Sequence[P], do: Callable[[P], R], undo: Callable[[P, R], None]) -> list[R]:
    """``[do(part) for part in parts]``, or, if one raises, nothing: the parts done so far
    are undone (``undo(part, result)``, last first) and the error is raised."""
    done: list[tuple[P, R]] = []
    try:
        for part in parts:
            done.append((part, do(part)))
    except Exception:
        for part, result in reversed(done):
            undo(part, result)
        raise
    return [result for _, result in done]


def reserve_agreed(
    reserve: Callable[[int | None], Sequence[R]],
    cancel: Callable[[Sequence[R]], None],
    cached_of: Callable[[R], int | None],
    max_cached: int | None = None,
) -> Sequence[R]:
    """Every part's reservation, all mapping one prefix (see the module's rule).

    Args:
      reserve: ``reserve(cap)``: every part's reservation with at most ``cap`` prefix
        tokens mapped (None: no cap), all or none (raising, nothing reserved).
      cancel: undoes what one ``reserve`` call made.
      cached_of: a reservation's mapped prefix (tokens).
      max_cached: the caller's own cap.

    Raises:
      Whatever ``reserve`` raises (nothing stays reserved); RuntimeError if a part maps
      more than its cap (it would never end).
    """
    cap = max_cached
    reservations = reserve(cap)
    while True:
        cached = {cached_of(r) for r in reservations} - {None}
        if len(cached) <= 1:
            return reservations
        if cap is not None and max(cached) > cap:
            cancel(reservations)
            raise RuntimeError(f"a part mapped {max(cached)} prefix tokens past its cap of {cap}")
        cap = min(cached)
        cancel(reservations)
        reservations = reserve(cap)


def bring_to_common_commit(
    caches: Sequence[Any], warn: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]
) -> None:
    """Re-attach: brings one-device caches (a slot's head shards, a model's layer groups)
    that a crash left at different commits to their common one.

    Their common state is the shorter one, every part of it: a slot one part holds
    released is released in all (its KV dropped); a slot's rows and token ids end at the
    shortest length any part committed (the rows below it are committed, and checksummed,
    everywhere; ids past it are not its KV's, and a release would index blocks under
    them). ``warn(i, its committed lengths, the common ones, the slots released in it)``
    is called for each part that changes. Nothing happens for a non-persistent cache.
    """
    committed = [c.committed_lengths for c in caches]
    if not caches or committed[0] is None:
        return
    common, torn_in = persistence.common_commit(
        [c.capacity for c in caches],
        committed,
        [c.slots.shared.astype(np.int64) * c.spec.block_tokens for c in caches],
    )
    for cache, torn in zip(caches, torn_in):
        for b in np.flatnonzero(torn):
            cache.slots.release(int(b), 0)
    tokens = persistence.agree_tokens([c.slots.history for c in caches], common)
    for i, (cache, torn) in enumerate(zip(caches, torn_in)):
        history = cache.slots.history
        if not (
            torn.any()
            or (committed[i] != common).any()
            or any(history.count(b) != len(ids) for b, ids in enumerate(tokens))
        ):
            continue
        warn(i, committed[i], common, torn)
        cache.restart_at(common, tokens)


@contextlib.contextmanager
def reserving_in_each(parts: Sequence[Any], states: Sequence[Any]) -> Iterator[None]:
    """A cache of parts' ``reserving_in(state)``: every part's
    :meth:`~jax_tpusync.caches.protocol.Reservable.reserving_in` its own of ``states`` (in
    part order; left in reverse)."""
    with contextlib.ExitStack() as stack:
        for part, state in zip(parts, states, strict=True):
            stack.enter_context(part.reserving_in(state))
        yield


def restart_part(
    persisted: Any,
    slots: Any,
    block_tokens: int,
    lengths: np.ndarray,
    tokens: Sequence[np.ndarray] | None = None,
) -> np.ndarray:
    """One part's share of :func:`bring_to_common_commit` (what
    :meth:`jax_tpusync.OffloadedKVCache.restart_at` and
    :meth:`jax_tpusync.caches.pool.cache.HostPoolKVCache.restart_at` do): commits ``lengths`` (int[batch],
    at most the committed ones, at least each slot's shared prefix) as the part's new
    rows, each slot's token ids cut at its length or set to ``tokens[b]`` (at most
    ``lengths[b]`` ids). Returns the lengths committed (int32[batch]).

    Args:
      persisted: the part's :class:`~jax_tpusync.persist.commit.Persistence` (None: not
        persistent, refused).
      slots: the part's :class:`~jax_tpusync.core.slots.SlotTable` (shared prefixes, token ids).
      block_tokens: tokens of one block.

    Raises:
      ValueError: lengths out of that range, or tokens longer than them; CommitError: the
        commit was not made. Either way nothing changes (the token ids are put back).
    """
    batch = slots.batch
    lengths = np.asarray(lengths, np.int32)
    if (
        persisted is None
        or lengths.shape != (batch,)
        or (lengths > persisted.committed_lengths).any()
        or (lengths < 0).any()
    ):
        raise ValueError(
            f"lengths {lengths.tolist()} must be in [0, committed lengths] of a persistent tier"
        )
    shared = slots.shared.astype(np.int64) * block_tokens
    for b in np.flatnonzero(lengths < shared):
        raise ValueError(
            f"lengths[{b}]={int(lengths[b])} ends inside slot {b}'s shared prefix of "
            f"{int(shared[b])} tokens (mapped blocks are committed whole): release it first"
        )
    if tokens is not None and (
        len(tokens) != batch or any(len(t) > n for t, n in zip(tokens, lengths.tolist()))
    ):
        raise ValueError("tokens must hold, per slot, at most lengths[b] token ids")
    history = slots.history
    before = [history.ids(b) for b in range(batch)]
    for b in range(batch):
        if tokens is None:
            history.truncate(b, int(lengths[b]))
        else:
            history.set(b, tokens[b])
    try:
        persisted.commit(lengths)
    except Exception:
        for b, ids in enumerate(before):
            history.set(b, ids)
        raise
    return lengths
