"""The Mooncake benchmarks' fixture: ``mooncake_usable`` skips a test where the Mooncake
client or master is missing, unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI), where it fails."""

from __future__ import annotations

import os

import pytest

from jax_tpusync.bench import mooncake_master

REQUIRED = os.environ.get("TPUSYNC_REQUIRE_MOONCAKE") == "1"


def _why_unavailable() -> str | None:
    """None if the Mooncake client and master can be used here, else why not."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"import mooncake.store: {e}"
    if mooncake_master.find_binary() is None:
        return "no mooncake_master next to the interpreter or on PATH"
    return None


@pytest.fixture
def mooncake_usable():
    why = _why_unavailable()
    if why is None:
        return
    if REQUIRED:
        pytest.fail(
            f"TPUSYNC_REQUIRE_MOONCAKE=1 but the Mooncake client cannot be used: {why} "
            f"(pip install 'jax-tpusync[mooncake]'; apt-get install libibverbs1 libnuma1)"
        )
    pytest.skip(f"Mooncake client unavailable: {why}")
