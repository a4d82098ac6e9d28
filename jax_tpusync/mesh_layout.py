"""How a mesh cache's shards map onto a device mesh (:class:`MeshLayout`).

A low module of its own: the cache (:mod:`jax_tpusync.mesh`) builds a layout, the state's
spec carries it, and the mesh step (:mod:`jax_tpusync.step.sharded`) reads it, so neither
of those two imports the other.
"""

from __future__ import annotations

import dataclasses

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
