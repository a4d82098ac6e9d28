"""The ``decode`` benchmark's row: step times, ratios, errors, bytes, targets; and its summary."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
from typing import Any

import numpy as np

from jax_tpusync.bench import baselines, common, verdict
from jax_tpusync.bench.decode_variants import VARIANTS, Bench, Step
from jax_tpusync.bench.tiny_decoder import Shape

# Every row name, in table order.
ALL = VARIANTS + baselines.VARIANTS
# Contexts at which device_bytes is checked to be the same.
CONTEXT_CHECK = (32 * 1024, 1024 * 1024)
STALL_NS = 100_000  # A wait longer than this stalled the step.


def row(
    b: Bench,
    steps: dict[str, Step],
    samples: dict[str, common.Samples],
    costs: dict[str, dict[str, list[float]]],
    first_out: dict[str, np.ndarray],
    pf_stats: dict[str, Any],
    aux_fetch: dict[str, float],
    rounds: int,
) -> dict[str, Any]:
    """One context's row, from what the rotation measured."""
    from jax_tpusync.runtime.engine import huge_page_fraction

    args, shape, spec = b.args, b.shape, b.spec
    pf_engine = b.pf_cache.engine
    aux = b.cache_of("transfer")[0]
    contig = b.cache_of("contiguous")[0]
    quant = b.cache_of("quantized")[0]
    resident_cache = b.cache_of("resident_mode")[0]
    med = {n: s.median * 1e3 for n, s in samples.items()}
    pf_tier = pf_engine.tier_info(b.pf_cache.tier)
    aux_tier = aux.engine.tier_info(aux.tier) if aux else None
    res: dict[str, Any] = dict(
        tier=args.tier,
        context=args.context,
        layers=shape.layers,
        batch=shape.batch,
        q_heads=shape.q_heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        ffn=shape.ffn,
        dtype=args.dtype,
        chunk_len=spec.chunk_len,
        units_per_layer=-(-args.context // spec.chunk_len),
        staging_bytes=args.staging_bytes,
        io_chunk_bytes=args.chunk_bytes,
        io_depth=args.io_depth,
        engine_cpus=args.engine_cpus_kept,
        worker_cpus=list(b.worker_cpus),
        prefetch_depth=b.depth,
        kv_bytes_per_step=shape.kv_bytes_per_step,
        direct_io=pf_tier.direct_io if args.tier == "file" else None,
        direct_read_fraction=common.direct_read_fraction(pf_tier),
        transfer_direct_read_fraction=(common.direct_read_fraction(aux_tier) if aux_tier else None),
        # Whether sync and transfer read the prefetching cache's own file (no longer, on the
        # file tier: see decode_variants._aux_cache).
        transfer_same_file=bool(
            aux_tier
            and b.path
            and aux_tier.description == pf_tier.description
            and aux.first_block == b.pf_cache.first_block
        ),
        # O_DIRECT into 4 KiB pages ran at 2.0-2.5 GB/s here, into huge pages at 2.9.
        staging_huge_page_fraction=huge_page_fraction(steps["prefetch"].state.staging),
        transfer_staging_huge_page_fraction=(
            huge_page_fraction(steps["transfer"].state) if "transfer" in steps else None
        ),
        samples_per_variant=len(samples["prefetch"].seconds),
    )
    for n in ALL:
        if n in samples:
            res[f"t_{n}_ms"] = med[n]
            res[f"t_{n}_ms_min"] = samples[n].min * 1e3
            res[f"t_{n}_ms_max"] = samples[n].max * 1e3
            res[f"t_{n}_ms_samples"] = [t * 1e3 for t in samples[n].seconds]
            res[f"cpu_user_{n}_ms"] = statistics.median(costs[n]["cpu_user"]) * 1e3
            res[f"cpu_system_{n}_ms"] = statistics.median(costs[n]["cpu_system"]) * 1e3
            res[f"minor_faults_{n}_per_step"] = statistics.median(costs[n]["minor_faults"])
        else:
            res[f"t_{n}_ms"] = res[f"t_{n}_ms_min"] = res[f"t_{n}_ms_max"] = None
            res[f"t_{n}_ms_samples"] = []
    res["jax_offload_label"] = b.jax_offload_label
    t_res, t_xfer, t_pf = res["t_resident_ms"], res["t_transfer_ms"], res["t_prefetch_ms"]
    res["overlap_efficiency"] = (
        (t_res + t_xfer - t_pf) / min(t_res, t_xfer) if t_res and t_xfer else None
    )
    res["prefetch_over_max"] = t_pf / max(t_res, t_xfer) if t_res and t_xfer else None
    t_cmp = res["t_compute_ms"]
    res["overlap_efficiency_compute"] = (
        (t_cmp + t_xfer - t_pf) / min(t_cmp, t_xfer) if t_cmp and t_xfer else None
    )
    res["prefetch_over_max_compute"] = t_pf / max(t_cmp, t_xfer) if t_cmp and t_xfer else None
    t_plain, t_platform = res["t_plain_ms"], res["t_platform_ms"]
    res["platform_overlap_efficiency"] = (
        (t_cmp + t_plain - t_platform) / min(t_cmp, t_plain)
        if t_cmp and t_plain and t_platform
        else None
    )
    res["prefetch_over_platform"] = t_pf / t_platform if t_platform else None
    res["sync_over_prefetch"] = res["t_sync_ms"] / t_pf if res["t_sync_ms"] else None
    t_contig = res["t_contiguous_ms"]
    res["paged_over_contiguous"] = t_pf / t_contig if t_contig else None
    t_two = res["t_two_level_ms"]
    res["two_level_over_prefetch"] = t_two / t_pf if t_two else None
    res["two_level_note"] = b.notes.get("two_level")
    res["copy_note"] = b.notes.get("copy")
    res["copy_over_prefetch"] = res["t_copy_ms"] / t_pf if res["t_copy_ms"] else None
    res["block_tokens"] = spec.block_tokens
    fetch = pf_engine.stats()["tiers"][b.pf_cache.tier]["fetch"]
    res["fetch_segments"] = fetch["segments"]
    res["fetch_bytes_per_segment"] = fetch["bytes_per_segment"]
    if contig is not None:
        res["contiguous_block_tokens"] = contig.spec.block_tokens
        cfetch = contig.engine.stats()["tiers"][contig.tier]["fetch"]
        res["contiguous_fetch_bytes_per_segment"] = cfetch["bytes_per_segment"]
    res.update(_quantized_row(res, quant, spec, shape, args, first_out))
    res.update(_sparse_row(res, b, steps, first_out))
    res["baseline_page_cache"] = baselines.page_cache(args) if args.baselines else None
    res["memcpy_ms"], res["memcpy_bytes_timed"] = baselines.memcpy_ms(shape.kv_bytes_per_step)
    res.update(baselines.ratios(res))
    res["tokens_per_s"] = shape.batch / (t_pf / 1e3)
    for n in ("resident", "compute", "sync", "jax_offload"):
        res[f"tokens_per_s_{n}"] = shape.batch / (med[n] / 1e3) if n in med else None

    # Errors: every variant's first step ran at lengths == context; resident and prefetch
    # have since run the same number of steps (so their caches hold the same tokens).
    def err(x, y):
        return float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))

    if "resident" in steps:
        ref = first_out["resident"]
        res["max_abs_err"] = err(first_out["prefetch"], ref)
        assert steps["resident"].steps == steps["prefetch"].steps
        res["max_abs_err"] = max(
            res["max_abs_err"], err(steps["prefetch"].out, steps["resident"].out)
        )
        for n in ("sync", "jax_offload"):
            res[f"{n}_max_abs_err"] = err(first_out[n], ref) if n in first_out else None
        for n in ("copy", "resident_mode", "two_level"):  # Append a token per step too.
            res[f"max_abs_err_{n}"] = None
            if n in steps:
                assert steps[n].steps == steps["resident"].steps
                res[f"max_abs_err_{n}"] = max(
                    err(first_out[n], ref), err(steps[n].out, steps["resident"].out)
                )
        # The baselines append a token per step too: first and last step against resident.
        for n in baselines.VARIANTS:
            res[f"max_abs_err_{n}"] = None
            if n in steps:
                assert steps[n].steps == steps["resident"].steps
                res[f"max_abs_err_{n}"] = max(
                    err(first_out[n], ref), err(steps[n].out, steps["resident"].out)
                )
    else:
        res["max_abs_err"] = res["max_abs_err_resident_mode"] = None
        res["max_abs_err_two_level"] = res["max_abs_err_copy"] = None
        res.update({f"max_abs_err_{n}": None for n in baselines.VARIANTS})
    res["output_abs_max"] = float(np.max(np.abs(first_out["prefetch"])))
    res["resident_mode_note"] = b.notes.get("resident_mode")
    res["resident_mode_device_bytes"] = (
        resident_cache.spec.device_bytes if resident_cache is not None else None
    )

    res["device_bytes"] = spec.device_bytes
    res["kv_bytes"] = spec.kv_bytes
    res["device_bytes_by_context"] = _device_bytes_by_context(
        args, shape, shape.dtype, spec.reads_in_place
    )
    res["resident_device_bytes"] = 2 * shape.layers * shape.batch * b.max_len * shape.row_bytes

    steps_timed = rounds * args.block  # Since reset_stats: every step of the timed rounds.
    res["prefetch_hits"] = pf_stats["prefetch_hits"]
    res["prefetch_misses"] = pf_stats["prefetch_misses"]
    res["in_place_reads"] = pf_stats["in_place_reads"]
    res["reads_in_place"] = spec.reads_in_place
    res["prefetch_wait_ms_per_step"] = pf_stats["wait_s"] * 1e3 / steps_timed
    pf_fetch = pf_stats["tiers"][0]["fetch"]
    res["prefetch_fetch_gbps_busy"] = pf_fetch["gbps"]
    res["prefetch_fetch_gbps"] = shape.kv_bytes_per_step / (t_pf / 1e3) / 1e9
    res["transfer_fetch_gbps"] = shape.kv_bytes_per_step / (t_xfer / 1e3) / 1e9 if t_xfer else None
    res["transfer_fetch_gbps_busy"] = (
        aux_fetch["bytes"] / aux_fetch["busy"] / 1e9 if aux_fetch["busy"] else None
    )
    res["targets"] = targets(res)
    return res


def timeline_outputs(res: dict[str, Any], b: Bench, timeline) -> None:
    """The prefetch steps' timeline: its summary in ``res``, and ``--trace`` / ``--plot``."""
    from jax_tpusync.runtime import timeline as tl

    args, shape, spec = b.args, b.shape, b.spec
    t_pf, t_xfer = res["t_prefetch_ms"], res["t_transfer_ms"]
    res["timeline_summary"] = tl.summarize(timeline, stall_ns=STALL_NS)
    if args.trace:
        tl.write_chrome_trace(timeline, args.trace)
        print(f"wrote {args.trace}")
    if args.plot_timeline:
        title = (
            f"prefetch decode step: {args.tier} tier, context {args.context}, "
            f"{shape.layers} layers, chunk_len {spec.chunk_len} "
            f"({t_pf:.0f} ms/step median; compute {res['t_compute_ms'] or float('nan'):.0f}"
            f" ms, transfer {t_xfer or float('nan'):.0f} ms, sync "
            f"{res['t_sync_ms'] or float('nan'):.0f} ms)"
        )
        tl.plot(timeline, args.plot_timeline, title=title, stall_ns=STALL_NS, last_steps=2)
        print(f"wrote {args.plot_timeline}")


def fetch_counters(engine) -> tuple[int, float]:
    s = engine.stats()
    return (
        sum(t["fetch"]["bytes"] for t in s["tiers"]),
        sum(t["fetch"]["busy_s"] for t in s["tiers"]),
    )


def _device_bytes_by_context(args, shape: Shape, dtype, reads_in_place: bool) -> dict[str, int]:
    """device_bytes of the same cache configuration at 32K and 1M context (on a sparse file
    tier, as the configuration of a cache that ``reads_in_place`` or not)."""
    import jax_tpusync as tps

    out = {}
    d = tempfile.mkdtemp(
        prefix="tpusync-devbytes-",
        dir=os.path.abspath(args.path or os.getcwd()) if args.tier == "file" else None,
    )
    try:
        for n in CONTEXT_CHECK + (args.context,):
            with tps.OffloadedKVCache(
                num_layers=shape.layers,
                batch=shape.batch,
                max_len=n,
                num_kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                dtype=dtype,
                tier="file",
                path=d,
                staging_bytes=args.staging_bytes,
            ) as c:
                spec = dataclasses.replace(c.spec, reads_in_place=reads_in_place)
                out[str(n)] = spec.device_bytes
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _quantized_row(res, quant, spec, shape: Shape, args, first_out) -> dict[str, Any]:
    """The quantized variant's bytes and ratios beside the prefetch step's."""
    if quant is None:
        return dict(tier_dtype=None, quantized_over_prefetch=None)
    fetched = shape.kv_bytes_per_step * quant.spec.row_bytes // spec.row_bytes
    out = dict(
        tier_dtype=args.tier_dtype,
        quantized_over_prefetch=res["t_quantized_ms"] / res["t_prefetch_ms"],
        quantized_row_bytes=quant.spec.row_bytes,
        quantized_bytes_ratio=quant.spec.row_bytes / spec.row_bytes,
        kv_bytes_per_step=shape.kv_bytes_per_step,
        quantized_kv_bytes_per_step=fetched,
        quantized_chunk_len=quant.spec.chunk_len,
        quantized_device_bytes=quant.spec.device_bytes,
        quantized_kv_bytes=quant.spec.kv_bytes,
    )
    if "resident" in first_out:  # Quantization error of the first step, not a bug check.
        diff = np.asarray(first_out["quantized"], np.float32) - np.asarray(
            first_out["resident"], np.float32
        )
        out["quantized_max_abs_diff"] = float(np.max(np.abs(diff)))
    return out


def _sparse_row(res, b: Bench, steps: dict[str, Step], first_out) -> dict[str, Any]:
    """The sparse variant's step against the dense ones, the KV bytes it read per step
    (summaries, predicted and late blocks) against a dense step's, and its first step's
    output against the dense one's (the relative error of reading a share of the blocks,
    on the bench's random KV)."""
    cache = b.cache_of("sparse")[0]
    if cache is None or "sparse" not in steps:
        return dict(sparse_budget=None, sparse_over_prefetch=None, sparse_read_share=None)
    stats = cache.sparse_stats(steps["sparse"].state)
    t_sparse = res["t_sparse_ms"]
    layers = stats["layers"]
    dense = np.asarray(first_out["prefetch"], np.float32)
    predicted = sum(row["predicted"] for row in layers)
    hits = sum(row["hits"] for row in layers)
    return dict(
        sparse_budget=b.args.sparse,
        sparse_block_tokens=cache.spec.block_tokens,
        sparse_over_prefetch=t_sparse / res["t_prefetch_ms"],
        sparse_over_resident=t_sparse / res["t_resident_ms"] if res["t_resident_ms"] else None,
        sparse_over_resident_mode=(
            t_sparse / res["t_resident_mode_ms"] if res["t_resident_mode_ms"] else None
        ),
        sparse_steps_counted=stats["steps"],
        sparse_bytes_per_step=stats["bytes_per_step"]["read"],
        sparse_dense_bytes_per_step=stats["bytes_per_step"]["dense"],
        sparse_bytes=stats["bytes"],
        sparse_read_share=stats["read_share"],
        sparse_hit_rate=hits / predicted if predicted else None,
        sparse_hit_rate_per_layer=[row["hit_rate"] for row in layers],
        sparse_late_per_layer=[row["late"] for row in layers],
        sparse_summary_bytes=cache.spec.summary_bytes,
        sparse_relative_error=float(
            np.linalg.norm(np.asarray(first_out["sparse"], np.float32) - dense)
            / max(float(np.linalg.norm(dense)), 1e-30)
        ),
    )


def targets(res: dict[str, Any]) -> dict[str, Any]:
    """Each bar of the decode bench this run can judge: True or False, None where it cannot."""
    by_ctx = res["device_bytes_by_context"]
    out: dict[str, Any] = {}
    for suffix, floor in (("", "t_resident"), ("_compute", "t_compute")):
        eff = res[f"overlap_efficiency{suffix}"]
        ratio = res[f"prefetch_over_max{suffix}"]
        out[f"overlap_efficiency{suffix} >= 0.9 (file tier)"] = None if eff is None else eff >= 0.9
        out[f"t_prefetch <= 1.1 x max({floor}, t_transfer)"] = (
            None if ratio is None else ratio <= 1.1
        )
    paged = res.get("paged_over_contiguous")
    out["paged step <= 1.05 x contiguous"] = None if paged is None else paged <= 1.05
    quantized = res.get("quantized_over_prefetch")
    # Each tier's bar: half the bytes pay where reads bound the step (the file tier's reads
    # slower than the compute), and dequantizing costs nothing net where they do not.
    t_read, t_compute = res.get("t_transfer_ms"), res.get("t_compute_ms")
    read_bound = t_read is not None and t_compute is not None and t_read > t_compute
    out["quantized step <= 0.6 x prefetch (file tier, reads bound the step)"] = (
        quantized <= 0.6 if quantized is not None and res["tier"] == "file" and read_bound else None
    )
    out["quantized step <= 1.0 x prefetch (host tier)"] = (
        quantized <= 1.0 if quantized is not None and res["tier"] == "host" else None
    )
    share, ratio = res.get("sparse_read_share"), res.get("sparse_over_prefetch")
    five = res.get("sparse_budget") == 0.05
    out["sparse (5%) bytes read <= 0.07 x dense, from 128K"] = (
        share <= 0.07 if share is not None and five and res["context"] >= 128 * 1024 else None
    )
    out["sparse (5%) step <= 0.15 x dense (file tier, 256K)"] = (
        ratio <= 0.15
        if ratio is not None and five and res["tier"] == "file" and res["context"] >= 256 * 1024
        else None
    )
    out["device_bytes equal at 32K and 1M context"] = (
        len({by_ctx[str(n)] for n in CONTEXT_CHECK}) == 1
    )
    return out


# The library's steps, the plain-JAX baselines and the floor of the short summary, with the
# words the summary calls them by.
LIBRARY_LABELS = {
    "prefetch": "library (prefetching_attention)",
    "resident_mode": "library (resident=True cache)",
}
BASELINE_LABELS = {
    "jax_offload": "plain JAX (device_put in jit)",
    "plain_jax": "plain JAX (memmap + device_put per layer)",
    "tuned_jax": "plain JAX (memmap, next layer on a thread)",
}
FLOOR_LABEL = "resident floor (all KV in device memory)"


def _spread(res: dict[str, Any], name: str) -> verdict.Spread | None:
    samples = res.get(f"t_{name}_ms_samples")
    return verdict.Spread.of(samples) if samples else None


def user_summary(res: dict[str, Any]) -> str:
    """One context's short summary: the library's step against the faster plain-JAX
    baseline (and the resident floor, where it ran) in words, with the samples' spread."""
    ran = {n: s for n in (*LIBRARY_LABELS, *BASELINE_LABELS, "resident") if (s := _spread(res, n))}
    library = min((n for n in LIBRARY_LABELS if n in ran), key=lambda n: ran[n].median)
    jax = [n for n in BASELINE_LABELS if n in ran]
    best_jax = min(jax, key=lambda n: ran[n].median) if jax else None
    rows = [(LIBRARY_LABELS[library], ran[library])]
    rows += [(BASELINE_LABELS[n], ran[n]) for n in jax]
    if "resident" in ran:
        rows.append((FLOOR_LABEL, ran["resident"]))
    heading = (
        f"context {baselines.tokens(res['context'])}: {res['tier']} tier, {res['layers']} "
        f"layers x {res['kv_heads']} KV heads x {res['head_dim']} ({res['dtype']}), batch "
        f"{res['batch']}"
    )
    lines = [heading, verdict.table(rows)]
    if best_jax is None:
        lines.append(
            "  no plain-JAX baseline ran: add the jax_offload variant or --baselines plain,tuned"
        )
    else:
        lines.append(
            f"  the library is {verdict.compare(ran[library], ran[best_jax], BASELINE_LABELS[best_jax])}"
        )
    if res.get("sparse_over_prefetch") is not None:
        lines.append(sparse_words(res))
    if "resident" in ran:
        floor, lib = ran["resident"], ran[library]
        line = f"  the resident floor is {verdict.compare(floor, lib, 'the library')}"
        if floor.median > lib.median and not verdict.within_noise(floor, lib):
            line += "; a floor should not be slower: rerun with more --steps on a quieter machine"
        lines.append(line)
    return "\n".join(lines)


def sparse_words(res: dict[str, Any]) -> str:
    """The sparse step against the dense ones and its bytes, in words."""
    mib = 1 << 20
    words = (
        f"  sparse decode (budget {res['sparse_budget']}): {res['t_sparse_ms']:.1f} ms a step, "
        f"{res['sparse_over_prefetch']:.3f} x the dense step ({res['t_prefetch_ms']:.1f} ms)"
    )
    if res.get("sparse_over_resident") is not None:
        words += f", {res['sparse_over_resident']:.3f} x the resident floor"
    hit = res.get("sparse_hit_rate")
    words += (
        f"; it read {res['sparse_bytes_per_step'] / mib:.1f} MiB of KV a step (summaries, "
        f"predicted and late blocks) against {res['sparse_dense_bytes_per_step'] / mib:.1f} "
        f"MiB dense: {res['sparse_read_share']:.3f} of the bytes"
        + ("" if hit is None else f"; prediction hit rate {hit:.3f}")
    )
    return words


def plot_comparison(res: dict[str, Any], out: str) -> None:
    """``--plot`` at one context: a bar per step of :func:`user_summary`, with its spread."""
    names = [*LIBRARY_LABELS, *BASELINE_LABELS, "resident"]
    labels = {**LIBRARY_LABELS, **BASELINE_LABELS, "resident": FLOOR_LABEL}
    rows = [(labels[n], res[f"t_{n}_ms_samples"]) for n in names if res.get(f"t_{n}_ms_samples")]
    title = (
        f"decode step at context {baselines.tokens(res['context'])}, {res['tier']} tier:\n"
        f"{res['layers']} layers x {res['kv_heads']} KV heads x {res['head_dim']} ({res['dtype']})"
    )
    verdict.plot_bars(rows, out, title)


def print_summary(res: dict[str, Any]) -> None:
    """The developer summary (``--details``): every variant, ratios, counters, targets."""

    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    print()
    print(f"{'variant':<12} {'median ms':>10} {'min':>9} {'max':>9} {'cpu ms':>13}  note")
    notes = {
        "resident": "resident_attention, all KV in device memory, no engine",
        "compute": "the same per-unit attention on warm staging slots, no transfer",
        "transfer": f"engine fetch of one step's KV, no compute "
        f"({f(res['transfer_fetch_gbps'], '.2f')} GB/s)",
        "sync": "fetch on demand, then compute, per unit",
        "prefetch": f"prefetching_attention ({f(res['tokens_per_s'], '.2f')} tok/s, "
        f"{f(res['prefetch_fetch_gbps'], '.2f')} GB/s of KV; {res['block_tokens']}-token "
        f"blocks, {res['fetch_bytes_per_segment'] / 1024:.0f} KiB per segment)",
        "copy": res.get("copy_note")
        or f"the same with read_in_place=False: each unit copied into staging "
        f"(copy/prefetch {f(res.get('copy_over_prefetch'), '.3f')})",
        "resident_mode": res.get("resident_mode_note")
        or "prefetching_attention on a resident=True cache: write-back only, no fetch",
        "contiguous": f"the same, one KV block per sequence (paged/contiguous "
        f"{f(res['paged_over_contiguous'], '.3f')})",
        "two_level": res.get("two_level_note")
        or f"the same on a two-level cache, all blocks in DRAM: a fetch per tier per unit "
        f"(two-level/prefetch {f(res.get('two_level_over_prefetch'), '.3f')})",
        "quantized": "not run (--tier-dtype adds it)"
        if res.get("tier_dtype") is None
        else f"the same over {res.get('tier_dtype')} rows + scales "
        f"({f(res.get('quantized_bytes_ratio'), '.3f')} of the bytes; quantized/prefetch "
        f"{f(res['quantized_over_prefetch'], '.3f')})",
        "sparse": "not run (--sparse BUDGET adds it)"
        if res.get("sparse_budget") is None
        else f"the same read sparsely (budget {res['sparse_budget']}): "
        f"{f(res.get('sparse_read_share'), '.3f')} of the KV bytes, hit rate "
        f"{f(res.get('sparse_hit_rate'), '.3f')} (sparse/prefetch "
        f"{f(res.get('sparse_over_prefetch'), '.3f')})",
        "plain": "plain reader thread on the engine's CPUs, same bytes, no engine",
        "platform": "compute beside that plain reader: this machine's own overlap",
        "jax_offload": "pinned_host KV + device_put in jit"
        + (f" [{res['jax_offload_label']}]" if res.get("jax_offload_label") else ""),
        **baselines.NOTES,
    }
    for n in ALL:
        cpu = "-"
        if res.get(f"cpu_user_{n}_ms") is not None:  # user+system, all threads, per step
            cpu = f"{res[f'cpu_user_{n}_ms']:.0f}+{res[f'cpu_system_{n}_ms']:.0f}"
        print(
            f"{n:<12} {f(res[f't_{n}_ms']):>10} {f(res[f't_{n}_ms_min']):>9} "
            f"{f(res[f't_{n}_ms_max']):>9} {cpu:>13}  {notes[n]}"
        )
    print(
        f"\noverlap_efficiency {f(res['overlap_efficiency'], '.3f')} (vs compute: "
        f"{f(res['overlap_efficiency_compute'], '.3f')})  t_prefetch/max(floor, t_transfer) "
        f"{f(res['prefetch_over_max'], '.3f')} (vs compute: "
        f"{f(res['prefetch_over_max_compute'], '.3f')})  t_sync/t_prefetch "
        f"{f(res['sync_over_prefetch'], '.3f')}  max_abs_err {f(res['max_abs_err'], '.3g')}"
    )
    print(
        f"plain JAX: t_prefetch/min(plain_jax, tuned_jax) {f(res['prefetch_over_best_jax'], '.3f')}"
        f" (with resident mode: {f(res['library_over_best_jax'], '.3f')})"
        f" (memmap pages: {res['baseline_page_cache'] or '-'}), errors "
        f"{f(res['max_abs_err_plain_jax'], '.3g')} / {f(res['max_abs_err_tuned_jax'], '.3g')}; "
        f"memcpy of the step's KV {f(res['memcpy_ms'])} ms, t_prefetch/max(t_resident, memcpy) "
        f"{f(res['host_over_floor'], '.3f')}"
    )
    print(
        f"platform (compute beside a plain reader): efficiency "
        f"{f(res['platform_overlap_efficiency'], '.3f')}, t_prefetch/t_platform "
        f"{f(res['prefetch_over_platform'], '.3f')}"
    )
    print(
        f"prefetch hits {res['prefetch_hits']} misses {res['prefetch_misses']}, units read in "
        f"place {res['in_place_reads']}, stalled "
        f"{res['prefetch_wait_ms_per_step']:.1f} ms/step in waits; device_bytes "
        f"{common.format_bytes(res['device_bytes'])} (by context: "
        f"{res['device_bytes_by_context']}), kv_bytes {common.format_bytes(res['kv_bytes'])}"
    )
    pf_huge, xfer_huge = (
        res["staging_huge_page_fraction"],
        res["transfer_staging_huge_page_fraction"],
    )
    if pf_huge is not None:
        print(
            f"staging in huge pages: prefetch {pf_huge:.0%}"
            + (f", transfer {xfer_huge:.0%}" if xfer_huge is not None else "")
        )
    pf_direct, xfer_direct = res["direct_read_fraction"], res["transfer_direct_read_fraction"]
    if xfer_direct is not None and xfer_direct < pf_direct - 0.01:
        print(
            f"note: transfer/sync fetched {xfer_direct:.0%} by O_DIRECT straight into staging "
            f"(prefetch {pf_direct:.0%}): their staging buffers fell out of phase with the "
            "file, so their rows include bounce copies"
        )
    print("targets:")
    for name, ok in res["targets"].items():
        print(f"  [{'PASS' if ok else '----' if ok is None else 'FAIL'}] {name}")
