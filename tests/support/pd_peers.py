"""Processes of the P/D tests, started with the ``spawn`` start method (a fresh interpreter:
never a fork of a process whose engines run threads). Top-level functions of a module that
imports nothing of the package until called, so a child imports it from its own cwd."""

from __future__ import annotations

import os
import signal

# A tiny decoder (jax_tpusync.bench.tiny_decoder) and its cache.
MODEL = {
    "layers": 2,
    "d_model": 64,
    "q_heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "ffn": 64,
    "vocab": 97,
}
BLOCK, MAX_LEN, SEED = 8, 64, 3


def model():
    from jax_tpusync.bench import tiny_decoder

    cfg = tiny_decoder.Decoder(**MODEL)
    return cfg, tiny_decoder.init_params(cfg, SEED)


def cache_args(batch: int) -> dict:
    """The keyword arguments both cache kinds share: the tiny model's KV geometry."""
    import jax.numpy as jnp

    return {
        "num_layers": MODEL["layers"],
        "batch": batch,
        "max_len": MAX_LEN,
        "num_kv_heads": MODEL["kv_heads"],
        "head_dim": MODEL["head_dim"],
        "dtype": jnp.bfloat16,
        "block_tokens": BLOCK,
        "model_id": "pd-test",
    }


def make_cache(batch: int = 2, num_blocks: int | None = None, **overrides):
    import jax_tpusync as tps

    return tps.OffloadedKVCache(**{**cache_args(batch), "num_blocks": num_blocks, **overrides})


def make_mesh_cache(devices, batch: int = 2, **overrides):
    """A mesh cache over ``devices`` (one axis, "model"): each device holds
    ``kv_heads / len(devices)`` of the KV heads of every slot."""
    import numpy as np
    from jax.sharding import Mesh

    import jax_tpusync as tps

    mesh = {"mesh": Mesh(np.asarray(devices), ("model",)), "kv_heads_axis": "model"}
    return tps.ShardedKVCache(**{**mesh, **cache_args(batch), **overrides})


def shard_kv(cache, state, slot: int, n: int) -> dict:
    """``{(lo, hi): [(k, v) per layer]}``: each head shard's first ``n`` rows of ``slot``,
    as uint16 views (bfloat16 bytes) of [n, its heads, head_dim]."""
    import numpy as np

    parts = cache.split(state)
    out = {}
    for s, shard in cache.shards.items():
        local = slot - cache.rows_of(s).start
        heads = cache.heads_of(s)
        out[(heads.start, heads.stop)] = [
            tuple(np.asarray(x).view(np.uint16) for x in shard.read(parts[s], layer, local, 0, n))
            for layer in range(MODEL["layers"])
        ]
    return out


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


def serve_prefill(
    queue, mode: str = "ok", deadline_s: float = 10.0, host: str = "127.0.0.1", netns=None
) -> None:
    """A prefill process: puts its address on ``queue``, serves one request with the tiny
    decoder (mode "ok"), or misbehaves once the request is in ("kill": dies; "stop":
    stops itself). ``netns``: a network namespace (/var/run/netns/NAME) it joins first,
    listening at ``host`` there."""
    os.chdir("/")
    if netns is not None:
        join_netns(netns)
    import functools

    import jax

    from jax_tpusync.bench import tiny_decoder
    from jax_tpusync.pd.transfer import KVSender

    cfg, params = model()
    step = jax.jit(functools.partial(tiny_decoder.forward, cfg), donate_argnums=(2,))
    cache = make_cache(batch=1)
    state = cache.init(admit=False)
    with KVSender(cache, host=host, deadline_s=deadline_s) as sender:
        queue.put(sender.address)
        request = sender.accept(timeout=60)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        state, first = prefill_tokens(step, params, cache, state, 0, request.tokens)
        state, sent = sender.send(request, state, 0, extra={"first_token": first})
        queue.put({"nbytes": sent.nbytes, "segments": sent.segments})
    cache.close(state)


def serve_rows(queue, tokens_len: int, fragment: bool) -> None:
    """A prefill process that writes known rows (no model) into a slot whose blocks are
    not contiguous (``fragment``), then sends them; puts its address, then a summary."""
    os.chdir("/")

    from jax_tpusync.pd.transfer import KVSender

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
        queue.put({"nbytes": sent.nbytes, "segments": sent.segments})
    cache.close(state)


def rows(layer: int, n: int):
    """K and V rows of ``layer`` that differ in every byte position: [n, heads, dim] each,
    as bfloat16."""
    import jax.numpy as jnp
    import numpy as np

    shape = (n, MODEL["kv_heads"], MODEL["head_dim"])
    base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7 + 1000 * layer
    return jnp.asarray(base, jnp.bfloat16), jnp.asarray(-base - 0.5, jnp.bfloat16)


def serve_mesh_prefill(queue, devices: int = 2) -> None:
    """A prefill process on a mesh of ``devices`` CPU devices (head shards): serves one
    request with the tiny decoder; puts its address, then what it sent and each head
    shard's KV of the slot."""
    import sys

    os.chdir("/")
    assert "jax" not in sys.modules, "jax was imported before its device count was set"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import functools

    import jax

    from jax_tpusync.bench import tiny_decoder
    from jax_tpusync.pd.transfer import KVSender

    assert jax.device_count() == devices, jax.devices()
    cfg, params = model()
    step = jax.jit(functools.partial(tiny_decoder.forward, cfg), donate_argnums=(2,))
    cache = make_mesh_cache(jax.devices())
    state = cache.init(admit=False)
    with KVSender(cache, deadline_s=30.0, batch_bytes=4096) as sender:
        queue.put(sender.address)
        request = sender.accept(timeout=60)
        state, first = prefill_tokens(step, params, cache, state, 0, request.tokens)
        state, sent = sender.send(request, state, 0, extra={"first_token": first})
        queue.put(
            {
                "nbytes": sent.nbytes,
                "head_bytes": sent.head_bytes,
                "kv": shard_kv(cache, state, 0, len(request.tokens)),
            }
        )
    cache.close(state)


def join_netns(name: str) -> None:
    """Moves this process (before it opens a socket or starts a thread) into the network
    namespace /var/run/netns/<name>."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as ns:
        if libc.setns(ns.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name}")
