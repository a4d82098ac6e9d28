"""Each slot's token ids: recorded at admit, extended by the serving loop, checked against the
ids a release passes, used by a release that passes none, and persisted by commits."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.persist import commit as persistence

from support import child_env

LAYERS, BATCH, MAX_LEN, HEADS, DIM, BLOCK = 2, 2, 32, 2, 4, 4
PROMPT = list(range(100, 110))


def make(**overrides):
    args = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=jnp.float32,
        block_tokens=BLOCK,
    )
    args.update(overrides)
    return tps.OffloadedKVCache(**args)


def prefill(cache, state, slot, n, start=0):
    """Rows [start, n) of ``slot`` in every layer (values of the position)."""
    k = np.zeros((BATCH, n - start, HEADS, DIM), np.float32)
    k[slot] = np.arange(start, n, dtype=np.float32)[:, None, None]
    counts = [n - start if b == slot else 0 for b in range(BATCH)]
    starts = [start if b == slot else 0 for b in range(BATCH)]
    for layer in range(LAYERS):
        state = cache.load(state, layer, k, k, start=starts, lengths=counts)
    return state


def test_admit_records_the_prompt_and_extend_appends():
    with make() as cache:
        state, _ = cache.admit(cache.init(admit=False), 0, tokens=PROMPT, max_tokens=12)
        np.testing.assert_array_equal(cache.tokens(0), PROMPT)
        cache.extend_tokens(0, [7, 8])  # The edge: exactly the capacity of 12 ids.
        np.testing.assert_array_equal(cache.tokens(0), PROMPT + [7, 8])
        with pytest.raises(
            ValueError, match=r"would record 13 token ids, more than its capacity of 12"
        ):
            cache.extend_tokens(0, [9])
        np.testing.assert_array_equal(cache.tokens(0), PROMPT + [7, 8])
        with pytest.raises(ValueError, match=r"slot 1 is not active"):
            cache.extend_tokens(1, [1])
        with pytest.raises(ValueError, match=r"is not in \[0, 2\*\*63 - 1 = "):
            cache.extend_tokens(0, [2**63])
        assert cache.tokens(1).tolist() == []


def test_a_release_without_tokens_publishes_the_recorded_ids():
    with make() as cache:
        state, _ = cache.admit(cache.init(admit=False), 0, tokens=PROMPT, max_tokens=16)
        state = prefill(cache, state, 0, len(PROMPT))
        state = cache.release(state, 0)  # Recorded ids cover all 10 tokens: 2 full blocks.
        assert cache.prefix_stats["indexed_blocks"] == 2
        state, cached = cache.admit(state, 1, tokens=PROMPT + [1], max_tokens=16)
        assert cached == 8
        assert cache.tokens(1).tolist() == PROMPT + [1]


def test_a_release_whose_ids_are_not_all_recorded_publishes_nothing():
    """The edge: one token of KV past the recorded ids, and nothing is indexed (the KV of a
    token whose id the cache does not know is never published)."""
    with make() as cache:
        state, _ = cache.admit(cache.init(admit=False), 0, tokens=PROMPT, max_tokens=16)
        state = prefill(cache, state, 0, len(PROMPT) + 1)
        state = cache.release(state, 0)
        assert cache.prefix_stats["indexed_blocks"] == 0
        assert cache.free_blocks == cache.spec.num_blocks


def test_a_release_with_ids_that_differ_from_the_recorded_ones_is_refused():
    with make() as cache:
        state, _ = cache.admit(cache.init(admit=False), 0, tokens=PROMPT, max_tokens=16)
        state = prefill(cache, state, 0, len(PROMPT))
        other = list(PROMPT)
        other[9] += 1  # The edge: the last token whose KV the slot holds.
        with pytest.raises(
            ValueError, match=r"tokens\[9\]=110 differs from slot 0's recorded token 109"
        ):
            cache.release(state, 0, tokens=other)
        assert cache.capacity[0] == 16  # Refused: still admitted, and the state still works.
        state = cache.release(state, 0, tokens=PROMPT + [55])  # Past the length: not checked.
        assert cache.prefix_stats["indexed_blocks"] == 2


CHILD = textwrap.dedent(
    """
    import os, sys
    from support import load_module
    t = load_module({test_file!r})
    cache = t.make(tier="file", path={path!r}, file_name="kv")
    state, _ = cache.admit(cache.init(admit=False), 0, tokens=t.PROMPT, max_tokens=16)
    state = t.prefill(cache, state, 0, 6)
    cache.extend_tokens(0, [])
    state = cache.commit(state)
    state = t.prefill(cache, state, 0, 9, start=6)  # Past the commit: dropped by the crash.
    os.kill(os.getpid(), 9)
    """
)


def test_token_ids_survive_commit_sigkill_and_reattach(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    script = CHILD.format(test_file=__file__, path=str(data))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd="/",  # Not the source tree, whose package has no built extension.
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with make(tier="file", path=str(data), file_name="kv") as cache:
        assert cache.committed_lengths.tolist() == [6, 0]
        assert cache.tokens(0).tolist() == PROMPT[:6]  # Up to the committed length.
        state = cache.init()
        cache.extend_tokens(0, PROMPT[6:9])
        state = prefill(cache, state, 0, 9, start=6)
        state = cache.release(state, 0)  # Its 9 recorded ids: 2 full blocks published.
        assert cache.prefix_stats["indexed_blocks"] == 2
        cache.close(state)


def test_a_manifest_with_malformed_token_ids_is_refused_by_name(tmp_path):
    with make(tier="file", path=str(tmp_path), file_name="kv") as cache:
        state, _ = cache.admit(cache.init(admit=False), 0, tokens=PROMPT, max_tokens=16)
        state = prefill(cache, state, 0, 4)
        cache.close(state)
    path = tmp_path / ("kv" + persistence.MANIFEST_SUFFIX)
    manifest = json.loads(path.read_text())
    assert len(manifest["tokens"]) == BATCH
    for bad, message in (
        (["!!", ""], r"tokens of sequence 0: token ids are not base64"),
        ("AAAA", r"'tokens' is a string \('AAAA'\), not a list of 2 strings"),
        (
            [base64.b64encode(np.arange(5, dtype="<i8").tobytes()).decode(), ""],
            r"sequence 0 records 5 token ids, more than its length 4",
        ),
    ):
        manifest["tokens"] = bad
        path.write_text(json.dumps(manifest))
        with pytest.raises(persistence.MissingManifestError, match=message):
            make(tier="file", path=str(tmp_path), file_name="kv")


def test_load_of_one_slot_writes_that_slot_only():
    with make() as cache:
        state = cache.init()
        rows = np.arange(3 * HEADS * DIM, dtype=np.float32).reshape(3, HEADS, DIM)
        for layer in range(LAYERS):
            state = cache.load(state, layer, rows, -rows, slot=1, start=0)
        assert np.asarray(state.lengths).tolist() == [0, 3]
        k, v = cache.read(state, 0, 1)
        np.testing.assert_array_equal(k, rows)
        np.testing.assert_array_equal(v, -rows)
        with pytest.raises(
            ValueError, match=r"with slot=, k must be \[n, num_kv_heads, head_dim\]"
        ):
            cache.load(state, 0, rows[None], rows[None], slot=1)
        with pytest.raises(ValueError, match=r"slot=2 must be an int in \[0, batch=2\)"):
            cache.load(state, 0, rows, rows, slot=2)
