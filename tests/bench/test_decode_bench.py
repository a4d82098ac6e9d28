"""The decode benchmark, its timeline outputs, and the long-context example, at tiny sizes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from jax_tpusync.bench import __main__ as bench_main  # noqa: E402
from jax_tpusync.bench import common, decode, decode_report  # noqa: E402
from jax_tpusync.runtime import timeline as tl  # noqa: E402
from jax_tpusync.runtime.engine import Timeline  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "long_context_decode.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = [
    "--tier",
    "host",
    "--context",
    "600",
    "--layers",
    "1",
    "--q-heads",
    "2",
    "--kv-heads",
    "1",
    "--head-dim",
    "32",
    "--staging-bytes",
    "32K",
    "--steps",
    "5",
    "--block",
    "2",
    "--warmup",
    "0",
    "--engine-cpus",
    # JAX already runs in this process; tests/runtime/engine/test_split_cpus covers the split.
    "0",
    # A test must not change the XLA flags of the whole test process
    # (tests/runtime/test_xla_cpu_schedule.py covers the memory schedule).
    "--xla-cpu-schedule",
    "concurrency",
]


def _parser():
    subs = tuple(bench_main.SUBCOMMANDS)
    if "decode" not in subs:
        subs += ("decode",)
    return bench_main.build_parser(subs)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    paths = dict(
        json=str(out / "decode.json"), plot=str(out / "decode.png"), trace=str(out / "trace.json")
    )
    args = _parser().parse_args(
        [
            "decode",
            *TINY,
            "--tier-dtype",
            "int8",
            "--sparse",
            "0.5",
            "--json",
            paths["json"],
            "--plot",
            paths["plot"],
            "--trace",
            paths["trace"],
        ]
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # What a user reads: the default output.
        results = args.run(args)
        bench_main.print_results(results, args.columns)
    paths["stdout"] = printed.getvalue()
    common.write_json(args.json, args.subcommand, args, results)
    return results, paths


@pytest.mark.slow
def test_default_output_is_the_short_summary(bench_run):
    """Without --details: the library against plain JAX in words, no targets, no None, no
    context that was not asked for, no developer table."""
    res, paths = bench_run
    text = paths["stdout"]
    assert "None" not in text
    assert "context 600: host tier" in text
    assert "the library is " in text and ("faster than" in text or "slower than" in text)
    assert "plain JAX (device_put in jit)" in text and "resident floor" in text
    assert "targets" not in text and "32K" not in text and "1M" not in text
    assert "overlap eff" not in text and "rows + scales" not in text
    assert res["t_prefetch_ms_samples"] and len(res["t_prefetch_ms_samples"]) >= 5


@pytest.mark.slow
def test_details_bring_back_the_targets_and_the_table(bench_run):
    res, _ = bench_run
    args = _parser().parse_args(["decode", "--details"])
    assert args.details and args.columns is decode.COLUMNS
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        decode_report.print_summary(res)
        bench_main.print_results(res, args.columns)
    text = printed.getvalue()
    assert "targets:" in text and "[PASS]" in text
    assert "overlap eff" in text and "quantized" in text
    assert "None" not in text


@pytest.mark.slow
def test_decode_json_has_every_key(bench_run):
    results, paths = bench_run
    with open(paths["json"]) as f:
        doc = json.load(f)
    assert doc["subcommand"] == "decode"
    res = doc["results"]
    # The tiny cache's KV does not fit its 32K staging budget: resident_mode says so.
    assert res["resident_mode_note"].startswith("skipped: resident=True needs")
    for name in decode.VARIANTS:
        for suffix in ("", "_min", "_max"):
            if name == "resident_mode":
                assert res[f"t_{name}_ms{suffix}"] is None
                continue
            assert res[f"t_{name}_ms{suffix}"] > 0, name
    for key in (
        "overlap_efficiency",
        "overlap_efficiency_compute",
        "prefetch_over_max",
        "platform_overlap_efficiency",
        "prefetch_over_platform",
        "max_abs_err",
        "device_bytes",
        "kv_bytes",
        "tokens_per_s",
        "prefetch_hits",
        "prefetch_misses",
        "prefetch_fetch_gbps",
        "transfer_fetch_gbps",
        "device_bytes_by_context",
        "targets",
        "jax_offload_label",
        "timeline_summary",
    ):
        assert key in res, key
    # Every block of the two-level cache is in DRAM: the same outputs as resident.
    assert res["max_abs_err_two_level"] <= 1e-2 * max(1.0, res["output_abs_max"])
    assert res["two_level_over_prefetch"] > 0
    # The host tier read in place (prefetch) and copied into staging (copy): same outputs.
    assert res["max_abs_err_copy"] <= 1e-2 * max(1.0, res["output_abs_max"])
    assert res["copy_over_prefetch"] > 0
    assert res["samples_per_variant"] >= 5
    assert res["units_per_layer"] > 1  # The tiny size still exercises the chunk loop.
    assert (
        res["jax_offload_label"] in ("host-copy-on-cpu", "unsupported")
        or "->" in res["jax_offload_label"]
    )


@pytest.mark.slow
def test_the_quantized_variant_moves_about_half_the_bytes(bench_run):
    res, _ = bench_run
    assert res["tier_dtype"] == "int8"
    assert res["quantized_bytes_ratio"] == res["quantized_row_bytes"] / (32 * 2) == 48 / 64
    assert res["quantized_kv_bytes_per_step"] < res["kv_bytes_per_step"]
    assert res["quantized_over_prefetch"] == res["t_quantized_ms"] / res["t_prefetch_ms"]
    assert 0 < res["quantized_max_abs_diff"] <= 0.05 * max(1.0, res["output_abs_max"])


@pytest.mark.slow
def test_decode_outputs_match_resident(bench_run):
    res, _ = bench_run
    # Same operations in the same order: equal up to rounding of the bf16 output.
    assert res["max_abs_err"] <= 1e-2 * max(1.0, res["output_abs_max"])
    for name in ("sync", "jax_offload"):
        assert res[f"{name}_max_abs_err"] <= 1e-2 * max(1.0, res["output_abs_max"]), name
    assert res["prefetch_misses"] == 0 or res["prefetch_hits"] > res["prefetch_misses"]


@pytest.mark.slow
def test_deeper_prefetch_on_the_file_tier_matches(tmp_path):
    """--prefetch-depth 2: three staging slots, the transfer variant pipelined as deep; the
    platform variant reads the tier file beside the compute."""
    tiny = list(TINY)
    tiny[tiny.index("--tier") + 1] = "file"
    args = _parser().parse_args(
        [
            "decode",
            *tiny,
            "--path",
            str(tmp_path),
            "--prefetch-depth",
            "2",
            "--variants",
            "resident",
            "transfer",
            "sync",
            "prefetch",
            "platform",
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    res = args.run(args)
    assert res["prefetch_depth"] == 2 and res["units_per_layer"] > 3
    assert res["t_transfer_ms"] > 0 and res["transfer_fetch_gbps"] > 0
    # sync and transfer read a file of their own, through an engine of their own (a tier
    # file has one writer at a time). (Whether their small staging buffers land in phase
    # with the file is up to the allocator.)
    assert not res["transfer_same_file"] and 0 <= res["transfer_direct_read_fraction"] <= 1
    for key in ("staging_huge_page_fraction", "transfer_staging_huge_page_fraction"):
        assert res[key] is None or 0 <= res[key] <= 1, key  # None before Linux 6.7.
    # The plain reader read the prefetching cache's own tier file, beside the compute.
    assert res["t_plain_ms"] > 0 and res["t_platform_ms"] > 0
    assert res["prefetch_over_platform"] > 0
    for key in ("max_abs_err", "sync_max_abs_err"):  # Against the resident step.
        assert res[key] <= 1e-2 * max(1.0, res["output_abs_max"]), key
    assert res["prefetch_misses"] == 0 or res["prefetch_hits"] > res["prefetch_misses"]
    for key in ("cpu_user_prefetch_ms", "cpu_system_prefetch_ms", "minor_faults_prefetch_per_step"):
        assert res[key] >= 0, key


@pytest.mark.slow
def test_device_bytes_do_not_grow_with_context(bench_run):
    res, _ = bench_run
    by_ctx = res["device_bytes_by_context"]
    assert by_ctx[str(32 * 1024)] == by_ctx[str(1024 * 1024)] == res["device_bytes"]
    assert res["targets"]["device_bytes equal at 32K and 1M context"] is True


@pytest.mark.slow
def test_trace_json_has_events(bench_run):
    _, paths = bench_run
    with open(paths["trace"]) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    cats = {e["cat"] for e in events}
    assert {"fetch", "compute", "wait"} <= cats, cats
    for e in events:
        assert e["dur"] >= 0 and e["ts"] > 0
        assert "layer" in e["args"]
    fetches = [e for e in events if e["cat"] == "fetch"]
    assert all(e["args"]["bytes"] > 0 for e in fetches)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "compute" in names and any(n.startswith("fetch") for n in names)


@pytest.mark.slow
def test_plot_writes_png(bench_run):
    _, paths = bench_run
    with open(paths["plot"], "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(paths["plot"]) > 10_000


def _synthetic_timeline() -> Timeline:
    ms = 1_000_000
    t0 = 10_000 * ms
    transfers, waits, marks = [], [], []
    ticket = 0
    for step in range(2):
        base = t0 + step * 50 * ms
        for layer in range(3):
            begin = base + layer * 10 * ms
            marks += [
                (tl.MARK_COMPUTE_BEGIN, layer, -1, begin),
                (tl.MARK_COMPUTE_END, layer, -1, begin + 8 * ms),
            ]
            for chunk in range(2):  # Two overlapping fetches: two lanes.
                ticket += 1
                transfers.append(
                    (
                        ticket,
                        0,
                        0,
                        (layer + 1) % 3,
                        chunk,
                        1 << 20,
                        begin,
                        begin + ms,
                        begin + 6 * ms,
                        True,
                    )
                )
                waits.append(
                    (
                        ticket,
                        layer,
                        chunk,
                        begin + 2 * ms,
                        begin + 2 * ms + (3 * ms if chunk else 1000),
                    )
                )
            transfers.append(
                (ticket + 100, 0, 1, layer, -1, 4096, begin, begin, begin + 1000, True)
            )
    return Timeline(transfers=transfers, waits=waits, marks=marks)


def test_timeline_from_synthetic_events(tmp_path):
    timeline = _synthetic_timeline()
    spans = tl.spans(timeline)
    assert sum(s.kind == "compute" for s in spans) == 6
    assert len(tl.step_starts(timeline)) == 2
    summary = tl.summarize(timeline)
    assert summary["steps"] == 2
    assert summary["stalled_waits"] == 6  # The 3 ms waits; the 1 us ones did not stall.
    assert summary["stall_ms_per_step"] == pytest.approx(9.0)
    assert summary["per_layer"]["0"]["compute_ms"] == pytest.approx(8.0)

    trace = tl.chrome_trace(timeline, pid=1)
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(x) == len(spans)
    fetch_tracks = {e["tid"] for e in x if e["cat"] == "fetch"}
    assert len(fetch_tracks) == 2  # Overlapping fetches go to separate lanes.
    c = next(e for e in x if e["cat"] == "compute")
    assert c["ts"] == pytest.approx(10_000_000.0) and c["dur"] == pytest.approx(8000.0)

    path = tl.write_chrome_trace(timeline, tmp_path / "t.json")
    assert json.load(open(path))["traceEvents"]
    png = tl.plot(timeline, tmp_path / "t.png", title="synthetic", last_steps=1)
    assert open(png, "rb").read(8) == PNG_MAGIC


def test_timeline_without_marks_or_events(tmp_path):
    empty = Timeline(transfers=[], waits=[], marks=[])
    assert tl.summarize(empty)["transfers"] == 0
    assert [e for e in tl.chrome_trace(empty)["traceEvents"] if e["ph"] == "X"] == []
    tl.plot(empty, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0


@pytest.mark.slow
def test_example_runs(tmp_path):
    """The example at a tiny size, file tier, checked against the resident model."""
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--context",
        "300",
        "--steps",
        "2",
        "--layers",
        "1",
        "--d-model",
        "64",
        "--q-heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "16",
        "--ffn",
        "64",
        "--vocab",
        "64",
        "--staging-mb",
        "0.01",
        "--tier",
        "file",
        "--path",
        str(tmp_path),
        "--resident",
        "--json",
        str(tmp_path / "summary.json"),
    ]
    # Run outside the source tree so the installed package is the one imported.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("tok/s") >= 2
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["device_bytes"] < summary["kv_bytes"]
    assert summary["resident_max_abs_logit_diff"] < 1e-3
    assert not list(tmp_path.glob(".tpusync-*"))  # The anonymous cache file is gone.


@pytest.mark.slow
def test_baselines_over_a_context_sweep(tmp_path):
    """--baselines plain,tuned at two contexts on the file tier (the memmap's pages dropped
    before each step): one row per context, the plain-JAX steps match resident, one plot."""
    tiny = list(TINY)
    tiny[tiny.index("--tier") + 1] = "file"
    tiny[tiny.index("--context") + 1 : tiny.index("--context") + 2] = ["256", "512"]
    paths = dict(json=str(tmp_path / "sweep.json"), plot=str(tmp_path / "sweep.png"))
    args = _parser().parse_args(
        ["decode", *tiny, "--path", str(tmp_path), "--variants", "resident", "prefetch"]
        + ["--baselines", "plain,tuned", "--json", paths["json"], "--plot", paths["plot"]]
    )
    rows = args.run(args)
    common.write_json(args.json, args.subcommand, args, rows)
    with open(paths["json"]) as f:
        doc = json.load(f)
    assert [r["context"] for r in doc["results"]] == [256, 512]
    for res in doc["results"]:
        assert res["baseline_page_cache"] == "drop"
        for name in ("plain_jax", "tuned_jax"):
            assert res[f"t_{name}_ms"] > 0 and res[f"t_{name}_ms_min"] > 0, name
            # Another attention code path than resident's: equal up to bf16 output rounding.
            assert res[f"max_abs_err_{name}"] <= 1e-2 * max(1.0, res["output_abs_max"]), name
        assert res["memcpy_ms"] > 0
        assert res["prefetch_over_best_jax"] == pytest.approx(
            res["t_prefetch_ms"] / min(res["t_plain_jax_ms"], res["t_tuned_jax_ms"])
        )
        assert res["host_over_floor"] > 0
    with open(paths["plot"], "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert not list(tmp_path.glob("tpusync-decode-*"))  # The memmaps went with the temp dir.


def test_baselines_flag_parses():
    args = _parser().parse_args(["decode", "--baselines", "tuned,plain", "--json", "-"])
    assert args.baselines == ["tuned_jax", "plain_jax"] and args.context == [32 * 1024]
    assert _parser().parse_args(["decode", "--json", "-"]).baselines == []
    assert _parser().parse_args(["decode", "--json", "-"]).xla_cpu_schedule == "memory"
    with pytest.raises(SystemExit):
        _parser().parse_args(["decode", "--baselines", "plain,numpy", "--json", "-"])


def test_the_resident_mode_variant_runs_when_the_cache_fits(tmp_path):
    """--staging-bytes holding the whole tiny cache: resident_mode is timed beside resident
    and prefetch, and matches resident; its staging is the whole cache."""
    tiny = list(TINY)
    tiny[tiny.index("--staging-bytes") + 1] = "1M"
    args = _parser().parse_args(
        ["decode", *tiny, "--variants", "resident", "prefetch", "resident_mode"]
        + ["--json", str(tmp_path / "rm.json")]
    )
    res = args.run(args)
    assert res["resident_mode_note"] is None
    assert res["t_resident_mode_ms"] > 0 and res["t_resident_ms"] > 0
    assert res["max_abs_err_resident_mode"] <= 1e-2 * max(1.0, res["output_abs_max"])
    assert res["resident_mode_device_bytes"] == res["resident_device_bytes"]


@pytest.mark.skipif(len(__import__("jax").devices()) < 2, reason="needs 2 devices")
# tp decode itself: tests/caches/offloaded.
@pytest.mark.parametrize("mesh, tier", [("dp", "file")])
@pytest.mark.slow
def test_decode_devices_rows_fetch_one_shard_each(tmp_path, mesh, tier):
    """``--devices 2``: a row per device count, each shard fetching its own share (the same
    bytes per shard at 1 and 2 devices: the per-device shapes are fixed)."""
    args = _parser().parse_args(
        [
            "decode",
            *TINY,
            *("--tier", tier, "--path", str(tmp_path)),
            *("--devices", "2", "--mesh", mesh, "--json", str(tmp_path / "m.json")),
        ]
    )
    rows = args.run(args)
    bench_main.print_results(rows, args.columns)
    assert [r["devices"] for r in rows] == [1, 2]
    one, two = rows
    assert one["per_device"] == two["per_device"] == {"batch": 1, "kv_heads": 1}
    assert len(two["fetch_bytes_by_shard"]) == 2
    # Every shard fetches about one shard's KV per step (the context grows by a token a
    # step past kv_bytes_per_shard_step), never another shard's too.
    for r in rows:
        for b in r["fetch_bytes_by_shard"]:
            assert r["kv_bytes_per_shard_step"] <= b < 1.2 * r["kv_bytes_per_shard_step"], r
    assert two["t_prefetch_ms"] > 0


def test_the_sparse_variant_reads_a_share_of_the_bytes(tmp_path):
    """--sparse 0.25 at a small context: the sparse step is timed beside the dense and
    resident ones, its bytes per step (summaries, predicted and late blocks) are a share
    of the dense step's, in words and in the JSON; --sparse 1.0 reads every block and
    equals the dense output."""
    tiny = list(TINY)
    tiny[tiny.index("--context") + 1] = "1024"
    common_args = ["decode", *tiny, "--block-tokens", "32", "--variants", "resident", "prefetch"]
    args = _parser().parse_args(
        [*common_args, "sparse", "--sparse", "0.25", "--json", str(tmp_path / "sp.json")]
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        res = args.run(args)
    assert res["t_sparse_ms"] > 0
    assert res["sparse_over_prefetch"] == res["t_sparse_ms"] / res["t_prefetch_ms"]
    assert res["sparse_block_tokens"] == 32
    bytes_ = res["sparse_bytes"]
    assert bytes_["read"] == bytes_["summaries"] + bytes_["predicted"] + bytes_["late"]
    assert res["sparse_read_share"] == bytes_["read"] / bytes_["dense"]
    # 9 of 33 blocks (ceil(0.25 x 33)) and their summaries (1/32 of a block's KV each).
    assert 0.25 < res["sparse_read_share"] < 0.35
    assert res["sparse_hit_rate"] > 0.9  # The bench's input is the same every step.
    assert "sparse decode (budget 0.25)" in printed.getvalue()
    assert "of the bytes" in printed.getvalue()
    args = _parser().parse_args([*common_args, "sparse", "--sparse", "1.0"])
    res = args.run(args)
    assert res["sparse_relative_error"] < 1e-2
    assert res["sparse_read_share"] > 1.0  # Every block, and the summaries too.


@pytest.mark.parametrize(
    "tier, t_transfer, t_compute, quantized, file_bar, host_bar",
    [
        ("file", 50.0, 35.0, 0.6, True, None),  # reads bound the step: 0.6 is the edge
        ("file", 50.0, 35.0, 0.601, False, None),
        ("file", 35.0, 35.0, 0.5, None, None),  # compute-bound: no read bar to judge
        ("file", 50.0, None, 0.5, None, None),  # no compute run: cannot tell
        ("host", None, 30.0, 1.0, None, True),  # the host tier's bar: 1.0 is the edge
        ("host", None, 30.0, 1.001, None, False),
    ],
)
def test_the_quantized_bar_is_the_tiers_own(
    tier, t_transfer, t_compute, quantized, file_bar, host_bar
):
    """The file tier's int8 bar (0.6) is judged only where reads bound the step, the host
    tier's (1.0) only on the host tier: neither judges the other tier's run."""
    res = dict(
        tier=tier, context=32768, t_transfer_ms=t_transfer, t_compute_ms=t_compute,
        quantized_over_prefetch=quantized, overlap_efficiency=None, prefetch_over_max=None,
        overlap_efficiency_compute=None, prefetch_over_max_compute=None,
        device_bytes_by_context={str(n): 1 for n in decode_report.CONTEXT_CHECK},
    )  # fmt: skip
    bars = decode_report.targets(res)
    assert bars["quantized step <= 0.6 x prefetch (file tier, reads bound the step)"] is file_bar
    assert bars["quantized step <= 1.0 x prefetch (host tier)"] is host_bar
