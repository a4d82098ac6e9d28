"""Memory given to a transfer engine: registrations counted per (engine, address), and
populated pages that keep their bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jax_tpusync.mooncake import transfer_memory


class FakeEngine:
    """register_memory / unregister_memory as an engine answers them: overlapping
    ranges are refused (-600)."""

    def __init__(self):
        self.ranges: dict[int, int] = {}
        self.calls: list[tuple] = []

    def register_memory(self, address, nbytes):
        self.calls.append(("register", address, nbytes))
        for a, n in self.ranges.items():
            if a < address + nbytes and address < a + n:
                return -600
        self.ranges[address] = nbytes
        return 0

    def unregister_memory(self, address):
        self.calls.append(("unregister", address))
        del self.ranges[address]


def test_registrations_are_counted_and_reach_the_engine_once():
    engine = FakeEngine()
    assert transfer_memory.register(engine, 4096, 8192) == 0
    assert transfer_memory.register(engine, 4096, 8192) == 0  # A second holder.
    assert transfer_memory.registrations(engine, 4096) == 2
    assert engine.calls == [("register", 4096, 8192)]
    # The same address with another size is refused without asking the engine.
    assert transfer_memory.register(engine, 4096, 4096) == -600
    assert len(engine.calls) == 1
    # An overlapping range at another address: the engine's own refusal, not counted.
    assert transfer_memory.register(engine, 8192, 4096) == -600
    assert transfer_memory.registrations(engine, 8192) == 0
    transfer_memory.unregister(engine, 4096)
    assert engine.ranges == {4096: 8192}  # One holder left.
    transfer_memory.unregister(engine, 4096)
    assert engine.ranges == {} and transfer_memory.registrations(engine, 4096) == 0
    transfer_memory.unregister(engine, 4096)  # Not registered: ignored.
    assert engine.calls[-1] == ("unregister", 4096)


def test_other_engines_count_apart():
    a, b = FakeEngine(), FakeEngine()
    assert transfer_memory.register(a, 1 << 20, 4096) == 0
    assert transfer_memory.register(b, 1 << 20, 4096) == 0
    transfer_memory.unregister(a, 1 << 20)
    assert a.ranges == {} and b.ranges == {1 << 20: 4096}
    transfer_memory.unregister(b, 1 << 20)


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


@pytest.mark.parametrize("offset", [0, 7])
def test_populate_keeps_every_byte(offset):
    data = np.random.default_rng(offset).integers(0, 256, (3 << 20) + 11, dtype=np.uint8)
    view = data[offset:]  # Page-aligned or not, at either end.
    before = view.copy()
    populated = transfer_memory.populate(view.ctypes.data, view.nbytes)
    np.testing.assert_array_equal(view, before)
    if not _kernel_at_least(5, 14):
        assert not populated  # The advice does not exist there.
    elif not populated:  # A sandbox (seccomp, gVisor) may refuse it: then it is a no-op.
        pytest.skip("this kernel refused MADV_POPULATE_WRITE")


def test_populate_of_fresh_memory_leaves_it_zero():
    fresh = np.zeros(8 << 20, np.uint8)  # Untouched pages (calloc'd by mmap).
    transfer_memory.populate(fresh.ctypes.data, fresh.nbytes)
    assert not fresh.any()
