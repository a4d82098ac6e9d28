"""examples/serve_requests.py at a tiny size: every request finishes, from the prefix store
after the first, with tokens equal to the resident run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_requests.py"


def test_serve_requests_tiny(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--requests", "6",
            "--rate", "200",
            "--system-tokens", "32",
            "--question-tokens", "1", "40",
            "--max-new-tokens", "5",
            "--batch", "3",
            "--chunk", "16",
            "--block-tokens", "16",
            "--path", str(tmp_path),
            "--json", str(out),
        ],
        check=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["all_finished"] and doc["tokens_match"] is True
    rows = doc["requests"]
    assert len(rows) == 6
    for row in rows:
        assert len(row["tokens"]) == 5 and row["tokens"] == row["tokens_resident"]
        assert row["ttft_s"] > 0 and row["time_per_output_token_s"] > 0
    # Three slots, six requests: the later ones start after a release, from its blocks.
    assert max(r["cached_tokens"] for r in rows[3:]) >= 32
    assert set(doc["loop"]["steps_by_width"]) == {"1", "16"}
    assert not [p for p in tmp_path.iterdir() if p != out]  # The tier file is gone.
