"""One publishing process's part of a version in the Mooncake weight store
(:mod:`jax_tpusync.weights.store_mooncake`): its ``begun`` marker, its shards as objects
with their chunk checksums, and its manifest, put last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jax_tpusync.weights.mooncake_objects import checksummed_json, chunk_checksums
from jax_tpusync.weights.plan import Box
from jax_tpusync.weights.records import WeightSyncError, checked_shards
from jax_tpusync.weights.store import FORMAT_VERSION

logger = logging.getLogger(__name__)


class PartStore(Protocol):
    """What a part writer uses of its store
    (:class:`~jax_tpusync.weights.store_mooncake.MooncakeWeightStore`)."""

    chunk_bytes: int

    def begun_key(self, version: int) -> str: ...

    def part_key(self, version: int, process: int) -> str: ...

    def shard_key(self, version: int, process: int, leaf: int, shard: int) -> str: ...

    def call(self, fn: Callable[[Any], Any], what: str) -> Any: ...

    def put_objects(
        self, keys: list[str], arrays: list[np.ndarray], what: str, *, exists_ok: bool = False
    ) -> None: ...

    def versions(self) -> list[int]: ...

    def write_versions(self, versions: list[int]) -> None: ...


class MooncakePartWriter:
    """One process's part of a version: each leaf's shards put as objects as they are
    added, the manifest put by :meth:`commit`, last."""

    def __init__(self, store: PartStore, version: int, process: int, num_processes: int):
        self.store = store
        self.version = version
        self.process = process
        self.num_processes = num_processes
        self.manifest_key = store.part_key(version, process)
        exists = store.call(
            lambda client: client.is_exist(self.manifest_key), f"weights version {version}"
        )
        if exists == 1:
            raise ValueError(
                f"version {version}: process {process} already published its part "
                f"({self.manifest_key!r}); versions are immutable, publish a new version"
            )
        self._leaves: list[dict] = []
        self._paths: set[str] = set()
        self._put: list[str] = []
        self.nbytes = 0
        begun = np.frombuffer(checksummed_json({"num_processes": num_processes}), np.uint8).copy()
        # Every process puts it (the first put stays): the version is begun even if
        # process 0 never starts.
        store.put_objects(
            [store.begun_key(version)], [begun], f"weights version {version}", exists_ok=True
        )
        if process == 0:
            listed = store.versions()
            if version not in listed:
                store.write_versions([*listed, version])

    def add(
        self, path: str, shape: tuple[int, ...], dtype: str, shards: Sequence[tuple[Box, Any]]
    ) -> None:
        if path in self._paths:
            raise ValueError(f"leaf {path} added twice to version {self.version}'s part")
        checked = checked_shards(path, dtype, shards)
        self._paths.add(path)
        leaf = len(self._leaves)
        keys, arrays, records = [], [], []
        for index, (box, data) in enumerate(checked):
            raw = data.reshape(-1).view(np.uint8)
            key = self.store.shard_key(self.version, self.process, leaf, index)
            records.append(
                {
                    "box": [list(r) for r in box],
                    "offset": 0,
                    "nbytes": raw.nbytes,
                    "key": key if raw.nbytes else "",
                    "chunks": [f"{c:016x}" for c in chunk_checksums(raw, self.store.chunk_bytes)],
                }
            )
            if raw.nbytes:
                keys.append(key)
                arrays.append(raw)
        # Every key counts as put, even when the request fails part-way: abort() removes
        # them all (removing one that is not there is harmless).
        self._put.extend(keys)
        self.store.put_objects(keys, arrays, f"weights version {self.version}, leaf {path}")
        self.nbytes += sum(a.nbytes for a in arrays)
        self._leaves.append({"path": path, "shape": list(shape), "dtype": dtype, "shards": records})

    def commit(self) -> None:
        doc = {
            "format": FORMAT_VERSION,
            "version": self.version,
            "process": self.process,
            "num_processes": self.num_processes,
            "chunk_bytes": self.store.chunk_bytes,
            "leaves": self._leaves,
        }
        body = np.frombuffer(checksummed_json(doc), np.uint8).copy()
        self.store.put_objects([self.manifest_key], [body], f"weights version {self.version}")

    def abort(self) -> None:
        """Removes the shards this part put (best effort: its manifest was never put)."""
        keys = list(self._put)
        self._put = []
        if keys:
            try:
                self.store.call(
                    lambda client: client.batch_remove(keys, True),
                    f"weights version {self.version}",
                )
            except WeightSyncError as e:
                logger.warning("removing an aborted part's objects: %s", e)
