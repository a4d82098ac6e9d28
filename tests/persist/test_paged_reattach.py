"""Persistence of a paged cache: block tables and capacities survive a re-attach, checksums
follow a sequence's blocks, and a manifest whose tables are inconsistent is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import blocks
from jax_tpusync.persist import commit as persistence
from jax_tpusync.persist import manifest

from support.tier_files import data_path, manifest_path

LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM, Q_HEADS = 2, 3, 64, 2, 16, 4
BLOCK_TOKENS, NUM_BLOCKS = 8, 16  # 8 blocks would hold a slot at max_len; 16 hold two.
ROW_BYTES = KV_HEADS * HEAD_DIM * 4
CHUNK_ROWS = 6  # Chunks that straddle block boundaries (and fragment boundaries).
HEADER_BYTES = 4096  # The tiers' header page, before the data.

# admit(1, 20), admit(0, 40), admit(2, 16), release(1), admit(1, 64) on 16 blocks: slot 1
# takes what slot 0 and 2 left, in two runs.
CAPACITY = [40, 64, 16]
TABLES = [
    [3, 4, 5, 6, 7, -1, -1, -1],
    [0, 1, 2, 10, 11, 12, 13, 14],
    [8, 9, -1, -1, -1, -1, -1, -1],
]
CONTEXT = np.array([35, 58, 10])
STEPS = 3  # Decode steps after the context; slot 1 then ends at 61 of 64.


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
        block_tokens=BLOCK_TOKENS,
        num_blocks=NUM_BLOCKS,
        staging_bytes=1 << 20,
    )
    args.update(where)
    args.update(kwargs)
    return tps.OffloadedKVCache(**args)


def fragmented_state(cache):
    """Admits the slots of TABLES / CAPACITY (slot 1 released and re-admitted)."""
    state = cache.init(admit=False)
    state, cached = cache.admit(state, 1, max_tokens=20)
    assert cached == 0
    state, _ = cache.admit(state, 0, max_tokens=40)
    state, _ = cache.admit(state, 2, max_tokens=16)
    state = cache.release(state, 1)
    state, _ = cache.admit(state, 1, max_tokens=64)
    np.testing.assert_array_equal(cache.block_tables, TABLES)
    np.testing.assert_array_equal(cache.capacity, CAPACITY)
    return state


def random_kv(rng, n):
    shape = (LAYERS, BATCH, n, KV_HEADS, HEAD_DIM)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(
        np.float32
    )


def load(cache, state, k, v, lengths, start=0):
    for layer in range(LAYERS):
        state = cache.load(state, layer, k[layer], v[layer], start=start, lengths=lengths)
    return state


def _step(q, k, v, state):
    outs = []
    for layer in range(LAYERS):
        o, state = tps.prefetching_attention(q[layer], k[layer], v[layer], state, layer=layer)
        outs.append(o)
    return jnp.stack(outs), state


# One decode step over every layer, compiled once for every cache of this module's geometry.
decode_step = jax.jit(_step, donate_argnums=(3,))


def loaded_cache(where, rng):
    """A fragmented cache with a loaded context, committed and closed; returns K, V."""
    with make(where) as cache:
        state = fragmented_state(cache)
        k, v = random_kv(rng, int(CONTEXT.max()))
        cache.close(load(cache, state, k, v, CONTEXT))
    return k, v


def decoded_cache(where, rng):
    """A fragmented cache with a loaded context and STEPS decoded rows, committed and
    closed; returns the expected K and V, [L, B, max_len, H, D] (zero past each length)."""
    want_k = np.zeros((LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM), np.float32)
    want_v = np.zeros_like(want_k)
    step = decode_step
    with make(where) as cache:
        state = fragmented_state(cache)
        k, v = random_kv(rng, int(CONTEXT.max()))
        state = load(cache, state, k, v, CONTEXT)
        for b in range(BATCH):
            want_k[:, b, : CONTEXT[b]] = k[:, b, : CONTEXT[b]]
            want_v[:, b, : CONTEXT[b]] = v[:, b, : CONTEXT[b]]
        state = cache.commit(state)
        for i in range(STEPS):
            q = rng.standard_normal((LAYERS, BATCH, 1, Q_HEADS, HEAD_DIM)).astype(np.float32)
            nk, nv = random_kv(rng, 1)
            _, state = step(q, nk, nv, state)
            state = cache.commit(state)  # Incremental checksums across fragments.
            for b in range(BATCH):
                want_k[:, b, CONTEXT[b] + i] = nk[:, b, 0]
                want_v[:, b, CONTEXT[b] + i] = nv[:, b, 0]
        np.testing.assert_array_equal(np.asarray(state.lengths), CONTEXT + STEPS)
        cache.close(state)
    return want_k, want_v


def flip_byte(where, cache, layer, kv, b, pos, byte=0):
    """Flips a byte of position ``pos`` of sequence ``b`` in the tier's backing file."""
    shift = cache.engine.tier_info(cache.tier).alignment_offset if where["tier"] == "file" else 0
    ((tier_offset, _),) = cache.tier_rows(layer, kv, b, pos, pos + 1)
    offset = HEADER_BYTES + shift + tier_offset + byte
    with open(data_path(where), "r+b") as f:
        f.seek(offset)
        (old,) = f.read(1)
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


# -- re-attach ------------------------------------------------------------------------------


def test_reattach_restores_tables_capacity_and_kv(where):
    want_k, want_v = decoded_cache(where, np.random.default_rng(0))
    lengths = CONTEXT + STEPS
    m = json.loads(manifest_path(where).read_text())
    assert m["block_tables"] == TABLES and m["capacity"] == CAPACITY
    assert m["lengths"] == lengths.tolist()
    assert m["geometry"]["block_tokens"] == BLOCK_TOKENS
    assert m["geometry"]["num_blocks"] == NUM_BLOCKS
    with make(where) as cache:  # verify=True: every committed chunk is checked on open.
        np.testing.assert_array_equal(cache.block_tables, TABLES)
        np.testing.assert_array_equal(cache.capacity, CAPACITY)
        np.testing.assert_array_equal(cache.committed_lengths, lengths)
        assert cache.free_blocks == NUM_BLOCKS - 15
        state = cache.init()  # Every slot is active: nothing is admitted.
        np.testing.assert_array_equal(np.asarray(state.lengths), lengths)
        np.testing.assert_array_equal(np.asarray(state.block_table), TABLES)
        np.testing.assert_array_equal(np.asarray(state.capacity), CAPACITY)
        for layer in range(LAYERS):
            got_k, got_v = cache.read_all(layer, lengths)
            np.testing.assert_array_equal(got_k, want_k[layer])
            np.testing.assert_array_equal(got_v, want_v[layer])
            for b in range(BATCH):
                k, v = cache.read(state, layer, b)
                np.testing.assert_array_equal(k, want_k[layer, b, : lengths[b]])
                np.testing.assert_array_equal(v, want_v[layer, b, : lengths[b]])
            k, v = cache.read(state, layer, 1, 20, 30)  # Across the two runs of slot 1.
            np.testing.assert_array_equal(k, want_k[layer, 1, 20:30])
            np.testing.assert_array_equal(v, want_v[layer, 1, 20:30])
        result = cache.verify(state)
        assert result.chunks == LAYERS * 2 * sum(-(-int(n) // CHUNK_ROWS) for n in lengths)
        assert result.bytes == LAYERS * 2 * int(lengths.sum()) * ROW_BYTES
        # The restored cache decodes on and commits again.
        q = np.zeros((LAYERS, BATCH, 1, Q_HEADS, HEAD_DIM), np.float32)
        nk, nv = random_kv(np.random.default_rng(1), 1)
        _, state = decode_step(q, nk, nv, state)
        cache.close(state)
    with make(where) as cache:
        np.testing.assert_array_equal(cache.committed_lengths, lengths + 1)
        k, _ = cache.read_all(1, lengths + 1)
        np.testing.assert_array_equal(k[np.arange(BATCH), lengths], nk[1, :, 0])


def test_admit_after_reattach_gets_only_free_blocks(where):
    rng = np.random.default_rng(2)
    with make(where) as cache:
        state = fragmented_state(cache)
        k, v = random_kv(rng, int(CONTEXT.max()))
        state = load(cache, state, k, v, CONTEXT * [1, 1, 0])
        state = cache.release(state, 2)  # Slot 2 inactive at the commit: blocks 8, 9 free.
        cache.close(state)
    m = json.loads(manifest_path(where).read_text())
    assert m["block_tables"][2] == [-1] * 8 and m["capacity"] == [40, 64, 0]
    with make(where) as cache:
        assert cache.free_blocks == 3
        held = set(cache.block_tables[:2].ravel()) - {-1}
        state = cache.init(admit=False)
        with pytest.raises(ValueError, match="needs 4 KV blocks but only 3"):
            cache.admit(state, 2, max_tokens=32)
        state, _ = cache.admit(state, 2, max_tokens=24)
        got = set(cache.block_tables[2, :3].tolist())
        assert got == {8, 9, 15} and not got & held
        rows = rng.standard_normal((LAYERS, BATCH, 24, KV_HEADS, HEAD_DIM)).astype(np.float32)
        state = load(cache, state, rows, rows, [0, 0, 24])
        for layer in range(LAYERS):  # The new slot's rows landed in its own blocks only.
            got_k, got_v = cache.read_all(layer)
            np.testing.assert_array_equal(got_k[0, :35], k[layer, 0, :35])
            np.testing.assert_array_equal(got_v[1, :58], v[layer, 1, :58])
            np.testing.assert_array_equal(got_k[2, :24], rows[layer, 2])
        state = cache.commit(state)
        cache.verify(state)
        cache.close(state)
    with make(where) as cache:
        np.testing.assert_array_equal(cache.capacity, [40, 64, 24])
        assert cache.free_blocks == 0


def test_init_admits_the_slots_a_reattached_cache_left_inactive(where):
    with make(where, num_blocks=24) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, max_tokens=10)
        cache.close(cache.commit(state))
    with make(where, num_blocks=24) as cache:
        np.testing.assert_array_equal(cache.capacity, [0, 10, 0])
        cache.init()  # Slots 0 and 2 at max_len, from the blocks slot 1 leaves free.
        np.testing.assert_array_equal(cache.capacity, [MAX_LEN, 10, MAX_LEN])
        tables = cache.block_tables
        assert tables[1, :2].tolist() == [0, 1]
        ids = tables[tables >= 0]
        assert len(ids) == 18 and len(set(ids.tolist())) == 18


def test_the_first_init_after_a_reattach_refuses_rows_past_the_commit(where):
    """Rows the crashed process loaded past its last commit are on the tier but were never
    committed: the first init() takes each slot's committed length, not one row more (a
    refused init changes nothing); later inits are this process's own."""
    rng = np.random.default_rng(3)
    k, v = random_kv(rng, 11)
    with make(where) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=16)
        state = load(cache, state, k[:, :, :9], v[:, :, :9], [9, 0, 0])
        state = cache.commit(state)
        state = load(cache, state, k[:, :, 9:], v[:, :, 9:], [2, 0, 0], start=[9, 0, 0])
        cache.close()  # Without a state: the rows past 9 are not committed.
    with make(where) as cache:
        np.testing.assert_array_equal(cache.committed_lengths, [9, 0, 0])
        with pytest.raises(ValueError, match=r"lengths\[0\]=10 is past slot 0's committed length 9"):
            cache.init([10, 0, 0], admit=False)
        np.testing.assert_array_equal(cache.capacity, [16, 0, 0])
        state = cache.init([9, 0, 0], admit=False)
        got_k, _ = cache.read(state, 0, 0)
        np.testing.assert_array_equal(got_k, k[0, 0, :9])
        state = load(cache, state, k[:, :, 9:], v[:, :, 9:], [2, 0, 0], start=[9, 0, 0])
        state = cache.init([11, 0, 0], admit=False)  # Rows this process wrote.
        np.testing.assert_array_equal(cache.read(state, 1, 0)[1], v[1, 0, :11])


def test_release_commits_the_slot_released_first(where):
    """A released slot's blocks go to another sequence: a crash after it overwrote them
    must not leave a manifest whose checksums cover the old rows there."""
    rng = np.random.default_rng(3)
    with make(where) as cache:
        state = fragmented_state(cache)
        k, v = random_kv(rng, int(CONTEXT.max()))
        state = load(cache, state, k, v, CONTEXT)
        state = cache.commit(state)
        assert json.loads(manifest_path(where).read_text())["commit"] == 1
        state = cache.release(state, 2)
        m = json.loads(manifest_path(where).read_text())
        assert m["commit"] == 2 and m["lengths"] == [35, 58, 0]
        assert m["block_tables"][2] == [-1] * 8 and m["capacity"] == [40, 64, 0]
        state, _ = cache.admit(state, 2, max_tokens=16)  # Blocks 8 and 9 again.
        assert cache.block_tables[2, :2].tolist() == [8, 9]
        ones = np.ones((LAYERS, BATCH, 16, KV_HEADS, HEAD_DIM), np.float32)
        state = load(cache, state, ones, ones, [0, 0, 16])
        cache.close()  # A crash: no final commit.
    with make(where) as cache:  # verify=True passes: commit 2 names no row in blocks 8, 9.
        np.testing.assert_array_equal(cache.committed_lengths, [35, 58, 0])
        np.testing.assert_array_equal(cache.capacity, [40, 64, 0])


def test_release_that_cannot_commit_keeps_the_slot(where, monkeypatch):
    with make(where) as cache:
        state = fragmented_state(cache)
        k, v = random_kv(np.random.default_rng(4), int(CONTEXT.max()))
        state = cache.commit(load(cache, state, k, v, CONTEXT))

        def fail(stage):
            raise OSError(28, f"No space left on device (at {stage})")

        monkeypatch.setattr(persistence, "fault_hook", fail)
        with pytest.raises(persistence.CommitError, match="No space left"):
            cache.release(state, 0)
        np.testing.assert_array_equal(cache.capacity, CAPACITY)
        np.testing.assert_array_equal(cache.block_tables, TABLES)
        monkeypatch.setattr(persistence, "fault_hook", None)


# -- checksums through the tables -----------------------------------------------------------


@pytest.mark.parametrize(
    "layer,kv,b,pos",
    [
        (1, 1, 1, 30),  # Slot 1's second run (block 10).
        (0, 0, 1, 23),  # The last row of slot 1's first run (block 2).
        (1, 0, 0, 36),  # A row decode appended (block 7).
        (0, 1, 2, 12),  # The last committed row of slot 2 (block 9).
    ],
)
def test_corrupt_committed_block_names_the_slot(where, layer, kv, b, pos):
    decoded_cache(where, np.random.default_rng(5))
    length = int(CONTEXT[b] + STEPS)
    lo = pos // CHUNK_ROWS * CHUNK_ROWS
    hi = min(lo + CHUNK_ROWS, length)
    name = f"layer {layer} {'KV'[kv]} sequence {b}, rows \\[{lo}, {hi}\\)"
    with make(where, verify=False) as cache:
        cache.verify()
        flip_byte(where, cache, layer, kv, b, pos, byte=ROW_BYTES - 1)
        with pytest.raises(persistence.ChecksumMismatchError, match=name) as info:
            cache.verify()
        assert (info.value.layer, info.value.kv, info.value.sequence) == (layer, "KV"[kv], b)
        assert info.value.rows == (lo, hi)
    with pytest.raises(persistence.ChecksumMismatchError, match=name):
        make(where)  # verify=True on re-attach.


def test_bytes_outside_committed_rows_are_not_checked(where):
    decoded_cache(where, np.random.default_rng(6))
    with make(where, verify=False) as cache:
        flip_byte(where, cache, 0, 0, 2, CONTEXT[2] + STEPS)  # Slot 2's first free row.
        flip_byte(where, cache, 1, 1, 0, CAPACITY[0] - 1)  # Slot 0's last reserved row.
        cache.verify()
    make(where).close()


def test_verify_refuses_a_slot_whose_blocks_moved_without_a_commit(where):
    decoded_cache(where, np.random.default_rng(7))
    with make(where) as cache:
        cache.slots._tables[[0, 2]] = cache.slots._tables[[2, 0]]  # Behind the manifest's back.
        with pytest.raises(
            persistence.PersistenceError,
            match=r"sequence 0 no longer holds the KV blocks commit 5 recorded .*commit first",
        ):
            cache.verify()


def test_commit_past_a_slot_capacity_is_refused(where):
    with make(where) as cache:
        state = fragmented_state(cache)
        with pytest.raises(
            persistence.CommitError, match=r"sequence 2's length 17 is not in \[0, 16\]"
        ):
            cache.persistence.commit([0, 0, 17])
        cache.close(state)
    assert json.loads(manifest_path(where).read_text())["commit"] == 1


def test_a_restore_over_held_blocks_changes_nothing(where):
    with make(where) as cache:
        fragmented_state(cache)
        tables = np.full((BATCH, 8), -1, np.int32)
        tables[0, :2] = [15, 3]  # Block 15 is free, block 3 is held by slot 0.
        with pytest.raises(ValueError, match="block 3 is not free"):
            cache.slots.restore(tables, [16, 0, 0])
        np.testing.assert_array_equal(cache.block_tables, TABLES)
        assert cache.free_blocks == 1


# -- geometry ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,changes,held,have",
    [
        ("block_tokens", dict(block_tokens=16), BLOCK_TOKENS, 16),
        ("num_blocks", dict(num_blocks=24), NUM_BLOCKS, 24),
        ("max_len", dict(max_len=2 * MAX_LEN), MAX_LEN, 2 * MAX_LEN),
    ],
)
def test_paging_geometry_mismatch_names_the_field(where, field, changes, held, have):
    loaded_cache(where, np.random.default_rng(8))
    with pytest.raises(persistence.LayoutMismatchError) as info:
        make(where, **changes)
    message = str(info.value).split("does not belong to this cache: ")[1]
    assert message.startswith(f"{field}: the tier holds {held}, this cache has {have}.")
    make(where).close()  # The refused open changed nothing.


# -- manifests whose tables do not add up ---------------------------------------------------


def _set(path, value):
    def edit(m):
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _drop(key):
    def edit(m):
        del m[key]

    return edit


BAD_MANIFESTS = {
    "no_tables": (_drop("block_tables"), "no 'block_tables'"),
    "no_capacity": (_drop("capacity"), "no 'capacity'"),
    "tables_rows": (
        _set(["block_tables"], TABLES[:2]),
        r"block_tables must have shape \[3, 8\]; block_tables has 2 entries, not 3",
    ),
    "table_row_length": (
        _set(["block_tables", 2], [8, 9]),
        r"block_tables must have shape \[3, 8\]; block_tables\[2\] has 2 entries, not 8",
    ),
    "table_not_int": (
        _set(["block_tables", 0, 1], 4.0),
        r"block_tables\[0\]\[1\] is 4.0, not an int",
    ),
    "id_out_of_range": (
        _set(["block_tables", 1, 7], 16),
        r"block_tables\[1\]\[7\] = 16 is not a block id \(-1 or in \[0, num_blocks=16\)\)",
    ),
    "negative_id": (
        _set(["block_tables", 1, 0], -2),
        r"block_tables\[1\]\[0\] = -2 is not a block id",
    ),
    "held_twice": (
        _set(["block_tables", 2, 1], 4),
        "block 4 is held twice \\(by sequence 0 and sequence 2\\)",
    ),
    "capacity_too_small_for_blocks": (
        _set(["capacity", 2], 8),
        r"sequence 2's capacity of 8 tokens needs blocks in exactly its first 1 table "
        r"entries, but its table row is \[8, 9, -1",
    ),
    "capacity_without_blocks": (
        _set(["capacity", 0], 48),
        r"sequence 0's capacity of 48 tokens needs blocks in exactly its first 6",
    ),
    "capacity_past_max_len": (
        _set(["capacity", 1], 65),
        r"capacity\[1\] = 65 is not in \[0, max_len=64\]",
    ),
    "capacity_not_int": (_set(["capacity", 1], "64"), r"capacity\[1\] is '64', not an int"),
    "length_past_capacity": (
        _set(["lengths", 2], 17),
        r"lengths\[2\] = 17 is not in \[0, 16\] \(sequence 2's capacity\)",
    ),
    "lengths_shape": (_set(["lengths"], [1, 2]), r"lengths must have shape \[3\]"),
    "commit": (_set(["commit"], -1), "commit is -1, not an int >= 0"),
    "chunk_rows": (_set(["checksum", "chunk_rows"], 0), "checksum.chunk_rows is 0"),
    "algorithm": (_set(["checksum", "algorithm"], "md5"), "checksum.algorithm is 'md5'"),
    "checksum_count": (
        _set(["checksums", 1, 0, 2], ["0" * 16]),
        r"layer 1 K sequence 2 has 1 checksums for 10 rows of 6-row chunks \(2\)",
    ),
    "checksum_text": (
        _set(["checksums", 0, 1, 0, 0], "not hex"),
        r"checksums are not \[layer\]\[K\|V\]\[sequence\] hex lists",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_inconsistent_manifest_is_refused(where, case):
    edit, message = BAD_MANIFESTS[case]
    loaded_cache(where, np.random.default_rng(9))
    good = manifest_path(where).read_text()
    m = json.loads(good)
    edit(m)
    manifest_path(where).write_text(json.dumps(m))
    with pytest.raises(persistence.MissingManifestError, match=message) as info:
        make(where)
    assert f"cannot use manifest {manifest_path(where)}" in str(info.value)
    assert "overwrite=True" in str(info.value)
    manifest_path(where).write_text(good)  # The refused open changed nothing.
    with make(where) as cache:
        np.testing.assert_array_equal(cache.block_tables, TABLES)


def test_manifest_without_paging_geometry_is_refused():
    """A geometry without block_tokens (prepare cannot tell: the cache did not say) is
    refused by the commit check."""
    held = persistence.Geometry.of(LAYERS, BATCH, MAX_LEN, KV_HEADS, HEAD_DIM, "float32", None)
    with pytest.raises(
        persistence.MissingManifestError, match="geometry.block_tokens is None, not a positive int"
    ):
        manifest.checked_commit({}, held, Path("m.json"))


# -- the allocator's reserve ----------------------------------------------------------------


def test_reserve_takes_exactly_the_given_ids():
    a = blocks.BlockAllocator(10)
    a.reserve([0, 1, 2, 7, 5])
    assert a.free_blocks == 5 and a._free == [(3, 2), (6, 1), (8, 2)]
    assert a.allocate(3).tolist() == [3, 4, 6]  # No extent holds 3: first fit over several.
    a.reserve([])
    a.free([0, 1, 2, 3, 4, 5, 6, 7])
    assert a._free == [(0, 10)]


@pytest.mark.parametrize(
    "ids,message",
    [
        ([3, 3], "block 3 is given twice"),
        ([10], r"block 10 is out of range \[0, 10\)"),
        ([-1, 4], r"block -1 is out of range \[0, 10\)"),
        ([2], "block 2 is not free"),  # Inside an allocated run.
        ([6, 7, 8], "block 8 is not free"),  # A run whose end is allocated.
        ([0, 9], "block 0 is not free"),
    ],
)
def test_reserve_refuses_ids_that_are_not_free(ids, message):
    a = blocks.BlockAllocator(10)
    a.allocate(3)  # 0, 1, 2
    a.reserve([8])
    before = list(a._free)
    with pytest.raises(ValueError, match=message):
        a.reserve(ids)
    assert a._free == before  # All or nothing.
