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

This module decides which caches read in place; the step's unit that does it is
:mod:`jax_tpusync.step.in_place`.
"""

from __future__ import annotations

from typing import Any

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
