"""The sparse part of a host pool's state: block summaries in host memory, each layer's
previous selection (the layer-ahead prediction) and the counts that say how it did
(:class:`PoolSparseState`), and where the summaries lie (:class:`SummaryLayout`).

Summaries (:mod:`jax_tpusync.sparse.summaries`: per physical block and KV head, the
channel-wise minimum and maximum of its keys) live beside the pool, in ``pinned_host``
memory, so that device memory stays flat in the context: a step copies a layer's summaries
to the device in chunks of :attr:`SummaryLayout.chunk_blocks` blocks while it scores them,
and keeps only the per-block score bounds of each slot (4 bytes per KV head and block).
One summary row per (layer, physical block), every channel's ``(lo, hi)`` pair in 32-bit
words (a 16-bit pair is one word): a chunk is one copy (host slices cut the first
dimension only), and a step's write of one block's row is whole 32-bit sublanes, as host
memory takes updates (on XLA's CPU backend, words also keep a write from copying the
array; see :func:`~jax_tpusync.core.pool_state.pool_dtype`). A quantized pool's keys are
summarized after dequantization, in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import quantize
from jax_tpusync.core.pool_state import into_pool, to_device
from jax_tpusync.core.state import CacheSpec
from jax_tpusync.sparse import summaries as block_summaries
from jax_tpusync.sparse.config import SparseConfig

# Most blocks a step copies (and scores) in one summary chunk: 64 blocks of 8 KV heads x
# 128 in bf16 are 256 KiB on the device, whatever the context. The device holds a few
# chunk-sized buffers (the staged chunk in and out, the one in flight, its values scored),
# so a chunk that grows with the context up to its cap grows device memory with it: at 512
# blocks, compiled for TPU7x (8 layers of 8 KV heads x 128, bf16, blocks of 256), 804.1
# MiB at 32K (a chunk of 128 blocks) and 818.6 at 256K (512). At 64, the chunk is one size
# from 16K tokens up there, and a layer of 32K tokens has two: its chunk copies, the next
# layer's first included, are made in the scoring loop, each spanning a scoring
# (jax_tpusync.step.pool_sparse.score_blocks). A smaller chunk costs loop iterations only:
# the bytes copied are a layer's summaries at any chunk size.
SUMMARY_CHUNK_BLOCKS = 64

# A layer's counts (int32[len(COUNTS)]), summed over its sparse decode steps and slots:
# the prediction's (jax_tpusync.sparse.prediction.COUNTS), the sparse decode steps (each
# copies the layer's summaries once), the decode rows that selected, and the blocks a dense
# step would have read for them.
COUNTS = ("predicted", "hits", "late", "wasted", "steps", "decode_rows", "context_blocks")


@dataclasses.dataclass(frozen=True)
class SummaryLayout:
    """Where a host pool's block summaries lie in their host array.

    ``[sink_row + write_rows, row_width]`` 32-bit words: each layer's rows (one per
    physical block, padded to whole chunks), then a sink row that writes of slots with no
    block go to. A row holds each channel's ``(lo, hi)`` pair, channel by channel.
    """

    spec: CacheSpec

    @property
    def summary_dtype(self) -> np.dtype:
        """What the summaries hold: the key dtype, or float32 for a quantized pool."""
        spec = self.spec
        return np.dtype(np.float32) if spec.quantized else block_summaries.summary_dtype(spec.dtype)

    @property
    def dtype(self) -> np.dtype:
        """The host array's element type: 32-bit words (each 16-bit summary value paired
        with its channel's other bound), so that one row is whole 32-bit sublanes, the
        smallest update the compiler slices into host memory."""
        return np.dtype(np.uint32)

    @property
    def half_width(self) -> int:
        return self.spec.num_kv_heads * self.spec.head_dim

    @property
    def row_width(self) -> int:
        """Words of one summary row: ``lo`` and ``hi`` of every channel of every KV head,
        interleaved."""
        return 2 * self.half_width * self.summary_dtype.itemsize // 4

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    @property
    def chunk_blocks(self) -> int:
        """Blocks of one summary chunk (a copy, scored at once)."""
        return min(self.spec.num_blocks, SUMMARY_CHUNK_BLOCKS)

    @property
    def num_chunks(self) -> int:
        return -(-self.spec.num_blocks // self.chunk_blocks)

    @property
    def layer_rows(self) -> int:
        """Rows of one layer: its physical blocks, padded to whole chunks."""
        return self.num_chunks * self.chunk_blocks

    @property
    def write_rows(self) -> int:
        """Rows of one aligned write: a 32-bit word's worth of the dtype per element (the
        smallest update the compiler slices into host memory, as for the pool)."""
        return max(1, 4 // self.dtype.itemsize)

    @property
    def sink_row(self) -> int:
        """The row (an aligned group) that writes of slots with no block go to."""
        group = self.write_rows
        return -(-self.spec.num_layers * self.layer_rows // group) * group

    @property
    def shape(self) -> tuple[int, int]:
        return (self.sink_row + self.write_rows, self.row_width)

    @property
    def nbytes(self) -> int:
        """Host bytes of every layer's summaries."""
        rows, width = self.shape
        return rows * width * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Device bytes of one summary chunk."""
        return self.chunk_blocks * self.row_bytes

    def row(self, layer, block):
        """Summary row of ``block`` in ``layer`` (traced or not)."""
        return layer * self.layer_rows + block

    def empty_rows(self, rows: int) -> np.ndarray:
        """``rows`` summary rows of blocks with no keys (``lo`` at the dtype's largest
        value, ``hi`` at its smallest), as the host array holds them."""
        big = jnp.finfo(self.summary_dtype).max
        values = np.empty((rows, self.half_width, 2), self.summary_dtype)
        values[..., 0] = big
        values[..., 1] = -big
        return values.view(self.dtype).reshape(rows, self.row_width)

    def to_values(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Summary rows ``[..., row_width]`` as ``(lo, hi)`` ``[..., H, D]`` in the summary
        dtype."""
        lead = rows.shape[:-1]
        # A word is one value (f32) or two ([..., row_width, 2]): lo, hi of a channel.
        pairs = jax.lax.bitcast_convert_type(rows, self.summary_dtype)
        pairs = pairs.reshape(*lead, self.spec.num_kv_heads, self.spec.head_dim, 2)
        return pairs[..., 0], pairs[..., 1]

    def to_rows(self, lo: jax.Array, hi: jax.Array) -> jax.Array:
        """``(lo, hi)`` ``[..., H, D]`` as summary rows ``[..., row_width]`` in the host
        array's dtype."""
        lead = lo.shape[:-2]
        pairs = jnp.stack([lo, hi], axis=-1).astype(self.summary_dtype)
        pairs = pairs.reshape(*lead, self.half_width * 2)
        if self.summary_dtype.itemsize == 4:
            return jax.lax.bitcast_convert_type(pairs, self.dtype)
        words = pairs.reshape(*lead, self.row_width, 4 // self.summary_dtype.itemsize)
        return jax.lax.bitcast_convert_type(words, self.dtype)


@jax.tree_util.register_pytree_node_class
class PoolSparseState:
    """The sparse part of a :class:`~jax_tpusync.core.pool_state.PoolState`.

    Fields (arrays):
      summaries: ``SummaryLayout.shape`` in ``pinned_host`` memory: every layer's block
        summaries.
      previous: int32[num_layers, batch, max_selected]: each layer's selection at its last
        sparse decode step (logical blocks, ascending, -1 padded): the next step's
        prediction for the layer.
      counts: int32[num_layers, len(COUNTS)]: per layer, the counts of :data:`COUNTS`
        since the cache was made (read with ``HostPoolKVCache.sparse_stats``).
      staged_chunk: [chunk_blocks, row_width] on the device: a layer's first summary
        chunk, copied a layer ahead (by the layer before, or the step before).
      staged_layer: int32[], the layer whose first chunk ``staged_chunk`` holds
        (``NOT_STAGED``: none; every host call that writes KV leaves none).

    ``config`` (a :class:`~jax_tpusync.sparse.SparseConfig`) is static.
    """

    FIELDS = ("summaries", "previous", "counts", "staged_chunk", "staged_layer")

    def __init__(
        self, config: SparseConfig, summaries, previous, counts, staged_chunk, staged_layer
    ):
        self.config = config
        self.summaries = summaries
        self.previous = previous
        self.counts = counts
        self.staged_chunk = staged_chunk
        self.staged_layer = staged_layer

    @staticmethod
    def previous_shape(config: SparseConfig, spec: CacheSpec) -> tuple[int, int, int]:
        return (spec.num_layers, spec.batch, config.max_selected(spec.max_blocks))

    @staticmethod
    def counts_shape(spec: CacheSpec) -> tuple[int, int]:
        return (spec.num_layers, len(COUNTS))

    @staticmethod
    def staged_chunk_shape(spec: CacheSpec) -> tuple[int, int]:
        layout = SummaryLayout(spec)
        return (layout.chunk_blocks, layout.row_width)

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in self.FIELDS), self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        return cls(config, *children)

    def replace(self, **changes) -> PoolSparseState:
        fields = {name: getattr(self, name) for name in self.FIELDS}
        fields.update(changes)
        return PoolSparseState(self.config, **fields)


def stored_keys(spec: CacheSpec, k: jax.Array) -> jax.Array:
    """Keys ``k`` [..., H, D] as a pool of ``spec`` stores them (a quantized pool: its
    codes dequantized), in the summary dtype: what the summaries bound."""
    dtype = SummaryLayout(spec).summary_dtype
    if spec.quantized:
        packed = quantize.quantize(k.astype(spec.dtype), spec.tier_dtype)
        codes, scales = quantize.unpack(packed, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
        return quantize.dequantize(codes, scales, jnp.float32).astype(dtype)
    return k.astype(spec.dtype).astype(dtype)


def keys_of_pool_rows(spec: CacheSpec, rows: jax.Array) -> jax.Array:
    """The keys [..., H, D] (in the summary dtype) of pool rows ``[..., row_width]`` (K then
    V, as :class:`~jax_tpusync.core.pool_state.PoolLayout` lays them out)."""
    dtype = SummaryLayout(spec).summary_dtype
    lead = rows.shape[:-1]
    half = rows.shape[-1] // 2
    k_rows = rows[..., :half]
    if spec.quantized:
        codes, scales = quantize.unpack(k_rows, spec.tier_dtype, spec.num_kv_heads, spec.head_dim)
        return quantize.dequantize(codes, scales, jnp.float32).astype(dtype)
    if k_rows.dtype != np.dtype(spec.dtype):
        k_rows = jax.lax.bitcast_convert_type(k_rows, spec.dtype)
    return k_rows.reshape(*lead, spec.num_kv_heads, spec.head_dim).astype(dtype)


def merge_summary_row(
    layout: SummaryLayout,
    summaries: jax.Array,  # host array, SummaryLayout.shape
    row,  # int32[]: the summary row
    lo: jax.Array,  # [H, D] summary dtype: the new keys' minimum
    hi: jax.Array,  # [H, D]
    fresh,  # bool[]: the row starts afresh (set to ``lo, hi``, not merged)
) -> jax.Array:
    """``summaries`` with ``row`` merged with ``(lo, hi)`` (or set to them, ``fresh``):
    its aligned group of rows read, changed and written back (host memory takes updates of
    whole 32-bit sublanes)."""
    group = layout.write_rows
    start = row - row % group
    old = to_device(jax.lax.dynamic_slice(summaries, (start, 0), (group, layout.row_width)))
    old_lo, old_hi = layout.to_values(jax.lax.dynamic_slice_in_dim(old, row % group, 1))
    lo = jnp.where(fresh, lo, jnp.minimum(old_lo[0], lo))
    hi = jnp.where(fresh, hi, jnp.maximum(old_hi[0], hi))
    new = jax.lax.dynamic_update_slice_in_dim(old, layout.to_rows(lo, hi)[None], row % group, 0)
    return jax.lax.dynamic_update_slice(summaries, into_pool(summaries, new), (start, 0))


def masked_bounds(keys: jax.Array, mask: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """``(lo, hi)``: the minimum and maximum of ``keys`` over ``axis`` where ``mask``
    (broadcast like ``keys``) holds; an empty summary where it holds nowhere."""
    big = jnp.finfo(keys.dtype).max
    return jnp.where(mask, keys, big).min(axis=axis), jnp.where(mask, keys, -big).max(axis=axis)
