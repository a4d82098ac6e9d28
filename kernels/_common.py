"""Shared helpers for the chunk-attention kernels: validation and tuning."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# What the Pallas kernels take; the plain-jnp reference computes in f32 and takes float16 too.
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
REFERENCE_DTYPES = KERNEL_DTYPES + (jnp.dtype(jnp.float16),)
# Codes of quantized K/V, which come with per-(token, head) scales (``k_scale``/``v_scale``).
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """Static shape summary of a validated chunk-attention call."""

    batch: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    chunk_len: int

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


def static_validate_inputs(
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, chunk_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, chunk_len, num_kv_heads, head_dim]
    k_start: jax.Array,  # int32[batch]
    k_valid: jax.Array,  # int32[batch]
    q_start: jax.Array,  # int32[batch]
    *,
    scale: float,
    soft_cap: float | None,
    window: int | None,
    dtypes: tuple = KERNEL_DTYPES,
    k_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
    v_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
) -> ChunkShape:
    """Checks shapes, dtypes and static knobs at trace time.

    Only static properties are checked, so this is free under ``jax.jit``.

    Args:
      q: Queries.
      k: Keys of the chunk.
      v: Values of the chunk.
      k_start: Absolute position of ``k[:, 0]`` per batch row.
      k_valid: Number of valid keys per batch row.
      q_start: Absolute position of ``q[:, 0]`` per batch row.
      scale: Logit scale.
      soft_cap: Optional logit soft cap.
      window: Optional sliding-window size.
      dtypes: What ``q``, ``k`` and ``v`` may hold (``k``/``v`` hold codes, one of
        ``CODE_DTYPES``, when scales are given).
      k_scale: Per-(token, head) scales of quantized ``k``, or None.
      v_scale: Per-(token, head) scales of quantized ``v``; given with ``k_scale``.

    Returns:
      The static shape summary.

    Raises:
      ValueError: If any check fails; the message names the offending input.
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together (quantized K and V)")
    quantized = k_scale is not None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, len, heads, head_dim], got shape {jnp.shape(x)}"
            )
        allowed = CODE_DTYPES if quantized and name != "q" else dtypes
        if jnp.dtype(x.dtype) not in allowed:
            names = " or ".join(str(d) for d in allowed)
            what = " (codes, with k_scale/v_scale)" if quantized and name != "q" else ""
            raise ValueError(f"{name}.dtype must be {names}{what}, got {x.dtype}")
    b, t, hq, d = q.shape
    kb, s, hkv, kd = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={k.shape} v={v.shape}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must have the same dtype, got k={k.dtype} v={v.dtype}")
    if kb != b:
        raise ValueError(f"batch mismatch: q has batch={b}, k has batch={kb}")
    if kd != d:
        raise ValueError(f"head_dim mismatch: q has head_dim={d}, k/v have head_dim={kd}")
    if min(b, t, hq, d, s, hkv) < 1:
        raise ValueError(f"all dimensions must be positive, got q={q.shape} k={k.shape}")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            continue
        if jnp.shape(x) != (b, s, hkv):
            raise ValueError(
                f"{name} must be [batch, chunk_len, num_kv_heads] = {[b, s, hkv]}, got "
                f"{list(jnp.shape(x))}"
            )
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{name}.dtype must be float32, got {x.dtype}")
    for name, x in (("k_start", k_start), ("k_valid", k_valid), ("q_start", q_start)):
        if jnp.shape(x) != (b,):
            raise ValueError(f"{name} must have shape (batch,)=({b},), got {jnp.shape(x)}")
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {jnp.result_type(x)}")
    if not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python float, got {scale!r}")
    if soft_cap is not None and not (
        isinstance(soft_cap, (int, float, np.floating)) and soft_cap > 0
    ):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")
    if window is not None and not (isinstance(window, (int, np.integer)) and window >= 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    return ChunkShape(b, t, hq, hkv, d, s)


def as_positions(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Casts per-batch position scalars to int32 (the kernels' index type)."""
    return tuple(jnp.asarray(x).astype(jnp.int32) for x in xs)


def validate_block_kv(block_kv: int) -> None:
    """Raises ValueError unless ``block_kv`` is a positive int."""
    if isinstance(block_kv, bool) or not isinstance(block_kv, (int, np.integer)) or block_kv <= 0:
        raise ValueError(f"block_kv must be a positive int, got {block_kv!r}")


def round_up(x: int, multiple: int) -> int:
    """Rounds ``x`` up to a multiple of ``multiple``."""
    return -(-x // multiple) * multiple


def next_power_of_2(x: int) -> int:
    """Smallest power of two that is ``>= x`` (and ``>= 1``)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def is_power_of_2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def block_range(
    k_start: jax.Array,  # int32[]
    k_valid: jax.Array,  # int32[]
    q_start: jax.Array,  # int32[]
    *,
    q_len: int,
    block_kv: int,
    num_blocks: int,
    window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """Half-open range ``[lo, hi)`` of the KV blocks holding a visible key.

    The keys visible to at least one query form a single interval of chunk
    indices: from the first query's window start to the last query's own
    position, cut to ``[0, k_valid)``. The range covers exactly the blocks
    that intersect it, so kernels neither fetch nor compute anything else.

    Args:
      k_start: Absolute position of key 0 of the chunk.
      k_valid: Number of valid keys in the chunk.
      q_start: Absolute position of query 0.
      q_len: Number of queries.
      block_kv: Keys per block.
      num_blocks: Number of blocks in the (padded) chunk.
      window: Optional sliding-window size.

    Returns:
      ``(lo, hi)`` int32 scalars with ``0 <= lo <= hi <= num_blocks``;
      ``lo == hi`` when no key is visible.
    """
    # lax.div truncates; it is only relied upon for non-negative operands,
    # where it equals floor division and lowers without sign fix-ups.
    div = jax.lax.div
    # Exclusive end: past the last query's position (causal) and k_valid.
    end = jnp.minimum(q_start + q_len - k_start, k_valid)
    end = jnp.minimum(end, num_blocks * block_kv)
    if window is None:
        first = jnp.int32(0)
    else:
        first = jnp.maximum(q_start - window + 1 - k_start, 0)
    lo = jnp.minimum(div(first, block_kv), num_blocks)
    hi = jnp.where(end > first, div(end + block_kv - 1, block_kv), lo)
    return lo, hi


# Default KV block sizes per device kind, matched by substring of
# `jax.devices()[0].device_kind`, first match wins. These are starting points
# derived from on-chip memory budgets (double-buffered K and V blocks must fit
# comfortably in VMEM / shared memory next to the [q_rows, head_dim] f32
# accumulator); they have not been swept on every chip. Larger blocks amortize
# per-step overhead; smaller ones waste less work on ragged tails.
BLOCK_KV_TABLE: dict[str, dict[str, int]] = {
    "tpu": {
        "TPU v4": 512,
        "TPU v5 lite": 512,  # v5e reports itself as "TPU v5 lite".
        "TPU v5e": 512,
        "TPU v5p": 512,
        "TPU v5": 512,
        "TPU v6 lite": 1024,  # v6e (Trillium): 2x the VMEM of v5e.
        "TPU v6e": 1024,
        "TPU7x": 1024,
        "cpu": 16,  # Interpret mode: small blocks keep tests fast.
    },
    "gpu": {
        "NVIDIA H100": 64,
        "NVIDIA H200": 64,
        "NVIDIA A100": 64,
        "NVIDIA L4": 32,
        "cpu": 16,
    },
}
DEFAULT_BLOCK_KV: dict[str, int] = {"tpu": 512, "gpu": 64}


def device_kind() -> str:
    """Device kind of the default device, or "cpu" if it cannot be queried."""
    try:
        return jax.devices()[0].device_kind
    except RuntimeError:
        return "cpu"


def default_block_kv(backend: str, kind: str | None = None) -> int:
    """Looks up the default ``block_kv`` for ``backend`` on device ``kind``.

    Args:
      backend: "tpu" or "gpu" (the kernel flavour, not the JAX platform).
      kind: Device kind string; defaults to the current default device's.

    Returns:
      The table entry whose key is a substring of ``kind``, else the backend's
      default.
    """
    kind = device_kind() if kind is None else kind
    if kind.lower() == "cpu":
        kind = "cpu"
    for key, value in BLOCK_KV_TABLE[backend].items():
        if key in kind:
            return value
    return DEFAULT_BLOCK_KV[backend]
