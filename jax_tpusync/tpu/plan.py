"""``plan_step``: a user's own decode step over a host-pool cache, compiled for a TPU
topology from any Linux x86_64 machine with libtpu (nothing runs on a TPU), and what it
would hold and take there.

Per context the step is traced with shapes only (the weights, the step's other inputs and
the cache's :class:`~jax_tpusync.core.pool_state.PoolState` as
:class:`jax.ShapeDtypeStruct`), compiled by XLA's TPU compiler and Mosaic for the
topology's chips, and read back:

* device memory per chip: what the compiled program places (arguments, temporaries,
  outputs), against a whole-KV-resident baseline (the weights and every layer's KV at the
  context, a sliding layer its window) and the chip's published device memory;
* whether every unit copy overlaps an attention in the scheduled program
  (:func:`~jax_tpusync.tpu.schedule.schedule_overlap`);
* a projected step time: the bytes a step copies over each chip's host link at its
  generation's published rate (:mod:`jax_tpusync.tpu.chips`);
* what does not fit: a context the compiler refuses, a resident baseline past the chip.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_tpusync.caches.hybrid.config import HYBRID_KEYWORDS, host_pool_groups
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.mesh_layout import MeshLayout, checked_layout
from jax_tpusync.core.pool_state import PoolLayout, unit_copies
from jax_tpusync.step.host_pool import ATTEND_SCOPE, FETCH_SCOPE
from jax_tpusync.tpu.abstract_state import abstract_hybrid_state, abstract_pool_state
from jax_tpusync.tpu.chips import hbm_bytes_per_device, host_link
from jax_tpusync.tpu.schedule import schedule_overlap
from jax_tpusync.tpu.target import (
    compiled_or_refusal,
    device_bytes,
    topology_devices,
    topology_mesh,
    tracing_for_tpu,
)

__all__ = [
    "DEFAULT_CONTEXTS",
    "ContextPlan",
    "GroupPlan",
    "SparseContextPlan",
    "StepPlan",
    "plan_step",
]

DEFAULT_CONTEXTS = (32768, 262144, 1048576)
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class SparseContextPlan:
    """A sparse cache's part of a :class:`ContextPlan` (a cache made with ``sparse=``);
    bytes are per chip.

    Attributes:
      context_blocks: blocks of one slot's context.
      selected_blocks: blocks one slot's selection holds at the context (the budget's
        share, at least the sink and recent blocks).
      summary_layer_bytes: one layer's block summaries, copied to the device whole (a
        chunk at a time) each step it decodes sparsely.
      summary_chunk_blocks: blocks of one summary chunk (a copy, scored at once).
      summary_host_bytes: every layer's summaries, in the chip's host memory.
      summary_overlap: the summary chunk copies of the scheduled program, counted as
        :func:`~jax_tpusync.tpu.schedule.schedule_overlap` counts unit copies (an
        attention, a layer's unit walk or a scoring counted as the work they may overlap;
        ``spanning``: those with one between their start and their end).
    """

    context_blocks: int
    selected_blocks: int
    summary_layer_bytes: int
    summary_chunk_blocks: int
    summary_host_bytes: int
    summary_overlap: dict[str, int]


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One layer group of a hybrid cache's :class:`ContextPlan` (a
    ``HybridKVCache(host_pool=True)``: a host pool per group); bytes are per chip.

    Attributes:
      layers: the model layers that store KV in the group.
      readers: the model layers that read one of them (``kv_sharing``): each runs its
        source's unit walk again, copying its units again.
      num_kv_heads, head_dim: the group's KV geometry.
      window: its sliding window (None: global).
      ring_blocks: blocks of the ring each slot keeps of its window (0: every position).
      chunk_len: tokens of a unit.
      unit_copies: asynchronous copies one unit makes.
      staging_bytes: the units the group holds on the device.
      pool_bytes: its pool in the chip's host memory.
      resident_kv_bytes: its layers' KV kept whole on the device instead (a sliding
        layer its window).
      step_copy_bytes: bytes its layers (and readers) copy per step.
    """

    layers: tuple[int, ...]
    readers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    window: int | None
    ring_blocks: int
    chunk_len: int
    unit_copies: int
    staging_bytes: int
    pool_bytes: int
    resident_kv_bytes: int
    step_copy_bytes: int


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """One context of a :class:`StepPlan`; bytes are per chip (per JAX device).

    Attributes:
      context: the cache's ``max_len``, tokens.
      device_bytes: device memory the compiled step places; None: the compiler refused it.
      refusal: why the compiler refused it ("" when it compiled).
      weights_bytes: the params' bytes on one chip (as their specs split them).
      staging_bytes: the units the cache holds on the device (``prefetch_depth + 1``).
      pool_bytes: the pool in the chip's host memory.
      resident_bytes: the whole-KV-resident baseline: the weights and every layer's KV.
      chunk_len: tokens of a unit.
      prefetch_depth: units staged ahead of the one attended.
      unit_copies: asynchronous copies one unit makes (a block and a tail per slot; past
        16 slots a chip, per slot of the group a layer walks at once:
        :func:`~jax_tpusync.core.pool_state.unit_slots`).
      computations: computations of the scheduled program holding a unit copy and an
        attention (a layer's unit loop is one).
      copies: unit copies in them.
      started_before: copies started before their computation's attention.
      overlapped: copies also waited for after it.
      step_copy_bytes: bytes one step copies over the chip's host link (whole units; a
        sparse cache: what its dense step would copy).
      projected_step_ms: ``step_copy_bytes`` over the host link: a projection.
      flops: the compiler's cost analysis of the step (0 where it gives none).
      bytes_accessed: the same analysis's device bytes read and written.
      compile_s: seconds the compile took here.
      spanning: unit copies with an attention between their start and their end (in any
        computation: also a unit attended outside its layer's loop).
      sparse: a sparse cache's summaries, selection and summary copies (None: dense).
      groups: a hybrid cache's layer groups, one :class:`GroupPlan` each (empty: one
        cache); then ``staging_bytes``, ``pool_bytes`` and ``step_copy_bytes`` are their
        sums, ``chunk_len`` and ``unit_copies`` their largest.
    """

    context: int
    device_bytes: int | None
    refusal: str
    weights_bytes: int
    staging_bytes: int
    pool_bytes: int
    resident_bytes: int
    chunk_len: int
    prefetch_depth: int
    unit_copies: int
    computations: int
    copies: int
    started_before: int
    overlapped: int
    step_copy_bytes: int
    projected_step_ms: float
    flops: float
    bytes_accessed: float
    compile_s: float
    spanning: int = 0
    sparse: SparseContextPlan | None = None
    groups: tuple[GroupPlan, ...] = ()

    @property
    def all_overlapped(self) -> bool:
        """Whether the step compiled and every unit copy overlaps an attention: started
        before its loop body's attention and waited for after it; a sparse cache's, every
        unit copy and every summary chunk copy with an attention, a unit walk or a scoring
        between its start and its end (its walk's first unit is attended outside the loop,
        among every layer's attention, so that it need not wait for the scoring)."""
        if self.device_bytes is None:
            return False
        if self.sparse is None:
            return self.overlapped == self.copies > 0
        summaries = self.sparse.summary_overlap
        return self.spanning == self.copies > 0 and summaries["spanning"] == summaries["copies"] > 0


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What :func:`plan_step` found: per context, a :class:`ContextPlan`.

    Attributes:
      topology: the TPU topology compiled for (``"v6e:2x2"``).
      device_kind: its chips' ``device_kind``.
      chips: JAX devices the step runs on (the mesh's, or one).
      mesh_axes: the mesh's axes and sizes ({} on one chip).
      link_gbps: the host link per chip the projection uses, GB/s.
      link_source: where that figure comes from.
      hbm_bytes: a chip's published device memory (None: not known for this kind).
      contexts: one :class:`ContextPlan` per context, in the order asked.
      ran_on_tpu: always False: the step is compiled, never run.
    """

    topology: str
    device_kind: str
    chips: int
    mesh_axes: dict[str, int]
    link_gbps: float
    link_source: str
    hbm_bytes: int | None
    contexts: tuple[ContextPlan, ...]
    ran_on_tpu: bool = False

    @property
    def all_overlapped(self) -> bool:
        """Whether every unit copy (a sparse cache's: and every summary chunk copy)
        overlaps an attention at every context (:attr:`ContextPlan.all_overlapped`)."""
        return all(c.all_overlapped for c in self.contexts)

    @property
    def device_bytes_flat(self) -> bool:
        """Whether the step compiled at every context and its device memory stays within
        1% of its least across them."""
        held = [c.device_bytes for c in self.contexts]
        if not held or None in held:
            return False
        return max(held) - min(held) <= 0.01 * min(held)

    @property
    def does_not_fit(self) -> list[str]:
        """In words, each thing that does not fit a chip: a context the compiler refused
        the step at, and each context whose whole-KV-resident baseline passes the chip's
        device memory."""
        out = []
        for c in self.contexts:
            if c.device_bytes is None:
                out.append(f"the step at {tokens_text(c.context)} tokens: {c.refusal}")
        for c in self.contexts:
            if self.hbm_bytes is not None and c.resident_bytes > self.hbm_bytes:
                out.append(
                    f"the whole KV resident at {tokens_text(c.context)} tokens: "
                    f"{_size(c.resident_bytes)} of a chip's {_size(self.hbm_bytes)}"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every field, and the derived verdicts, as plain data."""
        out = dataclasses.asdict(self)
        out.update(
            all_overlapped=self.all_overlapped,
            device_bytes_flat=self.device_bytes_flat,
            does_not_fit=self.does_not_fit,
        )
        return out

    def to_json(self, **dumps_options: Any) -> str:
        """:meth:`to_dict` as JSON."""
        return json.dumps(self.to_dict(), **dumps_options)

    def summary(self) -> str:
        """The plan in words."""
        return summary(self)

    def __str__(self) -> str:
        return self.summary()


def plan_step(
    step: Callable,
    params: Any,
    cache: CacheConfig | Mapping[str, Any],
    *,
    topology: str = "v5e:2x2",
    inputs: Sequence[Any] = (),
    mesh_axes: Mapping[str, int] | None = None,
    kv_heads_axis: str | None = None,
    batch_axis: str | None = None,
    param_specs: Any = None,
    input_specs: Any = None,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    link_gbps: float | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> StepPlan:
    """Compiles a user's decode step over a host-pool cache for a TPU topology, at each
    context, and reports what it holds and how its copies are scheduled.

    Compile only: libtpu's compiler runs here (any Linux x86_64 machine with ``pip
    install "jax[tpu]"``); nothing runs on a TPU. Call it in a process whose JAX has not
    started a TPU backend (``import jax_tpusync`` first, or set ``TPU_ACCELERATOR_TYPE`` and
    ``TPU_WORKER_HOSTNAMES``, :data:`jax_tpusync.runtime.libtpu.LIBTPU_ENVIRONMENT`).

    Args:
      step: the decode step, ``step(params, *inputs, state) -> (outputs, state)``: it calls
        :func:`jax_tpusync.prefetching_attention` per layer on ``state`` (its default
        implementation here is the TPU's, the Pallas kernel through Mosaic) (a host-pool
        cache's :class:`~jax_tpusync.core.pool_state.PoolState`) and returns the new state
        last. A ``jax.jit``-wrapped function is compiled from the function it wraps.
      params: the weights as shapes: a pytree of :class:`jax.ShapeDtypeStruct` (or arrays).
      cache: the cache, as :func:`jax_tpusync.kv_cache` keywords or a
        :class:`~jax_tpusync.core.config.CacheConfig`; ``max_len`` is each of ``contexts``,
        and ``batch`` counts every slot (over ``batch_axis``, each chip holds its share).
      topology: a libtpu topology name: ``"v4:2x2x1"``, ``"v5e:2x2"``, ``"v5p:2x2x1"``,
        ``"v6e:2x2"``, ``"tpu7x:2x2x1"``.
      inputs: the step's other arguments, as shapes (say the tokens, ``[batch, 1]``).
      mesh_axes: a mesh over the topology's first devices, its axes and sizes in order
        (``{"batch": 2, "heads": 2}``); None: one chip.
      kv_heads_axis: the mesh axis the KV heads are split over (a host pool per chip).
      batch_axis: the mesh axis the slots are split over.
      param_specs: a :class:`jax.sharding.PartitionSpec` per leaf of ``params`` (or a
        prefix of its tree) over the mesh; None: every chip holds every weight.
      input_specs: the same for ``inputs``; None: each input's leading axis split over
        ``batch_axis`` (replicated without one).
      contexts: the contexts to compile at, tokens.
      link_gbps: the host link per chip to project step times over, GB/s; None: the
        generation's published figure (:func:`jax_tpusync.tpu.chips.host_link`).
      compiler_options: passed to the compiler (``{"xla_tpu_host_transfer_overlap_limit":
        64}``, say).

    Returns:
      A :class:`StepPlan`: per context, device memory against the whole-KV-resident
      baseline, the unit copies overlapped, the projected step time; ``summary()`` says it
      in words, ``to_json()`` as data.

    Raises:
      ValueError: a context below 1, mesh axes or a split the cache does not divide, or a
        cache configuration a host pool does not take.
      RuntimeError: libtpu is not installed.
    """
    import jax

    contexts = tuple(contexts)
    if not contexts:
        raise ValueError("contexts is empty: name at least one context to compile at")
    for context in contexts:
        if not isinstance(context, int) or context < 1:
            raise ValueError(f"context {context!r} must be an int of at least 1 token")
    if link_gbps is not None and not link_gbps > 0:
        raise ValueError(f"link_gbps={link_gbps!r} must be positive")
    hybrid = _hybrid_keywords(cache)
    if hybrid is not None:
        if mesh_axes:
            raise ValueError(
                f"mesh_axes={dict(mesh_axes)} with a hybrid cache: a hybrid cache of host "
                f"pools is planned on one chip (a mesh is not supported here yet); drop "
                f"mesh_axes"
            )
        if hybrid.get("sparse") is not None:
            raise ValueError(
                f"sparse={hybrid['sparse']!r} with a hybrid cache: its plan reports dense "
                f"groups only (not supported here yet); drop sparse="
            )
        host_pool_groups(hybrid, max_len=contexts[0])  # Refused by name, before libtpu.
    elif mesh_axes and batch_axis is not None and batch_axis in mesh_axes:
        _config(cache, contexts[0], mesh_axes[batch_axis])  # The slots split, before libtpu.
    devices = topology_devices(topology)
    kind = devices[0].device_kind
    layout = _layout(devices, mesh_axes, kv_heads_axis, batch_axis)
    dp = layout.dp if layout else 1
    link = host_link(kind)
    gbps = link.gbps if link_gbps is None else float(link_gbps)
    source = link.source if link_gbps is None else "given (link_gbps=)"
    step_fn = getattr(step, "__wrapped__", step)  # A jax.jit-wrapped step: its function.

    plans = []
    for context in contexts:
        config = groups = None
        if hybrid is not None:
            groups, configs, step_tokens, kv_dtype = host_pool_groups(hybrid, max_len=context)
            state, on_device = abstract_hybrid_state(
                groups, configs, step_tokens, kv_dtype, devices[0]
            )
            specs = [part.spec for part in state.groups]
        else:
            config = _config(cache, context, dp)
            config.geometry.check_one_cache()  # A ring needs every layer to share one window.
            state, on_device = abstract_pool_state(config, devices, layout)
            specs = [state.spec]
        placed_params = _placed(params, param_specs, on_device, layout, batch_split=False)
        placed_inputs = _placed(tuple(inputs), input_specs, on_device, layout, batch_split=True)
        args = (placed_params, *placed_inputs, state)
        shardings = jax.tree.map(lambda a: a.sharding, args)

        def build(args=args, shardings=shardings, state=state, batch=specs[0].batch * dp):
            with tracing_for_tpu():
                outputs = jax.eval_shape(step_fn, *args)
                out_shardings = _out_shardings(outputs, state, batch, on_device, layout)
                jitted = jax.jit(
                    step_fn,
                    in_shardings=shardings,
                    out_shardings=out_shardings,
                    donate_argnums=len(args) - 1,
                )
                return (
                    jitted.trace(*args)
                    .lower()
                    .compile(compiler_options=dict(compiler_options) if compiler_options else None)
                )

        began = time.perf_counter()
        compiled, refusal = compiled_or_refusal(build)
        seconds = time.perf_counter() - began
        overlap = _no_copies()
        cost: dict = {}
        text = ""
        if compiled is not None:
            text = compiled.as_text()
            overlap = schedule_overlap(text, FETCH_SCOPE, ATTEND_SCOPE)
            cost = compiled.cost_analysis() or {}
            cost = (cost[0] if cost else {}) if isinstance(cost, list) else cost
        weights = _bytes_per_chip(placed_params)
        if groups is not None:
            parts = tuple(_group_plan(groups, g, spec, context) for g, spec in enumerate(specs))
        else:
            parts = (_group_plan(None, 0, specs[0], context),)
        copied = sum(p.step_copy_bytes for p in parts)
        plans.append(
            ContextPlan(
                context=context,
                device_bytes=None if compiled is None else device_bytes(compiled),
                refusal=refusal,
                weights_bytes=weights,
                staging_bytes=sum(p.staging_bytes for p in parts),
                pool_bytes=sum(p.pool_bytes for p in parts),
                resident_bytes=weights + sum(p.resident_kv_bytes for p in parts),
                chunk_len=max(p.chunk_len for p in parts),
                prefetch_depth=specs[0].prefetch_depth,
                unit_copies=max(p.unit_copies for p in parts),
                step_copy_bytes=copied,
                projected_step_ms=copied / (gbps * 1e9) * 1e3,
                flops=float(cost.get("flops", 0.0)),
                bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                compile_s=seconds,
                sparse=None if config is None else _sparse_plan(config, specs[0], context, text),
                groups=parts if groups is not None else (),
                **overlap,
            )
        )
    chips = layout.num_shards if layout else 1
    return StepPlan(
        topology=topology,
        device_kind=kind,
        chips=chips,
        mesh_axes=dict(mesh_axes or {}),
        link_gbps=gbps,
        link_source=source,
        hbm_bytes=hbm_bytes_per_device(kind, _devices_per_chip(topology, len(devices))),
        contexts=tuple(plans),
    )


def _hybrid_keywords(cache) -> dict | None:
    """The keywords of a ``HybridKVCache(host_pool=True)`` where ``cache`` describes one
    (kv_cache keywords with per-layer ``num_kv_heads`` or ``head_dim``, or a keyword only a
    hybrid cache takes: ``host_pool``, ``kv_sharing``, ``bound_windows``,
    ``window_cache_blocks``); None: one host pool."""
    if not isinstance(cache, Mapping):
        return None
    per_layer = any(isinstance(cache.get(n), (list, tuple)) for n in ("num_kv_heads", "head_dim"))
    if not per_layer and not any(n in cache for n in HYBRID_KEYWORDS):
        return None
    if (
        cache.get("bound_windows") is False
        and not per_layer
        and not any(
            cache.get(n) is not None for n in ("kv_sharing", "window_cache_blocks", "host_pool")
        )
    ):
        # Every position kept, one geometry: one host pool (kv_cache(bound_windows=False)).
        return None
    return dict(cache)


def _group_plan(groups, g: int, spec, context: int) -> GroupPlan:
    """Group ``g`` of a hybrid cache's ``groups`` at ``context`` tokens (``groups`` None:
    the one cache of ``spec``, every layer its own)."""
    pool = PoolLayout(spec)
    row_bytes = pool.row_width * pool.dtype.itemsize
    if groups is None:
        layers, readers = tuple(range(spec.num_layers)), ()
        windows = list(spec.windows)
    else:
        group = groups.groups[g]
        layers = group.layers
        readers = tuple(
            layer for layer, s in enumerate(groups.source_of) if s is not None and s in layers
        )
        windows = [group.window] * len(layers)
    walks = windows + [windows[layers.index(groups.source_of[r])] for r in readers]
    first = groups.groups[g] if groups is not None else None
    return GroupPlan(
        layers=layers,
        readers=readers,
        num_kv_heads=spec.num_kv_heads if first is None else first.num_kv_heads,
        head_dim=spec.head_dim,
        window=None if first is None else first.window,
        ring_blocks=int(spec.ring_blocks or 0),
        chunk_len=spec.chunk_len,
        unit_copies=unit_copies(pool.group_slots, pool.blocks_per_unit),
        staging_bytes=pool.device_bytes,
        pool_bytes=pool.pool_bytes,
        resident_kv_bytes=spec.batch * row_bytes * sum(_resident_rows(w, context) for w in windows),
        step_copy_bytes=sum(_units(spec, w, context) for w in walks) * pool.staging_bytes,
    )


def _no_copies() -> dict[str, int]:
    """:func:`schedule_overlap`'s counts of a program not compiled."""
    return dict(computations=0, copies=0, started_before=0, overlapped=0, spanning=0)


def _sparse_plan(
    config: CacheConfig, spec, context: int, hlo_text: str
) -> SparseContextPlan | None:
    """A sparse cache's :class:`SparseContextPlan` at ``context`` tokens (None: dense);
    ``hlo_text``: the compiled step ("" where the compiler refused it)."""
    if config.sparse is None:
        return None
    from jax_tpusync.core.pool_sparse import SummaryLayout
    from jax_tpusync.step.pool_sparse import SCORE_SCOPE

    summary = SummaryLayout(spec)
    overlap = _no_copies()
    if hlo_text:
        # The compiler drops these copies' scope: they are found by their shape, a chunk's,
        # and their source's, the summaries' host array (the compiler also splits a copied
        # chunk on the device with slices of the chunk's shape, which are no host copies).
        word = _HLO_TYPES[summary.dtype.name]
        rows, width = summary.shape
        overlap = schedule_overlap(
            hlo_text,
            (f"{word}[{summary.chunk_blocks},{summary.row_width}]{{", f"{word}[{rows},{width}]{{"),
            (SCORE_SCOPE, ATTEND_SCOPE, _KERNEL_NAME),
            loops=True,
        )
    context_blocks = -(-context // spec.block_tokens)
    return SparseContextPlan(
        context_blocks=context_blocks,
        selected_blocks=int(config.sparse.selected_count(context_blocks)),
        summary_layer_bytes=summary.layer_rows * summary.row_bytes,
        summary_chunk_blocks=summary.chunk_blocks,
        summary_host_bytes=summary.nbytes,
        summary_overlap=overlap,
    )


# The Pallas attention kernel's name, which its custom call's line holds.
_KERNEL_NAME = "chunk_attention"
# HLO's names of the summary host array's element types.
_HLO_TYPES = {"uint32": "u32", "int32": "s32", "float32": "f32"}


def _layout(devices, mesh_axes, kv_heads_axis, batch_axis) -> MeshLayout | None:
    """The cache's mesh layout over the topology (None: one chip)."""
    if not mesh_axes:
        if kv_heads_axis is not None or batch_axis is not None:
            raise ValueError("kv_heads_axis and batch_axis need mesh_axes= (the mesh to split)")
        return None
    return checked_layout(topology_mesh(devices, mesh_axes), kv_heads_axis, batch_axis)


def _config(cache, context: int, dp: int) -> CacheConfig:
    """One batch shard's cache config at ``context`` tokens."""
    if isinstance(cache, CacheConfig):
        g = cache.geometry
        batch = g.batch
    elif isinstance(cache, Mapping):
        batch = cache.get("batch")
        if batch is None:
            raise ValueError("cache has no batch: name the slots (batch=) the step runs")
    else:
        raise TypeError(
            f"cache must be kv_cache keywords (a dict) or a CacheConfig; got {type(cache).__name__}"
        )
    if batch % dp:
        raise ValueError(
            f"batch={batch} must be a multiple of the {dp} chips of the batch axis the slots "
            f"are split over"
        )
    if isinstance(cache, CacheConfig):
        geometry = dataclasses.replace(g, max_len=context, batch=batch // dp)
        return dataclasses.replace(cache, geometry=geometry)
    keywords = {k: v for k, v in cache.items() if k != "bound_windows"}  # False: one pool.
    return CacheConfig.from_kwargs(**{**keywords, "max_len": context, "batch": batch // dp})


def _placed(tree, specs, on_device, layout: MeshLayout | None, *, batch_split: bool):
    """``tree``'s leaves as :class:`jax.ShapeDtypeStruct` placed on the chip(s): by
    ``specs`` over the mesh, or by default replicated (inputs: split over the batch axis)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def shape_of(leaf, sharding):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    if layout is None:
        if specs is not None:
            raise ValueError("param_specs and input_specs need mesh_axes= (the mesh they name)")
        return jax.tree.map(lambda leaf: shape_of(leaf, on_device), tree)
    mesh = layout.mesh
    if specs is None:

        def default(leaf):
            split = batch_split and layout.batch_axis is not None and len(leaf.shape) > 0
            return shape_of(leaf, NamedSharding(mesh, P(layout.batch_axis) if split else P()))

        return jax.tree.map(default, tree)
    return jax.tree.map(
        lambda spec, leaf: shape_of(leaf, NamedSharding(mesh, spec if spec is not None else P())),
        specs,
        tree,
        is_leaf=lambda x: x is None or isinstance(x, P),
    )


def _out_shardings(outputs, state, batch: int, on_device, layout: MeshLayout | None):
    """The step's output shardings: the state where it came in (its pool in host memory:
    traced from shapes, the compiler knows that from the sharding only); the other outputs
    replicated, or split over the batch axis where their leading axis is the ``batch``
    slots'."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if not isinstance(outputs, tuple) or len(outputs) < 2:
        raise ValueError("the step must return a tuple (outputs..., state): the cache's state last")
    state_shardings = jax.tree.map(lambda a: a.sharding, state)

    def placed(leaf):
        if layout is not None and layout.batch_axis is not None and leaf.shape[:1] == (batch,):
            return NamedSharding(layout.mesh, P(layout.batch_axis))
        return on_device

    return (*jax.tree.map(placed, outputs[:-1]), state_shardings)


def _bytes_per_chip(tree) -> int:
    """Bytes of ``tree``'s leaves one chip holds (each leaf's share of its sharding)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def _resident_rows(window: int | None, context: int) -> int:
    """Rows a layer of ``window`` keeps resident at ``context`` (a sliding one its window)."""
    return context if window is None else min(context, window)


def _units(spec, window: int | None, context: int) -> int:
    """Units a layer copies per step at ``context`` (units start at a block boundary, so a
    window's keys may straddle one block more than its span)."""
    if window is None:
        reach = context
    else:
        reach = min(context, spec.layer_span(window) + spec.block_tokens - 1)
    return max(1, -(-reach // spec.chunk_len))


def _devices_per_chip(topology: str, devices: int) -> int:
    """JAX devices a chip of ``topology`` shows (``"v4:2x2x1"``: 4 chips, 8 devices)."""
    try:
        chips = math.prod(int(n) for n in topology.split(":")[1].split("x"))
    except (IndexError, ValueError):
        return 1
    return max(1, devices // chips) if chips else 1


def summary(plan: StepPlan) -> str:
    """A :class:`StepPlan` in words: device memory per chip across the contexts against the
    whole-KV-resident baseline, the pool in host memory, the unit copies overlapped, the
    projected step times and what does not fit."""
    cs = plan.contexts
    split = ", ".join(f"{n} {a}" for a, n in plan.mesh_axes.items())
    lines = [
        f"{plan.topology} ({plan.device_kind}, {plan.chips} chip{'s' if plan.chips > 1 else ''}"
        f"{' as ' + split if split else ''}), per chip:"
    ]
    held = [c.device_bytes for c in cs if c.device_bytes is not None]
    first = cs[0]
    if held:
        spread = (
            f"{_size(min(held))} at every context"
            if max(held) - min(held) <= 0.01 * min(held)
            else f"{_size(min(held))}-{_size(max(held))} across the contexts"
        )
        lines.append(
            f"  device memory: {spread} ({_contexts(cs)}; weights {_size(first.weights_bytes)}"
            f" + staging {_size(first.staging_bytes)})"
        )
    resident = "; ".join(f"{_size(c.resident_bytes)} at {tokens_text(c.context)}" for c in cs)
    chip = f" (a chip has {_size(plan.hbm_bytes)})" if plan.hbm_bytes else ""
    lines.append(f"  whole KV resident instead: {resident}{chip}")
    pools = "; ".join(f"{_size(c.pool_bytes)} at {tokens_text(c.context)}" for c in cs)
    lines.append(f"  the pool{'s' if first.groups else ''} in host memory: {pools}")
    for i, group in enumerate(cs[-1].groups):
        lines.append(f"  {_group_text(i, group, cs[-1].context)}")
    copies = sum(c.copies for c in cs)
    overlapped = sum(c.overlapped for c in cs)
    lines.append(
        f"  {overlapped} of {copies} unit copies are started before the attention they overlap"
        f" and waited for after it (units of {first.chunk_len} tokens, {first.unit_copies}"
        f" copies each)"
    )
    sparse = [c for c in cs if c.sparse is not None]
    if sparse:
        selected = "; ".join(
            f"{c.sparse.selected_blocks} of {c.sparse.context_blocks} at {tokens_text(c.context)}"
            for c in sparse
        )
        spanning = sum(c.sparse.summary_overlap["spanning"] for c in sparse)
        chunk_copies = sum(c.sparse.summary_overlap["copies"] for c in sparse)
        lines.append(
            f"  sparse decode: blocks selected per slot and layer {selected}; summaries in"
            f" host memory {_size(sparse[-1].sparse.summary_host_bytes)} at"
            f" {tokens_text(sparse[-1].context)}; {spanning} of {chunk_copies} summary chunk"
            f" copies have an attention, a layer's unit walk or a scoring between their start"
            f" and their end (the projected times below are the dense step's)"
        )
    times = ", ".join(f"{c.projected_step_ms:.1f} ms at {tokens_text(c.context)}" for c in cs)
    lines.append(
        f"  projected step time over a {plan.link_gbps:.2f} GB/s host link ({plan.link_source}):"
        f" {times}"
    )
    misfits = plan.does_not_fit
    lines.append("  does not fit: " + "; ".join(misfits) if misfits else "  everything fits")
    lines.append(
        "Compiled only: nothing ran on a TPU; the memory is the compiler's plan and the step"
        " time a projection from the bytes copied."
    )
    return "\n".join(lines)


def _group_text(index: int, group: GroupPlan, context: int) -> str:
    """A hybrid cache's layer group in words, at ``context`` tokens."""
    kind = "global" if group.window is None else f"sliding window {group.window}"
    if group.window is not None:
        kind += (
            f", a ring of {group.ring_blocks} blocks per slot"
            if group.ring_blocks
            else ", every position kept"
        )
    readers = f" (read by {', '.join(map(str, group.readers))})" if group.readers else ""
    return (
        f"layer group {index}: layers {', '.join(map(str, group.layers))}{readers}, "
        f"{group.num_kv_heads} KV heads x {group.head_dim}, {kind}: units of "
        f"{group.chunk_len} tokens ({group.unit_copies} copies each), staging "
        f"{_size(group.staging_bytes)}, pool {_size(group.pool_bytes)} at {tokens_text(context)}"
    )


def _size(count: int) -> str:
    """``"136 MiB"``, or ``"9.5 GiB"`` from 10 GiB up."""
    if count >= 10 * 2**30:
        return f"{count / 2**30:.1f} GiB"
    return f"{count / MIB:.0f} MiB"


def _contexts(contexts: Sequence[ContextPlan]) -> str:
    return contexts_text([c.context for c in contexts])


def contexts_text(contexts: Sequence[int]) -> str:
    """``"32K, 256K and 1M tokens"``."""
    names = [tokens_text(c) for c in contexts]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} tokens"


def tokens_text(count: int) -> str:
    """``32768`` -> ``"32K"``, ``1048576`` -> ``"1M"``, ``1000`` -> ``"1000"``."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if count >= size and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)
