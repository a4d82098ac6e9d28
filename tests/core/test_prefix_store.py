"""Prefix store: full blocks shared between sequences by content, pinned while mapped,
evicted LRU when space is needed, never written by a sequence that only maps them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import blocks, prefix

KV_HEADS, Q_HEADS, HEAD_DIM, BT = 2, 4, 8, 4


def _cache(**kw):
    args = dict(
        num_layers=2,
        batch=2,
        max_len=32,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        block_tokens=BT,
        staging_bytes=1 << 20,
    )
    args.update(kw)
    return tps.OffloadedKVCache(**args)


def _kv_of(tokens, layer):
    """Deterministic KV of token ids (the same tokens give the same KV, as a model's would
    for the same prefix): [2, n, H, D]."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    base = np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32).reshape(1, KV_HEADS, HEAD_DIM)
    k = np.sin(t * 0.37 + base * 0.11 + layer)
    return np.stack([k, -k])


def _prefill(cache, state, slot, tokens, start):
    """Writes the KV of tokens[start:] into ``slot`` (what a prefill would write)."""
    spec = cache.spec
    n = len(tokens) - start
    for layer in range(spec.num_layers):
        kv = _kv_of(tokens[start:], layer)
        full = np.zeros((2, spec.batch, n, KV_HEADS, HEAD_DIM), np.float32)
        full[:, slot] = kv
        counts = [n if b == slot else 0 for b in range(spec.batch)]
        starts = [start if b == slot else 0 for b in range(spec.batch)]
        state = cache.load(state, layer, full[0], full[1], start=starts, lengths=counts)
    return state


def _step():
    def step(x, state):
        outs = []
        for layer in range(2):
            q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], 1, Q_HEADS, HEAD_DIM)) * (layer + 1)
            o, state = tps.prefetching_attention(q, q[:, :, :KV_HEADS] * 0.5, -q[:, :, :KV_HEADS], state, layer=layer)
            outs.append(o)
        return outs, state

    return jax.jit(step, donate_argnums=(1,))


PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4, then 2 more.


def test_a_second_sequence_maps_the_shared_prefix():
    with _cache() as cache:
        state = cache.init(admit=False)
        a_tokens = PROMPT + [7, 8]
        state, cached = cache.admit(state, 0, tokens=a_tokens, max_tokens=16)
        assert cached == 0
        state = _prefill(cache, state, 0, a_tokens, 0)
        a_blocks = cache.block_tables[0, :3].tolist()
        state = cache.release(state, 0, tokens=a_tokens)  # 12 tokens: 3 full blocks indexed.
        assert cache.prefix_stats["indexed_blocks"] == 3
        assert cache.prefix_stats["cached_blocks"] == 3

        b_tokens = PROMPT + [9, 9, 9]  # Shares blocks 0 and 1 (tokens 0-7), not block 2.
        state, cached = cache.admit(state, 1, tokens=b_tokens, max_tokens=20)
        assert cached == 8
        assert cache.block_tables[1, :2].tolist() == a_blocks[:2]
        assert cache.block_tables[1, 2] not in a_blocks
        assert np.asarray(state.lengths).tolist() == [0, 8]
        state = _prefill(cache, state, 1, b_tokens, cached)
        # Slot 1 reads the shared KV it did not write, and its own after it.
        for layer in range(2):
            k, v = cache.read(state, layer, 1)
            want = _kv_of(b_tokens, layer)
            np.testing.assert_array_equal(k, want[0])
            np.testing.assert_array_equal(v, want[1])
        # Decode over the mapped prefix matches the resident attention over the same KV.
        x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, HEAD_DIM)), jnp.float32)
        lengths = np.asarray(state.lengths)
        refs = []
        for layer in range(2):
            k_all, v_all = cache.read_all(layer, lengths)
            q = jnp.broadcast_to(x[:, :, None, :], (2, 1, Q_HEADS, HEAD_DIM)) * (layer + 1)
            out, _, _ = tps.resident_attention(
                q, q[:, :, :KV_HEADS] * 0.5, -q[:, :, :KV_HEADS], jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(lengths)
            )
            refs.append(np.asarray(out))
        outs, state = _step()(x, state)
        np.testing.assert_allclose(np.asarray(outs[1])[1], refs[1][1], atol=1e-5)
        state = cache.drain(state)
        # The shared blocks are unchanged by slot 1's decode (it writes its own block 2).
        a_again = cache.read_all(0)[0]
        np.testing.assert_array_equal(a_again[1, :8], _kv_of(PROMPT[:8], 0)[0])


def test_the_prompts_last_token_is_always_computed():
    with _cache() as cache:
        state = cache.init(admit=False)
        tokens = PROMPT[:8]  # Exactly two blocks.
        state, _ = cache.admit(state, 0, tokens=tokens, max_tokens=12)
        state = _prefill(cache, state, 0, tokens, 0)
        state = cache.release(state, 0, tokens=tokens)
        state, cached = cache.admit(state, 0, tokens=tokens, max_tokens=12)
        assert cached == 4  # Not 8: the last token's logits need a forward pass.


def test_shared_blocks_are_read_only():
    with _cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=PROMPT, max_tokens=12)
        state = _prefill(cache, state, 0, PROMPT, 0)
        state = cache.release(state, 0, tokens=PROMPT)
        state, cached = cache.admit(state, 1, tokens=PROMPT, max_tokens=12)
        assert cached == 8
        kv = np.zeros((2, 2, 1, KV_HEADS, HEAD_DIM), np.float32)
        with pytest.raises(ValueError, match=r"rows \[7, 8\) of slot 1 overlap its shared prefix \[0, 8\)"):
            cache.load(state, 0, kv[0], kv[1], start=[0, 7], lengths=[0, 1])
        state = cache.load(state, 0, kv[0], kv[1], start=[0, 8], lengths=[0, 1])  # The edge.
        with pytest.raises(ValueError, match="lengths\\[1\\]=7 is below slot 1's shared prefix of 8 tokens"):
            cache.init([0, 7], admit=False)


def test_pinned_blocks_are_never_evicted_and_a_full_store_says_so():
    with _cache(num_blocks=6) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=PROMPT, max_tokens=12)  # 3 blocks.
        state = _prefill(cache, state, 0, PROMPT, 0)
        state = cache.release(state, 0, tokens=PROMPT)  # 2 full blocks cached, 1 freed.
        assert cache.free_blocks == 4 and cache.prefix_stats["cached_blocks"] == 2
        state, cached = cache.admit(state, 0, tokens=PROMPT, max_tokens=16)  # Pins both.
        assert cached == 8 and cache.free_blocks == 2
        with pytest.raises(ValueError, match="needs 3 KV blocks but only 2 of 6 are free and none is left to evict"):
            cache.admit(state, 1, max_tokens=12)
        assert cache.prefix_stats["evictions"] == 0
        state, _ = cache.admit(state, 1, max_tokens=8)  # Exactly the free ones fit.
        assert cache.free_blocks == 0


def test_cached_blocks_are_evicted_lru_tail_first():
    with _cache(num_blocks=8) as cache:
        state = cache.init(admit=False)
        seq_a = list(range(12))
        seq_b = list(range(50, 62))
        for tokens in (seq_a, seq_b):
            state, _ = cache.admit(state, 0, tokens=tokens, max_tokens=12)
            state = _prefill(cache, state, 0, tokens, 0)
            state = cache.release(state, 0, tokens=tokens)  # 3 full blocks each.
        assert cache.prefix_stats["cached_blocks"] == 6 and cache.free_blocks == 2
        # 3 blocks needed, 2 free: one eviction, a's tail (least recently used, last block).
        state, _ = cache.admit(state, 1, max_tokens=12)
        assert cache.prefix_stats["evictions"] == 1
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 0, tokens=seq_a + [1], max_tokens=16)
        assert cached == 8  # a's first two blocks survived; its third was evicted.
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 0, tokens=seq_b + [1], max_tokens=16)
        assert cached == 12  # b untouched.
        assert cache.prefix_stats["evictions"] == 1


def test_a_duplicate_prefix_written_twice_is_indexed_once():
    with _cache() as cache:
        state = cache.init(admit=False)
        for slot in (0, 1):  # Both miss: neither is released yet.
            state, cached = cache.admit(state, slot, tokens=PROMPT, max_tokens=12)
            assert cached == 0
            state = _prefill(cache, state, slot, PROMPT, 0)
        free = cache.free_blocks
        state = cache.release(state, 0, tokens=PROMPT)
        state = cache.release(state, 1, tokens=PROMPT)  # Its 2 full blocks are duplicates.
        assert cache.prefix_stats["indexed_blocks"] == 2
        assert cache.free_blocks == free + 1 + 3  # a's tail; b's 2 duplicates and tail.


def test_release_without_tokens_frees_private_blocks_and_unpins_shared_ones():
    with _cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=PROMPT, max_tokens=12)
        state = _prefill(cache, state, 0, PROMPT, 0)
        state = cache.release(state, 0, tokens=PROMPT)
        free = cache.free_blocks
        state, cached = cache.admit(state, 1, tokens=PROMPT, max_tokens=16)
        assert cached == 8 and cache.free_blocks == free - 2
        state = cache.release(state, 1)
        assert cache.free_blocks == free and cache.prefix_stats["cached_blocks"] == 2


def test_bad_tokens_are_named():
    with _cache() as cache:
        state = cache.init(admit=False)
        with pytest.raises(ValueError, match="tokens must be a 1-D sequence of ints; got float64"):
            cache.admit(state, 0, tokens=[1.5, 2.0])
        with pytest.raises(ValueError, match="tokens has 13 ids, more than max_tokens=12"):
            cache.admit(state, 0, tokens=list(range(13)), max_tokens=12)
        state, _ = cache.admit(state, 0, tokens=PROMPT, max_tokens=12)
        state = _prefill(cache, state, 0, PROMPT, 0)
        with pytest.raises(ValueError, match="tokens has 9 ids but slot 0 holds 10 tokens"):
            cache.release(state, 0, tokens=PROMPT[:9])


def test_prefix_sharing_on_a_persistent_tier_survives_a_restart(tmp_path):
    """The index is committed with the KV (tests/persist/test_prefix_reattach.py has
    the details): a re-opened cache maps the same blocks for the same prompt."""
    where = dict(tier="file", path=tmp_path, file_name="kv")
    with _cache(**where) as cache:
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=PROMPT, max_tokens=12)
        assert cached == 0
        state = _prefill(cache, state, 0, PROMPT, 0)
        blocks_a = cache.block_tables[0, :2].tolist()
        state = cache.release(state, 0, tokens=PROMPT)
        cache.close(state)
    with _cache(**where) as cache:
        assert cache.prefix_stats["indexed_blocks"] == 2
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 1, tokens=PROMPT, max_tokens=12)
        assert cached == 8 and cache.block_tables[1, :2].tolist() == blocks_a
        for layer in range(2):
            k, v = cache.read(state, layer, 1)
            np.testing.assert_array_equal(k, _kv_of(PROMPT[:8], layer)[0])
            np.testing.assert_array_equal(v, _kv_of(PROMPT[:8], layer)[1])


# -- the index alone ---------------------------------------------------------------------------


def _index(num_blocks=16, salt="m"):
    return prefix.PrefixIndex(blocks.BlockAllocator(num_blocks), BT, prefix.root_key(salt, dict(a=1)))


def test_keys_chain_over_the_whole_prefix_and_the_salt():
    a, b = _index(salt="model-a"), _index(salt="model-b")
    tokens = np.arange(12)
    ka = a.keys(tokens)
    assert len(ka) == 3 and len(set(ka)) == 3 and all(len(k) == 16 for k in ka)  # 128-bit.
    assert not set(ka) & set(b.keys(tokens))  # Another salt: no key in common.
    other = tokens.copy()
    other[0] = 99  # A change in block 0 changes every later key.
    assert not set(ka) & set(a.keys(other))
    assert prefix.root_key("m", dict(a=1)) != prefix.root_key("m", dict(a=2))


def test_a_digest_collision_cannot_map_wrong_kv(monkeypatch):
    """Even if two prefixes hashed alike, a lookup compares the stored tokens and parent."""
    index = _index()
    monkeypatch.setattr(prefix, "chain_key", lambda parent, tokens: b"\x00" * 16)
    tokens = np.arange(8)
    own = index.allocator.allocate(2)
    assert index.publish(tokens, own, shared=0) == [own[1]]  # Same (fake) key: a duplicate.
    assert index.match(tokens, 2) == [int(own[0])]
    index.unpin([int(own[0])])
    assert index.match(np.arange(8) + 1, 2) == []  # Same fake key, other tokens: no hit.


def test_evicting_a_block_takes_its_descendants():
    index = _index(num_blocks=4)
    own = index.allocator.allocate(3)
    tokens = np.arange(12)
    index.publish(tokens, own, shared=0)
    first = index.keys(tokens)[0]
    index._lru.move_to_end(first, last=False)  # The chain's first block is the LRU one.
    assert index.evict(1) == 3  # Without it its descendants are unreachable: all go.
    assert index.allocator.free_blocks == 4 and len(index) == 0
    assert index.match(tokens, 3) == []
