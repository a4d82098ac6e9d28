"""The prefix benchmark at tiny sizes: every key is there, the cached prefix is hit, and
the cached request's logits equal its full prefill's."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from jax_tpusync.bench import __main__ as bench_main  # noqa: E402
from jax_tpusync.bench import common  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_prefix_bench_tiny(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    png = tmp_path / "prefix.png"
    args = bench_main.build_parser().parse_args(
        [
            "prefix",
            "--tiers",
            "host",
            "file",
            "--path",
            str(tmp_path),
            "--prefix-tokens",
            "64",
            "--unique-tokens",
            "12",
            "--requests",
            "3",
            "--chunk",
            "32",
            "--block-tokens",
            "16",
            "--decode-steps",
            "3",
            "--layers",
            "2",
            "--d-model",
            "32",
            "--q-heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "16",
            "--ffn",
            "32",
            "--vocab",
            "64",
            "--staging-bytes",
            "64K",
            "--engine-cpus",
            "0",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    results = args.run(args)
    bench_main.print_results(results, args.columns)
    common.write_json(args.json, args.subcommand, args, results)
    doc = json.loads(out.read_text())
    assert [r["tier"] for r in doc["results"]] == ["host", "file"]
    for r in doc["results"]:
        assert r["ttft_full_ms"] > 0 and r["ttft_cached_ms"] > 0
        assert r["tokens_prefilled_full"] == 76
        assert r["release_first_ms"] > 0 and r["blocks_published_first_release"] == 0
        assert r["tokens_prefilled_cached"] == [12, 12]  # The prefix's 4 blocks are mapped.
        assert r["hit_rate"] == 128 / 152
        assert r["logits_max_abs_err"] < 0.05, r["logits_max_abs_err"]  # bf16 model.
        assert r["tier_blocks_used"] < r["tier_blocks_unshared"]
        assert r["prefix_index"]["hits"] >= 2 * 4
        # The re-attached index still holds the prefix's 4 full blocks.
        assert r["ttft_restart_ms"] > 0 and r["reattach_ms"] > 0
        assert r["tokens_cached_restart"] == 64  # The 4 full blocks it had released.
        assert r["logits_max_abs_err_restart"] < 0.05, r["logits_max_abs_err_restart"]
        assert set(r["targets"]) == {
            "ttft cached <= 0.1 x full prefill",
            "ttft after a restart <= 0.1 x full prefill",
            "decode on shared blocks <= 1.05 x private",
        }
        assert len(r["ttft_full_ms_all"]) == 2 and r["ttft_full_ms_all"][0] == r["ttft_full_ms"]
        assert len(r["decode_shared_ms_all"]) == 2 * 2  # Two runs of 3 steps, the first untimed.
        assert len(r["decode_private_ms_all"]) == 2
    assert png.read_bytes()[:8] == PNG_MAGIC
    # The short summary: per tier the cached TTFTs against a full prefill, in words.
    out = capsys.readouterr().out
    for tier in ("host", "file"):
        assert f"prefix, {tier} tier: 3 requests sharing a 64-token prefix + 12 tokens" in out
    assert out.count("TTFT, prefix cached: ") == 2 and "than a full prefill" in out
    assert out.count("TTFT, cached, after a restart: ") == 2
    assert out.count("a decode step on the shared blocks is ") == 2
    assert "None" not in out and "nan" not in out and "cached/full" not in out


def test_prefix_defaults_finish_in_about_a_minute():
    args = bench_main.build_parser().parse_args(["prefix"])
    assert (args.tiers, args.prefix_tokens, args.details) == (["host"], 4096, False)


@pytest.mark.slow
def test_quality_bench_tiny(tmp_path, capsys):
    out = tmp_path / "quality.json"
    args = bench_main.build_parser().parse_args(
        [
            "quality",
            "--tier", "file",
            "--path", str(tmp_path),
            "--context", "64",
            "--steps", "3",
            "--batch", "2",
            "--prefill-window", "32",
            "--chunk", "32",
            "--block-tokens", "16",
            "--layers", "1",
            "--d-model", "32",
            "--q-heads", "2",
            "--kv-heads", "1",
            "--head-dim", "32",
            "--ffn", "32",
            "--vocab", "64",
            "--staging-bytes", "64K",
            "--engine-cpus", "0",
            "--json", str(out),
        ]
    )  # fmt: skip
    rows = {r["tier_dtype"]: r for r in args.run(args)}
    assert set(rows) == {"bfloat16", "int8", "float8_e4m3fn", "other_context"}
    ref = rows["bfloat16"]
    assert ref["top1_agreement"] == 1.0 and ref["max_abs_logit_diff"] == 0
    assert ref["decisions"] == 6 and ref["reference_top1_margin"] > 0
    for name in ("int8", "float8_e4m3fn"):
        row = rows[name]
        assert row["tier_bytes_ratio"] == row["row_bytes"] / (32 * 2) == 48 / 64
        # Quantization moves the logits, far less than another context does.
        assert 0 < row["max_abs_logit_diff"] < rows["other_context"]["max_abs_logit_diff"]
    assert "targets" in rows["int8"]
    out = capsys.readouterr().out
    assert "2 sequences of 64 cached tokens, 3 greedy decode steps each (6 decisions)" in out
    control = rows["other_context"]
    assert (
        f"changing the context (each sequence given another's) moves the logits by "
        f"{control['mean_abs_logit_diff']:.3g} on average"
    ) in out
    for name in ("int8", "float8_e4m3fn"):
        row = rows[name]
        ratio = control["mean_abs_logit_diff"] / row["mean_abs_logit_diff"]
        times = f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"
        assert (
            f"{name} (0.75x the bytes of bfloat16 rows): moves the logits {times} less than"
            f" changing the context ({row['mean_abs_logit_diff']:.3g} on average"
        ) in out
        assert f"picks the reference's next token in {100 * row['top1_agreement']:.1f}%" in out
    assert "None" not in out and "nan" not in out and " ms" not in out and "agree" not in out


def test_quality_defaults_finish_in_a_minute_or_two():
    args = bench_main.build_parser().parse_args(["quality"])
    assert (args.context, args.steps, args.batch, args.details) == (8192, 64, 4, False)
