"""Warm restart of the prefix store: each commit records the prefix index (entries, shared
prefixes, per-block checksums) and a re-attached cache restores it, so a new sequence with a
known prompt maps the same physical blocks, and a corrupt or inconsistent index is refused
by name."""

from __future__ import annotations

import json
import os
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
from support.tier_files import data_path, manifest_path

LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM, Q_HEADS = 2, 3, 32, 2, 8, 4
BT, NUM_BLOCKS = 4, 24
ROW_BYTES = KV_HEADS * HEAD_DIM * 4
CHUNK_ROWS = 6  # Chunks that straddle blocks.
HEADER_BYTES = 4096  # The tiers' header page, before the data.

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4, then 2 more.
A = PROMPT + [7, 8]  # 3 full blocks.
B = PROMPT + [9, 9, 9]  # Shares A's first 2 blocks.


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(persistence, "CHUNK_TARGET_BYTES", CHUNK_ROWS * ROW_BYTES)


def make(where, **kwargs) -> tps.OffloadedKVCache:
    args = dict(
        num_layers=LAYERS,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        block_tokens=BT,
        num_blocks=NUM_BLOCKS,
        staging_bytes=1 << 20,
        model_id="m",
    )
    args.update(where)
    args.update(kwargs)
    return tps.OffloadedKVCache(**args)


def manifest(where) -> dict:
    return json.loads(manifest_path(where).read_text())


def kv_of(tokens, layer):
    """Deterministic KV of token ids (the same prefix gives the same KV): [2, n, H, D]."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    base = np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32).reshape(1, KV_HEADS, HEAD_DIM)
    k = np.sin(t * 0.37 + base * 0.11 + layer)
    return np.stack([k, -k])


def prefill(cache, state, slot, tokens, start):
    """Writes the KV of tokens[start:] into ``slot`` (what a prefill would write)."""
    n = len(tokens) - start
    for layer in range(LAYERS):
        full = np.zeros((2, BATCH, n, KV_HEADS, HEAD_DIM), np.float32)
        full[:, slot] = kv_of(tokens[start:], layer)
        counts = [n if b == slot else 0 for b in range(BATCH)]
        starts = [start if b == slot else 0 for b in range(BATCH)]
        state = cache.load(state, layer, full[0], full[1], start=starts, lengths=counts)
    return state


def serve(cache, state, slot, tokens, max_tokens, *, release=True):
    """Admits ``tokens`` into ``slot``, prefills what was not cached and (by default)
    releases it with its tokens; returns (state, cached, the slot's blocks)."""
    state, cached = cache.admit(state, slot, tokens=tokens, max_tokens=max_tokens)
    state = prefill(cache, state, slot, tokens, cached)
    held = cache.block_tables[slot]
    held = held[held >= 0].tolist()
    if release:
        state = cache.release(state, slot, tokens=tokens)
    return state, cached, held


def assert_kv(cache, state, slot, tokens):
    for layer in range(LAYERS):
        k, v = cache.read(state, layer, slot)
        want = kv_of(tokens, layer)
        np.testing.assert_array_equal(k, want[0])
        np.testing.assert_array_equal(v, want[1])


def shared_session(where, **kwargs):
    """A's 3 blocks indexed; slot 1 holds B, mapping A's first 2 (its third block is
    its own); committed and closed. Returns (A's blocks, slot 1's blocks)."""
    with make(where, **kwargs) as cache:
        state = cache.init(admit=False)
        state, cached, a_blocks = serve(cache, state, 0, A, 12)
        assert cached == 0
        state, cached, b_blocks = serve(cache, state, 1, B, 16, release=False)
        assert cached == 8 and b_blocks[:2] == a_blocks[:2]
        assert cache.prefix_stats["indexed_blocks"] == 3
        assert cache.prefix_stats["cached_blocks"] == 1
        cache.close(state)
    return a_blocks, b_blocks


def flip_block_byte(where, cache, layer, kv, block, byte=0):
    """Flips one byte of physical ``block`` of (layer, K|V) in the tier's backing file."""
    spec = cache.spec
    shift = cache.engine.tier_info(cache.tier).alignment_offset if where["tier"] == "file" else 0
    tier_block = cache.first_block + (layer * 2 + kv) * spec.num_blocks + block
    offset = HEADER_BYTES + shift + tier_block * spec.block_bytes + byte
    with open(data_path(where), "r+b") as f:
        f.seek(offset)
        (old,) = f.read(1)
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


# -- restore ------------------------------------------------------------------------------------


def test_a_restarted_cache_serves_the_indexed_prefix(where):
    a_blocks, b_blocks = shared_session(where)
    m = manifest(where)
    assert m["format_version"] == persistence.MANIFEST_VERSION
    index = m["prefix"]
    assert index["shared"] == [0, 2, 0]
    assert [e["block"] for e in index["entries"]] == [a_blocks[2], a_blocks[1], a_blocks[0]]
    assert index["entries"][2]["parent"] is None
    assert index["entries"][2]["tokens"] == A[:4]
    assert all(len(e["checksums"]) == LAYERS for e in index["entries"])
    assert m["lengths"] == [0, 13, 0]
    with make(where) as cache:  # verify=True: the indexed blocks are checked on open.
        assert cache.prefix_stats == dict(indexed_blocks=3, cached_blocks=1, hits=0, evictions=0)
        # 3 indexed blocks (2 of them slot 1's shared prefix) and slot 1's own 2.
        assert cache.free_blocks == NUM_BLOCKS - 5
        np.testing.assert_array_equal(cache.block_tables[1, :4], b_blocks)
        state = cache.init()  # Slots 0 and 2 at max_len, from the free blocks.
        np.testing.assert_array_equal(np.asarray(state.lengths), [0, 13, 0])
        assert_kv(cache, state, 1, B)
        state = cache.release(state, 0)
        state = cache.release(state, 2)
        # A new sequence with A's prompt maps A's 3 blocks, byte-exact.
        state, cached = cache.admit(state, 0, tokens=A + [1], max_tokens=16)
        assert cached == 12
        np.testing.assert_array_equal(cache.block_tables[0, :3], a_blocks)
        assert_kv(cache, state, 0, A)
        assert cache.prefix_stats["hits"] == 3
        result = cache.verify(state)
        assert result.prefix_blocks == 3
        cache.close(state)
    with make(where) as cache:  # The second session's commit indexes them again.
        assert cache.prefix_stats["indexed_blocks"] == 3
        assert cache.prefix_stats["cached_blocks"] == 0  # Slot 0 maps 3, slot 1 two of them.
        assert manifest(where)["prefix"]["shared"] == [3, 2, 0]


def test_restored_shared_blocks_stay_pinned(where):
    a_blocks, b_blocks = shared_session(where, num_blocks=10)
    with make(where, num_blocks=10) as cache:
        assert cache.free_blocks == 5
        state = cache.init(admit=False)
        # 6 blocks, 5 free: one eviction, A's unmapped tail; never slot 1's shared blocks.
        state, _ = cache.admit(state, 0, max_tokens=24)
        assert cache.prefix_stats["evictions"] == 1
        assert cache.prefix_stats == dict(indexed_blocks=2, cached_blocks=0, hits=0, evictions=1)
        assert a_blocks[2] in cache.block_tables[0].tolist()
        # The eviction was committed before block a_blocks[2] was handed out.
        entries = manifest(where)["prefix"]["entries"]
        assert sorted(e["block"] for e in entries) == sorted(a_blocks[:2])
        with pytest.raises(ValueError, match="needs 1 KV blocks but only 0 of 10 are free and no"):
            cache.admit(state, 2, max_tokens=4)
        assert_kv(cache, state, 1, B)
        # Released, slot 1's shared blocks become cached again (and evictable), and its own
        # full block is published under the ids the commit restored (its token history).
        np.testing.assert_array_equal(cache.tokens(1), B)
        state = cache.release(state, 1)
        assert cache.prefix_stats["cached_blocks"] == 3
        state, cached = cache.admit(state, 1, tokens=B + [1], max_tokens=16)
        assert cached == 12
        np.testing.assert_array_equal(cache.block_tables[1, :2], a_blocks[:2])
        np.testing.assert_array_equal(cache.block_tables[1, 2], b_blocks[2])
        assert_kv(cache, state, 1, B[:12])
        cache.close(state)


def test_lru_order_survives_a_restart(where):
    seq_a = list(range(12))
    seq_b = list(range(50, 62))
    with make(where, num_blocks=8) as cache:
        state = cache.init(admit=False)
        for tokens in (seq_a, seq_b):
            state, _, _ = serve(cache, state, 0, tokens, 12)
        cache.close(state)
    with make(where, num_blocks=8) as cache:
        assert cache.prefix_stats["cached_blocks"] == 6 and cache.free_blocks == 2
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, max_tokens=12)  # One eviction: a's tail.
        assert cache.prefix_stats["evictions"] == 1
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 0, tokens=seq_b + [1], max_tokens=16)
        assert cached == 12  # b untouched.
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 0, tokens=seq_a + [1], max_tokens=16)
        assert cached == 8  # a's first two blocks survived; its third was evicted.
        cache.close(state)


def test_release_with_tokens_keeps_indexed_blocks_and_frees_private_ones(where):
    """release(tokens=) commits the slot released first; its tail block goes to another
    sequence, and a crash after that sequence overwrote it re-opens cleanly."""
    with make(where) as cache:
        state = cache.init(admit=False)
        state, _, held = serve(cache, state, 0, A, 16, release=False)  # 4 blocks.
        state = cache.commit(state)
        state = cache.release(state, 0, tokens=A)
        m = manifest(where)
        assert m["lengths"][0] == 0 and m["block_tables"][0] == [-1] * 8
        assert m["prefix"]["entries"] == []  # Indexed after that commit: by the next one.
        state = cache.commit(state)
        assert sorted(e["block"] for e in manifest(where)["prefix"]["entries"]) == sorted(held[:3])
        state, cached = cache.admit(state, 1, tokens=[1, 2, 3], max_tokens=4)
        assert cached == 0 and cache.block_tables[1, 0] == held[3]  # A's freed tail block.
        ones = np.ones((BATCH, 4, KV_HEADS, HEAD_DIM), np.float32)
        for layer in range(LAYERS):
            state = cache.load(state, layer, ones, ones, lengths=[0, 4, 0])
        cache.close()  # A crash: no final commit.
    with make(where) as cache:  # verify=True passes: no manifest covers the tail block.
        assert cache.prefix_stats["indexed_blocks"] == 3
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=A + [1], max_tokens=16)
        assert cached == 12
        assert_kv(cache, state, 0, A)


def test_a_crash_after_an_eviction_never_maps_the_reused_block(where, monkeypatch):
    """An eviction of a block the last commit indexes writes that commit again without it
    before the block is handed out (no drain, sync or hash: the same lengths, tables and
    checksums). The block's new sequence overwrites it and the process dies before another
    commit: the re-attached cache does not index it (else, with verify=False, a prompt
    starting with A would map the new sequence's KV), and verify passes."""
    with make(where, num_blocks=8) as cache:
        state = cache.init(admit=False)
        state, _, a_blocks = serve(cache, state, 0, A, 12)  # A's 3 blocks, cached.
        state = cache.commit(state)
        before = manifest(where)
        assert sorted(e["block"] for e in before["prefix"]["entries"]) == sorted(a_blocks)
        assert cache.free_blocks == 5

        def no_full_commit(*args, **kwargs):
            raise AssertionError("an eviction made a full commit")

        def fail(stage):
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(persistence.Persistence, "commit", no_full_commit)
            m.setattr(persistence.Persistence, "_sync_data", no_full_commit)
            m.setattr(persistence, "fault_hook", fail)
            # The manifest cannot be written: the evicted block is not handed out.
            with pytest.raises(persistence.CommitError, match="evicted prefix blocks"):
                cache.admit(state, 1, max_tokens=24)  # 6 blocks, 5 free: A's tail evicted.
            assert manifest(where) == before
            assert cache.block_tables[1].tolist() == [-1] * 8
            m.setattr(persistence, "fault_hook", None)
            state, _ = cache.admit(state, 1, max_tokens=24)
        assert a_blocks[2] in cache.block_tables[1].tolist()
        after = manifest(where)
        assert after["commit"] == before["commit"] + 1
        assert sorted(e["block"] for e in after["prefix"]["entries"]) == sorted(a_blocks[:2])
        for field in ("lengths", "block_tables", "capacity", "checksums", "tokens"):
            assert after[field] == before[field], field
        ones = np.ones((BATCH, 24, KV_HEADS, HEAD_DIM), np.float32)
        for layer in range(LAYERS):  # Slot 1 overwrites A's tail block.
            state = cache.load(state, layer, ones, ones, lengths=[0, 24, 0])
        cache.close()  # A crash: no commit after the eviction's.
    with make(where, num_blocks=8, verify=False) as cache:
        assert cache.prefix_stats["indexed_blocks"] == 2
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=A + [1], max_tokens=16)
        assert cached == 8
        assert_kv(cache, state, 0, A[:8])
        assert cache.verify(state).prefix_blocks == 2
        cache.close(state)


# -- checksums -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer,kv,which", [(1, 1, 2), (0, 0, 0)])
def test_a_corrupt_indexed_block_is_named(where, layer, kv, which):
    a_blocks, _ = shared_session(where)
    block = a_blocks[which]  # A's unmapped tail, or a block slot 1 maps.
    name = f"layer {layer} {'KV'[kv]} prefix block {block} "
    with make(where, verify=False) as cache:
        cache.verify()
        flip_block_byte(where, cache, layer, kv, block, byte=ROW_BYTES * BT - 1)
        with pytest.raises(persistence.ChecksumMismatchError, match=name) as info:
            cache.verify()
        e = info.value
        assert (e.layer, e.kv, e.block, e.sequence, e.rows) == (layer, "KV"[kv], block, None, None)
    with pytest.raises(persistence.ChecksumMismatchError, match=name):
        make(where)  # verify=True on re-attach: never served.


def test_blocks_are_hashed_once(where, monkeypatch):
    with make(where) as cache:
        state = cache.init(admit=False)
        state, _, _ = serve(cache, state, 0, A, 12)
        hashed = []
        original = persistence.Persistence._hash_blocks

        def spy(self, entries):
            hashed.extend(e.block for e in entries)
            return original(self, entries)

        monkeypatch.setattr(persistence.Persistence, "_hash_blocks", spy)
        state = cache.commit(state)
        state = cache.commit(state)
        state, _, _ = serve(cache, state, 0, B, 16)
        state = cache.commit(state)
        assert len(hashed) == 3 + 1  # A's 3, then B's own third block.
        cache.close(state)


# -- salts ---------------------------------------------------------------------------------------


def test_another_salt_gets_no_hits(where):
    a_blocks, b_blocks = shared_session(where, prefix_salt="weights-1")
    with make(where, prefix_salt="weights-2") as cache:
        # A's unmapped tail is dropped; the 2 blocks slot 1 maps stay, never looked up.
        assert cache.prefix_stats["indexed_blocks"] == 2
        assert cache.prefix_stats["cached_blocks"] == 0
        assert cache.free_blocks == NUM_BLOCKS - 4
        index = manifest(where)["prefix"]
        assert len(index["foreign_roots"]) == 1 and len(index["entries"]) == 2
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=A + [1], max_tokens=16)
        assert cached == 0 and not set(cache.block_tables[0].tolist()) & set(a_blocks[:2])
        assert_kv(cache, state, 1, B)
        state = cache.release(state, 0)
        cache.close(state)
    with make(where, prefix_salt="weights-1") as cache:  # Its own root again: hits.
        assert cache.prefix_stats["indexed_blocks"] == 2
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=A + [1], max_tokens=16)
        assert cached == 8
        np.testing.assert_array_equal(cache.block_tables[0, :2], a_blocks[:2])
        assert_kv(cache, state, 0, A[:8])
        cache.close(state)


def test_another_model_id_never_attaches(where):
    shared_session(where)
    with pytest.raises(persistence.LayoutMismatchError, match="model_id"):
        make(where, model_id="other")


# -- manifests whose index does not add up ------------------------------------------------------


def _set_entry(i, field, value):
    def edit(m, a, b):
        m["prefix"]["entries"][i][field] = value(a, b) if callable(value) else value

    return edit


def _set_prefix(field, value):
    def edit(m, a, b):
        m["prefix"][field] = value

    return edit


def _set_table(b, i, value):
    def edit(m, a_blocks, b_blocks):
        m["block_tables"][b][i] = value(a_blocks, b_blocks)

    return edit


def _swap_shared(m, a, b):
    row = m["block_tables"][1]
    row[0], row[1] = row[1], row[0]


def _no_prefix(m, a, b):
    del m["prefix"]


# Entries are recorded A's tail first: entries[0] is a_blocks[2], [1] a_blocks[1], [2] a_blocks[0].
BAD_INDEXES = {
    "block_out_of_range": (
        _set_entry(0, "block", NUM_BLOCKS),
        r"prefix.entries\[0\].block = 24 is not a block id in \[0, num_blocks=24\)",
    ),
    "block_indexed_twice": (
        _set_entry(0, "block", lambda a, b: a[1]),
        r"block {a1} is indexed twice \(prefix.entries\[0\] and prefix.entries\[1\]\)",
    ),
    "tokens_changed": (
        _set_entry(1, "tokens", [104, 105, 106, 999]),
        r"prefix.entries\[1\].key does not match its parent and tokens .*block {a1}'s tokens",
    ),
    "tokens_short": (
        _set_entry(0, "tokens", [1, 2, 3]),
        r"prefix.entries\[0\].tokens must have shape \[4\]",
    ),
    "tokens_not_int": (
        _set_entry(2, "tokens", [100, 101.5, 102, 103]),
        r"prefix.entries\[2\].tokens\[1\] is 101.5, not an int",
    ),
    "parent_unknown": (
        _set_entry(0, "parent", "ab" * 16),
        r"prefix.entries\[0\].parent abab.* is neither an indexed key nor a root",
    ),
    "key_not_hex": (
        _set_entry(0, "key", "xyz"),
        r"prefix.entries\[0\].key is 'xyz', not a 128-bit digest",
    ),
    "checksums_shape": (
        _set_entry(0, "checksums", [["0" * 16, "0" * 16]]),
        r"prefix.entries\[0\].checksums are not \[layer\]\[K\|V\] hex digests",
    ),
    "root": (_set_prefix("root", 5), r"prefix.root is 5, not a 128-bit digest"),
    "algorithm": (_set_prefix("checksum", "md5"), r"prefix.checksum is 'md5'"),
    "no_prefix": (_no_prefix, "no 'prefix'"),
    "shared_shape": (_set_prefix("shared", [0, 2]), r"prefix.shared must have shape \[3\]"),
    "shared_over_a_free_entry": (
        _set_prefix("shared", [0, 2, 1]),
        r"sequence 2's shared prefix covers table entry 0, which holds no block",
    ),
    "shared_not_indexed": (
        _set_prefix("shared", [0, 3, 0]),
        r"sequence 1 maps block {b2} \(table entry 2\) as shared, but no prefix entry indexes it",
    ),
    "indexed_block_held_privately": (
        _set_prefix("shared", [0, 1, 0]),
        r"block {a1} is indexed \(prefix.entries\[1\]\) but sequence 1 holds it as a private "
        r"block \(table entry 1, past its shared prefix of 1 blocks\)",
    ),
    "shared_not_a_chain": (
        _swap_shared,
        r"sequence 1's shared prefix starts at block {a1}, which is not the first block",
    ),
    "private_block_held_by_two": (
        _set_table(1, 2, lambda a, b: b[3]),
        r"block {b3} is held twice \(by sequence 1 and sequence 1\)",
    ),
    "private_block_also_shared_elsewhere": (
        _set_table(1, 3, lambda a, b: a[2]),
        r"block {a2} is indexed \(prefix.entries\[0\]\) but sequence 1 holds it as a private",
    ),
    "length_below_shared": (
        lambda m, a, b: m["lengths"].__setitem__(1, 5),
        r"lengths\[1\] = 5 is below sequence 1's shared prefix of 8 tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_an_inconsistent_index_is_refused(where, case):
    edit, message = BAD_INDEXES[case]
    a_blocks, b_blocks = shared_session(where)
    message = message.format(a1=a_blocks[1], a2=a_blocks[2], b2=b_blocks[2], b3=b_blocks[3])
    good = manifest_path(where).read_text()
    m = json.loads(good)
    edit(m, a_blocks, b_blocks)
    manifest_path(where).write_text(json.dumps(m))
    with pytest.raises(persistence.MissingManifestError, match=message) as info:
        make(where)
    assert f"cannot use manifest {manifest_path(where)}" in str(info.value)
    manifest_path(where).write_text(good)  # The refused open changed nothing.
    with make(where) as cache:
        assert cache.prefix_stats["indexed_blocks"] == 3


def test_a_version_1_manifest_attaches_with_an_empty_index(where):
    with make(where) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, max_tokens=8)
        state = prefill(cache, state, 1, PROMPT[:6], 0)
        cache.close(state)
    m = manifest(where)
    m["format_version"] = 1
    del m["prefix"]
    manifest_path(where).write_text(json.dumps(m))
    with make(where) as cache:
        assert cache.prefix_stats["indexed_blocks"] == 0
        state = cache.init()
        assert_kv(cache, state, 1, PROMPT[:6])
        cache.close(state)
    assert manifest(where)["format_version"] == persistence.MANIFEST_VERSION


# -- crashes ------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp
    import numpy as np
    from support import load_module
    t = load_module({test_file!r})
    from jax_tpusync.persist import commit as persistence
    import jax_tpusync as tps
    persistence.CHUNK_TARGET_BYTES = t.CHUNK_ROWS * t.ROW_BYTES
    where = dict(tier="file", path={path!r}, file_name="kv")
    cache = t.make(where)
    state = cache.init(admit=False)
    state, _, a_blocks = t.serve(cache, state, 0, t.A, 12)
    # Slot 1 maps A's first two blocks and decodes on past its commit.
    state, cached, b_blocks = t.serve(cache, state, 1, t.B, 16, release=False)
    state = cache.commit(state)
    np.save({out!r} + "/a_blocks.npy", np.asarray(a_blocks))
    np.save({out!r} + "/b_blocks.npy", np.asarray(b_blocks))
    np.save({out!r} + "/commit.npy", np.asarray(cache.persistence.commit_number))
    # Published after the commit: C's blocks, and its tail freed for slot 2.
    c = list(range(300, 312))
    state, _, c_blocks = t.serve(cache, state, 0, c, 16)
    np.save({out!r} + "/c_blocks.npy", np.asarray(c_blocks))
    state, _ = cache.admit(state, 2, max_tokens=8)
    mode = {mode!r}
    if mode == "commit":
        # Killed inside the commit that would index C: after it hashed C's blocks, before
        # the manifest is replaced.
        def kill(stage):
            os.kill(os.getpid(), 9)
        persistence.fault_hook = kill
        cache.commit(state)
    else:
        # Killed with decode write-backs in flight (slots 1 and 2 write their own blocks).
        def step(x, state):
            for layer in range(t.LAYERS):
                q = jnp.broadcast_to(x[:, :, None, :], (t.BATCH, 1, t.Q_HEADS, t.HEAD_DIM))
                _, state = tps.prefetching_attention(
                    q, q[:, :, : t.KV_HEADS], q[:, :, : t.KV_HEADS], state, layer=layer
                )
            return state
        step = jax.jit(step, donate_argnums=(1,))
        x = jnp.ones((t.BATCH, 1, t.HEAD_DIM), jnp.float32)
        for _ in range(3):
            state = step(x, state)
        os.kill(os.getpid(), 9)
    """
)


@pytest.mark.parametrize("mode", ["commit", "decode"])
def test_a_sigkill_before_the_commit_reopens_to_the_last_commit(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    script = CHILD.format(
        test_file=__file__, path=str(data), out=str(out), mode=mode
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=child_env(),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    a_blocks = np.load(out / "a_blocks.npy").tolist()
    b_blocks = np.load(out / "b_blocks.npy").tolist()
    c_blocks = np.load(out / "c_blocks.npy").tolist()
    where = dict(tier="file", path=data, file_name="kv")
    m = manifest(where)
    assert m["commit"] == int(np.load(out / "commit.npy"))
    # Only what the last commit indexed: A's blocks, none of C's.
    assert sorted(e["block"] for e in m["prefix"]["entries"]) == sorted(a_blocks)
    with make(where) as cache:  # verify=True: every indexed block checks out.
        assert cache.prefix_stats["indexed_blocks"] == 3
        assert cache.prefix_stats["cached_blocks"] == 1
        # A's 3 and slot 1's own 2 are held; C's blocks and slot 2's are free again.
        assert cache.free_blocks == NUM_BLOCKS - 5
        assert not set(c_blocks) & (set(a_blocks) | set(b_blocks))
        np.testing.assert_array_equal(cache.committed_lengths, [0, 13, 0])
        state = cache.init(admit=False)
        assert_kv(cache, state, 1, B)
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 0, tokens=list(range(300, 312)) + [1], max_tokens=16)
        assert cached == 0  # C was never committed.
        state, cached = cache.admit(state, 2, tokens=A + [1], max_tokens=16)
        assert cached == 12
        np.testing.assert_array_equal(cache.block_tables[2, :3], a_blocks)
        assert_kv(cache, state, 2, A)
        cache.close(state)
