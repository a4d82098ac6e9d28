"""Weight sync through a Mooncake Store (a real ``mooncake_master`` on loopback): the pulled
params bitwise equal in two layout pairs, range reads, an incomplete version refused with
the previous params kept, a master killed in the middle of a pull, a master killed or
stopped at many moments of a publish and of a pull, a damaged object refused by name, old
versions retired, the URL's guards.

Without the Mooncake client these tests skip, unless TPUSYNC_REQUIRE_MOONCAKE=1 (then they
fail: the ``mooncake_usable`` fixture of tests/conftest.py)."""

from __future__ import annotations

import re
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_tpusync.bench.mooncake_master import LocalMaster, free_port
from jax_tpusync.weights.records import (
    IncompleteVersionError,
    VersionNotFoundError,
    WeightSyncError,
)
from jax_tpusync.weights.store_mooncake import SETTLE_MAX_S, RemovalNotReady
from jax_tpusync.weights.sync import WeightPublisher, WeightPuller, open_weight_store

from support import weights_support as ws

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")

NAMESPACE = "weights-test"


@pytest.fixture(autouse=True)
def _mooncake_available(mooncake_usable):
    return mooncake_usable


@pytest.fixture
def master():
    """A master of the test's own (some tests kill it)."""
    with LocalMaster("--client_ttl=3") as m:
        yield m


def url(master, **options) -> str:
    query = "&".join(
        f"{k}={v}" for k, v in {"namespace": NAMESPACE, "chunk_kb": 4, **options}.items()
    )
    return f"mooncake://{master.address}?{query}"


def params_with_a_big_leaf(seed: int):
    params = ws.host_params(seed)
    # 64 KiB: 16 chunks of 4 KiB, so that a puller reads ranges of a shard, not all of it.
    params["big"] = np.random.default_rng(seed).standard_normal((256, 64)).astype(np.float32)
    return params


def rows(axis):
    return lambda path, ndim: P(axis) if ndim else P()


def columns(path, ndim):
    return P(*([None] * (ndim - 1)), "tp") if ndim >= 2 else P()


LAYOUT_PAIRS = {
    # Trainer FSDP over 4, sampler tensor parallel over 2 of the devices.
    "fsdp4->tp2": ((0, 4, "fsdp", rows("fsdp")), (2, 4, "tp", columns)),
    # Trainer FSDP over 2, sampler FSDP over 4: each sampler shard is half a published one.
    "fsdp2->fsdp4": ((0, 2, "fsdp", rows("fsdp")), (0, 4, "fsdp", rows("fsdp"))),
}


def layout(pair: str, seed: int = 1):
    (a, b, name, spec), (c, d, tname, tspec) = LAYOUT_PAIRS[pair]
    devices = jax.devices()
    params = params_with_a_big_leaf(seed)
    trained = ws.shard(
        params, ws.mesh_of(devices[a:b], (b - a,), (name,)), ws.specs_like(params, spec)
    )
    targets = ws.shardings(
        ws.mesh_of(devices[c:d], (d - c,), (tname,)), ws.specs_like(params, tspec)
    )
    return params, trained, targets


@pytest.mark.parametrize("pair", sorted(LAYOUT_PAIRS))
def test_pull_is_bitwise_equal_and_reads_only_the_ranges_it_needs(master, pair):
    params, trained, targets = layout(pair)
    with (
        WeightPublisher(url(master), keep=2) as pub,
        WeightPuller(url(master, segment_mb=0), timeout_s=10) as puller,
    ):
        pub.publish(trained, 1)
        pub.wait()
        pulled = puller.pull(targets)
        ws.check_pulled(pulled, params, targets, puller.stats)
        assert puller.version == 1
        # This process's devices hold every array between them: each chunk came once,
        # though several destination blocks needed it.
        total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
        assert puller.store.bytes_fetched == total
        # The next version, same layouts: the plan is reused.
        again = params_with_a_big_leaf(2)
        pub.publish(jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), again, trained), 2)
        pub.wait()
        ws.check_pulled(puller.pull(targets), again, targets, puller.stats)
        assert puller.stats.plan_cached and puller.version == 2


def test_a_reader_fetches_only_the_chunks_a_piece_needs(master):
    params, trained, _ = layout("fsdp2->fsdp4")
    # The puller's own chunk size differs: it reads in the publisher's (4 KiB).
    with (
        WeightPublisher(url(master)) as pub,
        WeightPuller(url(master, segment_mb=0, chunk_kb=16)) as puller,
    ):
        pub.publish(trained, 1)
        pub.wait()
        store = puller.store
        manifest = store.read_manifest(1)
        big = next(leaf for leaf in manifest.leaves if leaf.path == "['big']")
        assert [s.box for s in big.shards] == [((0, 128), (0, 64)), ((128, 256), (0, 64))]
        # Rows 16-24 of the first shard: bytes 4096-6144, inside its second 4 KiB chunk.
        # Rows 30-34, columns 2-5 of the second: bytes 7688-8468, its second and third chunks.
        wanted = [(0, (slice(16, 24), slice(0, 64))), (1, (slice(30, 34), slice(2, 5)))]
        reader = store.open_version(manifest)
        got = reader.read(big, wanted)
        reader.close()
        np.testing.assert_array_equal(got[0], params["big"][16:24])
        np.testing.assert_array_equal(got[1], params["big"][158:162, 2:5])
        assert store.bytes_fetched == 3 * 4096


def test_an_incomplete_version_is_refused_and_the_previous_params_kept(master):
    _, trained, targets = layout("fsdp4->tp2")
    with WeightPublisher(url(master)) as pub, WeightPuller(url(master, segment_mb=0)) as puller:
        pub.publish(trained, 1)
        pub.wait()
        held = puller.pull(targets)
        # Version 2 of two publishing processes: process 1 never wrote its part.
        writer = pub.store.part_writer(2, 0, 2)
        writer.add("['step']", (), "int32", [((), np.array(2, np.int32))])
        writer.commit()
        start = time.monotonic()
        with pytest.raises(
            IncompleteVersionError,
            match=r"weights version 2 is incomplete: no part from process\(es\) \[1\] of 2 "
            r"publishing processes after waiting 0.3 s .*previous params \(version 1\) kept",
        ) as info:
            puller.pull(targets, 2, timeout_s=0.3)
        assert 0.3 <= time.monotonic() - start < 5
        assert (info.value.version, info.value.missing) == (2, (1,))
        assert puller.version == 1 and puller.params is held
        assert puller.pull(targets) is held  # "latest": the newest complete version, 1.
        with pytest.raises(ValueError, match=r"version 2: process 0 already published its part"):
            pub.store.part_writer(2, 0, 2)


def test_a_master_killed_in_the_middle_of_a_pull_is_a_clear_error_within_the_deadline(master):
    _, trained, targets = layout("fsdp4->tp2")
    deadline_s = 2.0
    pub = WeightPublisher(url(master, deadline_s=deadline_s))
    puller = WeightPuller(url(master, segment_mb=0, deadline_s=deadline_s), timeout_s=5)
    try:
        pub.publish(trained, 1)
        pub.wait()
        held = puller.pull(targets)
        pub.publish(jax.tree.map(lambda x: x + 0 if x.ndim else x, trained), 2)
        pub.wait()
        open_version = puller.store.open_version

        def kill_then_open(manifest):  # The manifest is read; the data is not yet.
            master.proc.kill()
            master.proc.wait(timeout=10)
            return open_version(manifest)

        puller.store.open_version = kill_then_open
        start = time.monotonic()
        with pytest.raises(
            WeightSyncError, match=r"weights version 2, leaf .*Mooncake (store|master)"
        ):
            puller.pull(targets, 2)
        assert time.monotonic() - start < deadline_s + 3
        assert puller.version == 1 and puller.params is held
        # Later calls fail fast too: the master does not answer.
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"Mooncake"):
            puller.pull(targets, 3, timeout_s=0)
        assert time.monotonic() - start < deadline_s + 3
        # A publish is refused as clearly (asking whether the version exists fails).
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"weights version 3: .*Mooncake (store|master)"):
            pub.publish(trained, 3)
        assert time.monotonic() - start < deadline_s + 3
        assert pub.last_version == 2
    finally:
        # Closing with the master down returns at once and leaves the clients open.
        start = time.monotonic()
        puller.close()
        pub.close()
        assert time.monotonic() - start < 2 * deadline_s + 3


def damage(store, key: str, nbytes: int) -> None:
    """Replaces object ``key`` with ``nbytes`` bytes of garbage."""
    garbage = np.full(nbytes, 0xA5, np.uint8)

    def upsert(client):
        client.register_buffer(garbage.ctypes.data, garbage.nbytes)
        try:
            return client.upsert_from(key, garbage.ctypes.data, garbage.nbytes)
        finally:
            client.unregister_buffer(garbage.ctypes.data)

    assert store.call(upsert, "damaging an object") == 0


def test_a_damaged_object_is_refused_by_name(master):
    _, trained, targets = layout("fsdp4->tp2")
    with WeightPublisher(url(master)) as pub, WeightPuller(url(master, segment_mb=0)) as puller:
        pub.publish(trained, 1)
        pub.wait()
        manifest = pub.store.read_manifest(1)
        big = next(leaf for leaf in manifest.leaves if leaf.path == "['big']")
        shard = big.shards[0]
        damage(pub.store, shard.key, shard.nbytes)
        with pytest.raises(
            WeightSyncError,
            match=rf"weights version 1, leaf \['big'\]: object '{shard.key}' is damaged: "
            rf"chunk \d+ \(bytes \d+-\d+\) does not match its checksum",
        ):
            puller.pull(targets, 1)
        assert puller.version is None and puller.params is None
        # Another size than the manifest says (one byte short): refused by name too.
        damage(pub.store, shard.key, shard.nbytes - 1)
        with pytest.raises(WeightSyncError, match=rf"object '{shard.key}' is damaged: it does not"):
            puller.pull(targets, 1)
        # A damaged manifest.
        part = pub.store.part_key(1, 0)
        damage(pub.store, part, 100)
        with pytest.raises(WeightSyncError, match=rf"object '{part}' is damaged: its checksum"):
            puller.pull(targets, 1)


def test_old_versions_are_retired(master):
    params, trained, targets = layout("fsdp4->tp2")
    with (
        WeightPublisher(url(master), keep=1) as pub,
        WeightPuller(url(master, segment_mb=0)) as puller,
    ):
        for version in (1, 2):
            pub.publish(trained, version)
            pub.wait()
            puller.pull(targets, version)
        pub.publish(trained, 3)
        pub.wait()
        store = pub.store
        assert store.versions() == [3]
        for version in (1, 2):
            assert store.parts(version) == (None, set())
            prefix = store.version_prefix(version)
            assert store.call(lambda c, p=prefix: c.is_exist(p + "p00000/l00000/s00000"), "") == 0
        ws.check_pulled(puller.pull(targets), params, targets, puller.stats)
        assert puller.version == 3


def test_a_full_pool_refuses_the_write_and_the_version_stays_incomplete(master):
    devices = jax.devices()
    mesh = ws.mesh_of(devices[:2], (2,), ("fsdp",))
    # 24 MiB in two shards of 12 MiB: more than the 16 MiB the only segment gives.
    big = {"w": np.ones((6 << 20,), np.float32)}
    params = ws.shard(big, mesh, {"w": P("fsdp")})
    targets = ws.shardings(mesh, {"w": P("fsdp")})
    with (
        WeightPublisher(url(master, segment_mb=16)) as pub,
        WeightPuller(url(master, segment_mb=0)) as puller,
    ):
        pub.publish(params, 1)
        with pytest.raises(
            WeightSyncError,
            match=r"weights version 1: writing this process's part failed \(WeightSyncError: "
            r"weights version 1, leaf \['w'\]: putting '.*' returned -200: no room in the pool",
        ):
            pub.wait()
        with pytest.raises(IncompleteVersionError, match=r"weights version 1 is incomplete"):
            puller.pull(targets, 1, timeout_s=0)
        # What fits is published (the aborted part's objects were removed).
        small = ws.shard({"w": np.ones((1 << 20,), np.float32)}, mesh, {"w": P("fsdp")})
        pub.publish(small, 2)
        pub.wait()
        assert np.asarray(puller.pull(targets, 2)["w"]).sum() == 1 << 20


def test_an_unreachable_master_is_a_clear_error_within_the_deadline():
    address = f"127.0.0.1:{free_port()}"
    puller = WeightPuller(f"mooncake://{address}?deadline_s=1&segment_mb=0", timeout_s=0)
    targets = layout("fsdp4->tp2")[2]
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"the Mooncake master at {address}: connecting"):
        puller.pull(targets)
    assert time.monotonic() - start < 3
    puller.close()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("mooncake://h:1?segment_mb=15", r"segment_bytes=15728640 must be 0 or at least"),
        ("mooncake://h:1?deadline_s=0", r"deadline_s=0.0 must be a number of seconds > 0"),
        ("mooncake://h:1?deadline_s=3600.5", r"deadline_s=3600.5 must be .* at most 3600"),
        ("mooncake://h:1?chunk_kb=3", r"chunk_bytes=3072 must be an int >= 4096"),
        ("mooncake://h:1?color=red", r"option color='red': known options: segment_mb"),
        ("mooncake://h:1?namespace=a/b", r"namespace='a/b' must be a non-empty name"),
        ("mooncake://h", r"expected 'mooncake://host:port"),
        ("mooncake://h:1/path", r"expected 'mooncake://host:port"),
        ("mooncake://h:99999", r"Port out of range"),
    ],
)
def test_the_url_guards(spec, message):
    with pytest.raises(ValueError, match=message):
        open_weight_store(spec)


def test_a_store_object_is_used_as_it_is(master):
    store = open_weight_store(url(master))
    assert open_weight_store(store) is store
    with pytest.raises(TypeError, match=r"store=3.5 must be a directory path, a 'mooncake://"):
        open_weight_store(3.5)
    store.close()


def test_the_url_edges_are_accepted():
    store = open_weight_store("mooncake://h:1?segment_mb=16&deadline_s=3600&chunk_kb=4")
    assert (store.segment_bytes, store.deadline_s, store.chunk_bytes) == (16 << 20, 3600.0, 4096)
    assert open_weight_store("mooncake://h:1?segment_mb=0").segment_bytes == 0
    store.close()


def test_a_version_marker_read_while_it_is_written_is_waited_for(master, monkeypatch):
    """The first publisher's marker of a version, read while it is being put (the store
    says "not readable yet"), is a version not there yet: waited for until the deadline,
    not an error."""
    with WeightPuller(url(master, segment_mb=0)) as puller:
        store = puller.store
        real_call = store.call
        begun = store.begun_key(3)

        def call(fn, what):
            class Client:  # The store's answer for the marker only.
                def get_size(self, key):
                    return -703 if key == begun else real_call(lambda c: c.get_size(key), what)

            if what == "weights version 3":
                try:
                    return fn(Client())
                except AttributeError:
                    pass
            return real_call(fn, what)

        monkeypatch.setattr(store, "call", call)
        assert store.parts(3) == (None, set())
        start = time.monotonic()
        with pytest.raises(VersionNotFoundError, match=r"weights version 3 not found .* after"):
            store.wait_manifest(3, 0.3)
        assert 0.3 <= time.monotonic() - start < 5


# A master killed (SIGKILL) or stopped (SIGSTOP) at many moments of a publish and of a pull:
# each returns within its deadline and a margin, done or refused by a named error, never
# half done; once the master is back (started again with every object gone, or resumed),
# the same publisher and puller work again.
FAULT_DEADLINE_S = 1.0
FAULT_WITHIN_S = FAULT_DEADLINE_S + 2.0  # The deadline, and room for a loaded 2-core runner.
FAULT_MOMENTS = {"kill": (0.0, 0.005, 0.015, 0.04), "stop": (0.003, 0.012, 0.03)}


def faulted(master, how: str, delay: float, fn):
    """(``fn()``'s value or the WeightSyncError it raised, seconds) with ``master`` killed
    or stopped ``delay`` seconds into it, then back."""
    safety = master.resume_later(30) if how == "stop" else None
    start = time.monotonic()
    try:
        fault = master.fault_after(how, delay)
        try:
            out = fn()
        except WeightSyncError as e:
            out = e
        seconds = time.monotonic() - start
        fault.join(timeout=10)
    finally:
        master.revive(how)
        if safety is not None:
            safety.kill()
            safety.wait(timeout=10)
    return out, seconds


# A put the master had begun when it was stopped leaves its object "not readable yet" for
# the master's discard timeout (30 s) once resumed: recovery may take that, and a margin.
RECOVER_S = 40.0


def until_it_works(fn, what: str, within_s: float = RECOVER_S):
    """``fn()``'s value once it raises no WeightSyncError (bounded)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return fn()
        except WeightSyncError as e:
            assert time.monotonic() < deadline, f"{what} never worked again: {e}"
            time.sleep(0.25)


@pytest.mark.parametrize("how", sorted(FAULT_MOMENTS))
def test_a_master_that_dies_during_a_publish_or_a_pull_is_a_named_error_within_the_deadline(
    make_master, how
):
    master = make_master()
    params, trained, targets = layout("fsdp4->tp2")
    options = dict(deadline_s=FAULT_DEADLINE_S)
    worst = 0.0
    with (
        WeightPublisher(url(master, **options), keep=2) as pub,
        WeightPuller(url(master, segment_mb=0, **options), timeout_s=0) as puller,
    ):
        version = 0

        def publish_and_pull():
            nonlocal version
            version += 1
            pub.publish(trained, version)
            pub.wait()
            return puller.pull(targets, version)

        ws.check_pulled(
            until_it_works(publish_and_pull, "publishing"), params, targets, puller.stats
        )
        for delay in FAULT_MOMENTS[how]:
            # A publish: written whole (then pulled whole) or refused by name.
            version += 1

            def publish(v=version):
                pub.publish(trained, v)
                return pub.wait()

            out, seconds = faulted(master, how, delay, publish)
            assert seconds < FAULT_WITHIN_S, (how, delay, seconds, out)
            worst = max(worst, seconds)
            if isinstance(out, WeightSyncError):
                assert re.search(r"weights version \d+\b.*: .*(Mooncake|master)", str(out)), out
            pulled = until_it_works(publish_and_pull, f"publishing after a {how}")
            ws.check_pulled(pulled, params, targets, puller.stats)
            held, held_version = puller.params, puller.version
            # A pull of a new version: whole, or refused by name with the params held kept.
            version += 1
            pub.publish(trained, version)
            pub.wait()
            out, seconds = faulted(master, how, delay, lambda: puller.pull(targets, version))
            assert seconds < FAULT_WITHIN_S, (how, delay, seconds, out)
            worst = max(worst, seconds)
            if isinstance(out, WeightSyncError):
                assert re.search(r"weights version \d+\b.*(Mooncake|master|not found)", str(out)), (
                    out
                )
                assert puller.params is held and puller.version == held_version
            else:
                ws.check_pulled(out, params, targets, puller.stats)
            pulled = until_it_works(publish_and_pull, f"pulling after a {how}")
            ws.check_pulled(pulled, params, targets, puller.stats)
    print(f"{how}: slowest publish or pull {worst:.3f} s")


def test_a_version_the_store_cannot_remove_yet_stays_listed_and_the_publish_goes_on(
    master, monkeypatch
):
    """After a fault, the master may start a put it never finishes: removing that object
    returns "not readable yet" (-703) until the master discards it. Retiring the version
    waits for a later publish; the publish itself succeeds."""
    params, trained, targets = layout("fsdp4->tp2")
    with (
        WeightPublisher(url(master), keep=1) as pub,
        WeightPuller(url(master, segment_mb=0)) as puller,
    ):
        pub.publish(trained, 1)
        pub.wait()
        store = pub.store
        real_call = store.call
        stuck = store.part_key(1, 0)

        def call(fn, what):
            class Client:  # The store's answer for version 1's manifest only.
                def batch_remove(self, keys, force):
                    if stuck in keys:
                        return [-703 if k == stuck else 0 for k in keys]
                    return real_call(lambda c: c.batch_remove(keys, force), what)

            if what == "retiring weights version 1":
                try:
                    return fn(Client())
                except AttributeError:
                    pass
            return real_call(fn, what)

        monkeypatch.setattr(store, "call", call)
        with pytest.raises(RemovalNotReady, match=r"retiring weights version 1: removing .*-703"):
            store.remove_version(1)
        pub.publish(trained, 2)
        assert pub.wait().version == 2  # Published; version 1 kept for now.
        assert store.versions() == [1, 2]
        ws.check_pulled(puller.pull(targets, 2), params, targets, puller.stats)
        monkeypatch.setattr(store, "call", real_call)  # The master discarded the put.
        pub.publish(trained, 3)
        pub.wait()
        assert store.versions() == [3]


@pytest.mark.parametrize("not_ready", [2, "always"])
def test_the_list_of_versions_read_while_it_is_replaced_is_read_again(
    master, monkeypatch, not_ready
):
    """Process 0 replaces the list of versions at every publish: a reader that meets the
    put in flight ("not readable yet") reads it again until it is readable; one that stays
    unreadable past a short wait (its writer died while putting it) is a named error."""
    with (
        WeightPublisher(url(master, segment_mb=16)) as publisher,  # Holds the objects.
        WeightPuller(url(master, segment_mb=0, deadline_s=0.5)) as puller,
    ):
        publisher.publish({"w": jax.numpy.arange(8, dtype=np.float32)}, 1)
        store = puller.store
        real_call = store.call
        answers = {"left": 10**9 if not_ready == "always" else not_ready, "reads": 0}

        def call(fn, what):
            if what != "reading the list of weight versions":
                return real_call(fn, what)
            answers["reads"] += 1
            if answers["left"]:
                answers["left"] -= 1
                return -703
            return real_call(fn, what)

        monkeypatch.setattr(store, "call", call)
        if not_ready == "always":
            start = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"versions' returned -703: not readable"):
                store.versions()
            assert SETTLE_MAX_S <= time.monotonic() - start < 5 and answers["reads"] > 2
            # A waiter for a version not there yet goes on waiting, the list unreadable.
            with pytest.raises(VersionNotFoundError, match=r"present: unknown: .*-703"):
                store.read_manifest(2)
        else:
            assert store.versions() == [1] and answers["reads"] == 3
