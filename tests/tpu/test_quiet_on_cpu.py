"""A JAX process in the test environment prints no libtpu error on a machine without a TPU.

The test extra installs libtpu for tests/tpu's compiles; on a CPU machine libtpu otherwise
prints errors about its accelerator type and worker hostnames from every JAX process that
starts a backend.
"""

from __future__ import annotations

import subprocess
import sys

from jax_tpusync.runtime.libtpu import LIBTPU_ENVIRONMENT, has_tpu_chip

from support import child_env

# Lines libtpu prints when it starts without a TPU and without its settings.
LIBTPU_ERRORS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "E0000", "host bounds")


def test_a_plain_jax_process_prints_no_tpu_error():
    done = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices())"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if not has_tpu_chip():
        assert "CpuDevice" in done.stdout or "CudaDevice" in done.stdout, done.stdout
    noisy = [line for line in done.stderr.splitlines() if any(e in line for e in LIBTPU_ERRORS)]
    assert not noisy, done.stderr[-3000:]


def started_without_the_settings(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` as a user's own script: without the suite's libtpu settings, from
    outside the source tree (whose package has no built extension); asserted quiet."""
    env = {k: v for k, v in child_env().items() if k not in LIBTPU_ENVIRONMENT}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    noisy = [line for line in done.stderr.splitlines() if any(e in line for e in LIBTPU_ERRORS)]
    assert not noisy, done.stderr[-3000:]
    return done


def test_a_plain_jax_process_without_the_settings_prints_no_tpu_error():
    """A user's JAX-only script in this environment, started without the suite's settings
    and without importing jax_tpusync: the installed JAX plugin hook gives libtpu its
    settings before the first backend starts."""
    done = started_without_the_settings("import jax; print(jax.devices())")
    if not has_tpu_chip():
        assert "CpuDevice" in done.stdout or "CudaDevice" in done.stdout, done.stdout


def test_a_users_script_importing_the_package_prints_no_tpu_error():
    """A script of the user's own, started without the suite's settings: importing
    jax_tpusync first is enough."""
    started_without_the_settings("import jax_tpusync, jax; print(jax.devices())")
