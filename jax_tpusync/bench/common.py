"""Helpers shared by the benchmark subcommands: buffers, sizes, timing, tables, JSON."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import math
import mmap
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# XLA's CPU client allocates buffers with 64-byte alignment; nothing makes them page aligned.
XLA_CPU_ALIGNMENT = 64
PAGE = 4096
FILE_TIER_HEADER_BYTES = 4096  # A file tier's data starts after one header page.

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """Parses a byte count such as ``4096``, ``256K``, ``1MiB`` or ``2G`` (binary units).

    Args:
      text: the size; a suffix K/M/G/T (optionally followed by ``iB`` or ``B``) multiplies
        by 1024 to that power.

    Returns:
      The size in bytes.

    Raises:
      ValueError: the text is not a size.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (try 4096, 256K, 1M, 2GiB)")
    scale = 1024 ** ("kmgt".index(m.group(2).lower()) + 1) if m.group(2) else 1
    value = float(m.group(1)) * scale
    if value != int(value) or value <= 0:
        raise ValueError(f"byte size must be a positive whole number of bytes: {text!r}")
    return int(value)


def format_bytes(n: int) -> str:
    """Formats a byte count with the largest binary unit that divides it (else bytes)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to a conservative 1 GiB)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return GiB


def page_aligned_buffer(nbytes: int, *, huge_pages: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Allocates a page-aligned, pre-faulted byte buffer.

    Args:
      nbytes: size in bytes.
      huge_pages: ask for transparent huge pages (as the engine's host pool does).

    Returns:
      ``(mapping, array)``: keep ``mapping`` alive as long as ``array`` is used.
    """
    # Private: shared anonymous memory is shmem, which gets huge pages only where the
    # system's shmem setting allows (often never).
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    array.fill(0)  # Fault every page now, not inside a timed region.
    return mapping, array


def xla_like_buffer(nbytes: int, alignment: int = XLA_CPU_ALIGNMENT) -> np.ndarray:
    """A writable, pre-faulted uint8 array aligned like an XLA CPU buffer.

    The start address is a multiple of ``alignment`` but deliberately *not* of 4 KiB (when
    ``alignment`` < 4096), the way XLA's CPU buffers are; O_DIRECT cannot land in such memory,
    which forces the file tier's bounce path.

    Args:
      nbytes: size in bytes.
      alignment: the address alignment; 4096 (or more) gives a page-aligned buffer.
    """
    raw = np.empty(nbytes + 2 * PAGE, dtype=np.uint8)
    addr = raw.ctypes.data
    start = (-addr) % PAGE  # First page boundary inside raw.
    if alignment < PAGE:
        start += alignment
    out = raw[start : start + nbytes]
    out.fill(0)
    assert out.ctypes.data % alignment == 0
    assert alignment >= PAGE or out.ctypes.data % PAGE != 0
    return out


def plain_read(fd: int, dst: memoryview, file_offset: int, piece: int) -> None:
    """Reads ``len(dst)`` bytes of ``fd`` from ``file_offset`` into ``dst``, ``piece`` at a time.

    One synchronous ``preadv`` after another, no engine: the platform's own sequential read,
    the baseline the engine is measured against. With an O_DIRECT ``fd``, ``dst`` must be
    aligned (page-aligned buffers are) and ``file_offset`` and ``piece`` sector multiples.
    """
    for off, n in chunks(len(dst), piece):
        got = os.preadv(fd, [dst[off : off + n]], file_offset + off)
        if got != n:
            raise OSError(f"short read: {got} of {n} bytes at file offset {file_offset + off}")


def file_tier_path(directory: str, file_name: str) -> str:
    """Where ``Engine.add_file_tier(directory, file_name=...)`` keeps its data."""
    return os.path.join(directory, file_name + ".tpusync")


class PlainFetch:
    """The platform's own fetch of ``nbytes``: no engine, no XLA.

    File tier (``path`` of its data file): synchronous ``preadv`` calls of ``piece`` bytes
    (O_DIRECT where the file system takes it) from the first sector-aligned offset after
    the header (the same bytes up to the tier's alignment shift, which O_DIRECT cannot
    follow). Host tier (``path`` None): ``np.copyto`` of ``source`` (default: random bytes)
    in ``piece``-byte pieces. Either lands in one page-aligned huge-page buffer; both
    release the GIL, so a thread can run them beside XLA's compute.
    """

    def __init__(self, path: str | None, nbytes: int, piece: int, source: np.ndarray | None = None):
        self.piece, self.fd = piece, -1
        self.mapping, self.dst = page_aligned_buffer(nbytes, huge_pages=True)
        if path is None:
            if source is None:
                self.source_mapping, source = page_aligned_buffer(nbytes)
                fill_random(source)
            self.source = source[:nbytes]
            return
        with open(path, "rb+") as f:  # Writes may have left dirty pages behind.
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # e.g. tmpfs: the page cache it is.
            self.fd = os.open(path, os.O_RDONLY)

    def __call__(self) -> None:
        if self.fd >= 0:
            plain_read(self.fd, memoryview(self.dst), FILE_TIER_HEADER_BYTES, self.piece)
            return
        for off, n in chunks(self.source.size, self.piece):
            np.copyto(self.dst[off : off + n], self.source[off : off + n])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def beside(
    background: Callable[[], Any], work: Callable[[], Any], *, cpus: Sequence[int] = ()
) -> Any:
    """Runs ``background()`` on another thread while ``work()`` runs on this one.

    ``cpus``: pin the thread there (the engine's CPUs, so that a plain reader competes with
    the compute as the engine's workers do; empty: the process's CPUs).
    Returns ``work()``'s result once both have finished; re-raises the thread's exception.
    """
    failure: list[BaseException] = []

    def run() -> None:
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)  # 0: this thread only.
            background()
        except BaseException as e:  # Re-raised on this thread below.
            failure.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        result = work()
    finally:
        thread.join()
    if failure:
        raise failure[0]
    return result


def add_engine_arguments(p, *, io_depth: bool = True) -> None:
    """The engine knobs every benchmark takes: ``--workers``, ``--chunk-bytes``,
    ``--split-read-bytes`` and (unless ``io_depth`` is False) ``--io-depth``, with the
    engine's defaults."""
    p.add_argument("--workers", type=int, default=2, help="engine num_workers (default 2)")
    p.add_argument(
        "--chunk-bytes",
        type=parse_bytes,
        default=1 * MiB,
        help="engine io_chunk_bytes (default 1M)",
    )
    p.add_argument(
        "--split-read-bytes",
        type=lambda text: 0 if text.strip() == "0" else parse_bytes(text),
        default=1 * MiB,
        help="engine split_read_bytes: host-tier reads at a wait this large are copied by two "
        "threads (default 1M; 0: one)",
    )
    if io_depth:
        p.add_argument("--io-depth", type=int, default=4, help="engine io_depth (default 4)")


def engine_config(args, worker_cpus: tuple[int, ...] = ()):
    """The :class:`~jax_tpusync.EngineConfig` of :func:`add_engine_arguments`' knobs."""
    from jax_tpusync.runtime.engine import EngineConfig

    return EngineConfig(
        num_workers=args.workers,
        io_chunk_bytes=args.chunk_bytes,
        io_depth=getattr(args, "io_depth", EngineConfig.io_depth),
        worker_cpus=tuple(worker_cpus),
        split_read_bytes=getattr(args, "split_read_bytes", EngineConfig.split_read_bytes),
    )


def add_cpu_arguments(p) -> None:
    """``--engine-cpus`` and ``--worker-cpus``, for commands that run XLA compute."""
    p.add_argument(
        "--engine-cpus",
        type=int,
        default=1,
        help="CPUs kept for the engine's workers, away from XLA's CPU compute "
        "(jax_tpusync.split_cpus; 0: compute and engine share every CPU, as they must once "
        "JAX has started; default 1)",
    )
    p.add_argument(
        "--worker-cpus",
        type=lambda s: tuple(int(c) for c in s.split(",") if c),
        default=None,
        help="engine worker_cpus, e.g. 1 or 0,1 (default: the CPUs --engine-cpus kept)",
    )


def apply_cpu_arguments(args) -> tuple[int, ...]:
    """Splits the CPUs as asked (call before JAX starts); returns the workers' CPUs."""
    from jax_tpusync.runtime.engine import split_cpus

    if args.engine_cpus < 0:
        raise SystemExit("--engine-cpus must be >= 0")
    kept = split_cpus(args.engine_cpus) if args.engine_cpus else ()
    args.engine_cpus_kept = list(kept)
    return tuple(args.worker_cpus) if args.worker_cpus is not None else kept


def address_alignment(array: np.ndarray) -> int:
    """The largest power of two (up to 4096) that divides the array's start address."""
    addr = array.ctypes.data
    align = 1
    while align < PAGE and addr % (align * 2) == 0:
        align *= 2
    return align


def fill_random(array: np.ndarray, seed: int = 0, chunk: int = 64 * MiB) -> None:
    """Fills a uint8 array with reproducible random bytes, a chunk at a time."""
    rng = np.random.default_rng(seed)
    flat = array.reshape(-1)
    for lo in range(0, flat.size, chunk):
        hi = min(lo + chunk, flat.size)
        flat[lo:hi] = rng.integers(0, 256, size=hi - lo, dtype=np.uint8)


@dataclasses.dataclass
class Samples:
    """Wall times in seconds of repeated runs of one measurement."""

    seconds: list[float] = dataclasses.field(default_factory=list)

    def add(self, s: float) -> None:
        self.seconds.append(s)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else math.nan

    @property
    def min(self) -> float:
        return min(self.seconds) if self.seconds else math.nan

    @property
    def max(self) -> float:
        return max(self.seconds) if self.seconds else math.nan

    def ms(self, prefix: str) -> dict[str, float]:
        """``{prefix_ms_median, prefix_ms_min, prefix_ms_max}`` in milliseconds."""
        return {
            f"{prefix}_ms_median": self.median * 1e3,
            f"{prefix}_ms_min": self.min * 1e3,
            f"{prefix}_ms_max": self.max * 1e3,
        }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``fn()`` and returns ``(seconds, result)`` on ``time.perf_counter``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def interleaved(
    measurements: dict[str, Callable[[], float]],
    repeats: int,
    warmup: int,
    samples: dict[str, Samples] | None = None,
) -> dict[str, Samples]:
    """Runs several measurements in rounds, rotating their order each round.

    Each callable runs one repetition and returns its duration in seconds. Rotating the order
    spreads drifts of a shared machine (other tenants, frequency, page cache) evenly over the
    measurements instead of biasing whichever always runs first.

    Args:
      measurements: name -> one-repetition callable.
      repeats: recorded rounds.
      warmup: unrecorded rounds first.
      samples: collect into these (created when None).

    Returns:
      name -> Samples.
    """
    samples = samples if samples is not None else {k: Samples() for k in measurements}
    names = list(measurements)
    for r in range(warmup + repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            s = measurements[name]()
            if r >= warmup:
                samples[name].add(s)
    return samples


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Renders rows as an aligned text table.

    Args:
      rows: the records.
      columns: ``(key, header, format)`` triples; ``format`` is a ``str.format`` spec such as
        ``".2f"``, or ``"bytes"`` for :func:`format_bytes`.
    """

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        if fmt == "bytes":
            return format_bytes(int(v))
        if isinstance(v, float) and math.isnan(v):
            return "n/a"
        return format(v, fmt)

    table = [[h for _, h, _ in columns]]
    table += [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where the numbers come from: host, CPUs, load, software versions, command line."""
    env: dict[str, Any] = {
        "argv": sys.argv,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "loadavg": os.getloadavg(),
        "mem_available_bytes": available_ram_bytes(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import jax_tpusync

        env["jax_tpusync"] = jax_tpusync.__version__
    except ImportError:  # pragma: no cover
        pass
    if "jax" in sys.modules:
        env["jax"] = sys.modules["jax"].__version__
    return env


def add_json_argument(p) -> None:
    """``--json OUT``: optional on every subcommand; without it nothing is written."""
    p.add_argument(
        "--json",
        default=None,
        metavar="OUT",
        help="also write the results as JSON to OUT ('-': stdout); without it the table is "
        "printed and no file is written",
    )


def add_details_argument(p, what: str) -> None:
    """``--details``: the developer's table (``what``) instead of the short summary."""
    p.add_argument(
        "--details",
        action="store_true",
        help=f"print {what} instead of the short summary",
    )


def summary_or_details(args: Any, summary: str) -> None:
    """Prints ``summary`` (the short comparison in words) unless ``--details`` asked for
    the developer's table, which :mod:`jax_tpusync.bench.__main__` then prints from
    ``args.columns``; without ``--details`` no table follows."""
    if getattr(args, "details", False):
        return
    args.columns = None
    print()
    print(summary)


def progress(message: str) -> None:
    """A progress line on stderr (stdout keeps the results)."""
    print(message, file=sys.stderr, flush=True)


def report_json(args: Any, subcommand: str, results: Any) -> None:
    """Writes the results where ``--json`` asks (``args.json``; None: nowhere) and says where."""
    if args.json is None:
        return
    write_json(args.json, subcommand, args, results)
    if args.json != "-":
        print(f"\nwrote {args.json}")


def write_json(path: str, subcommand: str, args: Any, results: Any) -> None:
    """Writes ``{subcommand, args, environment, results}`` to ``path`` (``-``: stdout)."""
    doc = {
        "subcommand": subcommand,
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
        "environment": environment(),
        "results": results,
    }
    text = json.dumps(doc, indent=2, default=_json_default)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def chunks(total: int, size: int) -> Iterable[tuple[int, int]]:
    """``(offset, length)`` pieces of ``[0, total)`` of at most ``size`` bytes."""
    for off in range(0, total, size):
        yield off, min(size, total - off)


def direct_read_fraction(info) -> float:
    """Share of a tier's fetched bytes that O_DIRECT put straight into the destination."""
    total = info.direct_read_bytes + info.bounced_read_bytes
    return info.direct_read_bytes / total if total else 0.0


# -- network namespaces (benchmarks between two "hosts" over a veth pair) --------------------

NETNS_DIRECTORY = "/var/run/netns"


def require_netns(flag: str, name: str | None) -> None:
    """Refuses (SystemExit naming ``flag``) a network namespace that ``ip netns add`` has not
    made; before any process starts, so that a typo costs nothing."""
    if name is not None and not os.path.exists(os.path.join(NETNS_DIRECTORY, name)):
        raise SystemExit(
            f"{flag} {name}: no {NETNS_DIRECTORY}/{name} (make it with 'ip netns add', as root)"
        )


def join_netns(name: str) -> None:
    """Moves this process into the network namespace ``NETNS_DIRECTORY/<name>``; call it
    before the process starts threads or opens sockets (a thread keeps its namespace)."""
    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    with open(os.path.join(NETNS_DIRECTORY, name)) as ns:
        if libc.setns(ns.fileno(), clone_newnet) != 0:
            err = ctypes.get_errno()
            raise SystemExit(f"joining network namespace {name!r}: {os.strerror(err)}")


def child_reply(replies: Any, child: Any, timeout: float, who: str) -> Any:
    """The next item ``child`` (a multiprocessing process, ``who`` in errors) put on
    ``replies``; SystemExit if it died or did not answer within ``timeout`` seconds."""
    import queue

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            return replies.get(timeout=min(1.0, max(0.01, end - time.monotonic())))
        except queue.Empty:
            if not child.is_alive():
                raise SystemExit(f"{who} died (exit code {child.exitcode})") from None
    raise SystemExit(f"{who} did not answer within {timeout} s")


def start_child(ctx: Any, target: Callable[..., None], *args: Any) -> Any:
    """A daemon process of ``ctx`` (a multiprocessing context, e.g. spawn) running
    ``target(*args)``, started from ``/``: a spawned interpreter imports the package
    installed, not one in the caller's working directory."""
    child = ctx.Process(target=target, args=args, daemon=True)
    here = os.getcwd()
    os.chdir("/")
    try:
        child.start()
    finally:
        os.chdir(here)
    return child


def add_remote_arguments(p, rows: str, master_default: str) -> None:
    """``--remote mooncake`` (``rows``: what it adds) and ``--remote-master HOST:PORT``
    (``master_default``: where the benchmark's own master runs without it)."""
    p.add_argument("--remote", choices=("mooncake",), default=None, help=f"add {rows}")
    p.add_argument(
        "--remote-master",
        default=None,
        metavar="HOST:PORT",
        help=f"a running mooncake_master (implies --remote mooncake); default: one of the "
        f"benchmark's own {master_default}",
    )
