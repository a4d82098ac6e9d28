"""Runs an example script as a user would: a fresh interpreter on the CPU backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def pytest_collection_modifyitems(items):
    """Every example runs in a fresh interpreter (tens of seconds each): all are slow."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def run_example(tmp_path):
    """``run_example(name, *args, timeout=...)``: ``examples/<name>`` with ``args`` and
    ``--json OUT``; returns the JSON it wrote (a failed run fails the test)."""

    def run(name: str, *args: str, timeout: float) -> dict:
        out = tmp_path / f"{Path(name).stem}.json"
        subprocess.run(
            [sys.executable, str(EXAMPLES / name), *args, "--json", str(out)],
            check=True,
            timeout=timeout,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        return json.loads(out.read_text())

    return run
