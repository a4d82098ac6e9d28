"""The deadline worker: a call's value or error comes back; a call past its deadline is
refused and keeps the thread; calls meanwhile are refused at once, not queued."""

from __future__ import annotations

import threading
import time

import pytest

from jax_tpusync.deadline_worker import DeadlinePassed, DeadlineWorker


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
