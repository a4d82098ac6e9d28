"""Prefill-to-decode (P/D) transfer: a prefill process computes a sequence's KV into its own
cache and writes it, one-sided, into the blocks a decode process reserved in its cache's
host pool, over a Mooncake TransferEngine.

Two roles, one object each:

* :class:`KVReceiver` (the decode process): registers its cache's host pool with a
  TransferEngine; :meth:`KVReceiver.receive` reserves a slot for the prompt, sends the
  prefill process the prompt, its session and where each (layer, K|V) run of the slot's
  blocks lies in the pool, waits for the completion message, then admits the slot at the
  prompt's length. Any failure cancels the reservation (the slot stays inactive, the
  blocks free) and raises :class:`PDTransferError` saying why.
* :class:`KVSender` (the prefill process): registers its own pool, listens for requests
  on a control socket; :meth:`KVSender.accept` takes one, the caller prefills the prompt
  into a slot of its cache, and :meth:`KVSender.send` writes that slot's rows straight from
  its pool into the decode pool (no copy on either side), then sends the completion
  message (with any JSON the caller adds, e.g. the first sampled token).
  :meth:`KVSender.serve_one` does the three.

Control channel: one TCP connection per transfer carrying length-prefixed JSON (a 4-byte
big-endian length, then UTF-8): the request (protocol version, token ids, the first
position to send, the decode engine's session, the cache layout, the destination runs) and
one reply (``ok`` with the bytes written and the caller's JSON, or an error). The bytes
themselves go only through the TransferEngine. The completion message is sent after every
write returned success, so a slot is admitted only with whole blocks.

If the decode cache already holds a prefix of the prompt (its prefix index), only the rest
is sent: the request's first position is the reservation's cached length.

Deadlines: every socket operation and every TransferEngine call is bounded by
``deadline_s``; a killed peer (connection refused or reset, a failed write) or a hung one
(no answer in time) is a :class:`PDTransferError` naming the peer and what did not
happen. Unless the environment sets them, ``MC_TCP_PROGRESS_TIMEOUT_SEC`` and
``MC_TCP_STATUS_TIMEOUT_SEC`` default to the deadline so the engine's own transfers end
too. The sender keeps at most ``batch_bytes`` of writes in flight and checks the control
connection before each write: once the decode side has given up (closed it), a prefill
process that was paused and resumes stops at its next write. (Writes already in flight
when the decode side gave up can still land in blocks it freed; keep ``batch_bytes``
small where a paused prefill process is a real risk.)

Both caches must have the same row layout (layers, heads, head size, dtype, block size;
checked) on a host tier (the pool must be mapped memory); a cache that keeps only its
window (``max_step_tokens``) and a two-level cache's spill blocks are refused.

Never fork a process after an engine started here (it runs many threads): start helper
processes with ``subprocess`` or the ``spawn`` start method.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_tpusync.cache import OffloadedKVCache
from jax_tpusync.config import is_int
from jax_tpusync.state import KVState

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # The longest control message either side accepts.
# One engine write's most bytes: 4 MiB pieces, all in flight, measured fastest over TCP on a
# 2-core machine (1 MiB pieces cost more per-request overhead, 16 MiB ones less parallelism).
PIECE_BYTES = 4 << 20
WARMUP_BYTES = 4096  # The first write to a new session (it opens the engine's connection).
_POLL_MIN_S, _POLL_MAX_S = 1e-4, 1e-3  # Sleeps between completion polls (doubling).
_LENGTH = struct.Struct(">I")

_INSTALL_HINT = (
    "P/D transfer needs the Mooncake TransferEngine: pip install 'jax-tpusync[mooncake]' "
    "(and the system library libibverbs1, even over TCP: apt-get install libibverbs1 libnuma1)"
)


class PDTransferError(RuntimeError):
    """A P/D transfer that did not happen: the message says why (and for a receiver, that
    the slot was left unadmitted)."""


@dataclasses.dataclass(frozen=True)
class Received:
    """What :meth:`KVReceiver.receive` admitted: ``slot`` at ``length`` tokens, of which
    ``cached`` were already in the decode cache (prefix index) and the rest, ``nbytes``
    bytes, were written by the prefill process in ``seconds`` (request to completion
    message); ``extra``: the JSON the prefill side sent with it."""

    slot: int
    length: int
    cached: int
    nbytes: int
    seconds: float
    extra: Any


@dataclasses.dataclass
class PrefillRequest:
    """A request :meth:`KVSender.accept` took: prefill ``tokens`` (int64[n]) and send
    positions ``[start, n)``. Answer it with :meth:`KVSender.send` or
    :meth:`KVSender.fail`."""

    tokens: np.ndarray
    start: int
    session: str
    runs: list  # Per region (layer * 2 + K|V): [[address, bytes], ...] in the decode pool.
    peer: str
    conn: socket.socket | None = dataclasses.field(default=None, repr=False)

    @property
    def answered(self) -> bool:
        return self.conn is None


@dataclasses.dataclass(frozen=True)
class Sent:
    """What :meth:`KVSender.send` wrote: ``nbytes`` in ``segments`` writes, ``seconds``."""

    nbytes: int
    segments: int
    seconds: float


# -- shared helpers ------------------------------------------------------------------------------


def layout_of(cache: OffloadedKVCache) -> dict:
    """The row layout two caches must share for one's rows to be the other's bytes."""
    spec = cache.spec
    return dict(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=np.dtype(spec.dtype).name,
        tier_dtype=None if spec.tier_dtype is None else np.dtype(spec.tier_dtype).name,
        block_tokens=spec.block_tokens,
        row_bytes=spec.row_bytes,
    )


def _check_cache(cache: Any, role: str) -> tuple[int, int]:
    """(address, bytes) of ``cache``'s host pool, after refusing what cannot take part."""
    if not isinstance(cache, OffloadedKVCache):
        raise TypeError(
            f"{role} needs an OffloadedKVCache (one device's cache); got {type(cache).__name__}"
        )
    if cache.spec.ring_blocks:
        raise ValueError(
            f"{role}: a cache that keeps only its window (max_step_tokens) cannot take part in "
            f"P/D transfer (its positions wrap around a ring of blocks)"
        )
    info = cache.engine.tier_info(cache.tier)
    if info.read_only:
        raise ValueError(f"{role}: the cache's tier is attached read-only")
    try:
        return cache.engine.mapped_memory(cache.tier)
    except ValueError as e:
        raise ValueError(
            f"{role} needs a cache on a host tier (tier='host'): the TransferEngine reads and "
            f"writes the pool in memory ({e})"
        ) from None


def pool_runs(
    cache: OffloadedKVCache, pool_address: int, slot: int, lo: int, hi: int
) -> list[list[list[int]]]:
    """Per region (layer * 2 + K|V): ``[address, bytes]`` runs of positions ``[lo, hi)`` of
    ``slot``, in ``cache``'s host pool mapped at ``pool_address`` in this process. Raises
    ValueError for blocks on a two-level cache's spill tier."""
    out = []
    for layer in range(cache.spec.num_layers):
        for kv in (0, 1):
            runs = []
            for tier, offset, n in cache.tier_runs(layer, kv, slot, lo, hi):
                if tier != cache.tier:
                    raise ValueError(
                        f"slot {slot}'s blocks include blocks on the spill tier: P/D moves "
                        f"only blocks in the DRAM pool"
                    )
                runs.append([pool_address + offset, n])
            out.append(runs)
    return out


def _check_deadline(deadline_s: Any) -> float:
    if (
        isinstance(deadline_s, bool)
        or not isinstance(deadline_s, (int, float))
        or not (math.isfinite(deadline_s) and deadline_s > 0)
    ):
        raise ValueError(f"deadline_s={deadline_s!r} must be a finite number > 0")
    return float(deadline_s)


def _start_engine(host: str, deadline_s: float) -> tuple[Any, str]:
    """A TransferEngine on ``host`` (TCP, peers found by handshake) and its session."""
    try:
        from mooncake.engine import TransferEngine  # Optional: imported when used.
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    # Read when the engine starts: a hung peer then ends a transfer within about the
    # deadline instead of 30 s. A user's own settings win.
    seconds = str(max(1, math.ceil(deadline_s)))
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds)
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", seconds)
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise PDTransferError(f"starting a Mooncake TransferEngine on {host} returned {rc}")
    return engine, f"{host}:{engine.get_rpc_port()}"


def _register(engine: Any, address: int, nbytes: int, role: str) -> None:
    rc = engine.register_memory(address, nbytes)
    if rc != 0:
        raise PDTransferError(
            f"{role}: registering the cache's host pool ({nbytes} bytes) with the "
            f"TransferEngine returned {rc}"
        )


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


def _split_address(address: Any) -> tuple[str, int]:
    if isinstance(address, tuple) and len(address) == 2:
        host, port = address
    elif isinstance(address, str) and address.count(":") == 1:
        host, port = address.split(":")
    else:
        raise ValueError(f"address {address!r} must be 'host:port' or (host, port)")
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"address {address!r}: the port is not an int") from None
    if not 0 < port < 65536:
        raise ValueError(f"address {address!r}: port {port} is out of [1, 65535]")
    return str(host), port


def _bounded(fn: Callable[[], Any], seconds: float, what: str) -> Any:
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


# -- the decode role ---------------------------------------------------------------------------


class KVReceiver:
    """The decode side: receives sequences' KV into ``cache``'s host pool.

    Args:
      cache: the decode cache (host tier, same row layout as the prefill cache's).
      host: the address the prefill process reaches this engine at (its NIC's address when
        the two run on different hosts).
      deadline_s: the longest one :meth:`receive` waits in all (connect, request, the
        prefill itself and the writes, the completion message).
      transfer_engine: a started ``mooncake.engine.TransferEngine`` to share (one per
        process), with ``session`` its ``host:rpc_port``; None: one is started here.

    Raises:
      TypeError, ValueError: a cache that cannot take part (the message says why).
      ImportError: Mooncake is not installed (the message names the package extra).
    """

    def __init__(
        self,
        cache: OffloadedKVCache,
        *,
        host: str = "127.0.0.1",
        deadline_s: float = 30.0,
        transfer_engine: Any = None,
        session: str | None = None,
    ):
        self.deadline_s = _check_deadline(deadline_s)
        self.cache = cache
        self.pool_address, self.pool_bytes = _check_cache(cache, "KVReceiver")
        if (transfer_engine is None) != (session is None):
            raise ValueError("give transfer_engine and its session together, or neither")
        if transfer_engine is None:
            transfer_engine, session = _start_engine(host, self.deadline_s)
        self.engine = transfer_engine
        self.session = session
        _register(self.engine, self.pool_address, self.pool_bytes, "KVReceiver")
        self.layout = layout_of(cache)
        self.received = 0
        self.failed = 0

    def destination_runs(self, slot: int, lo: int, hi: int) -> list[list[list[int]]]:
        """Per region (layer * 2 + K|V): ``[address, bytes]`` runs of positions ``[lo,
        hi)`` of ``slot`` in this process's pool."""
        return pool_runs(self.cache, self.pool_address, slot, lo, hi)

    def receive(
        self,
        state: KVState,
        slot: int,
        tokens: Sequence[int] | np.ndarray,
        *,
        prefill: str | tuple[str, int],
        max_tokens: int | None = None,
    ) -> tuple[KVState, Received]:
        """Has the prefill process at ``prefill`` (its :attr:`KVSender.address`) compute
        ``tokens``' KV and write it into ``slot``; returns the live state with the slot
        admitted at ``len(tokens)`` and what was received.

        Raises:
          ValueError: a bad slot, tokens or max_tokens, or too few free blocks (from the
            reservation; nothing changed).
          PDTransferError: the transfer failed (the message says why); the reservation
            was cancelled: the slot is inactive and ``state`` is still the live state.
        """
        start_time = time.monotonic()
        deadline = start_time + self.deadline_s
        host, port = _split_address(prefill)
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D sequence of ints; got {tokens!r}")
        admission = self.cache.reserve(slot, max_tokens, ids)  # Refused: nothing changed.
        n = int(ids.size)
        try:
            runs = self.destination_runs(slot, admission.cached, n)
            request = dict(
                version=PROTOCOL_VERSION,
                op="prefill",
                tokens=[int(t) for t in ids],
                start=admission.cached,
                session=self.session,
                layout=self.layout,
                runs=runs,
            )
            reply = self._exchange(host, port, request, deadline)
            want = sum(r[1] for region in runs for r in region)
            if reply.get("nbytes") != want:
                raise PDTransferError(
                    f"the prefill process reported {reply.get('nbytes')!r} bytes written, "
                    f"expected {want}"
                )
        except Exception as e:
            self.cache.cancel(admission)
            self.failed += 1
            reason = e if isinstance(e, PDTransferError) else f"{type(e).__name__}: {e}"
            raise PDTransferError(
                f"P/D transfer of {n} tokens into slot {slot} from {host}:{port} failed, the "
                f"slot was left unadmitted: {reason}"
            ) from e
        state = self.cache.admitted(state, dataclasses.replace(admission, cached=n))
        self.received += 1
        return state, Received(
            slot=slot,
            length=n,
            cached=admission.cached,
            nbytes=want,
            seconds=time.monotonic() - start_time,
            extra=reply.get("extra"),
        )

    def _exchange(self, host: str, port: int, request: dict, deadline: float) -> dict:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(1e-3, deadline - time.monotonic())
            )
        except OSError as e:
            raise PDTransferError(f"cannot reach the prefill process ({e})") from None
        with sock:
            try:
                send_message(sock, request, deadline)
                reply = recv_message(sock, deadline)
            except TimeoutError:
                raise PDTransferError(
                    f"no completion message within the deadline ({self.deadline_s} s): the "
                    f"prefill process is hung or too slow"
                ) from None
            except (ConnectionError, OSError) as e:
                raise PDTransferError(f"the prefill process went away ({e})") from None
            except ValueError as e:
                raise PDTransferError(f"unreadable reply from the prefill process ({e})") from None
        if not isinstance(reply, dict) or reply.get("version") != PROTOCOL_VERSION:
            raise PDTransferError(f"the prefill process answered in another protocol: {reply!r}")
        if not reply.get("ok"):
            raise PDTransferError(f"the prefill process refused: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Unregisters the pool from the TransferEngine (the engine itself stays)."""
        if self.engine is not None:
            self.engine.unregister_memory(self.pool_address)
            self.engine = None

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the prefill role --------------------------------------------------------------------------


class KVSender:
    """The prefill side: writes slots of ``cache`` into decode processes' pools.

    Args:
      cache: the prefill cache (host tier, same row layout as the decode caches').
      host, port: where the control socket listens (port 0: a free one; see
        :attr:`address`) and the TransferEngine's host.
      deadline_s: the longest one call waits (accepting and reading a request; sending
        the slot, each write's acknowledgement and the completion message).
      batch_bytes: the most bytes of writes in flight at once; the control connection is
        checked before each write is submitted.
      piece_bytes: the most bytes of one write; longer runs are cut (the engine moves the
        pieces in flight in parallel; see :data:`PIECE_BYTES`).
      transfer_engine, session: a started TransferEngine to share, or None.
    """

    def __init__(
        self,
        cache: OffloadedKVCache,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        deadline_s: float = 30.0,
        batch_bytes: int = 64 << 20,
        piece_bytes: int = PIECE_BYTES,
        transfer_engine: Any = None,
        session: str | None = None,
    ):
        self.deadline_s = _check_deadline(deadline_s)
        for name, value in (("batch_bytes", batch_bytes), ("piece_bytes", piece_bytes)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        self.piece_bytes = int(piece_bytes)
        if not is_int(port) or not 0 <= port < 65536:
            raise ValueError(f"port={port!r} must be an int in [0, 65535]")
        self.cache = cache
        self.pool_address, self.pool_bytes = _check_cache(cache, "KVSender")
        if (transfer_engine is None) != (session is None):
            raise ValueError("give transfer_engine and its session together, or neither")
        self.batch_bytes = int(batch_bytes)
        self.layout = layout_of(cache)
        self._listener = socket.create_server((host, port))
        try:
            if transfer_engine is None:
                transfer_engine, session = _start_engine(host, self.deadline_s)
            self.engine = transfer_engine
            self.session = session
            _register(self.engine, self.pool_address, self.pool_bytes, "KVSender")
        except BaseException:
            self._listener.close()
            raise
        self.address = "%s:%d" % self._listener.getsockname()[:2]
        self.sent = 0
        self.failed = 0
        self._warm: set[str] = set()  # Sessions already written to (connection open).

    def accept(self, timeout: float | None = None) -> PrefillRequest:
        """The next request (waits at most ``timeout`` s, default the deadline), checked:
        a request in another protocol or for another layout is answered with an error and
        raises :class:`PDTransferError`, as does no request in time."""
        wait = self.deadline_s if timeout is None else _check_deadline(timeout)
        self._listener.settimeout(wait)
        try:
            conn, peer = self._listener.accept()
        except TimeoutError:
            raise PDTransferError(f"no P/D request within {wait:.3g} s") from None
        deadline = time.monotonic() + self.deadline_s
        peer = "%s:%d" % peer[:2]
        try:
            message = recv_message(conn, deadline)
        except Exception as e:  # noqa: BLE001 - a peer that sent nothing readable.
            conn.close()
            raise PDTransferError(f"reading a P/D request from {peer}: {e}") from None
        request = PrefillRequest(
            tokens=np.zeros(0, np.int64), start=0, session="", runs=[], peer=peer, conn=conn
        )
        problem = self._check_request(message)
        if problem is not None:
            self.fail(request, problem)
            raise PDTransferError(f"refused a P/D request from {peer}: {problem}")
        request.tokens = np.asarray(message["tokens"], np.int64)
        request.start = message["start"]
        request.session = message["session"]
        request.runs = message["runs"]
        return request

    def _check_request(self, m: Any) -> str | None:
        if not isinstance(m, dict) or m.get("version") != PROTOCOL_VERSION:
            return f"not a version-{PROTOCOL_VERSION} P/D request"
        if m.get("layout") != self.layout:
            return f"layout {m.get('layout')!r} is not this cache's {self.layout!r}"
        tokens, start = m.get("tokens"), m.get("start")
        if not (isinstance(tokens, list) and tokens and all(is_int(t) for t in tokens)):
            return "tokens must be a non-empty list of ints"
        if not (is_int(start) and 0 <= start < len(tokens)):
            return f"start={start!r} must be in [0, {len(tokens)})"
        runs = m.get("runs")
        regions = 2 * self.layout["num_layers"]
        want = (len(tokens) - start) * self.layout["row_bytes"]
        if not (
            isinstance(runs, list)
            and len(runs) == regions
            and all(
                isinstance(region, list)
                and all(
                    isinstance(r, list) and len(r) == 2 and all(is_int(v) and v > 0 for v in r)
                    for r in region
                )
                and sum(r[1] for r in region) == want
                for region in runs
            )
        ):
            return f"runs must be {regions} lists of [address, bytes] covering {want} bytes each"
        if not isinstance(m.get("session"), str) or not m["session"]:
            return "session must be a non-empty string"
        return None

    def fail(self, request: PrefillRequest, reason: str) -> None:
        """Tells the decode process the request failed (best effort) and closes it."""
        conn, request.conn = request.conn, None
        if conn is None:
            return
        self.failed += 1
        try:
            send_message(
                conn,
                dict(version=PROTOCOL_VERSION, ok=False, error=str(reason)),
                time.monotonic() + self.deadline_s,
            )
        except OSError as e:
            logger.debug("telling %s that its request failed: %s", request.peer, e)
        finally:
            conn.close()

    def send(
        self, request: PrefillRequest, state: KVState, slot: int, *, extra: Any = None
    ) -> tuple[KVState, Sent]:
        """Writes positions ``[request.start, len(request.tokens))`` of ``slot`` (which
        holds at least that many tokens in ``state``) into the decode pool, then the
        completion message with ``extra`` (JSON); returns the live state.

        Raises:
          PDTransferError: a write or the message failed (the decode side was told when
            it could still be reached); ValueError: ``slot`` holds too few tokens.
        """
        if request.answered:
            raise ValueError("this request was already answered")
        begin = time.monotonic()
        cache = self.cache
        n = int(request.tokens.size)
        length = int(np.asarray(state.lengths)[slot])
        if length < n:
            self.fail(request, f"the prefill slot holds {length} tokens, not {n}")
            raise ValueError(f"slot {slot} holds {length} tokens; the request needs {n}")
        state = cache.drain(state)
        cache.engine.drain()  # The step's write-backs are on the tier.
        try:
            pairs = self._pairs(slot, request)
            nbytes = sum(p[2] for p in pairs)
            self._write(request, pairs)
            send_message(
                request.conn,
                dict(version=PROTOCOL_VERSION, ok=True, nbytes=nbytes, extra=extra),
                time.monotonic() + self.deadline_s,
            )
        except Exception as e:
            reason = e if isinstance(e, PDTransferError) else f"{type(e).__name__}: {e}"
            self.fail(request, f"writing the KV failed: {reason}")
            raise PDTransferError(
                f"P/D transfer of slot {slot} to {request.peer} failed: {reason}"
            ) from e
        conn, request.conn = request.conn, None
        conn.close()
        self.sent += 1
        return state, Sent(nbytes=nbytes, segments=len(pairs), seconds=time.monotonic() - begin)

    def _pairs(self, slot: int, request: PrefillRequest) -> list[tuple[int, int, int]]:
        """(source address, destination address, bytes) writes: each region's source runs
        and destination runs walked together, split where either one ends."""
        out = []
        n = int(request.tokens.size)
        sources = pool_runs(self.cache, self.pool_address, slot, request.start, n)
        for region, src in enumerate(sources):
            dst = [list(r) for r in request.runs[region]]
            i = j = 0
            while i < len(src) and j < len(dst):
                size = min(src[i][1], dst[j][1], self.piece_bytes)
                out.append((src[i][0], dst[j][0], size))
                for run in (src[i], dst[j]):
                    run[0] += size
                    run[1] -= size
                i += src[i][1] == 0
                j += dst[j][1] == 0
        return out

    def _write(self, request: PrefillRequest, pairs: list[tuple[int, int, int]]) -> None:
        """The writes, one engine request per piece, up to ``batch_bytes`` in flight; each
        piece must be acknowledged within the deadline of its submission. Stops when the
        decode side closed the control connection (it gave up; checked before every
        submission) or a write fails.

        Completion is polled with short sleeps: the engine's blocking batch wait spins a
        core, which on a small machine takes it from the engine's own threads and the
        receiver. Each piece is its own request because some engine versions report a
        multi-request batch's status from its first request only."""
        engine, session = self.engine, request.session
        if session not in self._warm and pairs:
            # The first write to a session opens the engine's connection (handshake) and is
            # slow; one small write first, bounded, so the rest starts on a warm connection.
            src, dst, size = pairs[0]
            first = (src, dst, min(size, WARMUP_BYTES))
            rc = _bounded(
                lambda: engine.transfer_sync_write(session, *first),
                self.deadline_s,
                f"the first write to {session}",
            )
            if rc != 0:
                raise PDTransferError(
                    f"the TransferEngine's writes to {session} failed ({rc}): the decode "
                    f"process is gone or refused the addresses"
                )
            self._warm.add(session)
        pending: dict[int, tuple[int, float]] = {}  # request id -> (bytes, submitted at)
        in_flight = 0
        pause = _POLL_MIN_S
        i = 0
        while i < len(pairs) or pending:
            while i < len(pairs) and (not pending or in_flight + pairs[i][2] <= self.batch_bytes):
                ready, _, _ = select.select([request.conn], [], [], 0)
                if ready:  # The decode side only ever closes the connection before our reply.
                    raise PDTransferError("the decode process closed the connection (it gave up)")
                src, dst, size = pairs[i]
                rid = engine.transfer_submit_write(session, src, dst, size)
                if rid < 0:
                    raise PDTransferError(
                        f"submitting a write to {session} returned {rid}: the decode process "
                        f"is gone or refused the addresses"
                    )
                pending[rid] = (size, time.monotonic())
                in_flight += size
                i += 1
            done = []
            for rid, (size, submitted) in pending.items():
                status = engine.transfer_check_status(rid)
                if status == 1:
                    done.append(rid)
                elif status < 0:
                    raise PDTransferError(
                        f"the TransferEngine's writes to {session} failed ({status}): the "
                        f"decode process is gone or refused the addresses"
                    )
                elif time.monotonic() - submitted > self.deadline_s:
                    raise PDTransferError(
                        f"a write of {size} bytes to {session} was not acknowledged within "
                        f"{self.deadline_s:.3g} s"
                    )
            for rid in done:
                in_flight -= pending.pop(rid)[0]
            if done:
                pause = _POLL_MIN_S
            elif pending:
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)

    def serve_one(
        self,
        state: KVState,
        prefill: Callable[[KVState, np.ndarray], tuple[KVState, int, Any]],
        *,
        timeout: float | None = None,
    ) -> tuple[KVState, int, Sent]:
        """Accepts one request, runs ``prefill(state, tokens) -> (state, slot, extra)``
        (computes the prompt's KV into ``slot`` of this cache; ``extra``: JSON for the
        decode side, e.g. the first token) and sends it; returns the state, the slot (the
        caller releases it) and what was sent. A ``prefill`` that raises fails the
        request (the decode side is told why) and the error propagates."""
        request = self.accept(timeout)
        try:
            state, slot, extra = prefill(state, request.tokens)
        except BaseException as e:
            self.fail(request, f"the prefill raised {type(e).__name__}: {e}")
            raise
        state, sent = self.send(request, state, slot, extra=extra)
        return state, slot, sent

    def close(self) -> None:
        """Stops listening and unregisters the pool (the engine itself stays)."""
        self._listener.close()
        if self.engine is not None:
            self.engine.unregister_memory(self.pool_address)
            self.engine = None

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
