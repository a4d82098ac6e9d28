"""Serve requests that arrive at random times and share a system prompt, KV in a file.

``--requests`` prompts (the same ``--system-tokens`` system prompt, then a random question
of ``--question-tokens`` tokens) arrive at random times (exponential gaps, ``--rate`` per
second) and are served by :class:`jax_tpusync.serving.ServingLoop` over ``--batch`` slots of
an :class:`jax_tpusync.OffloadedKVCache` on the file tier (a temporary directory unless
``--path``): each joins between steps (its system prompt's full blocks mapped from the
prefix store once an earlier request released them), is prefilled ``--chunk`` tokens a step
beside the others' decode, decodes ``--max-new-tokens`` greedy tokens and leaves.

Every request's tokens are then checked against a resident run: the same model
(``model.py``) with :func:`jax_tpusync.resident_attention` over KV in device arrays, one
request at a time. The loop's ``warmup()`` compiles the step first, so the times hold no
compile (its seconds are printed apart). Prints per-request TTFT and time per output token;
``--json OUT`` writes them, the tokens and the check.

    python examples/serve_requests.py --json serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as model_lib  # noqa: E402

import jax_tpusync as tps  # noqa: E402
from jax_tpusync import serving  # noqa: E402
from jax_tpusync.runtime import xla_cpu


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second")
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--question-tokens", type=int, nargs=2, default=[4, 80], metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="slots served at once")
    p.add_argument("--chunk", type=int, default=32, help="prefill tokens per slot and step")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--path", default=None, help="directory for the file tier (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the resident run")
    p.add_argument("--json", default=None, metavar="OUT")
    return p.parse_args(argv)


def make_resident_step(cfg: model_lib.ModelConfig):
    """The same step over resident KV: ``(ks, vs, lengths)``, per-layer [B, max_len, H, D]."""

    def step(params, tokens, positions, counts, cache):
        ks, vs, lengths = cache

        def attend(layer, q, k, v, c):
            ks, vs = c
            out, ks[layer], vs[layer] = tps.resident_attention(
                q, k, v, ks[layer], vs[layer], lengths, query_seq_lengths=counts
            )
            return out, (ks, vs)

        logits, (ks, vs) = model_lib.forward(
            params, cfg, tokens, positions, (list(ks), list(vs)), attend
        )
        return logits, (ks, vs, lengths + counts)

    return jax.jit(step, donate_argnums=(4,))


def resident_tokens(cfg, params, prompt, new_tokens: int, max_len: int, chunk: int) -> list[int]:
    """Greedy tokens of one request, its KV resident, prefilled ``chunk`` tokens a step."""
    step = _resident_step(cfg)
    shape = (1, max_len, cfg.kv_heads, cfg.head_dim)
    cache = (
        [jnp.zeros(shape, cfg.dtype) for _ in range(cfg.layers)],
        [jnp.zeros(shape, cfg.dtype) for _ in range(cfg.layers)],
        jnp.zeros(1, jnp.int32),
    )
    out = []
    pending = list(prompt)
    while len(out) < new_tokens:
        n = min(chunk, len(pending)) if pending else 1
        width = chunk if pending else 1
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = pending[:n] if pending else out[-1:]
        pending = pending[n:]
        positions = cache[2][:, None] + jnp.arange(width, dtype=jnp.int32)
        logits, cache = step(params, jnp.asarray(tokens), positions, jnp.asarray([n]), cache)
        if not pending:
            out.append(int(np.argmax(np.asarray(logits)[0, n - 1])))
    return out


_STEPS: dict = {}


def _resident_step(cfg):
    if cfg not in _STEPS:
        _STEPS[cfg] = make_resident_step(cfg)
    return _STEPS[cfg]


def main(argv=None) -> dict:
    args = parse_args(argv)
    xla_cpu.use_memory_scheduler()  # Before JAX computes anything (see README).
    cfg = model_lib.ModelConfig(
        layers=args.layers,
        d_model=args.d_model,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn,
        vocab=args.vocab,
        dtype=jnp.float32,
    )
    params = model_lib.init_params(cfg, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    system = rng.integers(0, cfg.vocab, args.system_tokens).tolist()
    lo, hi = args.question_tokens
    prompts = [
        system + rng.integers(0, cfg.vocab, int(rng.integers(lo, hi + 1))).tolist()
        for _ in range(args.requests)
    ]
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.requests)).tolist()
    arrivals = [a - arrivals[0] for a in arrivals]  # The first at once.
    requests = [serving.Request(p, args.max_new_tokens) for p in prompts]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    max_len = -(-longest // args.block_tokens) * args.block_tokens
    blocks_per_seq = max_len // args.block_tokens

    def step_fn(params, tokens, positions, counts, state):
        def attend(layer, q, k, v, state):
            return tps.prefetching_attention(q, k, v, state, layer=layer, query_seq_lengths=counts)

        return model_lib.forward(params, cfg, tokens, positions, state, attend)

    step = jax.jit(step_fn, donate_argnums=(4,))
    path = args.path or tempfile.mkdtemp(prefix="tpusync-serve-")
    try:
        with tps.OffloadedKVCache(
            num_layers=cfg.layers,
            batch=args.batch,
            max_len=max_len,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.dtype,
            tier="file",
            path=path,
            block_tokens=args.block_tokens,
            # Every slot at max_len, and room for the released system prompt's blocks.
            num_blocks=(args.batch + 1) * blocks_per_seq,
            prefetch_depth="auto",
        ) as cache:
            loop = serving.ServingLoop(cache, step, params, chunk=args.chunk, seed=args.seed)
            # Compile both step widths before the clock starts (a request's TTFT would
            # otherwise include it); reported apart as the loop's warm-up seconds.
            warmup = loop.warmup()
            t0 = time.perf_counter()
            with tqdm(total=len(requests), desc="requests", unit="req") as bar:

                def finished(c: serving.Completion) -> None:
                    bar.set_postfix(ttft_ms=f"{c.ttft * 1e3:.0f}")
                    bar.update()

                done = loop.run(requests, arrivals=arrivals, on_finish=finished)
            wall = time.perf_counter() - t0
            stats = dict(loop.stats(), prefix=cache.prefix_stats)
            cache.close(loop.state)
    finally:
        if args.path is None:
            shutil.rmtree(path, ignore_errors=True)

    rows = [c.summary() for c in done]
    for row, arrival in zip(rows, arrivals):
        row["arrival_s"] = arrival
    if not args.no_check:
        for row, prompt in zip(rows, prompts):
            row["tokens_resident"] = resident_tokens(
                cfg, params, prompt, args.max_new_tokens, max_len, args.chunk
            )
            row["tokens_match"] = row["tokens"] == row["tokens_resident"]
    print(f"{'req':>4} {'prompt':>6} {'cached':>6} {'TTFT ms':>8} {'ms/token':>8}  match")
    for row in rows:
        tpot = row["time_per_output_token_s"]
        print(
            f"{row['index']:>4} {row['prompt_tokens']:>6} {row['cached_tokens']:>6} "
            f"{row['ttft_s'] * 1e3:>8.1f} {'-' if tpot is None else f'{tpot * 1e3:.1f}':>8}  "
            f"{row.get('tokens_match', '-')}"
        )
    generated = sum(len(r["tokens"]) for r in rows)
    tpots = [r["time_per_output_token_s"] for r in rows if r["time_per_output_token_s"]]
    result = dict(
        requests=rows,
        all_finished=all(c.done for c in done),
        tokens_match=None if args.no_check else all(r["tokens_match"] for r in rows),
        wall_s=wall,
        generated_tokens=generated,
        output_tokens_per_s=generated / wall,
        ttft_ms_median=statistics.median(r["ttft_s"] for r in rows) * 1e3,
        time_per_output_token_ms_median=statistics.median(tpots) * 1e3 if tpots else None,
        prompt_tokens_cached=sum(r["cached_tokens"] for r in rows),
        prompt_tokens=sum(r["prompt_tokens"] for r in rows),
        compile_s=sum(warmup.values()),
        loop=stats,
        config=vars(args),
    )
    print(
        f"{len(rows)} requests in {wall:.2f} s: {result['output_tokens_per_s']:.1f} tokens/s, "
        f"TTFT median {result['ttft_ms_median']:.1f} ms, "
        f"{result['prompt_tokens_cached']}/{result['prompt_tokens']} prompt tokens from the "
        f"prefix store; tokens equal to the resident run: {result['tokens_match']} "
        f"(compile before the first request: {result['compile_s']:.2f} s, not in the times)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["all_finished"] and res["tokens_match"] is not False else 1)
