"""Copies of many host arrays into others at once: the engine's multi-range copy, split
over threads, large ranges with streaming stores (``ffi/engine/stream_copy.h``).

A weight publish copies each of hundreds of shards (1-16 MiB each) into the store's mapped
file. One numpy assignment per shard ran at 112 ms per GB on the 2-core VM measured, where
one 1 GB memcpy took 63 ms: below glibc's streaming threshold (192 MiB there) each copy
reads every destination cache line before writing it. Streaming stores skip that read, and
a second thread uses the bandwidth one core leaves: the same shards took about 60 ms per
GB on two threads (see docs/weights.md for the measurements).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from jax_tpusync import _tpusync

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_COPY_THREADS", "copy_arrays"]

# Threads of a copy by default: memory bandwidth stops growing after a few cores, and a
# publish should not take every core of a training host.
MAX_DEFAULT_THREADS = 4
DEFAULT_COPY_THREADS = max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))


def copy_arrays(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], *, threads: int = DEFAULT_COPY_THREADS
) -> int:
    """Copies each ``(dst, src)`` pair's bytes, all pairs at once over ``threads`` threads
    (the calling thread among them; the interpreter's lock is released meanwhile).

    Args:
      pairs: ``(destination, source)`` host arrays, each C-contiguous, the destination
        writable, both of the same number of bytes (their dtypes and shapes may differ: the
        bytes are copied as they are). No destination may overlap another or a source.
      threads: how many threads share the copy (>= 1).

    Returns:
      The bytes copied.

    Raises:
      TypeError: a pair that is not two numpy arrays, or ``threads`` not an int.
      ValueError: a non-contiguous or read-only array, byte counts that differ, ``threads``
        < 1, or overlapping ranges, naming the pair; nothing is copied then.
    """
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads={threads!r} must be an int")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    count = len(pairs)
    dst_addr = np.empty(count, np.int64)
    src_addr = np.empty(count, np.int64)
    nbytes = np.empty(count, np.int64)
    for i, pair in enumerate(pairs):
        try:
            dst, src = pair
        except (TypeError, ValueError):
            raise TypeError(f"pairs[{i}] must be a (dst, src) pair of arrays") from None
        if not isinstance(dst, np.ndarray) or not isinstance(src, np.ndarray):
            raise TypeError(
                f"pairs[{i}] is ({type(dst).__name__}, {type(src).__name__}), expected two "
                f"numpy arrays"
            )
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError(f"pairs[{i}]: both arrays must be C-contiguous")
        if not dst.flags.writeable:
            raise ValueError(f"pairs[{i}]: the destination is read-only")
        if dst.nbytes != src.nbytes:
            raise ValueError(
                f"pairs[{i}]: the destination has {dst.nbytes} bytes, the source {src.nbytes}"
            )
        dst_addr[i] = dst.ctypes.data
        src_addr[i] = src.ctypes.data
        nbytes[i] = dst.nbytes
    # `pairs` holds every array until the call returns: no range is freed meanwhile.
    _tpusync.copy_ranges(dst_addr, src_addr, nbytes, threads)
    return int(nbytes.sum())
