"""The P/D tests' side of a transfer: a spawned prefill peer (support.pd_peers) and the
tiny decoder's steps in this process (test_pd_transfer.py, test_pd_netns.py)."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync.bench import tiny_decoder
from jax_tpusync.bench.common import start_child

from support import pd_peers

TIMEOUT = 120  # The longest any child may live.


@contextlib.contextmanager
def peer(target, *args):
    """A spawned process running ``target(queue, *args)``, started from cwd "/"; yields
    (process, queue); killed at exit if still alive."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = start_child(ctx, target, queue, *args)
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


def local_first_step(step, params, prompt):
    """(first token, logits of the step after it) with the prompt prefilled locally, in
    slot 1 of a cache of the peers' shape: what a transfer must reproduce."""
    local = pd_peers.make_cache()
    state = local.init(admit=False)
    state, first = pd_peers.prefill_tokens(step, params, local, state, 1, prompt)
    want, state = one_token(step, params, local, state, 1, first)
    local.close(state)
    return first, want
