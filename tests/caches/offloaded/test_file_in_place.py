"""A file tier read in place (CPU backend, ``read_in_place="auto"``): each unit is fetched
ahead into the engine's landing memory and attended where it landed (``ops.attend_landed``),
with no copy into staging. A decode over it equals the staged path (``read_in_place=False``,
every unit copied into staging first) from the same KV: f32 within 1e-5, bf16 within its
rounding, int8 rows too; GQA ratios, sliding windows, multi-unit layers, prefetch depths 1
and 3, cross-step prefetch on or off, ragged per-slot counts, a scanned layer loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.runtime import backend

pytestmark = pytest.mark.skipif(
    backend.in_place_blocker() is not None, reason="a file tier is read in place on CPU only"
)

LAYERS, BATCH, MAX_LEN, HEAD_DIM = 3, 3, 96, 16
START = np.array([70, 0, 41])
STEPS = 4


def _cache(path, read_in_place, *, kv_heads, dtype, unit_rows, depth, **kw):
    row = kv_heads * HEAD_DIM * np.dtype(dtype).itemsize
    return tps.OffloadedKVCache(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        dtype=dtype,
        tier="file",
        path=path,
        staging_bytes=(depth + 1) * 2 * BATCH * unit_rows * row,
        prefetch_depth=depth,
        read_in_place=read_in_place,
        **kw,
    )


def _step(scan, counts_given):
    def step(q, k, v, counts, state):
        counts = counts if counts_given else None
        if scan:

            def body(state, xs):
                q, k, v, layer = xs
                o, state = tps.prefetching_attention(
                    q, k, v, state, layer=layer, query_seq_lengths=counts
                )
                return state, o

            state, outs = jax.lax.scan(body, state, (q, k, v, jnp.arange(LAYERS)))
            return outs, state
        outs = []
        for layer in range(LAYERS):
            o, state = tps.prefetching_attention(
                q[layer], k[layer], v[layer], state, layer=layer, query_seq_lengths=counts
            )
            outs.append(o)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=(4,))


def _decode(tmp_path, read_in_place, *, q_heads, kv_heads, dtype, q_len=1, counts=None,
            scan=False, seed=0, **kw):  # fmt: skip
    """Outputs [STEPS, LAYERS, BATCH, q_len, q_heads, HEAD_DIM] of a decode from the same
    random context and inputs, and the engine's stats."""
    rng = np.random.default_rng(seed)
    path = tmp_path / ("in-place" if read_in_place else "staged")
    path.mkdir(exist_ok=True)
    outs = []
    with _cache(path, read_in_place, kv_heads=kv_heads, dtype=dtype, **kw) as cache:
        assert cache.spec.attends_landed == read_in_place
        assert cache.spec.device_bytes == 0 or not read_in_place
        state = cache.init()
        n = int(START.max())
        for layer in range(LAYERS):
            kv = rng.standard_normal((2, BATCH, n, kv_heads, HEAD_DIM)).astype(dtype)
            state = cache.load(state, layer, kv[0], kv[1], lengths=START)
        step = _step(scan, counts is not None)
        for i in range(STEPS):
            q = rng.standard_normal((LAYERS, BATCH, q_len, q_heads, HEAD_DIM))
            k = rng.standard_normal((LAYERS, BATCH, q_len, kv_heads, HEAD_DIM))
            v = rng.standard_normal((LAYERS, BATCH, q_len, kv_heads, HEAD_DIM))
            c = jnp.asarray(counts[i % len(counts)] if counts else np.zeros(BATCH), jnp.int32)
            o, state = step(*(jnp.asarray(x, dtype) for x in (q, k, v)), c, state)
            outs.append(np.asarray(o, np.float32))
        stats = cache.engine.stats()
        cache.drain(state)
    return np.stack(outs), stats


CASES = {
    # name: (decode options, tolerance)
    "f32-gqa4-depth3": (dict(q_heads=8, kv_heads=2, dtype=np.float32, unit_rows=16, depth=3), 1e-5),
    "f32-mha-depth1": (dict(q_heads=2, kv_heads=2, dtype=np.float32, unit_rows=24, depth=1), 1e-5),
    "f32-mqa-windows": (
        dict(q_heads=4, kv_heads=1, dtype=np.float32, unit_rows=8, depth=3,
             sliding_window=[None, 9, 30]),
        1e-5,
    ),  # fmt: skip
    "f32-one-unit-per-layer": (
        dict(q_heads=4, kv_heads=2, dtype=np.float32, unit_rows=MAX_LEN, depth=3), 1e-5
    ),
    "f32-no-cross-step": (
        dict(q_heads=4, kv_heads=2, dtype=np.float32, unit_rows=16, depth=3,
             prefetch_across_steps=False),
        1e-5,
    ),  # fmt: skip
    "f32-scan": (
        dict(q_heads=4, kv_heads=2, dtype=np.float32, unit_rows=16, depth=1, scan=True), 1e-5
    ),
    "f32-ragged": (
        dict(q_heads=4, kv_heads=2, dtype=np.float32, unit_rows=16, depth=3, q_len=4,
             counts=[np.array([1, 4, 0]), np.array([3, 0, 2])]),
        1e-5,
    ),  # fmt: skip
    # bf16 rows are read exactly; the two paths differ only in f32 summation order, the
    # outputs then rounded to bf16 (one ulp: 2**-8 relative).
    "bf16-gqa4-depth3": (
        dict(q_heads=8, kv_heads=2, dtype=jnp.bfloat16, unit_rows=16, depth=3), 2**-7
    ),
    "bf16-windows-ragged": (
        dict(q_heads=4, kv_heads=2, dtype=jnp.bfloat16, unit_rows=8, depth=1, q_len=2,
             sliding_window=[5, None, None], counts=[np.array([2, 1, 0])]),
        2**-7,
    ),  # fmt: skip
    "int8-f32-gqa2": (
        dict(q_heads=4, kv_heads=2, dtype=np.float32, unit_rows=16, depth=3, tier_dtype="int8"),
        1e-5,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attended_where_it_landed_equals_the_staged_path(case, tmp_path):
    options, tol = CASES[case]
    got, stats = _decode(tmp_path, True, **options)
    want, staged = _decode(tmp_path, False, **options)
    assert np.isfinite(got).all()
    if "counts" in options:  # Padding rows' outputs are the caller's to ignore.
        for i in range(STEPS):
            c = options["counts"][i % len(options["counts"])]
            for b in range(BATCH):
                np.testing.assert_allclose(
                    got[i, :, b, : c[b]], want[i, :, b, : c[b]], rtol=tol, atol=tol,
                    err_msg=f"step {i} slot {b}",
                )  # fmt: skip
    else:
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # Every unit was read where it landed; fetched ahead as often as the staged path's.
    assert stats["landed_reads"] > 0 and staged["landed_reads"] == 0
    assert stats["prefetch_hits"] == staged["prefetch_hits"] > 0
    assert stats["prefetch_misses"] == staged["prefetch_misses"]
