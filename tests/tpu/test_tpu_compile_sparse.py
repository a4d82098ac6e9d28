"""The sparse host-pool decode step compiled for a TPU (libtpu's compiler; nothing runs):
``bench tpu-compile --sparse`` for a v5e, two layers, at 128K and 256K tokens (summary
chunks of 512 blocks at both: below 128K tokens a chunk is every block). Its device
memory must not grow with the context (the summaries stay in host memory, scored a chunk
at a time), every unit copy (predicted and late) must have an attention between its start
and its end, and so must each layer's first summary chunk, copied a layer ahead (the
chunks after it are copied while the one before is scored, which is short: measured, not
asserted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

import pytest

# libtpu's wheels are Linux x86_64 only: there the test extra installs it.
REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if importlib.util.find_spec("libtpu") is None:
        if REQUIRED:
            pytest.fail("libtpu is not installed: pip install '.[test]' installs it here")
        pytest.skip("libtpu has no wheel for this platform")
    out = tmp_path_factory.mktemp("tpu") / "tpu_compile.json"
    command = [
        sys.executable, "-m", "jax_tpusync.bench", "tpu-compile", "--sparse",
        "--topologies", "v5e:2x2", "--contexts", "131072", "262144", "--layers", "2",
        "--kinds", "ours", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=900, cwd=out.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Nothing ran on a TPU: " in done.stdout
    assert "v5e:2x2 sparse (budget 0.03, 10% of each selection assumed late)" in done.stdout
    return done.stdout, {row["context"]: row for row in json.loads(out.read_text())["results"]}


@pytest.mark.slow
def test_device_memory_is_flat_in_the_context(report):
    _, rows = report
    short, long = rows[131072], rows[262144]
    assert abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * short[
        "ours_device_mib"
    ]
    # The summaries are in host memory: twice as many at twice the context.
    assert long["summary_host_mib"] > 1.9 * short["summary_host_mib"]


@pytest.mark.slow
def test_unit_copies_and_layer_ahead_summary_copies_span_an_attention(report):
    _, rows = report
    for row in rows.values():
        units, summaries = row["overlap"], row["summary_overlap"]
        # Every unit copy, predicted or late, has an attention between its start and end.
        assert units["copies"] > 0 and units["spanning"] == units["copies"]
        # So has each layer's first summary chunk, copied a layer ahead (2 layers).
        assert summaries["spanning"] >= 2
    # At 128K a layer's summaries are one chunk: every summary copy is a layer ahead.
    one_chunk = rows[131072]["summary_overlap"]
    assert one_chunk["copies"] > 0 and one_chunk["spanning"] == one_chunk["copies"]


@pytest.mark.slow
def test_the_projected_step_is_set_by_the_budget(report):
    _, rows = report
    short, long = rows[131072], rows[262144]
    assert short["selected_blocks"] == 16 and long["selected_blocks"] == 31  # 3% of 512, 1024
    # Twice the context, about twice the sparse step, both far below dense.
    assert long["projected_step_ms"] < 0.1 * long["dense_projected_step_ms"]
    assert short["projected_step_ms"] < long["projected_step_ms"] < 3 * short["projected_step_ms"]
