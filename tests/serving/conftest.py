"""The serving tests count the programs each step compiles (``compiled_in_steps``)."""

import pytest


@pytest.fixture(autouse=True)
def _compiles_counted(compiles_counted):
    """Every serving test runs without the suite's compilation cache."""
