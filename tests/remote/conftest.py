"""A Mooncake master for the remote-level tests: started once per session on free loopback
ports, stopped by its pid; further masters for the tests that kill, pause or fill one.

Without the Mooncake client these tests skip, unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI), where
they fail instead (the ``mooncake_usable`` fixture of tests/conftest.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from jax_tpusync.bench.mooncake_master import LocalMaster


@pytest.fixture(autouse=True, scope="session")
def _mooncake_available(mooncake_usable):
    return mooncake_usable


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


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """One master for the session's tests that do not disturb it."""
    master = Master(tmp_path_factory.mktemp("mooncake"))
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def make_master(tmp_path):
    """Masters of a test's own (to kill, pause or fill), stopped at teardown."""
    made: list[Master] = []

    def make(*extra: str) -> Master:
        made.append(Master(tmp_path, *extra))
        return made[-1]

    yield make
    for master in made:
        master.stop()
