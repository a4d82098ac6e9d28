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

import errno
import fcntl
import logging
import mmap
import os
import secrets
import weakref
from pathlib import Path

logger = logging.getLogger(__name__)

POOL_DIR = ".free"


class LeasedMap(mmap.mmap):
    """A read-only mapping of a data file that holds the file's shared lock until the
    mapping is gone (closed, or collected with the last array that views it)."""

    lease: weakref.finalize


class FileRetiredError(OSError):
    """The file is no longer the one at its path (retired, or reused for a newer version)."""


def map_leased(path: str | os.PathLike) -> LeasedMap | None:
    """``path`` mapped read-only (its pages mapped up front where Linux allows:
    ``MAP_POPULATE``) under a shared lock; None for an empty file (no mapping, no lease).

    Raises:
      FileNotFoundError / FileRetiredError: the file is gone from ``path``, or being reused.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # A writer holds it: it left the version for the pool.
            raise FileRetiredError(errno.EBUSY, "being reused for a newer version", str(path))
        # Locked first, then checked: a retire renames the path away before it locks.
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileRetiredError(errno.ESTALE, "replaced since it was opened", str(path))
        size = os.fstat(fd).st_size
        if size == 0:
            os.close(fd)
            return None
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mapped = LeasedMap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise
    # The lock goes with the descriptor: close it when the mapping goes (a view of the
    # mapping that JAX adopted as a device buffer keeps it alive as long as that buffer).
    mapped.lease = weakref.finalize(mapped, os.close, fd)
    return mapped


def release(mapped: LeasedMap) -> None:
    """Unmaps ``mapped`` and drops its lease now, unless arrays still view it (then both go
    with the last of them)."""
    try:
        mapped.close()
    except BufferError:  # Exported views are alive.
        return
    mapped.lease()


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
