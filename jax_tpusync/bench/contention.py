"""``contention``: the tier bandwidth the engine keeps while the other CPUs work.

A decode step bound by its tier runs at the tier's speed *while the model computes beside
it*, which need not be its speed on an idle machine: on a virtual machine, the host thread
that serves the virtual disk may share physical cores with the guest's busy CPUs. This
measures that directly, with no JAX involved.

The tier (``--total-bytes``, written once with random bytes) is fetched whole by the
engine, one request per ``--block-bytes``, all submitted before the first wait, into a
page-aligned huge-page buffer (O_DIRECT lands in place). The engine's workers run on the
CPUs ``--engine-cpus`` keeps (the last ones); the other CPUs, where a model's compute would
run, are in one of three states, rotated each round:

* ``idle``: nothing else runs;
* ``alu``: one process per compute CPU spins an integer loop (no memory traffic);
* ``memory``: one process per compute CPU copies a 64 MiB array over and over (DRAM
  traffic, like attention streaming its KV).

Reports GB/s per state (medians of ``--repeats`` rounds after ``--warmup``; the warm-up
round verifies the bytes) and ``alu_over_idle`` / ``memory_over_idle``. With one CPU, the
load shares it with the engine (said in the row).

Printed by default: per load, the share of its idle fetch rate the engine keeps, in words,
with the spread of the rounds; ``--details``: the row of rates and ratios. Rounds are
reported on stderr as they finish.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zlib
from typing import Any

from jax_tpusync.bench import common, verdict
from jax_tpusync.runtime.engine import Engine

STATES = ("idle", "alu", "memory")
# What each state's load does, in the summary's words.
STATE_WORDS = {
    "idle": "the other CPUs idle",
    "alu": "the other CPUs spinning an integer loop",
    "memory": "the other CPUs copying memory",
}
TIER_BLOCK_BYTES = 64 * common.KiB
RAMP_SECONDS = 0.2  # Lets the load processes start and reach their CPUs before timing.

# Each load process dies with the benchmark (PR_SET_PDEATHSIG), even a killed one, and pins
# itself (a parent with engine threads must not fork-and-pin).
_LOAD_PRELUDE = (
    "import ctypes, os, signal\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != {parent}:\n"
    "    os._exit(0)\n"
    "os.sched_setaffinity(0, {{{cpu}}})\n"
)
_LOAD_LOOP = {
    "alu": "x = 0\nwhile True:\n    x = (x * 3 + 1) & 0xFFFF\n",
    "memory": "import numpy as np\na = np.ones(64 << 20, np.uint8)\nb = np.empty_like(a)\n"
    "while True:\n    np.copyto(b, a)\n",
}


def load_code(state: str, cpu: int) -> str:
    """The Python source of one ``state`` load process pinned to ``cpu``."""
    return _LOAD_PRELUDE.format(parent=os.getpid(), cpu=cpu) + _LOAD_LOOP[state]


COLUMNS = [
    ("tier", "tier", "s"),
    ("block_bytes", "block", "bytes"),
    ("idle_gbps", "idle GB/s", ".2f"),
    ("alu_gbps", "alu GB/s", ".2f"),
    ("memory_gbps", "memory GB/s", ".2f"),
    ("alu_over_idle", "alu/idle", ".3f"),
    ("memory_over_idle", "memory/idle", ".3f"),
    ("load_cpus", "load cpus", "s"),
    ("engine_cpus", "engine cpus", "s"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``contention`` subcommand."""
    p = subparsers.add_parser(
        "contention",
        help="engine tier bandwidth with the compute CPUs idle, spinning, copying memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tier", choices=("host", "file"), default="file")
    p.add_argument("--path", default=None, help="file tier directory (default: cwd)")
    p.add_argument(
        "--total-bytes",
        type=common.parse_bytes,
        default=256 * common.MiB,
        help="bytes fetched per measurement (default 256M)",
    )
    p.add_argument(
        "--block-bytes",
        type=common.parse_bytes,
        default=8 * common.MiB,
        help="request size (default 8M, a 32K decode unit)",
    )
    p.add_argument("--repeats", type=int, default=5, help="recorded rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded rounds first (default 1)")
    common.add_engine_arguments(p)
    p.add_argument(
        "--engine-cpus",
        type=int,
        default=1,
        help="CPUs kept for the engine's workers, the last ones; the load runs on the others "
        "(default 1)",
    )
    common.add_details_argument(p, "the row of GB/s per load and their ratios to idle")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def split(engine_cpus: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(engine CPUs, load CPUs)`` from the CPUs this process may use."""
    if engine_cpus < 1:
        raise SystemExit("--engine-cpus must be >= 1")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) <= engine_cpus:
        return tuple(allowed), tuple(allowed)  # Nothing to split: the load shares the CPUs.
    return tuple(allowed[-engine_cpus:]), tuple(allowed[:-engine_cpus])


class _Load:
    """One busy process per CPU in ``state`` ("idle": none); always reaped by ``close``."""

    def __init__(self, state: str, cpus: tuple[int, ...]):
        self.procs: list[subprocess.Popen] = []
        if state == "idle":
            return
        try:
            for cpu in cpus:
                self.procs.append(subprocess.Popen([sys.executable, "-c", load_code(state, cpu)]))
            time.sleep(RAMP_SECONDS)
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"the {state} load process exited with {proc.returncode}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measures the engine's fetch rate in each load state; returns one JSON-ready row."""
    if args.repeats < 1 or args.warmup < 1:
        raise SystemExit("--repeats and --warmup must be >= 1 (the warm-up run verifies bytes)")
    total, block = args.total_bytes, args.block_bytes
    if block <= 0 or total < block or total % block:
        raise SystemExit(f"--total-bytes ({total}) must be a positive multiple of --block-bytes")
    engine_cpus, load_cpus = split(args.engine_cpus)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, engine_cpus)  # This thread only waits; keep it off the load.
    try:
        row, samples = _measure(args, total, block, engine_cpus, load_cpus)
    finally:
        os.sched_setaffinity(0, affinity)
    common.summary_or_details(args, summary(row, samples))
    return row


def summary(row: dict[str, Any], samples: dict[str, common.Samples]) -> str:
    """Per load state, in words: the share of the idle fetch rate the engine keeps, with
    the spread of the rounds (``samples``: each state's whole-fetch seconds)."""
    spreads = {s: verdict.Spread.of([t * 1e3 for t in samples[s].seconds]) for s in STATES}
    shared = " (one CPU: the load shares it with the engine)" if row["shared_cpus"] else ""
    heading = (
        f"{row['tier']} tier: {common.format_bytes(row['total_bytes'])} fetched whole in "
        f"{common.format_bytes(row['block_bytes'])} requests, engine on CPUs "
        f"{row['engine_cpus']}, load on {row['load_cpus']}{shared} (whole fetch, ms)"
    )
    table = [(f"{s}: {STATE_WORDS[s]}, {row[f'{s}_gbps']:.2f} GB/s", spreads[s]) for s in STATES]
    words = [
        f"  with {STATE_WORDS[s]} the engine keeps {row[f'{s}_over_idle']:.2f}x of its idle "
        f"fetch rate ({row[f'{s}_gbps']:.2f} against {row['idle_gbps']:.2f} GB/s): a whole "
        f"fetch is {verdict.compare(spreads[s], spreads['idle'], 'with them idle')}"
        for s in STATES[1:]
    ]
    return "\n".join([heading, verdict.table(table, "load"), *words])


def _measure(
    args, total, block, engine_cpus, load_cpus
) -> tuple[dict[str, Any], dict[str, common.Samples]]:
    shared = set(engine_cpus) == set(load_cpus)
    _, source = common.page_aligned_buffer(total, huge_pages=True)
    common.fill_random(source, seed=99)
    expected_crc = zlib.crc32(source)
    _, dst = common.page_aligned_buffer(total, huge_pages=True)
    name = f"tpusync-bench-{os.getpid()}"
    engine = Engine(common.engine_config(args, engine_cpus))
    try:
        if args.tier == "file":
            tier = engine.add_file_tier(
                os.path.abspath(args.path or os.getcwd()),
                block_bytes=TIER_BLOCK_BYTES,
                num_blocks=total // TIER_BLOCK_BYTES,
                file_name=name,
            )
        else:
            tier = engine.add_host_tier(
                block_bytes=TIER_BLOCK_BYTES, num_blocks=total // TIER_BLOCK_BYTES
            )
        info = engine.tier_info(tier)
        engine.write(tier, 0, source)
        del source
        segments = [(off, off, n) for off, n in common.chunks(total, block)]

        def fetch_all(verify: bool) -> float:
            if verify:
                dst.fill(0)  # So that the check below sees this fetch's bytes.
            t0 = time.perf_counter()
            engine.wait(engine.submit_read(tier, segments, dst))
            return time.perf_counter() - t0

        common.progress(
            f"{info.description}; {common.format_bytes(total)} in "
            f"{common.format_bytes(block)} requests; engine on CPUs {list(engine_cpus)}, "
            f"load on {list(load_cpus)}{' (shared: one CPU)' if shared else ''}"
        )
        samples = {s: common.Samples() for s in STATES}
        for r in range(args.warmup + args.repeats):
            k = r % len(STATES)
            for state in STATES[k:] + STATES[:k]:
                load = _Load(state, load_cpus)
                try:
                    seconds = fetch_all(verify=r < args.warmup)
                finally:
                    load.close()
                if r < args.warmup and zlib.crc32(dst) != expected_crc:
                    raise RuntimeError(f"fetched bytes differ from the written ones ({state})")
                if r >= args.warmup:
                    samples[state].add(seconds)
            common.progress(
                f"  round {r + 1}, medians so far: "
                + ", ".join(f"{s} {total / samples[s].median / 1e9:.2f} GB/s" for s in STATES)
                if r >= args.warmup
                else f"  round {r + 1} (warm-up, bytes verified)"
            )
    finally:
        engine.close()
        if args.tier == "file":
            try:
                os.unlink(common.file_tier_path(os.path.abspath(args.path or os.getcwd()), name))
            except FileNotFoundError:
                pass

    gbps = {s: total / samples[s].median / 1e9 for s in STATES}
    row: dict[str, Any] = {
        "tier": args.tier,
        "total_bytes": total,
        "block_bytes": block,
        "direct_io": info.direct_io if args.tier == "file" else None,
        **{f"{s}_gbps": gbps[s] for s in STATES},
        **{k: v for s in STATES for k, v in samples[s].ms(s).items()},
        "alu_over_idle": gbps["alu"] / gbps["idle"],
        "memory_over_idle": gbps["memory"] / gbps["idle"],
        "engine_cpus": ",".join(map(str, engine_cpus)),
        "load_cpus": ",".join(map(str, load_cpus)),
        "shared_cpus": shared,
        "repeats": args.repeats,
    }
    return row, samples
