"""SlotTable.share_computed: a running slot's full blocks enter the prefix index as soon as
they are computed, pinned by their writer; mapped by a later admission; never a block
being filled; eviction and reference counts stay right; refused calls change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from jax_tpusync.core import prefix
from jax_tpusync.core.slots import SlotTable

BT = 4
ROOT = prefix.root_key("share-computed-tests", dict(block_tokens=BT))


def make_table(**kw) -> SlotTable:
    args = dict(batch=4, max_len=32, block_tokens=BT, num_blocks=16, root=ROOT)
    args.update(kw)
    return SlotTable(**args)


def snapshot(t: SlotTable) -> dict:
    entries = sorted((e.key, e.block, e.refs) for e in t.prefix.entries_in_order())
    return dict(
        tables=t.tables.tolist(),
        capacity=t.capacity.tolist(),
        shared=t.shared.tolist(),
        free_blocks=t.free_blocks,
        entries=entries,
    )


PROMPT = list(range(100, 114))  # 14 ids: three full blocks and two ids of a fourth.


def test_a_block_is_shared_once_computed_and_mapped_by_the_next_admission():
    t = make_table()
    t.admit(0, 20, PROMPT)
    # The first prefill chunk wrote 6 rows: one full block, the second being filled.
    assert t.share_computed(0, 6) == 1
    assert t.shared_tokens(0) == BT
    owner_blocks = t.table_row(0)[:4].tolist()
    assert t.prefix.refs(owner_blocks[0]) == 1  # Its writer pins it.
    assert not t.prefix.is_indexed(owner_blocks[1])  # Being filled: never indexed.
    got = t.admit(1, 20, PROMPT)
    assert got.cached == BT  # Only the whole block.
    assert t.table_row(1)[0] == owner_blocks[0]
    assert t.table_row(1)[1] != owner_blocks[1]
    assert t.prefix.refs(owner_blocks[0]) == 2  # Writer and reader.
    # The writer goes on: 13 rows now, three full blocks; one more call indexes two.
    assert t.share_computed(0, 13) == 2
    assert t.share_computed(0, 13) == 0  # Nothing new.
    assert t.shared_tokens(0) == 3 * BT
    assert [t.prefix.refs(b) for b in owner_blocks[:3]] == [2, 1, 1]


def test_a_partially_filled_block_is_never_mapped():
    t = make_table()
    t.admit(0, 20, PROMPT)
    assert t.share_computed(0, BT - 1) == 0  # One row short of a whole block.
    assert len(t.prefix) == 0
    assert t.admit(1, 20, PROMPT).cached == 0
    assert t.share_computed(0, BT) == 1  # Exactly one block: shared.


def test_only_recorded_ids_are_shared():
    """Rows past the slot's recorded ids have no key: not indexed."""
    t = make_table()
    t.admit(0, 20, PROMPT[:5])  # Ids of one block and one row.
    assert t.share_computed(0, 12) == 1
    t.extend_history(0, PROMPT[5:9])  # 9 ids now: two full blocks.
    assert t.share_computed(0, 12) == 1
    assert t.shared_tokens(0) == 2 * BT


def test_release_unpins_shared_blocks_and_the_reader_keeps_them():
    t = make_table()
    t.admit(0, 20, PROMPT)
    t.share_computed(0, 12)
    owner = t.table_row(0)[:4].tolist()
    t.admit(1, 20, PROMPT)
    free_before = t.free_blocks
    t.release(0, 14)  # Its history covers 14 rows: blocks 0-2 were indexed already.
    # The shared blocks stay (pinned by slot 1), the fourth (partial) is freed.
    assert [t.prefix.refs(b) for b in owner[:3]] == [1, 1, 1]
    assert t.free_blocks == free_before + 2  # Blocks 3 and 4 of its capacity of 20.
    assert t.prefix.cached_blocks == 0
    t.release(1, 14)
    assert t.prefix.cached_blocks == 3  # Now evictable, and nothing else is indexed.
    assert len(t.prefix) == 3


def test_shared_blocks_of_a_running_slot_are_never_evicted():
    """A block its writer still maps is pinned: an admission short of blocks evicts only
    cached ones, and is refused (changing nothing) rather than take a shared one."""
    t = make_table(num_blocks=8)
    t.admit(0, 16, PROMPT[:12] + [1, 2, 3, 4])  # All 4 blocks.
    assert t.share_computed(0, 16) == 4
    before = snapshot(t)
    with pytest.raises(ValueError, match="needs 5 KV blocks but only 4 of 8 are free"):
        t.admit(1, 20, [7] * 20)
    assert snapshot(t) == before
    t.admit(1, 16, [7] * 16)  # Exactly the four free ones.
    assert t.prefix.evictions == 0


def test_a_block_another_sequence_indexed_first_is_kept_as_a_duplicate():
    t = make_table()
    t.admit(0, 20, PROMPT)
    t.admit(1, 20, PROMPT)  # Both compute the prompt (admitted in the same step).
    assert t.share_computed(0, 8) == 2
    assert t.share_computed(1, 8) == 0  # Indexed by slot 0: slot 1 keeps its copies.
    assert t.shared_tokens(1) == 0
    free = t.free_blocks
    t.release(1, 14)
    # Its copies of blocks 0-1 are duplicates (freed), its block 2 extends slot 0's chain
    # (indexed, cached), its last two were never full.
    assert t.free_blocks == free + 4
    assert len(t.prefix) == 3 and t.prefix.cached_blocks == 1
    t.release(0, 14)
    assert len(t.prefix) == 3 and t.prefix.cached_blocks == 3


def test_a_ring_slot_shares_nothing():
    t = make_table(ring_blocks=2, window=4, num_blocks=16)
    t.admit(0, 20, PROMPT)
    assert t.share_computed(0, 12) == 0
    assert len(t.prefix) == 0


@pytest.mark.parametrize(
    "slot, length, message",
    [
        (4, 4, r"slot=4 must be an int in \[0, batch=4\)"),
        (2, 4, "slot 2 is not active"),
        (0, 21, r"length=21 must be an int in \[0, capacity=20\] of slot 0"),
        (0, -1, r"length=-1 must be an int in \[0, capacity=20\]"),
        (0, 4.0, r"length=4.0 must be an int"),
    ],
)
def test_a_refused_share_changes_nothing(slot, length, message):
    t = make_table()
    t.admit(0, 20, PROMPT)
    t.share_computed(0, 4)
    before = snapshot(t)
    with pytest.raises(ValueError, match=message):
        t.share_computed(slot, length)
    assert snapshot(t) == before
    assert t.share_computed(0, 20) == 2  # At the capacity itself: the blocks the ids cover.


def test_the_index_refuses_tokens_shorter_than_the_blocks():
    index = prefix.PrefixIndex(make_table().allocators, BT, ROOT)
    with pytest.raises(ValueError, match="2 full blocks but tokens cover only 1"):
        index.share(np.arange(BT, dtype=np.int64), [0, 1], 0)
