"""Hybrid models (HybridKVCache): a Gemma-3-like decoder (five sliding layers per global one)
and a Gemma-4-like one (sliding and global layers of other KV heads and head sizes, late
layers that read an earlier layer's KV, attention scale 1.0), their attention swapped for
``prefetching_attention``, against the same decoder over a plain in-memory KV history:
ragged chunks, decode through several window wraps, a slot released and re-admitted."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync import serving
from jax_tpusync.core import quantize
from jax_tpusync.persist import commit as persistence

BATCH, MAX_LEN, STEP, BLOCK, D_MODEL, Q_HEADS = 2, 128, 4, 4, 32, 4


@dataclasses.dataclass(frozen=True)
class Model:
    """A tiny decoder: per layer its KV heads, head size, window, RoPE base and source."""

    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    windows: tuple[int | None, ...]
    sharing: tuple[int | None, ...]
    scale: float | None  # None: 1/sqrt(head_dim)

    @property
    def num_layers(self) -> int:
        return len(self.kv_heads)

    def theta(self, layer: int) -> float:  # Sliding layers: local RoPE base; global: long.
        return 10_000.0 if self.windows[layer] is not None else 1_000_000.0

    def weights(self, seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        out = []
        for l in range(self.num_layers):
            h, d = self.kv_heads[l], self.head_dims[l]
            w = {
                "q": rng.standard_normal((D_MODEL, Q_HEADS * d)) / np.sqrt(D_MODEL),
                "o": rng.standard_normal((Q_HEADS * d, D_MODEL)) / np.sqrt(Q_HEADS * d),
            }
            if self.sharing[l] is None:
                w["k"] = rng.standard_normal((D_MODEL, h * d)) / np.sqrt(D_MODEL)
                w["v"] = rng.standard_normal((D_MODEL, h * d)) / np.sqrt(D_MODEL)
            out.append({k: v.astype(np.float32) for k, v in w.items()})
        return out


GEMMA3 = Model(
    kv_heads=(2,) * 6,
    head_dims=(16,) * 6,
    windows=(8, 8, 8, 8, 8, None),
    sharing=(None,) * 6,
    scale=None,
)
# Sliding layers 2 KV heads x 16, global ones 1 x 32; layers 5..7 read layers 3 and 4.
GEMMA4 = Model(
    kv_heads=(2, 2, 1, 2, 1, 2, 1, 2),
    head_dims=(16, 16, 32, 16, 32, 16, 32, 16),
    windows=(8, 8, None, 8, None, 8, None, 8),
    sharing=(None, None, None, None, None, 3, 4, 3),
    scale=1.0,
)


def rope(x, positions, theta):
    """x [..., T, H, D] rotated by positions [..., T] (half-split RoPE)."""
    d = x.shape[-1] // 2
    freq = theta ** (-np.arange(d) / d)
    angle = positions[..., None, None] * freq  # [..., T, 1, d]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def projections(model, w, l, x, positions):
    b, t, _ = x.shape
    d = model.head_dims[l]
    q = rope((x @ w["q"]).reshape(b, t, Q_HEADS, d), positions, model.theta(l))
    if model.sharing[l] is not None:
        return q, None, None
    h = model.kv_heads[l]
    k = rope((x @ w["k"]).reshape(b, t, h, d), positions, model.theta(l))
    v = (x @ w["v"]).reshape(b, t, h, d)
    return q, k, v


def make_step(model, weights, *, scan=False, period=6):
    """jit(step)(x [B, STEP, D_MODEL], counts, state) -> (x, state) through the cache; with
    ``scan``, a ``lax.scan`` over blocks of ``period`` layers (``layer`` traced), a Python
    loop inside each block (its layer kinds static, as a model's block code has them)."""

    def layer_fn(x, positions, counts, state, l, w, kind=None):
        kind = l if kind is None else kind  # The layer whose kind (RoPE, sizes) this is.
        q, k, v = projections(model, w, kind, x, positions)
        out, state = tps.prefetching_attention(
            q, k, v, state, layer=l, query_seq_lengths=counts, scale=model.scale
        )
        return x + jnp.tanh(out.reshape(*x.shape[:2], -1) @ w["o"]), state

    def step(x, counts, state):
        positions = state.positions(x.shape[1])
        if not scan:
            for l in range(model.num_layers):
                x, state = layer_fn(x, positions, counts, state, l, weights[l])
            return x, state
        blocks = model.num_layers // period
        stacked = [
            jax.tree.map(lambda *a: jnp.stack(a), *weights[i::period]) for i in range(period)
        ]

        def body(carry, xs):
            x, state = carry
            ws, block = xs
            for i in range(period):
                x, state = layer_fn(x, positions, counts, state, block * period + i, ws[i], kind=i)
            return (x, state), None

        (x, state), _ = jax.lax.scan(body, (x, state), (stacked, jnp.arange(blocks)))
        return x, state

    return jax.jit(step, donate_argnums=(2,))


class Reference:
    """The same decoder over a plain KV history per layer and slot (NumPy, float64); with
    ``tier_dtype``, a step's rows are kept as the tier gives them back (quantized) once
    the step ends (its own tokens attend in full precision, as the cache's do)."""

    def __init__(self, model, weights, tier_dtype=None):
        self.model, self.weights, self.tier_dtype = model, weights, tier_dtype
        self.kv = [
            np.zeros((2, BATCH, MAX_LEN, model.kv_heads[l], model.head_dims[l]))
            for l in range(model.num_layers)
        ]
        self.lengths = np.zeros(BATCH, np.int64)

    def reset(self, slot):
        self.lengths[slot] = 0

    def step(self, x, counts):
        m = self.model
        x = np.asarray(x, np.float64)
        positions = jnp.asarray(self.lengths[:, None] + np.arange(x.shape[1]), jnp.float32)
        for l in range(m.num_layers):
            q, k, v = projections(m, self.weights[l], l, jnp.asarray(x, jnp.float32), positions)
            q = np.asarray(q, np.float64)
            store = self.kv[l if m.sharing[l] is None else m.sharing[l]]
            if k is not None:
                for b in range(BATCH):
                    n, c = self.lengths[b], counts[b]
                    store[0, b, n : n + c] = np.asarray(k)[b, :c]
                    store[1, b, n : n + c] = np.asarray(v)[b, :c]
            scale = m.scale if m.scale is not None else 1 / np.sqrt(m.head_dims[l])
            group = Q_HEADS // m.kv_heads[l]
            out = np.zeros_like(q)
            for b in range(BATCH):
                for i in range(counts[b]):
                    p = self.lengths[b] + i
                    lo = 0 if m.windows[l] is None else max(0, p - m.windows[l] + 1)
                    for h in range(Q_HEADS):
                        keys = store[0, b, lo : p + 1, h // group]
                        logits = keys @ q[b, i, h] * scale
                        e = np.exp(logits - logits.max())
                        out[b, i, h] = (e / e.sum()) @ store[1, b, lo : p + 1, h // group]
            x = x + np.tanh(out.reshape(*x.shape[:2], -1) @ self.weights[l]["o"])
        if self.tier_dtype is not None:
            for l in range(m.num_layers):
                if m.sharing[l] is None:
                    for b in range(BATCH):
                        n, c = self.lengths[b], counts[b]
                        rows = self.kv[l][:, b, n : n + c]
                        self.kv[l][:, b, n : n + c] = as_tier_holds(rows, self.tier_dtype)
        self.lengths += counts
        return x


def as_tier_holds(x, tier_dtype):
    """Rows [..., H, D] as a quantized tier gives them back."""
    h, d = x.shape[-2:]
    dtype = np.dtype(tier_dtype)
    packed = quantize.quantize_host(x.astype(np.float32), dtype)
    return quantize.dequantize_host(quantize.unpack_host(packed, dtype, h, d), np.float32)


def make_cache(model, tmp_path=None, **options):
    if options.get("tier") == "file":
        options.setdefault("path", str(tmp_path))
    return tps.kv_cache(
        num_layers=model.num_layers,
        batch=BATCH,
        max_len=MAX_LEN,
        num_kv_heads=list(model.kv_heads),
        head_dim=list(model.head_dims),
        sliding_window=list(model.windows),
        kv_sharing=list(model.sharing),
        max_step_tokens=STEP,
        block_tokens=BLOCK,
        dtype=jnp.float32,
        **options,
    )


# Per step, the real rows of each slot: ragged prefill chunks, then decode, through 3+ wraps
# of a sliding group's ring (16 tokens); slot 1 idles some steps.
SCHEDULE = [[4, 3], [4, 4], [2, 0]] + [[1, 1], [1, 0], [4, 1]] * 9


def run(
    cache, model, weights, schedule, *, seed=0, scan=False, reference=None, state=None, tol=2e-4
):
    rng = np.random.default_rng(seed)
    step = make_step(model, weights, scan=scan)
    ref = reference or Reference(model, weights, cache.groups[0].spec.tier_dtype)
    state = cache.init() if state is None else state
    for counts in schedule:
        counts = np.asarray(counts)
        x = rng.standard_normal((BATCH, STEP, D_MODEL)).astype(np.float32)
        got, state = step(jnp.asarray(x), jnp.asarray(counts, jnp.int32), state)
        want = ref.step(x, counts)
        for b in range(BATCH):
            np.testing.assert_allclose(
                np.asarray(got)[b, : counts[b]],
                want[b, : counts[b]],
                rtol=tol,
                atol=tol,
                err_msg=f"slot {b} at length {ref.lengths[b] - counts[b]}",
            )
        np.testing.assert_array_equal(np.asarray(state.lengths), ref.lengths)
    return state, ref


PATHS = {
    "in-place-host": {},
    "int8": dict(tier_dtype="int8", read_in_place=False, staging_bytes=1 << 16),
    "streamed-host": dict(read_in_place=False, staging_bytes=1 << 16),
    "file": dict(tier="file", prefetch_depth=2),
    "file-staged": dict(tier="file", read_in_place=False, staging_bytes=1 << 16),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_hybrid_decoder_matches_a_plain_history(name, path, tmp_path):
    model = {"gemma3": GEMMA3, "gemma4": GEMMA4}[name]
    weights = model.weights(1)
    with make_cache(model, tmp_path, **PATHS[path]) as cache:
        assert isinstance(cache, tps.HybridKVCache)
        # int8: a code rounds the other way for inputs 1e-6 apart (the two paths' float
        # sums), one quantization step (1%) in a row; a wrong row errs by O(1).
        tol = 5e-2 if path == "int8" else 2e-4
        state, ref = run(cache, model, weights, SCHEDULE, tol=tol)
        assert ref.lengths.max() > 3 * 16  # Three wraps of the sliding rings.
        # Slot 1 leaves; a new sequence takes it: every layer, the reading ones included,
        # sees only the new sequence's KV.
        state = cache.release(state, 1)
        state, cached = cache.admit(state, 1)
        assert cached == 0
        ref.reset(1)
        run(
            cache,
            model,
            weights,
            [[1, 4], [1, 2], [1, 1]],
            seed=5,
            reference=ref,
            state=state,
            tol=tol,
        )


def test_scan_over_the_repeating_block_of_layers(tmp_path):
    """``lax.scan`` over two of Gemma 3's 6-layer blocks (``layer`` traced: each call
    switches over the groups whose shapes match)."""
    model = dataclasses.replace(
        GEMMA3,
        kv_heads=(2,) * 12,
        head_dims=(16,) * 12,
        windows=GEMMA3.windows * 2,
        sharing=(None,) * 12,
    )
    weights = model.weights(2)
    with make_cache(model) as cache:
        run(cache, model, weights, SCHEDULE[:8], scan=True)


def test_tier_bytes_follow_the_global_layers():
    """Sliding groups hold a ring per slot; reading layers hold nothing."""
    with make_cache(GEMMA4) as cache:
        by_group = {g.window: c.spec for g, c in zip(cache.plan.groups, cache.groups)}
        row = 2 * 16 * 4
        # A ring of (8 + 4 - 3) // 4 + 2 = 4 blocks per slot, and as many again for cached
        # prefixes' windows (window_cache_blocks).
        assert by_group[8].num_blocks == 2 * BATCH * 4
        assert by_group[8].num_layers == 3 and by_group[None].num_layers == 2
        global_bytes = 2 * 2 * BATCH * MAX_LEN * 32 * 4  # 2 layers, K and V, 1 x 32 f32.
        assert by_group[None].kv_bytes == global_bytes
        assert by_group[8].kv_bytes == 3 * 2 * 2 * BATCH * 16 * row
        assert cache.kv_bytes == global_bytes + by_group[8].kv_bytes
    with make_cache(GEMMA4, window_cache_blocks=0) as lean:
        assert lean.groups[0].spec.num_blocks == BATCH * 4
    with make_cache(GEMMA4, bound_windows=False) as unbounded:
        sliding = [c.spec for c in unbounded.groups if c.spec.windows[0] is not None][0]
        assert sliding.num_blocks == BATCH * MAX_LEN // BLOCK


def test_refusals_name_the_layer():
    common = dict(num_layers=3, batch=1, max_len=32, block_tokens=4, max_step_tokens=2)
    with pytest.raises(ValueError, match=r"num_kv_heads has 2 entries for 3 layers"):
        tps.HybridKVCache(num_kv_heads=[1, 2], head_dim=8, **common)
    with pytest.raises(ValueError, match=r"kv_sharing\[1\]=2: a layer reads the KV of an earlier"):
        tps.HybridKVCache(num_kv_heads=1, head_dim=8, kv_sharing=[None, 2, None], **common)
    with pytest.raises(
        ValueError, match=r"layer 2 \(1 KV heads x 16, global\) cannot read layer 0"
    ):
        tps.HybridKVCache(num_kv_heads=1, head_dim=[8, 8, 16], kv_sharing=[None, None, 0], **common)
    with pytest.raises(ValueError, match=r"layer 1 reads layer 0's KV itself"):
        tps.HybridKVCache(num_kv_heads=1, head_dim=8, kv_sharing=[None, 0, 1], **common)
    with pytest.raises(ValueError, match=r"kv_sharing has 2 entries for 3 layers"):
        tps.HybridKVCache(num_kv_heads=1, head_dim=8, kv_sharing=[None, 0], **common)
    with pytest.raises(
        ValueError,
        match=r"gives one value per layer: a cache whose layers differ in KV geometry is a jax_tpusync.HybridKVCache",
    ):
        tps.OffloadedKVCache(
            num_kv_heads=[1, 1, 1],
            head_dim=8,
            **{k: v for k, v in common.items() if k != "max_step_tokens"},
        )
    with tps.HybridKVCache(
        num_kv_heads=1, head_dim=8, kv_sharing=[None, 0, None], **common
    ) as cache:
        state = cache.init()
        q = jnp.zeros((1, 2, 2, 8), jnp.float32)
        kv = jnp.zeros((1, 2, 1, 8), jnp.bfloat16)
        with pytest.raises(
            ValueError, match=r"layer 1 reads layer 0's KV \(kv_sharing\): call it with k=None"
        ):
            tps.prefetching_attention(q, kv, kv, state, layer=1)
        with pytest.raises(
            ValueError, match=r"layer 2 \(1 KV heads x 8, global\) stores its own KV"
        ):
            tps.prefetching_attention(q, None, None, state, layer=2)
        with pytest.raises(
            ValueError, match=r"reads layer 0's KV \(kv_sharing\) and stores none: load"
        ):
            cache.load(state, 1, np.zeros((1, 2, 1, 8)), np.zeros((1, 2, 1, 8)))


@pytest.fixture(params=("directory", "mooncake"))
def shared_level(request, tmp_path):
    """``(cache options of a writer, of a reader, the level's stats prefix)``: a shared
    directory, or a Mooncake store (a master of the test's own)."""
    if request.param == "directory":
        where = dict(shared_prefix_dir=str(tmp_path / "shared"))
        yield where, where, "shared"
        return
    request.getfixturevalue("mooncake_usable")
    from jax_tpusync.bench.mooncake_master import LocalMaster

    with LocalMaster() as master:
        url = f"mooncake://{master.address}?deadline_s=5&segment_mb="
        yield dict(remote_prefix=url + "16"), dict(remote_prefix=url + "0"), "mooncake"


@pytest.mark.parametrize("bound_windows", (True, False))
def test_a_prompt_is_shared_beyond_the_process_in_every_group(bound_windows, shared_level):
    """A prompt released by one cache is admitted by a fresh one from a shared directory or
    a Mooncake store alone: the global groups import the chain of full blocks, a bounded
    sliding group only its window's blocks (published as its window copies were made);
    the fresh cache's next step equals the first one's."""
    writer_level, reader_level, stats = shared_level
    weights = GEMMA4.weights(4)
    prompt = np.arange(100, 100 + 13)
    step = make_step(GEMMA4, weights)
    x = np.random.default_rng(0).standard_normal((BATCH, STEP, D_MODEL)).astype(np.float32)
    counts = jnp.asarray([4, 0], jnp.int32)
    with make_cache(GEMMA4, bound_windows=bound_windows, **writer_level) as writer:
        state = writer.init(admit=False)
        state, _ = writer.admit(state, 0, tokens=prompt)
        for _ in range(3):  # The prompt's first 12 tokens.
            state = step(jnp.asarray(x), counts, state)[1]
        want, state = step(jnp.asarray(x), counts, state)  # Tokens 12-15.
        want = np.asarray(want)[0]
        state = writer.release(state, 0, tokens=np.concatenate([prompt, [0, 0, 0]]))
        # The reader while the writer is open: a Mooncake client's objects go with it.
        with make_cache(GEMMA4, bound_windows=bound_windows, **reader_level) as reader:
            check_fresh_reader(reader, prompt, step, x, counts, want, bound_windows, stats)
        writer.close(state)


def check_fresh_reader(reader, prompt, step, x, counts, want, bound_windows, stats) -> None:
    """``reader`` maps ``prompt``'s first 12 tokens in every group from the shared level
    alone (a bounded sliding group its window's two blocks, the others the chain's three),
    and its step over tokens 12-15 gives ``want``."""
    state = reader.init(admit=False)
    state, cached = reader.admit(state, 0, tokens=prompt)
    assert cached == 12
    assert {int(np.asarray(g.lengths)[0]) for g in state.groups} == {12}
    imported = [g.prefix_stats[f"{stats}_imported"] for g in reader.groups]
    window_blocks = 2  # Rows [5, 12) of an 8-token window: blocks 1 and 2.
    bounded = [bound_windows and g.window is not None for g in reader.plan.groups]
    assert imported == [window_blocks if b else 3 for b in bounded]
    got, state = step(jnp.asarray(x), counts, state)
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=1e-5)
    reader.close(state)


def test_a_mesh_hybrid_cache_shares_its_windows_through_a_directory(tmp_path):
    """Gemma 3's groups on a 2 x 2 mesh (slots over ``data``, KV heads over ``model``),
    bounded windows: each head shard publishes its own heads' window copies (between
    prefill steps and at release) into its head range's directory, and a fresh mesh cache
    maps the prompt in every group; its next step equals the first cache's."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    options = dict(mesh=mesh, batch_axis="data", kv_heads_axis="model")
    options.update(shared_prefix_dir=str(tmp_path / "shared"))
    step = make_step(GEMMA3, GEMMA3.weights(4))
    prompt = np.arange(100, 113)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((BATCH, STEP, D_MODEL)), jnp.float32)
    counts = jnp.asarray([4, 0], jnp.int32)
    with make_cache(GEMMA3, **options) as writer:
        state = writer.init(admit=False)
        state, _ = writer.admit(state, 0, tokens=prompt)
        copied = 0
        for _ in range(3):  # The prompt's first 12 tokens, windows copied as they pass.
            state = step(x, counts, state)[1]
            copied += writer.publish_windows(state, 0)
        assert copied > 0
        want, state = step(x, counts, state)
        writer.close(writer.release(state, 0, tokens=np.concatenate([prompt, [0, 0, 0]])))
    with make_cache(GEMMA3, **options) as reader:
        state = reader.init(admit=False)
        state, cached = reader.admit(state, 0, tokens=prompt)
        assert cached == 12
        got, state = step(x, counts, state)
        np.testing.assert_allclose(np.asarray(got)[0], np.asarray(want)[0], atol=1e-5)
        reader.close(state)


def test_persistence_reattaches_per_layer_geometry(tmp_path):
    """Each group persists on its own; the layers' record is checked layer by layer."""
    weights = GEMMA4.weights(3)
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    with make_cache(GEMMA4, **opts) as cache:
        state, ref = run(cache, GEMMA4, weights, SCHEDULE[:5])
        state = cache.commit(state)
        cache.close(state)
    record = json.loads((tmp_path / "kv.tpusync.layers.json").read_text())
    assert record["layers"][6] == dict(
        num_kv_heads=1, head_dim=32, sliding_window=None, kv_sharing=4
    )
    with make_cache(GEMMA4, **opts) as cache:
        state = cache.init(admit=False)
        np.testing.assert_array_equal(np.asarray(state.lengths), ref.lengths)
        run(cache, GEMMA4, weights, SCHEDULE[5:8], seed=9, reference=ref, state=state)
    other = dataclasses.replace(GEMMA4, sharing=(None,) * 5 + (3, 4, None))
    with pytest.raises(ValueError, match=r"has layer 7 as .* this cache has it as"):
        make_cache(other, **opts)


def test_prefix_reuse_maps_every_group_or_none():
    """A released sequence's prefix is reused by the next one with its prompt, in every
    group alike: kept whole (``bound_windows=False``) or as the sliding group's window
    copied at release (the sequence ended right past its prompt, so the ring still held
    it); with no room for window copies no group maps anything (each group's rows must
    all be there)."""
    weights = GEMMA4.weights(4)
    prompt = np.arange(100, 100 + 13)
    step = make_step(GEMMA4, weights)
    for options, want in (
        (dict(bound_windows=False), 12),
        ({}, 12),
        (dict(window_cache_blocks=0), 0),
    ):
        with make_cache(GEMMA4, **options) as cache:
            state = cache.init(admit=False)
            if not want:  # The other slot's ring takes the rest of the sliding pool.
                state, _ = cache.admit(state, 1)
            state, cached = cache.admit(state, 0, tokens=prompt)
            assert cached == 0
            x = np.random.default_rng(0).standard_normal((BATCH, STEP, D_MODEL)).astype(np.float32)
            for _ in range(4):  # 13 prompt tokens: chunks of 4, 4, 4, 1.
                state = step(jnp.asarray(x), jnp.asarray([4, 0], jnp.int32), state)[1]
            state = cache.release(state, 0, tokens=np.concatenate([prompt, [0, 0, 0]]))
            if not want:
                state = cache.release(state, 1)
            state, cached = cache.admit(state, 1, tokens=prompt)
            assert cached == want
            np.testing.assert_array_equal(np.asarray(state.lengths), [0, want])
            groups_lengths = {int(np.asarray(g.lengths)[1]) for g in state.groups}
            assert groups_lengths == {want}


VOCAB = 48


def test_serving_loop_drives_a_hybrid_cache():
    """``ServingLoop`` over the Gemma-4-like decoder with an embedding and logits: requests
    of different prompt lengths, batched, generate what the plain history generates for
    each request alone (greedy)."""
    model = GEMMA4
    weights = model.weights(6)
    rng = np.random.default_rng(6)
    embed = rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32)
    unembed = (rng.standard_normal((D_MODEL, VOCAB)) / np.sqrt(D_MODEL)).astype(np.float32)

    def forward(tokens, positions, counts, state):
        x = jnp.asarray(embed)[tokens]
        for l in range(model.num_layers):
            q, k, v = projections(model, weights[l], l, x, positions)
            out, state = tps.prefetching_attention(
                q, k, v, state, layer=l, query_seq_lengths=counts, scale=model.scale
            )
            x = x + jnp.tanh(out.reshape(*x.shape[:2], -1) @ weights[l]["o"])
        return x @ unembed, state

    step = jax.jit(lambda params, t, p, c, s: forward(t, p, c, s), donate_argnums=(4,))

    def alone(prompt, new):
        ref = Reference(model, weights)
        ids, out = list(prompt), []
        fed = 0
        while len(out) < new:
            n = min(STEP, len(ids) - fed)
            x = np.zeros((BATCH, STEP, D_MODEL), np.float32)
            x[0, :n] = embed[ids[fed : fed + n]]
            logits = ref.step(x, np.array([n, 0])) @ unembed
            fed += n
            if fed == len(ids):
                out.append(int(np.argmax(logits[0, n - 1])))
                ids.append(out[-1])
        return out

    prompts = [rng.integers(0, VOCAB, n) for n in (7, 13, 2)]
    with make_cache(model) as cache:
        loop = serving.ServingLoop(cache, step, None, chunk=STEP)
        done = loop.run([serving.Request(p, max_new_tokens=6) for p in prompts])
        for prompt, completion in zip(prompts, done):
            assert completion.tokens == alone(prompt, 6)
        # A later request sharing the second prompt's first 10 tokens: every group maps its
        # 8-token prefix (the global group its blocks, the sliding group a copy of the
        # window the loop kept as the prompt was prefilled), and it generates the same.
        later = np.concatenate([prompts[1][:10], [5, 6, 7]])
        (again,) = loop.run([serving.Request(later, max_new_tokens=6)])
        assert again.cached == 8
        assert again.tokens == alone(later, 6)


def test_hybrid_groups_on_a_mesh():
    """Gemma 3's groups, each split over a 2 x 2 mesh (slots over ``data``, each group's
    KV heads over ``model``), against the plain history."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    weights = GEMMA3.weights(7)
    with make_cache(GEMMA3, mesh=mesh, batch_axis="data", kv_heads_axis="model") as cache:
        assert all(isinstance(g, tps.ShardedKVCache) for g in cache.groups)
        state, ref = run(cache, GEMMA3, weights, SCHEDULE[:9])
        np.testing.assert_array_equal(cache.lengths(state), ref.lengths)
        state = cache.release(state, 0)
        state, _ = cache.admit(state, 0)
        ref.reset(0)
        run(cache, GEMMA3, weights, [[4, 1], [2, 1]], seed=8, reference=ref, state=state)


def test_layers_reading_another_layers_kv_on_a_mesh():
    """Gemma 4's shape over 2 devices (its global layers' single KV head cannot split, so
    the slots do): the reading layers' attention runs in each shard."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((2,), ("data",))
    weights = GEMMA4.weights(8)
    with make_cache(GEMMA4, mesh=mesh, batch_axis="data") as cache:
        state, ref = run(cache, GEMMA4, weights, SCHEDULE[:9])
        state = cache.release(state, 1)
        state, _ = cache.admit(state, 1)
        ref.reset(1)
        run(cache, GEMMA4, weights, [[1, 4], [2, 1]], seed=9, reference=ref, state=state)


def test_scan_over_reading_layers():
    """Layers 4..7 read layers 2 (sliding) and 3 (global) in turn; a ``lax.scan`` over them
    in pairs (``layer`` traced, ``k=None``) switches over the reading groups; layers 0..3 run
    in a Python loop first."""
    model = Model(
        kv_heads=(2, 2, 2, 1, 2, 1, 2, 1),
        head_dims=(16, 16, 16, 32, 16, 32, 16, 32),
        windows=(8, 8, 8, None, 8, None, 8, None),
        sharing=(None, None, None, None, 2, 3, 2, 3),
        scale=1.0,
    )
    weights = model.weights(10)
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *weights[4 + i :: 2]) for i in range(2)]

    def step(x, counts, state):
        positions = state.positions(x.shape[1])

        def layer_fn(x, state, l, w, kind):
            q, _, _ = projections(model, w, kind, x, positions)
            out, state = tps.prefetching_attention(
                q, None, None, state, layer=l, query_seq_lengths=counts, scale=model.scale
            )
            return x + jnp.tanh(out.reshape(*x.shape[:2], -1) @ w["o"]), state

        for l in range(4):
            q, k, v = projections(model, weights[l], l, x, positions)
            out, state = tps.prefetching_attention(
                q, k, v, state, layer=l, query_seq_lengths=counts, scale=model.scale
            )
            x = x + jnp.tanh(out.reshape(*x.shape[:2], -1) @ weights[l]["o"])

        def body(carry, xs):
            x, state = carry
            ws, block = xs
            for i in range(2):
                x, state = layer_fn(x, state, 4 + 2 * block + i, ws[i], kind=4 + i)
            return (x, state), None

        (x, state), _ = jax.lax.scan(body, (x, state), (stacked, jnp.arange(2)))
        return x, state

    step = jax.jit(step, donate_argnums=(2,))
    rng = np.random.default_rng(10)
    with make_cache(model) as cache:
        ref = Reference(model, weights)
        state = cache.init()
        for counts in SCHEDULE[:8]:
            counts = np.asarray(counts)
            x = rng.standard_normal((BATCH, STEP, D_MODEL)).astype(np.float32)
            got, state = step(jnp.asarray(x), jnp.asarray(counts, jnp.int32), state)
            want = ref.step(x, counts)
            for b in range(BATCH):
                np.testing.assert_allclose(
                    np.asarray(got)[b, : counts[b]], want[b, : counts[b]], rtol=2e-4, atol=2e-4
                )


def test_a_traced_layer_of_no_group_is_refused_by_shape():
    with make_cache(GEMMA4) as cache:
        state = cache.init()
        q = jnp.zeros((BATCH, 1, Q_HEADS, 8), jnp.float32)
        kv = jnp.zeros((BATCH, 1, 3, 8), jnp.float32)
        with pytest.raises(
            ValueError, match=r"no layer group of this cache has KV heads x head_dim \(3, 8\)"
        ):
            tps.prefetching_attention(q, kv, kv, state, layer=jnp.int32(1))
        with pytest.raises(
            ValueError, match=r"no layer group of this cache reads another layer's KV"
        ):
            tps.prefetching_attention(q, None, None, state, layer=jnp.int32(5))


def fail_at_manifest_write(monkeypatch, nth: int) -> list[str]:
    """From now on, the ``nth`` manifest write (counting from 1) raises as a crash there
    would stop it: the groups committed before it keep their new manifests, the others
    their old ones. Returns the stages seen."""
    seen: list[str] = []

    def hook(stage: str) -> None:
        seen.append(stage)
        if len(seen) == nth:
            raise RuntimeError("killed at a group's manifest write")

    monkeypatch.setattr(persistence, "fault_hook", hook)
    return seen


def test_a_crash_between_group_commits_brings_every_group_to_the_common_commit(
    tmp_path, monkeypatch, caplog
):
    """Killed after group 0 committed 12 rows and before group 1 did (at the second
    manifest write of the commit): the re-attached cache holds 8 rows in every group, and
    the slot's token ids end there too, so a continued slot released without ``tokens=``
    indexes its blocks under the tokens whose KV they hold (rows 8-11 are the continued
    sequence's, not the first prompt's)."""
    weights = GEMMA4.weights(11)
    step = make_step(GEMMA4, weights)
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    prompt = np.arange(200, 212)
    rng = np.random.default_rng(11)
    chunk = [
        jnp.asarray(rng.standard_normal((BATCH, STEP, D_MODEL)), jnp.float32) for _ in range(4)
    ]
    counts = jnp.asarray([4, 0], jnp.int32)
    with make_cache(GEMMA4, **opts) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, tokens=prompt)
        for x in chunk[:2]:
            state = step(x, counts, state)[1]
        state = cache.commit(state)  # 8 rows in every group.
        state = step(chunk[2], counts, state)[1]
        seen = fail_at_manifest_write(monkeypatch, 2)
        with pytest.raises(persistence.CommitError, match="killed at a group's manifest write"):
            cache.commit(state)
        assert len(seen) == 2
        monkeypatch.setattr(persistence, "fault_hook", None)
        assert [int(g.committed_lengths[0]) for g in cache.groups] == [12, 8]
    with caplog.at_level(logging.WARNING, logger="jax_tpusync.caches.hybrid.cache"):
        cache = make_cache(GEMMA4, **opts)
    assert "left at another commit" in caplog.text
    with cache:
        np.testing.assert_array_equal(cache.committed_lengths, [8, 0])
        for g in cache.groups:
            np.testing.assert_array_equal(g.committed_lengths, [8, 0])
            np.testing.assert_array_equal(g.tokens(0), prompt[:8])
        np.testing.assert_array_equal(cache.tokens(0), prompt[:8])
        state = cache.init(admit=False)
        assert {int(np.asarray(g.lengths)[0]) for g in state.groups} == {8}
        # The slot goes on with other tokens: rows 8-11 are theirs.
        state = step(chunk[3], counts, state)[1]
        other = np.arange(900, 904)
        cache.extend_tokens(0, other)
        np.testing.assert_array_equal(cache.tokens(0), np.concatenate([prompt[:8], other]))
        continued = [cache.read(state, l, 0, 8, 12) for l in (0, 2)]
        state = cache.release(state, 0)
        # The first prompt's third block was never committed: only 8 of its tokens map.
        state, cached = cache.admit(state, 1, tokens=np.concatenate([prompt, [7]]))
        assert cached == 8
        state = cache.release(state, 1)
        # The continued sequence's tokens map all 12, rows 8-11 its own.
        state, cached = cache.admit(state, 1, tokens=np.concatenate([prompt[:8], other, [7]]))
        assert cached == 12
        for l, (k, v) in zip((0, 2), continued):
            got_k, got_v = cache.read(state, l, 1, 8, 12)
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)
        cache.close(state)


def test_a_crash_between_group_commits_of_a_reused_slot_releases_it_in_every_group(
    tmp_path, monkeypatch
):
    """Slot 0 held an empty sequence (committed at 0 rows) and was released without a
    commit; the next sequence in it maps a 12-token cached prefix, and the commit that
    records it reaches group 0 only. Group 0 cannot be brought below the prefix it maps,
    group 1 holds the old sequence: re-attach releases the slot in both, and the cached
    prefix still maps."""
    weights = GEMMA4.weights(12)
    step = make_step(GEMMA4, weights)
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    prompt = np.arange(300, 313)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((BATCH, STEP, D_MODEL)), jnp.float32)
    with make_cache(GEMMA4, **opts) as cache:
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 1, tokens=prompt)
        for _ in range(3):
            state = step(x, jnp.asarray([0, 4], jnp.int32), state)[1]
        state = cache.release(state, 1, tokens=prompt)
        state, _ = cache.admit(state, 0)
        state = cache.commit(state)  # Slot 0 active at 0 rows; the prefix indexed.
        state = cache.release(state, 0)  # Nothing of it committed: no commit.
        state, cached = cache.admit(state, 0, tokens=prompt)
        assert cached == 12
        fail_at_manifest_write(monkeypatch, 2)
        with pytest.raises(persistence.CommitError):
            cache.commit(state)
        monkeypatch.setattr(persistence, "fault_hook", None)
    with make_cache(GEMMA4, **opts) as cache:
        np.testing.assert_array_equal(cache.capacity, [0, 0])
        for g in cache.groups:
            np.testing.assert_array_equal(g.capacity, [0, 0])
            np.testing.assert_array_equal(g.committed_lengths, [0, 0])
            assert len(g.tokens(0)) == 0
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=prompt)
        assert cached == 12
        cache.close(state)


HYBRID_ARGS = dict(
    num_layers=3,
    batch=1,
    max_len=32,
    block_tokens=4,
    max_step_tokens=2,
    num_kv_heads=1,
    head_dim=8,
    sliding_window=[4, None, 4],
)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(bound_windows="no"), ValueError, r"bound_windows='no' must be a bool"),
        (dict(bound_windows=1), ValueError, r"bound_windows=1 must be a bool"),
        (dict(max_len="32"), ValueError, r"max_len='32' must be a positive int"),
        (dict(batch="1"), ValueError, r"batch='1' must be a positive int"),
        (dict(batch=0), ValueError, r"batch=0 must be a positive int"),
        (
            dict(max_step_tokens=33),
            ValueError,
            r"max_step_tokens=33 must be an int in \[1, max_len=32\]",
        ),
        (
            dict(window_cache_blocks="2"),
            ValueError,
            r"window_cache_blocks='2' must be None or an int >= 0",
        ),
        (
            dict(window_cache_blocks=-1, bound_windows=False),
            ValueError,
            r"window_cache_blocks=-1 must be None or an int >= 0",
        ),
        (dict(staging_bytes="x"), ValueError, r"staging_bytes='x' must be a positive int"),
        (
            dict(engine="e"),
            TypeError,
            r"engine must be an Engine, an EngineConfig or None; got str",
        ),
        (dict(shm_name=5), ValueError, r"shm_name=5 must be a non-empty str or None"),
        (dict(file_name="", tier="file"), ValueError, r"file_name='' must be a non-empty str"),
        (dict(kv_heads_axis="model"), ValueError, r"kv_heads_axis='model' .* name axes of a mesh"),
        (dict(dtype="no such dtype"), ValueError, r"dtype='no such dtype' must be bfloat16"),
        (dict(block_tokens="4"), ValueError, r"block_tokens='4' must be a power of two"),
        (dict(block_tokens=3), ValueError, r"block_tokens=3 must be a power of two"),
    ],
)
def test_a_bad_constructor_argument_is_named(change, error, message, tmp_path):
    args = dict(HYBRID_ARGS, **change)
    if args.get("tier") == "file":
        args["path"] = str(tmp_path)
    with pytest.raises(error, match=message):
        tps.HybridKVCache(**args)
    assert not list(tmp_path.iterdir())


@pytest.fixture
def hybrid_shm_name():
    """A unique shm name; every file of a hybrid cache of that name is removed at
    teardown."""
    name = f"tpusync-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield name
    for path in Path(persistence.SHM_DIRECTORY).glob(f"{name}*"):
        if path.name.endswith(".json"):
            path.unlink(missing_ok=True)
        else:
            tps.Engine.unlink_shm(path.name)


def persisted_files(tmp_path, shm_name) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir()) + sorted(
        p.name for p in Path(persistence.SHM_DIRECTORY).glob(f"{shm_name}*")
    )


@pytest.mark.parametrize("tier", ("file", "host"))
def test_a_refused_persistent_hybrid_cache_changes_nothing_on_disk(tmp_path, hybrid_shm_name, tier):
    """Bounded windows cannot persist: the refusal writes no record of the layers (which
    would refuse the next cache of that name), and a valid cache of the name opens."""
    where = (
        dict(tier="file", path=str(tmp_path), file_name="kv")
        if tier == "file"
        else dict(shm_name=hybrid_shm_name)
    )
    with pytest.raises(
        ValueError, match=r"bound_windows=True keeps only each sliding group's window, whose ring"
    ):
        make_cache(GEMMA4, **where)
    assert persisted_files(tmp_path, hybrid_shm_name) == []
    with make_cache(GEMMA4, bound_windows=False, **where) as cache:
        state = cache.init()
        cache.close(cache.commit(state))
    assert persisted_files(tmp_path, hybrid_shm_name) != []


def test_a_group_refused_after_another_opened_leaves_nothing_behind(tmp_path):
    """Group 1's tier file is there without a manifest, so group 1 refuses after group 0
    made its tier and manifest: those and the record of the layers are removed again."""
    stray = tmp_path / "kv.g1.tpusync"
    stray.write_bytes(bytes(4096))
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    with pytest.raises(persistence.MissingManifestError, match=r"kv.g1.tpusync holds KV but"):
        make_cache(GEMMA4, **opts)
    assert persisted_files(tmp_path, "no shm") == ["kv.g1.tpusync"]


def test_a_record_of_layers_without_any_group_is_replaced(tmp_path):
    """A record of the layers with no group beside it (a crash after it was written and
    before any group was made) describes no KV: a cache of other layers replaces it."""
    (tmp_path / "kv.tpusync.layers.json").write_text(json.dumps({"layers": []}))
    opts = dict(tier="file", path=str(tmp_path), file_name="kv", bound_windows=False)
    with make_cache(GEMMA4, **opts) as cache:
        cache.close(cache.commit(cache.init()))
    record = json.loads((tmp_path / "kv.tpusync.layers.json").read_text())
    assert len(record["layers"]) == GEMMA4.num_layers
    with make_cache(GEMMA4, **opts) as cache:  # Now it holds groups: compared, and equal.
        np.testing.assert_array_equal(cache.committed_lengths, [0, 0])


def damage_block(cache, group: int, ids, block: int, kind: str):
    """Flips a byte of block ``block`` (of the tokens ``ids``) that group ``group`` of
    ``cache`` published to its shared level (a directory's file, or a Mooncake object)."""
    g = cache.groups[group]
    key = g.slots.prefix.keys(np.asarray(ids))[block]
    level = g.slots.remote_levels[0]
    if kind == "shared":
        path = level.directory.file_of(key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        return None
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 << 20, "tcp", "", level.master) == 0
    header = json.loads(client.get(level.header_key(key))[16:])
    name = level.range_key(key, *header["ranges"][0])
    body = bytearray(client.get(name))
    body[-1] ^= 1
    assert client.upsert(name, bytes(body)) == 0
    return client  # Kept open while the object is read (it holds the damaged copy).


def test_a_damaged_last_window_block_maps_the_longest_intact_prefix(shared_level):
    """The shared level's copy of the sliding group's block 2 is damaged: a fresh reader
    of the 13-token prompt cannot map 12 tokens (their window needs blocks 1 and 2), but
    maps 8, whose window (blocks 0 and 1) and global blocks are whole, and its step over
    tokens 8-11 equals the writer's."""
    writer_level, reader_level, stats = shared_level
    weights = GEMMA4.weights(4)
    prompt = np.arange(100, 100 + 13)
    step = make_step(GEMMA4, weights)
    x = np.random.default_rng(0).standard_normal((BATCH, STEP, D_MODEL)).astype(np.float32)
    counts = jnp.asarray([4, 0], jnp.int32)
    with make_cache(GEMMA4, **writer_level) as writer:
        sliding = next(i for i, g in enumerate(writer.plan.groups) if g.window is not None)
        state = writer.init(admit=False)
        state, _ = writer.admit(state, 0, tokens=prompt)
        for _ in range(2):
            state = step(jnp.asarray(x), counts, state)[1]
        want, state = step(jnp.asarray(x), counts, state)  # Tokens 8-11.
        want = np.asarray(want)[0]
        state = step(jnp.asarray(x), counts, state)[1]
        state = writer.release(state, 0, tokens=np.concatenate([prompt, [0, 0, 0]]))
        keep = damage_block(writer, sliding, prompt[:12], 2, stats)
        with make_cache(GEMMA4, **reader_level) as reader:
            state = reader.init(admit=False)
            state, cached = reader.admit(state, 0, tokens=prompt)
            assert cached == 8
            assert {int(np.asarray(g.lengths)[0]) for g in state.groups} == {8}
            s = reader.groups[sliding].prefix_stats
            assert s[f"{stats}_damaged"] >= 1  # Block 2 (a Mooncake run may ask twice).
            assert s[f"{stats}_imported"] == 2  # Blocks 0 and 1, the 8-token window.
            got, state = step(jnp.asarray(x), counts, state)
            np.testing.assert_allclose(np.asarray(got)[0], want, atol=1e-5)
            reader.close(state)
        if keep is not None:
            keep.close()
        writer.close(state)


@pytest.mark.parametrize("host_pool", [False, True], ids=["engine", "host-pool"])
@pytest.mark.parametrize(
    "max_len, step", [(64, 64), (511, 511), (512, 512), (513, 512)], ids=str
)  # fmt: skip
def test_the_default_max_step_tokens_fits_max_len(max_len, step, host_pool):
    # The default (512) was refused, naming an argument the caller did not pass, by a
    # cache whose max_len is below it: it is max_len there, and an explicit value past
    # max_len is still refused by name.
    args = dict(HYBRID_ARGS, max_len=max_len, sliding_window=[8, None, 8], host_pool=host_pool)
    del args["max_step_tokens"]
    with tps.HybridKVCache(**args) as cache:
        assert cache.max_step_tokens == step
    with pytest.raises(
        ValueError,
        match=rf"max_step_tokens={max_len + 1} must be an int in \[1, max_len={max_len}\]",
    ):
        tps.HybridKVCache(**dict(args, max_step_tokens=max_len + 1))
