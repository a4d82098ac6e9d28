"""The host pool: a paged KV cache kept in a JAX array in host memory, and the state a
jitted step carries for it (:class:`PoolState`).

On a TPU the in-graph ops of the other data paths (XLA FFI custom calls into the C++
engine) do not exist: XLA runs custom calls of this kind on CPU and CUDA only. What the TPU
compiler does provide is memory kinds: an array may live in ``pinned_host`` memory, and a
program may slice it and move the slices to the device (asynchronous copies it schedules
against compute), or move device values into it. So on this path the pool itself is a
program operand, carried and donated through every step like the rest of the state, and
the step does its transfers with plain JAX (:mod:`jax_tpusync.step.host_pool`).

The pool's layout is chosen for what the TPU compiler accepts and moves fast:

* one 2-D array ``[pool_rows, row_width]``: every (layer, block) is ``block_tokens``
  consecutive rows, so a block is one slice of the first dimension (asynchronous slices
  of host memory may cut one dimension only);
* a row is one token's K and V together: ``[K values, V values]`` of ``num_kv_heads *
  head_dim`` each (or the two quantized rows' bytes), so a block moves in one copy;
* rows are written in aligned groups of :attr:`PoolLayout.write_rows` rows (one 32-bit
  sublane's worth: 1 row of f32, 2 of 16-bit values, 4 of bytes), the smallest update the
  compiler slices into host memory; a step rewrites the few rows before its first new
  one with the values they hold;
* one extra block at the end, the *sink*: table entries past a slot's blocks, and writes
  past its capacity, go there, never into another slot's blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import quantize
from jax_tpusync.core.state import CacheSpec

# The memory kind of the pool; the CPU backend has it too, which is how the path is
# emulated and tested there.
POOL_MEMORY_KIND = "pinned_host"

# staged_at entry of a staging that holds no fetch.
NOT_STAGED = -1

# Host-to-device copies the TPU compiler keeps in flight at once (libtpu's
# ``xla_tpu_host_transfer_overlap_limit``, 32 in the libtpu that jax 0.10 pins, on v5e,
# v6e and TPU7x alike): read off compiled decode steps, a loop iteration whose unit makes
# more copies than this waits for the rest before the attention (batch 2, 16 blocks and a
# tail per slot: 32 of 34 copies overlapped; with the limit raised to 64, all 34; lowered
# to 16, 16), whatever the block size. A sparse pool's summary chunk copies take no share
# of it: each is made in its layer's scoring loop (jax_tpusync.step.pool_sparse), a program
# of its own holding one copy and no unit's, so a unit keeps every copy the limit allows.
# (Made in the step's top-level program instead, a layer's copy of the next layer's first
# chunk overlapped 2 of 8 times at 32K on v5e with units of 31 blocks, 8 of 8 with 30: the
# compiled program showed it waiting for the layer's summary write, which the compiler
# overlaps with the walk, and so starting after the walk, not a want of copies in flight.)
HOST_COPIES_IN_FLIGHT = 32

# Most blocks per unit off TPUs, where no compiler bounds the copies: the CPU emulation
# runs units of a one-slot TPU's size.
OFF_TPU_UNIT_BLOCKS = 30


def unit_slots(device_kind: str, batch: int = 1) -> int:
    """Slots one unit's copies cover on a device of ``device_kind`` holding ``batch``.

    A unit makes a block copy and a tail copy per slot at least, so on a TPU at most
    ``HOST_COPIES_IN_FLIGHT // 2`` (16) slots fit the copies the compiler keeps in flight
    (:data:`HOST_COPIES_IN_FLIGHT`). Above that a layer walks each unit in groups of
    slots: ``ceil(batch / 16)`` groups of ``ceil(batch / groups)`` slots (the last one
    padded), each group's copies issued one unit ahead and attended by its own rows
    (:func:`jax_tpusync.step.host_pool.pool_layer`). Up to 16 slots, and off TPUs (no
    compiler bounds the copies there), every slot: ``batch``."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be at least 1")
    most = HOST_COPIES_IN_FLIGHT // 2
    if not device_kind.startswith("TPU") or batch <= most:
        return batch
    groups = -(-batch // most)
    return -(-batch // groups)


def unit_block_limit(device_kind: str, batch: int = 1) -> int:
    """Most blocks per unit on a device of ``device_kind`` holding ``batch`` slots.

    A unit of a group of slots (:func:`unit_slots`) is one asynchronous copy per block and
    one per tail, for each slot: ``slots * (blocks + 1)`` copies, at any
    ``prefetch_depth`` (a loop iteration starts one unit's copies). On a TPU they all
    overlap the attention when they fit the copies the compiler keeps in flight
    (:data:`HOST_COPIES_IN_FLIGHT`), so a unit holds ``HOST_COPIES_IN_FLIGHT // slots -
    1`` blocks: at least one, since a group holds at most 16 slots. Off TPUs,
    :data:`OFF_TPU_UNIT_BLOCKS` whatever the batch: a unit copies every one of its blocks,
    so a unit as large as the staging allows would copy up to a slot's whole capacity
    each layer, however short its context (measured on a 2-core VM, bf16, 4 layers of 8 KV
    heads x 64: a 4K-token context in a 64K-token slot took 196 ms a step in units of 256
    blocks)."""
    slots = unit_slots(device_kind, batch)
    if not device_kind.startswith("TPU"):
        return OFF_TPU_UNIT_BLOCKS
    return HOST_COPIES_IN_FLIGHT // slots - 1


def unit_copies(batch: int, blocks_per_unit: int) -> int:
    """Asynchronous copies one unit of ``batch`` slots makes: a block each and a tail each."""
    return batch * (blocks_per_unit + 1)


def pool_dtype(dtype: Any, quantized: bool) -> np.dtype:
    """What a pool (and its staged units) holds for KV of ``dtype``: uint8 codes when
    quantized; a 16-bit float's bits as uint16 words; else ``dtype`` itself.

    Why words: XLA's CPU backend widens a 16-bit float array to f32 to update a slice of
    it, which turns every write into the pool (a step's rows, a load, an import) into a
    copy of the whole pool (measured on a 2-core VM: 132 ms per write into a 132 MiB bf16
    pool, 0.1 ms into the same pool as uint16). The words are the same bytes, viewed as
    floats where the rows are attended; on a TPU the view costs nothing."""
    dtype = np.dtype(dtype)
    if quantized:
        return np.dtype(np.uint8)
    if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.uint16)
    return dtype


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Where a cache's rows lie in its host pool; derived from the :class:`CacheSpec`."""

    spec: CacheSpec

    def __post_init__(self):
        spec = self.spec
        if spec.chunk_len % spec.block_tokens:
            raise ValueError(
                f"chunk_len={spec.chunk_len} must be a multiple of "
                f"block_tokens={spec.block_tokens}: a host-pool unit is whole blocks"
            )
        if spec.block_tokens % self.write_rows:
            raise ValueError(
                f"block_tokens={spec.block_tokens} must be a multiple of {self.write_rows} "
                f"(the rows one write of {np.dtype(self.dtype).name} moves)"
            )

    @property
    def dtype(self) -> np.dtype:
        """The pool's element type (:func:`pool_dtype`)."""
        return pool_dtype(self.spec.dtype, self.spec.quantized)

    @property
    def half_width(self) -> int:
        """Elements of one K (or V) row: ``num_kv_heads * head_dim``, or its bytes when
        quantized."""
        spec = self.spec
        return spec.row_bytes if spec.quantized else spec.num_kv_heads * spec.head_dim

    @property
    def row_width(self) -> int:
        """Elements of one pool row: the token's K row, then its V row."""
        return 2 * self.half_width

    @property
    def write_rows(self) -> int:
        """Rows of one aligned write: a 32-bit word's worth of this dtype per element."""
        return max(1, 4 // self.dtype.itemsize)

    @property
    def blocks_per_unit(self) -> int:
        return self.spec.chunk_len // self.spec.block_tokens

    @property
    def group_slots(self) -> int:
        """Slots one unit copy covers (:func:`unit_slots`): a layer walks each unit a group
        of them at a time; every slot where the spec names no groups."""
        slots = self.spec.unit_slots
        return slots if 0 < slots < self.spec.batch else self.spec.batch

    @property
    def slot_groups(self) -> int:
        """Groups of :attr:`group_slots` a unit is walked in (the last one padded)."""
        return -(-self.spec.batch // self.group_slots)

    @property
    def single_unit(self) -> bool:
        """Whether every layer's keys fit one unit: units start at a block boundary, so a
        window's keys may reach ``block_tokens - 1`` rows past its span."""
        spec = self.spec
        reach = max(
            spec.max_len if w is None else spec.layer_span(w) + spec.block_tokens - 1
            for w in spec.windows
        )
        return spec.chunk_len >= reach

    @property
    def sink_row(self) -> int:
        """First row of the sink block (after every layer's blocks)."""
        spec = self.spec
        return spec.num_layers * spec.num_blocks * spec.block_tokens

    @property
    def pool_shape(self) -> tuple[int, int]:
        """[pool_rows, row_width]: every layer's blocks, then the sink."""
        return (self.sink_row + self.spec.block_tokens, self.row_width)

    @property
    def pool_bytes(self) -> int:
        rows, width = self.pool_shape
        return rows * width * self.dtype.itemsize

    @property
    def staging_shape(self) -> tuple[int, int, int]:
        """[batch, chunk_len, row_width]: one unit of every slot, on the device."""
        return (self.spec.batch, self.spec.chunk_len, self.row_width)

    @property
    def tail_shape(self) -> tuple[int, int, int]:
        """[batch, write_rows, row_width]: each slot's write group at its length."""
        return (self.spec.batch, self.write_rows, self.row_width)

    @property
    def staging_bytes(self) -> int:
        """Device bytes of one staged unit and its tails (a step holds ``prefetch_depth +
        1`` of them: the units staged ahead and the one in flight)."""
        per_row = self.row_width * self.dtype.itemsize
        return self.spec.batch * (self.spec.chunk_len + self.write_rows) * per_row

    @property
    def device_bytes(self) -> int:
        """Device bytes of a step's units: ``prefetch_depth`` staged ahead (the state's)
        and the one in flight, each with its tails."""
        return (self.spec.prefetch_depth + 1) * self.staging_bytes

    @property
    def staged_at_shape(self) -> tuple[int, int]:
        """[batch, blocks_per_unit + 1]: a staged unit's pool rows (see :class:`PoolState`)."""
        return (self.spec.batch, self.blocks_per_unit + 1)

    def block_row(self, layer, block):
        """Pool row of ``block``'s first token in ``layer`` (traced or not)."""
        spec = self.spec
        return (layer * spec.num_blocks + block) * spec.block_tokens

    def host_rows(self, layer: int, block_ids: np.ndarray) -> np.ndarray:
        """int64[n * block_tokens]: the pool rows of ``layer``'s blocks ``block_ids``, in
        order (host-side indexing for loads and reads)."""
        bt = self.spec.block_tokens
        starts = self.block_row(layer, np.asarray(block_ids, np.int64))
        return (starts[:, None] + np.arange(bt)).reshape(-1)


@jax.tree_util.register_pytree_node_class
class PoolState:
    """What a jitted step carries (and donates) for a host-pool cache.

    Fields (arrays):
      lengths: int32[batch], tokens cached per slot.
      block_table: int32[batch, max_blocks], physical block of each slot's positions
        ``[i * block_tokens, (i + 1) * block_tokens)`` (-1: none); a cache that keeps only
        its window repeats each slot's ring in it (:mod:`jax_tpusync.core.window_ring`).
      capacity: int32[batch], tokens each slot may hold; 0: inactive.
      pool: [pool_rows, row_width] in ``pinned_host`` memory: every layer's blocks (see
        :class:`PoolLayout`).
      staging: [batch, chunk_len, row_width] on the device: the unit fetched ahead, the
        next one a layer attends.
      tail: [batch, write_rows, row_width] on the device: fetched with it, the write group
        at each slot's length in that unit's layer.
      staged_at: int32[batch, blocks_per_unit + 1], the pool row each staged block (and,
        last, each tail) was copied from; ``NOT_STAGED``: nothing staged. A layer uses
        staging only where this equals the rows it needs, and copies them itself otherwise
        (a prefetch is an optimization, never a source of data).
      refused: int32[batch], tokens of steps refused for each slot because they would
        have passed its capacity (its length did not grow; the rows went to the sink).
        The cache refuses every host call on a state with a refusal, naming the slot.
      epoch: int32[], which host call of its cache made the state (unique across caches; a
        step passes it on): a cache refuses a state that is not the last one it made, so a
        state a later call superseded (its block tables may name blocks another slot holds
        now) or another cache's is never used again. 0: a state no call may take.
      ahead: the units staged after that one, ``prefetch_depth - 1`` tuples ``(staging,
        tail, staged_at)`` in the order they are attended (empty at depth 1).
      sparse: a cache made with ``sparse=``: its
        :class:`~jax_tpusync.core.pool_sparse.PoolSparseState` (block summaries in host
        memory, each layer's prediction and counts); None: dense (no leaves).

    The pytree structure depends on the :class:`CacheSpec` and the sparse setting only.
    """

    FIELDS = (
        "lengths",
        "block_table",
        "capacity",
        "pool",
        "staging",
        "tail",
        "staged_at",
        "refused",
        "epoch",
        "ahead",
        "sparse",
    )

    def __init__(
        self,
        spec,
        lengths,
        block_table,
        capacity,
        pool,
        staging,
        tail,
        staged_at,
        refused,
        epoch,
        ahead=(),
        sparse=None,
    ):
        self.spec = spec
        self.lengths = lengths
        self.block_table = block_table
        self.capacity = capacity
        self.pool = pool
        self.staging = staging
        self.tail = tail
        self.staged_at = staged_at
        self.refused = refused
        self.epoch = epoch
        self.ahead = tuple(tuple(unit) for unit in ahead)
        self.sparse = sparse

    @property
    def layout(self) -> PoolLayout:
        return PoolLayout(self.spec)

    @classmethod
    def fresh(cls, spec: CacheSpec, lengths, block_table, capacity, pool) -> PoolState:
        """A state of these tables over ``pool`` (an array of :attr:`PoolLayout.pool_shape`
        in host memory), nothing staged."""
        layout = PoolLayout(spec)

        def unstaged():
            return (
                jnp.zeros(layout.staging_shape, layout.dtype),
                jnp.zeros(layout.tail_shape, layout.dtype),
                jnp.full(layout.staged_at_shape, NOT_STAGED, jnp.int32),
            )

        staging, tail, staged_at = unstaged()
        return cls(
            spec,
            lengths=jnp.asarray(lengths, jnp.int32),
            block_table=jnp.asarray(block_table, jnp.int32),
            capacity=jnp.asarray(capacity, jnp.int32),
            pool=pool,
            staging=staging,
            tail=tail,
            staged_at=staged_at,
            refused=jnp.zeros((spec.batch,), jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            ahead=tuple(unstaged() for _ in range(spec.prefetch_depth - 1)),
        )

    @property
    def staged_units(self) -> tuple[tuple[jax.Array, jax.Array, jax.Array], ...]:
        """Every staged unit, ``(staging, tail, staged_at)``, the next one attended first."""
        return ((self.staging, self.tail, self.staged_at), *self.ahead)

    def with_staged_units(self, units) -> PoolState:
        """This state holding ``units`` (as :attr:`staged_units` lists them) staged."""
        (staging, tail, staged_at), *ahead = units
        return self.replace(staging=staging, tail=tail, staged_at=staged_at, ahead=tuple(ahead))

    def with_spec(self, spec: CacheSpec) -> PoolState:
        """The same arrays under ``spec`` (one shard's spec of a mesh state, say)."""
        return PoolState(spec, **{name: getattr(self, name) for name in self.FIELDS})

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in self.FIELDS), self.spec

    @classmethod
    def tree_unflatten(cls, spec, children):
        return cls(spec, *children)

    def positions(self, q_len: int) -> jax.Array:
        """int32[batch, q_len]: each slot's next ``q_len`` positions (see
        :meth:`jax_tpusync.core.state.KVState.positions`)."""
        return jnp.asarray(self.lengths, jnp.int32)[..., None] + jnp.arange(q_len, dtype=jnp.int32)

    def replace(self, **changes) -> PoolState:
        fields = {name: getattr(self, name) for name in self.FIELDS}
        fields.update(changes)
        return PoolState(self.spec, **fields)

    def __repr__(self) -> str:
        return f"PoolState(lengths={self.lengths}, pool={self.pool.shape})"


def to_device(x: jax.Array) -> jax.Array:
    """``x`` (a slice of the pool) copied to device memory."""
    return jax.device_put(x, jax.memory.Space.Device)


def into_pool(pool: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` placed where updates of ``pool`` come from: host memory when the pool is traced
    as a host array (a concrete argument), else left to the compiler, which moves it into
    the host memory the pool's sharding names (an abstract argument traces as a device
    array whatever its sharding)."""
    if jax.typeof(pool).memory_space == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Host)
    return x


def pool_rows_of(
    layout: PoolLayout,
    k: jax.Array,  # [batch, n, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, n, num_kv_heads, head_dim]
) -> jax.Array:  # [batch, n, row_width] in layout.dtype
    """New K/V as pool rows: K then V, in the cache's dtype (quantized: the codes and
    scales' bytes of each), as the pool holds it (16-bit floats as words)."""
    spec = layout.spec
    both = jnp.stack([k, v]).astype(spec.dtype)
    if spec.quantized:
        both = quantize.quantize(both, spec.tier_dtype)
    elif both.dtype != layout.dtype:
        both = jax.lax.bitcast_convert_type(both, layout.dtype)
    both = both.reshape(*both.shape[:3], layout.half_width)
    return jnp.concatenate([both[0], both[1]], axis=-1)


def pool_sharding(device: jax.Device) -> jax.sharding.Sharding:
    """Where a one-device pool lives: ``device``'s pinned host memory."""
    return jax.sharding.SingleDeviceSharding(device, memory_kind=POOL_MEMORY_KIND)
