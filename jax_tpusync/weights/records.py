"""Weight sync's store interface: what every store answers (:class:`WeightStoreBackend`,
its writers and readers), the records a version is described by (:class:`VersionManifest`
and its leaves and shards), the errors, and the checks every store shares (versions,
timeouts, shards against their boxes, chunk checksums). The directory store is
:mod:`jax_tpusync.weights.store`; the Mooncake store :mod:`jax_tpusync.weights.store_mooncake`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import xxhash

from jax_tpusync.weights.plan import Box, SourceLayout

MAX_VERSION = 10**12 - 1


class WeightSyncError(RuntimeError):
    """A weight sync that did not happen; the message says why. Nothing was changed."""


class IncompleteVersionError(WeightSyncError):
    """A version some publishing process never finished (it died, or is still writing when
    the deadline passed). ``version`` and ``missing`` (the processes whose part is absent)
    say which."""

    def __init__(self, message: str, *, version: int, missing: tuple[int, ...]):
        super().__init__(message)
        self.version = version
        self.missing = missing


class VersionNotFoundError(WeightSyncError):
    """A version no publisher has started (or one already retired)."""


class DamagedVersionError(WeightSyncError):
    """A version whose stored bytes do not match the checksums written with them (changed
    after they were written). ``version`` says which; the message names the data file (or
    object) and the byte range."""

    def __init__(self, message: str, *, version: int):
        super().__init__(message)
        self.version = version


def chunk_checksums(raw: np.ndarray, chunk_bytes: int) -> list[int]:
    """xxh3-64 of each ``chunk_bytes`` of ``raw`` (``uint8[n]``; the last chunk shorter)."""
    return [
        xxhash.xxh3_64_intdigest(raw[at : at + chunk_bytes])
        for at in range(0, raw.size, chunk_bytes)
    ]


def check_version(version: object) -> int:
    """``version`` as an int, or ValueError naming it (an int in [0, 10**12))."""
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise TypeError(f"version={version!r} must be an int, got {type(version).__name__}")
    if not 0 <= int(version) <= MAX_VERSION:
        raise ValueError(f"version={version!r} must be in [0, {MAX_VERSION}]")
    return int(version)


def check_timeout(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"{name}={value!r} must be a finite number of seconds >= 0")
    return float(value)


@dataclasses.dataclass(frozen=True)
class StoredShard:
    """One published shard: its box, the process whose data file holds it, where."""

    box: Box
    process: int
    offset: int
    nbytes: int
    key: str = ""  # The object holding it, in a store of one object per shard.
    checksums: tuple[int, ...] = ()  # xxh3-64 of each chunk of its bytes, where recorded.


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    """One array of a version: its shards sorted by box (the plan numbers them so)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[StoredShard, ...]

    def layout(self) -> SourceLayout:
        return SourceLayout(self.path, self.shape, self.dtype, tuple(s.box for s in self.shards))


@dataclasses.dataclass(frozen=True)
class VersionManifest:
    """A complete version: every leaf with all of its shards, the data file of each
    process, and the fingerprint of the publisher's layout."""

    version: int
    num_processes: int
    leaves: tuple[StoredLeaf, ...]
    data_files: tuple[Path, ...]
    fingerprint: str
    chunk_bytes: int = 0  # The unit of the shards' chunk checksums, where recorded.
    # (process, offset) -> checksums of the shard there, where kept out of ``leaves`` (the
    # directory store's: its leaves stay alike from version to version).
    shard_checksums: dict[tuple[int, int], tuple[int, ...]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for leaf in self.leaves for s in leaf.shards)


class PartWriting(Protocol):
    """One process's part of a version being written: :meth:`add` each leaf, then
    :meth:`commit` (its manifest goes in last: the part counts only then) or :meth:`abort`
    (nothing of it stays). ``nbytes``: the shard bytes added so far."""

    nbytes: int

    def add(
        self,
        path: str,
        shape: tuple[int, ...],
        dtype: str,
        shards: Sequence[tuple[Box, np.ndarray]],
    ) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class VersionReader(Protocol):
    """A complete version opened for reading."""

    def read(
        self, leaf: StoredLeaf, wanted: Sequence[tuple[int, tuple[slice, ...]]]
    ) -> list[np.ndarray]:
        """Per ``(shard number, slices of that shard)`` of ``leaf``, those values (an array
        of the slices' shape and the leaf's dtype, possibly a read-only view), checked.
        They stay valid and unchanged as long as they are referenced, after :meth:`close`
        too: a puller may hand them to ``jax.device_put`` as they are."""
        ...

    def read_stacked(self, leaf: StoredLeaf, shards: Sequence[int]) -> np.ndarray | None:
        """Whole shards ``shards`` of ``leaf``, consecutive along its first axis, as one
        array (valid as long as referenced, like :meth:`read`'s values) where the store
        holds their bytes back to back; None where it does not (then :meth:`read` them)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightStoreBackend(Protocol):
    """Where versions live: a directory (:class:`WeightStore`) or a Mooncake Store
    (:class:`jax_tpusync.weights.store_mooncake.MooncakeWeightStore`). Publishers and
    pullers use only this; every method bounds its waits (a store that does not answer is
    a :class:`WeightSyncError`, never a hang)."""

    def describe(self) -> str:
        """Where the store is, for messages."""
        ...

    def versions(self) -> list[int]:
        """The versions present, complete or not, oldest first."""
        ...

    def parts(self, version: int) -> tuple[int | None, set[int]]:
        """``(number of publishing processes, processes whose part is complete)``;
        ``(None, set())`` for a version no process has begun."""
        ...

    def latest_complete(self) -> int | None: ...

    def wait_manifest(
        self, version: int, timeout_s: float, poll_s: float = 0.01
    ) -> VersionManifest:
        """The checked manifest once the version is complete; IncompleteVersionError /
        VersionNotFoundError when it is not by the deadline."""
        ...

    def part_writer(
        self, version: int, process: int, num_processes: int, *, fsync: bool = False
    ) -> PartWriting: ...

    def open_version(self, manifest: VersionManifest) -> VersionReader: ...

    def retire(self, keep: int) -> list[int]:
        """Removes versions older than the ``keep`` newest complete ones; returns them."""
        ...

    def close(self) -> None: ...


def checked_shards(
    path: str, dtype: str, shards: Sequence[tuple[Box, np.ndarray]]
) -> list[tuple[Box, np.ndarray]]:
    """``shards`` as C-contiguous host arrays, each checked to hold its box in ``dtype``
    (a ValueError naming the leaf and the shard otherwise): every shard is checked before
    any byte is written."""
    checked = []
    for box, data in shards:
        data = np.asarray(data)
        if not data.flags.c_contiguous:  # (ascontiguousarray would make a scalar 1-D)
            data = data.copy(order="C")
        if tuple(data.shape) != tuple(b - a for a, b in box) or data.dtype.name != dtype:
            raise ValueError(
                f"leaf {path}: shard {box} data is {data.dtype.name}{list(data.shape)}, "
                f"expected {dtype} of its box"
            )
        checked.append((box, data))
    return checked
