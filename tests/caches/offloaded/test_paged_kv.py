"""Paged KV: block tables, the slot lifecycle, and guards at exactly their edges.

Every decode here is checked against ``resident_attention`` over the same tokens, and every
guard by the message it raises and by the tier bytes it leaves unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import blocks

KV_HEADS, Q_HEADS, HEAD_DIM = 2, 4, 8


def _cache(tier="host", tmp_path=None, **kw):
    """A small paged cache; ``tier="host-in-place"`` reads its host tier in place, every
    other host cache streams through staging (the path whose prefetches are counted)."""
    in_place = tier == "host-in-place"
    tier = "host" if in_place else tier
    args = dict(
        num_layers=2,
        batch=2,
        max_len=32,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        tier=tier,
        block_tokens=4,
        staging_bytes=1 << 20,
        read_in_place=in_place,
        prefetch_depth=1,  # The staging sizes below count 2 slots.
    )
    if tier == "file":
        args["path"] = tmp_path
    args.update(kw)
    return tps.OffloadedKVCache(**args)


def _step(layers, q_len=1):
    """A jitted step: every layer's q/k/v from x; returns (outs per layer, state)."""

    def step(x, state):
        outs = []
        for layer in range(layers):
            q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], q_len, Q_HEADS, HEAD_DIM))
            q = q * (layer + 1)
            k = q[:, :, :KV_HEADS] * 0.5
            v = -q[:, :, :KV_HEADS]
            o, state = tps.prefetching_attention(q, k, v, state, layer=layer)
            outs.append(o)
        return outs, state

    return jax.jit(step, donate_argnums=(1,))


def _reference(cache, lengths_before, x, q_len=1):
    """Outputs of the same step over the tier's KV, slot by slot (resident_attention)."""
    spec = cache.spec
    outs = []
    for layer in range(spec.num_layers):
        k_all, v_all = cache.read_all(layer, lengths_before)
        q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], q_len, Q_HEADS, HEAD_DIM)) * (layer + 1)
        k = q[:, :, :KV_HEADS] * 0.5
        v = -q[:, :, :KV_HEADS]
        out, _, _ = tps.resident_attention(
            q, k, v, jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(lengths_before)
        )
        outs.append(np.asarray(out))
    return outs


def _fill(cache, state, lengths, seed=0):
    rng = np.random.default_rng(seed)
    n = max(max(lengths), 1)
    for layer in range(cache.spec.num_layers):
        kv = rng.standard_normal((2, cache.spec.batch, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, layer, kv[0], kv[1], lengths=lengths)
    return state


def _lengths(state):
    return np.asarray(state.lengths).tolist()


# -- layout -----------------------------------------------------------------------------------


def test_init_gives_every_slot_consecutive_blocks():
    with _cache() as cache:
        cache.init()
        np.testing.assert_array_equal(cache.block_tables, np.arange(16).reshape(2, 8))
        np.testing.assert_array_equal(cache.capacity, [32, 32])
        assert cache.free_blocks == 0


def test_block_tokens_must_be_a_power_of_two():
    for bad in (0, 3, 12, -4, 2.0):
        with pytest.raises(ValueError, match=rf"block_tokens={bad!r} must be a power of two"):
            _cache(block_tokens=bad)


def test_the_default_block_fits_a_short_max_len():
    with _cache(block_tokens=None, max_len=20) as cache:
        assert cache.spec.block_tokens == 32  # The power of two at or above max_len.
    with _cache(block_tokens=None, max_len=5000) as cache:
        assert cache.spec.block_tokens == 256


@pytest.mark.parametrize("tier", ("host", "host-in-place", "file"))
def test_decode_through_fragmented_tables_matches_resident(tier, tmp_path):
    """Slots whose blocks interleave (0: blocks 1, 3, 5, ...; 1: 0, 2, 4, ...) decode
    across block boundaries, with units of 3 tokens (several per block, straddling them)."""
    unit_bytes = 2 * 2 * 2 * 3 * KV_HEADS * HEAD_DIM * 4  # 2 slots x K,V x batch x 3 rows.
    with _cache(tier, tmp_path, staging_bytes=unit_bytes, num_blocks=16) as cache:
        assert cache.spec.chunk_len == 3
        # Interleaved tables (slot 0: blocks 1, 3, 5, ...; slot 1: 0, 2, 4, ...), set up
        # host-side as an allocator with a fragmented history would leave them.
        cache.slots.place(0, np.arange(1, 16, 2), 32)
        cache.slots.place(1, np.arange(0, 16, 2), 32)
        state = cache.init(admit=False)
        lengths = [9, 6]
        state = _fill(cache, state, lengths)
        step = _step(2)
        x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 1, HEAD_DIM)), jnp.float32)
        for i in range(5):  # Crosses the block boundaries at 12 and 8.
            before = _lengths(state)
            want = _reference(cache, before, x)
            outs, state = step(x, state)
            for layer in range(2):
                np.testing.assert_allclose(np.asarray(outs[layer]), want[layer], atol=1e-5)
            assert _lengths(state) == [b + 1 for b in before]
            state = cache.drain(state)  # read_all reads the tier: no write may be in flight.
        used = "in_place_reads" if tier == "host-in-place" else "prefetch_hits"
        assert cache.engine.stats()[used] > 0


def test_consecutive_blocks_are_one_segment():
    """A unit of a slot with consecutive blocks is fetched as one segment per K|V."""
    with _cache(batch=1, block_tokens=4, max_len=64, staging_bytes=1 << 20) as cache:
        state = _fill(cache, cache.init(), [40])
        cache.engine.reset_stats()
        outs, state = _step(2)(jnp.ones((1, 1, HEAD_DIM), jnp.float32), state)
        jax.block_until_ready(state)
        fetch = cache.engine.stats()["tiers"][cache.tier]["fetch"]
        # Each fetch reads a unit of 10-11 blocks of K and of V: one segment each.
        assert fetch["requests"] > 0 and fetch["segments"] == 2 * fetch["requests"], fetch
        cache.drain(state)


# -- slot lifecycle ---------------------------------------------------------------------------


def test_admit_release_and_reuse():
    with _cache(num_blocks=10) as cache:
        state = cache.init(admit=False)
        assert cache.capacity.tolist() == [0, 0]
        state, cached = cache.admit(state, 0, max_tokens=17)  # 5 blocks of 4.
        assert cached == 0 and cache.capacity.tolist() == [17, 0] and cache.free_blocks == 5
        state, _ = cache.admit(state, 1, max_tokens=20)  # The other 5.
        with pytest.raises(ValueError, match="slot 1 is active .* release it"):
            cache.admit(state, 1)
        state = _fill(cache, state, [3, 7])
        state = cache.release(state, 0)
        assert _lengths(state) == [0, 7] and cache.free_blocks == 5
        with pytest.raises(ValueError, match="slot 0 is not active"):
            cache.release(state, 0)
        with pytest.raises(ValueError, match="needs 6 KV blocks but only 5 of 10 are free"):
            cache.admit(state, 0, max_tokens=24)
        state, _ = cache.admit(state, 0, max_tokens=20)  # Reuses the released blocks.
        assert _lengths(state) == [0, 7]
        k, _ = cache.read(state, 0, 1)
        assert k.shape == (7, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("bad", [-1, 2, 1.0, None])
def test_admit_and_release_name_a_bad_slot(bad):
    with _cache() as cache:
        state = cache.init(admit=False)
        with pytest.raises(ValueError, match=rf"slot={bad!r} must be an int in \[0, batch=2\)"):
            cache.admit(state, bad)
        with pytest.raises(ValueError, match=rf"slot={bad!r} must be an int"):
            cache.release(state, bad)


@pytest.mark.parametrize("bad", [0, 33, -1, 4.5])
def test_admit_names_a_bad_max_tokens(bad):
    with _cache() as cache:
        state = cache.init(admit=False)
        with pytest.raises(ValueError, match=rf"max_tokens={bad!r} must be an int in \[1, max_len=32\]"):
            cache.admit(state, 0, max_tokens=bad)


def test_init_refuses_when_every_slot_cannot_be_admitted():
    with _cache(num_blocks=15) as cache:
        with pytest.raises(ValueError, match="needs 16 KV blocks, but 15 of 15 are free; call init"):
            cache.init()
        state = cache.init(admit=False)
        with pytest.raises(ValueError, match=r"lengths\[1\]=1 must be in \[0, 0\] .*inactive"):
            cache.init([0, 1], admit=False)
        cache.drain(state)


def test_an_inactive_slot_moves_no_bytes_and_keeps_its_length():
    with _cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, max_tokens=12)
        state = _fill(cache, state, [0, 5])
        cache.engine.reset_stats()
        x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, HEAD_DIM)), jnp.float32)
        want = _reference(cache, [0, 5], x)
        outs, state = _step(2)(x, state)
        assert _lengths(state) == [0, 6]
        for layer in range(2):  # Slot 0 attends to its new token alone; slot 1 to all 6.
            np.testing.assert_allclose(np.asarray(outs[layer]), want[layer], atol=1e-5)
        state = cache.drain(state)
        cache.engine.drain()
        wrote = cache.engine.stats()["tiers"][cache.tier]["write_back"]["bytes"]
        assert wrote == 2 * 2 * KV_HEADS * HEAD_DIM * 4  # 2 layers x (K, V) x one row of slot 1.


# -- guards at their edges ----------------------------------------------------------------------


@pytest.mark.parametrize("tier", ("host", "file"))
def test_a_write_past_capacity_is_refused_before_any_byte(tier, tmp_path):
    """max_tokens=6 (two 4-token blocks, the second half used): length 5 takes one more
    token, length 6 is refused, naming the slot, its length and its capacity; the block's
    unused rows past the capacity and the neighbour's blocks stay as they were."""
    with _cache(tier, tmp_path, num_blocks=8) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=6)
        state, _ = cache.admit(state, 1, max_tokens=8)
        state = _fill(cache, state, [5, 2])
        step = _step(2)
        x = jnp.ones((2, 1, HEAD_DIM), jnp.float32)
        outs, state = step(x, state)  # 5 -> 6: the last row of its capacity.
        assert _lengths(state) == [6, 3]
        state = cache.drain(state)
        before = [cache.read_all(layer) for layer in range(2)]
        raw_before = _raw_blocks(cache)
        with pytest.raises(Exception, match="slot 0 holds 6 tokens and cannot take 1 more: its capacity is 6 tokens; nothing was written"):
            jax.block_until_ready(step(x, state))
        for layer in range(2):
            for a, b in zip(before[layer], cache.read_all(layer)):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(raw_before, _raw_blocks(cache))  # Rows past capacity too.


def _raw_blocks(cache):
    """Every byte of the cache's tier blocks."""
    spec = cache.spec
    n = 2 * spec.num_layers * spec.num_blocks * spec.block_bytes
    out = np.zeros(n, np.uint8)
    cache.engine.wait(
        cache.engine.submit_read(cache.tier, [(cache.first_block * spec.block_bytes, 0, n)], out)
    )
    return out


def test_a_prefill_chunk_is_guarded_against_the_slot_capacity():
    with _cache(num_blocks=8) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, max_tokens=7)
        state = _fill(cache, state, [0, 4])
        x = jnp.ones((2, 3, HEAD_DIM), jnp.float32)
        outs, state = _step(2, q_len=3)(x, state)  # 4 + 3 = 7: fills it exactly.
        assert _lengths(state) == [0, 7]
        with pytest.raises(Exception, match="slot 1 holds 7 tokens and cannot take 3 more: its capacity is 7"):
            jax.block_until_ready(_step(2, q_len=3)(x, state))


def test_load_is_guarded_against_the_slot_capacity():
    with _cache(num_blocks=8) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=5)
        kv = np.zeros((2, 6, KV_HEADS, HEAD_DIM), np.float32)
        state = cache.load(state, 0, kv[:, :5], kv[:, :5], lengths=[5, 0])  # The edge: fits.
        with pytest.raises(ValueError, match="start \\+ lengths = 6 of slot 0 would overflow its capacity of 5 tokens"):
            cache.load(state, 0, kv, kv, lengths=[6, 0])
        with pytest.raises(ValueError, match="of slot 1 would overflow its capacity of 0 tokens .*admit it first"):
            cache.load(state, 0, kv, kv, lengths=[0, 1])


def test_load_never_changes_another_slots_length():
    with _cache(max_len=64) as cache:
        state = _fill(cache, cache.init(), [10, 0])
        assert _lengths(state) == [10, 0]
        kv = np.ones((2, 50, KV_HEADS, HEAD_DIM), np.float32)
        for layer in range(2):
            state = cache.load(state, layer, kv, kv, lengths=[0, 50])
        assert _lengths(state) == [10, 50]
        cache.drain(state)


def test_a_row_past_its_block_is_refused_by_the_engine():
    """The engine checks each row against the block it names: a row from the last row of a
    block that reaches one row into the next block is refused, and the exact fit passes."""
    from jax_tpusync.runtime import ops

    with _cache(batch=1, num_blocks=8) as cache:
        spec = cache.spec
        row = spec.row_bytes
        src = jnp.zeros((2 * row,), jnp.uint8)

        def write(offset_rows, rows):
            seg = jnp.asarray([[1, offset_rows * row, 0, rows * row]], jnp.int32)
            jax.block_until_ready(
                ops.write_back(
                    cache.engine.id,
                    cache.tier,
                    src,
                    seg,
                    jnp.zeros(2, jnp.int32),
                    regions=spec.regions,
                    first_block=cache.first_block,
                )
            )
            cache.engine.drain()

        write(3, 1)  # The block's last row.
        write(2, 2)
        with pytest.raises(Exception, match=f"runs past the end of its {spec.block_bytes}-byte KV block"):
            write(3, 2)


# -- read ---------------------------------------------------------------------------------------


def test_read_a_range_of_one_slot():
    with _cache() as cache:
        rng = np.random.default_rng(3)
        state = cache.init()
        k = rng.standard_normal((2, 10, KV_HEADS, HEAD_DIM)).astype(np.float32)
        for layer in range(2):  # Lengths count rows every layer holds.
            state = cache.load(state, layer, k * (layer + 1), -k, lengths=[10, 4])
        got_k, got_v = cache.read(state, 1, 0, 3, 9)  # Crosses blocks at 4 and 8.
        np.testing.assert_array_equal(got_k, 2 * k[0, 3:9])
        np.testing.assert_array_equal(got_v, -k[0, 3:9])
        assert cache.read(state, 1, 1)[0].shape == (4, KV_HEADS, HEAD_DIM)  # To its length.
        assert cache.read(state, 1, 1, 4, 4)[0].shape == (0, KV_HEADS, HEAD_DIM)
        with pytest.raises(ValueError, match=r"\[start, stop\) = \[0, 5\) must lie in \[0, 4\]"):
            cache.read(state, 1, 1, 0, 5)
        with pytest.raises(ValueError, match=r"\[start, stop\) = \[3, 2\)"):
            cache.read(state, 1, 0, 3, 2)


# -- the state's structure ------------------------------------------------------------------------


def test_two_caches_of_one_configuration_share_a_compiled_step():
    step = _step(2)
    x = jnp.ones((2, 1, HEAD_DIM), jnp.float32)
    for seed in range(2):
        with _cache() as cache:
            state = _fill(cache, cache.init(), [3, 5], seed=seed)
            want = _reference(cache, [3, 5], x)
            outs, state = step(x, state)
            np.testing.assert_allclose(np.asarray(outs[1]), want[1], atol=1e-5)
            cache.drain(state)
    assert step._cache_size() == 1


def test_a_state_of_another_cache_is_refused():
    with _cache() as a, _cache() as b:
        state = a.init()
        with pytest.raises(ValueError, match="state belongs to another cache"):
            b.drain(state)


def test_a_donated_state_is_named_not_a_jax_error():
    with _cache() as cache:
        state = cache.init([1, 1])
        _, new = _step(2)(jnp.ones((2, 1, HEAD_DIM), jnp.float32), state)
        with pytest.raises(ValueError, match="this KVState was donated to a step"):
            cache.drain(state)
        cache.drain(new)


def test_a_step_without_donation_still_hits_its_prefetches():
    """Without donation XLA copies staging every step; the prefetches still land (they are
    matched on tier bytes and offsets, not on buffers), so only the copy is lost."""
    with _cache() as cache:
        state = _fill(cache, cache.init(), [6, 6])
        step = jax.jit(_step(2).__wrapped__)
        x = jnp.ones((2, 1, HEAD_DIM), jnp.float32)
        for _ in range(3):
            _, state = step(x, state)
        jax.block_until_ready(state)
        stats = cache.engine.stats()
        assert stats["prefetch_hits"] >= 4 and stats["prefetch_misses"] <= 1, stats
        cache.drain(state)


def test_layers_out_of_order_stay_correct_and_are_counted():
    with _cache(num_layers=3) as cache:
        state = _fill(cache, cache.init(), [5, 7])
        x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 1, HEAD_DIM)), jnp.float32)

        def step(x, state):
            outs = {}
            for layer in (1, 0, 2):  # Layer 0 (which claims the step) need not come first.
                q = jnp.broadcast_to(x[:, :, None, :], (2, 1, Q_HEADS, HEAD_DIM)) * (layer + 1)
                k = q[:, :, :KV_HEADS] * 0.5
                o, state = tps.prefetching_attention(q, k, -q[:, :, :KV_HEADS], state, layer=layer)
                outs[layer] = o
            return outs, state

        want = _reference(cache, [5, 7], x)
        misses = cache.engine.stats()["prefetch_misses"]
        outs, state = jax.jit(step, donate_argnums=(1,))(x, state)
        for layer in range(3):
            np.testing.assert_allclose(np.asarray(outs[layer]), want[layer], atol=1e-5)
        assert cache.engine.stats()["prefetch_misses"] > misses
        cache.drain(state)


def test_block_segments_rows_never_cross_a_block():
    table = jnp.asarray([[5, 6, 2, blocks.NO_BLOCK]], jnp.int32)
    segs = np.asarray(
        blocks.block_segments(
            table,
            jnp.asarray([0, 100], jnp.int32),
            jnp.asarray([3], jnp.int32),
            jnp.asarray([6], jnp.int32),
            jnp.asarray([[0], [1000]], jnp.int32),
            block_tokens=4,
            row_bytes=10,
            max_positions=6,
        )
    )
    k_rows = segs[: len(segs) // 2]
    used = k_rows[k_rows[:, 3] > 0]
    # Positions 3 (block 5, row 3), 4-7 (block 6), 8 (block 2, row 0).
    np.testing.assert_array_equal(used, [[5, 30, 0, 10], [6, 0, 10, 40], [2, 0, 50, 10]])
    missing = np.asarray(
        blocks.block_segments(
            table,
            jnp.asarray([0, 100], jnp.int32),
            jnp.asarray([12], jnp.int32),
            jnp.asarray([2], jnp.int32),
            jnp.asarray([[0], [0]], jnp.int32),
            block_tokens=4,
            row_bytes=10,
            max_positions=2,
        )
    )
    assert (missing[missing[:, 3] > 0][:, 0] == blocks.NO_BLOCK).all()


def test_allocator_first_fit_and_free_merging():
    a = blocks.BlockAllocator(10)
    assert a.allocate(3).tolist() == [0, 1, 2]
    assert a.allocate(3).tolist() == [3, 4, 5]
    a.free([0, 1, 2])
    assert a.allocate(4).tolist() == [6, 7, 8, 9]  # One extent that holds it all.
    assert a.allocate(3).tolist() == [0, 1, 2]
    a.free([3, 4])
    a.free([0, 1, 2])
    assert a.free_blocks == 5
    assert a.allocate(5).tolist() == [0, 1, 2, 3, 4]  # Merged back into one extent.
    with pytest.raises(ValueError, match="are not all allocated"):
        a.free([0])
        a.free([0])


# -- after a failed step ------------------------------------------------------------------------


def test_recover_after_a_refused_step_keeps_the_cache_usable():
    with _cache() as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=3)
        state, _ = cache.admit(state, 1, max_tokens=8)
        state = _fill(cache, state, [2, 4])
        step = _step(2)
        x = jnp.ones((2, 1, HEAD_DIM), jnp.float32)
        _, state = step(x, state)  # Slot 0 is full now.
        with pytest.raises(Exception, match="slot 0 holds 3 tokens"):
            jax.block_until_ready(step(x, state))
        with pytest.raises(ValueError, match="donated to a step"):
            cache.drain(state)
        state = cache.recover()
        assert _lengths(state) == [3, 5]  # The refused step's input lengths.
        k, _ = cache.read(state, 1, 0)
        assert k.shape == (3, KV_HEADS, HEAD_DIM)
        state = cache.release(state, 0)
        _, state = step(x, state)
        assert _lengths(state) == [0, 6]
        cache.drain(state)


def test_recover_a_lost_state_after_good_steps():
    """A state dropped after steps that completed: the last write-back of its last layer was
    accepted, so the recovered lengths include that step's tokens."""
    with _cache() as cache:
        state = _fill(cache, cache.init(), [2, 5])
        step = _step(2)
        for _ in range(2):
            _, state = step(jnp.ones((2, 1, HEAD_DIM), jnp.float32), state)
        jax.block_until_ready(state)
        del state
        state = cache.recover()
        assert _lengths(state) == [4, 7]
        x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 1, HEAD_DIM)), jnp.float32)
        want = _reference(cache, [4, 7], x)
        outs, state = step(x, state)
        np.testing.assert_allclose(np.asarray(outs[1]), want[1], atol=1e-5)
        cache.drain(state)


def test_a_refused_step_prints_no_traceback_at_exit(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, jax_tpusync as tps
        c = tps.OffloadedKVCache(num_layers=1, batch=1, max_len=2, num_kv_heads=1,
                                 head_dim=4, dtype=jnp.float32)
        s = c.init([2])
        f = jax.jit(lambda q, s: tps.prefetching_attention(q, q, q, s, layer=0),
                    donate_argnums=(1,))
        try:
            jax.block_until_ready(f(jnp.ones((1, 1, 1, 4)), s))
        except Exception as e:
            print("refused:", "slot 0 holds 2 tokens" in str(e))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "refused: True" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def test_every_state_of_a_file_tier_read_in_place_has_one_shape(tmp_path):
    """The first state is shaped like the later ones (no unit-sized staging kept for a
    file tier whose units are read where they land): one compiled step serves them all."""
    with _cache("file", tmp_path, read_in_place="auto") as cache:
        if not cache.spec.reads_in_place:
            pytest.skip("this backend reads a file tier through staging")
        first = cache.init()
        assert first.staging.shape == cache.spec.staging_shape == cache.inert_state().staging.shape
        again = cache.drain(first)
        assert again.staging.shape == first.staging.shape
