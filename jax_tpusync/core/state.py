"""What a jitted step carries: the static :class:`CacheSpec` and the :class:`KVState` pytree.

The lowest layer of the cache above the in-graph ops: the step (``jax_tpusync.step``), the
host-side cache and the mesh all read these, and this module imports nothing above
:mod:`jax_tpusync.runtime.ops`. Also the dtype rule for KV going into a cache (exact conversions
only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import quantize, window_ring
from jax_tpusync.runtime import ops
from jax_tpusync.sparse import summaries

# Window value standing for "no sliding window" in traced per-layer window arrays.
NO_WINDOW = np.iinfo(np.int32).max // 2

INT32_MAX = int(np.iinfo(np.int32).max)


def row_bytes_of(num_kv_heads: int, head_dim: int, dtype: Any, tier_dtype: Any) -> int:
    """Bytes of one token's K (or V) row on the tier and in staging: ``num_kv_heads x
    head_dim`` values of ``dtype``, or a quantized row (``tier_dtype`` not None: codes plus
    scales, see :func:`jax_tpusync.core.quantize.row_bytes`). The one place a row's size is
    computed (:class:`~jax_tpusync.core.config.KVGeometry` and :class:`CacheSpec` ask it)."""
    if tier_dtype is not None:
        return quantize.row_bytes(num_kv_heads, head_dim)
    return num_kv_heads * head_dim * np.dtype(dtype).itemsize


def row_shape_of(num_kv_heads: int, head_dim: int, dtype: Any, tier_dtype: Any) -> tuple[int, ...]:
    """A staged row's shape: [num_kv_heads, head_dim] values, or [row_bytes] quantized."""
    if tier_dtype is not None:
        return (row_bytes_of(num_kv_heads, head_dim, dtype, tier_dtype),)
    return (num_kv_heads, head_dim)


def staging_shape_of(num_slots, batch, chunk_len, row_shape) -> tuple[int, ...]:
    """[num_slots, 2 (K, V), batch, chunk_len, *row_shape]: a row is [num_kv_heads,
    head_dim] values, or the [row_bytes] bytes of a quantized row."""
    return (num_slots, 2, batch, chunk_len, *row_shape)


def resident_shape_of(num_layers, batch, max_len, row_shape) -> tuple[int, ...]:
    """[num_layers, 2 (K, V), batch, max_len, *row_shape]: every layer's rows, by position."""
    return (num_layers, 2, batch, max_len, *row_shape)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Static description of an offloaded cache; hashable, so it rides in jit as aux data.

    It holds the configuration only, nothing of one cache object (which engine, tier and
    blocks is the state's ``target`` operand): two caches of one configuration share a
    compiled step.
    """

    num_layers: int
    batch: int
    max_len: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # a numpy dtype
    windows: tuple[int | None, ...]  # per layer; None: global attention
    chunk_len: int  # tokens per staging unit
    num_slots: int
    prefetch_depth: int
    block_tokens: int  # Token rows per KV block (a power of two).
    num_blocks: int  # Physical KV blocks per (layer, K|V).
    prefetch_across_steps: bool
    # ``dtype``, uint16 words holding its bits (see OffloadedKVCache), or uint8 (quantized).
    staging_dtype: Any
    tier_dtype: Any = None  # Codes of quantized rows (int8, float8_e4m3fn), or None.
    # Staging holds every layer's KV (see OffloadedKVCache's ``resident``); steps fetch nothing.
    resident: bool = False
    # A mesh cache's layout (jax_tpusync.core.mesh_layout.MeshLayout): the other fields describe one
    # shard, and every state leaf has a leading axis of shards. None: one device.
    mesh: Any = None
    # Two-level caches (jax_tpusync.core.spill): blocks per (layer, K|V) on the spill tier,
    # table ids [num_blocks, num_blocks + spill_blocks). 0: one tier.
    spill_blocks: int = 0
    # A host tier's units are attended to where they lie in the pool, on the CPU backend
    # (see jax_tpusync.step.in_place); False: they are copied into staging first.
    reads_in_place: bool = False
    # Of such a cache, a file tier's (or a two-level cache's spill tier's): each unit is
    # still fetched ahead (prefetch_depth), into the engine's landing memory, and attended
    # where it landed (ops.attend_landed; ops.attend_spilled with the DRAM tier's rows).
    attends_landed: bool = False
    # Most rows one step appends, when each slot keeps a ring of blocks covering its window
    # (every layer shares one window; see jax_tpusync.core.window_ring); 0: no ring.
    step_tokens: int = 0
    # Sparse decode (a jax_tpusync.sparse.SparseConfig): a decode row of a global layer
    # reads only the blocks its query selects; the state carries a SparseState. None: dense.
    sparse: Any = None
    # A host pool's slots per unit copy (jax_tpusync.core.pool_state.unit_slots): a layer
    # walks each unit a group of this many slots at a time. 0: every slot at once.
    unit_slots: int = 0

    @property
    def ring_blocks(self) -> int:
        """Blocks of each slot's ring, or 0: every slot keeps all its positions."""
        if not self.step_tokens:
            return 0
        return window_ring.ring_blocks(self.windows[0], self.step_tokens, self.block_tokens)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def quantized(self) -> bool:
        """Rows on the tier (and in staging) are codes plus scales (see ``quantize``)."""
        return self.tier_dtype is not None

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) row on the tier and in staging
        (:func:`row_bytes_of`)."""
        return row_bytes_of(self.num_kv_heads, self.head_dim, self.dtype, self.tier_dtype)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """A staged row's shape: [num_kv_heads, head_dim], or [row_bytes] quantized."""
        return row_shape_of(self.num_kv_heads, self.head_dim, self.dtype, self.tier_dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block: the tier's block size."""
        return self.block_tokens * self.row_bytes

    @property
    def max_blocks(self) -> int:
        """Block table entries per slot: the blocks of max_len tokens."""
        return -(-self.max_len // self.block_tokens)

    @property
    def kv_bytes(self) -> int:
        """Bytes the tier holds for the cache's blocks (every layer, K and V)."""
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    @property
    def unit_staging_shape(self) -> tuple[int, ...]:
        """[num_slots, 2, batch, chunk_len, *row_shape]: staging slots of ``chunk_len``-token
        units, what a streamed state's staging is (and what ops over units take)."""
        return staging_shape_of(self.num_slots, self.batch, self.chunk_len, self.row_shape)

    @property
    def staging_shape(self) -> tuple[int, ...]:
        """The state's staging: unit slots; every layer's rows (resident); or slots of no
        rows (read in place: no unit lands on the device)."""
        if self.resident:
            return resident_shape_of(self.num_layers, self.batch, self.max_len, self.row_shape)
        if self.reads_in_place:
            return staging_shape_of(self.num_slots, self.batch, 0, self.row_shape)
        return self.unit_staging_shape

    @property
    def device_bytes(self) -> int:
        """Device memory the state's staging buffers take, independent of context length
        (resident: the whole cache's rows; read in place: none)."""
        return math.prod(self.staging_shape) * np.dtype(self.staging_dtype).itemsize

    @property
    def regions(self) -> ops.Regions:
        """One region of KV blocks per (layer, K|V); every row inside the block it names."""
        return ops.Regions(
            base=0,
            nbytes=self.num_blocks * self.block_bytes,
            count=self.num_layers * 2,
            block_rows=True,
        )

    @property
    def levels(self) -> tuple[int, ...] | None:
        """Block ids per tier of a two-level cache (DRAM, spill); None: one tier."""
        return (self.num_blocks, self.spill_blocks) if self.spill_blocks else None

    @property
    def spill_regions(self) -> ops.Regions:
        """:attr:`regions` of the spill tier."""
        return dataclasses.replace(self.regions, nbytes=self.spill_blocks * self.block_bytes)

    @property
    def num_tickets(self) -> int:
        """Tickets a state carries: one per staging slot and tier."""
        return self.num_slots * (2 if self.spill_blocks else 1)

    @property
    def single_unit(self) -> bool:
        """True when every layer's cached KV fits one staging unit (no chunk loop)."""
        return self.chunk_len >= max(self.layer_span(w) for w in self.windows)

    def layer_span(self, window: int | None) -> int:
        """Most cached tokens one layer reads: all of max_len, or its window less one."""
        return self.max_len if window is None else min(self.max_len, max(window - 1, 1))

    def with_layer_window(self, layer, run):
        """``run(window)`` with ``layer``'s sliding window (None: global), which kernels
        and ops take statically: a traced layer (scan) with mixed windows switches over
        the distinct values."""
        if isinstance(layer, int):
            return run(self.windows[layer])
        distinct = sorted(set(self.windows), key=lambda w: -1 if w is None else w)
        if len(distinct) == 1:
            return run(distinct[0])
        index = jnp.asarray([distinct.index(w) for w in self.windows], jnp.int32)[layer]
        return jax.lax.switch(index, [functools.partial(run, w) for w in distinct])

    def windows_array(self) -> jax.Array:
        return jnp.asarray([NO_WINDOW if w is None else w for w in self.windows], jnp.int32)

    @property
    def max_selected(self) -> int:
        """Sparse: the static size of one slot's selection (0: dense)."""
        return self.sparse.max_selected(self.max_blocks) if self.sparse is not None else 0

    @property
    def summary_dtype(self) -> np.dtype:
        """Sparse: the dtype of the block summaries (the key dtype, or float32)."""
        return summaries.summary_dtype(self.dtype)

    @property
    def summary_shape(self) -> tuple[int, ...]:
        """Sparse: [num_layers, num_blocks, num_kv_heads, head_dim], one of ``lo``/``hi``."""
        return (self.num_layers, self.num_blocks, self.num_kv_heads, self.head_dim)

    @property
    def summary_bytes(self) -> int:
        """Sparse: bytes of the state's block summaries (``lo`` and ``hi``, every layer)."""
        if self.sparse is None:
            return 0
        return 2 * math.prod(self.summary_shape) * self.summary_dtype.itemsize


@jax.tree_util.register_pytree_node_class
class SparseState:
    """What a sparse cache's state carries for its layers' selections (device arrays).

    Fields:
      lo, hi: [num_layers, num_blocks, num_kv_heads, head_dim] in ``spec.summary_dtype``:
        per physical block, layer and KV head, the channel-wise minimum and maximum of the
        block's keys (:mod:`jax_tpusync.sparse.summaries`; an empty block: ``lo`` at the
        dtype's largest value, ``hi`` at its smallest). Kept per physical block, so blocks
        a prefix shares share them.
      previous: int32[num_layers, batch, max_selected]: each layer's exact selection at
        the last decode step (logical blocks, ascending, -1 padded): its prediction for
        the next one (:func:`jax_tpusync.sparse.prediction.predict`).
      counts: int32[num_layers, 5]: per layer, summed over the decode steps since the
        state's ``init``: blocks predicted, hits, late, wasted
        (:data:`jax_tpusync.sparse.prediction.COUNTS`), and the context blocks a dense
        step would have read.
      steps: int32[]: sparse decode steps counted (a dense step, e.g. a prefill chunk,
        counts nothing).
    """

    _FIELDS = ("lo", "hi", "previous", "counts", "steps")

    def __init__(self, lo, hi, previous, counts, steps):
        self.lo = lo
        self.hi = hi
        self.previous = previous
        self.counts = counts
        self.steps = steps

    @classmethod
    def empty(cls, spec: CacheSpec, lo=None, hi=None) -> SparseState:
        """No prediction, no counts; summaries ``lo``/``hi`` (None: every block empty)."""
        if lo is None or hi is None:
            lo, hi = summaries.empty(spec.summary_shape, spec.summary_dtype)
        return cls(
            lo=jnp.asarray(lo, spec.summary_dtype),
            hi=jnp.asarray(hi, spec.summary_dtype),
            previous=jnp.full((spec.num_layers, spec.batch, spec.max_selected), -1, jnp.int32),
            counts=jnp.zeros((spec.num_layers, 5), jnp.int32),
            steps=jnp.zeros((), jnp.int32),
        )

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in self._FIELDS), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def replace(self, **changes) -> SparseState:
        fields = {name: getattr(self, name) for name in self._FIELDS}
        fields.update(changes)
        return SparseState(**fields)


@jax.tree_util.register_pytree_node_class
class KVState:
    """What a jitted decode step carries (and donates) for an :class:`OffloadedKVCache`.

    Fields (all device arrays):
      lengths: int32[batch], tokens cached per slot.
      block_table: int32[batch, max_blocks], physical KV block of each slot's positions
        ``[i * block_tokens, (i + 1) * block_tokens)`` (-1: none).
      capacity: int32[batch], tokens each slot may hold (its reserved blocks, at most
        max_len); 0: the slot is inactive (no I/O, its length does not grow).
      staging: [num_slots, 2, batch, chunk_len, *row_shape] fetch landing zone; resident
        (``spec.resident``): [num_layers, 2, batch, max_len, *row_shape], every layer's rows
        by position, equal to the tier at each active slot's positions ``[0, length)``.
      tickets: int32[num_tickets], engine ticket of the fetch in flight into each slot (-1:
        none); a two-level cache: the DRAM tier's per slot, then the spill tier's.
      slot: int32[], the slot the next unit is consumed from.
      token: int32[], orders engine calls (write-backs before later fetches).
      owner: int32[3], (stream, epoch, generation): which cache stream, which start of it
        and which step of it this state is for. The engine refuses ops of a state that a
        newer one superseded (two steps from one parent, a state kept across
        ``init()``/``drain()``), so two states can never write the same tier rows.
      target: int32[6], (engine id, tier, first block, shard, spill tier, spill first
        block): where the cache's blocks are, which shard of a mesh cache this is (0 on
        one device), and where a two-level cache's spill blocks are (0, 0: none).
      sparse: a :class:`SparseState` (``spec.sparse`` set: the block summaries, each
        layer's last selection and the prediction counts), or None (dense: the state's
        pytree is then exactly the dense one).

    A mesh cache's state (``spec.mesh`` set) has a leading axis of shards on every field,
    sharded over the mesh (see :mod:`jax_tpusync.caches.offloaded.mesh`).

    The pytree structure depends on the :class:`CacheSpec` only, never on the cache object.
    """

    _FIELDS = (
        "lengths",
        "block_table",
        "capacity",
        "staging",
        "tickets",
        "slot",
        "token",
        "owner",
        "target",
    )

    def __init__(
        self,
        spec: CacheSpec,
        lengths,
        block_table,
        capacity,
        staging,
        tickets,
        slot,
        token,
        owner,
        target,
        sparse=None,
    ):
        self.spec = spec
        self.lengths = lengths
        self.block_table = block_table
        self.capacity = capacity
        self.staging = staging
        self.tickets = tickets
        self.slot = slot
        self.token = token
        self.owner = owner
        self.target = target
        self.sparse = sparse

    @classmethod
    def fresh(
        cls, spec, lengths, block_table, capacity, staging, owner, target, sparse=None
    ) -> KVState:
        """A state with no fetch in flight, its first unit next: ``lengths`` int[batch],
        ``block_table`` int[batch, max_blocks], ``capacity`` int[batch], ``staging`` of
        ``spec.staging_shape``, ``owner`` int32[3], ``target`` int[6]; a sparse spec's
        ``sparse`` (None: empty summaries, no prediction)."""
        if spec.sparse is not None and sparse is None:
            sparse = SparseState.empty(spec)
        return cls(
            spec,
            lengths=jnp.asarray(lengths, jnp.int32),
            block_table=jnp.asarray(block_table, jnp.int32),
            capacity=jnp.asarray(capacity, jnp.int32),
            staging=staging,
            tickets=jnp.full((spec.num_tickets,), ops.NO_TICKET, jnp.int32),
            slot=jnp.zeros((), jnp.int32),
            token=jnp.zeros((), jnp.int32),
            owner=owner,
            target=jnp.asarray(target, jnp.int32),
            sparse=sparse if spec.sparse is not None else None,
        )

    def tree_flatten(self):
        children = tuple(getattr(self, name) for name in self._FIELDS)
        if self.spec.sparse is not None:  # A dense state's pytree stays the dense one.
            children += (self.sparse,)
        return children, self.spec

    @classmethod
    def tree_unflatten(cls, spec, children):
        return cls(spec, *children)

    @classmethod
    def from_leaves(cls, spec: CacheSpec, leaves) -> KVState:
        """The state of ``spec`` whose ``jax.tree_util.tree_leaves`` are ``leaves`` (a mesh
        cache's shards are split and assembled leaf by leaf)."""
        leaves = list(leaves)
        fields, rest = leaves[: len(cls._FIELDS)], leaves[len(cls._FIELDS) :]
        sparse = SparseState(*rest) if spec.sparse is not None else None
        if len(rest) != (len(SparseState._FIELDS) if sparse is not None else 0):
            raise ValueError(f"{len(leaves)} leaves are not a KVState's of this spec")
        return cls(spec, *fields, sparse=sparse)

    def positions(self, q_len: int) -> jax.Array:
        """int32[batch, q_len]: each slot's next ``q_len`` positions, ``lengths[:, None] +
        arange(q_len)``: where a step's query row ``i`` of slot ``b`` sits (its RoPE
        position), and where its K/V row goes if it is one of the slot's real rows (see
        ``query_seq_lengths`` of :func:`~jax_tpusync.prefetching_attention`). A mesh
        cache's global state: [shards, batch, q_len], each shard's slots."""
        lengths = jnp.asarray(self.lengths, jnp.int32)
        return lengths[..., None] + jnp.arange(q_len, dtype=jnp.int32)

    def replace(self, **changes) -> KVState:
        fields = {name: getattr(self, name) for name in (*self._FIELDS, "sparse")}
        fields.update(changes)
        return KVState(self.spec, **fields)

    def __repr__(self) -> str:
        return f"KVState(lengths={self.lengths}, device_bytes={self.spec.device_bytes})"


def exact_cast_allowed(src: Any, dst: Any) -> bool:
    """Whether KV of dtype ``src`` may go into a cache of dtype ``dst`` without an explicit
    cast: the same dtype, or a float dtype that ``np.can_cast(src, dst, "safe")`` converts
    exactly (bfloat16 or float16 into float32). Integer sources are refused although some
    convert exactly: integer KV is quantized data, whose values are not the KV."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst:
        return True
    return bool(np.issubdtype(src, np.floating) or src == np.dtype(jnp.bfloat16)) and np.can_cast(
        src, dst, casting="safe"
    )


def dtype_error(name: str, src: Any, dst: Any) -> str:
    """The message refusing ``name`` of dtype ``src`` for a cache of dtype ``dst``."""
    dst_name = np.dtype(dst).name
    return (
        f"{name} has dtype {np.dtype(src).name} but the cache holds {dst_name}, and the "
        f"conversion is not exact (only the same dtype or a float dtype that "
        f"np.can_cast(..., casting='safe') allows is converted implicitly); pass "
        f"{name}.astype({dst_name}) if the rounding is intended"
    )
