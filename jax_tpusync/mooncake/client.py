"""What every user of the Mooncake Store client in this package shares: the client class
(imported when used, with how to install it), its error codes and what they mean, the
limits it sets, the master's address, and asking the master whether it answers at all.

The prefix level (:mod:`jax_tpusync.mooncake.level`) and the weight store
(:mod:`jax_tpusync.weights.store_mooncake`) each keep their own calls and failure rules on
top of these.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any

# Error codes of the store's client, and what each means.
INTERNAL_ERROR = -200  # No room in the pool (no handle).
INVALID = -600  # Also a buffer of another size than the object.
REPLICA_NOT_READY = -703
NOT_FOUND = -704
ALREADY_EXISTS = -705
LEASED = -706
TRANSFER_FAILED = -800
RPC_FAILED = -900
RPC_TIMEOUT = -901  # A request to the master passed the client's own limit on it.
CODE_MEANING = {
    ALREADY_EXISTS: "already exists",
    NOT_FOUND: "not found",
    REPLICA_NOT_READY: "not readable yet (its writer may have died while putting it)",
    LEASED: "held by a reader's lease",
    TRANSFER_FAILED: "transfer failed (the process holding it is gone)",
    RPC_FAILED: "the master did not answer",
    RPC_TIMEOUT: "the master did not answer in time",
    INTERNAL_ERROR: "no room in the pool",
    INVALID: "invalid request (an object of another size than its manifest says)",
}

# Memory the client copies through (its own puts and gets); ours are zero-copy from
# buffers registered with it, so this only has to exist.
LOCAL_BUFFER_BYTES = 4 << 20
# The smallest segment the client accepts.
MIN_SEGMENT_BYTES = 16 << 20
# The longest deadline_s: a call waited for longer than an hour is a hang by another name
# (and the engine's TCP timeouts are whole seconds of a C int).
MAX_DEADLINE_S = 3600.0

# The client's own limits on each request to its master, read when a client is set up:
# 30 s each by default, and a request is tried again, so a call (a setup, a close) into a
# client whose master was killed or stopped during it was measured to wait 90 s. A client
# set up by :func:`setup_within` gets its caller's deadline instead; the environment's own
# settings win.
RPC_TIMEOUT_VARIABLES = ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS")
# Setting them for one client's setup and taking them back is one step for every thread.
_SETUP_LOCK = threading.Lock()

# A few bytes that are not a request of the master's protocol: a running master answers
# them by closing the connection (see :func:`probe_master`).
_PROBE = b"\0" * 64

# Clients whose master did not answer when they closed: closing one then would hold the
# interpreter's lock until the master answers, so they stay referenced, never closed
# (freeing one closes it too).
_ABANDONED: list[Any] = []


def meaning(code: int) -> str:
    """``"-704: not found"``: a client error code and what it means."""
    return f"{code}: {CODE_MEANING.get(code, 'error')}"


def import_store(what: str) -> Any:
    """The client's ``MooncakeDistributedStore`` class; an ImportError saying how to
    install it (``what`` needs it) when it is not there."""
    try:
        from mooncake.store import MooncakeDistributedStore  # Optional: imported when used.
    except ImportError as e:
        raise ImportError(
            f"{what} needs the Mooncake Store client: pip install 'jax-tpusync[mooncake]' "
            f"(and the system library libibverbs1, even over TCP: apt-get install libibverbs1 "
            f"libnuma1) ({e})"
        ) from e
    return MooncakeDistributedStore


def abandon(client: Any) -> None:
    """Keeps ``client`` referenced and never closes it: its master did not answer, or its
    setup failed or passed its deadline (freeing it closes it, which holds the
    interpreter's lock while it waits for a master that may be gone)."""
    _ABANDONED.append(client)


def setup_within(client: Any, deadline_s: float, *args: Any) -> int:
    """``client.setup(*args)`` (its return code), with each of the client's requests to its
    master, then and later, limited to ``deadline_s`` (``MC_RPC_TIMEOUT_MS`` /
    ``MC_RPC_CONNECT_TIMEOUT_MS`` for this client, unless the environment sets them): a
    call whose master dies or stops during it then ends by itself in about the deadline
    instead of 30 s per request. Setup and close hold the interpreter's lock while they
    wait for the master, so their callers' deadlines rest on this bound."""
    milliseconds = str(max(1, math.ceil(deadline_s * 1000)))
    with _SETUP_LOCK:
        added = [name for name in RPC_TIMEOUT_VARIABLES if name not in os.environ]
        for name in added:
            os.environ[name] = milliseconds
        try:
            return client.setup(*args)
        finally:
            for name in added:
                os.environ.pop(name, None)


def split_master(master: Any) -> tuple[str, int]:
    """(host, port) of a master's ``host:port`` (``[v6 address]:port``); a ValueError
    naming ``master`` otherwise."""
    if isinstance(master, str):
        host, sep, port = master.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if (
            sep
            and host
            and not any(c.isspace() or c in "/[]" for c in host)
            and port.isascii()
            and port.isdigit()
            and 0 < int(port) < 65536
        ):
            return host, int(port)
    raise ValueError(f"master={master!r} must be 'host:port' (a port in 1-65535)")


def probe_master(host: str, port: int, timeout: float) -> str | None:
    """None if the master at ``host:port`` answered a few bytes that are not a request
    within ``timeout`` seconds (with bytes, or by closing the connection); else why not.
    Only socket calls, which release the GIL (the client's own setup and close hold it
    while they wait for a master)."""
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(max(1e-3, timeout - (time.monotonic() - start)))
            conn.sendall(_PROBE)
            conn.recv(1)  # b"" (closed) or an answer: either way the master runs.
    except TimeoutError:
        return f"it did not answer within {timeout:.3g} s"
    except (ConnectionResetError, BrokenPipeError):
        return None  # It closed the connection on the bytes it did not expect.
    except OSError as e:
        return f"connecting to it failed ({e})"
    return None
