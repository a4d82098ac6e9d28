"""Tier safety guards: short reads are errors, one writer per store, read-only attaches,
and sizes checked (and stores preallocated) when a tier is made."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_tpusync.runtime.engine import Engine, TierDataLossError, TpusyncError

BLOCK = 4096
NUM_BLOCKS = 16
HEADER = 4096
FILE_BYTES = HEADER + BLOCK * NUM_BLOCKS  # alignment_offset 0: already page-rounded.


def _tier_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + ".tpusync")


def _add_file(e: Engine, directory: str, name: str = "kv", **kw) -> int:
    return e.add_file_tier(
        directory, block_bytes=BLOCK, num_blocks=NUM_BLOCKS, file_name=name, **kw
    )


def _add_store(e: Engine, kind: str, where: str, **kw) -> int:
    """kind "shm": `where` is the segment name; "file": the directory."""
    if kind == "shm":
        return e.add_host_tier(block_bytes=BLOCK, num_blocks=NUM_BLOCKS, shm_name=where, **kw)
    return _add_file(e, where, **kw)


def _store_name(kind: str, where: str) -> str:
    """How error messages name the store."""
    if kind == "shm":
        return f"shm segment '/{where}'"
    return f"file '{_tier_path(where, 'kv')}'"


@pytest.fixture(params=["shm", "file"])
def store(request, shm_names, file_dir):
    """(kind, where) for a persistent store: a fresh shm name or an O_DIRECT directory."""
    return request.param, shm_names() if request.param == "shm" else file_dir


# Child processes load only the extension module: importing the package imports jax, which
# takes seconds. `engine()` makes a raw engine; `write(e, tier, offset, data)` blocks.
_CHILD_PRELUDE = """
import glob, importlib.machinery, importlib.util, os
import numpy as np
_loc = importlib.util.find_spec("jax_tpusync").submodule_search_locations[0]
_path = glob.glob(os.path.join(_loc, "_tpusync.*.so"))[0]
_loader = importlib.machinery.ExtensionFileLoader("jax_tpusync._tpusync", _path)
_t = importlib.util.module_from_spec(
    importlib.util.spec_from_file_location("jax_tpusync._tpusync", _path, loader=_loader))
_loader.exec_module(_t)
TpusyncError = _t.TpusyncError

def engine():
    return _t.Engine(num_workers=1, io_chunk_bytes=1 << 20, io_depth=4,
                     huge_page_destinations=False, max_inflight_bytes=0,
                     max_bytes_per_second=0.0, worker_cpus=[], split_read_bytes=0,
                     poison_fetches=False, debug_delay_us=0, record_timeline=False)

def write(e, tier, offset, data):
    one = lambda x: np.array([x], np.int64)
    e.wait(e.submit(tier, True, one(offset), data, one(0), one(data.nbytes), -1, -1), -1.0)
"""


def _child_argv(code: str) -> list[str]:
    return [sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(code)]


def _run_python(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    # cwd: not the repository root, whose source package has no built extension.
    return subprocess.run(
        _child_argv(code), capture_output=True, text=True, timeout=timeout, cwd="/"
    )


# ---------------------------------------------------------------- short reads


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("truncate_to", [4096, 0])
def test_read_of_truncated_file_raises_naming_offset(make_engine, file_dir, direct_io, truncate_to):
    assert issubclass(TierDataLossError, TpusyncError)
    e = make_engine()
    t = _add_file(e, file_dir, direct_io=direct_io)
    assert e.tier_info(t).direct_io == direct_io
    offset = 3 * BLOCK
    e.write(t, offset, np.full(BLOCK, 7, np.uint8))
    np.testing.assert_array_equal(e.read(t, offset, np.zeros(BLOCK, np.uint8)), 7)
    path = _tier_path(file_dir, "kv")
    os.truncate(path, truncate_to)
    with pytest.raises(
        TierDataLossError,  # A TpusyncError: the bytes are gone, not a passing failure.
        match=rf"tpusync: file tier read of \d+ bytes at file offset {HEADER + offset} returned 0: "
        rf"file '{path}' \(now {truncate_to} bytes\) is shorter than the tier "
        r"\(truncated or replaced\?\)",
    ):
        e.read(t, offset, np.zeros(BLOCK, np.uint8))
    e.close()
    short = (
        rf"is {truncate_to} bytes but its header and capacity need {FILE_BYTES}"
        if truncate_to >= HEADER
        else rf"is 0 bytes, shorter than its {HEADER}-byte header"
    )
    with Engine() as e2:
        with pytest.raises(TpusyncError, match=rf"tpusync: tier file '{path}' {short}"):
            _add_file(e2, file_dir)


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_last_byte_reads_and_a_file_one_byte_short_fails(make_engine, file_dir, direct_io):
    e = make_engine()
    t = _add_file(e, file_dir, direct_io=direct_io)
    last = BLOCK * NUM_BLOCKS - 1
    path = _tier_path(file_dir, "kv")
    assert os.stat(path).st_size == FILE_BYTES
    # Never written: zeros, read from inside the (preallocated) file.
    np.testing.assert_array_equal(e.read(t, last, np.full(1, 9, np.uint8)), 0)
    e.write(t, last, np.array([42], np.uint8))
    assert e.read(t, last, np.zeros(1, np.uint8))[0] == 42
    # A destination in phase with the file: the O_DIRECT read goes straight to it.
    page = np.zeros(2 * BLOCK, np.uint8)
    start = (-page.ctypes.data) % BLOCK
    dst = page[start : start + BLOCK]
    assert e.read(t, last + 1 - BLOCK, dst)[-1] == 42
    os.truncate(path, FILE_BYTES - 1)
    with pytest.raises(
        TierDataLossError, match=r"at file offset \d+ returned \d+: .*shorter than the tier"
    ):
        e.read(t, last, np.zeros(1, np.uint8))
    with pytest.raises(TierDataLossError, match="shorter than the tier"):
        e.read(t, last + 1 - BLOCK, dst)
    e.close()
    with Engine() as e2:
        with pytest.raises(
            TpusyncError,
            match=rf"is {FILE_BYTES - 1} bytes but its header and capacity need {FILE_BYTES}",
        ):
            _add_file(e2, file_dir)


# ---------------------------------------------------------------- ownership


def test_second_writer_in_process_fails_naming_holder(make_engine, store):
    kind, where = store
    a, b = make_engine(), make_engine()
    _add_store(a, kind, where)
    holder = rf"{_store_name(kind, where)} is already attached by pid {os.getpid()} \(read-write\)"
    with pytest.raises(TpusyncError, match="^tpusync: .*" + holder):
        _add_store(b, kind, where)
    with pytest.raises(TpusyncError, match=holder):  # The same engine is refused too.
        _add_store(a, kind, where)
    a.close()
    assert b.tier_info(_add_store(b, kind, where)).attached  # Released on close.


def test_second_writer_in_another_process_fails_naming_holder(make_engine, store):
    kind, where = store
    e = make_engine()
    t = _add_store(e, kind, where)
    e.write(t, 0, np.full(BLOCK, 5, np.uint8))
    if kind == "shm":
        call = f"e.add_host_tier({BLOCK}, {NUM_BLOCKS}, {where!r}, read_only)"
    else:
        call = f"e.add_file_tier({where!r}, {BLOCK}, {NUM_BLOCKS}, 'kv', True, 0, read_only)"
    code = f"""
        e = engine()
        for read_only in (False, True):
            try:
                {call}
                print("attached")
            except TpusyncError as err:
                print(err)
        e.close()
    """
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for line in lines:
        assert f"is already attached by pid {os.getpid()} (read-write)" in line, line
    np.testing.assert_array_equal(e.read(t, 0, np.zeros(BLOCK, np.uint8)), 5)


def test_holder_in_another_process_is_named(make_engine, shm_names):
    """The holder is a live process other than this one (what /proc/locks reports)."""
    name = shm_names()
    code = f"""
        import sys
        e = engine()
        e.add_host_tier({BLOCK}, {NUM_BLOCKS}, {name!r}, False)
        print("ready", flush=True)
        sys.stdin.read()
        e.close()
    """
    child = subprocess.Popen(
        _child_argv(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        e = make_engine()
        with pytest.raises(
            TpusyncError, match=rf"'/{name}' is already attached by pid {child.pid} \(read-write\)"
        ):
            e.add_host_tier(block_bytes=BLOCK, num_blocks=NUM_BLOCKS, shm_name=name)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert e.tier_info(
        e.add_host_tier(block_bytes=BLOCK, num_blocks=NUM_BLOCKS, shm_name=name)
    ).attached


def test_read_only_attaches_coexist_and_refuse_writes(make_engine, store):
    kind, where = store
    with Engine() as w:
        t = _add_store(w, kind, where)
        first = w.allocate(t, 2, name="seq")
        w.write(t, first * BLOCK, np.arange(2 * BLOCK, dtype=np.uint8))
    readers = [make_engine(), make_engine()]
    tiers = [_add_store(r, kind, where, read_only=True) for r in readers]
    for r, t in zip(readers, tiers):
        info = r.tier_info(t)
        assert info.read_only and info.attached and info.regions == {"seq": (first, 2)}
        assert "read-only" in info.description
        out = r.read(t, first * BLOCK, np.zeros(2 * BLOCK, np.uint8))
        np.testing.assert_array_equal(out, np.arange(2 * BLOCK, dtype=np.uint8))
        assert r.allocate(t, 2, name="seq") == first  # Existing name: no header write.
    refused = rf"tpusync: tier {_store_name(kind, where)} is attached read-only; writes are refused"
    r, t = readers[0], tiers[0]
    with pytest.raises(TpusyncError, match=refused):
        r.write(t, 0, np.ones(16, np.uint8))
    with pytest.raises(TpusyncError, match=refused):
        r.allocate(t, 1, name="new")  # Would record a region in the header.


def test_writer_and_reader_exclude_each_other(make_engine, store):
    kind, where = store
    w = make_engine()
    _add_store(w, kind, where)
    r = make_engine()
    name = _store_name(kind, where)
    with pytest.raises(
        TpusyncError,
        match=rf"{name} is already attached by pid {os.getpid()} \(read-write\); a read-only "
        "attach needs every writer closed",
    ):
        _add_store(r, kind, where, read_only=True)
    w.close()
    _add_store(r, kind, where, read_only=True)
    with pytest.raises(
        TpusyncError, match=rf"{name} is already attached by pid {os.getpid()} \(read-only\)"
    ):
        _add_store(make_engine(), kind, where)


def test_read_only_never_creates(make_engine, store):
    kind, where = store
    e = make_engine()
    with pytest.raises(TpusyncError, match="does not exist; a read-only attach never creates one"):
        _add_store(e, kind, where, read_only=True)
    if kind == "shm":
        assert not os.path.exists(f"/dev/shm/{where}")
    else:
        assert os.listdir(where) == []
    with pytest.raises(ValueError, match="read-only host tier needs shm_name"):
        e.add_host_tier(block_bytes=BLOCK, num_blocks=1, read_only=True)
    with pytest.raises(ValueError, match="read-only file tier needs file_name"):
        e.add_file_tier(
            where if kind == "file" else "/tmp", block_bytes=BLOCK, num_blocks=1, read_only=True
        )


# ---------------------------------------------------------------- sizes


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


def test_host_pool_larger_than_available_memory_raises(make_engine):
    e = make_engine()
    block = 1 << 20
    num_blocks = _mem_available() // block + 1024
    with pytest.raises(
        TpusyncError,
        match=rf"a host pool of {HEADER + num_blocks * block} bytes exceeds the memory "
        r"available \(MemAvailable \d+ bytes in /proc/meminfo\); ask for fewer",
    ):
        e.add_host_tier(block_bytes=block, num_blocks=num_blocks)
    e.add_host_tier(block_bytes=block, num_blocks=4)  # A pool that fits still works.


def test_shm_segment_is_preallocated(make_engine, shm_names):
    name = shm_names()
    e = make_engine()
    e.add_host_tier(block_bytes=1 << 20, num_blocks=8, shm_name=name)
    st = os.stat(f"/dev/shm/{name}")
    assert st.st_size == HEADER + (8 << 20)
    assert st.st_blocks * 512 >= st.st_size  # Pages reserved now, not on first touch.


def test_shm_larger_than_dev_shm_free_space_raises(make_engine, shm_names):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    vfs = os.statvfs("/dev/shm")
    free = vfs.f_bavail * vfs.f_frsize
    block = 1 << 20
    num_blocks = free // block + 64
    name = shm_names()
    e = make_engine()
    with pytest.raises(
        TpusyncError,
        match=rf"cannot preallocate shm segment '/{name}' of {HEADER + num_blocks * block} "
        r"bytes: \d+ more bytes needed \(/dev/shm has \d+ bytes free\)",
    ):
        e.add_host_tier(block_bytes=block, num_blocks=num_blocks, shm_name=name)
    assert not os.path.exists(f"/dev/shm/{name}")  # The segment it made is removed again.
    assert e.tier_info(e.add_host_tier(block_bytes=BLOCK, num_blocks=4, shm_name=name))


@pytest.mark.parametrize("named", [True, False], ids=["named", "anonymous"])
def test_file_tier_is_preallocated(make_engine, file_dir, named):
    e = make_engine()
    e.add_file_tier(file_dir, block_bytes=1 << 20, num_blocks=8, file_name="pre" if named else None)
    if named:
        st = os.stat(_tier_path(file_dir, "pre"))
        assert st.st_size == HEADER + (8 << 20)
    assert [f for f in os.listdir(file_dir) if f != "pre.tpusync"] == []  # No temporaries.
    if named and st.st_blocks * 512 < st.st_size:
        pytest.skip("this filesystem cannot preallocate (sized sparse instead)")


@pytest.mark.parametrize("named", [True, False], ids=["named", "anonymous"])
def test_file_tier_larger_than_free_space_raises(make_engine, file_dir, named):
    vfs = os.statvfs(file_dir)
    free = vfs.f_bavail * vfs.f_frsize
    block = 1 << 30
    num_blocks = free // block + 4
    e = make_engine()
    with pytest.raises(
        TpusyncError,
        match=r"cannot preallocate tier file '.*' of \d+ bytes: (\d+ more bytes needed|No space "
        rf"left on device) \({file_dir} has \d+ bytes free\); free space there",
    ):
        e.add_file_tier(
            file_dir, block_bytes=block, num_blocks=num_blocks, file_name="big" if named else None
        )
    assert os.listdir(file_dir) == []  # Nothing left behind, not even a temporary.


def test_failed_write_names_tier_offset_and_errno(file_dir):
    """A write the kernel refuses (here: past RLIMIT_FSIZE, standing in for ENOSPC or EIO)
    fails with the tier's file, the file offset and the errno text."""
    code = f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        for direct in (True, False):
            e = engine()
            t = e.add_file_tier({file_dir!r}, {BLOCK}, {NUM_BLOCKS}, "w%d" % direct, direct, 0)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8 * {BLOCK}, resource.RLIM_INFINITY))
            try:
                write(e, t, 10 * {BLOCK}, np.ones({BLOCK}, np.uint8))
                print("wrote")
            except TpusyncError as err:
                print(err)
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
            e.close()
    """
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for direct, line in zip((1, 0), lines):
        path = _tier_path(file_dir, f"w{direct}")
        assert line == (
            f"tpusync: file tier '{path}': write of {BLOCK} bytes at file offset "
            f"{HEADER + 10 * BLOCK} failed: File too large"
        ), line
