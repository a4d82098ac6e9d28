"""P/D transfer with host-pool caches (the TPU data path) on either side, over one real
Mooncake TransferEngine in this process: the rows arrive byte for byte through the staging
buffers, a host-pool decode after a transfer equals a local prefill, and a failure after the
request went out frees the slot at once and sets the staging buffer aside, not the slot's
blocks."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.bench import tiny_decoder
from jax_tpusync.pd.channel import start_engine
from jax_tpusync.pd.pool_staging import MIN_STAGING_TOKENS
from jax_tpusync.pd.transfer import KVReceiver, KVSender, PDTransferError

from support import pd_peers

# Skipped without the Mooncake client, failed instead where TPUSYNC_REQUIRE_MOONCAKE=1
# (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("mooncake_usable")

N = 21  # Tokens of the transfers: two whole blocks of 8 and a part of a third.
JOIN_S = 60


@pytest.fixture(scope="module")
def engine():
    """One real TransferEngine for both roles (it writes to its own session)."""
    engine, session = start_engine("127.0.0.1", 30.0)
    return engine, session


def pool_cache(batch=2, **overrides):
    return tps.HostPoolKVCache(**{**pd_peers.cache_args(batch), **overrides})


def rows_of(layer, n, dtype=jnp.bfloat16):
    k, v = pd_peers.rows(layer, n)
    return np.asarray(k).astype(dtype), np.asarray(v).astype(dtype)


def filled(cache, n=N, slot=0, tokens=None):
    """A state of ``cache`` whose ``slot`` holds ``n`` known rows in every layer."""
    state = cache.init(admit=False)
    state, _ = cache.admit(state, slot, max_tokens=n, tokens=tokens)
    for layer in range(cache.spec.num_layers):
        state = cache.load(state, layer, *rows_of(layer, n, cache.spec.dtype), slot=slot)
    return state


@contextlib.contextmanager
def receiving(rx, state, address, slot=0, tokens=None):
    """``rx.receive`` on a thread; yields a dict holding its "result" or "error" once the
    block exits (joined, bounded)."""
    outcome: dict = {}

    def run():
        try:
            ids = np.arange(N) if tokens is None else tokens
            outcome["result"] = rx.receive(state, slot, ids, prefill=address)
        except Exception as e:  # noqa: BLE001 - checked by the test.
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield outcome
    finally:
        thread.join(JOIN_S)
        assert not thread.is_alive()


def transfer(engine, tx_cache, tx_state, rx_cache, rx_state, *, slot=1, tokens=None, **rx_kw):
    """One transfer of slot 0 of ``tx_state`` into ``slot`` of ``rx_state``: (rx state,
    Received, Sent)."""
    e, session = engine
    with (
        KVReceiver(rx_cache, transfer_engine=e, session=session, **rx_kw) as rx,
        KVSender(tx_cache, transfer_engine=e, session=session) as tx,
        receiving(rx, rx_state, tx.address, slot=slot, tokens=tokens) as outcome,
    ):
        request = tx.accept(timeout=JOIN_S)
        tx_state, sent = tx.send(request, tx_state, 0)
    if "error" in outcome:
        raise outcome["error"]
    rx_state, got = outcome["result"]
    return rx_state, got, sent, tx_state


def stored(cache, state, slot, n):
    """Every layer's K and V rows of ``slot`` as stored, whichever cache kind: bytes of
    [n, heads * head_dim] values, or a quantized tier's codes and scales."""
    raw = cache.spec.tier_dtype is not None
    out = []
    for layer in range(cache.spec.num_layers):
        k, v = cache.read(state, layer, slot, 0, n, raw=raw)
        if raw:
            out.append(tuple(tuple(np.asarray(p) for p in x) for x in (k, v)))
        else:
            out.append(tuple(np.asarray(x).view(np.uint8).reshape(n, -1) for x in (k, v)))
    return out


def assert_same_rows(a, b):
    for (k, v), (wk, wv) in zip(a, b):
        for got, want in ((k, wk), (v, wv)):
            if isinstance(got, tuple):  # Codes and scales.
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w)
            else:
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "sender,receiver",
    [("engine", "pool"), ("pool", "engine"), ("pool", "pool")],
)
def test_rows_arrive_byte_for_byte_through_the_staging_buffers(engine, sender, receiver):
    make = {"engine": pd_peers.make_cache, "pool": pool_cache}
    tx_cache, rx_cache = make[sender](batch=1), make[receiver](batch=2)
    tx_state = filled(tx_cache)
    rx_state = rx_cache.init(admit=False)
    rx_state, got, sent, tx_state = transfer(engine, tx_cache, tx_state, rx_cache, rx_state)
    row_bytes = pd_peers.cache_args(1)["num_kv_heads"] * pd_peers.MODEL["head_dim"] * 2
    assert got.nbytes == sent.nbytes == 2 * pd_peers.MODEL["layers"] * N * row_bytes
    assert (
        int(np.asarray(rx_cache.lengths(rx_state) if receiver == "pool" else rx_state.lengths)[1])
        == N
    )
    assert_same_rows(stored(rx_cache, rx_state, 1, N), stored(tx_cache, tx_state, 0, N))
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


def test_quantized_pools_exchange_codes_and_scales_as_they_are(engine):
    tx_cache = pd_peers.make_cache(batch=1, tier_dtype="int8")
    rx_cache = pool_cache(tier_dtype="int8")
    tx_state = filled(tx_cache)
    rx_state, got, _, tx_state = transfer(
        engine, tx_cache, tx_state, rx_cache, rx_cache.init(admit=False)
    )
    assert got.nbytes == 2 * pd_peers.MODEL["layers"] * N * rx_cache.spec.row_bytes
    assert_same_rows(stored(rx_cache, rx_state, 1, N), stored(tx_cache, tx_state, 0, N))
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


@pytest.mark.slow
def test_a_host_pool_decode_after_transfer_equals_a_local_prefill(engine):
    cfg, params = pd_peers.model()
    step = jax.jit(functools.partial(tiny_decoder.forward, cfg), donate_argnums=(2,))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, 29)

    def first_and_next(cache, state, slot):
        ids = np.zeros((cache.batch, 1), np.int32)
        ids[slot] = first
        logits, state = step(params, jnp.asarray(ids), state)
        return np.asarray(logits)[slot], state

    local = pool_cache()
    state = local.init(admit=False)
    state, first = pd_peers.prefill_tokens(step, params, local, state, 1, prompt)
    want, state = first_and_next(local, state, 1)
    local.close(state)

    tx_cache = pool_cache()  # The local cache's shape: its compiled prefill is reused.
    tx_state = tx_cache.init(admit=False)
    tx_state, sent_first = pd_peers.prefill_tokens(step, params, tx_cache, tx_state, 0, prompt)
    assert sent_first == first
    rx_cache = pool_cache()
    rx_state, got, _, tx_state = transfer(
        engine, tx_cache, tx_state, rx_cache, rx_cache.init(admit=False), tokens=prompt
    )
    assert got.length == len(prompt) and got.cached == 0
    logits, rx_state = first_and_next(rx_cache, rx_state, 1)
    np.testing.assert_array_equal(logits, want)
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


def test_a_prefix_the_decode_pool_holds_is_not_sent(engine):
    """The decode pool's index holds the first two blocks of the prompt: the request
    starts at 16, and the slot reads the prefix's rows and the received ones."""
    tokens = np.arange(N)
    rx_cache = pool_cache()
    rx_state = filled(rx_cache, n=N, slot=0, tokens=tokens)
    rx_state = rx_cache.release(rx_state, 0, tokens=tokens)
    tx_cache = pd_peers.make_cache(batch=1)
    tx_state = filled(tx_cache)
    rx_state, got, sent, tx_state = transfer(
        engine, tx_cache, tx_state, rx_cache, rx_state, tokens=tokens
    )
    assert got.cached == 16 and sent.nbytes == got.nbytes
    assert got.nbytes == 2 * pd_peers.MODEL["layers"] * (N - 16) * rx_cache.spec.row_bytes
    assert_same_rows(stored(rx_cache, rx_state, 1, N), stored(tx_cache, tx_state, 0, N))
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


def test_a_receive_into_a_full_pool_demotes_its_cached_blocks_to_the_spill_tier(
    engine, tmp_path
):
    """The receiving pool's 9 blocks: 2 cached, 7 free; the slot's 8 make the least
    recently used cached block go to the spill tier (the receive reserves in the state
    it admits into), not away."""
    other = np.arange(100, 100 + N)
    rx_cache = pool_cache(num_blocks=9, spill_path=str(tmp_path), spill_blocks=4)
    rx_state = filled(rx_cache, n=N, slot=0, tokens=other)
    rx_state = rx_cache.release(rx_state, 0, tokens=other)
    tx_cache = pd_peers.make_cache(batch=1)
    tx_state = filled(tx_cache)
    rx_state, got, _, tx_state = transfer(engine, tx_cache, tx_state, rx_cache, rx_state)
    stats = rx_cache.prefix_stats
    assert (stats["demoted"], stats["evictions"], got.cached) == (1, 0, 0), stats
    assert_same_rows(stored(rx_cache, rx_state, 1, N), stored(tx_cache, tx_state, 0, N))
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


def test_a_failure_after_the_request_frees_the_slot_and_sets_the_buffer_aside(engine):
    """The sender refuses after the request went out (its slot is too short): the decode
    slot is free at once (no write can land in its blocks), the staging buffer is held
    for exactly the quarantine and the next receive maps another one."""
    e, session = engine
    now = [100.0]
    rx_cache = pool_cache()
    tx_cache = pd_peers.make_cache(batch=1)
    tx_state = filled(tx_cache, n=N - 1)
    rx_state = rx_cache.init(admit=False)
    free = rx_cache.slots.free_blocks
    with (
        KVReceiver(
            rx_cache, transfer_engine=e, session=session, quarantine_s=5.0, clock=lambda: now[0]
        ) as rx,
        KVSender(tx_cache, transfer_engine=e, session=session) as tx,
    ):
        with receiving(rx, rx_state, tx.address, slot=1) as outcome:
            request = tx.accept(timeout=JOIN_S)
            request.writes_submitted = None  # Not known to be none: the decode side holds.
            with pytest.raises(ValueError, match=r"slot 0 holds 20 tokens; the request needs 21"):
                tx.send(request, tx_state, 0)
        assert isinstance(outcome["error"], PDTransferError)
        assert "the staging buffer set aside for 5 s" in str(outcome["error"])
        assert rx.quarantined == {} and rx_cache.slots.free_blocks == free
        assert rx.staging.retired == [105.0] and rx.staging.tokens == 0
        now[0] = 104.999
        rx.reclaim()
        assert rx.staging.retired == [105.0]
        now[0] = 105.0
        rx.reclaim()
        assert rx.staging.retired == []
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


class FaultyWrites:
    """The real engine, whose writes the prefill side makes go wrong (``fault``): "wrote
    nothing" (every write acknowledged, no byte moved), or "flipped one byte after writing"
    (every write made, and at each one after the first, one more real write puts a byte
    that differs from it over the first byte written: one byte of the slot changed in place
    after it landed, before the completion message)."""

    def __init__(self, engine, fault):
        self.engine, self.fault = engine, fault
        self.first = None  # (source, destination) of the first write.

    def register_memory(self, address, nbytes):
        return self.engine.register_memory(address, nbytes)

    def unregister_memory(self, address):
        return self.engine.unregister_memory(address)

    def transfer_sync_write(self, session, src, dst, size):
        return 0 if self.fault == "wrote nothing" else self._write(session, src, dst, size)

    def transfer_submit_write(self, session, src, dst, size):
        if self.fault == "wrote nothing":
            return 1
        assert self._write(session, src, dst, size) == 0
        return 1

    def transfer_check_status(self, rid):
        return 1

    def _write(self, session, src, dst, size):
        rc = self.engine.transfer_sync_write(session, src, dst, size)
        if self.first is None:
            self.first = (src, dst)
        elif self.first[1] != dst:
            s, d = self.first
            first = ctypes.c_uint8.from_address(s).value
            # A source byte that differs from the first one (the rows differ in every byte).
            other = next(
                a for a in range(s, s + 64) if ctypes.c_uint8.from_address(a).value != first
            )
            rc |= self.engine.transfer_sync_write(session, other, d, 1)
        return rc


@pytest.mark.parametrize("fault", ["wrote nothing", "flipped one byte after writing"])
@pytest.mark.parametrize("receiver", ["pool", "engine"])
def test_bytes_that_are_not_the_senders_are_refused_naming_the_checksum(engine, receiver, fault):
    """Over the real engine: the prefill side reports the exact count, and the checksum of
    the rows it read, but what landed (in the staging buffer, or the slot's blocks) is not
    them: refused before the admission, naming the checksum; the slot stays free."""
    e, session = engine
    make = {"engine": pd_peers.make_cache, "pool": pool_cache}
    rx_cache, tx_cache = make[receiver](batch=2), pool_cache(batch=1)
    tx_state = filled(tx_cache)
    rx_state = rx_cache.init(admit=False)
    free = rx_cache.slots.free_blocks
    with (
        KVReceiver(rx_cache, transfer_engine=e, session=session, quarantine_s=0.0) as rx,
        KVSender(tx_cache, transfer_engine=FaultyWrites(e, fault), session=session) as tx,
    ):
        with receiving(rx, rx_state, tx.address, slot=1) as outcome:
            tx_state, sent = tx.send(tx.accept(timeout=JOIN_S), tx_state, 0)
        error = outcome.get("error")
        assert isinstance(error, PDTransferError), outcome
        assert re.search(
            r"into slot 1 from .* the slot was left unadmitted: the bytes received for heads "
            rf"\[0, 2\] do not match the xxh3_64 checksum the prefill process sent "
            rf"\([0-9a-f]{{16}} here, {sent.checksums[0]} sent\)",
            str(error),
        ), str(error)
        assert int(np.asarray(rx_cache.capacity)[1]) == 0 and rx_cache.slots.free_blocks == free
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)


def test_the_staging_buffer_grows_to_a_longer_sequence():
    cache = pool_cache(max_len=4096)
    engine = _CountingEngine()
    rx = KVReceiver(cache, transfer_engine=engine, session="d:1")
    runs = rx.staging.head_runs(10)
    assert rx.staging.tokens == MIN_STAGING_TOKENS
    assert [len(region) for region in runs[0]["runs"]] == [1] * 4
    assert all(r[0][1] == 10 * cache.spec.row_bytes for r in runs[0]["runs"])
    first = rx.staging.head_runs(MIN_STAGING_TOKENS)[0]["runs"][0][0][0]
    assert rx.staging.tokens == MIN_STAGING_TOKENS
    grown = rx.staging.head_runs(MIN_STAGING_TOKENS + 1)[0]["runs"][0][0][0]
    assert rx.staging.tokens == 2 * MIN_STAGING_TOKENS and grown != first
    assert list(engine.registered) == [grown]  # The old one is unregistered.
    rx.close()
    assert engine.registered == {}
    cache.close()


class _CountingEngine:
    def __init__(self, rc=0):
        self.rc, self.registered = rc, {}

    def register_memory(self, address, nbytes):
        if self.rc == 0:
            self.registered[address] = nbytes
        return self.rc

    def unregister_memory(self, address):
        del self.registered[address]
        return 0


def test_a_staging_buffer_the_engine_refuses_fails_the_receive_and_frees_the_slot():
    cache = pool_cache()
    state = cache.init(admit=False)
    free = cache.slots.free_blocks
    rx = KVReceiver(cache, transfer_engine=_CountingEngine(rc=-1), session="d:1")
    with pytest.raises(
        PDTransferError,
        match=r"registering a staging buffer of \d+ bytes with the "
        r"TransferEngine returned -1",
    ):
        rx.receive(state, 1, np.arange(N), prefill="127.0.0.1:1")
    assert cache.slots.free_blocks == free and rx.staging.retired == []
    rx.close()
    cache.close(state)


def test_a_ring_pool_and_engine_runs_of_a_pool_are_refused():
    cache = pool_cache()
    rx = KVReceiver(cache, transfer_engine=_CountingEngine(), session="d:1")
    with pytest.raises(ValueError, match=r"receives through a staging buffer.*no runs"):
        rx.destination_runs(0, 0, 8)
    with pytest.raises(ValueError, match=r"receives through a staging buffer.*no runs"):
        rx.head_runs(0, 0, 8)
    rx.close()
    cache.close()


@pytest.mark.parametrize("slot", [-1, 2, 1.0])
def test_a_bad_slot_is_refused_before_anything_changes(slot):
    cache = pool_cache()
    state = cache.init(admit=False)
    rx = KVReceiver(cache, transfer_engine=_CountingEngine(), session="d:1")
    with pytest.raises(ValueError, match=r"must be an int in \[0, batch=2\)"):
        rx.receive(state, slot, np.arange(N), prefill="127.0.0.1:1")
    assert rx.staging.tokens == 0
    rx.close()
    cache.close(state)


def test_a_state_the_cache_refuses_is_refused_before_anything_changes():
    cache = pool_cache()
    state = cache.init(admit=False)
    rx = KVReceiver(cache, transfer_engine=_CountingEngine(), session="d:1")
    with pytest.raises(TypeError, match="expected a PoolState, got str"):
        rx.receive("not a state", 0, np.arange(N), prefill="127.0.0.1:1")
    np.testing.assert_array_equal(cache.capacity, [0, 0])  # Nothing reserved.
    assert rx.staging.tokens == 0 and rx.failed == 0
    rx.close()
    cache.close(state)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_a_mesh_pool_receives_each_head_range_from_a_mesh_engine_cache(engine):
    from jax.sharding import Mesh

    devices = jax.devices()[:2]
    rx_cache = tps.HostPoolKVCache(
        **pd_peers.cache_args(2),
        mesh=Mesh(np.asarray(devices), ("model",)),
        kv_heads_axis="model",
    )
    tx_cache = pd_peers.make_mesh_cache(jax.devices()[:2], batch=2)
    tx_state = tx_cache.init(admit=False)
    tx_state, _ = tx_cache.admit(tx_state, 0, max_tokens=N)
    for layer in range(pd_peers.MODEL["layers"]):
        tx_state = tx_cache.load(tx_state, layer, *pd_peers.rows(layer, N), slot=0)
    rx_state, got, sent, tx_state = transfer(
        engine, tx_cache, tx_state, rx_cache, rx_cache.init(admit=False)
    )
    share = 2 * pd_peers.MODEL["layers"] * N * rx_cache.spec.row_bytes
    assert got.head_bytes == sent.head_bytes == (share, share)
    for layer in range(pd_peers.MODEL["layers"]):
        k, v = rx_cache.read(rx_state, layer, 1)
        want_k, want_v = pd_peers.rows(layer, N)
        np.testing.assert_array_equal(
            np.asarray(k).view(np.uint16), np.asarray(want_k).view(np.uint16)
        )
        np.testing.assert_array_equal(
            np.asarray(v).view(np.uint16), np.asarray(want_v).view(np.uint16)
        )
    tx_cache.close(tx_state)
    rx_cache.close(rx_state)
