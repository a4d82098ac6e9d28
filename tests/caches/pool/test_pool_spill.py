"""A host pool's spill tier: cached prefix blocks demoted from the pool to a file when the
pool is full (least recently used first; evicted only when neither tier has room), and
promoted back into the pool by the admission that maps them, before any step reads them."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_tpusync as tps
from jax_tpusync.caches.pool.spill import check_pool_ids
from jax_tpusync.runtime.engine import Engine

H, QH, D, BT, NB, LAYERS = 2, 4, 8, 4, 8, 2  # KV heads, query heads, head size, block tokens
DOC = list(range(200, 212))  # 12 tokens: 3 full blocks.


def make_cache(tmp_path, **options):
    options.setdefault("dtype", jnp.float32)
    options.setdefault("spill_blocks", 8)
    return tps.HostPoolKVCache(
        num_layers=LAYERS, batch=2, max_len=32, num_kv_heads=H, head_dim=D, block_tokens=BT,
        num_blocks=NB, staging_bytes=1 << 16, spill_path=str(tmp_path), **options,
    )  # fmt: skip


def kv_of(tokens, layer):
    """The KV a model would compute for ``tokens`` (the same ids, the same rows): [2, n, H, D]."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    k = np.cos(t * 0.29 + np.arange(H * D, dtype=np.float32).reshape(1, H, D) * 0.07 + layer)
    return np.stack([k, 2 * k])


def prefill(cache, state, slot, tokens, start=0):
    dtype = cache.spec.dtype
    for layer in range(LAYERS):
        k, v = kv_of(tokens[start:], layer).astype(dtype)
        state = cache.load(state, layer, k, v, slot=slot, start=start)
    return state


def cache_prompt(cache, state, tokens, slot=0):
    """``tokens``' KV written by ``slot``, which is released: its full blocks are cached."""
    state, _ = cache.admit(state, slot, tokens=tokens, max_tokens=16)
    state = prefill(cache, state, slot, tokens)
    return cache.release(state, slot, tokens=tokens)


def blocks_of(cache, tokens):
    """The blocks the prefix index holds ``tokens``' full blocks in (ids past NB: spilled)."""
    return cache.slots.prefix.peek(np.asarray(tokens), len(tokens) // BT)


def snapshot(cache, state):
    """What a refused call must leave as it was."""
    dram, spill = cache.slots.allocators.dram, cache.slots.allocators.spill
    return dict(
        pool=np.asarray(state.pool).copy(),
        stats=cache.prefix_stats,
        free=(dram.free_blocks, spill.free_blocks),
        tables=cache.slots.tables,
        capacity=cache.capacity,
        index=[(e.key, e.block, e.refs) for e in cache.slots.prefix.entries_in_order()],
    )


def assert_unchanged(before, after):
    np.testing.assert_array_equal(after.pop("pool"), before.pop("pool"))
    np.testing.assert_array_equal(after.pop("tables"), before.pop("tables"))
    np.testing.assert_array_equal(after.pop("capacity"), before.pop("capacity"))
    assert after == before


@jax.jit
def qkv(x, layer):
    q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], 1, QH, D)) * (layer + 1)
    return q, q[:, :, :H] * 0.5, -q[:, :, :H]


resident_attention = jax.jit(tps.resident_attention)


@jax.jit
def decode_step(state, x):
    outs = []
    for layer in range(LAYERS):
        q, k, v = qkv(x, layer)
        out, state = tps.prefetching_attention(q, k, v, state, layer=layer)
        outs.append(out)
    return outs, state


def decode_matches_resident(cache, state, steps=2):
    """``steps`` decode steps, each against resident attention over the rows the cache
    holds before it (read back through the tables); returns the state."""
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = jnp.asarray(rng.standard_normal((2, 1, D)), jnp.float32)
        lengths = cache.lengths(state)
        want = []
        for layer in range(LAYERS):
            k_all = np.zeros((2, 32, H, D), np.float32)
            v_all = np.zeros_like(k_all)
            for b in np.flatnonzero(lengths):
                k_all[b, : lengths[b]], v_all[b, : lengths[b]] = cache.read(state, layer, int(b))
            q, k, v = qkv(x, layer)
            ref, _, _ = resident_attention(
                q, k, v, jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(lengths)
            )
            want.append(np.asarray(ref))
        outs, state = decode_step(state, x)
        for layer in range(LAYERS):
            active = lengths > 0
            np.testing.assert_allclose(
                np.asarray(outs[layer])[active], want[layer][active], atol=1e-5
            )
    return state


@pytest.mark.parametrize(
    "dtype, tier_dtype",
    [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, "int8")],
    ids=["f32", "bf16", "int8"],
)
def test_a_prefix_goes_to_the_spill_tier_and_back_byte_exact(tmp_path, dtype, tier_dtype):
    with make_cache(tmp_path, dtype=dtype, tier_dtype=tier_dtype) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=DOC, max_tokens=16)
        state = prefill(cache, state, 0, DOC)
        stored = cache.read_stored_rows(state, 0, 0, 12)  # The pool's bytes of the prefix.
        state = cache.release(state, 0, tokens=DOC)
        # A sequence taking every pool block: the 3 cached ones move to the spill tier.
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)
        stats = cache.prefix_stats
        assert (stats["demoted"], stats["evictions"], stats["spill_free_blocks"]) == (3, 0, 5)
        assert min(blocks_of(cache, DOC)) >= NB
        state = cache.release(state, 0)
        # An admission mapping them brings them back into the pool before any step.
        tokens = DOC + [5, 6, 7]
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=20)
        assert cached == 12
        assert (cache.slots.table_row(1)[:5] < NB).all()
        assert (np.asarray(state.block_table)[1, :5] < NB).all()
        stats = cache.prefix_stats
        assert (stats["promoted"], stats["spill_hits"], stats["spill_free_blocks"]) == (3, 3, 8)
        np.testing.assert_array_equal(cache.read_stored_rows(state, 1, 0, 12), stored)
        if dtype != jnp.float32 or tier_dtype is not None:
            return
        # Decode over the promoted prefix, beside a private sequence in slot 0.
        state = prefill(cache, state, 1, tokens, cached)
        other = [1, 2, 3, 4, 5, 6, 7]
        state, _ = cache.admit(state, 0, tokens=other, max_tokens=12)
        state = prefill(cache, state, 0, other)
        state = decode_matches_resident(cache, state)
        assert cache.lengths(state).tolist() == [9, 17]
        for layer in range(LAYERS):  # Decode wrote past the shared prefix only.
            np.testing.assert_array_equal(
                np.stack(cache.read(state, layer, 1, 0, 15)), kv_of(tokens, layer)
            )


def test_demotion_takes_the_least_recent_prefix_and_eviction_waits_for_both_tiers(tmp_path):
    first, second = list(range(100, 108)), list(range(300, 308))  # 2 blocks each.
    with make_cache(tmp_path, spill_blocks=2) as cache:
        state = cache.init(admit=False)
        state = cache_prompt(cache, state, first)
        state = cache_prompt(cache, state, second)
        # 2 of the 4 cached blocks must go: the least recently used prompt, to the spill.
        state, _ = cache.admit(state, 0, max_tokens=6 * BT)
        assert min(blocks_of(cache, first)) >= NB and max(blocks_of(cache, second)) < NB
        stats = cache.prefix_stats
        assert (stats["demoted"], stats["evictions"], stats["cached_blocks"]) == (2, 0, 4)
        state = cache.release(state, 0)
        # The pool and the spill full: the spill tier's least recent blocks are evicted.
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)
        assert blocks_of(cache, first) == [] and min(blocks_of(cache, second)) >= NB
        stats = cache.prefix_stats
        assert (stats["demoted"], stats["evictions"], stats["cached_blocks"]) == (4, 2, 2)
        # Refused: no pool block is free or cached, and the spill's blocks are no room.
        before = snapshot(cache, state)
        with pytest.raises(ValueError, match=r"needs 1 KV blocks but only 0 of 8 are free"):
            cache.admit(state, 1, max_tokens=BT)
        assert_unchanged(before, snapshot(cache, state))
        state = cache.release(state, 0)
        # A reservation made without a state has no pool to read: it evicts instead.
        state = cache_prompt(cache, state, first)
        reservation = cache.reserve(1, NB * BT)
        assert cache.prefix_stats["evictions"] == 4 and cache.prefix_stats["demoted"] == 4
        cache.cancel(reservation)
        state, cached = cache.admit(state, 1, tokens=second + [1], max_tokens=12)
        assert cached == 8 and cache.prefix_stats["promoted"] == 2


@pytest.mark.parametrize("own_blocks, refused", [(5, False), (6, True)])
def test_promotion_needs_free_pool_blocks_and_never_takes_a_mapped_one(
    tmp_path, own_blocks, refused
):
    with make_cache(tmp_path) as cache:
        state = cache_prompt(cache, cache.init(admit=False), DOC[:8])
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)  # Both cached blocks spill.
        state = cache.release(state, 0)
        state, _ = cache.admit(state, 0, max_tokens=own_blocks * BT)
        # 1 block of its own and 2 promoted: 3 pool blocks, of 3 free / 2 free.
        before = snapshot(cache, state)
        if refused:
            with pytest.raises(ValueError, match=r"needs 3 KV blocks but only 2 of 8 are free"):
                cache.admit(state, 1, tokens=DOC[:8] + [1], max_tokens=12)
            assert_unchanged(before, snapshot(cache, state))
            assert min(blocks_of(cache, DOC[:8])) >= NB
            return
        state, cached = cache.admit(state, 1, tokens=DOC[:8] + [1], max_tokens=12)
        assert cached == 8 and max(blocks_of(cache, DOC[:8])) < NB
        assert cache.prefix_stats["promoted"] == 2 and cache.prefix_stats["evictions"] == 0
        np.testing.assert_array_equal(cache.slots.tables[0], before["tables"][0])


def test_a_cancelled_reservation_puts_the_blocks_it_promoted_back_on_the_spill_tier(tmp_path):
    # Promotion freed the spill copies: the pending bytes are the blocks' only copy, so a
    # cancel (a hybrid's retry, a failed P/D receive) must not drop them from the index.
    with make_cache(tmp_path) as cache:
        state = cache_prompt(cache, cache.init(admit=False), DOC[:8])
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)
        state = cache.release(state, 0)
        tokens = DOC[:8] + [1]
        with cache.reserving_in(state):
            reservation = cache.reserve(1, 12, tokens)
        assert reservation.cached == 8 and max(blocks_of(cache, DOC[:8])) < NB
        cache.cancel(reservation)
        assert min(blocks_of(cache, DOC[:8])) >= NB
        stats = cache.prefix_stats
        assert (stats["cached_blocks"], stats["evictions"], stats["demoted"]) == (2, 0, 4)
        assert cache.slots.allocators.dram.free_blocks == NB
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=12)
        assert cached == 8 and cache.prefix_stats["promoted"] == 4
        for layer in range(LAYERS):
            np.testing.assert_array_equal(
                np.stack(cache.read(state, layer, 1, 0, 8)), kv_of(DOC[:8], layer)
            )


def test_a_cancel_keeps_what_the_spill_tier_has_room_for_the_first_blocks_first(tmp_path):
    # While the reservation waits, another one demotes 2 blocks into the spill blocks its
    # promotions freed: 1 is left, for the first of its 2 blocks (the second is dropped).
    first, other = DOC[:8], list(range(300, 308))
    with make_cache(tmp_path, spill_blocks=3) as cache:
        state = cache_prompt(cache, cache.init(admit=False), first)
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)  # Both blocks spill.
        state = cache.release(state, 0)
        state = cache_prompt(cache, state, other)  # 2 cached pool blocks.
        with cache.reserving_in(state):
            promoting = cache.reserve(1, 12, first + [1])  # 2 promoted, 1 own block.
            demoting = cache.reserve(0, 5 * BT)  # 3 free pool blocks: demotes the other 2.
        assert cache.prefix_stats["spill_free_blocks"] == 1
        cache.cancel(promoting)
        assert len(blocks_of(cache, first)) == 1 and blocks_of(cache, first)[0] >= NB
        assert cache.prefix_stats["spill_free_blocks"] == 0
        assert cache.slots.allocators.dram.free_blocks == NB - 5
        state = cache.release(cache.admitted(state, demoting), 0)
        state, cached = cache.admit(state, 1, tokens=first + [1], max_tokens=12)
        assert cached == BT
        for layer in range(LAYERS):
            np.testing.assert_array_equal(
                np.stack(cache.read(state, layer, 1, 0, BT)), kv_of(first[:BT], layer)
            )


def test_a_failed_spill_file_write_or_read_refuses_the_admission_changing_nothing(
    tmp_path, monkeypatch
):
    # The spill file's I/O fails mid-admission: the demotion's write (no index entry may
    # point at bytes the file lacks) and the promotion's read (no counter may move).
    def failing(self, segments, buffer, write):
        raise OSError(f"spill file {'write' if write else 'read'} failed")

    with make_cache(tmp_path) as cache:
        state = cache_prompt(cache, cache.init(admit=False), DOC[:8])
        real = Engine.transfer

        def refused(admit, message):
            before = snapshot(cache, state)
            monkeypatch.setattr(Engine, "transfer", failing)
            with pytest.raises(OSError, match=message):
                admit()
            monkeypatch.setattr(Engine, "transfer", real)
            assert_unchanged(before, snapshot(cache, state))

        # Needs the room of the 2 cached blocks: demotes them, and the write fails.
        refused(lambda: cache.admit(state, 0, max_tokens=NB * BT), "spill file write failed")
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)
        state = cache.release(state, 0)
        assert min(blocks_of(cache, DOC[:8])) >= NB
        # Maps the 2 spilled blocks: promotes them, and the read fails.
        tokens = DOC[:8] + [1]
        refused(lambda: cache.admit(state, 1, tokens=tokens, max_tokens=12), "file read failed")
        state, cached = cache.admit(state, 1, tokens=DOC[:8] + [1], max_tokens=12)
        assert cached == 8 and cache.prefix_stats["spill_hits"] == 2
        for layer in range(LAYERS):
            np.testing.assert_array_equal(
                np.stack(cache.read(state, layer, 1, 0, 8)), kv_of(DOC[:8], layer)
            )


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(shm_name="tps-pool-spill"), r"a two-level cache \(spill_path\) does not persist"),
        (dict(promote_after=1), r"promote_after=1: a host pool promotes every spill block"),
        (dict(promote_after=None), r"promote_after=None: a host pool promotes every spill"),
        (dict(spill_blocks=0), r"spill_blocks=0 must be a positive int"),
        (
            dict(sliding_window=8, max_step_tokens=4),
            r"with max_step_tokens=4: a pool that keeps only each slot's sliding window",
        ),
    ],
)
def test_what_a_pool_spill_tier_does_not_go_with_is_refused_by_name(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        make_cache(tmp_path, **options)


def test_the_edges_of_the_spill_arguments_are_taken(tmp_path):
    with make_cache(tmp_path, spill_blocks=1, promote_after=2) as cache:
        assert cache.prefix_stats["spill_free_blocks"] == 1


def test_a_spill_tier_over_a_mesh_is_refused_as_on_the_engine_cache(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:2]), ("h",))
    with pytest.raises(ValueError, match=r"spill_path \(a two-level cache\) is not supported on"):
        make_cache(tmp_path, mesh=mesh, kv_heads_axis="h")


def test_a_spill_id_in_a_table_a_state_would_carry_is_refused():
    tables = np.full((2, 4), -1, np.int32)
    tables[1, 2] = NB - 1
    check_pool_ids(tables, NB)  # The pool's last block.
    tables[1, 2] = NB
    with pytest.raises(RuntimeError, match=r"slot 1's block table names block 8 at index 2"):
        check_pool_ids(tables, NB)


def test_a_cached_block_no_pool_holds_yet_is_demoted_with_its_imported_bytes(tmp_path):
    # Two reservations map blocks a shared directory's import wrote (pending until an
    # admission's pool takes them) and both are cancelled: the blocks stay cached with
    # their bytes still pending. Demoted, the spill tier gets those bytes, not the pool's.
    shared = tmp_path / "shared"
    with make_cache(tmp_path, shared_prefix_dir=shared) as writer:
        cache_prompt(writer, writer.init(admit=False), DOC[:8])
    with make_cache(tmp_path, shared_prefix_dir=shared) as cache:
        state = cache.init(admit=False)
        first = cache.reserve(0, 12, DOC[:8] + [1])
        second = cache.reserve(1, 12, DOC[:8] + [1])
        assert first.cached == second.cached == 8
        cache.cancel(first)
        cache.cancel(second)
        assert cache.prefix_stats["cached_blocks"] == 2
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)
        assert cache.prefix_stats["demoted"] == 2
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 1, tokens=DOC[:8] + [1], max_tokens=12)
        assert cached == 8 and cache.prefix_stats["promoted"] == 2
        for layer in range(LAYERS):
            np.testing.assert_array_equal(
                np.stack(cache.read(state, layer, 1, 0, 8)), kv_of(DOC[:8], layer)
            )


def test_a_block_imported_before_a_refusal_keeps_its_bytes(tmp_path, monkeypatch):
    # The import of a shared directory's second block needs room: the demotion it makes
    # fails (the spill file write), refusing the reservation. The first block imported
    # stays indexed: its bytes must reach the pool before an admission maps it.
    shared = tmp_path / "shared"
    with make_cache(tmp_path, shared_prefix_dir=shared) as writer:
        cache_prompt(writer, writer.init(admit=False), DOC)
    with make_cache(tmp_path, shared_prefix_dir=shared) as cache:
        state = cache_prompt(cache, cache.init(admit=False), list(range(500, 508)))
        state, _ = cache.admit(state, 0, max_tokens=5 * BT)  # 1 pool block free, 2 cached.
        real = Engine.transfer

        def failing_writes(self, segments, buffer, write):
            if write:
                raise OSError("spill file write failed")
            return real(self, segments, buffer, write)

        monkeypatch.setattr(Engine, "transfer", failing_writes)
        with pytest.raises(OSError, match="spill file write failed"):
            with cache.reserving_in(state):
                cache.reserve(1, 16, DOC + [1])
        monkeypatch.setattr(Engine, "transfer", real)
        assert len(blocks_of(cache, DOC)) == 1  # Imported, indexed, cached.
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 1, tokens=DOC + [1], max_tokens=16)
        assert cached == 12
        for layer in range(LAYERS):
            np.testing.assert_array_equal(
                np.stack(cache.read(state, layer, 1, 0, 12)), kv_of(DOC, layer)
            )


def test_a_hybrid_cache_of_pools_demotes_in_every_group_at_admission(tmp_path):
    """A hybrid admission reserves in each group's pool through reserving_in: the cached
    blocks its groups need room for go to their spill tiers, not away."""
    cache = tps.HybridKVCache(
        num_layers=2, batch=2, max_len=32, num_kv_heads=[2, 1], head_dim=[8, 16],
        max_step_tokens=4, block_tokens=BT, staging_bytes=1 << 16, dtype=jnp.float32,
        host_pool=True, spill_path=str(tmp_path), spill_blocks=4,
    )  # fmt: skip
    with cache:
        assert [g.config.geometry.num_blocks for g in cache.groups] == [16, 16]
        state = cache.init(admit=False)
        tokens = list(range(100, 108))  # 2 full blocks in each group.
        state, _ = cache.admit(state, 0, tokens=tokens, max_tokens=16)
        for layer, (heads, size) in enumerate([(2, 8), (1, 16)]):
            rows = np.arange(8 * heads * size, dtype=np.float32).reshape(8, heads, size)
            state = cache.load(state, layer, rows + layer, -rows, slot=0)
        state = cache.release(state, 0, tokens=tokens)
        # 8 + 8 blocks of the 16 with 2 cached: each group makes room for 2 more.
        state, _ = cache.admit(state, 1, max_tokens=32)
        state, _ = cache.admit(state, 0, max_tokens=32)
        for group in cache.groups:
            stats = group.prefix_stats
            assert (stats["demoted"], stats["evictions"]) == (2, 0), stats
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 0, tokens=tokens + [1], max_tokens=12)
        assert cached == 8 and [g.prefix_stats["promoted"] for g in cache.groups] == [2, 2]
        for layer, (heads, size) in enumerate([(2, 8), (1, 16)]):
            rows = np.arange(8 * heads * size, dtype=np.float32).reshape(8, heads, size)
            k, v = cache.read(state, layer, 0, 0, 8)
            np.testing.assert_array_equal(k, rows + layer)
            np.testing.assert_array_equal(v, -rows)


# -- a damaged or truncated spill file: each spilled block checked, a bad one a miss ------------

PROMPTS = [list(range(100 * i, 100 * i + 12)) for i in range(1, 7)]  # 3 full blocks each.
REGIONS, SPILL = LAYERS * 2, 8


def six_prompts_cached(cache):
    """Six prompts cached in a pool of 8 blocks: some demoted (the third prompt's blocks are
    spill blocks 0, 5 and 7, so it maps the file's first and last block), some evicted."""
    state = cache.init(admit=False)
    for tokens in PROMPTS:
        state = cache_prompt(cache, state, tokens)
    assert blocks_of(cache, PROMPTS[2]) == [NB, NB + 5, NB + 7]
    assert max(blocks_of(cache, PROMPTS[5])) < NB
    return state


def spill_file(tmp_path):
    """The path of the cache's anonymous spill file (in ``tmp_path``, deleted on close)
    through this process's open descriptor, and where its blocks' data starts."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(tmp_path)):
            path = f"/proc/self/fd/{fd}"
            block_bytes = BT * H * D * 4  # float32 rows of every head.
            return path, os.path.getsize(path) - REGIONS * SPILL * block_bytes
    raise AssertionError("no spill file open")


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def assert_prompt_recomputed(cache, state, slot, tokens, cached):
    """The slot's cached rows and the ones the caller computes are the prompt's KV."""
    state = prefill(cache, state, slot, tokens, cached)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(
            np.stack(cache.read(state, layer, slot, 0, len(tokens))), kv_of(tokens, layer)
        )
    return state


def test_a_spill_file_overwritten_with_random_bytes_is_a_miss_not_kv(tmp_path):
    with make_cache(tmp_path) as cache:
        state = six_prompts_cached(cache)
        path, _ = spill_file(tmp_path)
        with open(path, "r+b") as f:
            f.write(np.random.default_rng(0).bytes(os.path.getsize(path)))
        tokens = PROMPTS[2] + [1]
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=16)
        assert cached == 0 and cache.prefix_stats["spill_damaged"] == 1
        assert blocks_of(cache, PROMPTS[2]) == []  # The chain left the index.
        state = assert_prompt_recomputed(cache, state, 1, tokens, cached)
        # Later admissions: a prefix in the pool is mapped as before.
        state, cached = cache.admit(state, 0, tokens=PROMPTS[5] + [1], max_tokens=16)
        assert cached == 12 and cache.prefix_stats["spill_damaged"] == 1
        assert_prompt_recomputed(cache, state, 0, PROMPTS[5] + [1], cached)


@pytest.mark.parametrize(
    "where, cached", [("first", 0), ("last", 2 * BT)], ids=["first-block", "last-block"]
)
def test_one_byte_flipped_in_a_spilled_block_makes_it_and_its_chain_a_miss(tmp_path, where, cached):
    # The file's first byte of data is spill block 0's (layer 0's K), its last byte spill
    # block 7's (the last layer's V): the prompt's first and last block.
    with make_cache(tmp_path) as cache:
        state = six_prompts_cached(cache)
        path, data_start = spill_file(tmp_path)
        flip_byte(path, data_start if where == "first" else os.path.getsize(path) - 1)
        tokens = PROMPTS[2] + [1]
        state, got = cache.admit(state, 1, tokens=tokens, max_tokens=16)
        assert got == cached
        stats = cache.prefix_stats
        assert (stats["spill_damaged"], stats["promoted"]) == (1, cached // BT)
        assert len(blocks_of(cache, PROMPTS[2])) == cached // BT
        state = assert_prompt_recomputed(cache, state, 1, tokens, got)
        state = cache.release(state, 1, tokens=tokens)
        # The recomputed blocks are cached again, from the pool; nothing counted twice.
        state, got = cache.admit(state, 1, tokens=tokens, max_tokens=16)
        assert got == 12 and cache.prefix_stats["spill_damaged"] == 1
        assert_prompt_recomputed(cache, state, 1, tokens, got)


@pytest.mark.parametrize("keep", ["none", "all-but-one-byte"])
def test_a_spill_file_truncated_between_calls_is_a_miss_and_admissions_go_on(tmp_path, keep):
    with make_cache(tmp_path) as cache:
        state = six_prompts_cached(cache)
        path, _ = spill_file(tmp_path)
        # Cut to nothing, every spilled block is missing; cut by one byte, the last one.
        os.truncate(path, 0 if keep == "none" else os.path.getsize(path) - 1)
        tokens = PROMPTS[2] + [1]
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=16)
        assert cached == (0 if keep == "none" else 2 * BT)
        assert cache.prefix_stats["spill_damaged"] == 1
        state = assert_prompt_recomputed(cache, state, 1, tokens, cached)
        state = cache.release(state, 1, tokens=tokens)
        # Every later admission is taken: the truncated file gets no more blocks (room is
        # made by eviction), and what it cannot give is a miss each time it is mapped.
        for slot, prompt in enumerate(PROMPTS[1:] * 2):
            state, cached = cache.admit(state, slot % 2, tokens=prompt + [1], max_tokens=16)
            state = assert_prompt_recomputed(cache, state, slot % 2, prompt + [1], cached)
            state = cache.release(state, slot % 2, tokens=prompt + [1])
        state, cached = cache.admit(state, 0, tokens=PROMPTS[5] + [1], max_tokens=16)
        assert cached == 12


def test_an_admission_refused_after_a_damaged_block_changes_nothing_else(tmp_path):
    with make_cache(tmp_path) as cache:
        state = six_prompts_cached(cache)
        state, _ = cache.admit(state, 0, max_tokens=5 * BT)  # 3 pool blocks left.
        assert blocks_of(cache, PROMPTS[2]) == [NB, NB + 5]
        path, data_start = spill_file(tmp_path)
        flip_byte(path, data_start)  # Spill block 0: the prompt's first block.
        before = snapshot(cache, state)
        tokens = PROMPTS[2] + [1]
        with pytest.raises(ValueError, match=r"needs 4 KV blocks"):
            cache.admit(state, 1, tokens=tokens, max_tokens=16)
        after = snapshot(cache, state)
        # The damaged block and its chain are gone (and counted); nothing else moved.
        dropped = {NB, NB + 5}
        expected = dict(before["stats"], spill_damaged=1)
        for name in ("indexed_blocks", "cached_blocks"):
            expected[name] -= len(dropped)
        expected["spill_free_blocks"] += len(dropped)
        assert after.pop("stats") == expected
        assert after.pop("index") == [e for e in before.pop("index") if e[1] not in dropped]
        assert after.pop("free") == (before["free"][0], before.pop("free")[1] + len(dropped))
        before.pop("stats")
        assert_unchanged(before, after)
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=16)
        assert cached == 0 and cache.prefix_stats["spill_damaged"] == 1
        assert_prompt_recomputed(cache, state, 1, tokens, cached)
