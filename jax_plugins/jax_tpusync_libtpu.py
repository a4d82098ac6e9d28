"""JAX's plugin hook for jax_tpusync: keeps libtpu quiet in a JAX process on a host without a
TPU, whether or not the process imports jax_tpusync.

``pip install 'jax[tpu]'`` (this project's ``test`` and ``tpu`` extras: compiling for TPUs from
any machine) puts libtpu beside JAX, and from then on every JAX process probes for a TPU when it
starts a backend; on a machine with none, libtpu prints errors about its accelerator type and
worker hostnames. Given an accelerator type and a worker list, the TPU backend fails to start
quietly, JAX goes on with the others (CPU, CUDA), and ``jax.experimental.topologies`` still
compiles for any TPU topology.

JAX imports every module of the ``jax_plugins`` namespace (and every ``jax_plugins`` entry
point) and calls its ``initialize()`` before it starts any backend: the one moment at which
these settings reach libtpu in a process that never imports this project. This module stands
alone (it imports nothing from jax_tpusync, whose import takes a second) so that the hook
costs a JAX process next to nothing.
"""

from __future__ import annotations

import glob
import importlib.util
import os

__all__ = ["LIBTPU_ENVIRONMENT", "has_tpu_chip", "initialize", "quiet_on_cpu"]

# libtpu refuses to start without an accelerator type and a worker list; any valid pair lets it
# compile for every topology named later. It also takes a host-wide lock file that lets one
# process use it at a time: compile-only processes share the host with each other.
LIBTPU_ENVIRONMENT = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
# The PCI vendor id of Google's TPU chips, as JAX looks for one.
GOOGLE_PCI_VENDOR = "0x1ae0"


def has_tpu_chip() -> bool:
    """Whether this host has a TPU chip (a Google PCI device)."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def quiet_on_cpu() -> None:
    """Sets :data:`LIBTPU_ENVIRONMENT` (each unless already set) where libtpu is installed and
    no TPU chip is. Nothing changes on a TPU host (libtpu reads its real settings there) or
    where libtpu is not installed."""
    if importlib.util.find_spec("libtpu") is None or has_tpu_chip():
        return
    for name, value in LIBTPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def initialize() -> None:
    """JAX's plugin entry: called once per process, before any backend starts."""
    quiet_on_cpu()
