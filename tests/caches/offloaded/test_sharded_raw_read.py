"""A mesh cache's raw read of a quantized tier joins its head shards' codes and scales as
one device's cache holds them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps

ARGS = dict(num_layers=1, batch=2, max_len=32, num_kv_heads=4, head_dim=16, block_tokens=8,
            dtype=jnp.float32, tier_dtype="int8")  # fmt: skip


def test_raw_read_joins_the_head_shards_codes_and_scales():
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((2, 11, 4, 16)).astype(np.float32)
    with tps.ShardedKVCache(mesh=mesh, kv_heads_axis="model", **ARGS) as sharded, \
            tps.OffloadedKVCache(**ARGS) as single:  # fmt: skip
        got = sharded.load(sharded.init(), 0, rows, -rows)
        want = single.load(single.init(), 0, rows, -rows)
        for a, b in zip(sharded.read(got, 0, 1, raw=True), single.read(want, 0, 1, raw=True)):
            assert a.codes.shape == (11, 4, 16) and a.scales.shape == (11, 4)
            np.testing.assert_array_equal(a.codes, b.codes)
            np.testing.assert_array_equal(a.scales, b.scales)
