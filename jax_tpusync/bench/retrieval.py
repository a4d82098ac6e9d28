"""``retrieval``: answer accuracy of sparse decode against dense on a task whose answer
needs one KV block of a long context.

The model and the task are :mod:`jax_tpusync.bench.retrieval_model`'s: a two-layer decoder
whose weights are constructed by hand from one seed (a question head and a retrieval head),
asked for the digits of a key whose record is planted at ``--depths`` depths of a context
of ``--contexts`` tokens, among records of the key's siblings (hard negatives: key
directions of cosine ``--sibling-cos``), other keys' records and noise words. Each trial
decodes its ``--answer-tokens`` answer tokens greedily, densely and at each of ``--budgets``
(a share of each layer's context blocks, the first and the last block included); a trial
is right when every answer token is.

``--path engine`` (the default) decodes through :func:`jax_tpusync.prefetching_attention`
on an ``OffloadedKVCache(sparse=...)`` of ``--tier`` (``--tier pool``: a
``HostPoolKVCache(sparse=...)``, the TPU data path on the CPU backend's ``pinned_host``;
the context's KV loaded per layer:
the model computes it per token, without attention, so a 128K context costs seconds); the
counts and bytes are the cache's ``sparse_stats``. ``--path reference`` decodes through the
sparse reference (:func:`jax_tpusync.sparse.measure.measure`: the same summaries,
selection, prediction and late blocks in plain jnp over the KV kept in arrays), which also
reports each layer's recall. The output names the path (``path``).

Reported per context and budget: accuracy (and the trials right); the share of the dense
step's bytes read; per layer the prediction's hit rate (the blocks it prefetched that the
exact selection used, as ``sparse_stats`` counts it) and its coverage (the exact
selection's blocks it had prefetched; the rest are fetched late), over every decode step
and after the first (the first decode step has no previous selection: its prediction is
the sink and recent blocks). The defaults (32K tokens, 8 trials) run in minutes on two
cores; the figures in docs/benchmarks.md are from ``--contexts 32768 131072``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, retrieval_model

PATHS = {
    "engine": "engine cache (prefetching_attention on OffloadedKVCache(sparse=...), {tier} tier)",
    "reference": "sparse reference (jax_tpusync.sparse.measure over KV in arrays), not an "
    "engine cache",
}
# --tier pool's path (an engine-path option: the cache the engine path decodes through).
POOL_PATH = (
    "host pool (prefetching_attention on HostPoolKVCache(sparse=...), the TPU data path "
    "emulated on the CPU backend's pinned_host)"
)
TARGET_ACCURACY_POINTS = 1.0  # accuracy at a 5% budget within this many points of dense
TARGET_HIT_RATE = 0.90
TARGET_BUDGET = 0.05
COLUMNS = [
    ("context", "context", "d"),
    ("budget", "budget", "s"),
    ("trials", "trials", "d"),
    ("accuracy", "accuracy", ".3f"),
    ("hit_rate_min", "min hit rate", ".3f"),
    ("coverage_min", "min coverage", ".3f"),
    ("warm_coverage_min", "min cov., after 1st", ".3f"),
    ("read_share", "read share", ".3f"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``retrieval`` subcommand."""
    p = subparsers.add_parser(
        "retrieval",
        help="retrieval accuracy, sparse vs dense, on a hand-built model (one-block answers)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[32768], help="context tokens")
    p.add_argument(
        "--budgets", type=float, nargs="+", default=[0.02, 0.05, 0.10], help="shares of blocks"
    )
    p.add_argument("--depths", type=int, default=8, help="needle depths per context")
    p.add_argument("--seeds", type=int, default=1, help="contexts per depth")
    p.add_argument("--records", type=int, default=64, help="other keys' records per context")
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="trials decoded together")
    p.add_argument(
        "--path",
        choices=tuple(PATHS),
        default="engine",
        help="engine: prefetching_attention on a sparse OffloadedKVCache; reference: the "
        "sparse reference in plain jnp (also reports each layer's recall)",
    )
    p.add_argument(
        "--tier",
        choices=("host", "file", "pool"),
        default="host",
        help="engine path: the engine cache's tier, or pool: a HostPoolKVCache (the TPU data "
        "path, emulated on the CPU backend's pinned_host)",
    )
    p.add_argument("--tier-path", default=None, help="directory of the file tier (default: cwd)")
    for f in dataclasses.fields(retrieval_model.RetrievalModel):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    common.add_details_argument(p, "every row (accuracy, hit rates, recall, blocks read)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from jax_tpusync.sparse import SparseConfig

    if min(args.contexts) < 1 or args.depths < 1 or args.seeds < 1 or args.batch < 1:
        raise SystemExit("--contexts, --depths, --seeds and --batch must be positive")
    model = retrieval_model.RetrievalModel(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(retrieval_model.RetrievalModel)
        }
    )
    params = retrieval_model.build(model)
    rows = []
    for context in args.contexts:
        trials = [
            retrieval_model.make_trial(
                model,
                context,
                depth,
                args.block_tokens,
                seed=args.seed + 1000 * s + i,
                records=args.records,
            )
            for s in range(args.seeds)
            for i, depth in enumerate(retrieval_model.depths(args.depths))
        ]
        for budget in [None, *args.budgets]:
            config = SparseConfig(budget=budget if budget is not None else 1.0)
            t0 = time.perf_counter()
            decoded = []
            for lo in range(0, len(trials), args.batch):
                batch = trials[lo : lo + args.batch]
                if args.path == "engine":
                    out = _decode_engine(args, model, params, batch, budget and config)
                else:
                    out = retrieval_model.decode_reference(
                        model, params, batch, args.block_tokens, config, sparse=budget is not None
                    )
                decoded.append((batch, out))
            rows.append(_row(args, model, context, budget, decoded))
            common.progress(
                f"retrieval: {context} tokens, {rows[-1]['budget']}: accuracy "
                f"{rows[-1]['accuracy']:.3f} ({time.perf_counter() - t0:.0f} s)"
            )
    common.summary_or_details(args, summary(rows))
    return rows


def _decode_engine(args, model, params, batch, config):
    import os
    import shutil
    import tempfile

    path = None
    if args.tier == "file":
        where = os.path.abspath(args.tier_path or os.getcwd())
        path = tempfile.mkdtemp(prefix="tpusync-retrieval-", dir=where)
    try:
        return retrieval_model.decode_engine(
            model, params, batch, args.block_tokens, config or None, tier=args.tier, path=path
        )
    finally:
        if path:
            shutil.rmtree(path, ignore_errors=True)


def _stats_bytes(stats: dict, name: str) -> int:
    """Bytes ``name`` ("read" or "dense") of a cache's ``sparse_stats``: an engine cache's
    ``stats["bytes"]``, or a host pool's ``stats["totals"]`` (``read_bytes``...)."""
    if "bytes" in stats:
        return stats["bytes"][name]
    return stats["totals"][f"{name}_bytes"]


def _rate(numerator, denominator) -> list[float]:
    return [float(n / max(1, d)) for n, d in zip(numerator, denominator)]


def _row(args, model, context, budget, decoded) -> dict[str, Any]:
    right = np.concatenate([retrieval_model.correct(model, b, o.answers) for b, o in decoded])
    counts = sum(o.counts.sum(0) for _, o in decoded)  # [layers, 4]: COUNTS
    warm = sum(o.counts[1:].sum(0) for _, o in decoded)
    context_blocks = -(-(context + model.answer_tokens) // args.block_tokens)
    row = dict(
        context=context,
        budget="dense" if budget is None else f"{100 * budget:g}%",
        budget_share=budget,
        trials=int(right.size),
        right=int(right.sum()),
        accuracy=float(right.mean()),
        path=POOL_PATH
        if args.path == "engine" and args.tier == "pool"
        else PATHS[args.path].format(tier=args.tier),
        block_tokens=args.block_tokens,
        answer_tokens=model.answer_tokens,
        context_blocks=context_blocks,
        hit_rate_min=None,
        coverage_min=None,
        warm_coverage_min=None,
        read_share=None,
    )
    if decoded[0][1].recall is not None:
        # The selection the budget makes along the decode (dense: measured, not used).
        recall = np.concatenate([o.recall for _, o in decoded], axis=-1)
        read = np.concatenate([o.read_blocks for _, o in decoded], axis=-1)
        row.update(
            recall_per_layer=[float(x) for x in recall.mean(axis=(0, 2))],
            recall_min=float(recall.mean(axis=(0, 2)).min()),
            read_share=float(read.mean() / context_blocks),
        )
    if budget is not None:
        predicted, hits, late = counts[:, 0], counts[:, 1], counts[:, 2]
        hit_rate = _rate(hits, predicted)  # as sparse_stats: prefetched blocks used
        coverage = _rate(hits, hits + late)  # needed blocks that were prefetched
        warm_coverage = _rate(warm[:, 1], warm[:, 1] + warm[:, 2])
        row.update(
            counts_per_layer=counts.tolist(),
            hit_rate_per_layer=hit_rate,
            coverage_per_layer=coverage,
            warm_coverage_per_layer=warm_coverage,
            hit_rate_min=min(hit_rate),
            coverage_min=min(coverage),
            warm_coverage_min=min(warm_coverage),
        )
        stats = [o.stats for _, o in decoded if o.stats]
        if stats:  # the cache's bytes: summaries, predicted and late blocks against dense
            read_bytes = sum(_stats_bytes(st, "read") for st in stats)
            row["read_share"] = read_bytes / sum(_stats_bytes(st, "dense") for st in stats)
    row["read_share_of"] = (
        "the dense step's KV bytes (summaries, predicted and late blocks)"
        if args.path == "engine"
        else "the context's blocks (prediction and late blocks)"
    )
    return row


def summary(rows: list[dict[str, Any]]) -> str:
    """Per context, in words: dense accuracy, each budget's accuracy and prediction hit
    rates, and whether the targets hold."""
    lines = [f"retrieval through the {rows[0]['path']}"]
    for context in dict.fromkeys(r["context"] for r in rows):
        mine = [r for r in rows if r["context"] == context]
        dense = next(r for r in mine if r["budget_share"] is None)
        lines.append(
            f"{context} tokens ({dense['context_blocks']} blocks of {dense['block_tokens']}), "
            f"{dense['trials']} trials: dense answers {_percent(dense['accuracy'])} right"
        )
        for r in mine:
            if r["budget_share"] is None:
                continue
            gap = 100 * (dense["accuracy"] - r["accuracy"])
            hits = ", ".join(f"{h:.3f}" for h in r["hit_rate_per_layer"])
            cover = ", ".join(f"{h:.3f}" for h in r["coverage_per_layer"])
            warm = ", ".join(f"{h:.3f}" for h in r["warm_coverage_per_layer"])
            lines.append(
                f"  budget {r['budget']} (reads {_percent(r['read_share'])} of "
                f"{r['read_share_of']}): {_percent(r['accuracy'])} right ({_points(gap)}); per layer, the "
                f"prediction's hit rate (prefetched blocks used) {hits}, its coverage (needed "
                f"blocks prefetched) {cover}, after the first decode step {warm}"
            )
            if r["budget_share"] == TARGET_BUDGET:
                r["targets"] = {
                    f"accuracy within {TARGET_ACCURACY_POINTS:g} point of dense": gap
                    <= TARGET_ACCURACY_POINTS,
                    f"hit rate >= {TARGET_HIT_RATE} on every layer": r["hit_rate_min"]
                    >= TARGET_HIT_RATE,
                }
                met = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["targets"].items())
                lines.append(f"    targets: {met}")
    return "\n".join(lines)


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def _points(below: float) -> str:
    """Points below dense, in words."""
    if abs(below) < 0.05:
        return "as dense"
    return f"{abs(below):.1f} points {'below' if below > 0 else 'above'} dense"
