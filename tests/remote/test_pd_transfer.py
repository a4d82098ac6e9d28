"""Prefill-to-decode transfer over a Mooncake TransferEngine between two processes: the
decode logits equal a local prefill's, the KV is byte-exact in non-contiguous blocks, and a
killed, hung or absent peer is a refusal within its deadline that leaves the slot
unadmitted.

The prefill processes (pd_peers.py) are started with ``spawn`` from cwd "/"; every wait is
bounded."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.bench import tiny_decoder
from jax_tpusync.pd_transfer import KVReceiver, PDTransferError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pd_peers, here and in children.
import pd_peers

TIMEOUT = 120  # The longest any child may live.


@contextlib.contextmanager
def peer(target, *args):
    """A spawned process running ``target(queue, *args)``, started from cwd "/"; yields
    (process, queue); killed at exit if still alive."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue, *args), daemon=True)
    here = os.getcwd()
    os.chdir("/")
    try:
        proc.start()
    finally:
        os.chdir(here)
    try:
        yield proc, queue
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)
        queue.close()


def decode_step(cfg):
    return jax.jit(functools.partial(tiny_decoder.forward, cfg), donate_argnums=(2,))


def one_token(step, params, cache, state, slot, token):
    ids = np.zeros((cache.batch, 1), np.int32)
    ids[slot] = token
    logits, state = step(params, jnp.asarray(ids), state)
    return np.asarray(logits)[slot], state


def test_decode_after_transfer_equals_local_prefill():
    cfg, params = pd_peers.model()
    step = decode_step(cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, 37)
    # Local: prefill and decode in one cache.
    local = pd_peers.make_cache()
    state = local.init(admit=False)
    state, first = pd_peers.prefill_tokens(step, params, local, state, 1, prompt)
    want, state = one_token(step, params, local, state, 1, first)
    local.close(state)

    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with peer(pd_peers.serve_prefill) as (proc, queue), KVReceiver(cache, deadline_s=60) as rx:
        address = queue.get(timeout=TIMEOUT)
        state, got = rx.receive(state, 1, prompt, prefill=address)
        summary = queue.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
    assert got.length == len(prompt) and got.cached == 0
    assert got.nbytes == summary["nbytes"] == 2 * cfg.layers * len(prompt) * cache.spec.row_bytes
    assert int(np.asarray(state.lengths)[1]) == len(prompt)
    assert got.extra["first_token"] == first
    logits, state = one_token(step, params, cache, state, 1, got.extra["first_token"])
    np.testing.assert_array_equal(logits, want)
    cache.close(state)


def test_byte_exact_into_non_contiguous_blocks():
    n = 37
    # 6 blocks: slots 0, 1, 2 take one each, 0 and 2 leave: free {0, 2, 3, 4, 5}.
    cache = pd_peers.make_cache(batch=4, num_blocks=6)
    state = cache.init(admit=False)
    for s in range(3):
        state, _ = cache.admit(state, s, max_tokens=pd_peers.BLOCK)
    state = cache.release(state, 0)
    state = cache.release(state, 2)
    with (
        peer(pd_peers.serve_rows, n, True) as (proc, queue),
        KVReceiver(cache, deadline_s=60) as rx,
    ):
        address = queue.get(timeout=TIMEOUT)
        runs = None
        state, got = rx.receive(state, 3, np.arange(n), prefill=address, max_tokens=n)
        runs = rx.destination_runs(3, 0, n)
        summary = queue.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
    assert all(len(region) > 1 for region in runs)  # Non-contiguous on this side.
    assert summary["segments"] > len(runs) * len(runs[0])  # Split on the other side too.
    for layer in range(pd_peers.MODEL["layers"]):
        k, v = cache.read(state, layer, 3)
        want_k, want_v = pd_peers.rows(layer, n)
        np.testing.assert_array_equal(
            np.asarray(k).view(np.uint16), np.asarray(want_k).view(np.uint16)
        )
        np.testing.assert_array_equal(
            np.asarray(v).view(np.uint16), np.asarray(want_v).view(np.uint16)
        )
    cache.close(state)


def _assert_refused(cache, rx, state, address, deadline, match):
    free = cache.free_blocks
    begin = time.monotonic()
    with pytest.raises(PDTransferError, match=match) as info:
        rx.receive(state, 0, np.arange(20), prefill=address)
    took = time.monotonic() - begin
    assert took < deadline + 2.0, took
    assert "slot 0 from" in str(info.value) and "left unadmitted" in str(info.value)
    assert int(cache.capacity[0]) == 0 and cache.free_blocks == free
    return took


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_dead_or_hung_prefill_is_a_refusal_within_the_deadline(mode):
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    deadline = 4.0
    with (
        peer(pd_peers.serve_prefill, mode) as (proc, queue),
        KVReceiver(cache, deadline_s=deadline) as rx,
    ):
        address = queue.get(timeout=TIMEOUT)
        match = "went away" if mode == "kill" else "no completion message within the deadline"
        _assert_refused(cache, rx, state, address, deadline, match)
    # The slot can be used again.
    state, _ = cache.admit(state, 0, max_tokens=20)
    cache.close(state)


def test_no_prefill_process_is_a_refusal():
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with KVReceiver(cache, deadline_s=2.0) as rx:
        import socket

        with socket.socket() as s:  # A port nobody listens on.
            s.bind(("127.0.0.1", 0))
            address = "127.0.0.1:%d" % s.getsockname()[1]
        _assert_refused(cache, rx, state, address, 2.0, "cannot reach the prefill process")
    cache.close(state)


def test_a_cache_off_a_host_tier_is_refused(tmp_path):
    cache = pd_peers.make_cache(tier="file", path=str(tmp_path))
    with pytest.raises(ValueError, match="not mapped in memory: only a host tier is"):
        cache.engine.mapped_memory(cache.tier)
    with pytest.raises(ValueError, match=r"KVReceiver needs a cache on a host tier"):
        KVReceiver(cache)
    cache.close()


@pytest.mark.parametrize("deadline", [0, -1.0, float("inf"), True])
def test_deadline_must_be_positive_and_finite(deadline):
    cache = pd_peers.make_cache()
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        KVReceiver(cache, deadline_s=deadline)
    cache.close()
