"""Hybrid models: layers of several KV geometries, grouped, and the state a step carries.

A hybrid decoder (Gemma 3: five sliding-window layers per global one; Gemma 4: sliding
layers of 16 KV heads x 256 beside global ones of 4 x 512, and late layers that store no KV
of their own but read an earlier layer's) has no single KV geometry. Its layers fall into
*groups* of one geometry each (KV heads, head size, sliding window), and each group is an
ordinary offloaded cache of its own: its own tier region, blocks, block tables and staging
(a sliding group keeps only its window, see :mod:`jax_tpusync.core.window_ring`). A layer that
*reads another layer's KV* (``kv_sharing``) stores nothing: it attends over its source's
rows, and takes the source's new rows of the step from the state (the source left them
there).

:func:`plan_groups` validates the per-layer description and plans the groups
(:class:`LayerGroups`, static and hashable); :class:`HybridState` is the pytree a jitted step
carries: one :class:`~jax_tpusync.core.state.KVState` per group, the step's starting lengths, and
the step's new rows of every layer some other layer reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.core.state import KVState


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class Group:
    """One geometry's layers: ``layers`` the model layers that store KV in it (in order;
    the group's cache's layer ``i`` is model layer ``layers[i]``)."""

    num_kv_heads: int
    head_dim: int
    window: int | None
    layers: tuple[int, ...]

    def describe(self) -> str:
        kind = "global" if self.window is None else f"sliding window {self.window}"
        return f"{self.num_kv_heads} KV heads x {self.head_dim}, {kind}"


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """Per model layer: its group, its index in that group's cache, and, for a layer that
    reads another's KV, that source. Static (rides in jit as aux data)."""

    num_layers: int
    groups: tuple[Group, ...]
    group_of: tuple[int, ...]  # per model layer
    local_of: tuple[int, ...]  # per model layer: its (or its source's) layer in the group
    source_of: tuple[int | None, ...]  # per model layer: the layer whose KV it reads, or None
    sources: tuple[int, ...]  # model layers some other layer reads, in order

    def group(self, layer: int) -> Group:
        return self.groups[self.group_of[layer]]

    def pending_index(self, source: int) -> int:
        """Where ``source``'s new rows of the step sit in :attr:`HybridState.pending`."""
        return self.sources.index(source)

    def describe_layer(self, layer: int) -> str:
        return f"layer {layer} ({self.group(layer).describe()})"


def per_layer(name: str, value: Any, num_layers: int, *, allow_none: bool) -> tuple:
    """One value per layer from an int (every layer) or a sequence of ``num_layers``."""
    if _is_int(value) or (allow_none and value is None):
        return (value,) * num_layers
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"{name}={value!r} must be an int or a sequence of one value per layer ({num_layers})"
        )
    values = tuple(value)
    if len(values) != num_layers:
        raise ValueError(f"{name} has {len(values)} entries for {num_layers} layers")
    return values


def plan_groups(
    num_layers: int,
    num_kv_heads: int | Sequence[int],
    head_dim: int | Sequence[int],
    windows: Sequence[int | None],
    kv_sharing: Sequence[int | None] | None = None,
) -> LayerGroups:
    """The groups of a model whose layer ``l`` has ``num_kv_heads[l]`` KV heads of
    ``head_dim[l]``, sliding window ``windows[l]`` (None: global), and reads layer
    ``kv_sharing[l]``'s KV instead of storing its own (None: it stores its own).

    Raises:
      ValueError: a sequence of the wrong length, a non-positive size, or a layer reading a
        layer that is not earlier, reads another layer itself, or has another geometry or
        window (each naming the layers).
    """
    heads = per_layer("num_kv_heads", num_kv_heads, num_layers, allow_none=False)
    dims = per_layer("head_dim", head_dim, num_layers, allow_none=False)
    for name, values in (("num_kv_heads", heads), ("head_dim", dims)):
        for layer, x in enumerate(values):
            if not _is_int(x) or x < 1:
                raise ValueError(f"{name} of layer {layer} is {x!r}: it must be a positive int")
    sharing = (None,) * num_layers if kv_sharing is None else tuple(kv_sharing)
    if len(sharing) != num_layers:
        raise ValueError(f"kv_sharing has {len(sharing)} entries for {num_layers} layers")
    kinds = [(int(h), int(d), w) for h, d, w in zip(heads, dims, windows)]

    def describe(layer: int) -> str:
        h, d, w = kinds[layer]
        return f"{h} KV heads x {d}, " + ("global" if w is None else f"sliding window {w}")

    for layer, source in enumerate(sharing):
        if source is None:
            continue
        if not _is_int(source) or not 0 <= source < layer:
            raise ValueError(
                f"kv_sharing[{layer}]={source!r}: a layer reads the KV of an earlier layer "
                f"(an int in [0, {layer}))"
            )
        if sharing[source] is not None:
            raise ValueError(
                f"kv_sharing[{layer}]={source}: layer {source} reads layer "
                f"{sharing[source]}'s KV itself; name the layer that stores it"
            )
        if kinds[source] != kinds[layer]:
            raise ValueError(
                f"kv_sharing[{layer}]={source}: layer {layer} ({describe(layer)}) cannot "
                f"read layer {source}'s KV ({describe(source)}): the geometry and window "
                f"must be the same"
            )
    order: list[tuple[int, int, int | None]] = []
    members: dict[tuple, list[int]] = {}
    for layer, kind in enumerate(kinds):
        if sharing[layer] is None:
            if kind not in members:
                order.append(kind)
                members[kind] = []
            members[kind].append(layer)
    groups = tuple(Group(h, d, w, tuple(members[(h, d, w)])) for h, d, w in order)
    group_of, local_of = [], []
    for layer, kind in enumerate(kinds):
        g = order.index(kind)
        stored = layer if sharing[layer] is None else int(sharing[layer])
        group_of.append(g)
        local_of.append(groups[g].layers.index(stored))
    return LayerGroups(
        num_layers=num_layers,
        groups=groups,
        group_of=tuple(group_of),
        local_of=tuple(local_of),
        source_of=tuple(None if s is None else int(s) for s in sharing),
        sources=tuple(sorted({int(s) for s in sharing if s is not None})),
    )


@jax.tree_util.register_pytree_node_class
class HybridState:
    """What a jitted step carries for a :class:`~jax_tpusync.caches.hybrid.cache.HybridKVCache`.

    Fields:
      groups: one :class:`KVState` per group (``plan.groups``).
      step_lengths: int32[batch], every slot's length when the step began (the groups'
        lengths grow after their own last layer; a layer reading another's KV after that
        still attends as of the step's start).
      pending: per layer some other layer reads (``plan.sources``),
        [2, batch, max_step_tokens, num_kv_heads, head_dim] in the cache's dtype: that
        layer's new K/V rows of the current step (its first ``q_len``), which its readers
        attend to as their own.
    """

    def __init__(self, plan: LayerGroups, groups, step_lengths, pending):
        self.plan = plan
        self.groups = tuple(groups)
        self.step_lengths = step_lengths
        self.pending = tuple(pending)

    def tree_flatten(self):
        return (self.groups, self.step_lengths, self.pending), self.plan

    @classmethod
    def tree_unflatten(cls, plan, children):
        groups, step_lengths, pending = children
        return cls(plan, groups, step_lengths, pending)

    @property
    def lengths(self) -> jax.Array:
        """int32[batch]: tokens cached per slot (the same in every group between steps); a
        mesh cache's groups hold [shards, batch / dp] each, read as the global slots."""
        lengths = self.groups[0].lengths
        layout = self.groups[0].spec.mesh
        if layout is None:
            return lengths
        # Shard d * tp + t holds slots [d * b, (d + 1) * b), every t alike (a reduction
        # over t, where a slice of a sharded axis would not lower).
        return lengths.reshape(layout.dp, layout.tp, -1).max(axis=1).reshape(-1)

    def positions(self, q_len: int) -> jax.Array:
        """int32[batch, q_len]: each slot's next positions, ``lengths[:, None] +
        arange(q_len)`` (the global slots' on a mesh)."""
        return self.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)

    def replace(self, **changes) -> HybridState:
        fields = dict(groups=self.groups, step_lengths=self.step_lengths, pending=self.pending)
        fields.update(changes)
        return HybridState(self.plan, **fields)

    def with_group(self, g: int, state: KVState) -> HybridState:
        groups = list(self.groups)
        groups[g] = state
        return self.replace(groups=tuple(groups))

    def __repr__(self) -> str:
        return f"HybridState(lengths={self.lengths}, groups={len(self.groups)})"
