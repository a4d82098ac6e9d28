"""Mooncake masters for the tests of the Mooncake level and of P/D transfer: real
``mooncake_master`` processes on free loopback ports, stopped by their pid, which a test can
kill, pause or fill (the ``mooncake_master`` and ``make_master`` fixtures of
tests/conftest.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from jax_tpusync.bench.mooncake_master import LocalMaster


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
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # A paused master cannot take SIGTERM.
        super().stop()
