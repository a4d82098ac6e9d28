"""``decode``: one decode step over a long offloaded context, every way it can run, side by side.

The step is a small decoder (per layer: q/k/v projections, attention over the cache plus the
new token, an output projection, and, with ``--ffn F``, a SwiGLU-free ``silu`` MLP of width F
that adds compute without adding KV). It runs as

* ``resident``: every layer's KV in device memory, :func:`jax_tpusync.resident_attention`
  (``unit_len = chunk_len``, so the same operations as the offloaded path); no engine. The
  compute floor. 16-bit KV is kept as ``uint16`` words, the form that XLA's CPU backend
  reads and updates in place (see ``resident_attention``'s ``kv_dtype``).
* ``compute``: the prefetched step's compute with the transfers taken out: the same per-unit
  attention (as ``sync``) over the device staging slots, which are never refilled, so
  every unit reads data that is already in device memory. On a CPU this is a cache-warm
  floor: the staging slots (tens of MiB at most) stay in the last-level cache, whereas the
  resident step streams its whole cache from DRAM. ``overlap_efficiency_compute`` uses this floor.
  Its output attends to the wrong tokens (the same few units again and again), so it has
  no error check.
* ``transfer``: the engine fetching one step's KV (every unit of every layer, pipelined
  ``--prefetch-depth`` units ahead through the same staging slots as the prefetching step)
  from inside ``jax.jit``,
  with no compute. The transfer floor.
* ``sync``: fetch, then compute: for each unit of each layer a ``wait_fetch`` without a
  ticket (the engine fetches on demand and the step blocks), then the attention of that unit.
  Built from :mod:`jax_tpusync.ops` with the same attention math; nothing is in flight while
  the step computes.
* ``prefetch``: :func:`jax_tpusync.prefetching_attention`: layer-ahead and cross-step
  prefetch. On the CPU backend a host tier's units are attended to where the pool holds
  them (``read_in_place="auto"``, see :mod:`jax_tpusync.in_place`): nothing is copied.
* ``copy`` (host tier): ``prefetch`` on a cache made with ``read_in_place=False``: every
  unit is copied into staging inside its wait, then attended to, as on an accelerator
  (skipped with a note on the file tier, where the two are the same).
* ``resident_mode``: ``prefetch`` on a cache made with ``resident=True`` (every layer's
  KV in the state's staging, which must fit ``--staging-bytes``; skipped with a note
  otherwise): write-back only, no fetch. What a small experiment gets from the library.
* ``two_level`` (host tier): ``prefetch`` on a two-level cache (``spill_path``, see
  :mod:`jax_tpusync.spill`) holding every block in DRAM: each unit is fetched from both
  tiers, the file tier's fetch with nothing to move. ``two_level_over_prefetch`` is the
  cost of that second fetch per unit (skipped with a note on the file tier).
* ``quantized`` (with ``--tier-dtype int8|float8_e4m3fn``): ``prefetch`` over a cache of
  quantized rows (codes + per-token scales, about half of bf16's bytes) holding the same
  KV, with the same staging budget. ``quantized_over_prefetch`` is the ratio of the two
  steps; ``quantized_max_abs_diff`` its first step's distance from ``resident`` (the
  quantization error; ``bench quality`` measures what it does to next tokens).
* ``plain``: the platform's own fetch of the same number of bytes, no engine and no XLA: one
  synchronous O_DIRECT ``preadv`` of ``--chunk-bytes`` after another from the prefetching
  cache's tier file (``memcpy`` on the host tier), on a thread pinned to the engine's CPUs.
* ``platform``: the ``compute`` step while that thread does ``plain``: what this machine
  gives a plain reader beside the same compute. ``platform_overlap_efficiency`` is that
  pair's efficiency and ``prefetch_over_platform`` compares the prefetching step with it;
  on a machine where transfers slow the compute down (shared memory bandwidth, a virtual
  disk's host threads), this is the ceiling to read the engine against.
* ``jax_offload``: JAX's own answer: the KV arrays live in ``memory_kind="pinned_host"`` and
  the step ``jax.device_put``s each layer's KV to device memory inside ``jit`` before the
  resident attention. On CPU both memory kinds are host DRAM: the compiled step holds no
  copy, yet each call copies the ``pinned_host`` KV into fresh memory outside it (the
  step's minor faults match the KV's size: 73K 4-KiB faults for 256 MiB at 32K). The row
  is labeled ``host-copy-on-cpu``: a DRAM-to-DRAM copy plus the resident step, not a
  transfer between memories.

``compute``, ``sync``, ``transfer`` and ``jax_offload`` attend over a fixed context (the new token is
attended to but not persisted); ``resident`` and ``prefetch`` append a token per step, like
a real decode, and are compared with each other (``max_abs_err``) after the same number of
steps.

Timing: rounds of ``--block`` consecutive steps per variant, variants rotated each round;
the first step of each block is dropped (it follows another variant, so the cross-step
prefetch of ``prefetch`` would have had free time), the rest are samples. Medians, min and
max over ``--steps`` samples per variant after ``--warmup`` unrecorded rounds.

``overlap_efficiency = (t_resident + t_transfer - t_prefetch) / min(t_resident, t_transfer)``:
1 when the shorter of compute and transfer hides entirely behind the longer, 0 when they
add up (no overlap). It only means something when the two are of comparable size.

``--baselines plain,tuned`` adds the ``plain_jax`` and ``tuned_jax`` rows: the decode step
written in plain JAX over a NumPy memmap of the KV, without this library (see
:mod:`jax_tpusync.bench.baselines`), timed in the same rotation.
``prefetch_over_best_jax = t_prefetch / min(t_plain_jax, t_tuned_jax)`` and
``library_over_best_jax``, the same for the faster of ``prefetch`` and ``resident_mode``
(what the library offers at that context); ``memcpy_ms`` is one
``np.copyto`` of a step's KV bytes and ``host_over_floor = t_prefetch / max(t_resident,
memcpy_ms)`` (a host-tier figure; computed whenever ``resident`` ran).

``--context`` takes several values (``--context 4096 32768 1048576``): the whole benchmark
runs once per context, in order, with fresh caches. One context returns (and ``--json``
writes as ``results``) one row, a dict, as before; several return a list of rows, one per
context. ``--plot`` draws, for one context, the prefetch step's timeline; for several, step
time against context (log-log) of every variant and baseline that ran. ``--trace`` with
several contexts writes one trace per context (``OUT-<context>.json``).

``--xla-cpu-schedule memory`` (the default) runs every variant and baseline under XLA's
memory-minimizing CPU schedule (:func:`jax_tpusync.xla_cpu.use_memory_scheduler`; an
``XLA_FLAGS`` that already names the flag wins); ``concurrency`` keeps XLA's default, under
which a one-program step of many 16-bit layers pays for every layer's weight conversion up
front (see :mod:`jax_tpusync.xla_cpu`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_tpusync import xla_cpu
from jax_tpusync.bench import baselines, common, mesh_decode

DTYPES = ("bf16", "f32", "f16")
VARIANTS = (
    "resident",
    "compute",
    "transfer",
    "sync",
    "prefetch",
    "copy",
    "resident_mode",
    "contiguous",
    "two_level",
    "quantized",
    "plain",
    "platform",
    "jax_offload",
)
# Contexts at which device_bytes is checked to be the same.
CONTEXT_CHECK = (32 * 1024, 1024 * 1024)
STALL_NS = 100_000  # A wait longer than this stalled the step.

COLUMNS = [
    ("tier", "tier", "s"),
    ("context", "context", "d"),
    ("t_resident_ms", "resident ms", ".1f"),
    ("t_compute_ms", "compute ms", ".1f"),
    ("t_transfer_ms", "transfer ms", ".1f"),
    ("t_sync_ms", "sync ms", ".1f"),
    ("t_prefetch_ms", "prefetch ms", ".1f"),
    ("t_copy_ms", "copy ms", ".1f"),
    ("copy_over_prefetch", "copy/pf", ".3f"),
    ("t_resident_mode_ms", "resident mode ms", ".1f"),
    ("t_contiguous_ms", "contiguous ms", ".1f"),
    ("paged_over_contiguous", "paged/contig", ".3f"),
    ("t_two_level_ms", "two-level ms", ".1f"),
    ("two_level_over_prefetch", "2lvl/pf", ".3f"),
    ("fetch_bytes_per_segment", "B/segment", ".0f"),
    ("t_quantized_ms", "quantized ms", ".1f"),
    ("quantized_over_prefetch", "quant/pf", ".3f"),
    ("t_platform_ms", "platform ms", ".1f"),
    ("t_jax_offload_ms", "jax offload ms", ".1f"),
    ("overlap_efficiency", "overlap eff", ".3f"),
    ("prefetch_over_max", "pf/max", ".3f"),
    ("overlap_efficiency_compute", "eff vs compute", ".3f"),
    ("prefetch_over_max_compute", "pf/max compute", ".3f"),
    ("prefetch_over_platform", "pf/platform", ".3f"),
    ("direct_read_fraction", "direct", ".2f"),
    ("t_plain_jax_ms", "plain jax ms", ".1f"),
    ("t_tuned_jax_ms", "tuned jax ms", ".1f"),
    ("prefetch_over_best_jax", "pf/best jax", ".3f"),
    ("library_over_best_jax", "lib/best jax", ".3f"),
    ("memcpy_ms", "memcpy ms", ".1f"),
    ("host_over_floor", "pf/floor", ".3f"),
    ("tokens_per_s", "tok/s", ".2f"),
    ("max_abs_err", "max err", ".2g"),
    ("max_abs_err_plain_jax", "plain jax err", ".2g"),
    ("device_bytes", "device", "bytes"),
    ("kv_bytes", "kv", "bytes"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``decode`` subcommand."""
    p = subparsers.add_parser(
        "decode",
        help="decode step: resident vs sync vs prefetched vs JAX host offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", choices=("host", "file"), default="file")
    p.add_argument(
        "--path",
        default=None,
        help="file tier: directory on the SSD to measure (default: a temporary "
        "directory under the current directory)",
    )
    p.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=[32 * 1024],
        help="cached tokens (default 32K); several: one run per context, a row each",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--ffn",
        type=int,
        default=0,
        help="per-layer MLP width: compute that does not read KV (default 0)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="KV and weights dtype")
    p.add_argument(
        "--staging-bytes",
        type=common.parse_bytes,
        default=32 * common.MiB,
        help="device staging budget of the offloaded cache (--prefetch-depth + 1 slots; "
        "default 32M). Fixes device_bytes whatever the context",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help="tokens per KV block of the paged cache (a power of two; default the cache's, "
        "256). The contiguous row uses one block per sequence",
    )
    common.add_engine_arguments(p)
    common.add_cpu_arguments(p)
    p.add_argument(
        "--prefetch-depth",
        type=_depth,
        default="auto",
        help="units fetched ahead, or 'auto' (the default: the cache's choice, 3 on the "
        "file tier, where four 8 MiB slots of 32M keep one slow read or unit of compute from "
        "stalling the step (depth 1 in 16M stalled 60-75 ms per 32K step here), 1 on the "
        "host tier, whose reads run inside the wait); the staging budget is split into "
        "depth + 1 slots",
    )
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant (>= 5; default 6)")
    p.add_argument(
        "--block",
        type=int,
        default=3,
        help="consecutive steps per variant per round; the first is not timed (default 3)",
    )
    p.add_argument("--warmup", type=int, default=1, help="unrecorded rounds (default 1)")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="what to measure (default: all)",
    )
    p.add_argument(
        "--tier-dtype",
        choices=("int8", "float8_e4m3fn"),
        default=None,
        help="adds the quantized variant: the prefetch step over a cache of this tier dtype",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="one --context: plot the prefetch step's timeline (transfers, compute, "
        "stalls); several: step time vs context, log-log, every variant and baseline",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="OUT.json",
        help="write the prefetch steps' timeline as a Chrome/Perfetto trace",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="instead of the variants: the prefetch step on a mesh cache of 1, 2, 4 ... N "
        "devices at the same per-device shapes (simulated CPU devices on a CPU host), with "
        "the bytes each shard fetched (see jax_tpusync.bench.mesh_decode)",
    )
    p.add_argument(
        "--mesh",
        choices=("tp", "dp"),
        default="tp",
        help="with --devices: split KV heads (tp, default) or sequences (dp) over the devices",
    )
    p.add_argument(
        "--xla-cpu-schedule",
        choices=("memory", "concurrency"),
        default="memory",
        help="XLA CPU instruction schedule for every variant (default memory; see jax_tpusync.xla_cpu)",
    )
    baselines.add_arguments(p)
    p.add_argument("--json", required=True, metavar="OUT", help="result file ('-': stdout)")


# -- the model step ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int
    dtype: Any

    @property
    def d_model(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def kv_bytes_per_step(self) -> int:
        """Cached KV bytes one step reads (all layers, K and V, all sequences)."""
        return self.layers * 2 * self.batch * self.context * self.row_bytes


def _init_params(shape: Shape, seed: int):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    d, kv = shape.d_model, shape.kv_heads * shape.head_dim

    def w(fan_in, *dims):
        return jnp.asarray(
            rng.standard_normal(dims, dtype=np.float32) / math.sqrt(fan_in), shape.dtype
        )

    layers = []
    for _ in range(shape.layers):
        p = dict(wq=w(d, d, d), wk=w(d, d, kv), wv=w(d, d, kv), wo=w(d, d, d))
        if shape.ffn:
            p.update(w1=w(d, d, shape.ffn), w2=w(shape.ffn, shape.ffn, d))
        layers.append(p)
    return layers


def _model(params, shape: Shape, x, cache, attend: Callable, mark: Callable | None = None):
    """x [B, 1, d_model] -> (x, cache); ``attend(layer, q, k, v, cache) -> (out, cache)``."""
    import jax

    b = x.shape[0]
    for layer, p in enumerate(params):
        if mark is not None:
            x = mark(True, x, layer)
        q = (x @ p["wq"]).reshape(b, 1, shape.q_heads, shape.head_dim)
        k = (x @ p["wk"]).reshape(b, 1, shape.kv_heads, shape.head_dim)
        v = (x @ p["wv"]).reshape(b, 1, shape.kv_heads, shape.head_dim)
        o, cache = attend(layer, q, k, v, cache)
        x = x + o.reshape(b, 1, -1) @ p["wo"]
        if shape.ffn:
            x = x + jax.nn.silu(x @ p["w1"]) @ p["w2"]
        if mark is not None:
            x = mark(False, x, layer)
    return x, cache


def _marker(engine_id: int):
    import jax.numpy as jnp

    from jax_tpusync import ops

    def mark(begin: bool, x, layer: int):
        kind = ops.MARK_COMPUTE_BEGIN if begin else ops.MARK_COMPUTE_END
        return ops.mark(engine_id, kind, x, jnp.asarray([layer, -1], jnp.int32))

    return mark


def _units(context: int, chunk_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(first position, valid tokens) int32[U] of the units of a fixed ``context``."""
    units = max(1, -(-context // chunk_len))
    lo = np.arange(units, dtype=np.int64) * chunk_len
    return lo.astype(np.int32), np.clip(context - lo, 0, chunk_len).astype(np.int32)


def _depth(text: str) -> int | str:
    """``--prefetch-depth``: an int, or ``auto``."""
    return text if text == "auto" else int(text)


def _unit_table(cache, context: int, slots: int) -> np.ndarray:
    """Host-side segments int32[L, U, slots, 2B, 4] of every unit of a fixed ``context``.

    Unit u of layer l landing in staging slot s, through the cache's block tables (absolute
    tier blocks). The benchmark admits every slot at init(), so each slot's blocks are
    consecutive: one segment per (K|V, slot) and unit.
    """
    from jax_tpusync import ops

    spec = cache.spec
    c = spec.chunk_len
    lo, count = _units(context, c)
    table = np.zeros((spec.num_layers, len(lo), slots, 2 * spec.batch, 4), np.int32)
    for layer in range(spec.num_layers):
        for u in range(len(lo)):
            for s in range(slots):
                tier_off, mem_off, sizes = [], [], []
                for kv in range(2):
                    for b in range(spec.batch):
                        runs = cache.tier_rows(layer, kv, b, int(lo[u]), int(lo[u] + count[u]))
                        if len(runs) > 1:
                            raise AssertionError("the benchmark's slots hold consecutive blocks")
                        offset, n = runs[0] if runs else (0, 0)
                        tier_off.append(offset)
                        mem_off.append(((s * 2 + kv) * spec.batch + b) * c * spec.row_bytes)
                        sizes.append(n)
                table[layer, u, s] = ops.segment_rows(tier_off, mem_off, sizes, spec.block_bytes)
    return table


def _absolute_regions(cache):
    """The cache's (layer, K|V) regions in absolute tier bytes, for host-built segments
    that span blocks (the sync and transfer rows)."""
    from jax_tpusync import ops

    spec = cache.spec
    return ops.Regions(
        base=cache.first_block * spec.block_bytes,
        nbytes=spec.num_blocks * spec.block_bytes,
        count=2 * spec.num_layers,
    )


# -- the benchmark -------------------------------------------------------------------------------


# What one step cost the whole process (all threads: XLA's, the engine's, the kernel's).
_COSTS = ("cpu_user", "cpu_system", "minor_faults")


class _Variant:
    """A jitted step plus its carried (donated) state; ``once()`` runs one step, timed."""

    def __init__(
        self, name: str, fn: Callable, state: Any, args: tuple = (), prepare: Callable | None = None
    ):
        self.name, self.fn, self.state, self.args = name, fn, state, args
        self.prepare = prepare  # Untimed, before each step.
        self.out = None
        self.steps = 0

    def once(self) -> tuple[float, dict[str, float]]:
        """Runs one step; returns its wall seconds and its ``_COSTS``."""
        import jax

        if self.prepare is not None:
            self.prepare()
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out, self.state = self.fn(*self.args, self.state)
        jax.block_until_ready((out, self.state))
        dt = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        self.out = out
        self.steps += 1
        return dt, {
            "cpu_user": c1.ru_utime - c0.ru_utime,
            "cpu_system": c1.ru_stime - c0.ru_stime,
            "minor_faults": c1.ru_minflt - c0.ru_minflt,
        }


def run(args: argparse.Namespace) -> dict[str, Any] | list[dict[str, Any]]:
    """Runs the benchmark at each ``--context``; one row (a dict), or a list of them."""
    contexts = list(args.context) if isinstance(args.context, (list, tuple)) else [args.context]
    if args.plot:
        baselines.require_matplotlib()
    if args.xla_cpu_schedule == "memory":
        try:
            args.xla_cpu_schedule_result = xla_cpu.use_memory_scheduler()  # Before JAX starts.
        except RuntimeError:  # Called in a process that already computed (tests): as it is.
            args.xla_cpu_schedule_result = "backends already started"
        if args.xla_cpu_schedule_result not in ("set", "kept"):
            print(f"note: --xla-cpu-schedule memory not applied ({args.xla_cpu_schedule_result})")
    if args.devices is not None:
        if args.devices < 1 or len(contexts) != 1:
            raise SystemExit("--devices N needs N >= 1 and one --context")
        mesh_decode.ask_for_devices(args.devices)  # Before JAX starts its backend.
        args.context = contexts[0]
        args.columns = mesh_decode.COLUMNS  # Its rows are per device count.
        return mesh_decode.run(args, common.apply_cpu_arguments(args))
    worker_cpus = common.apply_cpu_arguments(args)  # Once, before JAX starts its backend.
    if len(contexts) == 1:
        args.context = contexts[0]  # The JSON's args keep their one-context form.
        return _run_context(args, worker_cpus)
    rows = []
    for context in contexts:
        trace = None
        if args.trace:
            stem, ext = os.path.splitext(args.trace)
            trace = f"{stem}-{context}{ext or '.json'}"
        # --plot is the sweep's plot here, not a per-context timeline.
        one = argparse.Namespace(**{**vars(args), "context": context, "plot": None, "trace": trace})
        rows.append(_run_context(one, worker_cpus))
    if args.plot:
        baselines.plot_sweep(rows, args.plot, VARIANTS + baselines.VARIANTS)
        print(f"wrote {args.plot}")
    return rows


def _run_context(args: argparse.Namespace, worker_cpus: tuple[int, ...]) -> dict[str, Any]:
    """Builds the variants at one context, times them side by side, returns one row."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    import jax_tpusync as tps
    from jax_tpusync import ops
    from jax_tpusync.step.unit import attend_valid_rows, staged_block_len, staged_rows
    from jax_tpusync.cache import auto_prefetch_depth
    from jax_tpusync.engine import huge_page_fraction
    from jax_tpusync.kernels import reference as kref

    if args.steps < 5:
        raise SystemExit("--steps must be >= 5")
    if args.block < 2:
        raise SystemExit("--block must be >= 2 (its first step is not timed)")
    if args.q_heads % args.kv_heads:
        raise SystemExit("--q-heads must be a multiple of --kv-heads")
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}[args.dtype]
    shape = Shape(
        args.layers,
        args.batch,
        args.q_heads,
        args.kv_heads,
        args.head_dim,
        args.ffn,
        args.context,
        dtype,
    )
    variants_wanted = list(dict.fromkeys(args.variants))
    if "prefetch" not in variants_wanted:
        variants_wanted.append("prefetch")  # The reference row of everything else.
    timed_per_block = args.block - 1
    rounds = -(-args.steps // timed_per_block)
    total_steps = 1 + (args.warmup + rounds) * args.block
    max_len = args.context + total_steps + 1
    depth = args.prefetch_depth
    if depth == "auto":
        depth = auto_prefetch_depth(args.tier)
    slots = depth + 1

    tmpdir = None
    path = None
    # The baselines' memmaps live there too, and a two-level cache's file tier.
    if args.tier == "file" or args.baselines or "two_level" in variants_wanted:
        parent = os.path.abspath(args.path or os.getcwd())
        tmpdir = tempfile.mkdtemp(prefix="tpusync-decode-", dir=parent)
        path = tmpdir if args.tier == "file" else None
    caches = []
    plain = None
    memmap_decoders: list[baselines.MemmapDecode] = []
    try:
        config = common.engine_config(args, worker_cpus)

        def new_cache(record: bool, file_name: str | None = None, **kwargs):
            c = tps.OffloadedKVCache(
                num_layers=shape.layers,
                batch=shape.batch,
                max_len=max_len,
                num_kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                dtype=dtype,
                tier=args.tier,
                path=path,
                file_name=file_name,
                staging_bytes=args.staging_bytes,
                prefetch_depth=depth,
                engine=dataclasses.replace(config, record_timeline=record),
                **{"block_tokens": args.block_tokens, **kwargs},
            )
            caches.append(c)
            return c

        # Named, so that the plain reader can open the same file.
        pf_cache = new_cache(record=bool(args.plot or args.trace), file_name="kv" if path else None)
        spec = pf_cache.spec
        # sync and transfer read the same bytes through one more engine of their own. On the
        # file tier that is a file of their own: a tier file has one writer at a time, and
        # sync writes back. Two files of the same bytes, written alike, were read at speeds
        # up to 1.6x apart on one VM (which of the two was faster changed between runs), so
        # compare the transfer row with prefetch over several runs.
        aux = None
        if {"sync", "transfer"} & set(variants_wanted):
            aux = new_cache(record=False, file_name="kv_aux" if path else None)
        # The same cache with one KV block per sequence: the contiguous layout the paged one
        # is measured against (its own file, like aux).
        contig = None
        if "contiguous" in variants_wanted:
            contig = new_cache(
                record=False,
                file_name="kv_contig" if path else None,
                block_tokens=1 << (max_len - 1).bit_length(),
            )
        # The same KV kept resident in the cache's staging, if it fits the budget.
        resident_cache, resident_mode_note = None, None
        if "resident_mode" in variants_wanted:
            try:
                resident_cache = new_cache(
                    record=False, file_name="kv_resident" if path else None, resident=True
                )
            except ValueError as e:
                resident_mode_note = f"skipped: {e}"
        # The same KV, each unit copied into staging first (host tier only).
        copy_cache, copy_note = None, None
        if "copy" in variants_wanted:
            if args.tier != "host":
                copy_note = "skipped: only a host tier is read in place"
            else:
                copy_cache = new_cache(record=False, read_in_place=False)
        # The same KV on a two-level cache (host tier only): every block in DRAM, a file
        # tier behind it, so each unit is fetched from both tiers with nothing on the file.
        two_level, two_level_note = None, None
        if "two_level" in variants_wanted:
            if args.tier != "host":
                two_level_note = "skipped: a two-level cache has a host tier in front"
            else:
                two_level = new_cache(record=False, spill_path=tmpdir, spill_blocks=1)
        # The same cache with quantized rows (same staging budget: more tokens per unit).
        quant = None
        if args.tier_dtype and "quantized" in variants_wanted:
            quant = new_cache(
                record=False,
                file_name="kv_quant" if path else None,
                tier_dtype=args.tier_dtype,
            )
        print(
            f"decode: {args.tier} tier, context {args.context}, {shape.layers} layers x "
            f"{shape.kv_heads} kv heads x {shape.head_dim} ({args.dtype}), batch {shape.batch}, "
            f"q heads {shape.q_heads}, ffn {shape.ffn}; chunk_len {spec.chunk_len}, "
            f"{-(-args.context // spec.chunk_len)} units/layer, "
            f"{shape.kv_bytes_per_step / common.MiB:.1f} MiB of KV read per step",
            flush=True,
        )

        # The measured state first: it takes the staging buffer the file tier was aligned to.
        pf_state = pf_cache.init([args.context] * shape.batch)
        contig_state = contig.init([args.context] * shape.batch) if contig else None
        quant_state = quant.init([args.context] * shape.batch) if quant else None
        rm_state = resident_cache.init([args.context] * shape.batch) if resident_cache else None
        two_level_state = two_level.init([args.context] * shape.batch) if two_level else None
        copy_state = copy_cache.init([args.context] * shape.batch) if copy_cache else None
        # Fill: the same random KV into every tier and the resident arrays.
        t0 = time.perf_counter()
        resident_kv = _fill(
            shape,
            max_len,
            [pf_cache]
            + [
                c
                for c in (aux, contig, quant, resident_cache, two_level, copy_cache)
                if c is not None
            ],
            args.seed,
            keep=bool(
                {"resident", "compute", "platform", "jax_offload"} & set(variants_wanted)
                or args.baselines
            ),
        )
        pf_state = pf_cache.drain(pf_state)  # The live state again (_fill made others).
        if contig is not None:
            contig_state = contig.drain(contig_state)
        if quant is not None:
            quant_state = quant.drain(quant_state)
        if resident_cache is not None:
            rm_state = resident_cache.drain(rm_state)  # Its copy, refreshed from the tier.
        if two_level is not None:
            two_level_state = two_level.drain(two_level_state)
        if copy_cache is not None:
            copy_state = copy_cache.drain(copy_state)
        print(
            f"filled {args.context} tokens x {shape.layers} layers in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        params = _init_params(shape, args.seed)
        x0 = jnp.asarray(
            np.random.default_rng(args.seed + 7).standard_normal(
                (shape.batch, 1, shape.d_model), dtype=np.float32
            ),
            dtype,
        )
        scale = 1.0 / math.sqrt(shape.head_dim)
        # A numpy constant: closures must not capture a device array a step donates.
        context_lengths = np.full((shape.batch,), args.context, np.int32)
        variants: dict[str, _Variant] = {}

        # resident ------------------------------------------------------------------------------
        def resident_attend(layer, q, k, v, cache):
            ks, vs, lengths = cache
            out, ks[layer], vs[layer] = tps.resident_attention(
                q, k, v, ks[layer], vs[layer], lengths, unit_len=spec.chunk_len, kv_dtype=dtype
            )
            return out, (ks, vs, lengths)

        def resident_step(params, x, cache):
            ks, vs, lengths = cache
            y, (ks, vs, _) = _model(
                params, shape, x, (list(ks), list(vs), lengths), resident_attend
            )
            return y, (ks, vs, lengths + 1)

        if "resident" in variants_wanted:
            ks = [jnp.asarray(_as_words(k)) for k, _ in resident_kv]
            vs = [jnp.asarray(_as_words(v)) for _, v in resident_kv]
            variants["resident"] = _Variant(
                "resident",
                jax.jit(resident_step, donate_argnums=(2,)),
                (ks, vs, jnp.asarray(context_lengths)),
                (params, x0),
            )
            del ks, vs

        # prefetch ------------------------------------------------------------------------------
        mark = _marker(pf_cache.engine.id)

        def prefetch_attend(layer, q, k, v, state):
            return tps.prefetching_attention(q, k, v, state, layer=layer)

        def prefetch_step(params, x, state):
            return _model(params, shape, x, state, prefetch_attend, mark)

        variants["prefetch"] = _Variant(
            "prefetch",
            jax.jit(prefetch_step, donate_argnums=(2,)),
            pf_state,
            (params, x0),
        )

        # The same step over the other caches: one block per sequence, resident, quantized.
        def other_cache_step(params, x, state):
            return _model(params, shape, x, state, prefetch_attend)

        for name, other, other_state in (
            ("contiguous", contig, contig_state),
            ("copy", copy_cache, copy_state),
            ("resident_mode", resident_cache, rm_state),
            ("two_level", two_level, two_level_state),
            ("quantized", quant, quant_state),
        ):
            if other is not None:
                variants[name] = _Variant(
                    name,
                    jax.jit(other_cache_step, donate_argnums=(2,)),
                    other_state,
                    (params, x0),
                )

        # Per-unit attention over a fixed context, shared by compute and sync ------------------
        unit_lo, unit_count = _units(args.context, spec.chunk_len)
        num_units = len(unit_lo)

        def unit_attention(q, k, v, get_unit, buf):
            """Attention over every unit + new token.

            ``get_unit(u, buf, deps) -> (buf, slot)``: unit ``u`` sits in staging slot ``slot``.
            """
            lo_all, count_all = jnp.asarray(unit_lo), jnp.asarray(unit_count)

            def unit(u, carry):
                out, lse, buf = carry
                buf, slot = get_unit(u, buf, (q, out))
                lo = jnp.full((shape.batch,), lo_all[u], jnp.int32)
                cnt = jnp.full((shape.batch,), count_all[u], jnp.int32)
                o, l = attend_valid_rows(
                    lambda start, n, valid: kref.chunk_attention_reference(
                        q,
                        *staged_rows(buf, slot, start, n, dtype),
                        lo + start,
                        valid,
                        context_lengths,
                        scale=scale,
                    ),
                    cnt,
                    spec.chunk_len,
                    staged_block_len(spec),
                    q.shape,
                )
                out, lse = kref.merge_partials(out, lse, o, l)
                return out, lse, buf

            carry = (
                jnp.zeros(q.shape, jnp.float32),
                jnp.full(q.shape[:3], -jnp.inf, jnp.float32),
                buf,
            )
            if num_units == 1:
                out, lse, buf = unit(0, carry)
            else:
                out, lse, buf = jax.lax.fori_loop(0, num_units, unit, carry)
            o, l = kref.chunk_attention_reference(
                q,
                k.astype(dtype),
                v.astype(dtype),
                context_lengths,
                jnp.ones((shape.batch,), jnp.int32),
                context_lengths,
                scale=scale,
            )
            out, _ = kref.merge_partials(out, lse, o, l)
            return out.astype(q.dtype), buf

        # compute, plain and platform -----------------------------------------------------------
        if {"plain", "platform"} & set(variants_wanted):
            plain = common.PlainFetch(
                path and common.file_tier_path(path, "kv"),
                shape.kv_bytes_per_step,
                args.chunk_bytes,
            )
            variants["plain"] = _Variant(
                "plain", lambda st: (common.beside(plain, lambda: None, cpus=worker_cpus), st), None
            )
        if {"compute", "platform"} & set(variants_wanted):
            chunk = spec.chunk_len

            def compute_attend(layer, q, k, v, staging):
                def get_unit(u, staging, deps):
                    return staging, u % slots

                return unit_attention(q, k, v, get_unit, staging)

            def compute_step(params, x, staging):
                return _model(params, shape, x, staging, compute_attend)

            # The staging slots hold the first units of layer 0 (no transfer ever refills them).
            k0, v0 = resident_kv[0]
            k0, v0 = k0.view(spec.staging_dtype), v0.view(spec.staging_dtype)
            staged = np.zeros(spec.unit_staging_shape, spec.staging_dtype)
            for s_ in range(slots):
                n = max(0, min(chunk, k0.shape[1] - s_ * chunk))
                staged[s_, 0, :, :n] = k0[:, s_ * chunk : s_ * chunk + n]
                staged[s_, 1, :, :n] = v0[:, s_ * chunk : s_ * chunk + n]
            compute_jit = jax.jit(compute_step, donate_argnums=(2,))
            if "compute" in variants_wanted:
                variants["compute"] = _Variant(
                    "compute", compute_jit, jnp.asarray(staged), (params, x0)
                )
            if "platform" in variants_wanted:

                def platform_step(params, x, staging):
                    def compute():
                        return jax.block_until_ready(compute_jit(params, x, staging))

                    return common.beside(plain, compute, cpus=worker_cpus)

                variants["platform"] = _Variant(
                    "platform", platform_step, jnp.asarray(staged), (params, x0)
                )
            del staged

        # sync and transfer ---------------------------------------------------------------------
        if aux is not None:
            aspec = aux.spec
            table = _unit_table(aux, args.context, slots)
            eid, tier, regions = aux.engine.id, aux.tier, _absolute_regions(aux)
            tag = lambda l, c: jnp.stack([jnp.asarray(l, jnp.int32), jnp.asarray(c, jnp.int32)])

            def sync_attend(layer, q, k, v, staging):
                segs = jnp.asarray(table[layer, :, 0])  # [U, 2B, 4], slot 0

                def get_unit(u, staging, deps):
                    staging = ops.wait_fetch(
                        eid,
                        tier,
                        staging,
                        ops.NO_TICKET,
                        segs[u],
                        tag(layer, u),
                        deps=deps,
                        regions=regions,
                    )
                    return staging, 0

                return unit_attention(q, k, v, get_unit, staging)

            def sync_step(params, x, staging):
                return _model(params, shape, x, staging, sync_attend)

            # The units a decode step reads: the context plus the tokens decoded since, which
            # fill a last, small unit per layer (its fetch costs a disk round trip).
            step_table = _unit_table(aux, args.context + 1, slots)
            flat = step_table.reshape(-1, slots, 2 * shape.batch, 4)  # [L*U, slots, 2B, 4]
            flat = np.stack([flat[i, i % slots] for i in range(flat.shape[0])])  # alternate slots
            n_fetch = flat.shape[0]

            def transfer_step(x, staging):
                # Unit i lands in slot i % slots, `depth` units ahead of the one waited for,
                # as in the prefetching step.
                segs = jnp.asarray(flat)
                ahead = min(depth, n_fetch)
                tickets = jnp.full((slots,), ops.NO_TICKET, jnp.int32)

                def start(i, x):
                    return ops.start_fetch(
                        eid,
                        tier,
                        x,
                        segs[i],
                        tag(-1, i),
                        dst_bytes=ops.buffer_bytes(staging),
                        regions=regions,
                    )

                for i in range(ahead):
                    x, t = start(i, x)
                    tickets = tickets.at[i % slots].set(t)

                def wait(i, staging, tickets):
                    return ops.wait_fetch(
                        eid, tier, staging, tickets[i % slots], segs[i], tag(-1, i), regions=regions
                    )

                def body(i, carry):
                    x, staging, tickets = carry
                    j = i + depth  # Into the slot of unit i - 1, waited for last.
                    x, t = start(j, x)
                    staging = wait(i, staging, tickets)
                    return x, staging, tickets.at[j % slots].set(t)

                if n_fetch > ahead:
                    x, staging, tickets = jax.lax.fori_loop(
                        0, n_fetch - ahead, body, (x, staging, tickets)
                    )
                for i in range(n_fetch - ahead, n_fetch):
                    staging = wait(i, staging, tickets)
                return x, staging

            if "sync" in variants_wanted:
                variants["sync"] = _Variant(
                    "sync",
                    jax.jit(sync_step, donate_argnums=(2,)),
                    jnp.zeros(aspec.unit_staging_shape, aspec.staging_dtype),
                    (params, x0),
                )
            if "transfer" in variants_wanted:
                variants["transfer"] = _Variant(
                    "transfer",
                    jax.jit(transfer_step, donate_argnums=(1,)),
                    jnp.zeros(aspec.unit_staging_shape, aspec.staging_dtype),
                    (x0,),
                )

        # jax_offload ---------------------------------------------------------------------------
        jax_label = None
        if "jax_offload" in variants_wanted:
            dev = jax.devices()[0]
            kinds = [m.kind for m in dev.addressable_memories()]
            host_kind = "pinned_host" if "pinned_host" in kinds else None
            if host_kind is None:
                jax_label = "unsupported"
                print(
                    f"jax_offload: device {dev} has no pinned_host memory (kinds {kinds}); skipped"
                )
            else:
                dev_sharding = SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
                host_sharding = SingleDeviceSharding(dev, memory_kind=host_kind)

                def offload_attend(layer, q, k, v, cache):
                    ks, vs = cache
                    kd = jax.device_put(ks[layer], dev_sharding)
                    vd = jax.device_put(vs[layer], dev_sharding)
                    out, _, _ = tps.resident_attention(
                        q, k, v, kd, vd, context_lengths, unit_len=spec.chunk_len, kv_dtype=dtype
                    )
                    return out, cache

                def offload_step(params, x, cache):
                    y, _ = _model(params, shape, x, cache, offload_attend)
                    return y

                ks = [jax.device_put(_as_words(k), host_sharding) for k, _ in resident_kv]
                vs = [jax.device_put(_as_words(v), host_sharding) for _, v in resident_kv]
                jitted = jax.jit(offload_step)
                hlo = jitted.lower(params, x0, (ks, vs)).compile().as_text()
                copies = sum(
                    ("copy-start" in line or "dynamic-update-slice" in line and "S(5)" in line)
                    for line in hlo.splitlines()
                )
                if dev.platform == "cpu":
                    jax_label = "host-copy-on-cpu"
                else:
                    jax_label = f"{host_kind}->{dev.default_memory().kind}"
                jax_label_detail = (
                    f"memory kinds {kinds}; compiled step has {copies} async host->device copies"
                )
                print(f"jax_offload: {jax_label} ({jax_label_detail})")
                variants["jax_offload"] = _Variant(
                    "jax_offload", lambda p, x, c: (jitted(p, x, c), c), (ks, vs), (params, x0)
                )
                del ks, vs

        # plain_jax, tuned_jax: the same model in plain JAX over a memmap of the same KV --------
        page_cache = args.baseline_page_cache or ("drop" if args.tier == "file" else "keep")
        drop_page_cache = page_cache == "drop"
        for name in args.baselines:
            dec = baselines.MemmapDecode(
                name,
                os.path.join(tmpdir, f"{name}.kv"),
                resident_kv,
                context_lengths,
                params,
                x0,
                shape,
                _model,
                block_len=staged_block_len(spec),  # The rows per slice resident reads.
                background=name == "tuned_jax",
                loader_cpus=worker_cpus,
                drop_page_cache=drop_page_cache,
            )
            memmap_decoders.append(dec)
            variants[name] = _Variant(name, lambda st, d=dec: (d.step(), st), None, (), dec.prepare)
        del resident_kv

        # compile + correctness at lengths == context -----------------------------------------
        first_out = {}
        for name, var in variants.items():
            t0 = time.perf_counter()
            var.once()
            first_out[name] = np.asarray(var.out, np.float32)
            print(
                f"  compiled + first step of {name}: {time.perf_counter() - t0:.1f} s", flush=True
            )

        order = [v for v in VARIANTS + baselines.VARIANTS if v in variants]
        samples = {name: common.Samples() for name in order}
        costs: dict[str, dict[str, list[float]]] = {n: {c: [] for c in _COSTS} for n in order}
        pf_engine = pf_cache.engine
        aux_fetch = {"bytes": 0, "busy": 0.0}
        timeline = None
        for r in range(args.warmup + rounds):
            k = r % len(order)
            last = r == args.warmup + rounds - 1
            if r == args.warmup:
                pf_engine.reset_stats()
            for name in order[k:] + order[:k]:
                var = variants[name]
                if last and name == "prefetch" and (args.plot or args.trace):
                    pf_engine.timeline()  # Drop what came before this block.
                before = _fetch_counters(aux.engine) if (aux and name == "transfer") else None
                for i in range(args.block):
                    dt, cost = var.once()
                    if r >= args.warmup and i > 0:
                        samples[name].add(dt)
                        for c, v in cost.items():
                            costs[name][c].append(v)
                if before is not None and r >= args.warmup:
                    after = _fetch_counters(aux.engine)
                    aux_fetch["bytes"] += after[0] - before[0]
                    aux_fetch["busy"] += after[1] - before[1]
                if last and name == "prefetch" and (args.plot or args.trace):
                    timeline = pf_engine.timeline()
            print(
                f"  round {r + 1}/{args.warmup + rounds}"
                f"{' (warm-up)' if r < args.warmup else ''}: "
                + ", ".join(
                    f"{n} {statistics.median(samples[n].seconds) * 1e3:.1f} ms"
                    for n in order
                    if samples[n].seconds
                ),
                flush=True,
            )
        pf_stats = pf_engine.stats()

        # Results ------------------------------------------------------------------------------
        med = {n: samples[n].median * 1e3 for n in order}
        pf_tier = pf_engine.tier_info(pf_cache.tier)
        aux_tier = aux.engine.tier_info(aux.tier) if aux else None
        res: dict[str, Any] = dict(
            tier=args.tier,
            context=args.context,
            layers=shape.layers,
            batch=shape.batch,
            q_heads=shape.q_heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            ffn=shape.ffn,
            dtype=args.dtype,
            chunk_len=spec.chunk_len,
            units_per_layer=-(-args.context // spec.chunk_len),
            staging_bytes=args.staging_bytes,
            io_chunk_bytes=args.chunk_bytes,
            io_depth=args.io_depth,
            engine_cpus=args.engine_cpus_kept,
            worker_cpus=list(worker_cpus),
            prefetch_depth=depth,
            kv_bytes_per_step=shape.kv_bytes_per_step,
            direct_io=pf_tier.direct_io if args.tier == "file" else None,
            direct_read_fraction=common.direct_read_fraction(pf_tier),
            transfer_direct_read_fraction=(
                common.direct_read_fraction(aux_tier) if aux_tier else None
            ),
            # Whether sync and transfer read the prefetching cache's own file (see aux above:
            # no longer, on the file tier).
            transfer_same_file=bool(
                aux_tier
                and path
                and aux_tier.description == pf_tier.description
                and aux.first_block == pf_cache.first_block
            ),
            # O_DIRECT into 4 KiB pages ran at 2.0-2.5 GB/s here, into huge pages at 2.9.
            staging_huge_page_fraction=huge_page_fraction(variants["prefetch"].state.staging),
            transfer_staging_huge_page_fraction=(
                huge_page_fraction(variants["transfer"].state) if "transfer" in variants else None
            ),
            samples_per_variant=len(samples["prefetch"].seconds),
        )
        for n in VARIANTS + baselines.VARIANTS:
            if n in samples:
                res[f"t_{n}_ms"] = med[n]
                res[f"t_{n}_ms_min"] = samples[n].min * 1e3
                res[f"t_{n}_ms_max"] = samples[n].max * 1e3
                res[f"cpu_user_{n}_ms"] = statistics.median(costs[n]["cpu_user"]) * 1e3
                res[f"cpu_system_{n}_ms"] = statistics.median(costs[n]["cpu_system"]) * 1e3
                res[f"minor_faults_{n}_per_step"] = statistics.median(costs[n]["minor_faults"])
            else:
                res[f"t_{n}_ms"] = res[f"t_{n}_ms_min"] = res[f"t_{n}_ms_max"] = None
        res["jax_offload_label"] = jax_label
        t_res, t_xfer, t_pf = res["t_resident_ms"], res["t_transfer_ms"], res["t_prefetch_ms"]
        res["overlap_efficiency"] = (
            (t_res + t_xfer - t_pf) / min(t_res, t_xfer) if t_res and t_xfer else None
        )
        res["prefetch_over_max"] = t_pf / max(t_res, t_xfer) if t_res and t_xfer else None
        t_cmp = res["t_compute_ms"]
        res["overlap_efficiency_compute"] = (
            (t_cmp + t_xfer - t_pf) / min(t_cmp, t_xfer) if t_cmp and t_xfer else None
        )
        res["prefetch_over_max_compute"] = t_pf / max(t_cmp, t_xfer) if t_cmp and t_xfer else None
        t_plain, t_platform = res["t_plain_ms"], res["t_platform_ms"]
        res["platform_overlap_efficiency"] = (
            (t_cmp + t_plain - t_platform) / min(t_cmp, t_plain)
            if t_cmp and t_plain and t_platform
            else None
        )
        res["prefetch_over_platform"] = t_pf / t_platform if t_platform else None
        res["sync_over_prefetch"] = res["t_sync_ms"] / t_pf if res["t_sync_ms"] else None
        t_contig = res["t_contiguous_ms"]
        res["paged_over_contiguous"] = t_pf / t_contig if t_contig else None
        t_two = res["t_two_level_ms"]
        res["two_level_over_prefetch"] = t_two / t_pf if t_two else None
        res["two_level_note"] = two_level_note
        res["copy_note"] = copy_note
        res["copy_over_prefetch"] = res["t_copy_ms"] / t_pf if res["t_copy_ms"] else None
        res["block_tokens"] = spec.block_tokens
        fetch = pf_engine.stats()["tiers"][pf_cache.tier]["fetch"]
        res["fetch_segments"] = fetch["segments"]
        res["fetch_bytes_per_segment"] = fetch["bytes_per_segment"]
        if contig is not None:
            res["contiguous_block_tokens"] = contig.spec.block_tokens
            cfetch = contig.engine.stats()["tiers"][contig.tier]["fetch"]
            res["contiguous_fetch_bytes_per_segment"] = cfetch["bytes_per_segment"]
        res.update(_quantized_row(res, quant, spec, shape, args, first_out))
        res["baseline_page_cache"] = page_cache if args.baselines else None
        res["memcpy_ms"], res["memcpy_bytes_timed"] = baselines.memcpy_ms(shape.kv_bytes_per_step)
        res.update(baselines.ratios(res))
        res["tokens_per_s"] = shape.batch / (t_pf / 1e3)
        for n in ("resident", "compute", "sync", "jax_offload"):
            res[f"tokens_per_s_{n}"] = shape.batch / (med[n] / 1e3) if n in med else None

        # Errors: every variant's first step ran at lengths == context; resident and prefetch
        # have since run the same number of steps (so their caches hold the same tokens).
        def err(a, b):
            return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))

        if "resident" in variants:
            ref = first_out["resident"]
            res["max_abs_err"] = err(first_out["prefetch"], ref)
            assert variants["resident"].steps == variants["prefetch"].steps
            res["max_abs_err"] = max(
                res["max_abs_err"], err(variants["prefetch"].out, variants["resident"].out)
            )
            for n in ("sync", "jax_offload"):
                res[f"{n}_max_abs_err"] = err(first_out[n], ref) if n in first_out else None
            for n in ("copy", "resident_mode", "two_level"):  # Append a token per step too.
                res[f"max_abs_err_{n}"] = None
                if n in variants:
                    assert variants[n].steps == variants["resident"].steps
                    res[f"max_abs_err_{n}"] = max(
                        err(first_out[n], ref), err(variants[n].out, variants["resident"].out)
                    )
            # The baselines append a token per step too: first and last step against resident.
            for n in baselines.VARIANTS:
                res[f"max_abs_err_{n}"] = None
                if n in variants:
                    assert variants[n].steps == variants["resident"].steps
                    res[f"max_abs_err_{n}"] = max(
                        err(first_out[n], ref), err(variants[n].out, variants["resident"].out)
                    )
        else:
            res["max_abs_err"] = res["max_abs_err_resident_mode"] = None
            res["max_abs_err_two_level"] = res["max_abs_err_copy"] = None
            res.update({f"max_abs_err_{n}": None for n in baselines.VARIANTS})
        res["output_abs_max"] = float(np.max(np.abs(first_out["prefetch"])))
        res["resident_mode_note"] = resident_mode_note
        res["resident_mode_device_bytes"] = (
            resident_cache.spec.device_bytes if resident_cache is not None else None
        )

        res["device_bytes"] = spec.device_bytes
        res["kv_bytes"] = spec.kv_bytes
        res["device_bytes_by_context"] = _device_bytes_by_context(
            args, shape, dtype, spec.reads_in_place
        )
        res["resident_device_bytes"] = 2 * shape.layers * shape.batch * max_len * shape.row_bytes

        steps_timed = rounds * args.block  # Since reset_stats: every step of the timed rounds.
        res["prefetch_hits"] = pf_stats["prefetch_hits"]
        res["prefetch_misses"] = pf_stats["prefetch_misses"]
        res["in_place_reads"] = pf_stats["in_place_reads"]
        res["reads_in_place"] = spec.reads_in_place
        res["prefetch_wait_ms_per_step"] = pf_stats["wait_s"] * 1e3 / steps_timed
        pf_fetch = pf_stats["tiers"][0]["fetch"]
        res["prefetch_fetch_gbps_busy"] = pf_fetch["gbps"]
        res["prefetch_fetch_gbps"] = shape.kv_bytes_per_step / (t_pf / 1e3) / 1e9
        res["transfer_fetch_gbps"] = (
            shape.kv_bytes_per_step / (t_xfer / 1e3) / 1e9 if t_xfer else None
        )
        res["transfer_fetch_gbps_busy"] = (
            aux_fetch["bytes"] / aux_fetch["busy"] / 1e9 if aux_fetch["busy"] else None
        )
        res["targets"] = _targets(res)

        if timeline is not None:
            from jax_tpusync import timeline as tl

            res["timeline_summary"] = tl.summarize(timeline, stall_ns=STALL_NS)
            if args.trace:
                tl.write_chrome_trace(timeline, args.trace)
                print(f"wrote {args.trace}")
            if args.plot:
                title = (
                    f"prefetch decode step: {args.tier} tier, context {args.context}, "
                    f"{shape.layers} layers, chunk_len {spec.chunk_len} "
                    f"({t_pf:.0f} ms/step median; compute {res['t_compute_ms'] or float('nan'):.0f}"
                    f" ms, transfer {t_xfer or float('nan'):.0f} ms, sync "
                    f"{res['t_sync_ms'] or float('nan'):.0f} ms)"
                )
                tl.plot(timeline, args.plot, title=title, stall_ns=STALL_NS, last_steps=2)
                print(f"wrote {args.plot}")
        _print_summary(res)
        return res
    finally:
        for dec in memmap_decoders:
            dec.close()
        for c in caches:
            try:
                c.engine.drain()
            finally:
                c.close()
        if plain is not None:
            plain.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _fill(shape: Shape, max_len: int, caches, seed: int, keep: bool):
    """Writes the same random KV into each cache; returns per-layer [B, max_len, H, D] (k, v)."""
    rng = np.random.default_rng(seed + 1)
    n = shape.context
    dims = (shape.batch, n, shape.kv_heads, shape.head_dim)
    # One random pool, sliced at random offsets: random enough for attention, fast to make.
    pool_n = min(math.prod(dims), 1 << 24)
    pool = rng.standard_normal(2 * pool_n, dtype=np.float32)
    pool = pool.astype(shape.dtype)
    out = []
    for layer in range(shape.layers):
        kv = []
        for _ in range(2):
            x = np.empty(math.prod(dims), shape.dtype)
            for lo in range(0, x.size, pool_n):
                hi = min(x.size, lo + pool_n)
                off = int(rng.integers(0, pool.size - (hi - lo) + 1))
                x[lo:hi] = pool[off : off + hi - lo]
            kv.append(x.reshape(dims))
        for c in caches:
            st = c.load(c.init(), layer, kv[0], kv[1])
            del st
        if keep:
            pad = ((0, 0), (0, max_len - n), (0, 0), (0, 0))
            out.append((np.pad(kv[0], pad), np.pad(kv[1], pad)))
    return out


def _as_words(kv: np.ndarray) -> np.ndarray:
    """16-bit float KV as the uint16 words ``resident_attention`` keeps in place on CPU."""
    return kv.view(np.uint16) if kv.dtype.itemsize == 2 else kv


def _fetch_counters(engine) -> tuple[int, float]:
    s = engine.stats()
    return (
        sum(t["fetch"]["bytes"] for t in s["tiers"]),
        sum(t["fetch"]["busy_s"] for t in s["tiers"]),
    )


def _device_bytes_by_context(args, shape: Shape, dtype, reads_in_place: bool) -> dict[str, int]:
    """device_bytes of the same cache configuration at 32K and 1M context (on a sparse file
    tier, as the configuration of a cache that ``reads_in_place`` or not)."""
    import jax_tpusync as tps

    out = {}
    d = tempfile.mkdtemp(
        prefix="tpusync-devbytes-",
        dir=os.path.abspath(args.path or os.getcwd()) if args.tier == "file" else None,
    )
    try:
        for n in CONTEXT_CHECK + (args.context,):
            with tps.OffloadedKVCache(
                num_layers=shape.layers,
                batch=shape.batch,
                max_len=n,
                num_kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                dtype=dtype,
                tier="file",
                path=d,
                staging_bytes=args.staging_bytes,
            ) as c:
                spec = dataclasses.replace(c.spec, reads_in_place=reads_in_place)
                out[str(n)] = spec.device_bytes
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _quantized_row(res, quant, spec, shape: Shape, args, first_out) -> dict[str, Any]:
    """The quantized variant's bytes and ratios beside the prefetch step's."""
    if quant is None:
        return dict(tier_dtype=None, quantized_over_prefetch=None)
    fetched = shape.kv_bytes_per_step * quant.spec.row_bytes // spec.row_bytes
    out = dict(
        tier_dtype=args.tier_dtype,
        quantized_over_prefetch=res["t_quantized_ms"] / res["t_prefetch_ms"],
        quantized_row_bytes=quant.spec.row_bytes,
        quantized_bytes_ratio=quant.spec.row_bytes / spec.row_bytes,
        kv_bytes_per_step=shape.kv_bytes_per_step,
        quantized_kv_bytes_per_step=fetched,
        quantized_chunk_len=quant.spec.chunk_len,
        quantized_device_bytes=quant.spec.device_bytes,
        quantized_kv_bytes=quant.spec.kv_bytes,
    )
    if "resident" in first_out:  # Quantization error of the first step, not a bug check.
        diff = np.asarray(first_out["quantized"], np.float32) - np.asarray(
            first_out["resident"], np.float32
        )
        out["quantized_max_abs_diff"] = float(np.max(np.abs(diff)))
    return out


def _targets(res: dict[str, Any]) -> dict[str, Any]:
    by_ctx = res["device_bytes_by_context"]
    out: dict[str, Any] = {}
    for suffix, floor in (("", "t_resident"), ("_compute", "t_compute")):
        eff = res[f"overlap_efficiency{suffix}"]
        ratio = res[f"prefetch_over_max{suffix}"]
        out[f"overlap_efficiency{suffix} >= 0.9 (file tier)"] = None if eff is None else eff >= 0.9
        out[f"t_prefetch <= 1.1 x max({floor}, t_transfer)"] = (
            None if ratio is None else ratio <= 1.1
        )
    paged = res.get("paged_over_contiguous")
    out["paged step <= 1.05 x contiguous"] = None if paged is None else paged <= 1.05
    quantized = res.get("quantized_over_prefetch")
    out["quantized step <= 0.6 x prefetch (file tier)"] = (
        None if quantized is None else quantized <= 0.6
    )
    out["device_bytes equal at 32K and 1M context"] = (
        len({by_ctx[str(n)] for n in CONTEXT_CHECK}) == 1
    )
    return out


def _print_summary(res: dict[str, Any]) -> None:
    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    print()
    print(f"{'variant':<12} {'median ms':>10} {'min':>9} {'max':>9} {'cpu ms':>13}  note")
    notes = {
        "resident": "resident_attention, all KV in device memory, no engine",
        "compute": "the same per-unit attention on warm staging slots, no transfer",
        "transfer": f"engine fetch of one step's KV, no compute "
        f"({f(res['transfer_fetch_gbps'], '.2f')} GB/s)",
        "sync": "fetch on demand, then compute, per unit",
        "prefetch": f"prefetching_attention ({f(res['tokens_per_s'], '.2f')} tok/s, "
        f"{f(res['prefetch_fetch_gbps'], '.2f')} GB/s of KV; {res['block_tokens']}-token "
        f"blocks, {res['fetch_bytes_per_segment'] / 1024:.0f} KiB per segment)",
        "copy": res.get("copy_note")
        or f"the same with read_in_place=False: each unit copied into staging "
        f"(copy/prefetch {f(res.get('copy_over_prefetch'), '.3f')})",
        "resident_mode": res.get("resident_mode_note")
        or "prefetching_attention on a resident=True cache: write-back only, no fetch",
        "contiguous": f"the same, one KV block per sequence (paged/contiguous "
        f"{f(res['paged_over_contiguous'], '.3f')})",
        "two_level": res.get("two_level_note")
        or f"the same on a two-level cache, all blocks in DRAM: a fetch per tier per unit "
        f"(two-level/prefetch {f(res.get('two_level_over_prefetch'), '.3f')})",
        "quantized": f"the same over {res.get('tier_dtype')} rows + scales "
        f"({f(res.get('quantized_bytes_ratio'), '.3f')} of the bytes; quantized/prefetch "
        f"{f(res['quantized_over_prefetch'], '.3f')})",
        "plain": "plain reader thread on the engine's CPUs, same bytes, no engine",
        "platform": "compute beside that plain reader: this machine's own overlap",
        "jax_offload": f"pinned_host KV + device_put in jit [{res['jax_offload_label']}]",
        **baselines.NOTES,
    }
    for n in VARIANTS + baselines.VARIANTS:
        cpu = "-"
        if res.get(f"cpu_user_{n}_ms") is not None:  # user+system, all threads, per step
            cpu = f"{res[f'cpu_user_{n}_ms']:.0f}+{res[f'cpu_system_{n}_ms']:.0f}"
        print(
            f"{n:<12} {f(res[f't_{n}_ms']):>10} {f(res[f't_{n}_ms_min']):>9} "
            f"{f(res[f't_{n}_ms_max']):>9} {cpu:>13}  {notes[n]}"
        )
    print(
        f"\noverlap_efficiency {f(res['overlap_efficiency'], '.3f')} (vs compute: "
        f"{f(res['overlap_efficiency_compute'], '.3f')})  t_prefetch/max(floor, t_transfer) "
        f"{f(res['prefetch_over_max'], '.3f')} (vs compute: "
        f"{f(res['prefetch_over_max_compute'], '.3f')})  t_sync/t_prefetch "
        f"{f(res['sync_over_prefetch'], '.3f')}  max_abs_err {f(res['max_abs_err'], '.3g')}"
    )
    print(
        f"plain JAX: t_prefetch/min(plain_jax, tuned_jax) {f(res['prefetch_over_best_jax'], '.3f')}"
        f" (with resident mode: {f(res['library_over_best_jax'], '.3f')})"
        f" (memmap pages: {res['baseline_page_cache'] or '-'}), errors "
        f"{f(res['max_abs_err_plain_jax'], '.3g')} / {f(res['max_abs_err_tuned_jax'], '.3g')}; "
        f"memcpy of the step's KV {f(res['memcpy_ms'])} ms, t_prefetch/max(t_resident, memcpy) "
        f"{f(res['host_over_floor'], '.3f')}"
    )
    print(
        f"platform (compute beside a plain reader): efficiency "
        f"{f(res['platform_overlap_efficiency'], '.3f')}, t_prefetch/t_platform "
        f"{f(res['prefetch_over_platform'], '.3f')}"
    )
    print(
        f"prefetch hits {res['prefetch_hits']} misses {res['prefetch_misses']}, units read in "
        f"place {res['in_place_reads']}, stalled "
        f"{res['prefetch_wait_ms_per_step']:.1f} ms/step in waits; device_bytes "
        f"{common.format_bytes(res['device_bytes'])} (by context: "
        f"{res['device_bytes_by_context']}), kv_bytes {common.format_bytes(res['kv_bytes'])}"
    )
    pf_huge, xfer_huge = (
        res["staging_huge_page_fraction"],
        res["transfer_staging_huge_page_fraction"],
    )
    if pf_huge is not None:
        print(
            f"staging in huge pages: prefetch {pf_huge:.0%}"
            + (f", transfer {xfer_huge:.0%}" if xfer_huge is not None else "")
        )
    pf_direct, xfer_direct = res["direct_read_fraction"], res["transfer_direct_read_fraction"]
    if xfer_direct is not None and xfer_direct < pf_direct - 0.01:
        print(
            f"note: transfer/sync fetched {xfer_direct:.0%} by O_DIRECT straight into staging "
            f"(prefetch {pf_direct:.0%}): their staging buffers fell out of phase with the "
            "file, so their rows include bounce copies"
        )
    print("targets:")
    for name, ok in res["targets"].items():
        print(f"  [{'PASS' if ok else '----' if ok is None else 'FAIL'}] {name}")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (the same as ``python -m jax_tpusync.bench decode``)."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_tpusync.bench.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    args = parser.parse_args(argv)
    results = run(args)
    print()
    columns = getattr(args, "columns", COLUMNS)
    print(common.format_table(results if isinstance(results, list) else [results], columns))
    args.subcommand = "decode"
    common.write_json(args.json, "decode", args, results)
    if args.json != "-":
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
