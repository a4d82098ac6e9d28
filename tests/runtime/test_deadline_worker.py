"""The deadline worker: a call's value or error comes back; a call past its deadline is
refused and keeps the thread; calls meanwhile are refused at once, not queued."""

from __future__ import annotations

import threading
import time

import pytest

from jax_tpusync.runtime.deadline_worker import DeadlinePassed, DeadlineWorker


def test_values_and_errors_come_back():
    worker = DeadlineWorker("test")
    assert worker.call(lambda: 41 + 1, 1.0) == 42
    with pytest.raises(KeyError, match="nope"):
        worker.call(lambda: {}["nope"], 1.0)
    assert not worker.busy
    worker.stop()


def test_a_call_past_its_deadline_keeps_the_thread_and_later_calls_are_refused_at_once():
    worker = DeadlineWorker("test")
    release = threading.Event()
    begin = time.monotonic()
    with pytest.raises(DeadlinePassed, match="no answer within 0.2 s"):
        worker.call(lambda: release.wait(30), 0.2)
    assert 0.2 <= time.monotonic() - begin < 2.0
    assert worker.busy
    begin = time.monotonic()
    with pytest.raises(DeadlinePassed, match="an earlier call to the store has not returned"):
        worker.call(lambda: 1, 5.0)
    assert time.monotonic() - begin < 1.0  # Not queued behind the stuck call (5 s).
    release.set()
    deadline = time.monotonic() + 5
    while worker.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker.call(lambda: "again", 1.0) == "again"
    worker.stop()


def wait_until_settled(worker: DeadlineWorker) -> None:
    deadline = time.monotonic() + 5
    while worker.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_call_past_its_deadline_hands_its_outcome_to_late_once_it_returns():
    worker = DeadlineWorker("test")
    got: list = []
    release = threading.Event()
    with pytest.raises(DeadlinePassed) as e:
        worker.call(lambda: release.wait(30) and "done", 0.2, late=lambda *o: got.append(o))
    assert e.value.running and got == []
    release.set()
    wait_until_settled(worker)
    assert got == [(True, "done")]
    # An error of the call goes to late too; a call within its deadline never does.
    release.clear()

    def fails():
        release.wait(30)
        raise OSError("gone")

    with pytest.raises(DeadlinePassed):
        worker.call(fails, 0.2, late=lambda *o: got.append(o))
    release.set()
    wait_until_settled(worker)
    assert got[1][0] is False and isinstance(got[1][1], OSError)
    assert worker.call(lambda: 7, 1.0, late=lambda *o: got.append(o)) == 7
    assert len(got) == 2
    # A late that raises is logged; the thread goes on.
    with pytest.raises(DeadlinePassed):
        worker.call(lambda: time.sleep(0.3), 0.1, late=lambda *o: 1 / 0)
    wait_until_settled(worker)
    assert worker.call(lambda: "alive", 1.0) == "alive"
    worker.stop()


def test_a_refused_call_never_runs():
    worker = DeadlineWorker("test")
    ran: list = []
    for deadline in (0.0, -1.0):
        with pytest.raises(DeadlinePassed, match="no time left") as e:
            worker.call(lambda: ran.append(1), deadline, late=lambda *o: ran.append(o))
        assert not e.value.running
    release = threading.Event()
    with pytest.raises(DeadlinePassed):
        worker.call(lambda: release.wait(30), 0.1)
    with pytest.raises(DeadlinePassed, match="has not returned") as e:
        worker.call(lambda: ran.append(2), 1.0, late=lambda *o: ran.append(o))
    assert not e.value.running
    release.set()
    wait_until_settled(worker)
    assert ran == []
    worker.stop()
