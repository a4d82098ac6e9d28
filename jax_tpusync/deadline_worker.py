"""One daemon thread that runs blocking calls (a network client's), each waited for at most
a deadline, for callers that must never wait longer (:mod:`jax_tpusync.mooncake_level`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class DeadlinePassed(Exception):
    """The worker did not answer within the deadline (or is still in an earlier call)."""


class DeadlineWorker:
    """One daemon thread that runs blocking calls, each waited for at most a deadline.

    A call that passes its deadline keeps the thread until it returns; calls made in the
    meantime are refused at once (``DeadlinePassed``) instead of queueing behind it. A daemon
    thread: a call stuck in the network never holds up the interpreter's exit."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: threading.Event | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done, out = job
            try:
                out.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller.
                out.append((False, e))
            done.set()

    @property
    def busy(self) -> bool:
        if self._stuck is not None and self._stuck.is_set():
            self._stuck = None
        return self._stuck is not None

    def call(self, fn: Callable[[], Any], deadline: float) -> Any:
        if self.busy:
            raise DeadlinePassed("an earlier call to the store has not returned yet")
        done = threading.Event()
        out: list = []
        self._jobs.put((fn, done, out))
        if not done.wait(deadline):
            self._stuck = done
            raise DeadlinePassed(f"no answer within {deadline} s")
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)
