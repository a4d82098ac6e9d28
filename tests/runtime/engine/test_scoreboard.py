"""The hazard scoreboard (ffi/engine/scoreboard.h) on its own:
tests/runtime/engine/scoreboard_test.cc built with the C++ compiler against scoreboard.cc
alone (no engine, no XLA) and run.

It covers the ordering rules the engine relies on: a write after a read of overlapping bytes
waits (and a read after a write); disjoint transfers, transfers of different tiers and two
reads do not order; ranges that only touch (end == start) do not conflict while one byte of
overlap does, also once widened to hazard pages; and completion releases waiters in
submission order, including a read registered as running."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "ffi" / "engine" / "scoreboard.cc"
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(
    CXX is None or not SOURCE.exists(), reason="needs a C++ compiler and the source tree"
)


def test_scoreboard_orders_conflicting_transfers_only(tmp_path):
    exe = tmp_path / "scoreboard_test"
    cmd = [
        CXX, "-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
        "-fsanitize=address,undefined", "-fno-omit-frame-pointer", f"-I{ROOT / 'ffi'}",
        str(Path(__file__).with_name("scoreboard_test.cc")), str(SOURCE), "-o", str(exe),
    ]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0 and "sanitizer" in build.stderr and "cannot find" in build.stderr:
        cmd = [c for c in cmd if not c.startswith("-fsanitize")]
        build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-3000:] + run.stderr
