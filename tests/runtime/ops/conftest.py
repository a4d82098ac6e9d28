"""Fixtures for the in-graph op tests (jax on CPU)."""

from __future__ import annotations

import pytest

from jax_tpusync.runtime.engine import Engine


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
