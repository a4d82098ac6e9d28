"""attend_in_place: attention over a host tier's rows where they lie, against the jnp
reference; its ordering after write-backs; and every guard on what a segment may address,
tried at exactly its edge."""

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
from jax_tpusync.kernels import reference

from jax_tpusync import ops

XlaError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
TAG = np.array([0, 0], np.int32)


class Pool:
    """A host tier holding per-sequence K and V rows in scattered blocks of ``block_rows``
    rows, and the fetch segments of a unit of ``unit_len`` rows over them."""

    def __init__(self, engine, *, batch, unit_len, kv_heads, head_dim, dtype, block_rows, seed=0):
        self.engine, self.batch, self.unit_len = engine, batch, unit_len
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, np.dtype(dtype)
        self.row_bytes = kv_heads * head_dim * self.dtype.itemsize
        self.block_rows = block_rows
        self.block_bytes = block_rows * self.row_bytes
        blocks_per_seq = -(-unit_len // block_rows)
        self.num_blocks = 2 * batch * blocks_per_seq
        self.tier = engine.add_host_tier(block_bytes=self.block_bytes, num_blocks=self.num_blocks)
        rng = np.random.default_rng(seed)
        shape = (batch, unit_len, kv_heads, head_dim)
        self.k = rng.standard_normal(shape).astype(np.float32).astype(self.dtype)
        self.v = rng.standard_normal(shape).astype(np.float32).astype(self.dtype)
        # Block of (kv, sequence, i): a fixed shuffle, so no sequence's blocks are in order.
        order = rng.permutation(self.num_blocks)
        self.block_of = order.reshape(2, batch, blocks_per_seq)
        for kv, rows in ((0, self.k), (1, self.v)):
            for b in range(batch):
                for i in range(blocks_per_seq):
                    chunk = rows[b, i * block_rows : (i + 1) * block_rows]
                    at = int(self.block_of[kv, b, i]) * self.block_bytes
                    engine.write(self.tier, at, np.ascontiguousarray(chunk).view(np.uint8))

    def segments(self, valid) -> list[list[int]]:
        """[tier offset, memory offset, bytes] of rows [0, valid[b]) of every sequence."""
        out = []
        for kv in range(2):
            for b in range(self.batch):
                for row in range(0, int(valid[b]), self.block_rows):
                    n = min(self.block_rows, int(valid[b]) - row)
                    i = row // self.block_rows
                    out.append(
                        [
                            int(self.block_of[kv, b, i]) * self.block_bytes,
                            ((kv * self.batch + b) * self.unit_len + row) * self.row_bytes,
                            n * self.row_bytes,
                        ]
                    )
        return out

    def rows(self, segments) -> jax.Array:
        t, m, n = zip(*segments) if segments else ((), (), ())
        return jnp.asarray(ops.segment_rows(t, m, n, self.block_bytes))

    def reference(self, q, k_start, valid, q_start, **kw):
        """The jnp reference's (out, lse) over the pool's rows."""
        k_start, valid, q_start = (jnp.asarray(x, jnp.int32) for x in (k_start, valid, q_start))
        return reference.chunk_attention_reference(
            q, jnp.asarray(self.k), jnp.asarray(self.v), k_start, valid, q_start, **kw
        )

    def attend(self, q, segments, k_start, valid, q_start, **kw):
        positions = jnp.asarray(np.stack([k_start, valid, q_start]).astype(np.int32))
        fn = jax.jit(
            lambda q, s, p: ops.attend_in_place(
                self.engine.id,
                self.tier,
                q,
                s,
                p,
                TAG,
                unit_len=self.unit_len,
                kv_dtype=self.dtype,
                num_kv_heads=self.kv_heads,
                **kw,
            )
        )
        return fn(q, self.rows(segments), positions)


SHAPES = [
    # q heads, kv heads, head_dim, q_len: GQA groups of 2 and 8, MHA, a head_dim off the
    # 8-lane and 32-value vector widths, and several queries (causal within them).
    (16, 8, 64, 1),
    (8, 1, 128, 1),
    (4, 4, 12, 3),
    (6, 2, 40, 2),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("split_read_bytes", [0, 1], ids=["one-thread", "two-threads"])
def test_matches_the_reference(make_engine, dtype, heads, split_read_bytes):
    """Three sequences (one with no key, one with a partial last block, one full unit whose
    queries sit among its keys) in shuffled blocks, on one thread and split with the copy
    helper: the reference's output and log-sum-exp, with a window and a soft cap or
    without."""
    q_heads, kv_heads, head_dim, q_len = heads
    e = make_engine(split_read_bytes=split_read_bytes)
    unit = 70
    pool = Pool(
        e, batch=3, unit_len=unit, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_rows=16
    )
    valid = np.array([0, 37, unit], np.int32)
    k_start = np.array([5, 0, 200], np.int32)
    # Sequence 2's queries sit among its keys: the keys after each query are masked.
    q_start = k_start + np.array([0, 37, 40], np.int32)
    q = jnp.asarray(
        np.random.default_rng(1).standard_normal((3, q_len, q_heads, head_dim)), jnp.float32
    )
    for window, soft_cap in ((None, None), (23, 30.0)):
        out, lse = pool.attend(
            q,
            pool.segments(valid),
            k_start,
            valid,
            q_start,
            scale=0.3,
            soft_cap=soft_cap,
            window=window,
        )
        want_out, want_lse = pool.reference(
            q, k_start, valid, q_start, scale=0.3, soft_cap=soft_cap, window=window
        )
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-6, atol=2e-6)
        assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
    stats = e.stats()
    assert stats["in_place_reads"] == 2
    assert stats["tiers"][pool.tier]["fetch"]["bytes"] == 2 * 2 * int(valid.sum()) * pool.row_bytes


def test_a_segment_running_on_into_the_next_sequence_is_cut_there(make_engine):
    """Contiguous on the tier and in the unit's rows, one segment may hold the end of one
    sequence's K rows and the start of the next one's: each sequence attends to its own."""
    e = make_engine()
    unit = 8
    pool = Pool(
        e, batch=2, unit_len=unit, kv_heads=2, head_dim=8, dtype=np.float32, block_rows=unit
    )
    rb, bb = pool.row_bytes, pool.block_bytes
    # Rewrite the tier so that sequence 0's K block is followed by sequence 1's.
    for b in range(2):
        e.write(pool.tier, b * bb, pool.k[b].view(np.uint8))
        e.write(pool.tier, (2 + b) * bb, pool.v[b].view(np.uint8))
    segments = [[0, 0, 2 * unit * rb], [2 * bb, 2 * unit * rb, 2 * unit * rb]]
    valid = np.array([unit, unit], np.int32)
    zero = np.zeros(2, np.int32)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, 4, 8)), jnp.float32)
    out, lse = pool.attend(q, segments, zero, valid, valid, scale=1.0)
    want, want_lse = pool.reference(q, zero, valid, valid, scale=1.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-6, atol=2e-6)


def test_it_reads_after_an_earlier_write_back_of_its_rows(make_engine):
    """A write-back queued before the read (and slowed down) lands first: the read sees
    the new rows, never the old ones."""
    e = make_engine(debug_delay_us=50_000)
    unit = 16
    pool = Pool(
        e, batch=1, unit_len=unit, kv_heads=1, head_dim=8, dtype=np.float32, block_rows=unit
    )
    new_k = np.full((unit, 1, 8), 3.0, np.float32)
    new_k[5] = 9.0
    segments = pool.segments([unit])
    k_rows = pool.rows(segments[:1])  # The K block, from memory offset 0 of new_k.

    def step(q, src):
        token = ops.write_back(e.id, pool.tier, src, k_rows, TAG)
        positions = jnp.asarray([[0], [unit], [unit]], jnp.int32)
        return ops.attend_in_place(
            e.id,
            pool.tier,
            q,
            pool.rows(segments),
            positions,
            TAG,
            unit_len=unit,
            kv_dtype=np.float32,
            num_kv_heads=1,
            scale=1.0,
            deps=(token,),
        )

    q = jnp.ones((1, 1, 1, 8), jnp.float32)
    _, lse = jax.jit(step)(q, jnp.asarray(new_k))
    _, want = reference.chunk_attention_reference(
        q,
        jnp.asarray(new_k[None]),
        jnp.asarray(pool.v),
        jnp.zeros(1, jnp.int32),
        jnp.full(1, unit, jnp.int32),
        jnp.full(1, unit, jnp.int32),
        scale=1.0,
    )
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), rtol=1e-6)


def _refusal(pool, segments, valid, match):
    q = jnp.zeros((pool.batch, 1, 2, pool.head_dim), jnp.float32)
    zero = np.zeros(pool.batch, np.int32)
    with pytest.raises(XlaError, match=match):
        jax.block_until_ready(
            pool.attend(
                q, segments, zero, np.asarray(valid, np.int32), zero + pool.unit_len, scale=1.0
            )
        )


@pytest.fixture
def small_pool(make_engine):
    return Pool(
        make_engine(), batch=2, unit_len=8, kv_heads=2, head_dim=4, dtype=np.float32, block_rows=4
    )


def test_each_sequences_rows_must_be_exactly_its_valid_keys(small_pool):
    """K or V rows one short of, or one past, the valid keys; a gap; a row twice: refused,
    naming the sequence. Exactly the valid keys (a full unit included) pass."""
    p = small_pool
    q = jnp.zeros((2, 1, 2, 4), jnp.float32)
    zero = np.zeros(2, np.int32)
    for valid in ([8, 8], [5, 0]):  # At the edge: a whole unit; a partial block and none.
        jax.block_until_ready(
            p.attend(q, p.segments(valid), zero, np.asarray(valid, np.int32), zero + 8, scale=1.0)
        )
    segs = p.segments([5, 8])
    short = [list(s) for s in segs]
    short[1][2] -= p.row_bytes  # Sequence 0's K: rows [0, 4), valid 5.
    _refusal(p, short, [5, 8], r"tpusync: the K rows of sequence 0 cover 4 rows, but it has 5")
    _refusal(p, segs, [4, 8], r"the K rows of sequence 0 cover 5 rows, but it has 4 valid keys")
    gap = [s for i, s in enumerate(segs) if i != 2]  # Sequence 1's K rows [0, 4) missing.
    _refusal(p, gap, [5, 8], r"the K rows of sequence 1 skip to row 4")
    twice = segs + [segs[-1]]  # Sequence 1's last V block again.
    _refusal(p, twice, [5, 8], r"the V rows of sequence 1 overlap at row 4")
    v_short = [list(s) for s in segs]
    v_short[-1][2] -= p.row_bytes
    _refusal(p, v_short, [5, 8], r"the V rows of sequence 1 cover 7 rows, but it has 8")


def test_valid_keys_must_fit_the_unit_and_segments_whole_rows(small_pool):
    p = small_pool
    _refusal(p, p.segments([8, 8]), [9, 8], r"sequence 0 has 9 valid keys in a unit of 8 rows")
    _refusal(p, p.segments([8, 8]), [-1, 8], r"sequence 0 has -1 valid keys")
    partial = [list(s) for s in p.segments([5, 8])]
    partial[1][2] -= 1  # One byte short of a row.
    # (Segments are counted after the engine merges contiguous ones.)
    _refusal(p, partial, [5, 8], r"tpusync: segment \d+ is not whole rows of 32 bytes")


def test_a_segment_must_lie_inside_the_units_rows(small_pool):
    """The unit's rows are [2, batch, unit_len] rows: a segment ending exactly at their end
    passes, one row further is refused before anything is read."""
    p = small_pool
    end = 2 * p.batch * p.unit_len * p.row_bytes
    segs = p.segments([8, 8])
    assert max(m + n for _, m, n in segs) == end
    past = [list(s) for s in segs]
    past[-1][1] += p.row_bytes  # Sequence 1's last V block, one row later.
    _refusal(
        p, past, [8, 8], r"tpusync: segment \d+ covers bytes \[928, 1056\) of a 1024-byte buffer"
    )
    assert p.engine.stats()["in_place_reads"] == 0


def test_only_a_memory_tier_is_read_in_place(make_engine, file_dir):
    e = make_engine()
    tier = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=4)
    segs = jnp.asarray(ops.segment_rows([0, 4096], [0, 32], [32, 32], 4096))
    positions = jnp.asarray([[0], [1], [1]], jnp.int32)
    with pytest.raises(XlaError, match=r"tpusync: tier 0 \(.*\) is not in memory"):
        jax.block_until_ready(
            jax.jit(
                lambda q: ops.attend_in_place(
                    e.id,
                    tier,
                    q,
                    segs,
                    positions,
                    TAG,
                    unit_len=1,
                    kv_dtype=np.float32,
                    num_kv_heads=2,
                    scale=1.0,
                )
            )(jnp.zeros((1, 1, 2, 4), jnp.float32))
        )


def test_python_side_checks_name_the_argument(small_pool):
    p = small_pool
    q = jnp.zeros((2, 1, 2, 4), jnp.float32)
    segs = p.rows(p.segments([8, 8]))
    pos = jnp.zeros((3, 2), jnp.int32)

    def call(q=q, positions=pos, **kw):
        knobs = {"unit_len": 8, "kv_dtype": np.float32, "num_kv_heads": 2, "scale": 1.0, **kw}
        return ops.attend_in_place(p.engine.id, p.tier, q, segs, positions, TAG, **knobs)

    with pytest.raises(ValueError, match=r"kv_dtype=float16 must be float32 or bfloat16"):
        call(kv_dtype=np.float16)
    with pytest.raises(ValueError, match=r"q must be f32\[batch, q_len, heads, head_dim\]"):
        call(q=q.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"positions must be int32\[3, batch=2\]"):
        call(positions=jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"unit_len=0 must be an int >= 1"):
        call(unit_len=0)
    with pytest.raises(ValueError, match=r"2 query heads are not a multiple of 4 kv heads"):
        call(num_kv_heads=4)


def test_the_baseline_build_matches_the_reference_too():
    """The kernel is compiled for AVX2 with FMA and for the baseline ISA, picked per CPU at
    load: the baseline one (forced by ``TPUSYNC_CPU_ISA=baseline``) gives the reference's
    numbers as well, on a head_dim off both vector widths."""
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np, jax.numpy as jnp
        from jax_tpusync import Engine, _tpusync
        assert _tpusync.pool_attention_isa() == "baseline", _tpusync.pool_attention_isa()
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from test_ops_attend_in_place import Pool
        with Engine() as e:
            pool = Pool(e, batch=2, unit_len=45, kv_heads=2, head_dim=44, dtype=jnp.bfloat16,
                        block_rows=16)
            valid = np.array([45, 20], np.int32)
            start = np.zeros(2, np.int32)
            q = jnp.asarray(np.random.default_rng(4).standard_normal((2, 2, 6, 44)), jnp.float32)
            out, lse = pool.attend(q, pool.segments(valid), start, valid, valid - 1, scale=0.2)
            want, want_lse = pool.reference(q, start, valid, valid - 1, scale=0.2)
            print(float(np.max(np.abs(np.asarray(out) - np.asarray(want)))),
                  float(np.max(np.abs(np.asarray(lse) - np.asarray(want_lse)))))
        """
    )
    env = {**os.environ, "TPUSYNC_CPU_ISA": "baseline"}
    run = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out_err, lse_err = map(float, run.stdout.split()[-2:])
    assert out_err <= 2e-6 and lse_err <= 2e-6, run.stdout


def test_this_cpu_runs_the_build_it_supports():
    from jax_tpusync import _tpusync

    flags = pathlib.Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    has_avx2 = " avx2" in flags and " fma" in flags
    assert _tpusync.pool_attention_isa() == ("avx2" if has_avx2 else "baseline")
