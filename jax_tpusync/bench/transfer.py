"""``transfer``: engine fetch bandwidth from a tier, next to a plain ceiling.

A tier of ``--total-bytes`` is written once with random bytes. Then, for each block size,
two measurements alternate (medians of ``--repeats`` rounds after a warm-up round):

* engine: fetch the whole tier into a destination that is aligned like an XLA CPU buffer
  (64 bytes, deliberately not 4 KiB), one request per block, all submitted before the
  first wait, so the engine has many requests in flight;
* ceiling: the same bytes moved without the engine --

  * host tier: a single-thread ``np.copyto`` of each block from a page-aligned source into
    the same destination;
  * file tier: a sequential ``O_DIRECT`` read of the same file region, block by block, into
    a page-aligned buffer in huge pages, as the engine's destinations are (what the device
    delivers to one plain reader).

``ratio = engine_gbps / ceiling_gbps``; the documented target is >= 0.9 for 1-8 MiB blocks.
Each block size's line also says it in words (``engine_vs_ceiling``: "1.3x faster than the
ceiling", "within noise" where the medians differ by no more than the wider IQR of the two
runs' times, see :mod:`jax_tpusync.bench.verdict`).
With ``--affinity`` the whole sweep repeats for a few worker pinning choices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib
from typing import Any

import numpy as np

from jax_tpusync.bench import common, verdict
from jax_tpusync.runtime.engine import Engine

# Tier layout unit; requests are byte-addressed, so it only has to divide the tier size.
TIER_BLOCK_BYTES = 64 * common.KiB
DEFAULT_BLOCKS = (256 * common.KiB, 1 * common.MiB, 2 * common.MiB, 4 * common.MiB, 8 * common.MiB)
DEFAULT_TOTAL = {"file": 512 * common.MiB, "host": 256 * common.MiB}
# Buffers alive at once, in units of total_bytes: tier (host only), source/ceiling, destination.
_BUFFERS = {"file": 2, "host": 3}
_RAM_FRACTION = 0.5

COLUMNS = [
    ("tier", "tier", "s"),
    ("affinity", "pin", "s"),
    ("block_bytes", "block", "bytes"),
    ("engine_gbps", "engine GB/s", ".2f"),
    ("ceiling_gbps", "ceiling GB/s", ".2f"),
    ("ratio", "ratio", ".3f"),
    ("ratio_paired_median", "paired", ".3f"),
    ("engine_ms_median", "eng ms", ".1f"),
    ("engine_ms_min", "eng min", ".1f"),
    ("engine_ms_max", "eng max", ".1f"),
    ("ceiling_ms_median", "ceil ms", ".1f"),
    ("ceiling_ms_min", "ceil min", ".1f"),
    ("ceiling_ms_max", "ceil max", ".1f"),
    ("engine_submit_ms_median", "submit ms", ".1f"),
    ("engine_busy_gbps", "busy GB/s", ".2f"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``transfer`` subcommand."""
    p = subparsers.add_parser(
        "transfer",
        help="engine fetch bandwidth vs a memcpy / O_DIRECT ceiling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tier", choices=("host", "file"), default="host")
    p.add_argument(
        "--path",
        default=None,
        help="directory of the file tier (needs O_DIRECT support for a meaningful "
        "ceiling; default: the current directory)",
    )
    p.add_argument(
        "--block-bytes",
        type=common.parse_bytes,
        nargs="+",
        default=None,
        metavar="N",
        help="request sizes (default: 256K 1M 2M 4M 8M)",
    )
    p.add_argument(
        "--total-bytes",
        type=common.parse_bytes,
        default=None,
        help="tier size fetched per repetition (default: 512M file, 256M host; "
        "clamped to available RAM)",
    )
    p.add_argument("--repeats", type=int, default=7, help="recorded rounds (default 7)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded rounds first (default 1)")
    common.add_engine_arguments(p)
    p.add_argument(
        "--affinity",
        action="store_true",
        help="sweep worker pinning: none, all workers on cpu 1, worker i on cpu i",
    )
    p.add_argument(
        "--dst-align",
        type=int,
        default=common.XLA_CPU_ALIGNMENT,
        help="destination address alignment; 64 mimics XLA CPU buffers (file tier: "
        "bounce path), 4096 lets O_DIRECT land in place (default 64)",
    )
    p.add_argument("--keep-file", action="store_true", help="keep the file tier's file")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def affinity_configs(sweep: bool) -> list[tuple[str, tuple[int, ...]]]:
    """``(label, worker_cpus)`` pairs to measure."""
    configs = [("none", ())]
    if sweep:
        ncpu = os.cpu_count() or 1
        last = min(1, ncpu - 1)
        configs.append((f"cpu{last}", (last,)))
        if ncpu > 1:
            configs.append(("split", tuple(range(min(ncpu, 2)))))
    return configs


def _clamp_total(tier: str, total: int) -> int:
    budget = int(common.available_ram_bytes() * _RAM_FRACTION) // _BUFFERS[tier]
    if total > budget:
        print(
            f"note: total_bytes {common.format_bytes(total)} clamped to {budget >> 20} MiB "
            f"to fit available RAM"
        )
        total = budget
    total -= total % TIER_BLOCK_BYTES
    if total <= 0:
        raise SystemExit("not enough RAM for a transfer benchmark")
    return total


class _Setup:
    """One engine with one tier holding ``total`` known bytes, plus the ceiling's buffers."""

    def __init__(
        self,
        args: argparse.Namespace,
        total: int,
        worker_cpus: tuple[int, ...],
        source: np.ndarray,
        dst: np.ndarray,
        name: str,
    ):
        self.args = args
        self.total = total
        self.source = source  # Holds the tier's bytes (host: ceiling source; file: ceiling dst).
        self.dst = dst
        self.engine = Engine(common.engine_config(args, worker_cpus))
        num_blocks = total // TIER_BLOCK_BYTES
        self.fd = -1
        self.file_path = None
        if args.tier == "host":
            self.tier = self.engine.add_host_tier(
                block_bytes=TIER_BLOCK_BYTES, num_blocks=num_blocks
            )
        else:
            directory = os.path.abspath(args.path or os.getcwd())
            self.tier = self.engine.add_file_tier(
                directory, block_bytes=TIER_BLOCK_BYTES, num_blocks=num_blocks, file_name=name
            )
            self.file_path = os.path.join(directory, name + ".tpusync")
        self.info = self.engine.tier_info(self.tier)
        self.engine.write(self.tier, 0, source)
        if self.file_path is not None:
            with open(self.file_path, "rb+") as f:  # Engine writes may leave dirty pages behind.
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            flags = os.O_RDONLY | (os.O_DIRECT if self.info.direct_io else 0)
            self.fd = os.open(self.file_path, flags)
            self.source_view = memoryview(source)

    def close(self) -> None:
        self.engine.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def engine_once(self, block: int) -> tuple[float, float]:
        """Fetches the whole tier, one request per block; returns (total s, submit s)."""
        engine, tier, dst = self.engine, self.tier, self.dst
        t0 = time.perf_counter()
        tickets = [
            engine.submit_read(tier, [(off, off, n)], dst)
            for off, n in common.chunks(self.total, block)
        ]
        t1 = time.perf_counter()
        for t in tickets:
            engine.wait(t)
        return time.perf_counter() - t0, t1 - t0

    def ceiling_once(self, block: int) -> float:
        """The same bytes without the engine (memcpy, or sequential O_DIRECT reads)."""
        t0 = time.perf_counter()
        if self.fd < 0:
            src, dst = self.source, self.dst
            for off, n in common.chunks(self.total, block):
                np.copyto(dst[off : off + n], src[off : off + n])
        else:
            common.plain_read(self.fd, self.source_view, common.FILE_TIER_HEADER_BYTES, block)
        return time.perf_counter() - t0


def _measure_block(
    setup: _Setup, block: int, repeats: int, warmup: int, expected_crc: int
) -> dict[str, Any]:
    engine_s, ceiling_s, submit_s = common.Samples(), common.Samples(), common.Samples()
    verified = None

    def engine_run() -> float:
        nonlocal verified
        s, sub = setup.engine_once(block)
        if verified is None:  # First (warm-up) run: the fetched bytes are the written ones.
            verified = zlib.crc32(setup.dst) == expected_crc
            if not verified:
                raise AssertionError(f"engine fetched wrong bytes (block {block})")
        submit_s.add(sub)
        return s

    def ceiling_run() -> float:
        return setup.ceiling_once(block)

    setup.engine.reset_stats()
    samples = common.interleaved(
        {"engine": engine_run, "ceiling": ceiling_run},
        repeats,
        warmup,
        {"engine": engine_s, "ceiling": ceiling_s},
    )
    fetch = setup.engine.stats()["tiers"][setup.tier]["fetch"]
    total = setup.total
    paired = [c / e for e, c in zip(samples["engine"].seconds, samples["ceiling"].seconds)]
    engine_ms = [s * 1e3 for s in engine_s.seconds]
    ceiling_ms = [s * 1e3 for s in ceiling_s.seconds]
    return {
        # In words, with the noise note: "1.3x faster than the ceiling; within noise: ...".
        "engine_vs_ceiling": verdict.compare(
            verdict.Spread.of(engine_ms), verdict.Spread.of(ceiling_ms), "the ceiling"
        ),
        "engine_gbps": total / engine_s.median / 1e9,
        "ceiling_gbps": total / ceiling_s.median / 1e9,
        "ratio": ceiling_s.median / engine_s.median,
        "ratio_paired_median": statistics.median(paired),
        **engine_s.ms("engine"),
        **ceiling_s.ms("ceiling"),
        "engine_submit_ms_median": statistics.median(submit_s.seconds[warmup:]) * 1e3,
        "engine_busy_gbps": fetch["gbps"],
        "verified": bool(verified),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs the sweep; returns one row per (affinity, block size)."""
    if args.repeats < 1 or args.warmup < 1:
        raise SystemExit("--repeats and --warmup must be >= 1 (the warm-up run verifies bytes)")
    blocks = args.block_bytes or list(DEFAULT_BLOCKS)
    total = _clamp_total(args.tier, args.total_bytes or DEFAULT_TOTAL[args.tier])
    ceiling_kind = (
        "single-thread np.copyto"
        if args.tier == "host"
        else "sequential O_DIRECT preadv, one reader"
    )

    # Buffers shared by every configuration: the bytes (ceiling source for host, ceiling
    # destination for file -- page aligned, huge pages either way) and the engine's XLA-like
    # destination.
    mapping, source = common.page_aligned_buffer(total, huge_pages=True)
    common.fill_random(source, seed=1234)
    expected_crc = zlib.crc32(source)
    dst = common.xla_like_buffer(total, args.dst_align)
    name = f"tpusync-bench-{os.getpid()}"

    rows = []
    try:
        for label, cpus in affinity_configs(args.affinity):
            setup = _Setup(args, total, cpus, source, dst, name)
            try:
                print(
                    f"[{label}] {setup.info.description}; ceiling: {ceiling_kind}; "
                    f"{common.format_bytes(total)} per run, dst aligned to "
                    f"{common.address_alignment(dst)} B"
                )
                if args.tier == "file" and not setup.info.direct_io:
                    print("warning: no O_DIRECT in this directory: both sides read the page cache")
                for block in blocks:
                    m = _measure_block(setup, block, args.repeats, args.warmup, expected_crc)
                    row = {
                        "tier": args.tier,
                        "affinity": label,
                        "worker_cpus": list(cpus),
                        "block_bytes": block,
                        "total_bytes": total,
                        **m,
                        "repeats": args.repeats,
                        "workers": args.workers,
                        "chunk_bytes": args.chunk_bytes,
                        "io_depth": args.io_depth,
                        "direct_io": setup.info.direct_io,
                        "dst_alignment": common.address_alignment(dst),
                        "ceiling": ceiling_kind,
                    }
                    rows.append(row)
                    print(
                        f"  {common.format_bytes(block):>8}: engine {m['engine_gbps']:.2f} GB/s, "
                        f"ceiling {m['ceiling_gbps']:.2f} GB/s: the engine is "
                        f"{m['engine_vs_ceiling']}",
                        flush=True,
                    )
            finally:
                setup.close()
    finally:
        if args.tier == "file" and not args.keep_file:
            directory = os.path.abspath(args.path or os.getcwd())
            try:
                os.unlink(os.path.join(directory, name + ".tpusync"))
            except FileNotFoundError:
                pass
        del mapping  # Unmapped once the last view of it is gone.
    return rows
