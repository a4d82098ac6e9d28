"""The transfer plan of a weight sync: which index ranges of which source shards feed which
destination shard, from two layouts of the same arrays.

The source layout is what a publisher wrote (each array's unique shards as index boxes,
whatever mesh and process count it had); the destination is a :class:`jax.sharding.Sharding`
of the puller's. A plan is pure data, computed once per pair of layouts
(:class:`PlanCache`), and says exactly which bytes each destination shard reads: nothing
else is read.

A *box* is a shard's index range, one ``(start, stop)`` per dimension (``()`` for a
scalar).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]


def box_of_index(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """The box of a shard's index (``Shard.index``: slices, ``None`` bounds for a whole
    dimension) in an array of ``shape``."""
    if len(index) != len(shape):
        raise ValueError(f"index {tuple(index)!r} has {len(index)} slices for shape {tuple(shape)}")
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index {tuple(index)!r}: a strided shard (step {step}) is not a box")
        out.append((start, stop))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_volume(box: Box) -> int:
    return math.prod(box_shape(box))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None where they share no element."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that select ``inner`` from an array holding ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


@dataclasses.dataclass(frozen=True)
class SourceLayout:
    """One array as a publisher laid it out: its unique shards' boxes (each element of the
    array in exactly one box), in the order the store numbers them."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    boxes: tuple[Box, ...]

    def check(self) -> None:
        """Raises ValueError unless the boxes tile the array exactly (inside it, pairwise
        disjoint, volumes summing to the array's)."""
        total = math.prod(self.shape)
        for box in self.boxes:
            if len(box) != len(self.shape) or any(
                not (0 <= a <= b <= n) for (a, b), n in zip(box, self.shape, strict=True)
            ):
                raise ValueError(
                    f"leaf {self.path}: shard box {box} lies outside shape {self.shape}"
                )
        covered = sum(box_volume(b) for b in self.boxes)
        if covered != total:
            raise ValueError(
                f"leaf {self.path}: the published shards hold {covered} elements of {total} "
                f"(shape {self.shape}): the shards do not tile the array"
            )
        for i, a in enumerate(self.boxes):
            for b in self.boxes[i + 1 :]:
                common = intersect(a, b)
                if common is not None and box_volume(common) > 0:
                    raise ValueError(f"leaf {self.path}: published shards {a} and {b} overlap")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One copy: ``source_slices`` of source shard ``source`` into ``dest_slices`` of a
    destination block."""

    source: int
    source_slices: tuple[slice, ...]
    dest_slices: tuple[slice, ...]
    elements: int


@dataclasses.dataclass(frozen=True)
class DestBlock:
    """One destination shard's index range, the puller's devices that hold it (replicas get
    one read and one copy per device), and the pieces that fill it."""

    box: Box
    devices: tuple[Any, ...]
    pieces: tuple[Piece, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The plan of one array: its blocks and what they read."""

    path: str
    shape: tuple[int, ...]
    source_dtype: np.dtype
    target_dtype: np.dtype
    sharding: jax.sharding.Sharding
    blocks: tuple[DestBlock, ...]

    @functools.cached_property
    def bytes_read(self) -> int:
        """Source bytes this process reads: each distinct destination block once."""
        return sum(box_volume(b.box) for b in self.blocks) * self.source_dtype.itemsize

    def device_bytes(self) -> dict[Any, int]:
        """``{device: bytes its shard holds}`` (in the target dtype)."""
        item = self.target_dtype.itemsize
        return {d: box_volume(b.box) * item for b in self.blocks for d in b.devices}


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """The plan of a whole pytree, leaf by leaf in the manifest's order."""

    key: Hashable
    leaves: tuple[LeafPlan, ...]
    build_seconds: float

    # Both computed once per plan (a cached plan serves every pull of its pair of layouts:
    # summing them again was about 10 ms of each 1 GB pull of 354 arrays).
    @functools.cached_property
    def bytes_read(self) -> int:
        return sum(leaf.bytes_read for leaf in self.leaves)

    @functools.cached_property
    def _device_bytes(self) -> dict[Any, int]:
        out: dict[Any, int] = collections.defaultdict(int)
        for leaf in self.leaves:
            for device, n in leaf.device_bytes().items():
                out[device] += n
        return dict(out)

    def device_bytes(self) -> dict[Any, int]:
        """``{device: bytes of every shard it receives}`` (in the target dtypes)."""
        return dict(self._device_bytes)


def layout_fingerprint(sources: Sequence[SourceLayout]) -> str:
    """A digest of a publisher's layout (paths, shapes, dtypes, boxes): equal for every
    version published with the same shardings."""
    h = hashlib.blake2b(digest_size=16)
    for s in sources:
        h.update(repr((s.path, s.shape, s.dtype, s.boxes)).encode())
    return h.hexdigest()


def check_divisible(path: str, shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> None:
    """Raises ValueError naming the leaf and the axis where ``sharding`` splits ``shape``
    unevenly (JAX arrays have no uneven shards)."""
    try:
        sharding.shard_shape(shape)
    except Exception as e:  # noqa: BLE001 - JAX's own error class is private.
        raise ValueError(
            f"leaf {path}: target sharding {sharding} does not split shape {shape} evenly "
            f"(each sharded axis must be divisible by its number of shards): {e}"
        ) from None


def plan_leaf(
    source: SourceLayout, sharding: jax.sharding.Sharding, target_dtype: np.dtype
) -> LeafPlan:
    """The plan of one array: this process's destination blocks and their pieces."""
    if not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"leaf {source.path}: target sharding must be a jax.sharding.Sharding, "
            f"got {type(sharding).__name__}"
        )
    check_divisible(source.path, source.shape, sharding)
    by_box: dict[Box, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(source.shape).items():
        by_box.setdefault(box_of_index(index, source.shape), []).append(device)
    blocks = []
    for box, devices in by_box.items():
        pieces = []
        for i, src in enumerate(source.boxes):
            common = intersect(box, src)
            if common is None:
                continue
            n = box_volume(common)
            if n == 0:
                continue
            pieces.append(Piece(i, relative_slices(common, src), relative_slices(common, box), n))
        covered = sum(p.elements for p in pieces)
        if covered != box_volume(box):  # Only a scalar or empty array gets here with no piece.
            if box_volume(box) == 0:
                pieces = []
            else:
                raise ValueError(
                    f"leaf {source.path}: destination shard {box} gets {covered} of its "
                    f"{box_volume(box)} elements from the published shards"
                )
        blocks.append(DestBlock(box, tuple(devices), tuple(pieces)))
    return LeafPlan(
        source.path,
        source.shape,
        np.dtype(source.dtype),
        np.dtype(target_dtype),
        sharding,
        tuple(blocks),
    )


class PlanCache:
    """Plans by (source layout, destination shardings, target dtypes): a pair of layouts
    is planned once. Bounded (least recently used plan dropped first)."""

    def __init__(self, capacity: int = 16):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be an int >= 1")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._plans: collections.OrderedDict[Hashable, WeightPlan] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> dict[Hashable, WeightPlan]:
        """The cached plans by key, least recently used first."""
        return dict(self._plans)

    def get(
        self,
        fingerprint: str,
        sources: Sequence[SourceLayout] | Callable[[], Sequence[SourceLayout]],
        shardings: Sequence[jax.sharding.Sharding],
        target_dtypes: Sequence[np.dtype],
    ) -> WeightPlan:
        """The cached plan for this pair of layouts, or a new one (then cached).

        ``sources`` may be a function that returns them: it is called only to build a plan
        (the fingerprint names the layout)."""
        key = (fingerprint, tuple(shardings), tuple(np.dtype(d).str for d in target_dtypes))
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        start = time.perf_counter()
        if callable(sources):
            sources = sources()
        leaves = tuple(
            plan_leaf(s, sh, d) for s, sh, d in zip(sources, shardings, target_dtypes, strict=True)
        )
        plan = WeightPlan(key, leaves, time.perf_counter() - start)
        self.misses += 1
        self._plans[key] = plan
        if len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        logger.debug(
            "weight plan built in %.3f ms (%d leaves)", plan.build_seconds * 1e3, len(leaves)
        )
        return plan
