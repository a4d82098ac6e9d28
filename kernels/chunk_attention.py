"""Per-chunk attention: reference oracle and backend dispatch.

``chunk_attention`` computes attention of a query block over one KV chunk that
sits in the device staging buffer, returning the chunk-normalized output and
its log-sum-exp. Results for successive chunks are combined with
``merge_partials``; see ``reference.py`` for the exact semantics.
"""

from __future__ import annotations

from typing import Any

import jax

from . import _common
from .chunk_attention_gpu import chunk_attention_gpu
from .chunk_attention_tpu import chunk_attention_tpu
from .reference import attention_reference
from .reference import chunk_attention_reference
from .reference import merge_many
from .reference import merge_partials

__all__ = [
    "BACKENDS",
    "attention_reference",
    "chunk_attention",
    "chunk_attention_gpu",
    "chunk_attention_reference",
    "chunk_attention_tpu",
    "merge_many",
    "merge_partials",
    "resolve_backend",
]

BACKENDS = ("auto", "tpu", "gpu")


def resolve_backend(backend: str, interpret: bool | Any = False) -> str:
    """Maps the ``backend`` knob to the kernel flavour to run.

    Args:
      backend: "tpu", "gpu" or "auto". "auto" follows
        ``jax.default_backend()``; on CPU it needs ``interpret`` and then
        picks the TPU kernel, whose interpreter also simulates DMAs.
      interpret: The ``interpret`` knob passed to ``chunk_attention``.

    Returns:
      "tpu" or "gpu".

    Raises:
      ValueError: For an unknown backend, or "auto" on CPU without interpret.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if interpret:
        return "tpu"
    raise ValueError(
        f"backend='auto' found platform {platform!r}, which has no native "
        "kernel; pass backend='tpu' or 'gpu' together with interpret=... to "
        "run a kernel in interpret mode, or use chunk_attention_reference"
    )


def chunk_attention(
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
    backend: str = "auto",
    block_kv: int | None = None,
    interpret: bool | Any = False,
    k_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
    v_scale: jax.Array | None = None,  # f32[batch, chunk_len, num_kv_heads]
) -> tuple[jax.Array, jax.Array]:
    """Per-chunk attention with a Pallas kernel for the current backend.

    Same contract as :func:`chunk_attention_reference` (inputs, ``scale``, ``soft_cap``,
    ``window``, quantized K/V with ``k_scale``/``v_scale``, outputs); only the dispatch
    knobs are described here.

    Args:
      backend: "tpu", "gpu" or "auto" (see :func:`resolve_backend`).
      block_kv: KV rows per kernel block; ``None`` uses the per-device table
        in ``_common.BLOCK_KV_TABLE``.
      interpret: False for a compiled kernel. For the TPU kernel, a
        ``pltpu.InterpretParams`` (True means default parameters); for the
        GPU kernel, True.

    Returns:
      ``(out, lse)``: f32[batch, q_len, num_q_heads, head_dim] normalized
      within the chunk, and f32[batch, q_len, num_q_heads]. Queries with no
      visible key get ``out = 0`` and ``lse = -inf``.

    Raises:
      ValueError: On inconsistent shapes, dtypes or knobs.
    """
    # Validate before resolving the backend so shape errors read the same
    # everywhere.
    _common.static_validate_inputs(
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
    kind = resolve_backend(backend, interpret)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if kind == "tpu":
        return chunk_attention_tpu(
            q,
            k,
            v,
            k_start,
            k_valid,
            q_start,
            scale=scale,
            soft_cap=soft_cap,
            window=window,
            block_kv=block_kv,
            interpret=interpret,
            **scales,
        )
    return chunk_attention_gpu(
        q,
        k,
        v,
        k_start,
        k_valid,
        q_start,
        scale=scale,
        soft_cap=soft_cap,
        window=window,
        block_kv=block_kv,
        interpret=bool(interpret),
        **scales,
    )
