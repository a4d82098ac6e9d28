"""Helpers of the weight-sync tests: deterministic params, sharding them, and checking a
pulled pytree against the published values, shard by shard."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def host_params(seed: int = 0) -> dict[str, Any]:
    """A small model's params (host arrays): bf16 matrices, an f32 vector, int32 ids, a
    scalar, a 3-D tensor."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((32, 16)).astype(jnp.bfloat16),
        "layers": [
            {
                "wq": rng.standard_normal((16, 24)).astype(jnp.bfloat16),
                "norm": rng.standard_normal((16,)).astype(np.float32),
            }
            for _ in range(2)
        ],
        "experts": rng.standard_normal((8, 16, 8)).astype(jnp.bfloat16),
        "ids": np.arange(8, dtype=np.int32) * (seed + 1),
        "step": np.array(seed, dtype=np.int32),
    }


def flat_with_paths(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), x) for p, x in flat]


def fsdp(path: str, ndim: int) -> P:
    """Leading axis over "fsdp" (a spec_for of :func:`specs_like`); scalars replicated."""
    return P("fsdp") if ndim else P()


def tp(path: str, ndim: int) -> P:
    """Columns (the last axis) over "tp"; vectors and scalars replicated."""
    return P(*([None] * (ndim - 1)), "tp") if ndim >= 2 else P()


def mesh_of(devices: list, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.asarray(devices).reshape(shape), names)


def specs_like(params: Any, spec_for: Any) -> Any:
    """A PartitionSpec per leaf: ``spec_for(path, ndim)``."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(jax.tree_util.keystr(p), np.ndim(x)), params
    )


def shard(params: Any, mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def shardings(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def bits(x: Any) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(x))
    return a.reshape(-1).view(np.uint8)


def check_pulled(
    pulled: Any, expected: Any, targets: Any, stats: Any, published: Any = None
) -> None:
    """Every leaf bitwise equal with its target sharding; every device's shards equal the
    expected values at their index; the bytes each device received what its shards hold;
    the bytes read those of each distinct shard once, in the ``published`` dtypes (default:
    those of ``expected``)."""
    flat_published = jax.tree.leaves(expected if published is None else published)
    flat_pulled = jax.tree.leaves(pulled)
    flat_expected = jax.tree.leaves(expected)
    flat_targets = jax.tree.leaves(targets, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    assert len(flat_pulled) == len(flat_expected) == len(flat_targets)
    per_device: dict[int, int] = {}
    distinct = 0
    for got, want, target, source in zip(
        flat_pulled, flat_expected, flat_targets, flat_published, strict=True
    ):
        assert isinstance(got, jax.Array)
        assert got.sharding == target, (got.sharding, target)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(bits(got), bits(want))
        boxes = set()
        for s in got.addressable_shards:
            np.testing.assert_array_equal(bits(s.data), bits(np.asarray(want)[s.index]))
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
            boxes.add(tuple((i.start, i.stop) for i in s.index))
        distinct += (
            sum(
                int(np.prod([(b or n) - (a or 0) for (a, b), n in zip(box, want.shape)]))
                for box in boxes
            )
            * np.dtype(source.dtype).itemsize
        )
    assert stats.device_bytes == per_device
    assert stats.bytes_read == distinct
