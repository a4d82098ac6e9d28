"""Host-tier KV attended to where it lies: no copy into the step's buffers (CPU backend).

On the CPU backend a host tier's pool and the compiled step share one memory. A fetch from
the pool can only run inside the op that needs its bytes (an XLA buffer is ours only while
an op holds it, see :mod:`jax_tpusync.ops`), so there the copy stops the compute it was
meant to overlap, and the attention then reads every copied byte back. Reading the pool
in place removes both: one custom call per unit attends to the unit's rows through the
state's block table, where the engine keeps them (``engine/pool_attention.cc``, f32
arithmetic with the same masks as :func:`~jax_tpusync.kernels.reference.chunk_attention_reference`).

Ordering is a fetch's: the call is registered with the engine's scoreboard as a read of
those tier bytes, so it starts after every earlier write-back of them (a failed one fails
it) and later writes wait for it. Nothing lands in staging, so nothing is prefetched.

It applies to a host tier whose rows are bfloat16 or float32 values (not quantized codes,
not float16), on one tier (not a two-level cache), streamed (not resident), on the CPU
backend; anywhere else units go through staging as before. Such a cache's state holds no
staging at all, so it takes the plain-XLA attention only (the Pallas kernels read units
from staging).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tpusync import backend, ops

def why_not(*, tier: str, dtype, quantized: bool, two_level: bool, resident: bool) -> str | None:
    """Why a cache of this configuration cannot read in place, or None if it can."""
    if tier != "host":
        return f"tier={tier!r} is not in memory (only a host tier is)"
    if (blocker := backend.in_place_blocker()) is not None:
        return blocker
    if quantized:
        return "a quantized tier's rows are codes and scales"
    if np.dtype(dtype) not in ops.IN_PLACE_KV_DTYPES:
        return f"dtype={np.dtype(dtype)} (rows are read in place as bfloat16 or float32)"
    if two_level:
        return "a two-level cache's units also come from its spill file"
    if resident:
        return "a resident cache reads no unit at all"
    return None


def decide(choice: Any, **config) -> bool:
    """``OffloadedKVCache(read_in_place=choice)``: True, False or ``"auto"`` (True where
    :func:`why_not` finds nothing against it); True where it cannot is refused, naming why."""
    if not (isinstance(choice, bool) or (isinstance(choice, str) and choice == "auto")):
        raise ValueError(f"read_in_place={choice!r} must be True, False or 'auto'")
    if choice is False:
        return False
    reason = why_not(**config)
    if choice is True and reason is not None:
        raise ValueError(f"read_in_place=True cannot apply: {reason}")
    return reason is None


def attend_unit(
    spec,
    state,
    layer,
    q: jax.Array,  # [batch, q_len, num_q_heads, head_dim]
    segments: jax.Array,  # int32[n, 4]: the unit's fetch segments into staging slot 0
    lo: jax.Array,  # int32[batch]: the unit's first position
    count: jax.Array,  # int32[batch]: its cached tokens per slot
    *,
    tag: jax.Array,
    deps,
    owner: jax.Array,
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array]:  # out f32[batch, q_len, num_q_heads, head_dim], lse f32[...]
    """``(out, lse)`` of ``q`` over one unit's cached rows, read where the tier holds them:
    what ``wait_fetch`` of ``segments`` and the attention over the staged unit compute."""
    # An inactive slot's segments move no bytes (see attention._segments): nor may it attend.
    valid = jnp.where(state.capacity > 0, count, 0).astype(jnp.int32)
    positions = jnp.stack([lo, valid, state.lengths]).astype(jnp.int32)
    call = functools.partial(
        ops.attend_in_place,
        state.target[0],
        state.target[1],
        q.astype(jnp.float32),
        segments,
        positions,
        tag,
        unit_len=spec.chunk_len,
        kv_dtype=spec.dtype,
        num_kv_heads=spec.num_kv_heads,
        scale=scale,
        soft_cap=soft_cap,
        deps=deps,
        regions=spec.regions,
        owner=owner,
        first_block=state.target[2],
    )
    return spec.with_layer_window(layer, lambda window: call(window=window))
