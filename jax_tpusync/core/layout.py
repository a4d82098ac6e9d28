"""From a configuration to sizes: the staging units, slots and modes of a cache.

Pure arithmetic (no engine, no tier, no device buffer): :func:`plan` turns a
:class:`~jax_tpusync.core.config.CacheConfig` and the backend's choices into the
:class:`~jax_tpusync.core.state.CacheSpec` a step compiles against, refusing, by name, a layout
whose int32 segment fields or position arithmetic would overflow. The cache checks the same
bounds again with the first block its tier allocation got (:func:`check_int32_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.state import INT32_MAX, CacheSpec
from jax_tpusync.runtime import backend, ops


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


def in_place_blocker(
    *, tier: str, dtype, quantized: bool, two_level: bool, resident: bool
) -> str | None:
    """Why a cache of this configuration cannot attend to its tier in place (see
    :mod:`jax_tpusync.step.in_place`), or None if it can: a host tier where its pool holds
    the rows, a file tier (or a two-level cache's spill file) where each unit's fetch
    landed in the engine's memory."""
    if tier not in ("host", "file"):
        return f"tier={tier!r} is neither in memory nor fetched into the engine's memory"
    if (blocker := backend.in_place_blocker()) is not None:
        return blocker
    if quantized and np.dtype(dtype) not in ops.IN_PLACE_KV_DTYPES:
        return (
            f"dtype={np.dtype(dtype)} (a quantized tier is read in place for bfloat16 or float32)"
        )
    if np.dtype(dtype) not in ops.IN_PLACE_KV_DTYPES:
        return f"dtype={np.dtype(dtype)} (rows are read in place as bfloat16 or float32)"
    if resident:
        return "a resident cache reads no unit at all"
    return None


def longest_span(max_len: int, windows: Sequence[int | None]) -> int:
    """Most cached tokens any layer reads: max_len, or a sliding layer's window less one."""
    return max(max_len if w is None else min(max_len, max(w - 1, 1)) for w in windows)


def plan(config: CacheConfig) -> CacheSpec:
    """The :class:`CacheSpec` of ``config`` on this backend.

    Raises:
      ValueError: ``resident=True`` that does not fit ``staging_bytes``; a budget that
        cannot hold one token per slot; ``read_in_place=True`` where it cannot apply; an
        int32 overflow of the layout (each naming the numbers involved).
    """
    g, staging = config.geometry, config.staging
    two_level = config.two_level
    depth = staging.prefetch_depth
    if isinstance(depth, str):
        depth = auto_prefetch_depth(config.tier.kind, two_level)
    depth = int(depth)
    num_slots = depth + 1
    row_bytes = g.row_bytes
    longest = longest_span(g.max_len, g.windows)
    whole_cache_bytes = g.num_layers * 2 * g.batch * g.max_len * row_bytes
    fits = whole_cache_bytes <= staging.staging_bytes
    if staging.resident is True and not fits:
        raise ValueError(
            f"resident=True needs the whole cache on device: {g.num_layers} layers x 2 "
            f"(K, V) x batch {g.batch} x max_len {g.max_len} x {row_bytes} bytes per token "
            f"row = {whole_cache_bytes} bytes, more than staging_bytes={staging.staging_bytes}"
        )
    # A spill block has no resident copy: "auto" stays streamed on a two-level cache.
    # A ring (bounded window) keeps no copy of each position: "auto" stays streamed.
    # Sparse decode reads a tier's selected blocks: "auto" stays streamed.
    resident = bool(
        fits
        and staging.resident in (True, "auto")
        and not two_level
        and not g.ring_blocks
        and (config.sparse is None or staging.resident is True)
    )
    reads_in_place = False
    if staging.read_in_place is not False:
        reason = in_place_blocker(
            tier=config.tier.kind,
            dtype=g.dtype,
            quantized=g.quantized,
            two_level=two_level,
            resident=resident,
        )
        if staging.read_in_place is True and reason is not None:
            raise ValueError(f"read_in_place=True cannot apply: {reason}")
        reads_in_place = reason is None
    unit_row_bytes = num_slots * 2 * g.batch * row_bytes
    chunk_len = longest if resident else staging.staging_bytes // unit_row_bytes
    if chunk_len < 1:
        raise ValueError(
            f"staging_bytes={staging.staging_bytes} cannot hold one token per slot: "
            f"{num_slots} slots x 2 (K, V) x batch {g.batch} x {row_bytes} bytes per "
            f"token row = {unit_row_bytes} bytes at least"
        )
    chunk_len = min(chunk_len, longest)
    if chunk_len >= longest and depth > g.num_layers:
        # One unit per layer: a unit more than num_layers ahead belongs to the step after
        # next, whose lengths the walk does not know, so every such prefetch would miss.
        # Fewer slots hold the same single units.
        depth, num_slots = g.num_layers, g.num_layers + 1
    page_rows = 4096 // math.gcd(row_bytes, 4096)
    if page_rows < chunk_len < longest:
        # Whole pages per staging unit keep fetch segments page-aligned at both ends, so
        # O_DIRECT lands them straight in the staging buffer.
        chunk_len -= chunk_len % page_rows
    if chunk_len * row_bytes >= 2**31:
        chunk_len = (2**31 - 1) // row_bytes  # One segment's byte count is int32.
    spill_blocks = config.spill_blocks
    block_bytes = g.block_tokens * row_bytes
    check_int32_layout(g.max_len, g.windows, chunk_len, block_bytes, tier_blocks(g, 0), 0)
    if spill_blocks:
        check_int32_layout(
            g.max_len, g.windows, chunk_len, block_bytes, g.num_layers * 2 * spill_blocks, 0
        )
    return CacheSpec(
        **g.spec_fields(),
        chunk_len=int(chunk_len),
        num_slots=num_slots,
        prefetch_depth=depth,
        prefetch_across_steps=bool(staging.prefetch_across_steps),
        staging_dtype=backend.staging_dtype(g.dtype, g.quantized),
        resident=resident,
        spill_blocks=spill_blocks,
        reads_in_place=reads_in_place,
        attends_landed=reads_in_place and (config.tier.kind == "file" or two_level),
        sparse=config.sparse,
    )


def tier_blocks(geometry, spill_blocks: int = 0) -> int:
    """Tier blocks one allocation holds: one region per (layer, K|V) of ``num_blocks``
    blocks (or of ``spill_blocks``, for the spill tier)."""
    return geometry.num_layers * 2 * (spill_blocks or geometry.num_blocks)


def check_int32_layout(
    max_len: int,
    windows: Sequence[int | None],
    chunk_len: int,
    block_bytes: int,
    num_tier_blocks: int,
    first_block: int,
) -> None:
    """Refuses a layout whose segment fields or position arithmetic would leave int32.

    Segments carry (block, offset_in_block, memory_offset, nbytes) as int32: a block's
    bytes must fit, and so must ``first_block + num_tier_blocks`` (block ``2**31 - 1``
    marks a traced layer out of range, see ``step.plan``). A layer that reads the whole
    context counts its units as ``(span + chunk_len - 1) // chunk_len`` with ``span`` up
    to ``max_len``.
    """
    if block_bytes > INT32_MAX:
        raise ValueError(
            f"a KV block of {block_bytes} bytes does not fit a segment's int32 byte count; "
            f"use a smaller block_tokens"
        )
    if first_block + num_tier_blocks >= INT32_MAX:
        raise ValueError(
            f"the cache needs {num_tier_blocks} tier blocks from block {first_block}, past the "
            f"int32 block index of segments (2**31 - 1); use a larger block_tokens or fewer "
            f"num_blocks"
        )
    span = longest_span(max_len, windows)
    if span + chunk_len - 1 > INT32_MAX:
        raise ValueError(
            f"max_len={max_len} is too large for a layer that reads the whole context: its "
            f"unit count needs max_len + chunk_len - 1 = {span + chunk_len - 1} to "
            f"fit int32; at most {INT32_MAX + 1 - chunk_len} with chunk_len={chunk_len}"
        )
