"""Runs support/layout_cases_8dev.py in a process of its own with 8 simulated CPU devices (this
process's device count was fixed when JAX started)."""

from __future__ import annotations

import subprocess
import sys

from support import TESTS, child_env


def test_layout_pairs_on_eight_devices(tmp_path):
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(TESTS / "support" / "layout_cases_8dev.py"),
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "cases"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
        cwd=tmp_path,  # Not the source tree, whose package has no built extension.
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
