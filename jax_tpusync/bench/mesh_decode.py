"""``decode --devices N``: the prefetching decode step on a mesh cache of 1, 2, 4 ... N
devices, at the same per-device shapes.

Each row shards the cache over ``n`` devices (``--mesh tp``: KV heads over a ``model``
axis, each device keeping ``--kv-heads`` heads and ``--q-heads`` query heads; ``--mesh
dp``: sequences over a ``data`` axis, each device keeping ``--batch`` of them), fills the
same per-device context, and times the step (median of ``--steps`` after a warm-up step).
It also reports the bytes each shard's tier fetched per step, against one shard's KV per
step: every device streams exactly its own share.

On a CPU host the devices are simulated (``--xla_force_host_platform_device_count``, set
before JAX starts) and share the host's cores, memory bandwidth and one engine: the rows
show that the per-device bytes and the results hold at any device count, not a speedup.
On a multi-chip host the same flag uses the real devices.
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

from jax_tpusync.bench import common, tiny_decoder

COLUMNS = [
    ("devices", "devices", "d"),
    ("mesh", "mesh", "s"),
    ("context", "context", "d"),
    ("t_prefetch_ms", "prefetch ms", ".1f"),
    ("tokens_per_s", "tok/s", ".1f"),
    ("fetch_bytes_per_shard_step", "fetched/shard/step", "bytes"),
    ("kv_bytes_per_shard_step", "kv/shard/step", "bytes"),
    ("device_bytes", "device", "bytes"),
]


def ask_for_devices(n: int) -> None:
    """Simulated CPU devices for a CPU host (call before JAX starts; other platforms
    ignore the flag)."""
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()


def device_counts(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    counts = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return counts if counts[-1] == n else [*counts, n]


def run(args: argparse.Namespace, worker_cpus: tuple[int, ...]) -> list[dict[str, Any]]:
    import jax

    if len(jax.devices()) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(jax.devices())} devices here")
    rows = []
    for n in device_counts(args.devices):
        rows.append(_one(args, n, worker_cpus))
        print(
            f"{n} device(s): {rows[-1]['t_prefetch_ms']:.1f} ms/step, "
            f"{rows[-1]['fetch_bytes_per_shard_step']} B fetched per shard per step"
        )
    return rows


def _one(args: argparse.Namespace, n: int, worker_cpus: tuple[int, ...]) -> dict[str, Any]:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_tpusync as tps

    tp = n if args.mesh == "tp" else 1
    dp = n if args.mesh == "dp" else 1
    dtype = tiny_decoder.jnp_dtype(args.dtype)
    shape = tiny_decoder.Shape(  # Global: the per-device shapes times the devices.
        layers=args.layers,
        batch=args.batch * dp,
        q_heads=args.q_heads * tp,
        kv_heads=args.kv_heads * tp,
        head_dim=args.head_dim,
        ffn=args.ffn,
        context=args.context,
        dtype=np.dtype(dtype),
    )
    devices = np.asarray(jax.devices()[:n]).reshape(dp, tp)
    mesh = Mesh(devices, ("data", "model"))
    max_len = args.context + args.steps + 2
    directory = tempfile.mkdtemp(prefix="tpusync-mesh-", dir=os.path.abspath(args.path or "."))
    cache = tps.kv_cache(
        num_layers=shape.layers,
        batch=shape.batch,
        max_len=max_len,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        tier=args.tier,
        path=directory if args.tier == "file" else None,
        staging_bytes=args.staging_bytes,
        prefetch_depth=args.prefetch_depth,
        engine=common.engine_config(args, worker_cpus),
        mesh=mesh,
        kv_heads_axis="model" if tp > 1 else None,
        batch_axis="data" if dp > 1 or tp == 1 else None,
    )
    try:
        tiny_decoder.fill(shape, max_len, [cache], args.seed, keep=False)
        state = cache.init(np.full(shape.batch, args.context))
        params = tiny_decoder.init_step_params(shape, args.seed)
        step = jax.jit(
            lambda params, x, state: tiny_decoder.step(
                params, shape, x, state, tiny_decoder.prefetch_attend
            ),
            donate_argnums=(2,),
        )
        x = jax.device_put(
            np.zeros((shape.batch, 1, shape.d_model), dtype),
            NamedSharding(mesh, P("data" if dp > 1 else None)),
        )
        x, state = step(params, x, state)  # Compiles; its fetches prime the next step.
        jax.block_until_ready(x)
        # Counted on completion: with the fetch in flight into the next step finished at
        # both ends, the window holds exactly `steps` steps' bytes.
        cache.engine.drain()
        before = _fetched_per_tier(cache)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            x, state = step(params, x, state)
            jax.block_until_ready((x, state))
            times.append(time.perf_counter() - t0)
        cache.engine.drain()
        after = _fetched_per_tier(cache)
        per_shard = [(after[t] - before[t]) / args.steps for t in after]
        spec = cache.shard_spec
        t = statistics.median(times)
        return {
            "devices": n,
            "mesh": args.mesh,
            "context": args.context,
            "per_device": {"batch": spec.batch, "kv_heads": spec.num_kv_heads},
            "t_prefetch_ms": t * 1e3,
            "t_prefetch_min_ms": min(times) * 1e3,
            "t_prefetch_max_ms": max(times) * 1e3,
            "tokens_per_s": shape.batch / t,
            "fetch_bytes_per_shard_step": int(round(statistics.median(per_shard))),
            "fetch_bytes_by_shard": [int(round(b)) for b in per_shard],
            # A step reads the context plus the tokens decoded so far (at most `steps`).
            "kv_bytes_per_shard_step": tiny_decoder.Shape(
                **{**vars(shape), "batch": spec.batch, "kv_heads": spec.num_kv_heads}
            ).kv_bytes_per_step,
            "device_bytes": spec.device_bytes,
        }
    finally:
        cache.close()
        shutil.rmtree(directory, ignore_errors=True)


def _fetched_per_tier(cache) -> dict[int, int]:
    """Bytes each shard's tier has fetched so far (every shard has a tier of its own)."""
    tiers = cache.engine.stats()["tiers"]
    return {c.tier: tiers[c.tier]["fetch"]["bytes"] for c in cache.shards.values()}
