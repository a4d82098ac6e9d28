"""An offloaded KV cache: where each layer's keys and values live, and the jit-carried state.

Tier layout: paged. The cache owns one allocation of a tier holding ``num_blocks`` KV
blocks of ``block_tokens`` token rows per (layer, K|V) (see :mod:`jax_tpusync.blocks`).
A batch *slot* holds a sequence; its row of the state's block table maps its positions to
physical blocks, which the host-side allocator hands out (:meth:`OffloadedKVCache.admit`,
:meth:`~OffloadedKVCache.release`), consecutive where it can: a sequence whose blocks are
consecutive reads a chunk of a layer in one segment per K|V, whatever its length. Fetch and
write-back segments are computed from the table inside ``jit``, and the engine checks
every row against the block it names.

Device side. The state carries ``num_slots = prefetch_depth + 1`` staging slots, each
holding one *unit* (a chunk of ``chunk_len`` tokens of one layer, K and V, all sequences).
``staging_bytes`` bounds them, so device memory does not grow with the context: a layer
longer than a slot is processed in several units with an online-softmax merge. Fetches land
in engine memory and each wait copies its unit into its slot (see :mod:`jax_tpusync.ops`),
so the engine never writes a staging buffer outside the op that holds it.

Resident mode (``resident=True``, or ``"auto"`` when it fits): the staging budget holds the
whole cache, so the state carries every layer's KV on device and the step only writes back
(the tier stays the durable copy); host-side changes to the tier are copied into it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync import (
    backend,
    blocks,
    in_place,
    ops,
    persistence,
    prefix,
    quantize,
    shared_blocks,
    spill,
)
from jax_tpusync.state import (
    INT32_MAX,
    NO_WINDOW,
    CacheSpec,
    KVState,
    dtype_error,
    exact_cast_allowed,
    staging_shape_of,
)
from jax_tpusync.engine import Engine, EngineConfig, page_offset

logger = logging.getLogger(__name__)


# Most units a cache fetches ahead. The walk to the unit ahead is computed in closed form
# (no trace-time loop), so this bounds staging slots, not compile time.
MAX_PREFETCH_DEPTH = 64


def auto_prefetch_depth(tier: str, two_level: bool = False) -> int:
    """``prefetch_depth="auto"``: 1 on a host tier, 3 where a unit is read from a file.

    A host tier's fetch is read inside the wait of the op that needs it (nothing is read
    ahead from memory), so units fetched further ahead only shrink every unit of the
    staging budget and add per-unit work: with 32 MiB of staging, depth 1 against 3 took
    the host-tier decode step from 30 to 25 ms at 8K and from 114 to 85 ms at 32K (4
    layers, 8 KV heads x 64, bf16). A file read runs ahead on the engine's workers, and
    three units in flight absorb a slow one (see the decode benchmark's notes).
    """
    return 1 if tier == "host" and not two_level else 3


# Tokens per KV block unless the cache is given ``block_tokens``; smaller for a short max_len.
DEFAULT_BLOCK_TOKENS = 256


class OffloadedKVCache:
    """A KV cache kept in a host tier and streamed through fixed device staging buffers.

    Args:
      num_layers: decoder layers.
      batch: sequences.
      max_len: tokens one sequence may hold (the most a slot can be admitted for). Every
        segment field the in-graph ops carry (and the positions the attention computes)
        is int32, which bounds it: ``max_len + chunk_len - 1`` must fit int32 for a layer
        that reads the whole context, and the cache's last block index must too. The
        constructor names the condition a larger value breaks.
      num_kv_heads: KV heads (GQA/MQA: fewer than query heads).
      head_dim: head size.
      dtype: cache dtype (bf16, f16 or f32): what the model's K/V hold, and what
        :meth:`read` returns.
      tier_dtype: None (rows stored in ``dtype``), ``"int8"`` or ``"float8_e4m3fn"``:
        K/V rows go to the tier (and through staging) as one-byte codes with one float32
        scale per token per KV head, about half the bytes of bf16 (see
        :mod:`jax_tpusync.quantize`). Quantized on the way out (in the step, and in
        :meth:`load`); attention applies the scales inside its kernels. The current
        step's own tokens attend in full precision.
      tier: ``"host"`` (DRAM) or ``"file"`` (a file in ``path``).
      path: directory of the file tier.
      shm_name: host tier only: back it by POSIX shm so a restarted process re-attaches.
      file_name: file tier only: a persistent file name (re-attached on reopen).
      block_tokens: token rows per KV block, a power of two; default 256 (or the power of
        two at or above max_len, if smaller). A sequence whose blocks are consecutive
        reads a unit in one segment whatever the block size; smaller blocks waste less of
        the last block of each sequence.
      num_blocks: physical KV blocks per (layer, K|V) on the tier; default enough for
        every slot at max_len (``batch * ceil(max_len / block_tokens)``). Fewer: slots are
        admitted with smaller ``max_tokens`` (:meth:`admit`).
      staging_bytes: device memory budget of the state's staging slots, an int in
        ``[1, 2**31 - 1]`` that holds at least one token row per slot. Layers whose KV is
        larger are processed in chunks.
      resident: ``False`` (default): stream the KV through staging units. ``True``: keep
        the whole cache on device in the state's staging, ``[num_layers, 2, batch,
        max_len, *row_shape]``, which must fit ``staging_bytes`` (``num_layers x 2 x batch
        x max_len x row_bytes`` bytes; refused, naming both, if not). ``"auto"``: resident
        when it fits. A resident step fetches nothing: it writes its new tokens back to the
        tier as a streaming step does (same capacity guards, same stale-state refusal) and
        into the resident copy, and attends over the copy, so small caches run at resident
        speed. Host-side changes of the tier (:meth:`load`, :meth:`admit` of a cached
        prefix, :meth:`init`, :meth:`recover`, :meth:`drain` of a state older than the
        latest) are copied into the state they return.
        Not the default, so that a small cache exercises the same streaming path as a large
        one unless asked.
      read_in_place: ``"auto"`` (default), ``True`` or ``False``. On the CPU backend a
        host tier's pool is the step's own memory: with ``True`` (what ``"auto"`` picks
        wherever it applies) each unit is attended to where the pool holds it, with no copy
        into staging (see :mod:`jax_tpusync.in_place`: a host tier of bfloat16 or float32
        rows, not quantized, not two-level, not resident). Such a state allocates no staging
        (``spec.device_bytes`` is 0), so it takes the ``"xla"`` attention only. ``True``
        where it cannot apply is refused, naming why; ``False`` copies every unit into
        staging first, as on an accelerator (and serves ``implementation="pallas"``).
      prefetch_depth: units fetched ahead (1: layer L+1 while layer L computes), an int
        in ``[1, MAX_PREFETCH_DEPTH]`` (64), or ``"auto"``: 1 on a host tier, 3 on a file
        tier or a two-level cache (:func:`auto_prefetch_depth`). When every layer's KV
        fits one staging unit the cache uses at most ``num_layers``
        (``spec.prefetch_depth``): further ahead lies the step after next, which no
        prefetch can serve.
      sliding_window: None, an int for every layer, or a per-layer sequence of
        ``int | None`` (ints in ``[1, 2**31 - 1]``): a sliding layer attends to (and
        fetches) only its last W tokens.
      prefetch_across_steps: the last layer's call fetches the next step's first unit.
        The returned state then has a fetch in flight (into engine memory: dropping the
        state is safe, the next step's wait copies it into staging).
      engine: an :class:`Engine` to use, an :class:`EngineConfig` for a new one, or None
        (a new engine with the default config).
      debug_poison: fill fetch destinations with NaN until each fetch lands (an engine
        bug that served bytes before they landed shows up as NaN).
      model_id: persistent tiers: names the model whose KV this is (None: "unspecified").
        Persisted KV re-attaches only to a cache of the same model_id and geometry.
      verify: persistent tiers: on re-attach, check the committed rows' checksums
        (:meth:`verify`) before returning.
      overwrite: persistent tiers: discard existing data and manifest and start empty,
        instead of refusing data that has no manifest or another geometry/model.
      prefix_salt: what keeps two models' prefix blocks apart (weights name and version);
        default ``model_id``. The cache adds its geometry, dtype and block size itself.
        See :meth:`admit` (``tokens=``) and :mod:`jax_tpusync.prefix`.
      shared_prefix_dir: a directory that several processes (or hosts, on shared
        storage) publish prefix blocks to and import them from: :meth:`release` with
        ``tokens`` writes each full block that has no file there yet, and :meth:`admit`
        with ``tokens`` continues its match there past its own index. See
        :mod:`jax_tpusync.shared_blocks` (one file per block, atomic rename, checksums).
      spill_path: ``tier="host"`` only: a directory for a second, file tier behind the
        DRAM tier (a two-level store, see :mod:`jax_tpusync.spill`). Cached prefix blocks
        that DRAM has no room for are demoted there instead of evicted, and the step reads
        them in place; sequences' own blocks stay in DRAM.
      spill_blocks: blocks per (layer, K|V) on the spill tier, a positive int; default
        ``4 * num_blocks``.
      promote_after: admissions that map a spill block before it is copied back into
        DRAM (at the next one, if DRAM has a free block and no other slot maps it), an
        int >= 1, or None: never. Default 2.

      mesh: a ``jax.sharding.Mesh`` to shard the cache over (returns a
        :class:`jax_tpusync.mesh.ShardedKVCache`): each device keeps the sequences and KV
        heads of its place in the mesh in tier blocks of its own.
      kv_heads_axis: mesh axis the KV heads are split over (tensor parallel), or None.
      batch_axis: mesh axis the batch is split over (data parallel), or None.

    Persistence (``shm_name`` or ``file_name``): see :mod:`jax_tpusync.persistence`. A new
    cache writes a manifest (commit 0); :meth:`commit` records the state's lengths and the
    prefix index; a re-attached cache restores the last commit's lengths as :meth:`init`'s
    default, and its prefix index (shared blocks stay pinned by the slots that map them).

    Raises:
      ValueError: an argument out of its range; the message names it and the range.
      TypeError: ``engine`` of another type.
    """

    def __new__(cls, *args, mesh=None, **kwargs):
        # A mesh cache is a set of these, one per device (jax_tpusync.mesh).
        if mesh is not None and cls is OffloadedKVCache:
            from jax_tpusync.mesh import ShardedKVCache

            return ShardedKVCache(*args, mesh=mesh, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = jnp.bfloat16,
        tier_dtype: Any = None,
        tier: str = "host",
        path: str | os.PathLike | None = None,
        shm_name: str | None = None,
        file_name: str | None = None,
        block_tokens: int | None = None,
        num_blocks: int | None = None,
        staging_bytes: int = 256 << 20,
        resident: bool | str = False,
        read_in_place: bool | str = "auto",
        prefetch_depth: int | str = 1,
        sliding_window: int | Sequence[int | None] | None = None,
        prefetch_across_steps: bool = True,
        engine: Engine | EngineConfig | None = None,
        debug_poison: bool = False,
        model_id: str | None = None,
        verify: bool = True,
        overwrite: bool = False,
        prefix_salt: str | bytes | None = None,
        shared_prefix_dir: str | os.PathLike | None = None,
        spill_path: str | os.PathLike | None = None,
        spill_blocks: int | None = None,
        promote_after: int | None = 2,
        mesh: None = None,
        kv_heads_axis: str | None = None,
        batch_axis: str | None = None,
    ):
        if kv_heads_axis is not None or batch_axis is not None:
            raise ValueError(
                f"kv_heads_axis={kv_heads_axis!r} and batch_axis={batch_axis!r} name axes of "
                f"a mesh: pass mesh= too"
            )
        for name, value in dict(
            num_layers=num_layers,
            batch=batch,
            max_len=max_len,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        ).items():
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if max_len > INT32_MAX:
            raise ValueError(f"max_len={max_len} must be at most 2**31 - 1 (positions are int32)")
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"dtype={dtype} must be bfloat16, float16 or float32")
        tier_dtype = quantize.tier_dtype_of(tier_dtype)
        if tier not in ("host", "file"):
            raise ValueError(f"tier={tier!r} must be 'host' or 'file'")
        if tier == "file" and path is None:
            raise ValueError("tier='file' needs path=<directory>")
        if tier == "host" and (path is not None or file_name is not None):
            raise ValueError("path and file_name apply to tier='file' only")
        if tier == "file" and shm_name is not None:
            raise ValueError("shm_name applies to tier='host' only")
        if isinstance(prefetch_depth, str) and prefetch_depth == "auto":
            prefetch_depth = auto_prefetch_depth(tier, spill_path is not None)
        if not _is_int(prefetch_depth) or not 1 <= prefetch_depth <= MAX_PREFETCH_DEPTH:
            raise ValueError(
                f"prefetch_depth={prefetch_depth!r} must be an int in [1, {MAX_PREFETCH_DEPTH}] "
                f"or 'auto': "
                f"each unit ahead takes a staging slot, and beyond a few units (3 hide a slow "
                f"read in the benchmarks) more slots only shrink every unit"
            )
        if not _is_int(staging_bytes) or not 1 <= staging_bytes <= INT32_MAX:
            raise ValueError(
                f"staging_bytes={staging_bytes!r} must be an int in [1, 2**31 - 1] (a "
                f"segment's memory offset is int32)"
            )
        if engine is not None and not isinstance(engine, (Engine, EngineConfig)):
            raise TypeError(
                f"engine must be an Engine, an EngineConfig or None; got {type(engine).__name__}"
            )
        is_auto = isinstance(resident, str) and resident == "auto"
        if not (isinstance(resident, (bool, np.bool_)) or is_auto):
            raise ValueError(f"resident={resident!r} must be True, False or 'auto'")
        resident = resident if isinstance(resident, str) else bool(resident)
        prefetch_depth = int(prefetch_depth)
        staging_bytes = int(staging_bytes)
        if block_tokens is None:
            block_tokens = min(DEFAULT_BLOCK_TOKENS, 1 << (int(max_len) - 1).bit_length())
        if not _is_int(block_tokens) or block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens={block_tokens!r} must be a power of two (1, 2, 4, ...)")
        block_tokens = int(block_tokens)
        max_blocks = -(-int(max_len) // block_tokens)
        if num_blocks is None:
            num_blocks = batch * max_blocks
        if not _is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
        num_blocks = int(num_blocks)
        windows = _normalize_windows(sliding_window, num_layers)
        spill_blocks = _check_spill(
            tier, spill_path, spill_blocks, promote_after, num_blocks, resident, shm_name, file_name
        )
        if spill_blocks:
            resident = False  # "auto" (True was refused): a spill block has no resident copy.
        if model_id is not None and not isinstance(model_id, str):
            raise ValueError(f"model_id={model_id!r} must be a str or None")
        # Checked before the tier opens, so that a mismatch touches nothing.
        self._persistence = persistence.Persistence.prepare(
            tier=tier,
            path=path,
            shm_name=shm_name,
            file_name=file_name,
            geometry=persistence.Geometry.of(
                num_layers,
                batch,
                max_len,
                num_kv_heads,
                head_dim,
                dtype,
                model_id,
                block_tokens=block_tokens,
                num_blocks=num_blocks,
                tier_dtype=tier_dtype,
            ),
            overwrite=overwrite,
        )
        self._restored_lengths: np.ndarray | None = None  # init()'s default once re-attached.
        self._closed = False
        # Where the attention reads staging in small blocks of rows (CPU), 16-bit KV is staged
        # as uint16 words: XLA's CPU backend slices 16-bit floats element by element but words
        # as fast as any integer (blocks from bfloat16 staging took twice as long).
        staging_dtype = backend.staging_dtype(dtype, tier_dtype is not None)

        self._first_staging: jax.Array | None = None  # Handed to the first init().
        self._owns_engine = not isinstance(engine, Engine)
        if isinstance(engine, Engine):
            if debug_poison and not engine.config.poison_fetches:
                raise ValueError("debug_poison needs an engine made with poison_fetches=True")
            self.engine = engine
        else:
            config = engine or EngineConfig()
            if debug_poison:
                config = dataclasses.replace(config, poison_fetches=True)
            self.engine = Engine(config)

        try:
            if tier_dtype is None:
                row_bytes = num_kv_heads * head_dim * dtype.itemsize
                row_shape = (num_kv_heads, head_dim)
            else:
                row_bytes = quantize.row_bytes(num_kv_heads, head_dim)
                row_shape = (row_bytes,)
            num_slots = prefetch_depth + 1
            longest = max(max_len if w is None else min(max_len, max(w - 1, 1)) for w in windows)
            whole_cache_bytes = num_layers * 2 * batch * max_len * row_bytes
            fits = whole_cache_bytes <= staging_bytes
            if resident is True and not fits:
                raise ValueError(
                    f"resident=True needs the whole cache on device: {num_layers} layers x 2 "
                    f"(K, V) x batch {batch} x max_len {max_len} x {row_bytes} bytes per token "
                    f"row = {whole_cache_bytes} bytes, more than staging_bytes={staging_bytes}"
                )
            resident = bool(fits and resident in (True, "auto"))
            reads_in_place = in_place.decide(
                read_in_place,
                tier=tier,
                dtype=dtype,
                quantized=tier_dtype is not None,
                two_level=bool(spill_blocks),
                resident=resident,
            )
            unit_row_bytes = num_slots * 2 * batch * row_bytes
            chunk_len = longest if resident else staging_bytes // unit_row_bytes
            if chunk_len < 1:
                raise ValueError(
                    f"staging_bytes={staging_bytes} cannot hold one token per slot: "
                    f"{num_slots} slots x 2 (K, V) x batch {batch} x {row_bytes} bytes per "
                    f"token row = {unit_row_bytes} bytes at least"
                )
            chunk_len = min(chunk_len, longest)
            if chunk_len >= longest and prefetch_depth > num_layers:
                # One unit per layer: a unit more than num_layers ahead belongs to the step
                # after next, whose lengths the walk does not know, so every such prefetch
                # would miss. Fewer slots hold the same single units.
                prefetch_depth, num_slots = num_layers, num_layers + 1
            page_rows = 4096 // math.gcd(row_bytes, 4096)
            if page_rows < chunk_len < longest:
                # Whole pages per staging unit keep fetch segments page-aligned at both
                # ends, so O_DIRECT lands them straight in the staging buffer.
                chunk_len -= chunk_len % page_rows
            if chunk_len * row_bytes >= 2**31:
                chunk_len = (2**31 - 1) // row_bytes  # One segment's byte count is int32.
            block_bytes = block_tokens * row_bytes
            tier_blocks = num_layers * 2 * num_blocks
            _check_int32_layout(max_len, windows, chunk_len, block_bytes, tier_blocks, 0)
            if tier == "host":
                tier_index = self.engine.add_host_tier(
                    block_bytes=block_bytes, num_blocks=tier_blocks, shm_name=shm_name
                )
            else:
                # The first state's staging buffer is allocated now, and the data shifted
                # to its offset within a page, so fetches into it skip the bounce buffer.
                # (Where XLA places a buffer depends on the allocator's history; asking
                # for a probe buffer of the same size is not reliable.)
                # Resident: no fetch lands in staging, so the phase does not matter.
                alignment_offset = 0
                if not resident:
                    self._first_staging = jnp.zeros(
                        staging_shape_of(num_slots, batch, chunk_len, row_shape), staging_dtype
                    )
                    alignment_offset = page_offset(self._first_staging) or 0
                tier_index = self.engine.add_file_tier(
                    path,
                    block_bytes=block_bytes,
                    num_blocks=tier_blocks,
                    file_name=file_name,
                    alignment_offset=alignment_offset,
                )
            region_name = "kv" if (shm_name or file_name) else None
            first_block = self.engine.allocate(tier_index, tier_blocks, name=region_name)
            _check_int32_layout(max_len, windows, chunk_len, block_bytes, tier_blocks, first_block)
            spill_tier = spill_first = 0
            if spill_blocks:
                # Fetches from the file land in staging: align them as for a file tier.
                self._first_staging = jnp.zeros(
                    staging_shape_of(num_slots, batch, chunk_len, row_shape), staging_dtype
                )
                spill_tier_blocks = num_layers * 2 * spill_blocks
                _check_int32_layout(max_len, windows, chunk_len, block_bytes, spill_tier_blocks, 0)
                spill_tier = self.engine.add_file_tier(
                    spill_path,
                    block_bytes=block_bytes,
                    num_blocks=spill_tier_blocks,
                    alignment_offset=page_offset(self._first_staging) or 0,
                )
                spill_first = self.engine.allocate(spill_tier, spill_tier_blocks)
                _check_int32_layout(
                    max_len, windows, chunk_len, block_bytes, spill_tier_blocks, spill_first
                )
        except Exception:
            if self._owns_engine:
                self.engine.close()
            raise

        self.spec = CacheSpec(
            num_layers=num_layers,
            batch=batch,
            max_len=max_len,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            windows=windows,
            chunk_len=int(chunk_len),
            num_slots=num_slots,
            prefetch_depth=prefetch_depth,
            block_tokens=block_tokens,
            num_blocks=num_blocks,
            prefetch_across_steps=prefetch_across_steps,
            staging_dtype=staging_dtype,
            tier_dtype=tier_dtype,
            resident=resident,
            spill_blocks=spill_blocks,
            reads_in_place=reads_in_place,
        )
        self.tier = tier_index
        self.first_block = first_block
        self._target = np.asarray(
            [self.engine.id, tier_index, first_block, 0, spill_tier, spill_first], np.int64
        )
        # The slots' blocks, decided here between steps; each state carries a copy. A
        # slot's own blocks are always DRAM blocks (this allocator's).
        self._allocator = blocks.BlockAllocator(num_blocks)
        self._spill: spill.SpillTier | None = None
        index_allocator: Any = self._allocator
        if spill_blocks:
            index_allocator = spill.LevelAllocators(
                self._allocator, blocks.BlockAllocator(spill_blocks)
            )
            self._spill = spill.SpillTier(
                self.engine,
                dram_tier=tier_index,
                spill_tier=spill_tier,
                dram_first=first_block,
                spill_first=spill_first,
                allocators=index_allocator,
                regions=num_layers * 2,
                block_bytes=block_bytes,
                promote_after=promote_after,
            )
        self._prefix = prefix.PrefixIndex(
            index_allocator,
            block_tokens,
            prefix.root_key(
                model_id if prefix_salt is None and model_id is not None else (prefix_salt or ""),
                dict(
                    num_layers=num_layers,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    dtype=dtype.name,
                    block_tokens=block_tokens,
                    layout=persistence.LAYOUT_VERSION,
                    # Quantized blocks hold other bytes for the same tokens.
                    **({} if tier_dtype is None else dict(tier_dtype=tier_dtype.name)),
                ),
            ),
        )
        self._shared_dir = None
        if shared_prefix_dir is not None:
            self._shared_dir = shared_blocks.SharedBlockDirectory(
                shared_prefix_dir,
                root=self._prefix.root,
                num_layers=num_layers,
                block_tokens=block_tokens,
                block_bytes=self.spec.block_bytes,
            )
        # Per slot: leading blocks of its table mapped from the prefix index (read-only).
        self._shared = np.zeros(batch, np.int32)
        self._tables = np.full((batch, self.spec.max_blocks), blocks.NO_BLOCK, np.int32)
        self._capacity = np.zeros(batch, np.int32)
        # Per layer and sequence, the end of the furthest row load() wrote since init().
        self._loaded_extent = np.zeros((num_layers, batch), np.int64)
        # The lengths of the latest state the host made or saw (see recover()).
        self._live_lengths = np.zeros(batch, np.int32)
        # Resident mode: the epoch of the latest state whose copy matches the tier.
        self._resident_epoch: int | None = None
        self._stream = self.engine.open_stream()
        if self._persistence is not None:
            try:
                self._restored_lengths = self._persistence.attach(
                    self, attached=self.engine.tier_info(tier_index).attached, verify=verify
                )
            except Exception:
                if self._owns_engine:
                    self.engine.close()
                raise
        logger.info(
            "offloaded KV cache: %s tier, %.1f MiB of KV, %.1f MiB staging%s, chunk_len=%d",
            tier,
            self.spec.kv_bytes / 2**20,
            self.spec.device_bytes / 2**20,
            " (resident)" if resident else "",
            self.spec.chunk_len,
        )

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
          ValueError: lengths out of range, or too few free blocks to admit every slot.
        """
        spec = self.spec
        if admit:
            empty = [b for b in range(spec.batch) if self._capacity[b] == 0]
            need = len(empty) * spec.max_blocks
            if not self._make_room(need):
                raise ValueError(
                    f"init() admits every slot for max_len={spec.max_len} tokens, which needs "
                    f"{need} KV blocks, but {self._allocator.free_blocks} of "
                    f"{spec.num_blocks} are free; call init(admit=False) and admit() "
                    f"slots with smaller max_tokens"
                )
            for b in empty:
                self._reserve(b, spec.max_len)
        if lengths is None:
            lengths = self._restored_lengths
        if lengths is None:
            lengths = np.zeros(spec.batch, np.int32)
        lengths = np.asarray(lengths)
        if lengths.shape != (spec.batch,):
            raise ValueError(f"lengths must have shape ({spec.batch},); got {lengths.shape}")
        for b in range(spec.batch):
            shared = int(self._shared[b]) * spec.block_tokens
            if lengths[b] < shared:
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} is below slot {b}'s shared prefix of "
                    f"{shared} tokens (blocks other sequences read: decode would write them)"
                )
            if not 0 <= lengths[b] <= self._capacity[b]:
                raise ValueError(
                    f"lengths[{b}]={int(lengths[b])} must be in [0, {int(self._capacity[b])}]"
                    f" (slot {b}'s capacity"
                    + (", inactive: admit it first)" if self._capacity[b] == 0 else ")")
                )
        self._loaded_extent[:] = 0
        if self._persistence is not None:
            self._persistence.note_init(lengths)
        return self._fresh_state(lengths)

    def _fresh_state(self, lengths: np.ndarray) -> KVState:
        """A state of the host's tables and ``lengths``, fresh staging, a new epoch."""
        spec = self.spec
        staging, self._first_staging = self._first_staging, None
        if spec.resident:
            staging = self._resident_copy()
        elif staging is None:
            staging = jnp.zeros(spec.staging_shape, spec.staging_dtype)
        if not spec.resident:
            self._note_staging_phase(staging)
        self._live_lengths = np.asarray(lengths, np.int32).copy()
        owner = self._new_owner()
        self._resident_epoch = int(np.asarray(owner)[1])
        return KVState(
            spec,
            lengths=jnp.asarray(lengths, jnp.int32),
            block_table=jnp.asarray(self._tables),
            capacity=jnp.asarray(self._capacity),
            staging=staging,
            tickets=jnp.full((spec.num_tickets,), ops.NO_TICKET, jnp.int32),
            slot=jnp.zeros((), jnp.int32),
            token=jnp.zeros((), jnp.int32),
            owner=owner,
            target=jnp.asarray(self._target, jnp.int32),
        )

    def _resident_copy(
        self,
        staging: jax.Array | None = None,  # spec.staging_shape; None: build it whole
        *,
        layer: int | None = None,
        slot: int | None = None,
    ) -> jax.Array:  # spec.staging_shape
        """Resident staging holding the tier's rows of ``layer`` and ``slot`` (None: every
        layer, every slot), the others kept from ``staging``.

        Copies every position a slot's blocks hold (up to its capacity, not only its
        length): a later :meth:`load` that extends the lengths refreshes only its own
        layer, so the other layers' rows past the old lengths must already be there.
        """
        spec = self.spec
        layers = range(spec.num_layers) if layer is None else [layer]
        slots = range(spec.batch) if slot is None else [slot]
        buf = np.zeros((len(layers), 2, len(slots), spec.max_len, spec.row_bytes), np.uint8)
        rows = []
        for i, l in enumerate(layers):
            for kv in range(2):
                for j, b in enumerate(slots):
                    mem = ((i * 2 + kv) * len(slots) + j) * spec.max_len * spec.row_bytes
                    for offset, n in self.tier_rows(l, kv, b, 0, int(self._capacity[b])):
                        rows.append((offset, mem, n))
                        mem += n
        if rows:  # Ordered after the write-backs in flight to the same bytes.
            self.engine.wait(self.engine.submit_read(self.tier, rows, buf))
        # The tier's bytes as staging holds them (values, their uint16 words, or raw rows).
        values = buf.view(spec.staging_dtype).reshape(buf.shape[:4] + spec.row_shape)
        if layer is None and slot is None:
            return jnp.asarray(values)
        if layer is None:
            return staging.at[:, :, slot].set(values[:, :, 0])
        if slot is None:
            return staging.at[layer].set(values[0])
        return staging.at[layer, :, slot].set(values[0, :, 0])

    def inert_state(self) -> KVState:
        """A state of this cache's structure that moves no bytes: every slot inactive, an
        unchecked owner, no epoch started.

        For code that must run the model once without decoding: Flax Linen's
        ``model.init`` (which runs the forward pass), tracing, shape checks. A step on it
        computes every slot's new tokens alone and writes nothing to the tier; the live
        state (from :meth:`init`) stays live. (``jax.eval_shape`` of a step runs nothing
        at all, for shapes alone.)
        """
        spec = self.spec
        return KVState(
            spec,
            lengths=jnp.zeros((spec.batch,), jnp.int32),
            block_table=jnp.full((spec.batch, spec.max_blocks), blocks.NO_BLOCK, jnp.int32),
            capacity=jnp.zeros((spec.batch,), jnp.int32),
            staging=jnp.zeros(spec.staging_shape, spec.staging_dtype),
            tickets=jnp.full((spec.num_tickets,), ops.NO_TICKET, jnp.int32),
            slot=jnp.zeros((), jnp.int32),
            token=jnp.zeros((), jnp.int32),
            owner=jnp.zeros((3,), jnp.int32),
            target=jnp.asarray(self._target, jnp.int32),
        )

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
        spec = self.spec
        state = self.drain(state)
        self._check_slot(slot)
        if max_tokens is None:
            max_tokens = spec.max_len
        if not _is_int(max_tokens) or not 1 <= max_tokens <= spec.max_len:
            raise ValueError(
                f"max_tokens={max_tokens!r} must be an int in [1, max_len={spec.max_len}]"
            )
        if self._capacity[slot] > 0:
            raise ValueError(
                f"slot {slot} is active (capacity {int(self._capacity[slot])} tokens); "
                f"release it before admitting another sequence"
            )
        shared: list[int] = []
        if tokens is not None:
            tokens = _token_ids(tokens)
            if len(tokens) > max_tokens:
                raise ValueError(f"tokens has {len(tokens)} ids, more than max_tokens={max_tokens}")
            limit = max(len(tokens) - 1, 0) // spec.block_tokens
            shared = self._prefix.match(tokens, limit)
            if self._shared_dir is not None:
                try:
                    shared += self._import_shared_blocks(tokens, len(shared), limit)
                except Exception:
                    self._prefix.unpin(shared)
                    raise
        try:
            self._reserve(slot, int(max_tokens), shared)
        except Exception:
            self._prefix.unpin(shared)
            raise
        if self._spill is not None and shared:
            try:
                promoted = self._spill.admitted(self._prefix, shared)
            except Exception:
                self.release(state, slot)
                raise
            self._tables[slot, : len(promoted)] = promoted
        cached = len(shared) * spec.block_tokens
        lengths = np.asarray(state.lengths).copy()
        lengths[slot] = cached
        self._loaded_extent[:, slot] = cached
        state = self._with_slots(state, lengths)
        if spec.resident and cached:  # The shared prefix's rows, as the tier holds them.
            state = state.replace(staging=self._resident_copy(state.staging, slot=slot))
        return state, cached

    def release(
        self, state: KVState, slot: int, *, tokens: Sequence[int] | np.ndarray | None = None
    ) -> KVState:
        """Frees ``slot``; the slot becomes inactive (length 0, no I/O).

        Args:
          tokens: the sequence's token ids (at least its length of them: the tokens whose
            KV the slot holds). Given, the slot's full blocks enter the prefix index
            (after its write-backs have completed: the engine is drained first) and stay
            on the tier, cached, for later sequences with the same prefix, until their
            space is needed. Without it the slot's own blocks are freed at once. On a
            persistent tier the slot is committed released first (its private blocks may
            be rewritten); the blocks it indexes join the committed index at the next
            commit.

        Raises:
          ValueError: a bad slot, one that is not active, or too few tokens.
        """
        spec = self.spec
        state = self.drain(state)
        self._check_slot(slot)
        if self._capacity[slot] == 0:
            raise ValueError(f"slot {slot} is not active (nothing to release)")
        length = int(np.asarray(state.lengths)[slot])
        if tokens is not None:
            tokens = _token_ids(tokens)
            if len(tokens) < length:
                raise ValueError(
                    f"tokens has {len(tokens)} ids but slot {slot} holds {length} tokens: "
                    f"pass the ids of every token whose KV it holds"
                )
            self.engine.drain()  # Its blocks are published only once fully written.
        if self._persistence is not None:
            # Its private blocks may be rewritten: commit it gone first. The ones indexed
            # below join the committed index at the next commit (never rewritten meanwhile).
            self._persistence.note_release(slot)
        held = self._tables[slot][self._tables[slot] >= 0]
        shared = int(self._shared[slot])
        if tokens is not None:
            full = length // spec.block_tokens
            if self._shared_dir is not None:
                self._export_shared_blocks(tokens[: full * spec.block_tokens], held[:full])
            duplicates = self._prefix.publish(
                tokens[: full * spec.block_tokens], held[:full], shared
            )
            self._allocator.free(np.asarray(duplicates + held[full:].tolist(), np.int64))
        else:
            self._prefix.unpin(held[:shared])
            self._allocator.free(held[shared:])
        self._tables[slot] = blocks.NO_BLOCK
        self._capacity[slot] = 0
        self._shared[slot] = 0
        lengths = np.asarray(state.lengths).copy()
        lengths[slot] = 0
        self._loaded_extent[:, slot] = 0
        return self._with_slots(state, lengths)

    def _block_rows(self, block: int, at: int = 0) -> list[tuple[int, int, int, int]]:
        """(tier, tier offset, memory offset, bytes) of physical ``block`` in every layer, K
        then V, packed in that order in memory from byte ``at`` (a shared block file's
        payload)."""
        spec = self.spec
        return [
            (*self._locate_block(region, block), at + region * spec.block_bytes, spec.block_bytes)
            for region in range(spec.num_layers * 2)
        ]

    def _export_shared_blocks(self, tokens: np.ndarray, held: np.ndarray) -> None:
        """Publishes the full blocks ``held`` (holding ``tokens``) that the shared
        directory lacks, read from the tier in one request; their write-backs have
        completed (the engine was drained)."""
        keys = self._prefix.keys(tokens)
        missing = [i for i, key in enumerate(keys[: len(held)]) if not self._shared_dir.has(key)]
        if not missing:
            return
        size = self._shared_dir.payload_bytes
        buf = np.empty(len(missing) * size, np.uint8)
        rows = [r for j, i in enumerate(missing) for r in self._block_rows(int(held[i]), j * size)]
        self.engine.transfer(rows, buf, write=False)
        t = self.spec.block_tokens
        for j, i in enumerate(missing):
            parent = keys[i - 1] if i else None
            self._shared_dir.publish(
                keys[i], parent, tokens[i * t : (i + 1) * t], buf[j * size : (j + 1) * size]
            )

    def _import_shared_blocks(self, tokens: np.ndarray, start: int, limit: int) -> list[int]:
        """Blocks ``start`` .. of ``tokens`` (at most ``limit`` in all) found in the shared
        directory, each written into a free block of the tier and indexed, pinned; stops at
        the first block it lacks (or when no block is free)."""
        spec = self.spec
        t = spec.block_tokens
        keys = self._prefix.keys(tokens)[:limit]
        out: list[int] = []
        parent = keys[start - 1] if start else None
        try:
            for i in range(start, len(keys)):
                ids = tokens[i * t : (i + 1) * t]
                payload = self._shared_dir.load(keys[i], parent, ids)
                if payload is None or not self._make_room(1):
                    break
                if self._persistence is not None:  # An evicted block the last commit indexes.
                    self._persistence.note_evicted()
                block = int(self._allocator.allocate(1)[0])
                try:
                    self.engine.transfer(self._block_rows(block), payload, write=True)
                except Exception:
                    self._allocator.free(np.asarray([block], np.int64))
                    raise
                self._prefix.adopt(keys[i], parent, ids, block)
                out.append(block)
                parent = keys[i]
        except Exception:
            self._prefix.unpin(out)  # Those imported stay indexed, cached.
            raise
        return out

    @property
    def prefix_stats(self) -> dict:
        """The prefix index: indexed blocks, cached (unmapped) ones, hits, evictions; with
        a shared directory, the blocks this cache published there and imported from it."""
        p = self._prefix
        stats = dict(
            indexed_blocks=len(p), cached_blocks=p.cached_blocks, hits=p.hits, evictions=p.evictions
        )
        if self._shared_dir is not None:
            stats.update(
                shared_published=self._shared_dir.published,
                shared_imported=self._shared_dir.imported,
            )
        if self._spill is not None:
            stats.update(self._spill.stats())
        return stats

    @property
    def capacity(self) -> np.ndarray:
        """int32[batch]: tokens each slot may hold (0: inactive); a copy."""
        return self._capacity.copy()

    @property
    def block_tables(self) -> np.ndarray:
        """int32[batch, max_blocks]: the slots' physical KV blocks (-1: none); a copy."""
        return self._tables.copy()

    @property
    def free_blocks(self) -> int:
        """Physical KV blocks that neither a slot nor the prefix index holds."""
        return self._allocator.free_blocks

    def _make_room(self, count: int) -> bool:
        """Whether ``count`` (DRAM) blocks are free, after demoting (two-level caches) or
        evicting cached prefix blocks if not."""
        if count > self._allocator.free_blocks and self._spill is not None:
            self._spill.demote(self._prefix, count)
        short = count - self._allocator.free_blocks
        if short > 0:
            in_dram = self._spill.allocators.in_dram if self._spill else None
            self._prefix.evict(short, where=in_dram)
        return count <= self._allocator.free_blocks

    def _reserve(self, slot: int, tokens: int, shared: Sequence[int] = ()) -> None:
        """Gives ``slot`` ``shared`` then fresh blocks for ``tokens``, evicting cached
        prefix blocks if the free ones do not suffice."""
        n = -(-tokens // self.spec.block_tokens)
        fresh = n - len(shared)
        if not self._make_room(fresh):
            raise ValueError(
                f"needs {fresh} KV blocks but only {self._allocator.free_blocks} of "
                f"{self.spec.num_blocks} are free and none is left to evict (the others are "
                f"held by active slots{', or pinned prefix blocks' if len(self._prefix) else ''}); "
                f"release a slot, or make the cache with more num_blocks"
            )
        if self._persistence is not None:  # An evicted block the last commit indexes:
            self._persistence.note_evicted()  # commit it gone before it is rewritten.
        ids = self._allocator.allocate(fresh)
        self._tables[slot] = blocks.NO_BLOCK
        self._tables[slot, : len(shared)] = shared
        self._tables[slot, len(shared) : n] = ids
        self._capacity[slot] = tokens
        self._shared[slot] = len(shared)

    def _restore_slots(
        self,
        tables: np.ndarray,
        capacity: np.ndarray,
        shared: np.ndarray | None = None,
        entries: Sequence[prefix._Entry] = (),
    ) -> None:
        """Re-attach: the slots hold the blocks, capacities and shared prefixes a commit
        recorded (int32[batch, max_blocks], int32[batch] and int32[batch], validated by
        the manifest's reader), and the prefix index its ``entries`` (with their reference
        counts). Their blocks leave the allocator's free extents; raises, changing nothing,
        if one is not free."""
        tables = np.asarray(tables, np.int32).reshape(self._tables.shape)
        capacity = np.asarray(capacity, np.int32).reshape(self._capacity.shape)
        shared = np.zeros_like(self._shared) if shared is None else np.asarray(shared, np.int32)
        # A block several slots map (indexed) is reserved once.
        held = sorted({int(p) for p in tables[tables >= 0]} | {int(e.block) for e in entries})
        self._allocator.reserve(held)
        try:
            self._prefix.restore(entries)
        except Exception:
            self._allocator.free(np.asarray(held, np.int64))
            raise
        self._tables[:] = tables
        self._capacity[:] = capacity
        self._shared[:] = shared.reshape(self._shared.shape)

    def _with_slots(self, state: KVState, lengths: np.ndarray) -> KVState:
        self._live_lengths = np.asarray(lengths, np.int32).copy()
        return state.replace(
            lengths=jnp.asarray(lengths, jnp.int32),
            block_table=jnp.asarray(self._tables),
            capacity=jnp.asarray(self._capacity),
        )

    def _check_slot(self, slot: Any) -> None:
        if not _is_int(slot) or not 0 <= slot < self.spec.batch:
            raise ValueError(f"slot={slot!r} must be an int in [0, batch={self.spec.batch})")

    def _new_owner(self) -> jax.Array:
        """Starts a new epoch of the cache's stream: every earlier state becomes stale and
        their unconsumed prefetches are discarded."""
        epoch = self.engine.begin_epoch(self._stream)
        return jnp.asarray([self._stream, epoch, 1], jnp.int32)

    def _note_staging_phase(self, staging: jax.Array) -> None:
        """Logs when fetches into ``staging`` will go through bounce buffers."""
        info = self.engine.tier_info(self.tier)
        offset = page_offset(staging)
        if not info.dio_alignment or offset is None:
            return
        # dio_alignment divides the page size, so the offset within a page decides.
        phase = (offset - info.alignment_offset) % info.dio_alignment
        if phase:
            logger.info(
                "staging buffer is %d bytes out of phase with the file tier's data: fetches "
                "copy through bounce buffers (correct, slower)",
                phase,
            )

    def _check_state(self, state: KVState) -> None:
        if not isinstance(state, KVState):
            raise TypeError(f"expected a KVState, got {type(state).__name__}")
        if state.lengths.is_deleted():
            raise ValueError(
                "this KVState was donated to a step (its buffers are gone); use the state "
                "that step returned, or cache.recover() if the step failed"
            )
        if state.spec != self.spec or not np.array_equal(np.asarray(state.target), self._target):
            raise ValueError(
                f"state belongs to another cache (target {np.asarray(state.target).tolist()}, "
                f"this cache's is {self._target.tolist()})"
            )

    def drain(self, state: KVState) -> KVState:
        """Discards the prefetches ``state`` carries; returns it as the cache's live state.

        Fetches land in engine-owned memory, so a state may be dropped with fetches in
        flight; call this before handing a state to host-side methods or re-using one whose
        successor was lost (e.g. after a failed step). Every other state of this cache
        becomes stale: the engine refuses its ops. Resident mode: a state from before the
        latest host-side change gets a fresh copy of the tier.
        """
        self._check_state(state)
        jax.block_until_ready(state)  # The step that made it has finished with the engine.
        self._live_lengths = np.asarray(state.lengths).copy()
        owner = self._new_owner()
        staging = state.staging
        if self.spec.resident:
            # Only the latest epoch's copy is known to match the tier: the host may have
            # changed the tier through a later state (load, admit) since an older one's.
            if int(np.asarray(state.owner)[1]) != self._resident_epoch:
                staging = self._resident_copy()
            self._resident_epoch = int(np.asarray(owner)[1])
        return state.replace(
            tickets=jnp.full((self.spec.num_tickets,), ops.NO_TICKET, jnp.int32),
            owner=owner,
            staging=staging,
        )

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
        _settle_failed_steps()
        lengths = self._live_lengths.copy()
        record = self.engine.last_guards(self._stream)
        if record is not None and len(record["lengths"]) == self.spec.batch:
            lengths = np.asarray(record["lengths"], np.int32)
            if record["accepted"] and record["layer"] == self.spec.num_layers - 1:
                lengths = lengths + np.asarray(record["counts"], np.int32)
        self._loaded_extent[:] = 0
        return self._fresh_state(lengths)

    # -- host-side bulk access --------------------------------------------------------------

    def tier_runs(
        self, layer: int, kv: int, slot: int, lo: int, hi: int
    ) -> list[tuple[int, int, int]]:
        """``(tier, tier byte offset, bytes)`` runs holding positions ``[lo, hi)`` of
        ``slot``'s K (``kv=0``) or V (1) in ``layer``, through its block table; consecutive
        blocks merged. ``tier`` is :attr:`tier`, or a two-level cache's spill tier for
        blocks on it. Raises if a position has no block."""
        spec = self.spec
        out = []
        table = self._tables[slot]
        for block, row, n in blocks.row_runs(table, spec.block_tokens, lo, hi, spec.num_blocks):
            tier, offset = self._locate_block(layer * 2 + kv, block)
            out.append((tier, offset + row * spec.row_bytes, n * spec.row_bytes))
        return out

    def tier_rows(self, layer: int, kv: int, slot: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """:meth:`tier_runs` without the tier: ``(tier byte offset, bytes)`` on
        :attr:`tier`. Raises if a position's block is on a two-level cache's spill tier."""
        runs = self.tier_runs(layer, kv, slot, lo, hi)
        if any(tier != self.tier for tier, _, _ in runs):
            raise ValueError(
                f"positions [{lo}, {hi}) of slot {slot} include blocks on the spill tier: "
                f"use tier_runs(), which names each run's tier"
            )
        return [(offset, n) for _, offset, n in runs]

    def _locate_block(self, region: int, block: int) -> tuple[int, int]:
        """(tier, tier byte offset) of table id ``block`` in ``region`` (layer * 2 + K|V)."""
        if self._spill is not None:
            return self._spill.locate(region, block)
        offset = (self.first_block + region * self.spec.num_blocks + block) * self.spec.block_bytes
        return self.tier, offset

    def _segments(self, layer: int, kv: int, start: np.ndarray, counts: np.ndarray):
        """Host segments (tier, tier offset, memory offset, bytes) of rows ``[start[b],
        start[b] + counts[b])`` of every slot, packed slot after slot in memory."""
        rows = []
        mem = 0
        for b in range(self.spec.batch):
            lo, hi = int(start[b]), int(start[b] + counts[b])
            for tier, offset, n in self.tier_runs(layer, kv, b, lo, hi):
                rows.append((tier, offset, mem, n))
                mem += n
        return rows

    def load(
        self,
        state: KVState,
        layer: int,
        k: jax.Array | np.ndarray,
        v: jax.Array | np.ndarray,
        *,
        start: int | Sequence[int] = 0,
        lengths: Sequence[int] | None = None,
    ) -> KVState:
        """Bulk-writes existing KV of one layer to the tier, host-side.

        For experiments that synthesize or load a long context without a prefill.

        Args:
          state: the cache's state; it is drained first (its prefetches may have read
            bytes this call overwrites) and the returned state is the live one.
          layer: which layer.
          k: [batch, n, num_kv_heads, head_dim] keys (after RoPE, as the model caches them).
            Its dtype must be the cache's, or one that converts to it exactly: a float
            dtype with ``np.can_cast(k.dtype, cache_dtype, casting="safe")`` (bfloat16 or
            float16 into a float32 cache). Anything else (float32 into bfloat16, float64,
            integers, complex) is refused: cast it with ``.astype(...)`` if rounding is
            what you want.
          v: [batch, n, num_kv_heads, head_dim] values, same rule.
          start: first position written, per slot or for all; ``>= 0``.
          lengths: per-slot count of rows of ``k``/``v`` to write (ragged), in
            ``[0, n]``; default n. ``start + lengths`` must not exceed the slot's capacity
            (a slot with rows to write must be active).

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
        spec = self.spec
        self._check_state(state)
        if not _is_int(layer) or not 0 <= layer < spec.num_layers:
            raise ValueError(
                f"layer={layer!r} is out of range for a cache of {spec.num_layers} layers"
            )
        k = _as_cache_array("k", k, spec.dtype)
        v = _as_cache_array("v", v, spec.dtype)
        want = (spec.batch, None, spec.num_kv_heads, spec.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or x.shape[0] != spec.batch or x.shape[2:] != want[2:]:
                raise ValueError(
                    f"{name} must be [batch={spec.batch}, n, num_kv_heads="
                    f"{spec.num_kv_heads}, head_dim={spec.head_dim}]; got "
                    f"{x.shape}"
                )
        if k.shape != v.shape:
            raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
        n = k.shape[1]
        starts = _per_sequence("start", start, spec.batch)
        counts = _per_sequence("lengths", n if lengths is None else lengths, spec.batch)
        if (counts < 0).any() or (counts > n).any():
            raise ValueError(f"lengths must be in [0, n={n}]; got {counts}")
        for b in range(spec.batch):
            if starts[b] < 0:
                raise ValueError(f"start={int(starts[b])} of slot {b} must be >= 0")
            shared = int(self._shared[b]) * spec.block_tokens
            if counts[b] and starts[b] < shared:
                raise ValueError(
                    f"rows [{int(starts[b])}, {int(starts[b] + counts[b])}) of slot {b} "
                    f"overlap its shared prefix [0, {shared}): those blocks are read-only"
                )
            if counts[b] and starts[b] + counts[b] > self._capacity[b]:
                raise ValueError(
                    f"start + lengths = {int(starts[b] + counts[b])} of slot {b} would "
                    f"overflow its capacity of {int(self._capacity[b])} tokens"
                    + (" (the slot is inactive: admit it first)" if not self._capacity[b] else "")
                )
        state = self.drain(state)
        if self._persistence is not None:  # Committed rows may change: re-hash them.
            self._persistence.note_rows_written(layer, starts, counts)
        tickets = []
        for kv, x in enumerate((k, v)):
            rows = [x[b, : counts[b]] for b in range(spec.batch)]
            if spec.quantized:  # The bytes the step's write-back would write for them.
                rows = [quantize.quantize_host(r, spec.tier_dtype) for r in rows]
            packed = np.concatenate([r.reshape(-1) for r in rows])
            segments = self._segments(layer, kv, starts, counts)
            # A slot's own blocks are DRAM blocks (the shared prefix was refused above).
            assert all(tier == self.tier for tier, *_ in segments)
            tickets.append(
                self.engine.submit_write(self.tier, [r[1:] for r in segments], packed, layer=layer)
            )
        for t in tickets:
            self.engine.wait(t)
        extent = self._loaded_extent[layer]
        written = counts > 0
        extent[written] = np.maximum(extent[written], (starts + counts)[written])
        # Only rows every layer holds count; a length already past them stays.
        lengths_now = np.asarray(state.lengths).astype(np.int64)
        grown = np.maximum(lengths_now, self._loaded_extent.min(axis=0))
        if (grown != lengths_now).any():
            state = state.replace(lengths=jnp.asarray(grown, jnp.int32))
            self._live_lengths = grown.astype(np.int32)
        if spec.resident:
            state = state.replace(staging=self._resident_copy(state.staging, layer=layer))
        return state

    def read(
        self,
        state: KVState,
        layer: int,
        slot: int,
        start: int = 0,
        stop: int | None = None,
        *,
        raw: bool = False,
    ) -> tuple[np.ndarray, np.ndarray] | tuple[quantize.QuantizedRows, quantize.QuantizedRows]:
        """Host-side copy of positions ``[start, stop)`` of one slot's K and V in ``layer``:
        two [stop - start, num_kv_heads, head_dim] arrays in the cache's dtype (dequantized
        from a quantized tier).

        ``stop`` defaults to the slot's length in ``state``; ``0 <= start <= stop <=
        length``. Drain the state first if it may have write-backs in flight (the engine
        orders this read after them either way). ``raw=True`` (quantized tiers only)
        returns the stored codes and scales instead, as two :class:`QuantizedRows`.
        """
        spec = self.spec
        self._check_state(state)
        self._check_layer(layer)
        self._check_slot(slot)
        length = int(np.asarray(state.lengths)[slot])
        if stop is None:
            stop = length
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= length):
            raise ValueError(
                f"[start, stop) = [{start}, {stop}) must lie in [0, {length}] (slot {slot}'s "
                f"length)"
            )
        if raw and not spec.quantized:
            raise ValueError("raw=True reads codes and scales: this cache's tier is not quantized")
        out = []
        for kv in range(2):
            buf = self._row_buffer((stop - start,))
            rows, mem = [], 0
            for tier, offset, n in self.tier_runs(layer, kv, slot, start, stop):
                rows.append((tier, offset, mem, n))
                mem += n
            self.engine.transfer(rows, buf, write=False)
            out.append(self._from_rows(buf, raw=raw))
        return out[0], out[1]

    def _row_buffer(self, lead: tuple[int, ...]) -> np.ndarray:
        """Zeros for ``lead`` rows as the tier stores them: [*lead, H, D] in the cache's
        dtype, or uint8[*lead, row_bytes] quantized."""
        spec = self.spec
        if spec.quantized:
            return np.zeros((*lead, spec.row_bytes), np.uint8)
        return np.zeros((*lead, spec.num_kv_heads, spec.head_dim), spec.dtype)

    def _from_rows(self, rows: np.ndarray, *, raw: bool = False):
        """Rows read from the tier as KV in the cache's dtype (or codes and scales)."""
        spec = self.spec
        if not spec.quantized:
            return rows
        stored = quantize.unpack_host(rows, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
        if raw:
            return stored
        return quantize.dequantize_host(stored, spec.dtype)

    def read_all(
        self,
        layer: int,
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host-side copy of one layer's K and V of every slot: two [batch, max_len, H, D]
        arrays, through the slots' block tables.

        Positions at or past ``lengths[b]`` (if given; an int or one per slot, in
        ``[0, max_len]``) or past a slot's capacity are zero. For checks and debugging.
        """
        spec = self.spec
        self._check_layer(layer)
        counts = _per_sequence("lengths", spec.max_len if lengths is None else lengths, spec.batch)
        if (counts < 0).any() or (counts > spec.max_len).any():
            raise ValueError(f"lengths must be in [0, max_len={spec.max_len}]; got {counts}")
        counts = np.minimum(counts, self._capacity)
        out = []
        for kv in range(2):
            buf = self._row_buffer((spec.batch, spec.max_len))
            rows = []
            for b in range(spec.batch):
                mem = b * spec.max_len * spec.row_bytes
                for tier, offset, n in self.tier_runs(layer, kv, b, 0, int(counts[b])):
                    rows.append((tier, offset, mem, n))
                    mem += n
            self.engine.transfer(rows, buf, write=False)
            out.append(self._from_rows(buf))
        return out[0], out[1]

    def _check_layer(self, layer: Any) -> None:
        if not _is_int(layer) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(
                f"layer={layer!r} is out of range for a cache of {self.spec.num_layers} layers"
            )

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
        if self._persistence is None:
            self.engine.drain()
            return state
        try:
            self.engine.drain()
        except Exception as e:
            p = self._persistence
            raise persistence.CommitError(
                f"commit {p.commit_number + 1} was not written (the tier keeps commit "
                f"{p.commit_number}, lengths {p.committed_lengths.tolist()}): {e}"
            ) from e
        self._persistence.commit(np.asarray(state.lengths), session=session)
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
        if self._persistence is None:
            raise ValueError("verify() needs a persistent tier (shm_name= or file_name=)")
        if state is not None:
            self._check_state(state)
            self.engine.drain()
        return self._persistence.verify()

    @property
    def committed_lengths(self) -> np.ndarray | None:
        """Per-sequence lengths of the last commit (None: not a persistent tier)."""
        return None if self._persistence is None else self._persistence.committed_lengths

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
        _settle_failed_steps()
        if state is not None:
            try:
                self._commit(state, session="closed")
            except Exception as e:  # noqa: BLE001 - reported; the last commit stands.
                logger.error("final commit failed; the last successful commit stands: %s", e)
        if not self.engine.closed:
            self.engine.close_stream(self._stream)
        if self._owns_engine:
            try:
                self.engine.close()
            except Exception as e:  # noqa: BLE001 - a failed engine still has to close.
                logger.error("closing the engine: %s", e)

    def __enter__(self) -> OffloadedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _settle_at_exit() -> None:
    # Registered after JAX's own exit hook, so it runs first (see _settle_failed_steps).
    _settle_failed_steps(at_exit=True)


def _token_ids(tokens: Any) -> np.ndarray:
    """int64[n] token ids from a sequence of ints (refuses floats, bools, other ranks)."""
    array = np.asarray(tokens)
    if array.ndim != 1 or (
        array.size and not (np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_)
    ):
        raise ValueError(
            f"tokens must be a 1-D sequence of ints; got {array.dtype} of shape {array.shape}"
        )
    return array.astype(np.int64)


def _settle_failed_steps(*, at_exit: bool = False) -> None:
    """Clears a failed step's error from JAX's per-device record of side effects.

    JAX keeps the runtime token of the latest computation with effects (our ops have side
    effects) and blocks on it at interpreter exit, where a step that failed would raise
    again and print tracebacks. A later computation with effects replaces the token, so
    after a failure one tiny one runs on each local device.
    """
    try:
        jax.effects_barrier()
        return
    except Exception as e:  # noqa: BLE001 - a failed step's error, raised to its caller.
        if at_exit:
            logger.warning("a step failed before exit: %s", e)
    for device in jax.local_devices():
        try:
            jax.block_until_ready(_effect_only(jax.device_put(np.int32(0), device)))
        except Exception:  # noqa: BLE001 - best effort: nothing else depends on it.
            pass
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - logged only.
        logger.info("a failed step's error is still in JAX's record of effects")


@jax.jit
def _effect_only(x: jax.Array) -> jax.Array:
    jax.debug.callback(lambda: None, ordered=False)
    return x


def _as_cache_array(name: str, x: Any, dtype: Any) -> np.ndarray:
    """``x`` as a numpy array of the cache's ``dtype``, converted only if exactly."""
    x = np.asarray(x)
    if not exact_cast_allowed(x.dtype, dtype):
        raise ValueError(dtype_error(name, x.dtype, dtype))
    return x.astype(dtype, copy=False)


def _per_sequence(name: str, value: Any, batch: int) -> np.ndarray:
    """int64[batch] from an int or one int per sequence."""
    array = np.asarray(value)
    if array.ndim > 1 or (array.ndim == 1 and array.shape != (batch,)):
        raise ValueError(f"{name} must be an int or {batch} ints (one per sequence); got {value!r}")
    if array.size and not (
        np.issubdtype(array.dtype, np.integer) and not np.issubdtype(array.dtype, np.bool_)
    ):
        raise ValueError(f"{name} must hold ints; got {value!r}")
    return np.broadcast_to(array.astype(np.int64), (batch,))


def _is_int(value: Any) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int32_layout(
    max_len: int,
    windows: Sequence[int | None],
    chunk_len: int,
    block_bytes: int,
    tier_blocks: int,
    first_block: int,
) -> None:
    """Refuses a layout whose segment fields or position arithmetic would leave int32.

    Segments carry (block, offset_in_block, memory_offset, nbytes) as int32: a block's
    bytes must fit, and so must ``first_block + tier_blocks`` (block ``2**31 - 1`` marks a
    traced layer out of range, see ``attention._refuse_bad_layer``). A layer that reads
    the whole context counts its units as ``(span + chunk_len - 1) // chunk_len`` with
    ``span`` up to ``max_len``.
    """
    if block_bytes > INT32_MAX:
        raise ValueError(
            f"a KV block of {block_bytes} bytes does not fit a segment's int32 byte count; "
            f"use a smaller block_tokens"
        )
    if first_block + tier_blocks >= INT32_MAX:
        raise ValueError(
            f"the cache needs {tier_blocks} tier blocks from block {first_block}, past the "
            f"int32 block index of segments (2**31 - 1); use a larger block_tokens or fewer "
            f"num_blocks"
        )
    longest_span = max(max_len if w is None else min(max_len, max(w - 1, 1)) for w in windows)
    if longest_span + chunk_len - 1 > INT32_MAX:
        raise ValueError(
            f"max_len={max_len} is too large for a layer that reads the whole context: its "
            f"unit count needs max_len + chunk_len - 1 = {longest_span + chunk_len - 1} to "
            f"fit int32; at most {INT32_MAX + 1 - chunk_len} with chunk_len={chunk_len}"
        )


def _check_spill(
    tier, spill_path, spill_blocks, promote_after, num_blocks, resident, shm_name, file_name
) -> int:
    """The spill tier's blocks per (layer, K|V) (0: none), after checking its arguments."""
    if spill_path is None:
        if spill_blocks is not None:
            raise ValueError(f"spill_blocks={spill_blocks!r} needs spill_path=<directory>")
        return 0
    if tier != "host":
        raise ValueError(
            f"spill_path puts a file tier behind the DRAM tier: it needs tier='host', not "
            f"{tier!r} (a file tier's blocks are on the file already)"
        )
    if shm_name is not None or file_name is not None:
        raise ValueError(
            "a two-level cache (spill_path) does not persist across restarts: drop shm_name "
            "/ file_name, or use a one-level persistent tier (or shared_prefix_dir)"
        )
    if resident is True:
        raise ValueError("resident=True keeps every block on device: it takes no spill_path")
    if spill_blocks is None:
        spill_blocks = 4 * num_blocks
    if not _is_int(spill_blocks) or spill_blocks < 1:
        raise ValueError(f"spill_blocks={spill_blocks!r} must be a positive int")
    if promote_after is not None and (not _is_int(promote_after) or promote_after < 1):
        raise ValueError(f"promote_after={promote_after!r} must be an int >= 1 or None")
    if num_blocks + spill_blocks > INT32_MAX:
        raise ValueError(
            f"num_blocks + spill_blocks = {num_blocks + spill_blocks} must fit int32 (one id "
            f"space in the block tables)"
        )
    return int(spill_blocks)


def _normalize_windows(sliding_window, num_layers: int) -> tuple[int | None, ...]:
    if sliding_window is None or _is_int(sliding_window):
        windows = (sliding_window,) * num_layers
    elif isinstance(sliding_window, (str, bytes)) or not isinstance(sliding_window, Sequence):
        raise ValueError(
            f"sliding_window={sliding_window!r} must be None, an int or a sequence of "
            f"{num_layers} ints or Nones"
        )
    else:
        windows = tuple(sliding_window)
        if len(windows) != num_layers:
            raise ValueError(f"sliding_window has {len(windows)} entries for {num_layers} layers")
    for layer, w in enumerate(windows):
        if w is not None and (not _is_int(w) or not 1 <= w <= INT32_MAX):
            raise ValueError(
                f"sliding window {w!r} of layer {layer} must be None or an int in "
                f"[1, 2**31 - 1] (positions are int32)"
            )
    return tuple(None if w is None else int(w) for w in windows)
