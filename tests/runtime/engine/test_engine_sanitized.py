"""The engine core under AddressSanitizer and ThreadSanitizer: the fetch lifecycle stress
(tests/runtime/engine/landing_stress.cc) with fetches consumed, discarded, orphaned by a new epoch
and left in flight at shutdown, visited where they landed (a new epoch racing the visit from
another thread), and (host tier) reads in place, beside write-backs of the same bytes from
three threads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(str(p) for p in (ROOT / "ffi" / "engine").glob("*.cc"))
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(
    CXX is None or not SOURCES, reason="needs a C++ compiler and the source tree"
)


def _build(tmp_path: Path, sanitizer: str) -> Path:
    exe = tmp_path / f"landing_stress_{sanitizer}"
    cmd = [
        CXX, "-std=c++17", "-O0", "-g1", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer",
        f"-I{ROOT / 'ffi'}", str(Path(__file__).with_name("landing_stress.cc")), *SOURCES,
        "-o", str(exe), "-lpthread", "-lrt",
    ]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0 and "sanitizer" in build.stderr and "cannot find" in build.stderr:
        pytest.skip(f"no {sanitizer} sanitizer runtime: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


# ASan over the file tier (its paths include the host tier's landing and pooling), TSan over
# the host tier (deferred reads on the workers), the host tier's reads at the wait split
# with the copy helper ("host-split") and the file tier (visits of landed fetches beside
# fetches that reuse pooled landing buffers). Built at -O0 with line tables only: half the
# compile time of -O1 -g, while the stress runs stay a few seconds.
@pytest.mark.parametrize(
    "sanitizer,modes", [("address", ("file",)), ("thread", ("host", "host-split", "file"))]
)
@pytest.mark.slow
def test_fetch_lifecycle_is_clean_under_sanitizers(tmp_path, sanitizer, modes):
    exe = _build(tmp_path, sanitizer)
    env = {"ASAN_OPTIONS": "detect_leaks=1", "TSAN_OPTIONS": "halt_on_error=1"}
    for mode in modes:
        run = subprocess.run(
            [str(exe), mode, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
        )
        assert run.returncode == 0 and run.stdout.strip() == "ok", (mode, run.stderr[-4000:])
