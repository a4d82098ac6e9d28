"""In-graph transfer ops: XLA custom calls into the engine, usable inside ``jax.jit``.

The pair :func:`start_fetch` / :func:`wait_fetch` splits a fetch so that compute placed
between them overlaps the copy. XLA is free to reorder anything that has no data
dependency, and on CPU its memory-optimized scheduler does move a wait ahead of unrelated
compute (``lax.optimization_barrier`` does not stop it). Ordering therefore comes from data:

* ``start_fetch`` passes an activation the following compute needs *through* itself, so
  that compute cannot begin before the fetch is queued;
* ``wait_fetch`` takes the overlapping compute's outputs as extra operands (``deps``), so it
  cannot run before that compute is done.

Never stale, by construction. A fetch lands in memory the engine owns; only the
``wait_fetch`` that consumes it writes the bytes into its own operand, while it runs. XLA may
copy, free or reuse any buffer of a compiled program between two ops (it copies a donated,
aliased buffer in some graphs), and a state may be dropped or a program interrupted with
fetches in flight: none of that can receive a late write. Every wait compares the fetch
that was started with the one it needs (tier bytes and offsets in its buffer) and reads
the bytes itself on a mismatch.

Ownership. Ops take an ``owner`` operand, int32[4] ``(stream, epoch, generation, claims)``
(see :class:`jax_tpusync.KVState`): the engine refuses an op of a state that a newer state
of the same cache has superseded; a step's first op claims its generation, which a second
step from the same state cannot claim again. Stream 0 (the default) is unchecked.

Target. ``engine_id``, ``tier`` and ``first_block`` travel as one int32[3] *operand*, not
as attributes, so one compiled step serves every cache of the same configuration (they may
be Python ints or traced int32 scalars).

Segments are ``int32[n, 4]`` rows ``(block, offset_in_block, memory_offset, nbytes)``: the
tier byte offset is ``(first_block + block) * block_bytes + offset_in_block``, which reaches
past 2 GiB without ``jax_enable_x64``. Rows with ``nbytes == 0`` are skipped; rows that
continue one another on the tier and in memory are merged into one transfer (a sequence's
consecutive KV blocks cost one request).

A row ``(CAPACITY_GUARD, length, count, capacity)`` moves nothing: the op fails before any
byte moves unless ``length + count <= capacity`` (see :func:`capacity_guards`). A cache
puts one per sequence in each write-back, so a sequence that would outgrow its room is
refused by name rather than writing into the region next to it.

A row ``(SHARD_GUARD, state_shard, device_shard, 0)`` ahead of those moves nothing
either: the op fails unless the two agree (see :func:`shard_guard`).

An optional :class:`Regions` tells the engine how the caller carved its allocation
(``count`` regions of ``nbytes`` from byte ``base`` past ``first_block``, e.g. one per layer
and K|V). Every segment must then lie inside one region, and with ``block_rows`` inside the
one block its row names, so an out-of-range layer or a row past its KV block is an error
rather than a read or write of a neighbouring sequence's KV.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync import _tpusync

_TARGETS = {
    "start": "tpusync_start",
    "wait": "tpusync_wait",
    "write_back": "tpusync_write_back",
    "mark": "tpusync_mark",
    "attend": "tpusync_attend",
    "attend_landed": "tpusync_attend_landed",
    "attend_spilled": "tpusync_attend_spilled",
}

# kv_dtype codes of :func:`attend_in_place` (engine/pool_attention.h).
IN_PLACE_KV_DTYPES = {np.dtype(np.float32): 0, np.dtype(jnp.bfloat16): 1}
# Its tier_dtype codes: rows of kv_dtype values (None), or quantized rows of these codes
# with per-(token, head) float32 scales (jax_tpusync.core.quantize's layout).
IN_PLACE_TIER_DTYPES = {None: 0, np.dtype(np.int8): 1, np.dtype(jnp.float8_e4m3fn): 2}

NO_TICKET = -1
INT32_MAX = int(np.iinfo(np.int32).max)
# (stream, epoch, generation, claims) of ops that no cache state owns: not checked.
NO_OWNER = (0, 0, 0, 0)

# Block field of a capacity guard row (see the module docstring).
CAPACITY_GUARD = -2
# Block field of a shard guard row (see shard_guard()).
SHARD_GUARD = -3

# Kinds for mark(): compute spans in the timeline.
MARK_COMPUTE_BEGIN = 1
MARK_COMPUTE_END = 2


@dataclasses.dataclass(frozen=True)
class Regions:
    """``count`` tier regions of ``nbytes`` bytes each, starting at tier byte ``base``."""

    base: int = 0
    nbytes: int = 0  # 0: no region check.
    count: int = 0
    block_rows: bool = False  # Each row must stay inside the tier block it names.

    def __post_init__(self):
        if self.base < 0 or self.nbytes < 0 or self.count < 0:
            raise ValueError(f"{self} has a negative field")
        if self.nbytes and not self.count:
            raise ValueError(f"{self}: count must be positive when nbytes is")


_UNCHECKED = Regions()


def _register() -> None:
    for name, capsule in _tpusync.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


_register()


def _ffi_call(*args, **kwargs):
    """``jax.ffi.ffi_call``, with the CUDA handlers registered first where a GPU is visible.

    Deferred from import: finding out starts JAX's backends, and importing this package
    must not (:func:`jax_tpusync.split_cpus` has to run before they start).
    """
    from jax_tpusync.runtime import _cuda

    _cuda.register()
    return jax.ffi.ffi_call(*args, **kwargs)


def _check_segments(segments: jax.Array) -> None:
    if segments.ndim != 2 or segments.shape[1] != 4:
        raise ValueError(f"segments must be int32[n, 4]; got shape {segments.shape}")
    if segments.dtype != jnp.int32:
        raise ValueError(f"segments must be int32; got {segments.dtype}")


def _check_tag(tag: jax.Array) -> jax.Array:
    tag = jnp.asarray(tag, dtype=jnp.int32)
    if tag.shape != (2,):
        raise ValueError(f"tag must be int32[2] (layer, chunk); got shape {tag.shape}")
    return tag


def _check_owner(owner) -> jax.Array:
    owner = jnp.asarray(NO_OWNER if owner is None else owner, dtype=jnp.int32)
    if owner.shape != (4,):
        raise ValueError(
            f"owner must be int32[4] (stream, epoch, generation, claims); got shape "
            f"{owner.shape}"
        )
    return owner


def _attrs(regions: Regions | None) -> dict:
    regions = regions or _UNCHECKED
    return dict(
        region_base=np.int64(regions.base),
        region_bytes=np.int64(regions.nbytes),
        region_count=np.int64(regions.count),
        region_block_rows=np.int32(regions.block_rows),
    )


def target(engine_id, tier, first_block=0) -> jax.Array:
    """int32[3] (engine id, tier, first block) operand of a transfer op.

    Each may be a Python int (checked here) or a traced int32 scalar (checked by the op).
    """
    fields = (("engine_id", engine_id, 1), ("tier", tier, 0), ("first_block", first_block, 0))
    for name, value, low in fields:
        if not isinstance(value, (int, np.integer)):
            continue
        if name == "engine_id" and value < low:
            raise ValueError(f"engine_id={value} is not a valid engine id")
        if not low <= value <= INT32_MAX:
            raise ValueError(f"{name}={value} must be >= {low} and fit int32")
    return jnp.stack([jnp.asarray(x, jnp.int32).reshape(()) for _, x, _ in fields])


def buffer_bytes(x) -> int:
    """Bytes of an array or tracer: the ``dst_bytes`` of a fetch that ``x`` will receive."""
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _sds(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def start_fetch(
    engine_id: int,
    tier: int,
    passthrough: jax.Array,
    segments: jax.Array,
    tag: jax.Array,
    *,
    dst_bytes: int,
    deps: Sequence[jax.Array] = (),
    regions: Regions | None = None,
    retire: jax.Array | int = NO_TICKET,
    owner: jax.Array | Sequence[int] | None = None,
    first_block: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Queues a fetch of ``segments``; returns ``(passthrough, ticket)``.

    Args:
      engine_id: :attr:`Engine.id`.
      tier: the tier index to read.
      passthrough: an array the overlapping compute consumes; returned unchanged (aliased).
      segments: int32[n, 4] rows (block, offset_in_block, memory_offset, nbytes), the
        memory offsets into the buffer the matching :func:`wait_fetch` will fill.
      tag: int32[2] (layer, chunk), recorded in the engine timeline.
      dst_bytes: size of that buffer (every segment must fit in it).
      deps: arrays that must exist before the fetch is queued (e.g. a write-back token).
      regions: optional bounds every segment must respect (see the module docstring).
      retire: int32 ticket of an earlier fetch nobody will wait for (the slot's previous
        prefetch); it is discarded.
      owner: int32[4] (stream, epoch, generation, claims); default unchecked.
      first_block: the tier block that segment blocks count from (a cache's allocation).

    Returns:
      ``(passthrough, ticket)``; ``ticket`` is an int32 scalar for :func:`wait_fetch`.
    """
    _check_segments(segments)
    tag = _check_tag(tag)
    if not isinstance(dst_bytes, (int, np.integer)) or dst_bytes < 0:
        raise ValueError(f"dst_bytes={dst_bytes!r} must be an int >= 0")
    call = _ffi_call(
        _TARGETS["start"],
        (_sds(passthrough), jax.ShapeDtypeStruct((), jnp.int32)),
        input_output_aliases={0: 0},
        has_side_effect=True,
    )
    retire = jnp.asarray(retire, dtype=jnp.int32)
    if retire.shape != ():
        raise ValueError(f"retire must be an int32 scalar; got shape {retire.shape}")
    return call(
        passthrough,
        segments,
        tag,
        retire,
        _check_owner(owner),
        target(engine_id, tier, first_block),
        *deps,
        **_attrs(regions),
        dst_bytes=np.int64(dst_bytes),
    )


def wait_fetch(
    engine_id: int,
    tier: int,
    dst: jax.Array,
    ticket: jax.Array,
    segments: jax.Array,
    tag: jax.Array,
    deps: Sequence[jax.Array] = (),
    regions: Regions | None = None,
    owner: jax.Array | Sequence[int] | None = None,
    first_block: jax.Array | int = 0,
) -> jax.Array:
    """Returns ``dst`` with ``segments`` written into it (aliased: donate ``dst``).

    Copies the bytes ``ticket`` fetched if it fetched exactly ``segments``; if ``ticket`` is
    :data:`NO_TICKET` or fetched different bytes (a stale or mismatched prefetch), reads
    ``segments`` itself. ``deps`` are the outputs of the compute that should overlap the
    fetch.
    """
    _check_segments(segments)
    tag = _check_tag(tag)
    ticket = jnp.asarray(ticket, dtype=jnp.int32)
    if ticket.shape != ():
        raise ValueError(f"ticket must be an int32 scalar; got shape {ticket.shape}")
    call = _ffi_call(_TARGETS["wait"], _sds(dst), input_output_aliases={0: 0}, has_side_effect=True)
    return call(
        dst,
        ticket,
        segments,
        tag,
        _check_owner(owner),
        target(engine_id, tier, first_block),
        *deps,
        **_attrs(regions),
    )


def write_back(
    engine_id: int,
    tier: int,
    src: jax.Array,
    segments: jax.Array,
    tag: jax.Array,
    deps: Sequence[jax.Array] = (),
    regions: Regions | None = None,
    owner: jax.Array | Sequence[int] | None = None,
    first_block: jax.Array | int = 0,
) -> jax.Array:
    """Writes ``src`` bytes to the tier in the background; returns an int32 order token.

    ``segments`` rows address ``src`` bytes with their ``memory_offset``. The bytes are copied
    out before the op returns, so ``src`` may be reused at once. Later fetches of the same
    tier bytes are ordered after this write by the engine; pass the token to later ops as a
    dep to make sure XLA issues them after it. A failed write-back makes every later engine
    call fail (KV is never silently lost).
    """
    _check_segments(segments)
    tag = _check_tag(tag)
    call = _ffi_call(
        _TARGETS["write_back"], jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
    )
    return call(
        src,
        segments,
        tag,
        _check_owner(owner),
        target(engine_id, tier, first_block),
        *deps,
        **_attrs(regions),
    )


def _attend_attrs(q, positions, unit_len, kv_dtype, num_kv_heads, scale, soft_cap, window,
                  tier_dtype) -> dict:
    """The checked attributes of :func:`attend_in_place` and :func:`attend_landed`."""
    kv_dtype = np.dtype(kv_dtype)
    if kv_dtype not in IN_PLACE_KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype} must be float32 or bfloat16 to be read in place")
    try:
        tier_code = IN_PLACE_TIER_DTYPES.get(None if tier_dtype is None else np.dtype(tier_dtype))
    except TypeError:
        tier_code = None
    if tier_code is None:
        raise ValueError(
            f"tier_dtype={tier_dtype!r} must be None, int8 or float8_e4m3fn to be read in place"
        )
    if q.dtype != jnp.float32 or q.ndim != 4:
        got = f"{q.dtype}{list(q.shape)}"
        raise ValueError(f"q must be f32[batch, q_len, heads, head_dim]; got {got}")
    if positions.shape not in ((3, q.shape[0]), (4, q.shape[0])) or positions.dtype != jnp.int32:
        got = f"{positions.dtype}{list(positions.shape)}"
        raise ValueError(f"positions must be int32[3 or 4, batch={q.shape[0]}]; got {got}")
    if not isinstance(unit_len, (int, np.integer)) or unit_len < 1:
        raise ValueError(f"unit_len={unit_len!r} must be an int >= 1")
    if q.shape[2] % num_kv_heads:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {num_kv_heads} kv heads")
    return dict(
        unit_len=np.int64(unit_len),
        kv_dtype=np.int32(IN_PLACE_KV_DTYPES[kv_dtype]),
        tier_dtype=np.int32(tier_code),
        num_kv_heads=np.int32(num_kv_heads),
        scale=np.float32(scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
        window=np.int32(0 if window is None else window),
    )


def attend_in_place(
    engine_id: int,
    tier: int,
    q: jax.Array,  # f32[batch, q_len, num_q_heads, head_dim]
    segments: jax.Array,  # int32[n, 4]: the unit's fetch segments into [2, batch, unit_len] rows
    positions: jax.Array,  # int32[3 or 4, batch]: key start, valid keys, query start[, real rows]
    tag: jax.Array,
    *,
    unit_len: int,
    kv_dtype,
    num_kv_heads: int,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
    tier_dtype=None,
    deps: Sequence[jax.Array] = (),
    regions: Regions | None = None,
    owner: jax.Array | Sequence[int] | None = None,
    first_block: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array]:  # out f32 like q, lse f32[batch, q_len, num_q_heads]
    """Attention of ``q`` over one unit's keys where they lie in a memory tier: nothing is
    copied (CPU backend, host tier).

    ``segments`` are the unit's fetch segments as :func:`wait_fetch` would take them into
    a staging slot of ``unit_len`` rows (K rows, then V); sequence ``b``'s K and V segments
    must cover exactly its valid keys, rows ``[0, positions[1, b])``, which sit at absolute
    positions ``positions[0, b] + row``; its queries at ``positions[2, b] + t``; with a
    fourth row only its first ``positions[3, b]`` queries (in ``[0, q_len]``) attend, the
    others (a step's padding rows) cost nothing and get out 0, lse -inf. The op
    runs after every earlier write-back of those bytes, like a fetch. Returns the unit's
    normalized partial and log-sum-exp, as
    :func:`~jax_tpusync.kernels.reference.chunk_attention_reference` does.

    Rows are ``kv_dtype`` values ``[num_kv_heads, head_dim]``, or with ``tier_dtype``
    (``int8`` or ``float8_e4m3fn``) a quantized tier's rows
    (:func:`jax_tpusync.core.quantize.quantize`: codes, then one float32 scale per head, padded
    to 16 bytes): the scales are applied as the reference's ``k_scale``/``v_scale`` are,
    to the logits and to the weights of the V codes; nothing is dequantized.
    """
    _check_segments(segments)
    tag = _check_tag(tag)
    attrs = _attend_attrs(
        q, positions, unit_len, kv_dtype, num_kv_heads, scale, soft_cap, window, tier_dtype
    )
    call = _ffi_call(
        _TARGETS["attend"],
        (_sds(q), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        has_side_effect=True,
    )
    return call(
        q,
        segments,
        positions,
        tag,
        _check_owner(owner),
        target(engine_id, tier, first_block),
        *deps,
        **_attrs(regions),
        **attrs,
    )


def attend_landed(
    engine_id: int,
    tier: int,
    q: jax.Array,  # f32[batch, q_len, num_q_heads, head_dim]
    ticket: jax.Array,  # int32[]: the fetch started for this unit (NO_TICKET: none)
    segments: jax.Array,  # int32[n, 4]: the unit's fetch segments into [2, batch, unit_len] rows
    positions: jax.Array,  # int32[3 or 4, batch]: key start, valid keys, query start[, real rows]
    tag: jax.Array,
    *,
    unit_len: int,
    kv_dtype,
    num_kv_heads: int,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
    tier_dtype=None,
    deps: Sequence[jax.Array] = (),
    regions: Regions | None = None,
    owner: jax.Array | Sequence[int] | None = None,
    first_block: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array]:  # out f32 like q, lse f32[batch, q_len, num_q_heads]
    """:func:`attend_in_place`'s attention over a unit that :func:`start_fetch` fetched
    ahead (``ticket``) into the engine's landing memory, read where it landed: nothing is
    copied into an XLA buffer (CPU backend, a file tier).

    Wait and attention in one op: it waits for the fetch to end, compares it with
    ``segments`` as :func:`wait_fetch` does (tier bytes and offsets; ``start_fetch`` must
    have been given these segments and ``dst_bytes=2 * batch * unit_len * row_bytes``), and
    reads the unit again itself if it differs, failed or is :data:`NO_TICKET`; the landing
    buffer is held until the attention ends. Consumes the ticket. On a memory tier it
    reads in place as :func:`attend_in_place` does. Segments, positions and rows are
    :func:`attend_in_place`'s, with the same checks.
    """
    _check_segments(segments)
    tag = _check_tag(tag)
    attrs = _attend_attrs(
        q, positions, unit_len, kv_dtype, num_kv_heads, scale, soft_cap, window, tier_dtype
    )
    ticket = jnp.asarray(ticket, dtype=jnp.int32)
    if ticket.shape != ():
        raise ValueError(f"ticket must be an int32 scalar; got shape {ticket.shape}")
    call = _ffi_call(
        _TARGETS["attend_landed"],
        (_sds(q), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        has_side_effect=True,
    )
    return call(
        q,
        ticket,
        segments,
        positions,
        tag,
        _check_owner(owner),
        target(engine_id, tier, first_block),
        *deps,
        **_attrs(regions),
        **attrs,
    )


def attend_spilled(
    engine_id: int,
    tier: int,
    q: jax.Array,  # f32[batch, q_len, num_q_heads, head_dim]
    spill_ticket: jax.Array,  # int32[]: the spill tier's fetch of this unit (NO_TICKET: none)
    segments: jax.Array,  # int32[n, 4]: the unit's rows on the memory tier
    spill_segments: jax.Array,  # int32[m, 4]: its rows on the spill tier
    positions: jax.Array,  # int32[3 or 4, batch]: key start, valid keys, query start[, real rows]
    tag: jax.Array,
    *,
    spill_tier: int,
    unit_len: int,
    kv_dtype,
    num_kv_heads: int,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
    tier_dtype=None,
    deps: Sequence[jax.Array] = (),
    regions: Regions | None = None,
    spill_regions: Regions | None = None,
    owner: jax.Array | Sequence[int] | None = None,
    first_block: jax.Array | int = 0,
    spill_first_block: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array]:  # out f32 like q, lse f32[batch, q_len, num_q_heads]
    """A two-level cache's unit (CPU backend): its rows on the memory tier (``segments``)
    read where they lie, as :func:`attend_in_place` does, and its rows on the spill tier
    (``spill_segments``) where ``spill_ticket``'s fetch landed, as :func:`attend_landed`
    does, attended together. Each sequence's rows, both tiers together, must be exactly
    its valid keys."""
    _check_segments(segments)
    _check_segments(spill_segments)
    tag = _check_tag(tag)
    attrs = _attend_attrs(
        q, positions, unit_len, kv_dtype, num_kv_heads, scale, soft_cap, window, tier_dtype
    )
    spill_ticket = jnp.asarray(spill_ticket, dtype=jnp.int32)
    if spill_ticket.shape != ():
        raise ValueError(f"spill_ticket must be an int32 scalar; got shape {spill_ticket.shape}")
    spill_attrs = {f"spill_{k}": v for k, v in _attrs(spill_regions).items()}
    call = _ffi_call(
        _TARGETS["attend_spilled"],
        (_sds(q), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        has_side_effect=True,
    )
    return call(
        q,
        spill_ticket,
        segments,
        spill_segments,
        positions,
        tag,
        _check_owner(owner),
        target(engine_id, tier, first_block),
        target(engine_id, spill_tier, spill_first_block),
        *deps,
        **_attrs(regions),
        **spill_attrs,
        **attrs,
    )


def mark(
    engine_id: int, kind: int, x: jax.Array, tag: jax.Array, deps: Sequence[jax.Array] = ()
) -> jax.Array:
    """Returns ``x`` (aliased) after recording a timestamped mark in the engine timeline."""
    tag = _check_tag(tag)
    if engine_id <= 0:
        raise ValueError(f"engine_id={engine_id} is not a valid engine id")
    call = _ffi_call(_TARGETS["mark"], _sds(x), input_output_aliases={0: 0}, has_side_effect=True)
    return call(x, tag, *deps, engine_id=np.int64(engine_id), kind=np.int32(kind))


def capacity_guards(lengths: jax.Array, count, capacity) -> jax.Array:
    """int32[batch, 4] guard rows: sequence ``b`` may take ``count`` more tokens past
    ``lengths[b]`` only if that stays within ``capacity`` (an int or int32[batch])."""
    lengths = jnp.asarray(lengths, jnp.int32)
    shape = lengths.shape
    return jnp.stack(
        [
            jnp.full(shape, CAPACITY_GUARD, jnp.int32),
            lengths,
            jnp.broadcast_to(jnp.asarray(count, jnp.int32), shape),
            jnp.broadcast_to(jnp.asarray(capacity, jnp.int32), shape),
        ],
        axis=-1,
    )


def shard_guard(state_shard, device_shard) -> jax.Array:
    """int32[1, 4] guard row leading a mesh shard's write-back: the op fails, before any
    byte moves and before the capacity guards, unless the state is the shard (its target's
    shard field) of the device that runs it (``device_shard``, from ``lax.axis_index``)."""
    return jnp.stack(
        [
            jnp.int32(SHARD_GUARD),
            jnp.asarray(state_shard, jnp.int32),
            jnp.asarray(device_shard, jnp.int32),
            jnp.int32(0),
        ]
    )[None]


def segment_rows(
    tier_offsets: Sequence[int],
    memory_offsets: Sequence[int],
    sizes: Sequence[int],
    block_bytes: int,
) -> np.ndarray:
    """Host-side helper: builds int32[n, 4] segment rows from 64-bit tier byte offsets."""
    tier_offsets = np.asarray(tier_offsets, dtype=np.int64)
    rows = np.stack(
        [
            tier_offsets // block_bytes,
            tier_offsets % block_bytes,
            np.asarray(memory_offsets, np.int64),
            np.asarray(sizes, np.int64),
        ],
        axis=1,
    )
    if rows.size and (rows.max() > np.iinfo(np.int32).max or rows.min() < 0):
        raise ValueError(
            "a segment field does not fit int32 (split the segment or use larger blocks)"
        )
    return rows.astype(np.int32).reshape(-1, 4)
