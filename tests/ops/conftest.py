"""Fixtures for the in-graph op tests (jax on CPU)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from jax_tpusync.engine import Engine

_DIRECT_IO_BASES = ("/var/tmp", "/work")


def _direct_io_works(directory: str) -> bool:
    try:
        with Engine() as e:
            tier = e.add_file_tier(directory, block_bytes=4096, num_blocks=1)
            return e.tier_info(tier).direct_io
    except Exception:  # noqa: BLE001 - unusable directory: not a candidate.
        return False


@pytest.fixture
def file_dir(tmp_path):
    """A directory on a filesystem where the file tier really uses O_DIRECT."""
    if _direct_io_works(str(tmp_path)):
        yield str(tmp_path)
        return
    for base in _DIRECT_IO_BASES:
        if not (os.path.isdir(base) and os.access(base, os.W_OK)):
            continue
        d = tempfile.mkdtemp(prefix="tpusync-test-", dir=base)
        if _direct_io_works(d):
            try:
                yield d
            finally:
                shutil.rmtree(d, ignore_errors=True)
            return
        shutil.rmtree(d, ignore_errors=True)
    pytest.skip("no writable filesystem here supports O_DIRECT")


@pytest.fixture
def make_engine():
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        e = Engine(**overrides)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.fixture(params=("host", "file"))
def tier_kind(request) -> str:
    return request.param


@pytest.fixture
def add_tier(file_dir):
    def add(engine: Engine, kind: str, *, block_bytes: int, num_blocks: int) -> int:
        if kind == "host":
            return engine.add_host_tier(block_bytes=block_bytes, num_blocks=num_blocks)
        tier = engine.add_file_tier(file_dir, block_bytes=block_bytes, num_blocks=num_blocks)
        assert engine.tier_info(tier).direct_io
        return tier

    return add
