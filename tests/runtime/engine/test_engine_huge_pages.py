"""Direct reads ask for huge pages under their destinations (a read into physically
contiguous memory is a few large segments, not one per 4 KiB page): every 2 MiB page a
read covers at least half of, including pages that straddle two slots of one buffer, and
again for a buffer mapped where an earlier one was."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
from collections.abc import Iterator

import numpy as np
import pytest

from jax_tpusync.runtime.engine import huge_page_fraction

MiB = 1 << 20
HUGE = 2 * MiB
REGION = 12 * MiB

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FIXED_NOREPLACE = 0x100000


def _kernel_at_least(major: int, minor: int) -> bool:
    parts = platform.release().split(".")
    try:
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


needs_pagemap_scan = pytest.mark.skipif(
    not _kernel_at_least(6, 7),
    reason="the kernel reports huge pages to processes (PAGEMAP_SCAN) from Linux 6.7",
)


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@contextlib.contextmanager
def small_pages(addr: int = 0) -> Iterator[int]:
    """A private anonymous REGION at ``addr`` (0: anywhere, 2 MiB-aligned), faulted in as
    4 KiB pages; yields its address and unmaps it after."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_FIXED_NOREPLACE if addr else 0)
    span = REGION if addr else REGION + HUGE
    p = _libc.mmap(addr or None, span, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    assert p not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    if addr:
        assert p == addr, "the old address was taken"
    else:  # Trim to a 2 MiB-aligned REGION.
        base = -(-p // HUGE) * HUGE
        if base > p:
            _libc.munmap(p, base - p)
        _libc.munmap(base + REGION, p + span - base - REGION)
        p = base
    assert _libc.madvise(p, REGION, mmap.MADV_NOHUGEPAGE) == 0
    ctypes.memset(p, 7, REGION)
    try:
        yield p
    finally:
        _libc.munmap(p, REGION)


def _huge_bytes(addr: int) -> int:
    """AnonHugePages over the mappings inside [addr, addr + REGION)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = addr <= lo and hi <= addr + REGION
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


def _read_slots(engine, tier, addr: int) -> np.ndarray:
    """Three reads of 3 MiB at addr + 1, 4 and 7 MiB (slots that do not start on 2 MiB
    boundaries), each its own job; returns the bytes that landed."""
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * REGION).from_address(addr))
    tickets = [
        engine.submit_read(tier, [(i * 3 * MiB, (1 + 3 * i) * MiB, 3 * MiB)], buf) for i in range(3)
    ]
    for t in tickets:
        engine.wait(t)
    return buf[MiB : 10 * MiB].copy()


@pytest.fixture
def direct_tier(make_engine, file_dir):
    if not _thp_available():
        pytest.skip("transparent huge pages are off")
    engine = make_engine(huge_page_destinations=True)
    tier = engine.add_file_tier(file_dir, block_bytes=MiB, num_blocks=16)
    if not engine.tier_info(tier).direct_io:
        pytest.skip("no O_DIRECT on the test directory")
    data = np.random.default_rng(5).integers(0, 256, size=9 * MiB, dtype=np.uint8)
    engine.write(tier, 0, data)
    return engine, tier, data


def test_pages_straddling_two_slots_become_huge(direct_tier):
    engine, tier, data = direct_tier
    with small_pages() as addr:
        if _huge_bytes(addr):
            pytest.skip("this kernel gave huge pages despite MADV_NOHUGEPAGE")
        np.testing.assert_array_equal(_read_slots(engine, tier, addr), data)
        if not _kernel_at_least(6, 1) and not _huge_bytes(addr):
            pytest.skip("no MADV_COLLAPSE before Linux 6.1")
        # [0, 2) and [6, 8) MiB are half covered (the second by two slots); [10, 12) is not.
        assert _huge_bytes(addr) == 10 * MiB


@needs_pagemap_scan
def test_a_buffer_mapped_where_an_earlier_one_was_becomes_huge(direct_tier):
    engine, tier, data = direct_tier
    with small_pages() as addr:
        _read_slots(engine, tier, addr)
        assert _huge_bytes(addr) == 10 * MiB
    with small_pages(addr) as again:
        assert _huge_bytes(again) == 0
        np.testing.assert_array_equal(_read_slots(engine, tier, again), data)
        assert _huge_bytes(again) == 10 * MiB


def test_no_huge_pages_when_disabled(make_engine, file_dir):
    if not _thp_available():
        pytest.skip("transparent huge pages are off")
    engine = make_engine(huge_page_destinations=False)
    tier = engine.add_file_tier(file_dir, block_bytes=MiB, num_blocks=16)
    engine.write(tier, 0, np.ones(9 * MiB, np.uint8))
    with small_pages() as addr:
        _read_slots(engine, tier, addr)
        assert _huge_bytes(addr) == 0


@needs_pagemap_scan
def test_huge_page_fraction_reports_what_the_kernel_mapped(direct_tier):
    engine, tier, _ = direct_tier
    with small_pages() as addr:
        region = np.ctypeslib.as_array((ctypes.c_uint8 * REGION).from_address(addr))
        assert huge_page_fraction(region) == 0.0
        _read_slots(engine, tier, addr)
        assert huge_page_fraction(region) == pytest.approx(10 / 12)
        assert huge_page_fraction(region[MiB : 3 * MiB]) == pytest.approx(1.0)
        assert huge_page_fraction(region[11 * MiB :]) == 0.0
        assert huge_page_fraction(region[:0]) is None


def test_huge_page_fraction_needs_contiguous_bytes():
    with pytest.raises(ValueError, match="huge_page_fraction needs a C-contiguous array"):
        huge_page_fraction(np.zeros((4, 4), np.uint8)[:, ::2])


def test_huge_page_fraction_of_a_jax_array():
    import jax.numpy as jnp

    fraction = huge_page_fraction(jnp.zeros(1 << 20, jnp.float32))
    assert fraction is None or 0.0 <= fraction <= 1.0


def test_a_bounced_read_leaves_the_destination_pages_alone(direct_tier):
    """Out of phase with the file, bytes arrive through a bounce buffer: the destination's
    pages do not change the disk's speed, so they are not collapsed."""
    engine, tier, data = direct_tier
    with small_pages() as addr:
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * REGION).from_address(addr))
        engine.wait(engine.submit_read(tier, [(0, MiB + 64, 9 * MiB)], buf))
        np.testing.assert_array_equal(buf[MiB + 64 : 10 * MiB + 64], data)
        assert _huge_bytes(addr) == 0
