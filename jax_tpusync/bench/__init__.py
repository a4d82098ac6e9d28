"""Benchmarks for jax_tpusync: ``python -m jax_tpusync.bench <subcommand> ... --json OUT``.

Subcommands:

* ``transfer``: engine fetch bandwidth from a host or file tier, side by side with a plain
  ceiling (single-thread memcpy, or a sequential O_DIRECT read of the same file region).
* ``overlap``: how much of a fetch issued from inside ``jax.jit`` hides behind compute.

Every subcommand measures the engine and its reference in the same run, interleaved, and
reports medians after warm-up, because the machines this runs on are small and shared.
"""
