"""The host-pool data path (the TPU one) on the CPU backend: its steps against resident
attention, its host-side rows byte-exact, its guards at their edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core.pool_state import PoolLayout

from support.pool_model import (
    HEAD_DIM,
    HEADS,
    Q_HEADS,
    TOLERANCE,
    decode_step,
    make_cache,
    run_against_resident,
    unit_budget,
)

# Two step widths (each compiles once): a prefill of 7 rows (ragged: a slot takes 0-7 of
# them) and decode; 27 and 26 tokens at the end, past a unit of 16.
STEPS = [(7, None), (1, None), (7, [7, 3]), (1, None), (7, [0, 3]), (7, None)]
STEPS += [(1, None)] * 4


@pytest.mark.parametrize(
    "dtype, windows, depth",
    # Depth 2 in f32 (a global layer beside two windows), depth 1 in bf16: two compiles.
    [(jnp.bfloat16, (None, 5, 12), 1), (np.float32, (None, 5, 12), 2)],
    ids=["windows-bf16", "windows-f32-depth2"],
)
@pytest.mark.slow
def test_steps_equal_resident_attention(dtype, windows, depth):
    from jax_tpusync.core.pool_state import NOT_STAGED
    from jax_tpusync.step.host_pool import unit_rows

    cache = make_cache(
        dtype=dtype,
        sliding_window=list(windows),
        prefetch_depth=depth,
        staging_bytes=unit_budget(depth, dtype),
    )
    assert not cache.layout.single_unit  # Several units per layer: the loop and its prefetch.
    assert cache.spec.prefetch_depth == depth and cache.spec.chunk_len == 16
    assert cache.device_bytes == (depth + 1) * cache.layout.staging_bytes
    state, worst, (ref_k, ref_v, lengths) = run_against_resident(cache, STEPS, windows, dtype)
    assert worst <= TOLERANCE[np.dtype(dtype)]
    # The state ends staging the next step's first units (layer 0 has two, at 27 and 26).
    assert len(state.staged_units) == depth
    for ahead, (_, _, staged_at) in enumerate(state.staged_units):
        need = unit_rows(cache.layout, state, 0, ahead, state.lengths)
        np.testing.assert_array_equal(np.asarray(staged_at), np.asarray(need))
    # What the steps wrote is the resident cache's rows, byte for byte.
    for layer in range(3):
        for slot in range(2):
            k, v = cache.read(state, layer, slot)
            np.testing.assert_array_equal(k, np.asarray(ref_k[layer, slot, : lengths[slot]]))
            np.testing.assert_array_equal(v, np.asarray(ref_v[layer, slot, : lengths[slot]]))
    # A host-side write leaves nothing staged: a staged unit may hold the rows it replaced.
    k, v = cache.read(state, 0, 0, 0, 1)
    state = cache.load(state, 0, k, v, slot=0)
    for _, _, staged_at in state.staged_units:
        assert (np.asarray(staged_at) == NOT_STAGED).all()


@pytest.mark.parametrize("batch, depth", [(24, 1), (17, 2)], ids=["24-slots", "17-slots-depth2"])
@pytest.mark.slow
def test_more_slots_than_one_units_copies_hold_walk_in_groups_equal_to_resident(
    monkeypatch, batch, depth
):
    """Past 16 slots a chip, as on a TPU, a layer walks each unit a group of slots at a
    time (24 slots: two groups of 12, a block each; 17: two of 9, the last padded, two
    blocks each): the same attention as resident, and the state ends staging the next
    step's first units of every slot."""
    from jax_tpusync.caches.pool import assembly
    from jax_tpusync.core import pool_state
    from jax_tpusync.step.host_pool import unit_rows

    def as_on(rule):
        return lambda kind, batch: rule("TPU v6 lite", batch)

    monkeypatch.setattr(assembly, "unit_slots", as_on(pool_state.unit_slots))
    monkeypatch.setattr(assembly, "unit_block_limit", as_on(pool_state.unit_block_limit))
    windows = (None, 5, 12)
    cache = make_cache(
        batch=batch, sliding_window=list(windows), prefetch_depth=depth,
        staging_bytes=unit_budget(depth, batch=batch),
    )  # fmt: skip
    group, blocks = {24: (12, 1), 17: (9, 2)}[batch]
    assert cache.spec.unit_slots == cache.layout.group_slots == group
    assert cache.layout.slot_groups == 2 and cache.layout.blocks_per_unit == blocks
    ragged = [7, 3, 0] * (batch // 3) + [7] * (batch % 3)
    steps = [(7, None), (1, None), (7, ragged), (1, None), (7, None), (1, None), (1, None)]
    state, worst, (ref_k, ref_v, lengths) = run_against_resident(
        cache, steps, windows, np.float32
    )
    assert worst <= TOLERANCE[np.dtype(np.float32)]
    assert len(state.staged_units) == depth
    for ahead, (staging, _, staged_at) in enumerate(state.staged_units):
        assert staging.shape[0] == batch
        need = unit_rows(cache.layout, state, 0, ahead, state.lengths)
        np.testing.assert_array_equal(np.asarray(staged_at), np.asarray(need))
    for slot in (0, group - 1, group, batch - 1):
        k, v = cache.read(state, 1, slot)
        np.testing.assert_array_equal(k, np.asarray(ref_k[1, slot, : lengths[slot]]))
        np.testing.assert_array_equal(v, np.asarray(ref_v[1, slot, : lengths[slot]]))


@pytest.mark.slow
def test_single_unit_layers_and_a_state_that_stays_on_the_host():
    cache = make_cache(staging_bytes=1 << 20)
    assert cache.layout.single_unit
    state, worst, _ = run_against_resident(cache, STEPS[:5], (None,) * 3, np.float32)
    assert worst <= 1e-5
    assert state.pool.sharding.memory_kind == "pinned_host"
    assert state.staging.sharding.memory_kind == "device"


@pytest.mark.parametrize("tier_dtype", ["int8"])  # The codec itself: tests of quantize.
@pytest.mark.slow
def test_quantized_pool_equals_resident_attention_over_decoded_rows(tier_dtype):
    # Quantized rows: compare against attention over the rows the pool holds, decoded.
    cache = make_cache(tier_dtype=tier_dtype)
    state, worst, (ref_k, ref_v, lengths) = run_against_resident(
        cache, STEPS[:4], (None,) * 3, np.float32
    )
    k, _ = cache.read(state, 0, 0)
    scale = float(np.max(np.abs(np.asarray(ref_k[0, 0, : lengths[0]]))))
    assert np.max(np.abs(k - np.asarray(ref_k[0, 0, : lengths[0]]))) <= 0.1 * scale
    assert worst <= 0.25


def test_load_then_decode_reads_the_loaded_rows():
    cache = make_cache()
    state = cache.init()
    rng = np.random.default_rng(1)
    context = 21
    loaded = {}
    for layer in range(3):
        for slot in range(2):
            k = rng.standard_normal((context, HEADS, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal((context, HEADS, HEAD_DIM)).astype(np.float32)
            state = cache.load(state, layer, k, v, slot=slot)
            loaded[layer, slot] = (k, v)
    np.testing.assert_array_equal(np.asarray(state.lengths), [context, context])
    k, v = cache.read(state, 2, 1, 3, 17)
    np.testing.assert_array_equal(k, loaded[2, 1][0][3:17])
    np.testing.assert_array_equal(v, loaded[2, 1][1][3:17])
    # A patch inside a block keeps the rows around it.
    patch = np.ones((2, HEADS, HEAD_DIM), np.float32)
    state = cache.load(state, 1, patch, -patch, start=9, slot=0)
    k, v = cache.read(state, 1, 0)
    np.testing.assert_array_equal(k[9:11], patch)
    np.testing.assert_array_equal(k[:9], loaded[1, 0][0][:9])
    np.testing.assert_array_equal(k[11:], loaded[1, 0][0][11:])

    q = jnp.asarray(rng.standard_normal((2, 1, Q_HEADS, HEAD_DIM)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((2, 1, HEADS, HEAD_DIM)), jnp.float32)
    out, state = jax.jit(
        lambda s: tps.prefetching_attention(q, new, new, s, layer=0), donate_argnums=0
    )(state)
    cache_k = np.zeros((2, 64, HEADS, HEAD_DIM), np.float32)
    cache_v = np.zeros_like(cache_k)
    for slot in range(2):
        cache_k[slot, :context], cache_v[slot, :context] = loaded[0, slot]
    ref, _, _ = tps.resident_attention(
        q, new, new, jnp.asarray(cache_k), jnp.asarray(cache_v), jnp.asarray([context] * 2)
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_admit_maps_a_released_prefix_and_continues_it():
    cache = make_cache(batch=2)
    state = cache.init(admit=False)
    prompt = np.arange(100, 120)
    state, cached = cache.admit(state, 0, max_tokens=32, tokens=prompt)
    assert cached == 0
    rng = np.random.default_rng(2)
    k = rng.standard_normal((20, HEADS, HEAD_DIM)).astype(np.float32)
    for layer in range(3):
        state = cache.load(state, layer, k, -k, slot=0)
    state = cache.release(state, 0, tokens=prompt)
    state, cached = cache.admit(state, 1, max_tokens=32, tokens=prompt)
    assert cached == 16  # Two full blocks of 8, at most len - 1 tokens.
    got_k, got_v = cache.read(state, 2, 1)
    np.testing.assert_array_equal(got_k, k[:16])
    np.testing.assert_array_equal(got_v, -k[:16])
    shared = r"rows \[15, 16\) of slot 1 overlap its shared prefix \[0, 16\)"
    with pytest.raises(ValueError, match=shared):
        cache.load(state, 0, k[:1], k[:1], start=15, slot=1)
    state = cache.load(state, 0, k[:1], k[:1], start=16, slot=1)  # The first private row.


def test_a_step_past_capacity_is_refused_for_its_slot_alone():
    cache = make_cache(batch=2)
    state = cache.init(admit=False)
    state, _ = cache.admit(state, 0, max_tokens=10)
    state, _ = cache.admit(state, 1, max_tokens=40)
    layout = PoolLayout(cache.spec)
    sink_before = np.array(state.pool[layout.sink_row :])
    step = decode_step(3, (None,) * 3, np.float32)
    rng = np.random.default_rng(3)

    def run(state, q_len):
        shape = (3, 2, q_len)
        qs = jnp.asarray(rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)), jnp.float32)
        ks = jnp.asarray(rng.standard_normal((*shape, HEADS, HEAD_DIM)), jnp.float32)
        return step(state, qs, ks, ks, None)[1]

    state = run(state, 10)  # Exactly slot 0's capacity: accepted.
    cache.check(state)
    np.testing.assert_array_equal(np.asarray(state.lengths), [10, 10])
    state = run(state, 1)  # One past it: refused for slot 0, slot 1 goes on.
    np.testing.assert_array_equal(np.asarray(state.lengths), [10, 11])
    np.testing.assert_array_equal(np.asarray(state.refused), [1, 0])
    assert not np.array_equal(np.array(state.pool[layout.sink_row :]), sink_before)
    with pytest.raises(ValueError, match=r"slot 0: 1 tokens of its steps were refused .*10 tokens"):
        cache.check(state)
    with pytest.raises(ValueError, match="slot 0: 1 tokens"):
        cache.release(state, 1)
    # The refused slot itself may be released (its rows up to its length are whole).
    state = cache.release(state, 0)
    cache.check(state)
    np.testing.assert_array_equal(np.asarray(state.refused), [0, 0])
    np.testing.assert_array_equal(cache.lengths(state), [0, 11])


def test_a_traced_layer_out_of_range_writes_nothing_and_is_refused():
    """Layers in lax.scan: the in-range ones decode as static ones do; a traced layer of
    -1 or num_layers writes no pool row outside the sink (it would land in another
    layer's blocks) and is refused for every active slot, as a step past capacity is."""
    cache = tps.HostPoolKVCache(
        num_layers=2, batch=2, max_len=16, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=4, dtype=jnp.float32, staging_bytes=1 << 14,
    )  # fmt: skip
    state = cache.init()
    rng = np.random.default_rng(5)
    for layer in range(2):
        rows = rng.standard_normal((2, 6, HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, layer, rows, -rows)
    q = jnp.asarray(rng.standard_normal((2, 1, Q_HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 1, HEADS, HEAD_DIM)), jnp.float32)

    @jax.jit
    def attend(state, layers):
        def body(state, layer):
            out, state = tps.prefetching_attention(q, k, k, state, layer=layer)
            return state, out

        state, outs = jax.lax.scan(body, state, layers)
        return outs, state

    state = attend(state, jnp.arange(2))[1]  # In range: one decode step.
    cache.check(state)
    np.testing.assert_array_equal(cache.lengths(state), [7, 7])
    sink = cache.layout.sink_row
    for bad in (-1, 2):
        before = np.array(state.pool[:sink])
        state = attend(state, jnp.asarray([bad], jnp.int32))[1]
        np.testing.assert_array_equal(np.array(state.pool[:sink]), before)
        np.testing.assert_array_equal(np.asarray(state.refused), [1, 1])
        with pytest.raises(ValueError, match=r"slot 0: 1 tokens .*traced layer outside \[0, 2\)"):
            cache.check(state)
        state = cache.release(cache.release(state, 0), 1)
        state, _ = cache.admit(state, 0, max_tokens=16)
        state, _ = cache.admit(state, 1, max_tokens=16)


def test_a_donated_state_is_refused():
    cache = make_cache()
    state = cache.init()
    step = decode_step(3, (None,) * 3, np.float32)
    x = jnp.zeros((3, 2, 1, Q_HEADS, HEAD_DIM), jnp.float32)
    kv = jnp.zeros((3, 2, 1, HEADS, HEAD_DIM), jnp.float32)
    step(state, x, kv, kv, None)
    with pytest.raises(ValueError, match="donated to a step"):
        cache.read(state, 0, 0)


def test_guards_name_the_argument_at_their_edges():
    with pytest.raises(ValueError, match="tier='file' without file_name: the pool is host memory"):
        make_cache(tier="file", path="/tmp")
    with pytest.raises(ValueError, match=r"prefetch_depth=0 must be an int in \[1, 64\]"):
        make_cache(prefetch_depth=0)
    assert make_cache(prefetch_depth=1).spec.prefetch_depth == 1
    assert make_cache(prefetch_depth="auto").spec.prefetch_depth == 1
    # At most num_layers units ahead (3 here): further lies the step after next.
    assert make_cache(prefetch_depth=3).spec.prefetch_depth == 3
    assert make_cache(prefetch_depth=4).spec.num_slots == 4
    row = 2 * HEADS * HEAD_DIM * 4
    smallest = 2 * 2 * 8 * row  # Two units of one block, batch 2, f32.
    make_cache(staging_bytes=smallest)
    with pytest.raises(ValueError, match=f"staging_bytes={smallest - 1} cannot hold 2 units"):
        make_cache(staging_bytes=smallest - 1)
    smallest = 3 * 2 * 8 * row  # prefetch_depth=2: three units of one block.
    assert make_cache(staging_bytes=smallest, prefetch_depth=2).spec.chunk_len == 8
    with pytest.raises(
        ValueError,
        match=rf"staging_bytes={smallest - 1} cannot hold 3 units of one block "
        rf"\(prefetch_depth=2 ahead and the one in flight\): 3 x batch 2 x block_tokens 8 x "
        rf"{row} bytes per token row \(K and V\) = {smallest} bytes at least",
    ):
        make_cache(staging_bytes=smallest - 1, prefetch_depth=2)
    cache = make_cache()
    state = cache.init(admit=False)
    state, _ = cache.admit(state, 0, max_tokens=16)
    rows = np.zeros((16, HEADS, HEAD_DIM), np.float32)
    for layer in range(3):  # Up to the capacity exactly, in every layer.
        state = cache.load(state, layer, rows, rows, slot=0)
    with pytest.raises(
        ValueError, match=r"start \+ lengths = 17 of slot 0 would overflow its capacity of 16"
    ):
        cache.load(state, 0, rows, rows, start=1, slot=0)
    with pytest.raises(ValueError, match="layer=3 is out of range for a cache of 3 layers"):
        cache.load(state, 3, rows, rows, slot=0)
    with pytest.raises(ValueError, match="k has dtype float64"):
        cache.load(state, 0, rows.astype(np.float64), rows, slot=0)
    with pytest.raises(ValueError, match=r"\[start, stop\) = \[0, 17\) must lie in \[0, 16\]"):
        cache.read(state, 0, 0, 0, 17)
    cache.read(state, 0, 0, 0, 16)
    with pytest.raises(ValueError, match="init\\(\\) was called already"):
        cache.init()


def test_units_hold_no_more_blocks_than_the_tpu_overlaps_copies():
    from jax_tpusync.caches.pool.assembly import pool_spec
    from jax_tpusync.core.config import CacheConfig
    from jax_tpusync.core.pool_state import (
        HOST_COPIES_IN_FLIGHT,
        unit_block_limit,
        unit_copies,
        unit_slots,
    )

    # On every TPU a unit's copies (a block and a tail per slot) fit the compiler's copies
    # in flight: 32 for one slot is 31 blocks, for two 15, for 16 slots one block.
    assert HOST_COPIES_IN_FLIGHT == 32
    for kind in ("TPU v5 lite", "TPU v6 lite", "TPU7x"):
        for batch in (1, 2, 3, 4, 8, 16):
            blocks = unit_block_limit(kind, batch)
            assert unit_copies(batch, blocks) <= HOST_COPIES_IN_FLIGHT
            assert unit_copies(batch, blocks + 1) > HOST_COPIES_IN_FLIGHT
    assert unit_block_limit("TPU v6 lite") == 31 and unit_block_limit("TPU v5 lite", 2) == 15
    assert unit_block_limit("TPU7x", 16) == 1
    # Past 16 slots a unit's copies are a group's of at most 16 slots (unit_slots): the
    # fewest groups, as even as they go, each group's unit within the copies in flight.
    for batch in (17, 24, 31, 32, 33, 48, 64, 100):
        slots = unit_slots("TPU7x", batch)
        groups = -(-batch // slots)
        assert slots <= 16 and groups == -(-batch // 16) and groups * slots - batch < groups
        blocks = unit_block_limit("TPU7x", batch)
        assert unit_copies(slots, blocks) <= HOST_COPIES_IN_FLIGHT
        assert unit_copies(slots, blocks + 1) > HOST_COPIES_IN_FLIGHT
    assert [unit_slots("TPU v5 lite", b) for b in (16, 17, 24, 32, 33)] == [16, 9, 12, 16, 11]
    assert unit_block_limit("TPU7x", 17) == 2 and unit_block_limit("TPU7x", 64) == 1
    assert unit_slots("cpu", 64) == 64 and unit_slots("TPU7x", 1) == 1
    with pytest.raises(ValueError, match=r"batch=0 must be at least 1"):
        unit_slots("cpu", 0)
    assert unit_block_limit("cpu") == unit_block_limit("cpu", 8) == 30
    with pytest.raises(ValueError, match=r"batch=0 must be at least 1"):
        unit_block_limit("TPU7x", 0)
    # Staging for 40 blocks a unit: the limit decides (off TPUs, 30 blocks).
    def config(batch, depth=1):
        return CacheConfig.from_kwargs(
            num_layers=2, batch=batch, max_len=4096, num_kv_heads=HEADS, head_dim=HEAD_DIM,
            block_tokens=8, dtype=jnp.float32, prefetch_depth=depth,
            staging_bytes=(depth + 1) * batch * 40 * 8 * 2 * HEADS * HEAD_DIM * 4,
        )  # fmt: skip

    assert pool_spec(config(1), device_kind="cpu").chunk_len == 30 * 8
    assert pool_spec(config(1), device_kind="TPU v6 lite").chunk_len == 31 * 8
    assert pool_spec(config(2), device_kind="TPU v6 lite").chunk_len == 15 * 8
    assert pool_spec(config(4), device_kind="TPU v5 lite").chunk_len == 7 * 8
    # Two units ahead: a loop iteration still starts one unit's copies, the same limit.
    assert pool_spec(config(1, 2), device_kind="cpu").chunk_len == 30 * 8
    # Past 16 slots the spec names the group a unit's copies cover (0: every slot).
    wide = pool_spec(config(24), device_kind="TPU v6 lite")
    assert wide.unit_slots == 12 and wide.chunk_len == 8
    assert pool_spec(config(16), device_kind="TPU v6 lite").unit_slots == 0
    assert pool_spec(config(17), device_kind="TPU7x").chunk_len == 2 * 8
    assert pool_spec(config(24), device_kind="cpu").unit_slots == 0
    assert pool_spec(config(2, 2), device_kind="TPU v6 lite").chunk_len == 15 * 8


def test_the_host_pool_keeps_the_cache_protocol_and_answers_as_the_others():
    from jax_tpusync.caches.protocol import KVCache, mismatches

    assert mismatches(tps.HostPoolKVCache) == []
    cache = make_cache(num_layers=2, batch=2, max_len=32, staging_bytes=1 << 20)
    assert isinstance(cache, KVCache)
    state = cache.init(admit=False)
    np.testing.assert_array_equal(cache.lengths(state), [0, 0])
    assert cache.lengths(state).dtype == np.int32
    state, cached = cache.admit(state, 1, max_tokens=16, tokens=np.arange(10))
    assert cached == 0
    rows = np.ones((5, HEADS, HEAD_DIM), np.float32)
    state = cache.load(state, 0, rows, rows, slot=1)
    np.testing.assert_array_equal(cache.lengths(state), [0, 0])  # Layer 1 has none yet.
    state = cache.load(state, 1, rows, rows, slot=1)
    np.testing.assert_array_equal(cache.lengths(state), [0, 5])
    before = cache.capacity
    with pytest.raises(ValueError, match="active"):
        cache.admit(state, 1, max_tokens=16)
    np.testing.assert_array_equal(cache.capacity, before)
    reservation = cache.reserve(0, 8)
    cache.cancel(reservation)
    np.testing.assert_array_equal(cache.capacity, before)
    k, _ = cache.read(state, 0, 1)
    np.testing.assert_array_equal(k, rows)
    assert cache.publish_windows(state, 1) == 0
    state = cache.commit(state)
    state = cache.release(state, 1)
    np.testing.assert_array_equal(cache.lengths(state), [0, 0])
    assert cache.kv_bytes > 0 and cache.committed_lengths is None
    inert = cache.inert_state()
    np.testing.assert_array_equal(np.asarray(inert.capacity), [0, 0])
    with pytest.raises(ValueError, match="cannot recover a state lost with a failed step"):
        cache.recover()
    cache.close(state)
    with pytest.raises(ValueError, match="this cache is closed"):
        cache.lengths(state)


def test_a_whole_batch_load_is_ragged_and_refused_whole():
    cache = make_cache(num_layers=1, batch=2, max_len=32)
    state = cache.init()
    rng = np.random.default_rng(7)
    k = rng.standard_normal((2, 12, HEADS, HEAD_DIM)).astype(np.float32)
    state = cache.load(state, 0, k, -k, start=[0, 4], lengths=[12, 3])
    np.testing.assert_array_equal(cache.lengths(state), [12, 7])
    got, neg = cache.read(state, 0, 1, 4, 7)
    np.testing.assert_array_equal(got, k[1, :3])
    np.testing.assert_array_equal(neg, -k[1, :3])
    # One slot past its capacity refuses the whole call: slot 0's rows do not change.
    with pytest.raises(ValueError, match="start \\+ lengths = 33 of slot 1 would overflow"):
        cache.load(state, 0, k * 0, k * 0, start=[0, 21], lengths=[12, 12])
    np.testing.assert_array_equal(cache.read(state, 0, 0)[0], k[0])


def test_a_config_instead_of_keywords_and_not_beside_them():
    from jax_tpusync.core.config import CacheConfig

    config = CacheConfig.from_kwargs(
        num_layers=2, batch=1, max_len=32, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=8, dtype=jnp.float32,
    )  # fmt: skip
    cache = tps.HostPoolKVCache(config)
    assert cache.spec == tps.HostPoolKVCache(**cache_keywords(config)).spec
    with pytest.raises(ValueError, match="batch given with config="):
        tps.HostPoolKVCache(config, batch=2)


def cache_keywords(config):
    from jax_tpusync.core.config import to_kwargs

    return to_kwargs(config)
