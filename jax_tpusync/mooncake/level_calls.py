"""The Mooncake prefix level's client and every call to it
(:class:`~jax_tpusync.mooncake.level.MooncakeStoreLevel`): one worker thread, each call
waited for at most the deadline, the master asked whether it answers before the client is
set up or closed, and every fault a miss of a named kind, counted and logged once per kind,
that pauses the level for a while when the master cannot be reached or a call passed its
deadline.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_tpusync.mooncake import transfer_memory
from jax_tpusync.mooncake.client import (
    INTERNAL_ERROR,
    LOCAL_BUFFER_BYTES,
    REPLICA_NOT_READY,
    RPC_FAILED,
    RPC_TIMEOUT,
    TRANSFER_FAILED,
    abandon,
    probe_master,
    setup_within,
    split_master,
)
from jax_tpusync.runtime.deadline_worker import DeadlinePassed, DeadlineWorker

# Fault kinds, each counted in stats() as mooncake_fault_<kind> and logged once.
FAULT_KINDS = ("unreachable", "timeout", "transfer", "not_ready", "evicted", "full", "error")
# Kinds that pause the level for retry_after_s: the master is gone or does not answer.
PAUSING = ("unreachable", "timeout")

FAULT_TEXT = {
    "unreachable": "the Mooncake master at {master} cannot be reached",
    "timeout": "a call to the Mooncake store at {master} took longer than {deadline} s",
    "transfer": "a transfer from the Mooncake store failed (the process holding the object "
    "is gone)",
    "not_ready": "an object in the Mooncake store is not readable yet (its writer may have "
    "died while putting it)",
    "evicted": "a block's header is in the Mooncake store but a layer range it names is "
    "gone (evicted)",
    "full": "the Mooncake store has no room for a put",
    "error": "the Mooncake store returned an error",
}

# The client's setup() and close() hold this interpreter's GIL while they wait for the master
# (measured: 8 s with the master stopped, until it resumed; 91 s with it killed), so no
# deadline can be kept around them from another thread. Before either, the master is asked
# with a plain socket (which releases the GIL) whether it answers at all: a few bytes that
# are not a request of its protocol, which a running master answers by closing the
# connection. A master that refuses or says nothing within the deadline is unreachable;
# the client is then neither set up nor closed. A master that dies or stops after it
# answered is bounded by the client's own limit on each request to it, the deadline
# (:func:`~jax_tpusync.mooncake.client.setup_within`; by default 30 s per request, tried
# again: a setup measured 90 s), and a client whose setup failed is never freed (freeing
# closes it). Masters that did not answer, by address:
# (until when every level of this process treats them as unreachable without asking, why).
_UNANSWERED: dict[str, tuple[float, str]] = {}
_UNANSWERED_LOCK = threading.Lock()


class StoreFault(Exception):
    """A call to the store failed: a miss of ``kind``."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def code_fault(code: int, what: str) -> StoreFault:
    """The fault a client error ``code`` means (``what`` returned it)."""
    kind = {
        RPC_FAILED: "unreachable",
        RPC_TIMEOUT: "timeout",
        TRANSFER_FAILED: "transfer",
        REPLICA_NOT_READY: "not_ready",
        INTERNAL_ERROR: "full",
    }.get(code, "error")
    return StoreFault(kind, f"{what} returned {code}")


class StoreCalls:
    """The level's client, connected at the first call, and every call to it.

    Args:
      master: ``host:port`` of the store's master.
      local_host: the address other clients reach this one at.
      segment_bytes: DRAM this process gives the pool (0: none).
      deadline_s: the longest any call waits for the store.
      retry_after_s: how long every call is a miss after the master could not be reached
        or a call passed its deadline.
      transfer_engine: a started ``TransferEngine`` for the client, or None.
      store_class: the client's class (:func:`~jax_tpusync.mooncake.client.import_store`).
      buffer: ``uint8[n]`` memory of the level's own, registered at the connection (before
        any pool given to :meth:`use_memory`).
      log: where faults are reported (the level's logger).

    ``faults``: per kind of :data:`FAULT_KINDS`, the faults counted; ``skipped``: calls
    answered with their default while paused or once closed.
    """

    def __init__(
        self,
        master: str,
        *,
        local_host: str,
        segment_bytes: int,
        deadline_s: float,
        retry_after_s: float,
        transfer_engine: Any,
        store_class: Any,
        buffer: np.ndarray,
        log: logging.Logger,
    ):
        self.master = master
        self.local_host = local_host
        self.segment_bytes = segment_bytes
        self.deadline_s = deadline_s
        self.retry_after_s = retry_after_s
        self._engine = transfer_engine
        self._store_class = store_class
        self._buffer = buffer
        self._log = log
        self._memory: list[tuple[int, int]] = []  # Pools given by use_memory().
        self._registered: list[int] = []  # Addresses registered with the client/engine.
        self._client: Any = None
        self._worker = DeadlineWorker(f"mooncake-level-{master}")
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._logged: set[str] = set()
        self._closed = False
        self.skipped = 0
        self.faults = dict.fromkeys(FAULT_KINDS, 0)

    @property
    def busy(self) -> bool:
        """Whether a call that passed its deadline is still running."""
        return self._worker.busy

    def use_memory(self, address: int, nbytes: int) -> None:
        """Registers ``nbytes`` at ``address`` with the client: now if connected (a fault
        is counted and leaves it unregistered), else at the connection."""
        self._memory.append((int(address), int(nbytes)))
        if self._client is not None:
            self.run(lambda client: self._register(address, nbytes), None)

    def close(self) -> None:
        """Leaves the pool; every later call is a miss (counted as ``skipped``). Returns
        within about the deadline: a client stuck in a call is left to its daemon thread,
        and one whose master does not answer is left open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
            if client is not None and self._worker.busy:
                abandon(client)
            elif client is not None:
                try:
                    self._reach_master()
                except StoreFault as e:
                    abandon(client)
                    self._log.warning(
                        "the Mooncake master at %s does not answer (%s): this level's client "
                        "is left open, not closed",
                        self.master,
                        e,
                    )
                    leave = functools.partial(self._unregister_all, client)  # Local only.
                else:

                    def leave() -> None:
                        self._unregister_all(client)
                        client.close()

                try:
                    self._worker.call(leave, self.deadline_s)
                except Exception as e:  # noqa: BLE001 - leaving is best effort.
                    self._log.debug("closing the Mooncake client: %s", e)
            self._worker.stop()

    def run(
        self,
        fn: Callable[[Any], Any],
        default: Any,
        stage: Callable[[], None] | None = None,
        late: Callable[[bool, Any], None] | None = None,
        in_flight: Any = None,
    ) -> Any:
        """``fn(client)`` on the worker within the deadline; ``default`` on a fault (counted,
        logged once per kind), while paused or once closed. Never raises. ``stage`` runs
        first, on this thread, once no earlier call is still running (it fills the buffer
        that ``fn`` sends: a call that passed its deadline may still be reading it). A call
        that passed its deadline returns ``in_flight`` if ``late`` is given, which then gets
        the call's outcome on the worker once it returns.

        Not connected yet, the master is first asked whether it answers at all
        (:func:`~jax_tpusync.mooncake.client.probe_master`), within the same deadline: the
        client's ``setup()`` would hold the GIL for as long as it waits for the master."""
        with self._lock:
            if self._closed or time.monotonic() < self._paused_until:
                self.skipped += 1
                return default
            try:
                if self._worker.busy:
                    raise DeadlinePassed("an earlier call to the store has not returned yet")
                deadline = self.deadline_s
                if self._client is None:
                    deadline -= self._reach_master()
                if stage is not None:
                    stage()
                return self._worker.call(lambda: fn(self._connected()), deadline, late=late)
            except DeadlinePassed as e:
                self.fault("timeout", str(e), pause=True)
                if e.running and late is not None:
                    return in_flight
            except StoreFault as e:
                self.fault(e.kind, str(e), pause=e.kind in PAUSING)
            except Exception as e:  # noqa: BLE001 - the client's own errors: a miss, logged.
                self.fault("error", f"{type(e).__name__}: {e}", pause=False)
            return default

    def fault(self, kind: str, detail: str, *, pause: bool) -> None:
        """Counts a fault of ``kind`` (one of :data:`FAULT_KINDS`) and logs it, a warning the
        first time; ``pause``: every call is a miss for ``retry_after_s``."""
        self.faults[kind] += 1
        if pause:
            self._paused_until = time.monotonic() + self.retry_after_s
        text = FAULT_TEXT[kind].format(master=self.master, deadline=self.deadline_s)
        if kind not in self._logged:
            self._logged.add(kind)
            self._log.warning(
                "%s (%s): remote prefix blocks are misses%s (logged once; counted in "
                "stats()['mooncake_fault_%s'])",
                text,
                detail,
                f" for {self.retry_after_s} s, then retried" if pause else " when it happens",
                kind,
            )
        else:
            self._log.debug("%s (%s)", text, detail)

    def _reach_master(self) -> float:
        """Seconds spent making sure the master answers before the client is set up or
        closed (both hold the GIL while they wait for it); a ``StoreFault("unreachable")`` if
        it does not, or if it did not answer any level of this process within the last
        ``retry_after_s`` (so that the groups of a hybrid cache, a level each, wait once)."""
        start = time.monotonic()
        with _UNANSWERED_LOCK:
            until, why = _UNANSWERED.get(self.master, (0.0, ""))
        if start < until:
            raise StoreFault("unreachable", f"{why}; asked again in {until - start:.1f} s")
        host, port = split_master(self.master)
        try:
            why = self._worker.call(
                functools.partial(probe_master, host, port, self.deadline_s), self.deadline_s
            )
        except DeadlinePassed:  # The worker keeps the probe until its own timeout ends it.
            why = f"it did not answer within {self.deadline_s:.3g} s"
        with _UNANSWERED_LOCK:
            if why is None:
                _UNANSWERED.pop(self.master, None)
            else:
                _UNANSWERED[self.master] = (time.monotonic() + self.retry_after_s, why)
        if why is not None:
            raise StoreFault("unreachable", why)
        return time.monotonic() - start

    def _connected(self) -> Any:
        """The client, connected, with the level's buffer and the pools registered (on the
        worker)."""
        if self._client is None:
            client = self._store_class()
            args = [
                self.local_host,
                "P2PHANDSHAKE",
                self.segment_bytes,
                LOCAL_BUFFER_BYTES,
                "tcp",
                "",
                self.master,
            ]
            if self._engine is not None:
                args.append(self._engine.get_engine())
            rc = setup_within(client, self.deadline_s, *args)
            if rc != 0:
                abandon(client)  # Never freed: that would close it, waiting for the master.
                raise StoreFault("unreachable", f"connecting returned {rc}")
            self._client = client
            try:
                self._register(self._buffer.ctypes.data, self._buffer.nbytes)
                for address, nbytes in self._memory:
                    self._register(address, nbytes)
            except StoreFault:
                self._client = None
                self._unregister_all(client)
                client.close()
                raise
        return self._client

    def _register(self, address: int, nbytes: int) -> None:
        if self._engine is not None:  # Shared: counted, so P/D may register it too.
            rc = transfer_memory.register(self._engine, address, nbytes)
        else:
            rc = self._client.register_buffer(address, nbytes)
        if rc != 0:
            raise StoreFault("error", f"registering {nbytes} bytes of memory returned {rc}")
        self._registered.append(address)

    def _unregister_all(self, client: Any) -> None:
        for address in self._registered:
            if self._engine is not None:
                transfer_memory.unregister(self._engine, address)
            else:
                client.unregister_buffer(address)
        self._registered = []
