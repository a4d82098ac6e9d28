"""The prefix benchmark's remote row at tiny sizes, against a real ``mooncake_master``: the
prefix a first cache published is admitted by a fresh cache from the store alone, and its
first token equals the full prefill's. And the benchmark's own master: started, refused and
stopped within its bounds.

Without the Mooncake client the remote rows skip, unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI),
where they fail instead."""

from __future__ import annotations

import json
import socket
import stat

import matplotlib
import pytest

matplotlib.use("Agg")

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import common, mooncake_master

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCK_PAYLOAD = 2 * 2 * 16 * 1 * 16 * 2  # layers x (K, V) x block tokens x heads x dim x bf16

TINY = [
    "prefix",
    "--prefix-tokens", "64",
    "--unique-tokens", "12",
    "--requests", "2",
    "--chunk", "32",
    "--block-tokens", "16",
    "--decode-steps", "3",
    "--layers", "2",
    "--d-model", "32",
    "--q-heads", "2",
    "--kv-heads", "1",
    "--head-dim", "16",
    "--ffn", "32",
    "--vocab", "64",
    "--staging-bytes", "64K",
    "--engine-cpus", "0",
]  # fmt: skip


def run_bench(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "prefix.json"
    args = bench_main.build_parser().parse_args(
        [*TINY, "--path", str(tmp_path), "--json", str(out), *extra]
    )
    results = args.run(args)
    bench_main.print_results(results, args.columns)
    common.write_json(args.json, args.subcommand, args, results)
    return json.loads(out.read_text())["results"]


def check_remote_row(row: dict, tier: str, local: dict) -> None:
    assert row["tier"] == f"{tier} <- mooncake" and row["publisher_tier"] == tier
    # The same run's full prefill and local hit, beside the remote hit.
    assert row["ttft_full_ms"] == local["ttft_full_ms"]
    assert row["ttft_cached_ms"] == local["ttft_cached_ms"]
    assert row["ttft_remote_ms"] > 0
    assert row["ttft_remote_over_full"] == row["ttft_remote_ms"] / row["ttft_full_ms"]
    # The prefix's 4 blocks, all from the store: the reader had nothing of its own.
    assert row["tokens_cached_remote"] == 64
    assert row["blocks_imported"] == 4
    assert row["bytes_loaded"] == 4 * BLOCK_PAYLOAD
    level = row["remote_level"]
    assert level["mooncake_imported"] == 4 and level["mooncake_faults"] == 0
    assert level["mooncake_misses"] == 0 and level["mooncake_damaged"] == 0
    assert row["publisher_level"]["mooncake_published"] >= 4
    # The first release published the first prompt's 4 full blocks (76 tokens, 16 a block).
    assert row["blocks_published"] == 4 and row["publish_release_ms"] > 0
    assert row["publish_release_ms"] == local["release_first_ms"]
    assert row["publisher_level"]["mooncake_faults"] == 0
    assert row["first_token"] == "same"
    assert row["first_token_remote"] == row["first_token_full"]
    assert row["logits_max_abs_err"] < 0.05, row["logits_max_abs_err"]  # bf16 model.
    assert set(row["targets"]) == {
        "ttft remote hit <= 0.2 x full prefill",
        "remote hit's first token = full prefill's",
        "the reader connected without a fault",
    }
    assert row["targets"]["remote hit's first token = full prefill's"]
    assert row["remote_connect_faults"] == 0
    assert row["targets"]["the reader connected without a fault"]


def test_remote_row_with_a_master_of_the_benchmarks_own(tmp_path, mooncake_usable, capsys):
    png = tmp_path / "prefix.png"
    rows = run_bench(tmp_path, "--tiers", "host", "--remote", "mooncake", "--plot", str(png))
    assert [r["tier"] for r in rows] == ["host", "host <- mooncake"]
    check_remote_row(rows[1], "host", rows[0])
    assert rows[1]["link"] == "loopback"
    assert rows[0]["first_token"] == "same"
    assert png.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    # The summary's remote line (the table, with its "host <- mooncake" row, is --details').
    assert "library: from the remote level" in out
    assert "TTFT, from the remote level: " in out and "host <- mooncake" not in out
    address = out.split("started a mooncake_master at ")[1].split()[0]
    port = int(address.rsplit(":", 1)[1])
    with pytest.raises(OSError):  # Stopped at exit.
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.slow
def test_remote_row_on_a_running_master_publishes_from_the_first_file_or_host_tier(
    tmp_path, mooncake_usable
):
    with mooncake_master.LocalMaster() as master:
        rows = run_bench(tmp_path, "--tiers", "file", "host", "--remote-master", master.address)
        # The same master again: the run's own namespace, so no earlier run's blocks are hit.
        again = run_bench(tmp_path, "--tiers", "file", "--remote-master", master.address)
    assert [r["tier"] for r in rows] == ["file", "file <- mooncake", "host"]
    check_remote_row(rows[1], "file", rows[0])
    assert rows[0]["tokens_prefilled_full"] == 76  # Nothing cached for the full prefill.
    assert again[0]["tokens_prefilled_full"] == 76
    check_remote_row(again[1], "file", again[0])


@pytest.mark.slow
def test_remote_row_with_the_reader_in_another_namespace_over_a_veth_pair(
    tmp_path, mooncake_usable, veth_pair
):
    ns, reader_ip, publisher_ip = veth_pair
    rows = run_bench(
        tmp_path,
        "--tiers", "host",
        "--reader-netns", ns,
        "--publisher-host", publisher_ip,
        "--reader-host", reader_ip,
    )  # fmt: skip
    assert [r["tier"] for r in rows] == ["host", "host <- mooncake"]
    check_remote_row(rows[1], "host", rows[0])
    assert rows[1]["link"] == f"{publisher_ip} -> netns {ns} {reader_ip}"


def test_a_reader_namespace_that_does_not_exist_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--reader-netns tpsync-no-such-ns: no /var/run/netns/"):
        run_bench(tmp_path, "--tiers", "host", "--reader-netns", "tpsync-no-such-ns")
    assert "started a mooncake_master" not in capsys.readouterr().out


def test_remote_needs_a_host_or_file_tier(tmp_path):
    with pytest.raises(SystemExit, match="--remote needs host or file among --tiers"):
        run_bench(tmp_path, "--tiers", "spill", "--remote", "mooncake")


# -- the benchmark's own master ------------------------------------------------------------------


def fake_binary(tmp_path, body: str) -> str:
    """An executable that ignores its flags and runs ``body`` (a shell script)."""
    path = tmp_path / "fake_master"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_master_that_exits_at_once_is_an_error_naming_its_log(tmp_path):
    master = mooncake_master.LocalMaster(binary=fake_binary(tmp_path, "exit 3"))
    with pytest.raises(RuntimeError, match=r"exited with 3 before listening .*its output: "):
        master.start()


def test_a_master_that_never_listens_is_stopped_after_the_start_timeout(tmp_path):
    master = mooncake_master.LocalMaster(
        binary=fake_binary(tmp_path, "exec sleep 60"), start_timeout_s=0.3
    )
    with pytest.raises(RuntimeError, match=r"did not listen on 127\.0\.0\.1:\d+ within 0\.3 s"):
        master.start()
    assert master.proc.poll() is not None  # Ended by its pid, not left running.


def test_a_master_that_ignores_sigterm_is_killed(tmp_path):
    master = mooncake_master.LocalMaster(
        binary=fake_binary(tmp_path, "trap '' TERM; exec sleep 60"), stop_timeout_s=0.3
    )
    master.start_timeout_s = 0.3
    with pytest.raises(RuntimeError, match="did not listen"):
        master.start()
    assert master.proc.returncode == -9  # SIGKILL after the SIGTERM was ignored.


def test_without_a_binary_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(mooncake_master, "find_binary", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"no mooncake_master .*jax-tpusync\[mooncake\]"):
        mooncake_master.LocalMaster()


def test_a_master_started_twice_is_refused(tmp_path, mooncake_usable):
    master = mooncake_master.LocalMaster()
    with master, pytest.raises(RuntimeError, match="was already started"):
        master.start()
    assert master.proc.poll() is not None
