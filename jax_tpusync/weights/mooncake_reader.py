"""Reading a complete version from the Mooncake weight store
(:mod:`jax_tpusync.weights.store_mooncake`): the byte ranges the wanted pieces need, widened
to whole chunks, each chunk checked against its checksum before any of it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

from jax_tpusync.mooncake.client import NOT_FOUND, meaning
from jax_tpusync.weights.records import (
    DamagedVersionError,
    StoredLeaf,
    VersionManifest,
    WeightSyncError,
)


class RangeStore(Protocol):
    """What a version reader uses of its store
    (:class:`~jax_tpusync.weights.store_mooncake.MooncakeWeightStore`)."""

    request_bytes: int
    bytes_fetched: int

    def call(self, fn: Callable[[Any], Any], what: str) -> Any: ...


def contiguous_span(shape: tuple[int, ...], slices: tuple[slice, ...]) -> tuple[int, int] | None:
    """(first element, last element + 1) in C order of ``slices`` of an array of
    ``shape``; None when they select nothing."""
    first = last = 0
    stride = 1
    for n, s in zip(reversed(shape), reversed(slices), strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a slice with step {step}: only contiguous slices are planned")
        if stop <= start:
            return None
        first += start * stride
        last += (stop - 1) * stride
        stride *= n
    return first, last + 1


class MooncakeVersionReader:
    """Reads pieces of a complete version's shard objects: whole chunks, checked."""

    def __init__(self, store: RangeStore, manifest: VersionManifest):
        self.store = store
        self.manifest = manifest

    def read(
        self, leaf: StoredLeaf, wanted: Sequence[tuple[int, tuple[slice, ...]]]
    ) -> list[np.ndarray]:
        store = self.store
        dtype = np.dtype(leaf.dtype)
        chunk = self.manifest.chunk_bytes  # The publisher's, whatever this store's is.
        # Per shard, the chunks any piece needs, then their runs of consecutive chunks.
        spans: list[tuple[int, int, int] | None] = []  # (shard, first byte, end byte)
        chunks: dict[int, set[int]] = {}
        for index, slices in wanted:
            shape = tuple(b - a for a, b in leaf.shards[index].box)
            span = contiguous_span(shape, slices)
            if span is None:
                spans.append(None)
                continue
            lo, hi = span[0] * dtype.itemsize, span[1] * dtype.itemsize
            spans.append((index, lo, hi))
            chunks.setdefault(index, set()).update(range(lo // chunk, (hi - 1) // chunk + 1))
        runs = []  # (shard, first chunk, end chunk, byte offset in the buffer)
        total = 0
        for index in sorted(chunks):
            nbytes = leaf.shards[index].nbytes
            ordered = sorted(chunks[index])
            start = prev = ordered[0]
            for c in [*ordered[1:], None]:
                if c is not None and c == prev + 1:
                    prev = c
                    continue
                runs.append((index, start, prev + 1, total))
                total += min((prev + 1) * chunk, nbytes) - start * chunk
                if c is not None:
                    start = prev = c
        buffer = np.empty(max(total, 1), np.uint8)
        self._fetch(leaf, runs, buffer)
        self._check(leaf, runs, buffer)
        store.bytes_fetched += total
        out = []
        for (index, slices), span in zip(wanted, spans, strict=True):
            shape = tuple(b - a for a, b in leaf.shards[index].box)
            piece_shape = tuple(
                len(range(*s.indices(n))) for s, n in zip(slices, shape, strict=True)
            )
            if span is None:
                out.append(np.empty(piece_shape, dtype))
                continue
            _, lo, _ = span
            run = next(r for r in runs if r[0] == index and r[1] * chunk <= lo < r[2] * chunk)
            at = run[3] + lo - run[1] * chunk
            strides = [dtype.itemsize] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * shape[d + 1]
            out.append(
                np.ndarray(piece_shape, dtype, buffer=buffer, offset=at, strides=tuple(strides))
            )
        return out

    def read_stacked(self, leaf: StoredLeaf, shards: Sequence[int]) -> np.ndarray | None:
        """None: every shard is an object of its own (:meth:`read` them)."""
        return None

    def _fetch(self, leaf: StoredLeaf, runs: list, buffer: np.ndarray) -> None:
        """Gets every run's bytes into ``buffer`` (registered for each request), at most
        ``request_bytes`` per request; a WeightSyncError names the object that failed."""
        store = self.store
        chunk = self.manifest.chunk_bytes
        ranges = []  # (key, source offset, size, buffer offset), each <= request_bytes
        for index, first, end, at in runs:
            shard = leaf.shards[index]
            lo, hi = first * chunk, min(end * chunk, shard.nbytes)
            while lo < hi:
                size = min(hi - lo, store.request_bytes)
                ranges.append((shard.key, lo, size, at))
                lo, at = lo + size, at + size
        requests: list[list] = [[]]
        size = 0
        for item in ranges:
            if requests[-1] and size + item[2] > store.request_bytes:
                requests.append([])
                size = 0
            requests[-1].append(item)
            size += item[2]
        base = buffer.ctypes.data
        what = f"weights version {self.manifest.version}, leaf {leaf.path}"
        for request in requests:
            if not request:
                continue
            keys: list[str] = []
            dst: list[list[int]] = []
            src: list[list[int]] = []
            sizes: list[list[int]] = []
            for key, lo, n, at in request:  # Ranges of one object go under one key.
                if not keys or keys[-1] != key:
                    keys.append(key)
                    dst.append([])
                    src.append([])
                    sizes.append([])
                dst[-1].append(at)
                src[-1].append(lo)
                sizes[-1].append(n)

            def get(client: Any, keys=keys, dst=dst, src=src, sizes=sizes) -> list:
                # ``buffer`` is held by this closure: a call past its deadline writes into
                # memory that stays alive.
                rc = client.register_buffer(base, buffer.nbytes)
                if rc != 0:
                    return [[[rc] * len(s) for s in sizes]]
                try:
                    return client.get_into_ranges([base], [keys], [dst], [src], [sizes])
                finally:
                    client.unregister_buffer(base)

            codes = store.call(get, what)[0]
            for key, got, want in zip(keys, codes, sizes, strict=True):
                for code, n in zip(got, want, strict=True):
                    if code == n:
                        continue
                    if code == -600 or 0 <= code < n:
                        raise WeightSyncError(
                            f"{what}: object {key!r} is damaged: it does not hold the bytes "
                            f"its manifest says ({meaning(code)})"
                        )
                    if code == NOT_FOUND:
                        raise WeightSyncError(
                            f"{what}: object {key!r} is gone (retired, or its publishing "
                            f"process exited): pull again"
                        )
                    raise WeightSyncError(
                        f"{what}: getting object {key!r} returned {meaning(code)}"
                    )

    def _check(self, leaf: StoredLeaf, runs: list, buffer: np.ndarray) -> None:
        chunk = self.manifest.chunk_bytes
        for index, first, end, at in runs:
            shard = leaf.shards[index]
            for c in range(first, end):
                lo = at + (c - first) * chunk
                hi = at + min((c + 1) * chunk, shard.nbytes) - first * chunk
                if xxhash.xxh3_64_intdigest(buffer[lo:hi]) != shard.checksums[c]:
                    raise DamagedVersionError(
                        f"weights version {self.manifest.version}, leaf {leaf.path}: object "
                        f"{shard.key!r} is damaged: chunk {c} (bytes {c * chunk}-"
                        f"{min((c + 1) * chunk, shard.nbytes)}) does not match its checksum",
                        version=self.manifest.version,
                    )

    def close(self) -> None:
        """Nothing held between reads."""
