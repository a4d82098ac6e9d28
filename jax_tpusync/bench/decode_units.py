"""The fixed-context unit walk of the ``compute``, ``sync`` and ``transfer`` decode variants.

Those variants do by hand what :func:`jax_tpusync.prefetching_attention` does: the units of
a fixed context (:func:`units`), their segments built on the host from the cache's block
tables (:func:`unit_table`, :func:`absolute_regions`), and the attention over them unit by
unit plus the new token (:func:`unit_attention`), with the library's per-unit math.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def units(context: int, chunk_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(first position, valid tokens) int32[U] of the units of a fixed ``context``."""
    n = max(1, -(-context // chunk_len))
    lo = np.arange(n, dtype=np.int64) * chunk_len
    return lo.astype(np.int32), np.clip(context - lo, 0, chunk_len).astype(np.int32)


def unit_table(cache, context: int, slots: int) -> np.ndarray:
    """Host-side segments int32[L, U, slots, 2B, 4] of every unit of a fixed ``context``.

    Unit u of layer l landing in staging slot s, through the cache's block tables (absolute
    tier blocks). The benchmark admits every slot at init(), so each slot's blocks are
    consecutive: one segment per (K|V, slot) and unit.
    """
    from jax_tpusync.runtime import ops

    spec = cache.spec
    c = spec.chunk_len
    lo, count = units(context, c)
    table = np.zeros((spec.num_layers, len(lo), slots, 2 * spec.batch, 4), np.int32)
    for layer in range(spec.num_layers):
        for u in range(len(lo)):
            for s in range(slots):
                tier_off, mem_off, sizes = [], [], []
                for kv in range(2):
                    for b in range(spec.batch):
                        runs = cache.tier_rows(layer, kv, b, int(lo[u]), int(lo[u] + count[u]))
                        if len(runs) > 1:
                            raise AssertionError("the benchmark's slots hold consecutive blocks")
                        offset, n = runs[0] if runs else (0, 0)
                        tier_off.append(offset)
                        mem_off.append(((s * 2 + kv) * spec.batch + b) * c * spec.row_bytes)
                        sizes.append(n)
                table[layer, u, s] = ops.segment_rows(tier_off, mem_off, sizes, spec.block_bytes)
    return table


def absolute_regions(cache):
    """The cache's (layer, K|V) regions in absolute tier bytes, for host-built segments
    that span blocks (the sync and transfer rows)."""
    from jax_tpusync.runtime import ops

    spec = cache.spec
    return ops.Regions(
        base=cache.first_block * spec.block_bytes,
        nbytes=spec.num_blocks * spec.block_bytes,
        count=2 * spec.num_layers,
    )


def tag(layer, unit):
    import jax.numpy as jnp

    return jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(unit, jnp.int32)])


def unit_attention(q, k, v, get_unit: Callable, buf, shape, spec, lengths: np.ndarray):
    """Attention over every unit of ``shape.context`` + the new token, from ``spec``'s
    staging slots in ``buf``; ``lengths``: the context per sequence (a NumPy constant).

    ``get_unit(u, buf, deps) -> (buf, slot)``: unit ``u`` sits in staging slot ``slot``.
    """
    import jax
    import jax.numpy as jnp

    from jax_tpusync.kernels import reference as kref
    from jax_tpusync.step.unit import attend_valid_rows, staged_block_len, staged_rows

    dtype, scale = shape.dtype, 1.0 / math.sqrt(shape.head_dim)
    unit_lo, unit_count = units(shape.context, spec.chunk_len)
    lo_all, count_all = jnp.asarray(unit_lo), jnp.asarray(unit_count)

    def unit(u, carry):
        out, lse, buf = carry
        buf, slot = get_unit(u, buf, (q, out))
        lo = jnp.full((shape.batch,), lo_all[u], jnp.int32)
        cnt = jnp.full((shape.batch,), count_all[u], jnp.int32)
        o, l = attend_valid_rows(
            lambda start, n, valid: kref.chunk_attention_reference(
                q,
                *staged_rows(buf, slot, start, n, dtype),
                lo + start,
                valid,
                lengths,
                scale=scale,
            ),
            cnt,
            spec.chunk_len,
            staged_block_len(spec),
            q.shape,
        )
        out, lse = kref.merge_partials(out, lse, o, l)
        return out, lse, buf

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32), buf)
    if len(unit_lo) == 1:
        out, lse, buf = unit(0, carry)
    else:
        out, lse, buf = jax.lax.fori_loop(0, len(unit_lo), unit, carry)
    o, l = kref.chunk_attention_reference(
        q,
        k.astype(dtype),
        v.astype(dtype),
        lengths,
        jnp.ones((shape.batch,), jnp.int32),
        lengths,
        scale=scale,
    )
    out, _ = kref.merge_partials(out, lse, o, l)
    return out.astype(q.dtype), buf
