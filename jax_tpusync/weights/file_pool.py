"""Data files of a directory weight store that are reused, and the read leases that say
when one may be.

Writing a version into a new file on ``/dev/shm`` makes the kernel find and zero a fresh
page for every 4 KiB, and removing a retired version frees them all again: on a 2-core VM
that was about half of a publish (120 ms to write 244 MB into a new file, 60 ms into an
existing one, and 35-75 ms to remove the old version). So a retired version's data files
go into a pool (``<store>/.free/``) and the next part is written over one of them.

A file may be written over only when nobody reads it. Every reader holds a shared
``flock`` on the file from before it checks that the file is still the version's (same
inode under the version's path) until its last view of the file is gone; a writer takes a
file out of the pool only with an exclusive ``flock`` that it gets without waiting. The
kernel drops a dead process's locks, so a killed reader blocks nothing. Retiring renames
the version's directory aside *before* trying the exclusive lock, so a reader either
locked the file first (then the file is not reused: it is unlinked, and the reader's
mapping keeps its pages) or finds the path gone (then it refuses the version as retired).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import secrets
import weakref
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

POOL_DIR = ".free"


class FileRetiredError(OSError):
    """The file is no longer the one at its path (retired, or reused for a newer version)."""


class _LeasedBytes:
    """A mapped file's bytes under a lease (the descriptor holding its shared lock): the
    base of every array :class:`MappingCache` hands out, so the lease lasts while any of
    them (or a JAX buffer that adopted one) does."""

    def __init__(self, mapped: mmap.mmap, size: int, fd: int):
        whole = np.frombuffer(mapped, np.uint8, count=size)
        self.__array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (whole.ctypes.data, True),  # Read-only.
            "version": 3,
        }
        self._mapped = whole  # Keeps the mapping alive too, even once evicted.
        weakref.finalize(self, os.close, fd)


def _map(
    path: str | os.PathLike, inode: int, size: int, *, writable: bool = False
) -> tuple[mmap.mmap, int]:
    """``path`` (whose inode must be ``inode``) mapped shared, read-only unless
    ``writable``, its pages mapped up front where Linux allows (``MAP_POPULATE``), and a
    descriptor of it (no lock; the caller closes it). Opened again for this: ``mmap`` keeps
    a duplicate of the descriptor it is given, which would hold the caller's lock as long
    as the mapping."""
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_ino != inode:
            raise FileRetiredError(errno.ESTALE, "replaced since it was opened", str(path))
        populate = getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=prot), fd
    except BaseException:
        os.close(fd)
        raise


class _KeptMaps:
    """Mappings kept by (device, inode), at most ``capacity``, each with a descriptor of
    its file: a file since unlinked (retired while an array held it, or a pool over its
    room) loses its mapping at the next look-up, so a kept mapping never holds the pages
    of a file nobody else has."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[int, int], tuple[mmap.mmap, int]] = (
            collections.OrderedDict()
        )

    def get(self, key: tuple[int, int], size: int) -> mmap.mmap | None:
        """The kept mapping of ``key`` if it covers ``size`` bytes."""
        for other, (_, fd) in list(self._entries.items()):
            if os.fstat(fd).st_nlink == 0:
                self._drop(other)
        entry = self._entries.get(key)
        if entry is None or len(entry[0]) < size:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple[int, int], mapped: mmap.mmap, fd: int) -> None:
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (mapped, fd)
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, int]) -> None:
        _, fd = self._entries.pop(key)  # Unmapped once no array views it.
        os.close(fd)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def __len__(self) -> int:
        return len(self._entries)


class WriteMappings:
    """Writable mappings of the pooled data files a publisher wrote over, kept (by device
    and inode, at most ``capacity``) for the next time it takes the same file: copying a
    part into a kept mapping took about half the time of ``write`` calls here. A writer
    uses one only while it holds the file's exclusive lock, and only within the file's
    size (past it the mapping has no pages)."""

    def __init__(self, capacity: int = 4):
        self._maps = _KeptMaps(capacity)

    def get(self, path: str | os.PathLike, fd: int) -> np.ndarray | None:
        """The bytes of the file ``fd`` (at ``path``, exclusively locked by the caller) as
        a writable uint8 array of the file's size; None for an empty file."""
        stat = os.fstat(fd)
        if stat.st_size == 0:
            return None
        key = (stat.st_dev, stat.st_ino)
        mapped = self._maps.get(key, stat.st_size)
        if mapped is None:
            mapped, map_fd = _map(path, stat.st_ino, stat.st_size, writable=True)
            self._maps.put(key, mapped, map_fd)
        return np.frombuffer(mapped, np.uint8, count=stat.st_size)

    def clear(self) -> None:
        self._maps.clear()


class MappingCache:
    """Read-only mappings of data files kept from one pull to the next (by device and
    inode): a version written over a pooled file the last pulls mapped needs no new
    mapping (mapping 244 MB with ``MAP_POPULATE`` took 40-60 ms here, about a third of a
    pull). Each :meth:`lease` takes a new shared lock, so a cached mapping is only read
    under a lease; a kept mapping of a file since unlinked keeps its pages until it is
    dropped at the next pull (at most ``capacity`` mappings are kept)."""

    def __init__(self, capacity: int = 8):
        self._maps = _KeptMaps(capacity)
        self.hits = 0

    @property
    def kept(self) -> int:
        """How many mappings are kept."""
        return len(self._maps)

    def lease(self, path: str | os.PathLike) -> np.ndarray | None:
        """The bytes of ``path`` (a read-only uint8 array whose base holds a shared lock on
        it while any view of it lives); None for an empty file.

        Raises:
          FileNotFoundError / FileRetiredError: the file is gone from ``path``, or being
            reused.
        """
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # A writer holds it: it left the version for the pool.
                raise FileRetiredError(
                    errno.EBUSY, "being reused for a newer version", str(path)
                ) from None
            # Locked first, then checked: a retire renames the path away before it locks.
            stat = os.fstat(fd)
            if stat.st_ino != os.stat(path).st_ino:
                raise FileRetiredError(errno.ESTALE, "replaced since it was opened", str(path))
            if stat.st_size == 0:
                os.close(fd)
                return None
            # A kept mapping pins its inode: no other file can have its number meanwhile.
            key = (stat.st_dev, stat.st_ino)
            mapped = self._maps.get(key, stat.st_size)
            if mapped is not None:
                self.hits += 1
            else:
                mapped, map_fd = _map(path, stat.st_ino, stat.st_size)
                self._maps.put(key, mapped, map_fd)
            leased = _LeasedBytes(mapped, stat.st_size, fd)
        except BaseException:
            os.close(fd)
            raise
        return np.asarray(leased)

    def clear(self) -> None:
        """Forgets every kept mapping (each is unmapped once no array views it)."""
        self._maps.clear()


class FilePool:
    """The reusable data files of a store directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory) / POOL_DIR

    def take(self, destination: Path) -> tuple[int, int] | None:
        """A pooled file renamed to ``destination`` and opened for writing under an
        exclusive lock: ``(fd, its size)``; None when none is free."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return None
        for name in names:
            path = self.directory / name
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:  # Another writer took it.
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.replace(path, destination)  # Fails if another writer moved it meanwhile.
            except (BlockingIOError, FileNotFoundError):
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            return fd, os.fstat(fd).st_size
        return None

    def give(self, path: Path, capacity: int) -> bool:
        """Puts the retired data file ``path`` into the pool if no reader holds it and the
        pool holds fewer than ``capacity`` files; unlinks it otherwise. Returns whether it
        was pooled."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # A reader maps it: its pages stay until it lets go.
                path.unlink(missing_ok=True)
                return False
            self.directory.mkdir(exist_ok=True)
            if len(os.listdir(self.directory)) >= capacity:
                path.unlink(missing_ok=True)
                return False
            os.replace(path, self.directory / f"data-{secrets.token_hex(8)}.bin")
            return True
        finally:
            os.close(fd)

    def clear(self) -> None:
        """Removes every pooled file nobody is writing."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            (self.directory / name).unlink(missing_ok=True)
