"""The Mooncake Store as a remote prefix level: blocks published by one cache and admitted by
another (in a second process), every check of a hit, and every fault a miss in a deadline.

Each test's masters are real ``mooncake_master`` processes on loopback (conftest.py); every
wait is bounded and every subprocess has a timeout."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync import prefix
from jax_tpusync.mooncake_level import MooncakeStoreLevel, make_level
from jax_tpusync.slots import SlotTable

LAYERS, HEADS, DIM, BLOCK = 2, 2, 16, 8
TOKENS = np.arange(100, 164)  # 64 token ids: 8 blocks.
HERE = Path(__file__).resolve().parent
SUBPROCESS_TIMEOUT = 120
LOGGER = "jax_tpusync.mooncake_level"


# -- helpers ------------------------------------------------------------------------------------


def make_cache(**overrides) -> tps.OffloadedKVCache:
    args = dict(
        num_layers=LAYERS,
        batch=2,
        max_len=64,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=jnp.float32,
        block_tokens=BLOCK,
        model_id="mooncake-test",
    )
    args.update(overrides)
    return tps.OffloadedKVCache(**args)


def attach(cache, master: str, **overrides) -> MooncakeStoreLevel:
    """A Mooncake level appended to ``cache``'s remote levels (one object per layer)."""
    args = dict(
        root=cache.slots.prefix.root,
        num_layers=LAYERS,
        block_tokens=BLOCK,
        block_bytes=cache.spec.block_bytes,
        segment_bytes=16 << 20,
        object_bytes=2 * cache.spec.block_bytes,
        deadline_s=3.0,
    )
    args.update(overrides)
    level = MooncakeStoreLevel(master, **args)
    cache.slots.remote_levels = cache.slots.remote_levels + (level,)
    return level


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
    batch = cache.spec.batch
    for layer in range(LAYERS):
        state = cache.load(
            state,
            layer,
            kv[layer, 0][None, cached:].repeat(batch, 0),
            kv[layer, 1][None, cached:].repeat(batch, 0),
            start=cached,
            lengths=[len(tokens) - cached if b == slot else 0 for b in range(batch)],
        )
    return cache.release(state, slot, tokens=tokens), cached


def assert_kv(cache, state, slot, tokens):
    want = kv_of(tokens)
    for layer in range(LAYERS):
        k, v = cache.read(state, layer, slot, 0, len(tokens))
        np.testing.assert_array_equal(k, want[layer, 0])
        np.testing.assert_array_equal(v, want[layer, 1])


ROOT = prefix.root_key("mooncake-level-test", dict(layers=LAYERS))


def level(master: str, **overrides) -> MooncakeStoreLevel:
    """A level of the small synthetic geometry (payloads of 4 x 8 KiB ranges)."""
    args = dict(
        root=ROOT,
        num_layers=4,
        block_tokens=BLOCK,
        block_bytes=4096,
        segment_bytes=16 << 20,
        object_bytes=8192,
        deadline_s=3.0,
        retry_after_s=0.5,
    )
    args.update(overrides)
    return MooncakeStoreLevel(master, **args)


def chain(n: int, start: int = 0):
    """(keys, parents, token blocks) of a sequence of ``n`` blocks from ``ROOT``."""
    keys, parents, blocks = [], [], []
    parent = ROOT
    for i in range(n):
        tokens = np.arange(start + i * BLOCK, start + (i + 1) * BLOCK, dtype=np.int64)
        key = prefix.chain_key(parent, tokens)
        keys.append(key)
        parents.append(None if parent is ROOT else parent)
        blocks.append(tokens)
        parent = key
    return keys, parents, blocks


def payload_of(lv: MooncakeStoreLevel, i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, lv.payload_bytes, dtype=np.uint8)


def timed(fn, *args):
    t = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t


def raw_client(master: str):
    """A plain store client of the test's own (to damage and remove objects)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 << 20, "tcp", "", master) == 0
    return client


def run_python(code: str, *args: str, timeout: float = SUBPROCESS_TIMEOUT, **kw):
    """A fresh interpreter (never a fork of this process, whose client runs threads)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=kw.pop("cwd", "/"),  # Not the source tree, whose package has no built extension.
        **kw,
    )


# -- through the cache, two processes -----------------------------------------------------------

PEER = """
    import json, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import test_mooncake_level as t
    cache = t.make_cache()
    # A client that gives the pool no memory: what it publishes lives in the first
    # process's segment, and outlives this process.
    level = t.attach(cache, sys.argv[1], segment_bytes=0)
    # Slot 1 holds every other block: the imports land in blocks 1, 3, 5, 7.
    cache.slots.place(1, [0, 2, 4, 6], 32)
    state = cache.init(admit=False)
    start = time.perf_counter()
    state, cached = cache.admit(state, 0, tokens=t.TOKENS[:41], max_tokens=64)
    admit_s = time.perf_counter() - start
    table = cache.block_tables[0][:5].tolist()
    t.assert_kv(cache, state, 0, t.TOKENS[:cached])
    # Extend the prefix to 6 blocks and publish the 2 new ones.
    state = cache.release(state, 0, tokens=t.TOKENS[:cached])
    state, _ = t.write_and_release(cache, state, 0, t.TOKENS[:48])
    print(json.dumps(dict(cached=cached, table=table, admit_s=admit_s, **level.stats())))
    level.close()
"""


def test_blocks_published_by_one_cache_are_admitted_by_a_second_process(mooncake_master):
    with make_cache() as cache:
        level = attach(cache, mooncake_master.address)
        state = cache.init(admit=False)
        state, cached = write_and_release(cache, state, 0, TOKENS[:33])  # 4 full blocks.
        assert cached == 0
        stats = cache.prefix_stats
        assert stats["mooncake_published"] == 4 and stats["mooncake_publish_failures"] == 0
        peer = run_python(PEER, mooncake_master.address, str(HERE))
        assert peer.returncode == 0, peer.stderr[-3000:]
        out = json.loads(peer.stdout.strip().splitlines()[-1])
        assert out["cached"] == 32
        assert out["mooncake_imported"] == 4 and out["mooncake_damaged"] == 0
        # Into the free blocks between slot 1's: not one contiguous run.
        assert out["table"][:4] == [1, 3, 5, 7]
        assert out["mooncake_published"] == 2  # Blocks 4 and 5, new to the store.
        # The first process finds the second's blocks past its own index: 6 blocks.
        state, cached = cache.admit(state, 1, tokens=TOKENS[:49], max_tokens=64)
        assert cached == 48
        assert cache.prefix_stats["mooncake_imported"] == 2
        assert_kv(cache, state, 1, TOKENS[:48])
        level.close()


def test_a_remote_hit_after_the_local_index_was_cleared(mooncake_master):
    with make_cache(model_id="mooncake-test-evicted") as cache:
        level = attach(cache, mooncake_master.address)
        state = cache.init(admit=False)
        state, _ = write_and_release(cache, state, 0, TOKENS[:25])  # 3 full blocks.
        p = cache.slots.prefix
        p.evict(p.cached_blocks)
        assert len(p) == 0
        state, cached = cache.admit(state, 0, tokens=TOKENS[:25], max_tokens=64)
        assert cached == 24
        assert cache.prefix_stats["mooncake_imported"] == 3
        assert_kv(cache, state, 0, TOKENS[:24])
        level.close()


# -- the slot table alone -------------------------------------------------------------------------


class BlockBytes:
    """A BlockStore of whole payloads by block id."""

    def __init__(self, size: int):
        self.size = size
        self.blocks: dict[int, np.ndarray] = {}

    def read_blocks(self, blocks):
        return [self.blocks[int(b)].copy() for b in blocks]

    def write_block(self, block, payload):
        assert payload.size == self.size
        self.blocks[int(block)] = np.array(payload, np.uint8)


def table(store, lv, num_blocks=16):
    return SlotTable(
        batch=2,
        max_len=64 * BLOCK,
        block_tokens=BLOCK,
        num_blocks=num_blocks,
        root=ROOT,
        store=store,
        remote_levels=[lv],
    )


def test_the_slot_table_publishes_and_a_fresh_table_imports(mooncake_master):
    writer, reader = level(mooncake_master.address), level(mooncake_master.address, segment_bytes=0)
    assert len(writer.layer_ranges) == 4
    tokens = np.arange(5000, 5000 + 4 * BLOCK + 3)
    store = BlockBytes(writer.payload_bytes)
    t = table(store, writer)
    t.admit(0, 64, tokens)
    held = t.table_row(0)[:4]
    for i, b in enumerate(held):
        store.write_block(int(b), payload_of(writer, 100 + i))
    t.release(0, len(tokens), tokens)
    assert writer.stats()["mooncake_published"] == 4
    other = BlockBytes(reader.payload_bytes)
    t2 = table(other, reader)
    admission = t2.admit(1, 64, tokens)
    assert admission.cached == 4 * BLOCK
    for i, b in enumerate(t2.table_row(1)[:4]):
        np.testing.assert_array_equal(other.blocks[int(b)], payload_of(writer, 100 + i))
    # Published again by the reader: every block is there already, nothing is put.
    t2.release(1, len(tokens), tokens)
    assert reader.stats()["mooncake_published"] == 0
    writer.close()
    reader.close()


# -- every hit checked ----------------------------------------------------------------------------


def _header(client, lv, key):
    data = client.get(lv.header_key(key))
    assert data
    return data, json.loads(data[16:])


def test_missing_key_is_a_plain_miss(mooncake_master, caplog):
    lv = level(mooncake_master.address)
    keys, parents, blocks = chain(1, start=900_000)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert not lv.has(keys[0])
        assert lv.load(keys[0], parents[0], blocks[0]) is None
    assert not caplog.records
    s = lv.stats()
    assert s["mooncake_misses"] == 1 and s["mooncake_faults"] == 0
    lv.close()
    # A closed level is a miss too (a cache may outlive it).
    assert lv.load(keys[0], parents[0], blocks[0]) is None and not lv.has(keys[0])
    assert not lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0))
    assert lv.stats()["mooncake_skipped"] == 3


def test_collision_and_damaged_blocks_are_misses_with_a_warning(mooncake_master, caplog):
    lv = level(mooncake_master.address)
    client = raw_client(mooncake_master.address)
    keys, parents, blocks = chain(4, start=700_000)
    for i in range(4):
        assert lv.publish(keys[i], parents[i], blocks[i], payload_of(lv, i))
    assert not lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 99))  # First wins.
    np.testing.assert_array_equal(lv.load(keys[0], parents[0], blocks[0]), payload_of(lv, 0))

    def refused(i, tokens=None, parent=...):
        caplog.clear()
        with caplog.at_level(logging.WARNING, LOGGER):
            got = lv.load(
                keys[i],
                parents[i] if parent is ... else parent,
                blocks[i] if tokens is None else tokens,
            )
        assert got is None
        return " ".join(r.getMessage() for r in caplog.records)

    # A digest collision: the header names other tokens, or another parent.
    assert "collision" in refused(1, tokens=blocks[1] + 1)
    assert "collision" in refused(1, parent=keys[3])
    # A flipped byte in a layer range.
    data, header = _header(client, lv, keys[2])
    first, end, checksum = header["ranges"][1]
    name = lv.range_key(keys[2], first, end, checksum)
    body = bytearray(client.get(name))
    body[100] ^= 0x10
    assert client.upsert(name, bytes(body)) == 0
    assert "checksum mismatch" in refused(2)
    # A header that is not one, one written for another geometry, one of another block.
    data, _ = _header(client, lv, keys[3])
    assert client.upsert(lv.header_key(keys[3]), b"not a header at all") == 0
    assert "unreadable header" in refused(3)
    foreign = data.replace(b'"block_tokens":8', b'"block_tokens":9')
    assert client.upsert(lv.header_key(keys[3]), foreign) == 0
    assert "block_tokens is 9" in refused(3)
    assert client.upsert(lv.header_key(keys[3]), _header(client, lv, keys[2])[0]) == 0
    assert f"key is '{keys[2].hex()}'" in refused(3)
    # A range gone (as eviction leaves it).
    data, header = _header(client, lv, keys[0])
    assert client.remove(lv.range_key(keys[0], *header["ranges"][0]), True) == 0
    assert "gone (evicted)" in refused(0)
    s = lv.stats()
    assert s["mooncake_damaged"] == 6 and s["mooncake_fault_evicted"] == 1
    assert s["mooncake_imported"] == 1
    client.close()
    lv.close()


# -- faults: each a miss within the deadline --------------------------------------------------


def test_master_killed_then_restarted_is_a_miss_and_loses_every_object(make_master, caplog):
    master = make_master()
    lv = level(master.address, deadline_s=2.0, retry_after_s=0.5)
    keys, parents, blocks = chain(3, start=300_000)
    for i in range(2):
        assert lv.publish(keys[i], parents[i], blocks[i], payload_of(lv, i))
    master.kill()
    with caplog.at_level(logging.WARNING, LOGGER):
        for call in (
            lambda: lv.load(keys[0], parents[0], blocks[0]),
            lambda: lv.has(keys[1]),
            lambda: lv.publish(keys[2], parents[2], blocks[2], payload_of(lv, 2)),
        ):
            got, seconds = timed(call)
            assert got in (None, False) and seconds < 2.5
    assert any(
        "cannot be reached" in r.getMessage() or "longer than" in r.getMessage()
        for r in caplog.records
    )
    assert lv.stats()["mooncake_publish_failures"] == 1
    master.start()
    # The client finds the restarted master by itself; bounded wait for the first publish.
    deadline = time.monotonic() + 20
    while not lv.publish(keys[2], parents[2], blocks[2], payload_of(lv, 2)):
        assert time.monotonic() < deadline, lv.stats()
        time.sleep(0.25)
    np.testing.assert_array_equal(lv.load(keys[2], parents[2], blocks[2]), payload_of(lv, 2))
    # What the old master knew is gone: misses, not errors.
    assert lv.load(keys[0], parents[0], blocks[0]) is None and not lv.has(keys[1])
    s = lv.stats()
    assert s["mooncake_fault_unreachable"] + s["mooncake_fault_timeout"] >= 1
    lv.close()


def test_a_hung_master_is_a_miss_within_the_deadline(make_master):
    master = make_master()
    lv = level(master.address, deadline_s=1.0, retry_after_s=0.5)
    keys, parents, blocks = chain(2, start=400_000)
    assert lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0))
    master.pause()
    try:
        # A call waits at most the deadline (the client may also give up sooner by itself).
        got, seconds = timed(lv.has, keys[1])
        assert got is False and seconds < 2.0, (seconds, lv.stats())
        if lv.stats()["mooncake_fault_timeout"]:
            # That call is still stuck: the next ones are misses at once, even past
            # retry_after_s.
            for pause in (0.0, 0.6):
                time.sleep(pause)
                got, seconds = timed(lv.load, keys[1], parents[1], blocks[1])
                assert got is None and seconds < 0.2, (seconds, lv.stats())
        got, seconds = timed(lv.load, keys[0], parents[0], blocks[0])
        assert seconds < 2.0, (seconds, lv.stats())
    finally:
        master.resume()
    s = lv.stats()
    assert s["mooncake_fault_timeout"] + s["mooncake_fault_unreachable"] >= 1, s
    deadline = time.monotonic() + 15
    while not lv.publish(keys[1], parents[1], blocks[1], payload_of(lv, 1)):
        assert time.monotonic() < deadline, lv.stats()
        time.sleep(0.25)
    np.testing.assert_array_equal(lv.load(keys[1], parents[1], blocks[1]), payload_of(lv, 1))
    lv.close()


def test_objects_a_killed_writer_left_unfinished_are_misses(mooncake_master):
    lv = level(mooncake_master.address)
    client = raw_client(mooncake_master.address)
    keys, parents, blocks = chain(2, start=800_000)
    assert lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0))
    # A put started and never finished, as a writer killed mid-put leaves it: the header
    # of one block, a layer range of another.
    assert client.batch_put_session_start([lv.header_key(keys[1])], [100]) == [0]
    _, header = _header(client, lv, keys[0])
    name = lv.range_key(keys[0], *header["ranges"][0])
    assert client.remove(name, True) == 0
    assert client.batch_put_session_start([name], [8192]) == [0]
    for i in (0, 1):
        got, seconds = timed(lv.load, keys[i], parents[i], blocks[i])
        assert got is None and seconds < 1.0
    assert lv.stats()["mooncake_fault_not_ready"] == 2
    client.close()
    lv.close()


HOLDER = """
    import sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import test_mooncake_level as t
    lv = t.level(sys.argv[1])
    keys, parents, blocks = t.chain(3, start=500_000)
    for i in range(3):
        assert lv.publish(keys[i], parents[i], blocks[i], t.payload_of(lv, i))
    print("published", flush=True)
    time.sleep(120)
"""


def test_a_killed_holder_is_a_miss_within_the_deadline(make_master):
    master = make_master()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), master.address, str(HERE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd="/",  # Not the source tree, whose package has no built extension.
    )
    try:
        line = holder.stdout.readline()  # Bounded by the holder's own sleep and the kill below.
        assert line.strip() == "published", "the holder process failed"
        reader = level(master.address, segment_bytes=0, deadline_s=2.0)
        keys, parents, blocks = chain(3, start=500_000)
        np.testing.assert_array_equal(
            reader.load(keys[0], parents[0], blocks[0]), payload_of(reader, 0)
        )
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        for i in (1, 2):
            got, seconds = timed(reader.load, keys[i], parents[i], blocks[i])
            assert got is None and seconds < 2.5
        s = reader.stats()
        assert s["mooncake_imported"] == 1
        assert (
            s["mooncake_fault_transfer"] + s["mooncake_misses"] + s["mooncake_fault_evicted"] >= 2
        )
        reader.close()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)


def _leading(present: list[bool]) -> int:
    return present.index(False) if False in present else len(present)


def test_a_full_pool_publishes_or_counts_and_admits_stop_at_the_first_missing_block(make_master):
    master = make_master()
    geometry = dict(block_bytes=256 << 10, num_layers=2, object_bytes=1 << 20)  # 1 MiB blocks.
    writer = level(master.address, **geometry)  # The pool: one 16 MiB segment.
    reader = level(master.address, segment_bytes=0, **geometry)

    def admitted(tokens, first_payload):
        store = BlockBytes(reader.payload_bytes)
        t = table(store, reader, num_blocks=64)
        cached = t.admit(0, len(tokens), tokens).cached
        for i, b in enumerate(t.table_row(0)[: cached // BLOCK]):
            np.testing.assert_array_equal(
                store.blocks[int(b)], payload_of(writer, first_payload + i)
            )
        return cached

    # A chain whose third block is gone (as eviction may leave it, parents before
    # children): its first two blocks are admitted, the fourth is not reached.
    keys, parents, blocks = chain(4, start=650_000)
    for i in range(4):
        assert writer.publish(keys[i], parents[i], blocks[i], payload_of(writer, 100 + i))
    client = raw_client(master.address)
    assert client.remove(writer.header_key(keys[2]), True) == 0
    client.close()
    assert [reader.has(k) for k in keys] == [True, True, False, True]
    assert admitted(np.concatenate([*blocks, [1]]), 100) == 2 * BLOCK
    # 40 MiB published into 16: each publish succeeds or is counted as failed.
    n = 40
    keys, parents, blocks = chain(n, start=600_000)
    wrote = [
        writer.publish(keys[i], parents[i], blocks[i], payload_of(writer, i)) for i in range(n)
    ]
    s = writer.stats()
    assert s["mooncake_published"] == 4 + sum(wrote)
    assert sum(wrote) + s["mooncake_publish_failures"] == n
    time.sleep(1.0)  # The master evicts in the background and tells no client.
    present = [reader.has(k) for k in keys]
    assert not all(present)
    leading = present.index(False)
    cached = admitted(np.concatenate([*blocks, [1]]), 0)
    # Fewer only where a header outlived a range of its block (a miss and a warning).
    assert cached == leading * BLOCK or (
        cached < leading * BLOCK and reader.stats()["mooncake_fault_evicted"] == 1
    )
    writer.close()
    reader.close()


# -- the factory and the optional import -------------------------------------------------------


def test_make_level():
    geometry = dict(root=ROOT, num_layers=2, block_tokens=BLOCK, block_bytes=1024)
    lv = make_level("mooncake://127.0.0.1:1?segment_mb=32&deadline_s=0.5&object_kb=4", **geometry)
    assert lv.master == "127.0.0.1:1" and lv.segment_bytes == 32 << 20
    assert lv.deadline_s == 0.5 and lv.layer_ranges == [(0, 2)]
    lv.close()
    assert make_level(lv, **geometry) is lv
    for bad in (
        "redis://h:1",
        "mooncake://h",
        "mooncake://h:1?bogus=1",
        "mooncake://h:1?segment_mb=x",
    ):
        with pytest.raises(ValueError, match="remote level"):
            make_level(bad, **geometry)
    with pytest.raises(TypeError, match="lacks"):
        make_level(object(), **geometry)


def test_without_the_client_the_error_names_the_extra_and_the_system_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match=r"jax-tpusync\[mooncake\].*libibverbs1"):
        level("127.0.0.1:1")


def test_a_cache_built_with_remote_prefix_publishes_and_finds_its_blocks(mooncake_master):
    """The constructor's ``remote_prefix="mooncake://..."``: the level is the cache's own
    (closed with it), searched after the local index."""
    address = f"mooncake://{mooncake_master.address}?segment_mb=16&deadline_s=3"
    with make_cache(model_id="mooncake-test-wired", remote_prefix=address) as cache:
        state = cache.init(admit=False)
        state, _ = write_and_release(cache, state, 0, TOKENS[:17])  # 2 full blocks.
        assert cache.prefix_stats["mooncake_published"] == 2
        p = cache.slots.prefix
        p.evict(p.cached_blocks)
        state, cached = cache.admit(state, 1, tokens=TOKENS[:17], max_tokens=64)
        assert cached == 16 and cache.prefix_stats["mooncake_imported"] == 2
        assert_kv(cache, state, 1, TOKENS[:16])
    with pytest.raises(ValueError, match=r"remote_prefix='redis://x:1' must be a 'mooncake://host:port'"):
        make_cache(remote_prefix="redis://x:1")


def test_a_mesh_gives_each_head_range_its_own_namespace():
    from jax_tpusync import mesh

    got = mesh._heads_address("mooncake://127.0.0.1:9?segment_mb=16", "heads0-2")
    assert got == "mooncake://127.0.0.1:9?segment_mb=16&namespace=tpusync-heads0-2"
    with pytest.raises(ValueError, match=r"must be a 'mooncake://host:port' address"):
        mesh._heads_address(object(), "heads0-2")
