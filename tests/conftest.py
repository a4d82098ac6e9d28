"""Fixtures shared by the tests: engines that always close, directories where a file tier
really uses O_DIRECT, whether the Mooncake client can be used, and persistent tiers (a
unique shm name, either kind of tier)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

# Four simulated CPU devices for the mesh tests (tests/caches); every other test runs on the
# first. Read when JAX's backends start, so set before anything starts them.
_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=4".strip()
# Compiling many small programs is most of the suite's time, and LLVM's optimization passes
# most of each compile on the CPU backend (test_pool_attention.py: 83 s with them, 51 s
# without). The tests check values, which the passes do not change, not speed; the
# benchmarks (python -m jax_tpusync.bench) run outside the suite, optimized. TPU compiles
# (tests/tpu) are unaffected by this flag.
_LLVM_OPT_FLAG = "--xla_backend_optimization_level"
if _LLVM_OPT_FLAG not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {_LLVM_OPT_FLAG}=0"

# libtpu (installed for tests/tpu's compile-only checks) takes a host-wide lock file when
# JAX starts unless told not to: with it, the test processes and the compiles they spawn
# would refuse each other.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

# Where libtpu is installed on a machine without a TPU, `import jax_tpusync` (below) gives it
# the settings `bench tpu-compile` gives it, for this process and those it starts
# (jax_tpusync.runtime.libtpu): no libtpu errors, JAX going on with its other backends.
from jax_tpusync.persist import commit as persistence  # noqa: E402
from jax_tpusync.runtime.engine import Engine, EngineConfig  # noqa: E402

from support.mooncake_masters import Master  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Runs the files that hold ``slow`` tests first, the slowest-marked first: the suite
    spreads whole files over its workers (``--dist loadfile``), so a long file handed out
    last would leave the other worker idle while it runs. (xdist keeps this order only
    with ``--no-loadscope-reorder``, in pyproject's addopts; by default it hands out the
    files with the most tests first.)"""
    slow_in_file: dict[str, int] = {}
    for item in items:
        path = str(item.path)
        slow_in_file[path] = slow_in_file.get(path, 0) + (
            item.get_closest_marker("slow") is not None
        )
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(str(it.path) for it in items))}
    items.sort(key=lambda it: (-slow_in_file[str(it.path)], first_seen[str(it.path)]))


# Bases tried for a directory where a file tier gets O_DIRECT (after pytest's tmp_path).
_DIRECT_IO_BASES = ("/var/tmp", "/work")


def _direct_io_works(directory: str) -> bool:
    """Whether a file tier opened in `directory` uses O_DIRECT (asks the engine itself)."""
    try:
        with Engine() as e:
            tier = e.add_file_tier(directory, block_bytes=4096, num_blocks=1)
            return e.tier_info(tier).direct_io
    except Exception:  # noqa: BLE001 - unusable directory: not a candidate.
        return False


@pytest.fixture
def file_dir(tmp_path):
    """A directory on a filesystem where the file tier really uses O_DIRECT."""
    if _direct_io_works(str(tmp_path)):
        yield str(tmp_path)
        return
    for base in _DIRECT_IO_BASES:
        if not (os.path.isdir(base) and os.access(base, os.W_OK)):
            continue
        d = tempfile.mkdtemp(prefix="tpusync-test-", dir=base)
        if _direct_io_works(d):
            try:
                yield d
            finally:
                shutil.rmtree(d, ignore_errors=True)
            return
        shutil.rmtree(d, ignore_errors=True)
    pytest.skip("no writable filesystem here supports O_DIRECT")


@pytest.fixture
def make_engine():
    """Engine factory; every engine it made is closed at teardown."""
    engines: list[Engine] = []

    def make(config: EngineConfig | None = None, **overrides) -> Engine:
        e = Engine(config, **overrides)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.fixture(scope="session")
def mooncake_usable():
    """Skips a test where the Mooncake client or its master is missing; fails it instead
    where TPUSYNC_REQUIRE_MOONCAKE=1 (CI, where they install)."""
    from jax_tpusync.bench.mooncake_master import find_binary

    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        why = f"import mooncake.store: {e}"
    else:
        why = None if find_binary() else "no mooncake_master next to the interpreter or on PATH"
    if why is None:
        return
    if os.environ.get("TPUSYNC_REQUIRE_MOONCAKE") == "1":
        pytest.fail(
            f"TPUSYNC_REQUIRE_MOONCAKE=1 but the Mooncake client cannot be used: {why} "
            f"(pip install 'jax-tpusync[mooncake]'; apt-get install libibverbs1 libnuma1)"
        )
    pytest.skip(f"Mooncake client unavailable: {why}")


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """One master for the session's tests that do not disturb it."""
    master = Master(tmp_path_factory.mktemp("mooncake"))
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def make_master(tmp_path):
    """Masters of a test's own (to kill, pause or fill), stopped at teardown."""
    made: list[Master] = []

    def make(*extra: str) -> Master:
        made.append(Master(tmp_path, *extra))
        return made[-1]

    yield make
    for master in made:
        master.stop()


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def veth_pair():
    """(namespace, its address, this end's address): a network namespace with one end of a
    veth pair, the other end here; removed at teardown (which removes the pair too). Needs
    root: skipped otherwise, and wherever the kernel or container refuses them."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace and a veth pair")
    tag = os.getpid() % 100_000
    ns, inner, outer = f"tpsync-ns-{tag}", f"tpsI{tag}", f"tpsO{tag}"
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    inner_ip, outer_ip = f"{subnet}.1", f"{subnet}.2"
    steps = [
        ("netns", "add", ns),
        ("link", "add", outer, "type", "veth", "peer", "name", inner),
        ("link", "set", inner, "netns", ns),
        ("-n", ns, "addr", "add", f"{inner_ip}/24", "dev", inner),
        ("-n", ns, "link", "set", inner, "up"),
        ("-n", ns, "link", "set", "lo", "up"),
        ("addr", "add", f"{outer_ip}/24", "dev", outer),
        ("link", "set", outer, "up"),
    ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"ip {' '.join(step)}: {done.stderr.strip()}")
        yield ns, inner_ip, outer_ip
    finally:
        _ip("link", "del", outer)
        _ip("netns", "del", ns)


# -- persistent tiers (the persistence and host-pool persistence tests) -------------------


@pytest.fixture
def shm_name():
    """A unique shm name; the segment and its manifest are removed at teardown."""
    name = f"tpusync-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        Engine.unlink_shm(name)
    except Exception:  # noqa: BLE001 - never created, or removed by the test.
        pass
    Path(persistence.SHM_DIRECTORY, name + persistence.MANIFEST_SUFFIX).unlink(missing_ok=True)


@pytest.fixture(params=["file", "shm"])
def where(request, tmp_path, shm_name):
    """Keyword arguments of a persistent tier of either kind."""
    if request.param == "file":
        return dict(tier="file", path=tmp_path, file_name="kv")
    return dict(tier="host", shm_name=shm_name)
