"""Prefill in one process, decode in another: a sequence's KV handed over a Mooncake
TransferEngine.

A prefill process (started with ``spawn``) holds the model (``model.py``) and a cache of its
own; for each request it prefills the prompt and writes the prompt's KV, one-sided, into
the blocks this process (the decode side) reserved in its cache's host pool, then sends
the first token. This process admits the slot with that KV and decodes
``--max-new-tokens`` greedy tokens. Every request's tokens are checked against the same
model prefilling and decoding here alone. Needs ``pip install 'jax-tpusync[mooncake]'``.

    python examples/prefill_decode.py --requests 3 --prompt-tokens 512 --json pd.json

On two hosts, give each side its NIC's address (``KVSender(host=...)``,
``KVReceiver(host=...)``); nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as model_lib  # noqa: E402

import jax_tpusync as tps  # noqa: E402
from jax_tpusync.pd.transfer import KVReceiver, KVSender  # noqa: E402


def model_and_cache(args, batch: int):
    cfg = model_lib.ModelConfig(
        layers=args.layers, d_model=256, q_heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512
    )
    cache = tps.OffloadedKVCache(
        num_layers=cfg.layers,
        batch=batch,
        max_len=args.prompt_tokens + args.max_new_tokens,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype,
        block_tokens=args.block_tokens,
        model_id="prefill-decode-example",
    )
    return cfg, model_lib.init_params(cfg, seed=0), model_lib.make_offloaded_step(cfg), cache


def prefill(step, params, cache, state, slot, tokens):
    """Admits ``tokens`` into ``slot`` and prefills them: (state, first token)."""
    state, cached = cache.admit(state, slot, tokens=tokens)
    ids = np.zeros((cache.batch, len(tokens) - cached), np.int32)
    ids[slot] = tokens[cached:]
    logits, state = step(params, jnp.asarray(ids), state)
    return state, int(np.argmax(np.asarray(logits)[slot, -1]))


def decode(step, params, cache, state, slot, first, n):
    """``n`` greedy tokens after ``first`` (included) in ``slot``: (state, tokens)."""
    out = [first]
    for _ in range(n - 1):
        ids = np.zeros((cache.batch, 1), np.int32)
        ids[slot] = out[-1]
        logits, state = step(params, jnp.asarray(ids), state)
        out.append(int(np.argmax(np.asarray(logits)[slot, -1])))
    return state, out


def prefill_process(address_queue, args) -> None:
    """The prefill side: serves ``args.requests`` requests, one slot."""
    _, params, step, cache = model_and_cache(args, batch=1)
    state = cache.init(admit=False)

    def run(state, tokens):
        state, first = prefill(step, params, cache, state, 0, tokens)
        return state, 0, {"first_token": first}

    with KVSender(cache, deadline_s=120) as sender:
        address_queue.put(sender.address)
        for _ in range(args.requests):
            state, slot, _ = sender.serve_one(state, run, timeout=120)
            state = cache.release(state, slot)
    cache.close(state)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)

    ctx = multiprocessing.get_context("spawn")  # Never fork a process running engines.
    address_queue = ctx.Queue()
    child = ctx.Process(target=prefill_process, args=(address_queue, args), daemon=True)
    child.start()
    cfg, params, step, cache = model_and_cache(args, batch=2)
    _, _, _, local = model_and_cache(args, batch=2)
    rng = np.random.default_rng(1)
    rows = []
    try:
        address = address_queue.get(timeout=300)
        state, local_state = cache.init(admit=False), local.init(admit=False)
        with KVReceiver(cache, deadline_s=300) as receiver:
            for r in range(args.requests):
                prompt = rng.integers(0, cfg.vocab, args.prompt_tokens)
                state, got = receiver.receive(state, 1, prompt, prefill=address)
                state, tokens = decode(
                    step, params, cache, state, 1, got.extra["first_token"], args.max_new_tokens
                )
                state = cache.release(state, 1)
                local_state, first = prefill(step, params, local, local_state, 0, prompt)
                local_state, want = decode(
                    step, params, local, local_state, 0, first, args.max_new_tokens
                )
                local_state = local.release(local_state, 0)
                rows.append(
                    {
                        "request": r,
                        "kv_bytes": got.nbytes,
                        "transfer_s": got.seconds,
                        "tokens": tokens,
                        "tokens_match": tokens == want,
                    }
                )
                print(
                    f"request {r}: {got.nbytes / 2**20:.1f} MiB of KV in {got.seconds:.3f} s "
                    f"(prefill included); tokens {tokens} "
                    f"{'= the local run' if tokens == want else '!= the local run ' + str(want)}"
                )
        child.join(60)
        cache.close(state)
        local.close(local_state)
    finally:
        if child.is_alive():
            child.kill()
    doc = {"requests": rows, "all_match": all(r["tokens_match"] for r in rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    sys.exit(0 if main()["all_match"] else 1)
