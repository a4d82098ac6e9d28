"""The transfer and overlap benchmarks end to end, at tiny sizes (numbers are not checked)."""

from __future__ import annotations

import json

import pytest

from jax_tpusync.bench import __main__ as bench_main


def run_bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "out.json"
    assert bench_main.main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("tier", ["host", "file"])
def test_overlap_reports_engine_and_platform(tier, tmp_path):
    data_dir = tmp_path / "tier"
    data_dir.mkdir()
    doc = run_bench(
        tmp_path,
        "overlap",
        "--tier",
        tier,
        "--path",
        str(data_dir),
        "--bytes",
        "2M",
        "--segment-bytes",
        "512K",
        "--matmul",
        "64",
        "--iters",
        "2",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--engine-cpus",
        "0",  # JAX already runs in this process; test_split_cpus covers the split.
    )
    row = doc["results"]
    assert all(row["verified"].values()) and set(row["verified"]) >= {"overlap", "engine"}
    for key in ("t_compute_ms", "t_transfer_ms", "t_overlap_ms", "t_plain_ms"):
        assert row[key] > 0, key
    for key in ("overlap_efficiency", "platform_overlap_efficiency"):
        assert isinstance(row[key], float), key
    assert list(data_dir.iterdir()) == []  # The named tier file is removed at the end.


def test_transfer_reports_engine_and_ceiling(tmp_path):
    doc = run_bench(
        tmp_path,
        "transfer",
        "--tier",
        "file",
        "--path",
        str(tmp_path),
        "--block-bytes",
        "256K",
        "--total-bytes",
        "2M",
        "--repeats",
        "2",
        "--warmup",
        "1",
    )
    (row,) = doc["results"]
    assert row["block_bytes"] == 256 * 1024 and row["total_bytes"] == 2 * 1024 * 1024
    assert row["verified"] and row["engine_gbps"] > 0 and row["ceiling_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["engine_gbps"] / row["ceiling_gbps"])
