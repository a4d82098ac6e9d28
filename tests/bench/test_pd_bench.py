"""The P/D benchmark at a tiny shape: a prefill process and this one, the KV moved over a
Mooncake TransferEngine and over a socket side by side, checked byte-exact; and its
refusals. Skips without the Mooncake client unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI)."""

from __future__ import annotations

import json
import re

import pytest

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import common


def run_bench(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "pd.json"
    args = bench_main.build_parser().parse_args(
        ["pd", "--repeats", "1", "--recompute", "--block-tokens", "16", "--json", str(out), *extra]
    )
    results = args.run(args)
    bench_main.print_results(results, args.columns)
    common.write_json(args.json, args.subcommand, args, results)
    return json.loads(out.read_text())["results"]


def test_a_tiny_shape_moves_byte_exact_both_ways(tmp_path, mooncake_usable, capsys):
    (row,) = run_bench(tmp_path, "--shapes", "200x2x2x32", "--piece-bytes", "4K")
    assert row["shape"] == "200x2x2x32" and row["link"] == "loopback"
    assert row["byte_exact"] is True
    assert row["nbytes"] == 200 * 2 * 2 * 2 * 32 * 2  # tokens x layers x K|V x heads x dim x bf16
    assert row["pd_s"] > 0 and row["socket_s"] > 0 and row["pool_s"] > 0
    assert len(row["pool_all_s"]) == len(row["pd_all_s"])  # Side by side, every repeat.
    assert row["pd_over_socket"] == pytest.approx(row["socket_s"] / row["pd_s"])
    # The checksum, timed in the same transfers on both sides.
    assert len(row["checksum_receive_all_s"]) == len(row["pd_all_s"])
    assert len(row["checksum_send_all_s"]) == len(row["pd_all_s"])
    assert 0 < row["checksum_receive_s"] < row["pd_s"] and row["checksum_send_s"] > 0
    assert row["checksum_share"] == pytest.approx(row["checksum_receive_s"] / row["pd_s"])
    # The short summary: the transfer against the socket in words, no developer table.
    out = capsys.readouterr().out
    assert "P/D transfer over loopback" in out and "200x2x2x32 (100 KiB): library" in out
    assert "200x2x2x32: the library's transfer is " in out and "a plain TCP socket" in out
    assert "byte-exact" in out and "pd/socket rate" not in out
    assert re.search(
        r"its checksum \(xxh3-64 of the bytes\) took [\d.]+ ms on the decode side before the "
        r"admission \([\d.]+% of the transfer's [\d.]+ ms, [\d.]+ GB/s\) and [\d.]+ ms on the "
        r"prefill side, while its writes were in flight",
        out,
    ), out
    assert "200x2x2x32 (100 KiB): library into a host pool" in out
    assert "into a host pool (the TPU data path: staging buffer, then the pool) it is " in out
    assert "None" not in out and "nan" not in out


@pytest.mark.parametrize("shape", ["1x2x3", "0x1x1x1", "ax1x1x1", "nope"])
def test_a_shape_that_is_not_one_is_refused_by_name(shape, capsys):
    with pytest.raises(SystemExit):
        bench_main.build_parser().parse_args(["pd", "--shapes", shape, "--json", "-"])
    assert "nor TOKENSxLAYERSxHEADSxDIM" in capsys.readouterr().err


def test_a_namespace_that_does_not_exist_is_refused_before_any_process_starts(tmp_path):
    with pytest.raises(SystemExit, match="no /var/run/netns/tpsync-no-such-ns"):
        run_bench(tmp_path, "--shapes", "16x1x1x8", "--prefill-netns", "tpsync-no-such-ns")
