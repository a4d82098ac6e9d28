"""How much of a context a sparse step reads: the budget and the blocks always taken."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def is_int(value) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Which KV blocks a sparse decode row attends to.

    Attributes:
      budget: a float in ``(0, 1]``: the share of each slot's context blocks a step reads
        (rounded up); or an int ``>= 1``: that many blocks. The sink and recent blocks
        count toward it, and it never goes below them.
      sink_blocks: the context's first blocks, always read (attention sinks: the first
        tokens draw weight from every query whatever their content).
      recent_blocks: the context's last blocks, always read; at least 1, so that the block
        being written (the last, partly filled one) is always among them.
    """

    budget: float | int = 0.05
    sink_blocks: int = 1
    recent_blocks: int = 1

    def __post_init__(self):
        budget = self.budget
        if not (is_int(budget) or isinstance(budget, (float, np.floating))):
            raise ValueError(
                f"sparse budget={budget!r} must be a float in (0, 1] (a share of the context) "
                f"or an int >= 1 (blocks)"
            )
        if is_int(budget):
            if budget < 1:
                raise ValueError(f"sparse budget={budget!r} blocks must be at least 1")
            object.__setattr__(self, "budget", int(budget))
        elif not (math.isfinite(budget) and 0.0 < budget <= 1.0):
            raise ValueError(f"sparse budget={budget!r} must be a share in (0, 1]")
        else:
            object.__setattr__(self, "budget", float(budget))
        if not is_int(self.sink_blocks) or self.sink_blocks < 0:
            raise ValueError(f"sparse sink_blocks={self.sink_blocks!r} must be an int >= 0")
        if not is_int(self.recent_blocks) or self.recent_blocks < 1:
            raise ValueError(
                f"sparse recent_blocks={self.recent_blocks!r} must be an int >= 1: the block "
                f"being written is always read"
            )
        object.__setattr__(self, "sink_blocks", int(self.sink_blocks))
        object.__setattr__(self, "recent_blocks", int(self.recent_blocks))
        if is_int(self.budget) and self.budget < self.always_read:
            raise ValueError(
                f"sparse budget={self.budget} blocks is fewer than the blocks always read: "
                f"sink_blocks + recent_blocks = {self.always_read}"
            )

    @property
    def always_read(self) -> int:
        """Blocks every selection holds (where the context has that many)."""
        return self.sink_blocks + self.recent_blocks

    def max_selected(self, max_blocks: int) -> int:
        """The static bound on the blocks one slot's selection holds, for a cache whose
        slots hold at most ``max_blocks`` blocks: the size of every selection array."""
        if is_int(self.budget):
            wanted = self.budget
        else:
            product = np.float32(self.budget) * np.float32(max_blocks)  # as selected_count
            wanted = max(math.ceil(product), math.ceil(self.budget * max_blocks))
            wanted = max(wanted, self.always_read)
        return max(1, min(max_blocks, wanted))

    def selected_count(self, context_blocks: jax.Array) -> jax.Array:
        """int32[batch]: the blocks each slot's selection holds, for ``context_blocks``
        int32[batch] blocks in its context (all of them, where the budget covers them)."""
        context_blocks = jnp.asarray(context_blocks, jnp.int32)
        if is_int(self.budget):
            wanted = jnp.full_like(context_blocks, self.budget)
        else:
            # In float32, as jit computes it (x64 off): the reference does the same.
            share = jnp.float32(self.budget)
            wanted = jnp.ceil(share * context_blocks.astype(jnp.float32)).astype(jnp.int32)
            wanted = jnp.maximum(wanted, self.always_read)
        return jnp.minimum(wanted, context_blocks).astype(jnp.int32)
