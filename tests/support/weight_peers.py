"""One process of a trainer or sampler group for test_multiprocess.py (jax.distributed on
localhost, simulated CPU devices). Prints one JSON line: what it saw.

    python -m support.weight_peers trainer PROCESS NUM_PROCESSES PORT DIR
    python -m support.weight_peers sampler PROCESS NUM_PROCESSES PORT DIR

Trainer: 2 devices per process, FSDP over all of them; publishes version 1, then process 1
is killed (SIGKILL) before version 2, so version 2 stays incomplete. Sampler: 1 device per
process, tensor-parallel over all of them; pulls version 1, is refused version 2 and keeps
version 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys

role, process, num_processes, port, directory = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
devices_per_process = 2 if role == "trainer" else 1
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tpusync.weights.records import IncompleteVersionError
from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

from support import weights_support as ws

jax.distributed.initialize(f"localhost:{port}", num_processes, process)


def global_params(mesh, specs, seed):
    """The same params on every process, as global arrays (each process its own shards)."""
    host = ws.host_params(seed)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, s), lambda index, x=x: x[index]
        ),
        host,
        specs,
    )


def shards_equal(pulled, host) -> bool:
    for got, want in zip(jax.tree.leaves(pulled), jax.tree.leaves(host), strict=True):
        for s in got.addressable_shards:
            if not np.array_equal(ws.bits(s.data), ws.bits(np.asarray(want)[s.index])):
                return False
    return True


report: dict = {"role": role, "process": process}
if role == "trainer":
    mesh = ws.mesh_of(jax.devices(), (jax.device_count(),), ("fsdp",))
    specs = ws.specs_like(ws.host_params(), lambda p, n: P("fsdp") if n else P())
    pub = WeightPublisher(directory)
    pub.publish(global_params(mesh, specs, 1), 1)
    pub.wait()
    pub.wait_complete(1, timeout_s=60)
    report["v1_bytes"] = pub.stats.nbytes
    if process == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # Dies before its part of version 2.
    pub.publish(global_params(mesh, specs, 2), 2)
    pub.wait()
    try:
        pub.wait_complete(2, timeout_s=1.0)
        report["v2"] = "complete"
    except IncompleteVersionError as e:
        report["v2"] = str(e)
        report["v2_missing"] = list(e.missing)
else:
    mesh = ws.mesh_of(jax.devices(), (jax.device_count(),), ("tp",))
    specs = ws.specs_like(
        ws.host_params(), lambda p, n: P(*([None] * (n - 1)), "tp") if n >= 2 else P()
    )
    targets = ws.shardings(mesh, specs)
    puller = WeightPuller(directory, timeout_s=60)
    pulled = puller.pull(targets)
    report["v1_version"] = puller.version
    report["v1_equal"] = shards_equal(pulled, ws.host_params(1))
    report["v1_sharding"] = all(
        x.sharding == t for x, t in zip(jax.tree.leaves(pulled), jax.tree.leaves(targets))
    )
    report["device_bytes"] = puller.stats.device_bytes
    report["own_bytes"] = sum(
        s.data.nbytes for x in jax.tree.leaves(pulled) for s in x.addressable_shards
    )
    try:
        puller.pull(targets, 2, timeout_s=1.0)
        report["v2"] = "pulled"
    except IncompleteVersionError as e:
        report["v2"] = str(e)
    report["kept_version"] = puller.version
    report["kept_params"] = puller.params is pulled
    report["latest_after"] = puller.pull(targets) is pulled and puller.version
print(json.dumps(report), flush=True)
# The trainer group lost a process: skip the distributed shutdown's barrier.
os._exit(0)
