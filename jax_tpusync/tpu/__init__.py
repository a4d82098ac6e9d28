"""Planning a model for a TPU from any machine: its decode step over a host-pool cache
compiled for a TPU topology with libtpu (nothing runs on a TPU), and what it would hold and
take there (:func:`plan_step`)."""

from jax_tpusync.tpu.chips import HostLink, hbm_bytes_per_device, host_link
from jax_tpusync.tpu.plan import (
    DEFAULT_CONTEXTS,
    ContextPlan,
    GroupPlan,
    SparseContextPlan,
    StepPlan,
    plan_step,
)

__all__ = [
    "DEFAULT_CONTEXTS",
    "ContextPlan",
    "GroupPlan",
    "HostLink",
    "SparseContextPlan",
    "StepPlan",
    "hbm_bytes_per_device",
    "host_link",
    "plan_step",
]
