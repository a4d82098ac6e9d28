"""A Gemma-4-like hybrid model's decode step over host-pool layer groups
(``HybridKVCache(host_pool=True)``, what ``kv_cache()`` makes for it on a TPU) compiled for
a v5e with the Pallas attention kernel (libtpu's compiler; nothing runs): its device memory
is the weights and the groups' staging, the same at 32K and 1M tokens, while the pools
(host memory) grow 32-fold."""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys

import pytest

from support import child_env

# libtpu's wheels are Linux x86_64 only: there the test extra installs it (as
# test_tpu_compile.py says), and a missing one is a failure, not a skip.
REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.mark.slow
def test_the_hybrid_pool_step_compiles_bounded_at_any_context(tmp_path):
    if importlib.util.find_spec("libtpu") is None:
        if REQUIRED:
            pytest.fail("libtpu is not installed: pip install '.[test]' installs it here")
        pytest.skip("libtpu has no wheel for this platform")
    done = subprocess.run(
        [sys.executable, "-m", "support.compile_hybrid_pool", "v5e:2x2", "32768", "1048576"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env=child_env(JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["context"] for row in rows] == [32768, 1048576]
    for row in rows:
        assert row["groups"] == 2  # Sliding 4 x 128 and global 2 x 256.
        # The weights, each group's two units (attended, in flight) and, while a layer's
        # first unit is copied, one more: measured 133.1 MiB of 80 + 35.
        budget = row["weights_mib"] + 1.5 * row["staging_mib"] + row["pending_mib"]
        assert row["device_mib"] <= 1.05 * budget, row
    short, long = rows
    assert long["pool_mib"] >= 30 * short["pool_mib"]  # Host memory grows with the context.
    assert abs(long["device_mib"] - short["device_mib"]) <= 0.01 * short["device_mib"]
