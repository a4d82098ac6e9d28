"""bench hybrid at a tiny size: both caches of both shapes on both tiers, and the bytes the
rows report are the layouts' own (tier bytes from the specs, fetched bytes from the engine)."""

from __future__ import annotations

import json

import pytest

from jax_tpusync.bench import __main__ as bench_main
from jax_tpusync.bench import common


@pytest.mark.slow
def test_hybrid_bench_tiny(tmp_path, capsys):
    out = tmp_path / "hybrid.json"
    argv = [
        "hybrid", "--contexts", "2048", "--window", "64", "--steps", "8",
        "--path", str(tmp_path), "--load-chunk", "1024", "--staging-bytes", "1M",
        "--json", str(out),
    ]  # fmt: skip
    args = bench_main.build_parser().parse_args(argv)
    results = args.run(args)
    bench_main.print_results(results, args.columns)
    common.write_json(args.json, args.subcommand, args, results)
    rows = json.loads(out.read_text())["results"]
    assert [(r["model"], r["tier"], r["cache"]) for r in rows] == [
        (m, t, c)
        for m in ("gemma3", "gemma4")
        for t in ("host", "file")
        for c in ("uniform", "hybrid")
    ]
    for uniform, hybrid in zip(rows[::2], rows[1::2]):
        # The one-geometry cache holds every layer's whole context (and max_len's 64 spare
        # tokens): 6x the global layer's (Gemma 3), 24x (Gemma 4: 4x wider rows); hybrid the
        # global layer's, and per sliding layer a ring of 2 blocks of 256 tokens and as many
        # spare blocks for cached windows.
        want = 6.0 if uniform["model"] == "gemma3" else 24.0
        assert want <= uniform["kv_over_global"] <= want * 1.15
        assert 1.0 < hybrid["kv_over_global"] < 0.6 * uniform["kv_over_global"]
        assert hybrid["time_over_uniform"] > 0 and uniform["time_over_uniform"] == 1.0
        if hybrid["tier"] == "file":  # A step fetches what it attends over (and re-fetches
            # units a reading layer took from its source's prefetch chain; 8 steps, so
            # that the first unit, prefetched before the count starts or not, is 1/8 of one).
            fetched, attended = hybrid["fetched_bytes_per_step"], hybrid["step_bytes"]
            assert 0.95 * attended <= fetched <= 1.25 * attended
        assert len(hybrid["step_ms_all"]) == len(uniform["step_ms_all"]) == 8
    # The short summary: per model, each tier's hybrid step against one geometry in words.
    out = capsys.readouterr().out
    for model in ("gemma3", "gemma4"):
        assert f"hybrid, {model} shape, context 2048 (decode step, batch 1)" in out
    assert out.count("tier: the hybrid step is ") == 4 and "than one geometry" in out
    assert out.count("host: library (HybridKVCache)") == 2
    assert "None" not in out and "nan" not in out and "time/uniform" not in out


def test_hybrid_defaults_run_one_context():
    args = bench_main.build_parser().parse_args(["hybrid"])
    assert (args.contexts, args.details) == ([32768], False)


@pytest.mark.slow
def test_hybrid_bench_remote_rows_import_the_global_chain_and_the_windows(
    tmp_path, mooncake_usable
):
    """Through a Mooncake store (the benchmark's own master): each fresh cache maps the
    context; the hybrid one imports the global layers' chain and, per sliding layer, only
    the blocks of one window."""
    argv = [
        "hybrid", "--contexts", "2048", "--window", "64", "--steps", "1", "--tiers", "host",
        "--models", "gemma3", "gemma4", "--load-chunk", "1024", "--staging-bytes", "1M",
        "--block-tokens", "16", "--remote", "mooncake", "--json", str(tmp_path / "h.json"),
    ]  # fmt: skip
    args = bench_main.build_parser().parse_args(argv)
    rows = {(r["model"], r["cache"]): r for r in args.run(args)}
    block = 16 * 2 * 2  # Tokens x (K, V) x bf16, per KV head x head size.
    mapped = 2048 - 16  # Whole blocks, the last token left to compute.
    for model in ("gemma3", "gemma4"):
        uniform, hybrid = rows[model, "uniform <- mooncake"], rows[model, "hybrid <- mooncake"]
        assert uniform["cached_tokens"] == hybrid["cached_tokens"] == mapped
        assert uniform["faults"] == hybrid["faults"] == 0
    # Gemma 3: 6 layers of 2 x 64; its hybrid cache: the global layer's 127 blocks and, per
    # sliding layer, the 4 blocks covering [1969, 2032) (window 64).
    g3u, g3h = rows["gemma3", "uniform <- mooncake"], rows["gemma3", "hybrid <- mooncake"]
    assert g3u["imported_bytes"] == 127 * 6 * 2 * 64 * block
    assert g3h["imported_bytes"] == (127 * 1 + 4 * 5) * 2 * 64 * block
    assert g3h["imported_over_uniform"] == g3h["imported_bytes"] / g3u["imported_bytes"]
    # Gemma 4: uniform 6 layers of 4 x 64; hybrid: one stored global layer of 1 x 64 (127
    # blocks), 2 stored sliding layers of 4 x 32 (4 blocks); layers 3-5 read others' KV.
    g4u, g4h = rows["gemma4", "uniform <- mooncake"], rows["gemma4", "hybrid <- mooncake"]
    assert g4u["imported_bytes"] == 127 * 6 * 4 * 64 * block
    assert g4h["imported_bytes"] == (127 * 1 * 64 + 4 * 2 * 4 * 32) * block
