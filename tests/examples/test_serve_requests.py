"""examples/serve_requests.py at a tiny size: every request finishes, from the prefix store
after the first, with tokens equal to the resident run's."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_serve_requests_tiny(run_example, tmp_path):
    doc = run_example(
        "serve_requests.py",
        "--requests", "6",
        "--rate", "200",
        "--system-tokens", "32",
        "--question-tokens", "1", "40",
        "--max-new-tokens", "5",
        "--batch", "3",
        "--chunk", "16",
        "--block-tokens", "16",
        "--path", str(tmp_path),
        timeout=120,
    )  # fmt: skip
    assert doc["all_finished"] and doc["tokens_match"] is True
    rows = doc["requests"]
    assert len(rows) == 6
    for row in rows:
        assert len(row["tokens"]) == 5 and row["tokens"] == row["tokens_resident"]
        assert row["ttft_s"] > 0 and row["time_per_output_token_s"] > 0
    # Three slots, six requests: the later ones start after a release, from its blocks.
    assert max(r["cached_tokens"] for r in rows[3:]) >= 32
    assert set(doc["loop"]["steps_by_width"]) == {"1", "16"}
    # Both widths compiled by the warm-up, before the first request: no step held a compile.
    assert set(doc["loop"]["warmup_seconds_by_width"]) == {"1", "16"}
    assert doc["loop"]["compiled_in_steps"] == [] and doc["compile_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["serve_requests.json"]  # No tier file left.
