"""A TPU as a compile target on a machine without one: libtpu's settings, a topology's
devices, a mesh over them, the Pallas kernels aimed at the TPU, and what a compiled
program places in device memory.

libtpu (``pip install "jax[tpu]"``) compiles programs for a TPU topology it is told of
(:func:`jax.experimental.topologies.get_topology_desc`) with XLA's TPU compiler and Mosaic
on any Linux x86_64 host: nothing runs, but what the compiler accepts, the device memory it
plans and the order it schedules copies and compute in are the chip's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from jax_tpusync.runtime.libtpu import LIBTPU_ENVIRONMENT

__all__ = [
    "TOPOLOGIES",
    "compiled_or_refusal",
    "device_bytes",
        "prepare_compile_only",
    "topology_devices",
    "topology_mesh",
    "tracing_for_tpu",
]

# Topology names libtpu takes (a host's chips: v5e and v6e 2x2, the others 2x2x1).
TOPOLOGIES = ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")


def prepare_compile_only() -> None:
    """Sets what libtpu needs before JAX starts a backend (each unless already set) and
    keeps JAX's default backend the CPU: the programs are compiled, never run. A process
    that started JAX's backends already keeps them; libtpu reads these at the start."""
    for name, value in LIBTPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def topology_devices(topology: str) -> list:
    """The devices of a TPU ``topology`` (``"v5e:2x2"``...), for compiling only.

    Raises:
      RuntimeError: libtpu is not installed (``pip install "jax[tpu]"``).
    """
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(
            'compiling for a TPU needs libtpu: pip install "jax[tpu]" (Linux x86_64)'
        )
    prepare_compile_only()
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def topology_mesh(devices: list, mesh_axes: Mapping[str, int]):
    """A :class:`jax.sharding.Mesh` of ``mesh_axes`` (``{"batch": 2, "heads": 2}``: names
    and sizes, in order) over the first of ``devices``.

    Raises:
      ValueError: an axis of size below 1, or more devices asked for than the topology has.
    """
    import numpy as np
    from jax.sharding import Mesh

    for name, size in mesh_axes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} has size {size!r}: each must be an int >= 1")
    count = math.prod(mesh_axes.values())
    if count > len(devices):
        raise ValueError(
            f"mesh_axes={dict(mesh_axes)} needs {count} devices; the topology has "
            f"{len(devices)}"
        )
    shape = tuple(mesh_axes.values())
    return Mesh(np.array(devices[:count]).reshape(shape), tuple(mesh_axes))


class tracing_for_tpu:
    """Makes the package's choices by backend (:mod:`jax_tpusync.runtime.backend`) a TPU's
    while a step is traced and compiled for one on a machine whose default backend is the
    CPU: the Pallas attention kernel by default, through Mosaic (not interpret mode), KV
    staged in its own dtype, no engine ops."""

    def __enter__(self):
        from jax_tpusync.runtime import backend

        self.saved = backend.name, backend.pallas_options
        backend.name = lambda: "tpu"
        backend.pallas_options = lambda block_kv, interpret: dict(
            block_kv=block_kv, interpret=False, backend="tpu"
        )
        return self

    def __exit__(self, *exc):
        from jax_tpusync.runtime import backend

        backend.name, backend.pallas_options = self.saved


def device_bytes(compiled) -> int:
    """Device memory a compiled program places: arguments, temporaries and outputs not
    aliased to an argument."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


_OUT_OF_MEMORY = re.compile(r"memory required for HLO temporaries \(([0-9.]+)([KMGT])\)")


def compiled_or_refusal(build: Callable[[], Any]) -> tuple[Any, str]:
    """(the program ``build()`` compiles, ""), or (None, why) when the compiler refuses it
    for want of device memory (with the MiB it needed, from its message). Other errors
    are raised."""
    try:
        return build(), ""
    except Exception as error:
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        need = _OUT_OF_MEMORY.search(message)
        if need:
            scale = {"K": 2**-10, "M": 1, "G": 2**10, "T": 2**20}[need.group(2)]
            return (
                None,
                f"does not fit: needs {float(need.group(1)) * scale:.0f} MiB of temporaries",
            )
        return None, "does not fit: " + message.splitlines()[0][:160]
