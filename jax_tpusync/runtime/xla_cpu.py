"""One XLA CPU compiler setting that a whole decode step inside one ``jax.jit`` needs.

XLA's CPU backend orders a program's instructions to run independent ones concurrently
(``--xla_cpu_enable_concurrency_optimized_scheduler``, on by default in the jaxlib versions
this package supports). In a decoder, every layer's weights are independent of the
activations, so in one program of many layers that order hoists each layer's 16-bit weight
conversion (the CPU backend computes bf16 dots in f32) to the start of the step: every
layer's f32 weights are materialized before the first layer runs and read back from DRAM,
no longer from cache, when their layer comes. The cost grows with the layers; a model run as
one jitted call per layer never sees it. Measured on a 2-core VM, jax 0.10.2, batch 1,
bf16: the q/k/v/o projections of 8 layers (d_model 1024, KV width 256) took 34 ms as one
program and 12 ms as 8 one-layer calls; with the memory-minimizing schedule, 10 ms as one
program. A whole decode step of 8 layers over a 4K context went from 72 to 20 ms.

:func:`use_memory_scheduler` asks for the memory-minimizing schedule instead. XLA reads its
flags once, when JAX creates its backends, so it must run before the first computation (a
``jax.jit(...).lower(...).compile(compiler_options=...)`` of the same option is accepted
but does not change the CPU schedule in jax 0.10.2). It only affects the CPU backend.
"""

from __future__ import annotations

import mmap
import os
import pathlib
from typing import Any

from jax_tpusync.runtime.engine import EngineConfig, split_cpus

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def _jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib's binaries define ``flag`` (an unknown name in
    ``XLA_FLAGS`` aborts the process when the backends start)."""
    import jaxlib

    needle = flag.lstrip("-").encode()
    for path in pathlib.Path(jaxlib.__file__).parent.rglob("*.so*"):
        if path.stat().st_size < 1 << 20:  # Binding stubs; the flags live in the big library.
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(needle) >= 0:
                return True
    return False


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def use_memory_scheduler() -> str:
    """Asks XLA's CPU backend for its memory-minimizing instruction schedule.

    Call it before JAX runs anything (first thing in a script). Returns what happened:

    * ``"set"``: ``XLA_FLAGS`` now ends with ``--xla_cpu_enable_concurrency_optimized_scheduler=false``;
    * ``"kept"``: ``XLA_FLAGS`` already names the flag; the value there stands;
    * ``"unknown"``: the installed jaxlib has no such flag (nothing changed; naming an
      unknown flag in ``XLA_FLAGS`` would abort the process).

    Raises:
      RuntimeError: JAX's backends already started, so a flag set now would do nothing.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG in flags:
        return "kept"
    if _backends_started():
        raise RuntimeError(
            "tpusync: use_memory_scheduler() must run before JAX starts its backends "
            "(before the first computation or jax.devices()); XLA reads XLA_FLAGS once, "
            f"so set {SCHEDULER_FLAG}=false in XLA_FLAGS before starting Python instead"
        )
    if not _jaxlib_knows(SCHEDULER_FLAG):
        return "unknown"
    os.environ["XLA_FLAGS"] = f"{flags} {SCHEDULER_FLAG}=false".strip()
    return "set"


def setup(engine_cpus: int = 1, **engine_options: Any) -> EngineConfig:
    """The one setup call for JAX's CPU backend, first thing in a script (before JAX
    computes anything): asks for the memory-minimizing schedule
    (:func:`use_memory_scheduler`), keeps ``engine_cpus`` CPUs for the engine's workers
    (:func:`jax_tpusync.split_cpus`, where the process has more CPUs than that), and
    returns the :class:`~jax_tpusync.EngineConfig` to give the caches
    (``engine=...``), with ``engine_options`` (its other fields).

    Raises:
      RuntimeError: JAX's backends already started (naming what to do instead).
    """
    if _backends_started():
        raise RuntimeError(
            "tpusync: setup_cpu() must run before JAX starts its backends (before the first "
            "computation or jax.devices()): XLA reads its flags and sizes its thread pools "
            "once, at that moment"
        )
    use_memory_scheduler()
    workers = split_cpus(engine_cpus)
    return EngineConfig(worker_cpus=tuple(workers), **engine_options)
