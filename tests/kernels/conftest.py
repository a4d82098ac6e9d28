"""Shared configuration for the kernel tests.

Hypothesis runs deterministically under the "ci" profile (the default) so
that CI results are reproducible; select "dev" with HYPOTHESIS_PROFILE=dev
for a broader local search.
"""

import os

import pytest
from hypothesis import settings
from jax.experimental.pallas import tpu as pltpu

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=5)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def tpu_race_check():
    """TPU interpret params that detect races and run DMAs eagerly (a slot overwritten
    while in use corrupts the result); yields (params, races_found) and resets the
    simulator afterwards (a failed kernel leaves its state behind)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    def races_found() -> bool:
        # jax 0.10 keeps the detector's state in a module global, new per kernel.
        assert interpret_pallas_call.races is not None, "TPU interpret mode did not run"
        return interpret_pallas_call.races.races_found

    yield pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"), races_found
    pltpu.reset_tpu_interpret_mode_state()
