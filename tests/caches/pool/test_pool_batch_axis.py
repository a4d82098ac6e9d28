"""A host-pool cache with its slots split over a mesh's batch_axis (one host pool per batch
shard, BatchShardedPoolKVCache), on four simulated CPU devices: its steps against the
one-device pool of the same inputs, its host calls on slots of every shard byte-exact,
its guards at their edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_tpusync as tps

HEADS, Q_HEADS, HEAD_DIM, LAYERS, BATCH, MAX_LEN, BLOCK = 4, 8, 8, 2, 4, 32, 8
Q_LEN = 3  # One step width: one compile per cache.
STEP_LAYERS = 1  # The steps' caches: what a shard's step does per layer is the pool's own.


def grid(*shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def dp_tp():
    return dict(mesh=grid(2, 2, names=("data", "model")), batch_axis="data", kv_heads_axis="model")


def make(batch=BATCH, num_layers=LAYERS, **options):
    options.setdefault("dtype", jnp.float32)
    options.setdefault("block_tokens", BLOCK)
    cls = tps.BatchShardedPoolKVCache if "batch_axis" in options else tps.HostPoolKVCache
    return cls(
        num_layers=num_layers,
        batch=batch,
        max_len=MAX_LEN,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        **options,
    )


@jax.jit
def _step(state, qs, ks, vs, counts):
    outs = []
    for layer in range(STEP_LAYERS):
        out, state = tps.prefetching_attention(
            qs[layer], ks[layer], vs[layer], state, layer=layer, query_seq_lengths=counts
        )
        outs.append(out)
    return jnp.stack(outs), state


def rows(rng, n):
    return rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32)


def serve(cache, seed=0):
    """A schedule over global slots of several batch shards: prompts of ragged lengths
    loaded host-side, steps of ragged counts, a release and a later admission."""
    rng = np.random.default_rng(seed)
    state = cache.init(admit=False)
    outs = []

    def prompt(state, slot, n):
        state, _ = cache.admit(state, slot, max_tokens=24)
        for layer in range(STEP_LAYERS):
            k, v = rows(rng, n), rows(rng, n)
            state = cache.load(state, layer, k, v, slot=slot)
        return state

    def step(state, counts):
        shape = (STEP_LAYERS, BATCH, Q_LEN)
        qs = rng.standard_normal((*shape, Q_HEADS, HEAD_DIM)).astype(np.float32)
        ks = rng.standard_normal((*shape, HEADS, HEAD_DIM)).astype(np.float32)
        vs = rng.standard_normal((*shape, HEADS, HEAD_DIM)).astype(np.float32)
        out, state = _step(state, qs, ks, vs, jnp.asarray(counts, jnp.int32))
        active = np.asarray(counts) > 0
        outs.append(np.asarray(out)[:, active])
        return state

    state = prompt(state, 0, 5)
    state = prompt(state, 3, 11)
    state = step(state, [3, 0, 0, 2])
    state = step(state, [1, 0, 0, 3])
    state = cache.release(state, 0)
    state = prompt(state, 2, 9)
    state = prompt(state, 1, 2)
    state = step(state, [0, 3, 1, 3])
    return state, outs


@pytest.mark.parametrize(
    "axes",
    [
        dp_tp(),
        dict(mesh=grid(4, names=("data",)), batch_axis="data"),
    ],
    ids=["dp2xtp2", "dp4"],
)
@pytest.mark.slow  # Three step compiles (the mesh's two and the one-device pool's).
def test_steps_equal_the_one_device_pool(axes):
    cache = make(num_layers=STEP_LAYERS, **axes)
    single = make(num_layers=STEP_LAYERS)
    mesh = axes["mesh"]
    dp = mesh.shape["data"]
    assert cache.spec.batch == BATCH // dp and cache.shards == 4
    state, outs = serve(cache)
    ref_state, ref_outs = serve(single)
    for got, want in zip(outs, ref_outs):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths(state), single.lengths(ref_state))
    np.testing.assert_array_equal(cache.capacity, single.capacity)
    for slot in (1, 2, 3):
        for layer in range(STEP_LAYERS):
            for got, want in zip(
                cache.read(state, layer, slot), single.read(ref_state, layer, slot)
            ):
                np.testing.assert_array_equal(got, want)
    # Each device its own pool in its host memory, split as the cache says.
    assert state.pool.sharding.memory_kind == "pinned_host"
    assert state.pool.shape == (4, *cache.layout.pool_shape)
    assert {s.device for s in state.pool.addressable_shards} == set(mesh.devices.flat)
    # Slots 0 and 3 (batch shards 0 and the last) refused by one step past their capacity:
    # each refused slot's release is taken while the other shard's slot is refused too.
    for slot in (1, 2, 3):
        state = cache.release(state, slot)
    for slot in (0, 3):
        state, _ = cache.admit(state, slot, max_tokens=2)
    zeros = np.zeros((STEP_LAYERS, BATCH, Q_LEN, HEADS, HEAD_DIM), np.float32)
    qs = np.zeros((STEP_LAYERS, BATCH, Q_LEN, Q_HEADS, HEAD_DIM), np.float32)
    state = _step(state, qs, zeros, zeros, jnp.asarray([Q_LEN, 0, 0, Q_LEN], jnp.int32))[1]
    with pytest.raises(ValueError, match="batch shard 0 .*slot 0: 3 tokens of its steps"):
        cache.release(state, 1)  # Not a refused slot.
    state = cache.release(state, 0)
    with pytest.raises(ValueError, match="3 tokens of its steps were refused"):
        cache.check(state)
    state = cache.release(state, 3)
    cache.check(state)
    cache.close(state)


def test_host_calls_on_a_slot_of_each_shard_round_trip():
    cache = make(**dp_tp())
    rng = np.random.default_rng(1)
    state = cache.init(admit=False)
    written = {}
    for slot, n in ((1, 7), (2, 13)):  # Shard 0's second slot, shard 1's first.
        state, cached = cache.admit(state, slot, max_tokens=20)
        assert cached == 0
        written[slot] = [(rows(rng, n), rows(rng, n)) for _ in range(LAYERS)]
        for layer, (k, v) in enumerate(written[slot]):
            state = cache.load(state, layer, k, v, slot=slot)
    np.testing.assert_array_equal(cache.lengths(state), [0, 7, 13, 0])
    for slot, layers in written.items():
        for layer, (k, v) in enumerate(layers):
            got_k, got_v = cache.read(state, layer, slot)
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)
    # A slot's stored rows into a slot of the other shard, byte-exact.
    stored = cache.read_stored_rows(state, 1, 0, 7)
    assert stored.shape[0] == 2  # The heads' two devices of its row.
    state, _ = cache.admit(state, 3, max_tokens=20)
    state = cache.load_stored_rows(state, 3, 0, stored)
    np.testing.assert_array_equal(cache.read_stored_rows(state, 3, 0, 7), stored)
    np.testing.assert_array_equal(cache.read(state, 1, 3)[1], written[1][1][1])
    # A whole-batch load: each shard its own slots' rows.
    k = rng.standard_normal((BATCH, 4, HEADS, HEAD_DIM)).astype(np.float32)
    for layer in range(LAYERS):
        state = cache.load(state, layer, k, k, start=[0, 7, 13, 7], lengths=[0, 2, 4, 1])
    np.testing.assert_array_equal(cache.lengths(state), [0, 9, 17, 8])
    np.testing.assert_array_equal(cache.read(state, 0, 2, 13, 17)[0], k[2])
    np.testing.assert_array_equal(cache.read(state, 1, 1, 7, 9)[0], k[1, :2])
    state = cache.release(state, 2)
    np.testing.assert_array_equal(cache.capacity, [0, 20, 0, 20])
    np.testing.assert_array_equal(cache.lengths(state), [0, 9, 0, 8])
    np.testing.assert_array_equal(cache.read(state, 1, 1, 0, 7)[0], written[1][1][0])
    # Each shard its own prefix index: blocks shard 0 indexed are reused there only.
    tokens = np.arange(17)
    state, _ = cache.admit(state, 0, max_tokens=20, tokens=tokens)
    for layer in range(LAYERS):
        state = cache.load(state, layer, rows(rng, 17), rows(rng, 17), slot=0)
    state = cache.release(state, 0, tokens=tokens)
    assert cache.prefix_stats[0]["indexed_blocks"] == 17 // BLOCK
    assert cache.prefix_stats[1]["indexed_blocks"] == 0
    state, cached_there = cache.admit(state, 0, max_tokens=20, tokens=tokens)
    state, cached_elsewhere = cache.admit(state, 2, max_tokens=20, tokens=tokens)
    assert (cached_there, cached_elsewhere) == (16, 0)
    cache.close()


def test_refusals_at_their_edges_change_nothing():
    axes = dp_tp()
    make(batch=2, **axes).close()  # One slot per batch shard.
    with pytest.raises(ValueError, match=r"batch=3 must be a positive multiple of mesh axis "):
        make(batch=3, **axes)
    with pytest.raises(ValueError, match=r"batch_axis=None: this cache splits the slots"):
        tps.BatchShardedPoolKVCache(
            mesh=grid(4, names=("model",)), kv_heads_axis="model", batch_axis=None,
            num_layers=LAYERS, batch=BATCH, max_len=MAX_LEN, num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"batch_axis='data' of 2 devices: a HostPoolKVCache"):
        tps.HostPoolKVCache(
            mesh=axes["mesh"], kv_heads_axis="model", batch_axis="data", num_layers=LAYERS,
            batch=BATCH, max_len=MAX_LEN, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"spill_path=.* with mesh=: spill_path"):
        make(**axes, spill_path="/tmp", spill_blocks=4)

    cache, other = make(**axes), make(**axes)
    state, other_state = cache.init(admit=False), other.init()
    with pytest.raises(ValueError, match=r"slot=4 must be an int in \[0, batch=4\)"):
        cache.read(state, 0, 4)
    with pytest.raises(ValueError, match=r"slot=-1 must be an int in \[0, batch=4\)"):
        cache.read(state, 0, -1)
    with pytest.raises(TypeError, match=r"expected a PoolState, got dict"):
        cache.lengths({})
    with pytest.raises(ValueError, match=r"state belongs to another cache \(its spec differs"):
        cache.lengths(state.with_spec(cache.parts[0].spec))  # A batch shard's spec.
    with pytest.raises(ValueError, match=r"state is not split as cache.state_sharding says"):
        cache.lengths(state.replace(lengths=jax.device_put(state.lengths, jax.devices()[0])))
    with pytest.raises(ValueError, match=r"lengths must have shape \(4,\); got \(3,\)"):
        cache.init([0, 0, 0])
    with pytest.raises(ValueError, match=r"lengths must hold ints; got float32"):
        cache.init(np.zeros(4, np.float32))
    assert cache.read(state, 0, 3)[0].shape == (0, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"batch shard 0 .*not the cache's live state"):
        cache.lengths(other_state)  # Another cache's (its spec is the same).
    # A call on shard 1 supersedes the state: refused for a slot of shard 0 too.
    live, _ = cache.admit(state, 2, max_tokens=MAX_LEN)
    k = rows(np.random.default_rng(2), 3)
    with pytest.raises(ValueError, match=r"batch shard 1 .*not the cache's live state"):
        cache.admit(state, 0, max_tokens=MAX_LEN)
    np.testing.assert_array_equal(cache.capacity, [0, 0, MAX_LEN, 0])  # Nothing admitted.
    for slot in (0, 1, 3):
        live, _ = cache.admit(live, slot, max_tokens=MAX_LEN)
    stale, live = live, cache.load(live, 0, k, k, slot=2)  # Shard 1's pool donated.
    with pytest.raises(ValueError, match=r"batch shard 1 .*its pool is gone"):
        cache.read(stale, 0, 0)
    # Another shard's part where a shard's belongs (their epochs swapped) is refused.
    pieces = sorted(live.epoch.addressable_shards, key=lambda p: p.index[0].start)
    swapped = [jax.device_put(pieces[(i + 2) % 4].data, p.device) for i, p in enumerate(pieces)]
    epoch = jax.make_array_from_single_device_arrays((4,), live.epoch.sharding, swapped)
    with pytest.raises(ValueError, match=r"batch shard 0 .*not the cache's live state"):
        cache.lengths(live.replace(epoch=epoch))
    # A load that one shard refuses (past slot 2's capacity) writes in no shard.
    before = cache.lengths(live)
    both = np.zeros((BATCH, MAX_LEN + 1, HEADS, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match=r"batch shard 1 .*would overflow its capacity"):
        cache.load(live, 1, both, both, lengths=[1, 1, MAX_LEN + 1, 1])
    np.testing.assert_array_equal(cache.lengths(live), before)  # Still the live state.
    live = cache.load(live, 1, both, both, lengths=[1, 1, MAX_LEN, 1])
    # Slot 2's length grows to the rows every layer holds (3 of layer 0).
    np.testing.assert_array_equal(cache.lengths(live), [0, 0, 3, 0])
    np.testing.assert_array_equal(cache.read(live, 1, 2)[0], both[2, :3])
    with pytest.raises(ValueError, match=r"k must be \[batch=4, n, num_kv_heads=4, head_dim=8\]"):
        cache.load(live, 0, both[:2], both[:2])
    cache.close(live)
    other.close()
    with pytest.raises(ValueError, match=r"this cache is closed"):
        cache.lengths(live)


def test_each_shard_persists_under_its_own_name_and_reattaches(tmp_path):
    tier = dict(tier="file", path=str(tmp_path), file_name="kv", tier_dtype="int8")
    cache = make(**dp_tp(), **tier)
    rng = np.random.default_rng(3)
    state = cache.init(admit=False)
    for slot, n in ((0, 9), (3, 4)):
        state, _ = cache.admit(state, slot, max_tokens=16)
        for layer in range(LAYERS):
            state = cache.load(state, layer, rows(rng, n), rows(rng, n), slot=slot)
    want = [cache.read(state, layer, 3, raw=True) for layer in range(LAYERS)]
    state = cache.commit(state)
    cache.close()
    assert {p.name.split(".")[0] for p in tmp_path.iterdir()} >= {"kv-batch0", "kv-batch1"}
    again = make(**dp_tp(), **tier)
    np.testing.assert_array_equal(again.committed_lengths, [9, 0, 0, 4])
    # Slot 3 one row past its commit: refused in batch shard 1 before any shard's init.
    with pytest.raises(ValueError, match=r"shard 1 .*lengths\[1\]=5 is past slot 1's committed"):
        again.init([9, 0, 0, 5], admit=False)
    state = again.init(admit=False)
    np.testing.assert_array_equal(again.lengths(state), [9, 0, 0, 4])
    for layer in range(LAYERS):
        for got, expected in zip(again.read(state, layer, 3, raw=True), want[layer]):
            np.testing.assert_array_equal(got.codes, expected.codes)
            np.testing.assert_array_equal(got.scales, expected.scales)
    assert set(again.verify(state)) == {0, 1}
    again.close()


def test_an_init_one_shard_has_no_room_for_makes_no_shards_pool(tmp_path):
    # Re-attached, shard 0 holds 2 of its 6 blocks and shard 1 holds 3: init() admits every
    # inactive slot for max_len (4 blocks), which fits shard 0 exactly and not shard 1.
    tier = dict(tier="file", path=str(tmp_path), file_name="kv", num_blocks=6)
    cache = make(**dp_tp(), **tier)
    state = cache.init(admit=False)
    state, _ = cache.admit(state, 0, max_tokens=2 * BLOCK)
    state, _ = cache.admit(state, 2, max_tokens=3 * BLOCK)
    cache.close(state)
    again = make(**dp_tp(), **tier)
    with pytest.raises(ValueError, match=r"batch shard 1 .*which needs 4 KV blocks, but 3 of 6"):
        again.init()
    state = again.init(admit=False)  # What the refusal advises: no shard made its pool.
    np.testing.assert_array_equal(again.capacity, [2 * BLOCK, 0, 3 * BLOCK, 0])
    again.close()
