"""Blocks a running slot shared once computed (share_computed) on a persistent tier: the
next commit records them as the slot's shared, indexed blocks (with their checksums), and a
re-attached cache keeps them pinned by the slot and maps them for a new prompt."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps

from support.tier_files import manifest_path

LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM = 2, 3, 32, 2, 8
BT, NUM_BLOCKS = 4, 24
PROMPT = list(range(100, 114))  # 14 ids: three full blocks, two of a fourth.


def make(where) -> tps.OffloadedKVCache:
    return tps.OffloadedKVCache(
        num_layers=LAYERS, batch=BATCH, max_len=MAX_LEN, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, dtype=jnp.float32, block_tokens=BT, num_blocks=NUM_BLOCKS,
        staging_bytes=1 << 20, model_id="m", **where,
    )  # fmt: skip


def kv_of(tokens, layer):
    t = np.asarray(tokens, np.float32)[:, None, None]
    base = np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32).reshape(1, KV_HEADS, HEAD_DIM)
    k = np.sin(t * 0.37 + base * 0.11 + layer)
    return np.stack([k, -k])


def test_blocks_shared_mid_prefill_are_committed_and_restored_pinned(where):
    with make(where) as cache:
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=PROMPT, max_tokens=20)
        assert cached == 0
        for layer in range(LAYERS):  # A prefill that has reached row 10 of 14.
            kv = kv_of(PROMPT[:10], layer)
            state = cache.load(state, layer, kv[0], kv[1], slot=0)
        assert cache.share_computed(state, 0) == 2
        table = cache.block_tables[0].tolist()
        cache.close(state)  # Commits.
    m = json.loads(manifest_path(where).read_text())["prefix"]
    assert m["shared"] == [2, 0, 0]
    assert sorted(e["block"] for e in m["entries"]) == sorted(table[:2])
    assert all(len(e["checksums"]) == LAYERS for e in m["entries"])
    with make(where) as cache:  # verify=True: the indexed blocks are checked on open.
        assert cache.prefix_stats["indexed_blocks"] == 2
        assert cache.prefix_stats["cached_blocks"] == 0  # Pinned by slot 0 still.
        state = cache.init(admit=False)
        np.testing.assert_array_equal(np.asarray(state.lengths), [10, 0, 0])
        state, cached = cache.admit(state, 1, tokens=PROMPT, max_tokens=20)
        assert cached == 2 * BT
        assert cache.block_tables[1, :2].tolist() == table[:2]
        for layer in range(LAYERS):
            k, v = cache.read(state, layer, 1, 0, 2 * BT)
            want = kv_of(PROMPT[: 2 * BT], layer)
            np.testing.assert_array_equal(k, want[0])
            np.testing.assert_array_equal(v, want[1])
        state = cache.release(state, 0)
        state = cache.release(state, 1)
        assert cache.prefix_stats["cached_blocks"] == 2
        cache.close(state)
