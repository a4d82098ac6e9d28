"""The Mooncake Store as a remote prefix level: blocks published by one cache and admitted by
another (in a second process), every check of a hit, and every fault a miss in a deadline.

Each test's masters are real ``mooncake_master`` processes on loopback (tests/conftest.py);
every wait is bounded and every subprocess has a timeout."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core import prefix
from jax_tpusync.core.slots import SlotTable
from jax_tpusync.mooncake import transfer_memory
from jax_tpusync.mooncake.level import (
    HEADER_BATCH,
    MAX_DEADLINE_S,
    PUBLISH_BATCH_BYTES,
    MooncakeStoreLevel,
    make_level,
)

from support import child_env

# Skipped without the Mooncake client, failed instead where TPUSYNC_REQUIRE_MOONCAKE=1
# (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("mooncake_usable")

LAYERS, HEADS, DIM, BLOCK = 2, 2, 16, 8
TOKENS = np.arange(100, 164)  # 64 token ids: 8 blocks.
SUBPROCESS_TIMEOUT = 120
LOGGER = "jax_tpusync.mooncake.level"


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


class Heartbeat:
    """A thread that ticks every 0.1 s and keeps its longest gap between ticks: a call that
    holds the GIL (or blocks the process) stalls it for as long."""

    def __init__(self):
        self.gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self):
        last = time.monotonic()
        while not self._stop.wait(0.1):
            now = time.monotonic()
            self.gap = max(self.gap, now - last)
            last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)


def resume_later(master, seconds: float) -> subprocess.Popen:
    """Resumes a paused master after ``seconds`` from outside this interpreter (a thread of
    it cannot run while a call holds the GIL): a frozen call then fails the test's time
    bounds instead of hanging it. Kill the returned process to cancel."""
    return subprocess.Popen(["sh", "-c", f"sleep {seconds} && kill -CONT {master.proc.pid}"])


def cancel(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


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
        env=kw.pop("env", child_env()),
        **kw,
    )


# -- through the cache, two processes -----------------------------------------------------------

PEER = """
    import json, sys, time
    import numpy as np
    from support import load_module
    t = load_module(sys.argv[2])
    cache = t.make_cache()
    # A client that gives the pool no memory: what it publishes lives in the first
    # process's segment, and outlives this process.
    level = t.attach(cache, sys.argv[1], segment_bytes=0)
    # Slot 1 holds every other block of the pool: the imports land in blocks 1, 3, 5, 7.
    assert cache.free_blocks == 16
    cache.slots.place(1, [0, 2, 4, 6, 8, 10, 12, 14], 64)
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
        peer = run_python(PEER, mooncake_master.address, __file__)
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
    """A BlockStore over one pool laid out as a tier is (region-major: block ``b`` of
    region ``r`` at ``(r * num_blocks + b) * block_bytes``); ``in_memory``: it hands the
    level its pool, which then reads blocks straight into it."""

    def __init__(self, lv: MooncakeStoreLevel, num_blocks: int = 16, in_memory: bool = True):
        self.num_blocks = num_blocks
        self.regions = 2 * lv.num_layers
        self.block_bytes = lv.block_bytes
        self.pool = np.zeros(self.regions * num_blocks * lv.block_bytes, np.uint8)
        self.in_memory = in_memory
        self.quiesced = 0
        if in_memory:
            lv.use_memory(self.pool.ctypes.data, self.pool.nbytes)

    def _views(self, block: int) -> list[np.ndarray]:
        n, size = self.num_blocks, self.block_bytes
        return [
            self.pool[(r * n + block) * size : (r * n + block + 1) * size]
            for r in range(self.regions)
        ]

    def payload(self, block: int) -> np.ndarray:
        return np.concatenate(self._views(int(block)))

    def read_blocks(self, blocks):
        return [self.payload(b) for b in blocks]

    def write_block(self, block, payload):
        for view, part in zip(self._views(int(block)), np.split(payload, self.regions)):
            view[:] = part

    def block_memory(self, block):
        return self._views(int(block)) if self.in_memory else None

    def quiesce(self):
        self.quiesced += 1


def table(store, lv):
    return SlotTable(
        batch=2,
        max_len=64 * BLOCK,
        block_tokens=BLOCK,
        num_blocks=store.num_blocks,
        root=ROOT,
        store=store,
        remote_levels=[lv],
    )


@pytest.mark.parametrize("in_memory", [True, False], ids=["in-place", "copied"])
def test_the_slot_table_publishes_and_a_fresh_table_imports(mooncake_master, in_memory):
    writer, reader = level(mooncake_master.address), level(mooncake_master.address, segment_bytes=0)
    assert len(writer.layer_ranges) == 4
    tokens = np.arange(5000, 5000 + 4 * BLOCK + 3) + 1000 * in_memory
    store = BlockBytes(writer)
    t = table(store, writer)
    t.admit(0, 64, tokens)
    held = t.table_row(0)[:4]
    for i, b in enumerate(held):
        store.write_block(int(b), payload_of(writer, 100 + i))
    t.release(0, len(tokens), tokens)
    assert writer.stats()["mooncake_published"] == 4
    other = BlockBytes(reader, in_memory=in_memory)
    t2 = table(other, reader)
    t2.admit(0, 8, np.arange(8))  # Slot 0 takes block 0: the imports do not start at 0.
    admission = t2.admit(1, 64, tokens)
    assert admission.cached == 4 * BLOCK
    for i, b in enumerate(t2.table_row(1)[:4]):
        np.testing.assert_array_equal(other.payload(b), payload_of(writer, 100 + i))
    assert t2.table_row(1)[:4].tolist() == [1, 2, 3, 4]
    assert other.quiesced == int(in_memory)  # Once, before the one in-place request.
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


def _in_place(lv, keys, parents, blocks, store, ids):
    """lookup() then load_into() of the chain into blocks ``ids`` of ``store``."""
    wanted = list(zip(keys, parents, blocks))
    found = lv.lookup(wanted)
    return found, lv.load_into(wanted[:found], [store.block_memory(b) for b in ids[:found]])


def test_in_place_loads_land_byte_exact_in_scattered_blocks_and_are_checked_there(
    mooncake_master, caplog
):
    lv = level(mooncake_master.address)
    client = raw_client(mooncake_master.address)
    keys, parents, blocks = chain(5, start=710_000)
    for i in range(5):
        assert lv.publish(keys[i], parents[i], blocks[i], payload_of(lv, i))
    store = BlockBytes(lv, num_blocks=16)
    ids = [9, 2, 14, 5, 11]
    found, got = _in_place(lv, keys, parents, blocks, store, ids)
    assert found == 5 and got.loaded == 5 and got.busy_until == 0
    for i, b in enumerate(ids):
        np.testing.assert_array_equal(store.payload(b), payload_of(lv, i))
    untouched = [b for b in range(16) if b not in ids]
    assert not store.pool.reshape(lv.num_layers * 2, 16, -1)[:, untouched].any()

    def loaded_with_warning(expect_found, expect_loaded, text, **change):
        caplog.clear()
        store.pool[:] = 0
        k, p, b = list(keys), list(parents), list(blocks)
        for i, tokens in change.get("tokens", {}).items():
            b[i] = tokens
        with caplog.at_level(logging.WARNING, LOGGER):
            found, got = _in_place(lv, k, p, b, store, ids)
        assert (found, got.loaded, got.busy_until) == (expect_found, expect_loaded, 0)
        for i in range(expect_loaded):  # The blocks before the bad one are whole.
            np.testing.assert_array_equal(store.payload(ids[i]), payload_of(lv, i))
        assert text in " ".join(r.getMessage() for r in caplog.records)

    # A collision stops the lookup at that block.
    loaded_with_warning(1, 1, "collision", tokens={1: blocks[1] + 1})
    # A flipped byte in block 3's second range: blocks 0-2 loaded, 3 refused.
    _, header = _header(client, lv, keys[3])
    name = lv.range_key(keys[3], *header["ranges"][1])
    body = bytearray(client.get(name))
    body[5] ^= 0x01
    assert client.upsert(name, bytes(body)) == 0
    loaded_with_warning(5, 3, "checksum mismatch")
    # An object of another size under a range's name, damaged and named with both sizes
    # (the client fails a shorter one as a failed transfer, as for a holder that is gone).
    assert client.upsert(name, bytes(body) + b"x") == 0
    loaded_with_warning(5, 3, f"object {name!r} (layers 1-2) holds 8193 bytes, not 8192: size")
    assert client.upsert(name, bytes(body[:-1])) == 0
    loaded_with_warning(5, 3, f"object {name!r} (layers 1-2) holds 8191 bytes, not 8192: trunc")
    # A range gone: a miss, counted as evicted.
    _, header = _header(client, lv, keys[2])
    assert client.remove(lv.range_key(keys[2], *header["ranges"][0]), True) == 0
    loaded_with_warning(5, 2, "gone (evicted)")
    s = lv.stats()
    assert s["mooncake_damaged"] == 4 and s["mooncake_fault_evicted"] == 1
    assert s["mooncake_fault_transfer"] == 0
    assert s["mooncake_imported"] == 5 + 1 + 3 + 3 + 3 + 2
    # A header gone ends the lookup there (eviction may take a parent before a child).
    assert client.remove(lv.header_key(keys[1]), True) == 0
    assert lv.lookup(list(zip(keys, parents, blocks))) == 1
    client.close()
    lv.close()


def test_runs_of_blocks_are_published_a_batch_a_request_and_read_back(make_master):
    master = make_master()
    lv = level(master.address, segment_bytes=32 << 20)
    # A batch is HEADER_BATCH blocks here (their bytes fit): 40 blocks are two, 32 and 8.
    assert HEADER_BATCH == 32 and PUBLISH_BATCH_BYTES // lv.payload_bytes >= 32
    keys, parents, blocks = chain(40, start=730_000)
    assert lv.missing(keys) == list(range(40))
    items = [(keys[i], parents[i], blocks[i], payload_of(lv, 300 + i)) for i in range(40)]
    assert lv.publish_many(items[:3]) == 3
    assert lv.missing(keys) == list(range(3, 40))
    assert lv.publish_many([items[i] for i in lv.missing(keys)]) == 37
    assert lv.missing(keys) == [] and lv.stats()["mooncake_published"] == 40
    store = BlockBytes(lv, num_blocks=48)
    wanted = list(zip(keys, parents, blocks))
    assert lv.lookup(wanted) == 40
    ids = list(range(47, 7, -1))  # Scattered, backwards.
    assert lv.load_into(wanted, [store.block_memory(b) for b in ids]).loaded == 40
    for i, b in enumerate(ids):
        np.testing.assert_array_equal(store.payload(b), payload_of(lv, 300 + i))
    # Published from views of scattered blocks of a pool (as a release on a host tier
    # does): the same objects as from contiguous bytes, read back byte-exact.
    pool = BlockBytes(lv, num_blocks=8)
    views_of = {i: pool.block_memory(b) for i, b in zip(range(3), (6, 1, 4))}
    for i, views in views_of.items():
        for r, view in enumerate(views):
            view[:] = payload_of(lv, 500 + i)[r * lv.block_bytes : (r + 1) * lv.block_bytes]
    fresh = chain(3, start=750_000)
    items = [(fresh[0][i], fresh[1][i], fresh[2][i], views_of[i]) for i in range(3)]
    assert lv.publish_many(items) == 3
    pool.pool[:] = 0  # Reused at once: what was published is the store's.
    wanted = list(zip(*fresh))
    assert lv.lookup(wanted) == 3
    assert lv.load_into(wanted, [store.block_memory(b) for b in (0, 1, 2)]).loaded == 3
    for i in range(3):
        np.testing.assert_array_equal(store.payload(i), payload_of(lv, 500 + i))
    views = views_of[0]
    for bad in (views[:-1], [*views[:-1], views[-1][:-1]], [*views[:-1], views[-1].view(np.int8)]):
        with pytest.raises(ValueError, match="a payload given as regions needs 8 uint8 views"):
            lv.publish_many([(fresh[0][0], None, fresh[2][0], bad)])
    # The master gone: a miss within the deadline, every block counted, nothing raised.
    master.kill()
    more = chain(2, start=740_000)
    got, seconds = timed(
        lv.publish_many, [(more[0][i], more[1][i], more[2][i], payload_of(lv, i)) for i in (0, 1)]
    )
    assert got == 0 and seconds < lv.deadline_s + 1.0
    assert lv.stats()["mooncake_publish_failures"] == 2
    lv.close()


def test_load_into_refuses_what_was_not_looked_up_and_bad_destinations(mooncake_master):
    lv = level(mooncake_master.address)
    keys, parents, blocks = chain(2, start=720_000)
    assert lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0))
    store = BlockBytes(lv, num_blocks=4)
    wanted = list(zip(keys, parents, blocks))
    assert lv.lookup(wanted) == 1
    with pytest.raises(ValueError, match="was not found by the last lookup"):
        lv.load_into(wanted, [store.block_memory(0), store.block_memory(1)])
    with pytest.raises(ValueError, match="1 destinations for 2 blocks"):
        lv.load_into(wanted, [store.block_memory(0)])
    views = store.block_memory(0)
    for bad in (views[:-1], [*views[:-1], views[-1][:-1]]):
        with pytest.raises(ValueError, match="must be 8 views of 4096 bytes"):
            lv.load_into(wanted[:1], [bad])
    assert lv.load_into(wanted[:1], [views]).loaded == 1
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
            assert got in (None, False) and seconds < 3.5
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


def test_a_hung_master_is_a_miss_within_the_deadline(make_master, monkeypatch):
    # The client's own limit on a request to its master as the environment sets it (30 s,
    # its default), not the deadline: the call that passes the deadline stays stuck.
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "30000")
    master = make_master()
    lv = level(master.address, deadline_s=1.0, retry_after_s=0.5)
    keys, parents, blocks = chain(2, start=400_000)
    assert lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0))
    master.pause()
    try:
        # A call waits at most the deadline (the client may also give up sooner by itself).
        got, seconds = timed(lv.has, keys[1])
        assert got is False and seconds < 2.5, (seconds, lv.stats())
        if lv.stats()["mooncake_fault_timeout"]:
            # That call is still stuck: the next ones are misses at once, even past
            # retry_after_s.
            for pause in (0.0, 0.6):
                time.sleep(pause)
                got, seconds = timed(lv.load, keys[1], parents[1], blocks[1])
                assert got is None and seconds < 0.5, (seconds, lv.stats())
            if not lv.settled():
                # A publish too, before it stages anything into the buffer the stuck call
                # owns.
                failures = lv.stats()["mooncake_publish_failures"]
                item = (keys[1], parents[1], blocks[1], payload_of(lv, 1))
                got, seconds = timed(lv.publish_many, [item])
                assert got == 0 and seconds < 0.5, (seconds, lv.stats())
                assert lv.stats()["mooncake_publish_failures"] == failures + 1
        got, seconds = timed(lv.load, keys[0], parents[0], blocks[0])
        assert seconds < 2.5, (seconds, lv.stats())
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


# The client's setup() and close() hold the GIL while they wait for the master: a first
# call (the client connects then) or a close must never reach them while it does not answer.
DEADLINE = 1.0
WITHIN = DEADLINE + 1.5  # The deadline, and room for a loaded 2-core runner.
STILL = 1.0  # The longest a 0.1 s heartbeat may stall.


def recovers(lv, start: int) -> None:
    """``lv`` connects and publishes (bounded) once its master answers again."""
    keys, parents, blocks = chain(1, start=start)
    deadline = time.monotonic() + 20
    while not lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0)):
        assert time.monotonic() < deadline, lv.stats()
        time.sleep(0.25)
    np.testing.assert_array_equal(lv.load(keys[0], parents[0], blocks[0]), payload_of(lv, 0))


def test_a_first_call_to_a_stopped_master_is_a_miss_within_the_deadline(make_master, caplog):
    master = make_master()
    master.pause()
    net = resume_later(master, 30)
    try:
        lv = level(master.address, deadline_s=DEADLINE, retry_after_s=0.5)
        keys, parents, blocks = chain(2, start=420_000)
        with caplog.at_level(logging.WARNING, LOGGER), Heartbeat() as beat:
            got, seconds = timed(lv.has, keys[0])
            assert got is False and seconds < WITHIN, (seconds, lv.stats())
            time.sleep(0.6)  # Past retry_after_s: asked again, a miss again.
            got, seconds = timed(lv.load, keys[1], parents[1], blocks[1])
            assert got is None and seconds < WITHIN, (seconds, lv.stats())
        assert beat.gap < STILL, beat.gap
        assert lv.stats()["mooncake_fault_unreachable"] == 2
        assert "did not answer within 1 s" in caplog.text
    finally:
        master.resume()
        cancel(net)
    recovers(lv, 421_000)
    lv.close()


def test_a_first_call_to_a_killed_master_is_a_miss_at_once(make_master, caplog):
    master = make_master()
    master.kill()
    lv = level(master.address, deadline_s=DEADLINE, retry_after_s=0.5)
    keys, parents, blocks = chain(1, start=430_000)
    with caplog.at_level(logging.WARNING, LOGGER), Heartbeat() as beat:
        got, seconds = timed(lv.publish, keys[0], parents[0], blocks[0], payload_of(lv, 0))
    assert got is False and seconds < WITHIN and beat.gap < STILL, (seconds, beat.gap)
    s = lv.stats()
    assert s["mooncake_fault_unreachable"] == 1 and s["mooncake_publish_failures"] == 1
    assert "cannot be reached" in caplog.text and "connecting to it failed" in caplog.text
    master.start()
    recovers(lv, 431_000)
    lv.close()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_closing_a_level_whose_master_does_not_answer_returns_within_the_deadline(
    make_master, caplog, how
):
    master = make_master()
    lv = level(master.address, deadline_s=DEADLINE)
    keys, parents, blocks = chain(1, start=440_000)
    assert lv.publish(keys[0], parents[0], blocks[0], payload_of(lv, 0))  # Connected.
    master.pause() if how == "stopped" else master.kill()
    net = resume_later(master, 30) if how == "stopped" else None
    try:
        with caplog.at_level(logging.WARNING, LOGGER), Heartbeat() as beat:
            _, seconds = timed(lv.close)
        assert seconds < WITHIN and beat.gap < STILL, (seconds, beat.gap)
        assert "is left open, not closed" in caplog.text
        assert not lv.has(keys[0]) and lv.stats()["mooncake_skipped"] == 1
    finally:
        if net is not None:
            master.resume()
            cancel(net)


def test_a_hybrid_cache_waits_for_a_stopped_master_once_not_once_per_group(make_master):
    """Each group of a hybrid cache has a level (a client) of its own: the first that finds
    the master silent tells the others, which do not ask again within retry_after_s."""
    master = make_master()
    address = f"mooncake://{master.address}?segment_mb=16&deadline_s=2&retry_after_s=30"
    with tps.HybridKVCache(
        num_layers=2,
        batch=2,
        max_len=64,
        num_kv_heads=[2, 1],
        head_dim=[16, 32],
        dtype=jnp.float32,
        block_tokens=BLOCK,
        max_step_tokens=8,
        model_id="mooncake-test-hybrid-stopped",
        remote_prefix=address,
    ) as cache:
        levels = [g.slots.remote_levels[-1] for g in cache.groups]
        assert len(levels) == 2 and levels[0] is not levels[1]
        state = cache.init(admit=False)
        # Warm, without a call to the store (no full block): the first call is below.
        state, cached = cache.admit(state, 0, tokens=TOKENS[:5])
        state = cache.release(state, 0)
        master.pause()
        net = resume_later(master, 30)
        try:
            with Heartbeat() as beat:
                (state, cached), seconds = timed(
                    lambda: cache.admit(state, 0, tokens=TOKENS[:33], max_tokens=64)
                )
            assert cached == 0
            # One wait of the deadline (2 s), not one per group (4 s).
            assert seconds < 2.0 + 1.5 and beat.gap < STILL, (seconds, beat.gap)
            faults = [lv.stats()["mooncake_fault_unreachable"] for lv in levels]
            assert faults == [1, 1], [lv.stats() for lv in levels]
            _, seconds = timed(cache.close, state)
            assert seconds < 1.5
        finally:
            master.resume()
            cancel(net)


def test_publish_counts_tell_what_reached_the_store_after_a_stop_during_a_release(
    make_master, monkeypatch
):
    """48 blocks published while the master is stopped: the first request (32 blocks)
    passes its deadline and reaches the store once the master resumes, the other 16 are
    never sent. The counts say so: in flight, then published; only the 16 failed."""
    # The client's own limit on a request to its master as the environment sets it (30 s,
    # its default), not the deadline: the request waits for the master to resume.
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "30000")
    master = make_master()
    lv = level(master.address, deadline_s=DEADLINE, retry_after_s=0.5)
    # One request of 32 blocks, then one of 16.
    assert HEADER_BATCH == 32 and PUBLISH_BATCH_BYTES // lv.payload_bytes >= 32
    keys, parents, blocks = chain(48, start=450_000)
    assert lv.missing(keys) == list(range(48))  # Connected.
    items = [(keys[i], parents[i], blocks[i], payload_of(lv, i)) for i in range(48)]
    master.pause()
    net = resume_later(master, 30)
    try:
        got, seconds = timed(lv.publish_many, items)
        assert got == 0 and seconds < WITHIN, (seconds, lv.stats())
        s = lv.stats()
        assert s["mooncake_publish_in_flight"] == 32, s
        assert s["mooncake_publish_failures"] == 16 and s["mooncake_published"] == 0, s
    finally:
        master.resume()
        cancel(net)
    deadline = time.monotonic() + 30
    while not lv.settled():
        assert time.monotonic() < deadline, "the stuck request never returned"
        time.sleep(0.05)
    time.sleep(0.6)  # Past retry_after_s.
    s = lv.stats()
    in_store = 48 - len(lv.missing(keys))
    assert s["mooncake_publish_in_flight"] == 0
    assert s["mooncake_published"] == in_store == 32, (s, in_store)
    assert s["mooncake_publish_failures"] == 16, s
    assert s["mooncake_bytes_published"] == 32 * lv.payload_bytes
    lv.close()


def test_a_publish_the_master_never_answered_leaves_no_header_over_an_unfinished_range(
    make_master,
):
    """The client's own limit on each request to its master is the deadline: 48 blocks
    published while the master is stopped, the request that passed its deadline ends by
    itself before the master resumes (nothing in flight: 48 failed). The master may still
    start those puts once it resumes and never end them (unreadable until it discards
    them, and a put of one again returns 0): published again at once, no header is put
    over such a range (it would be a miss for good); once the master discarded them,
    every block is put and read back."""
    master = make_master("--put_start_discard_timeout_sec=2")
    lv = level(master.address, deadline_s=DEADLINE, retry_after_s=0.5)
    keys, parents, blocks = chain(48, start=460_000)
    assert lv.missing(keys) == list(range(48))  # Connected.
    items = [(keys[i], parents[i], blocks[i], payload_of(lv, i)) for i in range(48)]
    master.pause()
    net = master.resume_later(30)
    try:
        got, seconds = timed(lv.publish_many, items)
        assert got == 0 and seconds < WITHIN, (seconds, lv.stats())
        deadline = time.monotonic() + 5 * DEADLINE
        while not lv.settled():
            assert time.monotonic() < deadline, "the client did not give up by itself"
            time.sleep(0.05)
        s = lv.stats()
        assert s["mooncake_publish_in_flight"] == 0 and s["mooncake_published"] == 0, s
        assert s["mooncake_publish_failures"] == 48, s
    finally:
        master.resume()
        cancel(net)
    time.sleep(0.6)  # Past retry_after_s.
    lv.publish_many([items[i] for i in lv.missing(keys)])
    for i in range(48):
        # A header names ranges that can be read: never a block that is there but unreadable.
        found = lv.has(keys[i])
        assert found == (lv.load(keys[i], parents[i], blocks[i]) is not None), (i, lv.stats())
    deadline = time.monotonic() + 20
    while missing := lv.missing(keys):
        assert time.monotonic() < deadline, (len(missing), lv.stats())
        lv.publish_many([items[i] for i in missing])
        time.sleep(0.25)
    for i in range(48):
        np.testing.assert_array_equal(lv.load(keys[i], parents[i], blocks[i]), payload_of(lv, i))
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
        assert got is None and seconds < 2.0
    assert lv.stats()["mooncake_fault_not_ready"] == 2
    client.close()
    lv.close()


HOLDER = """
    import sys, time
    import numpy as np
    from support import load_module
    t = load_module(sys.argv[2])
    lv = t.level(sys.argv[1])
    keys, parents, blocks = t.chain(3, start=500_000)
    for i in range(3):
        assert lv.publish(keys[i], parents[i], blocks[i], t.payload_of(lv, i))
    print("published", flush=True)
    time.sleep(120)
"""


def start_holder(master) -> subprocess.Popen:
    """A process that publishes blocks 500_000.. into its own segment, says "published",
    then sleeps (the holder of those objects)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), master.address, __file__],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
        cwd="/",  # Not the source tree, whose package has no built extension.
    )


def test_a_killed_holder_is_a_miss_within_the_deadline(make_master):
    master = make_master()
    holder = start_holder(master)
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
            assert got is None and seconds < 3.5
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


def test_a_holder_hung_during_an_in_place_load_leaves_its_destinations_busy_until_settled(
    make_master,
):
    master = make_master()
    holder = start_holder(master)
    try:
        assert holder.stdout.readline().strip() == "published", "the holder process failed"
        reader = level(master.address, segment_bytes=0, deadline_s=1.0)
        store = BlockBytes(reader, num_blocks=8)
        keys, parents, blocks = chain(3, start=500_000)
        wanted = list(zip(keys, parents, blocks))
        assert reader.lookup(wanted) == 3
        os.kill(holder.pid, signal.SIGSTOP)
        # One block (its 4 objects): the engine times out the objects' transfers one
        # after another, so a stuck call on many objects stays stuck longer.
        got, seconds = timed(reader.load_into, wanted[:1], [store.block_memory(4)])
        assert seconds < 2.5, seconds
        if got.busy_until:  # The call passed its deadline: it may still write there.
            assert (got.loaded, got.busy_until) == (0, 1)
            assert not reader.settled()
            assert reader.stats()["mooncake_fault_timeout"] == 1
            time.sleep(0.5)
            assert not reader.settled()  # Still stuck while the holder is.
            # The holder resumes: the stuck call ends (its bytes may land now, after
            # load_into returned: why the destinations stay busy until it has settled).
            os.kill(holder.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while not reader.settled():
                assert time.monotonic() < deadline, "the stuck call never returned"
                time.sleep(0.05)
        else:  # The client gave up by itself within the deadline: nothing in flight.
            assert got.loaded == 0 and reader.settled()
        reader.close()
    finally:
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
        store = BlockBytes(reader, num_blocks=64)
        t = table(store, reader)
        cached = t.admit(0, len(tokens), tokens).cached
        for i, b in enumerate(t.table_row(0)[: cached // BLOCK]):
            np.testing.assert_array_equal(store.payload(b), payload_of(writer, first_payload + i))
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


def test_a_pool_is_faulted_in_when_given_not_inside_a_calls_deadline(monkeypatch):
    """use_memory populates the pool at once, in the caller's thread, connected or not: a
    first touch inside the first call would count against that call's deadline."""
    populated = []
    monkeypatch.setattr(transfer_memory, "populate", lambda a, n: populated.append((a, n)))
    lv = level("127.0.0.1:1", deadline_s=0.5)  # Nothing listens there: never connected.
    pool = np.zeros(1 << 16, np.uint8)
    lv.use_memory(pool.ctypes.data, pool.nbytes)
    assert populated == [(pool.ctypes.data, pool.nbytes)]
    assert lv.stats()["mooncake_faults"] == 0  # No call was made.
    lv.close()


# -- the factory and the optional import -------------------------------------------------------


def test_make_level():
    geometry = dict(root=ROOT, num_layers=2, block_tokens=BLOCK, block_bytes=1024)
    lv = make_level("mooncake://127.0.0.1:1?segment_mb=32&deadline_s=0.5&object_kb=4", **geometry)
    assert lv.master == "127.0.0.1:1" and lv.segment_bytes == 32 << 20
    assert lv.deadline_s == 0.5 and lv.layer_ranges == [(0, 2)]
    lv.close()
    assert make_level(lv, **geometry) is lv
    made = make_level(
        functools.partial(MooncakeStoreLevel, "127.0.0.1:2", namespace="f"), **geometry
    )
    assert (made.master, made.namespace, made.root, made.block_bytes) == (
        "127.0.0.1:2",
        "f",
        ROOT,
        1024,
    )
    made.close()
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


@pytest.mark.parametrize(
    "name, accepted, refused, why",
    [
        ("deadline_s", MAX_DEADLINE_S, math.nextafter(MAX_DEADLINE_S, math.inf), "at most 3600"),
        ("deadline_s", math.ulp(0.0), 0.0, "> 0"),
        ("deadline_s", 3.0, math.inf, "> 0 and at most"),
        ("deadline_s", 3.0, math.nan, "> 0 and at most"),
        ("deadline_s", 3, "3", "a number of seconds"),
        ("retry_after_s", 0.0, -math.ulp(0.0), ">= 0"),
        ("retry_after_s", sys.float_info.max, math.inf, "finite"),
        ("namespace", "a", "", "non-empty"),
        ("local_host", "a", "", "non-empty"),
        ("local_host", "10.0.0.7", "10.0.0.7 ", "no spaces"),
        ("master", "h:65535", "h:65536", "a port in 1-65535"),
        ("master", "h:1", "h:0", "a port in 1-65535"),
        ("master", "[::1]:1", "h", "must be 'host:port'"),
    ],
)
def test_bad_arguments_are_refused_by_name_at_their_edge(name, accepted, refused, why):
    """The last value accepted makes a level (nothing connects yet); the first refused is
    a ValueError naming the argument and its value."""
    if name == "master":
        make = lambda value: level(value)
    else:
        make = lambda value: level("127.0.0.1:1", **{name: value})
    make(accepted).close()
    with pytest.raises(
        ValueError, match="^" + re.escape(f"{name}={refused!r} ") + ".*" + re.escape(why)
    ):
        make(refused)


@pytest.mark.parametrize(
    "option, accepted, refused, why",
    [
        ("deadline_s", "3600", "inf", "deadline_s=inf must be a number of seconds > 0"),
        ("deadline_s", "0.5", "-inf", "deadline_s=-inf must be"),
        ("deadline_s", "0.5", "nan", "deadline_s=nan must be"),
        ("deadline_s", "0.5", "", "option deadline_s=''"),
        ("retry_after_s", "0", "inf", "retry_after_s=inf must be a finite"),
        ("namespace", "a", "", "namespace='' must be a non-empty name"),
        ("local_host", "a", "", "local_host='' must be this host's name or address"),
        ("segment_mb", "0", "", "option segment_mb=''"),
    ],
)
def test_bad_address_options_are_refused_by_name(option, accepted, refused, why):
    """An address option's edge: accepted, then refused naming the option, never dropped
    (an empty value once meant the default) or an OverflowError."""
    geometry = dict(root=ROOT, num_layers=2, block_tokens=BLOCK, block_bytes=1024)
    made = make_level(f"mooncake://127.0.0.1:1?{option}={accepted}", **geometry)
    if option == "segment_mb":
        assert made.segment_bytes == int(accepted) << 20
    else:
        want = float(accepted) if option.endswith("_s") else accepted
        assert getattr(made, option) == want
    made.close()
    spec = f"mooncake://127.0.0.1:1?{option}={refused}"
    with pytest.raises(
        ValueError, match=re.escape(f"remote level {spec!r}: ") + ".*" + re.escape(why)
    ):
        make_level(spec, **geometry)
    for bad in ("mooncake://h:1?namespace", "mooncake://h:99999"):
        with pytest.raises(ValueError, match=re.escape(f"remote level {bad!r}: ")):
            make_level(bad, **geometry)


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
    with pytest.raises(
        ValueError, match=r"remote_prefix='redis://x:1' must be a 'mooncake://host:port'"
    ):
        make_cache(remote_prefix="redis://x:1")


def test_a_mesh_gives_each_head_range_its_own_namespace():
    from jax_tpusync.caches.offloaded import mesh

    got = mesh._heads_address("mooncake://127.0.0.1:9?segment_mb=16", "heads0-2")
    assert got == "mooncake://127.0.0.1:9?segment_mb=16&namespace=tpusync-heads0-2"
    # A level object cannot be split by heads: the mesh cache refuses one at construction
    # (tests/caches/test_kv_cache_factory.py), before any head range is named.
