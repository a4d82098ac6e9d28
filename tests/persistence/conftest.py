"""Fixtures shared by the persistence tests: a unique shm name, and either persistent tier."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import jax_tpusync as tps
from jax_tpusync import persistence


@pytest.fixture
def shm_name():
    """A unique shm name; the segment and its manifest are removed at teardown."""
    name = f"tpusync-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        tps.Engine.unlink_shm(name)
    except Exception:  # noqa: BLE001 - never created, or removed by the test.
        pass
    Path(persistence.SHM_DIRECTORY, name + persistence.MANIFEST_SUFFIX).unlink(missing_ok=True)


@pytest.fixture(params=["file", "shm"])
def where(request, tmp_path, shm_name):
    """Keyword arguments of a persistent tier of either kind."""
    if request.param == "file":
        return dict(tier="file", path=tmp_path, file_name="kv")
    return dict(tier="host", shm_name=shm_name)
