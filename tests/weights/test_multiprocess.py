"""A trainer group (2 processes x 2 CPU devices, FSDP over 4) publishes; a sampler group (2
processes x 1 device, tensor-parallel over 2) pulls. Trainer process 1 is killed before
version 2: both groups see version 2 refused by name within their deadline, and the
samplers keep version 1."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from support import child_env
from support import weights_support as ws


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_group(role: str, n: int, directory: Path, cwd: Path) -> list[subprocess.Popen]:
    port = _free_port()
    env = child_env()
    env.pop("XLA_FLAGS", None)  # Each process sets its own device count.
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "support.weight_peers",
                role,
                str(i),
                str(n),
                str(port),
                str(directory),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        for i in range(n)
    ]


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, dict | None, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            lines = stdout.strip().splitlines()
            out.append((p.returncode, json.loads(lines[-1]) if lines else None, stderr[-3000:]))
    finally:
        for p in procs:
            p.kill()
    return out


@pytest.mark.slow
def test_trainer_and_sampler_groups_with_a_killed_publisher(tmp_path):
    directory = tmp_path / "weights"
    trainers = _finish(_run_group("trainer", 2, directory, tmp_path))
    (rc0, t0, err0), (rc1, t1, _) = trainers
    assert rc0 == 0, err0
    assert rc1 == -signal.SIGKILL and t1 is None  # Killed before it reported.
    # Process 0 wrote only its own shards of version 1: half of every leaf's rows (rows
    # over 4 devices, 2 of them its own) and the scalar (replica 0 is on its device 0).
    leaves = jax.tree.leaves(ws.host_params(1))
    assert t0["v1_bytes"] == sum(x.nbytes for x in leaves if x.ndim) // 2 + 4
    assert t0["v2_missing"] == [1]
    assert t0["v2"].startswith(
        "weights version 2 is incomplete: no part from process(es) [1] "
        "of 2 publishing processes after waiting 1 s"
    )
    samplers = _finish(_run_group("sampler", 2, directory, tmp_path))
    for rc, report, err in samplers:
        assert rc == 0, err
        assert report["v1_version"] == 1 and report["v1_equal"] and report["v1_sharding"]
        # Each process received exactly its own shards' bytes.
        assert sum(report["device_bytes"].values()) == report["own_bytes"]
        assert report["v2"].startswith(
            "weights version 2 is incomplete: no part from process(es) [1] of 2"
        )
        assert report["v2"].endswith("previous params (version 1) kept")
        assert report["kept_version"] == 1 and report["kept_params"]
        assert report["latest_after"] == 1
