"""The checksum of a P/D transfer's bytes (:mod:`jax_tpusync.pd.transfer`): per head range,
the xxh3-64 of the bytes of its runs, region after region (layer * 2 + K|V), read where they
lie in this process's memory.

The prefill side computes it over the bytes it writes (its source runs) and sends it with
the completion message; the decode side computes it over the bytes that landed (its
destination runs: the slot's blocks, or the staging buffer) and admits only when the two
agree. A byte count alone admits a peer that reported the count without writing, or wrote
other bytes. Both sides walk the same bytes in the same order (the runs of a head range
cover the same positions region by region), so equal bytes give equal digests, however
either side's runs are cut.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"  # Named in the completion message's field and in refusals.


def runs_digest(runs: list) -> int:
    """xxh3-64 of the bytes of ``runs`` (per region, ``[[address, bytes], ...]`` in this
    process's memory), region after region. The bytes are read in place (xxhash reads the
    memory without a copy, and without holding the GIL)."""
    hasher = xxhash.xxh3_64()
    for region in runs:
        for address, nbytes in region:
            hasher.update(memoryview((ctypes.c_char * int(nbytes)).from_address(int(address))))
    return hasher.intdigest()


def head_checksums(heads: list[dict]) -> list[str]:
    """Per head range, in head order (``{"heads": [lo, hi], "runs": per region [[address,
    bytes], ...]}``): the xxh3-64 of its runs' bytes as 16 hex digits (JSON has no 64-bit
    ints)."""
    return [f"{runs_digest(head['runs']):016x}" for head in heads]


def start_head_checksums(heads: list[dict]) -> Callable[[], tuple[list[str], float]]:
    """Starts :func:`head_checksums` of ``heads`` on a thread (the prefill side hashes while
    its writes are in flight: xxhash does not hold the GIL); returns the function that
    waits for it and returns the checksums and the seconds they took. Always call it, even
    when the writes failed: the memory read must outlive the hashing."""
    out: list = []

    def run() -> None:
        begin = time.perf_counter()
        try:
            out.append((True, head_checksums(heads), time.perf_counter() - begin))
        except BaseException as e:  # noqa: BLE001 - handed to the caller.
            out.append((False, e, 0.0))

    thread = threading.Thread(target=run, name="pd-checksum", daemon=True)
    thread.start()

    def result() -> tuple[list[str], float]:
        thread.join()
        ok, value, seconds = out[0]
        if not ok:
            raise value
        return value, seconds

    return result


def checksum_mismatch(sent: Any, heads: list[dict]) -> str | None:
    """Why the bytes of ``heads`` (the runs the writes landed in) are not the ones the
    prefill side reported (``sent``: its per-head-range checksums, as received); None when
    every head range's bytes match."""
    if not (
        isinstance(sent, list)
        and len(sent) == len(heads)
        and all(isinstance(s, str) and len(s) == 16 for s in sent)
    ):
        return (
            f"the completion message has no {ALGORITHM} checksum per head range of the bytes "
            f"written (16 hex digits each, {len(heads)} of them): got {sent!r}"
        )
    try:
        want = [int(s, 16) for s in sent]
    except ValueError:
        return f"the completion message's {ALGORITHM} checksums are not hex: {sent!r}"
    for head, digest in zip(heads, want):
        got = runs_digest(head["runs"])
        if got != digest:
            return (
                f"the bytes received for heads {head['heads']} do not match the {ALGORITHM} "
                f"checksum the prefill process sent ({got:016x} here, {digest:016x} sent): the "
                f"byte count adds up, but these are not the bytes it wrote"
            )
    return None
