"""The prefill side's writes in P/D transfer (:mod:`jax_tpusync.pd.transfer`): a slot's
source runs and the decode side's destination runs walked together into pieces, and the
pieces written, one-sided, through a TransferEngine: at most ``batch_bytes`` in flight,
each acknowledged within the deadline, stopping as soon as the decode side gave up.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any, Protocol

from jax_tpusync.pd.channel import PDTransferError, bounded

# One engine write's most bytes: 4 MiB pieces, all in flight, measured fastest over TCP on a
# 2-core machine (1 MiB pieces cost more per-request overhead, 16 MiB ones less parallelism).
PIECE_BYTES = 4 << 20
WARMUP_BYTES = 4096  # The first write to a new session (it opens the engine's connection).
_POLL_MIN_S, _POLL_MAX_S = 1e-4, 1e-3  # Sleeps between completion polls (doubling).


class WriteRequest(Protocol):
    """What the writes need of the request they answer (a
    :class:`~jax_tpusync.pd.transfer.PrefillRequest`): the decode engine's ``session``, the
    control connection ``conn`` (closed by the decode side once it gave up), and
    ``writes_submitted``, set once any write went to the engine (it may land)."""

    session: str
    conn: socket.socket | None
    writes_submitted: bool


def head_pieces(source: dict, destination: dict, piece_bytes: int) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) writes of one head range: each region's
    source runs and destination runs walked together, split where either one ends and at
    ``piece_bytes``.

    Args:
      source, destination: ``{"heads": [lo, hi], "runs": per region (layer * 2 + K|V)
        [[address, bytes], ...]}`` of the same head range, here and in the decode process.
      piece_bytes: the most bytes of one write.
    """
    if list(source["heads"]) != destination["heads"]:  # accept() checked the order; kept so.
        raise ValueError(
            f"heads {destination['heads']} sent to the pool of heads {tuple(source['heads'])}"
        )
    out = []
    for region, src in enumerate(source["runs"]):
        src = [list(r) for r in src]
        dst = [list(r) for r in destination["runs"][region]]
        i = j = 0
        while i < len(src) and j < len(dst):
            size = min(src[i][1], dst[j][1], piece_bytes)
            out.append((src[i][0], dst[j][0], size))
            for run in (src[i], dst[j]):
                run[0] += size
                run[1] -= size
            i += src[i][1] == 0
            j += dst[j][1] == 0
    return out


class PieceWriter:
    """Writes pieces into decode processes' registered memory through ``engine``; knows
    which sessions it already opened a connection to.

    Args:
      engine: a started ``mooncake.engine.TransferEngine`` (the pieces' sources registered
        with it).
      deadline_s: how long each piece may wait for its acknowledgement (from its
        submission), and the first write to a session in all.
      batch_bytes: the most bytes of writes in flight at once.
    """

    def __init__(self, engine: Any, *, deadline_s: float, batch_bytes: int):
        self.engine = engine
        self.deadline_s = deadline_s
        self.batch_bytes = batch_bytes
        self.warm: set[str] = set()  # Sessions already written to (connection open).

    def write(self, request: WriteRequest, pieces: list[tuple[int, int, int]]) -> None:
        """The writes, one engine request per piece, up to ``batch_bytes`` in flight; each
        piece must be acknowledged within the deadline of its submission. Stops when the
        decode side closed the control connection (it gave up; checked before every
        submission) or a write fails (:class:`PDTransferError`, naming the session).

        Completion is polled with short sleeps: the engine's blocking batch wait spins a
        core, which on a small machine takes it from the engine's own threads and the
        receiver. Each piece is its own request because some engine versions report a
        multi-request batch's status from its first request only."""
        engine, session = self.engine, request.session
        if session not in self.warm and pieces:
            self._open(request, pieces[0])
        pending: dict[int, tuple[int, float]] = {}  # request id -> (bytes, submitted at)
        in_flight = 0
        pause = _POLL_MIN_S
        i = 0
        while i < len(pieces) or pending:
            while i < len(pieces) and (not pending or in_flight + pieces[i][2] <= self.batch_bytes):
                ready, _, _ = select.select([request.conn], [], [], 0)
                if ready:  # The decode side only ever closes the connection before our reply.
                    raise PDTransferError("the decode process closed the connection (it gave up)")
                src, dst, size = pieces[i]
                request.writes_submitted = True
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

    def _open(self, request: WriteRequest, piece: tuple[int, int, int]) -> None:
        """The first write to a session opens the engine's connection (handshake) and is
        slow: one small write first, bounded, so the rest starts on a warm connection."""
        engine, session = self.engine, request.session
        src, dst, size = piece
        first = (src, dst, min(size, WARMUP_BYTES))
        request.writes_submitted = True
        rc = bounded(
            lambda: engine.transfer_sync_write(session, *first),
            self.deadline_s,
            f"the first write to {session}",
        )
        if rc != 0:
            raise PDTransferError(
                f"the TransferEngine's writes to {session} failed ({rc}): the decode "
                f"process is gone or refused the addresses"
            )
        self.warm.add(session)
