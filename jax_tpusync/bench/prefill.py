"""``prefill``: chunked prefill through the library against plain JAX with the KV resident.

One sequence of ``--context`` tokens is prefilled ``--chunk`` tokens a step by
:mod:`.serving_model`'s decoder (bf16) three ways:

* ``plain_jax``: the KV in device arrays (:func:`.serving_model.make_plain_prefill`): each
  chunk's K/V written at its position, then attended in ``--block-len``-row slices up to
  the chunk's end; what a user writes without the library, with nothing to stream;
* one row per ``--tiers`` entry: the serving step (:func:`.serving_model.make_step`,
  ``prefetching_attention`` with the chunk's count) over an offloaded cache: ``host`` (read
  in place on a CPU), ``host-staged`` (``read_in_place=False``: every unit copied into
  staging, as on an accelerator), ``file``.

Each chunk's time runs from its call until its logits are on the host. Where the time goes:
``floor_chunk_ms`` is a chunk with nothing cached (the plain step at position 0: the
projections, MLP, logits and the chunk's own attention), so ``(total - chunks x floor)`` is
the attention over cached KV (``cached_attention_share``); ``first_chunk_ms`` /
``last_chunk_ms`` show its growth with the position; ``engine_wait_s`` is the time the
step's waits blocked on the engine (reads not yet landed), ``fetched_bytes`` /
``written_bytes`` what moved. Each variant runs ``--repeats`` times, in rotated order; its
row is its run of median time (``seconds_all``: every run's). ``over_plain`` is the row's
tokens/s over plain JAX's (target: >= 0.9 on the host tier).

Printed by default: per context, each tier's whole prefill against plain JAX's in words,
with the spread of the runs; ``--details``: every variant's row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, serve, serving_model, tiny_decoder, verdict

COLUMNS = [
    ("context", "context", "d"),
    ("variant", "variant", "s"),
    ("tokens_per_s", "tok/s", ".0f"),
    ("over_plain", "over plain", ".3f"),
    ("first_chunk_ms", "first chunk ms", ".1f"),
    ("last_chunk_ms", "last chunk ms", ".1f"),
    ("floor_chunk_ms", "floor ms", ".1f"),
    ("cached_attention_share", "cached attn", ".2f"),
    ("engine_wait_s", "wait s", ".2f"),
    ("fetched_bytes", "fetched", "bytes"),
]

MODEL = tiny_decoder.Decoder(
    layers=2, d_model=256, q_heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``prefill`` subcommand."""
    p = subparsers.add_parser(
        "prefill",
        help="chunked prefill tokens/s through the library vs plain JAX with resident KV",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument(
        "--tiers",
        nargs="+",
        choices=("host", "host-staged", "file"),
        default=["host", "file"],
    )
    p.add_argument("--path", default=None, help="directory of the file tier (default: cwd)")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--block-len", type=int, default=512, help="plain JAX's attention slice rows")
    tiny_decoder.add_arguments(p, defaults=MODEL)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--staging-bytes", type=common.parse_bytes, default=32 * common.MiB)
    p.add_argument("--prefetch-depth", default="auto")
    p.add_argument("--floor-chunks", type=int, default=5, help="chunks timed for the floor")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant (median kept)")
    p.add_argument("--seed", type=int, default=0)
    common.add_engine_arguments(p)
    common.add_cpu_arguments(p)
    common.add_details_argument(p, "every variant's row (chunk times, floor, engine waits, bytes)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    worker_cpus = serve.start_jax(args)
    import jax.numpy as jnp

    model = tiny_decoder.Decoder.of(args)
    params = serving_model.init_params(model, args.seed, jnp.bfloat16)
    plain = serving_model.make_plain_prefill(model, jnp.bfloat16, args.block_len)
    step = serving_model.make_step(model)
    rows = []
    for context in args.contexts:
        if context % args.chunk:
            raise SystemExit(f"--contexts must be multiples of --chunk ({context})")
        tokens = np.random.default_rng(args.seed + context).integers(0, model.vocab, context)
        tokens = tokens.astype(np.int32)
        common.progress(f"prefill: {context} tokens, {args.repeats} runs of each way")
        variants = ["plain_jax", *args.tiers]
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        floors = []
        for r in range(args.repeats):  # Rotated, so that drift favours no variant.
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                if v == "plain_jax":
                    floor, row = _plain(args, model, params, plain, tokens)
                    floors.append(floor)
                else:
                    row = _in_tier(args, v, worker_cpus, model, params, step, tokens)
                runs[v].append(row)
        floor = statistics.median(floors)
        for v in variants:  # Each variant's run of median time.
            ordered = sorted(runs[v], key=lambda row: row["seconds"])
            row = ordered[(len(ordered) - 1) // 2]
            row["seconds_all"] = [one["seconds"] for one in runs[v]]
            row["floor_chunk_ms"] = floor * 1e3
            row["cached_attention_share"] = max(
                0.0, 1 - floor * len(row["chunk_ms"]) / row["seconds"]
            )
            rows.append(row)
        base = rows[-len(variants)]
        for row in rows[-len(args.tiers) :] if args.tiers else []:
            row["over_plain"] = row["tokens_per_s"] / base["tokens_per_s"]
            if row["variant"] == "host":
                row["targets"] = {"host tier >= 0.9 x plain JAX": row["over_plain"] >= 0.9}
    common.summary_or_details(args, summary(rows))
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Per context, in words: each tier's whole prefill against plain JAX's, with the
    spread of the runs."""
    if not rows:
        return "prefill: no context ran"
    table, words = [], []
    for context in dict.fromkeys(r["context"] for r in rows):
        mine = [r for r in rows if r["context"] == context]
        spreads = {
            r["variant"]: verdict.Spread.of([t * 1e3 for t in r["seconds_all"]]) for r in mine
        }
        plain = spreads.pop("plain_jax")
        table.append((f"{context}: plain JAX (KV resident)", plain))
        for variant, spread in spreads.items():
            table.append((f"{context}: library, {variant} tier", spread))
            words.append(
                f"  {context} tokens, {variant} tier: the library's prefill is "
                f"{verdict.compare(spread, plain, 'plain JAX with the KV resident')}"
            )
    chunk = rows[0]["chunk"]
    heading = f"Chunked prefill of one sequence, {chunk} tokens a step (whole prefill, ms)"
    return "\n".join([heading, verdict.table(table, "prefill"), *words])


def _in_tier(args, tier, worker_cpus, model, params, step, tokens) -> dict[str, Any]:
    path = None
    if tier == "file":
        path = tempfile.mkdtemp(
            prefix="tpusync-prefill-", dir=os.path.abspath(args.path or os.getcwd())
        )
    try:
        return _library(args, tier, path, worker_cpus, model, params, step, tokens)
    finally:
        if path:
            shutil.rmtree(path, ignore_errors=True)


def _timed_chunks(tokens: np.ndarray, chunk: int, call) -> list[float]:
    """Seconds of each chunk: ``call(lo, ids [1, chunk])`` returns logits; the host takes a
    row of them, so each chunk's time ends when its step did."""
    times = []
    for lo in range(0, tokens.size, chunk):
        t0 = time.perf_counter()
        logits = call(lo, tokens[None, lo : lo + chunk])
        np.asarray(logits[0, -1, :1])
        times.append(time.perf_counter() - t0)
    return times


def _plain(args, model, params, plain, tokens) -> tuple[float, dict[str, Any]]:
    import jax.numpy as jnp

    def chunks_of(kv_holder, ids):
        def call(lo, x):
            logits, kv_holder[0] = plain(params, jnp.asarray(x), jnp.int32(lo), kv_holder[0])
            return logits

        return _timed_chunks(ids, args.chunk, call)

    kv = [serving_model.new_resident_kv(model, tokens.size, jnp.bfloat16, args.block_len)]
    chunks_of(kv, tokens[: args.chunk])  # Compiles.
    floor_times = []
    for _ in range(args.floor_chunks):  # Nothing cached: a chunk at position 0.
        floor_times += chunks_of(kv, tokens[: args.chunk])
    times = chunks_of(kv, tokens)  # Overwrites every row in order.
    del kv
    return statistics.median(floor_times), _row(args, "plain_jax", tokens, times)


def _row(args, variant: str, tokens, times: list[float]) -> dict[str, Any]:
    return dict(
        context=int(tokens.size),
        variant=variant,
        chunk=args.chunk,
        seconds=sum(times),
        tokens_per_s=tokens.size / sum(times),
        first_chunk_ms=times[0] * 1e3,
        last_chunk_ms=times[-1] * 1e3,
        chunk_ms=[t * 1e3 for t in times],
    )


def _library(args, tier, path, worker_cpus, model, params, step, tokens) -> dict[str, Any]:
    import jax.numpy as jnp

    import jax_tpusync as tps

    max_len = -(-tokens.size // args.block_tokens) * args.block_tokens
    options = dict(read_in_place=False) if tier == "host-staged" else {}
    with tps.OffloadedKVCache(
        num_layers=model.layers,
        batch=1,
        max_len=max_len,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        dtype=jnp.bfloat16,
        tier="file" if tier == "file" else "host",
        path=path,
        block_tokens=args.block_tokens,
        staging_bytes=args.staging_bytes,
        prefetch_depth=serve.depth(args.prefetch_depth),
        engine=common.engine_config(args, worker_cpus),
        **options,
    ) as cache:
        counts = jnp.asarray([args.chunk], jnp.int32)
        x = jnp.zeros((1, args.chunk), jnp.int32)
        # Compiles on live states (init() twice: a file tier's first state has staging
        # of another shape than later ones), at position 0; the timed run starts over.
        for _ in range(2):
            st = cache.init()
            st = step(params, x, st.positions(args.chunk), counts, st)[1]
            cache.drain(st)
        holder = [cache.init()]
        cache.engine.drain()  # The warm-up's write-backs, before the counters restart.
        cache.engine.reset_stats()

        def call(lo, ids):
            st = holder[0]
            logits, holder[0] = step(params, jnp.asarray(ids), st.positions(args.chunk), counts, st)
            return logits

        times = _timed_chunks(tokens, args.chunk, call)
        holder[0] = cache.drain(holder[0])
        cache.engine.drain()  # The last write-backs counted.
        stats = cache.engine.stats()
        info = stats["tiers"][cache.tier]
        cache.close(holder[0])
    row = _row(args, tier, tokens, times)
    row.update(
        engine_wait_s=stats["wait_s"],
        fetched_bytes=info["fetch"]["bytes"],
        written_bytes=info["write_back"]["bytes"],
        in_place_reads=stats["in_place_reads"],
        prefetch_hits=stats["prefetch_hits"],
        prefetch_misses=stats["prefetch_misses"],
    )
    return row
