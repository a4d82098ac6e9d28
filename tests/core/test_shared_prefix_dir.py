"""Prefix blocks shared between processes through one directory (shared_prefix_dir)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

import jax_tpusync as tps

from support import child_env

LAYERS, HEADS, DIM, BLOCK = 2, 2, 16, 8
TOKENS = np.arange(100, 164)  # 64 token ids: 8 blocks.


def make_cache(directory, **overrides):
    args = dict(
        num_layers=LAYERS,
        batch=2,
        max_len=64,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=jnp.float32,
        block_tokens=BLOCK,
        model_id="shared-test",
        shared_prefix_dir=str(directory),
    )
    args.update(overrides)
    return tps.OffloadedKVCache(**args)


def kv_of(tokens):
    """KV rows that depend only on the token ids: [LAYERS, 2, n, HEADS, DIM]."""
    t = np.asarray(tokens, np.float32)[None, None, :, None, None]
    layer = np.arange(LAYERS, dtype=np.float32)[:, None, None, None, None]
    kv = np.arange(2, dtype=np.float32)[None, :, None, None, None]
    head = np.arange(HEADS, dtype=np.float32)[None, None, None, :, None]
    return t * (layer + 1) + kv / 2 + head / 4 + np.arange(DIM, dtype=np.float32) / 100


def write_and_release(cache, state, slot, tokens):
    """Admits ``tokens`` (what is cached is kept), writes the rest of their KV, releases."""
    state, cached = cache.admit(state, slot, tokens=tokens, max_tokens=64)
    kv = kv_of(tokens)
    for layer in range(LAYERS):
        state = cache.load(
            state,
            layer,
            kv[layer, 0][None, cached:].repeat(2, 0),
            kv[layer, 1][None, cached:].repeat(2, 0),
            start=cached,
            lengths=[len(tokens) - cached if b == slot else 0 for b in range(2)],
        )
    return cache.release(state, slot, tokens=tokens), cached


PEER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from support import load_module
    t = load_module(sys.argv[2])
    cache = t.make_cache(sys.argv[1])
    state = cache.init(admit=False)
    # Blocks 0-3 were published by the test process: imported, then 4-5 written here.
    state, cached = t.write_and_release(cache, state, 1, t.TOKENS[:48])
    print(cached, cache.prefix_stats["shared_imported"], cache.prefix_stats["shared_published"])
    """
)


def test_blocks_published_by_one_process_are_imported_by_another(tmp_path):
    shared = tmp_path / "shared"
    with make_cache(shared) as cache:
        state = cache.init(admit=False)
        state, cached = write_and_release(cache, state, 0, TOKENS[:33])  # 4 full blocks.
        assert cached == 0
        assert cache.prefix_stats["shared_published"] == 4
    assert len(list(shared.glob("*.kvblock"))) == 4
    peer = subprocess.run(
        [sys.executable, "-c", PEER, str(shared), __file__],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert peer.returncode == 0, peer.stderr[-3000:]
    assert peer.stdout.split() == ["32", "4", "2"]  # Cached 32, imported 4, published 2.
    # A third cache sees the blocks of both processes.
    with make_cache(shared, batch=1) as cache:
        state = cache.init(admit=False)
        state, cached = cache.admit(state, 0, tokens=TOKENS[:49], max_tokens=64)
        assert cached == 48
        want = kv_of(TOKENS[:48])
        for layer in range(LAYERS):
            k, v = cache.read(state, layer, 0, 0, 48)
            np.testing.assert_array_equal(k, want[layer, 0])
            np.testing.assert_array_equal(v, want[layer, 1])


def test_another_model_id_or_geometry_shares_nothing(tmp_path):
    with make_cache(tmp_path) as cache:
        write_and_release(cache, cache.init(admit=False), 0, TOKENS[:33])
    for overrides in (dict(model_id="other-model"), dict(dtype=jnp.bfloat16), dict(num_kv_heads=1)):
        with make_cache(tmp_path, **overrides) as other:
            _, cached = other.admit(other.init(admit=False), 0, tokens=TOKENS[:33], max_tokens=64)
            assert cached == 0, overrides


def _publish_first_block(tmp_path):
    with make_cache(tmp_path) as cache:
        write_and_release(cache, cache.init(admit=False), 0, TOKENS[:9])  # 1 full block.
    (path,) = tmp_path.glob("*.kvblock")
    return path


def test_a_flipped_last_payload_byte_is_a_miss_and_a_warning_naming_the_file(tmp_path, caplog):
    path = _publish_first_block(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # The edge: the payload's last byte.
    path.write_bytes(bytes(data))
    with make_cache(tmp_path) as cache:
        with caplog.at_level(logging.WARNING, logger="jax_tpusync.core.levels"):
            state, cached = cache.admit(cache.init(admit=False), 0, tokens=TOKENS[:9], max_tokens=64)
        assert cached == 0
        assert f"shared block {path}: checksum mismatch" in caplog.text
        assert cache.prefix_stats["shared_damaged"] == 1
        # Nothing of the damaged block was mapped or indexed: the slot got fresh blocks.
        assert cache.prefix_stats["indexed_blocks"] == 0
        assert cache.free_blocks == cache.spec.num_blocks - 8
        cache.release(state, 0)


def test_a_truncated_file_and_a_foreign_header_are_misses(tmp_path, caplog):
    path = _publish_first_block(tmp_path)
    whole = path.read_bytes()
    for damaged, message in ((whole[:-1], "payload bytes, expected"), (b"garbage!" + whole[8:], "unreadable header")):
        path.write_bytes(damaged)
        caplog.clear()
        with make_cache(tmp_path) as cache:
            with caplog.at_level(logging.WARNING, logger="jax_tpusync.core.levels"):
                _, cached = cache.admit(cache.init(admit=False), 0, tokens=TOKENS[:9], max_tokens=64)
            assert cached == 0
            assert message in caplog.text and str(path) in caplog.text


def test_a_file_holding_other_tokens_under_the_key_is_never_used(tmp_path):
    """A digest collision, forced: the file under block 0's key holds tokens that differ
    in their last id only. The match stops there; nothing is mapped."""
    with make_cache(tmp_path) as cache:
        key = cache.slots.prefix.keys(TOKENS[:8])[0]
        directory = cache.slots.remote_levels[0]
        other = TOKENS[:8].copy()
        other[-1] += 1
        directory.publish(key, None, other, np.zeros(directory.payload_bytes, np.uint8))
        _, cached = cache.admit(cache.init(admit=False), 0, tokens=TOKENS[:9], max_tokens=64)
        assert cached == 0


def test_leftover_temporary_files_are_ignored(tmp_path):
    (tmp_path / ".tmp-123-abc").write_bytes(b"half a block")
    path = _publish_first_block(tmp_path)
    with make_cache(tmp_path) as cache:
        _, cached = cache.admit(cache.init(admit=False), 0, tokens=TOKENS[:9], max_tokens=64)
        assert cached == 8
    assert path.exists()
