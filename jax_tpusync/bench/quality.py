"""``quality``: what a quantized tier does to a model's next tokens after a long context.

``--batch`` sequences of random tokens are prefilled through the benchmarks' small decoder
(:mod:`jax_tpusync.bench.tiny_decoder`) to ``--context`` tokens, so the cached KV is the
model's own (its projections of its hidden states, not random numbers). The prefill attends
within a sliding window of ``--prefill-window`` tokens, which keeps it linear in the context
on a CPU (0: full attention). That KV is loaded once into a cache per tier dtype: the
reference (rows in bfloat16) and each ``--tier-dtypes`` entry (quantized by ``load``, as
the step quantizes its own tokens). Then ``--steps`` decode steps with full attention over
the whole context: the reference picks each next token greedily, and every quantized cache
is fed the same tokens (teacher forcing), so each step compares the next-token choice
given one history.

Per tier dtype: ``top1_agreement`` (share of steps x sequences whose argmax matches the
reference's), ``max_abs_logit_diff`` / ``mean_abs_logit_diff``, the tier bytes against the
reference's, and the median decode step. ``reference_top1_margin`` (the reference's mean
gap between its best and second-best logit) and ``reference_near_ties`` (the share of
decisions it led by less than 0.05) say how close the calls were
(``top1_agreement_decisive`` counts only the others), and the
``other_context`` row (bfloat16 rows, each sequence given another sequence's context, with
``--batch`` >= 2) how far the logits move when the context itself changes: quantization
error is only small next to that.

Printed by default: per quantized tier, in words, how far it moves the logits next to how
far changing the context moves them, and how often it picks the reference's token;
``--details``: every row. The default context (8192 tokens) runs in a minute or two on two
cores; the figures in docs/benchmarks.md are from ``--context 32768``.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, tiny_decoder

COLUMNS = [
    ("tier_dtype", "tier dtype", "s"),
    ("context", "context", "d"),
    ("decisions", "decisions", "d"),
    ("top1_agreement", "top-1 agree", ".4f"),
    ("top1_agreement_decisive", "decisive agree", ".4f"),
    ("max_abs_logit_diff", "max |dlogit|", ".3g"),
    ("mean_abs_logit_diff", "mean |dlogit|", ".3g"),
    ("tier_bytes_ratio", "tier bytes", ".3f"),
    ("step_ms", "step ms", ".1f"),
]
TARGET_INT8_AGREEMENT = 0.99
# Reference decisions whose best logit leads the second by less are near-ties: any change
# of the context flips some of them (reported apart as ``reference_near_ties``).
DECISIVE_MARGIN = 0.05
# The row that shows how much the logits depend on the context at all.
CONTROL = "other_context"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``quality`` subcommand."""
    p = subparsers.add_parser(
        "quality",
        help="top-1 agreement and logit error of quantized tiers vs a bf16 cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tier-dtypes",
        nargs="+",
        choices=("int8", "float8_e4m3fn"),
        default=["int8", "float8_e4m3fn"],
    )
    p.add_argument("--tier", choices=("host", "file"), default="host")
    p.add_argument("--path", default=None, help="directory of the file tier (default: cwd)")
    p.add_argument("--context", type=int, default=8192, help="cached tokens before decoding")
    p.add_argument("--steps", type=int, default=64, help="greedy decode steps compared")
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--prefill-window", type=int, default=1024, help="prefill window (0: full)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill tokens per call")
    # Queries x4: attention picks out a few keys, so the next token depends on the context
    # (at 1, over thousands of random-weight keys, it is nearly an average; see README).
    tiny_decoder.add_arguments(p, defaults=tiny_decoder.Decoder(q_gain=4.0))
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--staging-bytes", type=common.parse_bytes, default=32 * common.MiB)
    p.add_argument("--prefetch-depth", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    common.add_engine_arguments(p)
    common.add_cpu_arguments(p)
    common.add_details_argument(p, "every row (agreement, logit differences, bytes, step time)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    worker_cpus = common.apply_cpu_arguments(args)  # Before JAX starts its backend.
    import jax
    import jax.numpy as jnp

    import jax_tpusync as tps

    if args.context < 1 or args.steps < 1 or args.batch < 2:
        raise SystemExit("--context and --steps must be positive, --batch at least 2")
    model = tiny_decoder.Decoder.of(args)
    params = tiny_decoder.init_params(model, args.seed)
    step = jax.jit(functools.partial(tiny_decoder.forward, model), donate_argnums=(2,))
    engine = common.engine_config(args, worker_cpus)
    max_len = args.context + args.steps
    cache_args = dict(
        num_layers=model.layers,
        batch=args.batch,
        max_len=max_len,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        dtype=jnp.bfloat16,
        block_tokens=args.block_tokens,
        staging_bytes=args.staging_bytes,
        prefetch_depth=args.prefetch_depth,
        engine=engine,
    )

    # The context: the model's own KV, from a (windowed) prefill in host DRAM.
    tokens = np.random.default_rng(args.seed + 1).integers(
        0, model.vocab, (args.batch, args.context)
    )
    t0 = time.perf_counter()
    window = args.prefill_window or None
    with tps.OffloadedKVCache(**cache_args, sliding_window=window) as prefill_cache:
        state = prefill_cache.init(np.zeros(args.batch, np.int32))
        for lo in range(0, args.context, args.chunk):
            logits, state = step(
                params, jnp.asarray(tokens[:, lo : lo + args.chunk], jnp.int32), state
            )
        first = np.asarray(jnp.argmax(logits, axis=-1))
        state = prefill_cache.drain(state)
        context_kv = [prefill_cache.read_all(layer, args.context) for layer in range(model.layers)]
    prefill_s = time.perf_counter() - t0
    common.progress(f"quality: prefilled {args.batch} x {args.context} tokens in {prefill_s:.1f} s")

    path = None
    if args.tier == "file":
        path = tempfile.mkdtemp(
            prefix="tpusync-quality-", dir=os.path.abspath(args.path or os.getcwd())
        )
    try:
        decoded = {}
        fed = None  # The reference's greedy tokens, fed to every quantized cache.
        # The control: bfloat16 rows, each sequence given the next one's context.
        for variant in [None, *args.tier_dtypes, CONTROL]:
            tier_dtype = None if variant == CONTROL else variant
            roll = 1 if variant == CONTROL else 0
            common.progress(f"quality: {args.steps} decode steps, {variant or 'bfloat16'} cache")
            with tps.OffloadedKVCache(
                **cache_args, tier_dtype=tier_dtype, tier=args.tier, path=path
            ) as cache:
                state = cache.init(np.zeros(args.batch, np.int32))
                for layer, (k, v) in enumerate(context_kv):
                    k, v = (np.roll(x[:, : args.context], roll, axis=0) for x in (k, v))
                    state = cache.load(state, layer, k, v)
                logits_seen, times, picked = [], [], []
                token = first
                for i in range(args.steps):
                    if fed is not None:
                        token = fed[i]
                    t0 = time.perf_counter()
                    logits, state = step(params, jnp.asarray(token[:, None], jnp.int32), state)
                    logits = np.asarray(logits)
                    times.append(time.perf_counter() - t0)
                    logits_seen.append(logits)
                    picked.append(token)
                    token = logits.argmax(-1)
                decoded[variant] = dict(
                    logits=np.stack(logits_seen),  # [steps, batch, vocab]
                    step_ms=statistics.median(times[1:] or times) * 1e3,
                    kv_bytes=cache.spec.kv_bytes,
                    row_bytes=cache.spec.row_bytes,
                )
                if fed is None:
                    fed = picked
    finally:
        if path:
            shutil.rmtree(path, ignore_errors=True)
    rows = _rows(args, decoded, prefill_s)
    common.summary_or_details(args, summary(rows))
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Per quantized tier, in words: how far it moves the next-token logits next to how far
    another context moves them (the control row), and how often it picks the reference's
    token (overall and on the decisions that are not near-ties)."""
    by_name = {r["tier_dtype"]: r for r in rows}
    ref, control = by_name["bfloat16"], by_name[CONTROL]
    decisions = ref["decisions"]
    decisive = round(decisions * (1 - ref["reference_near_ties"]))
    heading = (
        f"{ref['batch']} sequences of {ref['context']} cached tokens, {ref['steps']} greedy "
        f"decode steps each ({decisions} decisions) against a cache of bfloat16 rows; "
        f"{_percent(ref['reference_near_ties'])} of its decisions are near-ties (its best "
        f"next-token logit leads by less than {DECISIVE_MARGIN})"
    )
    scale_line = (
        f"  changing the context (each sequence given another's) moves the logits by "
        f"{control['mean_abs_logit_diff']:.3g} on average (at most "
        f"{control['max_abs_logit_diff']:.3g}) and keeps the next token in "
        f"{_percent(control['top1_agreement'])} of the decisions"
    )
    lines = [heading, scale_line]
    for row in rows:
        if row["tier_dtype"] in ("bfloat16", CONTROL):
            continue
        name, moved = row["tier_dtype"], row["mean_abs_logit_diff"]
        if moved == 0:
            scale = "does not move the logits at all"
        else:
            ratio = control["mean_abs_logit_diff"] / moved
            if ratio >= 1:
                than = f"{_ratio(ratio)} less than changing the context"
            else:
                than = f"{_ratio(1 / ratio)} more than changing the context"
            scale = (
                f"moves the logits {than} ({moved:.3g} on average, at most "
                f"{row['max_abs_logit_diff']:.3g})"
            )
        agree = f"picks the reference's next token in {_percent(row['top1_agreement'])}"
        if row["top1_agreement_decisive"] is None:
            agree += " of the decisions (every one a near-tie)"
        else:
            agree += (
                f" of the decisions, {_percent(row['top1_agreement_decisive'])} of the "
                f"{decisive} that are not near-ties"
            )
        lines.append(
            f"  {name} ({row['tier_bytes_ratio']:.2f}x the bytes of bfloat16 rows): {scale};"
            f" it {agree}"
        )
    return "\n".join(lines)


def _percent(share: float) -> str:
    """``0.953`` -> ``"95.3%"``."""
    return f"{100 * share:.1f}%"


def _ratio(ratio: float) -> str:
    """``18.2`` -> ``"18x"``; under 10 one decimal (``"2.4x"``)."""
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _rows(args, decoded: dict, prefill_s: float) -> list[dict[str, Any]]:
    ref = decoded[None]
    top2 = np.sort(ref["logits"], axis=-1)[..., -2:]
    margins = top2[..., 1] - top2[..., 0]  # [steps, batch]
    decisive = margins >= DECISIVE_MARGIN
    rows = []
    for variant, got in decoded.items():
        diff = np.abs(got["logits"] - ref["logits"])
        agree = got["logits"].argmax(-1) == ref["logits"].argmax(-1)
        row = dict(
            tier_dtype=variant or "bfloat16",
            context=args.context,
            steps=args.steps,
            batch=args.batch,
            decisions=int(agree.size),
            top1_agreement=float(agree.mean()),
            max_abs_logit_diff=float(diff.max()),
            mean_abs_logit_diff=float(diff.mean()),
            reference_top1_margin=float(margins.mean()),
            reference_near_ties=float(1 - decisive.mean()),
            top1_agreement_decisive=float(agree[decisive].mean()) if decisive.any() else None,
            row_bytes=got["row_bytes"],
            tier_bytes=got["kv_bytes"],
            tier_bytes_ratio=got["kv_bytes"] / ref["kv_bytes"],
            step_ms=got["step_ms"],
            prefill_window=args.prefill_window,
            prefill_s=prefill_s,
        )
        if variant == "int8":
            row["targets"] = {
                f"top-1 agreement >= {TARGET_INT8_AGREEMENT}": row["top1_agreement"]
                >= TARGET_INT8_AGREEMENT
            }
        rows.append(row)
    return rows
