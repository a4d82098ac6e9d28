"""Error paths of the in-graph ops: Python-side checks raise ValueError at trace time; engine
errors raised inside the custom call surface as XLA runtime errors carrying the tpusync text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tpusync.runtime import ops

BLOCK = 4096
TAG = np.array([0, 0], np.int32)
# What jax raises for a failed custom call (a RuntimeError subclass); match on the text.
XlaError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)


def _rows(tier_offsets, memory_offsets, sizes, block=BLOCK):
    return jnp.asarray(ops.segment_rows(tier_offsets, memory_offsets, sizes, block))


@pytest.fixture
def host(make_engine):
    e = make_engine()
    return e, e.add_host_tier(block_bytes=BLOCK, num_blocks=4)


def _start_wait(engine_id, tier):
    def step(x, dst, segs):
        x, ticket = ops.start_fetch(engine_id, tier, x, segs, TAG, dst_bytes=ops.buffer_bytes(dst))
        return ops.wait_fetch(engine_id, tier, dst, ticket, segs, TAG, deps=(x,))

    return jax.jit(step, donate_argnums=(1,))


def test_segments_of_wrong_shape_or_dtype(host):
    e, t = host
    x, dst = jnp.ones(2), jnp.zeros(16, jnp.uint8)
    for segs, match in [
        (jnp.zeros((2, 3), jnp.int32), r"int32\[n, 4\]; got shape \(2, 3\)"),
        (jnp.zeros((4,), jnp.int32), r"int32\[n, 4\]"),
        (jnp.zeros((1, 4), jnp.float32), "must be int32; got float32"),
        (jnp.zeros((1, 4), jnp.int16), "must be int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            ops.start_fetch(e.id, t, x, segs, TAG, dst_bytes=16)
        with pytest.raises(ValueError, match=match):
            ops.wait_fetch(e.id, t, dst, ops.NO_TICKET, segs, TAG)
        with pytest.raises(ValueError, match=match):
            ops.write_back(e.id, t, dst, segs, TAG)
        with pytest.raises(ValueError, match=match):  # Also while tracing under jit.
            jax.jit(lambda d, s: ops.wait_fetch(e.id, t, d, ops.NO_TICKET, s, TAG))(dst, segs)


def test_other_trace_time_checks(host):
    e, t = host
    x, dst = jnp.ones(2), jnp.zeros(16, jnp.uint8)
    segs = _rows([0], [0], [16])
    with pytest.raises(ValueError, match=r"tag must be int32\[2\]"):
        ops.start_fetch(e.id, t, x, segs, np.zeros(3, np.int32), dst_bytes=16)
    with pytest.raises(ValueError, match="ticket must be an int32 scalar"):
        ops.wait_fetch(e.id, t, dst, jnp.zeros(2, jnp.int32), segs, TAG)
    with pytest.raises(ValueError, match="not a valid engine id"):
        ops.start_fetch(0, t, x, segs, TAG, dst_bytes=16)
    with pytest.raises(ValueError, match="not a valid engine id"):
        ops.mark(-3, ops.MARK_COMPUTE_BEGIN, x, TAG)
    with pytest.raises(ValueError, match="tier=-1 must be >= 0"):
        ops.write_back(e.id, -1, dst, segs, TAG)
    with pytest.raises(ValueError, match="does not fit int32"):
        ops.segment_rows([0], [0], [1 << 31], BLOCK)
    with pytest.raises(ValueError, match="does not fit int32"):
        ops.segment_rows([-1], [0], [1], BLOCK)
    np.testing.assert_array_equal(
        ops.segment_rows([3 * BLOCK + 5, 7], [1, 2], [3, 4], BLOCK), [[3, 5, 1, 3], [0, 7, 2, 4]]
    )
    assert ops.segment_rows([], [], [], BLOCK).shape == (0, 4)


def test_segment_beyond_the_buffer(host):
    e, t = host
    fn = _start_wait(e.id, t)
    with pytest.raises(
        XlaError,
        match=r"tpusync: segment 0 covers bytes \[10, 26\) of a "
        r"16-byte buffer",
    ):
        jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(16, jnp.uint8), _rows([0], [10], [16])))
    with pytest.raises(XlaError, match="-byte buffer"):
        wb = jax.jit(lambda s, g: ops.write_back(e.id, t, s, g, TAG))
        jax.block_until_ready(wb(jnp.zeros(4, jnp.float32), _rows([0], [0], [17])))
    with pytest.raises(XlaError, match="64-byte buffer"):
        w = jax.jit(lambda d, g: ops.wait_fetch(e.id, t, d, ops.NO_TICKET, g, TAG))
        jax.block_until_ready(w(jnp.zeros(16, jnp.float32), _rows([0], [60], [8])))


def test_segment_beyond_the_tier(host):
    e, t = host
    fn = _start_wait(e.id, t)
    with pytest.raises(
        XlaError,
        match=r"tpusync: segment 0: range \[16380, 16400\) is outside "
        r"the host tier of 16384 bytes",
    ):
        jax.block_until_ready(
            fn(jnp.ones(1), jnp.zeros(32, jnp.uint8), _rows([4 * BLOCK - 4], [0], [20]))
        )
    with pytest.raises(XlaError, match="outside the"):
        wb = jax.jit(lambda s, g: ops.write_back(e.id, t, s, g, TAG))
        jax.block_until_ready(wb(jnp.zeros(8, jnp.uint8), _rows([100 * BLOCK], [0], [8])))
    # No write-back was queued: the engine is healthy and the tier untouched.
    e.drain()
    out = fn(jnp.ones(1), jnp.zeros(32, jnp.uint8), _rows([0], [0], [32]))
    np.testing.assert_array_equal(np.asarray(out), 0)


def test_bad_tier_and_negative_fields(host):
    e, t = host
    fn = _start_wait(e.id, 5)
    with pytest.raises(XlaError, match=r"tpusync: no tier 5 \(engine has 1\)"):
        jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(8, jnp.uint8), _rows([0], [0], [8])))
    fn = _start_wait(e.id, t)
    with pytest.raises(XlaError, match="segment 0 has a negative field"):
        jax.block_until_ready(
            fn(jnp.ones(1), jnp.zeros(8, jnp.uint8), jnp.asarray([[0, 0, -1, 4]], jnp.int32))
        )


def test_unknown_ticket_in_graph(host):
    e, t = host
    w = jax.jit(lambda d, k, g: ops.wait_fetch(e.id, t, d, k, g, TAG))
    with pytest.raises(XlaError, match="tpusync: unknown ticket 777"):
        jax.block_until_ready(w(jnp.zeros(8, jnp.uint8), jnp.int32(777), _rows([0], [0], [8])))


def test_closed_engine(make_engine):
    e = make_engine()
    t = e.add_host_tier(block_bytes=BLOCK, num_blocks=4)
    fn = _start_wait(e.id, t)
    segs = _rows([0], [0], [8])
    jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(8, jnp.uint8), segs))  # Compiled, works.
    wb = jax.jit(lambda s, g: ops.write_back(e.id, t, s, g, TAG))
    mk = jax.jit(lambda x: ops.mark(e.id, ops.MARK_COMPUTE_BEGIN, x, TAG))
    e.close()
    pattern = f"tpusync: engine {e.id} is closed or was never created"
    with pytest.raises(XlaError, match=pattern):
        jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(8, jnp.uint8), segs))
    with pytest.raises(XlaError, match=pattern):
        jax.block_until_ready(wb(jnp.zeros(8, jnp.uint8), segs))
    with pytest.raises(XlaError, match=pattern):
        jax.block_until_ready(mk(jnp.ones(3)))
    never = jax.jit(lambda x: ops.mark(10**9, ops.MARK_COMPUTE_END, x, TAG))
    with pytest.raises(XlaError, match="is closed or was never created"):
        jax.block_until_ready(never(jnp.ones(3)))


def test_engine_keeps_working_after_in_graph_errors(host):
    e, t = host
    e.write(t, 0, np.arange(64, dtype=np.uint8))
    fn = _start_wait(e.id, t)
    for _ in range(3):
        with pytest.raises(XlaError):
            jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(8, jnp.uint8), _rows([0], [4], [8])))
    out = fn(jnp.ones(1), jnp.zeros(64, jnp.uint8), _rows([0], [0], [64]))
    np.testing.assert_array_equal(np.asarray(out), np.arange(64))


def test_close_while_a_jitted_wait_is_blocked(make_engine):
    """Closing the engine from Python while a jitted step waits on a slow fetch neither
    hangs nor crashes: the step either finishes or reports the cancellation."""
    import threading

    e = make_engine(num_workers=1, debug_delay_us=300_000)
    t = e.add_host_tier(block_bytes=BLOCK, num_blocks=4)
    fn = _start_wait(e.id, t)
    segs = _rows([0], [0], [64])
    jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(64, jnp.uint8), segs))  # Compile.
    outcome = []

    def run():
        try:
            jax.block_until_ready(fn(jnp.ones(1), jnp.zeros(64, jnp.uint8), segs))
            outcome.append("ok")
        except Exception as err:  # noqa: BLE001
            outcome.append(str(err))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(0.1)
    closer = threading.Thread(target=e.close, daemon=True)
    closer.start()
    closer.join(20)
    th.join(20)
    assert not closer.is_alive() and not th.is_alive()
    assert outcome and (outcome[0] == "ok" or "tpusync:" in outcome[0]), outcome


def test_capacity_guard_rows_lead_or_are_bad_rows(host):
    """Guard rows are checked only as a leading run: at the edge (length + count ==
    capacity) the write goes through; one over is refused by sequence; a guard-shaped row
    after a transfer is a bad row, never a skipped transfer."""
    e, t = host
    src = jnp.arange(16, dtype=jnp.uint8)
    write = _rows([0], [0], [16])

    def run(rows):
        jax.block_until_ready(ops.write_back(e.id, t, src, jnp.asarray(rows), TAG))
        e.drain()

    run(np.concatenate([np.asarray(ops.capacity_guards(jnp.asarray([3, 7]), 1, 8)), write]))
    with pytest.raises(Exception, match="slot 1 holds 8 tokens and cannot take 1 more"):
        run(np.concatenate([np.asarray(ops.capacity_guards(jnp.asarray([3, 8]), 1, 8)), write]))
    with pytest.raises(Exception, match="segment 1 has a negative field"):
        run(np.concatenate([write, np.asarray(ops.capacity_guards(jnp.asarray([0]), 1, 8))]))


def test_shard_guard_rows_lead_the_capacity_guards(host):
    """A shard guard passes only when the state's shard is the device's (the edge: the next
    shard either way is refused), ahead of the capacity guards, whose slot numbers it does
    not shift; after them it is a bad row."""
    e, t = host
    src = jnp.arange(16, dtype=jnp.uint8)
    write = _rows([0], [0], [16])
    caps = np.asarray(ops.capacity_guards(jnp.asarray([3, 7]), 1, 8))

    def run(*parts):
        rows = np.concatenate([np.asarray(p) for p in parts])
        jax.block_until_ready(ops.write_back(e.id, t, src, jnp.asarray(rows), TAG))
        e.drain()

    run(ops.shard_guard(2, 2), caps, write)
    for state_shard in (1, 3):
        with pytest.raises(
            Exception,
            match=rf"this state is shard {state_shard} of its mesh cache but runs on the device of shard 2",
        ):
            run(ops.shard_guard(state_shard, 2), caps, write)
    with pytest.raises(Exception, match=r"this state is no shard of its mesh cache"):
        run(ops.shard_guard(-1, 0), caps, write)
    with pytest.raises(Exception, match="slot 1 holds 8 tokens"):  # Slots still count from 0.
        run(
            ops.shard_guard(0, 0), np.asarray(ops.capacity_guards(jnp.asarray([3, 8]), 1, 8)), write
        )
    with pytest.raises(Exception, match="segment 2 has a negative field"):
        run(caps, ops.shard_guard(0, 0), write)


def test_target_fields_are_checked_when_concrete_and_when_traced(host):
    """engine id, tier and first block travel as an int32[3] operand: Python ints are
    checked at trace time, traced ones by the op (before any byte moves)."""
    e, t = host
    dst = jnp.zeros(16, jnp.uint8)
    segs = _rows([0], [0], [16])
    with pytest.raises(ValueError, match="first_block=-1 must be >= 0 and fit int32"):
        ops.write_back(e.id, t, dst, segs, TAG, first_block=-1)
    with pytest.raises(ValueError, match=r"first_block=2147483648 must be >= 0 and fit int32"):
        ops.write_back(e.id, t, dst, segs, TAG, first_block=2**31)

    @jax.jit
    def traced(first_block):
        return ops.write_back(e.id, t, dst, segs, TAG, first_block=first_block)

    with pytest.raises(
        XlaError, match=r"target \(engine \d+, tier 0, first block -1\) has a field out of range"
    ):
        jax.block_until_ready(traced(jnp.int32(-1)))
    # First block 3 of a 4-block tier: the row's block 0 is tier block 3, the last one.
    jax.block_until_ready(traced(jnp.int32(3)))
    e.drain()
    with pytest.raises(
        XlaError, match=r"range \[16384, 16400\) is outside the host tier of 16384 bytes"
    ):
        jax.block_until_ready(traced(jnp.int32(4)))


def test_rows_that_continue_one_another_are_one_transfer(host):
    """Two rows contiguous on the tier and in the buffer are merged; a gap keeps two."""
    e, t = host
    dst = jnp.zeros(3 * BLOCK, jnp.uint8)

    def fetch(rows):
        e.reset_stats()
        segs = jnp.asarray(np.asarray(rows, np.int32))
        jax.block_until_ready(_start_wait(e.id, t)(jnp.ones(2), jnp.zeros_like(dst), segs))
        return e.stats()["tiers"][t]["fetch"]["segments"]

    assert fetch([[0, 0, 0, BLOCK], [1, 0, BLOCK, BLOCK]]) == 1
    assert fetch([[0, 0, 0, BLOCK], [2, 0, BLOCK, BLOCK]]) == 2  # A gap on the tier.
    assert fetch([[0, 0, 0, BLOCK], [1, 0, 2 * BLOCK, BLOCK]]) == 2  # A gap in memory.
