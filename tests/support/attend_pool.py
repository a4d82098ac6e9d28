"""A host tier of per-sequence K and V rows in scattered blocks and the fetch segments of a
unit over them (``Pool``), with the jnp reference it is checked against: the in-place
attention tests' fixture, shared by test_ops_attend_in_place*.py and test_ops_attend_landed.py
(and their child processes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax_tpusync.kernels import reference

from jax_tpusync.core import quantize
from jax_tpusync.runtime import ops

# The engine's attention sums in another order than the jnp reference; how far the two
# drift depends on the CPU (f32: 4.1e-6 seen on an AMD EPYC; quantized rows, which are
# dequantized on the way, 1.5e-5).
EXACT_ORDER_APART = dict(rtol=1e-5, atol=1e-5)
QUANTIZED_APART = dict(rtol=4e-5, atol=4e-5)

XlaError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
TAG = np.array([0, 0], np.int32)


class Pool:
    """A host tier holding per-sequence K and V rows in scattered blocks of ``block_rows``
    rows, and the fetch segments of a unit of ``unit_len`` rows over them. With
    ``tier_dtype`` the rows are a quantized tier's (codes, per-head scales, padding), each
    (token, head) of its own magnitude, and the reference attends to what they stand for,
    dequantized first."""

    def __init__(
        self,
        engine,
        *,
        batch,
        unit_len,
        kv_heads,
        head_dim,
        dtype,
        block_rows,
        seed=0,
        tier_dtype=None,
        add_tier=None,  # (block_bytes=, num_blocks=) -> tier; None: a host tier
    ):
        self.engine, self.batch, self.unit_len = engine, batch, unit_len
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, np.dtype(dtype)
        self.tier_dtype = None if tier_dtype is None else np.dtype(tier_dtype)
        if self.tier_dtype is None:
            self.row_bytes = kv_heads * head_dim * self.dtype.itemsize
        else:
            self.row_bytes = quantize.row_bytes(kv_heads, head_dim)
        self.block_rows = block_rows
        self.block_bytes = block_rows * self.row_bytes
        blocks_per_seq = -(-unit_len // block_rows)
        self.num_blocks = 2 * batch * blocks_per_seq
        add_tier = add_tier or engine.add_host_tier
        self.tier = add_tier(block_bytes=self.block_bytes, num_blocks=self.num_blocks)
        rng = np.random.default_rng(seed)
        shape = (batch, unit_len, kv_heads, head_dim)
        if self.tier_dtype is None:
            self.k = rng.standard_normal(shape).astype(np.float32).astype(self.dtype)
            self.v = rng.standard_normal(shape).astype(np.float32).astype(self.dtype)
            stored = (self.k, self.v)
        else:
            stored, values = [], []
            for _ in range(2):
                x = rng.standard_normal(shape).astype(np.float32)
                x *= rng.uniform(0.05, 4.0, (*shape[:3], 1)).astype(np.float32)
                rows = quantize.quantize_host(x, self.tier_dtype)
                stored.append(rows)
                values.append(self.dequantized(rows))
            self.k, self.v = values
        self.stored = stored
        # Block of (kv, sequence, i): a fixed shuffle, so no sequence's blocks are in order.
        order = rng.permutation(self.num_blocks)
        self.block_of = order.reshape(2, batch, blocks_per_seq)
        for kv, rows in enumerate(stored):
            for b in range(batch):
                for i in range(blocks_per_seq):
                    row = i * block_rows
                    self.write_rows(kv, b, row, rows[b, row : row + block_rows])

    def write_rows(self, kv, b, row, rows):
        """Writes ``rows`` (stored form) as sequence ``b``'s K (kv 0) or V rows from ``row``
        (within one block)."""
        i, at = divmod(row, self.block_rows)
        offset = int(self.block_of[kv, b, i]) * self.block_bytes + at * self.row_bytes
        self.engine.write(self.tier, offset, np.array(rows, order="C").view(np.uint8))

    def dequantized(self, rows: np.ndarray) -> np.ndarray:
        """f32 values of quantized rows: codes times scales (the dequantize-first form)."""
        stored = quantize.unpack_host(rows, self.tier_dtype, self.kv_heads, self.head_dim)
        return quantize.dequantize_host(stored, np.float32)

    def poison_after(self, valid):
        """Rows past each sequence's valid keys become NaN scales and codes (0xff: int8 -1,
        an fp8 NaN); unquantized rows NaN values. The op must never read them."""
        for kv in range(2):
            for b in range(self.batch):
                for row in range(int(valid[b]), self.unit_len):
                    if self.tier_dtype is None:
                        bad = np.full((1, self.kv_heads, self.head_dim), np.nan, self.dtype)
                    else:
                        bad = np.full((1, self.row_bytes), 0xFF, np.uint8)
                        at = self.kv_heads * self.head_dim
                        bad[0, at : at + 4 * self.kv_heads] = np.full(
                            self.kv_heads, np.nan, np.float32
                        ).view(np.uint8)
                    self.write_rows(kv, b, row, bad)

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

    def attend(self, q, segments, k_start, valid, q_start, q_rows=None, **kw):
        """The op's (out, lse); with ``q_rows`` only each sequence's first q_rows[b] queries
        attend (positions' fourth row)."""
        rows = [k_start, valid, q_start] + ([] if q_rows is None else [q_rows])
        positions = jnp.asarray(np.stack(rows).astype(np.int32))
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
                tier_dtype=self.tier_dtype,
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
