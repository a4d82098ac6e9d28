"""A cache's configuration as values: frozen dataclasses, each checked when it is made.

:class:`CacheConfig` gathers what :class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache` takes as
keywords (:meth:`CacheConfig.from_kwargs` is that constructor's parser), grouped by concern:

* :class:`KVGeometry`: layers, batch, heads, dtypes, windows, blocks — what the KV is;
* the tier, a value: :class:`HostTier` (DRAM, optionally a named ``/dev/shm`` segment),
  :class:`FileTier` (a file in a directory) or :class:`TwoLevelTier` (DRAM over a spill
  file);
* :class:`StagingConfig`: the device budget and how units move through it;
* :class:`PrefixConfig`: the prefix store's salt and shared directory;
* :class:`PersistenceConfig`: what a persistent tier checks on re-attach.

Everything here is checked before the cache creates anything (engine, tier, file or
directory), so that a refused configuration leaves nothing behind. Turning a configuration
into sizes is :mod:`jax_tpusync.core.layout`'s job.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import prefix, quantize, window_ring
from jax_tpusync.core.state import INT32_MAX, row_bytes_of, row_shape_of
from jax_tpusync.sparse.config import SparseConfig

# Most units a cache fetches ahead. The walk to the unit ahead is computed in closed form
# (no trace-time loop), so this bounds staging slots, not compile time.
MAX_PREFETCH_DEPTH = 64

# Tokens per KV block unless the cache is given ``block_tokens``; smaller for a short max_len.
DEFAULT_BLOCK_TOKENS = 256

KV_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float16))


def is_int(value: Any) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """What the cached KV is: its shape per layer and how the tier blocks it."""

    num_layers: int
    batch: int
    max_len: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16
    tier_dtype: Any = None  # None, or the one-byte codes' dtype (see jax_tpusync.core.quantize)
    windows: tuple[int | None, ...] | int | None = None  # per layer; None: global
    block_tokens: int | None = None  # None: DEFAULT_BLOCK_TOKENS, or less for a short max_len
    num_blocks: int | None = None  # None: every slot at max_len (or its ring)
    # Most rows one step appends to a slot, when every layer shares one sliding window:
    # each slot then keeps a ring of blocks covering its window (jax_tpusync.core.window_ring).
    # None: every slot keeps max_len tokens.
    step_tokens: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "batch", "max_len", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if name in ("num_kv_heads", "head_dim") and isinstance(value, (list, tuple)):
                raise ValueError(
                    f"{name}={value!r} gives one value per layer: a cache whose layers differ "
                    f"in KV geometry is a jax_tpusync.HybridKVCache (jax_tpusync.kv_cache() "
                    f"picks it)"
                )
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
            object.__setattr__(self, name, int(value))
        if self.max_len > INT32_MAX:
            raise ValueError(
                f"max_len={self.max_len} must be at most 2**31 - 1 (positions are int32)"
            )
        dtype = np.dtype(self.dtype)
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype={dtype} must be bfloat16, float16 or float32")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "tier_dtype", quantize.tier_dtype_of(self.tier_dtype))
        object.__setattr__(self, "windows", normalize_windows(self.windows, self.num_layers))
        block_tokens = self.block_tokens
        if block_tokens is None:
            block_tokens = default_block_tokens(self.max_len)
        if not is_int(block_tokens) or block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens={block_tokens!r} must be a power of two (1, 2, 4, ...)")
        object.__setattr__(self, "block_tokens", int(block_tokens))
        if self.step_tokens is not None:
            self._check_ring()
        num_blocks = self.num_blocks
        if num_blocks is None:
            num_blocks = self.batch * self.slot_blocks
        if not is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
        object.__setattr__(self, "num_blocks", int(num_blocks))

    def _check_ring(self) -> None:
        step = self.step_tokens
        if not is_int(step) or not 1 <= step <= self.max_len:
            raise ValueError(
                f"max_step_tokens={step!r} must be an int in [1, max_len={self.max_len}]"
            )
        object.__setattr__(self, "step_tokens", int(step))

    @property
    def bounds_windows(self) -> bool:
        """Whether sliding layers keep only their window (``max_step_tokens`` given, and a
        layer has a window): one ring per slot in one cache, one per sliding group in a
        hybrid cache."""
        return self.step_tokens is not None and any(w is not None for w in self.windows)

    def check_one_cache(self) -> None:
        """Refuses what one cache (one geometry, one ring) cannot hold: ``max_step_tokens``
        where the layers do not all share one sliding window. Such a model is a
        :class:`~jax_tpusync.HybridKVCache`, one group per kind of layer, which
        :func:`jax_tpusync.kv_cache` makes from the same configuration."""
        if self.step_tokens is not None and (
            len(set(self.windows)) != 1 or self.windows[0] is None
        ):
            raise ValueError(
                f"max_step_tokens={self.step_tokens} keeps only each slot's window, which in "
                f"one cache needs every layer to share one sliding window; the cache's "
                f"windows are {sorted(set(self.windows), key=str)}: jax_tpusync.kv_cache() "
                f"makes the cache of such a model (a HybridKVCache, one group per kind of "
                f"layer)"
            )

    @property
    def ring_blocks(self) -> int:
        """Blocks of each slot's ring (jax_tpusync.core.window_ring), or 0: no ring (as one
        cache; :meth:`check_one_cache` refuses ``max_step_tokens`` of mixed windows)."""
        if self.step_tokens is None or len(set(self.windows)) != 1 or self.windows[0] is None:
            return 0
        return window_ring.ring_blocks(self.windows[0], self.step_tokens, self.block_tokens)

    @property
    def max_blocks(self) -> int:
        """Block table entries per slot: the blocks of max_len tokens."""
        return -(-self.max_len // self.block_tokens)

    @property
    def slot_blocks(self) -> int:
        """Blocks one slot holds at most: its ring, or the blocks of max_len tokens."""
        return min(self.ring_blocks, self.max_blocks) if self.ring_blocks else self.max_blocks

    @property
    def quantized(self) -> bool:
        return self.tier_dtype is not None

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) row on the tier (computed by
        :func:`~jax_tpusync.core.state.row_bytes_of`, as the spec's is)."""
        return row_bytes_of(self.num_kv_heads, self.head_dim, self.dtype, self.tier_dtype)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """A staged row: [num_kv_heads, head_dim] values, or [row_bytes] quantized."""
        return row_shape_of(self.num_kv_heads, self.head_dim, self.dtype, self.tier_dtype)

    def spec_fields(self) -> dict[str, Any]:
        """The :class:`~jax_tpusync.core.state.CacheSpec` fields this geometry decides (the
        others are the layout's: chunking, prefetch, residency)."""
        return dict(
            num_layers=self.num_layers,
            batch=self.batch,
            max_len=self.max_len,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            windows=self.windows,
            block_tokens=self.block_tokens,
            num_blocks=self.num_blocks,
            tier_dtype=self.tier_dtype,
            step_tokens=self.step_tokens or 0,
        )


def check_not_empty(name: str, value: Any, what: str) -> None:
    """Refuses, by name, an empty name or path (``""``): it names nothing (an empty shm or
    file name, or the current directory by accident), so it is never taken for one.

    Args:
      name: the keyword, as the caller passed it.
      value: its value (None: not given; other types are the consumer's to check).
      what: what it must be, for the message (``"str"``, ``"path (a directory)"``).
    """
    if isinstance(value, (str, bytes, os.PathLike)) and not os.fspath(value):
        raise ValueError(f"{name}={value!r} must be a non-empty {what} or None")


def check_prefix_salt(salt: Any) -> None:
    """Refuses, by name, an empty prefix salt (``""`` or ``b""``): it keeps nothing apart,
    and given with a model_id it would drop the model_id the salt defaults to, mixing this
    model's prefix blocks with every other's."""
    if isinstance(salt, (str, bytes)) and not salt:
        raise ValueError(
            f"prefix_salt={salt!r} must be a non-empty str or bytes, or None (None: the "
            f"model_id)"
        )


@dataclasses.dataclass(frozen=True)
class HostTier:
    """Host DRAM: an anonymous pool, or a named ``/dev/shm`` segment that a restarted
    process re-attaches to (``shm_name``)."""

    shm_name: str | None = None

    kind = "host"

    def __post_init__(self):
        check_not_empty("shm_name", self.shm_name, "str")

    @property
    def persistent(self) -> bool:
        return self.shm_name is not None


@dataclasses.dataclass(frozen=True)
class FileTier:
    """One file in directory ``path`` (local SSD or shared storage); a ``file_name``
    makes it persistent (re-attached on reopen)."""

    path: str | os.PathLike
    file_name: str | None = None

    kind = "file"

    def __post_init__(self):
        if self.path is None:
            raise ValueError("tier='file' needs path=<directory>")
        check_not_empty("path", self.path, "path (a directory)")
        check_not_empty("file_name", self.file_name, "str")

    @property
    def persistent(self) -> bool:
        return self.file_name is not None


@dataclasses.dataclass(frozen=True)
class TwoLevelTier:
    """DRAM over a spill file in ``spill_path`` (see :mod:`jax_tpusync.core.spill`): cached
    prefix blocks that DRAM has no room for are demoted there instead of evicted.

    ``spill_blocks``: blocks per (layer, K|V) on the spill file (None: 4x the DRAM tier's);
    ``promote_after``: admissions mapping a spill block before it is copied back to DRAM
    (None: never)."""

    spill_path: str | os.PathLike
    spill_blocks: int | None = None
    promote_after: int | None = 2

    kind = "host"
    persistent = False
    shm_name = None

    def __post_init__(self):
        check_not_empty("spill_path", self.spill_path, "path (a directory)")
        if self.spill_blocks is not None and (
            not is_int(self.spill_blocks) or self.spill_blocks < 1
        ):
            raise ValueError(f"spill_blocks={self.spill_blocks!r} must be a positive int")
        if self.promote_after is not None and (
            not is_int(self.promote_after) or self.promote_after < 1
        ):
            raise ValueError(f"promote_after={self.promote_after!r} must be an int >= 1 or None")

    def blocks_for(self, num_blocks: int) -> int:
        """Spill blocks per (layer, K|V) behind ``num_blocks`` DRAM blocks."""
        spill = 4 * num_blocks if self.spill_blocks is None else int(self.spill_blocks)
        if num_blocks + spill > INT32_MAX:
            raise ValueError(
                f"num_blocks + spill_blocks = {num_blocks + spill} must fit int32 (one id "
                f"space in the block tables)"
            )
        return spill


Tier = HostTier | FileTier | TwoLevelTier


@dataclasses.dataclass(frozen=True)
class StagingConfig:
    """The device side: the staging budget and how units move through it (see
    :class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache` for each field)."""

    staging_bytes: int = 256 << 20
    resident: bool | str = False
    read_in_place: bool | str = "auto"
    prefetch_depth: int | str = "auto"
    prefetch_across_steps: bool = True
    debug_poison: bool = False

    def __post_init__(self):
        depth = self.prefetch_depth
        if not (isinstance(depth, str) and depth == "auto") and (
            not is_int(depth) or not 1 <= depth <= MAX_PREFETCH_DEPTH
        ):
            raise ValueError(
                f"prefetch_depth={depth!r} must be an int in [1, {MAX_PREFETCH_DEPTH}] "
                f"or 'auto': "
                f"each unit ahead takes a staging slot, and beyond a few units (3 hide a slow "
                f"read in the benchmarks) more slots only shrink every unit"
            )
        if not is_int(self.staging_bytes) or not 1 <= self.staging_bytes <= INT32_MAX:
            raise ValueError(
                f"staging_bytes={self.staging_bytes!r} must be an int in [1, 2**31 - 1] (a "
                f"segment's memory offset is int32)"
            )
        object.__setattr__(self, "staging_bytes", int(self.staging_bytes))
        resident = self.resident
        is_auto = isinstance(resident, str) and resident == "auto"
        if not (isinstance(resident, (bool, np.bool_)) or is_auto):
            raise ValueError(f"resident={resident!r} must be True, False or 'auto'")
        object.__setattr__(self, "resident", resident if is_auto else bool(resident))
        choice = self.read_in_place
        if not (isinstance(choice, bool) or (isinstance(choice, str) and choice == "auto")):
            raise ValueError(f"read_in_place={choice!r} must be True, False or 'auto'")


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """The prefix store: ``salt`` keeps two models' blocks apart (default: the model id);
    ``shared_dir`` is a directory other processes publish blocks to and import them from;
    ``remote`` a network level past both (a ``RemoteLevel`` object, or
    ``"mooncake://host:port[?options]"`` for a Mooncake Store, see
    :mod:`jax_tpusync.mooncake.level`)."""

    salt: str | bytes | None = None
    shared_dir: str | os.PathLike | None = None
    remote: Any = None

    def __post_init__(self):
        check_prefix_salt(self.salt)
        check_not_empty("shared_prefix_dir", self.shared_dir, "path (a directory)")
        if isinstance(self.remote, str) and not self.remote.startswith("mooncake://"):
            raise ValueError(
                f"remote_prefix={self.remote!r} must be a 'mooncake://host:port' address or a "
                f"RemoteLevel object"
            )
        if self.shared_dir is not None and os.path.exists(self.shared_dir):
            if not os.path.isdir(self.shared_dir):
                raise ValueError(
                    f"shared_prefix_dir={os.fspath(self.shared_dir)!r} exists and is not a "
                    f"directory"
                )


@dataclasses.dataclass(frozen=True)
class PersistenceConfig:
    """What a persistent tier's re-attach checks: the model id, the checksums (``verify``),
    or nothing at all (``overwrite``: start empty)."""

    model_id: str | None = None
    verify: bool = True
    overwrite: bool = False

    def __post_init__(self):
        if self.model_id is not None and not isinstance(self.model_id, str):
            raise ValueError(f"model_id={self.model_id!r} must be a str or None")
        # A blank id names no model (None says "unspecified"), yet persisted KV would be
        # stamped with it and re-attach only to a cache as blank.
        if self.model_id is not None and not self.model_id.strip():
            raise ValueError(
                f"model_id={self.model_id!r} must be a non-empty str or None (None: "
                f"unspecified)"
            )


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """A whole cache's configuration (see :meth:`from_kwargs`)."""

    geometry: KVGeometry
    tier: Tier = HostTier()
    staging: StagingConfig = StagingConfig()
    prefix: PrefixConfig = PrefixConfig()
    persistence: PersistenceConfig = PersistenceConfig()
    sparse: SparseConfig | None = None

    def __post_init__(self):
        tier, staging = self.tier, self.staging
        if self.sparse is not None:
            if not isinstance(self.sparse, SparseConfig):
                raise TypeError(
                    f"sparse must be a SparseConfig, a budget (float share or int blocks) or "
                    f"None; got {type(self.sparse).__name__}"
                )
            if all(w is not None for w in self.geometry.windows):
                raise ValueError(
                    "sparse= selects blocks of global layers' contexts; every layer of this "
                    "cache has a sliding window (which it reads whole): drop sparse="
                )
        if isinstance(tier, TwoLevelTier) and staging.resident is True:
            raise ValueError("resident=True keeps every block on device: it takes no spill_path")
        if self.geometry.bounds_windows and tier.persistent:
            raise ValueError(
                "a cache with max_step_tokens overwrites its committed rows as its window "
                "moves, so no commit would survive a crash: drop shm_name / file_name, or "
                "max_step_tokens (a hybrid cache: bound_windows=False)"
            )
        if self.geometry.bounds_windows and staging.resident is True:
            raise ValueError(
                "resident=True copies every position to the device; a cache with "
                "max_step_tokens keeps only each slot's window: drop one of them"
            )

    def prefix_root(self, layout_version: int) -> bytes:
        """The prefix index's root key: the salt (default the model id), the geometry,
        dtype, block size and tier layout — what keeps two caches' blocks apart."""
        g, salt, model_id = self.geometry, self.prefix.salt, self.persistence.model_id
        return prefix.root_key(
            model_id if salt is None and model_id is not None else (salt or ""),
            dict(
                num_layers=g.num_layers,
                num_kv_heads=g.num_kv_heads,
                head_dim=g.head_dim,
                dtype=g.dtype.name,
                block_tokens=g.block_tokens,
                layout=layout_version,
                # Quantized blocks hold other bytes for the same tokens.
                **({} if g.tier_dtype is None else dict(tier_dtype=g.tier_dtype.name)),
            ),
        )

    @property
    def two_level(self) -> bool:
        return isinstance(self.tier, TwoLevelTier)

    @property
    def spill_blocks(self) -> int:
        """Spill blocks per (layer, K|V); 0 for a one-level tier."""
        if not isinstance(self.tier, TwoLevelTier):
            return 0
        return self.tier.blocks_for(self.geometry.num_blocks)

    @classmethod
    def from_kwargs(
        cls,
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
        prefetch_depth: int | str = "auto",
        sliding_window: int | Sequence[int | None] | None = None,
        max_step_tokens: int | None = None,
        prefetch_across_steps: bool = True,
        debug_poison: bool = False,
        model_id: str | None = None,
        verify: bool = True,
        overwrite: bool = False,
        prefix_salt: str | bytes | None = None,
        shared_prefix_dir: str | os.PathLike | None = None,
        remote_prefix: Any = None,
        spill_path: str | os.PathLike | None = None,
        spill_blocks: int | None = None,
        promote_after: int | None = 2,
        sparse: SparseConfig | float | int | None = None,
    ) -> CacheConfig:
        """The configuration :class:`~jax_tpusync.caches.offloaded.cache.OffloadedKVCache`'s keywords
        describe, every argument checked.

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
            :meth:`OffloadedKVCache.read` returns.
          tier_dtype: None (rows stored in ``dtype``), ``"int8"`` or ``"float8_e4m3fn"``:
            K/V rows go to the tier (and through staging) as one-byte codes with one float32
            scale per token per KV head, about half the bytes of bf16 (see
            :mod:`jax_tpusync.core.quantize`). Quantized on the way out (in the step, and in
            :meth:`OffloadedKVCache.load`); attention applies the scales inside its kernels. The current
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
            admitted with smaller ``max_tokens`` (:meth:`OffloadedKVCache.admit`).
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
            speed. Host-side changes of the tier (:meth:`OffloadedKVCache.load`, :meth:`OffloadedKVCache.admit` of a cached
            prefix, :meth:`OffloadedKVCache.init`, :meth:`OffloadedKVCache.recover`, :meth:`OffloadedKVCache.drain` of a state older than the
            latest) are copied into the state they return.
            Not the default, so that a small cache exercises the same streaming path as a large
            one unless asked.
          read_in_place: ``"auto"`` (default), ``True`` or ``False``. On the CPU backend the
            engine's memory is the step's own: with ``True`` (what ``"auto"`` picks wherever
            it applies) each unit is attended to where the engine holds it, with no copy into
            staging — a host tier's rows where the pool keeps them, a file tier's (and a
            two-level cache's spill) units where their fetch landed, still fetched
            ``prefetch_depth`` ahead (see :mod:`jax_tpusync.step.in_place`: a bfloat16 or
            float32 cache, its rows plain or quantized, not resident). Such a state
            allocates no staging (``spec.device_bytes`` is 0), so it takes the ``"xla"``
            attention only. ``True`` where it cannot apply is refused, naming why;
            ``False`` copies every unit into staging first, as on an accelerator (and
            serves ``implementation="pallas"``).
          prefetch_depth: units fetched ahead (1: layer L+1 while layer L computes), an int
            in ``[1, MAX_PREFETCH_DEPTH]`` (64), or ``"auto"`` (the default): 1 on a host
            tier, 3 on a file tier or a two-level cache (:func:`auto_prefetch_depth`). When every layer's KV
            fits one staging unit the cache uses at most ``num_layers``
            (``spec.prefetch_depth``): further ahead lies the step after next, which no
            prefetch can serve.
          sliding_window: None, an int for every layer, or a per-layer sequence of
            ``int | None`` (ints in ``[1, 2**31 - 1]``): a sliding layer attends to (and
            fetches) only its last W tokens.
          max_step_tokens: None (default), or, when every layer shares one sliding window
            W, the most rows one step appends to a slot (its ``q_len``; a decode step 1, a
            chunked prefill its chunk): each slot then keeps only a ring of blocks covering
            its last ``W - 1 + max_step_tokens`` tokens (:mod:`jax_tpusync.core.window_ring`),
            so the tier, the fetches and the persistence of the cache are independent of
            the context length; the rows before a slot's window are overwritten (``read``
            refuses them, a ``load`` writes only the rows the window keeps), and a step of
            more rows is refused when it is traced. Prefix reuse (``tokens=``) does not map
            ring blocks.
          prefetch_across_steps: the last layer's call fetches the next step's first unit.
            The returned state then has a fetch in flight (into engine memory: dropping the
            state is safe, the next step's wait copies it into staging).
          debug_poison: fill fetch destinations with NaN until each fetch lands (an engine
            bug that served bytes before they landed shows up as NaN).
          model_id: persistent tiers: names the model whose KV this is (None: "unspecified";
            a blank one is refused). Persisted KV re-attaches only to a cache of the same
            model_id and geometry.
          verify: persistent tiers: on re-attach, check the committed rows' checksums
            (:meth:`OffloadedKVCache.verify`) before returning.
          overwrite: persistent tiers: discard existing data and manifest and start empty,
            instead of refusing data that has no manifest or another geometry/model.
          prefix_salt: what keeps two models' prefix blocks apart (weights name and version);
            default ``model_id`` (an empty one, which would drop it, is refused). The cache
            adds its geometry, dtype and block size itself. See
            :meth:`OffloadedKVCache.admit` (``tokens=``) and :mod:`jax_tpusync.core.prefix`.
          shared_prefix_dir: a directory that several processes (or hosts, on shared
            storage) publish prefix blocks to and import them from: :meth:`OffloadedKVCache.release` with
            ``tokens`` writes each full block that has no file there yet, and :meth:`OffloadedKVCache.admit`
            with ``tokens`` continues its match there past its own index. See
            :mod:`jax_tpusync.core.shared_blocks` (one file per block, atomic rename, checksums).
          remote_prefix: a network level searched after the shared directory and
            published to with it: ``"mooncake://host:port[?options]"`` (a Mooncake Store,
            :mod:`jax_tpusync.mooncake.level`; needs the ``mooncake`` extra), a factory of a
            level called with the cache's root and geometry (e.g. ``functools.partial(
            MooncakeStoreLevel, "host:port", transfer_engine=engine)``: one engine for the
            store and P/D transfer), or any :class:`jax_tpusync.core.levels.RemoteLevel`. Its
            faults are misses, never errors. A mesh cache takes an address only (each head
            range gets a namespace of its own).
          spill_path: ``tier="host"`` only: a directory for a second, file tier behind the
            DRAM tier (a two-level store, see :mod:`jax_tpusync.core.spill`). Cached prefix blocks
            that DRAM has no room for are demoted there instead of evicted, and the step reads
            them in place; sequences' own blocks stay in DRAM.
          spill_blocks: blocks per (layer, K|V) on the spill tier, a positive int; default
            ``4 * num_blocks``.
          promote_after: admissions that map a spill block before it is copied back into
            DRAM (at the next one, if DRAM has a free block and no other slot maps it), an
            int >= 1, or None: never. Default 2.
          sparse: None (default: every decode row reads its layer's whole context), a
            :class:`~jax_tpusync.sparse.SparseConfig`, or its budget alone (a float share
            of the context in ``(0, 1]``, or an int count of blocks): decode rows of global
            layers read only the blocks their query selects (see :mod:`jax_tpusync.sparse`);
            sliding layers read their window whole, prefill rows read densely.

        Raises:
          ValueError: an argument out of its range; the message names it and the range.
        """
        geometry = KVGeometry(
            num_layers=num_layers,
            batch=batch,
            max_len=max_len,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            tier_dtype=tier_dtype,
            windows=sliding_window,
            block_tokens=block_tokens,
            num_blocks=num_blocks,
            step_tokens=max_step_tokens,
        )
        return cls(
            geometry=geometry,
            tier=tier_of(tier, path, shm_name, file_name, spill_path, spill_blocks, promote_after),
            staging=StagingConfig(
                staging_bytes=staging_bytes,
                resident=resident,
                read_in_place=read_in_place,
                prefetch_depth=prefetch_depth,
                prefetch_across_steps=prefetch_across_steps,
                debug_poison=debug_poison,
            ),
            prefix=PrefixConfig(
                salt=prefix_salt, shared_dir=shared_prefix_dir, remote=remote_prefix
            ),
            persistence=PersistenceConfig(model_id=model_id, verify=verify, overwrite=overwrite),
            sparse=sparse_config_of(sparse),
        )


def sparse_config_of(sparse: SparseConfig | float | int | None) -> SparseConfig | None:
    """``sparse=`` as a :class:`SparseConfig`: a float or int is its budget."""
    if sparse is None or isinstance(sparse, SparseConfig):
        return sparse
    if is_int(sparse) or isinstance(sparse, (float, np.floating)):
        return SparseConfig(budget=sparse)
    raise TypeError(
        f"sparse must be a SparseConfig, a budget (float share or int blocks) or None; got "
        f"{type(sparse).__name__}"
    )


def default_block_tokens(max_len: int) -> int:
    """The block size of a cache not given ``block_tokens``: DEFAULT_BLOCK_TOKENS, or the
    power of two at or above ``max_len`` if smaller."""
    return min(DEFAULT_BLOCK_TOKENS, 1 << (max_len - 1).bit_length())


def keyword_names() -> tuple[str, ...]:
    """The keywords :meth:`CacheConfig.from_kwargs` takes (what a ``config=`` holds)."""
    return tuple(inspect.signature(CacheConfig.from_kwargs).parameters)


def to_kwargs(config: CacheConfig) -> dict[str, Any]:
    """The keywords of :meth:`CacheConfig.from_kwargs` that make ``config``, those at their
    defaults left out (so that a cache that takes some keywords per part of itself, a
    hybrid cache's ``num_blocks``, gets only what was chosen)."""
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig; got {type(config).__name__}")
    g, tier, staging = config.geometry, config.tier, config.staging
    out: dict[str, Any] = dict(
        num_layers=g.num_layers,
        batch=g.batch,
        max_len=g.max_len,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        dtype=g.dtype,
    )
    chosen = dict(
        tier_dtype=g.tier_dtype,
        block_tokens=None if g.block_tokens == default_block_tokens(g.max_len) else g.block_tokens,
        num_blocks=None if g.num_blocks == g.batch * g.slot_blocks else g.num_blocks,
        sliding_window=None if all(w is None for w in g.windows) else g.windows,
        max_step_tokens=g.step_tokens,
        prefix_salt=config.prefix.salt,
        shared_prefix_dir=config.prefix.shared_dir,
        remote_prefix=config.prefix.remote,
        model_id=config.persistence.model_id,
        sparse=config.sparse,
    )
    if isinstance(tier, FileTier):
        chosen.update(tier="file", path=tier.path, file_name=tier.file_name)
    elif isinstance(tier, TwoLevelTier):
        chosen.update(spill_path=tier.spill_path, spill_blocks=tier.spill_blocks)
        if tier.promote_after != 2:
            out["promote_after"] = tier.promote_after
    else:
        chosen.update(shm_name=tier.shm_name)
    out.update({name: value for name, value in chosen.items() if value is not None})
    defaults = StagingConfig()
    for field in dataclasses.fields(StagingConfig):
        value = getattr(staging, field.name)
        if value != getattr(defaults, field.name):
            out[field.name] = value
    if not config.persistence.verify:
        out["verify"] = False
    if config.persistence.overwrite:
        out["overwrite"] = True
    return out


def with_config(config: CacheConfig | None, keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` and the keywords of ``config`` (None: ``keywords`` alone), refusing, by
    name, a keyword that ``config`` holds too: one of them would silently lose."""
    if config is None:
        return dict(keywords)
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig or None; got {type(config).__name__}")
    both = sorted(set(keywords) & set(keyword_names()))
    if both:
        raise ValueError(
            f"{', '.join(both)} given with config=: the CacheConfig holds "
            f"{'it' if len(both) == 1 else 'them'} (change the config, e.g. with "
            f"dataclasses.replace, or pass keywords alone)"
        )
    return {**to_kwargs(config), **keywords}


def tier_of(
    tier: str,
    path: Any = None,
    shm_name: str | None = None,
    file_name: str | None = None,
    spill_path: Any = None,
    spill_blocks: int | None = None,
    promote_after: int | None = 2,
) -> Tier:
    """The tier value the keyword arguments name (``tier="host" | "file"`` and the
    arguments each kind takes), refusing arguments of another kind."""
    if tier not in ("host", "file"):
        raise ValueError(f"tier={tier!r} must be 'host' or 'file'")
    if tier == "file" and path is None:
        raise ValueError("tier='file' needs path=<directory>")
    if tier == "host" and (path is not None or file_name is not None):
        raise ValueError("path and file_name apply to tier='file' only")
    if tier == "file" and shm_name is not None:
        raise ValueError("shm_name applies to tier='host' only")
    if spill_path is None:
        if spill_blocks is not None:
            raise ValueError(f"spill_blocks={spill_blocks!r} needs spill_path=<directory>")
        return HostTier(shm_name) if tier == "host" else FileTier(path, file_name)
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
    return TwoLevelTier(spill_path, spill_blocks, promote_after)


def normalize_windows(sliding_window: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows from None, an int, or one ``int | None`` per layer."""
    if sliding_window is None or is_int(sliding_window):
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
        if w is not None and (not is_int(w) or not 1 <= w <= INT32_MAX):
            raise ValueError(
                f"sliding window {w!r} of layer {layer} must be None or an int in "
                f"[1, 2**31 - 1] (positions are int32)"
            )
    return tuple(None if w is None else int(w) for w in windows)
