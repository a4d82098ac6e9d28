"""Processes of the P/D tests, started with the ``spawn`` start method (a fresh interpreter:
never a fork of a process whose engines run threads). Top-level functions of a module that
imports nothing of the package until called, so a child imports it from its own cwd."""

from __future__ import annotations

import os
import signal

# A tiny decoder (jax_tpusync.bench.tiny_decoder) and its cache.
MODEL = dict(layers=2, d_model=64, q_heads=4, kv_heads=2, head_dim=16, ffn=64, vocab=97)
BLOCK, MAX_LEN, SEED = 8, 64, 3


def model():
    from jax_tpusync.bench import tiny_decoder

    cfg = tiny_decoder.Decoder(**MODEL)
    return cfg, tiny_decoder.init_params(cfg, SEED)


def make_cache(batch: int = 2, num_blocks: int | None = None, **overrides):
    import jax.numpy as jnp

    import jax_tpusync as tps

    args = dict(
        num_layers=MODEL["layers"],
        batch=batch,
        max_len=MAX_LEN,
        num_kv_heads=MODEL["kv_heads"],
        head_dim=MODEL["head_dim"],
        dtype=jnp.bfloat16,
        block_tokens=BLOCK,
        num_blocks=num_blocks,
        model_id="pd-test",
    )
    args.update(overrides)
    return tps.OffloadedKVCache(**args)


def prefill_tokens(step, params, cache, state, slot, tokens):
    """Admits ``tokens`` into ``slot`` and prefills them: (state, first token)."""
    import jax.numpy as jnp
    import numpy as np

    state, cached = cache.admit(state, slot, tokens=tokens)
    assert cached == 0
    batch_tokens = np.zeros((cache.batch, len(tokens)), np.int32)
    batch_tokens[slot] = tokens
    # Only ``slot`` is active; the others have no capacity and are skipped by the step.
    logits, state = step(params, jnp.asarray(batch_tokens), state)
    return state, int(np.argmax(np.asarray(logits)[slot]))


def serve_prefill(queue, mode: str = "ok", deadline_s: float = 10.0) -> None:
    """A prefill process: puts its address on ``queue``, serves one request with the tiny
    decoder (mode "ok"), or misbehaves once the request is in ("kill": dies; "stop":
    stops itself)."""
    os.chdir("/")
    import functools

    import jax

    from jax_tpusync.bench import tiny_decoder
    from jax_tpusync.pd_transfer import KVSender

    cfg, params = model()
    step = jax.jit(functools.partial(tiny_decoder.forward, cfg), donate_argnums=(2,))
    cache = make_cache(batch=1)
    state = cache.init(admit=False)
    with KVSender(cache, deadline_s=deadline_s) as sender:
        queue.put(sender.address)
        request = sender.accept(timeout=60)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        state, first = prefill_tokens(step, params, cache, state, 0, request.tokens)
        state, sent = sender.send(request, state, 0, extra=dict(first_token=first))
        queue.put(dict(nbytes=sent.nbytes, segments=sent.segments))
    cache.close(state)


def serve_rows(queue, tokens_len: int, fragment: bool) -> None:
    """A prefill process that writes known rows (no model) into a slot whose blocks are
    not contiguous (``fragment``), then sends them; puts its address, then a summary."""
    os.chdir("/")

    from jax_tpusync.pd_transfer import KVSender

    # 7 blocks: slot 0 takes two, slot 1 one, slot 0 leaves: free {0, 1, 3, 4, 5, 6},
    # and 5 blocks for slot 2 cannot be one run.
    cache = make_cache(batch=3, num_blocks=7 if fragment else None)
    state = cache.init(admit=False)
    slot = 2
    if fragment:
        state, _ = cache.admit(state, 0, max_tokens=2 * BLOCK)
        state, _ = cache.admit(state, 1, max_tokens=BLOCK)
        state = cache.release(state, 0)
    state, _ = cache.admit(state, slot, max_tokens=tokens_len)
    for layer in range(MODEL["layers"]):
        k, v = rows(layer, tokens_len)
        state = cache.load(state, layer, k, v, slot=slot)
    with KVSender(cache, deadline_s=10.0, batch_bytes=4096) as sender:
        queue.put(sender.address)
        request = sender.accept(timeout=60)
        state, sent = sender.send(request, state, slot)
        queue.put(dict(nbytes=sent.nbytes, segments=sent.segments))
    cache.close(state)


def rows(layer: int, n: int):
    """K and V rows of ``layer`` that differ in every byte position: [n, heads, dim] each,
    as bfloat16."""
    import jax.numpy as jnp
    import numpy as np

    shape = (n, MODEL["kv_heads"], MODEL["head_dim"])
    base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7 + 1000 * layer
    return jnp.asarray(base, jnp.bfloat16), jnp.asarray(-base - 0.5, jnp.bfloat16)
