"""``bench tpu-compile``: the host-pool decode step compiled for TPUs, on a machine without one.

libtpu (``pip install "jax[tpu]"``) compiles programs for TPU topologies it is told of
(:func:`jax.experimental.topologies.get_topology_desc`) with XLA's TPU compiler and Mosaic,
on any Linux x86_64 host: nothing runs, but what the compiler accepts, the device memory
it plans and the order it schedules copies and compute in are the chip's. Per topology and
context this compiles three decode steps of one model (:class:`tiny_decoder.Shape`):

* ``ours``: :class:`~jax_tpusync.HostPoolKVCache`'s step (the pool in ``pinned_host``);
* ``plain``: the way a model is written with JAX memory kinds alone: each layer's KV kept
  in ``pinned_host`` and brought in with ``jax.device_put`` inside the step;
* ``resident``: the KV in device memory (what does not fit at long contexts).

and reports each one's device bytes (arguments, temporaries and outputs the compiled
program places in device memory), the compiler's cost analysis, whether every unit copy of
ours is started before the attention it overlaps and waited for after it (read off the
scheduled program), and a projected step time: the KV bytes a step reads over a host link
of ``--link-gbps`` (default: each generation's published rate per chip,
:func:`jax_tpusync.tpu.host_link`). A projection, not a measurement: nothing here ran on a
TPU. Ours is planned by the public call a user plans their own step with,
:func:`jax_tpusync.tpu.plan_step`.

Over chips: ``--heads-over-chips`` splits the KV heads (and the projections) over every
chip of a topology, ``--batch-over-chips`` the slots (the batch-sharded pool's layout,
:class:`~jax_tpusync.BatchShardedPoolKVCache`); both make a grid of slots by heads (four
chips: 2 x 2). Every number is per chip: the weights split over the heads only, the KV
over both.

``--sparse[=BUDGET]``: ours with sparse decode (``HostPoolKVCache(sparse=BUDGET)``, 3%
bare), its summary chunk copies' overlap too, and its projected step (the layer's
summaries, the selected blocks and ``--late-share`` of them again) against the dense step
at the first context.

Printed by default: per topology, in words, the device memory ours holds across the
contexts against the plain and resident steps', and how many unit copies overlap an
attention; ``--details``: every row. Each program compiles in its own child process
(progress on stderr): the default nine rows take about 15 minutes on two cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any

from jax_tpusync.bench import common
from jax_tpusync.runtime.libtpu import LIBTPU_ENVIRONMENT
from jax_tpusync.tpu.plan import contexts_text, tokens_text
from jax_tpusync.tpu.schedule import schedule_overlap
from jax_tpusync.tpu.target import compiled_or_refusal, device_bytes, prepare_compile_only

__all__ = ["schedule_overlap", "device_bytes"]  # Read by the tests from here too.

TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "tpu7x:2x2x1")
# --sparse alone: a 3% budget (about the blocks a dense 32K step reads, at 1M tokens).
SPARSE_BUDGET = 0.03
# --sparse's projection: the share of each selection not predicted (copied late), measured
# on the host pool (the TPU data path) emulated on the CPU backend: `bench retrieval --tier
# pool --budgets 0.03 --contexts 32768` (the retrieval model's 8-token answers, 8 trials)
# counted per layer 240 hits and 16 late: late / (hits + late) over every decode step, the
# first included (it has no previous selection: its prediction is the sink and recent
# blocks); after the first step nothing was late. A model whose queries move reads more
# late (bench sparse); measure yours with sparse_stats() and pass --late-share.
LATE_SHARE = 0.0625
LATE_SHARE_SOURCE = (
    "measured: the retrieval model's decode at 32K through the host pool on the CPU backend"
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tpu-compile",
        help="compile the host-pool decode step for TPU topologies (libtpu; nothing runs)",
    )
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    p.add_argument("--contexts", nargs="+", type=int, default=[32768, 262144, 1048576])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--staging-mib", type=int, default=64, help="staging_bytes of ours, MiB")
    p.add_argument(
        "--prefetch-depth",
        type=int,
        default=1,
        help="ours' prefetch_depth: units in flight ahead of the one attended (the staging "
        "holds one more)",
    )
    p.add_argument("--implementation", choices=("xla", "pallas"), default="pallas")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="tokens a sliding layer attends (0: every layer global)",
    )
    p.add_argument(
        "--global-every",
        type=int,
        default=6,
        help="with --sliding-window: every Nth layer is global (Gemma 3: 6; 0: none)",
    )
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=0,
        help="ours keeps only the window, a ring per slot of the window plus this many rows "
        "(needs every layer sliding: --global-every 0; 0: every position kept)",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=("ours", "plain", "resident"),
        default=["ours", "plain", "resident"],
        help="which steps to compile (ours always)",
    )
    p.add_argument(
        "--heads-over-chips",
        action="store_true",
        help="split the KV heads (and the projections) over every chip of the topology",
    )
    p.add_argument(
        "--batch-over-chips",
        action="store_true",
        help="split the slots (--batch, a multiple of the chips they are split over) over "
        "every chip of the topology; with --heads-over-chips, the chips as a grid of slots "
        "by heads (4 chips: 2 x 2, 8: 2 x 4)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="the host link per chip to project step times over, GB/s (default: each "
        "generation's published figure, jax_tpusync.tpu.host_link)",
    )
    p.add_argument(
        "--sparse",
        nargs="?",
        type=float,
        const=SPARSE_BUDGET,
        default=None,
        metavar="BUDGET",
        help=f"ours with sparse decode at this budget (a share of each context's blocks; "
        f"bare: {SPARSE_BUDGET}): its device bytes, the overlap of its unit, late and summary "
        f"copies, and its projected step against the dense one at the first context",
    )
    p.add_argument(
        "--late-share",
        type=float,
        default=None,
        help=f"with --sparse: the share of each selection fetched late (not predicted) in "
        f"the projection (default {LATE_SHARE:g}, {LATE_SHARE_SOURCE})",
    )
    common.add_details_argument(p, "every row (device MiB per step, overlap, projected ms)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)


COLUMNS = [
    ("topology", "topology", ""),
    ("context", "context", ""),
    ("ours_device_mib", "ours MiB", ".1f"),
    ("plain_device_mib", "plain MiB", ".1f"),
    ("resident_device_mib", "resident MiB", ".1f"),
    ("weights_mib", "weights MiB", ".1f"),
    ("staging_mib", "staging MiB", ".1f"),
    ("overlapped", "copies overlapped", ""),
    ("projected_step_ms", "projected ms", ".2f"),
]


def prepare_libtpu() -> None:
    """Sets what libtpu needs before JAX starts a backend; the programs run nowhere."""
    prepare_compile_only()


def tpu_devices(topology: str) -> list:
    """The devices of a TPU ``topology`` (``v5e:2x2``...), compile-only."""
    from jax_tpusync.tpu.target import topology_devices

    return topology_devices(topology)


def chip_split(chips: int, *, batch_over_chips: bool, heads_over_chips: bool) -> tuple[int, int]:
    """(dp, tp): how many of ``chips`` the slots and the KV heads are split over. Both: a
    grid of every chip, dp the largest divisor of ``chips`` not above its square root (4
    chips: 2 x 2; 8: 2 x 4); one of them: every chip; neither: one chip."""
    if batch_over_chips and heads_over_chips:
        dp = max(d for d in range(1, math.isqrt(chips) + 1) if chips % d == 0)
        return dp, chips // dp
    return (chips if batch_over_chips else 1), (chips if heads_over_chips else 1)


def check_split(shape, dp: int, tp: int) -> None:
    """Refuses, by flag, a model whose slots or KV heads the chips do not divide."""
    if shape.batch % dp:
        raise ValueError(
            f"--batch {shape.batch} must be a multiple of the {dp} chips the slots are split "
            f"over (--batch-over-chips)"
        )
    if shape.kv_heads % tp:
        raise ValueError(
            f"--kv-heads {shape.kv_heads} must be a multiple of the {tp} chips the KV heads "
            f"are split over (--heads-over-chips)"
        )


def chip_layout(devices: list, dp: int, tp: int):
    """The :class:`~jax_tpusync.core.mesh_layout.MeshLayout` of ``dp`` x ``tp`` of ``devices``:
    mesh axis ``batch`` splits the slots, ``heads`` the KV heads (an axis of one chip left
    out); None for one chip."""
    import numpy as np
    from jax.sharding import Mesh

    from jax_tpusync.core.mesh_layout import checked_layout

    if dp * tp == 1:
        return None
    sizes = {axis: n for axis, n in (("batch", dp), ("heads", tp)) if n > 1}
    mesh = Mesh(np.array(devices[: dp * tp]).reshape(tuple(sizes.values())), tuple(sizes))
    return checked_layout(mesh, "heads" if tp > 1 else None, "batch" if dp > 1 else None)


def param_specs(shape, heads_axis: str | None) -> list[dict]:
    """The step's weights' partition specs (:func:`tiny_decoder.init_step_params`'s
    structure) as tensor parallelism splits them over ``heads_axis`` (the q/k/v projections
    by output heads, the output projection by input heads; every batch shard holds them
    whole); None splits nothing."""
    from jax.sharding import PartitionSpec as P

    split = {"wq": P(None, heads_axis), "wk": P(None, heads_axis), "wv": P(None, heads_axis)}
    split.update(wo=P(heads_axis, None), w1=P(None, heads_axis), w2=P(heads_axis, None))
    return [{name: split[name] for name in layer} for layer in param_shapes(shape)]


def param_shapes(shape) -> list[dict]:
    """The step's weights as shapes (:func:`tiny_decoder.init_step_params`'s structure)."""
    import jax

    d, kv = shape.d_model, shape.kv_heads * shape.head_dim
    dims = {"wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d)}
    if shape.ffn:
        dims.update(w1=(d, shape.ffn), w2=(shape.ffn, d))
    return [
        {name: jax.ShapeDtypeStruct(dim, shape.dtype) for name, dim in dims.items()}
        for _ in range(shape.layers)
    ]


def abstract_params(shape, sharding, layout=None) -> list[dict]:
    """:func:`param_shapes` on ``sharding``'s device, or over ``layout``'s mesh split as
    :func:`param_specs` splits them over its ``kv_heads_axis``."""
    import jax
    from jax.sharding import NamedSharding

    if layout is None:
        placed = jax.tree.map(lambda _: sharding, param_shapes(shape))
    else:
        specs = param_specs(shape, layout.kv_heads_axis)
        placed = [{n: NamedSharding(layout.mesh, p) for n, p in layer.items()} for layer in specs]
    return jax.tree.map(
        lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
        param_shapes(shape),
        placed,
    )


def batch_sharding(on_device, layout):
    """Where a step's ``[batch, ...]`` activations go: ``on_device`` (replicated), or split
    over ``layout``'s ``batch_axis`` when it has one."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if layout is None or layout.batch_axis is None:
        return on_device
    return NamedSharding(layout.mesh, P(layout.batch_axis))


def plan_ours(
    shape,
    topology: str,
    *,
    block_tokens: int,
    staging_bytes: int,
    implementation: str,
    dp: int = 1,
    tp: int = 1,
    windows: list[int | None] | None = None,
    max_step_tokens: int | None = None,
    prefetch_depth: int = 1,
    link_gbps: float | None = None,
    sparse: float | None = None,
):
    """The :class:`~jax_tpusync.tpu.ContextPlan` of the host-pool decode step at
    ``shape.context`` (:func:`jax_tpusync.tpu.plan_step`, the public planning call), on one
    chip of ``topology`` or with the slots split over ``dp`` of them and the heads over
    ``tp`` (mesh axes ``batch`` and ``heads``); ``windows``: per layer, the tokens a sliding
    layer attends (None: global); ``max_step_tokens``: the pool keeps a ring per slot of one
    window plus that many rows (None: every position); ``prefetch_depth``: units in flight
    ahead of the one attended; ``link_gbps``: the host link (None: the generation's);
    ``sparse``: a sparse decode budget (None: dense)."""
    import jax

    import jax_tpusync as tps
    from jax_tpusync.bench import tiny_decoder
    from jax_tpusync.tpu import plan_step

    check_split(shape, dp, tp)
    cache = dict(
        num_layers=shape.layers,
        batch=shape.batch,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
        block_tokens=block_tokens,
        staging_bytes=staging_bytes,
        sliding_window=windows,
        max_step_tokens=max_step_tokens or None,
        prefetch_depth=prefetch_depth,
        sparse=sparse,
    )
    options: dict[str, Any] = dict(implementation=implementation)
    if implementation == "pallas":
        options.update(interpret=False)  # The kernel for the target TPU, through Mosaic.

    def attend(layer, q, k, v, state):
        return tps.prefetching_attention(q, k, v, state, layer=layer, **options)

    def step(params, x, state):
        return tiny_decoder.step(params, shape, x, state, attend)

    axes = {axis: n for axis, n in (("batch", dp), ("heads", tp)) if n > 1}
    plan = plan_step(
        step,
        param_shapes(shape),
        cache,
        topology=topology,
        inputs=(jax.ShapeDtypeStruct((shape.batch, 1, shape.d_model), shape.dtype),),
        mesh_axes=axes or None,
        kv_heads_axis="heads" if tp > 1 else None,
        batch_axis="batch" if dp > 1 else None,
        param_specs=param_specs(shape, "heads") if tp > 1 else None,
        contexts=(shape.context,),
        link_gbps=link_gbps,
    )
    return plan, plan.contexts[0]


def compile_plain(
    shape,
    devices: list,
    *,
    resident: bool,
    dp: int = 1,
    tp: int = 1,
    windows: list[int | None] | None = None,
):
    """The same model with its KV in ``pinned_host`` arrays brought in per layer by
    ``jax.device_put`` inside the step (``resident=False``), or in device memory; on the
    first of ``devices``, or split as :func:`plan_ours` splits it (the KV's slots over
    ``dp`` of them, its heads over ``tp``). A sliding layer
    brings in (and attends) its window's last positions only."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    from jax_tpusync.bench import tiny_decoder

    check_split(shape, dp, tp)
    layout = chip_layout(devices, dp, tp)
    if layout is None:
        on_device = kv_device = SingleDeviceSharding(devices[0])
        kv_host = SingleDeviceSharding(devices[0], memory_kind="pinned_host")
    else:
        on_device = NamedSharding(layout.mesh, P())
        # [layers, K/V, batch, tokens, heads, head_dim]
        kv_spec = P(None, None, layout.batch_axis, None, layout.kv_heads_axis)
        kv_device = NamedSharding(layout.mesh, kv_spec)
        kv_host = NamedSharding(layout.mesh, kv_spec, memory_kind="pinned_host")
    kv_sharding = kv_device if resident else kv_host
    b, t = shape.batch, shape.context
    kv = jax.ShapeDtypeStruct(
        (shape.layers, 2, b, t, shape.kv_heads, shape.head_dim), shape.dtype, sharding=kv_sharding
    )

    def attend(layer, q, k, v, cache):
        layer_kv = cache[layer]
        window = windows[layer] if windows else None
        if window is not None and window < t:
            layer_kv = layer_kv[:, :, t - window :]
        if not resident:
            layer_kv = jax.device_put(layer_kv, jax.memory.Space.Device)
        groups = shape.q_heads // shape.kv_heads
        keys = jnp.repeat(layer_kv[0], groups, axis=2)  # [B, T, Hq, D]
        values = jnp.repeat(layer_kv[1], groups, axis=2)
        logits = jnp.einsum("bqhd,bthd->bhqt", q, keys, preferred_element_type=jnp.float32)
        weights = jax.nn.softmax(logits / shape.head_dim**0.5, axis=-1).astype(q.dtype)
        return jnp.einsum("bhqt,bthd->bqhd", weights, values), cache

    def step(params, x, cache):
        return tiny_decoder.step(params, shape, x, cache, attend)

    x_sharding = batch_sharding(on_device, layout)
    args = (
        abstract_params(shape, on_device, layout),
        jax.ShapeDtypeStruct((b, 1, shape.d_model), shape.dtype, sharding=x_sharding),
        kv,
    )
    shardings = jax.tree.map(lambda a: a.sharding, args)
    return (
        jax.jit(step, in_shardings=shardings, out_shardings=(x_sharding, kv_sharding))
        .trace(*args)
        .lower()
        .compile()
    )


def fitted_mib(build) -> tuple[float | None, str]:
    """(device MiB, "") of the program ``build()`` compiles, or (None, why) when the
    compiler refuses it for want of device memory (the MiB it needed, from its message)."""
    compiled, why = compiled_or_refusal(build)
    return (None, why) if compiled is None else (device_bytes(compiled) / 2**20, "")


def measure(kind: str, topology: str, shape, options: dict) -> dict:
    """Compiles one program (``ours``, ``plain`` or ``resident``) in this process; returns
    what :func:`run` reports of it."""
    if kind != "ours":
        devices = tpu_devices(topology)
        mib, note = fitted_mib(
            lambda: compile_plain(
                shape,
                devices,
                resident=kind == "resident",
                dp=options.get("dp", 1),
                tp=options.get("tp", 1),
                windows=options.get("windows"),
            )
        )
        return dict(device_mib=mib, note=note)
    plan, ours = plan_ours(shape, topology, **options)
    if ours.device_bytes is None:
        raise RuntimeError(f"the host-pool step does not fit a {topology} chip: {ours.refusal}")
    sparse_parts = {}
    if ours.sparse is not None:
        sparse_parts = dict(
            summary_overlap=ours.sparse.summary_overlap,
            summary_layer_bytes=ours.sparse.summary_layer_bytes,
            summary_chunk_blocks=ours.sparse.summary_chunk_blocks,
            summary_host_mib=ours.sparse.summary_host_bytes / 2**20,
            selected_blocks=ours.sparse.selected_blocks,
            context_blocks=ours.sparse.context_blocks,
        )
    return dict(
        **sparse_parts,
        device_mib=ours.device_bytes / 2**20,
        note="",
        compile_s=ours.compile_s,
        chunk_len=ours.chunk_len,
        staging_mib=ours.staging_bytes / 2**20,
        prefetch_depth=ours.prefetch_depth,
        pool_mib=ours.pool_bytes / 2**20,
        flops=ours.flops,
        bytes_accessed=ours.bytes_accessed,
        overlap=dict(
            computations=ours.computations,
            copies=ours.copies,
            started_before=ours.started_before,
            overlapped=ours.overlapped,
            spanning=ours.spanning,
        ),
        link_gbps=plan.link_gbps,
        link_source=plan.link_source,
    )


def measure_in_child(kind: str, topology: str, shape, options: dict) -> dict:
    """:func:`measure` in a child process: the TPU compiler aborts the process on some
    programs (seen with the plain memory-kinds step at 1M tokens on TPU7x), which must cost
    one row's cell, not the run."""
    request = dict(kind=kind, topology=topology, shape=dataclasses.asdict(shape), options=options)
    request["shape"]["dtype"] = "bf16"
    child = subprocess.run(
        [sys.executable, "-m", "jax_tpusync.bench.tpu_compile", json.dumps(request)],
        capture_output=True,
        text=True,
        env={**os.environ, **LIBTPU_ENVIRONMENT, "JAX_PLATFORMS": "cpu"},
    )
    for line in reversed(child.stdout.splitlines()):
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY) :])
    failed = [x for x in child.stderr.splitlines() if "Check failed" in x or "Error" in x]
    why = failed[-1].strip()[:200] if failed else f"exit status {child.returncode}"
    if kind == "ours":
        raise RuntimeError(f"the host-pool step did not compile for {topology}: {why}")
    return dict(device_mib=None, note=f"the compiler aborted: {why}")


REPLY = "tpu-compile-reply: "


def run(args) -> list[dict]:
    if args.sparse is not None:
        late_share_of(args)  # A bad --late-share refused before anything compiles.
    prepare_libtpu()
    import jax.numpy as jnp

    from jax_tpusync.bench import tiny_decoder

    windows = None
    if args.sliding_window:
        every = args.global_every
        windows = [
            None if every > 0 and (i + 1) % every == 0 else args.sliding_window
            for i in range(args.layers)
        ]

    def model(context: int):
        return tiny_decoder.Shape(
            layers=args.layers,
            batch=args.batch,
            q_heads=args.q_heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            ffn=0,
            context=context,
            dtype=jnp.bfloat16,
        )

    # Every topology's split, refused (by flag) before anything compiles.
    splits = {}
    for topology in args.topologies:
        over_chips = args.batch_over_chips or args.heads_over_chips
        splits[topology] = chip_split(
            len(tpu_devices(topology)) if over_chips else 1,
            batch_over_chips=args.batch_over_chips,
            heads_over_chips=args.heads_over_chips,
        )
        check_split(model(args.contexts[0]), *splits[topology])
    rows = []
    for topology in args.topologies:
        dp, tp = splits[topology]
        for context in args.contexts:
            shape = model(context)
            options = dict(
                block_tokens=args.block_tokens,
                staging_bytes=args.staging_mib << 20,
                implementation=args.implementation,
                dp=dp,
                tp=tp,
                windows=windows,
                max_step_tokens=args.max_step_tokens or None,
                prefetch_depth=args.prefetch_depth,
                link_gbps=args.link_gbps,
            )
            if args.sparse is not None:
                options["sparse"] = args.sparse
            ours = measure_in_child("ours", topology, shape, options)
            skipped = dict(device_mib=None, note="not compiled (--kinds)")
            plain, resident = (
                measure_in_child(kind, topology, shape, options) if kind in args.kinds else skipped
                for kind in ("plain", "resident")
            )
            d, kv = shape.d_model, shape.kv_heads * shape.head_dim
            # Per chip: wq, wk, wv, wo in bf16 (split over the heads only: every batch
            # shard holds them), and the KV each chip's own link brings in (its slots' and
            # heads' share).
            weights = shape.layers * 2 * d * (d + kv) * 2 / tp
            # Rows each layer reads: a sliding layer its window (ours: its blocks).
            layer_windows = windows or [None] * shape.layers
            read_rows = sum(context if w is None else min(context, w) for w in layer_windows)
            kv_bytes = 2 * shape.batch * read_rows * shape.row_bytes / (dp * tp)
            dense_kv_bytes = kv_bytes
            sparse_row = {}
            if args.sparse is not None:
                kv_bytes, sparse_row = sparse_read(args, shape, ours, layer_windows, dp * tp)
            gbps = ours["link_gbps"]
            overlap = ours["overlap"]
            rows.append(
                dict(
                    topology=topology,
                    context=context,
                    implementation=args.implementation,
                    chips=dp * tp,
                    dp=dp,
                    tp=tp,
                    windows=windows,
                    ours_device_mib=ours["device_mib"],
                    plain_device_mib=plain["device_mib"],
                    plain_note=plain["note"],
                    resident_device_mib=resident["device_mib"],
                    resident_note=resident["note"],
                    weights_mib=weights / 2**20,
                    staging_mib=ours["staging_mib"],
                    pool_mib=ours["pool_mib"],
                    max_step_tokens=args.max_step_tokens or None,
                    prefetch_depth=ours["prefetch_depth"],
                    chunk_len=ours["chunk_len"],
                    kv_mib_per_step=kv_bytes / 2**20,
                    flops=ours["flops"],
                    bytes_accessed=ours["bytes_accessed"],
                    overlapped=f"{overlap['overlapped']}/{overlap['copies']}",
                    overlap=overlap,
                    link_gbps=ours["link_gbps"],
                    link_source=ours["link_source"],
                    projected_step_ms=kv_bytes / (gbps * 1e9) * 1e3,
                    dense_projected_step_ms=dense_kv_bytes / (gbps * 1e9) * 1e3,
                    compile_s=ours["compile_s"],
                    ran_on_tpu=False,
                    **sparse_row,
                )
            )
            common.progress(f"{topology} {context}: compiled in {ours['compile_s']:.1f} s")
    common.summary_or_details(args, summary(rows))
    return rows


def sparse_read(args, shape, ours: dict, layer_windows, chips: int) -> tuple[float, dict]:
    """(KV bytes a sparse step reads per chip, the row's sparse fields): per global layer
    the layer's summaries (every physical block's, copied whole each step), the selected
    blocks (the budget's share of the context's, at least the sink and recent blocks:
    :class:`~jax_tpusync.tpu.SparseContextPlan`) and ``--late-share`` of them again
    (fetched late: a prediction's wasted blocks are about as many as its late ones, so
    predicted plus late is the selection plus the late share); a sliding layer its window.
    The blocks and windows of every slot and head are split over the ``chips``; the
    summaries are one chip's already (the plan's, of the chip's heads and blocks)."""
    block_bytes = 2 * args.block_tokens * shape.row_bytes
    selected = ours["selected_blocks"]
    late_share, late_source = late_share_of(args)
    total = 0.0
    global_layers = 0
    for w in layer_windows:
        if w is None:
            global_layers += 1
            total += shape.batch * selected * (1 + late_share) * block_bytes
        else:
            total += 2 * shape.batch * min(shape.context, w) * shape.row_bytes
    summary_bytes = global_layers * ours["summary_layer_bytes"]
    overlap = ours["summary_overlap"]
    return total / chips + summary_bytes, dict(
        sparse_budget=args.sparse,
        late_share=late_share,
        late_share_source=late_source,
        selected_blocks=selected,
        context_blocks=ours["context_blocks"],
        summary_mib_per_step=summary_bytes / 2**20,
        summary_chunk_blocks=ours["summary_chunk_blocks"],
        summary_host_mib=ours["summary_host_mib"],
        summary_overlapped=f"{overlap['spanning']}/{overlap['copies']}",
        summary_overlap=overlap,
    )


def late_share_of(args) -> tuple[float, str]:
    """(the late share the projection counts, where it comes from): ``--late-share``, or
    the measured default (:data:`LATE_SHARE`)."""
    if getattr(args, "late_share", None) is None:
        return LATE_SHARE, LATE_SHARE_SOURCE
    if not 0 <= args.late_share <= 1:
        raise ValueError(f"--late-share {args.late_share:g} must be a share in [0, 1]")
    return args.late_share, "given (--late-share)"


def sparse_summary(rows: list[dict]) -> list[str]:
    """With --sparse, per topology: the projected sparse step at each context against the
    dense step's at the first context, and how its summary copies overlap their scoring."""
    lines = []
    for topology in dict.fromkeys(r["topology"] for r in rows):
        mine = [r for r in rows if r["topology"] == topology]
        base = mine[0]
        ratios = ", ".join(
            f"{r['projected_step_ms'] / base['dense_projected_step_ms']:.2f}x at "
            f"{tokens_text(r['context'])}"
            for r in mine
        )
        summary = sum(r["summary_overlap"]["spanning"] for r in mine)
        copies = sum(r["summary_overlap"]["copies"] for r in mine)
        units = sum(r["overlap"]["spanning"] for r in mine)
        unit_copies = sum(r["overlap"]["copies"] for r in mine)
        lines.append(
            f"{topology} sparse (budget {base['sparse_budget']:g}, {base['late_share']:.0%} of "
            f"each selection late, {base['late_share_source']}): projected step against the"
            f" dense step at "
            f"{tokens_text(base['context'])} ({base['dense_projected_step_ms']:.1f} ms): {ratios};"
            f" summaries {_spread([r['summary_mib_per_step'] for r in mine], 'MiB')} copied"
            f" per step; {units} of {unit_copies} unit copies (predicted and late) and"
            f" {summary} of {copies} summary chunk copies have an attention, a layer's unit"
            f" walk or a scoring between their start and their end"
        )
    return lines


def summary(rows: list[dict]) -> str:
    """Per topology, in words: the device memory ours holds across the contexts (weights
    plus staging) against the plain memory-kinds step's and the resident step's at each
    context, how many of ours' unit copies overlap an attention, and the projected step
    time at each context."""
    if not rows:
        return "tpu-compile: nothing compiled"
    lines = []
    for topology in dict.fromkeys(r["topology"] for r in rows):
        mine = [r for r in rows if r["topology"] == topology]
        first = mine[0]
        lines.append(
            f"{topology} ({first['implementation']} attention{_split_words(first)}), device"
            f" memory per chip:"
        )
        ours = [r["ours_device_mib"] for r in mine]
        held = _spread(ours, "MiB")
        lines.append(
            f"  ours holds {held} ({_contexts(mine)}; weights {first['weights_mib']:.0f} MiB"
            f" + staging {first['staging_mib']:.0f} MiB)"
        )
        pools = [r["pool_mib"] for r in mine]
        ring = (
            f", a ring of the window plus {first['max_step_tokens']} rows per slot"
            if first["max_step_tokens"]
            else ""
        )
        lines.append(f"  its pool in host memory: {_spread(pools, 'MiB')}{ring}")
        for kind, name in (("plain", "plain memory kinds"), ("resident", "all KV resident")):
            held_at = _held(mine, kind)
            if held_at:
                lines.append(f"  {name}: {held_at}")
        copies = sum(r["overlap"]["copies"] for r in mine)
        overlapped = sum(r["overlap"]["overlapped"] for r in mine)
        lines.append(
            f"  {overlapped} of ours' {copies} unit copies are started before the attention"
            f" they overlap and waited for after it"
        )
        source = f" ({first['link_source']})" if first.get("link_source") else ""
        lines.append(
            f"  projected step time over a {first['link_gbps']:.2f} GB/s host link per chip"
            f"{source}: {_projected(mine)}"
        )
    if rows[0].get("sparse_budget") is not None:
        lines.extend(sparse_summary(rows))
    ran = any(r["ran_on_tpu"] for r in rows)
    lines.append(
        ("Ran on a TPU" if ran else "Nothing ran on a TPU")
        + ": the memory is the compiler's plan; a step's time is only projected from the KV"
        " it reads over its generation's host link"
    )
    return "\n".join(lines)


def _projected(rows: list[dict]) -> str:
    """``"0.5 ms at 32K, 4.0 ms at 256K and 16.0 ms at 1M tokens"``: each context's
    projected step time."""
    times = [f"{r['projected_step_ms']:.1f} ms at {tokens_text(r['context'])}" for r in rows]
    listed = times[0] if len(times) == 1 else ", ".join(times[:-1]) + " and " + times[-1]
    return f"{listed} tokens"


def _split_words(row: dict) -> str:
    """``", the slots split over 2 chips and the heads over 2"``; "" on one chip."""
    dp, tp = row["dp"], row["tp"]
    if dp > 1 and tp > 1:
        return f", the slots split over {dp} chips and the heads over {tp}"
    if dp > 1:
        return f", the slots split over {dp} chips"
    return f", the heads split over {tp} chips" if tp > 1 else ""


def _spread(values: list[float], unit: str) -> str:
    """``"12 MiB at every context"``, or ``"256-8192 MiB across the contexts"``."""
    if max(values) - min(values) <= 0.01 * max(values):
        return f"{min(values):.0f} {unit} at every context"
    return f"{min(values):.0f}-{max(values):.0f} {unit} across the contexts"


def _held(rows: list[dict], kind: str) -> str:
    """``"hold 2690 MiB at 32K; do not fit at 1M"`` for ``kind``'s cells of ``rows``
    ("": not compiled)."""
    parts = []
    for row in rows:
        mib, note = row[f"{kind}_device_mib"], row[f"{kind}_note"]
        at = tokens_text(row["context"])
        if mib is not None:
            parts.append(f"hold {mib:.0f} MiB at {at}")
        elif note.startswith("does not fit"):
            parts.append(f"do not fit at {at} ({note[len('does not fit: ') :]})")
        elif note.startswith("the compiler aborted"):
            parts.append(f"the compiler aborted at {at}")
    return "; ".join(parts)


def _contexts(rows: list[dict]) -> str:
    """``"32K, 256K and 1M tokens"``."""
    return contexts_text([r["context"] for r in rows])


def _child_main(request_json: str) -> None:
    request = json.loads(request_json)
    prepare_libtpu()
    from jax_tpusync.bench import tiny_decoder

    fields = dict(request["shape"], dtype=tiny_decoder.jnp_dtype(request["shape"]["dtype"]))
    shape = tiny_decoder.Shape(**fields)
    reply = measure(request["kind"], request["topology"], shape, request["options"])
    print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1])
