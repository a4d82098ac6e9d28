"""A Mooncake master killed (SIGKILL) or stopped (SIGSTOP) at many moments of a connected
hybrid cache's admit: every admit returns within its deadline and a margin, as a hit or a
miss (never a damaged block), and once the master is back (started again, or resumed) the
same cache publishes and admits again.

Each moment is a delay after the admit starts, swept over the milliseconds an admit of a
remote hit takes here (its header lookup, its in-place reads, the sliding group's window
search); a master started again has lost every object, so each moment has a prompt of its
own, published just before."""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.mooncake.client import (
    LOCAL_BUFFER_BYTES,
    RPC_TIMEOUT,
    RPC_TIMEOUT_VARIABLES,
    setup_within,
)

# Skipped without the Mooncake client, failed instead where TPUSYNC_REQUIRE_MOONCAKE=1
# (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("mooncake_usable")

BLOCK = 8
DEADLINE = 1.0
WITHIN = DEADLINE + 1.5  # The deadline, and room for a loaded 2-core runner.
RECOVER_S = 30.0  # The longest a cache may take to work again once its master is back.
# Delays (s) after an admit starts: a remote hit's admit takes 10-40 ms here.
MOMENTS = {
    "kill": (0.0, 0.003, 0.006, 0.01, 0.02, 0.03),
    "stop": (0.0, 0.003, 0.007, 0.012, 0.025),
}


def hybrid(address: str) -> tps.HybridKVCache:
    """A global and a sliding group, each with a Mooncake level (a client) of its own."""
    return tps.HybridKVCache(
        num_layers=2,
        batch=2,
        max_len=64,
        num_kv_heads=[2, 1],
        head_dim=[16, 32],
        dtype=jnp.float32,
        block_tokens=BLOCK,
        max_step_tokens=8,
        sliding_window=[None, 16],
        model_id="mooncake-master-dies",
        remote_prefix=address,
    )


def levels(cache) -> list:
    return [g.slots.remote_levels[-1] for g in cache.groups]


def publish(writer, tokens: np.ndarray) -> bool:
    """Puts every full block of ``tokens`` into each group's level of ``writer`` (payloads
    of seeded random bytes); whether every block went in."""
    put = True
    for group, lv in zip(writer.groups, levels(writer)):
        keys = group.slots.prefix.keys(tokens)
        rng = np.random.default_rng(int(tokens[0]))
        items = [
            (
                keys[j],
                keys[j - 1] if j else None,
                tokens[j * BLOCK : (j + 1) * BLOCK],
                rng.integers(0, 256, lv.payload_bytes, dtype=np.uint8),
            )
            for j in range(len(keys))
        ]
        put = lv.publish_many(items) == len(items) and put
    return put


def admit(reader, state, tokens):
    """(state, tokens cached, seconds) of admitting ``tokens`` into slot 0 and releasing it
    (without publishing)."""
    start = time.monotonic()
    state, cached = reader.admit(state, 0, tokens=tokens, max_tokens=64)
    seconds = time.monotonic() - start
    return reader.release(state, 0), cached, seconds


def published(writer, tokens, *context) -> None:
    """Publishes ``tokens`` whole, retried within ``RECOVER_S`` (see below)."""
    deadline = time.monotonic() + RECOVER_S
    while not publish(writer, tokens):
        assert time.monotonic() < deadline, (*context, [lv.stats() for lv in levels(writer)])
        time.sleep(0.25)


def published_and_found(writer, reader, state, tokens, *context):
    """``reader``'s state once ``tokens`` published by ``writer`` were admitted whole. A
    call of a live master may still pass the 1 s deadline on a loaded runner (the level
    then pauses for ``retry_after_s``): retried, within ``RECOVER_S``."""
    deadline = time.monotonic() + RECOVER_S
    while True:
        if publish(writer, tokens):
            state, cached, _ = admit(reader, state, tokens)
            if cached == 56:
                return state
        assert time.monotonic() < deadline, (
            *context,
            [lv.stats() for lv in levels(writer) + levels(reader)],
        )
        time.sleep(0.25)


@pytest.mark.parametrize("how", sorted(MOMENTS))
def test_a_master_that_dies_during_a_connected_admit_is_a_miss_within_the_deadline(
    make_master, how
):
    master = make_master()
    address = f"mooncake://{master.address}?segment_mb=16&deadline_s={DEADLINE:g}&retry_after_s=0.5"
    worst, hits, misses = 0.0, 0, 0
    with hybrid(address) as writer, hybrid(address) as reader:
        wstate, rstate = writer.init(admit=False), reader.init(admit=False)
        # Connected: a first prompt found whole, through both groups' levels.
        rstate = published_and_found(writer, reader, rstate, np.arange(64) + 1_000, how)
        assert all(lv.stats()["mooncake_imported"] for lv in levels(reader))
        for i, delay in enumerate(MOMENTS[how]):
            tokens = np.arange(64) + 10_000 * (i + 2)
            published(writer, tokens, how, delay)
            safety = master.resume_later(30) if how == "stop" else None
            try:
                fault = master.fault_after(how, delay)
                rstate, cached, seconds = admit(reader, rstate, tokens)
                fault.join(timeout=10)
            finally:
                master.revive(how)
                if safety is not None:
                    safety.kill()
                    safety.wait(timeout=10)
            assert seconds < WITHIN, (how, delay, seconds, [lv.stats() for lv in levels(reader)])
            assert cached % BLOCK == 0 and cached <= 56, cached
            worst = max(worst, seconds)
            hits += cached == 56
            misses += cached < 56
            # Back: the reader finds a fresh prompt again, published after the fault.
            again = np.arange(64) + 10_000 * (i + 2) + 5_000
            rstate = published_and_found(writer, reader, rstate, again, how, delay)
        stats = [lv.stats() for lv in levels(reader)]
        assert all(s["mooncake_damaged"] == 0 for s in stats), stats
        writer.close(wstate)
        reader.close(rstate)
    # Printed for the record (pytest -s): the slowest admit of the sweep.
    print(
        f"{how}: slowest admit {worst:.3f} s of {len(MOMENTS[how])} ({hits} hits, {misses} misses)"
    )


class SeesTheEnvironment:
    """A stand-in client whose setup records the limits it would read."""

    def setup(self, *args):
        self.args = args
        self.seen = {name: os.environ.get(name) for name in RPC_TIMEOUT_VARIABLES}
        return 0


def test_each_client_gets_its_callers_deadline_and_the_environment_wins(monkeypatch):
    for name in RPC_TIMEOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    client = SeesTheEnvironment()
    assert setup_within(client, 0.0004, "host", "P2PHANDSHAKE") == 0
    assert client.args == ("host", "P2PHANDSHAKE")
    # Milliseconds, rounded up (at least 1), only while it is set up.
    assert client.seen == dict.fromkeys(RPC_TIMEOUT_VARIABLES, "1")
    assert all(name not in os.environ for name in RPC_TIMEOUT_VARIABLES)
    setup_within(client, 2.5, "host")
    assert client.seen == dict.fromkeys(RPC_TIMEOUT_VARIABLES, "2500")
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "30000")
    setup_within(client, 2.5, "host")
    assert client.seen == {"MC_RPC_TIMEOUT_MS": "30000", "MC_RPC_CONNECT_TIMEOUT_MS": "2500"}
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "30000"
    assert "MC_RPC_CONNECT_TIMEOUT_MS" not in os.environ


def test_a_call_into_a_client_whose_master_stopped_ends_by_itself_in_its_deadline(
    make_master, monkeypatch
):
    """The client's own limit, not only the caller's wait: a connected client's request to
    a stopped master returns -901 in about the deadline (30 s by the client's default)."""
    from mooncake.store import MooncakeDistributedStore

    for name in RPC_TIMEOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    master = make_master()
    client = MooncakeDistributedStore()
    rc = setup_within(
        client,
        DEADLINE,
        "127.0.0.1",
        "P2PHANDSHAKE",
        0,
        LOCAL_BUFFER_BYTES,
        "tcp",
        "",
        master.address,
    )
    assert rc == 0
    assert client.is_exist("nothing") == 0
    master.pause()
    safety = master.resume_later(30)
    try:
        start = time.monotonic()
        code = client.is_exist("nothing-asked-while-stopped")  # Not one it answered
        seconds = time.monotonic() - start
    finally:
        master.resume()
        safety.kill()
        safety.wait(timeout=10)
    assert code == RPC_TIMEOUT and seconds < WITHIN, (code, seconds)
    assert client.is_exist("nothing") == 0  # The master back: answered again.
    client.close()
