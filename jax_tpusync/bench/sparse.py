"""``sparse``: how near sparse decode comes to dense attention, per layer, on the
benchmarks' models.

Per model, budget (``--budgets``: shares of each layer's context blocks, the first and the
last included) and layer, along ``--steps`` greedy decode steps after a context of
``--context`` tokens (attention dense: every budget is measured on the same queries and
KV):

* ``recall``: the share of the dense softmax weight the exact selection's blocks hold;
* ``error``: the relative error ``|out - dense| / |dense|`` of attention over the exact
  selection (``read_error``: over what a layer-ahead step reads, the prediction with the
  late blocks);
* ``hit_rate``: the share of the blocks the layer-ahead prediction (the previous step's
  selection with this step's sink and recent blocks) prefetched that the exact selection
  used (as the cache's ``sparse_stats`` counts it); ``coverage``: the share of the exact
  selection's blocks it had prefetched (the rest are fetched late), over every step and
  after the first (``warm_coverage``: the first decode step has no previous selection).

The models (``--models``):

* ``random``: the benchmarks' small decoder (:mod:`jax_tpusync.bench.tiny_decoder`, 4
  layers of 8 KV heads x 64) with random weights, queries as drawn. Its attention over a
  long context is nearly flat: every block holds a little of the weight, so no selection of
  a few blocks can hold most of it. This is the worst case, not a trained model's.
* ``random-q4``: the same weights with queries x4 (the ``quality`` benchmark's model): a
  few keys win, as in retrieval heads, though random keys hold no structure a block
  summary can use.
* ``topics``: no model, an input distribution with the structure trained models' KV has
  and random weights lack: keys drawn in segments of about 256 tokens that share a topic
  (a direction; neighbouring tokens' keys are alike), the first token an attention sink,
  and each row's decode queries aimed at two of its context's topics (plus a little of the
  sink's direction), with noise that drifts from step to step. Per layer and head its own draw
  (``--layers`` x ``--kv-heads`` x ``--head-dim``, one query head per KV head). Peaked
  where a few segments match the query, not on one token.
* ``retrieval``: the hand-built retrieval model (:mod:`jax_tpusync.bench.retrieval_model`)
  on its task: a question head whose weight sits on one recent token and a retrieval head
  whose weight sits on one record in the context, as a trained model's retrieval heads
  do. Its decode steps are the answer tokens of ``--retrieval-trials`` questions.

The random models' context is random tokens prefilled through the decoder (within a
``--prefill-window`` sliding window, which keeps it linear in the context on a CPU), so
the KV is the model's own. Everything runs through the sparse reference
(:func:`jax_tpusync.sparse.measure.measure`), not an engine cache. The defaults (16K tokens)
run in minutes on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, retrieval_model, tiny_decoder

MODELS = ("random", "random-q4", "topics", "retrieval")
COLUMNS = [
    ("model", "model", "s"),
    ("budget", "budget", "s"),
    ("layer", "layer", "d"),
    ("recall", "recall", ".4f"),
    ("recall_min", "min recall", ".4f"),
    ("error", "rel. error", ".4f"),
    ("read_error", "read error", ".4f"),
    ("hit_rate", "hit rate", ".3f"),
    ("coverage", "coverage", ".3f"),
    ("warm_coverage", "cov., after 1st", ".3f"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``sparse`` subcommand."""
    p = subparsers.add_parser(
        "sparse",
        help="per-layer recall, output error and prediction hit rate of sparse decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--context", type=int, default=16384, help="cached tokens before decoding")
    p.add_argument(
        "--budgets", type=float, nargs="+", default=[0.02, 0.05, 0.10], help="shares of blocks"
    )
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=16, help="decode steps (random models)")
    p.add_argument("--batch", type=int, default=2, help="sequences (random models)")
    p.add_argument("--prefill-window", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024, help="prefill tokens per call")
    p.add_argument("--retrieval-trials", type=int, default=4, help="questions (retrieval)")
    p.add_argument(
        "--retrieval-records", type=int, default=64, help="other keys' records (retrieval)"
    )
    p.add_argument("--seed", type=int, default=0)
    for f in dataclasses.fields(tiny_decoder.Decoder):
        if f.name != "q_gain":  # set by the model's name
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    common.add_details_argument(p, "every row (per model, budget and layer)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from jax_tpusync.sparse import SparseConfig

    if args.context < 1 or args.steps < 1 or args.batch < 1 or args.retrieval_trials < 1:
        raise SystemExit("--context, --steps, --batch and --retrieval-trials must be positive")
    configs = [SparseConfig(budget=b) for b in args.budgets]
    rows = []
    kv_cache = {}  # The random models share their weights and so their context's KV.
    for name in args.models:
        t0 = time.perf_counter()
        if name == "retrieval":
            measured = _retrieval(args, configs)
        elif name == "topics":
            measured = _topics(args, configs)
        else:
            fields = {
                f.name: getattr(args, f.name)
                for f in dataclasses.fields(tiny_decoder.Decoder)
                if f.name != "q_gain"
            }
            model = tiny_decoder.Decoder(**fields, q_gain=4.0 if name == "random-q4" else 1.0)
            params = tiny_decoder.init_params(model, args.seed)
            if "kv" not in kv_cache:
                kv_cache["kv"] = prefill(args, model, params)
            measured = decode_measured(args, model, params, *kv_cache["kv"], configs)
        rows += _rows(name, args, measured)
        common.progress(f"sparse: {name} measured in {time.perf_counter() - t0:.0f} s")
    common.summary_or_details(args, summary(rows))
    return rows


def prefill(args, model: tiny_decoder.Decoder, params) -> tuple[list, np.ndarray]:
    """The context's per-layer KV ([batch, context, H, D] bfloat16) from a windowed prefill
    of random tokens, and each sequence's first decode token (the prefill's greedy one)."""
    import jax
    import jax.numpy as jnp

    import jax_tpusync as tps

    # The prefill's attention is windowed, so its queries never see a full context: the
    # window only keeps the prefill linear; the KV is each token's own projection.
    step = jax.jit(functools.partial(tiny_decoder.forward, model), donate_argnums=(2,))
    tokens = np.random.default_rng(args.seed + 1).integers(
        0, model.vocab, (args.batch, args.context)
    )
    t0 = time.perf_counter()
    with tps.OffloadedKVCache(
        num_layers=model.layers,
        batch=args.batch,
        max_len=args.context,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        dtype=jnp.bfloat16,
        sliding_window=args.prefill_window or None,
    ) as cache:
        state = cache.init(np.zeros(args.batch, np.int32))
        for lo in range(0, args.context, args.chunk):
            logits, state = step(
                params, jnp.asarray(tokens[:, lo : lo + args.chunk], jnp.int32), state
            )
        first = np.asarray(jnp.argmax(logits, axis=-1))
        state = cache.drain(state)
        kv = [cache.read_all(layer, args.context) for layer in range(model.layers)]
    common.progress(
        f"sparse: prefilled {args.batch} x {args.context} tokens in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return kv, first


@functools.lru_cache(maxsize=8)
def _measured_step(model: tiny_decoder.Decoder, configs: tuple, block_tokens: int):
    import jax
    import jax.numpy as jnp

    from jax_tpusync.sparse import measure as measure_mod

    def step(params, token, keys, values, length, previous):
        batch = token.shape[0]
        lengths = jnp.full((batch,), length + 1, jnp.int32)
        found = []

        def attend(layer, q, k, v, kv):
            keys, values = measure_mod.with_row(kv, layer, k, v, length)
            got = [
                measure_mod.measure(
                    config,
                    q[:, 0],
                    keys[layer],
                    values[layer],
                    lengths,
                    block_tokens,
                    previous[i][layer],
                )
                for i, config in enumerate(configs)
            ]
            found.append(got)
            return got[0].dense[:, None].astype(q.dtype), (keys, values)

        x, (keys, values) = tiny_decoder.run_layers(
            params["layers"],
            params["embed"][token][:, None],
            (keys, values),
            attend,
            q_heads=model.q_heads,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            q_gain=model.q_gain,
            norm=tiny_decoder.rms_norm,
        )
        logits = (tiny_decoder.rms_norm(x[:, -1]) @ params["unembed"]).astype(jnp.float32)

        def per_budget(field):
            return [
                jnp.stack([getattr(layer[i], field) for layer in found])
                for i in range(len(configs))
            ]

        return (
            logits,
            keys,
            values,
            per_budget("selection"),
            per_budget("counts"),
            per_budget("recall"),
            per_budget("error"),
            per_budget("read_error"),
        )

    return jax.jit(step, donate_argnums=(2, 3))


def decode_measured(args, model, params, kv, first, configs) -> dict:
    """``--steps`` greedy dense decode steps over the context's KV, every layer measured at
    every budget. Returns per budget: counts [steps, layers, 4], recall / error /
    read_error [steps, layers, batch, q_heads]."""
    import jax.numpy as jnp

    context = kv[0][0].shape[1]
    pad = ((0, 0), (0, args.steps), (0, 0), (0, 0))
    keys = tuple(jnp.asarray(np.pad(np.asarray(k), pad)) for k, _ in kv)
    values = tuple(jnp.asarray(np.pad(np.asarray(v), pad)) for _, v in kv)
    step = _measured_step(model, tuple(configs), args.block_tokens)
    blocks = -(-(context + args.steps) // args.block_tokens)
    previous = [
        jnp.full((model.layers, args.batch, c.max_selected(blocks)), -1, jnp.int32) for c in configs
    ]
    token = jnp.asarray(first, jnp.int32)
    seen = {f: [[] for _ in configs] for f in ("counts", "recall", "error", "read_error")}
    for i in range(args.steps):
        logits, keys, values, previous, counts, recall, error, read_error = step(
            params, token, keys, values, jnp.int32(context + i), previous
        )
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        for field, got in (
            ("counts", counts),
            ("recall", recall),
            ("error", error),
            ("read_error", read_error),
        ):
            for b in range(len(configs)):
                seen[field][b].append(np.asarray(got[b]))
    return {
        "budgets": [c.budget for c in configs],
        "context_blocks": blocks,
        **{f: [np.stack(x) for x in per] for f, per in seen.items()},
    }


# The ``topics`` input: segments of about this many tokens share a topic direction.
TOPIC_TOKENS = 256
TOPIC_QUERY_GAIN = 1.5  # a query's gain on its two topics
TOPIC_DRIFT = 0.9  # how much of a step's query noise the next keeps (the rest is fresh)


def _topics(args, configs) -> dict:
    """KV and queries drawn, no model (see the module doc): per layer and KV head, the
    context is segments (geometric lengths, mean ``TOPIC_TOKENS``) whose keys are the
    segment's topic (a standard normal vector) plus half as much noise, the first token a
    sink (a large key along a direction every query shares a little of); each row's decode
    queries aim at two topics of its context, with noise that drifts from step to step;
    the new rows continue the last segment."""
    import jax
    import jax.numpy as jnp

    from jax_tpusync.sparse import measure as measure_mod

    layers, heads, dim = args.layers, args.kv_heads, args.head_dim
    batch, context, steps = args.batch, args.context, args.steps
    rng = np.random.default_rng(args.seed + 2)
    total = context + steps
    starts = np.cumsum(rng.geometric(1 / TOPIC_TOKENS, size=total))
    segment = np.searchsorted(starts, np.arange(total), side="right")  # [total]
    topics = rng.standard_normal((layers, batch, segment.max() + 1, heads, dim), np.float32)
    noise = rng.standard_normal((layers, batch, total, heads, dim), np.float32)
    keys = topics[:, :, segment] + 0.5 * noise
    sink = rng.standard_normal((layers, 1, 1, heads, dim), np.float32)
    sink *= 4 / np.linalg.norm(sink, axis=-1, keepdims=True) * math.sqrt(dim)
    keys[:, :, 0] = sink[:, :, 0]
    values = rng.standard_normal(keys.shape, np.float32)
    blocks = -(-total // args.block_tokens)
    measure = jax.jit(measure_mod.measure, static_argnums=(0, 5))
    out = {"budgets": [c.budget for c in configs], "context_blocks": blocks}
    seen = {f: [[] for _ in configs] for f in ("counts", "recall", "error", "read_error")}
    # Each row's two topics, drawn once from its context: the step's query keeps aiming
    # at them, its own noise drifting from step to step.
    aimed = segment[rng.integers(0, context, size=(layers, batch, 2))]
    target = topics[np.arange(layers)[:, None, None], np.arange(batch)[None, :, None], aimed]
    target = target.mean(axis=2) + 0.25 * sink[:, 0] / math.sqrt(dim)  # [L, B, H, D]
    drift = np.zeros_like(target)
    for step in range(steps):
        length = context + step + 1
        fresh = rng.standard_normal(target.shape, np.float32)
        drift = TOPIC_DRIFT * drift + math.sqrt(1 - TOPIC_DRIFT**2) * fresh
        query = target + 0.5 * drift
        per_layer = {f: [[] for _ in configs] for f in seen}
        for layer in range(layers):
            for b, config in enumerate(configs):
                previous = out.setdefault(("previous", b, layer), None)
                got = measure(
                    config,
                    jnp.asarray(TOPIC_QUERY_GAIN * query[layer]),
                    jnp.asarray(keys[layer, :, :total]),
                    jnp.asarray(values[layer, :, :total]),
                    jnp.full((batch,), length, jnp.int32),
                    args.block_tokens,
                    previous,
                )
                out[("previous", b, layer)] = got.selection
                per_layer["counts"][b].append(np.asarray(got.counts))
                for field in ("recall", "error", "read_error"):
                    per_layer[field][b].append(np.asarray(getattr(got, field)))
        for field in seen:
            for b in range(len(configs)):
                seen[field][b].append(np.stack(per_layer[field][b]))
    out = {k: v for k, v in out.items() if not isinstance(k, tuple)}
    out.update({f: [np.stack(x) for x in per] for f, per in seen.items()})
    return out


def _retrieval(args, configs) -> dict:
    """The retrieval model answering ``--retrieval-trials`` questions densely, every layer
    measured at every budget (its per-head arrays with one query head)."""
    model = retrieval_model.RetrievalModel(seed=args.seed)
    params = retrieval_model.build(model)
    trials = [
        retrieval_model.make_trial(
            model,
            args.context,
            depth,
            args.block_tokens,
            seed=args.seed + i,
            records=args.retrieval_records,
        )
        for i, depth in enumerate(retrieval_model.depths(args.retrieval_trials))
    ]
    out = {
        "budgets": [c.budget for c in configs],
        "counts": [],
        "recall": [],
        "error": [],
        "read_error": [],
    }
    for config in configs:
        got = retrieval_model.decode_reference(model, params, trials, args.block_tokens, config)
        out["counts"].append(got.counts)
        out["recall"].append(got.recall[..., None])
        out["error"].append(got.error[..., None])
        out["read_error"].append(None)
    out["context_blocks"] = -(-(args.context + model.answer_tokens) // args.block_tokens)
    return out


def _hit_rate(counts: np.ndarray) -> float:
    """The prefetched blocks the exact selection used (as ``sparse_stats`` counts it)."""
    predicted, hits = counts[..., 0].sum(), counts[..., 1].sum()
    return float(hits / max(1, predicted))


def _coverage(counts: np.ndarray) -> float:
    """The exact selection's blocks that were prefetched (the rest are fetched late)."""
    hits, late = counts[..., 1].sum(), counts[..., 2].sum()
    return float(hits / max(1, hits + late))


def _rows(name: str, args, measured: dict) -> list[dict[str, Any]]:
    rows = []
    for b, budget in enumerate(measured["budgets"]):
        counts, recall, error = measured["counts"][b], measured["recall"][b], measured["error"][b]
        read_error = measured["read_error"][b]
        for layer in range(counts.shape[1]):
            rows.append(
                dict(
                    model=name,
                    budget=f"{100 * budget:g}%",
                    budget_share=budget,
                    layer=layer,
                    context=args.context,
                    block_tokens=args.block_tokens,
                    context_blocks=measured["context_blocks"],
                    recall=float(recall[:, layer].mean()),
                    recall_min=float(recall[:, layer].min()),
                    error=float(error[:, layer].mean()),
                    read_error=None if read_error is None else float(read_error[:, layer].mean()),
                    hit_rate=_hit_rate(counts[:, layer]),
                    coverage=_coverage(counts[:, layer]),
                    warm_coverage=_coverage(counts[1:, layer]),
                    counts=counts[:, layer].sum(0).tolist(),
                    decode_steps=int(counts.shape[0]),
                )
            )
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Per model and budget, in words: the recall and error range over the layers, and the
    lowest layer's hit rate."""
    r0 = rows[0]
    lines = [
        f"{r0['context']} cached tokens in blocks of {r0['block_tokens']} "
        f"({r0['context_blocks']} blocks), through the sparse reference; per budget: the "
        f"dense softmax weight the selected blocks hold (recall), the attention output's "
        f"relative error, the layer-ahead prediction's hit rate (prefetched blocks used) and "
        f"coverage (needed blocks prefetched), each over the layers (lowest .. highest)"
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        lines.append(f"  {name}:")
        for budget in dict.fromkeys(r["budget"] for r in rows if r["model"] == name):
            mine = [r for r in rows if r["model"] == name and r["budget"] == budget]

            def span(field, fmt):
                values = [r[field] for r in mine]
                return f"{min(values):{fmt}} .. {max(values):{fmt}}"

            lines.append(
                f"    budget {budget}: recall {span('recall', '.3f')}, error "
                f"{span('error', '.3f')}, hit rate {span('hit_rate', '.2f')}, coverage "
                f"{span('coverage', '.2f')} ({span('warm_coverage', '.2f')} after the first "
                f"step)"
            )
    return "\n".join(lines)
