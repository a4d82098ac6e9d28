"""Admit and release are all or nothing, through the real cache: a refused call leaves the
slot tables and the live state as they were, so the same state decodes on (no stale-state
error) to the KV a twin cache that never saw the refusal holds. On a mesh: head shards map
the same prefix, and a refusal in one shard changes none."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps

KV_HEADS, Q_HEADS, HEAD_DIM, BT = 2, 4, 8, 4
PROMPT = list(range(9))
OTHER = list(range(50, 58))


def _cache():
    return tps.OffloadedKVCache(
        num_layers=2,
        batch=3,
        max_len=32,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=jnp.float32,
        block_tokens=BT,
        num_blocks=16,
        staging_bytes=1 << 20,
        read_in_place=False,
    )


def _step_fn():
    def step(x, state):
        outs = []
        for layer in range(2):
            q = jnp.broadcast_to(x[:, :, None, :], (x.shape[0], 1, Q_HEADS, HEAD_DIM)) * (layer + 1)
            o, state = tps.prefetching_attention(
                q, q[:, :, :KV_HEADS] * 0.5, -q[:, :, :KV_HEADS], state, layer=layer
            )
            outs.append(o)
        return jnp.stack(outs), state

    return jax.jit(step, donate_argnums=(1,))


def _load(cache, state, slot, start, n, seed):
    rng = np.random.default_rng(seed)
    lengths = [0] * 3
    lengths[slot] = n
    for layer in range(2):
        kv = rng.standard_normal((2, 3, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
        state = cache.load(state, layer, kv[0], kv[1], start=start, lengths=lengths)
    return state


def _setup(cache):
    """Slot 0 maps a released 2-block prefix and holds 9 tokens of 20; slot 1 holds 13 of
    24; slot 2 is inactive; another sequence's 2 blocks are cached; 3 blocks are free."""
    state = cache.init(admit=False)
    state, cached = cache.admit(state, 0, max_tokens=16, tokens=PROMPT)
    state = _load(cache, state, 0, 0, 9, seed=1)
    state = cache.release(state, 0, tokens=PROMPT)
    state, cached = cache.admit(state, 0, max_tokens=20, tokens=PROMPT)
    assert cached == 8
    state = _load(cache, state, 0, 8, 1, seed=2)
    state, _ = cache.admit(state, 1, max_tokens=24)
    state = _load(cache, state, 1, 0, 13, seed=3)
    state, _ = cache.admit(state, 2, max_tokens=8, tokens=OTHER)
    state = _load(cache, state, 2, 0, 8, seed=4)
    state = cache.release(state, 2, tokens=OTHER)
    assert cache.prefix_stats["cached_blocks"] == 2
    assert cache.free_blocks == 3 and np.asarray(state.lengths).tolist() == [9, 13, 0]
    return state


def _host(cache) -> dict:
    return dict(
        capacity=cache.capacity.tolist(),
        tables=cache.block_tables.tolist(),
        free=cache.free_blocks,
        stats=cache.prefix_stats,
    )


REFUSALS = [
    # 3 free and 2 cached blocks: 5 pass, 6 are refused without evicting the cached ones.
    (
        "admit",
        dict(slot=2, max_tokens=24),
        "needs 6 KV blocks but only 3 of 16 are free and evicting all 2",
    ),
    ("admit", dict(slot=3), r"slot=3 must be an int in \[0, batch=3\)"),
    ("admit", dict(slot=-1), r"slot=-1 must be an int"),
    ("admit", dict(slot=0), r"slot 0 is active \(capacity 20 tokens\)"),
    (
        "admit",
        dict(slot=2, max_tokens=8, tokens=list(range(9))),
        "tokens has 9 ids, more than max_tokens=8",
    ),
    ("admit", dict(slot=2, max_tokens=8, tokens=[1, 2**63]), r"token id 9223372036854775808"),
    ("release", dict(slot=2), "slot 2 is not active"),
    (
        "release",
        dict(slot=1, tokens=list(range(13))),
        r"tokens has 13 ids but slot 1 holds 2\d tokens",
    ),
    ("release", dict(slot=0, tokens=PROMPT), r"tokens has 9 ids but slot 0 holds 1\d tokens"),
]


def test_each_refused_call_leaves_a_state_that_decodes_on():
    step = _step_fn()
    rng = np.random.default_rng(7)
    with _cache() as cache, _cache() as twin:
        state, twin_state = _setup(cache), _setup(twin)
        for i, (method, kw, message) in enumerate(REFUSALS):
            before = _host(cache)
            kw = dict(kw)
            slot = kw.pop("slot")
            with pytest.raises(ValueError, match=message):
                getattr(cache, method)(state, slot, **kw)
            assert _host(cache) == before, (method, kw)
            # The same state (a prefetch of the last step may be in flight) decodes on.
            x = jnp.asarray(rng.standard_normal((3, 1, HEAD_DIM)), jnp.float32)
            outs, state = step(x, state)
            want, twin_state = step(x, twin_state)
            np.testing.assert_array_equal(np.asarray(outs), np.asarray(want))
            assert np.asarray(state.lengths).tolist() == [10 + i, 14 + i, 0]
        state, twin_state = cache.drain(state), twin.drain(twin_state)
        lengths = np.asarray(state.lengths)
        for layer in range(2):
            got, want = cache.read_all(layer, lengths), twin.read_all(layer, lengths)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        # The prefix the refusals passed over is intact: mapped again, the same rows.
        state = cache.release(state, 0, tokens=PROMPT + list(range(100, 100 + 9)))
        state, cached = cache.admit(state, 2, max_tokens=16, tokens=PROMPT + [5])
        assert cached == 8
        k, _ = cache.read(state, 1, 2, 0, 8)
        np.testing.assert_array_equal(k, twin.read(twin_state, 1, 0, 0, 8)[0])


# -- mesh -------------------------------------------------------------------------------------

from support.mesh_model import MeshTestModel

MESH_ARGS = dict(block_tokens=8, num_blocks=16, read_in_place=False)
needs_devices = pytest.mark.skipif(
    len(jax.devices()) < 4,
    reason="needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)",
)


def _tp2_cache(**kw):
    return tps.kv_cache(
        **MeshTestModel.cache_args(**MESH_ARGS, **kw),
        mesh=jax.make_mesh((1, 2), ("data", "model")),
        kv_heads_axis="model",
    )


@pytest.fixture(scope="module")
def mesh_model():
    return MeshTestModel()


@pytest.fixture(scope="module")
def mesh_step(mesh_model):
    return mesh_model.step()


@needs_devices
def test_head_shards_map_the_prefix_the_shorter_directory_holds(mesh_model, mesh_step, tmp_path):
    m, tokens = mesh_model, np.arange(40)
    shared = tmp_path / "shared"
    with _tp2_cache(shared_prefix_dir=str(shared)) as writer:
        state = writer.init(admit=False)
        state, _ = writer.admit(state, 0, tokens=tokens, max_tokens=48)
        for layer in range(2):
            state = writer.load(
                state,
                layer,
                m.context_k[layer, :, :40],
                m.context_v[layer, :, :40],
                lengths=[40, 0, 0, 0],
            )
        state = writer.release(state, 0, tokens=tokens)
        assert all(s["shared_published"] == 5 for s in writer.prefix_stats.values())
    with _tp2_cache(shared_prefix_dir=str(shared)) as cache:
        # Shard 1's directory lacks the prefix's third block: it can import two.
        level = cache.shards[1].slots.remote_levels[0]
        key = cache.shards[1].slots.prefix.keys(tokens)[2]
        level.directory.file_of(key).unlink()
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 1, tokens=np.arange(41), max_tokens=48)
        assert cached == 16
        assert [c.slots.shared_tokens(1) for c in cache.shards.values()] == [16, 16]
        assert cache.lengths(state).tolist() == [0, 16, 0, 0]
        assert cache.capacity.tolist() == [0, 48, 0, 0]
        for layer in range(2):  # Slot 1's rows: what slot 0 of the writer held, every head.
            k, v = cache.read(state, layer, 1, 0, 16)
            np.testing.assert_array_equal(k, m.context_k[layer, 0, :16])
            np.testing.assert_array_equal(v, m.context_v[layer, 0, :16])
        x, state, _, _ = mesh_step(jnp.asarray(m.x0), state)
        assert np.isfinite(np.asarray(x)).all()
        state = cache.drain(state)
        assert cache.lengths(state).tolist() == [0, 17, 0, 0]
        k, _ = cache.read(state, 0, 1, 0, 16)
        np.testing.assert_array_equal(k, m.context_k[0, 0, :16])


@needs_devices
def test_a_mesh_admission_refused_in_one_shard_changes_no_shard(mesh_model, mesh_step):
    with _tp2_cache() as cache:
        # Slots 2 and 3 hold 16 tokens in each shard, on 2 blocks of shard 0 but all 16 of
        # shard 1: shard 1 has no block left.
        first, second = cache.shards[0].slots, cache.shards[1].slots
        first.place(2, [0, 1], 16)
        first.place(3, [2, 3], 16)
        second.place(2, range(8), 16)
        second.place(3, range(8, 16), 16)
        state = cache.init(admit=False)
        before = (
            cache.capacity.tolist(),
            {s: t.tolist() for s, t in cache.block_tables.items()},
            [c.free_blocks for c in cache.shards.values()],
        )
        assert before[0] == [0, 0, 16, 16] and before[2] == [12, 0]
        with pytest.raises(ValueError, match="needs 2 KV blocks but only 0 of 16 are free"):
            cache.admit(state, 0, max_tokens=16)
        after = (
            cache.capacity.tolist(),
            {s: t.tolist() for s, t in cache.block_tables.items()},
            [c.free_blocks for c in cache.shards.values()],
        )
        assert after == before
        assert [c.capacity.tolist() for c in cache.shards.values()] == [[0, 0, 16, 16]] * 2
        _, state, _, _ = mesh_step(jnp.asarray(mesh_model.x0), state)  # The same state runs.
        assert cache.lengths(cache.drain(state)).tolist() == [0, 0, 1, 1]
