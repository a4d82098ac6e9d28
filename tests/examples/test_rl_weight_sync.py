"""examples/rl_weight_sync.py at two steps: a trainer group (2 processes, FSDP over 4
devices) and a sampler group (1 process, tensor-parallel over 2) alternate through the
weight store; the sampler's tokens and params equal the trainer's own at every version."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_rl_weight_sync(run_example):
    doc = run_example("rl_weight_sync.py", "--steps", "2", "--timeout", "120", timeout=240)
    assert doc["all_match"] is True
    assert doc["trainer"] == {"processes": 2, "mesh": "fsdp=4"}
    steps = doc["steps"]
    assert [s["version"] for s in steps] == [0, 1]
    # embed 256x128, 2 x (128x256 + 256x128), norm 128, unembed 128x256, all f32: the
    # sampler's process reads each element once.
    total = (256 * 128 + 2 * 2 * 128 * 256 + 128 + 128 * 256) * 4
    for s in steps:
        assert s["tokens_equal"] and s["params_hash_equal"]
        assert s["max_logit_diff"] < 1e-4  # Two layouts sum in other orders.
        assert s["bytes_read"] == total
        # Each trainer process wrote its own half (rows over 4 devices, 2 per process).
        assert s["published_bytes"] == total // 2
    assert [s["plan_cached"] for s in steps] == [False, True]


@pytest.mark.slow
def test_rl_weight_sync_through_a_mooncake_store(run_example, mooncake_usable):
    """The same loop through a Mooncake Store of the example's own: two trainer processes
    put their shards into the pool, the sampler process reads its ranges from them."""
    doc = run_example(
        "rl_weight_sync.py", "--steps", "2", "--timeout", "120", "--mooncake", timeout=240
    )
    assert doc["all_match"] is True
    assert [s["plan_cached"] for s in doc["steps"]] == [False, True]
