"""examples/prefill_decode.py at a tiny size: every request's KV comes from the prefill
process and its decoded tokens equal a local prefill's. Skips without the Mooncake client
unless TPUSYNC_REQUIRE_MOONCAKE=1 (CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prefill_decode.py"


def test_prefill_decode_tiny(tmp_path, mooncake_usable):
    out = tmp_path / "pd.json"
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--requests", "2",
            "--prompt-tokens", "40",
            "--max-new-tokens", "4",
            "--layers", "2",
            "--block-tokens", "16",
            "--json", str(out),
        ],
        check=True,
        timeout=180,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["all_match"] is True
    rows = doc["requests"]
    assert len(rows) == 2
    for row in rows:
        # 40 tokens x 2 layers x K|V x 2 heads x 64 x bf16.
        assert row["kv_bytes"] == 40 * 2 * 2 * 2 * 64 * 2
        assert len(row["tokens"]) == 4 and row["tokens_match"] is True
