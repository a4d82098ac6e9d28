"""Whole blocks of a host pool, moved between steps: the small jitted programs that read
and write them (:func:`read_blocks`, :func:`write_blocks`), rows written into a run of
blocks (:func:`write_rows`: the blocks they fill in part read first), and
:class:`PoolBlocks`, the slot table's block store over the pool (what prefix levels import
into and publish from).

A host pool is a JAX array the state carries (:mod:`jax_tpusync.core.pool_state`), not memory an
engine owns: a host call reads the pool of the state it is given and returns a state with
a new pool. So :class:`PoolBlocks` reads from the pool it was handed for the call and keeps
the blocks written into it (a prefix level's imports) until the cache applies them to the
state it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_tpusync.core.mesh_layout import MeshLayout
from jax_tpusync.core.pool_state import PoolLayout, into_pool, to_device


def read_blocks(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # [pool_rows, row_width], or [shards, pool_rows, row_width] over a mesh
    starts: np.ndarray,  # int[n]: the pool row of each block's first token
) -> np.ndarray:  # [shards, n * block_tokens, row_width] in the pool's dtype
    """Host copies of the blocks at pool rows ``starts``, every shard's."""
    if len(starts) == 0:
        return np.zeros((1 if mesh is None else mesh.num_shards, 0, layout.row_width), layout.dtype)
    starts = np.asarray(starts, np.int32)
    if mesh is None:
        return np.array(_read(layout, pool, starts))[None]
    return np.array(_read_sharded(layout, mesh, pool, starts))


# Most blocks one gather program reads (:func:`gather_blocks`): larger counts take several
# calls, so at most log2 of it + 1 programs are compiled, each of a bounded size. (Measured
# on the CPU backend of a 2-core VM: 16 compiles in about 1.2 s and gathers as fast as 64,
# which took 4 s to compile.)
GATHER_BLOCKS = 16


def gather_blocks(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # [pool_rows, row_width], or [shards, pool_rows, row_width] over a mesh
    starts: np.ndarray,  # int[n]: the pool row of each block's first token
) -> np.ndarray:  # [shards, n * block_tokens, row_width] in the pool's dtype
    """:func:`read_blocks` of any number of blocks in a few programs: calls of at most
    :data:`GATHER_BLOCKS` blocks, each padded to a power of two with reads of the sink
    block (so a commit's changing block counts reuse a handful of compiled programs)."""
    starts = np.asarray(starts, np.int64)
    bt = layout.spec.block_tokens
    parts = [read_blocks(layout, mesh, pool, starts[:0])]
    for at in range(0, len(starts), GATHER_BLOCKS):
        part = starts[at : at + GATHER_BLOCKS]
        padded = np.full(1 << (len(part) - 1).bit_length(), layout.sink_row, np.int64)
        padded[: len(part)] = part
        parts.append(read_blocks(layout, mesh, pool, padded)[:, : len(part) * bt])
    return np.concatenate(parts, axis=1)


def write_blocks(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # donated
    rows: np.ndarray,  # [shards, n * block_tokens, row_width]: each shard's blocks, in order
    starts: np.ndarray,  # int[n]: the pool row of each block's first token
) -> jax.Array:
    """``pool`` with the blocks ``rows`` at pool rows ``starts`` (the pool passed in is
    donated)."""
    if len(starts) == 0:
        return pool
    starts = np.asarray(starts, np.int32)
    if mesh is None:
        return _write(layout, pool, rows[0], starts)
    return _write_sharded(layout, mesh, pool, rows, starts)


def scatter_blocks(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # donated
    rows: np.ndarray,  # [shards, n * block_tokens, row_width]: each shard's blocks, in order
    starts: np.ndarray,  # int[n]: the pool row of each block's first token
) -> jax.Array:
    """:func:`write_blocks` of any number of blocks in a few programs, as
    :func:`gather_blocks` reads them: calls of at most :data:`GATHER_BLOCKS` blocks, each
    padded to a power of two with writes of zeros into the sink block (which no slot
    reads)."""
    starts = np.asarray(starts, np.int64)
    bt = layout.spec.block_tokens
    for at in range(0, len(starts), GATHER_BLOCKS):
        part = starts[at : at + GATHER_BLOCKS]
        padded = np.full(1 << (len(part) - 1).bit_length(), layout.sink_row, np.int64)
        padded[: len(part)] = part
        block_rows = rows[:, at * bt : (at + len(part)) * bt]
        if len(padded) > len(part):  # Zeros for the sink's writes (a full call: no copy).
            block_rows = np.concatenate(
                [
                    block_rows,
                    np.zeros(
                        (rows.shape[0], (len(padded) - len(part)) * bt, rows.shape[2]), rows.dtype
                    ),
                ],
                axis=1,
            )
        pool = write_blocks(layout, mesh, pool, block_rows, padded)
    return pool


def write_rows(
    layout: PoolLayout,
    mesh: MeshLayout | None,
    pool: jax.Array,  # donated
    starts: np.ndarray,  # int[layers, blocks]: per layer, the pool row of each block's first token
    at: int,
    rows: np.ndarray,  # [shards, layers, n, ...]: each shard's pool rows (as bytes, any shape)
) -> jax.Array:
    """``pool`` with ``rows`` written at positions ``[at, at + n)`` of a run of blocks
    (``at`` within the first block), in each layer ``starts`` names. A pool row's bytes may
    come in any trailing shape of ``rows`` (a pool row as the pool's dtype, or split into K
    and V bytes). The blocks at either end that the rows fill in part are read first, so
    their other rows keep what they hold; the rest are written whole."""
    shards, layers, n = rows.shape[:3]
    if n == 0:
        return pool
    bt = layout.spec.block_tokens
    count = starts.shape[1]
    blocks = np.zeros((shards, layers, count * bt, *rows.shape[3:]), rows.dtype)
    edges = [0] if at % bt else []  # Blocks the rows fill in part, by index in the run.
    if (at + n) % bt and count - 1 not in edges:
        edges.append(count - 1)
    if edges:
        kept = gather_blocks(layout, mesh, pool, starts[:, edges].reshape(-1))
        kept = kept.view(rows.dtype).reshape(shards, layers, len(edges) * bt, *rows.shape[3:])
        for i, e in enumerate(edges):
            blocks[:, :, e * bt : (e + 1) * bt] = kept[:, :, i * bt : (i + 1) * bt]
    blocks[:, :, at : at + n] = rows
    pool_rows = blocks.reshape(shards, layers * count * bt, -1).view(layout.dtype)
    return scatter_blocks(layout, mesh, pool, pool_rows, starts.reshape(-1))


class PoolBlocks:
    """The slot table's block store (:class:`jax_tpusync.core.levels.BlockStore`) over a host
    pool: a block's payload is its rows of every layer as bytes, each token's K row then
    its V row, each of every head (``uint8[num_layers, block_tokens, 2, shards, row
    bytes of one shard]``): over a mesh the shards' heads are joined in head order, so an
    unquantized pool publishes and imports the same bytes on one device and over a mesh of
    any size. (Quantized rows, every head's codes then the scales, do not join that way:
    a quantized pool over several devices keys its prefixes apart, see
    :func:`jax_tpusync.caches.pool.assembly.pool_prefix_layout`.)

    Reads come from the pool handed to :meth:`reading` for the host call under way; writes
    are kept, by block, until :meth:`take_writes` hands them to the cache, which applies
    them (:meth:`apply`) to the state it returns.
    """

    def __init__(self, layout: PoolLayout, mesh: MeshLayout | None):
        self.layout = layout
        self.mesh = mesh
        self.shards = 1 if mesh is None else mesh.num_shards
        self._pool: jax.Array | None = None
        self._writes: dict[int, np.ndarray] = {}

    @property
    def payload_bytes(self) -> int:
        spec = self.layout.spec
        rows = spec.num_layers * spec.block_tokens
        return self.shards * rows * self.layout.row_width * self.layout.dtype.itemsize

    @property
    def half_block_bytes(self) -> int:
        """The ``block_bytes`` prefix levels are told (they hold ``2 * num_layers`` of
        them a block: a K and a V region a layer)."""
        return self.payload_bytes // (2 * self.layout.spec.num_layers)

    def reading(self, pool: jax.Array | None) -> None:
        """The pool this host call reads blocks from (None: the call is over)."""
        self._pool = pool

    def take_writes(self) -> dict[int, np.ndarray]:
        """The blocks written since the last call, by block id (and forgets them)."""
        writes, self._writes = self._writes, {}
        return writes

    def apply(self, pool: jax.Array, writes: dict[int, np.ndarray]) -> jax.Array:
        """``pool`` (donated) with ``writes`` (from :meth:`take_writes`) in it."""
        if not writes:
            return pool
        spec = self.layout.spec
        ids = list(writes)
        blocks = np.stack([self._rows_of(writes[b]) for b in ids])  # [n, shards, L, bt, W]
        rows = blocks.transpose(1, 0, 2, 3, 4).reshape(self.shards, -1, self.layout.row_width)
        starts = [self.layout.block_row(layer, b) for b in ids for layer in range(spec.num_layers)]
        # A few bounded programs whatever the count (an admission's imports and promotions
        # vary: a program per count compiled one slice per block each time).
        return scatter_blocks(self.layout, self.mesh, pool, rows, np.asarray(starts))

    # -- the BlockStore interface -----------------------------------------------------------

    def read_blocks(self, blocks: Sequence[int]) -> list[np.ndarray]:
        """Payloads of ``blocks``: what was written to them in this call, else the pool's."""
        spec = self.layout.spec
        from_pool = [int(b) for b in blocks if int(b) not in self._writes]
        payloads: dict[int, np.ndarray] = {}
        if from_pool:
            if self._pool is None:
                raise RuntimeError("tpusync: a host-pool block was read outside a host call")
            layers = range(spec.num_layers)
            starts = [self.layout.block_row(layer, b) for b in from_pool for layer in layers]
            rows = read_blocks(self.layout, self.mesh, self._pool, np.asarray(starts))
            shape = (self.shards, len(from_pool), spec.num_layers, spec.block_tokens, 2, -1)
            # -> [block, layer, token, K|V, shard, row bytes]: a payload per block.
            per_block = rows.view(np.uint8).reshape(shape).transpose(1, 2, 3, 4, 0, 5)
            for b, block in zip(from_pool, per_block):
                payloads[b] = np.ascontiguousarray(block).reshape(-1)
        return [self._writes.get(int(b), payloads.get(int(b))) for b in blocks]

    def write_block(self, block: int, payload: np.ndarray) -> None:
        payload = np.asarray(payload)
        if payload.dtype != np.uint8 or payload.size != self.payload_bytes:
            raise ValueError(
                f"tpusync: a block payload of {payload.size} {payload.dtype} items, not "
                f"{self.payload_bytes} bytes"
            )
        self._writes[int(block)] = np.array(payload.reshape(-1), copy=True)

    def block_memory(self, block: int) -> None:
        """None: the pool is not memory a level may write in place."""
        return

    def quiesce(self) -> None:
        """Nothing in flight: the pool moves only in steps and in this store's calls."""

    def _rows_of(self, payload: np.ndarray) -> np.ndarray:  # [shards, L, bt, W]
        spec = self.layout.spec
        joined = payload.reshape(spec.num_layers, spec.block_tokens, 2, self.shards, -1)
        rows = np.ascontiguousarray(joined.transpose(3, 0, 1, 2, 4)).view(self.layout.dtype)
        return rows.reshape(self.shards, spec.num_layers, spec.block_tokens, self.layout.row_width)


@functools.partial(jax.jit, static_argnums=0)
def _read(layout: PoolLayout, pool: jax.Array, starts: jax.Array) -> jax.Array:
    """[len(starts) * block_tokens, row_width]: the blocks at pool rows ``starts``."""
    bt = layout.spec.block_tokens
    return jnp.concatenate(
        [
            to_device(jax.lax.dynamic_slice(pool, (starts[i], 0), (bt, layout.row_width)))
            for i in range(starts.shape[0])
        ]
    )


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _write(layout: PoolLayout, pool: jax.Array, rows: jax.Array, starts: jax.Array):
    """``pool`` with the blocks ``rows`` ([n * block_tokens, row_width]) at pool rows
    ``starts``."""
    bt = layout.spec.block_tokens
    for i in range(starts.shape[0]):
        block = jax.lax.dynamic_slice_in_dim(rows, i * bt, bt)
        pool = jax.lax.dynamic_update_slice(pool, into_pool(pool, block), (starts[i], 0))
    return pool


@functools.partial(jax.jit, static_argnums=(0, 1))
def _read_sharded(
    layout: PoolLayout, mesh: MeshLayout, pool: jax.Array, starts: jax.Array
) -> jax.Array:
    """[shards, len(starts) * block_tokens, row_width]: each shard's blocks at pool rows
    ``starts`` (a mesh cache's pool: [shards, pool_rows, row_width])."""
    return jax.shard_map(
        lambda pool, starts: _read(layout, pool[0], starts)[None],
        mesh=mesh.mesh,
        in_specs=(mesh.state_spec, P()),
        out_specs=mesh.state_spec,
        check_vma=False,
    )(pool, starts)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _write_sharded(
    layout: PoolLayout, mesh: MeshLayout, pool: jax.Array, rows: jax.Array, starts: jax.Array
) -> jax.Array:
    """``pool`` with each shard's blocks ``rows[shard]`` at pool rows ``starts``."""
    return jax.shard_map(
        lambda pool, rows, starts: _write(layout, pool[0], rows[0], starts)[None],
        mesh=mesh.mesh,
        in_specs=(mesh.state_spec, mesh.state_spec, P()),
        out_specs=mesh.state_spec,
        check_vma=False,
    )(pool, rows, starts)
