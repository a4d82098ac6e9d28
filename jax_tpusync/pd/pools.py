"""Where a cache's KV lies for P/D transfer (:mod:`jax_tpusync.pd.transfer`): one host pool
per head range (a mesh cache: one per head shard), the layout two caches must share, and
the runs of a slot's rows in a pool; the pools' registration with a TransferEngine. (A
host-pool cache's rows pass through a staging buffer instead:
:mod:`jax_tpusync.pd.pool_staging`.)

What a cache is asked here are its capabilities (:mod:`jax_tpusync.caches.capabilities`):
how its heads are split (:class:`~jax_tpusync.caches.capabilities.HeadSplit`) and, for
its pools, its one-device parts
(:class:`~jax_tpusync.caches.capabilities.EngineTierRows`), never its class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jax_tpusync.caches.capabilities import EngineTierRows, HeadSplit
from jax_tpusync.core.config import is_int
from jax_tpusync.mooncake import transfer_memory
from jax_tpusync.pd.channel import PDTransferError


@dataclasses.dataclass(frozen=True)
class HeadPool:
    """One head range's host pool: ``cache`` (a one-device cache, or shard ``shard`` of a
    mesh cache) holds KV heads ``heads`` (lo, hi) of the model, of global slots ``rows``
    (lo, hi), in its pool, mapped at ``address`` (``nbytes`` long) in this process."""

    shard: int | None
    cache: Any  # A one-device engine cache (an OffloadedKVCache).
    heads: tuple[int, int]
    rows: tuple[int, int]
    address: int
    nbytes: int


def head_split(cache: HeadSplit) -> list[list[int]]:
    """``[[lo, hi], ...]``: the KV head ranges ``cache``'s shards hold, in head order (one
    range, all heads, for a one-device cache)."""
    return [[int(lo), int(hi)] for lo, hi in cache.kv_head_ranges]


def layout_of(cache: HeadSplit) -> dict:
    """The layout two caches must share for one's rows to be the other's bytes: the row
    layout of one head range's pool and how the heads are split over pools."""
    spec = cache.shard_spec
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": sum(hi - lo for lo, hi in head_split(cache)),
        "head_split": head_split(cache),
        "head_dim": spec.head_dim,
        "dtype": np.dtype(spec.dtype).name,
        "tier_dtype": None if spec.tier_dtype is None else np.dtype(spec.tier_dtype).name,
        "block_tokens": spec.block_tokens,
        "row_bytes": spec.row_bytes,
    }


def layout_mismatch(ours: dict, theirs: Any) -> str | None:
    """What differs between layout ``ours`` and ``theirs`` (None: nothing), naming each
    field: "head_split [[0, 1], [1, 2]] here, [[0, 2]] there"."""
    if not isinstance(theirs, dict):
        return f"the layout is {theirs!r}, not a dict"
    fields = sorted(set(ours) | set(theirs))
    diff = [
        f"{k} {ours.get(k)!r} here, {theirs.get(k)!r} there"
        for k in fields
        if ours.get(k) != theirs.get(k)
    ]
    return "; ".join(diff) or None


def check_not_a_ring(cache: Any, role: str) -> None:
    """Refuses a cache that keeps only its window: its positions wrap around a ring of
    blocks, so a slot's rows are not where another process would write or read them."""
    if cache.spec.ring_blocks:
        raise ValueError(
            f"{role}: a cache that keeps only its window (max_step_tokens) cannot take part in "
            f"P/D transfer (its positions wrap around a ring of blocks)"
        )


def _check_pool(cache: Any, role: str) -> tuple[int, int]:
    """(address, bytes) of a one-device cache's host pool, after refusing what cannot take
    part."""
    check_not_a_ring(cache, role)
    info = cache.engine.tier_info(cache.tier)
    if info.read_only:
        raise ValueError(f"{role}: the cache's tier is attached read-only")
    try:
        return cache.engine.mapped_memory(cache.tier)
    except ValueError as e:
        raise ValueError(
            f"{role} needs a cache on a host tier (tier='host'): the TransferEngine reads and "
            f"writes the pool in memory ({e})"
        ) from None


def head_pools(cache: Any, role: str) -> list[HeadPool]:
    """The pools of ``cache`` (a one-device cache: one; a mesh cache: one per local shard),
    after refusing a cache that cannot take part (the message says why)."""
    if not isinstance(cache, EngineTierRows):
        raise TypeError(
            f"{role} needs an OffloadedKVCache, a ShardedKVCache or a HostPoolKVCache; got "
            f"{type(cache).__name__}"
        )
    out = []
    for part in cache.tier_parts():
        address, nbytes = _check_pool(part.cache, role)
        heads, rows = part.heads, part.rows
        out.append(
            HeadPool(
                part.shard,
                part.cache,
                (heads.start, heads.stop),
                (rows.start, rows.stop),
                address,
                nbytes,
            )
        )
    return out


def check_slot(cache: Any, slot: Any) -> None:
    """Refuses a slot that is not one of ``cache``'s, by name."""
    if not is_int(slot) or not 0 <= slot < cache.batch:
        raise ValueError(f"slot={slot!r} must be an int in [0, batch={cache.batch})")


def slot_pools(
    cache: EngineTierRows, pools: list[HeadPool], slot: Any
) -> list[tuple[HeadPool, int]]:
    """``(pool, slot within it)`` of every head range of global ``slot``, in head order.
    Raises ValueError for a bad slot, or one whose head ranges this process does not all
    hold (a multi-process mesh)."""
    check_slot(cache, slot)
    out = []
    for pool in pools:
        lo, hi = pool.rows
        if lo <= slot < hi:
            out.append((pool, int(slot) - lo))
    if len(out) != len(head_split(cache)):
        raise ValueError(
            f"slot {slot}'s KV heads are split over {len(head_split(cache))} devices, of which "
            f"this process holds {len(out)}: P/D transfer needs all of a slot's head shards "
            f"in one process"
        )
    return out


def pool_runs(cache: Any, pool_address: int, slot: int, lo: int, hi: int) -> list[list[list[int]]]:
    """Per region (layer * 2 + K|V): ``[address, bytes]`` runs of positions ``[lo, hi)`` of
    ``slot``, in ``cache``'s host pool mapped at ``pool_address`` in this process. Raises
    ValueError for blocks on a two-level cache's spill tier."""
    out = []
    for layer in range(cache.spec.num_layers):
        for kv in (0, 1):
            runs = []
            for tier, offset, n in cache.tier_runs(layer, kv, slot, lo, hi):
                if tier != cache.tier:
                    raise ValueError(
                        f"slot {slot}'s blocks include blocks on the spill tier: P/D moves "
                        f"only blocks in the DRAM pool"
                    )
                runs.append([pool_address + offset, n])
            out.append(runs)
    return out


def register_pools(engine: Any, pools: list[HeadPool], role: str) -> None:
    """Registers every pool with ``engine``; all or none (the ones done are unregistered
    before raising)."""
    done = []
    try:
        for pool in pools:
            # Counted: a remote prefix level on the same engine may register it too.
            rc = transfer_memory.register(engine, pool.address, pool.nbytes)
            if rc != 0:
                raise PDTransferError(
                    f"{role}: registering the cache's host pool ({pool.nbytes} bytes) with the "
                    f"TransferEngine returned {rc}"
                )
            done.append(pool)
    except BaseException:
        unregister_pools(engine, done)
        raise


def unregister_pools(engine: Any, pools: list[HeadPool]) -> None:
    for pool in pools:
        transfer_memory.unregister(engine, pool.address)
