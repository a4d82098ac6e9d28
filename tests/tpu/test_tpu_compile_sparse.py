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
    assert (
        abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * short["ours_device_mib"]
    )
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


def test_the_sparse_projection_counts_summaries_selection_and_late_share():
    """Without compiling: a global layer reads its summaries, its selection and
    ``--late-share`` of it again, a sliding layer its window; per chip; the summary line
    compares each context's step with the dense step at the first."""
    import argparse

    import jax.numpy as jnp

    from jax_tpusync.bench import tiny_decoder
    from jax_tpusync.bench.tpu_compile import sparse_read, summary

    shape = tiny_decoder.Shape(
        layers=2, batch=2, q_heads=8, kv_heads=2, head_dim=64, ffn=0, context=131072,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    args = argparse.Namespace(sparse=0.03, late_share=0.25, block_tokens=256)
    overlap = dict(computations=2, copies=4, started_before=0, overlapped=0, spanning=3)
    ours = dict(
        selected_blocks=16, context_blocks=512, summary_layer_bytes=4 << 20,
        summary_chunk_blocks=512, summary_host_mib=2.0, summary_overlap=overlap,
    )  # fmt: skip
    block_bytes = 2 * 256 * 2 * 64 * 2
    read, fields = sparse_read(args, shape, ours, [None, 1024], 2)
    global_layer = 2 * 16 * 1.25 * block_bytes
    sliding_layer = 2 * 2 * 1024 * 2 * 64 * 2
    # The blocks split over the 2 chips; the summaries are one chip's already.
    assert read == (global_layer + sliding_layer) / 2 + (4 << 20)
    assert fields["summary_mib_per_step"] == 4.0 and fields["summary_overlapped"] == "3/4"
    assert fields["selected_blocks"] == 16 and fields["late_share"] == 0.25

    row = dict(
        topology="v5e:2x2", context=131072, implementation="pallas", chips=1, dp=1, tp=1,
        ours_device_mib=700.0, plain_device_mib=None, plain_note="not compiled (--kinds)",
        resident_device_mib=None, resident_note="not compiled (--kinds)", weights_mib=600.0,
        staging_mib=64.0, pool_mib=100.0, max_step_tokens=None, link_gbps=13.0,
        link_source="a source", projected_step_ms=1.0, dense_projected_step_ms=4.0,
        overlap=dict(computations=2, copies=8, started_before=8, overlapped=8, spanning=8),
        ran_on_tpu=False, **fields,
    )  # fmt: skip
    longer = dict(row, context=262144, projected_step_ms=2.0, dense_projected_step_ms=8.0)
    assert (
        "v5e:2x2 sparse (budget 0.03, 25% of each selection assumed late): projected step"
        " against the dense step at 128K (4.0 ms): 0.25x at 128K, 0.50x at 256K; summaries"
        " 4 MiB at every context copied per step; 16 of 16 unit copies (predicted and late)"
        " and 6 of 8 summary chunk copies have an attention, a layer's unit walk or a scoring"
        " between their start and their end"
    ) in summary([row, longer]).splitlines()


@pytest.mark.slow
def test_the_sparse_step_over_a_heads_mesh_compiles_with_its_copies_overlapped(tmp_path):
    """The heads split over the 4 chips of a v5e 2x2, each chip selecting its own blocks
    from its own heads' summaries: it compiles, every unit copy spans an attention, each
    layer's first summary chunk is copied a layer ahead, and a step copies a chip's
    summaries (its heads') once per global layer."""
    if importlib.util.find_spec("libtpu") is None:
        if REQUIRED:
            pytest.fail("libtpu is not installed: pip install '.[test]' installs it here")
        pytest.skip("libtpu has no wheel for this platform")
    out = tmp_path / "tpu_compile.json"
    command = [
        sys.executable, "-m", "jax_tpusync.bench", "tpu-compile", "--sparse",
        "--heads-over-chips", "--topologies", "v5e:2x2", "--contexts", "131072",
        "--layers", "2", "--kinds", "ours", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert (row["chips"], row["dp"], row["tp"]) == (4, 1, 4)
    units, summaries = row["overlap"], row["summary_overlap"]
    assert units["copies"] > 0 and units["spanning"] == units["copies"]
    assert summaries["spanning"] >= 2  # Two layers' first chunks, each a layer ahead.
    # A chip's summaries: its 2 of the 8 KV heads x 128 channels, lo and hi in bf16, of
    # each of 512 blocks, per global layer.
    assert row["summary_mib_per_step"] == 2 * 512 * 2 * 128 * 2 * 2 / 2**20
