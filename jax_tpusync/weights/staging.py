"""Host buffers a weight pull copies pieces into before ``device_put``, reused from one
pull to the next.

A pull that reshards (columns of row shards, say) copies its pieces into one host buffer
per destination block. Fresh memory costs the kernel a page fault and a zeroed page per
4 KiB, which on a 2-core VM made such a copy several times slower than one into memory
touched before. So a buffer goes back to a free list when nothing references it anymore
(on JAX's CPU backend the pulled array adopts the buffer, so that is when the sampler drops
the array; on an accelerator, once ``device_put`` has copied it), and a later pull that
needs a buffer of the same size takes it from there. The free list holds at most
``max_free_bytes``; a buffer given back beyond that is freed.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import weakref

import numpy as np

logger = logging.getLogger(__name__)

ALIGNMENT = 4096  # JAX's CPU backend adopts an aligned host buffer without copying it.


class _Loan:
    """A lent buffer's memory, as the base of the array handed out: when the last view of
    it goes, the buffer goes back to its pool."""

    def __init__(self, raw: np.ndarray, pool: StagingBuffers):
        self.__array_interface__ = {
            "shape": (raw.nbytes,),
            "typestr": "|u1",
            "data": (raw.ctypes.data, False),
            "version": 3,
        }
        self._raw = raw
        weakref.finalize(self, pool.give_back, raw)


class StagingBuffers:
    """Page-aligned host buffers, lent by :meth:`empty` and taken back once unreferenced.

    Args:
      max_free_bytes: the most bytes of unused buffers kept for later pulls.
    """

    def __init__(self, max_free_bytes: int):
        if isinstance(max_free_bytes, bool) or not isinstance(max_free_bytes, int):
            raise TypeError(f"max_free_bytes={max_free_bytes!r} must be an int")
        if max_free_bytes < 0:
            raise ValueError(f"max_free_bytes={max_free_bytes} must be >= 0")
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, collections.deque[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # Buffers lent again (for tests and benchmarks).

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers waiting to be lent again."""
        return self._free_bytes

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized C-contiguous array of ``shape`` and ``dtype`` whose data starts
        at a multiple of 4096 bytes, in a reused buffer where one of its size is free."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        raw = None
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                raw = free.pop()
                self._free_bytes -= nbytes
                self.reused += 1
        if raw is None:
            block = np.empty(nbytes + ALIGNMENT, np.uint8)
            start = -block.ctypes.data % ALIGNMENT
            raw = block[start : start + nbytes]
        return np.asarray(_Loan(raw, self)).view(dtype).reshape(shape)

    def give_back(self, raw: np.ndarray) -> None:
        """Keeps ``raw`` (no longer referenced by any lent array) for a later :meth:`empty`,
        unless that would keep more than ``max_free_bytes``."""
        with self._lock:
            if self._free_bytes + raw.nbytes > self.max_free_bytes:
                return
            self._free.setdefault(raw.nbytes, collections.deque()).append(raw)
            self._free_bytes += raw.nbytes

    def clear(self) -> None:
        """Frees every unused buffer."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
