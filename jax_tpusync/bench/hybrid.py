"""``hybrid``: a hybrid model's decode step, grouped by KV geometry, against one geometry.

Two scaled-down shapes of today's hybrid models, decoded at ``--contexts`` tokens on each
of ``--tiers``, two caches side by side in one run:

* ``gemma3``: 6 layers, five sliding (window ``--window``) per global one, every layer
  2 KV heads x 64 (Gemma 3's pattern; its 27B has 16 x 128 and window 1024);
* ``gemma4``: 6 layers: sliding layers of 4 KV heads x 32, global ones of 1 x 64 (Gemma 4
  31B's ratios: 16 x 256 and 4 x 512), layers 3..5 storing no KV: they read layers 1, 1
  and 2 (its E2B/E4B ``kv_sharing``); attention scale 1.0.

``uniform`` is the cache one geometry gives (:class:`~jax_tpusync.OffloadedKVCache`): every
layer at the largest KV heads x head size, every layer holding every position (its sliding
layers still fetch only their window), the reading layers storing copies. ``hybrid`` is
:class:`~jax_tpusync.HybridKVCache`. Per row: tier bytes (``kv_bytes``), the bytes one
step attends over (``step_bytes``: what a file tier fetches; a host tier read in place
reads them where they lie), the bytes the engine fetched per step (``fetched``), and the
median step time (``time/uniform``: hybrid's over uniform's). ``tier/global`` is the tier
bytes over the global layers' own KV, ``step/global`` the step bytes over what the global
layers read (a layer reading a global layer's KV reads it too): the floors no layout goes
under (target <= 1.1 for hybrid).

``--remote mooncake`` (or ``--remote-master HOST:PORT``): per model, tier and context up to
``--remote-max-context``, two more rows (``uniform <- mooncake``, ``hybrid <- mooncake``):
each cache, opened with ``remote_prefix=`` a Mooncake Store, loads the context, and its
release publishes it (the global layers' chain of full blocks; a bounded sliding group's
window copies); then a fresh cache of the same kind, its client giving the pool no memory,
admits the same token ids from the store alone. Reported: the tokens it mapped, the bytes
it imported (``imported``), ``imported/uniform`` (hybrid's over the one geometry's), the
admission's and the publishing release's seconds. The benchmark starts a master of its own
on loopback unless given one.

Output: by default a short summary per model and context: each tier's decode step on the
hybrid cache against the one-geometry cache (median and interquartile range of the timed
steps, in words, "within noise" where the medians differ by no more than the wider IQR;
see :mod:`jax_tpusync.bench.verdict`), and the bytes each holds and fetches; ``--details``
prints the developer's table instead. Progress goes to stderr. The default context (32K)
takes about a minute and a half on two cores; the figures in docs/hybrid.md are of
``--contexts 131072 1048576``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, mooncake_master, verdict

COLUMNS = [
    ("model", "model", "s"),
    ("tier", "tier", "s"),
    ("context", "context", "d"),
    ("cache", "cache", "s"),
    ("kv_bytes", "tier bytes", "bytes"),
    ("step_bytes", "step bytes", "bytes"),
    ("fetched_bytes_per_step", "fetched/step", "bytes"),
    ("step_ms", "step ms", ".2f"),
    ("kv_over_global", "tier/global", ".3f"),
    ("step_bytes_over_global", "step/global", ".3f"),
    ("time_over_uniform", "time/uniform", ".3f"),
    ("cached_tokens", "mapped", "d"),
    ("imported_bytes", "imported", "bytes"),
    ("imported_over_uniform", "imported/uniform", ".3f"),
    ("admit_ms", "admit ms", ".1f"),
]

Q_HEADS = 4


def shapes(window: int) -> dict[str, dict[str, Any]]:
    """Per model: per-layer KV heads, head sizes, windows, sources, attention scale."""
    s, g = window, None
    return {
        "gemma3": dict(
            heads=[2] * 6,
            dims=[64] * 6,
            windows=[s, s, s, s, s, g],
            sharing=[None] * 6,
            scale=None,
        ),
        "gemma4": dict(
            heads=[4, 4, 1, 4, 4, 1],
            dims=[32, 32, 64, 32, 32, 64],
            windows=[s, s, g, s, s, g],
            sharing=[None, None, None, 1, 1, 2],
            scale=1.0,
        ),
    }


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``hybrid`` subcommand."""
    p = subparsers.add_parser(
        "hybrid",
        help="hybrid model decode: KV geometry groups and bounded windows vs one geometry",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--models", nargs="+", choices=("gemma3", "gemma4"), default=["gemma3", "gemma4"]
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[32768])
    p.add_argument("--tiers", nargs="+", choices=("host", "file"), default=["host", "file"])
    p.add_argument("--path", default=None, help="directory of the file tier (default: a temp dir)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per cache")
    p.add_argument("--staging-bytes", type=common.parse_bytes, default=32 * common.MiB)
    p.add_argument("--load-chunk", type=int, default=65536, help="tokens per load() call")
    common.add_remote_arguments(
        p, "rows of a prefix shared through a Mooncake Store", "on loopback"
    )
    p.add_argument(
        "--remote-max-context",
        type=int,
        default=131072,
        help="the longest context that gets remote rows (the store holds a copy of the KV)",
    )
    p.add_argument("--block-tokens", type=int, default=256)
    common.add_details_argument(p, "every cache's row (bytes, ratios, remote rows)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def _caches(tps, model: dict, tier: str, context: int, path: str | None, staging: int):
    """(uniform, hybrid) caches of ``model`` at ``context`` tokens, batch 1, bf16."""
    return tuple(
        _cache(tps, kind, model, tier, context, path, staging) for kind in ("uniform", "hybrid")
    )


def _cache(tps, kind: str, model: dict, tier: str, context: int, path, staging: int, **extra):
    """The ``kind`` ("uniform" or "hybrid") cache of ``model`` at ``context`` tokens, batch
    1, bf16; ``extra``: more arguments (a block size, a remote level)."""
    import jax.numpy as jnp

    common_args = dict(
        num_layers=len(model["heads"]),
        batch=1,
        max_len=context + 64,
        dtype=jnp.bfloat16,
        tier=tier,
        staging_bytes=staging,
        **({"path": path} if tier == "file" else {}),
        **extra,
    )
    if kind == "uniform":
        return tps.OffloadedKVCache(
            num_kv_heads=max(model["heads"]),
            head_dim=max(model["dims"]),
            sliding_window=model["windows"],
            **common_args,
        )
    return tps.HybridKVCache(
        num_kv_heads=model["heads"],
        head_dim=model["dims"],
        sliding_window=model["windows"],
        kv_sharing=model["sharing"],
        max_step_tokens=1,
        **common_args,
    )


def _load(cache, state, layers, heads, dims, context: int, chunk: int, rng, sharing=None):
    """Random KV for every stored layer's positions [0, context)."""
    import jax.numpy as jnp

    for layer in range(layers):
        if sharing is not None and sharing[layer] is not None:
            continue
        for lo, n in common.chunks(context, chunk):
            kv = rng.standard_normal((2, 1, n, heads[layer], dims[layer]), np.float32)
            kv = jnp.asarray(kv, jnp.bfloat16)
            state = cache.load(state, layer, kv[0], kv[1], start=lo)
    return state


def _step(tps, heads, dims, sharing, scale):
    import jax
    import jax.numpy as jnp

    def step(qkv, state):
        outs = []
        for layer, (q, k, v) in enumerate(qkv):
            if sharing is not None and sharing[layer] is not None:
                k = v = None
            out, state = tps.prefetching_attention(q, k, v, state, layer=layer, scale=scale)
            outs.append(out)
        return outs, state

    def inputs(rng):
        out = []
        for h, d in zip(heads, dims):
            q = jnp.asarray(rng.standard_normal((1, 1, Q_HEADS, d)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((1, 1, h, d)), jnp.bfloat16)
            out.append((q, k, k))
        return out

    return jax.jit(step, donate_argnums=(1,)), inputs


def _step_bytes(model: dict, context: int, uniform: bool) -> int:
    """Bytes one decode step attends over at ``context`` (K and V of every layer's span)."""
    total = 0
    for layer, w in enumerate(model["windows"]):
        h, d = (
            (max(model["heads"]), max(model["dims"]))
            if uniform
            else (model["heads"][layer], model["dims"][layer])
        )
        span = context if w is None else min(w - 1, context)
        total += 2 * span * h * d * 2
    return total


def _global_bytes(model: dict, context: int, *, reading: bool) -> int:
    """The global layers' own KV (``reading``: and the reads of the layers that read it):
    what no layout can avoid storing (reading)."""
    return sum(
        2 * context * model["heads"][l] * model["dims"][l] * 2
        for l, w in enumerate(model["windows"])
        if w is None and (reading or model["sharing"][l] is None)
    )


def _measure(tps, cache, model, context, args, rng, *, uniform: bool) -> dict[str, Any]:
    layers = len(model["heads"])
    if uniform:
        heads = [max(model["heads"])] * layers
        dims = [max(model["dims"])] * layers
        sharing = None
    else:
        heads, dims, sharing = model["heads"], model["dims"], model["sharing"]
    state = cache.init()
    t0 = time.perf_counter()
    state = _load(cache, state, layers, heads, dims, context, args.load_chunk, rng, sharing)
    load_s = time.perf_counter() - t0
    step, inputs = _step(tps, heads, dims, sharing, model["scale"])
    qkv = inputs(rng)
    outs, state = step(qkv, state)  # Compile, and the first fetches.
    jax_block(outs)
    engine = cache.engine
    engine.reset_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs, state = step(qkv, state)
        jax_block(outs)
        times.append(time.perf_counter() - t0)
    # The last step's prefetches for the next one landed, so they are counted: a step's
    # fetches are then counted once, give or take the first unit the warm-up step
    # prefetched (counted or not, as it landed before or after the counters restarted).
    cache.drain(state)
    fetched = sum(t["fetch"]["bytes"] for t in engine.stats()["tiers"]) / args.steps
    kv_bytes = cache.kv_bytes if not uniform else cache.spec.kv_bytes
    return dict(
        kv_bytes=kv_bytes,
        step_bytes=_step_bytes(model, context, uniform),
        fetched_bytes_per_step=fetched,
        step_ms=statistics.median(times) * 1e3,
        step_ms_all=[t * 1e3 for t in times],
        load_s=load_s,
    )


def _remote(tps, model, tier, context, args, rng, master: str, directory) -> dict[str, dict]:
    """Per cache kind: the context published by one cache's release, admitted by a fresh
    one from the store alone (see the module's docstring)."""
    ids = rng.integers(0, 50_000, context)
    namespace = f"bench-hybrid-{os.getpid()}-{time.time_ns()}"
    url = f"mooncake://{master}?namespace={namespace}&deadline_s=30&segment_mb="
    out = {}
    layers = len(model["heads"])
    # The store holds the context once per cache kind: the uniform copy is the largest.
    segment_mb = max(64, 3 * _uniform_bytes(model, context) // common.MiB)
    for kind in ("uniform", "hybrid"):
        extra = dict(block_tokens=args.block_tokens, model_id=f"bench-hybrid-{kind}")
        where = (tps, kind, model, tier, context, directory, args.staging_bytes)
        with _cache(*where, remote_prefix=url + str(segment_mb), **extra) as writer:
            uniform = kind == "uniform"
            heads = [max(model["heads"])] * layers if uniform else model["heads"]
            dims = [max(model["dims"])] * layers if uniform else model["dims"]
            state = writer.init(admit=False)
            state, _ = writer.admit(state, 0, tokens=ids, max_tokens=context + 64)
            if uniform:
                state = _load(writer, state, layers, heads, dims, context, args.load_chunk, rng)
            else:  # As a chunked prefill does: windows published block by block as they pass.
                state = _load_publishing(writer, state, model, context, args.block_tokens, rng)
            t0 = time.perf_counter()
            state = writer.release(state, 0, tokens=ids)
            publish_s = time.perf_counter() - t0
            # While the writer is open: its client's segment holds the objects.
            with _cache(*where, remote_prefix=url + "0", **extra) as reader:
                got = reader.init(admit=False)
                t0 = time.perf_counter()
                got, cached = reader.admit(got, 0, tokens=ids, max_tokens=context + 64)
                admit_s = time.perf_counter() - t0
                levels = _level_stats(reader)
                reader.close(reader.drain(got))
            writer.close(state)
        out[kind] = dict(
            cached_tokens=int(cached),
            imported_bytes=int(levels["mooncake_bytes_loaded"]),
            imported_blocks=int(levels["mooncake_imported"]),
            faults=int(levels["mooncake_faults"]),
            admit_ms=admit_s * 1e3,
            publish_release_ms=publish_s * 1e3,
        )
    out["hybrid"]["imported_over_uniform"] = (
        out["hybrid"]["imported_bytes"] / out["uniform"]["imported_bytes"]
    )
    out["uniform"]["imported_over_uniform"] = 1.0
    return out


def _load_publishing(cache, state, model: dict, context: int, block_tokens: int, rng):
    """Random KV for every stored layer's positions [0, context), a block at a time, each
    block's window copy made (and published) once all layers hold it, as
    :class:`~jax_tpusync.serving.ServingLoop` does between prefill steps."""
    import jax.numpy as jnp

    stored = [l for l, src in enumerate(model["sharing"]) if src is None]
    for lo, n in common.chunks(context, block_tokens):
        for layer in stored:
            shape = (2, 1, n, model["heads"][layer], model["dims"][layer])
            kv = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
            state = cache.load(state, layer, kv[0], kv[1], start=lo)
        cache.publish_windows(state, 0)
    return state


def _uniform_bytes(model: dict, context: int) -> int:
    """The one-geometry cache's KV of ``context`` tokens (bf16)."""
    return 2 * context * len(model["heads"]) * max(model["heads"]) * max(model["dims"]) * 2


def _level_stats(cache) -> dict[str, int]:
    """The Mooncake level's counts, summed over a hybrid cache's groups."""
    parts = getattr(cache, "groups", [cache])
    total: dict[str, int] = {}
    for part in parts:
        for key, value in part.prefix_stats.items():
            if key.startswith("mooncake_"):
                total[key] = total.get(key, 0) + value
    return total


def jax_block(x) -> None:
    import jax

    jax.block_until_ready(x)


def run(args) -> list[dict[str, Any]]:
    import jax_tpusync as tps

    rng = np.random.default_rng(0)
    rows = []
    with contextlib.ExitStack() as stack:
        _run(tps, args, rng, rows, mooncake_master.for_run(args, stack))
    common.summary_or_details(args, summary(rows))
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Per model and context, in words: each tier's hybrid step against the one-geometry
    step, and the bytes each holds and fetches (see the module)."""
    parts = []
    keys = list(dict.fromkeys((r["model"], r["context"]) for r in rows))
    for model, context in keys:
        mine = [r for r in rows if (r["model"], r["context"]) == (model, context)]
        steps = {(r["tier"], r["cache"]): r for r in mine if "step_ms_all" in r}
        table, words = [], []
        for tier in dict.fromkeys(r["tier"] for r in mine):
            uniform, hybrid = steps.get((tier, "uniform")), steps.get((tier, "hybrid"))
            if uniform is None or hybrid is None:
                continue
            h, u = (verdict.Spread.of(r["step_ms_all"]) for r in (hybrid, uniform))
            table += [
                (f"{tier}: library (HybridKVCache)", h),
                (f"{tier}: one geometry (OffloadedKVCache)", u),
            ]
            words.append(
                f"  {tier} tier: the hybrid step is {verdict.compare(h, u, 'one geometry')}; "
                f"it holds {common.format_bytes(hybrid['kv_bytes'])} against "
                f"{common.format_bytes(uniform['kv_bytes'])} "
                f"({uniform['kv_bytes'] / hybrid['kv_bytes']:.1f}x fewer bytes) and fetched "
                f"{common.format_bytes(int(hybrid['fetched_bytes_per_step']))} a step against "
                f"{common.format_bytes(int(uniform['fetched_bytes_per_step']))}"
            )
        for tier in dict.fromkeys(r["tier"] for r in mine):
            remote = {r["cache"]: r for r in mine if r["tier"] == tier and "<-" in r["cache"]}
            u, h = remote.get("uniform <- mooncake"), remote.get("hybrid <- mooncake")
            if u and h:
                words.append(
                    f"  {tier} tier, from a Mooncake Store: the hybrid cache imported "
                    f"{common.format_bytes(h['imported_bytes'])} "
                    f"({h['imported_over_uniform']:.3f}x the one geometry's) in "
                    f"{h['admit_ms']:.0f} ms against {u['admit_ms']:.0f} ms"
                )
        parts.append(
            "\n".join(
                [f"hybrid, {model} shape, context {context} (decode step, batch 1)"]
                + ([verdict.table(table)] if table else [])
                + words
            )
        )
    return "\n\n".join(parts)


def _run(tps, args, rng, rows: list, master: str | None) -> None:
    for name in args.models:
        model = shapes(args.window)[name]
        for tier in args.tiers:
            for context in args.contexts:
                directory = None
                if tier == "file":
                    directory = tempfile.mkdtemp(
                        prefix="tpusync-hybrid-", dir=args.path or os.getcwd()
                    )
                try:
                    common.progress(f"hybrid: {name}, {tier} tier, context {context} ...")
                    uniform, hybrid = _caches(
                        tps, model, tier, context, directory, args.staging_bytes
                    )
                    with uniform, hybrid:
                        results = {
                            "uniform": _measure(
                                tps, uniform, model, context, args, rng, uniform=True
                            ),
                            "hybrid": _measure(
                                tps, hybrid, model, context, args, rng, uniform=False
                            ),
                        }
                    remote = None
                    if master is not None and context <= args.remote_max_context:
                        remote = _remote(tps, model, tier, context, args, rng, master, directory)
                finally:
                    if directory:
                        shutil.rmtree(directory, ignore_errors=True)
                stored = _global_bytes(model, context, reading=False)
                read = _global_bytes(model, context, reading=True)
                for cache_name, r in results.items():
                    row = dict(model=name, tier=tier, context=context, cache=cache_name, **r)
                    row["global_bytes"] = stored
                    row["global_step_bytes"] = read
                    row["kv_over_global"] = r["kv_bytes"] / stored
                    row["step_bytes_over_global"] = r["step_bytes"] / read
                    row["time_over_uniform"] = r["step_ms"] / results["uniform"]["step_ms"]
                    rows.append(row)
                    common.progress(
                        f"{name} {tier} {context}: {cache_name} {r['step_ms']:.2f} ms/step, "
                        f"tier {common.format_bytes(r['kv_bytes'])}, load {r['load_s']:.1f} s"
                    )
                for cache_name, r in (remote or {}).items():
                    rows.append(
                        dict(
                            model=name,
                            tier=tier,
                            context=context,
                            cache=f"{cache_name} <- mooncake",
                            **r,
                        )
                    )
                    common.progress(
                        f"{name} {tier} {context}: {cache_name} <- mooncake: mapped "
                        f"{r['cached_tokens']}, imported {common.format_bytes(r['imported_bytes'])}"
                        f" ({r['imported_over_uniform']:.3f}x uniform) in {r['admit_ms']:.0f} ms"
                    )
