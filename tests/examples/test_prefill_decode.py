"""examples/prefill_decode.py at a tiny size: every request's KV comes from the prefill
process and its decoded tokens equal a local prefill's. Skips without the Mooncake client
unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_prefill_decode_tiny(run_example, mooncake_usable):
    doc = run_example(
        "prefill_decode.py",
        "--requests", "2",
        "--prompt-tokens", "40",
        "--max-new-tokens", "4",
        "--layers", "2",
        "--block-tokens", "16",
        timeout=180,
    )  # fmt: skip
    assert doc["all_match"] is True
    rows = doc["requests"]
    assert len(rows) == 2
    for row in rows:
        # 40 tokens x 2 layers x K|V x 2 heads x 64 x bf16.
        assert row["kv_bytes"] == 40 * 2 * 2 * 2 * 64 * 2
        assert len(row["tokens"]) == 4 and row["tokens_match"] is True
