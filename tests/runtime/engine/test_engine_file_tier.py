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


def test_named_file_is_preallocated_and_persists(make_engine, file_dir):
    e = make_engine()
    size = 256 << 20
    t = e.add_file_tier(file_dir, block_bytes=1 << 20, num_blocks=size >> 20, file_name="big")
    path = os.path.join(file_dir, "big.tpusync")
    st = os.stat(path)
    assert st.st_size == 4096 + size  # Header + capacity, made whole at creation.
    e.write(t, size - 10, np.arange(10, dtype=np.uint8))  # The very last bytes.
    out = np.zeros(10, np.uint8)
    e.read(t, size - 10, out)
    np.testing.assert_array_equal(out, np.arange(10))
    # Never-written bytes read as zeros.
    np.testing.assert_array_equal(e.read(t, 12345, np.full(5000, 7, np.uint8)), 0)
    e.close()
    assert os.path.exists(path)
    os.remove(path)  # Preallocated: do not leave 256 MiB in pytest's temporary directories.
    if st.st_blocks * 512 < size:  # Backed by disk blocks, where the filesystem can.
        pytest.skip("this filesystem cannot preallocate (sized sparse instead)")


def _buffer_at(nbytes: int, page_offset: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` that starts `page_offset` bytes past a page."""
    raw = np.zeros(nbytes + 2 * 4096, np.uint8)
    skip = (page_offset - raw.ctypes.data) % 4096
    return raw[skip : skip + nbytes]


@pytest.mark.parametrize("alignment_offset", [0, 64, 1856])
@pytest.mark.parametrize("dst_offset", [0, 64, 1856, 4000])
def test_reads_are_exact_in_and_out_of_phase(make_engine, file_dir, alignment_offset, dst_offset):
    """Every (data shift, destination phase) pair returns the written bytes, over odd
    sizes and unaligned tier offsets, through the direct and the bounce path alike."""
    e = make_engine(io_chunk_bytes=64 << 10, io_depth=3)
    t = e.add_file_tier(
        file_dir, block_bytes=4096, num_blocks=256, alignment_offset=alignment_offset
    )
    info = e.tier_info(t)
    assert info.alignment_offset == alignment_offset
    assert f"data at +{alignment_offset}" in info.description
    data = np.random.default_rng(alignment_offset + dst_offset).integers(
        0, 256, size=256 * 4096, dtype=np.uint8
    )
    e.write(t, 0, data)
    for tier_offset, nbytes in [(0, 256 * 4096), (5, 700_001), (4096 * 3 + 511, 513), (77, 3)]:
        out = _buffer_at(nbytes, (dst_offset + tier_offset) % 4096)
        e.read(t, tier_offset, out)
        np.testing.assert_array_equal(out, data[tier_offset : tier_offset + nbytes])


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 640 << 10, 256 << 10, 200 << 10])
def test_a_long_read_out_of_phase_cycles_the_ring_byte_exact(make_engine, file_dir, chunk_bytes):
    """Out of phase, a read goes through the bounce ring in reads of at most 256 KiB (of
    io_chunk_bytes when smaller), up to 2 MiB of them in flight as the ring's memory
    (io_depth x io_chunk_bytes) allows: 8 slots for 1 MiB chunks at depth 2, 4 for 640 KiB
    (whose last 128 KiB per buffer stay unused), 2 for 256 KiB or less. 5 MiB and 3 bytes
    cycle the ring many times and arrive byte-exact."""
    e = make_engine(io_chunk_bytes=chunk_bytes, io_depth=2)
    t = e.add_file_tier(file_dir, block_bytes=1 << 20, num_blocks=6)
    data = np.random.default_rng(chunk_bytes).integers(0, 256, size=6 << 20, dtype=np.uint8)
    e.write(t, 0, data)
    before = e.tier_info(t).bounced_read_bytes
    nbytes = (5 << 20) + 3
    out = _buffer_at(nbytes, 64 + 2048)
    e.read(t, 4097, out)
    np.testing.assert_array_equal(out, data[4097 : 4097 + nbytes])
    assert e.tier_info(t).bounced_read_bytes - before == nbytes


def test_reads_in_phase_skip_the_bounce_buffer(make_engine, file_dir):
    e = make_engine(io_chunk_bytes=64 << 10)
    t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=64, alignment_offset=64)
    data = np.random.default_rng(5).integers(0, 256, size=64 * 4096, dtype=np.uint8)
    e.write(t, 0, data)
    in_phase = _buffer_at(data.size, 64)
    e.read(t, 0, in_phase)
    np.testing.assert_array_equal(in_phase, data)
    info = e.tier_info(t)
    align = info.dio_alignment
    assert align in (512, 1024, 2048, 4096)
    # Only the partial sectors at either end (the buffer starts 64 bytes into one) bounce.
    direct, bounced = info.direct_read_bytes, info.bounced_read_bytes
    assert direct + bounced == data.size and bounced < 2 * align
    out_of_phase = _buffer_at(data.size, 64 + align // 2)
    e.read(t, 0, out_of_phase)
    np.testing.assert_array_equal(out_of_phase, data)
    info = e.tier_info(t)
    assert info.direct_read_bytes == direct and info.bounced_read_bytes == bounced + data.size


def test_alignment_offset_is_kept_by_the_file(make_engine, file_dir):
    """The shift is part of the file's layout: re-attaching with another one keeps the
    stored one, and the bytes stay where they were."""
    e = make_engine()
    t = e.add_file_tier(
        file_dir, block_bytes=4096, num_blocks=4, file_name="shifted", alignment_offset=192
    )
    data = np.arange(4 * 4096, dtype=np.uint32).view(np.uint8)[: 4 * 4096]
    e.write(t, 0, data)
    e.close()
    e2 = make_engine()
    t2 = e2.add_file_tier(
        file_dir, block_bytes=4096, num_blocks=4, file_name="shifted", alignment_offset=0
    )
    assert e2.tier_info(t2).attached and e2.tier_info(t2).alignment_offset == 192
    np.testing.assert_array_equal(e2.read(t2, 0, np.zeros_like(data)), data)


def test_concurrent_writes_on_a_shifted_page_do_not_lose_bytes(make_engine, file_dir):
    """Writes read-modify-write whole file pages; with the data shifted, one file page
    spans two tier pages, and the hazard scoreboard must still keep such writers apart."""
    e = make_engine(num_workers=4, io_chunk_bytes=4096)
    t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=16, alignment_offset=2048)
    rng = np.random.default_rng(9)
    expected = np.zeros(16 * 4096, np.uint8)
    pieces = []
    for start in range(0, expected.size, 1000):  # 1000-byte writes straddle every page.
        piece = rng.integers(0, 256, size=min(1000, expected.size - start), dtype=np.uint8)
        expected[start : start + piece.size] = piece
        pieces.append((start, piece))
    tickets = [e.submit_write(t, [(s, 0, p.size)], p) for s, p in pieces]
    for ticket in tickets:
        e.wait(ticket)
    np.testing.assert_array_equal(e.read(t, 0, np.zeros_like(expected)), expected)
