"""``serve``: requests sharing a prompt served by the loop, and one mixed step (a prompt
chunk beside decoding slots) against the same work as two steps.

``--case shared-prompt`` (the default) and ``--case step`` (both: ``--case shared-prompt
step``) are described below. Output: by default a short summary in words per case (the
library's figure against the plain way: ``share_prefixes`` on against off, the mixed step
against two steps), with the median and interquartile range of the samples and "within
noise" where the medians differ by no more than the wider IQR (see
:mod:`jax_tpusync.bench.verdict`); ``--details`` prints the developer's table instead.
Progress goes to stderr. ``--batch``, ``--chunk`` and ``--block-tokens`` default per case
(shared-prompt: 4 slots, chunk 128, 64-token blocks, about half a minute on two cores;
step: 8, 512, 256).

``--case step``: a cache of ``--batch`` slots (:mod:`.serving_model`'s decoder, bf16):
``--prefill-slots`` slots prefill a ``--chunk``-token chunk of their prompt (starting at
``--prefill-start``) while the other slots decode one token each over ``--context`` tokens
of cached KV. The same work runs two ways, alternated (``--repeats`` rounds, each from the same lengths):

* ``mixed``: one step of T = chunk, counts ``[chunk, 1, 1, ...]``, as
  :class:`jax_tpusync.serving.ServingLoop` runs it;
* ``separate``: a prefill step of T = chunk (counts ``[chunk, 0, ...]``) then a decode step
  of T = 1 (counts ``[0, 1, ...]``).

Reported: each step's median time (the step called until its logits are on the host),
tokens per second (prompt tokens plus decoded tokens over the time), and per-request
latency: a decoding slot waits ``mixed`` for its token in the mixed schedule and
``prefill + decode`` in the separate one (its decode step queues behind the prefill step);
the prefilling request's chunk takes ``mixed`` against ``prefill``. ``decode_only_ms``: a
T = 1 step with every non-prefilling slot decoding and nothing else, what those slots pay
with no prompt in the batch. Every step computes ``batch x T`` rows (the batch is the
cache's), so the mixed step's extra cost over the prefill step is the decode slots'
attention over their context.

``--case shared-prompt``: :class:`~jax_tpusync.serving.ServingLoop` serves ``--requests``
requests on ``--batch`` slots, each prompt a ``--prompt``-token shared prefix (a system
prompt) then ``--tail`` tokens of its own, ``--new-tokens`` generated each, the step
compiled first (:meth:`~jax_tpusync.serving.ServingLoop.warmup`; ``warmup_ms``, in no
request's TTFT: the first row compiles, the others reuse its programs). Two arrivals: all
requests at once (``together``), or one first and the others once it has its first token
(``first-then-rest``); each with ``share_prefixes`` on and off. Reported per row: every
request's TTFT and queue time (arrival to admission), the later requests' worst and median
TTFT over the first's, and the prompt tokens the steps computed against those mapped from
the cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from jax_tpusync.bench import common, serving_model, tiny_decoder, verdict

COLUMNS = [
    ("tier", "tier", "s"),
    ("context", "context", "d"),
    ("chunk", "chunk", "d"),
    ("mixed_ms", "mixed ms", ".1f"),
    ("separate_ms", "separate ms", ".1f"),
    ("separate_prefill_ms", "prefill ms", ".1f"),
    ("separate_decode_ms", "decode ms", ".1f"),
    ("decode_only_ms", "decode-only ms", ".1f"),
    ("mixed_tokens_per_s", "mixed tok/s", ".0f"),
    ("separate_tokens_per_s", "separate tok/s", ".0f"),
    ("mixed_over_separate", "mixed/separate", ".3f"),
]

MODEL = tiny_decoder.Decoder(
    layers=4, d_model=512, q_heads=8, kv_heads=2, head_dim=64, ffn=1024, vocab=1024
)


SHARED_COLUMNS = [
    ("tier", "tier", "s"),
    ("arrival", "arrival", "s"),
    ("share_prefixes", "share", "d"),
    ("first_ttft_ms", "first TTFT ms", ".1f"),
    ("later_ttft_max_ms", "later TTFT max ms", ".1f"),
    ("later_over_first", "later/first", ".3f"),
    ("prefill_tokens", "prefill tokens", "d"),
    ("cached_prompt_tokens", "cached tokens", "d"),
    ("wall_ms", "wall ms", ".1f"),
    ("warmup_ms", "warm-up ms", ".1f"),
]

# Per case: the defaults of the flags left unset (None).
CASE_DEFAULTS = {
    "step": dict(batch=8, chunk=512, block_tokens=256),
    "shared-prompt": dict(batch=4, chunk=128, block_tokens=64),
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="requests sharing a prompt served by the loop (default), or a mixed prefill + "
        "decode step against the same work as separate steps (--case step)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--case",
        nargs="+",
        choices=("shared-prompt", "step"),
        default=["shared-prompt"],
        help="shared-prompt (default): requests sharing a prompt, served by the loop; step: "
        "one mixed step against two; both: --case shared-prompt step",
    )
    p.add_argument("--tiers", nargs="+", choices=("host", "file"), default=["host"])
    p.add_argument("--path", default=None, help="directory of the file tier (default: cwd)")
    p.add_argument("--context", type=int, nargs="+", default=[4096], help="decode slots' context")
    p.add_argument(
        "--chunk", type=int, default=None, help="prompt tokens per prefill step (128; step: 512)"
    )
    p.add_argument("--batch", type=int, default=None, help="slots (4; step: 8)")
    p.add_argument("--prefill-slots", type=int, default=1)
    p.add_argument("--prefill-start", type=int, default=0, help="prompt tokens already cached")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    tiny_decoder.add_arguments(p, defaults=MODEL)
    p.add_argument("--requests", type=int, default=6, help="shared-prompt: requests")
    p.add_argument("--prompt", type=int, default=1024, help="shared-prompt: shared prefix")
    p.add_argument("--tail", type=int, default=16, help="shared-prompt: each prompt's own ids")
    p.add_argument("--new-tokens", type=int, default=4, help="shared-prompt: tokens generated")
    p.add_argument(
        "--block-tokens", type=int, default=None, help="tokens per KV block (64; step: 256)"
    )
    p.add_argument("--staging-bytes", type=common.parse_bytes, default=32 * common.MiB)
    p.add_argument("--prefetch-depth", default="auto")
    p.add_argument("--seed", type=int, default=0)
    common.add_engine_arguments(p)
    common.add_cpu_arguments(p)
    common.add_details_argument(p, "every row's developer table (per case)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def start_jax(args) -> tuple[int, ...]:
    """CPU split and XLA's CPU schedule, before JAX starts; returns the engine's CPUs."""
    from jax_tpusync.runtime import xla_cpu

    worker_cpus = common.apply_cpu_arguments(args)
    try:
        args.xla_cpu_schedule = xla_cpu.use_memory_scheduler()
    except RuntimeError:  # A process that computed already (tests): as it is.
        args.xla_cpu_schedule = "backends already started"
    return worker_cpus


def depth(text):
    return text if text == "auto" else int(text)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs each ``--case`` in turn; rows of every case, each with its ``case``."""
    cases = [args.case] if isinstance(args.case, str) else list(dict.fromkeys(args.case))
    worker_cpus = start_jax(args)
    rows: list[dict[str, Any]] = []
    summaries = []
    for case in cases:
        one = _with_case_defaults(args, case)
        if case == "shared-prompt":
            got = _shared_prompt(one, worker_cpus)
            summaries += [shared_prompt_summary(got, tier) for tier in one.tiers]
        else:
            got = _step_case(one, worker_cpus)
            summaries.append(step_summary(got))
        for row in got:
            row["case"] = case
        rows += got
    # One case: its table under the rows (--details); two: each printed here.
    args.columns = SHARED_COLUMNS if cases == ["shared-prompt"] else COLUMNS
    if args.details and len(cases) > 1:
        for case in cases:
            print()
            print(common.format_table(
                [r for r in rows if r["case"] == case],
                SHARED_COLUMNS if case == "shared-prompt" else COLUMNS,
            ))  # fmt: skip
        args.columns = None
    common.summary_or_details(args, "\n\n".join(summaries))
    return rows


def _with_case_defaults(args: argparse.Namespace, case: str) -> argparse.Namespace:
    """``args`` with the case's defaults for the flags left unset."""
    values = vars(args).copy()
    for flag, default in CASE_DEFAULTS[case].items():
        if values.get(flag) is None:
            values[flag] = default
    return argparse.Namespace(**values)


def _step_case(args: argparse.Namespace, worker_cpus: tuple[int, ...]) -> list[dict[str, Any]]:
    """The step case (see the module): one row per tier and context."""
    import jax.numpy as jnp

    if not 1 <= args.prefill_slots < args.batch:
        raise SystemExit("--prefill-slots must be in [1, batch)")
    model = tiny_decoder.Decoder.of(args)
    params = serving_model.init_params(model, args.seed, jnp.bfloat16)
    step = serving_model.make_step(model)
    rows = []
    for tier in args.tiers:
        for context in args.context:
            path = None
            if tier == "file":
                path = tempfile.mkdtemp(
                    prefix="tpusync-serve-", dir=os.path.abspath(args.path or os.getcwd())
                )
            try:
                common.progress(f"serve step: {tier} tier, context {context} ...")
                rows.append(_measure(args, tier, path, context, worker_cpus, model, params, step))
            finally:
                if path:
                    shutil.rmtree(path, ignore_errors=True)
    return rows


def _measure(args, tier, path, context, worker_cpus, model, params, step) -> dict[str, Any]:
    import jax.numpy as jnp

    import jax_tpusync as tps

    batch, chunk, p = args.batch, args.chunk, args.prefill_slots
    rounds = args.warmup + args.repeats
    max_len = max(context + 2 * rounds + 2, args.prefill_start + chunk)
    max_len = -(-max_len // args.block_tokens) * args.block_tokens
    base = np.full(batch, context, np.int32)
    base[:p] = args.prefill_start
    rng = np.random.default_rng(args.seed + 1)
    with tps.OffloadedKVCache(
        num_layers=model.layers,
        batch=batch,
        max_len=max_len,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        dtype=jnp.bfloat16,
        tier=tier,
        path=path,
        block_tokens=args.block_tokens,
        staging_bytes=args.staging_bytes,
        prefetch_depth=depth(args.prefetch_depth),
        engine=common.engine_config(args, worker_cpus),
    ) as cache:
        state = cache.init()
        n = int(base.max())
        for layer in range(model.layers):  # Random KV: the decoders' context.
            kv = rng.standard_normal((2, batch, n, model.kv_heads, model.head_dim), np.float32)
            state = cache.load(
                state, layer, kv[0].astype(jnp.bfloat16), kv[1].astype(jnp.bfloat16), lengths=base
            )
        del kv
        prompt = rng.integers(0, model.vocab, (batch, chunk)).astype(np.int32)
        decoded = rng.integers(0, model.vocab, (batch, 1)).astype(np.int32)
        holder = {"state": state}

        def call(tokens, counts):
            st = holder["state"]
            logits, holder["state"] = step(
                params, jnp.asarray(tokens), st.positions(tokens.shape[1]), jnp.asarray(counts), st
            )
            np.asarray(logits[:, 0, :1])  # The host has (a row of) the logits: the step ended.

        prefill_counts = np.where(np.arange(batch) < p, chunk, 0).astype(np.int32)
        decode_counts = np.where(np.arange(batch) < p, 0, 1).astype(np.int32)
        parts: dict[str, list[float]] = {"prefill": [], "decode": []}

        def reset():
            # A fresh state at the same lengths: each round does the same work.
            holder["state"] = cache.init(lengths=base, admit=False)

        def mixed() -> float:
            reset()
            tokens = prompt.copy()
            tokens[p:, 0] = decoded[p:, 0]
            s, _ = common.timed(lambda: call(tokens, prefill_counts + decode_counts))
            return s

        def separate() -> float:
            reset()
            a, _ = common.timed(lambda: call(prompt, prefill_counts))
            b, _ = common.timed(lambda: call(decoded, decode_counts))
            parts["prefill"].append(a)
            parts["decode"].append(b)
            return a + b

        def decode_only() -> float:
            reset()
            s, _ = common.timed(lambda: call(decoded, decode_counts))
            return s

        samples = common.interleaved(
            {"mixed": mixed, "separate": separate, "decode_only": decode_only},
            args.repeats,
            args.warmup,
        )
        cache.close(holder["state"])
    med = {k: v.median for k, v in samples.items()}
    prefill = float(np.median(parts["prefill"][args.warmup :]))
    decode = float(np.median(parts["decode"][args.warmup :]))
    tokens = p * chunk + (batch - p)
    row = dict(
        tier=tier,
        context=context,
        chunk=chunk,
        batch=batch,
        prefill_slots=p,
        prefill_start=args.prefill_start,
        mixed_ms=med["mixed"] * 1e3,
        separate_ms=med["separate"] * 1e3,
        separate_prefill_ms=prefill * 1e3,
        separate_decode_ms=decode * 1e3,
        decode_only_ms=med["decode_only"] * 1e3,
        mixed_tokens_per_s=tokens / med["mixed"],
        separate_tokens_per_s=tokens / med["separate"],
        mixed_over_separate=med["mixed"] / med["separate"],
        latency_ms={
            "decode_token_mixed": med["mixed"] * 1e3,
            "decode_token_separate": med["separate"] * 1e3,
            "prefill_chunk_mixed": med["mixed"] * 1e3,
            "prefill_chunk_separate": prefill * 1e3,
        },
        samples_ms={k: [s * 1e3 for s in v.seconds] for k, v in samples.items()},
    )
    return row


def _shared_prompt(args, worker_cpus) -> list[dict[str, Any]]:
    """The shared-prompt case (see the module): one row per tier, arrival and
    ``share_prefixes``."""
    import jax.numpy as jnp

    if args.requests < 2 or args.prompt < 1 or args.tail < 1 or args.new_tokens < 1:
        raise SystemExit("--requests must be >= 2, --prompt, --tail and --new-tokens >= 1")
    model = tiny_decoder.Decoder.of(args)
    params = serving_model.init_params(model, args.seed, jnp.bfloat16)
    step = serving_model.make_step(model)
    rng = np.random.default_rng(args.seed + 1)
    shared = rng.integers(0, model.vocab, args.prompt).tolist()
    prompts = [
        shared + rng.integers(0, model.vocab, args.tail).tolist() for _ in range(args.requests)
    ]
    rows = []
    for tier in args.tiers:
        path = None
        if tier == "file":
            path = tempfile.mkdtemp(
                prefix="tpusync-serve-", dir=os.path.abspath(args.path or os.getcwd())
            )
        try:
            for arrival in ("together", "first-then-rest"):
                for share in (True, False):
                    common.progress(
                        f"serve shared-prompt: {tier} tier, {arrival}, share_prefixes {share} ..."
                    )
                    rows.append(
                        _serve_shared(
                            args, tier, path, arrival, share, worker_cpus, model, params, step,
                            prompts,
                        )
                    )  # fmt: skip
        finally:
            if path:
                shutil.rmtree(path, ignore_errors=True)
    return rows


def _serve_shared(
    args, tier, path, arrival, share, worker_cpus, model, params, step, prompts
) -> dict[str, Any]:
    import time

    import jax.numpy as jnp

    import jax_tpusync as tps
    from jax_tpusync import serving

    need = len(prompts[0]) + args.new_tokens - 1
    max_len = -(-need // args.block_tokens) * args.block_tokens
    blocks = args.batch * (max_len // args.block_tokens) + len(prompts[0]) // args.block_tokens
    with tps.OffloadedKVCache(
        num_layers=model.layers,
        batch=args.batch,
        max_len=max_len,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        dtype=jnp.bfloat16,
        tier=tier,
        path=path,
        block_tokens=args.block_tokens,
        num_blocks=blocks,
        staging_bytes=args.staging_bytes,
        prefetch_depth=depth(args.prefetch_depth),
        engine=common.engine_config(args, worker_cpus),
    ) as cache:
        loop = serving.ServingLoop(
            cache, step, params, chunk=args.chunk, share_prefixes=share, seed=args.seed
        )
        warmup = loop.warmup()
        requests = [serving.Request(p, args.new_tokens) for p in prompts]
        t0 = time.perf_counter()
        if arrival == "together":
            done = loop.run(requests)
        else:
            first = loop.submit(requests[0])
            while first.first_token is None:
                loop.step()
            done = [first, *loop.run(requests[1:])]
        wall = time.perf_counter() - t0
        stats = loop.stats()
        cache.close(loop.state)
    ttft = [c.ttft for c in done]
    later = max(ttft[1:])
    return dict(
        tier=tier,
        arrival=arrival,
        share_prefixes=int(share),
        requests=len(prompts),
        batch=args.batch,
        prompt_tokens=len(prompts[0]),
        shared_tokens=args.prompt,
        chunk=args.chunk,
        block_tokens=args.block_tokens,
        first_ttft_ms=ttft[0] * 1e3,
        later_ttft_max_ms=later * 1e3,
        later_over_first=later / ttft[0],
        later_ttft_median_ms=float(np.median(ttft[1:])) * 1e3,
        warmup_ms=sum(warmup.values()) * 1e3,
        ttft_ms=[t * 1e3 for t in ttft],
        queue_ms=[(c.admitted - c.arrival) * 1e3 for c in done],
        cached_tokens=[c.cached for c in done],
        prefill_tokens=stats["prefill_tokens"],
        cached_prompt_tokens=stats["cached_prompt_tokens"],
        steps=stats["steps"],
        wall_ms=wall * 1e3,
    )


# The arrivals' words (first-then-rest: the others arrive once the first has its token).
ARRIVALS = {"together": "all at once", "first-then-rest": "one first"}


def shared_prompt_summary(rows: list[dict[str, Any]], tier: str) -> str:
    """The shared-prompt case on ``tier`` in words: per arrival, the later requests' TTFT
    with ``share_prefixes`` against without, and the first's; the compile apart."""
    by = {(r["arrival"], r["share_prefixes"]): r for r in rows if r["tier"] == tier}
    some = next(iter(by.values()))
    compile_ms = max(r["warmup_ms"] for r in by.values())
    lines = [
        f"shared prompt, {tier} tier: {some['requests']} requests on {some['batch']} slots, "
        f"each a {some['shared_tokens']}-token shared prompt + "
        f"{some['prompt_tokens'] - some['shared_tokens']} tokens of its own; all at once, or "
        "one first and the rest once it has its first token",
        f"  compile (warm-up before the first request, in no TTFT): {compile_ms / 1e3:.1f} s",
    ]
    table, verdicts = [], []
    for arrival, words in ARRIVALS.items():
        on, off = by.get((arrival, 1)), by.get((arrival, 0))
        if on is None or off is None:
            continue
        later = len(on["ttft_ms"]) - 1
        on_first, on_later = (verdict.Spread.of(t) for t in (on["ttft_ms"][:1], on["ttft_ms"][1:]))
        off_first, off_later = (
            verdict.Spread.of(t) for t in (off["ttft_ms"][:1], off["ttft_ms"][1:])
        )
        table += [
            (f"{words}: the first, sharing", on_first),
            (f"{words}: the {later} later, sharing", on_later),
            (f"{words}: the first, no sharing", off_first),
            (f"{words}: the {later} later, no sharing", off_later),
        ]
        verdicts.append(
            f"  {words}: with share_prefixes the later requests' TTFT is "
            f"{verdict.compare(on_later, off_later, 'without')} (the first's: "
            f"{on_later.median / on_first.median:.2f}x with, "
            f"{off_later.median / off_first.median:.2f}x without); prompt tokens computed "
            f"{on['prefill_tokens']} with, {off['prefill_tokens']} without"
        )
    lines.append(verdict.table(table, "TTFT"))
    return "\n".join(lines + verdicts)


def step_summary(rows: list[dict[str, Any]]) -> str:
    """The step case in words: per tier and context, the mixed step against a prefill step
    then a decode step."""
    lines = []
    for r in rows:
        mixed = verdict.Spread.of(r["samples_ms"]["mixed"])
        separate = verdict.Spread.of(r["samples_ms"]["separate"])
        decode = verdict.Spread.of(r["samples_ms"]["decode_only"])
        lines += [
            f"mixed step, {r['tier']} tier: {r['prefill_slots']} of {r['batch']} slots "
            f"prefill {r['chunk']} tokens while the others decode over {r['context']} tokens",
            verdict.table(
                [
                    ("library: one mixed step", mixed),
                    ("a prefill step, then a decode step", separate),
                    ("the decode step alone", decode),
                ]
            ),
            f"  the mixed step is {verdict.compare(mixed, separate, 'the two steps')}",
        ]
    return "\n".join(lines)
