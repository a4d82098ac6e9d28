"""One daemon thread that runs blocking calls (a network client's), each waited for at most
a deadline, for callers that must never wait longer (:mod:`jax_tpusync.mooncake.level`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class DeadlinePassed(Exception):
    """The worker did not answer within the deadline (or is still in an earlier call).

    ``running``: True when this call itself passed its deadline and still runs (its ``late``
    callback will get its outcome); False when it was refused before it started."""

    def __init__(self, message: str, *, running: bool = False):
        super().__init__(message)
        self.running = running


class _Job:
    def __init__(self, fn: Callable[[], Any], late: Callable[[bool, Any], None] | None):
        self.fn = fn
        self.late = late
        self.done = threading.Event()
        self.outcome: tuple[bool, Any] | None = None
        self.abandoned = False  # The caller stopped waiting: the outcome goes to ``late``.
        self.lock = threading.Lock()  # Hands the outcome to exactly one of the two.


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
            try:
                outcome = (True, job.fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller.
                outcome = (False, e)
            with job.lock:
                job.outcome = outcome
                late = job.late if job.abandoned else None
            if late is not None:
                try:
                    late(*outcome)
                except Exception:  # Nobody to hand it to; the thread lives on.
                    logger.exception("accounting for a call that passed its deadline failed")
            job.done.set()

    @property
    def busy(self) -> bool:
        if self._stuck is not None and self._stuck.is_set():
            self._stuck = None
        return self._stuck is not None

    def call(
        self,
        fn: Callable[[], Any],
        deadline: float,
        late: Callable[[bool, Any], None] | None = None,
    ) -> Any:
        """``fn()``'s value (or its exception, raised), waited for at most ``deadline``
        seconds. Past it, raises ``DeadlinePassed(running=True)``; ``late(ok, value or
        exception)`` then runs on the worker once ``fn`` returns, so a caller that gave up
        can still account for what the call did."""
        if self.busy:
            raise DeadlinePassed("an earlier call to the store has not returned yet")
        if not deadline > 0:
            raise DeadlinePassed(f"no time left of the deadline ({deadline:.3g} s)")
        job = _Job(fn, late)
        self._jobs.put(job)
        if not job.done.wait(deadline):
            with job.lock:
                if job.outcome is None:  # Still running: from now on it is the worker's.
                    job.abandoned = True
                    self._stuck = job.done
                    raise DeadlinePassed(f"no answer within {deadline:.3g} s", running=True)
        ok, value = job.outcome
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)
