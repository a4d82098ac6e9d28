"""Layout pairs on 8 simulated CPU devices, each published and pulled in one process: the
pulled params are bitwise the published ones, with the target sharding, and every device
received exactly what its shards hold. Run by test_layouts_eight_devices.py in a process of
its own (XLA_FLAGS sets the device count before JAX starts)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

from support import weights_support as ws


@pytest.fixture(autouse=True)
def eight_devices():
    assert len(jax.devices()) >= 8, (
        "needs 8 simulated devices: run tests/weights/test_layouts_eight_devices.py, or set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )


def by_rank(specs: dict[int, P]):
    """A spec per leaf by its number of dimensions."""
    return lambda path, ndim: specs.get(ndim, P())


# (name, source devices, mesh shape, axis names, spec by ndim; same for the destination)
LAYOUTS = {
    "replicated8": (slice(0, 8), (8,), ("r",), {}),
    "fsdp8": (slice(0, 8), (8,), ("fsdp",), {1: P("fsdp"), 2: P("fsdp"), 3: P("fsdp")}),
    "fsdp4": (slice(0, 4), (4,), ("fsdp",), {1: P("fsdp"), 2: P("fsdp"), 3: P("fsdp")}),
    "tp2": (slice(4, 6), (2,), ("tp",), {2: P(None, "tp"), 3: P(None, None, "tp")}),
    "tp8": (slice(0, 8), (8,), ("tp",), {1: P("tp"), 2: P(None, "tp"), 3: P("tp")}),
    "dp2xtp4": (
        slice(0, 8),
        (2, 4),
        ("dp", "tp"),
        {1: P("tp"), 2: P("dp", "tp"), 3: P("dp", None, "tp")},
    ),
    "tp4xdp2_swapped": (
        slice(0, 8),
        (4, 2),
        ("tp", "dp"),
        {1: P("dp"), 2: P("tp", "dp"), 3: P(None, "tp", "dp")},
    ),
    "2x2_two_axes_on_dim0": (
        slice(4, 8),
        (2, 2),
        ("a", "b"),
        {1: P(("a", "b")), 2: P(("b", "a")), 3: P(("a", "b"))},
    ),
    "2x2_partly_replicated": (slice(2, 6), (2, 2), ("a", "b"), {2: P(None, "b"), 3: P("a")}),
    "one_device": (slice(7, 8), (1,), ("x",), {}),
}

PAIRS = [
    ("fsdp4", "tp2"),
    ("replicated8", "fsdp8"),
    ("fsdp8", "replicated8"),
    ("dp2xtp4", "tp4xdp2_swapped"),
    ("tp8", "2x2_two_axes_on_dim0"),
    ("2x2_partly_replicated", "dp2xtp4"),
    ("one_device", "tp8"),
    ("fsdp8", "one_device"),
    ("fsdp4", "fsdp4"),
]


def layout(name: str, params):
    devices, shape, names, specs = LAYOUTS[name]
    mesh = ws.mesh_of(jax.devices()[devices], shape, names)
    return mesh, ws.specs_like(params, by_rank(specs))


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_layout_pair(source, target, tmp_path):
    params = ws.host_params(4)
    src_mesh, src_specs = layout(source, params)
    dst_mesh, dst_specs = layout(target, params)
    with WeightPublisher(tmp_path) as pub:
        pub.publish(ws.shard(params, src_mesh, src_specs), 1)
    # Each unique shard written once, whatever the replication.
    assert pub.stats.nbytes == sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    targets = ws.shardings(dst_mesh, dst_specs)
    puller = WeightPuller(tmp_path, timeout_s=5)
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)


def test_same_layout_reads_each_shard_whole(tmp_path):
    """Same layout on both sides: each destination shard is one piece, one source shard."""
    params = ws.host_params(5)
    mesh, specs = layout("dp2xtp4", params)
    with WeightPublisher(tmp_path) as pub:
        pub.publish(ws.shard(params, mesh, specs), 1)
    puller = WeightPuller(tmp_path, timeout_s=5)
    targets = ws.shardings(mesh, specs)
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)
    (plan,) = puller.plans.plans().values()
    for leaf in plan.leaves:
        for block in leaf.blocks:
            assert len(block.pieces) == 1
            assert block.pieces[0].elements == int(np.prod(block.shape))


def test_uneven_target_is_refused_by_name(tmp_path):
    params = {"w": np.arange(30, dtype=np.float32).reshape(10, 3)}
    mesh2 = ws.mesh_of(jax.devices()[:2], (2,), ("x",))
    with WeightPublisher(tmp_path) as pub:
        pub.publish(ws.shard(params, mesh2, {"w": P("x")}), 1)
    mesh4 = ws.mesh_of(jax.devices()[:4], (4,), ("x",))
    puller = WeightPuller(tmp_path, timeout_s=5)
    with pytest.raises(
        ValueError,
        match=r"leaf \['w'\]: target sharding .* does not split shape "
        r"\(10, 3\) evenly",
    ):
        puller.pull({"w": NamedSharding(mesh4, P("x"))})
    # Divisible by 5 (10 rows over 5 devices): the edge on the other side works.
    mesh5 = ws.mesh_of(jax.devices()[:5], (5,), ("x",))
    targets = {"w": NamedSharding(mesh5, P("x"))}
    ws.check_pulled(puller.pull(targets), params, targets, puller.stats)
