"""Fixtures for the transfer-engine tests: engines that always close, O_DIRECT-capable
directories, uniquely named shm segments that are always unlinked, and a factory for every
kind of tier."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from jax_tpusync.runtime.engine import Engine


@pytest.fixture
def shm_names():
    """Hands out unique shm segment names and unlinks every one at teardown."""
    names: list[str] = []

    def make() -> str:
        name = f"tpusync-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        names.append(name)
        return name

    yield make
    for name in names:
        try:
            Engine.unlink_shm(name)
        except Exception:  # noqa: BLE001 - never created, or already unlinked by the test.
            pass


TIER_KINDS = ("host", "shm", "file_direct", "file_buffered")


@pytest.fixture
def add_tier(file_dir, shm_names):
    """add_tier(engine, kind, block_bytes=, num_blocks=) -> tier index, for any TIER_KINDS."""

    def add(engine: Engine, kind: str, *, block_bytes: int, num_blocks: int) -> int:
        if kind == "host":
            return engine.add_host_tier(block_bytes=block_bytes, num_blocks=num_blocks)
        if kind == "shm":
            return engine.add_host_tier(
                block_bytes=block_bytes, num_blocks=num_blocks, shm_name=shm_names()
            )
        if kind == "file_direct":
            tier = engine.add_file_tier(file_dir, block_bytes=block_bytes, num_blocks=num_blocks)
            assert engine.tier_info(tier).direct_io, engine.tier_info(tier)
            return tier
        if kind == "file_buffered":
            tier = engine.add_file_tier(
                file_dir, block_bytes=block_bytes, num_blocks=num_blocks, direct_io=False
            )
            info = engine.tier_info(tier)
            assert not info.direct_io and "buffered" in info.description, info
            return tier
        raise AssertionError(kind)

    return add


@pytest.fixture(params=TIER_KINDS)
def tier_kind(request) -> str:
    return request.param


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def unaligned_empty(n: int, fill: int = 0) -> np.ndarray:
    """A writable, C-contiguous uint8 array of n bytes whose data pointer is odd."""
    base = np.full(n + 1, fill, dtype=np.uint8)
    out = base[1:]
    assert out.ctypes.data % 2 == 1 and out.flags.c_contiguous and out.flags.writeable
    return out


@pytest.fixture
def rand():
    return random_bytes


@pytest.fixture
def unaligned():
    return unaligned_empty
