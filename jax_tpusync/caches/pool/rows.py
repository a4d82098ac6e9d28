"""A slot's rows in a host pool, read and written host-side between steps: the blocks they
lie in move whole (:mod:`jax_tpusync.caches.pool.blocks`), converted from and to the pool's row
format (quantized when the pool is), each device of a mesh its own heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.caches.pool import blocks as pool_blocks
from jax_tpusync.core import quantize
from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_state import PoolLayout, pool_rows_of


def write_slot_rows(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # [pool_rows, row_width], or [shards, pool_rows, row_width] over a mesh
    table: np.ndarray,  # int[blocks]: the slot's block table
    layer: int,
    start: int,
    k: np.ndarray,  # [n, heads, head_dim] (every shard's heads), the cache's dtype
    v: np.ndarray,  # [n, heads, head_dim]
) -> jax.Array:
    """``pool`` (donated) with rows ``[start, start + n)`` of the slot whose blocks are
    ``table`` written in ``layer``. A block the rows fill in part is read first and
    written back with the rows in it."""
    bt = layout.spec.block_tokens
    first, end = start // bt, -(-(start + k.shape[0]) // bt)
    heads = layout.spec.num_kv_heads
    shards = 1 if mesh is None else mesh.num_shards
    rows = np.stack(  # Each device's pool holds its heads.
        [
            _pool_rows_host(
                layout, k[:, s * heads : (s + 1) * heads], v[:, s * heads : (s + 1) * heads]
            )
            for s in range(shards)
        ]
    )[:, None]  # [shards, 1 layer, n, row_width]
    starts = layout.block_row(layer, np.asarray(table[first:end], np.int64))[None]
    return pool_blocks.write_rows(layout, mesh, pool, starts, start - first * bt, rows)


def read_slot_rows(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # [pool_rows, row_width], or [shards, pool_rows, row_width] over a mesh
    table: np.ndarray,  # int[blocks]: the slot's block table
    layer: int,
    start: int,
    stop: int,
    raw: bool = False,
):
    """Host copies of rows ``[start, stop)`` of the slot whose blocks are ``table`` in
    ``layer``: K and V [stop - start, heads, head_dim] of every shard's heads, in the
    cache's dtype (``raw``, quantized: their codes and scales)."""
    bt = layout.spec.block_tokens
    first, end = start // bt, max(-(-stop // bt), start // bt)
    rows = _read_blocks(layout, mesh, pool, layer, table[first:end])
    rows = rows[:, start - first * bt : stop - first * bt]
    # Each shard's heads, in order: the global heads.
    return quantize.join_head_shards([_kv_of_rows(layout, part, raw) for part in rows])


def _read_blocks(
    layout: PoolLayout, mesh: MeshLayout | None, pool: jax.Array, layer: int, blocks: np.ndarray
) -> np.ndarray:  # [shards, len(blocks) * block_tokens, row_width]
    """Copies of ``blocks``' rows of ``layer``, every shard's."""
    return pool_blocks.read_blocks(
        layout, mesh, pool, layout.block_row(layer, np.asarray(blocks, np.int64))
    )


def _pool_rows_host(layout: PoolLayout, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """[n, row_width] pool rows of one shard's host K/V [n, H, D] (quantized when the pool
    is)."""
    return np.asarray(pool_rows_of(layout, jnp.asarray(k)[None], jnp.asarray(v)[None])[0])


def _kv_of_rows(layout: PoolLayout, rows: np.ndarray, raw: bool = False):
    """K and V [n, H, D] of one shard's pool rows [n, row_width], in the cache's dtype
    (``raw``, quantized: their codes and scales)."""
    spec = layout.spec
    half = layout.half_width
    if not spec.quantized:  # The pool's words viewed as the cache's dtype: the same bytes.
        shape = (rows.shape[0], spec.num_kv_heads, spec.head_dim)
        values = np.ascontiguousarray(rows).view(np.dtype(spec.dtype))
        return values[:, :half].reshape(shape), values[:, half:].reshape(shape)
    stored = [
        quantize.unpack_host(part, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
        for part in (rows[:, :half], rows[:, half:])
    ]
    return tuple(stored) if raw else tuple(quantize.dequantize_host(x, spec.dtype) for x in stored)
