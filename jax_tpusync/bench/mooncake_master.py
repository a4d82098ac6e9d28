"""A ``mooncake_master`` of a benchmark's own: started on free loopback ports, waited for
within a bound, stopped by its pid.

The master holds only metadata (which object lives in which client's segment); the bytes
live in the segments the clients give the pool, so a master of one's own is enough for a
benchmark whose clients all run on this host.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Self

BINARY = "mooncake_master"


def find_binary() -> str | None:
    """The ``mooncake_master`` next to the interpreter (the Mooncake wheel installs it
    there), else the one on ``PATH``; None if neither exists."""
    here = Path(sys.executable).parent / BINARY
    return str(here) if here.exists() else shutil.which(BINARY)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalMaster:
    """A ``mooncake_master`` on ``host`` (loopback by default; an address of this host's, e.g.
    one end of a veth pair, for clients in another network namespace); ``address`` is
    ``<host>:<port>``. Its metrics port stays on loopback.

    A context manager: ``__enter__`` starts it and waits (at most ``start_timeout_s``) until
    it accepts connections, ``__exit__`` stops it (SIGTERM, then SIGKILL after
    ``stop_timeout_s``). Its output goes to ``log`` (a file in the temp directory), which
    the errors name.
    """

    def __init__(
        self,
        *extra_flags: str,
        binary: str | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 5.0,
    ):
        self.binary = binary or find_binary()
        if self.binary is None:
            raise FileNotFoundError(
                f"no {BINARY} next to {sys.executable} or on PATH: "
                f"pip install 'jax-tpusync[mooncake]', or give a running master's host:port"
            )
        self.extra_flags = extra_flags
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.host = host
        self.port = free_port(host)
        self.metrics_port = free_port()
        self.address = f"{host}:{self.port}"
        self.log = os.path.join(tempfile.gettempdir(), f"tpusync-mooncake-master-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--rpc_thread_num=2",
            *self.extra_flags,
        ]

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"the master at {self.address} was already started")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{BINARY} exited with {self.proc.returncode} before listening on "
                    f"{self.address} (its output: {self.log})"
                )
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{BINARY} did not listen on {self.address} within {self.start_timeout_s} s "
            f"(its output: {self.log})"
        )

    def stop(self) -> None:
        """Ends the master by its pid (SIGTERM, then SIGKILL); a no-op once it exited."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=self.stop_timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def for_run(args: Any, stack: ExitStack, host: str = "127.0.0.1") -> str | None:
    """The master a benchmark run with ``--remote`` / ``--remote-master`` uses: the one it
    was given, else one of its own at ``host`` (stopped when ``stack`` closes); None when
    the run has no remote rows."""
    if args.remote_master is not None:
        return args.remote_master
    if not args.remote:
        return None
    master = stack.enter_context(LocalMaster(host=host)).address
    print(f"started a mooncake_master at {master}", flush=True)
    return master
