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
  Built from :mod:`jax_tpusync.runtime.ops` with the same attention math; nothing is in flight while
  the step computes.
* ``prefetch``: :func:`jax_tpusync.prefetching_attention`: layer-ahead and cross-step
  prefetch. On the CPU backend a host tier's units are attended to where the pool holds
  them (``read_in_place="auto"``, see :mod:`jax_tpusync.in_place`): nothing is copied.
* ``copy``: ``prefetch`` on a cache made with ``read_in_place=False``: every unit is
  copied into staging inside its wait (a file tier's from the landing memory its fetch
  ahead filled), then attended to, as on an accelerator (skipped with a note where
  ``prefetch`` does not read in place, where the two are the same).
* ``resident_mode``: ``prefetch`` on a cache made with ``resident=True`` (every layer's
  KV in the state's staging, which must fit ``--staging-bytes``; skipped with a note
  otherwise): write-back only, no fetch. What a small experiment gets from the library.
* ``two_level`` (host tier): ``prefetch`` on a two-level cache (``spill_path``, see
  :mod:`jax_tpusync.core.spill`) holding every block in DRAM: each unit is fetched from both
  tiers, the file tier's fetch with nothing to move. ``two_level_over_prefetch`` is the
  cost of that second fetch per unit (skipped with a note on the file tier).
* ``quantized`` (with ``--tier-dtype int8|float8_e4m3fn``): ``prefetch`` over a cache of
  quantized rows (codes + per-token scales, about half of bf16's bytes) holding the same
  KV, with the same staging budget. ``quantized_over_prefetch`` is the ratio of the two
  steps; ``quantized_max_abs_diff`` its first step's distance from ``resident`` (the
  quantization error; ``bench quality`` measures what it does to next tokens).
* ``sparse`` (with ``--sparse BUDGET``): ``prefetch`` over a cache made with
  ``sparse=BUDGET`` holding the same KV: each layer's decode row reads the blocks its query
  selects (its prediction from the previous step fetched ahead, what the exact selection
  adds fetched late). ``sparse_over_prefetch`` and ``sparse_over_resident`` are its step
  against the dense ones; ``sparse_bytes_per_step`` the KV bytes it read per step
  (block summaries, predicted and late blocks) and ``sparse_read_share`` their share of
  the dense step's; ``sparse_hit_rate`` the share of predicted blocks the exact selection
  held. The bench's input is the same every step, so the prediction stays right: a
  model's own tokens move the selection (see ``bench sparse`` for what it reads then).
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
context. ``--plot`` draws, for one context, a bar per step of the summary (the library, the
plain-JAX baselines, the resident floor) with its samples' spread; for several, step time
against context (log-log) of every variant and baseline that ran. ``--plot-timeline`` draws
the prefetch step's timeline (transfers, compute, stalls). ``--trace`` and ``--plot-timeline``
with several contexts write one file per context (``OUT-<context>.json``).

Output: by default, per context, a short table (the library's step, the plain-JAX steps that
ran, the resident floor: median and IQR of the timed samples) and, in words, how much faster
or slower the library is than the faster plain-JAX step, "within noise" where the medians
differ by no more than the wider IQR (see :mod:`jax_tpusync.bench.verdict`). ``--details``
prints the developer's output instead: every variant's row, ratios, counters, the targets
and the full table. Progress (builds, rounds, finished contexts) goes to stderr.

``--xla-cpu-schedule memory`` (the default) runs every variant and baseline under XLA's
memory-minimizing CPU schedule (:func:`jax_tpusync.runtime.xla_cpu.use_memory_scheduler`; an
``XLA_FLAGS`` that already names the flag wins); ``concurrency`` keeps XLA's default, under
which a one-program step of many 16-bit layers pays for every layer's weight conversion up
front (see :mod:`jax_tpusync.runtime.xla_cpu`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import (
    baselines,
    common,
    decode_report,
    decode_variants,
    mesh_decode,
    tiny_decoder,
)
from jax_tpusync.bench.tiny_decoder import DTYPES
from jax_tpusync.runtime import xla_cpu

# --variants names, in rotation order (each a registered builder in decode_variants).
VARIANTS = decode_variants.VARIANTS

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
    ("t_sparse_ms", "sparse ms", ".1f"),
    ("sparse_over_prefetch", "sparse/pf", ".3f"),
    ("sparse_read_share", "sparse bytes/dense", ".3f"),
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
    p.add_argument(
        "--sparse",
        type=_budget,
        default=None,
        metavar="BUDGET",
        help="adds the sparse variant: the prefetch step over a cache made with "
        "sparse=BUDGET (a share of the context in (0, 1], e.g. 0.05, or a number of blocks), "
        "with its KV bytes read per step (summaries, predicted and late blocks) against dense",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="one --context: bars of the library's step vs the plain-JAX steps and the "
        "resident floor, with the samples' spread; several: step time vs context, log-log, "
        "every variant and baseline",
    )
    p.add_argument(
        "--plot-timeline",
        default=None,
        metavar="OUT.png",
        help="plot the prefetch step's timeline (transfers, compute, stalls)",
    )
    p.add_argument(
        "--details",
        action="store_true",
        help="print every variant's row, the ratios, counters and targets, and the full "
        "table, instead of the short summary",
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
        help="XLA CPU instruction schedule for every variant (default memory; see jax_tpusync.runtime.xla_cpu)",
    )
    baselines.add_arguments(p)
    common.add_json_argument(p)


def _budget(text: str) -> float | int:
    """``--sparse``: a float share, or an int number of blocks."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def _depth(text: str) -> int | str:
    """``--prefetch-depth``: an int, or ``auto``."""
    return text if text == "auto" else int(text)


def run(args: argparse.Namespace) -> dict[str, Any] | list[dict[str, Any]]:
    """Runs the benchmark at each ``--context``; one row (a dict), or a list of them."""
    contexts = list(args.context) if isinstance(args.context, (list, tuple)) else [args.context]
    if args.plot or args.plot_timeline:
        baselines.require_matplotlib()
    if args.xla_cpu_schedule == "memory":
        try:
            args.xla_cpu_schedule_result = xla_cpu.use_memory_scheduler()  # Before JAX starts.
        except RuntimeError:  # Called in a process that already computed (tests): as it is.
            args.xla_cpu_schedule_result = "backends already started"
        if args.xla_cpu_schedule_result not in ("set", "kept"):
            print(
                f"note: --xla-cpu-schedule memory not applied ({args.xla_cpu_schedule_result})",
                file=sys.stderr,
            )
    if args.devices is not None:
        if args.devices < 1 or len(contexts) != 1:
            raise SystemExit("--devices N needs N >= 1 and one --context")
        mesh_decode.ask_for_devices(args.devices)  # Before JAX starts its backend.
        args.context = contexts[0]
        args.columns = mesh_decode.COLUMNS  # Its rows are per device count.
        return mesh_decode.run(args, common.apply_cpu_arguments(args))
    worker_cpus = common.apply_cpu_arguments(args)  # Once, before JAX starts its backend.
    if not args.details:
        args.columns = None  # The short summary below instead of the developer's table.
    if len(contexts) == 1:
        args.context = contexts[0]  # The JSON's args keep their one-context form.
        res = _run_context(args, worker_cpus)
        if args.plot:
            decode_report.plot_comparison(res, args.plot)
            print(f"wrote {args.plot}")
        _print_user_summary([res], args)
        return res
    rows = []
    for i, context in enumerate(contexts):
        per_context = {
            flag: _per_context_path(getattr(args, flag), context)
            for flag in ("trace", "plot_timeline")
        }
        # --plot is the sweep's plot here, drawn once all contexts ran.
        one = argparse.Namespace(**{**vars(args), "context": context, "plot": None, **per_context})
        rows.append(_run_context(one, worker_cpus))
        print(f"context {context}: done ({i + 1}/{len(contexts)})", file=sys.stderr, flush=True)
    if args.plot:
        baselines.plot_sweep(rows, args.plot, decode_report.ALL)
        print(f"wrote {args.plot}")
    _print_user_summary(rows, args)
    return rows


def _per_context_path(path: str | None, context: int) -> str | None:
    """``OUT.ext`` -> ``OUT-<context>.ext`` (None stays None)."""
    if path is None:
        return None
    stem, ext = os.path.splitext(path)
    return f"{stem}-{context}{ext or '.json'}"


def _print_user_summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The default output: one short comparison per context (nothing with ``--details``)."""
    if args.details:
        return
    for res in rows:
        print()
        print(decode_report.user_summary(res))


def _run_context(args: argparse.Namespace, worker_cpus: tuple[int, ...]) -> dict[str, Any]:
    """Builds the variants at one context, times them side by side, returns one row."""
    from jax_tpusync.caches.offloaded.cache import auto_prefetch_depth

    if args.steps < 5:
        raise SystemExit("--steps must be >= 5")
    if args.block < 2:
        raise SystemExit("--block must be >= 2 (its first step is not timed)")
    if args.q_heads % args.kv_heads:
        raise SystemExit("--q-heads must be a multiple of --kv-heads")
    shape = tiny_decoder.Shape(
        args.layers,
        args.batch,
        args.q_heads,
        args.kv_heads,
        args.head_dim,
        args.ffn,
        args.context,
        tiny_decoder.jnp_dtype(args.dtype),
    )
    wanted = decode_variants.resolve(args.variants)
    rounds = -(-args.steps // (args.block - 1))
    total_steps = 1 + (args.warmup + rounds) * args.block
    depth = args.prefetch_depth
    if depth == "auto":
        depth = auto_prefetch_depth(args.tier)

    tmpdir = path = None
    # The baselines' memmaps live there too, and a two-level cache's file tier.
    if args.tier == "file" or args.baselines or "two_level" in wanted:
        parent = os.path.abspath(args.path or os.getcwd())
        tmpdir = tempfile.mkdtemp(prefix="tpusync-decode-", dir=parent)
        path = tmpdir if args.tier == "file" else None
    max_len = args.context + total_steps + 1
    bench = decode_variants.Bench(args, shape, depth, max_len, path, tmpdir, worker_cpus)
    try:
        bench.open(wanted)
        steps = decode_variants.build(bench, wanted)

        # compile + correctness at lengths == context -----------------------------------------
        first_out = {}
        for name, step in steps.items():
            t0 = time.perf_counter()
            step.once()
            first_out[name] = np.asarray(step.out, np.float32)
            print(
                f"  compiled + first step of {name}: {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )

        order = [v for v in decode_report.ALL if v in steps]
        samples = {name: common.Samples() for name in order}
        costs = {n: {c: [] for c in decode_variants.COSTS} for n in order}
        pf_engine = bench.pf_cache.engine
        aux = bench.cache_of("transfer")[0]
        aux_fetch = {"bytes": 0, "busy": 0.0}
        timeline = None
        record = bool(args.plot_timeline or args.trace)
        for r in range(args.warmup + rounds):
            k = r % len(order)
            last = r == args.warmup + rounds - 1
            if r == args.warmup:
                pf_engine.reset_stats()
            for name in order[k:] + order[:k]:
                step = steps[name]
                if last and name == "prefetch" and record:
                    pf_engine.timeline()  # Drop what came before this block.
                before = None
                if aux is not None and name == "transfer":
                    before = decode_report.fetch_counters(aux.engine)
                for i in range(args.block):
                    dt, cost = step.once()
                    if r >= args.warmup and i > 0:
                        samples[name].add(dt)
                        for c, v in cost.items():
                            costs[name][c].append(v)
                if before is not None and r >= args.warmup:
                    after = decode_report.fetch_counters(aux.engine)
                    aux_fetch["bytes"] += after[0] - before[0]
                    aux_fetch["busy"] += after[1] - before[1]
                if last and name == "prefetch" and record:
                    timeline = pf_engine.timeline()
            print(
                f"  round {r + 1}/{args.warmup + rounds}"
                f"{' (warm-up)' if r < args.warmup else ''}: "
                + ", ".join(
                    f"{n} {statistics.median(samples[n].seconds) * 1e3:.1f} ms"
                    for n in order
                    if samples[n].seconds
                ),
                file=sys.stderr,
                flush=True,
            )
        pf_stats = pf_engine.stats()
        res = decode_report.row(
            bench, steps, samples, costs, first_out, pf_stats, aux_fetch, rounds
        )
        if timeline is not None:
            decode_report.timeline_outputs(res, bench, timeline)
        if args.details:
            decode_report.print_summary(res)
        return res
    finally:
        bench.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


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
    columns = getattr(args, "columns", COLUMNS)
    if columns:
        print()
        print(common.format_table(results if isinstance(results, list) else [results], columns))
    args.subcommand = "decode"
    common.report_json(args, "decode", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
