"""One KV cache made of parts: :class:`PartsKVCache`, the host calls of every cache of parts.

A mesh's head and batch shards (:class:`~jax_tpusync.ShardedKVCache`), a host pool's batch
shards (:class:`~jax_tpusync.BatchShardedPoolKVCache`) and a hybrid model's layer groups
(:class:`~jax_tpusync.HybridKVCache`) are each a set of caches (the *parts*, each a
:class:`~jax_tpusync.caches.protocol.KVCache` of its own) behind one
:class:`~jax_tpusync.caches.protocol.KVCache`. Every host call of such a cache has one
shape, written here once: split the state into the parts' states, call each part that
holds the slot (in its own slot ids, inside its own context), assemble the parts' states
back into one. The rules it keeps are :mod:`jax_tpusync.caches.parts`': all or none, one
prefix, one commit on re-attach.

A subclass says only what differs between its kinds of parts (:class:`PartsKVCache`'s
"what a kind of parts supplies"): how a state splits and assembles, which global slots a
part holds (:meth:`PartsKVCache.rows_of`: a part holds a range of slots, numbered from 0
there; layer groups hold every slot), the context a part's host work runs in, how a
layer's rows are shared out (:meth:`PartsKVCache.load`, :meth:`PartsKVCache.read`), and
its construction. A reservation of any of them is one :class:`PartsAdmission`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jax_tpusync.caches.parts import (
    bring_to_common_commit,
    each_or_none,
    reserve_agreed,
    reserving_in_each,
)
from jax_tpusync.caches.protocol import admit_by_reservation
from jax_tpusync.core.config import is_int
from jax_tpusync.core.quantize import join_head_shards

__all__ = ["PartsAdmission", "PartsKVCache", "outside_mesh"]


def outside_mesh() -> contextlib.AbstractContextManager[Any]:
    """No mesh context: a part's programs run on its own devices (under ``jax.set_mesh`` of
    the whole mesh, jit refuses eager ops on one device's arrays)."""
    return jax.set_mesh(None) if hasattr(jax, "set_mesh") else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class PartsAdmission:
    """What :meth:`PartsKVCache.reserve` made: global ``slot``, the reservation of each
    part of this process holding it (``{part: its reservation}``, each of the part's own
    slot id) and the prefix tokens they all map (None: no part of this process holds the
    slot)."""

    slot: int
    admissions: dict
    cached: int | None


class PartsKVCache:
    """The host calls of a cache made of parts (see the module).

    A subclass sets ``parts`` (``{key: part cache}``, this process's parts in order),
    ``batch`` (global slots) and ``_log`` (its module's logger), and supplies
    :meth:`rows_of`, :meth:`_split`, :meth:`_assemble`, :meth:`_load_shares` and
    :meth:`_read_parts`; :meth:`_running`, :meth:`_part_name` and the reservation order
    have defaults.
    """

    parts: dict[Any, Any]
    batch: int
    part_noun = "parts"  # What the parts are called in messages (plural).
    _log = logging.getLogger(__name__)
    _closed = False

    # -- what a kind of parts supplies ------------------------------------------------------

    def rows_of(self, key: Any) -> slice:
        """The global slots part ``key`` holds (numbered from 0 there)."""
        raise NotImplementedError

    def _split(self, state: Any, *, check: bool = True, releasing: int | None = None) -> dict:
        """``{key: part state}`` of this process's parts in ``state``, refusing a state of
        another structure (``check``: and whatever a kind checks of every part before any
        acts; ``releasing``: the global slot a release frees)."""
        raise NotImplementedError

    def _assemble(self, states: dict, state: Any = None) -> Any:
        """The state of the parts' ``states`` (``state``: the one they were split from)."""
        raise NotImplementedError

    def _load_shares(self, layer, k, v, start, lengths, slot) -> dict:
        """``{key: keywords of that part's load}`` (``layer``, ``k``, ``v``, ``start``,
        ``lengths``, ``slot``), every part's share checked before any is written."""
        raise NotImplementedError

    def _read_parts(self, layer: Any, slot: Any) -> list[tuple[Any, int, int]]:
        """``(key, layer there, slot there)`` of every part holding ``slot``'s rows of
        ``layer``, in head order (their reads are joined along the heads)."""
        raise NotImplementedError

    def _running(self, key: Any) -> contextlib.AbstractContextManager[Any]:
        """The context host work on part ``key`` runs in."""
        return contextlib.nullcontext()

    def _part_name(self, key: Any) -> str:
        return f"part {key}"

    def _reserve_order(self, keys: list) -> list:
        """The order in which the parts reserve a slot (default: theirs)."""
        return keys

    def _search_cap(self, key: Any, cap: int | None, found: list[int]) -> int | None:
        """The prefix cap of part ``key``'s reservation, given what the parts that
        reserved before it mapped (default: the caller's)."""
        return cap

    def _close_own(self) -> None:
        """Frees what the cache made besides its parts (an engine)."""

    # -- slots ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this cache is closed")

    def _holders(self, slot: Any) -> list[tuple[Any, int]]:
        """``(key, slot there)`` of every part of this process holding global ``slot``."""
        if not is_int(slot) or not 0 <= slot < self.batch:
            raise ValueError(f"slot={slot!r} must be an int in [0, batch={self.batch})")
        out = []
        for key in self.parts:
            rows = self.rows_of(key)
            if rows.start <= slot < rows.stop:
                out.append((key, int(slot) - rows.start))
        return out

    def _share(self, values: np.ndarray | None, key: Any) -> np.ndarray | None:
        """Part ``key``'s share of a per-slot array (None stays None)."""
        return None if values is None else values[self.rows_of(key)]

    def _gather(self, per_part: Callable[[Any, Any], Any], common: bool = False) -> np.ndarray:
        """A [batch, ...] array of a per-slot quantity, from ``per_part(key, part) -> [its
        slots, ...]`` of every part; the parts holding a slot must agree (a torn host call
        is refused, not averaged), or with ``common`` give their smallest value. Slots no
        part of this process holds are 0."""
        full, held = None, np.zeros(self.batch, bool)
        for key, part in self.parts.items():
            with self._running(key):
                value = np.asarray(per_part(key, part))
            rows = self.rows_of(key)
            if full is None:
                full = np.zeros((self.batch, *value.shape[1:]), value.dtype)
            seen = held[rows].reshape(-1, *[1] * (value.ndim - 1))
            torn = held[rows] & (full[rows] != value).reshape(len(value), -1).any(1)
            if common:
                value, torn = np.where(seen, np.minimum(full[rows], value), value), ()
            for i in np.flatnonzero(torn):
                raise ValueError(
                    f"the {self.part_noun} of slot {rows.start + i} disagree "
                    f"({full[rows][i].tolist()} vs {value[i].tolist()} in "
                    f"{self._part_name(key)}): a host call was torn"
                )
            full[rows], held[rows] = value, True
        return full

    def _each(self, state: Any, do: Callable[[Any, Any, Any], Any], **split: Any) -> Any:
        """The state after ``do(key, part, its state)`` on every part (``state`` None: on
        none, for a fresh one)."""
        states = {} if state is None else self._split(state, **split)
        for key, part in self.parts.items():
            with self._running(key):
                states[key] = do(key, part, states.get(key))
        return self._assemble(states, state)

    def _all_active(self, slot: int, holders: list, states: dict | None, what: str) -> None:
        """All or none: every holder of ``slot`` takes the call (an active slot, and its
        part's state) before any acts."""
        for key, local in holders:
            part = self.parts[key]
            if states is not None:
                part.lengths(states[key])  # A state of another cache, or donated, is refused.
            if not part.capacity[local]:
                raise ValueError(f"slot {slot} is not active ({what})")

    # -- state ------------------------------------------------------------------------------

    def init(self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True):
        """A fresh state of every part; ``lengths``: int[batch] of global slots (see
        :meth:`jax_tpusync.OffloadedKVCache.init`)."""
        self._check_open()
        if lengths is not None:
            lengths = np.asarray(lengths)
            if lengths.shape != (self.batch,):
                raise ValueError(f"lengths must have shape ({self.batch},); got {lengths.shape}")
        return self._each(None, lambda k, c, _: c.init(self._share(lengths, k), admit=admit))

    def inert_state(self):
        """A state of every part that moves no bytes (the live state stays live)."""
        self._check_open()
        return self._each(None, lambda k, c, _: c.inert_state())

    def drain(self, state: Any):
        """Every part's :meth:`~jax_tpusync.OffloadedKVCache.drain`; the live state."""
        return self._each(state, lambda k, c, s: c.drain(s))

    def recover(self):
        """Every part's live state after a failed step (see
        :meth:`jax_tpusync.OffloadedKVCache.recover`)."""
        return self._each(None, lambda k, c, _: c.recover())

    def commit(self, state: Any):
        """Commits every part (persistent tiers); returns the drained live state."""
        return self._each(state, lambda k, c, s: c.commit(s))

    def check(self, state: Any) -> None:
        """Refuses, changing nothing, what is not a state of this cache: not its kind of
        state (``TypeError``), or one of another structure or that any part refuses
        (``ValueError``, as the part's :meth:`check`)."""
        for key, part_state in self._split(state).items():
            with self._running(key):
                self.parts[key].check(part_state)

    def lengths(self, state: Any) -> np.ndarray:
        """int32[batch]: every global slot's length in ``state`` (the parts holding a slot
        must agree)."""
        states = self._split(state)
        return self._gather(lambda key, part: part.lengths(states[key])).astype(np.int32)

    # -- slot lifecycle ---------------------------------------------------------------------

    def admit(
        self,
        state: Any,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[Any, int | None]:
        """Admits global ``slot`` in every part holding it; returns ``(state, cached)``
        (``cached`` None where this process holds none of them). All parts or none; parts
        whose prefix stores differ all map the prefix the shortest one has (the rule of
        :func:`jax_tpusync.caches.parts.reserve_agreed`)."""
        return admit_by_reservation(self, state, slot, max_tokens, tokens)  # Checks state.

    @contextlib.contextmanager
    def reserving_in(self, state: Any) -> Iterator[None]:
        """Every part's :meth:`~jax_tpusync.caches.protocol.Reservable.reserving_in` its
        own of ``state`` (a host pool with a spill tier demotes out of its pool)."""
        states = self._split(state, check=False)
        with reserving_in_each([self.parts[k] for k in states], list(states.values())):
            yield

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> PartsAdmission:
        """:meth:`admit`'s first half: every holder part reserves ``slot`` (all or none,
        raising), no state changes; then :meth:`admitted` (which cannot be refused) or
        :meth:`cancel`. ``max_cached`` caps the mapped prefix (tokens)."""
        self._check_open()
        holders = dict(self._holders(slot))

        def reserve_each(cap: int | None) -> list:
            found: list[int] = []  # The prefixes the parts reserved so far map.

            def reserve(key):
                part_cap = self._search_cap(key, cap, found)
                with self._running(key):
                    r = self.parts[key].reserve(
                        holders[key], max_tokens, tokens, max_cached=part_cap
                    )
                if r.cached is not None:
                    found.append(r.cached)
                return key, r

            order = self._reserve_order(list(holders))
            done = each_or_none(order, reserve, lambda key, kr: self._cancel({key: kr[1]}))
            return sorted(done, key=lambda kr: list(holders).index(kr[0]))

        done = reserve_agreed(
            reserve_each, lambda done: self._cancel(dict(done)), lambda kr: kr[1].cached, max_cached
        )
        cached = {r.cached for _, r in done} - {None}
        return PartsAdmission(int(slot), dict(done), cached.pop() if cached else None)

    def _cancel(self, admissions: dict) -> None:
        for key, reservation in admissions.items():
            with self._running(key):
                self.parts[key].cancel(reservation)

    def cancel(self, reservation: PartsAdmission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        self._cancel(reservation.admissions)

    def admitted(self, state: Any, reservation: PartsAdmission):
        """The live state once :meth:`reserve` made ``reservation``."""
        states = self._split(state, check=False)
        for key, admission in reservation.admissions.items():
            with self._running(key):
                states[key] = self.parts[key].admitted(states[key], admission)
        return self._assemble(states, state)

    def check_release(self, state: Any, slot: int, tokens: Any = None) -> None:
        """Refuses, changing nothing, a :meth:`release` that a part would refuse."""
        holders = self._holders(slot)
        self._check_release(holders, self._split(state, releasing=slot), tokens)

    def _check_release(self, holders: list, states: dict, tokens: Any) -> None:
        for key, local in holders:
            with self._running(key):
                self.parts[key].check_release(states[key], local, tokens)

    def release(self, state: Any, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None):
        """Frees global ``slot`` in every part holding it, once every one of them accepted
        the arguments (a refusal changes no part)."""
        holders = self._holders(slot)
        states = self._split(state, releasing=slot)
        self._check_release(holders, states, tokens)
        for key, local in holders:
            with self._running(key):
                states[key] = self.parts[key].release(states[key], local, tokens=tokens)
        return self._assemble(states, state)

    def publish_windows(self, state: Any, slot: int) -> int:
        """Every holder part's :meth:`~jax_tpusync.OffloadedKVCache.publish_windows` (each
        head shard or sliding group copies its own window blocks); returns the blocks
        copied, summed."""
        holders = self._holders(slot)
        states = self._split(state)
        copied = 0
        for key, local in holders:
            with self._running(key):
                copied += self.parts[key].publish_windows(states[key], local)
        return copied

    def share_computed(self, state: Any, slot: int) -> int:
        """Every holder part's :meth:`~jax_tpusync.OffloadedKVCache.share_computed` (each
        indexes its own computed blocks; an admission maps the prefix every part holds);
        returns the blocks indexed, summed."""
        holders = self._holders(slot)
        states = self._split(state)
        self._all_active(slot, holders, states, "nothing to share")
        indexed = 0
        for key, local in holders:
            with self._running(key):
                indexed += self.parts[key].share_computed(states[key], local)
        return indexed

    def tokens(self, slot: int) -> np.ndarray:
        """int64[n]: global ``slot``'s recorded token ids (every part holding it records
        the same)."""
        holders = self._holders(slot)
        if not holders:
            raise ValueError(f"slot {slot} is held by no shard of this process")
        key, local = holders[0]
        with self._running(key):
            return self.parts[key].tokens(local)

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        """Records ``ids`` after global ``slot``'s token ids in every part holding it, once
        every one of them accepts them."""
        holders = self._holders(slot)
        self._all_active(slot, holders, None, "admit it first")
        for key, local in holders:
            with self._running(key):
                self.parts[key].extend_tokens(local, ids)

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
        """Bulk-writes one layer's KV host-side, each part its share of the slots (and
        heads, or the layer's group), every share accepted before any part writes (see
        :meth:`jax_tpusync.OffloadedKVCache.load`); returns the live state."""
        states = self._split(state)
        for key, share in self._load_shares(layer, k, v, start, lengths, slot).items():
            with self._running(key):
                states[key] = self.parts[key].load(states[key], **share)
        return self._assemble(states, state)

    def read(
        self,
        state: Any,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ) -> tuple[Any, Any]:
        """Host copies of positions ``[start, stop)`` of global ``slot``'s K and V in
        ``layer``, its parts' heads joined (see :meth:`jax_tpusync.OffloadedKVCache.read`;
        ``raw``: a quantized tier's codes and scales, joined the same way)."""
        where = self._read_parts(layer, slot)
        states = self._split(state)
        pieces = []
        for key, local_layer, local in where:
            with self._running(key):
                pieces.append(
                    self.parts[key].read(states[key], local_layer, local, start, stop, raw=raw)
                )
        return pieces[0] if len(pieces) == 1 else join_head_shards(pieces)

    # -- what the parts hold ----------------------------------------------------------------

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each global slot may hold (0: inactive); a copy."""
        return self._gather(lambda key, part: part.capacity).astype(np.int32)

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """int32[batch] of the parts' common commit (None: not persistent)."""
        if next(iter(self.parts.values())).committed_lengths is None:
            return None
        return self._gather(lambda key, part: part.committed_lengths, common=True).astype(np.int32)

    @property
    def kv_bytes(self) -> int:
        """Bytes the tiers of every part hold for their blocks."""
        return sum(part.kv_bytes for part in self.parts.values())

    @property
    def all_device_bytes(self) -> int:
        """Device memory of the state's staging over every device of every part."""
        return sum(part.all_device_bytes for part in self.parts.values())

    @property
    def prefix_stats(self) -> dict:
        """``{part: its prefix index's counts}`` (each part has its own index)."""
        return {key: part.prefix_stats for key, part in self.parts.items()}

    def verify(self, state: Any = None) -> dict:
        """Every part's :meth:`jax_tpusync.OffloadedKVCache.verify`: ``{part: result}``."""
        self._check_open()
        states = {} if state is None else self._split(state)
        out = {}
        for key, part in self.parts.items():
            with self._running(key):
                out[key] = part.verify(states.get(key))
        return out

    def _reconcile_commits(self) -> None:
        """Re-attach: each part commits on its own, so a crash between two parts' commits
        leaves the parts holding the same slots at different commits; each such set is
        brought to its common one (:func:`jax_tpusync.caches.parts.bring_to_common_commit`,
        logged as a warning naming the part). Parts of disjoint slots have none."""
        together: dict[tuple[int, int], list] = {}
        for key in self.parts:
            rows = self.rows_of(key)
            together.setdefault((rows.start, rows.stop), []).append(key)
        for (lo, hi), keys in together.items():
            if len(keys) < 2:
                continue

            def warn(i, committed, common, torn, keys=keys, lo=lo, hi=hi):
                self._log.warning(
                    "re-attach: %s was left at another commit (lengths %s); the %s %s of slots "
                    "[%d, %d) were left at different commits, bringing them to their common "
                    "lengths %s%s",
                    self._part_name(keys[i]),
                    committed.tolist(),
                    self.part_noun,
                    list(keys),
                    lo,
                    hi,
                    common.tolist(),
                    f", releasing slots {np.flatnonzero(torn).tolist()} of "
                    f"{self._part_name(keys[i])}"
                    if torn.any()
                    else "",
                )

            bring_to_common_commit([self.parts[k] for k in keys], warn)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, state: Any = None) -> None:
        """Closes every part, committing ``state``'s part in each if given (never raises
        for a failed commit; a state that is not this cache's is logged and nothing is
        committed), then what the cache made itself."""
        if self._closed:
            return
        states: dict = {}
        if state is not None:
            try:
                states = self._split(state, check=False)
            except (TypeError, ValueError) as e:
                self._log.error("close(): nothing committed, the state is not this cache's: %s", e)
        self._closed = True
        for key, part in getattr(self, "parts", {}).items():
            with outside_mesh():
                part.close(states.get(key))
        self._close_own()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
