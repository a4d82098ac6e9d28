"""The transfer and overlap benchmarks end to end, at tiny sizes (numbers are not checked)."""

from __future__ import annotations

import json
import os

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
    word = "faster than" if row["t_overlap_ms"] < row["t_sync_ms"] else "slower than"
    if row["t_overlap_ms"] == row["t_sync_ms"]:
        word = "as fast as"
    assert f"{word} fetch-then-compute (sync)" in row["overlap_vs_sync"]
    assert list(data_dir.iterdir()) == []  # The named tier file is removed at the end.
    if tier == "file":  # Landed in engine memory, copied into the operand at the wait.
        assert row["t_wait_copy_ms"] > 0
    else:  # A memory tier's fetch is deferred to the wait and read into the operand.
        assert row["t_wait_copy_ms"] == 0 and row["overlap_ceiling"] == 1
    from jax_tpusync.bench.overlap import overlap_ceiling

    ceiling = overlap_ceiling(row["t_compute_ms"], row["t_transfer_ms"], row["t_wait_copy_ms"])
    assert row["overlap_ceiling"] == pytest.approx(ceiling)
    assert row["efficiency_over_ceiling"] == pytest.approx(row["overlap_efficiency"] / ceiling)


def test_the_overlap_ceiling_is_what_the_copy_after_the_compute_leaves():
    from jax_tpusync.bench.overlap import overlap_ceiling

    assert overlap_ceiling(10.0, 10.0, 0.0) == 1.0
    assert overlap_ceiling(10.0, 10.0, 2.0) == pytest.approx(0.8)
    assert overlap_ceiling(10.0, 10.0, 10.0) == 0.0
    # A short transfer still fits beside a long compute, but its copy comes after it.
    assert overlap_ceiling(30.0, 10.0, 2.0) == pytest.approx(0.8)
    # A short compute hides in the transfer's reads as long as they outlast it.
    assert overlap_ceiling(5.0, 20.0, 4.0) == pytest.approx(1.0)
    assert overlap_ceiling(5.0, 20.0, 16.0) == pytest.approx(0.8)


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
    word = "faster than" if row["engine_ms_median"] < row["ceiling_ms_median"] else "slower than"
    if row["engine_ms_median"] == row["ceiling_ms_median"]:
        word = "as fast as"
    assert f"{word} the ceiling" in row["engine_vs_ceiling"]


@pytest.mark.parametrize("tier", ["host", "file"])
def test_contention_reports_each_load_state(tier, tmp_path, capsys):
    data_dir = tmp_path / "tier"
    data_dir.mkdir()
    before = os.sched_getaffinity(0)
    doc = run_bench(
        tmp_path,
        "contention",
        "--tier",
        tier,
        "--path",
        str(data_dir),
        "--total-bytes",
        "1M",
        "--block-bytes",
        "256K",
        "--repeats",
        "1",
        "--warmup",
        "1",
    )
    row = doc["results"]
    for state in ("idle", "alu", "memory"):
        assert row[f"{state}_gbps"] > 0 and row[f"{state}_ms_median"] > 0, state
    assert row["alu_over_idle"] == pytest.approx(row["alu_gbps"] / row["idle_gbps"])
    assert row["memory_over_idle"] == pytest.approx(row["memory_gbps"] / row["idle_gbps"])
    out = capsys.readouterr().out
    assert f"{tier} tier: 1 MiB fetched whole in 256 KiB requests, engine on CPUs" in out
    for state, words in (("alu", "spinning an integer loop"), ("memory", "copying memory")):
        assert (
            f"with the other CPUs {words} the engine keeps {row[f'{state}_over_idle']:.2f}x of"
            f" its idle fetch rate ({row[f'{state}_gbps']:.2f} against {row['idle_gbps']:.2f}"
            " GB/s): a whole fetch is "
        ) in out
    assert out.count("than with them idle") + out.count("as fast as with them idle") == 2
    assert "None" not in out and "nan" not in out and "alu/idle" not in out  # No table.
    assert os.sched_getaffinity(0) == before  # The caller's CPUs are given back.
    assert list(data_dir.iterdir()) == []  # The named tier file is removed at the end.


def test_contention_rejects_a_total_that_is_not_whole_blocks(tmp_path):
    with pytest.raises(SystemExit, match=r"--total-bytes \(1000000\) must be a positive multiple"):
        run_bench(tmp_path, "contention", "--total-bytes", "1000000", "--block-bytes", "256K")


def test_contention_splits_engine_and_load_cpus(monkeypatch):
    from jax_tpusync.bench import contention

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert contention.split(1) == ((3,), (0, 1, 2))
    assert contention.split(2) == ((2, 3), (0, 1))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert contention.split(1) == ((5,), (5,))  # One CPU: the load shares it.
    with pytest.raises(SystemExit, match="--engine-cpus must be >= 1"):
        contention.split(0)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split() == ["State:", "Z", "(zombie)"] for line in f)
    except FileNotFoundError:
        return True


def test_contention_load_dies_with_a_killed_benchmark(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    cpu = min(os.sched_getaffinity(0))
    script = (
        "import time\n"
        "from jax_tpusync.bench.contention import _Load\n"
        f"load = _Load('alu', ({cpu},))\n"
        "print(' '.join(str(p.pid) for p in load.procs), flush=True)\n"
        "time.sleep(60)\n"
    )
    bench = subprocess.Popen(  # Not from the source tree: the installed package.
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        pids = [int(p) for p in bench.stdout.readline().split()]
        assert pids and not any(_gone(p) for p in pids)
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids)
