"""File tier I/O modes: O_DIRECT where the filesystem allows it, buffered I/O otherwise,
and tier_info() saying which."""

from __future__ import annotations

import os

import numpy as np
import pytest


def _round_trip(e, t):
    data = np.random.default_rng(11).integers(0, 256, size=3 * 4096 + 13, dtype=np.uint8)
    e.write(t, 4095, data)
    out = np.zeros(data.size + 1, np.uint8)[1:]
    e.read(t, 4095, out)
    np.testing.assert_array_equal(out, data)


def test_direct_io_is_described(make_engine, file_dir):
    e = make_engine()
    t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=8)
    info = e.tier_info(t)
    assert info.kind == "file" and info.direct_io
    assert "O_DIRECT" in info.description and "buffered" not in info.description
    assert info.capacity_bytes == 8 * 4096 and info.free_blocks == 8 and not info.attached
    _round_trip(e, t)


def test_direct_io_disabled_by_option(make_engine, file_dir):
    e = make_engine()
    t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=8, direct_io=False)
    info = e.tier_info(t)
    assert not info.direct_io
    assert "buffered I/O: O_DIRECT disabled by option" in info.description
    _round_trip(e, t)


def test_tmpfs_tier_works_and_reports_its_io_mode(make_engine):
    """tmpfs refused O_DIRECT before Linux 6.6 (the tier then falls back to buffered I/O and
    says why); newer kernels accept it. Either way the description matches direct_io and the
    bytes round-trip."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    e = make_engine()
    t = e.add_file_tier("/dev/shm", block_bytes=4096, num_blocks=8)
    info = e.tier_info(t)
    if info.direct_io:
        assert "(O_DIRECT" in info.description
    else:
        assert "buffered I/O: O_DIRECT refused" in info.description, info.description
    _round_trip(e, t)


def test_named_file_is_sparse_and_persists(make_engine, file_dir):
    e = make_engine()
    t = e.add_file_tier(file_dir, block_bytes=1 << 20, num_blocks=1024, file_name="big")
    path = os.path.join(file_dir, "big.tpusync")
    st = os.stat(path)
    assert st.st_size >= (1 << 30)  # 1 GiB logical size...
    assert st.st_blocks * 512 < (64 << 20)  # ...but (almost) nothing allocated.
    e.write(t, (1 << 30) - 10, np.arange(10, dtype=np.uint8))  # The very last bytes.
    out = np.zeros(10, np.uint8)
    e.read(t, (1 << 30) - 10, out)
    np.testing.assert_array_equal(out, np.arange(10))
    # Never-written bytes read as zeros.
    np.testing.assert_array_equal(e.read(t, 12345, np.full(5000, 7, np.uint8)), 0)
    e.close()
    assert os.path.exists(path)
