"""The runtime: the C++ engine's Python face and everything that talks to XLA or a thread.

:mod:`~jax_tpusync.runtime.engine` (tiers, transfers, the timeline), the in-graph FFI ops
(:mod:`~jax_tpusync.runtime.ops`), the CUDA module's loader, the backend choices, XLA's CPU
flags, JAX's side-effect bookkeeping, the multi-threaded host copy and the deadline worker.
Imports nothing else from the package.
"""
