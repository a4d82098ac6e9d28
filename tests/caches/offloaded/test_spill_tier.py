"""Two-level store: cached prefix blocks demoted from DRAM to a file tier under pressure,
read in place by the step, promoted back after repeated use; writes stay in DRAM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.runtime import backend

H, QH, D, BT, NB = 2, 4, 8, 4, 8  # KV heads, query heads, head size, block tokens, DRAM blocks
LAYERS = 2


def _args(tmp_path, **kw):
    args = dict(
        num_layers=LAYERS,
        batch=2,
        max_len=32,
        num_kv_heads=H,
        head_dim=D,
        dtype=jnp.float32,
        block_tokens=BT,
        num_blocks=NB,
        spill_path=tmp_path,
        spill_blocks=8,
        # 6-token units: units straddle blocks, and the tiers, within one fetch.
        staging_bytes=2 * 2 * 2 * 6 * H * D * 4,
    )
    args.update(kw)
    return args


def _cache(tmp_path, **kw):
    return tps.OffloadedKVCache(**_args(tmp_path, **kw))


def _kv(tokens, layer):
    """KV a model would compute for ``tokens`` (the same ids give the same rows): [2, n, H, D]."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    k = np.cos(t * 0.29 + np.arange(H * D, dtype=np.float32).reshape(1, H, D) * 0.07 + layer)
    return np.stack([k, 2 * k])


def _prefill(cache, state, slot, tokens, start):
    for layer in range(LAYERS):
        kv = np.zeros((2, 2, len(tokens) - start, H, D), np.float32)
        kv[:, slot] = _kv(tokens[start:], layer)
        counts = [len(tokens) - start if b == slot else 0 for b in range(2)]
        starts = [start if b == slot else 0 for b in range(2)]
        state = cache.load(state, layer, kv[0], kv[1], start=starts, lengths=counts)
    return state


def _assert_rows(got, want, tier_dtype=None):
    """KV read back: the bytes written, or within int8's rounding of them (quantized)."""
    if tier_dtype is None:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, atol=2.0 / 127)  # |KV| <= 2: one int8 step.


@jax.jit
def _qkv(x, layer):
    q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], 1, QH, D)) * (layer + 1)
    return q, q[:, :, :H] * 0.5, -q[:, :, :H]


def _step():
    def step(x, state):
        outs = []
        for layer in range(LAYERS):
            q, k, v = _qkv(x, layer)
            o, state = tps.prefetching_attention(q, k, v, state, layer=layer)
            outs.append(o)
        return outs, state

    return jax.jit(step, donate_argnums=(1,))


def _decode_matches_resident(cache, state, steps=3):
    """Runs ``steps`` decode steps, each compared with the resident attention over the KV
    that ``read_all`` finds through the tables before it; returns the state."""
    step = _step()
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = jnp.asarray(rng.standard_normal((2, 1, D)), jnp.float32)
        lengths = np.asarray(state.lengths)
        want = []
        for layer in range(LAYERS):
            k_all, v_all = cache.read_all(layer, lengths)
            q, k, v = _qkv(x, layer)
            out, _, _ = tps.resident_attention(
                q, k, v, jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(lengths)
            )
            want.append(np.asarray(out))
        outs, state = step(x, state)
        active = lengths > 0
        for layer in range(LAYERS):
            np.testing.assert_allclose(
                np.asarray(outs[layer])[active], want[layer][active], atol=1e-5
            )
    return cache.drain(state)


DOC = list(range(200, 212))  # 12 tokens: 3 full blocks.


def _cache_doc_then_press(cache, state):
    """Slot 0 writes DOC's KV and releases it (3 cached DRAM blocks), then a sequence
    taking every DRAM block comes and goes: the cached blocks must move to make room."""
    state, _ = cache.admit(state, 0, tokens=DOC, max_tokens=16)
    state = _prefill(cache, state, 0, DOC, 0)
    state = cache.release(state, 0, tokens=DOC)
    state, _ = cache.admit(state, 0, max_tokens=NB * BT)  # All 8 DRAM blocks.
    assert cache.prefix_stats["demoted"] == 3
    return cache.release(state, 0)


@pytest.mark.parametrize("tier_dtype", [None, "int8"])
@pytest.mark.parametrize("read_in_place", ["auto", False], ids=["landed", "staged"])
def test_demoted_prefix_blocks_are_read_in_place_from_the_spill_tier(
    tmp_path, tier_dtype, read_in_place
):
    """Units that straddle the tiers: attended where the spill fetch landed and the DRAM
    rows lie (CPU backend's default), or copied into staging from both."""
    kw = dict(promote_after=None, tier_dtype=tier_dtype, read_in_place=read_in_place)
    with _cache(tmp_path, **kw) as cache:
        landing = read_in_place == "auto" and backend.in_place_blocker() is None
        assert cache.spec.attends_landed == landing
        state = _cache_doc_then_press(cache, cache.init(admit=False))
        assert cache.prefix_stats["spill_free_blocks"] == 8 - 3
        tokens = DOC + [5, 6, 7]
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=24)
        assert cached == 12
        table = cache.block_tables[1]
        assert (table[:3] >= NB).all() and (table[3:6] < NB).all()  # Shared: spill; own: DRAM.
        state = _prefill(cache, state, 1, tokens, cached)
        other = [1, 2, 3, 4, 5, 6, 7]  # Slot 0: a private sequence, DRAM only.
        state, _ = cache.admit(state, 0, tokens=other, max_tokens=12)
        state = _prefill(cache, state, 0, other, 0)
        for layer in range(LAYERS):  # The demoted rows, byte for byte (read through spill ids).
            k, v = cache.read(state, layer, 1)
            _assert_rows(np.stack([k, v]), _kv(tokens, layer), tier_dtype)
        runs = cache.tier_runs(0, 0, 1, 0, 15)
        assert [t for t, _, _ in runs] == [int(cache.target[4]), cache.tier]
        with pytest.raises(ValueError, match="include blocks on the spill tier: use tier_runs"):
            cache.tier_rows(0, 0, 1, 0, 15)

        spill_tier = int(cache.target[4])
        before = cache.engine.stats()["tiers"][spill_tier]["fetch"]["bytes"]
        state = _decode_matches_resident(cache, state)
        fetched = cache.engine.stats()["tiers"][spill_tier]["fetch"]["bytes"] - before
        landed = cache.engine.stats()["landed_reads"]
        assert (landed > 0) == cache.spec.attends_landed
        # 3 steps x 2 layers x K|V x 12 shared rows, each unit read once (some twice: the
        # last layer's cross-step prefetch is retired by the host's drain).
        row = H * D * 4
        assert fetched >= 3 * LAYERS * 2 * 12 * row
        assert cache.prefix_stats["promoted"] == 0
        for layer in range(LAYERS):  # Decode wrote its own blocks only.
            k, v = cache.read(state, layer, 1, 0, 15)
            _assert_rows(np.stack([k, v]), _kv(tokens, layer), tier_dtype)
        assert np.asarray(state.lengths).tolist() == [10, 18]


def test_a_spill_block_is_promoted_at_its_promote_after_th_admission(tmp_path):
    with _cache(tmp_path, promote_after=2) as cache:
        state = _cache_doc_then_press(cache, cache.init(admit=False))
        tokens = DOC + [9]
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=16)  # First: stays.
        assert cached == 12 and (cache.block_tables[1, :3] >= NB).all()
        state = cache.release(state, 1, tokens=tokens[:cached])
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=16)  # Second: moves.
        assert cached == 12
        assert (cache.block_tables[1, :3] < NB).all()
        stats = cache.prefix_stats
        assert (
            stats["promoted"] == 3 and stats["spill_free_blocks"] == 8 and stats["spill_hits"] == 6
        )
        for layer in range(LAYERS):
            k, v = cache.read(state, layer, 1)
            np.testing.assert_array_equal(np.stack([k, v]), _kv(DOC, layer))
        state = _prefill(cache, state, 1, tokens, cached)
        _decode_matches_resident(cache, state, steps=1)


def test_a_block_mapped_by_another_slot_is_not_promoted(tmp_path):
    with _cache(tmp_path, promote_after=1) as cache:
        state = _cache_doc_then_press(cache, cache.init(admit=False))
        cache.slots.mover.promote_after = None
        state, _ = cache.admit(state, 0, tokens=DOC, max_tokens=16)  # Maps the spill blocks.
        cache.slots.mover.promote_after = 1
        state, cached = cache.admit(state, 1, tokens=DOC, max_tokens=16)
        assert cached == 8  # The prompt's last block is computed, not mapped.
        # Both slots map blocks 0 and 1: moving them would change slot 0's live table.
        assert (cache.block_tables[:, :2] >= NB).all()
        assert cache.prefix_stats["promoted"] == 0
        state = cache.release(state, 0)  # Slot 1 is their only user now, at its next admission.
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 1, tokens=DOC, max_tokens=16)
        assert cached == 8 and (cache.block_tables[1, :2] < NB).all()
        assert cache.prefix_stats["promoted"] == 2


def test_the_spill_tier_evicts_its_least_recent_blocks_and_keeps_the_prefix_head(tmp_path):
    with _cache(tmp_path, spill_blocks=2, promote_after=None) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=DOC, max_tokens=16)
        state = _prefill(cache, state, 0, DOC, 0)
        state = cache.release(state, 0, tokens=DOC)
        state, _ = cache.admit(state, 0, max_tokens=NB * BT)
        stats = cache.prefix_stats
        # The tail block went first (to the spill tier, then out of it for the head).
        assert stats["demoted"] == 3 and stats["indexed_blocks"] == 2 and stats["evictions"] == 1
        state = cache.release(state, 0)
        state, cached = cache.admit(state, 1, tokens=DOC + [1], max_tokens=16)
        assert cached == 8
        for layer in range(LAYERS):
            k, v = cache.read(state, layer, 1)
            np.testing.assert_array_equal(np.stack([k, v]), _kv(DOC[:8], layer))


def test_pinned_blocks_are_never_moved_and_a_full_store_is_refused(tmp_path):
    with _cache(tmp_path) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=DOC, max_tokens=16)
        state = _prefill(cache, state, 0, DOC, 0)
        state = cache.release(state, 0, tokens=DOC)
        state, cached = cache.admit(state, 0, tokens=DOC + [3], max_tokens=16)  # Pins 3.
        table = cache.block_tables[0].copy()
        with pytest.raises(ValueError, match=r"needs 5 KV blocks but only 4 of 8 are free"):
            cache.admit(state, 1, max_tokens=20)
        np.testing.assert_array_equal(cache.block_tables[0], table)
        assert cache.prefix_stats["demoted"] == 0


def _spilled_state(cache):
    """Slot 1 at length 12 on 3 spill blocks (and its own DRAM block 3 next); slot 0 empty."""
    state = _cache_doc_then_press(cache, cache.init(admit=False))
    state, cached = cache.admit(state, 1, tokens=DOC + [1], max_tokens=16)
    assert cached == 12
    return state


def _run_with_table_entry(cache, position_block: int, block: int, refused: bool):
    """One decode step with slot 1's table entry ``position_block`` set to ``block``: it
    runs, or (``refused``) the engine refuses it by name before any byte moves; returns
    the cache's live state after it."""
    state = _spilled_state(cache)
    state = state.replace(block_table=state.block_table.at[1, position_block].set(block))
    x = jnp.ones((2, 1, D), jnp.float32)
    if not refused:
        _, state = _step()(x, state)
        return cache.drain(state)
    with pytest.raises(
        Exception, match=r"block -4: a position whose KV block is on the other level"
    ):
        jax.block_until_ready(_step()(x, state))
    return cache.recover()


@pytest.mark.parametrize("block, refused", [(NB - 1, False), (NB, True)])
def test_a_write_back_into_a_spill_block_is_refused_at_the_first_spill_id(tmp_path, block, refused):
    # Slot 1 writes position 12, its 4th block: pointed at DRAM's last id / spill's first.
    with _cache(tmp_path, promote_after=None) as cache:
        state = _run_with_table_entry(cache, 3, block, refused)
        if refused:
            assert np.asarray(state.lengths).tolist() == [0, 12]
        for layer in range(LAYERS):  # The shared rows on the spill tier, untouched.
            k, v = cache.read(state, layer, 1, 0, 12)
            np.testing.assert_array_equal(np.stack([k, v]), _kv(DOC, layer))


@pytest.mark.parametrize("block, refused", [(NB + 7, False), (NB + 8, True)])
def test_a_fetch_of_an_id_past_the_spill_tier_is_refused(tmp_path, block, refused):
    # Position 0 of slot 1 read through spill's last id (a readable block) / one past it.
    with _cache(tmp_path, promote_after=None) as cache:
        state = _run_with_table_entry(cache, 0, block, refused)
        if not refused:
            assert np.asarray(state.lengths).tolist() == [0, 13]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(spill_path=None), r"spill_blocks=8 needs spill_path=<directory>"),
        (
            dict(tier="file"),
            r"spill_path puts a file tier behind the DRAM tier: it needs tier='host'",
        ),
        (dict(shm_name="tps-spill-test"), r"a two-level cache \(spill_path\) does not persist"),
        (dict(resident=True), r"resident=True keeps every block on device: it takes no spill_path"),
        (dict(spill_blocks=0), r"spill_blocks=0 must be a positive int"),
        (dict(promote_after=0), r"promote_after=0 must be an int >= 1 or None"),
    ],
)
def test_spill_arguments_are_checked(tmp_path, kw, message):
    if kw.get("tier") == "file":
        kw["path"] = tmp_path
    with pytest.raises(ValueError, match=message):
        _cache(tmp_path, **kw)


def test_a_mesh_two_level_cache_is_refused(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    with pytest.raises(
        ValueError, match=r"spill_path \(a two-level cache\) is not supported on a mesh"
    ):
        tps.kv_cache(**_args(tmp_path), mesh=mesh, kv_heads_axis="model")


def test_resident_auto_streams_a_two_level_cache(tmp_path):
    with _cache(tmp_path, resident="auto", staging_bytes=64 << 20) as cache:
        assert not cache.spec.resident and cache.spec.spill_blocks == 8


def test_a_restarted_two_level_cache_warms_up_from_its_shared_directory(tmp_path):
    shared = tmp_path / "blocks"
    with _cache(tmp_path, shared_prefix_dir=shared, promote_after=None) as cache:
        state = _cache_doc_then_press(cache, cache.init(admit=False))
        for f in shared.iterdir():  # Published from DRAM; again below from the spill tier.
            f.unlink()
        tokens = DOC + [1]
        state, cached = cache.admit(state, 1, tokens=tokens, max_tokens=16)
        assert cached == 12 and (cache.block_tables[1, :3] >= NB).all()
        state = cache.release(state, 1, tokens=tokens[:12])
        assert cache.prefix_stats["shared_published"] == 6 and len(list(shared.iterdir())) == 3
    with _cache(tmp_path, shared_prefix_dir=shared) as restarted:
        state = restarted.init(admit=False)
        state, cached = restarted.admit(state, 0, tokens=DOC + [4], max_tokens=16)
        assert cached == 12 and restarted.prefix_stats["shared_imported"] == 3
        for layer in range(LAYERS):
            k, v = restarted.read(state, layer, 0)
            np.testing.assert_array_equal(np.stack([k, v]), _kv(DOC, layer))
