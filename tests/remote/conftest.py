"""A Mooncake master for the remote-level tests: started once per session on free loopback
ports, stopped by its pid; further masters for the tests that kill or fill one.

Without the Mooncake client these tests skip, unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI), where
they fail instead."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REQUIRED = os.environ.get("TPUSYNC_REQUIRE_MOONCAKE") == "1"


def _why_unavailable() -> str | None:
    """None if the Mooncake client and master can be used here, else why not."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"import mooncake.store: {e}"
    if _master_binary() is None:
        return "no mooncake_master next to the interpreter or on PATH"
    return None


def _master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


@pytest.fixture(autouse=True, scope="session")
def _mooncake_available():
    why = _why_unavailable()
    if why is None:
        return
    if REQUIRED:
        pytest.fail(
            f"TPUSYNC_REQUIRE_MOONCAKE=1 but the Mooncake client cannot be used: {why} "
            f"(pip install 'jax-tpusync[mooncake]'; apt-get install libibverbs1 libnuma1)"
        )
    pytest.skip(f"Mooncake client unavailable: {why}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A ``mooncake_master`` on loopback: ``address`` is ``127.0.0.1:<port>``."""

    def __init__(self, log_dir: Path, *extra: str):
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra = extra
        self.log = log_dir / f"master-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 15.0) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    _master_binary(),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--rpc_thread_num=2",
                    "--client_ttl=3",
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({self.proc.returncode}): {self.log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen within {timeout} s: {self.log}")

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
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


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
