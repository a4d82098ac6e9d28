"""The fetch overlaps the compute placed between start_fetch and wait_fetch.

Asserted from the engine timeline (ordering of timestamps, not wall-clock speed-ups), under
XLA:CPU's default scheduler in this process and under the memory-optimized scheduler in a
fresh process (XLA_FLAGS are read once, when the backend starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

MiB = 1 << 20
MEMORY_OPTIMIZED_FLAG = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
SUBPROCESS_TIMEOUT_S = 240


def measure_overlap(kind: str, directory: str, nbytes: int = 64 * MiB) -> dict:
    """Runs one jitted start -> mark -> compute -> mark -> wait step; returns its events."""
    import jax
    import jax.numpy as jnp

    from jax_tpusync.runtime import ops
    from jax_tpusync.runtime.engine import Engine

    block = MiB
    with Engine(record_timeline=True, num_workers=2) as e:
        if kind == "host":
            tier = e.add_host_tier(block_bytes=block, num_blocks=nbytes // block + 1)
        else:
            tier = e.add_file_tier(directory, block_bytes=block, num_blocks=nbytes // block + 1)
        data = (np.arange(nbytes // 4, dtype=np.uint32) * 2654435761).astype(np.uint32)
        e.write(tier, 4096, data)
        segs = jnp.asarray(ops.segment_rows([4096], [0], [nbytes], block))
        tag = np.array([3, 0], np.int32)

        def step(x, w, dst, segs):
            x, ticket = ops.start_fetch(
                e.id, tier, x, segs, tag, dst_bytes=ops.buffer_bytes(dst)
            )
            x = ops.mark(e.id, ops.MARK_COMPUTE_BEGIN, x, tag)
            y = x
            for _ in range(3):  # ~50-100 ms of matmuls on a small CPU.
                y = jnp.tanh(y @ w)
            y = ops.mark(e.id, ops.MARK_COMPUTE_END, y, tag)
            dst = ops.wait_fetch(e.id, tier, dst, ticket, segs, tag, deps=(y,))
            return y, dst

        fn = jax.jit(step, donate_argnums=(2,))
        x = jnp.full((1024, 1024), 0.01, jnp.float32)
        w = jnp.full((1024, 1024), 0.001, jnp.float32)
        fn(x, w, jnp.zeros(nbytes // 4, jnp.uint32), segs)[1].block_until_ready()  # Compile.
        e.timeline()
        e.reset_stats()
        y, dst = fn(x, w, jnp.zeros(nbytes // 4, jnp.uint32), segs)
        dst = np.asarray(dst)
        tl = e.timeline()
        stats = e.stats()
    (fetch,) = [r for r in tl.transfers if r[2] == 0]
    marks = {m[0]: m[3] for m in tl.marks}
    (wait,) = [w_ for w_ in tl.waits if w_[0] == fetch[0]]
    return {
        "data_ok": bool(np.array_equal(dst, data)),
        "fetch_bytes": fetch[5],
        "fetch_tag": [fetch[3], fetch[4]],
        "submit_ns": fetch[6],
        "start_ns": fetch[7],
        "end_ns": fetch[8],
        "compute_begin_ns": marks[ops.MARK_COMPUTE_BEGIN],
        "compute_end_ns": marks[ops.MARK_COMPUTE_END],
        "wait_begin_ns": wait[3],
        "wait_end_ns": wait[4],
        "prefetch_hits": stats["prefetch_hits"],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _check(r: dict, kind: str, nbytes: int = 64 * MiB) -> None:
    assert r["data_ok"]
    assert r["fetch_bytes"] == nbytes and r["fetch_tag"] == [3, 0]
    assert r["prefetch_hits"] == 1
    if kind == "host":
        # Memory defers its fetches to the wait (a read ahead would copy every byte twice,
        # into landing memory and then into the operand): the read runs inside the wait.
        assert r["submit_ns"] >= r["compute_end_ns"], r
        assert r["submit_ns"] <= r["start_ns"] <= r["end_ns"] <= r["wait_end_ns"], r
        return
    # Queued before the compute began; the compute ran ~tens of ms.
    assert r["submit_ns"] <= r["compute_begin_ns"] < r["compute_end_ns"]
    # The copy ran while the compute ran: it started before the compute ended and ended
    # after the compute began.
    assert r["start_ns"] < r["compute_end_ns"], r
    assert r["end_ns"] > r["compute_begin_ns"], r
    # The wait was not hoisted above the compute it should overlap.
    assert r["wait_begin_ns"] >= r["compute_end_ns"], r
    assert r["wait_end_ns"] >= r["end_ns"]


@pytest.mark.parametrize("kind", ("host", "file"))
def test_overlap_default_scheduler(kind, file_dir):
    _check(measure_overlap(kind, file_dir), kind)


@pytest.mark.parametrize("kind", ("host", "file"))
def test_overlap_memory_optimized_scheduler(kind, file_dir):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + MEMORY_OPTIMIZED_FLAG).strip()
    env["JAX_PLATFORMS"] = "cpu"
    code = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('overlap_probe', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "print('RESULT ' + json.dumps(m.measure_overlap(sys.argv[2], sys.argv[3])))\n"
    )
    # Run from the test directory, not the source tree, so the installed package is used.
    proc = subprocess.run(
        [sys.executable, "-c", code, __file__, kind, file_dir],
        env=env,
        cwd=os.path.dirname(__file__),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    r = json.loads(line[len("RESULT ") :])
    assert MEMORY_OPTIMIZED_FLAG in r["xla_flags"]
    _check(r, kind)
