"""Pallas GPU (Triton) kernel for per-chunk attention.

Split-K flash-decoding: the grid is (batch row, KV head, KV split). Each
program walks the KV blocks of its split with an online softmax and writes a
partial ``(out, lse)``; the partials are merged afterwards in plain jnp. For
decode-sized query counts this is what keeps the GPU busy: ``batch *
num_kv_heads`` alone is usually far below the number of SMs.

As in the TPU kernel, the ``G`` query heads sharing a KV head and all
``q_len`` queries are stacked into ``G * q_len`` rows so each KV block feeds a
single matmul. Triton wants power-of-two tensor sizes and ``tl.dot`` wants
every dimension to be at least 16, so rows and ``head_dim`` are zero-padded
up to such sizes in the wrapper (zero padding of ``head_dim`` does not change
``q . k``, and padded output columns are dropped).

Pallas' Triton backend is deprecated from jax 0.11 (Mosaic GPU succeeds it), and jax 0.11
warns at every lowering of a Triton kernel. This kernel uses only ``pl.pallas_call`` with
block specs, ``plgpu.load`` and ``plgpu.CompilerParams``, which 0.11 still provides; the
warning (that exact message, as a DeprecationWarning) is silenced whenever the kernel is
used, since the choice of backend is this library's, not its caller's. A jax that drops the
backend needs a Mosaic GPU port of this kernel.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from . import reference

__all__ = ["chunk_attention_gpu", "default_num_splits"]

# What jax 0.11 warns at each lowering of a Pallas Triton kernel.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated and will be removed"


def _silence_triton_deprecation() -> None:
    """Ignores ``TRITON_DEPRECATION`` (only it, only as a DeprecationWarning) from here on:
    it is raised when the caller's jit lowers, outside any frame of ours, so a scoped
    filter cannot catch it. Installed at every call (``filterwarnings`` replaces an equal
    filter), as a caller's ``catch_warnings`` block drops filters added inside it."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


# tl.dot needs M, N, K >= 16.
_MIN_DOT_DIM = 16
# Enough (batch, head, split) programs to cover ~2 waves on a large GPU.
_TARGET_PROGRAMS = 256


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int) -> int:
    """Picks how many KV splits to run in parallel.

    Args:
      batch: Batch size.
      num_kv_heads: Number of KV heads.
      num_blocks: Number of ``block_kv`` blocks in the (padded) chunk.

    Returns:
      A power of two ``<= num_blocks`` (rounded up) that brings ``batch *
      num_kv_heads * num_splits`` near the target program count.
    """
    want = max(1, -(-_TARGET_PROGRAMS // (batch * num_kv_heads)))
    return min(_common.next_power_of_2(want), _common.next_power_of_2(num_blocks))


def _kernel(
    meta_ref,  # int32[4]: (k_start, k_valid, q_start, unused)
    q_ref,  # [rows, head_dim]
    k_ref,  # [split_len, head_dim]
    v_ref,  # [split_len, head_dim]
    # Quantized K/V only: ks_ref, vs_ref (f32[split_len] scales). Then out_ref
    # (f32[rows, head_dim]) and lse_ref (f32[rows]).
    *refs,
    scale: float,
    soft_cap: float | None,
    window: int | None,
    q_len: int,
    group: int,
    block_kv: int,
    blocks_per_split: int,
    num_blocks: int,
    quantized: bool,
):
    if quantized:
        ks_ref, vs_ref, out_ref, lse_ref = refs
    else:
        out_ref, lse_ref = refs
    split = pl.program_id(2)
    k_start = meta_ref[0]
    k_valid = meta_ref[1]
    q_start = meta_ref[2]
    lo, hi = _common.block_range(
        k_start,
        k_valid,
        q_start,
        q_len=q_len,
        block_kv=block_kv,
        num_blocks=num_blocks,
        window=window,
    )
    # Restrict the global block range to this split's blocks.
    first = split * blocks_per_split
    lo = jnp.clip(lo - first, 0, blocks_per_split)
    hi = jnp.clip(hi - first, 0, blocks_per_split)

    q = q_ref[...]
    rows, head_dim = q.shape
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    # Padding rows (>= q_len * G) get the last query's position; their output
    # is dropped by the wrapper.
    q_idx = jnp.minimum(jax.lax.div(row, group), q_len - 1)
    q_pos = q_start + q_idx  # [rows, 1]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    v_row = jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry
        keys = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        k_idx = (first + j) * block_kv + col  # [1, block_kv]
        k_ok = k_idx < k_valid
        k = k_ref[keys, :]
        # The masked load zeroes garbage values: they may be NaN, and
        # 0 * NaN = NaN would leak through the p @ v matmul.
        v_ok = (first + j) * block_kv + v_row < k_valid  # [block_kv, 1]
        if quantized:
            # Codes convert exactly to q's dtype (then garbage is zeroed: Triton has no
            # fp8 fill value); their scales apply to s and p below.
            k = k.astype(q.dtype)
            v = jnp.where(v_ok, v_ref[keys, :].astype(q.dtype), 0.0)
        else:
            v = plgpu.load(v_ref.at[keys, :], mask=v_ok, other=0.0)

        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [rows, block_kv]
        if quantized:
            s = s * ks_ref[keys][None, :]  # (q . k_code) * s_k
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = k_start + k_idx
        visible = k_ok & (k_pos <= q_pos)
        if window is not None:
            visible &= k_pos > q_pos - window
        s = jnp.where(visible, s, -jnp.inf)

        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # Rows with nothing visible yet keep m = -inf; shift them by 0 so
        # exp() yields 0 instead of NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        p_v = p
        if quantized:
            # Probabilities times s_v before P . V; scales past k_valid load as 0.
            p_v = p * plgpu.load(vs_ref.at[keys], mask=k_ok[0], other=0.0)[None, :]
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
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf).reshape(rows)


def chunk_attention_gpu(
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
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    k_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
    v_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
) -> tuple[jax.Array, jax.Array]:
    """Per-chunk attention as a Pallas Triton kernel (split-K decoding).

    Same contract as ``chunk_attention_reference`` (inputs, ``scale``, ``soft_cap``,
    ``window``, ``k_scale``/``v_scale``, outputs); only the kernel's own knobs are
    described here. Quantized K/V stay one byte per value in memory; each block converts
    to ``q``'s dtype for ``tl.dot``, its scales applied to the logits and probabilities.

    Args:
      block_kv: KV rows per inner-loop step; a power of two >= 16. ``None``
        picks it from the per-device table. ``chunk_len`` is padded so
        that every split holds the same power-of-two number of blocks.
      num_splits: KV splits processed in parallel, a power of two. ``None``
        picks one from the grid size.
      num_warps: Triton ``num_warps``; ``None`` for the compiler default.
      num_stages: Triton ``num_stages``; ``None`` for the compiler default.
      interpret: True to run the kernel in the Pallas interpreter.

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
    _silence_triton_deprecation()
    s = shape.chunk_len
    if block_kv is None:
        # The table entry is an upper bound: no point in blocks longer than
        # the chunk itself.
        block_kv = min(
            _common.default_block_kv("gpu"),
            max(_MIN_DOT_DIM, _common.next_power_of_2(s)),
        )
    _common.validate_block_kv(block_kv)
    if not _common.is_power_of_2(block_kv) or block_kv < _MIN_DOT_DIM:
        raise ValueError(
            f"block_kv={block_kv} must be a power of two >= {_MIN_DOT_DIM} for the Triton kernel"
        )
    num_blocks = -(-s // block_kv)
    if num_splits is None:
        num_splits = default_num_splits(shape.batch, shape.num_kv_heads, num_blocks)
    if (
        isinstance(num_splits, bool)
        or not isinstance(num_splits, (int, np.integer))
        or not _common.is_power_of_2(num_splits)
    ):
        raise ValueError(f"num_splits must be a positive power of two, got {num_splits!r}")
    return _chunk_attention_gpu(
        q,
        k,
        v,
        *_common.as_positions(k_start, k_valid, q_start),
        k_scale,
        v_scale,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if window is None else int(window),
        block_kv=int(block_kv),
        num_splits=int(num_splits),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=bool(interpret),
        group=shape.group,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "window",
        "block_kv",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "group",
    ),
)
def _chunk_attention_gpu(
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
    num_splits,
    num_warps,
    num_stages,
    interpret,
    group,
):
    b, t, hq, d = q.shape
    _, s, hkv, _ = k.shape
    g = group
    quantized = k_scale is not None
    # tl.dot needs both operands in one dtype (codes convert inside the kernel).
    dtype = q.dtype if quantized else jnp.promote_types(q.dtype, k.dtype)
    kv_dtype = k.dtype if quantized else dtype
    rows = t * g
    rows_pad = max(_MIN_DOT_DIM, _common.next_power_of_2(rows))
    d_pad = max(_MIN_DOT_DIM, _common.next_power_of_2(d))
    num_blocks = -(-s // block_kv)
    # Blocks per split is a power of two so that split blocks stay
    # power-of-two sized; trailing splits may then be empty, which is cheap.
    blocks_per_split = _common.next_power_of_2(-(-num_blocks // num_splits))
    split_len = blocks_per_split * block_kv
    s_pad = split_len * num_splits

    # [B, T, Hkv*G, D] -> [B, Hkv, T*G, D]: row r is query r // G of group
    # member r % G.
    q_rows = q.astype(dtype).reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(b, hkv, rows, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_pad - rows), (0, d_pad - d)))

    # Head-major K/V: each (batch, head, split) is one contiguous slab.
    def head_major(x):
        x = jnp.pad(x.astype(kv_dtype), ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d)))
        return x.transpose(0, 2, 1, 3)

    # Scales [B, S, Hkv] -> [B, Hkv, S_pad].
    def scale_rows(x):
        return jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0))).transpose(0, 2, 1)

    meta = jnp.stack(
        [k_start, jnp.clip(k_valid, 0, s), q_start, jnp.zeros_like(k_start)],
        axis=1,
    )  # [B, 4]

    kernel = functools.partial(
        _kernel,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        q_len=t,
        group=g,
        block_kv=block_kv,
        blocks_per_split=blocks_per_split,
        num_blocks=num_blocks,
        quantized=quantized,
    )
    kv_block = pl.BlockSpec((None, None, split_len, d_pad), lambda bi, hi, si: (bi, hi, si, 0))
    inputs, specs = [head_major(k), head_major(v)], [kv_block, kv_block]
    if quantized:
        scale_block = pl.BlockSpec((None, None, split_len), lambda bi, hi, si: (bi, hi, si))
        inputs += [scale_rows(k_scale), scale_rows(v_scale)]
        specs += [scale_block, scale_block]
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=[
            pl.BlockSpec((None, 4), lambda bi, hi, si: (bi, 0)),
            pl.BlockSpec((None, None, rows_pad, d_pad), lambda bi, hi, si: (bi, hi, 0, 0)),
            *specs,
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, None, rows_pad, d_pad), lambda bi, hi, si: (bi, hi, si, 0, 0)
            ),
            pl.BlockSpec((None, None, None, rows_pad), lambda bi, hi, si: (bi, hi, si, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows_pad, d_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="chunk_attention_gpu",
    )(meta, q_rows, *inputs)

    # Merge the splits: [B, Hkv, splits, ...] -> splits first.
    out, lse = reference.merge_many(jnp.moveaxis(out, 2, 0), jnp.moveaxis(lse, 2, 0))
    out = out[:, :, :rows, :d].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, :rows].reshape(b, hkv, t, g).transpose(0, 2, 1, 3)
    return out.reshape(b, t, hq, d), lse.reshape(b, t, hq)
