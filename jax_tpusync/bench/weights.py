"""``weights``: weight sync from a trainer's layout to a sampler's, against the plain ways.

A Llama-like param pytree (bfloat16; embedding, per layer the attention projections with
grouped KV heads, a gated MLP and two norms, final norm and unembedding; ``--gb`` sets the
size by its number of layers, several sizes one after the other) sharded FSDP over 4
simulated CPU devices (rows) is moved, in one process with 8 devices, to

* ``fsdp4->tp2``: tensor parallel over 2 other devices (columns of the Q/K/V, gate and up
  projections and the embeddings, rows of the output and down projections), and
* ``fsdp4->fsdp4``: the same layout on 4 other devices,

(``--cases`` picks them) each way side by side:

* ``weights``: :class:`~jax_tpusync.weights.sync.WeightPublisher` ``publish`` then
  :class:`~jax_tpusync.weights.sync.WeightPuller` ``pull`` through a store in ``--dir``
  (``/dev/shm``); ``publish blocked`` is what the training step waits for;
* ``weights-nocopy``: the same with ``WeightPublisher(copy=False)`` (no snapshot copy:
  for a caller that does not donate or delete the params until the write ends);
* ``weights-mooncake``: ``weights`` through a Mooncake Store (``mooncake://...``: the
  publisher's shards in the segment it gives the pool, the puller's range reads over the
  transfer engine's TCP on loopback), added by ``--store mooncake://host:port?...`` (a
  running master), or by ``--remote mooncake`` (a master of the benchmark's own);
* ``gather+socket+put``: every array gathered to this process (``np.asarray``), its bytes
  sent through a plain socket (a Unix socket pair, the fastest plain socket on one host) to
  a receiving thread that reads them into fresh arrays, then ``jax.device_put`` with the
  target sharding: what a trainer process and a sampler process do without a store;
* ``gather+put``: the same without the socket (what a single-controller script that holds
  both meshes does; no two process groups can: a reference);
* ``jax.transfer``: ``jax.experimental.transfer`` (a transfer server, ``await_pull`` /
  ``pull``), where this jax has it; it moves whole shards in the same layout only (a
  reshard pull failed for small arrays and never returned for large ones here), so it runs
  in the same-layout case only;
* ``checkpoint``: ``np.save`` of every gathered array to ``--disk-dir``, then ``np.load``
  and ``device_put`` (the files are read back from the page cache just after writing);
* ``device_put``: ``jax.device_put(x, target)`` in this process, the in-process reshard
  no two process groups can use (a reference).

Each way is timed ``--repeats`` times after warm-up runs that are not timed, the ways
interleaved run by run (so that a load that comes and goes on a shared machine falls on all
of them alike): one warm-up run for a baseline, two for the weight store, which publishes a new version each run (its first
builds the plan and compiles the snapshot copy; its second is written into a new file,
since the store reuses a retired version's files and none is retired yet). The timed runs
are the steady state of a training loop: each reuses the plan (``plan ms`` is the build,
``plan reused`` whether the timed runs' plans came from the cache), and the files and
mappings of the versions two before it. For every way the bytes each destination device received are checked against
what its shards hold, and the result bitwise against the source.

The default output is a short table per case and size: each way's median and interquartile
range over its timed runs, its GB/s, its CPU time per run (this process's, all threads: the
work a way needs, whatever share of a busy machine it gets), and the weight store's fastest
row against the fastest of
the three baselines (gather + socket + device_put, jax.transfer, checkpoint) in words, with a note
where the difference is within the runs' spread (:mod:`jax_tpusync.bench.verdict`).
``--details`` prints every column instead (publish blocked, write, pull, plan).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jax_tpusync.bench import common, verdict

DEVICES = 8
CASES = ("fsdp4->tp2", "fsdp4->fsdp4")
# Copies of the params alive at once at most: the host copy and the source; per weight-store
# way (they run interleaved) its store (the version kept, the one written, a pooled file)
# and its staging buffers; the gathered and received copies, the checkpoint and its load.
PEAK_COPIES = 12
WARMUP_BASELINE = 1  # Untimed runs before a baseline's timed ones.
WARMUP_WEIGHTS = 2  # The weight store's: the plan and compile, then the first reused file.
D_MODEL, FFN, VOCAB, Q_HEADS, KV_HEADS, HEAD_DIM = 1024, 2816, 32000, 8, 2, 128

COLUMNS = [
    ("case", "case", "s"),
    ("method", "method", "s"),
    ("nbytes", "params", "bytes"),
    ("seconds", "seconds", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("cpu_ms", "CPU ms", ".1f"),
    ("publish_blocked_ms", "publish blocked ms", ".2f"),
    ("publish_write_s", "write s", ".3f"),
    ("pull_s", "pull s", ".3f"),
    ("plan_ms", "plan ms", ".2f"),
    ("plan_reused", "plan reused", ""),
    ("bytes_per_device_ok", "bytes/dest ok", ""),
    ("exact", "exact", ""),
    ("note", "note", "s"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``weights`` subcommand."""
    p = subparsers.add_parser(
        "weights",
        help="trainer-to-sampler weight sync (publish + pull) vs gather, transfer, checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--gb",
        type=_positive_float,
        nargs="+",
        default=[0.25],
        help="params size(s) in GB (1e9 bytes; bfloat16), by the number of layers; several "
        "sizes run one after the other in this process",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        default=list(CASES),
        choices=list(CASES),
        help="the layout pairs to run (default: both)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="timed runs per way (after 1 warm-up run, 2 for the weight store)",
    )
    p.add_argument(
        "--dir", default=None, help="the weight store's parent directory (default: /dev/shm)"
    )
    p.add_argument(
        "--disk-dir", default=None, help="the checkpoint baseline's directory (default: /var/tmp)"
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        choices=list(METHODS),
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="mooncake://HOST:PORT[?...]",
        help="a Mooncake weight store for the weights-mooncake rows (its master running)",
    )
    common.add_remote_arguments(
        p, "the weights-mooncake rows (a Mooncake weight store)", "on loopback"
    )
    p.add_argument(
        "--details",
        action="store_true",
        help="print every column (publish blocked, write, pull, plan) instead of the short summary",
    )
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and np.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return value


def layer_bytes() -> int:
    attn = D_MODEL * Q_HEADS * HEAD_DIM * 2 + D_MODEL * KV_HEADS * HEAD_DIM * 2
    return (attn + 3 * D_MODEL * FFN + 2 * D_MODEL) * 2


def params_bytes(layers: int) -> int:
    """Bytes of the pytree with ``layers`` layers."""
    return (2 * VOCAB * D_MODEL + D_MODEL) * 2 + layers * layer_bytes()


def layers_for(gb: float) -> int:
    """Layers that bring the pytree nearest ``gb`` GB (at least 1)."""
    fixed = (2 * VOCAB * D_MODEL + D_MODEL) * 2
    return max(1, round((gb * 1e9 - fixed) / layer_bytes()))


def host_params(layers: int, seed: int = 0) -> dict[str, Any]:
    """The Llama-like pytree on the host (bfloat16, random)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)

    return {
        "embed": w(VOCAB, D_MODEL),
        "layers": [
            {
                "attn_norm": w(D_MODEL),
                "wq": w(D_MODEL, Q_HEADS * HEAD_DIM),
                "wk": w(D_MODEL, KV_HEADS * HEAD_DIM),
                "wv": w(D_MODEL, KV_HEADS * HEAD_DIM),
                "wo": w(Q_HEADS * HEAD_DIM, D_MODEL),
                "mlp_norm": w(D_MODEL),
                "w_gate": w(D_MODEL, FFN),
                "w_up": w(D_MODEL, FFN),
                "w_down": w(FFN, D_MODEL),
            }
            for _ in range(layers)
        ],
        "final_norm": w(D_MODEL),
        "unembed": w(D_MODEL, VOCAB),
    }


def fsdp_spec(path: str, ndim: int):
    from jax.sharding import PartitionSpec as P

    return P("fsdp") if ndim == 2 else P()


def tp_spec(path: str, ndim: int):
    from jax.sharding import PartitionSpec as P

    if ndim != 2:
        return P()
    if any(name in path for name in ("wo", "w_down")):
        return P("tp", None)  # Row parallel.
    return P(None, "tp")  # Column parallel (and the embeddings by their model dimension).


def _tree_specs(params: Any, spec_for) -> Any:
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(jax.tree_util.keystr(p), np.ndim(x)), params
    )


def _device_bytes(tree: Any) -> dict[int, int]:
    import jax

    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return out


def _expected_device_bytes(host: Any, targets: Any) -> dict[int, int]:
    import jax

    out: dict[int, int] = {}
    for x, sharding in zip(jax.tree.leaves(host), jax.tree.leaves(targets), strict=True):
        nbytes = int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for d in sharding.addressable_devices:
            out[d.id] = out.get(d.id, 0) + nbytes
    return out


def _exact(pulled: Any, host: Any) -> bool:
    import jax

    for got, want in zip(jax.tree.leaves(pulled), jax.tree.leaves(host), strict=True):
        for s in got.addressable_shards:
            if not np.array_equal(
                np.asarray(s.data).view(np.uint16), want[s.index].view(np.uint16)
            ):
                return False
    return True


def _delete(tree: Any) -> None:
    import jax

    for x in jax.tree.leaves(tree):
        x.delete()


def _ready(tree: Any) -> Any:
    import jax

    return jax.block_until_ready(tree)


def method_weights(
    ctx: dict, case: str, source: Any, targets: Any, *, copy: bool = True, mooncake: bool = False
) -> Iterator:
    from jax_tpusync.weights.sync import WeightPublisher, WeightPuller

    store = tempfile.mkdtemp(prefix="bench-weights-", dir=ctx["dir"])
    if mooncake:  # Each run a namespace of its own; the puller gives the pool no memory.
        namespace = f"bench-{case.replace('>', '')}-{os.getpid()}"
        sep = "&" if "?" in ctx["store"] else "?"
        pub_store = f"{ctx['store']}{sep}namespace={namespace}"
        if "segment_mb=" not in ctx["store"]:  # Two versions of the params (keep=1 + 1).
            pub_store += f"&segment_mb={max(16, -(-3 * ctx['nbytes'] // (1 << 20)))}"
        pull_store = f"{ctx['store']}{sep}namespace={namespace}&segment_mb=0"
    else:
        pub_store = pull_store = store
    try:
        publisher = WeightPublisher(pub_store, keep=1, copy=copy)
        puller = WeightPuller(pull_store, timeout_s=600)
        runs, result = [], None
        plan_ms, reused = None, []
        total = WARMUP_WEIGHTS + ctx["repeats"]
        for version in range(total):
            cpu_start = time.process_time()
            start = time.perf_counter()
            publisher.publish(source, version)
            blocked = time.perf_counter() - start
            write_s = publisher.wait().write_seconds
            pull_start = time.perf_counter()
            result = _ready(puller.pull(targets, version))
            end = time.perf_counter()
            if version == 0:
                plan_ms = puller.stats.plan_seconds * 1e3
            else:
                reused.append(puller.stats.plan_cached)
            runs.append(
                (
                    end - start,
                    blocked,
                    end - pull_start,
                    write_s,
                    puller.stats.read_seconds,
                    puller.stats.put_seconds,
                    time.process_time() - cpu_start,
                )
            )
            if version < total - 1:  # The last one is checked below.
                _delete(result)
            yield  # The other ways run their next run now (see run_interleaved).
        # Bytes the Mooncake store moved per pull (the same every run).
        fetched = getattr(puller.store, "bytes_fetched", None)
        fetched = None if fetched is None else fetched // (WARMUP_WEIGHTS + ctx["repeats"])
        puller.close()
        publisher.close()
        ok = puller.stats.device_bytes == _device_bytes(result) == ctx["expected"]
        exact = _exact(result, ctx["host"])
        _delete(result)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    timed = runs[WARMUP_WEIGHTS:]
    return {
        "seconds": statistics.median(r[0] for r in timed),
        "samples_s": [r[0] for r in timed],
        "cpu_ms": statistics.median(r[6] for r in timed) * 1e3,
        "publish_blocked_ms": statistics.median(r[1] for r in timed) * 1e3,
        "pull_s": statistics.median(r[2] for r in timed),
        "publish_write_s": statistics.median(r[3] for r in timed),
        "pull_read_s": statistics.median(r[4] for r in timed),
        "pull_put_s": statistics.median(r[5] for r in timed),
        "plan_ms": plan_ms,
        "plan_reused": all(reused) if reused else None,
        "bytes_per_device_ok": ok,
        "exact": exact,
        "first_publish_blocked_ms": runs[0][1] * 1e3,
        "bytes_fetched": fetched,
        "note": (
            "publish + pull (Mooncake store, TCP loopback)"
            if mooncake
            else "publish + pull (store in RAM)"
            if copy
            else "publish(copy=False) + pull"
        ),
    }


def method_weights_no_copy(ctx: dict, case: str, source: Any, targets: Any) -> Iterator:
    return (yield from method_weights(ctx, case, source, targets, copy=False))


def method_weights_mooncake(ctx: dict, case: str, source: Any, targets: Any) -> Iterator:
    return (yield from method_weights(ctx, case, source, targets, mooncake=True))


def _timed(ctx: dict, move) -> Iterator:
    runs, cpu, result = [], [], None
    total = WARMUP_BASELINE + ctx["repeats"]
    for i in range(total):
        cpu_start = time.process_time()
        start = time.perf_counter()
        result = _ready(move())
        runs.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        if i < total - 1:  # The last one is checked below.
            _delete(result)
        yield
    ok = _device_bytes(result) == ctx["expected"]
    exact = _exact(result, ctx["host"])
    _delete(result)
    runs = runs[WARMUP_BASELINE:]
    return {
        "seconds": statistics.median(runs),
        "samples_s": runs,
        "cpu_ms": statistics.median(cpu[WARMUP_BASELINE:]) * 1e3,
        "bytes_per_device_ok": ok,
        "exact": exact,
    }


def method_gather_put(ctx: dict, case: str, source: Any, targets: Any) -> dict:
    import jax

    def move():
        host = jax.tree.map(np.asarray, source)
        return jax.device_put(host, targets)

    return {**(yield from _timed(ctx, move)), "note": "gather to this process, device_put"}


def method_gather_socket_put(ctx: dict, case: str, source: Any, targets: Any) -> dict:
    """Gathers every array to this process, sends its bytes through a plain socket (a Unix
    socket pair: the fastest plain socket on one host) to a receiving thread that reads
    them into fresh arrays, then ``device_put`` with the target sharding: what a trainer
    process and a sampler process do without a store."""
    import jax

    leaves, treedef = jax.tree.flatten(source)
    target_leaves = jax.tree.leaves(targets)

    def move():
        sender, receiver = socket.socketpair()
        received: list[np.ndarray] = []
        failure: list[BaseException] = []

        def receive():
            try:
                for x in leaves:
                    buf = np.empty(x.shape, x.dtype)
                    view = memoryview(buf.reshape(-1).view(np.uint8))
                    got = 0
                    while got < view.nbytes:
                        n = receiver.recv_into(view[got:])
                        if n == 0:
                            raise ConnectionError("the sender closed early")
                        got += n
                    received.append(buf)
            except OSError as e:  # Reported below; the closed socket stops the sender.
                failure.append(e)
                receiver.close()

        thread = threading.Thread(target=receive, name="bench-weights-receiver")
        thread.start()
        try:
            for x in leaves:
                sender.sendall(memoryview(np.asarray(x).reshape(-1).view(np.uint8)))
        finally:
            thread.join()
            sender.close()
            receiver.close()
        if failure:
            raise failure[0]
        return jax.tree.unflatten(treedef, jax.device_put(received, target_leaves))

    timed = yield from _timed(ctx, move)
    return {**timed, "note": "gather, Unix socket to a receiver thread, device_put"}


def method_transfer(ctx: dict, case: str, source: Any, targets: Any) -> dict:
    import jax

    try:
        from jax.experimental import transfer
    except ImportError as e:
        return {"note": f"not in this jax: {e}"}
    for x, target in zip(jax.tree.leaves(source), jax.tree.leaves(targets), strict=True):
        if x.sharding.shard_shape(x.shape) != target.shard_shape(x.shape):
            # Tried: a reshard pull fails (small arrays) or never returns (large ones).
            return {"note": "not run: moves whole shards in the same layout only"}
    client = jax.devices()[0].client
    server = transfer.start_transfer_server(client)
    connection = server.connect(server.address())
    leaves = jax.tree.leaves(source)
    structs = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(leaves, jax.tree.leaves(targets), strict=True)
    ]
    uuid = [0]

    def move():
        uuid[0] += 1
        server.await_pull(uuid[0], leaves)
        return connection.pull(uuid[0], structs)

    return {**(yield from _timed(ctx, move)), "note": "same layout only"}


def method_checkpoint(ctx: dict, case: str, source: Any, targets: Any) -> dict:
    import jax

    directory = tempfile.mkdtemp(prefix="bench-weights-ckpt-", dir=ctx["disk_dir"])
    leaves, treedef = jax.tree.flatten(source)
    target_leaves = jax.tree.leaves(targets)

    def move():
        # np.save writes bfloat16 as raw void: save its bits, view them back on load.
        for i, x in enumerate(leaves):
            np.save(os.path.join(directory, f"{i}.npy"), np.asarray(x).view(np.uint16))
        loaded = [
            np.load(os.path.join(directory, f"{i}.npy")).view(x.dtype) for i, x in enumerate(leaves)
        ]
        return jax.tree.unflatten(treedef, jax.device_put(loaded, target_leaves))

    try:
        timed = yield from _timed(ctx, move)
        return {**timed, "note": "np.save + np.load (page cache), device_put"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def method_device_put(ctx: dict, case: str, source: Any, targets: Any) -> dict:
    import jax

    timed = yield from _timed(ctx, lambda: jax.device_put(source, targets))
    return {**timed, "note": "one process only (reference)"}


METHODS = {
    "weights": method_weights,
    "weights-nocopy": method_weights_no_copy,
    "weights-mooncake": method_weights_mooncake,
    "gather+socket+put": method_gather_socket_put,
    "gather+put": method_gather_put,
    "jax.transfer": method_transfer,
    "checkpoint": method_checkpoint,
    "device_put": method_device_put,
}
# Every way but the one that needs a Mooncake store (added by --store or --remote), and
# weights-nocopy (on the CPU backend copy=True writes into the store in publish, which
# copy=False does in the background: the same bytes moved; ask for it by --methods).
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("weights-mooncake", "weights-nocopy"))


# The rows of the summary: the weight store's ways, then the three baselines it is
# compared with, then the one-process reference (not a baseline: no second process).
OURS = ("weights", "weights-nocopy", "weights-mooncake")
BASELINES = ("gather+socket+put", "jax.transfer", "checkpoint")
LABELS = {
    "weights": "weight store (publish + pull)",
    "weights-nocopy": "weight store, copy=False",
    "weights-mooncake": "weight store on Mooncake",
    "gather+socket+put": "gather + socket + device_put",
    "gather+put": "gather + device_put, one process (reference)",
    "jax.transfer": "jax.experimental.transfer",
    "checkpoint": "checkpoint (np.save/np.load)",
    "device_put": "in-process device_put (reference)",
}


def run_interleaved(ways: dict[str, Iterator]) -> dict[str, dict]:
    """Runs the ways round by round (each way's next run, then the next way's), so that a
    load that comes and goes on a shared machine falls on all of them alike; returns each
    way's result (a way's generator yields after each of its runs and returns its row)."""
    results: dict[str, dict] = {}
    active = dict(ways)
    while active:
        for name, way in list(active.items()):
            try:
                next(way)
            except StopIteration as done:
                results[name] = done.value
                del active[name]
    return results


def run(args: argparse.Namespace) -> list[dict]:
    with contextlib.ExitStack() as stack:
        rows = _run(args, stack)
    if not args.details:
        args.columns = None  # The short summary instead of the developer's table.
        print()
        print(summary(rows))
    return rows


def _spread(row: dict) -> verdict.Spread | None:
    samples = row.get("samples_s")
    return verdict.Spread.of([s * 1e3 for s in samples]) if samples else None


def summary(rows: list[dict]) -> str:
    """Per case: each way's median and IQR, its GB/s, and the weight store's fastest way
    against the fastest baseline in words (with the spread)."""
    lines = []
    for case, nbytes in dict.fromkeys((r["case"], r["nbytes"]) for r in rows):
        in_case = {r["method"]: r for r in rows if (r["case"], r["nbytes"]) == (case, nbytes)}
        any_row = next(iter(in_case.values()))
        lines.append(
            f"{case}: {any_row['nbytes'] / 1e6:.0f} MB of bf16 params ({any_row['layers']} "
            f"layers), publish + pull end to end"
        )
        # CPU ms: this process's CPU time per run (all threads: the way's own and JAX's), the
        # work a way needs whatever share of a busy host it gets.
        cells = [("way", "median ms", "IQR ms", "GB/s", "CPU ms", "runs")]
        for name, row in in_case.items():
            spread = _spread(row)
            if spread is None:
                cells.append((LABELS.get(name, name), row.get("note", "not run"), "", "", "", ""))
                continue
            cells.append(
                (
                    LABELS.get(name, name),
                    f"{spread.median:.1f}",
                    f"{spread.q1:.1f}-{spread.q3:.1f}",
                    f"{row['nbytes'] / spread.median / 1e6:.2f}",
                    f"{row['cpu_ms']:.0f}",
                    str(spread.count),
                )
            )
        columns = len(cells[0])
        widths = [max(len(c[i]) for c in cells if c[2] or i == 0) for i in range(columns)]
        for c in cells:
            if not c[2]:  # A way that did not run: its note across the columns.
                lines.append(f"  {c[0].ljust(widths[0])}  {c[1]}")
                continue
            lines.append(
                "  "
                + "  ".join(
                    c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i])
                    for i in range(columns)
                )
            )
        ours = {n: s for n in OURS if n in in_case and (s := _spread(in_case[n]))}
        others = {n: s for n in BASELINES if n in in_case and (s := _spread(in_case[n]))}
        if ours and others:
            best_ours = min(ours, key=lambda n: ours[n].median)
            best_other = min(others, key=lambda n: others[n].median)
            lines.append(
                f"  {LABELS[best_ours]} against the fastest baseline: "
                f"{verdict.compare(ours[best_ours], others[best_other], LABELS[best_other])}"
            )
        checked = [r for r in in_case.values() if r.get("exact") is not None]
        bad = [LABELS.get(r["method"], r["method"]) for r in checked if not r["exact"]]
        bad += [
            f"{LABELS.get(r['method'], r['method'])} (bytes per device)"
            for r in checked
            if not r["bytes_per_device_ok"]
        ]
        lines.append(
            "  every way moved the params bitwise, each destination device exactly its shards' "
            "bytes"
            if not bad
            else f"  MISMATCH: {', '.join(bad)}"
        )
        plan = in_case.get("weights") or next((in_case[n] for n in OURS if n in in_case), None)
        if plan is not None and plan.get("plan_ms") is not None:
            lines.append(
                f"  plan: built once in {plan['plan_ms']:.1f} ms, "
                + ("reused by every timed pull" if plan.get("plan_reused") else "rebuilt")
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def _mooncake_store(args: argparse.Namespace, stack: contextlib.ExitStack) -> str | None:
    """The ``mooncake://`` store of the weights-mooncake rows: ``--store``, else one on
    ``--remote-master`` or a master of this run's own (``--remote mooncake``); None."""
    from jax_tpusync.bench import mooncake_master

    if args.store is not None:
        if not args.store.startswith("mooncake://"):
            raise SystemExit(f"--store {args.store!r}: expected mooncake://host:port[?...]")
        return args.store
    master = mooncake_master.for_run(args, stack)
    return None if master is None else f"mooncake://{master}"


def _run(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[dict]:
    methods = list(args.methods)
    store = _mooncake_store(args, stack)
    if store is not None and "weights-mooncake" not in methods:
        methods.append("weights-mooncake")
    if store is None and "weights-mooncake" in methods:
        raise SystemExit(
            "weights-mooncake needs --store mooncake://host:port, --remote-master or --remote "
            "mooncake"
        )
    # Sizes that come to the same number of layers run once.
    layer_counts = list(dict.fromkeys(layers_for(gb) for gb in args.gb))
    shown = " ".join(f"{gb:g}" for gb in args.gb)
    # At most PEAK_COPIES copies of the params at once (see there), one size at a time.
    need = PEAK_COPIES * max(params_bytes(layers) for layers in layer_counts)
    if need > common.available_ram_bytes():
        raise SystemExit(
            f"--gb {shown} needs about {need / 1e9:.1f} GB of memory ({PEAK_COPIES} "
            f"copies of {need / PEAK_COPIES / 1e9:.2f} GB), "
            f"{common.available_ram_bytes() / 1e9:.1f} GB is available"
        )
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={DEVICES}".strip()
    import jax
    from jax.sharding import Mesh, NamedSharding

    devices = jax.devices()
    if len(devices) < DEVICES:
        raise SystemExit(
            f"weights needs {DEVICES} devices, JAX has {len(devices)} (it started before this "
            f"bench set {flag}={DEVICES}; set XLA_FLAGS yourself)"
        )
    train_mesh = Mesh(np.asarray(devices[:4]), ("fsdp",))
    meshes = {
        "fsdp4->tp2": (Mesh(np.asarray(devices[4:6]), ("tp",)), tp_spec),
        "fsdp4->fsdp4": (Mesh(np.asarray(devices[4:8]), ("fsdp",)), fsdp_spec),
    }
    rows = []
    for layers in layer_counts:
        nbytes = params_bytes(layers)
        host = host_params(layers)
        assert nbytes == sum(x.nbytes for x in jax.tree.leaves(host))
        source = jax.device_put(
            host,
            jax.tree.map(lambda s: NamedSharding(train_mesh, s), _tree_specs(host, fsdp_spec)),
        )
        ctx = {
            "repeats": args.repeats,
            "dir": args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None),
            "disk_dir": args.disk_dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None),
            "host": host,
            "store": store,
            "nbytes": nbytes,
        }
        for case in (c for c in CASES if c in args.cases):
            mesh, spec_for = meshes[case]
            targets = jax.tree.map(
                lambda s, m=mesh: NamedSharding(m, s), _tree_specs(host, spec_for)
            )
            ctx["expected"] = _expected_device_bytes(host, targets)
            measured = run_interleaved(
                {name: METHODS[name](ctx, case, source, targets) for name in methods}
            )
            for name in methods:
                row = {"case": case, "method": name, "nbytes": nbytes, "layers": layers}
                row.update(measured[name])
                if row.get("seconds"):
                    row["gbps"] = nbytes / row["seconds"] / 1e9
                rows.append(row)
                took = f"{row['seconds']:.3f} s" if row.get("seconds") else "-"
                print(
                    f"{nbytes / 1e6:6.0f} MB {case:>13} {name:>17}: {took} {row.get('note', '')}",
                    flush=True,
                )
        _delete(source)
        del host, source
    return rows
