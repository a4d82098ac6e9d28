"""A sparse host pool's block summaries between steps: recomputed from the pool's rows
where KV enters by a host call (:func:`summarize`), and the counts a step keeps read back
as stats (:func:`sparse_stats`).

A step keeps the summaries of the blocks it writes (:mod:`jax_tpusync.step.pool_sparse`).
KV that enters otherwise (a load, P/D's stored rows, an admission's imported or promoted
prefix blocks, a re-attached commit's rows) changes blocks under summaries that do not
know it: the cache recomputes the summaries of those blocks from the rows the pool holds
(:mod:`jax_tpusync.caches.pool.live_state` calls it), a small jitted program per batch of
blocks, as the block moves of :mod:`jax_tpusync.caches.pool.blocks` go.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_sparse import (
    COUNTS,
    SummaryLayout,
    keys_of_pool_rows,
    masked_bounds,
    merge_summary_row,
)
from jax_tpusync.core.pool_state import PoolLayout, PoolState, to_device

__all__ = ["summarize", "blocks_of_ranges", "sparse_stats", "combined_stats"]

# Most blocks one summarizing program reads (as blocks.GATHER_BLOCKS).
SUMMARIZE_BLOCKS = 16


def blocks_of_ranges(
    spec, tables: np.ndarray, layers, starts: np.ndarray, stops: np.ndarray
) -> list[tuple[int, int, int]]:
    """``(layer, physical block, rows)`` of every block that positions ``[starts[b],
    stops[b])`` of slot ``b`` touch in each of ``layers``; ``rows``: the block's rows
    below ``stops[b]`` (what its summary covers). A block twice (shared by a prefix) once,
    with its most rows."""
    bt = spec.block_tokens
    found: dict[tuple[int, int], int] = {}
    for b in range(len(starts)):
        start, stop = int(starts[b]), int(stops[b])
        if stop <= start:
            continue
        for logical in range(start // bt, -(-stop // bt)):
            block = int(tables[b, logical])
            if block < 0:
                continue
            rows = min(bt, stop - logical * bt)
            for layer in layers:
                key = (int(layer), block)
                found[key] = max(found.get(key, 0), rows)
    return [(layer, block, rows) for (layer, block), rows in found.items()]


def summarize(
    layout: PoolLayout,
    state: PoolState,
    blocks: list[tuple[int, int, int]],
    mesh: MeshLayout | None = None,
) -> PoolState:
    """``state`` with the summaries of ``blocks`` (``(layer, physical block, rows)``)
    recomputed from the first ``rows`` rows of each in its pool (a block of no rows: an
    empty summary). In programs of at most :data:`SUMMARIZE_BLOCKS` blocks, padded to a
    power of two with writes of the sink row. Over a ``mesh`` (pool and summaries with a
    leading axis of head shards) each device summarizes its own heads' rows."""
    if state.sparse is None or not blocks:
        return state
    summaries = state.sparse.summaries
    entries = np.asarray(blocks, np.int32).reshape(-1, 3)
    for at in range(0, len(entries), SUMMARIZE_BLOCKS):
        part = entries[at : at + SUMMARIZE_BLOCKS]
        padded = np.full((1 << (len(part) - 1).bit_length(), 3), -1, np.int32)
        padded[: len(part)] = part
        columns = (padded[:, 0], padded[:, 1], padded[:, 2])
        if mesh is None:
            summaries = _summarize(layout, state.pool, summaries, *columns)
        else:
            summaries = _summarize_sharded(layout, mesh, state.pool, summaries, *columns)
    return state.replace(sparse=state.sparse.replace(summaries=summaries))


def _summarized(layout: PoolLayout, pool, summaries, layers, blocks, rows):
    """``summaries`` with each of ``blocks`` of ``layers`` summarized from its first
    ``rows`` rows in ``pool`` (a block of -1: the sink row written)."""
    spec = layout.spec
    summary = SummaryLayout(spec)
    bt = spec.block_tokens
    for i in range(blocks.shape[0]):
        real = blocks[i] >= 0
        start = jnp.where(real, layout.block_row(layers[i], blocks[i]), layout.sink_row)
        block = to_device(jax.lax.dynamic_slice(pool, (start, 0), (bt, layout.row_width)))
        keys = keys_of_pool_rows(spec, block)  # [bt, H, D]
        mask = (jnp.arange(bt) < rows[i])[:, None, None]
        lo, hi = masked_bounds(keys, mask, axis=0)
        row = jnp.where(real, summary.row(layers[i], blocks[i]), summary.sink_row)
        summaries = merge_summary_row(summary, summaries, row, lo, hi, True)
    return summaries


_summarize = functools.partial(jax.jit, static_argnums=0, donate_argnums=2)(_summarized)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _summarize_sharded(layout: PoolLayout, mesh: MeshLayout, pool, summaries, layers, blocks, rows):
    """:func:`_summarize` of each shard's pool and summaries ([shards, ...] over ``mesh``)."""

    def shard(pool, summaries, *columns):
        return _summarized(layout, pool[0], summaries[0], *columns)[None]

    return jax.shard_map(
        shard,
        mesh=mesh.mesh,
        in_specs=(mesh.state_spec, mesh.state_spec, P(), P(), P()),
        out_specs=mesh.state_spec,
        check_vma=False,
    )(pool, summaries, layers, blocks, rows)


def sparse_stats(layout: PoolLayout, counts: np.ndarray) -> dict:
    """Per layer, a sparse pool's counts since it was made (``counts``: int[num_layers,
    len(COUNTS)], or int[shards, num_layers, len(COUNTS)] over a mesh) and the bytes they
    moved to the device.

    Returns:
      ``{"layers": [per layer: {COUNTS..., "hit_rate", "summary_bytes",
      "predicted_bytes", "late_bytes", "read_bytes", "dense_bytes"}], "totals": the same
      summed}``. ``summary_bytes``: the layer's summaries, copied whole (every physical
      block's, a chunk at a time) at each sparse decode step; ``predicted_bytes`` and
      ``late_bytes``: the blocks copied ahead and late (a slot's partly filled last block
      counts whole, as it is copied); ``read_bytes``: the three summed; ``dense_bytes``:
      the blocks a dense step would have copied for the same rows. ``hit_rate``: hits per
      predicted block (None before any). Over a mesh each head shard selects its own
      blocks: the blocks (a shard's heads' rows of one block) and bytes are summed over
      the shards, the steps and decode rows (the same on every shard) counted once.
    """
    spec = layout.spec
    block_bytes = spec.block_tokens * layout.row_width * layout.dtype.itemsize
    summary = SummaryLayout(spec)
    layer_summary_bytes = summary.layer_rows * summary.row_bytes
    byte_names = ("summary_bytes", "predicted_bytes", "late_bytes", "read_bytes", "dense_bytes")
    by_shard = np.asarray(counts, np.int64).reshape(-1, spec.num_layers, len(COUNTS))
    shards = by_shard.shape[0]
    once = [COUNTS.index(name) for name in ("steps", "decode_rows")]
    summed = by_shard.sum(axis=0)
    summed[:, once] = by_shard[0][:, once]
    rows = []
    for layer_counts in summed:
        row = {name: int(c) for name, c in zip(COUNTS, layer_counts)}
        row["summary_bytes"] = row["steps"] * shards * layer_summary_bytes
        row["predicted_bytes"] = row["predicted"] * block_bytes
        row["late_bytes"] = row["late"] * block_bytes
        row["read_bytes"] = row["summary_bytes"] + row["predicted_bytes"] + row["late_bytes"]
        row["dense_bytes"] = row["context_blocks"] * block_bytes
        rows.append(row)
    totals = {name: sum(r[name] for r in rows) for name in (*COUNTS, *byte_names)}
    for row in (*rows, totals):
        row["hit_rate"] = row["hits"] / row["predicted"] if row["predicted"] else None
    return dict(layers=rows, totals=totals)


def combined_stats(parts: list[dict]) -> dict:
    """The :func:`sparse_stats` of caches that hold different slots (a batch-sharded
    pool's shards) as one: blocks, decode rows and bytes summed, the steps (each shard
    runs every step) counted once, the hit rates over the sums."""
    layers = []
    for rows in zip(*(p["layers"] for p in parts)):
        row = {name: sum(r[name] for r in rows) for name in rows[0] if name != "hit_rate"}
        row["steps"] = rows[0]["steps"]
        layers.append(row)
    totals = {name: sum(r[name] for r in layers) for name in layers[0]}
    for row in (*layers, totals):
        row["hit_rate"] = row["hits"] / row["predicted"] if row["predicted"] else None
    return dict(layers=layers, totals=totals)
