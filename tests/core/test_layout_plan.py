"""The planner alone (no engine, no tier): ``layout.plan`` over many shapes against the rules
it promises, each refusal at its edge, and the configuration's own refusals."""

from __future__ import annotations

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_tpusync as tps
from jax_tpusync.core import layout, quantize
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.state import INT32_MAX
from jax_tpusync.runtime import backend

DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)


def row_bytes_of(heads: int, head_dim: int, dtype, tier_dtype) -> int:
    if tier_dtype is not None:
        return quantize.row_bytes(heads, head_dim)
    return heads * head_dim * np.dtype(dtype).itemsize


@st.composite
def configs(draw) -> dict:
    layers = draw(st.integers(1, 6))
    batch = draw(st.integers(1, 8))
    heads = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([1, 3, 8, 64, 96, 128]))
    dtype = draw(st.sampled_from(DTYPES))
    tier_dtype = draw(st.sampled_from([None, None, "int8", "float8_e4m3fn"]))
    max_len = draw(st.one_of(st.integers(1, 64), st.integers(65, 1 << 17)))
    window = st.one_of(st.none(), st.integers(1, 2 * max_len))
    windows = draw(st.one_of(st.none(), window, st.lists(window, min_size=layers, max_size=layers)))
    depth = draw(st.one_of(st.just("auto"), st.integers(1, 8), st.integers(9, 64)))
    tier = draw(st.sampled_from(["host", "file"]))
    # A budget around the size of one token per slot, or of the whole cache.
    row = row_bytes_of(heads, head_dim, dtype, tier_dtype)
    slots = (layout.auto_prefetch_depth(tier) if depth == "auto" else depth) + 1
    one_token = slots * 2 * batch * row
    whole = layers * 2 * batch * max_len * row
    anchor = draw(st.sampled_from([one_token, one_token, one_token, whole]))
    scale = draw(st.sampled_from([0.5, 1, 2, 30, 1000, 20000])) * draw(st.floats(1.0, 2.0))
    staging = min(max(int(anchor * scale) + draw(st.integers(-2, 2)), 1), INT32_MAX)
    return dict(
        num_layers=layers,
        batch=batch,
        max_len=max_len,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        tier_dtype=tier_dtype,
        sliding_window=windows,
        staging_bytes=staging,
        prefetch_depth=depth,
        resident=draw(st.sampled_from([False, False, "auto", True])),
        read_in_place=draw(st.sampled_from(["auto", False])),
        block_tokens=draw(st.sampled_from([None, 1, 16, 256])),
        tier=tier,
        **({"path": "/nonexistent-tier-dir"} if tier == "file" else {}),
    )


def _longest(max_len, windows):
    return max(max_len if w is None else min(max_len, max(w - 1, 1)) for w in windows)


@settings(derandomize=True, database=None, deadline=None, max_examples=400)
@given(kw=configs())
def test_plan_keeps_its_rules_across_shapes(kw):
    config = CacheConfig.from_kwargs(**kw)
    g = config.geometry
    row = g.row_bytes
    longest = _longest(g.max_len, g.windows)
    depth = kw["prefetch_depth"]
    depth = layout.auto_prefetch_depth(kw["tier"]) if depth == "auto" else depth
    whole = g.num_layers * 2 * g.batch * g.max_len * row
    fits = whole <= kw["staging_bytes"]
    if kw["resident"] is True and not fits:
        with pytest.raises(
            ValueError, match=rf"resident=True needs the whole cache .* = {whole} bytes"
        ):
            layout.plan(config)
        return
    resident = fits and kw["resident"] in (True, "auto")
    one_token = (depth + 1) * 2 * g.batch * row
    if not resident and kw["staging_bytes"] < one_token:
        with pytest.raises(ValueError, match=r"cannot hold one token per slot"):
            layout.plan(config)
        return
    spec = layout.plan(config)

    assert spec.resident == resident
    assert spec.num_slots == spec.prefetch_depth + 1
    assert 1 <= spec.chunk_len <= longest
    if spec.chunk_len >= longest and depth > g.num_layers:
        assert spec.prefetch_depth == g.num_layers  # Units past the next step: pointless.
    else:
        assert spec.prefetch_depth == depth
    unit_bytes = spec.num_slots * 2 * g.batch * spec.chunk_len * row
    assert math.prod(spec.unit_staging_shape) * np.dtype(spec.staging_dtype).itemsize == unit_bytes
    if not resident:
        assert unit_bytes <= kw["staging_bytes"]
        raw = kw["staging_bytes"] // ((depth + 1) * 2 * g.batch * row)
        page_rows = 4096 // math.gcd(row, 4096)
        want = min(raw, longest)
        if page_rows < want < longest:
            want -= want % page_rows  # Whole pages per unit.
            assert spec.chunk_len % page_rows == 0
        assert spec.chunk_len == want
    else:
        assert spec.chunk_len == longest
    in_place = (
        kw["read_in_place"] is not False
        and kw["tier"] in ("host", "file")
        and np.dtype(kw["dtype"]) in (np.dtype(jnp.bfloat16), np.dtype(np.float32))
        and not resident
        and backend.in_place_blocker() is None
    )
    assert spec.reads_in_place == in_place
    assert spec.attends_landed == (in_place and kw["tier"] == "file")
    if resident:
        assert spec.device_bytes == whole
    elif in_place:
        assert spec.device_bytes == 0
    else:
        assert spec.device_bytes == unit_bytes
    assert spec.block_bytes == g.block_tokens * row
    assert spec.staging_dtype == backend.staging_dtype(g.dtype, g.quantized)
    # Pure: the same configuration plans the same spec.
    assert layout.plan(config) == spec


# -- each refusal at its edge ----------------------------------------------------------------

BASE = dict(
    num_layers=2,
    batch=3,
    max_len=64,
    num_kv_heads=2,
    head_dim=8,
    dtype=jnp.float32,
    prefetch_depth=1,
    read_in_place=False,
)
ROW = 2 * 8 * 4  # Bytes of one token's K (or V) row.


def plan(**kw):
    return layout.plan(CacheConfig.from_kwargs(**{**BASE, **kw}))


def test_staging_one_byte_short_of_one_token_per_slot_is_refused():
    one_token = 2 * 2 * 3 * ROW  # 2 slots x K, V x batch 3 x a row.
    with pytest.raises(
        ValueError,
        match=rf"staging_bytes={one_token - 1} cannot hold one token per slot: 2 slots x 2 \(K, V\) "
        rf"x batch 3 x {ROW} bytes per token row = {one_token} bytes at least",
    ):
        plan(staging_bytes=one_token - 1)
    spec = plan(staging_bytes=one_token)
    assert spec.chunk_len == 1 and spec.device_bytes == one_token
    with pytest.raises(ValueError, match="cannot hold one token per slot: 4 slots"):
        plan(staging_bytes=one_token, prefetch_depth=3)  # Each unit ahead takes a slot.
    assert plan(staging_bytes=2 * one_token, prefetch_depth=3).chunk_len == 1


def test_resident_true_one_byte_short_is_refused():
    whole = 2 * 2 * 3 * 64 * ROW
    with pytest.raises(
        ValueError,
        match=rf"resident=True needs the whole cache on device: 2 layers x 2 \(K, V\) x batch 3 x "
        rf"max_len 64 x {ROW} bytes per token row = {whole} bytes, more than "
        rf"staging_bytes={whole - 1}",
    ):
        plan(resident=True, staging_bytes=whole - 1)
    spec = plan(resident=True, staging_bytes=whole)
    assert spec.resident and spec.device_bytes == whole and spec.chunk_len == 64
    assert not plan(resident="auto", staging_bytes=whole - 1).resident
    assert plan(resident="auto", staging_bytes=whole).resident


def test_max_len_at_the_unit_count_bound():
    # 4-byte rows: 1024 rows a page; 2 slots x 2 x 1 x 4 bytes = 16 bytes a token.
    kw = dict(
        num_layers=1,
        batch=1,
        num_kv_heads=1,
        head_dim=1,
        num_blocks=1,
        block_tokens=256,
        staging_bytes=16 * 2048,
    )
    edge = INT32_MAX + 1 - 2048
    spec = plan(max_len=edge, **kw)
    assert spec.chunk_len == 2048
    with pytest.raises(
        ValueError,
        match=rf"max_len={edge + 1} is too large for a layer that reads the whole context: its "
        rf"unit count needs max_len \+ chunk_len - 1 = {INT32_MAX + 1} to fit int32; at most "
        rf"{edge} with chunk_len=2048",
    ):
        plan(max_len=edge + 1, **kw)
    # A sliding window bounds what a layer reads: the same max_len then fits.
    assert plan(max_len=edge + 1, sliding_window=4096, **kw).chunk_len == 2048


def test_a_block_past_int32_bytes_is_refused():
    kw = dict(num_kv_heads=8, head_dim=128, num_blocks=1, max_len=1 << 20)  # 4096-byte rows.
    assert plan(block_tokens=1 << 19 >> 1, **kw).block_bytes == 1 << 30
    with pytest.raises(
        ValueError,
        match=rf"a KV block of {1 << 31} bytes does not fit a segment's int32 byte count; use a "
        r"smaller block_tokens",
    ):
        plan(block_tokens=1 << 19, **kw)


def test_tier_blocks_past_the_int32_block_index_are_refused():
    kw = dict(num_layers=1, block_tokens=1)
    plan(num_blocks=(1 << 30) - 1, **kw)  # 2**31 - 2 tier blocks: the last index fits.
    with pytest.raises(
        ValueError, match=rf"the cache needs {1 << 31} tier blocks from block 0, past the int32"
    ):
        plan(num_blocks=1 << 30, **kw)


@pytest.mark.parametrize(
    "kw, why",
    [
        (
            dict(tier_dtype="int8", dtype=jnp.float16),
            r"dtype=float16 \(a quantized tier is read in place for bfloat16 or float32\)",
        ),
        (
            dict(dtype=jnp.float16),
            r"dtype=float16 \(rows are read in place as bfloat16 or float32\)",
        ),
        (dict(resident=True), "a resident cache reads no unit at all"),
    ],
)
def test_read_in_place_true_where_it_cannot_apply_names_why(kw, why):
    if backend.in_place_blocker() is not None and "tier" not in kw:
        pytest.skip("this backend reads no host pool in place")
    with pytest.raises(ValueError, match=rf"read_in_place=True cannot apply: {why}"):
        plan(read_in_place=True, **kw)
    with pytest.raises(ValueError, match="read_in_place=True cannot apply"):
        tps.OffloadedKVCache(**{**BASE, "read_in_place": True, **kw})
    assert not plan(read_in_place="auto", **kw).reads_in_place


# -- the configuration's own refusals ---------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_layers=0), r"num_layers=0 must be a positive int"),
        (dict(batch=2.0), r"batch=2.0 must be a positive int"),
        (dict(head_dim=True), r"head_dim=True must be a positive int"),
        (dict(max_len=2**31), r"max_len=2147483648 must be at most 2\*\*31 - 1"),
        (dict(dtype=np.int8), r"dtype=int8 must be bfloat16, float16 or float32"),
        (dict(tier_dtype="int4"), r"tier_dtype='int4' must be None, 'int8' or 'float8_e4m3fn'"),
        (dict(block_tokens=12), r"block_tokens=12 must be a power of two"),
        (dict(num_blocks=0), r"num_blocks=0 must be a positive int"),
        (dict(staging_bytes=0), r"staging_bytes=0 must be an int in \[1, 2\*\*31 - 1\]"),
        (
            dict(staging_bytes=2**31),
            r"staging_bytes=2147483648 must be an int in \[1, 2\*\*31 - 1\]",
        ),
        (dict(resident="yes"), r"resident='yes' must be True, False or 'auto'"),
        (dict(read_in_place=1), r"read_in_place=1 must be True, False or 'auto'"),
        (dict(prefetch_depth=0), r"prefetch_depth=0 must be an int in \[1, 64\] or 'auto'"),
        (dict(prefetch_depth=65), r"prefetch_depth=65 must be an int in \[1, 64\]"),
        (dict(sliding_window=[4]), r"sliding_window has 1 entries for 2 layers"),
        (
            dict(sliding_window=0),
            r"sliding window 0 of layer 0 must be None or an int in \[1, 2\*\*31 - 1\]",
        ),
        (dict(sliding_window="4"), r"sliding_window='4' must be None, an int or a sequence"),
        (dict(tier="ssd"), r"tier='ssd' must be 'host' or 'file'"),
        (dict(tier="file"), r"tier='file' needs path=<directory>"),
        (dict(path="/tmp"), r"path and file_name apply to tier='file' only"),
        (dict(tier="file", path="/tmp", shm_name="x"), r"shm_name applies to tier='host' only"),
        (dict(spill_blocks=4), r"spill_blocks=4 needs spill_path=<directory>"),
        (dict(spill_path="/tmp", resident=True), r"resident=True keeps every block on device"),
        (dict(spill_path="/tmp", spill_blocks=0), r"spill_blocks=0 must be a positive int"),
        (dict(model_id=3), r"model_id=3 must be a str or None"),
    ],
)
def test_cache_config_refuses_each_bad_argument(kw, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig.from_kwargs(**{**BASE, **kw})


def test_a_shared_prefix_dir_that_is_a_file_is_refused_before_anything_is_made(tmp_path):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    regular = tmp_path / "not-a-directory"
    regular.write_bytes(b"x")
    with pytest.raises(
        ValueError, match=rf"shared_prefix_dir='{regular}' exists and is not a directory"
    ):
        tps.OffloadedKVCache(
            **BASE,
            tier="file",
            path=str(tier_dir),
            file_name="kv",
            shared_prefix_dir=str(regular),
        )
    assert os.listdir(tier_dir) == []
    assert regular.read_bytes() == b"x"
