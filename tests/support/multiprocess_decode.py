"""One process of the two-process mesh test (run by test_multiprocess.py, not collected).

Each process has 2 CPU devices; the (data=2, model=2) mesh puts one data row per process.
Both processes build the same sharded cache on one file-tier directory (a file per shard),
load the same context, run the same decode steps and check their own sequences' logits
against a single-device resident model computed locally, and their shards' tier bytes
against the KV the steps produced. Prints one JSON line with what it found.

Usage: python -m support.multiprocess_decode PROCESS_ID NUM_PROCESSES PORT DIRECTORY
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_tpusync as tps  # noqa: E402

from support import mesh_model  # noqa: E402


def main() -> None:
    process_id, num_processes, port, directory = sys.argv[1:5]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=int(num_processes),
        process_id=int(process_id),
    )
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = mesh_model.MeshTestModel()
    cache = tps.kv_cache(
        **model.cache_args(),
        mesh=mesh,
        kv_heads_axis="model",
        batch_axis="data",
        tier="file",
        path=directory,
        file_name="kv",  # kv-shard0 .. kv-shard3, from both processes.
        overwrite=True,
    )
    report = {"process": jax.process_index(), "shards": sorted(cache.shards)}
    state = model.load_context(cache, cache.init())
    logits, written, state = model.run_offloaded(cache, state, mesh=mesh)
    expected = model.run_resident()
    rows = set()
    for shard in cache.shards:
        rows.update(range(*cache.rows_of(shard).indices(model.batch)))
    rows = sorted(rows)
    report["rows"] = rows
    report["max_err"] = float(
        max(np.abs(got[rows] - want[rows]).max() for got, want in zip(logits, expected))
    )
    report["tier_exact"] = model.tier_matches(cache, state, written)
    cache.close(state)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
