"""Pallas TPU (Mosaic) kernel for per-chunk attention.

Flash-decoding over KV blocks with an online softmax. One grid step handles
one (batch row, KV head) pair; the ``G`` query heads that share the KV head
and all ``q_len`` queries are stacked into ``G * q_len`` rows so that each KV
block feeds a single matmul.

K and V stay in HBM (``memory_space=pl.ANY``) and are streamed into a
two-slot VMEM buffer with manual async copies: block ``j + 1`` is in flight
while block ``j`` is being computed. The per-row scalars (``k_start``,
``k_valid``, ``q_start``) are scalar-prefetched into SMEM, which lets the
kernel fetch only blocks that can hold a visible key: nothing past
``k_valid``, nothing entirely in the causal future of the last query, and
nothing entirely behind the sliding window of the first query.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common

__all__ = ["chunk_attention_tpu", "resolve_interpret"]

# Rows of a 32-bit VMEM tile; 16-bit dtypes pack twice as many rows per tile.
_SUBLANES = 8
# Lanes of a VMEM tile. Per-row scalars (query positions, lse) travel as
# lane-replicated [rows, 128] arrays: narrow [rows, 1] blocks would waste a
# full tile per 8 rows anyway and need masked, strided accesses.
_LANES = 128


def resolve_interpret(interpret: bool | Any) -> Any:
    """Maps the ``interpret`` knob to what the Mosaic pallas_call accepts.

    Plain ``interpret=True`` cannot simulate DMAs and semaphores, so it is
    upgraded to TPU interpret mode with default parameters.
    """
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


def _sublane_multiple(dtype: jnp.dtype) -> int:
    return _SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def _kernel(
    # Scalar prefetch (SMEM).
    k_start_ref,  # int32[batch]
    k_valid_ref,  # int32[batch]
    q_start_ref,  # int32[batch]
    # Inputs.
    q_ref,  # VMEM [rows, head_dim]
    row_t_ref,  # VMEM int32[rows, 128]: query index of each row, replicated
    k_hbm,  # HBM [batch, num_kv_heads, padded_len, head_dim]
    v_hbm,  # HBM [batch, num_kv_heads, padded_len, head_dim]
    # Quantized K/V only: ks_hbm, vs_hbm (HBM f32[batch, num_kv_heads, 1, padded_len]).
    # Outputs: out_ref (VMEM f32[rows, head_dim]), lse_ref (VMEM f32[rows, 128]: lse of
    # each row, replicated).
    # Scratch: k_buf, v_buf (VMEM [2 (slot), block_kv, head_dim]); quantized only: ks_buf,
    # vs_buf (VMEM f32[2, 1, block_kv]); sems (DMA semaphores [2 or 4 (k, v, ks, vs), 2]).
    *refs,
    scale: float,
    soft_cap: float | None,
    window: int | None,
    q_len: int,
    block_kv: int,
    num_blocks: int,
    quantized: bool,
):
    if quantized:
        ks_hbm, vs_hbm, out_ref, lse_ref, k_buf, v_buf, ks_buf, vs_buf, sems = refs
        sources, buffers = (k_hbm, v_hbm, ks_hbm, vs_hbm), (k_buf, v_buf, ks_buf, vs_buf)
    else:
        out_ref, lse_ref, k_buf, v_buf, sems = refs
        sources, buffers = (k_hbm, v_hbm), (k_buf, v_buf)
    b = pl.program_id(0)
    h = pl.program_id(1)
    k_start = k_start_ref[b]
    k_valid = k_valid_ref[b]
    q_start = q_start_ref[b]
    lo, hi = _common.block_range(
        k_start,
        k_valid,
        q_start,
        q_len=q_len,
        block_kv=block_kv,
        num_blocks=num_blocks,
        window=window,
    )

    def copies(block, slot):
        # Rebuilding the descriptors is cheap and lets start() and wait() sit
        # in different loop iterations.
        rows = pl.ds(pl.multiple_of(block * block_kv, block_kv), block_kv)
        # K and V rows are [block_kv, head_dim] slabs; scales [1, block_kv] lane rows.
        index = lambda i: (b, h, rows) if i < 2 else (b, h, slice(None), rows)
        return [
            pltpu.make_async_copy(src.at[index(i)], buf.at[slot], sems.at[i, slot])
            for i, (src, buf) in enumerate(zip(sources, buffers))
        ]

    @pl.when(lo < hi)
    def _():
        for c in copies(lo, 0):
            c.start()

    q = q_ref[...]
    rows, head_dim = q.shape
    q_pos = q_start + row_t_ref[:, :1]  # [rows, 1]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    v_row = jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry
        slot = jax.lax.rem(j - lo, 2)

        # Prefetch the next block into the other slot. That slot was last
        # read by the previous iteration's matmuls, which precede this point
        # in program order, so the overwrite cannot race with them.
        @pl.when(j + 1 < hi)
        def _():
            for c in copies(j + 1, 1 - slot):
                c.start()

        for c in copies(j, slot):
            c.wait()
        k = k_buf[slot]  # [block_kv, head_dim]
        v = v_buf[slot]
        if quantized:
            # Codes convert exactly to q's dtype (int8: |c| <= 127; fp8 into bf16/f32).
            k, v = k.astype(q.dtype), v.astype(q.dtype)

        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [rows, block_kv]
        if quantized:
            s = s * ks_buf[slot]  # (q . k_code) * s_k: dequantized in the logits.
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_idx = j * block_kv + col  # [1, block_kv]
        k_pos = k_start + k_idx
        visible = (k_idx < k_valid) & (k_pos <= q_pos)
        if window is not None:
            visible &= k_pos > q_pos - window
        # where(), not a large negative bias: garbage keys may make s NaN.
        s = jnp.where(visible, s, -jnp.inf)

        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # Rows with nothing visible yet keep m = -inf; shift them by 0 so
        # exp() yields 0 instead of NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        # Garbage values may be NaN and 0 * NaN = NaN: zero them explicitly.
        v = jnp.where(j * block_kv + v_row < k_valid, v, jnp.zeros_like(v))
        p_v = p
        if quantized:
            # Probabilities times s_v before P . V; garbage scales past k_valid zeroed.
            p_v = p * jnp.where(k_idx < k_valid, vs_buf[slot], 0.0)
        pv = jax.lax.dot_general(
            p_v.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        return m_new, l_new, alpha * acc_prev + pv

    init = (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(lo, hi, body, init)

    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out_ref[...] = jnp.where(seen, acc / l_safe, 0.0)
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def chunk_attention_tpu(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, chunk_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, chunk_len, num_kv_heads, head_dim]
    k_start: jax.Array,  # int32[batch]: absolute position of k[:, 0]
    k_valid: jax.Array,  # int32[batch]: keys at index >= k_valid are ignored
    q_start: jax.Array,  # int32[batch]: absolute position of q[:, 0]
    *,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
    block_kv: int | None = None,
    interpret: bool | Any = False,
    k_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
    v_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
) -> tuple[jax.Array, jax.Array]:
    """Per-chunk attention as a Pallas TPU kernel.

    Same contract as ``chunk_attention_reference`` (inputs, ``scale``, ``soft_cap``,
    ``window``, ``k_scale``/``v_scale``, outputs); only the kernel's own knobs are
    described here. Quantized K/V stay one byte per value in HBM and in VMEM; each block
    converts to ``q``'s dtype for the MXU, its scales applied to the logits and the
    probabilities.

    Args:
      block_kv: KV rows per DMA block; a multiple of 8 (16 for bf16 inputs).
        ``None`` picks it from the per-device table. ``chunk_len`` is padded
        up to a multiple of it.
      interpret: False to compile for TPU; a ``pltpu.InterpretParams`` (or
        True) to run in TPU interpret mode on any backend.

    Returns:
      ``(out, lse)``: f32[batch, q_len, num_q_heads, head_dim] and
      f32[batch, q_len, num_q_heads].

    Raises:
      ValueError: On inconsistent shapes, dtypes or knobs.
    """
    shape = _common.static_validate_inputs(
        q,
        k,
        v,
        k_start,
        k_valid,
        q_start,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    s = shape.chunk_len
    quantized = k_scale is not None
    # The MXU multiplies operands of one dtype; mixed inputs are promoted (codes convert
    # to q's dtype inside the kernel).
    dtype = q.dtype if quantized else jnp.promote_types(q.dtype, k.dtype)
    tiled = k.dtype if quantized else dtype  # One-byte codes: 32 rows a tile.
    align = max(_sublane_multiple(dtype), _sublane_multiple(tiled))
    if block_kv is None:
        # The table entry is an upper bound: no point in blocks longer than
        # the (aligned) chunk itself.
        block_kv = min(_common.default_block_kv("tpu"), _common.round_up(s, align))
        block_kv = _common.round_up(block_kv, align)
    _common.validate_block_kv(block_kv)
    if block_kv % align:
        raise ValueError(
            f"block_kv={block_kv} must be a multiple of {align} for the TPU "
            f"kernel (sublane tiling of {jnp.dtype(tiled).name})"
        )
    return _chunk_attention_tpu(
        q.astype(dtype),
        k if quantized else k.astype(dtype),
        v if quantized else v.astype(dtype),
        *_common.as_positions(k_start, k_valid, q_start),
        k_scale,
        v_scale,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if window is None else int(window),
        block_kv=int(block_kv),
        interpret=resolve_interpret(interpret),
        group=shape.group,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "window",
        "block_kv",
        "interpret",
        "group",
    ),
)
def _chunk_attention_tpu(
    q,
    k,
    v,
    k_start,
    k_valid,
    q_start,
    k_scale,
    v_scale,
    *,
    scale,
    soft_cap,
    window,
    block_kv,
    interpret,
    group,
):
    quantized = k_scale is not None
    b, t, hq, d = q.shape
    _, s, hkv, _ = k.shape
    g = group
    rows = t * g
    rows_pad = _common.round_up(rows, _sublane_multiple(q.dtype))
    s_pad = _common.round_up(s, block_kv)
    num_blocks = s_pad // block_kv

    # [B, T, Hkv*G, D] -> [B, Hkv, T*G, D]: row r is query r // G of group
    # member r % G. Padding rows are zero queries whose output is dropped.
    q_rows = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(b, hkv, rows, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    row_t = jnp.minimum(jnp.arange(rows_pad, dtype=jnp.int32) // g, t - 1)
    row_t = jnp.broadcast_to(row_t[:, None], (rows_pad, _LANES))

    # Head-major K/V make every (batch, head, block) a dense [block_kv, D]
    # slab in HBM, i.e. one contiguous, tile-aligned DMA per block. The extra
    # transpose is an on-device copy of a chunk that just crossed the much
    # slower host link.
    def head_major(x):
        x = jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3)

    # Scales [B, S, Hkv] -> [B, Hkv, 1, S_pad]: a block's scales are one lane row.
    def scale_rows(x):
        return jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0))).transpose(0, 2, 1)[:, :, None, :]

    k_valid = jnp.clip(k_valid, 0, s)

    kernel = functools.partial(
        _kernel,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        q_len=t,
        block_kv=block_kv,
        num_blocks=num_blocks,
        quantized=quantized,
    )
    row_block = lambda bi, hi, *_: (bi, hi, 0, 0)
    kv_inputs = [head_major(k), head_major(v)]
    kv_scratch = [pltpu.VMEM((2, block_kv, d), k.dtype), pltpu.VMEM((2, block_kv, d), v.dtype)]
    if quantized:
        kv_inputs += [scale_rows(k_scale), scale_rows(v_scale)]
        kv_scratch += [pltpu.VMEM((2, 1, block_kv), jnp.float32)] * 2
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hkv),
            in_specs=[
                pl.BlockSpec((None, None, rows_pad, d), row_block),
                pl.BlockSpec((rows_pad, _LANES), lambda bi, hi, *_: (0, 0)),
            ]
            + [pl.BlockSpec(memory_space=pl.ANY)] * len(kv_inputs),
            out_specs=[
                pl.BlockSpec((None, None, rows_pad, d), row_block),
                pl.BlockSpec((None, None, rows_pad, _LANES), row_block),
            ],
            scratch_shapes=[*kv_scratch, pltpu.SemaphoreType.DMA((len(kv_inputs), 2))],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, rows_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, rows_pad, _LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            # Grid steps are independent (each drains its own DMAs).
            dimension_semantics=("parallel", "parallel"),
        ),
        interpret=interpret,
        name="chunk_attention_tpu",
    )(k_start, k_valid, q_start, q_rows, row_t, *kv_inputs)

    out = out[:, :, :rows].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, :rows, 0].reshape(b, hkv, t, g).transpose(0, 2, 1, 3)
    return out.reshape(b, t, hq, d), lse.reshape(b, t, hq)
