"""Registers the CUDA implementations of the in-graph transfer ops (platform ``"CUDA"``).

The ops in :mod:`jax_tpusync.runtime.ops` lower to the same custom-call targets on every platform;
this module adds the CUDA handlers from the optional extension ``jax_tpusync._tpusync_cuda``
(built when a CUDA toolkit is found at build time, see ffi/cuda/device_context.h for the design).

:func:`register` is a no-op returning ``False`` when the extension was not built or no CUDA
GPU is visible, so CPU-only installs behave exactly as before. It initializes JAX's
backends (to see whether a CUDA GPU exists), so call it when the ops are first needed.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

import jax

from jax_tpusync import _tpusync

_lock = threading.Lock()
_registered: bool | None = None  # None: not looked for a GPU yet.


def extension() -> ModuleType | None:
    """The ``_tpusync_cuda`` extension module, or None if this install was built without it."""
    try:
        return importlib.import_module("jax_tpusync._tpusync_cuda")
    except ImportError:
        return None


def gpu_present() -> bool:
    """Whether JAX sees at least one CUDA device (ROCm devices do not count)."""
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:  # No CUDA backend: "Unknown backend cuda".
        return False


def registered() -> bool:
    return bool(_registered)


def register() -> bool:
    """Registers the CUDA handlers once; returns whether they are registered.

    Raises:
      RuntimeError: a CUDA GPU is present but this install has no CUDA extension, so the
        ops would fail at compile time with an unknown custom call.
    """
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        if not gpu_present():
            _registered = False
            return False
        ext = extension()
        if ext is None:
            raise RuntimeError(
                "tpusync: JAX sees a CUDA GPU but jax_tpusync was built without CUDA support "
                "(no CUDA toolkit >= 12.8 at build time); reinstall where nvcc/cuda headers are "
                "present, or run on CPU with JAX_PLATFORMS=cpu"
            )
        # Engines live in _tpusync's registry; the CUDA handlers must resolve the same ids.
        ext.attach(_tpusync.engine_registry_capsule())
        for name, capsule in ext.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _registered = True
        return True
