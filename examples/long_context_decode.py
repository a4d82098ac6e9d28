"""Long-context decode with the KV cache in host DRAM or in a file on SSD.

A small Llama-style decoder (see ``model.py``) decodes ``--steps`` tokens after a context of
``--context`` tokens whose KV lives in an :class:`jax_tpusync.OffloadedKVCache`. Each layer's
KV streams into fixed device staging buffers while the previous layer computes, so device
memory does not grow with the context.

The context is synthesized: random KV values written layer by layer with ``cache.load``
(not produced by the model, and not rotated by RoPE; only the shapes and byte counts are
those of a real cache). ``--prefill T`` then runs T real tokens through the model on top of
it (``prefetching_attention`` with ``q_len = T``), and decode runs one token per step.

``--resident`` also runs the same model with the whole cache in device memory
(``resident_attention``, the only line that differs) when it fits, and compares logits.

Quickstart (about a minute on a 2-core CPU; KV in a temporary file)::

    python examples/long_context_decode.py

A million tokens of context::

    python examples/long_context_decode.py --context 1048576 --layers 2 --kv-heads 1 \\
        --q-heads 8 --head-dim 128 --steps 6 --path /path/on/ssd
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as model_lib  # noqa: E402

import jax_tpusync as tps  # noqa: E402
from jax_tpusync.runtime import xla_cpu  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}
# Bytes of synthesized KV generated per cache.load call.
FILL_CHUNK_BYTES = 128 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--context", type=int, default=65536, help="tokens of synthesized context")
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="real prompt tokens run through the model after the context (q_len=T)",
    )
    p.add_argument("--steps", type=int, default=12, help="decode steps")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tier", choices=("host", "file"), default="file")
    p.add_argument(
        "--path",
        default=None,
        help="file tier: directory for the cache file (default: a temporary "
        "directory; use a directory on local SSD)",
    )
    p.add_argument(
        "--staging-mb",
        type=float,
        default=32.0,
        help="device staging buffers, MiB (bounds device memory at any context)",
    )
    p.add_argument(
        "--prefetch-depth",
        type=int,
        default=3,
        help="units fetched ahead; the staging is split into depth + 1 slots (default 3: "
        "enough lookahead that one slow read or one slow unit of compute does not stall)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--tier-dtype",
        choices=("int8", "float8_e4m3fn"),
        default=None,
        help="keep quantized KV rows on the tier (about half the bytes; with --resident the "
        "logits then differ by the quantization error)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resident",
        action="store_true",
        help="also run the resident-cache model (if the KV fits in memory) and compare logits",
    )
    p.add_argument(
        "--engine-cpus",
        type=int,
        default=1,
        help="CPUs kept for the transfer engine, away from XLA's compute (tps.split_cpus; "
        "0: share every CPU; default 1)",
    )
    p.add_argument("--json", default=None, help="write a summary here")
    args = p.parse_args(argv)
    if args.engine_cpus < 0:
        p.error("--engine-cpus must be >= 0")
    for name in (
        "layers",
        "d_model",
        "q_heads",
        "kv_heads",
        "head_dim",
        "ffn",
        "vocab",
        "context",
        "steps",
        "batch",
    ):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.prefill < 0:
        p.error("--prefill must be >= 0")
    return args


def gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def fill_context(
    cache: tps.OffloadedKVCache, state: tps.KVState, context: int, seed: int
) -> tps.KVState:
    """Writes ``context`` tokens of random KV into every layer with ``cache.load``.

    Values are standard-normal, cut at random offsets from one random pool (generating
    fresh random numbers for a million-token cache would take longer than the decode).
    """
    spec = cache.spec
    rng = np.random.default_rng(seed + 1)
    row_elems = spec.batch * spec.num_kv_heads * spec.head_dim
    chunk = max(1, min(context, FILL_CHUNK_BYTES // (2 * row_elems * spec.itemsize)))
    n_elems = chunk * row_elems
    pool = rng.standard_normal(2 * n_elems, dtype=np.float32).astype(spec.dtype)
    # Position-major: lengths become lo + n each time every layer has been loaded.
    for lo in range(0, context, chunk):
        for layer in range(spec.num_layers):
            n = min(chunk, context - lo)
            k, v = (
                pool[o : o + n_elems].reshape(spec.batch, chunk, spec.num_kv_heads, spec.head_dim)[
                    :, :n
                ]
                for o in rng.integers(0, n_elems + 1, size=2)
            )
            state = cache.load(state, layer, k, v, start=lo)
    assert np.all(np.asarray(state.lengths) == context), state.lengths
    return state


def fetch_stats(engine: tps.Engine) -> tuple[int, int, float, float]:
    """(prefetch hits, misses, fetch bytes, fetch busy seconds) so far."""
    s = engine.stats()
    fetch_bytes = sum(t["fetch"]["bytes"] for t in s["tiers"])
    busy = sum(t["fetch"]["busy_s"] for t in s["tiers"])
    return s["prefetch_hits"], s["prefetch_misses"], fetch_bytes, busy


def decode(
    step,
    params,
    tokens,
    cache_state,
    steps: int,
    batch: int,
    start_pos: int,
    engine: tps.Engine | None,
    label: str,
):
    """Greedy decode loop with a progress line per step; returns (times, logits, tokens, state)."""
    times, all_logits, all_tokens = [], [], []
    prev = fetch_stats(engine) if engine else None
    for i in range(steps):
        t0 = time.perf_counter()
        logits, cache_state = step(params, tokens, cache_state)
        logits = jax.block_until_ready(logits)
        dt = time.perf_counter() - t0
        times.append(dt)
        all_logits.append(np.asarray(logits[:, -1]))
        tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        all_tokens.append(np.asarray(tokens))
        line = (
            f"[{label}] step {i + 1:3d}/{steps}  pos {start_pos + i:8d}  {dt * 1e3:9.1f} ms  "
            f"{batch / dt:7.2f} tok/s"
        )
        if engine is not None:
            cur = fetch_stats(engine)
            hits, misses = cur[0] - prev[0], cur[1] - prev[1]
            nbytes = cur[2] - prev[2]
            line += (
                f"  prefetch hits {hits:3d} misses {misses:2d}  fetched {gb(nbytes)}"
                f" ({nbytes / dt / 1e9:.2f} GB/s)"
            )
            prev = cur
        if i == 0:
            line += "  (includes compile)"
        print(line, flush=True)
    return times, all_logits, all_tokens, cache_state


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before JAX starts: on a machine with few cores, compute that holds every core starves
    # the engine's disk queue (see tps.split_cpus).
    worker_cpus = tps.split_cpus(args.engine_cpus) if args.engine_cpus else ()
    xla_cpu.use_memory_scheduler()  # Also before JAX starts (see jax_tpusync.runtime.xla_cpu).
    dtype = DTYPES[args.dtype]
    cfg = model_lib.ModelConfig(
        layers=args.layers,
        d_model=args.d_model,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn,
        vocab=args.vocab,
        dtype=dtype,
    )
    max_len = args.context + args.prefill + args.steps
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; model: {cfg.layers} layers, "
        f"d_model {cfg.d_model}, {cfg.q_heads} q heads / {cfg.kv_heads} kv heads x "
        f"{cfg.head_dim}, ffn {cfg.ffn}, {cfg.num_params / 1e6:.1f}M params, {args.dtype}"
    )

    tmpdir = None
    path = args.path
    if args.tier == "file" and path is None:
        path = tmpdir = tempfile.mkdtemp(prefix="tpusync-example-")
    summary: dict = {"args": vars(args)}
    try:
        params = model_lib.init_params(cfg, args.seed)
        cache = tps.OffloadedKVCache(
            num_layers=cfg.layers,
            batch=args.batch,
            max_len=max_len,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            tier_dtype=args.tier_dtype,
            tier=args.tier,
            path=path,
            staging_bytes=int(args.staging_mb * 2**20),
            prefetch_depth=args.prefetch_depth,
            engine=tps.EngineConfig(worker_cpus=worker_cpus),
        )
        spec = cache.spec
        tier_info = cache.engine.tier_info(cache.tier)
        print(
            f"KV cache: {gb(cache.kv_bytes)} on the {args.tier} tier ({tier_info.description}); "
            + (
                "host tier read in place, no device staging; "
                if spec.reads_in_place
                else f"device staging {gb(cache.device_bytes)} = {spec.num_slots} slots x "
                f"{spec.chunk_len} tokens; "
            )
            + f"{math.ceil(args.context / spec.chunk_len)} units per layer"
        )

        t0 = time.perf_counter()
        state = fill_context(cache, cache.init(), args.context, args.seed)
        fill_s = time.perf_counter() - t0
        fill_bytes = cache.kv_bytes * args.context / max_len
        print(
            f"synthesized {args.context} tokens of random KV per layer in {fill_s:.1f} s "
            f"({fill_bytes / fill_s / 1e9:.2f} GB/s written)"
        )

        resident_kv = None
        if args.resident:
            need = 2 * spec.num_layers * args.batch * max_len * spec.row_bytes
            avail = _available_ram()
            if need > 0.4 * avail:
                print(
                    f"--resident: skipped, the resident cache ({gb(need)}) does not fit "
                    f"comfortably in {gb(avail)} of available memory"
                )
            else:
                resident_kv = [
                    cache.read_all(layer, lengths=[args.context] * args.batch)
                    for layer in range(spec.num_layers)
                ]

        rng = np.random.default_rng(args.seed + 2)
        step = model_lib.make_offloaded_step(cfg)
        first = jnp.asarray(
            rng.integers(0, cfg.vocab, (args.batch, max(args.prefill, 1))), jnp.int32
        )
        prefill_s = None
        if args.prefill:
            t0 = time.perf_counter()
            logits, state = step(params, first, state)
            logits = jax.block_until_ready(logits)
            prefill_s = time.perf_counter() - t0
            print(f"prefill of {args.prefill} tokens: {prefill_s * 1e3:.1f} ms (includes compile)")
            tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        else:
            tokens = first
        prompt = tokens
        start = args.context + args.prefill
        times, logits_off, _, state = decode(
            step, params, tokens, state, args.steps, args.batch, start, cache.engine, "offloaded"
        )
        state = cache.drain(state)
        stats = cache.engine.stats()
        cache.close()

        steady = times[1:] or times
        med = statistics.median(steady)
        summary.update(
            step_ms_median=med * 1e3,
            step_ms_min=min(steady) * 1e3,
            step_ms_max=max(steady) * 1e3,
            tokens_per_s=args.batch / med,
            first_step_ms=times[0] * 1e3,
            prefill_ms=None if prefill_s is None else prefill_s * 1e3,
            fill_s=fill_s,
            device_bytes=cache.device_bytes,
            kv_bytes=cache.kv_bytes,
            chunk_len=spec.chunk_len,
            kv_read_per_step_bytes=2 * spec.num_layers * args.batch * start * spec.row_bytes,
            prefetch_hits=stats["prefetch_hits"],
            prefetch_misses=stats["prefetch_misses"],
            wait_s=stats["wait_s"],
            fetch_gbps_busy=stats["tiers"][0]["fetch"]["gbps"],
        )
        print(
            f"\noffloaded: {med * 1e3:.1f} ms/step median over steps 2..{args.steps} "
            f"(min {min(steady) * 1e3:.1f}, max {max(steady) * 1e3:.1f}), "
            f"{args.batch / med:.2f} tokens/s; device staging {gb(cache.device_bytes)} for "
            f"{gb(cache.kv_bytes)} of KV; prefetch hits {stats['prefetch_hits']}, misses "
            f"{stats['prefetch_misses']}, stalled in waits {stats['wait_s']:.2f} s"
        )

        if resident_kv is not None:
            # cache.read returned [B, max_len, H, D] arrays, zero past the context.
            ks = [jnp.asarray(model_lib.as_resident_words(k)) for k, _ in resident_kv]
            vs = [jnp.asarray(model_lib.as_resident_words(v)) for _, v in resident_kv]
            del resident_kv
            lengths = jnp.full((args.batch,), args.context, jnp.int32)
            rstep = model_lib.make_resident_step(cfg, unit_len=spec.chunk_len)
            kv = (ks, vs, lengths)
            del ks, vs
            if args.prefill:
                _, kv = rstep(params, first, kv)
            rtimes, logits_res, _, kv = _teacher_forced(
                rstep, params, prompt, kv, logits_off, args, start
            )
            del kv
            rmed = statistics.median(rtimes[1:] or rtimes)
            err = max(float(np.max(np.abs(a - b))) for a, b in zip(logits_off, logits_res))
            summary.update(resident_step_ms_median=rmed * 1e3, resident_max_abs_logit_diff=err)
            print(
                f"resident:  {rmed * 1e3:.1f} ms/step median; max |logits offloaded - "
                f"resident| = {err:.3g} over {args.steps} steps"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2, default=str)
            print(f"wrote {args.json}")
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


def _teacher_forced(rstep, params, tokens, kv, logits_off, args, start):
    """Resident decode fed the offloaded run's tokens, so the logits are comparable."""
    times, out = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        logits, kv = rstep(params, tokens, kv)
        logits = jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
        out.append(np.asarray(logits[:, -1]))
        print(
            f"[resident]  step {i + 1:3d}/{args.steps}  pos {start + i:8d}  "
            f"{times[-1] * 1e3:9.1f} ms  {args.batch / times[-1]:7.2f} tok/s",
            flush=True,
        )
        tokens = jnp.asarray(np.argmax(logits_off[i], axis=-1)[:, None], jnp.int32)
    return times, out, None, kv


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30


if __name__ == "__main__":
    sys.exit(main())
