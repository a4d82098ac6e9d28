"""bench serve and bench prefill at tiny sizes: every row and key is there, and the timed
work is what the rows say."""

from __future__ import annotations

import json

import pytest

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import common, serve

TINY_MODEL = [
    "--layers", "2", "--d-model", "32", "--q-heads", "2", "--kv-heads", "1",
    "--head-dim", "16", "--ffn", "32", "--vocab", "64",
]  # fmt: skip


def run_bench(argv, out):
    args = bench_main.build_parser().parse_args([*argv, *TINY_MODEL, "--json", str(out)])
    results = args.run(args)
    bench_main.print_results(results, args.columns)
    common.write_json(args.json, args.subcommand, args, results)
    return json.loads(out.read_text())


def test_serve_defaults_to_the_shared_prompt_case_on_four_slots():
    args = bench_main.build_parser().parse_args(["serve"])
    assert args.case == ["shared-prompt"] and args.requests == 6 and not args.details
    one = serve._with_case_defaults(args, "shared-prompt")
    assert (one.batch, one.chunk, one.block_tokens) == (4, 128, 64)
    step = serve._with_case_defaults(
        bench_main.build_parser().parse_args(["serve", "--chunk", "32"]), "step"
    )
    assert (step.batch, step.chunk, step.block_tokens) == (8, 32, 256)  # A flag given wins.


def test_serve_bench_tiny(tmp_path, capsys):
    doc = run_bench(
        [
            # The host tier only: a file tier's state compiles the step again (half the
            # test's time) and its engine is tested elsewhere.
            "serve", "--case", "step", "--tiers", "host", "--path", str(tmp_path),
            "--context", "40", "--chunk", "16", "--batch", "4", "--prefill-slots", "1",
            "--repeats", "2", "--block-tokens", "16", "--staging-bytes", "64K",
            "--engine-cpus", "0",
        ],
        tmp_path / "serve.json",
    )  # fmt: skip
    rows = doc["results"]
    assert [r["tier"] for r in rows] == ["host"]
    for r in rows:
        assert r["mixed_ms"] > 0 and r["separate_ms"] > 0 and r["decode_only_ms"] > 0
        assert abs(r["mixed_tokens_per_s"] * r["mixed_ms"] / 1e3 - (16 + 3)) < 1e-6
        assert r["separate_ms"] >= r["separate_prefill_ms"]
        assert len(r["samples_ms"]["mixed"]) == 2
        assert set(r["latency_ms"]) == {
            "decode_token_mixed",
            "decode_token_separate",
            "prefill_chunk_mixed",
            "prefill_chunk_separate",
        }
        assert r["case"] == "step"
    out = capsys.readouterr().out
    assert out.count("the mixed step is") == 1 and "library: one mixed step" in out
    assert "mixed/separate" not in out  # The developer's table is behind --details.


def test_details_keeps_the_table_and_prints_no_summary(capsys):
    args = bench_main.build_parser().parse_args(["serve", "--details"])
    common.summary_or_details(args, "the summary")
    assert args.columns == serve.COLUMNS and "the summary" not in capsys.readouterr().out
    args = bench_main.build_parser().parse_args(["serve"])
    common.summary_or_details(args, "the summary")
    assert args.columns is None and "the summary" in capsys.readouterr().out


@pytest.mark.slow
def test_prefill_bench_tiny(tmp_path, capsys):
    doc = run_bench(
        [
            "prefill", "--tiers", "host", "file", "--path", str(tmp_path),
            "--contexts", "48", "--chunk", "16", "--block-len", "16",
            "--block-tokens", "16", "--staging-bytes", "64K", "--floor-chunks", "2", "--repeats", "2",
            "--engine-cpus", "0",
        ],
        tmp_path / "prefill.json",
    )  # fmt: skip
    rows = doc["results"]
    assert [(r["context"], r["variant"]) for r in rows] == [
        (48, v) for v in ("plain_jax", "host", "file")
    ]
    for r in rows:
        assert len(r["chunk_ms"]) == r["context"] // 16 and r["tokens_per_s"] > 0
        assert r["floor_chunk_ms"] > 0 and 0 <= r["cached_attention_share"] <= 1
        if r["variant"] != "plain_jax":
            assert r["over_plain"] > 0
            # Each chunk's K/V written once: layers x K|V x context rows of 1 x 16 bf16.
            assert r["written_bytes"] == 2 * 2 * r["context"] * 32
        if r["variant"] == "host":
            assert set(r["targets"]) == {"host tier >= 0.9 x plain JAX"}
    # The short summary: each tier against plain JAX in words, no developer columns.
    out = capsys.readouterr().out
    assert "48 tokens, host tier: the library's prefill is " in out
    assert "48 tokens, file tier: the library's prefill is " in out
    assert "than plain JAX with the KV resident" in out or "as fast as plain JAX" in out
    assert "over plain" not in out and "None" not in out


def test_serve_bench_shared_prompt_tiny(tmp_path, capsys):
    doc = run_bench(
        [
            "serve", "--case", "shared-prompt", "--tiers", "host", "--requests", "6",
            "--batch", "4", "--prompt", "32", "--tail", "4", "--chunk", "16",
            "--block-tokens", "16", "--new-tokens", "2", "--staging-bytes", "256K",
            "--engine-cpus", "0",
        ],
        tmp_path / "shared.json",
    )  # fmt: skip
    rows = doc["results"]
    assert [(r["arrival"], r["share_prefixes"]) for r in rows] == [
        ("together", 1),
        ("together", 0),
        ("first-then-rest", 1),
        ("first-then-rest", 0),
    ]
    for r in rows:
        assert len(r["ttft_ms"]) == 6 and min(r["ttft_ms"]) > 0
        assert r["prefill_tokens"] + r["cached_prompt_tokens"] == 6 * 36
        assert r["later_over_first"] == pytest.approx(max(r["ttft_ms"][1:]) / r["ttft_ms"][0])
    for r in rows[0], rows[2]:  # Shared: every request after the first maps the prompt.
        assert r["cached_tokens"] == [0] + [32] * 5
    assert rows[1]["cached_tokens"][:4] == [0, 0, 0, 0]  # Admitted together, each computes.
    assert rows[0]["warmup_ms"] > 0 and all(r["case"] == "shared-prompt" for r in rows)
    for r in rows:
        assert r["later_ttft_median_ms"] == pytest.approx(sorted(r["ttft_ms"][1:])[2])
    # The short summary in words, the compile apart; no developer table, no None or nan.
    out = capsys.readouterr().out
    assert "compile (warm-up before the first request, in no TTFT)" in out
    assert "one first: the 5 later, sharing" in out and "all at once: the first, no sharing" in out
    assert "with share_prefixes the later requests' TTFT is" in out
    assert "prompt tokens computed 56 with" in out
    assert "None" not in out and "nan" not in out and "later/first" not in out
