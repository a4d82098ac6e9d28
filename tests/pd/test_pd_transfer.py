"""Prefill-to-decode transfer over a Mooncake TransferEngine between two processes: the
decode logits equal a local prefill's, the KV is byte-exact in non-contiguous blocks, and a
killed, hung or absent peer is a refusal within its deadline that leaves the slot
unadmitted.

The prefill processes (pd_peers.py) are started with ``spawn`` from cwd "/"; every wait is
bounded."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xxhash

from jax_tpusync.pd import transfer as pd_transfer
from jax_tpusync.pd.pools import head_pools
from jax_tpusync.pd.transfer import KVReceiver, KVSender, PDTransferError
from jax_tpusync.pd.writes import head_pieces

from support import pd_peers
from support.pd_steps import TIMEOUT, decode_step, local_first_step, one_token, peer

# Skipped without the Mooncake client, failed instead where TPUSYNC_REQUIRE_MOONCAKE=1
# (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("mooncake_usable")


@pytest.mark.slow
def test_decode_after_transfer_equals_local_prefill():
    cfg, params = pd_peers.model()
    step = decode_step(cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, 37)
    first, want = local_first_step(step, params, prompt)

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
        state, _got = rx.receive(state, 3, np.arange(n), prefill=address, max_tokens=n)
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


def _assert_refused(cache, rx, state, address, deadline, match, *, held: bool):
    """A refused receive into slot 0 within the deadline: the slot inactive, its blocks
    free (``held``: held aside in quarantine instead); returns the free blocks before."""
    free = cache.free_blocks
    begin = time.monotonic()
    with pytest.raises(PDTransferError, match=match) as info:
        rx.receive(state, 0, np.arange(20), prefill=address)
    took = time.monotonic() - begin
    assert took < deadline + 2.0, took
    assert "slot 0 from" in str(info.value) and "left unadmitted" in str(info.value)
    assert int(cache.capacity[0]) == 0
    if held:
        assert "held aside" in str(info.value)
        assert list(rx.quarantined) == [0]
        assert cache.free_blocks == free - 3  # 20 tokens: 3 blocks of 8.
    else:
        assert rx.quarantined == {}
        assert cache.free_blocks == free
    return free


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_dead_or_hung_prefill_is_a_refusal_within_the_deadline(mode):
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    deadline = 4.0
    with (
        peer(pd_peers.serve_prefill, mode) as (_proc, queue),
        KVReceiver(cache, deadline_s=deadline, quarantine_s=1.0) as rx,
    ):
        address = queue.get(timeout=TIMEOUT)
        match = "went away" if mode == "kill" else "no completion message within the deadline"
        # The request went out: writes may be in flight, so the blocks are held aside.
        free = _assert_refused(cache, rx, state, address, deadline, match, held=True)
        with pytest.raises(ValueError, match=r"slot 0 is quarantined .* frees in"):
            rx.receive(state, 0, np.arange(20), prefill=address)
        assert rx.reclaim(wait=True) == [0]
        assert cache.free_blocks == free and rx.quarantined == {}
    # The slot can be used again.
    state, _ = cache.admit(state, 0, max_tokens=20)
    cache.close(state)


def test_no_prefill_process_is_a_refusal():
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with KVReceiver(cache, deadline_s=2.0, quarantine_s=60.0) as rx:
        with socket.socket() as s:  # A port nobody listens on.
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        # Nothing went out: the blocks are free at once, whatever the quarantine.
        _assert_refused(
            cache, rx, state, address, 2.0, "cannot reach the prefill process", held=False
        )
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


@pytest.mark.parametrize("quarantine", [-1.0, float("inf"), True, "1"])
def test_quarantine_must_be_none_or_finite_and_not_negative(quarantine):
    cache = pd_peers.make_cache()
    with pytest.raises(ValueError, match="must be None or a finite number >= 0"):
        KVReceiver(cache, quarantine_s=quarantine, transfer_engine=FakeEngine(), session="d:1")
    cache.close()


@pytest.mark.parametrize("role", [KVReceiver, KVSender])
@pytest.mark.parametrize("host", ["", " ", "a b", "host/1", None])
def test_a_host_that_names_no_machine_is_refused_by_name(role, host):
    """An empty host would listen on every interface and start an engine whose session
    (":port") no peer can write to; refused before anything starts."""
    cache = pd_peers.make_cache(batch=1)
    with pytest.raises(
        ValueError,
        match=rf"host={re.escape(repr(host))} must be a host's name or address \(non-empty, "
        r"no spaces or '/'\)",
    ):
        role(cache, host=host, transfer_engine=FakeEngine(), session="d:1")
    # The edge: a name of one character (the receiver's host is its engine's; given one,
    # it is not used) and a name the sender listens at.
    KVReceiver(cache, host="h", transfer_engine=FakeEngine(), session="d:1").close()
    KVSender(cache, host="localhost", transfer_engine=FakeEngine(), session="d:1").close()
    cache.close()


@pytest.mark.parametrize("role", [KVReceiver, KVSender])
@pytest.mark.parametrize("session", ["", "d", ":1", " :1", "d:", "d:x", "d:0", 5])
def test_a_session_that_is_not_host_port_is_refused_by_name(role, session):
    cache = pd_peers.make_cache(batch=1)
    with pytest.raises(
        ValueError,
        match=rf"session={re.escape(repr(session))} must be the TransferEngine's 'host:port'",
    ):
        role(cache, transfer_engine=FakeEngine(), session=session)
    role(cache, transfer_engine=FakeEngine(), session="d:1").close()  # The edge.
    cache.close()


@pytest.mark.parametrize("address", [":5", " :5", ("", 5), "a/b:5", (None, 5)])
def test_a_prefill_address_without_a_host_is_refused_before_anything_changes(address):
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with KVReceiver(cache, transfer_engine=FakeEngine(), session="d:1") as rx:
        free = cache.free_blocks
        with pytest.raises(
            ValueError,
            match=rf"address {re.escape(repr(address))}: the host must be a name or address",
        ):
            rx.receive(state, 0, np.arange(N), prefill=address)
        assert cache.free_blocks == free and int(cache.capacity[0]) == 0
        assert (rx.received, rx.failed) == (0, 0)
    cache.close(state)


# -- faults a real engine cannot make on cue: a stand-in engine ---------------------------------

N = 20  # Tokens of the fake transfers: 20 rows of 64 bytes per (layer, K|V), 3 blocks of 8.


def copy_bytes(src, dst, size):
    ctypes.memmove(dst, src, size)


class FakeEngine:
    """A TransferEngine stand-in for two roles in this process: a write is ``move(src, dst,
    size)`` (by default a copy: both pools are here), done when it is submitted;
    ``submit`` is what a submission returns when negative, ``status(request id)`` its
    status, ``warm`` what the first (synchronous) write to a session returns."""

    def __init__(self, *, submit=0, status=lambda rid: 1, warm=0, move=copy_bytes):
        self.submit, self.status, self.warm, self.move = submit, status, warm, move
        self.registered: dict[int, int] = {}
        self.submitted: list[int] = []  # Sizes of the writes submitted, in order.
        self.times: list[float] = []  # When each was submitted (time.monotonic()).

    def register_memory(self, address, nbytes):
        self.registered[address] = nbytes
        return 0

    def unregister_memory(self, address):
        del self.registered[address]
        return 0

    def transfer_sync_write(self, session, src, dst, size):
        if self.warm == 0:
            self.move(src, dst, size)
        return self.warm

    def transfer_submit_write(self, session, src, dst, size):
        if self.submit < 0:
            return self.submit
        self.move(src, dst, size)
        self.submitted.append(size)
        self.times.append(time.monotonic())
        return len(self.submitted)

    def transfer_check_status(self, rid):
        return self.status(rid)


@contextlib.contextmanager
def fake_pair(
    engine, *, sender_deadline=0.5, receiver_deadline=5.0, quarantine_s=0.0, rx_blocks=None, **kw
):
    """A receiver and a sender in this process over ``engine``; the sender's slot 0 holds
    N tokens; the decode cache has ``rx_blocks`` blocks. Yields (decode cache, receiver,
    sender, prefill state)."""
    tx_cache = pd_peers.make_cache(batch=1)
    tx_state = tx_cache.init(admit=False)
    tx_state, _ = tx_cache.admit(tx_state, 0, max_tokens=N)
    for layer in range(pd_peers.MODEL["layers"]):
        tx_state = tx_cache.load(tx_state, layer, *pd_peers.rows(layer, N), slot=0)
    rx_cache = pd_peers.make_cache(num_blocks=rx_blocks)
    rx = KVReceiver(
        rx_cache,
        deadline_s=receiver_deadline,
        quarantine_s=quarantine_s,
        transfer_engine=engine,
        session="decode:1",
        clock=kw.pop("clock", time.monotonic),
    )
    tx = KVSender(
        tx_cache, deadline_s=sender_deadline, transfer_engine=engine, session="prefill:1", **kw
    )
    try:
        yield rx_cache, rx, tx, tx_state
    finally:
        tx.close()
        rx.clock = time.monotonic  # A fake clock's quarantines end here, not in its future.
        rx.close()
        tx_cache.close()
        rx_cache.close()


@contextlib.contextmanager
def receiving(rx, state, address, slot=0):
    """``rx.receive(state, slot, N tokens)`` from the peer at ``address``, started on a
    thread; yields a dict that holds its "error" (or "result") once the block exits
    (joined, bounded)."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = rx.receive(state, slot, np.arange(N), prefill=address)
        except Exception as e:  # noqa: BLE001 - checked by the test.
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield outcome
    thread.join(30)
    assert not thread.is_alive(), "the receive did not end"


def _send_fails(engine, match, *, told, **kw):
    """A transfer whose send fails with ``match``; the decode side's error names ``told``."""
    with fake_pair(engine, **kw) as (rx_cache, rx, tx, tx_state):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            begin = time.monotonic()
            with pytest.raises(PDTransferError, match=match):
                tx.send(request, tx_state, 0)
            took = time.monotonic() - begin
        assert request.answered and tx.failed == 1
        error = str(outcome["error"])
        assert "slot 0 from" in error and told in error, error
        assert int(rx_cache.capacity[0]) == 0 and rx_cache.free_blocks == free
        return took, engine


def test_pieces_split_where_a_run_ends_on_either_side_and_at_piece_bytes():
    source = {"heads": [0, 2], "runs": [[[1000, 10]], [[2000, 4], [3000, 4]]]}
    destination = {"heads": [0, 2], "runs": [[[50, 6], [80, 4]], [[90, 8]]]}
    assert head_pieces(source, destination, 5) == [
        (1000, 50, 5),
        (1005, 55, 1),
        (1006, 80, 4),
        (2000, 90, 4),
        (3000, 94, 4),
    ]
    with pytest.raises(ValueError, match=r"heads \[0, 1\] sent to the pool of heads \(0, 2\)"):
        head_pieces(source, {**destination, "heads": [0, 1]}, 5)


def test_a_refused_submission_fails_the_send_and_the_decode_side_is_told():
    took, engine = _send_fails(
        FakeEngine(submit=-2),
        r"submitting a write to decode:1 returned -2: the decode process is gone",
        told="refused: writing the KV failed: submitting a write to decode:1 returned -2",
    )
    assert engine.submitted == [] and took < 2.0


def test_a_failed_first_write_fails_the_send_and_the_decode_side_is_told():
    _send_fails(
        FakeEngine(warm=-1),
        r"the TransferEngine's writes to decode:1 failed \(-1\)",
        told="refused: writing the KV failed: the TransferEngine's writes to decode:1 failed (-1)",
    )


def test_a_failed_write_status_fails_the_send_and_the_decode_side_is_told():
    _send_fails(
        FakeEngine(status=lambda rid: -1),
        r"the TransferEngine's writes to decode:1 failed \(-1\)",
        told="refused: writing the KV failed: the TransferEngine's writes to decode:1 failed (-1)",
    )


def test_a_write_never_acknowledged_fails_the_send_at_its_deadline():
    took, engine = _send_fails(
        FakeEngine(status=lambda rid: 0),
        r"a write of \d+ bytes to decode:1 was not acknowledged within 0.5 s",
        told="was not acknowledged within 0.5 s",
        sender_deadline=0.5,
    )
    assert 0.5 <= took < 2.0, took
    assert engine.submitted  # Some were in flight.


def test_a_write_acknowledged_within_its_deadline_is_not_a_failure():
    """The guard is "longer than the deadline since submission": writes acknowledged
    0.3 s after their submission pass a 0.5 s deadline."""
    engine = FakeEngine()
    engine.status = lambda rid: int(time.monotonic() - engine.times[rid - 1] > 0.3)
    with fake_pair(engine, sender_deadline=0.5) as (rx_cache, rx, tx, tx_state):
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            tx_state, sent = tx.send(request, tx_state, 0)
        assert "error" not in outcome, outcome.get("error")
        assert sent.nbytes == 2 * pd_peers.MODEL["layers"] * N * 64


def test_the_send_stops_once_the_decode_side_gives_up():
    """The decode side's deadline passes while a write is pending; the sender sees the
    closed control connection before its next write and stops."""
    gave_up = threading.Event()
    engine = FakeEngine(status=lambda rid: 1 if gave_up.is_set() else 0)
    kw = {"sender_deadline": 10.0, "receiver_deadline": 0.5, "piece_bytes": 256, "batch_bytes": 256}
    with fake_pair(engine, **kw) as (rx_cache, rx, tx, tx_state):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            watcher = threading.Thread(
                target=lambda: (time.sleep(0.5), _wait_for(outcome), gave_up.set()), daemon=True
            )
            watcher.start()
            begin = time.monotonic()
            with pytest.raises(PDTransferError, match=r"closed the connection \(it gave up\)"):
                tx.send(request, tx_state, 0)
            took = time.monotonic() - begin
            watcher.join(10)
        assert took < 3.0, took
        # One write was in flight when the decode side gave up; none was submitted after.
        assert engine.submitted == [256]
        assert "no completion message within the deadline" in str(outcome["error"])
        assert int(rx_cache.capacity[0]) == 0 and rx_cache.free_blocks == free


def _wait_for(outcome, timeout=10.0):
    end = time.monotonic() + timeout
    while "error" not in outcome and "result" not in outcome and time.monotonic() < end:
        time.sleep(0.01)


# -- quarantine of blocks writes may still land in ----------------------------------------------


def test_a_failure_after_writes_holds_the_blocks_until_exactly_the_quarantine():
    now = [100.0]
    engine = FakeEngine(status=lambda rid: -1)
    with fake_pair(engine, quarantine_s=10.0, clock=lambda: now[0], rx_blocks=11) as (
        rx_cache,
        rx,
        tx,
        tx_state,
    ):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            with pytest.raises(PDTransferError, match="writes to decode:1 failed"):
                tx.send(request, tx_state, 0)
        error = str(outcome["error"])
        assert "held aside for 10 s (writes may still land in them)" in error, error
        assert int(rx_cache.capacity[0]) == 0  # Inactive: no state shows it.
        assert rx_cache.free_blocks == free - 3 and rx.quarantined == {0: 10.0}
        # Other slots are served meanwhile, from the other blocks.
        state, _ = rx_cache.admit(state, 1, max_tokens=8 * pd_peers.BLOCK)
        assert rx_cache.free_blocks == 0
        with pytest.raises(ValueError, match="needs 3 KV blocks but only 0 of 11 are free"):
            rx_cache.admit(state, 0, max_tokens=N)
        state = rx_cache.release(state, 1)
        now[0] = 110.0 - 1e-6
        assert rx.reclaim() == [] and rx_cache.free_blocks == free - 3
        with pytest.raises(ValueError, match=r"slot 0 is quarantined .*: it frees in 1e-06 s"):
            rx.receive(state, 0, np.arange(N), prefill=tx.address)
        now[0] = 110.0
        assert rx.reclaim() == [0]
        assert rx_cache.free_blocks == free and rx.quarantined == {}


def test_receive_reclaims_expired_quarantines_first():
    now = [0.0]
    with fake_pair(FakeEngine(status=lambda rid: -1), quarantine_s=5.0, clock=lambda: now[0]) as (
        rx_cache,
        rx,
        tx,
        tx_state,
    ):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            with pytest.raises(PDTransferError):
                tx.send(tx.accept(timeout=10), tx_state, 0)
        assert rx_cache.free_blocks == free - 3
        tx.engine.status = lambda rid: 1
        now[0] = 5.0
        with receiving(rx, state, tx.address) as outcome:
            tx.send(tx.accept(timeout=10), tx_state, 0)
        state, got = outcome["result"]
        assert got.slot == 0 and got.length == N and rx.quarantined == {}
        assert rx_cache.free_blocks == free - 8  # Slot 0 admitted at max_len: 8 blocks.


def test_a_refusal_before_any_write_frees_the_blocks_at_once():
    """A request refused before a write was submitted (the prefill raised) leaves nothing
    in flight: no quarantine."""
    with fake_pair(FakeEngine(), quarantine_s=60.0) as (rx_cache, rx, tx, tx_state):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:

            def prefill(state, tokens):
                raise RuntimeError("out of memory")

            with pytest.raises(RuntimeError, match="out of memory"):
                tx.serve_one(tx_state, prefill, timeout=10)
        assert "refused: the prefill raised RuntimeError: out of memory" in str(outcome["error"])
        assert rx.quarantined == {} and rx_cache.free_blocks == free


def test_the_default_quarantine_is_twice_the_longest_tcp_timeout_plus_one(monkeypatch):
    cache = pd_peers.make_cache()
    for progress, status, want in (("3", "5", 11.0), ("7", None, 61.0), (None, None, 61.0)):
        for name, value in (
            ("MC_TCP_PROGRESS_TIMEOUT_SEC", progress),
            ("MC_TCP_STATUS_TIMEOUT_SEC", status),
        ):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        rx = KVReceiver(cache, transfer_engine=FakeEngine(), session="d:1")
        assert rx.quarantine_s == want
        rx.close()
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "soon")
    with pytest.raises(ValueError, match="MC_TCP_STATUS_TIMEOUT_SEC='soon' must be a positive"):
        KVReceiver(cache, transfer_engine=FakeEngine(), session="d:1")
    cache.close()


# -- mesh caches: each head shard sends its own heads -------------------------------------------


needs_two_devices = pytest.mark.skipif(
    jax.device_count() < 2,
    reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count)",
)


@needs_two_devices
@pytest.mark.slow
def test_mesh_decode_after_transfer_equals_local_prefill_and_each_shard_sends_its_heads():
    cfg, params = pd_peers.model()
    step = decode_step(cfg)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, 29)
    devices = jax.devices()[:2]
    local = pd_peers.make_mesh_cache(devices)
    state = local.init(admit=False)
    state, first = pd_peers.prefill_tokens(step, params, local, state, 1, prompt)
    want_kv = pd_peers.shard_kv(local, state, 1, len(prompt))
    want, state = one_token(step, params, local, state, 1, first)
    local.close(state)

    cache = pd_peers.make_mesh_cache(devices)
    state = cache.init(admit=False)
    with (
        peer(pd_peers.serve_mesh_prefill) as (proc, queue),
        KVReceiver(cache, deadline_s=60) as rx,
    ):
        address = queue.get(timeout=TIMEOUT)
        state, got = rx.receive(state, 1, prompt, prefill=address)
        summary = queue.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
    share = 2 * cfg.layers * len(prompt) * cache.shard_spec.row_bytes  # One head shard's.
    assert got.head_bytes == tuple(summary["head_bytes"]) == (share, share)
    assert got.nbytes == summary["nbytes"] == 2 * share
    assert got.extra["first_token"] == first
    # Each head shard holds the bytes the prefill process's shard of its heads held.
    got_kv = pd_peers.shard_kv(cache, state, 1, len(prompt))
    assert sorted(got_kv) == sorted(summary["kv"]) == [(0, 1), (1, 2)]
    for heads, layers in got_kv.items():
        for (k, v), (pk, pv), (wk, wv) in zip(layers, summary["kv"][heads], want_kv[heads]):
            np.testing.assert_array_equal(k, pk)
            np.testing.assert_array_equal(v, pv)
            np.testing.assert_array_equal(k, wk)
            np.testing.assert_array_equal(v, wv)
    logits, state = one_token(step, params, cache, state, 1, got.extra["first_token"])
    np.testing.assert_array_equal(logits, want)
    cache.close(state)


@needs_two_devices
def test_a_head_split_that_differs_is_refused_naming_it():
    """A one-device prefill cache (all heads in one pool) cannot write a 2-way head split;
    refused before any write, so the decode blocks are free at once."""
    decode = pd_peers.make_mesh_cache(jax.devices()[:2])
    prefill = pd_peers.make_cache(batch=1)
    engine = FakeEngine()
    with (
        KVReceiver(decode, quarantine_s=60.0, transfer_engine=engine, session="decode:1") as rx,
        KVSender(prefill, transfer_engine=engine, session="prefill:1") as tx,
    ):
        free = decode.free_blocks
        state = decode.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            with pytest.raises(
                PDTransferError,
                match=r"layout differs: head_split \[\[0, 2\]\] here, \[\[0, 1\], \[1, 2\]\] "
                r"there; row_bytes 64 here, 32 there",
            ):
                tx.accept(timeout=10)
        assert "refused: layout differs: head_split" in str(outcome["error"])
        assert rx.quarantined == {} and decode.free_blocks == free
        assert int(decode.capacity[0]) == 0
    decode.close()
    prefill.close()


@needs_two_devices
def test_a_mesh_slot_whose_head_shards_are_not_all_here_is_refused():
    """receive() needs every head shard of the slot in this process (a check a
    multi-process mesh meets): here a pool list without shard 1 stands for one."""
    cache = pd_peers.make_mesh_cache(jax.devices()[:2])
    with KVReceiver(cache, transfer_engine=FakeEngine(), session="decode:1") as rx:
        rx.endpoint.pools = rx.endpoint.pools[:1]
        with pytest.raises(
            ValueError,
            match=r"slot 1's KV heads are split over 2 devices, of which this "
            r"process holds 1",
        ):
            rx.receive(cache.init(admit=False), 1, np.arange(N), prefill="127.0.0.1:1")
        with pytest.raises(ValueError, match=r"slot=2 must be an int in \[0, batch=2\)"):
            rx.receive(cache.init(admit=False), 2, np.arange(N), prefill="127.0.0.1:1")
        rx.endpoint.pools = head_pools(cache, "KVReceiver")
    cache.close()


@needs_two_devices
def test_a_mesh_receivers_runs_are_per_head_range():
    cache = pd_peers.make_mesh_cache(jax.devices()[:2])
    state = cache.init(admit=False)
    state, _ = cache.admit(state, 0, max_tokens=2 * pd_peers.BLOCK)
    with KVReceiver(cache, transfer_engine=FakeEngine(), session="decode:1") as rx:
        runs = rx.head_runs(0, 0, 2 * pd_peers.BLOCK)
        assert [r["heads"] for r in runs] == [[0, 1], [1, 2]]
        row = cache.shard_spec.row_bytes
        for r in runs:
            assert len(r["runs"]) == 2 * pd_peers.MODEL["layers"]
            assert all(sum(n for _, n in region) == 16 * row for region in r["runs"])
        with pytest.raises(
            ValueError, match=r"slot 0's heads lie in 2 pools .*: use head_runs\(\)"
        ):
            rx.destination_runs(0, 0, 16)
    cache.close(state)


@needs_two_devices
def test_a_mesh_sender_refuses_a_slot_whose_head_shards_are_not_all_here():
    cache = pd_peers.make_mesh_cache(jax.devices()[:2])
    engine = FakeEngine()
    with (
        KVReceiver(cache, quarantine_s=60.0, transfer_engine=engine, session="decode:1") as rx,
        KVSender(
            pd_peers.make_mesh_cache(jax.devices()[2:4]),
            transfer_engine=engine,
            session="prefill:1",
        ) as tx,
    ):
        state = cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            tx.endpoint.pools = tx.endpoint.pools[1:]
            with pytest.raises(ValueError, match="slot 0's KV heads are split over 2 devices"):
                tx.send(request, tx.cache.init(admit=False), 0)
        assert "refused: the prefill slot cannot be sent: slot 0's KV heads" in str(
            outcome["error"]
        )
        assert rx.quarantined == {}  # Refused before any write.
        tx.endpoint.pools = head_pools(tx.cache, "KVSender")
    tx.cache.close()
    cache.close()


# -- the control channel, with a stand-in peer ---------------------------------------------------


@contextlib.contextmanager
def fake_prefill(reply):
    """A control socket that takes one request and answers ``reply`` (a dict); yields
    (its address, the request it got, once the block exits)."""
    server = socket.create_server(("127.0.0.1", 0))
    got: dict = {}

    def serve():
        server.settimeout(10)
        conn, _ = server.accept()
        with conn:
            got.update(pd_transfer.recv_message(conn, time.monotonic() + 10))
            pd_transfer.send_message(conn, reply, time.monotonic() + 10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1:{}".format(*server.getsockname()[1:2]), got
    finally:
        thread.join(10)
        server.close()


@pytest.mark.parametrize(
    "reply, match",
    [
        (
            {"version": 4, "ok": True, "nbytes": 5, "head_bytes": [5], "extra": None},
            (
                r"the prefill process reported 5 bytes written \(\[5\] per head range\), "
                r"expected 5120 \(\[5120\]\)"
            ),
        ),
        (
            {"version": 4, "ok": True, "nbytes": 5120, "head_bytes": [4000, 1120], "extra": None},
            r"reported 5120 bytes written \(\[4000, 1120\] per head range\), expected 5120",
        ),
        ({"version": 1, "ok": True}, "the prefill process answered in another protocol"),
        # A version-3 peer (no checksum) is refused as another protocol.
        (
            {"version": 3, "ok": True, "nbytes": 5120, "head_bytes": [5120], "extra": None},
            "the prefill process answered in another protocol",
        ),
    ],
)
def test_a_reply_that_does_not_add_up_is_a_refusal_with_the_blocks_held(reply, match):
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with KVReceiver(
        cache, quarantine_s=60.0, transfer_engine=FakeEngine(), session="decode:1"
    ) as rx:
        free = cache.free_blocks
        with fake_prefill(reply) as (address, request), pytest.raises(PDTransferError, match=match):
            rx.receive(state, 0, np.arange(N), prefill=address)
        assert request["start"] == 0 and [s["heads"] for s in request["shards"]] == [[0, 2]]
        assert cache.free_blocks == free - 3 and list(rx.quarantined) == [0]
        rx.clock = lambda: time.monotonic() + 60.0
        assert rx.reclaim() == [0] and cache.free_blocks == free
    cache.close(state)


# The completion message of a transfer of N tokens (5,120 bytes into one head range) whose
# count adds up; its checksum is what each case sets.
EXACT = {"version": 4, "ok": True, "nbytes": 5120, "head_bytes": [5120], "extra": None}
# The xxh3-64 of the bytes a fresh decode pool holds where they land: 5,120 zeros.
ZEROS = xxhash.xxh3_64_intdigest(bytes(5120))


@pytest.mark.parametrize(
    "checksums, match",
    [
        (
            None,
            r"the completion message has no xxh3_64 checksum per head range of the bytes "
            r"written \(16 hex digits each, 1 of them\): got None",
        ),
        ([f"{ZEROS:016x}"] * 2, r"16 hex digits each, 1 of them\): got \['"),
        ([f"{ZEROS:016x}"[1:]], r"16 hex digits each, 1 of them\): got \['"),
        ([ZEROS], r"16 hex digits each, 1 of them\): got \[\d+\]"),
        (["z" * 16], r"the completion message's xxh3_64 checksums are not hex: \['zzzz"),
        (
            [f"{ZEROS ^ 1:016x}"],  # One bit off the bytes that are there.
            rf"the bytes received for heads \[0, 2\] do not match the xxh3_64 checksum the "
            rf"prefill process sent \({ZEROS:016x} here, {ZEROS ^ 1:016x} sent\): the byte "
            rf"count adds up, but these are not the bytes it wrote",
        ),
    ],
)
def test_a_reply_whose_checksum_does_not_match_is_a_refusal_with_the_blocks_held(
    checksums, match
):
    reply = {**EXACT, **({} if checksums is None else {"head_xxh3_64": checksums})}
    test_a_reply_that_does_not_add_up_is_a_refusal_with_the_blocks_held(reply, match)


def test_a_reply_whose_checksum_is_the_bytes_that_landed_is_admitted():
    """The edge of the check: the exact count and the exact checksum of the bytes in the
    slot's blocks (a fresh pool's zeros) admit; one bit off is refused (above)."""
    cache = pd_peers.make_cache()
    state = cache.init(admit=False)
    with KVReceiver(
        cache, quarantine_s=60.0, transfer_engine=FakeEngine(), session="decode:1"
    ) as rx:
        with fake_prefill({**EXACT, "head_xxh3_64": [f"{ZEROS:016x}"]}) as (address, _):
            state, got = rx.receive(state, 0, np.arange(N), prefill=address)
        assert (got.length, got.nbytes, got.head_bytes) == (N, 5120, (5120,))
        assert int(np.asarray(state.lengths)[0]) == N and rx.quarantined == {}
        assert 0 <= got.checksum_s <= got.seconds
    cache.close(state)


def flip_first_byte_after_writing():
    """A move that copies, and at every later write sets the first byte it wrote to the
    complement of its source byte: one byte of the slot flipped in place after it was
    written, before the completion message."""
    first: list = []

    def move(src, dst, size):
        ctypes.memmove(dst, src, size)
        if not first:
            first.append((src, dst))
        elif first[0][1] != dst:
            s, d = first[0]
            ctypes.memset(d, ~ctypes.c_uint8.from_address(s).value & 0xFF, 1)

    return move


@pytest.mark.parametrize(
    "fault",
    ["wrote nothing", "wrote other bytes", "flipped one byte after writing"],
)
def test_a_peer_that_reports_the_count_but_not_the_bytes_is_refused_naming_the_checksum(fault):
    """The prefill side reports the exact byte count and the checksum of the rows it read,
    but the decode pool does not hold them: refused before the admission, naming the
    checksum; the slot stays unadmitted and free, and the next transfer into it is
    admitted byte for byte."""
    move = {
        "wrote nothing": lambda src, dst, size: None,
        "wrote other bytes": lambda src, dst, size: ctypes.memset(dst, 0xA5, size),
        "flipped one byte after writing": flip_first_byte_after_writing(),
    }[fault]
    engine = FakeEngine(move=move)
    with fake_pair(engine) as (rx_cache, rx, tx, tx_state):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            tx_state, sent = tx.send(tx.accept(timeout=10), tx_state, 0)
        assert sent.nbytes == 2 * pd_peers.MODEL["layers"] * N * 64
        assert len(sent.checksums) == 1 and len(sent.checksums[0]) == 16
        error = outcome["error"]
        assert isinstance(error, PDTransferError), outcome
        assert re.search(
            r"P/D transfer of 20 tokens into slot 0 from .* failed, the slot was left "
            r"unadmitted: the bytes received for heads \[0, 2\] do not match the xxh3_64 "
            rf"checksum the prefill process sent \([0-9a-f]{{16}} here, {sent.checksums[0]} "
            r"sent\)",
            str(error),
        ), str(error)
        assert int(rx_cache.capacity[0]) == 0 and rx_cache.free_blocks == free
        assert (rx.received, rx.failed) == (0, 1)

        engine.move = copy_bytes
        with receiving(rx, state, tx.address) as outcome:
            tx_state, again = tx.send(tx.accept(timeout=10), tx_state, 0)
        state, got = outcome["result"]
        assert again.checksums == sent.checksums  # The same rows, the same checksum.
        assert (got.slot, got.length, got.nbytes) == (0, N, sent.nbytes)
        for layer in range(pd_peers.MODEL["layers"]):
            for have, want in zip(rx_cache.read(state, layer, 0), pd_peers.rows(layer, N)):
                np.testing.assert_array_equal(
                    np.asarray(have).view(np.uint16), np.asarray(want).view(np.uint16)
                )
        state = rx_cache.release(state, 0)


def _request(**changes):
    layout = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_split": [[0, 2]],
        "head_dim": 16,
        "dtype": "bfloat16",
        "tier_dtype": None,
        "block_tokens": 8,
        "row_bytes": 64,
    }
    runs = [[[4096, 128]] for _ in range(4)]
    message = {
        "version": 4,
        "op": "prefill",
        "tokens": pd_transfer.encode_tokens(np.array([1, 2])),
        "start": 0,
        "session": "decode:1",
        "layout": layout,
        "shards": [{"heads": [0, 2], "runs": runs}],
    }
    message.update(changes)
    return message


@pytest.mark.parametrize(
    "message, match",
    [
        (_request(version=3), "not a version-4 P/D request"),
        (
            _request(layout={"num_layers": 2}),
            r"layout differs: block_tokens 8 here, None there; dtype",
        ),
        (_request(layout=[1]), r"layout differs: the layout is \[1\], not a dict"),
        (_request(tokens=""), "tokens must be base64 of little-endian int64 ids, at least one"),
        (_request(tokens=[1, 2]), "tokens must be base64 of little-endian int64 ids"),
        (_request(tokens="AAAA"), "tokens must be base64 of little-endian int64 ids"),  # 3 bytes
        (_request(tokens="not base64!"), "tokens must be base64 of little-endian int64 ids"),
        (_request(start=2), r"start=2 must be in \[0, 2\)"),
        (_request(shards=[]), r"shards must be one per head range \[\[0, 2\]\], in order"),
        (
            _request(shards=[{"heads": [0, 2], "runs": [[[4096, 64]]] * 4}]),
            r"the runs of heads \[0, 2\] must be 4 lists of \[address, bytes\] covering 128",
        ),
        (_request(session=""), "session must be a non-empty string"),
    ],
)
def test_a_malformed_request_is_refused_before_any_write(message, match):
    cache = pd_peers.make_cache(batch=1)
    with (
        KVSender(cache, transfer_engine=FakeEngine(), session="prefill:1") as tx,
        socket.create_connection(tx.address.split(":")) as conn,
    ):
        pd_transfer.send_message(conn, message, time.monotonic() + 10)
        with pytest.raises(PDTransferError, match="refused a P/D request from .*: " + match):
            tx.accept(timeout=10)
        reply = pd_transfer.recv_message(conn, time.monotonic() + 10)
    assert reply["ok"] is False and reply["writes_submitted"] is False
    cache.close()


@needs_two_devices
def test_a_mesh_failure_after_writes_holds_each_head_shards_blocks():
    decode = pd_peers.make_mesh_cache(jax.devices()[:2])
    prefill = pd_peers.make_mesh_cache(jax.devices()[2:4], batch=2)
    tx_state = prefill.init(admit=False)
    tx_state, _ = prefill.admit(tx_state, 0, max_tokens=N)
    for layer in range(pd_peers.MODEL["layers"]):
        tx_state = prefill.load(tx_state, layer, *pd_peers.rows(layer, N), slot=0)
    engine = FakeEngine(status=lambda rid: -1)
    with (
        KVReceiver(decode, quarantine_s=60.0, transfer_engine=engine, session="decode:1") as rx,
        KVSender(prefill, transfer_engine=engine, session="prefill:1") as tx,
    ):
        free = {s: c.free_blocks for s, c in decode.shards.items()}
        state = decode.init(admit=False)
        with receiving(rx, state, tx.address, slot=1) as outcome:
            with pytest.raises(PDTransferError, match="writes to decode:1 failed"):
                tx.send(tx.accept(timeout=10), tx_state, 0)
        assert "held aside for 60 s" in str(outcome["error"])
        assert int(decode.capacity[1]) == 0 and list(rx.quarantined) == [1]
        assert {s: c.free_blocks for s, c in decode.shards.items()} == {
            s: n - 3 for s, n in free.items()
        }
        rx.clock = lambda: time.monotonic() + 60.0
        assert rx.reclaim() == [1]
        assert {s: c.free_blocks for s, c in decode.shards.items()} == free
    prefill.close(tx_state)
    decode.close(state)


@needs_two_devices
def test_a_head_range_is_never_written_into_another_ones_pool():
    """The sender pairs each of its head shards with the decode pool of the same heads;
    pools listed out of order are refused, not written crosswise."""
    decode = pd_peers.make_mesh_cache(jax.devices()[:2])
    prefill = pd_peers.make_mesh_cache(jax.devices()[2:4])
    tx_state = prefill.init(admit=False)
    tx_state, _ = prefill.admit(tx_state, 0, max_tokens=N)
    for layer in range(pd_peers.MODEL["layers"]):
        tx_state = prefill.load(tx_state, layer, *pd_peers.rows(layer, N), slot=0)
    engine = FakeEngine()
    with (
        KVReceiver(decode, quarantine_s=0.0, transfer_engine=engine, session="decode:1") as rx,
        KVSender(prefill, transfer_engine=engine, session="prefill:1") as tx,
    ):
        state = decode.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            tx.endpoint.pools = tx.endpoint.pools[::-1]
            with pytest.raises(
                PDTransferError, match=r"heads \[0, 1\] sent to the pool of heads \(1, 2\)"
            ):
                tx.send(request, tx_state, 0)
            tx.endpoint.pools = tx.endpoint.pools[::-1]
        assert "heads [0, 1] sent to the pool of heads (1, 2)" in str(outcome["error"])
        assert engine.submitted == []
    prefill.close(tx_state)
    decode.close(state)


def test_the_quarantine_holds_only_the_blocks_the_request_named():
    """A prompt whose first 2 blocks the decode cache's prefix index holds: the request
    names positions [16, 20), one block; only it is held (the prefix stays indexed, the
    rest of the slot's capacity is freed)."""
    engine = FakeEngine(status=lambda rid: -1)
    with fake_pair(engine, quarantine_s=60.0) as (rx_cache, rx, tx, tx_state):
        state = rx_cache.init(admit=False)
        state, _ = rx_cache.admit(state, 1, tokens=np.arange(16))
        for layer in range(pd_peers.MODEL["layers"]):
            state = rx_cache.load(state, layer, *pd_peers.rows(layer, 16), slot=1)
        state = rx_cache.release(state, 1, tokens=np.arange(16))
        free = rx_cache.free_blocks
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            assert request.start == 16
            with pytest.raises(PDTransferError, match="writes to decode:1 failed"):
                tx.send(request, tx_state, 0)
        assert "held aside" in str(outcome["error"])
        assert rx_cache.free_blocks == free - 1
        rx.clock = lambda: time.monotonic() + 60.0
        assert rx.reclaim() == [0] and rx_cache.free_blocks == free
        # The prefix is still indexed: a new admission maps it.
        state, cached = rx_cache.admit(state, 0, tokens=np.arange(N))
        assert cached == 16


def test_a_prefill_slot_shorter_than_the_request_is_refused_and_the_decode_side_told():
    with fake_pair(FakeEngine(), quarantine_s=60.0) as (rx_cache, rx, tx, tx_state):
        free = rx_cache.free_blocks
        state = rx_cache.init(admit=False)
        with receiving(rx, state, tx.address) as outcome:
            request = tx.accept(timeout=10)
            short = tx_state.replace(lengths=tx_state.lengths - 1)  # 19 tokens in slot 0.
            with pytest.raises(ValueError, match=r"slot 0 holds 19 tokens; the request needs 20"):
                tx.send(request, short, 0)
        assert "refused: the prefill slot holds 19 tokens, not 20" in str(outcome["error"])
        assert rx.quarantined == {} and rx_cache.free_blocks == free


@pytest.mark.parametrize("role", [KVReceiver, KVSender])
def test_a_cache_of_another_kind_is_refused(role):
    with pytest.raises(TypeError, match=r"needs an OffloadedKVCache, a ShardedKVCache or a HostPoolKVCache; got dict"):
        role({}, transfer_engine=FakeEngine(), session="d:1")


@pytest.mark.slow
def test_one_transfer_engine_serves_the_store_level_and_pd(mooncake_master):
    """A decode process with one TransferEngine: P/D writes into its pool, its remote prefix
    level publishes the received prompt and later reads it back into the same pool; the
    pool is registered with the engine once, counted per holder."""
    from mooncake.engine import TransferEngine

    from jax_tpusync.mooncake import transfer_memory
    from jax_tpusync.mooncake.level import MooncakeStoreLevel

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    level = functools.partial(
        MooncakeStoreLevel,
        mooncake_master.address,
        transfer_engine=engine,
        segment_bytes=16 << 20,
        namespace="pd-shared-engine",
    )
    cfg, params = pd_peers.model()
    step = decode_step(cfg)
    prompt = np.random.default_rng(5).integers(0, cfg.vocab, 29)  # 3 full blocks.
    cache = pd_peers.make_cache(remote_prefix=level)
    pool = cache.store.memory.ctypes.data
    state = cache.init(admit=False)
    with (
        peer(pd_peers.serve_prefill) as (proc, queue),
        KVReceiver(cache, transfer_engine=engine, session=session, deadline_s=60) as rx,
    ):
        assert transfer_memory.registrations(engine, pool) == 1  # The receiver's.
        address = queue.get(timeout=TIMEOUT)
        state, got = rx.receive(state, 1, prompt, prefill=address)
        queue.get(timeout=TIMEOUT)
        proc.join(TIMEOUT)
        want, state = one_token(step, params, cache, state, 1, got.extra["first_token"])
        held = np.append(prompt, got.extra["first_token"])  # The prompt and the first token.
        state = cache.release(state, 1, tokens=held)  # Publishes 3 blocks: connects.
        assert cache.prefix_stats["mooncake_published"] == 3
        assert transfer_memory.registrations(engine, pool) == 2  # And the level's.
    assert transfer_memory.registrations(engine, pool) == 1
    p = cache.slots.prefix
    p.evict(p.cached_blocks)  # Only the store has the prompt now.
    state, cached = cache.admit(state, 1, tokens=prompt)
    assert cached == 24 and cache.prefix_stats["mooncake_imported"] == 3
    # The rest of the prompt on top of the imported blocks, then the same first step.
    ids = np.zeros((cache.batch, 29 - 24), np.int32)
    ids[1] = prompt[24:]
    logits, state = step(params, jnp.asarray(ids), state)
    assert int(np.argmax(np.asarray(logits)[1])) == got.extra["first_token"]
    again, state = one_token(step, params, cache, state, 1, got.extra["first_token"])
    np.testing.assert_array_equal(again, want)
    cache.close(state)
