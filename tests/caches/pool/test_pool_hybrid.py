"""Hybrid models on the host pool (the TPU data path) on the CPU backend: a Gemma-3-like
model (sliding layers of two window sizes and a global one) and a Gemma-4-like one (global
layers of other KV heads and head size, late layers reading an earlier layer's KV), their
steps against resident attention per layer; the host calls all groups or none; a mesh;
``kv_cache()`` on TPU giving these models the hybrid pool cache; persistence, a crash
between two groups' commits re-attaching both at their common one; the guards at their
edges.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

import jax_tpusync as tps
from jax_tpusync import factory as cache_factory
from jax_tpusync.core.pool_state import PoolLayout
from jax_tpusync.persist import commit as persistence
from jax_tpusync.step.host_pool import unit_rows

BATCH, MAX_LEN, BLOCK, Q_HEADS, STEP = 2, 64, 4, 4, 4


@dataclasses.dataclass(frozen=True)
class Shape:
    """Per model layer: KV heads, head size, window (None: global), source (kv_sharing)."""

    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    windows: tuple[int | None, ...]
    sharing: tuple[int | None, ...]

    @property
    def num_layers(self) -> int:
        return len(self.kv_heads)

    def cache_arguments(self) -> dict:
        return dict(
            num_layers=self.num_layers,
            batch=BATCH,
            max_len=MAX_LEN,
            num_kv_heads=list(self.kv_heads),
            head_dim=list(self.head_dims),
            sliding_window=list(self.windows),
            kv_sharing=list(self.sharing),
            max_step_tokens=STEP,
            block_tokens=BLOCK,
            dtype=jnp.float32,
            # A few blocks per unit: a global layer's keys take several units.
            staging_bytes=1 << 14,
        )


# Two window sizes beside a global layer: three groups of one KV geometry.
GEMMA3 = Shape((2,) * 4, (16,) * 4, (8, 12, 8, None), (None,) * 4)
# Sliding layers 2 KV heads x 16, global ones 1 x 32; layers 3 and 4 read layers 1 and 2.
GEMMA4 = Shape(
    kv_heads=(2, 1, 2, 1, 2),
    head_dims=(16, 32, 16, 32, 16),
    windows=(8, None, 8, None, 8),
    sharing=(None, None, None, 1, 2),
)
# Every group's heads split over two devices; layer 2 reads the global layer 1.
MESH = Shape((2, 2, 2), (16, 32, 32), (8, None, None), (None, None, 1))
# Two groups of other geometries: a sliding layer, a global one.
TWO_GROUPS = Shape((2, 1), (16, 32), (8, None), (None, None))


def pool_cache(shape: Shape, **options) -> tps.HybridKVCache:
    options = {**shape.cache_arguments(), "host_pool": True, **options}
    return tps.HybridKVCache(**options)


@functools.cache  # One compile per model shape, however many runs.
def make_step(shape: Shape, scanned: bool = False):
    """jit(step)(state, qs, ks, vs, counts): every layer's attention (a reading layer's k
    and v None), the state donated. ``scanned``: the layers in ``lax.scan`` (the layer
    traced; every layer one KV geometry, none reading another's)."""

    def scan_step(state, qs, ks, vs, counts):
        def body(state, xs):
            layer, q, k, v = xs
            out, state = tps.prefetching_attention(
                q, k, v, state, layer=layer, query_seq_lengths=counts
            )
            return state, out

        layers = jnp.arange(shape.num_layers)
        state, outs = lax.scan(body, state, (layers, *map(jnp.stack, (qs, ks, vs))))
        return list(outs), state

    def step(state, qs, ks, vs, counts):
        outs = []
        for layer in range(shape.num_layers):
            out, state = tps.prefetching_attention(
                qs[layer], ks[layer], vs[layer], state, layer=layer, query_seq_lengths=counts
            )
            outs.append(out)
        return outs, state

    return jax.jit(scan_step if scanned else step, donate_argnums=0)


@functools.partial(jax.jit, static_argnames="window")
def resident_attention(*args, window, counts):
    return tps.resident_attention(*args, window=window, query_seq_lengths=counts)


class Resident:
    """Resident attention per stored layer; a reading layer attends its source's cache as
    of the step's start and the source's new rows."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.kv = {
            l: [jnp.zeros((BATCH, MAX_LEN, shape.kv_heads[l], shape.head_dims[l]))] * 2
            for l in range(shape.num_layers)
            if shape.sharing[l] is None
        }
        self.lengths = np.zeros(BATCH, np.int32)

    def step(self, qs, ks, vs, counts) -> list:
        outs, new = [], {}
        lengths = jnp.asarray(self.lengths)
        for l in range(self.shape.num_layers):
            source = self.shape.sharing[l]
            stored = l if source is None else source
            k, v = (ks[l], vs[l]) if source is None else (ks[source], vs[source])
            out, new_k, new_v = resident_attention(
                qs[l],
                k,
                v,
                *self.kv[stored],
                lengths,
                window=self.shape.windows[l],
                counts=jnp.asarray(counts, jnp.int32),
            )
            if source is None:
                new[l] = [new_k, new_v]
            outs.append(out)
        self.kv.update(new)
        self.lengths = self.lengths + np.asarray(counts, np.int32)
        return outs


# Ragged prefill chunks, then decode past a sliding window and a unit, slot 1 idling a
# step, then chunks through several wraps of a bounded sliding group's ring (16 tokens):
# one step width (one compile), decode steps take one of its rows.
SCHEDULE = [(STEP, [4, 3]), (STEP, [4, 4]), (STEP, [1, 1]), (STEP, [2, 0])]
SCHEDULE += [(STEP, [1, 1])] * 4 + [(STEP, [4, 3])] * 9


def run(cache, shape: Shape, schedule, *, state=None, resident=None, seed=0, scanned=False):
    """Runs ``schedule`` (q_len, counts) through ``cache`` and resident attention; returns
    (state, resident, the worst difference of real rows)."""
    rng = np.random.default_rng(seed)
    step = make_step(shape, scanned)
    state = cache.init() if state is None else state
    resident = Resident(shape) if resident is None else resident
    worst = 0.0
    for q_len, counts in schedule:

        def draw(heads, layer):
            if heads is None:
                return None
            x = rng.standard_normal((BATCH, q_len, heads, shape.head_dims[layer]))
            return jnp.asarray(x, jnp.float32)

        qs = [draw(Q_HEADS, l) for l in range(shape.num_layers)]
        stores = [shape.sharing[l] is None for l in range(shape.num_layers)]
        ks = [draw(shape.kv_heads[l] if s else None, l) for l, s in enumerate(stores)]
        vs = [draw(shape.kv_heads[l] if s else None, l) for l, s in enumerate(stores)]
        got, state = step(state, qs, ks, vs, jnp.asarray(counts, jnp.int32))
        want = resident.step(qs, ks, vs, counts)
        real = np.arange(q_len)[None] < np.asarray(counts)[:, None]
        for layer, (a, b) in enumerate(zip(got, want)):
            diff = np.where(real[..., None, None], np.abs(np.asarray(a) - np.asarray(b)), 0)
            worst = max(worst, float(diff.max()))
        np.testing.assert_array_equal(cache.lengths(state), resident.lengths)
    return state, resident, worst


def test_a_scan_over_a_hybrid_pools_layers_equals_resident_attention():
    """The layers in lax.scan, the layer traced: each call switches to its layer's group
    (three, of windows 8 and 12 and global) and runs that pool's step."""
    with pool_cache(GEMMA3) as cache:
        state, resident, worst = run(cache, GEMMA3, SCHEDULE[:9], scanned=True)
        assert worst <= 1e-5 and resident.lengths.max() > 16


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, bound_windows", [(GEMMA3, True), (GEMMA4, True)], ids=["gemma3", "gemma4"]
)
def test_hybrid_pool_steps_equal_resident_attention(shape, bound_windows):
    with pool_cache(shape, bound_windows=bound_windows) as cache:
        assert all(isinstance(g, tps.HostPoolKVCache) for g in cache.groups)
        assert cache.engine is None
        # Several units per global layer: the unit loop and its chain run.
        assert any(g.spec.chunk_len < MAX_LEN for g in cache.groups)
        sliding = [g for g, p in zip(cache.groups, cache.plan.groups) if p.window is not None]
        assert all(bool(g.spec.ring_blocks) == bound_windows for g in sliding)
        state, resident, worst = run(cache, shape, SCHEDULE)
        assert worst <= 1e-5
        assert resident.lengths.max() > 3 * 16  # Three wraps of a ring.
        # A group none of whose layers is read by another ends the step with its next
        # step's first unit staged (its chain runs on through the other groups' layers).
        checked = 0
        for g, part in enumerate(state.groups):
            if any(cache.plan.group_of[s] == g for s in cache.plan.sources):
                continue  # A reading layer's prefetch replaced it.
            need = unit_rows(PoolLayout(part.spec), part, 0, 0, part.lengths)
            np.testing.assert_array_equal(np.asarray(part.staged_at), np.asarray(need))
            checked += 1
        assert checked == (3 if shape is GEMMA3 else 0)
        # Slot 1 leaves, published under token ids; a sequence of the same prompt takes it:
        # every group maps one prefix (the global groups' blocks, the sliding groups'
        # windows) and every layer, the reading ones included, goes on from there.
        ids = np.arange(int(resident.lengths[1])) % 7
        cache.extend_tokens(1, ids)
        assert (cache.publish_windows(state, 1) > 0) == bound_windows
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 1, tokens=ids)
        assert cached == len(ids) - len(ids) % BLOCK - (0 if len(ids) % BLOCK else BLOCK)
        resident.lengths[1] = cached
        state, _, worst = run(
            cache, shape, [(STEP, [1, 4]), (STEP, [1, 1])], state=state, resident=resident, seed=3
        )
        assert worst <= 1e-5
        # Slot 1 again, without ids: a new sequence, nothing of the old one seen.
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 1)
        assert cached == 0
        resident.lengths[1] = 0
        state, _, worst = run(cache, shape, [(STEP, [1, 4])], state=state, resident=resident)
        assert worst <= 1e-5
        # What the steps wrote is resident attention's rows (a reading layer: its source's).
        length, last = int(resident.lengths[0]), shape.num_layers - 1
        window = shape.windows[last]
        start = 0 if window is None or not bound_windows else max(0, length - window + 1)
        k, v = cache.read(state, last, 0, start)
        stored = last if shape.sharing[last] is None else shape.sharing[last]
        want_k, want_v = (x[0, start:length] for x in resident.kv[stored])
        np.testing.assert_array_equal(np.asarray(k), np.asarray(want_k))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(want_v))


def test_an_admission_one_group_refuses_is_undone_in_the_others(monkeypatch):
    shape = GEMMA4
    with pool_cache(shape) as cache:
        state = cache.init(admit=False)
        free = [g.slots.free_blocks for g in cache.groups]
        last = cache.groups[-1]

        def refuse(*args, **kwargs):
            raise ValueError("slot 0: refused here")

        monkeypatch.setattr(last, "reserve", refuse)
        with pytest.raises(ValueError, match="slot 0: refused here"):
            cache.admit(state, 0, max_tokens=16)
        for g, before in zip(cache.groups, free):
            assert g.capacity[0] == 0 and g.slots.free_blocks == before
        np.testing.assert_array_equal(cache.lengths(state), [0, 0])
        monkeypatch.undo()
        state, cached = cache.admit(state, 0, max_tokens=16)
        assert cached == 0 and all(g.capacity[0] == 16 for g in cache.groups)


@pytest.mark.slow
def test_a_hybrid_pool_over_a_mesh_equals_resident_attention():
    """Every group's KV heads split over two devices (each device's pool in its host
    memory), a reading layer among them."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    with pool_cache(MESH, mesh=mesh, kv_heads_axis="model", bound_windows=False) as cache:
        assert not any(g.spec.ring_blocks for g in cache.groups)  # Every position kept.
        assert all(g.shards == 2 for g in cache.groups)
        assert cache.device_bytes == sum(2 * g.device_bytes for g in cache.groups)
        _, _, worst = run(cache, MESH, SCHEDULE[:6])
        assert worst <= 1e-5


def test_kv_cache_on_tpu_gives_a_hybrid_model_the_hybrid_pool_cache(monkeypatch):
    monkeypatch.setattr(cache_factory, "backend_name", lambda: "tpu")
    arguments = GEMMA4.cache_arguments()
    with tps.kv_cache(**arguments) as cache:  # Its sliding group a pool of rings.
        assert isinstance(cache, tps.HybridKVCache) and cache.host_pool
        assert isinstance(cache, tps.KVCache)  # Every host call a cache answers.
        assert [len(g.layers) for g in cache.plan.groups] == [2, 1]
        assert all(isinstance(g, tps.HostPoolKVCache) for g in cache.groups)
        assert [bool(g.spec.ring_blocks) for g in cache.groups] == [True, False]
    with tps.kv_cache(**arguments, bound_windows=False) as cache:
        assert cache.host_pool and not any(g.spec.ring_blocks for g in cache.groups)
    with pytest.raises(ValueError, match=r"batch_axis='data': host-pool groups split"):
        mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
        tps.kv_cache(**arguments, mesh=mesh, batch_axis="data")


def test_a_traced_layer_of_another_groups_geometry_is_refused_for_every_slot():
    """A traced layer whose k has the sliding group's geometry but that is the global
    layer: the sliding pool's step at layer -1 writes nothing outside its sink and is
    refused for every active slot; the state is refused afterwards, naming it."""
    with pool_cache(TWO_GROUPS) as cache:
        state = cache.init()
        q = jnp.zeros((BATCH, 1, Q_HEADS, 16), jnp.float32)
        k = jnp.ones((BATCH, 1, 2, 16), jnp.float32)
        sliding = cache.plan.group_of[0]
        before = np.array(state.groups[sliding].pool)

        @jax.jit
        def traced(state, layer):
            return tps.prefetching_attention(q, k, k, state, layer=layer)

        state = traced(state, jnp.int32(1))[1]
        part = state.groups[sliding]
        sink = cache.groups[sliding].layout.sink_row
        np.testing.assert_array_equal(np.array(part.pool[:sink]), before[:sink])
        np.testing.assert_array_equal(np.asarray(part.refused), [1, 1])
        with pytest.raises(ValueError, match=r"slot 0: 1 tokens .*traced layer outside \[0, 1\)"):
            cache.check(state)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(host_pool=1), r"host_pool=1 must be a bool"),
        (dict(engine=tps.EngineConfig()), r"engine=EngineConfig: host-pool groups"),
    ],
)
def test_what_host_pool_groups_do_not_do_yet_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        pool_cache(GEMMA3, **change)


def test_batch_axis_and_persistence_on_a_mesh_are_refused_for_host_pool_groups(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match=r"batch_axis='data': host-pool groups split"):
        pool_cache(MESH, mesh=mesh, batch_axis="data")
    # As an engine hybrid cache on a mesh: its groups' shards have no common commit.
    file_tier = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    with pytest.raises(ValueError, match="a persistent hybrid cache on a mesh is not supported"):
        pool_cache(MESH, mesh=mesh, kv_heads_axis="data", **file_tier)
    assert not list(tmp_path.iterdir())  # Refused before anything was written.


def decode_inputs(shape: Shape, rng, counts) -> tuple:
    """One step's (qs, ks, vs, counts) of every layer (a reading layer's k and v None)."""

    def draw(heads, layer):
        x = rng.standard_normal((BATCH, STEP, heads, shape.head_dims[layer]))
        return jnp.asarray(x, jnp.float32)

    layers = range(shape.num_layers)
    qs = [draw(Q_HEADS, l) for l in layers]
    ks = [None if shape.sharing[l] is not None else draw(shape.kv_heads[l], l) for l in layers]
    vs = [None if shape.sharing[l] is not None else draw(shape.kv_heads[l], l) for l in layers]
    return qs, ks, vs, jnp.asarray(counts, jnp.int32)


def test_a_crash_between_group_commits_reattaches_every_group_at_the_common_commit(
    tmp_path, monkeypatch, caplog
):
    """Slot 1's prompt is released into the prefix index and slot 0 committed at 12 rows;
    slot 0 decodes 8 more, and the next commit reaches group 0 only (its manifest written,
    group 1's write killed). The re-made cache holds 12 rows and 12 token ids in every
    group, decodes on exactly as the cache that never crashed did, and maps the released
    prompt from the index. Another model's layers over the same files are refused by
    layer."""
    shape = TWO_GROUPS
    step = make_step(shape, False)
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    prompts = [np.arange(100, 112), np.arange(200, 213)]
    rng = np.random.default_rng(21)
    prefill = [decode_inputs(shape, rng, [4, 4]) for _ in range(3)]
    decode = [decode_inputs(shape, rng, [4, 0]) for _ in range(2)]
    with pool_cache(shape, **opts) as cache:
        state = cache.init(admit=False)
        for slot, prompt in enumerate(prompts):
            state, _ = cache.admit(state, slot, tokens=prompt)
        for inputs in prefill:
            state = step(state, *inputs)[1]
        released = cache.read(state, 1, 1, 0, 12)  # The global layer's rows.
        state = cache.release(state, 1, tokens=prompts[1])
        state = cache.commit(state)
        np.testing.assert_array_equal(cache.committed_lengths, [12, 0])
        outs = []
        for inputs in decode:
            out, state = step(state, *inputs)
            outs.append([np.asarray(o)[0] for o in out])
        cache.extend_tokens(0, np.arange(900, 908))
        seen: list[str] = []

        def killed_at_the_second(stage: str) -> None:
            seen.append(stage)
            if len(seen) == 2:
                raise RuntimeError("killed at a group's manifest write")

        monkeypatch.setattr(persistence, "fault_hook", killed_at_the_second)
        with pytest.raises(persistence.CommitError, match="killed at a group's manifest"):
            cache.commit(state)
        monkeypatch.setattr(persistence, "fault_hook", None)
        assert [g.committed_lengths.tolist() for g in cache.groups] == [[20, 0], [12, 0]]
        cache.close()  # Without a state: nothing more is committed.

    with caplog.at_level(logging.WARNING, logger="jax_tpusync.caches.hybrid.cache"):
        cache = pool_cache(shape, **opts)
    assert "layer group 0 was left at another commit (lengths [20, 0])" in caplog.text
    with cache:
        for g in cache.groups:
            np.testing.assert_array_equal(g.committed_lengths, [12, 0])
            np.testing.assert_array_equal(g.tokens(0), prompts[0])
        state = cache.init(admit=False)
        np.testing.assert_array_equal(cache.lengths(state), [12, 0])
        for inputs, want in zip(decode, outs):
            out, state = step(state, *inputs)
            for got, expected in zip(out, want):
                np.testing.assert_array_equal(np.asarray(got)[0], expected)
        state, cached = cache.admit(state, 1, tokens=prompts[1])
        assert cached == 12  # Every group maps the released prompt's three blocks.
        for got, expected in zip(cache.read(state, 1, 1, 0, 12), released):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        cache.close(state)
    other = dataclasses.replace(shape, windows=(8, 16))
    with pytest.raises(ValueError, match=r"has layer 1 as .* this cache has it as"):
        pool_cache(other, **opts)
