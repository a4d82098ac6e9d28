"""Mooncake masters for the tests of the Mooncake level and of P/D transfer: real
``mooncake_master`` processes on free loopback ports, stopped by their pid, which a test can
kill, pause or fill (the ``mooncake_master`` and ``make_master`` fixtures of
tests/conftest.py)."""

from __future__ import annotations

import ctypes
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from jax_tpusync.bench.mooncake_master import LocalMaster

# glog's severities: the Mooncake client logs a master it cannot reach at ERROR.
GLOG_FATAL = 3


def quiet_client_errors() -> None:
    """Raises the Mooncake client's log threshold (glog's ``minloglevel``, which the client
    sets once from ``MC_LOG_LEVEL``, at most ERROR) to FATAL in this process.

    A client whose master a test took away keeps pinging it until the process exits
    (:meth:`MooncakeStoreLevel.close` leaves such a client open), printing ``Client not
    available``, ``Failed to ping master`` and ``Reconnect failed`` from its threads among
    the other tests' output: the fault the test meant. The level's own Python log, which
    the tests check, is not affected. Nothing to do where this process has no client.
    """
    store = sys.modules.get("mooncake.store")
    if store is None:
        return
    package = os.path.dirname(os.path.dirname(store.__file__))
    for path in glob.glob(os.path.join(package, "mooncake*.libs", "libglog*.so*")):
        try:
            flag = ctypes.c_int32.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_minloglevelE")
        except (OSError, ValueError):
            continue
        flag.value = max(flag.value, GLOG_FATAL)


class Master(LocalMaster):
    """The benchmarks' master on loopback (``address`` is ``127.0.0.1:<port>``), started
    at once, with a short client TTL (a killed holder is forgotten in ~2.4 s); it can be
    killed and started again at the same address, paused and resumed."""

    def __init__(self, log_dir: Path, *extra: str):
        super().__init__("--client_ttl=3", *extra)
        self.log = str(log_dir / f"master-{self.port}.log")
        self.start()

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None  # Killed: started again at the same ports.
        super().start()

    def kill(self) -> None:
        """SIGKILL: every object's metadata is gone with it."""
        quiet_client_errors()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """Stops the master (SIGSTOP) and returns once it is stopped: the signal is only
        queued when ``kill`` returns, and a busy master could answer one more request."""
        quiet_client_errors()
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                # The state follows the command name, which is in parentheses.
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def resume_later(self, seconds: float) -> subprocess.Popen:
        """Resumes it after ``seconds`` from outside this interpreter (a thread of it cannot
        run while a call holds the GIL): a frozen call then fails a test's time bounds
        instead of hanging it. Kill the returned process to cancel."""
        return subprocess.Popen(["sh", "-c", f"sleep {seconds} && kill -CONT {self.proc.pid}"])

    def fault_after(self, how: str, seconds: float) -> threading.Thread:
        """Kills (``how="kill"``) or stops (``"stop"``) it ``seconds`` from now, from a
        thread of its own (started; join it)."""
        fault = {"kill": self.kill, "stop": self.pause}[how]

        def later() -> None:
            time.sleep(seconds)
            fault()

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread

    def revive(self, how: str) -> None:
        """Undoes :meth:`fault_after`: started again at the same address after a kill
        (every object is gone), resumed after a stop."""
        if how == "kill":
            self.start()
        else:
            self.resume()

    def stop(self) -> None:
        quiet_client_errors()  # Clients of this master may outlive it.
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # A paused master cannot take SIGTERM.
        super().stop()
