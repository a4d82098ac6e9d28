"""Prefill-to-decode (P/D) transfer: a prefill process computes a sequence's KV into its own
cache and writes it, one-sided, into the blocks a decode process reserved in its cache's
host pool, over a Mooncake TransferEngine.

Two roles, one object each:

* :class:`KVReceiver` (the decode process): registers its cache's host pool with a
  TransferEngine; :meth:`KVReceiver.receive` reserves a slot for the prompt, sends the
  prefill process the prompt, its session and where each (layer, K|V) run of the slot's
  blocks lies in the pool, waits for the completion message, then admits the slot at the
  prompt's length. A failure cancels the reservation (the slot stays inactive) and raises
  :class:`PDTransferError` saying why; see "Late writes" for its blocks.
* :class:`KVSender` (the prefill process): registers its own pool, listens for requests
  on a control socket; :meth:`KVSender.accept` takes one, the caller prefills the prompt
  into a slot of its cache, and :meth:`KVSender.send` writes that slot's rows straight from
  its pool into the decode pool (no copy on either side), then sends the completion
  message (with any JSON the caller adds, e.g. the first sampled token).
  :meth:`KVSender.serve_one` does the three.

Mesh caches: either side may be a :class:`~jax_tpusync.ShardedKVCache`. Each head shard's
pool is registered, the request carries the runs of each head range's pool, and the
sender writes each of its head shards' rows into the decode pool of the same head range
(no shard sends another's heads). Both sides must split the heads the same way (the
layout's ``head_split``) and all of a slot's head shards must be in the one process on
each side; the batch split may differ.

Control channel: one TCP connection per transfer carrying length-prefixed JSON (a 4-byte
big-endian length, then UTF-8): the request (protocol version, token ids, the first
position to send, the decode engine's session, the layout, per head range the destination
runs) and one reply (``ok`` with the bytes written, per head range too, the xxh3-64 of
those bytes per head range, and the caller's JSON; or an error and whether any write was
submitted). The bytes themselves go only through the TransferEngine. The completion
message is sent after every write returned success, so a slot is admitted only with whole
blocks.

Checksums: the count alone would admit a peer that reported it without writing, or wrote
other bytes. So the sender hashes the bytes it writes (xxh3-64 per head range, while its
writes are in flight), and the receiver hashes the bytes that landed (the slot's blocks, or
the staging buffer) before it admits: a mismatch is a :class:`PDTransferError` naming the
checksum and the head range, and changes nothing (the slot is unadmitted, its blocks held
aside as after any failure once the request went out). See
:mod:`jax_tpusync.pd.checksum`.

If the decode cache already holds a prefix of the prompt (its prefix index), only the rest
is sent: the request's first position is the reservation's cached length.

Deadlines: every socket operation and every TransferEngine call is bounded by
``deadline_s``; a killed peer (connection refused or reset, a failed write) or a hung one
(no answer in time) is a :class:`PDTransferError` naming the peer and what did not
happen. Unless the environment sets them, ``MC_TCP_PROGRESS_TIMEOUT_SEC`` and
``MC_TCP_STATUS_TIMEOUT_SEC`` default to the deadline so the engine's own transfers end
too. The sender keeps at most ``batch_bytes`` of writes in flight and checks the control
connection before each write: once the decode side has given up (closed it), a prefill
process that was paused and resumes stops at its next write.

Late writes: writes already in flight when the decode side gives up can still land (the
engine's TCP timeouts end them). So once the request went out, a failed receive holds the
blocks it named (the positions to be written, not a mapped prefix) out of the cache's
allocator for ``quarantine_s`` (default twice the engine's longest TCP timeout plus 1 s)
while the slot itself is inactive; :meth:`KVReceiver.reclaim` (called by every receive,
and waiting by :meth:`KVReceiver.close`) frees them once that time has passed, and a
receive into a slot still in quarantine is refused. A failure before the request went out
(the prefill process cannot be reached), or a refusal the sender answered before it
submitted any write, frees them at once. The quarantine covers writes the engine ends
within its timeouts; a prefill process frozen for longer than the quarantine, with writes
submitted, may still land them when it resumes (its timers were frozen too): keep
``batch_bytes`` small where that is a real risk, or raise ``quarantine_s``.

Both caches must have the same layout (layers, heads and their split over shards, head
size, dtype, block size; checked, a refusal names each field that differs) on a host tier
(the pool must be mapped memory); a cache that keeps only its window
(``max_step_tokens``) and a two-level cache's spill blocks are refused.

The control channel's messages are in :mod:`jax_tpusync.pd.channel`; where a cache's KV
lies (its pools per head range, a slot's runs) in :mod:`jax_tpusync.pd.pools`; where a
slot's rows land or come from, chosen once by the kind of cache, in
:mod:`jax_tpusync.pd.endpoint` (an engine cache's own pools:
:mod:`jax_tpusync.pd.tier_endpoint`; a host-pool cache's staging buffer:
:mod:`jax_tpusync.pd.pool_staging`); the blocks held aside after a failure in
:mod:`jax_tpusync.pd.quarantine`; the prefill side's write loop in
:mod:`jax_tpusync.pd.writes`.

Never fork a process after an engine started here (it runs many threads): start helper
processes with ``subprocess`` or the ``spawn`` start method.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np

from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.caches.offloaded.mesh import ShardedKVCache
from jax_tpusync.core.config import is_int
from jax_tpusync.core.state import KVState
from jax_tpusync.pd.channel import (
    PROTOCOL_VERSION,
    PDTransferError,
    check_deadline,
    check_host,
    check_session,
    decode_tokens,
    encode_tokens,
    engine_tcp_timeout_s,
    recv_message,
    send_message,
    split_address,
    start_engine,
)
from jax_tpusync.pd.checksum import checksum_mismatch, start_head_checksums
from jax_tpusync.pd.endpoint import SlotRowsEndpoint, slot_rows_endpoint
from jax_tpusync.pd.pool_staging import PoolStaging
from jax_tpusync.pd.pools import layout_mismatch, layout_of
from jax_tpusync.pd.quarantine import default_quarantine_s
from jax_tpusync.pd.writes import PIECE_BYTES, PieceWriter, head_pieces

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Received:
    """What :meth:`KVReceiver.receive` admitted: ``slot`` at ``length`` tokens, of which
    ``cached`` were already in the decode cache (prefix index) and the rest, ``nbytes``
    bytes (``head_bytes``: per head range, in head order), were written by the prefill
    process in ``seconds`` (request to completion message, the checksum included);
    ``extra``: the JSON the prefill side sent with it; ``checksum_s``: of those seconds,
    the time spent checking the bytes received against the prefill side's checksum."""

    slot: int
    length: int
    cached: int
    nbytes: int
    seconds: float
    extra: Any
    head_bytes: tuple[int, ...] = ()
    checksum_s: float = 0.0


@dataclasses.dataclass
class PrefillRequest:
    """A request :meth:`KVSender.accept` took: prefill ``tokens`` (int64[n]) and send
    positions ``[start, n)``. Answer it with :meth:`KVSender.send` or
    :meth:`KVSender.fail`."""

    tokens: np.ndarray
    start: int
    session: str
    # Per head range, in head order: {"heads": [lo, hi], "runs": per region (layer * 2 +
    # K|V) [[address, bytes], ...] in the decode pool of that head range}.
    shards: list
    peer: str
    conn: socket.socket | None = dataclasses.field(default=None, repr=False)
    writes_submitted: bool = False  # Whether any write went to the engine (may land).

    @property
    def answered(self) -> bool:
        return self.conn is None


@dataclasses.dataclass(frozen=True)
class Sent:
    """What :meth:`KVSender.send` wrote: ``nbytes`` (``head_bytes``: per head range, in
    head order) in ``segments`` writes, ``seconds``; ``checksums``: the xxh3-64 of those
    bytes per head range (16 hex digits each), sent with the completion message, computed
    in ``checksum_s`` while the writes were in flight."""

    nbytes: int
    segments: int
    seconds: float
    head_bytes: tuple[int, ...] = ()
    checksums: tuple[str, ...] = ()
    checksum_s: float = 0.0


# -- the decode role ---------------------------------------------------------------------------


class _Role:
    """What both roles share: the memory a slot's rows pass through (``endpoint``: the
    cache's pools, or a host-pool cache's staging buffer) registered with a TransferEngine
    (``engine``), unregistered at close; a context manager."""

    engine: Any
    endpoint: SlotRowsEndpoint

    @property
    def staging(self) -> PoolStaging | None:
        """The staging buffer a host-pool cache's rows pass through (None: an engine cache,
        whose rows land in and leave from its own pools)."""
        return self.endpoint.staging

    def _unregister(self) -> None:
        if self.engine is not None:
            self.endpoint.unregister()
            self.engine = None

    def close(self) -> None:
        self._unregister()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(_Role):
    """The decode side: receives sequences' KV into ``cache``'s host pool (a mesh cache:
    each head shard's pool receives its heads).

    Args:
      cache: the decode cache (host tier, same layout as the prefill cache's: row layout
        and head split), an :class:`~jax_tpusync.OffloadedKVCache` or a
        :class:`~jax_tpusync.ShardedKVCache`.
      host: the address the prefill process reaches this engine at (its NIC's address when
        the two run on different hosts).
      deadline_s: the longest one :meth:`receive` waits in all (connect, request, the
        prefill itself and the writes, the completion message).
      quarantine_s: how long a failed transfer's blocks are held aside once the request
        went out (writes already in flight may still land); None: twice the engine's
        longest TCP timeout plus 1 s (:func:`default_quarantine_s`; the timeouts default
        to the deadline). 0: freed at once.
      transfer_engine: a started ``mooncake.engine.TransferEngine`` to share (one per
        process), with ``session`` its ``host:rpc_port``; None: one is started here.
      clock: the time quarantines are counted in (``time.monotonic``).
      populate: fault the pools' pages in now (their contents kept;
        :func:`jax_tpusync.mooncake.transfer_memory.populate`) rather than during the first
        transfers into them.

    Raises:
      TypeError, ValueError: a cache that cannot take part (the message says why), a bad
        deadline or quarantine, a host that names no machine (empty, blanks, '/') or a
        session that is not ``host:port``.
      ImportError: Mooncake is not installed (the message names the package extra).
    """

    def __init__(
        self,
        cache: OffloadedKVCache | ShardedKVCache,
        *,
        host: str = "127.0.0.1",
        deadline_s: float = 30.0,
        quarantine_s: float | None = None,
        transfer_engine: Any = None,
        session: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        populate: bool = True,
    ):
        self.deadline_s = check_deadline(deadline_s)
        check_host("host", host)
        if session is not None:
            check_session(session)
        if quarantine_s is not None and (
            isinstance(quarantine_s, bool)
            or not isinstance(quarantine_s, (int, float))
            or not (math.isfinite(quarantine_s) and quarantine_s >= 0)
        ):
            raise ValueError(f"quarantine_s={quarantine_s!r} must be None or a finite number >= 0")
        self.cache = cache
        self.clock = clock
        # Checked before an engine starts. The clock is read through this receiver, so
        # one set on it later counts too.
        self.endpoint = slot_rows_endpoint(
            cache,
            "KVReceiver",
            populate_pools=populate,
            populate_staging=populate,
            clock=lambda: self.clock(),
        )
        if (transfer_engine is None) != (session is None):
            raise ValueError("give transfer_engine and its session together, or neither")
        if quarantine_s is None:
            engine_tcp_timeout_s()  # Refuses a bad setting before an engine starts.
        if transfer_engine is None:
            transfer_engine, session = start_engine(host, self.deadline_s)
        self.quarantine_s = default_quarantine_s() if quarantine_s is None else float(quarantine_s)
        self.engine = transfer_engine
        self.session = session
        self.endpoint.register(self.engine)
        self.layout = layout_of(cache)
        self.received = 0
        self.failed = 0

    def destination_runs(self, slot: int, lo: int, hi: int) -> list[list[list[int]]]:
        """Per region (layer * 2 + K|V): ``[address, bytes]`` runs of positions ``[lo,
        hi)`` of ``slot`` in this process's pool (a one-device cache, or a mesh cache of
        one head range; otherwise see :meth:`head_runs`)."""
        heads = self.head_runs(slot, lo, hi)
        if len(heads) != 1:
            raise ValueError(
                f"slot {slot}'s heads lie in {len(heads)} pools (one per head shard): use "
                f"head_runs()"
            )
        return heads[0]["runs"]

    def head_runs(self, slot: int, lo: int, hi: int) -> list[dict]:
        """Per head range of ``slot``, in head order: ``{"heads": [lo, hi], "runs": per
        region [[address, bytes], ...]}`` of positions ``[lo, hi)`` in that range's pool."""
        return self.endpoint.slot_runs(slot, lo, hi)

    @property
    def quarantined(self) -> dict[int, float]:
        """``{slot: seconds until its blocks are freed}`` of the failed transfers whose
        blocks are held aside (see :meth:`reclaim`)."""
        return self.endpoint.quarantined()

    def reclaim(self, wait: bool = False) -> list[int]:
        """Frees the blocks of every quarantine whose time has passed (with ``wait``: of
        every quarantine, after sleeping until the last one's time); returns their slots.
        (A host-pool cache: the staging buffers set aside, no slot.) Runs at the start of
        every :meth:`receive`, and with ``wait`` in :meth:`close`."""
        return self.endpoint.reclaim(wait)

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
          ValueError: a bad slot, tokens, max_tokens or ``prefill`` address (one without
            a host among them), too few free blocks (from the reservation), a slot whose
            last transfer's blocks are still quarantined, or a state the cache refuses
            (TypeError: not a state); nothing changed.
          PDTransferError: the transfer failed (the message says why: among others, bytes
            received that do not match the checksum the prefill process sent); the
            reservation was cancelled: the slot is inactive and ``state`` is still the
            live state.
            Once the request went out, the slot's own blocks stay held aside until the
            quarantine has passed (writes in flight may still land in them); a failure
            before (the prefill process cannot be reached) frees them at once.
        """
        # Admitting into a state the cache refuses would leave the slot reserved.
        self.cache.check(state)
        start_time = time.monotonic()
        deadline = start_time + self.deadline_s
        self.reclaim()
        left = self.endpoint.quarantined().get(slot)
        if left is not None:
            raise ValueError(
                f"slot {slot} is quarantined after a failed transfer (writes may still land in "
                f"its blocks): it frees in {left:.3g} s (reclaim())"
            )
        host, port = split_address(prefill)
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D sequence of ints; got {tokens!r}")
        self.endpoint.check_slot(slot)
        with self.cache.reserving_in(state):  # A spill tier demotes out of state's pool.
            reservation = self.cache.reserve(slot, max_tokens, ids)  # Refused: nothing changed.
        cached = int(reservation.cached)
        n = int(ids.size)
        may_write = False  # Whether the prefill process may have started writing.
        try:
            shards = self.endpoint.landing_runs(slot, cached, n)
            request = {
                "version": PROTOCOL_VERSION,
                "op": "prefill",
                "tokens": encode_tokens(ids),
                "start": cached,
                "session": self.session,
                "layout": self.layout,
                "shards": shards,
            }
            sock = self._connect(host, port, deadline)
            may_write = True
            reply = self._exchange(sock, request, deadline)
            if not reply.get("ok"):
                may_write = reply.get("writes_submitted") is not False
                raise PDTransferError(f"the prefill process refused: {reply.get('error')}")
            want = [sum(r[1] for region in shard["runs"] for r in region) for shard in shards]
            if reply.get("nbytes") != sum(want) or reply.get("head_bytes") != want:
                raise PDTransferError(
                    f"the prefill process reported {reply.get('nbytes')!r} bytes written "
                    f"({reply.get('head_bytes')!r} per head range), expected {sum(want)} "
                    f"({want})"
                )
            # The count adds up; the bytes must too (read where they landed).
            checked = time.perf_counter()
            mismatch = checksum_mismatch(reply.get("head_xxh3_64"), shards)
            checksum_s = time.perf_counter() - checked
            if mismatch is not None:
                raise PDTransferError(mismatch)
        except Exception as e:
            self.failed += 1
            reason = e if isinstance(e, PDTransferError) else f"{type(e).__name__}: {e}"
            if may_write and self.quarantine_s > 0:
                held = self.endpoint.set_aside(reservation, cached, n, self.quarantine_s)
            else:
                self.cache.cancel(reservation)
                held = ""
            raise PDTransferError(
                f"P/D transfer of {n} tokens into slot {slot} from {host}:{port} failed, the "
                f"slot was left unadmitted{held}: {reason}"
            ) from e
        state = self.endpoint.admit(state, reservation, cached, n)
        self.received += 1
        return state, Received(
            slot=slot,
            length=n,
            cached=cached,
            nbytes=sum(want),
            seconds=time.monotonic() - start_time,
            extra=reply.get("extra"),
            head_bytes=tuple(want),
            checksum_s=checksum_s,
        )

    def _connect(self, host: str, port: int, deadline: float) -> socket.socket:
        try:
            return socket.create_connection(
                (host, port), timeout=max(1e-3, deadline - time.monotonic())
            )
        except OSError as e:
            raise PDTransferError(f"cannot reach the prefill process ({e})") from None

    def _exchange(self, sock: socket.socket, request: dict, deadline: float) -> dict:
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
        return reply

    def close(self) -> None:
        """Waits out the quarantines (writes may still land in their blocks) and frees
        them, then unregisters the pools from the TransferEngine (the engine itself
        stays)."""
        self.reclaim(wait=True)
        self._unregister()


# -- the prefill role --------------------------------------------------------------------------


class KVSender(_Role):
    """The prefill side: writes slots of ``cache`` into decode processes' pools (a mesh
    cache: each head shard's rows into the decode pool of the same head range).

    Args:
      cache: the prefill cache (host tier, same layout as the decode caches': row layout
        and head split), an :class:`~jax_tpusync.OffloadedKVCache` or a
        :class:`~jax_tpusync.ShardedKVCache`.
      host, port: where the control socket listens (port 0: a free one; see
        :attr:`address`) and the TransferEngine's host.
      deadline_s: the longest one call waits (accepting and reading a request; sending
        the slot, each write's acknowledgement and the completion message).
      batch_bytes: the most bytes of writes in flight at once; the control connection is
        checked before each write is submitted.
      piece_bytes: the most bytes of one write; longer runs are cut (the engine moves the
        pieces in flight in parallel; see :data:`PIECE_BYTES`).
      transfer_engine, session: a started TransferEngine to share, or None.

    Raises:
      TypeError, ValueError: a cache that cannot take part (the message says why), a bad
        deadline, batch or piece size or port, a host that names no machine (empty,
        blanks, '/') or a session that is not ``host:port``.
    """

    def __init__(
        self,
        cache: OffloadedKVCache | ShardedKVCache,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        deadline_s: float = 30.0,
        batch_bytes: int = 64 << 20,
        piece_bytes: int = PIECE_BYTES,
        transfer_engine: Any = None,
        session: str | None = None,
    ):
        self.deadline_s = check_deadline(deadline_s)
        check_host("host", host)
        if session is not None:
            check_session(session)
        for name, value in (("batch_bytes", batch_bytes), ("piece_bytes", piece_bytes)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        self.piece_bytes = int(piece_bytes)
        if not is_int(port) or not 0 <= port < 65536:
            raise ValueError(f"port={port!r} must be an int in [0, 65535]")
        self.cache = cache
        # The cache's pools were faulted in by its own steps; a staging buffer is new
        # memory the rows are copied into.
        self.endpoint = slot_rows_endpoint(
            cache, "KVSender", populate_pools=False, populate_staging=True
        )
        if (transfer_engine is None) != (session is None):
            raise ValueError("give transfer_engine and its session together, or neither")
        self.batch_bytes = int(batch_bytes)
        self.layout = layout_of(cache)
        self._listener = socket.create_server((host, port))
        try:
            if transfer_engine is None:
                transfer_engine, session = start_engine(host, self.deadline_s)
            self.engine = transfer_engine
            self.session = session
            self.endpoint.register(self.engine)
        except BaseException:
            self._listener.close()
            raise
        self.address = "{}:{}".format(*self._listener.getsockname()[:2])
        self.sent = 0
        self.failed = 0
        self._writer = PieceWriter(
            self.engine, deadline_s=self.deadline_s, batch_bytes=self.batch_bytes
        )

    def accept(self, timeout: float | None = None) -> PrefillRequest:
        """The next request (waits at most ``timeout`` s, default the deadline), checked:
        a request in another protocol or for another layout is answered with an error and
        raises :class:`PDTransferError`, as does no request in time."""
        wait = self.deadline_s if timeout is None else check_deadline(timeout)
        self._listener.settimeout(wait)
        try:
            conn, peer = self._listener.accept()
        except TimeoutError:
            raise PDTransferError(f"no P/D request within {wait:.3g} s") from None
        deadline = time.monotonic() + self.deadline_s
        peer = "{}:{}".format(*peer[:2])
        try:
            message = recv_message(conn, deadline)
        except Exception as e:  # noqa: BLE001 - a peer that sent nothing readable.
            conn.close()
            raise PDTransferError(f"reading a P/D request from {peer}: {e}") from None
        request = PrefillRequest(
            tokens=np.zeros(0, np.int64), start=0, session="", shards=[], peer=peer, conn=conn
        )
        problem = self._check_request(message)
        if problem is not None:
            self.fail(request, problem)
            raise PDTransferError(f"refused a P/D request from {peer}: {problem}")
        request.tokens = decode_tokens(message["tokens"])
        request.start = message["start"]
        request.session = message["session"]
        request.shards = message["shards"]
        return request

    def _check_request(self, m: Any) -> str | None:
        if not isinstance(m, dict) or m.get("version") != PROTOCOL_VERSION:
            return f"not a version-{PROTOCOL_VERSION} P/D request"
        mismatch = layout_mismatch(self.layout, m.get("layout"))
        if mismatch is not None:
            return f"layout differs: {mismatch} (the prefill cache's here, the decode one's there)"
        tokens, start = decode_tokens(m.get("tokens")), m.get("start")
        if tokens is None or not tokens.size:
            return "tokens must be base64 of little-endian int64 ids, at least one"
        if not (is_int(start) and 0 <= start < len(tokens)):
            return f"start={start!r} must be in [0, {len(tokens)})"
        regions = 2 * self.layout["num_layers"]
        want = (len(tokens) - start) * self.layout["row_bytes"]
        split = self.layout["head_split"]
        shards = m.get("shards")
        if not (
            isinstance(shards, list)
            and [s.get("heads") if isinstance(s, dict) else None for s in shards] == split
        ):
            return f"shards must be one per head range {split}, in order"
        for shard in shards:
            runs = shard.get("runs")
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
                return (
                    f"the runs of heads {shard['heads']} must be {regions} lists of "
                    f"[address, bytes] covering {want} bytes each"
                )
        if not isinstance(m.get("session"), str) or not m["session"]:
            return "session must be a non-empty string"
        return None

    def fail(self, request: PrefillRequest, reason: str) -> None:
        """Tells the decode process the request failed, and whether any write was
        submitted (best effort), and closes it."""
        conn, request.conn = request.conn, None
        if conn is None:
            return
        self.failed += 1
        try:
            send_message(
                conn,
                {
                    "version": PROTOCOL_VERSION,
                    "ok": False,
                    "error": str(reason),
                    "writes_submitted": request.writes_submitted,
                },
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
        holds at least that many tokens in ``state``) into the decode pool (a mesh cache:
        each head shard's rows into the decode pool of its head range), then the
        completion message with ``extra`` (JSON) and the checksum of the bytes written;
        returns the live state.

        Raises:
          PDTransferError: a write or the message failed (the decode side was told when
            it could still be reached); ValueError: ``slot`` holds too few tokens, or is
            not this process's (a mesh cache must hold all of its head shards).
        """
        if request.answered:
            raise ValueError("this request was already answered")
        begin = time.monotonic()
        cache = self.cache
        n = int(request.tokens.size)
        try:
            self.endpoint.check_slot(slot)
        except ValueError as e:
            self.fail(request, f"the prefill slot cannot be sent: {e}")
            raise
        length = int(cache.lengths(state)[slot])
        if length < n:
            self.fail(request, f"the prefill slot holds {length} tokens, not {n}")
            raise ValueError(f"slot {slot} holds {length} tokens; the request needs {n}")
        state = cache.drain(state)
        try:
            sources = self.endpoint.source_runs(state, slot, request.start, n)
            per_head = [
                head_pieces(source, shard, self.piece_bytes)
                for source, shard in zip(sources, request.shards)
            ]
            head_bytes = [sum(p[2] for p in pieces) for pieces in per_head]
            pieces = [p for head in per_head for p in head]
            # Hashed while the writes are in flight; waited for even when they fail (the
            # source must outlive the reads).
            checksums = start_head_checksums(sources)
            try:
                self._writer.write(request, pieces)
            finally:
                digests, checksum_s = checksums()
            send_message(
                request.conn,
                {
                    "version": PROTOCOL_VERSION,
                    "ok": True,
                    "nbytes": sum(head_bytes),
                    "head_bytes": head_bytes,
                    "head_xxh3_64": digests,
                    "extra": extra,
                },
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
        return state, Sent(
            nbytes=sum(head_bytes),
            segments=len(pieces),
            seconds=time.monotonic() - begin,
            head_bytes=tuple(head_bytes),
            checksums=tuple(digests),
            checksum_s=checksum_s,
        )

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
        """Stops listening and unregisters the pools (the engine itself stays)."""
        self._listener.close()
        self._unregister()
