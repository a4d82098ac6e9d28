"""The async transfer engine, from Python.

An :class:`Engine` owns worker threads and storage tiers (host DRAM, optionally shm-backed;
a file in a directory on SSD or shared storage). It moves bytes between a tier and memory
in the background, one ticket per batched request. The same engine is driven from inside
``jax.jit`` by the custom calls in :mod:`jax_tpusync.runtime.ops`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_tpusync import _tpusync

logger = logging.getLogger(__name__)

TpusyncError = _tpusync.TpusyncError
# A TpusyncError: bytes a tier should hold are gone (its file truncated or replaced under it).
TierDataLossError = _tpusync.TierDataLossError


def split_cpus(engine_cpus: int = 1) -> tuple[int, ...]:
    """Keeps this process's compute off its last ``engine_cpus`` CPUs; returns those CPUs.

    Pass the result as ``EngineConfig(worker_cpus=...)``. On a machine with few cores, XLA's
    CPU compute takes every core it is given, and a transfer that must wait for a core
    stalls the disk queue: measured on a 2-core VM, a plain ``O_DIRECT`` reader ran at less
    than half speed beside two busy cores and at full speed beside one, and the overlap
    benchmark went from 0.65-0.86 efficiency (shared cores) to 0.90-0.995 (split). Call it
    before JAX starts its backend: XLA sizes its thread pools from the CPUs the process may
    use at that moment, and threads that already exist keep their CPUs.

    Args:
      engine_cpus: CPUs to keep for the engine's workers (>= 1).

    Returns:
      The CPUs kept for the engine, or ``()`` when the process may use fewer than
      ``engine_cpus + 1`` CPUs (nothing is changed then).

    Raises:
      RuntimeError: JAX's backend is already running.
      ValueError: ``engine_cpus`` < 1.
    """
    if engine_cpus < 1:
        raise ValueError(f"engine_cpus={engine_cpus} must be >= 1")
    if _jax_backend_started():
        raise RuntimeError(
            "split_cpus must run before JAX starts its backend (its compute threads exist "
            "already and would keep every CPU)"
        )
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) <= engine_cpus:
        return ()
    os.sched_setaffinity(0, allowed[:-engine_cpus])
    return tuple(allowed[-engine_cpus:])


def _jax_backend_started() -> bool:
    bridge = getattr(sys.modules.get("jax._src.xla_bridge"), "backends_are_initialized", None)
    return bool(bridge and bridge())


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs.

    Attributes:
      num_workers: transfer threads. Two keep a file tier's device busy while a host-tier
        copy runs; more mostly contend with XLA's compute threads on small machines.
      io_chunk_bytes: unit of pacing, cancellation and O_DIRECT reads (4 KiB multiple).
      io_depth: O_DIRECT reads each worker keeps queued on the device (Linux AIO), so a file
        tier keeps streaming while compute threads hold every core.
      huge_page_destinations: ask the kernel to back memory that O_DIRECT reads land in
        with transparent huge pages (every 2 MiB page a read covers at least half of;
        re-checked on each read where the kernel reports huge pages, Linux 6.7+, else once
        per address; contents unchanged; may also cover up to 1 MiB past the destination's
        ends, i.e. the rest of a 2 MiB page it mostly fills). Measured on
        a virtualized SSD: a 64 MiB O_DIRECT read took 23 ms into huge pages against 74 ms
        into 4 KiB pages, with a quarter of the kernel CPU time.
      max_inflight_bytes: cap on bytes of running requests (0: none), so a big prefetch cannot
        hog memory bandwidth that compute needs.
      max_bytes_per_second: pace all tier accesses to this rate (0: unpaced).
      worker_cpus: pin worker i to ``worker_cpus[i % len]`` (empty: no pinning, the default).
        Measured on a 2-core machine: pinning both workers to one CPU held host-tier fetches
        to ~0.94x of a one-thread memcpy, against 1.2-3.9x unpinned or one worker per CPU,
        and made no difference to the file tier's bandwidth; so nothing is pinned unless
        asked. What does pay on such a machine is keeping compute off the workers' CPU
        (:func:`split_cpus`), for a file tier whose reads overlap compute.
      split_read_bytes: a host-tier read of at least this many bytes (which runs inside the
        wait of the op that needs it, while compute is stopped), and a fetch's copy from
        where it landed into the waiting op's operand, are copied by the calling thread and
        a helper thread (pinned to ``worker_cpus[0]`` if set), half each. 0: one thread.
      poison_fetches: debug; fill fetch destinations with NaN bytes until the fetch lands.
      debug_delay_us: debug; delay every transfer (makes a missing wait observable).
      record_timeline: keep per-transfer, per-wait and mark events (see :meth:`Engine.timeline`).
    """

    num_workers: int = 2
    io_chunk_bytes: int = 1 << 20
    io_depth: int = 4
    huge_page_destinations: bool = True
    max_inflight_bytes: int = 0
    max_bytes_per_second: float = 0.0
    worker_cpus: tuple[int, ...] = ()
    split_read_bytes: int = 1 << 20
    poison_fetches: bool = False
    debug_delay_us: int = 0
    record_timeline: bool = False

    def __post_init__(self):
        if not 1 <= self.num_workers <= 64:
            raise ValueError(f"num_workers={self.num_workers} must be in [1, 64]")
        if self.io_chunk_bytes < 4096 or self.io_chunk_bytes % 4096:
            raise ValueError(
                f"io_chunk_bytes={self.io_chunk_bytes} must be a positive multiple of 4096"
            )
        if not 2 <= self.io_depth <= 64:
            raise ValueError(f"io_depth={self.io_depth} must be in [2, 64]")
        if self.max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes={self.max_inflight_bytes} must be >= 0")
        if self.max_bytes_per_second < 0:
            raise ValueError(f"max_bytes_per_second={self.max_bytes_per_second} must be >= 0")
        if self.split_read_bytes < 0:
            raise ValueError(f"split_read_bytes={self.split_read_bytes} must be >= 0")
        if self.debug_delay_us < 0:
            raise ValueError(f"debug_delay_us={self.debug_delay_us} must be >= 0")
        ncpu = os.cpu_count() or 1
        for cpu in self.worker_cpus:
            if not 0 <= cpu < ncpu:
                raise ValueError(f"worker cpu {cpu} does not exist (this machine has {ncpu} cpus)")


@dataclasses.dataclass(frozen=True)
class TierInfo:
    """What a tier is and how full it is."""

    index: int
    kind: str  # "host" or "file"
    description: str
    block_bytes: int
    num_blocks: int
    capacity_bytes: int
    free_blocks: int
    direct_io: bool  # file tier: O_DIRECT in use (False: buffered fallback, e.g. on tmpfs)
    dio_alignment: int  # file tier: O_DIRECT alignment of memory and offsets (0: no O_DIRECT)
    alignment_offset: int  # file tier: data shift in the file (see Engine.add_file_tier)
    direct_read_bytes: int  # fetched straight into the destination (file tier, same phase)
    bounced_read_bytes: int  # fetched through a bounce buffer
    attached: bool  # re-attached to an existing shm segment or file
    read_only: bool  # attached with read_only=True: writes are refused
    regions: dict[str, tuple[int, int]]  # persistent name -> (first_block, num_blocks)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Engine events, all stamped with ``time.monotonic_ns()``'s clock.

    transfers: rows (ticket, tier, direction [0 fetch, 1 write-back], layer, chunk, bytes,
      submit_ns, start_ns, end_ns, ok).
    waits: rows (ticket, layer, chunk, begin_ns, end_ns).
    marks: rows (kind, layer, chunk, ns) recorded by :func:`jax_tpusync.runtime.ops.mark`.
    """

    transfers: list[tuple]
    waits: list[tuple]
    marks: list[tuple]


Segments = Sequence[tuple[int, int, int]] | np.ndarray  # rows (tier_offset, mem_offset, nbytes)


def _segment_columns(segments: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = np.asarray(segments, dtype=np.int64)
    if rows.size == 0:
        rows = rows.reshape(0, 3)
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(
            f"segments must be rows of (tier_offset, mem_offset, nbytes); got shape {rows.shape}"
        )
    return (
        np.ascontiguousarray(rows[:, 0]),
        np.ascontiguousarray(rows[:, 1]),
        np.ascontiguousarray(rows[:, 2]),
    )


class Engine:
    """An async transfer engine with its tiers.

    Use as a context manager, or call :meth:`close`. Closing cancels queued fetches, lets
    write-backs and running transfers finish, and joins the workers.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config = config
        self._impl = _tpusync.Engine(
            num_workers=config.num_workers,
            io_chunk_bytes=config.io_chunk_bytes,
            io_depth=config.io_depth,
            huge_page_destinations=config.huge_page_destinations,
            max_inflight_bytes=config.max_inflight_bytes,
            max_bytes_per_second=float(config.max_bytes_per_second),
            worker_cpus=list(config.worker_cpus),
            split_read_bytes=config.split_read_bytes,
            poison_fetches=config.poison_fetches,
            debug_delay_us=config.debug_delay_us,
            record_timeline=config.record_timeline,
        )
        # Buffers of async Python-side transfers stay referenced until their ticket is waited.
        self._keepalive: dict[int, np.ndarray] = {}
        _open_engines.add(self)

    # -- lifetime ---------------------------------------------------------------------------

    @property
    def id(self) -> int:
        """The id XLA custom calls use to find this engine."""
        return self._impl.id

    @property
    def closed(self) -> bool:
        return self._impl.closed

    def close(self) -> None:
        self._impl.close()
        self._keepalive.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Engine(id={self.id}, {state})"

    # -- tiers ------------------------------------------------------------------------------

    def add_host_tier(
        self,
        *,
        block_bytes: int,
        num_blocks: int,
        shm_name: str | None = None,
        read_only: bool = False,
    ) -> int:
        """Adds a page-aligned DRAM pool; returns its tier index.

        An anonymous pool larger than the machine's available memory (``MemAvailable``) is
        refused. A new shm segment is preallocated in ``/dev/shm`` (an error now if it does
        not fit, instead of a SIGBUS when the pool fills).

        Args:
          block_bytes: allocation unit.
          num_blocks: pool size in blocks.
          shm_name: back the pool by POSIX shm ``/<shm_name>`` so another process (or this one
            after a restart) re-attaches to the same bytes. Opening an existing segment with
            another layout fails instead of reinterpreting it. One writer owns a segment at a
            time: a second attach, in this process or another, fails naming the holder's pid.
          read_only: attach an existing segment read-only (needs ``shm_name``; never creates
            one). Read-only attaches share a segment with each other, never with a writer;
            every write to the tier fails.
        """
        _check_layout(block_bytes, num_blocks)
        # "" is the engine's own "anonymous": a caller's "" would silently not persist.
        _check_name("shm_name", shm_name)
        return self._impl.add_host_tier(block_bytes, num_blocks, shm_name or "", read_only)

    def add_file_tier(
        self,
        directory: str | os.PathLike,
        *,
        block_bytes: int,
        num_blocks: int,
        file_name: str | None = None,
        direct_io: bool = True,
        alignment_offset: int = 0,
        read_only: bool = False,
    ) -> int:
        """Adds a file tier in ``directory``; returns its tier index.

        Args:
          directory: an existing, writable directory on local SSD or shared storage.
          block_bytes: allocation unit (a multiple of 4096 keeps O_DIRECT bounce-free).
          num_blocks: size in blocks. The file is preallocated to its full size when made
            (an error now, naming the free space, when the disk cannot hold it), so write-backs
            cannot run out of space later; a read past the end of a file that was truncated
            underneath the tier raises instead of returning zeros.
          file_name: keep the data in ``<directory>/<file_name>.tpusync`` and re-attach later;
            None: an anonymous file deleted on close. One writer owns a file at a time: a
            second attach, in this process or another, fails naming the holder's pid. A file
            shorter than its header and capacity is refused.
          direct_io: try O_DIRECT (falls back to buffered I/O where refused, e.g. tmpfs; see
            :meth:`tier_info`).
          alignment_offset: in [0, 4096): where destination buffers usually start modulo a
            page (:func:`page_offset` tells for an array). The data is shifted
            in the file by this much, so that O_DIRECT reads go straight into such buffers
            instead of through a bounce buffer and a copy. Any destination stays correct;
            see ``direct_read_bytes`` in :meth:`tier_info`. A re-attached file keeps the
            offset it was created with.
          read_only: attach an existing file read-only (needs ``file_name``; never creates
            one). Read-only attaches share a file with each other, never with a writer; every
            write to the tier fails.
        """
        _check_layout(block_bytes, num_blocks)
        if not os.fspath(directory):
            raise ValueError(f"directory={directory!r} must be a non-empty path (a directory)")
        _check_name("file_name", file_name)
        if not 0 <= alignment_offset < 4096:
            raise ValueError(f"alignment_offset={alignment_offset} must be in [0, 4096)")
        tier = self._impl.add_file_tier(
            os.fspath(directory),
            block_bytes,
            num_blocks,
            file_name or "",
            direct_io,
            alignment_offset,
            read_only,
        )
        info = self.tier_info(tier)
        if direct_io and not info.direct_io:
            logger.info("file tier %s: %s", tier, info.description)
        return tier

    def tier_info(self, tier: int) -> TierInfo:
        d = self._impl.tier_info(tier)
        return TierInfo(index=tier, **d)

    def mapped_memory(self, tier: int) -> tuple[int, int]:
        """(address, bytes) of a host tier's data in this process: tier byte offset ``o``
        is at ``address + o``. For registering the pool with another engine that reads or
        writes it in place (a network transfer engine); such writes bypass this engine's
        ordering, so the caller keeps them off blocks in use. Raises ValueError for a file
        tier (not mapped in memory)."""
        address, nbytes = self._impl.mapped_memory(tier)
        return int(address), int(nbytes)

    @staticmethod
    def unlink_shm(shm_name: str) -> None:
        """Removes a persistent shm segment made by ``add_host_tier(shm_name=...)``."""
        _tpusync.unlink_shm(shm_name)

    def allocate(self, tier: int, num_blocks: int, name: str | None = None) -> int:
        """Allocates contiguous blocks; returns the first block index.

        A ``name`` makes the region persistent on a shm/file-backed tier: allocating the same
        name and size again (in this or a later process) returns the same blocks.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        return self._impl.allocate(tier, num_blocks, name or "")

    def free(self, tier: int, first_block: int, num_blocks: int) -> None:
        self._impl.free(tier, first_block, num_blocks)

    # -- transfers --------------------------------------------------------------------------

    def submit_write(
        self, tier: int, segments: Segments, buffer: np.ndarray, *, layer: int = -1, chunk: int = -1
    ) -> int:
        """Queues tier writes from ``buffer`` bytes; returns a ticket for :meth:`wait`."""
        return self._submit(tier, True, segments, np.ascontiguousarray(buffer), layer, chunk)

    def submit_read(
        self, tier: int, segments: Segments, buffer: np.ndarray, *, layer: int = -1, chunk: int = -1
    ) -> int:
        """Queues tier reads into ``buffer`` (C-contiguous, writable); returns a ticket."""
        if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
            raise ValueError("read buffer must be a C-contiguous numpy array")
        if not buffer.flags.writeable:
            raise ValueError("read buffer must be writable")
        return self._submit(tier, False, segments, buffer, layer, chunk)

    def transfer(
        self, rows: Sequence[tuple[int, int, int, int]], buffer: np.ndarray, *, write: bool
    ) -> None:
        """Runs rows ``(tier, tier offset, memory offset, bytes)`` against ``buffer``, one
        request per tier (all queued before any is waited for), and waits for them."""
        by_tier: dict[int, list[tuple[int, int, int]]] = {}
        for tier, offset, mem, n in rows:
            by_tier.setdefault(tier, []).append((offset, mem, n))
        submit = self.submit_write if write else self.submit_read
        tickets = [submit(tier, segments, buffer) for tier, segments in by_tier.items()]
        for t in tickets:
            self.wait(t)

    def _submit(self, tier, write, segments, buffer, layer, chunk) -> int:
        tier_offsets, mem_offsets, sizes = _segment_columns(segments)
        ticket = self._impl.submit(
            tier,
            write,
            tier_offsets,
            buffer.reshape(-1).view(np.uint8),
            mem_offsets,
            sizes,
            layer,
            chunk,
        )
        self._keepalive[ticket] = buffer
        return ticket

    def wait(self, ticket: int, timeout: float | None = None) -> None:
        """Blocks until the ticket's transfer ends; consumes the ticket; raises its error."""
        try:
            self._impl.wait(ticket, -1.0 if timeout is None else float(timeout))
        except TpusyncError as e:
            if "still running" not in str(e):
                self._keepalive.pop(ticket, None)
            raise
        self._keepalive.pop(ticket, None)

    def poll(self, ticket: int) -> bool:
        """True once the transfer has ended (the ticket remains valid for :meth:`wait`)."""
        return self._impl.poll(ticket)

    def cancel(self, ticket: int) -> None:
        """Drops a queued transfer or stops a running one; :meth:`wait` then raises."""
        self._impl.cancel(ticket)

    def drain(self) -> None:
        """Blocks until every submitted transfer, including in-graph ones, has ended."""
        self._impl.drain()

    def write(self, tier: int, tier_offset: int, data: np.ndarray) -> None:
        """Blocking write of all of ``data``'s bytes at ``tier_offset``."""
        data = np.ascontiguousarray(data)
        self.wait(self.submit_write(tier, [(tier_offset, 0, data.nbytes)], data))

    def read(self, tier: int, tier_offset: int, out: np.ndarray) -> np.ndarray:
        """Blocking read of ``out.nbytes`` bytes at ``tier_offset`` into ``out``."""
        self.wait(self.submit_read(tier, [(tier_offset, 0, out.nbytes)], out))
        return out

    # -- observability ----------------------------------------------------------------------

    def stats(self) -> dict:
        """Per-tier fetch/write-back bytes, requests, segments (contiguous tier ranges, after
        the merging of adjacent rows) and bytes per segment, busy seconds and GB/s; wait
        counters; ``wait_copy_bytes`` and ``wait_copy_s``: fetches that landed in engine
        memory and were copied into their wait's operand, and the time those copies took
        (inside the wait, so not overlapped with compute)."""
        return self._impl.stats()

    def reset_stats(self) -> None:
        self._impl.reset_stats()

    def timeline(self) -> Timeline:
        """Takes (and clears) the recorded events; empty unless ``record_timeline``."""
        return Timeline(**self._impl.take_timeline())

    # -- streams (one per cache; see jax_tpusync.runtime.ops, "Ownership") -------------------------

    def open_stream(self) -> int:
        """A new stream id for a cache's states."""
        return self._impl.open_stream()

    def begin_epoch(self, stream: int) -> int:
        """Starts a new epoch of ``stream`` (older states become stale); returns it."""
        return self._impl.begin_epoch(stream)

    def close_stream(self, stream: int) -> None:
        self._impl.close_stream(stream)

    def last_guards(self, stream: int) -> dict | None:
        """The capacity guards of ``stream``'s latest write-back in its current epoch:
        ``{epoch, generation, layer, accepted, lengths, counts}`` (one length and count per
        slot), or None if the epoch has none yet. :meth:`OffloadedKVCache.recover` rebuilds
        a lost state's lengths from it."""
        return self._impl.last_guards(stream)

    def mark(self, kind: int, layer: int = -1, chunk: int = -1) -> None:
        """Records a host-side timeline mark."""
        self._impl.mark(kind, layer, chunk)


# Engines still open at interpreter exit are closed before Python tears down: queued
# write-backs finish, queued fetches are dropped, and the workers are joined while the
# buffers of host-side transfers still exist (a Ctrl-C in a decode loop ends here).
_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception as e:  # Exiting anyway: report, keep closing the others.
            logger.warning("closing engine %s at exit failed: %s", engine.id, e)


def page_offset(array) -> int | None:
    """Where ``array``'s bytes start within a 4 KiB page; None off CPU or when not known.

    A file tier created with this as its ``alignment_offset`` reads straight into the array.
    Ask the buffer itself: where XLA puts the next buffer depends on the allocator's
    history (glibc moves its mmap threshold), so a probe of the same size is unreliable.
    """
    from jax_tpusync.runtime import backend

    if not backend.is_cpu():
        return None
    try:
        return int(array.unsafe_buffer_pointer() % 4096)
    except Exception:  # noqa: BLE001 - sharded, non-addressable or not a jax.Array.
        return None


def huge_page_fraction(array) -> float | None:
    """Share of ``array``'s bytes mapped by huge pages now; None when not known.

    ``array`` is a numpy array or a jax.Array on CPU. The engine asks for huge pages under
    every buffer O_DIRECT reads land in (``huge_page_destinations``); this says whether the
    kernel gave them. None before Linux 6.7 (the kernel reports huge pages to a process
    from then on), off CPU, or for a buffer whose address is not known.
    """
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError(
                "huge_page_fraction needs a C-contiguous array (its bytes, in one run)"
            )
        address, nbytes = array.ctypes.data, array.nbytes
    else:
        try:
            if any(d.platform != "cpu" for d in array.devices()):
                return None  # A device address: not in this process's page tables.
            address, nbytes = array.unsafe_buffer_pointer(), array.nbytes
        except Exception:  # noqa: BLE001 - sharded, non-addressable, not an array.
            return None
    if nbytes == 0:
        return None
    got = _tpusync.huge_page_bytes(address, nbytes)
    return None if got < 0 else got / nbytes


def monotonic_ns() -> int:
    """The engine's clock (CLOCK_MONOTONIC), equal to ``time.monotonic_ns()``."""
    return _tpusync.monotonic_ns()


def _check_name(name: str, value: str | None) -> None:
    """Refuses an empty shm or file name by name (None: anonymous)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}={value!r} must be a non-empty str or None (None: anonymous)")


def _check_layout(block_bytes: int, num_blocks: int) -> None:
    if block_bytes <= 0:
        raise ValueError(f"block_bytes={block_bytes} must be positive")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks={num_blocks} must be positive")
