"""The host-side calls every KV cache answers, each with one meaning: :class:`KVCache`.

One device's :class:`~jax_tpusync.OffloadedKVCache`, a mesh's
:class:`~jax_tpusync.ShardedKVCache` and a hybrid model's :class:`~jax_tpusync.HybridKVCache`
all satisfy it (``tests/caches/test_cache_protocol.py`` checks every method's parameter
names against the ones here, so that the classes cannot drift apart). A serving loop or a
benchmark written against :class:`KVCache` runs on any of them.

Rules every method keeps:

* **A refusal changes nothing.** A call that raises (``ValueError`` naming the argument,
  ``TypeError`` for a value of the wrong kind) leaves every slot, block, tier byte, token
  id and commit as it was, and the state passed in stays the live one (unless a step
  donated it). A cache made of parts (head shards, layer groups) refuses in every part
  or in none: no part is left admitted, released or committed alone.
* **A state in, a state out.** A method that takes the state and returns one returns the
  live state: continue with it, the one passed in is stale (its prefetches discarded).
* **Admission.** :meth:`KVCache.admit` reserves a slot for a sequence and returns
  ``(state, cached)``: ``cached`` tokens of its prompt are already on the tier (a prefix
  mapped from the prefix index or imported from a prefix level); prefill the rest. It is
  a transaction of two halves (:class:`Reservable`): :meth:`~Reservable.reserve`, which
  may refuse and changes no state, then :meth:`~Reservable.admitted`, which cannot be
  refused, or :meth:`~Reservable.cancel`; every cache's ``admit`` checks its state
  (:meth:`~Reservable.check`), then runs both halves (:func:`admit_by_reservation`). A
  cache of parts maps the prefix every part holds: the parts' reservations are retried,
  each time capped at the shortest prefix one of them mapped, until they agree (each try
  maps less, so it ends, at the latest at 0). ``cached`` is None only for a mesh slot
  none of whose shards this process holds.
* **Lengths.** :meth:`KVCache.lengths` is int32[batch]: the tokens each slot holds in the
  state given (0 for an inactive slot), as the step sees them; the parts of a cache of
  parts must agree, and a disagreement (a torn host call) is refused, not averaged.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "KVCache",
    "Reservable",
    "Reservation",
    "admit_by_reservation",
    "mismatches",
    "protocol_members",
]


@runtime_checkable
class Reservation(Protocol):
    """What a :meth:`Reservable.reserve` returns (a slot table's ``Admission``, a mesh
    cache's or a hybrid cache's reservation of every part)."""

    @property
    def slot(self) -> int:
        """The slot reserved."""
        ...

    @property
    def cached(self) -> int | None:
        """Tokens of the prompt the reservation maps (None: a mesh slot none of whose
        shards this process holds)."""
        ...


@runtime_checkable
class Reservable(Protocol):
    """The admission transaction: :meth:`reserve` (all or nothing), then :meth:`admitted`
    or :meth:`cancel`. A cache of parts reserves in each part and agrees on one prefix
    (:func:`jax_tpusync.caches.parts.reserve_agreed`); P/D transfer reserves a slot before its
    rows arrive and admits it once they have."""

    def check(self, state: Any) -> None:
        """Refuses, changing nothing, a ``state`` that is not one this cache may continue
        with (``TypeError``: not a state of its kind; ``ValueError``: another cache's, one
        donated to a step, in a cache of parts any part's). :meth:`admitted` cannot be
        refused, so a caller checks the state it will admit into before it reserves."""
        ...

    def reserving_in(self, state: Any) -> AbstractContextManager[None]:
        """A context in which :meth:`reserve` may make room by moving cached blocks out of
        ``state`` (a host pool's spill tier reads the blocks it demotes from the state's
        pool); a no-op for caches whose blocks are not in their state. A caller that will
        admit into ``state`` reserves inside it."""
        ...

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> Reservation:
        """:meth:`KVCache.admit`'s first half: the slot tables admit ``slot`` (all or
        none), no state changes; then :meth:`admitted` (which cannot be refused) or
        :meth:`cancel`. ``max_cached`` caps the mapped prefix (tokens). The reservation's
        ``cached`` is the prefix it maps."""
        ...

    def cancel(self, reservation: Reservation) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        ...

    def admitted(self, state: Any, reservation: Reservation):
        """The live state once :meth:`reserve` made ``reservation``."""
        ...


@runtime_checkable
class KVCache(Reservable, Protocol):
    """The host side of a KV cache (see the module for the rules every method keeps),
    :class:`Reservable`'s calls included.

    ``state`` is the cache's own state type (a ``KVState``, a sharded ``KVState``, a
    ``HybridState``); a state of another cache is refused.
    """

    @property
    def batch(self) -> int:
        """Slots (sequences) of the cache."""
        ...

    @property
    def max_len(self) -> int:
        """Tokens one slot may hold at most."""
        ...

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each slot may hold (0: inactive); a copy."""
        ...

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """int32[batch]: every slot's length at the last commit (None: not persistent)."""
        ...

    @property
    def kv_bytes(self) -> int:
        """Bytes the tier holds for the cache's blocks (K and V, every stored layer, every
        shard), spare blocks included: what the cache allocates, not what it fills."""
        ...

    @property
    def device_bytes(self) -> int:
        """Device memory of the state's staging (every shard's)."""
        ...

    # -- state ------------------------------------------------------------------------------

    def init(self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True):
        """A fresh state; ``lengths`` per slot (default 0, or the last commit's for a cache
        that re-attached persisted KV); ``admit``: admit every slot for ``max_len`` tokens
        first. Every earlier state becomes stale."""
        ...

    def inert_state(self):
        """A state of the cache's structure that moves no bytes (for tracing, shape checks,
        a framework's init); the live state stays live."""
        ...

    def lengths(self, state: Any) -> np.ndarray:
        """int32[batch]: the tokens each slot holds in ``state`` (see the module)."""
        ...

    def drain(self, state: Any):
        """Discards the prefetches ``state`` carries; returns it as the live state."""
        ...

    def recover(self):
        """The live state after a step failed with its state donated."""
        ...

    def commit(self, state: Any):
        """Makes ``state``'s rows durable (persistent tiers; else it only drains); returns
        the drained live state."""
        ...

    # -- slot lifecycle ---------------------------------------------------------------------

    def admit(
        self,
        state: Any,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[Any, int | None]:
        """Reserves ``slot`` for a sequence of at most ``max_tokens`` tokens; returns
        ``(state, cached)`` (see the module)."""
        ...

    def check_release(self, state: Any, slot: int, tokens: Any = None) -> None:
        """Refuses, changing nothing, a :meth:`release` the cache would refuse."""
        ...

    def release(self, state: Any, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None):
        """Frees ``slot`` (length 0); with its token ids its full blocks stay cached in the
        prefix index for later sequences of the same prefix."""
        ...

    def publish_windows(self, state: Any, slot: int) -> int:
        """Copies the window blocks ``slot`` completed since its last call into the cache of
        windows (caches that keep only their sliding window); returns the blocks copied
        (0 where nothing keeps only its window)."""
        ...

    def share_computed(self, state: Any, slot: int) -> int:
        """Indexes ``slot``'s whole blocks that the steps so far computed (the step that
        wrote them finished) under its recorded token ids, pinned by the slot, so that an
        :meth:`admit` of the same prefix a step later maps them; returns the blocks
        indexed now. A block being filled is never indexed; the slot's read-only prefix
        grows over them (it only appends past them) and :meth:`release` unpins them. 0
        where a slot keeps only its sliding window (:meth:`publish_windows` instead).
        Remote prefix levels get the blocks at :meth:`release`."""
        ...

    def tokens(self, slot: int) -> np.ndarray:
        """int64[n]: ``slot``'s recorded token ids."""
        ...

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        """Records ``ids`` after ``slot``'s token ids (refused past its capacity, or for an
        inactive slot)."""
        ...

    # -- host-side rows ---------------------------------------------------------------------

    def load(
        self,
        state: Any,
        layer: int,
        k: Any,
        v: Any,
        *,
        start: int | Sequence[int] = 0,
        lengths: Sequence[int] | None = None,
        slot: int | None = None,
    ):
        """Bulk-writes one layer's KV host-side, ``k``/``v`` [batch, n, num_kv_heads,
        head_dim] (with ``slot``: that slot's [n, num_kv_heads, head_dim]); returns the
        live state, whose lengths never shrink."""
        ...

    def read(
        self,
        state: Any,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ):
        """Host copies of positions ``[start, stop)`` of one slot's K and V in ``layer``:
        two [stop - start, num_kv_heads, head_dim] arrays (``raw``: a quantized tier's
        codes and scales)."""
        ...

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, state: Any = None) -> None:
        """Commits ``state`` if given (persistent tiers), then frees what the cache made.
        Never raises for a failed commit: the last successful one stands."""
        ...

    def __enter__(self) -> KVCache: ...

    def __exit__(self, *exc: Any) -> None: ...


def admit_by_reservation(
    cache: Reservable,
    state: Any,
    slot: int,
    max_tokens: int | None,
    tokens: Sequence[int] | np.ndarray | None,
) -> tuple[Any, int | None]:
    """:meth:`KVCache.admit` as its two halves: ``cache`` checks ``state``, reserves
    ``slot`` (all or nothing: a refusal raises and changes nothing), then admits the
    reservation into ``state``; returns ``(state, cached)``. The state is checked first
    since :meth:`~Reservable.admitted` cannot be refused once the slot tables admitted the
    slot (a state it refused would leave the slot reserved)."""
    cache.check(state)
    with cache.reserving_in(state):
        reservation = cache.reserve(slot, max_tokens, tokens)
    return cache.admitted(state, reservation), reservation.cached


def protocol_members() -> dict[str, Any]:
    """``{name: function or property}`` of every call :class:`KVCache` names
    (:class:`Reservable`'s included)."""
    return {
        name: member
        for name, member in {**vars(Reservable), **vars(KVCache)}.items()
        if (inspect.isfunction(member) or isinstance(member, property))
        and (not name.startswith("_") or name in ("__enter__", "__exit__"))
    }


def mismatches(cls: type) -> list[str]:
    """Where ``cls`` departs from :class:`KVCache`: a missing call, a property that is a
    method (or the other way round), or a method whose parameters differ from the
    protocol's in name, kind or order. A class may add parameters after the protocol's
    only if they have defaults. Empty: ``cls`` keeps the protocol."""
    out = []
    for name, member in protocol_members().items():
        ours = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            if ours is None and name not in _instance_attributes(cls):
                out.append(f"{cls.__name__}.{name}: missing (a property of KVCache)")
            elif inspect.isfunction(ours):
                out.append(f"{cls.__name__}.{name}: a method, KVCache's is a property")
            continue
        if ours is None:
            out.append(f"{cls.__name__}.{name}(): missing")
            continue
        if not inspect.isfunction(ours):
            out.append(f"{cls.__name__}.{name}: not a method")
            continue
        want = list(inspect.signature(member).parameters.values())[1:]
        have = list(inspect.signature(ours).parameters.values())[1:]
        for i, p in enumerate(want):
            q = have[i] if i < len(have) else None
            if q is None or q.name != p.name or q.kind != p.kind:
                out.append(
                    f"{cls.__name__}.{name}: parameter {i + 1} is "
                    f"{'missing' if q is None else f'{q.name} ({q.kind.description})'}, KVCache "
                    f"has {p.name} ({p.kind.description})"
                )
                break
            if (q.default is inspect.Parameter.empty) != (p.default is inspect.Parameter.empty):
                out.append(
                    f"{cls.__name__}.{name}: parameter {p.name} "
                    f"{'has no' if q.default is inspect.Parameter.empty else 'has a'} default, "
                    f"KVCache's {'has one' if q.default is inspect.Parameter.empty else 'none'}"
                )
        for q in have[len(want) :]:
            if q.default is inspect.Parameter.empty and q.kind not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            ):
                out.append(f"{cls.__name__}.{name}: extra parameter {q.name} has no default")
    return out


def _instance_attributes(cls: type) -> set[str]:
    """Names the methods of ``cls`` and its bases assign on ``self`` (an instance attribute
    may stand for a property)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(source))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names
