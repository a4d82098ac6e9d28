"""The offloaded KV cache: one object that owns an engine stream, a tier allocation, the
slot table and the persistence of one cache, and hands out the state a jitted step carries.

What each part does lives in its own module; this class wires them together and keeps the
host-side calls' rules (refuse before changing anything, drain before moving bytes under a
live state, a new epoch for every state it hands out):

* :mod:`jax_tpusync.core.config` — the keyword arguments as checked values;
* :mod:`jax_tpusync.core.layout` — staging units, slots and modes (the :class:`CacheSpec`);
* :mod:`jax_tpusync.caches.offloaded.assembly` — the order the parts below are made in;
* :mod:`jax_tpusync.core.slots` — block tables, allocators, the prefix index, eviction;
* :mod:`jax_tpusync.core.levels` — where block bytes live (tiers, the shared directory);
* :mod:`jax_tpusync.core.host_io` — host-side row reads and writes through the tables, their
  arguments' checks, and how loads grow the lengths;
* :mod:`jax_tpusync.caches.offloaded.live_state` — which state is live (the stream's epochs);
* :mod:`jax_tpusync.caches.admission` — the admission transaction (reserve, then admitted or
  cancel), and :mod:`jax_tpusync.caches.offloaded.admission` this cache's side of it;
* :mod:`jax_tpusync.caches.offloaded.commits` — the lengths a re-attached cache starts from,
  and commits once the engine has drained;
* :mod:`jax_tpusync.persist.commit` — commits, re-attach, verification.

Tier layout: paged. The cache owns one allocation of a tier holding ``num_blocks`` KV
blocks of ``block_tokens`` token rows per (layer, K|V) (see :mod:`jax_tpusync.core.blocks`).
A batch *slot* holds a sequence; its row of the state's block table maps its positions to
physical blocks, consecutive where it can. Device side: the state carries
``prefetch_depth + 1`` staging slots of one *unit* each (``chunk_len`` tokens of one layer,
K and V, all sequences), bounded by ``staging_bytes`` whatever the context length; or the
whole cache (resident mode); or nothing (read in place, CPU).

(Length: under 600 lines for the class, most of them the docstrings that are the cache's
API reference; what is left is wiring, each decision living in the modules above.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_tpusync.caches.admission import AdmissionTransaction
from jax_tpusync.caches.capabilities import TierPart
from jax_tpusync.caches.offloaded import sparse_summaries
from jax_tpusync.caches.offloaded.admission import OffloadedAdmission
from jax_tpusync.caches.offloaded.assembly import (
    checked_config,
    engine_for,
    open_tier,
    persisted_kv_of,
)
from jax_tpusync.caches.offloaded.commits import OffloadedCommits
from jax_tpusync.caches.offloaded.live_state import LiveState
from jax_tpusync.caches.protocol import admit_by_reservation
from jax_tpusync.core import layout
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.host_io import LoadedExtent
from jax_tpusync.core.slots import Admission
from jax_tpusync.core.state import CacheSpec, KVState
from jax_tpusync.persist import commit as persistence
from jax_tpusync.runtime import effects
from jax_tpusync.runtime.engine import Engine, EngineConfig

logger = logging.getLogger(__name__)

# Re-exported: where users and the benchmarks have found them.
from jax_tpusync.core.config import MAX_PREFETCH_DEPTH  # noqa: E402
from jax_tpusync.core.layout import auto_prefetch_depth  # noqa: E402

__all__ = ["MAX_PREFETCH_DEPTH", "OffloadedKVCache", "auto_prefetch_depth"]


class OffloadedKVCache:
    """A KV cache kept in a host tier and streamed through fixed device staging buffers.

    Takes the keyword arguments :meth:`jax_tpusync.core.config.CacheConfig.from_kwargs`
    documents (geometry, tier, staging, prefix store, persistence), or ``config=`` a
    :class:`~jax_tpusync.core.config.CacheConfig` of them (a keyword the config holds too is
    refused by name), plus:

      engine: an :class:`Engine` to use, an :class:`EngineConfig` for a new one, or None
        (a new engine with the default config).
      shard: which shard of a mesh cache this is (0 on one device; set by
        :class:`jax_tpusync.caches.offloaded.mesh.ShardedKVCache`, which is what a mesh takes).

    Persistence (``shm_name`` or ``file_name``): see :mod:`jax_tpusync.persist.commit`. A new
    cache writes a manifest (commit 0); :meth:`commit` records the state's lengths and the
    prefix index; a re-attached cache restores the last commit's lengths as :meth:`init`'s
    default, and its prefix index (shared blocks stay pinned by the slots that map them).

    Raises:
      ValueError: an argument out of its range; the message names it and the range.
      TypeError: ``engine`` of another type.
    """

    def __init__(
        self,
        *,
        config: CacheConfig | None = None,
        engine: Engine | EngineConfig | None = None,
        mesh: None = None,
        kv_heads_axis: str | None = None,
        batch_axis: str | None = None,
        shard: int = 0,
        **options: Any,
    ):
        # Every argument is checked before anything (engine, tier, file) is made.
        config = checked_config(
            config,
            options,
            engine=engine,
            mesh=mesh,
            kv_heads_axis=kv_heads_axis,
            batch_axis=batch_axis,
        )
        spec = layout.plan(config)
        # Checked before the tier opens, so that a mismatch touches nothing.
        self.persistence = persistence.Persistence.prepare_for(config)
        self.config = config
        self.spec = spec
        self._closed = False
        self._owned_levels: list[Any] = []  # Network levels this cache opened (and closes).
        self.engine, self._owns_engine = engine_for(engine, config)
        self._commits = OffloadedCommits(self.persistence, self.engine, spec.batch)
        try:
            self._open(config, shard)
        except Exception:
            if self._owns_engine:
                self.engine.close()
            raise
        logger.info(
            "offloaded KV cache: %s tier, %.1f MiB of KV, %.1f MiB staging%s, chunk_len=%d",
            config.tier.kind,
            spec.kv_bytes / 2**20,
            spec.device_bytes / 2**20,
            " (resident)" if spec.resident else "",
            spec.chunk_len,
        )

    def _open(self, config: CacheConfig, shard: int) -> None:
        """Opens the tier and its parts (:func:`~jax_tpusync.caches.offloaded.assembly.open_tier`),
        the stream the states are epochs of, and re-attaches persisted KV."""
        opened = open_tier(self.engine, config, self.spec, self.persistence, shard)
        self._owned_levels = opened.owned_levels
        self.store, self.slots, self.rows = opened.store, opened.slots, opened.rows
        self.tier = self.store.tier
        self.first_block = self.store.first_block
        self._loads = LoadedExtent(self.spec.num_layers, self.spec.batch)
        self._live = LiveState(
            self.spec, self.engine, opened.target, self.rows, opened.first_staging
        )
        self._admission = AdmissionTransaction(
            self.slots, self._loads, OffloadedAdmission(self._live)
        )
        if self.persistence is not None:
            self._commits.attach(
                persisted_kv_of(self.engine, self.spec, opened),
                attached=self.engine.tier_info(self.tier).attached,
                verify=config.persistence.verify,
            )

    @property
    def batch(self) -> int:
        """Slots (sequences) of the cache."""
        return self.spec.batch

    @property
    def max_len(self) -> int:
        """Tokens one slot may hold at most."""
        return self.spec.max_len

    @property
    def kv_bytes(self) -> int:
        """Bytes the tier holds for the cache's blocks (K and V, every layer; spill blocks
        not counted)."""
        return self.spec.kv_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory of the state's staging (0 for a state read in place)."""
        return self.spec.device_bytes

    @property
    def all_device_bytes(self) -> int:
        """Device memory of the state's staging over every device (one here)."""
        return self.device_bytes

    @property
    def target(self) -> np.ndarray:
        """int64[6]: (engine id, tier, first block, shard, spill tier, spill first block),
        what the state's ``target`` carries (see :class:`KVState`); a copy."""
        return self._live.target.copy()

    # -- state ------------------------------------------------------------------------------

    def init(
        self, lengths: Sequence[int] | np.ndarray | None = None, *, admit: bool = True
    ) -> KVState:
        """A fresh state; ``lengths`` says how many tokens each slot holds.

        Args:
          lengths: per slot; default 0, or the last commit's lengths for a cache that
            re-attached persisted KV. Must be 0 for an inactive slot and at most an active
            slot's capacity.
          admit: admit every slot that has no blocks yet for ``max_len`` tokens (the
            default: a batch of sequences that all may grow to max_len). With False, slots
            keep what they have (a fresh cache: all inactive, for :meth:`admit`).

        Also forgets what :meth:`load` wrote so far (see its Returns). Every earlier state
        of this cache becomes stale.

        Raises:
          ValueError: lengths out of range (the first call after a re-attach: past a
            slot's committed length), or too few free blocks to admit every slot.
        """
        lengths = self._commits.start_lengths(lengths)
        if admit:
            self.slots.admit_all()
        self.slots.check_lengths(lengths)
        self._commits.started(lengths)
        self._loads.reset()
        return self._live.fresh(lengths)

    def inert_state(self) -> KVState:
        """A state of this cache's structure that moves no bytes: every slot inactive, an
        unchecked owner, no epoch started.

        For code that must run the model once without decoding: Flax Linen's
        ``model.init`` (which runs the forward pass), tracing, shape checks. A step on it
        computes every slot's new tokens alone and writes nothing to the tier; the live
        state (from :meth:`init`) stays live. (``jax.eval_shape`` of a step runs nothing
        at all, for shapes alone.)
        """
        return self._live.inert()

    # -- slot lifecycle ---------------------------------------------------------------------

    def admit(
        self,
        state: KVState,
        slot: int,
        *,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
    ):
        """Reserves KV blocks for a new sequence in ``slot``; returns ``(state, cached)``.

        Args:
          state: the cache's live state (drained first).
          slot: an inactive slot, in ``[0, batch)``.
          max_tokens: the most tokens the sequence may hold, in ``[1, max_len]`` (default
            max_len); its capacity. A write past it is refused before any byte moves.
          tokens: the sequence's prompt token ids (ints), at most ``max_tokens`` of them.
            Its longest prefix of full blocks that the prefix index holds (blocks released
            by earlier sequences with the same tokens, see :meth:`release`) is mapped into
            the slot's table instead of fresh blocks, read-only; at most ``len(tokens) - 1``
            tokens, so the prompt's last token is always computed (its logits are needed).

        Returns:
          The state with the slot active at length ``cached``, and ``cached``: tokens of
          the sequence already on the tier (prefill only ``tokens[cached:]``).

        Raises:
          ValueError: a bad slot, max_tokens or tokens, an active slot, or too few blocks
            (free, or cached in the prefix index and not mapped by any slot).
        """
        return admit_by_reservation(self, state, slot, max_tokens, tokens)  # Checks state.

    def reserving_in(self, state: KVState) -> contextlib.AbstractContextManager[None]:
        """Nothing to set: this cache's blocks are on its engine, not in ``state``
        (:meth:`jax_tpusync.caches.protocol.Reservable.reserving_in`)."""
        return self._admission.reserving_in(state)

    def reserve(
        self,
        slot: int,
        max_tokens: int | None = None,
        tokens: Sequence[int] | np.ndarray | None = None,
        *,
        max_cached: int | None = None,
    ) -> Admission:
        """:meth:`admit`'s first half: the slot table admits ``slot`` (or raises, changing
        nothing), no state changes; then :meth:`admitted` (which cannot be refused) or
        :meth:`cancel`. ``max_cached`` caps the mapped prefix (tokens): a cache made of
        several (mesh shards, a hybrid model's layer groups) maps what all of them have."""
        return self._admission.reserve(slot, max_tokens, tokens, max_cached=max_cached)

    def cancel(self, reservation: Admission) -> None:
        """Undoes a :meth:`reserve` that was not :meth:`admitted`."""
        self._admission.cancel(reservation)

    def check_release(self, state: KVState, slot: int, tokens=None) -> None:
        """Refuses, changing nothing, a :meth:`release` of ``slot`` the cache would refuse."""
        self._live.check(state)
        self.slots.check_slot(slot)
        self.slots.check_release(slot, int(np.asarray(state.lengths)[slot]), tokens)

    def admitted(self, state: KVState, reservation: Admission) -> KVState:
        """The live state once the slot table made ``reservation`` (:meth:`admit`'s second
        half, which cannot be refused; a mesh cache admits every shard's slot first)."""
        return self._admission.admitted(state, reservation)

    def release(
        self, state: KVState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> KVState:
        """Frees ``slot``; the slot becomes inactive (length 0, no I/O).

        Args:
          tokens: the sequence's token ids (at least its length of them: the tokens whose
            KV the slot holds; they must agree with its recorded ids, :meth:`tokens`).
            Given, or recorded for its whole length (its prompt and
            :meth:`extend_tokens`), the slot's full blocks enter the prefix index (after
            its write-backs have completed: the engine is drained first) and stay on the
            tier, cached, for later sequences with the same prefix, until their space is
            needed. Otherwise the slot's own blocks are freed at once. On a
            persistent tier the slot is committed released first (its private blocks may
            be rewritten); the blocks it indexes join the committed index at the next
            commit.

        Raises:
          ValueError: a bad slot, one that is not active, or too few tokens.
        """
        self._live.check(state)
        self.slots.check_slot(slot)
        length = int(np.asarray(state.lengths)[slot])
        publishes = self.slots.check_release(slot, length, tokens)  # Refused: no change.
        state = self.drain(state)
        if publishes is not None:
            self.engine.drain()  # Its blocks are published only once fully written.
        self.slots.release(slot, length, tokens)
        self._loads.reset(slot)
        return self._live.with_slot(state, slot, 0)

    def publish_windows(self, state: KVState, slot: int) -> int:
        """A cache that keeps only its sliding window (``max_step_tokens``): copies the full
        blocks ``slot`` completed since its last call, while its ring still holds them, into
        the index of cached windows (:mod:`jax_tpusync.core.window_prefix`), keyed by its
        recorded token ids; a later :meth:`admit` whose prompt starts with them copies the
        window of the longest such prefix into its ring. Call it between the steps of a
        prompt's chunked prefill (:class:`~jax_tpusync.serving.ServingLoop` does): a ring
        overwrites a block once the window has passed it, so by :meth:`release` (which
        publishes the last windows too) the blocks of a shared document's end are gone.
        Returns the blocks copied (0 for a cache that keeps every position: its blocks
        enter the prefix index at release). The state stays live (the engine orders the
        copies after the step's write-backs).
        """
        self._live.check(state)
        self.slots.check_slot(slot)
        jax.block_until_ready(state.lengths)  # The step's write-backs are submitted.
        return self.slots.publish_window(slot, int(np.asarray(state.lengths)[slot]))

    def share_computed(self, state: KVState, slot: int) -> int:
        """:meth:`KVCache.share_computed <jax_tpusync.caches.protocol.KVCache.share_computed>`
        (what :class:`~jax_tpusync.serving.ServingLoop` calls between a prompt's chunks).
        Shared directories get the blocks at :meth:`release`. The state stays live: the
        step that made it has finished (waited for here), and the engine orders later
        reads of those rows after its write-backs. ValueError for a bad or inactive slot, or
        a state of another cache (TypeError: not a state); nothing changes."""
        self._live.check(state)
        self.slots.check_slot(slot)
        jax.block_until_ready(state)  # The step that wrote the rows has finished.
        return self.slots.share_computed(slot, int(np.asarray(state.lengths)[slot]))

    def tokens(self, slot: int) -> np.ndarray:
        """int64[n]: ``slot``'s recorded token ids: its prompt (:meth:`admit`), then what
        :meth:`extend_tokens` added; restored by a re-attach up to the committed length."""
        self.slots.check_slot(slot)
        return self.slots.history.ids(slot)

    def extend_tokens(self, slot: int, ids: Sequence[int] | np.ndarray) -> None:
        """Records ``ids`` after ``slot``'s token ids (a serving loop's sampled tokens, fed
        back as the next step's inputs), so that :meth:`release` publishes its blocks and
        :meth:`commit` persists its ids without the caller keeping them. Refused past the
        slot's capacity, or for an inactive slot."""
        self.slots.extend_history(slot, ids)

    @property
    def prefix_stats(self) -> dict:
        """The prefix index: indexed blocks, cached (unmapped) ones, hits, evictions; with
        a shared directory, the blocks this cache published there, imported from it,
        refused as damaged, and failed publishes; with a spill tier, its moves."""
        return self.slots.stats()

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each slot may hold (0: inactive); a copy."""
        return self.slots.capacity

    @property
    def block_tables(self) -> np.ndarray:
        """int32[batch, max_blocks]: the slots' physical KV blocks (-1: none); a copy."""
        return self.slots.tables

    @property
    def free_blocks(self) -> int:
        """Physical KV blocks that neither a slot nor the prefix index holds."""
        return self.slots.free_blocks

    def check(self, state: KVState) -> None:
        """Refuses, changing nothing, what is not a state of this cache (``TypeError``: not
        a ``KVState``; ``ValueError``: another cache's, or one donated to a step)."""
        self._live.check(state)

    def lengths(self, state: KVState) -> np.ndarray:
        """int32[batch]: the tokens each slot holds in ``state`` (0: inactive)."""
        self._live.check(state)
        return np.asarray(state.lengths).astype(np.int32)

    def drain(self, state: KVState) -> KVState:
        """Discards the prefetches ``state`` carries; returns it as the cache's live state.

        Fetches land in engine-owned memory, so a state may be dropped with fetches in
        flight; call this before handing a state to host-side methods or re-using one whose
        successor was lost (e.g. after a failed step). Every other state of this cache
        becomes stale: the engine refuses its ops. Resident mode: a state from before the
        latest host-side change gets a fresh copy of the tier.
        """
        return self._live.drain(state)

    def recover(self) -> KVState:
        """The cache's live state after a step failed with its state donated.

        A failed step (a slot past its capacity, a stale state, an engine error) leaves the
        caller without a state: the one it passed was donated. The block tables and
        capacities are the host's; the lengths come from the engine's record of the latest
        write-back's capacity guards in the current epoch: a step whose last layer's
        write-back was accepted added its tokens, any other step added none (rows an
        unfinished step wrote past the lengths are never read, and the next step
        overwrites them). Without such a record (no step ran since the state the host last
        saw), the lengths are that state's.

        The returned state starts a new epoch (every other state becomes stale) and has
        fresh staging. Also clears the failed step's error from JAX's record of effects,
        which would otherwise raise again at interpreter exit.
        """
        effects.settle_failed_steps()
        lengths = self._live.recovered_lengths()
        self._loads.reset()
        return self._live.fresh(lengths)

    # -- host-side bulk access --------------------------------------------------------------

    def tier_runs(
        self, layer: int, kv: int, slot: int, lo: int, hi: int
    ) -> list[tuple[int, int, int]]:
        """``(tier, tier byte offset, bytes)`` runs holding positions ``[lo, hi)`` of
        ``slot``'s K (``kv=0``) or V (1) in ``layer``, through its block table; consecutive
        blocks merged. ``tier`` is :attr:`tier`, or a two-level cache's spill tier for
        blocks on it. Raises if a position has no block."""
        return self.rows.runs(layer, kv, slot, lo, hi)

    def tier_rows(self, layer: int, kv: int, slot: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """:meth:`tier_runs` without the tier: ``(tier byte offset, bytes)`` on
        :attr:`tier`. Raises if a position's block is on a two-level cache's spill tier."""
        return self.rows.tier_rows(layer, kv, slot, lo, hi)

    def load(
        self,
        state: KVState,
        layer: int,
        k: jax.Array | np.ndarray,
        v: jax.Array | np.ndarray,
        *,
        start: int | Sequence[int] = 0,
        lengths: Sequence[int] | None = None,
        slot: int | None = None,
    ) -> KVState:
        """Bulk-writes existing KV of one layer to the tier, host-side.

        For experiments that synthesize or load a long context without a prefill.

        Args:
          state: the cache's state; it is drained first (its prefetches may have read
            bytes this call overwrites) and the returned state is the live one.
          layer: which layer.
          k: [batch, n, num_kv_heads, head_dim] keys (after RoPE, as the model caches them),
            of the cache's dtype or one that converts to it exactly
            (:func:`jax_tpusync.core.state.exact_cast_allowed`; cast it yourself otherwise).
          v: [batch, n, num_kv_heads, head_dim] values, same rule.
          start: first position written, per slot or for all; ``>= 0``.
          lengths: per-slot count of rows of ``k``/``v`` to write (ragged), in
            ``[0, n]``; default n. ``start + lengths`` must not exceed the slot's capacity
            (a slot with rows to write must be active).
          slot: one slot's rows only: ``k``/``v`` are then [n, num_kv_heads, head_dim],
            written from position ``start`` (an int) of that slot; no other slot changes.

        Returns:
          The state, whose lengths never shrink: sequence ``b``'s length becomes the
          largest of its current length and the position every layer has been loaded up
          to (per layer, the end of its furthest load of ``b`` since :meth:`init`; a load
          of 0 rows leaves it as it was). So loading every layer up to ``start +
          lengths`` sets the lengths there, and patching rows of a context that decode has
          already extended leaves them as they are.

        Raises:
          ValueError: an argument out of range, or a dtype that would not convert exactly.
        """
        self._live.check(state)
        k, v, starts, counts, skip = self.rows.prepare_load(
            layer, k, v, start, lengths, slot, state.lengths, self._loads
        )  # Refused: no change.
        before = np.asarray(state.lengths).copy()
        if self.persistence is not None:  # Committed rows may change: commit them gone.
            jax.block_until_ready(state)  # The step that made it has finished writing.
            self.persistence.note_rows_written(layer, starts, counts)
        state = self.drain(state)
        self.rows.write(layer, k, v, starts, counts, skip)
        self._loads.record(layer, starts, counts)
        # Only rows every layer holds count; a length already past them stays.
        lengths_now = np.asarray(state.lengths)
        grown = self._loads.grown(lengths_now)
        if (grown != lengths_now).any():
            state = self._live.with_lengths(state, grown)
        if self.spec.resident:
            state = state.replace(staging=self.rows.resident_copy(state.staging, layer=layer))
        if self.spec.sparse is not None:  # The loaded blocks' summaries, from the tier.
            valid = np.zeros((self.spec.num_layers, self.spec.batch), np.int64)
            valid[layer] = np.maximum(self._loads.furthest(layer, before), before)
            spans = [
                (layer, b, int(starts[b]), int(starts[b] + counts[b]))
                for b in range(self.spec.batch)
            ]
            sparse = sparse_summaries.refreshed(
                self.spec, self.rows, state.sparse, self.slots.tables, spans, valid
            )
            state = state.replace(sparse=sparse)
        return state

    def sparse_stats(self, state: KVState) -> dict:
        """A sparse cache's decode steps since ``state``'s :meth:`init`: per layer, the
        blocks its prediction fetched ahead (``predicted``), those the exact selection
        held too (``hits``; ``hit_rate = hits / predicted``), those fetched late (``late``:
        exact, not predicted) and read for nothing (``wasted``: predicted, not exact), the
        context blocks a dense step reads (``context_blocks``), and their bytes
        (``summaries`` scored, ``predicted`` and ``late`` blocks read, K and V, against
        ``dense``); over all layers, ``bytes``, ``read_share`` (read / dense) and
        ``bytes_per_step``. Only layers that select count (sliding layers read their
        window densely), and only decode steps (``q_len == 1``).

        Raises:
          ValueError: the cache is not sparse (``sparse=``), or ``state`` is not its own.
        """
        self._live.check(state)
        if self.spec.sparse is None:
            raise ValueError("sparse_stats() needs a sparse cache (made with sparse=...)")
        return sparse_summaries.sparse_stats(self.spec, state)

    def read(
        self,
        state: KVState,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ):
        """Host-side copy of positions ``[start, stop)`` of one slot's K and V in ``layer``:
        two [stop - start, num_kv_heads, head_dim] arrays in the cache's dtype (dequantized
        from a quantized tier).

        ``stop`` defaults to the slot's length in ``state``; ``0 <= start <= stop <=
        length``. Drain the state first if it may have write-backs in flight (the engine
        orders this read after them either way). ``raw=True`` (quantized tiers only)
        returns the stored codes and scales instead, as two :class:`QuantizedRows`.
        """
        self._live.check(state)
        return self.rows.checked_read(np.asarray(state.lengths), layer, slot, start, stop, raw=raw)

    def kept_from(self, state: KVState) -> np.ndarray:
        """int64[batch]: each slot's first position the tier still holds: 0, or for a
        cache that keeps only its window (``max_step_tokens``) the window's first cached
        key (:func:`jax_tpusync.core.window_ring.kept_from`)."""
        return self.rows.kept_from(np.asarray(state.lengths))

    def read_all(
        self,
        layer: int,
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host-side copy of one layer's K and V of every slot: two [batch, max_len, H, D]
        arrays, through the slots' block tables.

        Positions at or past ``lengths[b]`` (if given; an int or one per slot, in
        ``[0, max_len]``) or past a slot's capacity are zero; so are, in a cache that keeps
        only its window (``max_step_tokens``), the positions before the window of a slot
        of ``lengths[b]`` tokens. For checks and debugging.
        """
        return self.rows.checked_read_all(layer, lengths)

    # -- persistence ------------------------------------------------------------------------

    def commit(self, state: KVState) -> KVState:
        """Makes ``state``'s rows durable and records its lengths; call between steps.

        Drains the state's fetches and the engine (raising a failed write-back's error),
        syncs the data (file tier), checksums the newly committed rows and atomically
        replaces the manifest. A re-attached cache starts from the last commit. On a
        non-persistent tier it only drains.

        Returns:
          The drained state: continue with it (the state passed in must not be reused).

        Raises:
          persistence.CommitError: the commit was not made (e.g. a write-back failed); the
            manifest still holds the previous commit.
        """
        return self._commit(state, session="open")

    def _commit(self, state: KVState, *, session: str) -> KVState:
        state = self.drain(state)
        self._commits.commit(np.asarray(state.lengths), session=session)
        return state

    def verify(self, state: KVState | None = None) -> persistence.VerifyResult:
        """Re-reads the committed rows and the committed prefix index's blocks and checks
        them against the manifest's checksums.

        Args:
          state: optional; when given it must belong to this cache, and the engine is
            drained first so that transfers in flight have ended.

        Raises:
          persistence.ChecksumMismatchError: naming the chunk (layer, K|V, sequence, rows)
            or the indexed block (layer, K|V, physical block).
          ValueError: the cache is not on a persistent tier.
        """
        if self.persistence is None:
            raise ValueError("verify() needs a persistent tier (shm_name= or file_name=)")
        if state is not None:
            self._live.check(state)
            self.engine.drain()
        return self.persistence.verify()

    def restart_at(self, lengths: np.ndarray, tokens: Sequence[np.ndarray] | None = None) -> None:
        """A re-attached cache starts (``init()``'s default) from ``lengths``, at most the
        committed ones and at least each slot's shared prefix, committed now: what a mesh
        or hybrid cache does to bring the parts that a crash left at different commits to
        their common rows (shorter committed rows stay covered by the checksums). Each
        slot's token ids are cut at its new length, or set to ``tokens[b]`` (at most
        ``lengths[b]`` ids: the ids every part agrees on), so that no id past the rows kept
        is taken for theirs. Raises (ValueError, CommitError), changing nothing."""
        self._commits.restart_at(self.slots, self.spec.block_tokens, lengths, tokens)

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """Per-sequence lengths of the last commit (None: not a persistent tier)."""
        return None if self.persistence is None else self.persistence.committed_lengths

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, state: KVState | None = None) -> None:
        """Commits ``state`` if given (persistent tiers), then closes the engine if the
        cache made it (waits for running transfers).

        Never raises for a failed engine or commit: it logs the error, and a re-opened cache
        restores the last commit that succeeded. Without a state nothing is committed, and
        the next session is told that rows past the last commit were dropped.
        """
        if self._closed:
            return
        self._closed = True
        effects.settle_failed_steps()
        if state is not None:
            try:
                self._commit(state, session="closed")
            except Exception as e:  # noqa: BLE001 - reported; the last commit stands.
                logger.error("final commit failed; the last successful commit stands: %s", e)
        for level in self._owned_levels:
            level.close()
        self._live.close()
        if self._owns_engine:
            try:
                self.engine.close()
            except Exception as e:  # noqa: BLE001 - a failed engine still has to close.
                logger.error("closing the engine: %s", e)

    def __enter__(self) -> OffloadedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- capabilities (jax_tpusync.caches.capabilities) --------------------------------------

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """One head range, every head: one device's pool holds them all."""
        return [(0, self.spec.num_kv_heads)]

    @property
    def shard_spec(self) -> CacheSpec:
        """The spec of the one head range's pool: this cache's own."""
        return self.spec

    def tier_parts(self) -> list[TierPart]:
        """This cache itself: every head and every slot, in its tier's pool."""
        return [TierPart(None, self, slice(0, self.spec.num_kv_heads), slice(0, self.batch))]
