"""The slot table alone: block tables, capacities, the prefix index and the eviction policy,
with no engine and no step. Hand-checked cases at the edges, fakes of the remote level and
the block store, and a state machine against a plain Python model."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jax_tpusync.core import prefix
from jax_tpusync.core.levels import InPlaceLoad
from jax_tpusync.core.slots import SlotTable

BT = 4
ROOT = prefix.root_key("slot-table-tests", dict(block_tokens=BT))


def make_table(**kw) -> SlotTable:
    args = dict(batch=4, max_len=32, block_tokens=BT, num_blocks=16, root=ROOT)
    args.update(kw)
    return SlotTable(**args)


def snapshot(t: SlotTable) -> dict:
    """Everything a refused call must leave as it was."""
    entries = sorted((e.key, e.block, e.refs) for e in t.prefix.entries_in_order())
    return dict(
        tables=t.tables.tolist(),
        capacity=t.capacity.tolist(),
        shared=t.shared.tolist(),
        free_blocks=t.free_blocks,
        stats=t.stats(),
        entries=entries,
        publish_failures=t.publish_failures,
    )


def seq(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def released(t: SlotTable, slot: int, tokens: list[int], capacity: int | None = None) -> None:
    """Admits ``slot`` for ``tokens`` and releases it holding all of them (its full blocks
    enter the index, cached)."""
    t.admit(slot, capacity or max(len(tokens), 1), tokens)
    t.release(slot, len(tokens), tokens)


# -- (a) hand-checked -------------------------------------------------------------------------


def test_admit_maps_a_released_prefix_in_whole_blocks_short_of_the_last_token():
    t = make_table()
    t.admit(0, 16, seq(12))
    blocks_of_0 = t.table_row(0)[:3].tolist()
    t.release(0, 12, seq(12))  # 3 full blocks indexed, cached; the 4th freed.
    assert t.stats()["indexed_blocks"] == 3 and t.stats()["cached_blocks"] == 3
    assert t.free_blocks == 16 - 3
    # (n tokens, tokens mapped): at most n - 1 tokens, in whole blocks.
    for slot, (n, want) in enumerate([(12, 8), (13, 12), (9, 8), (8, 4)]):
        a = t.admit(slot, 16, seq(n))
        assert (a.slot, a.cached, a.capacity) == (slot, want, 16)
        assert t.shared_tokens(slot) == want
        assert t.table_row(slot)[: want // BT].tolist() == blocks_of_0[: want // BT]
        # The rest are fresh blocks, not indexed.
        fresh = t.table_row(slot)[want // BT : 4]
        assert all(not t.prefix.is_indexed(int(b)) for b in fresh)
    # Four slots map block 0: pinned four times, never cached.
    assert t.prefix.refs(blocks_of_0[0]) == 4 and t.stats()["cached_blocks"] == 0
    assert t.stats()["hits"] == 2 + 3 + 2 + 1


def test_a_diverging_block_ends_the_match():
    t = make_table()
    released(t, 0, seq(16))
    tokens = seq(16)
    tokens[5] = 999  # Block 1 differs: only block 0 matches.
    assert t.admit(1, 16, tokens).cached == 4
    assert t.admit(2, 16, [7] + seq(15, 1)).cached == 0  # Block 0 differs.
    assert t.admit(3, 16, None).cached == 0


def test_max_cached_caps_the_mapped_prefix():
    t = make_table()
    released(t, 0, seq(16))
    for slot, (cap, want) in enumerate([(None, 12), (8, 8), (7, 4), (3, 0)]):
        assert t.admit(slot, 16, seq(16), max_cached=cap).cached == want
        assert t.shared_tokens(slot) == want


def test_cached_blocks_are_evicted_lru_only_when_free_blocks_run_short():
    t = make_table(batch=5, max_len=16, num_blocks=8)
    released(t, 0, seq(8), capacity=8)  # Sequence A: blocks 0, 1 cached.
    released(t, 0, seq(8, 100), capacity=8)  # Sequence B: blocks 2, 3 cached.
    assert t.stats()["cached_blocks"] == 4 and t.free_blocks == 4
    t.admit(1, 16)  # Exactly the 4 free blocks: nothing evicted.
    assert t.table_row(1).tolist() == [4, 5, 6, 7]
    assert t.stats()["evictions"] == 0 and t.stats()["cached_blocks"] == 4
    # One short: A's last block goes first (least recently used sequence, its tail first).
    t.admit(2, 4)
    assert t.table_row(2)[:1].tolist() == [1]
    assert t.stats()["evictions"] == 1 and t.prefix.is_indexed(0)
    # B mapped (its blocks pinned): the fresh block needed evicts A's head, not B's.
    assert t.admit(3, 12, seq(9, 100)).cached == 8
    assert t.table_row(3)[:3].tolist() == [2, 3, 0]
    assert t.stats()["evictions"] == 2 and t.stats()["cached_blocks"] == 0
    # Nothing left but mapped blocks: refused, naming it, and no mapped block is evicted.
    before = snapshot(t)
    with pytest.raises(
        ValueError, match="needs 1 KV blocks but only 0 of 8 are free and none is left to evict"
    ):
        t.admit(4, 4)
    assert snapshot(t) == before
    assert t.prefix.refs(2) == 1 and t.prefix.refs(3) == 1


def _crowded_table() -> SlotTable:
    """16 blocks: slots 0 and 2 hold 8 and 2, sequence A's 3 full blocks are cached, 3 are
    free."""
    t = make_table()
    released(t, 0, seq(12), capacity=16)
    t.admit(0, 32)
    t.admit(2, 8)
    assert (t.free_blocks, t.stats()["cached_blocks"]) == (3, 3)
    return t


def test_an_admission_needing_exactly_the_free_blocks_passes_one_more_refuses():
    t = _crowded_table()
    before = snapshot(t)
    with pytest.raises(
        ValueError,
        match="needs 7 KV blocks but only 3 of 16 are free and evicting all 3 cached prefix "
        "blocks would not make up the rest",
    ):
        t.admit(1, 7 * BT)  # Free 3 + cached 3 = 6 < 7: nothing may be evicted.
    assert snapshot(t) == before
    t.admit(1, 6 * BT)  # 3 free + 3 evicted: exactly enough.
    assert t.free_blocks == 0 and t.stats()["evictions"] == 3

    t = make_table(num_blocks=8)
    t.admit(0, 12)
    before = snapshot(t)
    with pytest.raises(
        ValueError, match="needs 6 KV blocks but only 5 of 8 are free and none is left"
    ):
        t.admit(1, 6 * BT)
    assert snapshot(t) == before
    t.admit(1, 5 * BT)
    assert t.free_blocks == 0


def test_a_refused_admission_that_matched_a_prefix_unpins_it_and_counts_no_hit():
    t = _crowded_table()
    before = snapshot(t)
    # Maps A's 3 blocks (pinned: no longer evictable), needs 4 fresh of 3 free.
    with pytest.raises(ValueError, match="needs 4 KV blocks but only 3 of 16 are free"):
        t.admit(1, 28, seq(13))
    assert snapshot(t) == before
    assert t.admit(1, 24, seq(13)).cached == 12  # 3 fresh: fits.
    assert t.stats()["hits"] == 3


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, 4, None), r"slot=-1 must be an int in \[0, batch=4\)"),
        ((4, 4, None), r"slot=4 must be an int"),
        ((1.0, 4, None), r"slot=1.0 must be an int"),
        ((True, 4, None), r"slot=True must be an int"),
        ((0, 4, None), r"slot 0 is active \(capacity 32 tokens\)"),
        ((1, 0, None), r"max_tokens=0 must be an int in \[1, max_len=32\]"),
        ((1, 33, None), r"max_tokens=33 must be an int in \[1, max_len=32\]"),
        ((1, 4.0, None), r"max_tokens=4.0 must be an int"),
        ((1, 4, seq(5)), r"tokens has 5 ids, more than max_tokens=4"),
        (
            (1, 8, [1, 2**63]),
            r"token id 9223372036854775808 \(tokens\[1\]\) is not in \[0, 2\*\*63",
        ),
        ((1, 8, [1, -1]), r"token id -1 \(tokens\[1\]\)"),
        ((1, 8, [[1, 2]]), r"tokens must be a 1-D sequence of ints"),
        ((1, 8, [1.0, 2.0]), r"tokens must be a 1-D sequence of ints"),
    ],
)
def test_a_refused_admission_changes_nothing(args, message):
    t = _crowded_table()
    before = snapshot(t)
    with pytest.raises(ValueError, match=message):
        t.admit(*args)
    assert snapshot(t) == before


def test_a_refused_release_changes_nothing_and_the_token_count_edge():
    t = make_table()
    t.admit(0, 16, seq(9))
    t.admit(1, 16)
    before = snapshot(t)
    with pytest.raises(ValueError, match="slot 2 is not active"):
        t.release(2, 0)
    with pytest.raises(ValueError, match="slot 2 is not active"):
        t.release(2, 0, seq(4))
    with pytest.raises(ValueError, match=r"slot=4 must be an int in \[0, batch=4\)"):
        t.release(4, 0)
    with pytest.raises(ValueError, match="tokens has 8 ids but slot 0 holds 9 tokens"):
        t.release(0, 9, seq(8))
    with pytest.raises(ValueError, match=r"token id 9223372036854775808"):
        t.release(0, 9, seq(8) + [2**63])
    assert snapshot(t) == before
    t.release(0, 9, seq(9))  # len(tokens) == length: the edge passes.
    assert not t.is_active(0) and t.stats()["cached_blocks"] == 2


def test_release_below_the_mapped_prefix_keeps_the_indexed_blocks():
    """A slot released holding fewer tokens than it maps: the mapped blocks past them are
    unpinned (indexed, cached), never freed while the index names them."""
    t = make_table()
    released(t, 0, seq(12), capacity=16)
    assert t.admit(0, 16, seq(13)).cached == 12
    t.release(0, 5, seq(5))
    s = t.stats()
    assert (s["indexed_blocks"], s["cached_blocks"]) == (3, 3)
    assert t.free_blocks == 16 - 3
    assert t.admit(1, 16, seq(13)).cached == 12  # The same blocks, intact.
    t.admit(2, 32)
    t.admit(3, 4 * BT)  # Every free block: none of them is an indexed one.
    held = t.tables[t.tables >= 0]
    assert len(set(held.tolist()) - set(t.table_row(1)[:3].tolist())) == len(held) - 3


def test_place_takes_exactly_free_blocks_or_nothing():
    t = make_table()
    released(t, 0, seq(8), capacity=8)  # Blocks 0, 1 cached.
    t.admit(1, 8)  # Blocks 2, 3.
    before = snapshot(t)
    for ids, message in [
        ([4, 2], "block 2 is not free"),  # Held by slot 1.
        ([0, 5], "block 0 is not free"),  # Cached (indexed).
        ([15, 16], r"block 16 is out of range \[0, 16\)"),
        ([5, 5], "block 5 is given twice"),
        (list(range(4, 13)), r"9 blocks given, more than a slot's table holds \(max_blocks=8\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            t.place(2, ids, 4)
        assert snapshot(t) == before
    with pytest.raises(ValueError, match=r"capacity=9 must be in \[1, 8\]"):
        t.place(2, [4, 5], 9)
    with pytest.raises(ValueError, match="slot 1 is active"):
        t.place(1, [4], 4)
    assert snapshot(t) == before
    t.place(2, [9, 4], 8)
    assert t.table_row(2)[:3].tolist() == [9, 4, -1] and t.capacity[2] == 8
    assert t.free_blocks == 16 - 6


# -- (b) a remote level and a block store, faked ----------------------------------------------

PAYLOAD = 16


class FakeStore:
    """A BlockStore: whole blocks' payloads by block id."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}

    def read_blocks(self, blocks):
        return [self.blocks.get(int(b), np.zeros(PAYLOAD, np.uint8)).copy() for b in blocks]

    def write_block(self, block, payload):
        self.blocks[int(block)] = np.array(payload, np.uint8)

    def block_memory(self, block):
        return None  # Not in memory: remote levels load through write_block.

    def quiesce(self):
        pass


class FakeRemote:
    """A RemoteLevel: published blocks by key, checked as a shared directory checks them."""

    def __init__(self, fail_load_at: int | None = None, fail_publish: bool = False):
        self.files: dict[bytes, tuple] = {}
        self.loads = 0
        self.fail_load_at = fail_load_at
        self.fail_publish = fail_publish

    def has(self, key):
        return key in self.files

    def load(self, key, parent, tokens):
        self.loads += 1
        if self.fail_load_at is not None and self.loads >= self.fail_load_at:
            raise OSError("remote level unreachable")
        found = self.files.get(key)
        if found is None or found[0] != parent or not np.array_equal(found[1], tokens):
            return None
        return found[2].copy()

    def publish(self, key, parent, tokens, payload):
        if self.fail_publish:
            raise OSError("remote level is read-only")
        if key in self.files:
            return False
        self.files[key] = (parent, np.array(tokens, np.int64), np.array(payload, np.uint8))
        return True

    def stats(self):
        return dict(fake_published=len(self.files), fake_loads=self.loads)

    def describe(self):
        return "a fake remote level"


def _payload(i: int) -> np.ndarray:
    return np.full(PAYLOAD, i + 1, np.uint8)


def _publisher(remote: FakeRemote, tokens: list[int]) -> SlotTable:
    """A table that wrote ``tokens`` (block i holding payload i) and released them."""
    store = FakeStore()
    t = make_table(store=store, remote_levels=[remote])
    t.admit(0, 16, tokens)
    for i, b in enumerate(t.table_row(0)[:4]):
        store.write_block(int(b), _payload(i))
    t.release(0, len(tokens), tokens)
    return t


def test_release_publishes_and_a_fresh_table_imports_through_the_remote_level():
    remote = FakeRemote()
    t = _publisher(remote, seq(14))
    assert len(remote.files) == 3 and t.stats()["fake_published"] == 3
    keys = t.prefix.keys(np.asarray(seq(14)))
    for i, key in enumerate(keys):
        parent, tokens, payload = remote.files[key]
        assert parent == (keys[i - 1] if i else None)
        assert tokens.tolist() == seq(4, 4 * i)
        np.testing.assert_array_equal(payload, _payload(i))
    assert t.publish_failures == 0 and t.stats()["shared_publish_failures"] == 0

    store = FakeStore()
    fresh = make_table(store=store, remote_levels=[remote])
    a = fresh.admit(1, 16, seq(13))
    assert a.cached == 12
    for i, b in enumerate(fresh.table_row(1)[:3]):
        np.testing.assert_array_equal(store.blocks[int(b)], _payload(i))
    assert fresh.prefix.refs(int(fresh.table_row(1)[0])) == 1
    assert fresh.stats()["indexed_blocks"] == 3
    # Released and admitted again: mapped from the local index, no further load.
    loads = remote.loads
    fresh.release(1, 13, seq(13))
    assert remote.loads == loads  # Every block is there already: nothing republished.
    assert fresh.admit(2, 16, seq(13)).cached == 12 and remote.loads == loads


class MemoryStore(FakeStore):
    """A BlockStore whose blocks are in memory (one region of PAYLOAD bytes per block)."""

    def __init__(self, num_blocks: int = 16):
        super().__init__()
        self.pool = np.zeros((num_blocks, PAYLOAD), np.uint8)
        self.quiesced = 0

    def read_blocks(self, blocks):
        return [self.pool[int(b)].copy() for b in blocks]

    def write_block(self, block, payload):
        self.pool[int(block)] = payload

    def block_memory(self, block):
        return [self.pool[int(block)]]

    def quiesce(self):
        self.quiesced += 1


class FakeInPlaceRemote(FakeRemote):
    """An InPlaceRemoteLevel: ``lookup`` finds the leading published blocks; ``load_into``
    writes them into the destinations, or, ``stuck``, writes none, reports them busy and
    is not settled until ``stuck`` is cleared."""

    def __init__(self):
        super().__init__()
        self.stuck = False
        self.published_views = 0  # Blocks published from views of the pool, not copies.
        self.lookups: list[int] = []
        self.loaded_into: list[list[int]] = []

    def use_memory(self, address, nbytes):
        pass

    def lookup(self, wanted):
        n = 0
        for key, parent, tokens in wanted:
            found = self.files.get(key)
            if found is None or found[0] != parent or not np.array_equal(found[1], tokens):
                break
            n += 1
        self.lookups.append(n)
        return n

    def load_into(self, wanted, destinations):
        if self.stuck:
            return InPlaceLoad(0, len(wanted))
        self.loaded_into.append([int(d[0].ctypes.data) for d in destinations])
        for (key, _, _), (view,) in zip(wanted, destinations):
            view[:] = self.files[key][2]
        return InPlaceLoad(len(wanted))

    def settled(self):
        return not self.stuck

    def missing(self, keys):
        return [i for i, key in enumerate(keys) if key not in self.files]

    def publish_many(self, items):
        """Payloads may be a pool's views (read only during the call): copied here."""
        self.published_views += sum(not isinstance(item[3], np.ndarray) for item in items)
        return sum(
            self.publish(key, parent, tokens, np.concatenate([np.ravel(r) for r in payload]))
            if not isinstance(payload, np.ndarray)
            else self.publish(key, parent, tokens, payload)
            for key, parent, tokens, payload in items
        )


def test_an_in_place_level_publishes_from_views_of_the_pool_after_draining_the_engine():
    remote = FakeInPlaceRemote()
    store = MemoryStore()
    t = make_table(store=store, remote_levels=[remote])
    t.admit(0, 16, seq(14))
    for i, b in enumerate(t.table_row(0)[:4]):
        store.pool[int(b)] = _payload(i)
    t.release(0, 14, seq(14))
    # The three full blocks, read where they lie (no read_blocks copy), the engine drained.
    assert remote.published_views == 3 and store.quiesced == 1
    store.pool[:] = 0  # The pool reused: what was published is the level's.
    fresh_store = MemoryStore()
    fresh = make_table(store=fresh_store, remote_levels=[remote])
    assert fresh.admit(0, 16, seq(13)).cached == 12
    for i, b in enumerate(fresh.table_row(0)[:3]):
        np.testing.assert_array_equal(fresh_store.pool[int(b)], _payload(i))


def test_a_tier_not_in_memory_publishes_copies_read_through_the_engine():
    remote = FakeInPlaceRemote()
    _publisher(remote, seq(14))  # A FakeStore: no block_memory.
    assert remote.published_views == 0 and len(remote.files) == 3


def test_an_in_place_level_reads_a_run_of_blocks_into_fresh_blocks_in_one_request():
    remote = FakeInPlaceRemote()
    _publisher(remote, seq(14))
    loads = remote.loads
    store = MemoryStore()
    t = make_table(store=store, remote_levels=[remote])
    t.admit(0, 4, seq(4, 100))  # Block 0 taken: the imports start at block 1.
    assert t.admit(1, 16, seq(13)).cached == 12
    assert remote.lookups == [3] and len(remote.loaded_into) == 1 and store.quiesced == 1
    for i, b in enumerate(t.table_row(1)[:3]):
        assert b == i + 1
        np.testing.assert_array_equal(store.pool[b], _payload(i))
    assert remote.loads == loads  # Never through the copying load().
    assert t.stats()["indexed_blocks"] == 3 and t.prefix.refs(1) == 1


def test_in_place_imports_take_only_the_room_eviction_can_make():
    remote = FakeInPlaceRemote()
    _publisher(remote, seq(14))  # Blocks of seq(12) published.
    store = MemoryStore(num_blocks=8)
    t = make_table(store=store, remote_levels=[remote], num_blocks=8)
    t.admit(0, 16, seq(16, 500))  # 4 blocks held.
    released(t, 1, seq(8, 900))  # 2 blocks cached (evictable).
    assert t.free_blocks == 2
    # 3 found, room for 2 free + 2 evictable: all 3 imported (one cached block evicted),
    # then the fresh fourth block evicts the other.
    assert t.admit(2, 16, seq(13)).cached == 12
    assert t.stats()["evictions"] == 2 and t.free_blocks == 0
    np.testing.assert_array_equal(store.pool[t.table_row(2)[2]], _payload(2))
    t.release(2, 12, seq(12))
    t.release(0, 0)
    # Exactly the room: 3 found + 1 fresh block, 4 free (2 held by slot 3).
    t2 = make_table(store=MemoryStore(num_blocks=6), remote_levels=[remote], num_blocks=6)
    t2.admit(3, 8, seq(8, 700))
    assert t2.admit(2, 16, seq(13)).cached == 12 and t2.free_blocks == 0
    # Room for 2 of the 3: those imported, then the admission is refused (they stay cached).
    t3 = make_table(store=MemoryStore(num_blocks=4), remote_levels=[remote], num_blocks=4)
    t3.admit(3, 8, seq(8, 700))
    with pytest.raises(ValueError, match="needs 2 KV blocks but only 0"):
        t3.admit(2, 16, seq(13))
    assert t3.stats()["indexed_blocks"] == 2 and t3.stats()["cached_blocks"] == 2


def test_blocks_a_stuck_load_may_still_write_are_held_aside_until_the_level_settles():
    remote = FakeInPlaceRemote()
    _publisher(remote, seq(14))
    t = make_table(store=MemoryStore(), remote_levels=[remote])
    remote.stuck = True
    assert t.admit(1, 16, seq(13)).cached == 0  # A miss: fresh blocks, nothing mapped.
    held = t.stats()["blocks_held_aside"]
    assert held == 3 and t.free_blocks == 16 - 4 - 3
    t.release(1, 0)
    t.admit(1, 4, seq(4, 300))  # Still stuck: still held, never handed out.
    assert t.stats()["blocks_held_aside"] == 3 and t.free_blocks == 16 - 1 - 3
    t.release(1, 0)
    remote.stuck = False
    assert t.admit(1, 16, seq(13)).cached == 12  # Settled: freed, then the run imported.
    assert t.stats()["blocks_held_aside"] == 0 and t.free_blocks == 16 - 4


def test_a_remote_load_that_raises_propagates_with_every_pin_undone():
    remote = FakeRemote()
    _publisher(remote, seq(14))
    store = FakeStore()
    t = make_table(store=store, remote_levels=[remote])
    released(t, 0, seq(5))  # Block 0 is local: matched, pinned, then the import fails.
    remote.fail_load_at = remote.loads + 2  # Block 1 loads, block 2 raises.
    before = snapshot(t)
    with pytest.raises(OSError, match="remote level unreachable"):
        t.admit(1, 16, seq(13))
    after = snapshot(t)
    assert after["tables"] == before["tables"] and after["capacity"] == before["capacity"]
    assert after["shared"] == before["shared"] and after["stats"]["hits"] == 0
    # Block 1 was imported: it stays indexed, cached (content, not a slot's state).
    assert all(refs == 0 for _, _, refs in after["entries"])
    assert after["stats"]["indexed_blocks"] == 2 and after["free_blocks"] == 16 - 2
    remote.fail_load_at = None
    assert t.admit(1, 16, seq(13)).cached == 12


def test_a_remote_publish_that_raises_does_not_fail_the_release(caplog):
    remote = FakeRemote(fail_publish=True)
    with caplog.at_level(logging.WARNING, logger="jax_tpusync.core.slots"):
        t = _publisher(remote, seq(14))
    assert not t.is_active(0) and t.capacity[0] == 0
    assert t.publish_failures == 1 and t.stats()["shared_publish_failures"] == 1
    assert t.stats()["cached_blocks"] == 3  # Indexed locally all the same.
    assert remote.files == {}
    assert "publishing prefix blocks to a fake remote level failed" in caplog.text
    assert "remote level is read-only" in caplog.text
    assert t.admit(0, 16, seq(13)).cached == 12


# -- (c) a state machine against a plain model -----------------------------------------------

BATCH, MAX_LEN, NUM_BLOCKS = 3, 24, 12
BASES = [list(range(1000 * p, 1000 * p + MAX_LEN)) for p in range(3)]


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while (n + 1) * BT <= min(len(a), len(b)) and a[n * BT : (n + 1) * BT] == b[
        n * BT : (n + 1) * BT
    ]:
        n += 1
    return n


class SlotTableMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.t = make_table(batch=BATCH, max_len=MAX_LEN, num_blocks=NUM_BLOCKS)
        self.capacity = [0] * BATCH  # The model.
        self.sequence: list[list[int] | None] = [None] * BATCH  # Each active slot's tokens.
        self.published: list[list[int]] = []  # Full blocks of every release with tokens.

    def _refused(self, call, *args, match=None, **kw):
        before = snapshot(self.t)
        with pytest.raises(ValueError, match=match):
            call(*args, **kw)
        assert snapshot(self.t) == before

    def _indexed_prefix(self, ids: list[int], limit: int) -> tuple[int, int]:
        """(leading blocks of ``ids`` the index holds, how many of them are cached)."""
        n = cached = 0
        for key in self.t.prefix.keys(np.asarray(ids, np.int64))[:limit]:
            try:
                block = self.t.prefix.block_of(key)
            except KeyError:
                break
            n += 1
            cached += self.t.prefix.refs(block) == 0
        return n, cached

    @rule(
        slot=st.integers(0, BATCH - 1),
        max_tokens=st.integers(1, MAX_LEN),
        base=st.integers(0, len(BASES) - 1),
        n=st.integers(0, MAX_LEN),
        diverge=st.one_of(st.none(), st.integers(0, MAX_LEN - 1)),
        with_tokens=st.booleans(),
        max_cached=st.one_of(st.none(), st.integers(0, MAX_LEN)),
    )
    def admit(self, slot, max_tokens, base, n, diverge, with_tokens, max_cached):
        tokens = list(BASES[base][:n])
        if diverge is not None and diverge < n:
            tokens[diverge] = 10**6 + diverge
        ids = tokens if with_tokens else None
        if self.capacity[slot]:
            return self._refused(self.t.admit, slot, max_tokens, ids, match="is active")
        if ids is not None and len(ids) > max_tokens:
            return self._refused(self.t.admit, slot, max_tokens, ids, match="more than max_tokens")
        limit = 0
        if ids is not None:
            limit = max(len(ids) - 1, 0) // BT
            if max_cached is not None:
                limit = min(limit, max_cached // BT)
        mapped, mapped_cached = self._indexed_prefix(ids or [], limit)
        need = -(-max_tokens // BT) - mapped
        room = self.t.free_blocks + self.t.stats()["cached_blocks"] - mapped_cached
        if need > room:
            return self._refused(
                self.t.admit, slot, max_tokens, ids, max_cached=max_cached, match="needs"
            )
        a = self.t.admit(slot, max_tokens, ids, max_cached=max_cached)
        assert a.cached == mapped * BT
        # Never more than the longest prefix ever released with these tokens.
        bound = max([_common_blocks(tokens, p) for p in self.published] + [0])
        assert a.cached <= min(bound, limit) * BT
        self.capacity[slot] = max_tokens
        # The slot's tokens: what it was admitted with, continued from its base.
        self.sequence[slot] = tokens + BASES[base][len(tokens) : max_tokens]

    @rule(slot=st.integers(0, BATCH - 1), data=st.data(), with_tokens=st.booleans())
    def release(self, slot, data, with_tokens):
        if not self.capacity[slot]:
            return self._refused(self.t.release, slot, 0, None, match="is not active")
        low = self.t.shared_tokens(slot) if data.draw(st.booleans()) else 0
        length = data.draw(st.integers(low, self.capacity[slot]))
        tokens = self.sequence[slot][:length]
        if with_tokens and length:
            self._refused(self.t.release, slot, length, tokens[:-1], match="tokens has")
        self.t.release(slot, length, tokens if with_tokens else None)
        if with_tokens:
            self.published.append(tokens[: length // BT * BT])
        self.capacity[slot] = 0
        self.sequence[slot] = None

    @rule(
        slot=st.sampled_from([-1, BATCH, 1.5, True, None]),
        max_tokens=st.sampled_from([0, MAX_LEN + 1, -3, 2.0]),
    )
    def bad_arguments(self, slot, max_tokens):
        self._refused(self.t.admit, slot, 4, None, match="must be an int")
        self._refused(self.t.release, slot, 0, None, match="must be an int")
        free = [b for b in range(BATCH) if not self.capacity[b]]
        if free:
            self._refused(self.t.admit, free[0], max_tokens, None, match="max_tokens=")
            self._refused(self.t.admit, free[0], 8, [1, 2**63], match="is not in")

    @precondition(lambda self: any(self.capacity))
    @rule(data=st.data())
    def place_on_a_held_block(self, data):
        free = [b for b in range(BATCH) if not self.capacity[b]]
        held = self.t.tables[self.t.tables >= 0].tolist()
        if free and held:
            block = data.draw(st.sampled_from(held))
            self._refused(self.t.place, free[0], [block], 1, match="is not free")

    @invariant()
    def blocks_are_accounted_for(self):
        t = self.t
        tables, shared = t.tables, t.shared
        holders: dict[int, list[tuple[int, bool]]] = {}
        for b in range(BATCH):
            row = tables[b]
            n = int((row >= 0).sum())
            assert (row[:n] >= 0).all() and (row[n:] < 0).all()
            assert n == -(-self.capacity[b] // BT)
            assert shared[b] <= n
            for i, block in enumerate(row[:n].tolist()):
                holders.setdefault(block, []).append((b, i < shared[b]))
        for block, by in holders.items():
            if len(by) > 1 or by[0][1]:
                # Mapped read-only by each holder: indexed, pinned once per slot.
                assert all(read_only for _, read_only in by), (block, by)
                assert t.prefix.is_indexed(block) and t.prefix.refs(block) == len(by)
            else:
                assert not t.prefix.is_indexed(block), block  # A slot's own block.
        stats = t.stats()
        assert t.free_blocks + len(holders) + stats["cached_blocks"] == NUM_BLOCKS
        assert stats["indexed_blocks"] == stats["cached_blocks"] + sum(
            t.prefix.is_indexed(b) for b in holders
        )

    @invariant()
    def capacity_matches_the_model(self):
        assert self.t.capacity.tolist() == self.capacity
        assert [self.t.is_active(b) for b in range(BATCH)] == [c > 0 for c in self.capacity]


SlotTableMachine.TestCase.settings = settings(
    derandomize=True, database=None, deadline=None, max_examples=30, stateful_step_count=40
)
test_slot_table_machine = SlotTableMachine.TestCase
