"""The weights benchmark at a tiny size, in a process of its own (it needs 8 simulated
devices): every way moves the params bitwise, each destination device gets exactly what
its shards hold, the plan is built once and reused; and its refusals."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import weights


def test_a_tiny_pytree_moves_exactly_every_way(tmp_path):
    out = tmp_path / "weights.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # The bench sets its own device count.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_tpusync.bench",
            "weights",
            "--gb",
            "0.01",
            "0.01",  # The same number of layers: run once.
            "--repeats",
            "2",
            "--dir",
            str(tmp_path),
            "--disk-dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        check=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["case"], r["method"]) for r in rows] == [
        (case, method)
        for case in ("fsdp4->tp2", "fsdp4->fsdp4")
        for method in weights.DEFAULT_METHODS
    ]
    # The default output: a short table per case and the verdict in words, no None.
    printed = done.stdout
    assert "None" not in printed and "plan reused" not in printed  # No developer table.
    for case in ("fsdp4->tp2", "fsdp4->fsdp4"):
        assert f"{case}: " in printed
    assert printed.count(" against the fastest baseline: ") == 2
    assert len(re.findall(r"median ms +IQR ms +GB/s +CPU ms +runs", printed)) == 2
    assert re.search(r"jax\.experimental\.transfer +not run: moves whole shards", printed)
    assert "every way moved the params bitwise" in printed
    layers = weights.layers_for(0.01)
    nbytes = (2 * weights.VOCAB * weights.D_MODEL + weights.D_MODEL) * 2
    nbytes += layers * weights.layer_bytes()
    for r in rows:
        assert r["nbytes"] == nbytes and r["layers"] == layers == 1
        if r["method"] == "jax.transfer" and r["case"] == "fsdp4->tp2":
            assert r["note"].startswith("not run: moves whole shards in the same layout only")
            continue
        if r["method"] == "jax.transfer" and r["note"].startswith("not in this jax"):
            continue
        assert r["exact"] is True and r["bytes_per_device_ok"] is True, r
        assert r["seconds"] > 0 and r["gbps"] == pytest.approx(nbytes / r["seconds"] / 1e9)
        assert len(r["samples_s"]) == 2  # The timed runs (after the warm-up ones).
        assert r["seconds"] == pytest.approx(statistics.median(r["samples_s"]))
        assert 0 < r["cpu_ms"] < 1e6  # This process's CPU time per run (all its threads).
    for r in rows:
        if r["method"] in ("weights", "weights-nocopy"):
            assert r["plan_ms"] > 0 and r["plan_reused"] is True
            assert 0 < r["publish_blocked_ms"] < r["seconds"] * 1e3


@pytest.mark.slow
def test_the_mooncake_rows_with_a_master_of_the_runs_own(tmp_path, mooncake_usable):
    out = tmp_path / "weights.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_tpusync.bench",
            "weights",
            "--gb",
            "0.01",
            "--repeats",
            "2",
            "--methods",
            "weights",
            "--remote",
            "mooncake",
            "--json",
            str(out),
        ],
        check=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["case"], r["method"]) for r in rows] == [
        (case, method)
        for case in ("fsdp4->tp2", "fsdp4->fsdp4")
        for method in ("weights", "weights-mooncake")
    ]
    for r in rows:
        assert r["exact"] is True and r["bytes_per_device_ok"] is True, r
        assert r["plan_reused"] is True
    for r in rows[1::2]:
        assert r["note"] == "publish + pull (Mooncake store, TCP loopback)"
        # Each pull: every byte of the params once (the sampler's two devices split each
        # array; a source shard's chunks both of them need are read once).
        assert r["bytes_fetched"] == r["nbytes"]


def test_the_mooncake_rows_need_a_store():
    args = bench_main.build_parser().parse_args(
        ["weights", "--methods", "weights-mooncake", "--json", "-"]
    )
    with pytest.raises(SystemExit, match=r"weights-mooncake needs --store mooncake://host:port"):
        args.run(args)
    args = bench_main.build_parser().parse_args(["weights", "--store", "/dev/shm/x", "--json", "-"])
    with pytest.raises(SystemExit, match=r"--store '/dev/shm/x': expected mooncake://host:port"):
        args.run(args)


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--gb", "0", "is not a number > 0"),
        ("--gb", "nan", "is not a number > 0"),
        ("--repeats", "0", "is not an int >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(flag, value, why, capsys):
    with pytest.raises(SystemExit):
        bench_main.build_parser().parse_args(["weights", flag, value, "--json", "-"])
    assert why in capsys.readouterr().err


def test_a_size_beyond_the_memory_is_refused_before_anything_runs():
    args = bench_main.build_parser().parse_args(["weights", "--gb", "100000", "--json", "-"])
    with pytest.raises(
        SystemExit,
        match=r"--gb 100000 needs about .* GB of memory \(12 copies "
        r"of .* GB\), .* GB is available",
    ):
        args.run(args)


def test_fewer_than_eight_devices_are_refused_by_name():
    import jax

    if len(jax.devices()) >= 8:
        pytest.skip("this process has 8 devices")
    args = bench_main.build_parser().parse_args(["weights", "--gb", "0.01", "--json", "-"])
    with pytest.raises(SystemExit, match=rf"weights needs 8 devices, JAX has {len(jax.devices())}"):
        args.run(args)
