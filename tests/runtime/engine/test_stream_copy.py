"""The multi-range streaming copy (ffi/engine/stream_copy.h) on its own:
tests/runtime/engine/stream_copy_test.cc built with the C++ compiler against stream_copy.cc alone
(no engine, no XLA) and run under the address and undefined-behaviour sanitizers.

It covers every destination alignment 0-16 with lengths around the 16-byte store and the
64-byte step (guard bytes on either side untouched), ranges over and under the streaming
threshold and the 1 MiB piece split over 1-3 threads, and the refused arguments (no
threads, a null pointer with bytes, destinations sharing one byte, a destination over its
own source), which copy nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "ffi" / "engine" / "stream_copy.cc"
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(
    CXX is None or not SOURCE.exists(), reason="needs a C++ compiler and the source tree"
)


def test_stream_copy_lands_every_byte_and_refuses_bad_ranges(tmp_path):
    exe = tmp_path / "stream_copy_test"
    cmd = [
        CXX, "-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread",
        "-fsanitize=address,undefined", "-fno-omit-frame-pointer", f"-I{ROOT / 'ffi'}",
        str(Path(__file__).with_name("stream_copy_test.cc")), str(SOURCE), "-o", str(exe),
    ]  # fmt: skip
    build = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if build.returncode != 0 and "sanitizer" in build.stderr and "cannot find" in build.stderr:
        cmd = [c for c in cmd if not c.startswith("-fsanitize")]
        build = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-3000:] + run.stderr
