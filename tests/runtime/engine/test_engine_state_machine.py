"""A hypothesis state machine drives one engine tier against a pure-Python model.

The model is the tier's byte image (plus a mask of bytes whose value is known), the set of
allocated block extents, and the outstanding tickets. Transfers are submitted without
waiting, so the engine's hazard ordering is what makes every read match the model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jax_tpusync import TpusyncError
from jax_tpusync.runtime.engine import Engine

# Deterministic for CI: the same examples on every run, nothing read from or saved to disk.
CI_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    stateful_step_count=30,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow],
)

BLOCK = 1000  # Odd: block edges never coincide with 4 KiB pages.
NUM_BLOCKS = 24
CAP = BLOCK * NUM_BLOCKS
MAX_IO = 9000


@dataclasses.dataclass
class Pending:
    write: bool
    lo: int
    hi: int
    seq: int
    buffer: np.ndarray
    expected: np.ndarray | None = None  # Reads: the model bytes at submission.
    known: np.ndarray | None = None  # Reads: which of those are defined.
    cancelled: bool = False


class EngineMachine(RuleBasedStateMachine):
    KIND = "host"
    DIRECTORY = None

    def __init__(self):
        super().__init__()
        self.engine = Engine(num_workers=3, io_chunk_bytes=4096)
        if self.KIND == "host":
            self.tier = self.engine.add_host_tier(block_bytes=BLOCK, num_blocks=NUM_BLOCKS)
        else:
            self.tier = self.engine.add_file_tier(
                self.DIRECTORY, block_bytes=BLOCK, num_blocks=NUM_BLOCKS
            )
            assert self.engine.tier_info(self.tier).direct_io
        self.engine.write(self.tier, 0, np.zeros(CAP, np.uint8))
        self.image = np.zeros(CAP, np.uint8)
        self.known = np.ones(CAP, bool)
        self.allocs: dict[int, int] = {}  # first block -> count
        self.pending: dict[int, Pending] = {}
        self.consumed: list[int] = []
        self.seq = 0

    # -- model helpers --------------------------------------------------------------------

    def _used(self) -> np.ndarray:
        used = np.zeros(NUM_BLOCKS, bool)
        for first, count in self.allocs.items():
            assert not used[first : first + count].any(), "model: overlapping allocations"
            used[first : first + count] = True
        return used

    def _first_fit(self, count: int) -> int | None:
        used = self._used()
        for s in range(NUM_BLOCKS - count + 1):
            if not used[s : s + count].any():
                return s
        return None

    def _pick(self, items, index):
        items = sorted(items)
        return items[index % len(items)]

    def _new_ticket(self, ticket: int) -> None:
        assert ticket > 0
        assert ticket not in self.pending and ticket not in self.consumed, "ticket reused"

    def _check_read(self, p: Pending) -> None:
        got = p.buffer[p.known]
        want = p.expected[p.known]
        if not np.array_equal(got, want):
            bad = np.flatnonzero(p.buffer != p.expected)
            bad = bad[p.known[bad]]
            raise AssertionError(
                f"read [{p.lo}, {p.hi}) differs from the model at tier bytes "
                f"{(bad[:8] + p.lo).tolist()} (of {bad.size})"
            )

    def _finish(self, ticket: int) -> None:
        p = self.pending.pop(ticket)
        try:
            self.engine.wait(ticket)
        except TpusyncError as e:
            assert p.cancelled and "cancelled" in str(e), str(e)
        else:
            if not p.write:
                self._check_read(p)
        self.consumed.append(ticket)

    # -- allocator ------------------------------------------------------------------------

    @rule(count=st.integers(1, 8), named=st.booleans())
    def allocate(self, count, named):
        expected = self._first_fit(count)
        name = f"r{len(self.allocs)}-{count}" if named else None
        if name is not None and name in self.engine.tier_info(self.tier).regions:
            name = None
        if expected is None:
            with pytest.raises(TpusyncError, match="tier full"):
                self.engine.allocate(self.tier, count, name=name)
            return
        first = self.engine.allocate(self.tier, count, name=name)
        assert first == expected, "first fit"
        self.allocs[first] = count
        self._used()  # Asserts the new extent overlaps no other.

    @precondition(lambda self: self.allocs)
    @rule(index=st.integers(0, 1 << 16))
    def free(self, index):
        first = self._pick(self.allocs, index)
        self.engine.free(self.tier, first, self.allocs.pop(first))

    @precondition(lambda self: len(self.allocs) < NUM_BLOCKS)
    @rule(index=st.integers(0, 1 << 16), count=st.integers(1, 3))
    def double_free(self, index, count):
        used = self._used()
        free_blocks = np.flatnonzero(~used)
        if free_blocks.size == 0:
            return
        b = int(free_blocks[index % free_blocks.size])
        count = min(count, NUM_BLOCKS - b)
        with pytest.raises(TpusyncError, match="double free"):
            self.engine.free(self.tier, b, count)

    # -- transfers ------------------------------------------------------------------------

    @precondition(lambda self: self.allocs)
    @rule(
        index=st.integers(0, 1 << 16),
        start=st.integers(0, 1 << 20),
        length=st.integers(1, MAX_IO),
        seed=st.integers(0, 1 << 30),
        odd_memory=st.booleans(),
        split=st.integers(1, 3),
    )
    def submit_write(self, index, start, length, seed, odd_memory, split):
        first = self._pick(self.allocs, index)
        region_lo, region_hi = first * BLOCK, (first + self.allocs[first]) * BLOCK
        lo = region_lo + start % (region_hi - region_lo)
        hi = min(region_hi, lo + length)
        data = np.random.default_rng(seed).integers(0, 256, size=hi - lo + 1, dtype=np.uint8)
        data = data[1:] if odd_memory else data[:-1]
        # Several segments per request: contiguous pieces of the range, listed in reverse.
        cuts = np.linspace(0, hi - lo, split + 1).astype(int)
        segs = [(lo + a, a, b - a) for a, b in zip(cuts, cuts[1:])][::-1]
        ticket = self.engine.submit_write(self.tier, segs, data)
        self._new_ticket(ticket)
        self.image[lo:hi] = data
        self.known[lo:hi] = True
        self.seq += 1
        self.pending[ticket] = Pending(True, lo, hi, self.seq, data)

    @rule(start=st.integers(0, CAP - 1), length=st.integers(1, MAX_IO), odd_memory=st.booleans())
    def submit_read(self, start, length, odd_memory):
        lo, hi = start, min(CAP, start + length)
        buf = np.full(hi - lo + 1, 0x5A, np.uint8)
        buf = buf[1:] if odd_memory else buf[:-1]
        ticket = self.engine.submit_read(self.tier, [(lo, 0, hi - lo)], buf)
        self._new_ticket(ticket)
        self.seq += 1
        self.pending[ticket] = Pending(
            False, lo, hi, self.seq, buf, self.image[lo:hi].copy(), self.known[lo:hi].copy()
        )

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 1 << 16))
    def wait(self, index):
        self._finish(self._pick(self.pending, index))

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 1 << 16))
    def poll(self, index):
        ticket = self._pick(self.pending, index)
        assert self.engine.poll(ticket) in (True, False)

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 1 << 16))
    def cancel(self, index):
        ticket = self._pick(self.pending, index)
        p = self.pending[ticket]
        self.engine.cancel(ticket)
        p.cancelled = True
        if p.write:
            # The write may land fully, partly or not at all: those bytes are now unknown, in
            # the image and for every read queued after the write.
            self.known[p.lo : p.hi] = False
            for q in self.pending.values():
                if not q.write and q.seq > p.seq:
                    lo, hi = max(p.lo, q.lo), min(p.hi, q.hi)
                    if lo < hi:
                        q.known[lo - q.lo : hi - q.lo] = False

    @precondition(lambda self: self.consumed)
    @rule(index=st.integers(0, 1 << 16))
    def wait_again(self, index):
        ticket = self.consumed[index % len(self.consumed)]
        with pytest.raises(TpusyncError, match="unknown ticket"):
            self.engine.wait(ticket)

    @rule()
    def drain(self):
        self.engine.drain()
        for ticket in self.pending:
            assert self.engine.poll(ticket)

    # -- invariants and teardown ----------------------------------------------------------

    @invariant()
    def free_block_count_matches(self):
        assert self.engine.tier_info(self.tier).free_blocks == NUM_BLOCKS - int(self._used().sum())

    def teardown(self):
        try:
            for ticket in sorted(self.pending):
                self._finish(ticket)
            out = np.zeros(CAP, np.uint8)
            self.engine.read(self.tier, 0, out)
            np.testing.assert_array_equal(out[self.known], self.image[self.known])
            for ticket in self.consumed[-5:]:
                with pytest.raises(TpusyncError, match="unknown ticket"):
                    self.engine.wait(ticket)
        finally:
            self.engine.close()


@pytest.mark.parametrize("kind", ("host", "file_direct"))
def test_engine_matches_model(kind, file_dir):
    machine = type(f"EngineMachine_{kind}", (EngineMachine,), {"KIND": kind, "DIRECTORY": file_dir})
    run_state_machine_as_test(machine, settings=CI_SETTINGS)
