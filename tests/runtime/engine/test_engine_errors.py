"""Error reporting: ValueError for invalid arguments, TpusyncError for the rest, and C++
messages prefixed with "tpusync:"."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jax_tpusync import TpusyncError, _tpusync
from jax_tpusync.runtime.engine import Engine, EngineConfig

# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_workers=0), r"num_workers=0 must be in \[1, 64\]"),
        (dict(num_workers=65), r"num_workers=65 must be in \[1, 64\]"),
        (dict(io_chunk_bytes=0), "io_chunk_bytes=0 must be a positive multiple of 4096"),
        (dict(io_chunk_bytes=4097), "io_chunk_bytes=4097 must be a positive multiple of 4096"),
        (dict(io_depth=1), r"io_depth=1 must be in \[2, 64\]"),
        (dict(io_depth=65), r"io_depth=65 must be in \[2, 64\]"),
        (dict(max_inflight_bytes=-1), "max_inflight_bytes=-1 must be >= 0"),
        (dict(max_bytes_per_second=-1.0), "max_bytes_per_second=-1.0 must be >= 0"),
        (dict(debug_delay_us=-5), "debug_delay_us=-5 must be >= 0"),
        (dict(worker_cpus=(-1,)), "worker cpu -1 does not exist"),
        (dict(worker_cpus=(0, 100000)), "worker cpu 100000 does not exist"),
    ],
)
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        Engine(**kwargs)


def test_io_chunk_upper_bound_checked_in_cpp():
    with pytest.raises(ValueError, match=r"tpusync: io_chunk_bytes must be in \[4096, 1 GiB\]"):
        Engine(io_chunk_bytes=2 << 30)


def test_io_depth_checked_in_cpp():
    with pytest.raises(ValueError, match=r"tpusync: io_depth must be in \[2, 64\], got 1"):
        _tpusync.Engine(
            num_workers=1,
            io_chunk_bytes=4096,
            io_depth=1,
            huge_page_destinations=True,
            max_inflight_bytes=0,
            max_bytes_per_second=0.0,
            worker_cpus=[],
            split_read_bytes=0,
            poison_fetches=False,
            debug_delay_us=0,
            record_timeline=False,
        )


def test_file_tier_alignment_offset_out_of_range(make_engine, tmp_path):
    e = make_engine()
    with pytest.raises(ValueError, match=r"alignment_offset=4096 must be in \[0, 4096\)"):
        e.add_file_tier(tmp_path, block_bytes=4096, num_blocks=1, alignment_offset=4096)
    with pytest.raises(
        ValueError, match=r"tpusync: alignment_offset must be in \[0, 4096\), got 5000"
    ):
        e._impl.add_file_tier(str(tmp_path), 4096, 1, "", True, 5000)


def test_good_config_with_pinned_workers(make_engine):
    e = make_engine(EngineConfig(num_workers=3, worker_cpus=(0,)), debug_delay_us=1)
    assert e.config.num_workers == 3 and e.config.debug_delay_us == 1
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    e.write(t, 0, np.ones(10, np.uint8))


# ---------------------------------------------------------------- tiers


def test_file_tier_missing_directory(make_engine, tmp_path):
    e = make_engine()
    with pytest.raises(TpusyncError, match="tpusync: file tier directory .* does not exist"):
        e.add_file_tier(tmp_path / "nope", block_bytes=4096, num_blocks=1)


def test_file_tier_path_is_a_file(make_engine, tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(b"x")
    e = make_engine()
    with pytest.raises(ValueError, match="tpusync: file tier path .* is not a directory"):
        e.add_file_tier(f, block_bytes=4096, num_blocks=1)


@pytest.mark.parametrize("directory", ("/proc", "/sys", "/proc/self"))
def test_file_tier_unwritable_directory(make_engine, directory):
    if not os.path.isdir(directory):
        pytest.skip(f"{directory} does not exist here")
    e = make_engine()
    with pytest.raises(TpusyncError, match="cannot create tier file|not writable"):
        e.add_file_tier(directory, block_bytes=4096, num_blocks=1)
    assert e.tier_info(e.add_host_tier(block_bytes=4096, num_blocks=1)).index == 0


def test_bad_layouts_and_names(make_engine, tmp_path):
    e = make_engine()
    with pytest.raises(ValueError, match="block_bytes=0 must be positive"):
        e.add_host_tier(block_bytes=0, num_blocks=1)
    with pytest.raises(ValueError, match="num_blocks=-1 must be positive"):
        e.add_file_tier(tmp_path, block_bytes=4096, num_blocks=-1)
    with pytest.raises(ValueError, match="tpusync: host tier size overflows"):
        e.add_host_tier(block_bytes=1 << 40, num_blocks=1 << 40)
    with pytest.raises(ValueError, match="tpusync: file tier size overflows"):
        e.add_file_tier(tmp_path, block_bytes=1 << 40, num_blocks=1 << 40)
    with pytest.raises(ValueError, match="must not contain '/'"):
        e.add_host_tier(block_bytes=4096, num_blocks=1, shm_name="a/b")
    with pytest.raises(ValueError, match="must not contain '/'"):
        e.add_file_tier(tmp_path, block_bytes=4096, num_blocks=1, file_name="a/b")
    # An empty name would be taken for "anonymous" (no persistence), an empty directory
    # for the current one: refused by name.
    with pytest.raises(ValueError, match=r"shm_name='' must be a non-empty str or None"):
        e.add_host_tier(block_bytes=4096, num_blocks=1, shm_name="")
    with pytest.raises(ValueError, match=r"file_name='' must be a non-empty str or None"):
        e.add_file_tier(tmp_path, block_bytes=4096, num_blocks=1, file_name="")
    with pytest.raises(ValueError, match=r"directory='' must be a non-empty path \(a directory\)"):
        e.add_file_tier("", block_bytes=4096, num_blocks=1)
    with pytest.raises(ValueError, match=r"tpusync: no tier 0 \(engine has 0\)"):
        e.tier_info(0)
    assert os.listdir(tmp_path) == []  # Failed opens leave nothing behind.


def test_anonymous_file_tier_leaves_no_file(make_engine, tmp_path):
    e = make_engine()
    t = e.add_file_tier(tmp_path, block_bytes=4096, num_blocks=4)
    e.write(t, 0, np.ones(5000, np.uint8))
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- tickets and segments


def test_bad_ticket_and_double_wait(make_engine):
    e = make_engine()
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    for call in (e.wait, e.poll, e.cancel):
        with pytest.raises(TpusyncError, match="tpusync: unknown ticket 424242"):
            call(424242)
    with pytest.raises(TpusyncError, match="unknown ticket -1"):
        e.wait(-1)
    ticket = e.submit_write(t, [(0, 0, 8)], np.ones(8, np.uint8))
    e.wait(ticket)
    with pytest.raises(TpusyncError, match=f"unknown ticket {ticket} .*already waited"):
        e.wait(ticket)
    with pytest.raises(TpusyncError, match="unknown ticket"):
        e.poll(ticket)


def test_wait_timeout_keeps_the_ticket(make_engine):
    e = make_engine(debug_delay_us=300_000)
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    out = np.zeros(8, np.uint8)
    ticket = e.submit_read(t, [(0, 0, 8)], out)
    with pytest.raises(TpusyncError, match=f"ticket {ticket} still running after 10 ms"):
        e.wait(ticket, timeout=0.01)
    assert not e.poll(ticket)
    e.wait(ticket)  # Still valid after the timeout.


def test_segment_errors(make_engine):
    e = make_engine()
    t = e.add_host_tier(block_bytes=1000, num_blocks=3)
    buf = np.zeros(100, np.uint8)
    with pytest.raises(
        ValueError,
        match=r"segment 1: range \[2950, 3050\) is outside the host "
        r"tier of 3000 bytes",
    ):
        e.submit_read(t, [(0, 0, 10), (2950, 0, 100)], buf)
    with pytest.raises(ValueError, match="outside the"):
        e.submit_write(t, [(1 << 62, 0, 1)], buf)
    with pytest.raises(
        ValueError, match=r"segment 0 covers bytes \[50, 150\) of a 100-byte buffer"
    ):
        e.submit_read(t, [(0, 50, 100)], buf)
    with pytest.raises(ValueError, match="-byte buffer"):
        e.submit_write(t, [(0, 0, 101)], buf)
    with pytest.raises(ValueError, match="400-byte buffer"):  # Sized in bytes, not elements.
        e.submit_read(t, [(0, 0, 401)], np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="negative field"):
        e.submit_read(t, [(0, -1, 1)], buf)
    with pytest.raises(ValueError, match=r"rows of \(tier_offset, mem_offset, nbytes\)"):
        e.submit_read(t, [(0, 0)], buf)
    with pytest.raises(ValueError, match="no tier 9"):
        e.submit_read(9, [(0, 0, 1)], buf)
    with pytest.raises(ValueError, match="C-contiguous"):
        e.submit_read(t, [(0, 0, 1)], buf[::2])
    ro = np.zeros(10, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        e.submit_read(t, [(0, 0, 1)], ro)
    # The engine is still healthy after all that.
    e.write(t, 0, np.ones(3, np.uint8))


def test_error_messages_come_prefixed(make_engine):
    e = make_engine()
    t = e.add_host_tier(block_bytes=4096, num_blocks=1)
    with pytest.raises(TpusyncError) as info:
        e.allocate(t, 2)
    assert str(info.value).startswith("tpusync: tier full")
    assert isinstance(info.value, RuntimeError)


# ---------------------------------------------------------------- closed engines


def test_use_after_close(make_engine, tmp_path):
    e = make_engine()
    t = e.add_host_tier(block_bytes=4096, num_blocks=2)
    ticket = e.submit_write(t, [(0, 0, 4)], np.ones(4, np.uint8))
    e.close()
    assert e.closed and "closed" in repr(e)
    e.close()  # Idempotent.
    buf = np.zeros(4, np.uint8)
    calls = [
        lambda: e.add_host_tier(block_bytes=4096, num_blocks=1),
        lambda: e.add_file_tier(tmp_path, block_bytes=4096, num_blocks=1),
        lambda: e.tier_info(t),
        lambda: e.allocate(t, 1),
        lambda: e.free(t, 0, 1),
        lambda: e.submit_read(t, [(0, 0, 4)], buf),
        lambda: e.submit_write(t, [(0, 0, 4)], buf),
        lambda: e.read(t, 0, buf),
        lambda: e.write(t, 0, buf),
        lambda: e.wait(ticket),
        lambda: e.poll(ticket),
        lambda: e.cancel(ticket),
        lambda: e.drain(),
        lambda: e.stats(),
        lambda: e.reset_stats(),
        lambda: e.timeline(),
        lambda: e.mark(1),
    ]
    for call in calls:
        with pytest.raises(TpusyncError, match=f"tpusync: engine {e.id} is closed"):
            call()


# ---------------------------------------------------------------- persistence


def test_shm_reattach_keeps_bytes_and_regions(shm_names):
    name = shm_names()
    data = np.random.default_rng(0).integers(0, 256, size=3 * 4096 + 17, dtype=np.uint8)
    with Engine() as e:
        t = e.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name)
        assert not e.tier_info(t).attached
        assert "shm /" + name in e.tier_info(t).description
        first = e.allocate(t, 4, name="seq0")
        e.allocate(t, 1)  # Unnamed: not persisted.
        e.write(t, first * 4096 + 5, data)
    with Engine() as e2:
        t = e2.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name)
        info = e2.tier_info(t)
        assert info.attached
        assert info.regions == {"seq0": (first, 4)}
        assert info.free_blocks == 4
        assert e2.allocate(t, 4, name="seq0") == first
        out = np.zeros_like(data)
        e2.read(t, first * 4096 + 5, out)
        np.testing.assert_array_equal(out, data)
        b = e2.allocate(t, 1)
        assert not first <= b < first + 4
    # One writer at a time; read-only attaches share the bytes it left.
    with Engine() as a, Engine() as b:
        ta = a.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name)
        with pytest.raises(TpusyncError, match="is already attached by pid"):
            b.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name)
        a.write(ta, 7 * 4096, np.full(100, 9, np.uint8))
    with Engine() as a, Engine() as b:
        ta = a.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name, read_only=True)
        tb = b.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name, read_only=True)
        for e, t in ((a, ta), (b, tb)):
            np.testing.assert_array_equal(e.read(t, 7 * 4096, np.zeros(100, np.uint8)), 9)


def test_shm_layout_mismatch(shm_names):
    name = shm_names()
    with Engine() as e:
        e.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name)
    with Engine() as e:
        with pytest.raises(
            TpusyncError,
            match="layout mismatch: it holds block_bytes=4096, "
            "num_blocks=8 but block_bytes=4096, num_blocks=9",
        ):
            e.add_host_tier(block_bytes=4096, num_blocks=9, shm_name=name)
        with pytest.raises(TpusyncError, match="layout mismatch"):
            e.add_host_tier(block_bytes=2048, num_blocks=16, shm_name=name)
        # The right layout still attaches.
        assert e.tier_info(e.add_host_tier(block_bytes=4096, num_blocks=8, shm_name=name)).attached


def test_shm_unlink(shm_names):
    name = shm_names()
    with Engine() as e:
        e.add_host_tier(block_bytes=4096, num_blocks=2, shm_name=name)
    Engine.unlink_shm(name)
    with pytest.raises(TpusyncError, match="cannot unlink shm segment"):
        Engine.unlink_shm(name)
    with Engine() as e:  # A fresh segment under the same name.
        assert not e.tier_info(
            e.add_host_tier(block_bytes=4096, num_blocks=3, shm_name=name)
        ).attached


def test_shm_refuses_foreign_segment(shm_names):
    name = shm_names()
    path = f"/dev/shm/{name}"
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with open(path, "wb") as f:
        f.write(b"not a tier" + b"\x01" * 8192)
    with Engine() as e:
        with pytest.raises(TpusyncError, match="not a tpusync tier"):
            e.add_host_tier(block_bytes=4096, num_blocks=1, shm_name=name)


def test_named_file_tier_reattach_and_mismatch(file_dir):
    data = np.arange(10000, dtype=np.uint16).view(np.uint8)
    with Engine() as e:
        t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=16, file_name="kv")
        assert not e.tier_info(t).attached
        first = e.allocate(t, 5, name="layer0")
        e.write(t, first * 4096 + 3, data)
    assert os.path.exists(os.path.join(file_dir, "kv.tpusync"))
    with Engine() as e:
        t = e.add_file_tier(file_dir, block_bytes=4096, num_blocks=16, file_name="kv")
        info = e.tier_info(t)
        assert info.attached and info.regions == {"layer0": (first, 5)}
        out = np.zeros_like(data)
        e.read(t, first * 4096 + 3, out)
        np.testing.assert_array_equal(out, data)
    with Engine() as e:
        with pytest.raises(TpusyncError, match="layout mismatch"):
            e.add_file_tier(file_dir, block_bytes=4096, num_blocks=17, file_name="kv")
    with open(os.path.join(file_dir, "junk.tpusync"), "wb") as f:
        f.write(b"\x07" * 5000)
    with Engine() as e:
        with pytest.raises(TpusyncError, match="bad magic"):
            e.add_file_tier(file_dir, block_bytes=4096, num_blocks=1, file_name="junk")
