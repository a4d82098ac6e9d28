"""attend_in_place with a prefill chunk's many query rows (the kernel's blocks-and-panels
path) and per-sequence real query rows (positions' fourth row), against the jnp reference:
GQA groups 1 to 8, head_dim 64 to 256, several blocks of keys with a partial last one,
windows and soft caps, bf16 values and int8/fp8 rows, ragged real rows incl. 0 and all;
each build of the kernel (AVX-512, AVX2, baseline); the guard on the real rows at its
edges."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import child_env
from support.attend_pool import Pool

XlaError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)

UNIT = 300  # Keys in blocks of 128: two whole blocks and a partial one.
Q_LEN = 40


def check_case(pool, q, *, q_rows, window, soft_cap, tol):
    """The op over four sequences (no key; 129 keys, queries past them; a full unit whose
    queries sit among its keys; 77 keys) against the reference, row by row for the real
    rows; the padding rows are out 0, lse -inf."""
    valid = np.array([0, 129, UNIT, 77], np.int32)
    pool.poison_after(valid)
    k_start = np.array([5, 0, 200, 10], np.int32)
    q_start = k_start + np.array([0, 129, 150, 77], np.int32)
    kw = {"scale": q.shape[-1] ** -0.5, "soft_cap": soft_cap, "window": window}
    out, lse = pool.attend(q, pool.segments(valid), k_start, valid, q_start, q_rows, **kw)
    want, want_lse = pool.reference(q, k_start, valid, q_start, **kw)
    out, lse, want, want_lse = map(np.asarray, (out, lse, want, want_lse))
    rows = np.full(4, Q_LEN) if q_rows is None else q_rows
    for b in range(4):
        n = int(rows[b])
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=tol, atol=tol)
        np.testing.assert_allclose(lse[b, :n], want_lse[b, :n], rtol=tol, atol=tol)
        assert np.all(out[b, n:] == 0) and np.all(np.isneginf(lse[b, n:]))


def make_pool(engine, *, group, head_dim, stored, seed=0):
    dtype = jnp.bfloat16 if stored in (None, "int8", "float8_e4m3fn") else stored
    tier_dtype = stored if stored in ("int8", "float8_e4m3fn") else None
    return Pool(
        engine,
        batch=4,
        unit_len=UNIT,
        kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
        block_rows=64,
        seed=seed,
        tier_dtype=tier_dtype,
    )


@pytest.mark.parametrize("group", [1, 2, 4, 8], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_a_chunk_of_queries_matches_the_reference(make_engine, group, head_dim):
    """bf16 rows; every query real, then ragged real rows (0, 1, all, 17); without and with
    a window and a soft cap."""
    pool = make_pool(make_engine(), group=group, head_dim=head_dim, stored=None, seed=group)
    rng = np.random.default_rng(head_dim + group)
    q = jnp.asarray(rng.standard_normal((4, Q_LEN, 2 * group, head_dim)), jnp.float32)
    ragged = np.array([0, 1, Q_LEN, 17], np.int32)
    for q_rows, window, soft_cap in (
        (None, None, None),
        (ragged, None, None),
        (ragged, 100, 20.0),
    ):
        check_case(pool, q, q_rows=q_rows, window=window, soft_cap=soft_cap, tol=2e-5)


@pytest.mark.parametrize("tier_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (8, 256)], ids=str)
def test_a_chunk_over_quantized_rows_matches_the_dequantized_reference(
    make_engine, tier_dtype, group, head_dim
):
    """int8 and fp8 rows (scales applied in the kernel), ragged real rows, a window and a
    soft cap; the rows past each sequence's valid keys are NaN and never read."""
    pool = make_pool(make_engine(), group=group, head_dim=head_dim, stored=tier_dtype)
    rng = np.random.default_rng(head_dim)
    q = jnp.asarray(rng.standard_normal((4, Q_LEN, 2 * group, head_dim)), jnp.float32)
    ragged = np.array([3, Q_LEN, 0, 16], np.int32)
    # Values up to ~4x larger than the bf16 case's, 300 keys of 256 values: f32 sums in
    # another order differ by up to ~2e-5 on outputs of magnitude ~1.
    for window, soft_cap in ((None, None), (60, 5.0)):
        check_case(pool, q, q_rows=ragged, window=window, soft_cap=soft_cap, tol=5e-5)


def test_a_sequence_without_real_rows_reads_none_of_its_keys(make_engine):
    """Sequence 1's valid keys are NaN: with no real query row it reads none of them (its
    out 0, lse -inf), and the others' rows match the reference over their own keys."""
    pool = make_pool(make_engine(split_read_bytes=1), group=2, head_dim=64, stored=np.float32)
    nan = np.full((64, 2, 64), np.nan, np.float32)
    for kv in range(2):
        for row in (0, 64):
            pool.write_rows(kv, 1, row, nan)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((4, Q_LEN, 4, 64)), jnp.float32)
    valid = np.array([0, 129, UNIT, 77], np.int32)
    k_start = np.zeros(4, np.int32)
    q_rows = np.array([Q_LEN, 0, 9, Q_LEN], np.int32)
    out, lse = pool.attend(q, pool.segments(valid), k_start, valid, valid, q_rows, scale=0.125)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    assert np.all(np.isfinite(out))
    want, want_lse = map(np.asarray, pool.reference(q, k_start, valid, valid, scale=0.125))
    for b in (0, 2, 3):
        n = int(q_rows[b])
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse[b, :n], want_lse[b, :n], rtol=2e-5, atol=2e-5)


def test_real_rows_must_lie_in_zero_to_q_len(make_engine):
    """positions[3, b] = 0 and = q_len pass; -1 and q_len + 1 are refused, naming it."""
    pool = Pool(
        make_engine(), batch=2, unit_len=8, kv_heads=1, head_dim=8, dtype=np.float32, block_rows=4
    )
    q = jnp.zeros((2, 3, 2, 8), jnp.float32)
    valid = np.array([8, 8], np.int32)
    zero = np.zeros(2, np.int32)
    pool.attend(q, pool.segments(valid), zero, valid, valid, np.array([0, 3]), scale=1.0)
    for bad, b in ((np.array([4, 3]), 0), (np.array([0, -1]), 1)):
        with pytest.raises(
            XlaError,
            match=rf"positions\[3, {b}\] = {bad[b]} real query rows must be in "
            r"\[0, q_len = 3\]",
        ):
            out, _ = pool.attend(q, pool.segments(valid), zero, valid, valid, bad, scale=1.0)
            out.block_until_ready()


@pytest.mark.parametrize("isa", ["baseline", "avx2"])
def test_every_build_matches_the_reference(isa):
    """The AVX2 and baseline builds (``TPUSYNC_CPU_ISA``) on the many-query path: bf16 and
    int8 rows, a head_dim off every vector width, ragged real rows, a window, a soft cap."""
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np, jax.numpy as jnp
        from jax_tpusync import Engine, _tpusync
        assert _tpusync.pool_attention_isa() == {isa!r}, _tpusync.pool_attention_isa()
        from support import load_module
        t = load_module({__file__!r})
        check_case, make_pool, Q_LEN = t.check_case, t.make_pool, t.Q_LEN
        with Engine() as e:
            for stored, head_dim, group in ((None, 128, 4), ("int8", 44, 2), (None, 44, 8)):
                pool = make_pool(e, group=group, head_dim=head_dim, stored=stored)
                rng = np.random.default_rng(head_dim)
                q = jnp.asarray(rng.standard_normal((4, Q_LEN, 2 * group, head_dim)),
                                jnp.float32)
                for window, cap in ((None, None), (100, 20.0)):
                    check_case(pool, q, q_rows=np.array([0, 5, Q_LEN, 17], np.int32),
                               window=window, soft_cap=cap, tol=2e-5)
        print("ok")
        """
    )
    flags = pathlib.Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    if isa == "avx2" and not all(f" {f}" in flags for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    run = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(TPUSYNC_CPU_ISA=isa),
        cwd="/",
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
