"""JAX's record of side effects after a failed step.

JAX keeps the runtime token of the latest computation with effects (the cache's ops have
side effects) and blocks on it at interpreter exit, where a step that failed would raise
again and print tracebacks. A later computation with effects replaces the token, so after
a failure :func:`settle_failed_steps` runs one tiny one on each local device.
"""

from __future__ import annotations

import atexit
import logging

import jax
import numpy as np

logger = logging.getLogger(__name__)


def settle_failed_steps(*, at_exit: bool = False) -> None:
    """Clears a failed step's error from JAX's per-device record of side effects."""
    try:
        jax.effects_barrier()
        return
    except Exception as e:  # noqa: BLE001 - a failed step's error, raised to its caller.
        if at_exit:
            logger.warning("a step failed before exit: %s", e)
    for device in jax.local_devices():
        try:
            jax.block_until_ready(_effect_only(jax.device_put(np.int32(0), device)))
        except Exception:  # noqa: BLE001 - best effort: nothing else depends on it.
            pass
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - logged only.
        logger.info("a failed step's error is still in JAX's record of effects")


@jax.jit
def _effect_only(x: jax.Array) -> jax.Array:
    jax.debug.callback(lambda: None, ordered=False)
    return x


@atexit.register
def _settle_at_exit() -> None:
    # Registered after JAX's own exit hook, so it runs first.
    settle_failed_steps(at_exit=True)
