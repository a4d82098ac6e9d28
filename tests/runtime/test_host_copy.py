"""The multi-range host copy (jax_tpusync.runtime.host_copy) through the extension: every pair's bytes
land whatever their alignment, length or thread count, and a refused call copies nothing."""

from __future__ import annotations

import numpy as np
import pytest

from jax_tpusync.runtime.host_copy import copy_arrays


def _pairs(rng, lengths, offset):
    """``(dst, src)`` uint8 pairs of ``lengths``, each destination starting ``offset`` bytes
    into a zeroed buffer (so the alignments vary)."""
    pairs, buffers = [], []
    for n in lengths:
        buf = np.zeros(n + offset + 8, np.uint8)
        buffers.append(buf)
        pairs.append((buf[offset : offset + n], rng.integers(0, 256, n, dtype=np.uint8)))
    return pairs, buffers


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_pair_lands_bitwise_and_nothing_beside_it(threads):
    rng = np.random.default_rng(threads)
    # Empty, shorter than a 16-byte store, over the 256 KiB streaming threshold and the
    # 1 MiB piece that threads' shares are cut into.
    lengths = [0, 1, 63, 65, 4096 + 3, (256 << 10) + 17, (1 << 20) + 5, (3 << 20) + 1]
    for offset in (0, 1, 15):
        pairs, buffers = _pairs(rng, lengths, offset)
        assert copy_arrays(pairs, threads=threads) == sum(lengths)
        for (dst, src), buf, n in zip(pairs, buffers, lengths, strict=True):
            assert np.array_equal(dst, src)
            assert not buf[:offset].any() and not buf[offset + n :].any()


def test_dtypes_and_shapes_may_differ_the_bytes_are_copied_as_they_are():
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    dst = np.zeros(24, np.uint8)
    copy_arrays([(dst, src)])
    assert np.array_equal(dst.view(np.float32), src.reshape(-1))


def test_refused_calls_name_the_problem_and_copy_nothing():
    src = np.ones(16, np.uint8)
    dst = np.zeros(32, np.uint8)
    good = (dst[:16], src)

    def refused(error, match, pairs, **kwargs):
        with pytest.raises(error, match=match):
            copy_arrays(pairs, **kwargs)
        assert not dst.any()

    refused(ValueError, r"threads=0 must be >= 1", [good], threads=0)
    refused(TypeError, r"threads=True must be an int", [good], threads=True)
    refused(TypeError, r"pairs\[1\] must be a \(dst, src\) pair of arrays", [good, (dst,)])
    refused(
        TypeError, r"pairs\[1\] is \(list, ndarray\), expected two numpy arrays", [good, ([0], src)]
    )
    # One byte more or fewer.
    refused(
        ValueError, r"pairs\[0\]: the destination has 17 bytes, the source 16", [(dst[:17], src)]
    )
    refused(
        ValueError, r"pairs\[0\]: the destination has 15 bytes, the source 16", [(dst[:15], src)]
    )
    refused(
        ValueError, r"pairs\[1\]: both arrays must be C-contiguous", [good, (dst[::2], src[:16])]
    )
    read_only = dst[16:]
    read_only.flags.writeable = False
    refused(ValueError, r"pairs\[1\]: the destination is read-only", [good, (read_only, src)])
    # Destinations sharing exactly one byte overlap; touching ones (below) do not.
    refused(ValueError, r"the destinations of ranges 0 and 1 overlap", [good, (dst[15:31], src)])
    refused(ValueError, r"range 0 overlaps its own source", [(dst[1:17], dst[:16])])
    # A destination over another pair's source by one byte; touching is fine (below).
    other = np.zeros(64, np.uint8)
    refused(
        ValueError,
        r"the destination of range 1 overlaps the source of range 0",
        [(other[:16], dst[15:31]), (dst[:16], src)],
    )
    assert not other.any()
    assert copy_arrays([(other[:16], dst[16:32]), (dst[:16], src)]) == 32
    assert dst[:16].all() and not dst[16:].any()
    dst[:] = 0
    assert copy_arrays([good, (dst[16:], src)], threads=2) == 32
    assert dst.all()
    assert copy_arrays([]) == 0
