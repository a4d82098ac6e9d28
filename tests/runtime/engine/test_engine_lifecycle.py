"""Cancel, drain and shutdown with transfers in flight: no hang, no crash, no lost write."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from jax_tpusync import TpusyncError
from jax_tpusync.runtime.engine import Engine

HANG_GUARD_S = 20.0


def _run_with_guard(fn, timeout=HANG_GUARD_S):
    """Runs fn in a thread; fails (rather than hanging the suite) if it does not return."""
    errors = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread.
            errors.append(e)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"{fn} still running after {timeout} s"
    if errors:
        raise errors[0]


def test_cancel_queued_transfer(make_engine):
    e = make_engine(num_workers=1, debug_delay_us=150_000)
    t = e.add_host_tier(block_bytes=4096, num_blocks=4)
    e.write(t, 0, np.full(4096, 7, np.uint8))
    running = e.submit_read(t, [(0, 0, 4096)], np.zeros(4096, np.uint8))
    out = np.zeros(4096, np.uint8)
    queued = e.submit_read(t, [(0, 0, 4096)], out)
    e.cancel(queued)
    assert e.poll(queued)  # Cancelled before it started: it has ended.
    with pytest.raises(TpusyncError, match="tpusync: transfer cancelled before it started"):
        e.wait(queued)
    assert not out.any()  # It never ran.
    with pytest.raises(TpusyncError, match="unknown ticket"):
        e.wait(queued)  # Consumed by the failed wait.
    e.wait(running)
    # A cancelled request is not counted as transferred.
    assert e.stats()["tiers"][t]["fetch"]["requests"] == 1


def test_cancel_queued_write_leaves_tier_untouched(make_engine, add_tier, tier_kind):
    e = make_engine(num_workers=1, debug_delay_us=100_000)
    t = add_tier(e, tier_kind, block_bytes=4096, num_blocks=4)
    e.write(t, 0, np.full(8192, 1, np.uint8))
    blocker = e.submit_write(t, [(8192, 0, 10)], np.zeros(10, np.uint8))
    w = e.submit_write(t, [(100, 0, 5000)], np.full(5000, 2, np.uint8))
    e.cancel(w)
    with pytest.raises(TpusyncError, match="cancelled"):
        e.wait(w)
    e.wait(blocker)
    np.testing.assert_array_equal(e.read(t, 0, np.zeros(8192, np.uint8)), 1)


@pytest.mark.parametrize("kind", ("host", "file_direct"))
def test_cancel_running_transfer_stops_early(make_engine, add_tier, kind):
    # 16 MiB paced at 40 MB/s would take ~0.4 s; cancelled after ~50 ms it stops at a chunk.
    e = make_engine(
        num_workers=1, io_chunk_bytes=64 * 1024, max_bytes_per_second=40e6, record_timeline=True
    )
    t = add_tier(e, kind, block_bytes=1 << 20, num_blocks=16)
    out = np.zeros(16 << 20, np.uint8)
    ticket = e.submit_read(t, [(3, 0, out.size - 3)], out)
    threading.Event().wait(0.05)
    assert not e.poll(ticket)
    e.cancel(ticket)
    with pytest.raises(TpusyncError, match="cancelled"):
        e.wait(ticket)
    (row,) = e.timeline().transfers
    assert row[0] == ticket and row[9] is False
    # It was running when cancelled, and stopped well before it could have finished.
    assert 0.03e9 < row[8] - row[7] < 0.3e9


def test_cancel_after_completion_is_harmless(make_engine):
    e = make_engine()
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    out = np.zeros(100, np.uint8)
    e.write(t, 0, np.full(100, 3, np.uint8))
    ticket = e.submit_read(t, [(0, 0, 100)], out)
    while not e.poll(ticket):
        pass
    e.cancel(ticket)
    e.wait(ticket)  # It had finished: the cancel changes nothing.
    np.testing.assert_array_equal(out, 3)


def test_poll_and_drain(make_engine):
    e = make_engine(num_workers=2, debug_delay_us=20_000)
    t = e.add_host_tier(block_bytes=4096, num_blocks=16)
    outs = [np.zeros(4096, np.uint8) for _ in range(8)]
    tickets = [e.submit_read(t, [(i * 4096, 0, 4096)], o) for i, o in enumerate(outs)]
    assert not all(e.poll(x) for x in tickets)
    e.drain()
    assert all(e.poll(x) for x in tickets)  # Tickets survive a drain...
    for x in tickets:
        e.wait(x)  # ...and are still consumed by their wait.
    e.drain()  # Nothing in flight: returns at once.


def test_close_with_many_slow_transfers_in_flight(file_dir):
    """Close cancels queued fetches, finishes queued write-backs, and returns promptly."""
    e = Engine(num_workers=2, debug_delay_us=30_000)
    t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=64, file_name="shutdown")
    writes = []
    for i in range(24):
        data = np.full(4096, i + 1, np.uint8)
        writes.append(e.submit_write(t, [(i * 4096 + 1, 0, 4096)], data))
    reads = [e.submit_read(t, [(i * 4096, 0, 4096)], np.zeros(4096, np.uint8)) for i in range(40)]
    _run_with_guard(e.close)
    assert e.closed
    for ticket in writes + reads:
        with pytest.raises(TpusyncError, match="closed"):
            e.wait(ticket)
    # Every queued write-back still reached the file.
    with Engine() as e2:
        t2 = e2.add_file_tier(file_dir, block_bytes=4096, num_blocks=64, file_name="shutdown")
        for i in range(24):
            out = e2.read(t2, i * 4096 + 1, np.zeros(4096, np.uint8))
            np.testing.assert_array_equal(out, i + 1)


def test_close_while_other_threads_wait(make_engine):
    """Waiters blocked in other threads wake up (done or cancelled) when the engine closes,
    and the engine outlives their calls."""
    for round_ in range(10):
        e = make_engine(num_workers=2, debug_delay_us=2_000)
        t = e.add_host_tier(block_bytes=4096, num_blocks=64)
        tickets = [
            e.submit_read(t, [(i * 4096, 0, 4096)], np.zeros(4096, np.uint8)) for i in range(12)
        ]
        results = []

        def waiter(ticket):
            try:
                e.wait(ticket)
                results.append("ok")
            except TpusyncError as err:
                results.append(str(err))

        threads = [threading.Thread(target=waiter, args=(x,), daemon=True) for x in tickets]
        for th in threads:
            th.start()
        _run_with_guard(e.close)
        for th in threads:
            th.join(HANG_GUARD_S)
            assert not th.is_alive()
        assert len(results) == len(tickets)
        for r in results:
            assert r == "ok" or "closed" in r, r


def test_close_while_draining(make_engine):
    e = make_engine(num_workers=1, debug_delay_us=20_000)
    t = e.add_host_tier(block_bytes=4096, num_blocks=8)
    for i in range(8):
        e.submit_write(t, [(i * 4096, 0, 10)], np.ones(10, np.uint8))
    drained = []
    th = threading.Thread(target=lambda: drained.append(e.drain()), daemon=True)
    th.start()
    _run_with_guard(e.close)
    th.join(HANG_GUARD_S)
    assert not th.is_alive() and drained == [None]


def test_garbage_collected_engine_shuts_down(file_dir):
    e = Engine(num_workers=2, debug_delay_us=10_000)
    t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=8)
    for i in range(8):
        e.submit_read(t, [(i * 4096, 0, 4096)], np.zeros(4096, np.uint8))
    engine_id = e.id

    def drop():
        nonlocal e
        del e
        gc.collect()

    _run_with_guard(drop)
    with Engine() as other:
        assert other.id != engine_id


def test_wait_with_timeout_then_close(make_engine):
    e = make_engine(num_workers=1, debug_delay_us=200_000)
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    ticket = e.submit_read(t, [(0, 0, 10)], np.zeros(10, np.uint8))
    with pytest.raises(TpusyncError, match="still running"):
        e.wait(ticket, timeout=0.001)
    _run_with_guard(e.close)
