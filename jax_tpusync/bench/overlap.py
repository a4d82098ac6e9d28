"""``overlap``: how much of an in-graph fetch hides behind compute.

Four jitted functions share one engine, one tier of ``--bytes`` random bytes and one
destination buffer that is donated into every call and threaded through all of them:

* ``compute``: ``y = compute(x)``, a chain of ``--iters`` matmuls of ``--matmul`` squared
  float32 matrices (``x <- tanh(x @ w)``);
* ``transfer``: ``start_fetch`` then ``wait_fetch``, nothing in between;
* ``sync``: ``wait_fetch`` with ``NO_TICKET`` (the wait fetches by itself), then ``compute``
  on an activation routed through ``mark(deps=(dst,))``, so compute really starts after
  the fetch has landed;
* ``overlap``: ``x, dst, t = start_fetch(...)``; ``y = compute(x)``;
  ``dst = wait_fetch(..., t, deps=(y,))``.

Beside them, the platform's own answer, with no engine and no XLA custom call:

* ``plain``: the same bytes read the plainest way (one synchronous O_DIRECT ``preadv`` of
  ``--segment-bytes`` after another into a page-aligned buffer; ``memcpy`` on the host tier),
  on a thread pinned to the engine's CPUs;
* ``plain_overlap``: ``compute`` while that thread does ``plain``; wall time until both
  are done.

``platform_overlap_efficiency`` is the efficiency of that pair: what a plain reader thread
gets beside the same compute, a reference for how much the machine itself loses when disk
reads and compute run together (on a virtual machine the disk's DMA and the host's I/O
threads share memory bandwidth and cores with the guest). ``efficiency_over_platform``
divides the engine's efficiency by it. ``overlap_vs_sync`` says in words how the overlapped
step compares with fetch-then-compute ("1.4x faster than ..."), "within noise" where the
medians differ by no more than the wider IQR (see :mod:`jax_tpusync.bench.verdict`).

Unless given, the matmul chain is calibrated so that ``t_compute`` is close to
``t_transfer``. All four then run in rotating order for ``--repeats`` rounds after warm-up:

  overlap_efficiency = (t_compute + t_transfer - t_overlap) / min(t_compute, t_transfer)

1.0 means the shorter of the two is entirely hidden; 0 means no overlap at all. The
documented target is >= 0.9 on the file tier. Fetched bytes are checked against the written
ones for every function once at the end.

A file-tier fetch lands in engine memory while the compute runs and is copied into the
wait's operand inside the wait: XLA may reuse an operand's memory for other values until the
op that takes it runs, so no byte may be written there before. That copy (``t_wait_copy_ms``,
from the engine's stats) cannot overlap anything, so it caps the efficiency at
``overlap_ceiling`` (:func:`overlap_ceiling`); ``efficiency_over_ceiling`` is how much of that
cap the engine reaches. A decode step does not pay it: attention reads the units where they
landed (``bench decode``).

XLA's matmul takes every core it is given, and a transfer that waits for a core stalls the
disk queue; by default (``--engine-cpus 1``) the command keeps one CPU for the engine's
workers and XLA's compute off it (:func:`jax_tpusync.split_cpus`). ``--engine-cpus 0``
measures compute and engine sharing every CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
import zlib
from typing import Any

import numpy as np

from jax_tpusync.bench import common, verdict
from jax_tpusync.runtime.engine import Engine, page_offset

TIER_BLOCK_BYTES = 64 * common.KiB
# Calibration aims t_compute / t_transfer into this band (the brief allows 0.7-1.5).
_CALIBRATION_BAND = (0.85, 1.15)
_CALIBRATION_STEPS = 4

COLUMNS = [
    ("tier", "tier", "s"),
    ("bytes", "bytes", "bytes"),
    ("matmul", "matmul", "d"),
    ("iters", "iters", "d"),
    ("t_compute_ms", "compute ms", ".2f"),
    ("t_transfer_ms", "transfer ms", ".2f"),
    ("t_engine_ms", "engine ms", ".2f"),
    ("t_sync_ms", "sync ms", ".2f"),
    ("t_overlap_ms", "overlap ms", ".2f"),
    ("overlap_efficiency", "efficiency", ".3f"),
    ("overlap_efficiency_paired_median", "paired", ".3f"),
    ("t_plain_ms", "plain ms", ".2f"),
    ("platform_overlap_efficiency", "platform eff", ".3f"),
    ("efficiency_over_platform", "eff/platform", ".3f"),
    ("t_wait_copy_ms", "copy ms", ".2f"),
    ("overlap_ceiling", "ceiling", ".3f"),
    ("efficiency_over_ceiling", "eff/ceiling", ".3f"),
    ("direct_read_fraction", "direct", ".2f"),
    ("engine_cpus", "engine cpus", ""),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``overlap`` subcommand."""
    p = subparsers.add_parser(
        "overlap",
        help="overlap of an in-graph fetch with compute",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tier", choices=("host", "file"), default="file")
    p.add_argument(
        "--path", default=None, help="directory of the file tier (default: the current directory)"
    )
    p.add_argument(
        "--bytes",
        type=common.parse_bytes,
        default=64 * common.MiB,
        help="bytes fetched per call (default 64M)",
    )
    p.add_argument(
        "--segment-bytes",
        type=common.parse_bytes,
        default=4 * common.MiB,
        help="bytes per segment row of the fetch (default 4M)",
    )
    p.add_argument("--matmul", type=int, default=512, help="matrix side (default 512)")
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="matmuls per compute call (default: calibrated to t_transfer)",
    )
    p.add_argument("--repeats", type=int, default=15, help="recorded rounds (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded rounds first (default 2)")
    common.add_engine_arguments(p)
    p.add_argument(
        "--alignment-offset",
        type=int,
        default=None,
        help="file tier alignment_offset (default: where XLA puts a buffer of --bytes; "
        "another value makes every fetch go through bounce buffers)",
    )
    common.add_cpu_arguments(p)
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def overlap_ceiling(t_compute: float, t_transfer: float, t_copy: float) -> float:
    """The best ``overlap_efficiency`` a fetch can reach when ``t_copy`` of its
    ``t_transfer`` must run after the compute (the wait's copy into its operand).

    The overlapped call takes at least ``max(t_compute, t_transfer - t_copy) + t_copy``.
    """
    best = max(t_compute, t_transfer - t_copy) + t_copy
    return (t_compute + t_transfer - best) / min(t_compute, t_transfer)


def _open_tier(
    engine: Engine, args: argparse.Namespace, nbytes: int, dst
) -> tuple[int, str | None]:
    """Adds the tier; returns its index and, for the file tier, the path of its data file."""
    num_blocks = -(-nbytes // TIER_BLOCK_BYTES)
    if args.tier == "host":
        return engine.add_host_tier(block_bytes=TIER_BLOCK_BYTES, num_blocks=num_blocks), None
    directory = os.path.abspath(args.path or os.getcwd())
    # Stored at the destination's offset within a page (unless told otherwise), so the
    # fetch reads straight into it.
    offset = args.alignment_offset
    if offset is None:
        offset = page_offset(dst) or 0
    # A named file, so that the plain reader can open the very same bytes.
    name = f"tpusync-overlap-bench-{os.getpid()}"
    tier = engine.add_file_tier(
        directory,
        block_bytes=TIER_BLOCK_BYTES,
        num_blocks=num_blocks,
        alignment_offset=offset,
        file_name=name,
    )
    return tier, common.file_tier_path(directory, name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Calibrates, measures the four functions interleaved; returns one result record."""
    if args.repeats < 1 or args.warmup < 1:
        raise SystemExit("--repeats and --warmup must be >= 1")
    if args.bytes >= 1 << 31:
        raise SystemExit("--bytes must stay below 2 GiB (int32 segment fields)")
    worker_cpus = common.apply_cpu_arguments(args)  # Before JAX starts its backend.

    import jax  # Deferred: split_cpus (above) must run before jax starts its backend.
    import jax.numpy as jnp
    from jax import lax

    from jax_tpusync.runtime import ops

    nbytes = args.bytes
    engine = Engine(common.engine_config(args, worker_cpus))
    data_path = None
    plain = None
    try:
        # The destination, donated into every call (so it keeps its address), comes first:
        # the file tier is laid out for it.
        state = {"dst": jnp.zeros((nbytes,), jnp.uint8)}
        tier, data_path = _open_tier(engine, args, nbytes, state["dst"])
        info = engine.tier_info(tier)
        data_map, data = common.page_aligned_buffer(nbytes)
        common.fill_random(data, seed=4321)
        expected_crc = zlib.crc32(data)
        engine.write(tier, 0, data)
        plain = common.PlainFetch(data_path, data.size, args.segment_bytes, source=data)
        del data, data_map
        print(
            f"tier: {info.description}; {common.format_bytes(nbytes)} per fetch; "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
            flush=True,
        )
        if args.tier == "file" and not info.direct_io:
            print("warning: no O_DIRECT in this directory: the file tier reads the page cache")

        offsets = list(range(0, nbytes, args.segment_bytes))
        sizes = [min(args.segment_bytes, nbytes - o) for o in offsets]
        segs = jnp.asarray(ops.segment_rows(offsets, offsets, sizes, TIER_BLOCK_BYTES))
        tag = jnp.asarray([0, 0], dtype=jnp.int32)
        eid = engine.id
        n = args.matmul
        key = jax.random.PRNGKey(0)
        x = jax.random.normal(key, (n, n), jnp.float32)
        w = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32) / np.sqrt(n)
        z = jnp.zeros((1,), jnp.float32)  # Passthrough of the compute-free transfer.

        def build(iters: int) -> dict[str, Any]:
            def compute(x, w):
                return lax.fori_loop(0, iters, lambda i, x: jnp.tanh(x @ w), x)

            def f_compute(x, w):
                return compute(x, w)

            def f_transfer(z, dst, segs, tag):
                z, ticket = ops.start_fetch(
                    eid, tier, z, segs, tag, dst_bytes=ops.buffer_bytes(dst)
                )
                return ops.wait_fetch(eid, tier, dst, ticket, segs, tag, deps=(z,))

            def f_sync(x, w, dst, segs, tag):
                dst = ops.wait_fetch(eid, tier, dst, jnp.int32(ops.NO_TICKET), segs, tag)
                x = ops.mark(eid, 0, x, tag, deps=(dst,))  # Compute starts after the fetch landed.
                return compute(x, w), dst

            def f_overlap(x, w, dst, segs, tag):
                x, ticket = ops.start_fetch(
                    eid, tier, x, segs, tag, dst_bytes=ops.buffer_bytes(dst)
                )
                y = compute(x, w)
                dst = ops.wait_fetch(eid, tier, dst, ticket, segs, tag, deps=(y,))
                return y, dst

            return {
                "compute": jax.jit(f_compute),
                "transfer": jax.jit(f_transfer, donate_argnums=(1,)),
                "sync": jax.jit(f_sync, donate_argnums=(2,)),
                "overlap": jax.jit(f_overlap, donate_argnums=(2,)),
            }

        np_dst = common.xla_like_buffer(nbytes)
        np_segments = [(o, o, s) for o, s in zip(offsets, sizes)]

        def runners(fns: dict[str, Any]) -> dict[str, Any]:
            def r_compute() -> float:
                t0 = time.perf_counter()
                fns["compute"](x, w).block_until_ready()
                return time.perf_counter() - t0

            def r_transfer() -> float:
                t0 = time.perf_counter()
                state["dst"] = fns["transfer"](z, state["dst"], segs, tag)
                state["dst"].block_until_ready()
                return time.perf_counter() - t0

            def r_sync() -> float:
                t0 = time.perf_counter()
                y, state["dst"] = fns["sync"](x, w, state["dst"], segs, tag)
                jax.block_until_ready((y, state["dst"]))
                return time.perf_counter() - t0

            def r_overlap() -> float:
                t0 = time.perf_counter()
                y, state["dst"] = fns["overlap"](x, w, state["dst"], segs, tag)
                jax.block_until_ready((y, state["dst"]))
                return time.perf_counter() - t0

            def r_engine() -> float:  # The same fetch from Python, no XLA involved.
                t0 = time.perf_counter()
                engine.wait(engine.submit_read(tier, np_segments, np_dst))
                return time.perf_counter() - t0

            def r_plain() -> float:
                t0 = time.perf_counter()
                common.beside(plain, lambda: None, cpus=worker_cpus)
                return time.perf_counter() - t0

            def r_plain_overlap() -> float:
                t0 = time.perf_counter()
                common.beside(
                    plain, lambda: fns["compute"](x, w).block_until_ready(), cpus=worker_cpus
                )
                return time.perf_counter() - t0

            return {
                "compute": r_compute,
                "transfer": r_transfer,
                "sync": r_sync,
                "overlap": r_overlap,
                "engine": r_engine,
                "plain": r_plain,
                "plain_overlap": r_plain_overlap,
            }

        def median_of(fn, k: int) -> float:
            fn()  # Compile / warm.
            return statistics.median(fn() for _ in range(k))

        # -- calibration: pick iters so that t_compute ~ t_transfer --------------------------
        iters = args.iters or 4
        fns = build(iters)
        t_transfer = median_of(runners(fns)["transfer"], 5)
        calibration = []
        if args.iters is None:
            for _ in range(_CALIBRATION_STEPS):
                t_comp = median_of(runners(fns)["compute"], 5)
                calibration.append(
                    {
                        "iters": iters,
                        "t_compute_ms": t_comp * 1e3,
                        "t_transfer_ms": t_transfer * 1e3,
                    }
                )
                ratio = t_comp / t_transfer
                if _CALIBRATION_BAND[0] <= ratio <= _CALIBRATION_BAND[1]:
                    break
                iters = max(1, round(iters / ratio))
                if iters == calibration[-1]["iters"]:
                    break
                fns = build(iters)
                t_transfer = median_of(runners(fns)["transfer"], 5)
            print(
                f"calibrated: {iters} matmuls of {n}x{n} (t_transfer ~ {t_transfer * 1e3:.1f} ms)",
                flush=True,
            )

        # -- interleaved measurement ---------------------------------------------------------
        engine.reset_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            samples = common.interleaved(runners(fns), args.repeats, args.warmup)
        stats = engine.stats()
        donation_warnings = sorted({str(w.message) for w in caught if "donat" in str(w.message)})
        for msg in donation_warnings:
            print(f"warning: {msg}")

        # -- correctness: every path lands the written bytes in a fresh, zeroed buffer --------
        verified = {}
        fresh = jnp.zeros((nbytes,), jnp.uint8)
        verified["transfer"] = zlib.crc32(np.asarray(fns["transfer"](z, fresh, segs, tag)))
        fresh = jnp.zeros((nbytes,), jnp.uint8)
        verified["sync"] = zlib.crc32(np.asarray(fns["sync"](x, w, fresh, segs, tag)[1]))
        fresh = jnp.zeros((nbytes,), jnp.uint8)
        verified["overlap"] = zlib.crc32(np.asarray(fns["overlap"](x, w, fresh, segs, tag)[1]))
        verified["engine"] = zlib.crc32(np_dst)
        if args.tier == "host":  # The file reader's bytes are shifted by the alignment offset.
            verified["plain"] = zlib.crc32(plain.dst)
        verified = {k: v == expected_crc for k, v in verified.items()}
        if not all(verified.values()):
            raise AssertionError(f"fetched bytes differ from the written ones: {verified}")

        tc, tt = samples["compute"], samples["transfer"]
        ts, to = samples["sync"], samples["overlap"]

        def eff(c: float, t: float, o: float) -> float:
            return (c + t - o) / min(c, t)

        paired = [eff(c, t, o) for c, t, o in zip(tc.seconds, tt.seconds, to.seconds)]
        tp, tpo = samples["plain"], samples["plain_overlap"]
        platform_eff = eff(tc.median, tp.median, tpo.median)
        # A fetch that landed in engine memory is copied into the wait's operand inside the
        # wait, after the compute: XLA may reuse an operand's memory until the op that takes
        # it runs, so nothing may write there earlier. That copy caps the overlap.
        copies = stats["wait_copy_bytes"] / nbytes
        t_copy = stats["wait_copy_s"] / copies if copies else 0.0
        ceiling = overlap_ceiling(tc.median, tt.median, t_copy)
        efficiency = eff(tc.median, tt.median, to.median)
        result = {
            "tier": args.tier,
            "bytes": nbytes,
            "segments": len(offsets),
            "matmul": n,
            "iters": iters,
            "t_compute_ms": tc.median * 1e3,
            "t_transfer_ms": tt.median * 1e3,
            "t_engine_ms": samples["engine"].median * 1e3,
            "t_sync_ms": ts.median * 1e3,
            "t_overlap_ms": to.median * 1e3,
            "overlap_efficiency": efficiency,
            "t_wait_copy_ms": t_copy * 1e3,
            "overlap_ceiling": ceiling,
            "efficiency_over_ceiling": efficiency / ceiling if ceiling > 0 else None,
            "overlap_efficiency_paired_median": statistics.median(paired),
            "overlap_efficiency_paired_min": min(paired),
            "overlap_efficiency_paired_max": max(paired),
            "t_plain_ms": tp.median * 1e3,
            "t_plain_overlap_ms": tpo.median * 1e3,
            "platform_overlap_efficiency": platform_eff,
            "efficiency_over_platform": (
                eff(tc.median, tt.median, to.median) / platform_eff if platform_eff > 0 else None
            ),
            "compute_over_transfer": tc.median / tt.median,
            "sync_over_overlap": ts.median / to.median,
            # In words, with the noise note: "1.4x faster than fetch-then-compute (sync)".
            "overlap_vs_sync": verdict.compare(
                verdict.Spread.of([s * 1e3 for s in to.seconds]),
                verdict.Spread.of([s * 1e3 for s in ts.seconds]),
                "fetch-then-compute (sync)",
            ),
            **tc.ms("t_compute"),
            **tt.ms("t_transfer"),
            **ts.ms("t_sync"),
            **to.ms("t_overlap"),
            **samples["engine"].ms("t_engine"),
            "transfer_gbps": nbytes / tt.median / 1e9,
            "repeats": args.repeats,
            "workers": args.workers,
            "chunk_bytes": args.chunk_bytes,
            "engine_cpus": args.engine_cpus_kept,
            "worker_cpus": list(worker_cpus),
            "direct_io": info.direct_io,
            "io_depth": args.io_depth,
            "alignment_offset": info.alignment_offset,
            "direct_read_fraction": common.direct_read_fraction(engine.tier_info(tier)),
            "prefetch_hits": stats["prefetch_hits"],
            "prefetch_misses": stats["prefetch_misses"],
            "donation_warnings": donation_warnings,
            "verified": verified,
            "calibration": calibration,
            "jax_devices": [str(d) for d in jax.devices()],
        }
        print(
            f"efficiency {result['overlap_efficiency']:.3f} (compute {tc.median * 1e3:.1f} ms, "
            f"transfer {tt.median * 1e3:.1f} ms, overlap {to.median * 1e3:.1f} ms, "
            f"sync {ts.median * 1e3:.1f} ms); platform {platform_eff:.3f} (plain read "
            f"{tp.median * 1e3:.1f} ms, with compute {tpo.median * 1e3:.1f} ms)\n"
            f"the wait's copy into the operand took {t_copy * 1e3:.1f} ms of the transfer: "
            f"no fetch delivered into an XLA operand can overlap more than {ceiling:.3f} "
            f"here; this one reached {efficiency / ceiling:.3f} of that\n"
            f"the overlapped step is {result['overlap_vs_sync']}",
            flush=True,
        )
        return result
    finally:
        if plain is not None:
            plain.close()
        engine.close()
        if data_path is not None and os.path.exists(data_path):
            os.unlink(data_path)
