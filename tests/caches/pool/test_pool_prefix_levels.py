"""Prefix levels feed the host pool between steps: blocks one host-pool cache publishes to a
shared directory at release are imported by another (a fresh process's cache, here a
second cache object) into its pool, byte-exact, on one device and over a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_tpusync as tps

HEADS, HEAD_DIM, LAYERS, BT = 2, 16, 2, 8


def make_cache(directory, **options):
    return tps.HostPoolKVCache(
        num_layers=LAYERS, batch=2, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=BT, dtype=jnp.bfloat16, staging_bytes=1 << 20,
        shared_prefix_dir=str(directory), **options,
    )  # fmt: skip


def mesh_options(devices):
    if devices == 1:
        return {}
    mesh = Mesh(np.array(jax.devices()[:devices]), ("h",))
    return dict(mesh=mesh, kv_heads_axis="h")


@pytest.mark.parametrize("devices", [1, 2], ids=["one-device", "mesh"])
def test_published_blocks_are_imported_into_another_caches_pool(tmp_path, devices):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 37)
    kv = rng.standard_normal((LAYERS, 2, 37, HEADS, HEAD_DIM)).astype(jnp.bfloat16)
    writer = make_cache(tmp_path, **mesh_options(devices))
    state = writer.init(admit=False)
    state, cached = writer.admit(state, 1, max_tokens=48, tokens=prompt)
    assert cached == 0
    for layer in range(LAYERS):
        state = writer.load(state, layer, kv[layer, 0], kv[layer, 1], slot=1)
    state = writer.release(state, 1, tokens=prompt)
    published = sorted(tmp_path.iterdir())
    assert len(published) == 37 // BT  # Its full blocks.
    writer.close()

    reader = make_cache(tmp_path, **mesh_options(devices))
    state = reader.init(admit=False)
    # A longer prompt that starts with the published one: its full blocks are imported.
    longer = np.concatenate([prompt, rng.integers(0, 1000, 5)])
    state, cached = reader.admit(state, 0, max_tokens=64, tokens=longer)
    assert cached == 32
    for layer in range(LAYERS):
        k, v = reader.read(state, layer, 0)
        np.testing.assert_array_equal(k, kv[layer, 0, :32])
        np.testing.assert_array_equal(v, kv[layer, 1, :32])
    # A refused admission (an active slot) imports nothing and changes no state.
    before = np.asarray(state.pool).copy()
    with pytest.raises(ValueError, match="active"):
        reader.admit(state, 0, max_tokens=64, tokens=longer)
    np.testing.assert_array_equal(np.asarray(state.pool), before)
    # A reservation that imported and was cancelled leaves the pool as it was.
    reservation = reader.reserve(1, 64, longer)
    assert reservation.cached == 32
    reader.cancel(reservation)
    state = reader.release(state, 0, tokens=longer[:32])
    np.testing.assert_array_equal(reader.capacity, [0, 0])
    reader.close()


def test_a_damaged_block_file_is_a_miss(tmp_path):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 17)
    writer = make_cache(tmp_path)
    state = writer.init(admit=False)
    state, _ = writer.admit(state, 0, max_tokens=32, tokens=prompt)
    rows = np.ones((17, HEADS, HEAD_DIM), jnp.bfloat16)
    for layer in range(LAYERS):
        state = writer.load(state, layer, rows, rows, slot=0)
    second_key = writer.slots.prefix.keys(prompt[: 2 * BT])[1]
    writer.release(state, 0, tokens=prompt)
    (second,) = tmp_path.glob(second_key.hex() + "*")
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF
    second.write_bytes(bytes(data))
    reader = make_cache(tmp_path)
    state = reader.init(admit=False)
    state, cached = reader.admit(state, 0, max_tokens=32, tokens=prompt)
    assert cached == 8  # The first block; the damaged second one is a miss.


def test_blocks_a_cancelled_reservation_imported_are_imported_again(tmp_path):
    # Cancelled, the imported blocks never reached a pool: they leave the index, and the
    # next admission of the prompt imports them again (not a map of unwritten blocks).
    prompt, kv = publish_a_prompt(tmp_path, seed=4)
    reader = make_cache(tmp_path)
    state = reader.init(admit=False)
    reservation = reader.reserve(0, 32, prompt)
    assert reservation.cached == 16 and len(reader.slots.prefix) == 2
    reader.cancel(reservation)
    assert len(reader.slots.prefix) == 0
    state, cached = reader.admit(state, 1, max_tokens=32, tokens=prompt)
    assert cached == 16
    check_rows(reader, state, 1, kv)
    reader.close()


@pytest.mark.parametrize("first_cancelled", [False, True], ids=["both-admitted", "cancelled"])
def test_a_reservation_mapping_anothers_imports_reads_them_admitted_first(
    tmp_path, first_cancelled
):
    # The second reservation maps the blocks the first imported (indexed at its reserve)
    # and is admitted before it, or after it was cancelled: its pool holds their bytes.
    prompt, kv = publish_a_prompt(tmp_path, seed=5)
    reader = make_cache(tmp_path)
    state = reader.init(admit=False)
    first = reader.reserve(0, 32, prompt)
    second = reader.reserve(1, 32, prompt)
    assert first.cached == second.cached == 16
    if first_cancelled:
        reader.cancel(first)
    state = reader.admitted(state, second)
    slots = [1]
    if not first_cancelled:
        check_rows(reader, state, 1, kv)  # Before the first is admitted.
        state = reader.admitted(state, first)
        slots.append(0)
    for slot in slots:
        check_rows(reader, state, slot, kv)
    reader.close()


def publish_a_prompt(directory, seed):
    """A 17-token prompt and its KV [layers, K|V, 17, heads, head_dim], whose two full
    blocks a cache (closed since) published to ``directory``."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1000, 17)
    kv = rng.standard_normal((LAYERS, 2, 17, HEADS, HEAD_DIM)).astype(jnp.bfloat16)
    writer = make_cache(directory)
    state = writer.init(admit=False)
    state, _ = writer.admit(state, 0, max_tokens=32, tokens=prompt)
    for layer in range(LAYERS):
        state = writer.load(state, layer, kv[layer, 0], kv[layer, 1], slot=0)
    writer.release(state, 0, tokens=prompt)
    writer.close()
    return prompt, kv


def check_rows(cache, state, slot, kv):
    """``slot``'s first 16 rows (the published blocks) in every layer equal ``kv``'s."""
    for layer in range(LAYERS):
        k, v = cache.read(state, layer, slot)
        np.testing.assert_array_equal(k, kv[layer, 0, :16])
        np.testing.assert_array_equal(v, kv[layer, 1, :16])


@pytest.mark.parametrize(
    "devices, rows",
    [(1, {}), (2, {}), (2, dict(tier_dtype="int8"))],
    ids=["one-device", "mesh", "mesh-int8"],
)
def test_imported_blocks_of_a_persistent_pool_are_committed_and_mapped_after_a_restart(
    tmp_path, devices, rows
):
    shared, data = tmp_path / "shared", tmp_path / "data"
    shared.mkdir()
    data.mkdir()
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 1000, 17)
    kv = rng.standard_normal((LAYERS, 2, 17, HEADS, HEAD_DIM)).astype(jnp.bfloat16)
    # One device: its blocks are a mesh pool's too, unless quantized (keyed apart by the
    # devices: a mesh writes them). Quantized blocks reach the tier with every head's codes
    # joined, then the scales, as a flush writes rows.
    raw = bool(rows)
    writer = make_cache(shared, **rows, **(mesh_options(devices) if raw else {}))
    state = writer.init(admit=False)
    state, _ = writer.admit(state, 0, max_tokens=32, tokens=prompt)
    for layer in range(LAYERS):
        state = writer.load(state, layer, kv[layer, 0], kv[layer, 1], slot=0)
    published = [writer.read(state, layer, 0, 0, 16, raw=raw) for layer in range(LAYERS)]
    writer.release(state, 0, tokens=prompt)
    writer.close()

    persistent = dict(tier="file", path=str(data), file_name="kv", **rows, **mesh_options(devices))
    reader = make_cache(shared, **persistent)
    state = reader.init(admit=False)
    # The imported blocks reach the tier at the reservation: the index holds them from then.
    state, cached = reader.admit(state, 0, max_tokens=32, tokens=prompt)
    assert cached == 16
    reader.close(reader.commit(state))

    # verify=True on re-attach checks the indexed blocks; no level to import from now.
    reader = tps.HostPoolKVCache(
        num_layers=LAYERS, batch=2, max_len=64, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        block_tokens=BT, dtype=jnp.bfloat16, staging_bytes=1 << 20, **persistent,
    )  # fmt: skip
    state = reader.init()
    np.testing.assert_array_equal(reader.lengths(state), [16, 0])
    for layer in range(LAYERS):
        got = reader.read(state, layer, 0, raw=raw)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(published[layer])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if not raw:  # The rows loaded, K of the last layer.
        np.testing.assert_array_equal(got[0], kv[-1, 0, :16])
    reader.close()


def test_quantized_blocks_are_not_shared_between_one_device_and_a_mesh(tmp_path):
    # A quantized row holds every head's codes, then the scales: a mesh pool's rows do not
    # join into a one-device pool's, so their prefixes are keyed apart (a miss, not a mix).
    # head_dim 28: a row of one head (28 codes, a 4-byte scale) and of two (56, 8) need no
    # padding, so both pools' blocks have the same size.
    def make(**options):
        return tps.HostPoolKVCache(
            num_layers=LAYERS, batch=2, max_len=64, num_kv_heads=HEADS, head_dim=28,
            block_tokens=BT, dtype=jnp.bfloat16, staging_bytes=1 << 20, tier_dtype="int8",
            shared_prefix_dir=str(tmp_path), **options,
        )  # fmt: skip

    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1000, 17)
    writer = make()
    state = writer.init(admit=False)
    state, _ = writer.admit(state, 0, max_tokens=32, tokens=prompt)
    rows = rng.standard_normal((17, HEADS, 28)).astype(jnp.bfloat16)
    for layer in range(LAYERS):
        state = writer.load(state, layer, rows, rows, slot=0)
    writer.release(state, 0, tokens=prompt)
    writer.close()
    assert len(list(tmp_path.iterdir())) == 2
    reader = make(**mesh_options(2))
    assert reader.slots.store.payload_bytes == writer.slots.store.payload_bytes
    state, cached = reader.admit(reader.init(admit=False), 0, max_tokens=32, tokens=prompt)
    assert cached == 0
    reader.close()
