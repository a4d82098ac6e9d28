"""The block allocator, through Engine.allocate / Engine.free / Engine.tier_info."""

from __future__ import annotations

import numpy as np
import pytest

from jax_tpusync import TpusyncError


@pytest.fixture(params=("host", "file_direct"))
def alloc_tier(request, make_engine, add_tier):
    e = make_engine()
    return e, add_tier(e, request.param, block_bytes=4096, num_blocks=16)


def test_allocations_are_contiguous_and_disjoint(alloc_tier):
    e, t = alloc_tier
    a = e.allocate(t, 3)
    b = e.allocate(t, 5)
    c = e.allocate(t, 1)
    spans = sorted([(a, 3), (b, 5), (c, 1)])
    for (f0, n0), (f1, _) in zip(spans, spans[1:]):
        assert f0 + n0 <= f1
    assert all(0 <= f and f + n <= 16 for f, n in spans)
    assert e.tier_info(t).free_blocks == 16 - 9


def test_first_fit_reuses_freed_extents_and_coalesces(alloc_tier):
    e, t = alloc_tier
    a = e.allocate(t, 4)
    b = e.allocate(t, 4)
    c = e.allocate(t, 4)
    e.free(t, a, 4)
    e.free(t, b, 4)  # Coalesces with a's extent: 8 contiguous free blocks before c.
    assert e.allocate(t, 8) == a
    e.free(t, c, 4)
    assert e.tier_info(t).free_blocks == 8


def test_whole_tier_then_full(alloc_tier):
    e, t = alloc_tier
    first = e.allocate(t, 16)
    assert first == 0
    with pytest.raises(TpusyncError, match="tier full"):
        e.allocate(t, 1)
    e.free(t, first, 16)
    assert e.tier_info(t).free_blocks == 16
    assert e.allocate(t, 16) == 0


def test_tier_full_by_fragmentation(alloc_tier):
    e, t = alloc_tier
    firsts = [e.allocate(t, 2) for _ in range(8)]
    for f in firsts[::2]:
        e.free(t, f, 2)
    assert e.tier_info(t).free_blocks == 8
    with pytest.raises(TpusyncError, match=r"tier full: no run of 3 free blocks \(8 of 16"):
        e.allocate(t, 3)
    assert e.allocate(t, 2) in firsts[::2]
    with pytest.raises(TpusyncError, match="tier full"):
        e.allocate(t, 17)


def test_double_free_and_partial_double_free(alloc_tier):
    e, t = alloc_tier
    a = e.allocate(t, 4)
    e.free(t, a, 4)
    with pytest.raises(TpusyncError, match="double free"):
        e.free(t, a, 4)
    b = e.allocate(t, 4)
    assert b == a
    # Freeing a range that straddles an allocated and a free extent changes nothing.
    with pytest.raises(TpusyncError, match="double free"):
        e.free(t, b + 2, 4)
    assert e.tier_info(t).free_blocks == 12
    e.free(t, b, 4)
    # Freeing part of an allocation is allowed (the blocks were allocated).
    c = e.allocate(t, 6)
    e.free(t, c + 2, 2)
    assert e.tier_info(t).free_blocks == 12
    with pytest.raises(TpusyncError, match="double free"):
        e.free(t, c + 3, 1)


def test_free_and_allocate_argument_errors(alloc_tier):
    e, t = alloc_tier
    with pytest.raises(ValueError, match="outside the tier"):
        e.free(t, 15, 2)
    with pytest.raises(ValueError, match="outside the tier"):
        e.free(t, 0, 0)
    with pytest.raises(ValueError, match="must be positive"):
        e.allocate(t, 0)
    with pytest.raises(ValueError, match="no tier 7"):
        e.allocate(7, 1)
    with pytest.raises(ValueError, match="longer than 47 bytes"):
        e.allocate(t, 1, name="x" * 48)


def test_named_regions(alloc_tier):
    e, t = alloc_tier
    k = e.allocate(t, 3, name="layer0/k")
    v = e.allocate(t, 3, name="layer0/v")
    assert k != v
    assert e.allocate(t, 3, name="layer0/k") == k  # Same name and size: the same blocks.
    assert e.tier_info(t).free_blocks == 10
    assert e.tier_info(t).regions == {"layer0/k": (k, 3), "layer0/v": (v, 3)}
    with pytest.raises(TpusyncError, match="exists with 3 blocks; asked for 4"):
        e.allocate(t, 4, name="layer0/k")
    e.free(t, k, 3)
    assert e.tier_info(t).regions == {"layer0/v": (v, 3)}
    assert e.allocate(t, 2, name="layer0/k") == k  # Freed name can be reused at another size.


def test_allocate_does_not_touch_data(alloc_tier):
    e, t = alloc_tier
    f = e.allocate(t, 2)
    data = np.arange(8192, dtype=np.uint32).view(np.uint8)[:8192]
    e.write(t, f * 4096, data)
    e.free(t, f, 2)
    g = e.allocate(t, 2)
    assert g == f
    out = np.zeros(8192, np.uint8)
    e.read(t, g * 4096, out)
    np.testing.assert_array_equal(out, data)
