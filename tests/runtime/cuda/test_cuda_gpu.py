"""The CUDA ops on a real GPU: fetches from host and file tiers, stale-prefetch refetch,
only the wait writing its buffer, write-back ordering, superseded states and error
reporting. Skipped (with a reason) without a CUDA GPU."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.runtime import _cuda, ops
from jax_tpusync.runtime.engine import Engine

BLOCK = 1 << 16
NUM_BLOCKS = 64
TAG = np.array([0, 0], np.int32)


@pytest.fixture(scope="module", autouse=True)
def cuda_ops():
    if _cuda.extension() is None:
        pytest.skip("jax_tpusync was built without CUDA support")
    if not _cuda.gpu_present():
        pytest.skip("no CUDA GPU visible to JAX")
    assert _cuda.register()
    yield _cuda.extension()
    # Every test below must leave the devices healthy (the error test runs in a subprocess).
    assert _cuda.extension().async_error() is None


@pytest.fixture
def engine():
    with Engine(num_workers=2) as e:
        yield e


def _tier(engine, kind, tmp_path):
    if kind == "host":
        return engine.add_host_tier(block_bytes=BLOCK, num_blocks=NUM_BLOCKS)
    return engine.add_file_tier(str(tmp_path), block_bytes=BLOCK, num_blocks=NUM_BLOCKS)


def _rows(tier_offsets, mem_offsets, sizes):
    return jnp.asarray(ops.segment_rows(tier_offsets, mem_offsets, sizes, BLOCK))


def _fetch_step(engine_id, tier, donate=True):
    """start(seg_start) -> overlapping compute -> wait(seg_wait); dst is donated."""

    @functools.partial(jax.jit, donate_argnums=(0,) if donate else ())
    def step(dst, x, seg_start, seg_wait):
        x, ticket = ops.start_fetch(
            engine_id, tier, x, seg_start, TAG, dst_bytes=ops.buffer_bytes(dst)
        )
        y = jnp.tanh(x) * 2.0  # The compute the fetch overlaps.
        dst = ops.wait_fetch(engine_id, tier, dst, ticket, seg_wait, TAG, deps=(y,))
        return dst, y

    return step


@pytest.mark.parametrize("kind", ["host", "file"])
def test_fetch_lands_exact_bytes(engine, kind, tmp_path, cuda_ops):
    tier = _tier(engine, kind, tmp_path)
    data = np.random.default_rng(0).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    engine.write(tier, 0, data)
    n = 3 * BLOCK + 123
    # Two segments, the second crossing a block boundary, into a buffer with untouched bytes.
    seg = _rows([5 * BLOCK + 7, 9 * BLOCK - 100], [0, 2 * BLOCK], [2 * BLOCK, BLOCK + 123])
    dst = jax.device_put(jnp.full((n + 4096,), 7, jnp.uint8), jax.devices("cuda")[0])
    before = cuda_ops.stats()
    out, _ = _fetch_step(engine.id, tier)(dst, jnp.ones((256, 256)), seg, seg)
    out = np.asarray(out)
    np.testing.assert_array_equal(out[: 2 * BLOCK], data[5 * BLOCK + 7 : 7 * BLOCK + 7])
    np.testing.assert_array_equal(out[2 * BLOCK : n], data[9 * BLOCK - 100 : 10 * BLOCK + 23])
    assert (out[n:] == 7).all(), "bytes outside the segments were overwritten"
    after = cuda_ops.stats()
    assert after["prefetch_hits"] == before["prefetch_hits"] + 1


def test_stale_prefetch_is_refetched(engine, tmp_path, cuda_ops):
    tier = _tier(engine, "host", tmp_path)
    data = np.random.default_rng(1).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    engine.write(tier, 0, data)
    dst = jax.device_put(jnp.zeros((BLOCK,), jnp.uint8), jax.devices("cuda")[0])
    before = cuda_ops.stats()
    out, _ = _fetch_step(engine.id, tier)(
        dst, jnp.ones((8,)), _rows([0], [0], [BLOCK]), _rows([3 * BLOCK], [0], [BLOCK])
    )
    np.testing.assert_array_equal(np.asarray(out), data[3 * BLOCK : 4 * BLOCK])
    assert cuda_ops.stats()["prefetch_misses"] == before["prefetch_misses"] + 1


def test_fetch_without_donation_still_correct(engine, tmp_path, cuda_ops):
    """XLA copies an undonated dst for the wait; the bytes land in the copy it hands over."""
    tier = _tier(engine, "host", tmp_path)
    data = np.random.default_rng(4).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    engine.write(tier, 0, data)
    dst = jax.device_put(jnp.full((2 * BLOCK,), 9, jnp.uint8), jax.devices("cuda")[0])
    seg = _rows([6 * BLOCK], [BLOCK], [BLOCK])
    out, _ = _fetch_step(engine.id, tier, donate=False)(dst, jnp.ones((8,)), seg, seg)
    out = np.asarray(out)
    np.testing.assert_array_equal(out[BLOCK:], data[6 * BLOCK : 7 * BLOCK])
    assert (out[:BLOCK] == 9).all()
    assert (np.asarray(dst) == 9).all(), "the undonated input was written"


@pytest.mark.parametrize("poison", (False, True))
def test_only_the_wait_writes_the_buffer(tmp_path, cuda_ops, poison):
    """A fetch in flight never writes the XLA buffer: read between start and wait (with a
    slow, optionally poisoned fetch), dst still holds its old bytes; the wait fills it."""
    n = 4096
    data = np.random.default_rng(5).uniform(1, 2, size=n).astype(np.float32)
    with Engine(num_workers=2, poison_fetches=poison, debug_delay_us=200_000) as e:
        tier = e.add_host_tier(block_bytes=BLOCK, num_blocks=8)
        e.write(tier, 3 * BLOCK, data)
        segs = _rows([3 * BLOCK], [0], [data.nbytes])

        @functools.partial(jax.jit, donate_argnums=(1,))
        def read_early(x, dst, segs):
            x, ticket = ops.start_fetch(
                e.id, tier, x, segs, TAG, dst_bytes=ops.buffer_bytes(dst)
            )
            early_sum = dst.sum()  # Before its wait: must see the old contents.
            dst = ops.wait_fetch(e.id, tier, dst, ticket, segs, TAG, deps=(early_sum, x))
            return early_sum, dst

        dev = jax.devices("cuda")[0]
        before = cuda_ops.stats()
        early_sum, dst = read_early(
            jax.device_put(jnp.ones(1), dev), jax.device_put(jnp.full(n, 0.5, jnp.float32), dev),
            segs,
        )
        assert float(early_sum) == 0.5 * n
        np.testing.assert_array_equal(np.asarray(dst), data)
        assert cuda_ops.stats()["prefetch_hits"] == before["prefetch_hits"] + 1


def test_repeated_steps_many_layers(engine, tmp_path):
    """Layer-ahead pattern over several calls: each call's result is its own layer's bytes."""
    tier = _tier(engine, "host", tmp_path)
    data = np.random.default_rng(2).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    engine.write(tier, 0, data)
    step = _fetch_step(engine.id, tier)
    dst = jax.device_put(jnp.zeros((2 * BLOCK,), jnp.uint8), jax.devices("cuda")[0])
    outs = []
    for layer in range(8):
        seg = _rows([layer * 2 * BLOCK], [0], [2 * BLOCK])
        dst, _ = step(dst, jnp.ones((64,)), seg, seg)
        outs.append(np.asarray(dst).copy())
    for layer, out in enumerate(outs):
        np.testing.assert_array_equal(out, data[layer * 2 * BLOCK : (layer + 1) * 2 * BLOCK])


@pytest.mark.parametrize("kind", ["host", "file"])
def test_write_back_then_fetch_sees_new_bytes(engine, kind, tmp_path):
    tier = _tier(engine, kind, tmp_path)
    engine.write(tier, 0, np.zeros(NUM_BLOCKS * BLOCK, np.uint8))
    new = np.random.default_rng(3).integers(0, 256, BLOCK, dtype=np.uint8)
    seg = _rows([4 * BLOCK], [0], [BLOCK])

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(src, dst):
        token = ops.write_back(engine.id, tier, src, seg, TAG)
        _, ticket = ops.start_fetch(
            engine.id, tier, src, seg, TAG, dst_bytes=ops.buffer_bytes(dst), deps=(token,)
        )
        return ops.wait_fetch(engine.id, tier, dst, ticket, seg, TAG)

    dev = jax.devices("cuda")[0]
    out = step(jax.device_put(jnp.asarray(new), dev), jax.device_put(jnp.zeros_like(new), dev))
    np.testing.assert_array_equal(np.asarray(out), new)
    engine.drain()  # Submitted before the step completed; drain covers it.
    np.testing.assert_array_equal(engine.read(tier, 4 * BLOCK, np.empty(BLOCK, np.uint8)), new)


def test_engine_path_bandwidth_is_measurable(engine, tmp_path, cuda_ops):
    tier = _tier(engine, "host", tmp_path)
    engine.write(tier, 0, np.ones(NUM_BLOCKS * BLOCK, np.uint8))
    assert all(g > 0 for g in cuda_ops.memcpy_h2d_gbps([1 << 20], iters=3))
    assert all(g > 0 for g in cuda_ops.engine_h2d_gbps(engine.id, tier, 0, [1 << 20], iters=3))


def test_region_violation_is_reported_and_sticky(tmp_path):
    # In a subprocess: a failure is sticky for the device, by design.
    script = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax_tpusync.runtime import _cuda
    from jax_tpusync.runtime import ops
    from jax_tpusync.runtime.engine import Engine
    assert _cuda.register()
    B = 1 << 16
    with Engine() as e:
      t = e.add_host_tier(block_bytes=B, num_blocks=8)
      regions = ops.Regions(base=0, nbytes=2 * B, count=2)
      seg = jnp.asarray(ops.segment_rows([B], [0], [2 * B], B))  # Crosses a region end.
      tag = np.array([0, 0], np.int32)
      def f(dst):
        _, ticket = ops.start_fetch(e.id, t, jnp.zeros(4), seg, tag,
                                    dst_bytes=ops.buffer_bytes(dst), regions=regions)
        return ops.wait_fetch(e.id, t, dst, ticket, seg, tag, regions=regions)
      try:
        # Fails only if the agent already saw the bad rows when the wait was enqueued;
        # otherwise the step completes with NaN bytes and the error turns up afterwards.
        out = np.asarray(jax.jit(f)(jnp.zeros((2 * B,), jnp.uint8)))
        assert (out == 0xFF).all(), "failed fetch must leave NaN bytes"
      except Exception as exc:
        assert "runs past the end of region" in str(exc), exc
      jax.effects_barrier()
      err = _cuda.extension().async_error()
      assert err and "runs past the end of region" in err, err
      try:
        np.asarray(jax.jit(f)(jnp.zeros((2 * B,), jnp.uint8)))
      except Exception as exc:  # The next op fails with the sticky error.
        assert "runs past the end of region" in str(exc), exc
      else:
        raise AssertionError("sticky error not raised")
    print("OK")
  """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_superseded_state_is_refused_and_sticky(tmp_path):
    # In a subprocess: a refused owner is sticky for the device, like any agent failure.
    script = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax_tpusync.runtime import _cuda
    from jax_tpusync.runtime import ops
    from jax_tpusync.runtime.engine import Engine
    assert _cuda.register()
    B = 1 << 16
    with Engine() as e:
      t = e.add_host_tier(block_bytes=B, num_blocks=8)
      e.write(t, 0, np.full(B, 3, np.uint8))
      s = e.open_stream()
      epoch = e.begin_epoch(s)
      claim = np.array([s, epoch, 1, 1], np.int32)  # The step's first op claims step 1.
      check = np.array([s, epoch, 1, 0], np.int32)
      seg = jnp.asarray(ops.segment_rows([0], [0], [B], B))
      tag = np.array([0, 0], np.int32)
      def f(dst):
        _, ticket = ops.start_fetch(e.id, t, jnp.zeros(4), seg, tag,
                                    dst_bytes=ops.buffer_bytes(dst), owner=claim)
        return ops.wait_fetch(e.id, t, dst, ticket, seg, tag, owner=check)
      step = jax.jit(f)
      out = np.asarray(step(jnp.zeros((B,), jnp.uint8)))
      assert (out == 3).all(), out
      assert _cuda.extension().async_error() is None
      try:  # The same state again: step 1 is taken.
        out = np.asarray(step(jnp.zeros((B,), jnp.uint8)))
        assert (out == 0xFF).all(), "a refused fetch must leave NaN bytes"
      except Exception as exc:
        assert "stale" in str(exc), exc
      jax.effects_barrier()
      err = _cuda.extension().async_error()
      assert err and "stale" in err, err
    print("OK")
  """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_pinned_host_operand_probe(cuda_ops):
    """Design probe, not a contract: how a memory_kind="pinned_host" operand reaches a CUDA
    custom call. Records the answer; only fails if compilation itself crashes the process."""
    dev = jax.devices("cuda")[0]
    call = jax.ffi.ffi_call("tpusync_pointer_kind", jax.ShapeDtypeStruct((), jnp.uint8))
    device_kind = int(jax.jit(call)(jax.device_put(jnp.zeros(16), dev)))
    assert device_kind == 2  # cudaMemoryTypeDevice.
    try:
        x = jax.device_put(
            jnp.zeros(16), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        )
        kind = int(jax.jit(call)(x))
    except Exception as exc:  # noqa: BLE001 - the answer may be "not supported".
        pytest.skip(f"pinned_host operand not accepted by a CUDA custom call: {exc!r:.300}")
    print(f"pinned_host operand pointer kind: {kind}")
