"""A host pool of one sliding window kept bounded (``max_step_tokens``: a ring of blocks per
slot) on the CPU backend: its steps against resident windowed attention across several
wraps of the ring, its host-side rows, its cached windows, what it refuses with rings, and
``kv_cache()`` on a TPU giving a windowed model the bounded pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync import factory as cache_factory

from support import pool_mesh_model as pool_mesh
from support import pool_model as pool_attention

HEADS, Q_HEADS, HEAD_DIM = pool_attention.HEADS, pool_attention.Q_HEADS, pool_attention.HEAD_DIM
WINDOW, STEP_TOKENS, BLOCK = 20, 4, 8
# A ring of (20 + 4 - 3) // 8 + 2 = 4 blocks (32 positions); units of two blocks, two a
# layer: the unit loop and its prefetch run over the ring.
RING = dict(sliding_window=WINDOW, max_step_tokens=STEP_TOKENS)


def ring_cache(**options):
    options = {"num_layers": 2, "max_len": 128, **RING, **options}
    return pool_attention.make_cache(**options)


# One step width (one compile, the reference's too), ragged: chunks of up to four rows and
# decode (one row a slot), to 87 and 69 tokens: the 32-position ring wraps twice, and the
# window crosses it everywhere.
DECODE = (4, [1, 1])
STEPS = [(4, [4, 4]), (4, [4, 1]), (4, [0, 3])] + [DECODE] * 4 + [(4, [4, 3])] * 18
STEPS += [DECODE] * 3


@pytest.mark.parametrize(
    "dtype, num_layers, depth",
    [(jnp.bfloat16, 2, 1), (np.float32, 3, 3)],
    ids=["bf16", "f32-depth3"],
)
@pytest.mark.slow
def test_ring_steps_equal_resident_windowed_attention_across_wraps(dtype, num_layers, depth):
    # Depth 3: three units in flight over layers of two, so the walk ahead crosses layers
    # and steps from every unit.
    cache = ring_cache(
        dtype=dtype,
        num_layers=num_layers,
        prefetch_depth=depth,
        staging_bytes=pool_attention.unit_budget(depth, dtype),
    )
    spec = cache.spec
    assert spec.ring_blocks == 4 and spec.num_blocks == 2 * 4
    assert spec.prefetch_depth == depth and spec.chunk_len == 2 * BLOCK
    assert not cache.layout.single_unit
    state, worst, (ref_k, ref_v, lengths) = pool_attention.run_against_resident(
        cache, STEPS, (WINDOW,) * num_layers, dtype
    )
    assert min(lengths) > 2 * spec.ring_blocks * BLOCK  # Past two wraps.
    assert worst <= pool_attention.TOLERANCE[np.dtype(dtype)]
    kept = cache.kept_from(state)
    np.testing.assert_array_equal(kept, np.asarray(lengths) - WINDOW + 1)
    # The ring holds the window's rows, byte for byte the resident cache's.
    for layer in range(spec.num_layers):
        for slot in range(spec.batch):
            window = slice(int(kept[slot]), int(lengths[slot]))
            k, v = cache.read(state, layer, slot, window.start)
            np.testing.assert_array_equal(k, np.asarray(ref_k[layer, slot, window]))
            np.testing.assert_array_equal(v, np.asarray(ref_v[layer, slot, window]))


def test_the_pool_does_not_grow_with_the_context():
    """Pool bytes, staging, units and host-side blocks per slot: the ring's, at any
    max_len."""
    short, long = ring_cache(max_len=128), ring_cache(max_len=1 << 20)
    assert short.spec.num_blocks == long.spec.num_blocks == 2 * short.spec.ring_blocks
    assert short.kv_bytes == long.kv_bytes and short.device_bytes == long.device_bytes
    assert short.spec.chunk_len == long.spec.chunk_len  # A step copies the window's units.
    long.init()
    assert len(long.slots.held_blocks(0)) == long.spec.ring_blocks
    long.close()
    short.close()


def test_a_step_of_more_rows_than_max_step_tokens_is_refused_at_the_edge():
    cache = ring_cache(num_layers=1, batch=1)
    state = cache.init()

    def step(state, q_len):
        q = jnp.zeros((1, q_len, Q_HEADS, HEAD_DIM), jnp.float32)
        kv = jnp.zeros((1, q_len, HEADS, HEAD_DIM), jnp.float32)
        return jax.eval_shape(
            lambda s: tps.prefetching_attention(q, kv, kv, s, layer=0), state
        )

    step(state, STEP_TOKENS)  # At the edge: traces.
    with pytest.raises(ValueError, match=r"q_len=5 exceeds max_step_tokens=4: the cache keeps"):
        step(state, STEP_TOKENS + 1)
    assert cache.lengths(state).tolist() == [0]  # Refused at trace time: nothing ran.
    cache.close()


def test_loads_keep_the_window_and_reads_refuse_older_positions_at_the_edge():
    cache = ring_cache(num_layers=1, batch=1)
    state = cache.init()
    rng = np.random.default_rng(0)
    n = 50  # More than the ring's 32 positions: only the last W - 1 + ... rows are kept.
    k = rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32)
    state = cache.load(state, 0, k, v, slot=0)
    assert cache.lengths(state).tolist() == [n]
    kept = n - WINDOW + 1
    assert cache.kept_from(state).tolist() == [kept]
    got_k, got_v = cache.read(state, 0, 0, kept)  # At the edge: the window's rows.
    np.testing.assert_array_equal(got_k, k[kept:])
    np.testing.assert_array_equal(got_v, v[kept:])
    with pytest.raises(ValueError, match=rf"reaches before position {kept}: slot 0 keeps only"):
        cache.read(state, 0, 0, kept - 1)
    stored = cache.read_stored_rows(state, 0, kept, n)  # The same rule for stored bytes.
    with pytest.raises(ValueError, match=rf"reaches before position {kept}: slot 0 keeps only"):
        cache.read_stored_rows(state, 0, kept - 1, n)
    with pytest.raises(ValueError, match=r"load_stored_rows: this cache keeps only each slot's"):
        cache.load_stored_rows(state, 0, kept, stored)
    # A load of rows the window no longer reads writes nothing.
    before = np.asarray(state.pool).copy()
    state = cache.load(state, 0, k[:kept], v[:kept], slot=0, start=0)
    np.testing.assert_array_equal(np.asarray(state.pool), before)
    cache.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(shm_name="tpusync-ring-pool"), r"a cache with max_step_tokens overwrites its"),
        (dict(resident=True), r"resident=True: a resident cache needs no pool"),
        (dict(sliding_window=[WINDOW, None]), r"max_step_tokens=4 keeps only each slot's window"),
        (dict(max_step_tokens=129), r"max_step_tokens=129 must be an int in \[1, max_len=128\]"),
    ],
    ids=["persistent", "resident", "mixed-windows", "step-past-max_len"],
)
def test_what_rings_rule_out_is_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        ring_cache(**extra)


def test_max_step_tokens_at_max_len_is_taken():
    ring_cache(max_step_tokens=128).close()  # The edge of the range above.


@pytest.mark.parametrize("devices", [1, 2], ids=["one-device", "mesh-2"])
@pytest.mark.slow
def test_a_cached_window_is_copied_into_a_new_slots_ring(devices):
    """A prompt's windows published from its ring are copied into the ring of a later
    admission of the same prompt, which continues from there as the first slot would (over
    a mesh: every device's heads)."""
    placement = {} if devices == 1 else dict(mesh=pool_mesh.mesh_of(devices), kv_heads_axis="h")
    # Two slots' rings and room for the cached windows.
    cache = ring_cache(num_layers=1, batch=2, num_blocks=2 * 4 + 8, **placement)
    state = cache.init(admit=False)
    prompt = np.arange(40) + 100
    state, cached = cache.admit(state, 0, max_tokens=64, tokens=prompt)
    assert cached == 0
    rng = np.random.default_rng(1)
    k = rng.standard_normal((40, HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((40, HEADS, HEAD_DIM)).astype(np.float32)
    published = 0
    for start, stop in ((0, 16), (16, 32), (32, 40)):  # A chunked prefill.
        state = cache.load(state, 0, k[start:stop], v[start:stop], slot=0, start=start)
        published += cache.publish_windows(state, 0)  # Its blocks, while the ring has them.
    assert published == 5
    assert len(cache.slots.windows) == 5
    state = cache.release(state, 0)
    free = cache.slots.free_blocks
    cancelled = cache.reserve(1, 64, prompt)  # A reservation undone gives its ring back.
    assert cancelled.cached == 32 and cache.slots.free_blocks == free - 4
    cache.cancel(cancelled)
    assert cache.slots.free_blocks == free and len(cache.slots.windows) == 5
    state, cached = cache.admit(state, 1, max_tokens=64, tokens=prompt)
    assert cached == 32  # Whole blocks, at most len(prompt) - 1 tokens.
    kept = cached - WINDOW + 1
    got_k, got_v = cache.read(state, 0, 1, kept)
    np.testing.assert_array_equal(got_k, k[kept:cached])
    np.testing.assert_array_equal(got_v, v[kept:cached])
    cache.close()


@pytest.mark.slow
def test_ring_over_a_mesh_equals_the_one_device_ring():
    mesh = pool_mesh.mesh_of(2)
    steps = [(4, [4, 4]), (4, [4, 2]), DECODE] + [(4, [3, 4])] * 9
    def make(**options):  # Test_pool_mesh's geometry (4 heads), over 128 positions.
        return tps.HostPoolKVCache(
            num_layers=pool_mesh.LAYERS, batch=pool_mesh.BATCH, max_len=128,
            num_kv_heads=pool_mesh.HEADS, head_dim=pool_mesh.HEAD_DIM, block_tokens=BLOCK,
            dtype=jnp.float32, staging_bytes=1 << 20, **RING, **options,
        )

    one, split = make(), make(mesh=mesh, kv_heads_axis="h")
    assert split.spec.ring_blocks == one.spec.ring_blocks == 4
    state_one, outs_one = pool_mesh.run(one, steps, jnp.float32)
    state_split, outs_split = pool_mesh.run(split, steps, jnp.float32)
    assert min(one.lengths(state_one)) > 32  # Past a wrap.
    for a, b in zip(outs_one, outs_split):
        np.testing.assert_allclose(a, b, atol=1e-5)
    kept = int(one.kept_from(state_one)[1])
    for x, y in zip(one.read(state_one, 1, 1, kept), split.read(state_split, 1, 1, kept)):
        np.testing.assert_array_equal(x, y)


def test_kv_cache_on_tpu_gives_a_one_window_model_the_bounded_pool(monkeypatch):
    monkeypatch.setattr(cache_factory, "backend_name", lambda: "tpu")
    small = dict(num_layers=2, batch=2, max_len=1024, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                 block_tokens=BLOCK, dtype=jnp.float32, staging_bytes=1 << 20)
    with tps.kv_cache(**small, sliding_window=WINDOW) as cache:
        assert isinstance(cache, tps.HostPoolKVCache)
        assert cache.spec.step_tokens == 512  # The default, as the engine cache's.
        assert cache.spec.ring_blocks == (WINDOW + 512 - 3) // BLOCK + 2
    with tps.kv_cache(**small, sliding_window=WINDOW, max_step_tokens=STEP_TOKENS) as cache:
        assert cache.spec.ring_blocks == 4
    with tps.kv_cache(**small, sliding_window=WINDOW, bound_windows=False) as cache:
        assert cache.spec.ring_blocks == 0  # Every position kept, as asked.
    with pytest.raises(ValueError, match=r"shm_name='x' rules out keeping only the sliding"):
        tps.kv_cache(**small, sliding_window=WINDOW, shm_name="x")
    with pytest.raises(ValueError, match=r"max_step_tokens=4 keeps only each sliding layer's"):
        tps.kv_cache(**small, sliding_window=WINDOW, max_step_tokens=4, bound_windows=False)
