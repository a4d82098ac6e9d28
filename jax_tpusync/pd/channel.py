"""The control channel of P/D transfer (:mod:`jax_tpusync.pd.transfer`): length-prefixed
JSON messages on a TCP connection, each bounded by a deadline; the token ids' encoding; the
TransferEngine a role starts, with the TCP timeouts it reads; calls bounded in time.
"""

from __future__ import annotations

import base64
import json
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# 4: the completion message carries the xxh3-64 of the bytes written per head range
# (head_xxh3_64), checked by the decode side before it admits. A peer of another version is
# refused by name on either side (its request or its reply).
PROTOCOL_VERSION = 4
MAX_MESSAGE_BYTES = 64 << 20  # The longest control message either side accepts.
# The engine's TCP timeouts (seconds) when the environment sets none.
MOONCAKE_TCP_TIMEOUT_S = 30.0
_TCP_TIMEOUT_VARIABLES = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
_LENGTH = struct.Struct(">I")

_INSTALL_HINT = (
    "P/D transfer needs the Mooncake TransferEngine: pip install 'jax-tpusync[mooncake]' "
    "(and the system library libibverbs1, even over TCP: apt-get install libibverbs1 libnuma1)"
)


class PDTransferError(RuntimeError):
    """A P/D transfer that did not happen: the message says why (and for a receiver, that
    the slot was left unadmitted)."""


def check_deadline(deadline_s: Any) -> float:
    if (
        isinstance(deadline_s, bool)
        or not isinstance(deadline_s, (int, float))
        or not (math.isfinite(deadline_s) and deadline_s > 0)
    ):
        raise ValueError(f"deadline_s={deadline_s!r} must be a finite number > 0")
    return float(deadline_s)


def check_host(name: str, host: Any) -> str:
    """Refuses, by name, a host that names no machine: not a str, empty, or holding blanks
    or '/' (an empty one would listen on every interface, and start an engine whose session
    ``":port"`` no peer can write to)."""
    if not isinstance(host, str) or not host or any(c.isspace() or c == "/" for c in host):
        raise ValueError(
            f"{name}={host!r} must be a host's name or address (non-empty, no spaces or '/')"
        )
    return host


def check_session(session: Any) -> str:
    """Refuses, by name, a TransferEngine session that is not ``host:port``."""
    try:
        split_address(session)
    except ValueError:
        raise ValueError(
            f"session={session!r} must be the TransferEngine's 'host:port' (its "
            f"get_rpc_port())"
        ) from None
    return session


def engine_tcp_timeout_s() -> float:
    """The longest of the engine's TCP timeouts (``MC_TCP_PROGRESS_TIMEOUT_SEC``,
    ``MC_TCP_STATUS_TIMEOUT_SEC``) as the environment sets them now (an engine reads them
    when it starts), :data:`MOONCAKE_TCP_TIMEOUT_S` for one not set. Raises ValueError for
    a value that is not a positive number of seconds."""
    out = 0.0
    for name in _TCP_TIMEOUT_VARIABLES:
        value = os.environ.get(name)
        if value is None:
            out = max(out, MOONCAKE_TCP_TIMEOUT_S)
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
        out = max(out, seconds)
    return out


def start_engine(host: str, deadline_s: float) -> tuple[Any, str]:
    """A TransferEngine on ``host`` (TCP, peers found by handshake) and its session."""
    try:
        from mooncake.engine import TransferEngine  # Optional: imported when used.
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    # Read when the engine starts: a hung peer then ends a transfer within about the
    # deadline instead of 30 s. A user's own settings win.
    seconds = str(max(1, math.ceil(deadline_s)))
    for name in _TCP_TIMEOUT_VARIABLES:
        os.environ.setdefault(name, seconds)
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise PDTransferError(f"starting a Mooncake TransferEngine on {host} returned {rc}")
    return engine, f"{host}:{engine.get_rpc_port()}"


def encode_tokens(ids: np.ndarray) -> str:
    """Token ids as the request carries them: base64 of little-endian int64 (a JSON list
    of 32K ids costs about 13 ms to write and read, this about 4)."""
    return base64.b64encode(np.asarray(ids, "<i8").tobytes()).decode("ascii")


def decode_tokens(text: Any) -> np.ndarray | None:
    """int64[n] ids from :func:`encode_tokens`'s text; None if it is not such a text."""
    if not isinstance(text, str):
        return None
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    if len(data) % 8:
        return None
    return np.frombuffer(data, "<i8").astype(np.int64)


def send_message(sock: socket.socket, message: Any, deadline: float) -> None:
    """Writes one length-prefixed JSON message, done by ``deadline`` (time.monotonic())."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise PDTransferError(f"a control message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete message before the deadline")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        out += chunk
    return bytes(out)


def recv_message(sock: socket.socket, deadline: float) -> Any:
    """Reads one length-prefixed JSON message, done by ``deadline`` (time.monotonic())."""
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    if n > MAX_MESSAGE_BYTES:
        raise PDTransferError(f"a control message of {n} bytes is over {MAX_MESSAGE_BYTES}")
    return json.loads(_recv_exact(sock, n, deadline))


def split_address(address: Any) -> tuple[str, int]:
    if isinstance(address, tuple) and len(address) == 2:
        host, port = address
    elif isinstance(address, str) and address.count(":") == 1:
        host, port = address.split(":")
    else:
        raise ValueError(f"address {address!r} must be 'host:port' or (host, port)")
    if not isinstance(host, str) or not host or any(c.isspace() or c == "/" for c in host):
        raise ValueError(f"address {address!r}: the host must be a name or address")
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"address {address!r}: the port is not an int") from None
    if not 0 < port < 65536:
        raise ValueError(f"address {address!r}: port {port} is out of [1, 65535]")
    return str(host), port


def bounded(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """``fn()`` on a daemon thread, waited for at most ``seconds``; a call that passes it
    is left to its thread (the engine's own timeouts end it) and raises here."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller.
            out.append((False, e))

    thread = threading.Thread(target=run, name="pd-transfer", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise PDTransferError(f"{what} did not finish within {seconds:.3g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value
