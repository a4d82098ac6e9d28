"""libtpu on a host without a TPU: the settings that keep it quiet.

The settings and the check live in ``jax_plugins.jax_tpusync_libtpu``, the JAX plugin hook this
project installs, so that a JAX process gets them before its first backend starts even if it
never imports jax_tpusync. ``import jax_tpusync`` applies them too (where JAX's plugin
discovery already ran, or the hook is not installed: a source checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

from jax_plugins.jax_tpusync_libtpu import LIBTPU_ENVIRONMENT, has_tpu_chip, quiet_on_cpu

__all__ = ["LIBTPU_ENVIRONMENT", "has_tpu_chip", "quiet_on_cpu"]
