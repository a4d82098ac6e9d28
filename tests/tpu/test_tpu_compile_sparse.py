"""The sparse host-pool decode step compiled for TPUs (libtpu's compiler; nothing runs):
``bench tpu-compile --sparse`` for a v5e, a v6e and a TPU7x, two layers, at 32K and 128K
tokens (summary chunks of 64 blocks: two a layer at 32K, eight at 128K). Its device memory
must not grow with the context (the summaries stay in host memory, scored a chunk at a
time, in chunks of one size), every unit copy (predicted and late) must have an attention
between its start and its end, and every summary chunk copy (the next layer's first
included, copied while the layer's last chunk is scored) an attention, a walk or a scoring.
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
TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "tpu7x:2x2x1")
SHORT, LONG = 32768, 131072


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if importlib.util.find_spec("libtpu") is None:
        if REQUIRED:
            pytest.fail("libtpu is not installed: pip install '.[test]' installs it here")
        pytest.skip("libtpu has no wheel for this platform")
    out = tmp_path_factory.mktemp("tpu") / "tpu_compile.json"
    command = [
        sys.executable, "-m", "jax_tpusync.bench", "tpu-compile", "--sparse",
        "--topologies", *TOPOLOGIES, "--contexts", str(SHORT), str(LONG), "--layers", "2",
        "--kinds", "ours", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=1500, cwd=out.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Nothing ran on a TPU: " in done.stdout
    from jax_tpusync.bench.tpu_compile import LATE_SHARE

    measured = f"{LATE_SHARE:.0%} of each selection late, measured: "
    assert f"v5e:2x2 sparse (budget 0.03, {measured}" in done.stdout
    results = json.loads(out.read_text())["results"]
    return done.stdout, {(row["topology"], row["context"]): row for row in results}


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_device_memory_is_flat_in_the_context(report, topology):
    _, rows = report
    short, long = rows[topology, SHORT], rows[topology, LONG]
    assert (
        abs(long["ours_device_mib"] - short["ours_device_mib"]) <= 0.01 * short["ours_device_mib"]
    )
    # The summaries are in host memory: four times as many at four times the context.
    assert long["summary_host_mib"] > 3.9 * short["summary_host_mib"]
    assert short["summary_chunk_blocks"] == long["summary_chunk_blocks"] == 64


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_unit_copy_and_summary_chunk_copy_spans_an_attention(report, topology):
    _, rows = report
    for context in (SHORT, LONG):
        units, summaries = (
            rows[topology, context]["overlap"],
            rows[topology, context]["summary_overlap"],
        )
        # Every unit copy, predicted or late, has an attention between its start and end.
        assert units["copies"] > 0 and units["spanning"] == units["copies"], context
        # Every summary chunk copy has a scoring (or an attention, a walk) inside: the
        # layer's chunks after its first and the next layer's first, two layers.
        assert summaries["copies"] >= 2, context
        assert summaries["spanning"] == summaries["copies"], (context, summaries)


@pytest.mark.slow
def test_the_projected_step_is_set_by_the_budget(report):
    _, rows = report
    short, long = rows["v5e:2x2", SHORT], rows["v5e:2x2", LONG]
    assert short["selected_blocks"] == 4 and long["selected_blocks"] == 16  # 3% of 128, 512
    # Four times the context, at most about four times the sparse step, both below dense.
    assert long["projected_step_ms"] < 0.2 * long["dense_projected_step_ms"]
    assert short["projected_step_ms"] < long["projected_step_ms"] < 5 * short["projected_step_ms"]


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
    assert fields["late_share_source"] == "given (--late-share)"

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
        "v5e:2x2 sparse (budget 0.03, 25% of each selection late, given (--late-share)):"
        " projected step against the dense step at 128K (4.0 ms): 0.25x at 128K, 0.50x at"
        " 256K; summaries"
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


def test_the_late_share_is_the_measured_one_unless_given_and_a_share():
    """Without --late-share the projection counts the share measured on the host pool's
    emulated decode, and says so; a given one is a share in [0, 1], refused by name past
    either edge before anything compiles."""
    import argparse

    from jax_tpusync.bench import tpu_compile

    share, source = tpu_compile.late_share_of(argparse.Namespace(late_share=None))
    assert share == tpu_compile.LATE_SHARE and source.startswith("measured: ")
    for edge in (0.0, 1.0):
        assert tpu_compile.late_share_of(argparse.Namespace(late_share=edge))[0] == edge
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match=r"--late-share .* must be a share in \[0, 1\]"):
            tpu_compile.late_share_of(argparse.Namespace(late_share=bad))
        with pytest.raises(ValueError, match=r"--late-share"):
            tpu_compile.run(argparse.Namespace(sparse=0.03, late_share=bad))
