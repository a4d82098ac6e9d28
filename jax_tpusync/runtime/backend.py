"""Every choice the package makes by backend, in one place.

The only module of the package that asks ``jax.default_backend()``. On JAX's CPU backend
the "device" is this process's memory, which changes three decisions:

* the plain-XLA attention reads staged KV in blocks of rows (``step.unit``), and 16-bit KV
  is staged as uint16 words: XLA's CPU backend slices 16-bit floats element by element but
  words as fast as any integer (blocks from bfloat16 staging took twice as long);
* a host tier's pool can be attended to where it lies (``step.in_place``): no copy into
  staging at all;
* the default attention implementation is plain XLA (the Pallas kernels run there only in
  interpret mode); elsewhere it is the Pallas kernel.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def name() -> str:
    """The default JAX backend: ``"cpu"``, ``"gpu"``, ``"tpu"``..."""
    return jax.default_backend()


def is_cpu() -> bool:
    return name() == "cpu"


def runs_engine_ops() -> bool:
    """Whether the engine's in-graph ops (XLA FFI custom calls) run here: on the CPU and
    CUDA backends. Elsewhere (TPU) the host pool is the data path."""
    return name() in ("cpu", "gpu", "cuda")


def attends_in_blocks() -> bool:
    """Whether the plain-XLA attention reads staged KV in blocks of rows (on CPU), which is
    also when 16-bit KV is staged as words."""
    return is_cpu()


def staging_dtype(dtype: Any, quantized: bool) -> np.dtype:
    """What staging holds for KV of ``dtype``: uint8 codes when quantized, uint16 words of
    16-bit KV where the attention reads blocks of rows, else ``dtype`` itself."""
    dtype = np.dtype(dtype)
    if quantized:
        return np.dtype(np.uint8)
    if dtype.itemsize == 2 and attends_in_blocks():
        return np.dtype(np.uint16)
    return dtype


def default_implementation() -> str:
    """``prefetching_attention``'s default: plain XLA on CPU, the Pallas kernel elsewhere."""
    return "xla" if is_cpu() else "pallas"


def pallas_options(block_kv: int | None, interpret: bool | None) -> dict:
    """Keyword options of the Pallas kernels here: on CPU they run in TPU interpret mode."""
    on_cpu = is_cpu()
    options: dict = dict(block_kv=block_kv, interpret=on_cpu if interpret is None else interpret)
    if on_cpu:
        options["backend"] = "tpu"
    return options


def in_place_blocker() -> str | None:
    """Why this backend cannot attend to a host pool in place, or None (CPU)."""
    backend = name()
    if backend != "cpu":
        return f"the backend is {backend!r} (a host pool is device memory on the CPU backend only)"
    return None
