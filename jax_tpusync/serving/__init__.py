"""Serving: :class:`ServingLoop`, continuous batching through the caller's step (chunked
prefill beside decode, sampling, TTFT), in :mod:`~jax_tpusync.serving.loop`; its checks in
:mod:`~jax_tpusync.serving.checks`."""

from jax_tpusync.serving.loop import (
    ADMISSION_ORDERS,
    ADMISSION_SKIP_LIMIT,
    Completion,
    Request,
    Sampler,
    ServingLoop,
    greedy,
)

__all__ = [
    "ADMISSION_ORDERS",
    "ADMISSION_SKIP_LIMIT",
    "Completion",
    "Request",
    "Sampler",
    "ServingLoop",
    "greedy",
]
