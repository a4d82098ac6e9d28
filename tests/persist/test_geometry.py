"""One geometry from configuration to manifest: ``KVGeometry`` decides the spec's geometry
fields, the manifest's ``Geometry`` and the row size (computed in one place), and the
manifest's geometry on disk keeps its format, so manifests written before still re-attach."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import layout, quantize
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.core.state import row_bytes_of, row_shape_of
from jax_tpusync.persist import manifest

BASE = dict(num_layers=2, batch=3, max_len=32, num_kv_heads=2, head_dim=8)

CONFIGS = {
    "bf16": dict(),
    "f32 paged": dict(dtype=jnp.float32, block_tokens=4, num_blocks=20),
    "f16 windows": dict(dtype=jnp.float16, sliding_window=(8, None)),
    "int8 codes": dict(tier_dtype="int8", block_tokens=8),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_the_spec_and_the_manifest_take_their_geometry_from_the_config(case):
    config = CacheConfig.from_kwargs(**BASE, **CONFIGS[case], staging_bytes=1 << 20)
    g = config.geometry
    spec = layout.plan(config)
    for name, value in g.spec_fields().items():
        assert getattr(spec, name) == value, name
    assert spec.row_bytes == g.row_bytes
    assert spec.row_shape == g.row_shape
    assert spec.block_bytes == g.block_tokens * g.row_bytes
    held = manifest.Geometry.of_kv(g, "m")
    assert held == manifest.Geometry.of(
        g.num_layers,
        g.batch,
        g.max_len,
        g.num_kv_heads,
        g.head_dim,
        g.dtype,
        "m",
        block_tokens=spec.block_tokens,
        num_blocks=spec.num_blocks,
        tier_dtype=spec.tier_dtype,
    )
    assert held.completed(spec) == held  # Nothing left for the opened cache to fill in.
    assert manifest.Geometry.from_json(json.loads(json.dumps(held.to_json()))) == held
    assert manifest.Geometry.of_kv(g, None).model_id == manifest.UNSPECIFIED_MODEL


@pytest.mark.parametrize(
    "dtype,tier_dtype,want",
    [
        (jnp.bfloat16, None, 2 * 8 * 2),
        (np.float32, None, 2 * 8 * 4),
        (jnp.bfloat16, np.int8, quantize.row_bytes(2, 8)),
    ],
)
def test_a_row_is_sized_in_one_place(dtype, tier_dtype, want):
    assert row_bytes_of(2, 8, dtype, tier_dtype) == want
    assert row_shape_of(2, 8, dtype, tier_dtype) == ((want,) if tier_dtype else (2, 8))


@pytest.fixture
def file_cache(tmp_path):
    def make(**kwargs):
        args = dict(
            BASE,
            dtype=jnp.float32,
            block_tokens=4,
            tier="file",
            path=tmp_path,
            file_name="kv",
            model_id="m",
            staging_bytes=1 << 20,
        )
        return tps.OffloadedKVCache(**{**args, **kwargs})

    return make, tmp_path / f"kv{manifest.MANIFEST_SUFFIX}"


def test_the_manifest_geometry_keeps_its_format(file_cache):
    make, manifest_path = file_cache
    with make() as cache:
        cache.close(cache.init())
    assert json.loads(manifest_path.read_text())["geometry"] == {
        "num_layers": 2,
        "batch": 3,
        "max_len": 32,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float32",
        "block_tokens": 4,
        "num_blocks": 24,
        "layout_version": manifest.LAYOUT_VERSION,
        "model_id": "m",
        "tier_dtype": None,
    }


def test_a_manifest_from_before_tier_dtype_reattaches(file_cache):
    """Manifests written before quantized tiers have no ``tier_dtype``: they re-attach to a
    cache of unquantized rows, and are refused by name by a quantized one."""
    make, manifest_path = file_cache
    with make() as cache:
        state = cache.init()
        ones = np.ones((3, 5, 2, 8), np.float32)
        for layer in range(2):
            state = cache.load(state, layer, ones, ones, lengths=[5, 0, 0])
        cache.close(state)
    m = json.loads(manifest_path.read_text())
    del m["geometry"]["tier_dtype"]
    manifest_path.write_text(json.dumps(m))
    with make() as cache:
        state = cache.init()
        np.testing.assert_array_equal(np.asarray(state.lengths), [5, 0, 0])
        np.testing.assert_array_equal(cache.read(state, 1, 0)[0], ones[0])
        cache.close(state)
    m = json.loads(manifest_path.read_text())
    del m["geometry"]["tier_dtype"]
    manifest_path.write_text(json.dumps(m))
    with pytest.raises(manifest.LayoutMismatchError, match="tier_dtype: the tier holds None"):
        make(tier_dtype="int8", dtype=jnp.bfloat16)
