"""A slot's rows of every layer as the bytes a host pool stores, in the byte order of an
engine cache's tier: per head shard, per layer, the K rows then the V rows of consecutive
positions (``uint8[shards, num_layers, 2, n, row_bytes]``, ``row_bytes`` one shard's K row:
its heads' values, or their codes and scales when quantized). That is the order P/D
transfer moves a sequence in (:mod:`jax_tpusync.pd.transfer`), so a host pool and an
engine cache of the same layout exchange rows byte for byte.

The rows move as whole blocks (:mod:`jax_tpusync.caches.pool.blocks`), in a few compiled programs
of at most :data:`~jax_tpusync.caches.pool.blocks.GATHER_BLOCKS` blocks each, whatever the count.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_tpusync.caches.pool import blocks as pool_blocks
from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_state import PoolLayout


def row_bytes(layout: PoolLayout) -> int:
    """Bytes of one shard's K (or V) row: half a pool row."""
    return layout.half_width * layout.dtype.itemsize


def stored_shape(layout: PoolLayout, shards: int, n: int) -> tuple[int, ...]:
    """[shards, num_layers, 2, n, row_bytes]: ``n`` positions of one slot, every layer."""
    return (shards, layout.spec.num_layers, 2, n, row_bytes(layout))


def read_stored_rows(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # [pool_rows, row_width], or [shards, pool_rows, row_width] over a mesh
    table: np.ndarray,  # int[blocks]: the slot's block table
    lo: int,
    hi: int,
) -> np.ndarray:  # uint8[shards, num_layers, 2, hi - lo, row_bytes]
    """Positions ``[lo, hi)`` of the slot whose blocks are ``table``, every layer, as
    stored."""
    shards = 1 if mesh is None else mesh.num_shards
    if hi <= lo:
        return np.zeros(stored_shape(layout, shards, 0), np.uint8)
    bt = layout.spec.block_tokens
    first = lo // bt
    blocks = _block_rows(layout, table[first : -(-hi // bt)]).reshape(-1)
    rows = _as_tokens(layout, pool_blocks.gather_blocks(layout, mesh, pool, blocks))
    return np.ascontiguousarray(
        rows[:, :, lo - first * bt : hi - first * bt].transpose(0, 1, 3, 2, 4)
    )


def write_stored_rows(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # donated
    table: np.ndarray,  # int[blocks]: the slot's block table
    lo: int,
    rows: np.ndarray,  # uint8[shards, num_layers, 2, n, row_bytes]
) -> jax.Array:
    """``pool`` (donated) with positions ``[lo, lo + n)`` of the slot whose blocks are
    ``table`` written, every layer. The blocks at either end that the rows fill in part are
    read first, so their other rows keep what they hold."""
    bt = layout.spec.block_tokens
    first, end = lo // bt, -(-(lo + rows.shape[3]) // bt)
    # Per layer, each position's K row then its V row: a pool row's bytes.
    return pool_blocks.write_rows(
        layout,
        mesh,
        pool,
        _block_rows(layout, table[first:end]),
        lo - first * bt,
        rows.transpose(0, 1, 3, 2, 4),
    )


def _block_rows(layout: PoolLayout, blocks: np.ndarray) -> np.ndarray:
    """int64[num_layers, len(blocks)]: the pool row of each block's first token, per layer
    (flattened, the order :func:`_as_tokens` reads them in)."""
    layers = np.arange(layout.spec.num_layers, dtype=np.int64)[:, None]
    return layout.block_row(layers, np.asarray(blocks, np.int64)[None, :])


def _as_tokens(layout: PoolLayout, rows: np.ndarray) -> np.ndarray:
    """[shards, num_layers, tokens, 2, row_bytes] bytes of gathered blocks' rows
    ([shards, num_layers * tokens, row_width], layer by layer)."""
    shards = rows.shape[0]
    return rows.view(np.uint8).reshape(shards, layout.spec.num_layers, -1, 2, row_bytes(layout))
