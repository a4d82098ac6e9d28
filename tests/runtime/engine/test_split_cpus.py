"""split_cpus, each case in a fresh interpreter (it changes the process's CPU affinity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ALLOWED = sorted(os.sched_getaffinity(0))


def run_python(code: str) -> subprocess.CompletedProcess:
    # From the filesystem root: a checkout's source tree must not shadow the installed package.
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd="/",
    )


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs to split")
def test_split_keeps_compute_off_the_engine_cpus():
    proc = run_python(
        "import json, os, jax, jax.numpy as jnp\n"
        "from jax_tpusync import split_cpus\n"
        "kept = split_cpus(1)\n"
        "jnp.ones(3).block_until_ready()  # the backend starts on the compute CPUs\n"
        "print(json.dumps([list(kept), sorted(os.sched_getaffinity(0))]))\n"
    )
    assert proc.returncode == 0, proc.stderr
    kept, compute = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kept == ALLOWED[-1:]
    assert compute == ALLOWED[:-1]


def test_split_needs_a_cpu_left_for_compute():
    proc = run_python(
        "import os\n"
        "from jax_tpusync import split_cpus\n"
        f"print(split_cpus({len(ALLOWED)}), sorted(os.sched_getaffinity(0)))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["()", *str(ALLOWED).split()]


def test_split_after_jax_started_is_an_error():
    proc = run_python(
        "import jax.numpy as jnp\n"
        "from jax_tpusync import split_cpus\n"
        "jnp.ones(3).block_until_ready()\n"
        "split_cpus(1)\n"
    )
    assert proc.returncode != 0
    assert "split_cpus must run before JAX starts its backend" in proc.stderr


def test_engine_cpus_must_be_positive():
    from jax_tpusync import split_cpus

    with pytest.raises(ValueError, match="engine_cpus=0 must be >= 1"):
        split_cpus(0)


def test_importing_the_package_leaves_jax_backends_unstarted():
    proc = run_python(
        "import jax._src.xla_bridge as xb\n"
        "import jax_tpusync, jax_tpusync.bench.decode, jax_tpusync.bench.overlap\n"
        "print(xb.backends_are_initialized())\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
