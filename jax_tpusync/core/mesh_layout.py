"""How a mesh cache's shards map onto a device mesh (:class:`MeshLayout`).

A low module of its own: the cache (:mod:`jax_tpusync.caches.offloaded.mesh`) builds a layout, the state's
spec carries it, and the mesh step (:mod:`jax_tpusync.step.sharded`) reads it, so neither
of those two imports the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How a mesh cache's shards map onto a mesh (hashable: it rides in ``CacheSpec``)."""

    mesh: Mesh
    batch_axis: str | None
    kv_heads_axis: str | None

    @property
    def dp(self) -> int:
        return self.mesh.shape[self.batch_axis] if self.batch_axis else 1

    @property
    def tp(self) -> int:
        return self.mesh.shape[self.kv_heads_axis] if self.kv_heads_axis else 1

    @property
    def num_shards(self) -> int:
        return self.dp * self.tp

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The mesh axes a state's leading shard axis is split over, major first."""
        return tuple(a for a in (self.batch_axis, self.kv_heads_axis) if a)

    @property
    def state_spec(self) -> P:
        return P(self.shard_axes)

    @property
    def qkv_spec(self) -> P:
        """[batch, q_len, heads, head_dim] split as the shards hold them."""
        return P(self.batch_axis, None, self.kv_heads_axis, None)

    def device_shard(self) -> jax.Array:
        """int32[]: the shard of the device running the code; inside ``shard_map`` only."""
        shard = np.int32(0)
        if self.batch_axis:
            shard = lax.axis_index(self.batch_axis) * self.tp
        if self.kv_heads_axis:
            shard = shard + lax.axis_index(self.kv_heads_axis)
        return jax.numpy.asarray(shard, jax.numpy.int32)


def checked_layout(mesh: Any, kv_heads_axis: Any, batch_axis: Any) -> MeshLayout:
    """The :class:`MeshLayout` of a cache split over ``mesh``; a ``TypeError`` or
    ``ValueError`` naming the argument if the axes do not describe one (every mesh axis of
    more than one device must split the heads or the slots: a KV cache is not replicated)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if kv_heads_axis is None and batch_axis is None:
        raise ValueError(
            f"a mesh cache needs kv_heads_axis, batch_axis or both (axes of the mesh: {names})"
        )
    for arg, axis in (("kv_heads_axis", kv_heads_axis), ("batch_axis", batch_axis)):
        if axis is not None and axis not in names:
            raise ValueError(f"{arg}={axis!r} is not an axis of the mesh (its axes: {names})")
    if kv_heads_axis is not None and kv_heads_axis == batch_axis:
        raise ValueError(f"kv_heads_axis and batch_axis are both {kv_heads_axis!r}")
    for axis in names:
        if axis not in (kv_heads_axis, batch_axis) and mesh.shape[axis] > 1:
            raise ValueError(
                f"mesh axis {axis!r} has {mesh.shape[axis]} devices but is neither "
                f"kv_heads_axis nor batch_axis: its devices would each run the same shard's "
                f"transfers on the same tier blocks (a KV cache is split over heads and "
                f"sequences, not replicated or split over head_dim)"
            )
    return MeshLayout(mesh, batch_axis, kv_heads_axis)
