"""``pd``: time to move one sequence's KV from a prefill process to a decode process.

For each shape (tokens x layers x KV heads x head size, bfloat16), a prefill process
(started with ``spawn``) holds the sequence's KV in a host-tier cache; this process, the
decode side, receives it into a slot of its own cache three ways, side by side:

* ``pd``: :class:`jax_tpusync.pd.transfer.KVReceiver` / ``KVSender``: one-sided writes
  from the prefill pool into the decode pool over a Mooncake TransferEngine (TCP), with
  the control round trip (request, completion message) included;
* ``pd-pool``: the same transfer into a :class:`~jax_tpusync.HostPoolKVCache` (the TPU
  data path), through its registered staging buffer and then into the state's pool
  between steps (what the decode side of a TPU host does), with ``--host-pool`` (default);
* ``socket``: the same bytes over one plain TCP socket, ``sendall`` from the prefill
  pool and ``recv_into`` the decode pool (zero copy in Python on both ends);
* ``recompute``: prefilling the sequence here instead (the benchmarks' tiny decoder of that
  KV shape, chunked, on this machine's backend), with ``--recompute``.

Over loopback by default. ``--prefill-netns NS --prefill-host A --decode-host B``, run
inside another network namespace (``ip netns exec NS2 python -m jax_tpusync.bench pd
...``), puts the prefill process in namespace ``NS`` (joined before it opens a socket; needs
root): the two sides then talk over whatever links the namespaces, e.g. a veth pair.

The first P/D transfer (right after the engines' handshake) is timed apart; then each way
runs ``--repeats`` times, interleaved, and the median is kept. The first transfer of each
shape is checked byte-exact (a checksum of the slot's rows on both sides).

The checksum every P/D transfer carries (xxh3-64 of the bytes written, per head range) is
timed within the same transfers: on the decode side (hashing the bytes that landed, before
the admission: on the transfer's path, part of ``pd s``) and on the prefill side (hashing
the bytes it writes while its writes are in flight); the median of each, and the decode
side's share of the transfer, per shape.

Output: by default a short summary per shape: the library's transfer against the plain
socket (median and interquartile range of the repeats, in words, "within noise" where the
medians differ by no more than the wider IQR; see :mod:`jax_tpusync.bench.verdict`), the
first transfer apart, and what recomputing the prefill here took where ``--recompute``
timed it; ``--details`` prints the developer's table instead. Progress goes to stderr.
The defaults take about a minute on two cores.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import socket
import statistics
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, verdict

# name: (tokens, layers, kv heads, head size)
SHAPES = {
    "readme-8k": (8192, 4, 8, 64),
    "readme-32k": (32768, 4, 8, 64),
    "8b-8k": (8192, 8, 8, 128),
}

COLUMNS = [
    ("shape", "shape", "s"),
    ("nbytes", "KV", "bytes"),
    ("pd_first_s", "pd first s", ".3f"),
    ("pd_s", "pd s", ".3f"),
    ("socket_s", "socket s", ".3f"),
    ("pd_gbps", "pd GB/s", ".2f"),
    ("socket_gbps", "socket GB/s", ".2f"),
    ("pool_s", "pd-pool s", ".3f"),
    ("pd_over_socket", "pd/socket rate", ".2f"),
    ("checksum_receive_s", "checksum rx s", ".4f"),
    ("checksum_send_s", "checksum tx s", ".4f"),
    ("checksum_share", "checksum/pd", ".1%"),
    ("recompute_s", "recompute s", ".2f"),
    ("byte_exact", "exact", ""),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``pd`` subcommand."""
    p = subparsers.add_parser(
        "pd",
        help="prefill-to-decode KV transfer (Mooncake TransferEngine) vs a plain socket",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        type=_shape,
        default=list(SHAPES),
        help=f"named shapes ({', '.join(SHAPES)}) or TOKENSxLAYERSxHEADSxDIM",
    )
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-bytes", type=common.parse_bytes, default=64 * common.MiB)
    p.add_argument("--piece-bytes", type=common.parse_bytes, default=4 * common.MiB)
    p.add_argument("--deadline-s", type=float, default=120.0)
    p.add_argument(
        "--recompute",
        nargs="*",
        type=_shape,
        default=["readme-8k"],
        help="shapes whose prefill is also timed here (slow on a CPU)",
    )
    p.add_argument("--chunk", type=int, default=1024, help="recompute prefill chunk tokens")
    p.add_argument("--prefill-host", default="127.0.0.1", help="the prefill side's address")
    p.add_argument("--decode-host", default="127.0.0.1", help="this (decode) side's address")
    p.add_argument(
        "--prefill-netns",
        default=None,
        metavar="NAME",
        help="network namespace (/var/run/netns/NAME) the prefill process joins",
    )
    p.add_argument(
        "--host-pool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also receive into a host-pool cache (the TPU data path), side by side",
    )
    p.add_argument("--seed", type=int, default=0)
    common.add_details_argument(p, "every shape's row (first transfer, rates, recompute)")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def _shape(text: str) -> str:
    """A shape's name, or ``TOKENSxLAYERSxHEADSxDIM`` (added to SHAPES under that name)."""
    if text in SHAPES:
        return text
    try:
        dims = tuple(int(v) for v in text.split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a shape ({', '.join(SHAPES)}) nor TOKENSxLAYERSxHEADSxDIM"
        )
    SHAPES[text] = dims
    return text


def _cache(
    tokens: int, layers: int, heads: int, dim: int, block_tokens: int, pool: bool = False, **kw: Any
):
    """A one-slot cache of the shape: an engine cache on a host tier, or a host-pool one."""
    import jax.numpy as jnp

    import jax_tpusync as tps

    return (tps.HostPoolKVCache if pool else tps.OffloadedKVCache)(
        num_layers=layers,
        batch=1,
        max_len=tokens,
        num_kv_heads=heads,
        head_dim=dim,
        dtype=jnp.bfloat16,
        block_tokens=block_tokens,
        model_id="bench-pd",
        **kw,
    )


def _pool_view(cache: Any, address: int, nbytes: int) -> np.ndarray:
    """A uint8 view of ``nbytes`` of ``cache``'s host pool at ``address``."""
    base, size = cache.engine.mapped_memory(cache.tier)
    assert base <= address and address + nbytes <= base + size
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _slot_checksum(cache: Any, state: Any, n: int) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    for layer in range(cache.spec.num_layers):
        for rows in cache.read(state, layer, 0, 0, n):
            h.update(np.ascontiguousarray(np.asarray(rows)).view(np.uint8))
    return h.intdigest()


def prefill_process(commands: Any, replies: Any, args: dict) -> None:
    """The prefill side: per shape, a cache holding random KV in slot 0, a KVSender and a
    plain socket server; serves what ``commands`` asks for."""
    os.chdir("/")
    if args["netns"]:
        common.join_netns(args["netns"])
    from jax_tpusync.pd.pools import pool_runs
    from jax_tpusync.pd.transfer import KVSender, recv_message

    host = args["host"]

    while True:
        command = commands.get()
        if command is None:
            return
        tokens, layers, heads, dim = command
        cache = _cache(tokens, layers, heads, dim, args["block_tokens"])
        state = cache.init(admit=False)
        state, _ = cache.admit(state, 0, max_tokens=tokens)
        rng = np.random.default_rng(args["seed"])
        for layer in range(layers):
            k = rng.standard_normal((tokens, heads, dim), np.float32).astype(cache.spec.dtype)
            state = cache.load(state, layer, k, -k, slot=0)
        state = cache.drain(state)
        checksum = _slot_checksum(cache, state, tokens)
        # The slot's runs in this pool, region after region (what the socket sends).
        runs = pool_runs(cache, cache.engine.mapped_memory(cache.tier)[0], 0, 0, tokens)
        listener = socket.create_server((host, 0))
        with KVSender(
            cache,
            host=host,
            deadline_s=args["deadline_s"],
            batch_bytes=args["batch_bytes"],
            piece_bytes=args["piece_bytes"],
        ) as sender:
            replies.put(
                dict(
                    pd=sender.address,
                    socket="%s:%d" % (host, listener.getsockname()[1]),
                    checksum=checksum,
                )
            )
            while (what := commands.get()) != "next":
                if what == "pd":
                    request = sender.accept(timeout=args["deadline_s"])
                    state, sent = sender.send(request, state, 0)
                    replies.put(sent.checksum_s)  # What hashing the bytes written took.
                else:
                    listener.settimeout(args["deadline_s"])
                    conn, _ = listener.accept()
                    with conn:
                        recv_message(conn, time.monotonic() + args["deadline_s"])
                        for region in runs:
                            for address, nbytes in region:
                                conn.sendall(_pool_view(cache, address, nbytes))
        listener.close()
        cache.close(state)


def run(args: argparse.Namespace) -> list[dict]:
    import multiprocessing

    from jax_tpusync.pd.transfer import KVReceiver, send_message

    common.require_netns("--prefill-netns", args.prefill_netns)
    ctx = multiprocessing.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    child_args = dict(
        block_tokens=args.block_tokens,
        seed=args.seed,
        deadline_s=args.deadline_s,
        batch_bytes=args.batch_bytes,
        piece_bytes=args.piece_bytes,
        host=args.prefill_host,
        netns=args.prefill_netns,
    )
    child = common.start_child(ctx, prefill_process, commands, replies, child_args)
    results = []
    try:
        for name in args.shapes:
            common.progress(f"pd: {name}: the prefill side fills its cache ...")
            tokens, layers, heads, dim = SHAPES[name]
            commands.put(SHAPES[name])
            peer = common.child_reply(replies, child, 600, "the prefill process")
            cache = _cache(tokens, layers, heads, dim, args.block_tokens)
            state = cache.init(admit=False)
            ids = np.arange(tokens) % 1000
            row = dict(shape=name, tokens=tokens, layers=layers, kv_heads=heads, head_dim=dim)
            row["link"] = (
                "loopback"
                if args.prefill_netns is None
                else f"{args.decode_host} -> netns {args.prefill_netns} {args.prefill_host}"
            )
            # The checksum's seconds of every timed P/D transfer into the engine cache.
            checksums: dict[str, list[float]] = {"receive": [], "send": []}
            with KVReceiver(cache, host=args.decode_host, deadline_s=args.deadline_s) as rx:
                calls = 0
                pool_cache = pool_state = pool_rx = None
                if args.host_pool:  # On the same TransferEngine (one per process).
                    pool_cache = _cache(tokens, layers, heads, dim, args.block_tokens, pool=True)
                    pool_state = pool_cache.init(admit=False)
                    pool_rx = KVReceiver(
                        pool_cache,
                        transfer_engine=rx.engine,
                        session=rx.session,
                        deadline_s=args.deadline_s,
                    )

                def pd() -> float:
                    nonlocal state, calls
                    commands.put("pd")
                    # Other ids each call: the decode cache's prefix index (the released
                    # slot's blocks) must not hold a prefix, or only the rest would be sent.
                    calls += 1
                    state, got = rx.receive(
                        state, 0, ids + 1000 * calls, prefill=peer["pd"], max_tokens=tokens
                    )
                    assert got.cached == 0 and got.nbytes == row.setdefault("nbytes", got.nbytes)
                    checksums["receive"].append(got.checksum_s)
                    checksums["send"].append(
                        common.child_reply(replies, child, args.deadline_s, "the prefill process")
                    )
                    return got.seconds

                def pd_pool() -> float:
                    nonlocal pool_state, calls
                    commands.put("pd")
                    calls += 1
                    begin = time.perf_counter()
                    pool_state, got = pool_rx.receive(
                        pool_state, 0, ids + 1000 * calls, prefill=peer["pd"], max_tokens=tokens
                    )
                    pool_state.pool.block_until_ready()  # The rows are in the pool.
                    assert got.cached == 0 and got.nbytes == row["nbytes"]
                    seconds = time.perf_counter() - begin
                    common.child_reply(replies, child, args.deadline_s, "the prefill process")
                    return seconds

                def sock() -> float:
                    nonlocal state
                    state, _ = cache.admit(state, 0, max_tokens=tokens)
                    runs = rx.destination_runs(0, 0, tokens)
                    views = [_pool_view(cache, a, n) for region in runs for a, n in region]
                    commands.put("socket")
                    begin = time.perf_counter()
                    host, port = peer["socket"].split(":")
                    with socket.create_connection((host, int(port)), timeout=args.deadline_s) as s:
                        send_message(s, dict(tokens=tokens), time.monotonic() + args.deadline_s)
                        for view in views:
                            got = 0
                            while got < view.size:
                                got += s.recv_into(memoryview(view)[got:])
                    return time.perf_counter() - begin

                def release() -> None:
                    nonlocal state
                    state = cache.release(state, 0)

                def release_pool() -> None:
                    nonlocal pool_state
                    pool_state = pool_cache.release(pool_state, 0)

                row["pd_first_s"] = pd()
                for way in checksums.values():  # The first transfer is timed apart.
                    way.clear()
                row["byte_exact"] = _slot_checksum(cache, state, tokens) == peer["checksum"]
                release()
                ways = [("pd", pd, release), ("socket", sock, release)]
                if args.host_pool:
                    pool_s = pd_pool()  # Maps the staging buffer, compiles the pool's writes.
                    exact = _slot_checksum(pool_cache, pool_state, tokens) == peer["checksum"]
                    row["byte_exact"] = row["byte_exact"] and exact
                    common.progress(f"pd: {name}: first receive into the host pool {pool_s:.3f} s")
                    release_pool()
                    ways.insert(1, ("pool", pd_pool, release_pool))
                times: dict[str, list[float]] = {way: [] for way, _, _ in ways}
                for _ in range(args.repeats):
                    for way, fn, done in ways:
                        times[way].append(fn())
                        done()
                if pool_rx is not None:
                    pool_rx.close()
                    pool_cache.close(pool_state)
            commands.put("next")
            cache.close(state)
            row["pd_s"] = statistics.median(times["pd"])
            row["socket_s"] = statistics.median(times["socket"])
            row["pd_gbps"] = row["nbytes"] / row["pd_s"] / 1e9
            row["socket_gbps"] = row["nbytes"] / row["socket_s"] / 1e9
            row["pd_over_socket"] = row["pd_gbps"] / row["socket_gbps"]
            row["pd_all_s"] = times["pd"]
            row["socket_all_s"] = times["socket"]
            # Side by side with pd_s: the same transfers (repeats after the first).
            row["checksum_receive_s"] = statistics.median(checksums["receive"])
            row["checksum_send_s"] = statistics.median(checksums["send"])
            row["checksum_share"] = row["checksum_receive_s"] / row["pd_s"]
            row["checksum_gbps"] = row["nbytes"] / row["checksum_receive_s"] / 1e9
            row["checksum_receive_all_s"] = checksums["receive"]
            row["checksum_send_all_s"] = checksums["send"]
            if "pool" in times:
                row["pool_s"] = statistics.median(times["pool"])
                row["pool_all_s"] = times["pool"]
            row["recompute_s"] = (
                _recompute(args, tokens, layers, heads, dim) if name in args.recompute else None
            )
            common.progress(
                f"{name}: {common.format_bytes(row['nbytes'])} pd {row['pd_s']:.3f} s, socket "
                f"{row['socket_s']:.3f} s ({row['pd_over_socket']:.2f}x the socket's rate)"
            )
            results.append(row)
    finally:
        commands.put(None)
        child.join(30)
        if child.is_alive():
            child.kill()
    common.summary_or_details(args, summary(results))
    return results


def summary(rows: list[dict[str, Any]]) -> str:
    """Per shape, in words: the library's transfer against the plain socket, the first
    transfer apart, and the recompute where it ran (see the module)."""
    if not rows:
        return "P/D transfer: no shape ran"
    table, words = [], []
    for r in rows:
        pd = verdict.Spread.of([t * 1e3 for t in r["pd_all_s"]])
        sock = verdict.Spread.of([t * 1e3 for t in r["socket_all_s"]])
        label = f"{r['shape']} ({common.format_bytes(r['nbytes'])})"
        table += [(f"{label}: library (KVSender)", pd), (f"{label}: plain TCP socket", sock)]
        pool = verdict.Spread.of([t * 1e3 for t in r["pool_all_s"]]) if "pool_all_s" in r else None
        if pool is not None:
            table.insert(-1, (f"{label}: library into a host pool", pool))
        line = (
            f"  {r['shape']}: the library's transfer is "
            f"{verdict.compare(pd, sock, 'a plain TCP socket')}; its first (after the "
            f"engines' handshake) took {r['pd_first_s'] * 1e3:.0f} ms; "
            f"{'byte-exact' if r['byte_exact'] else 'NOT byte-exact'}"
        )
        if pool is not None:
            line += (
                f"; into a host pool (the TPU data path: staging buffer, then the pool) it is "
                f"{verdict.compare(pool, pd, 'into an engine cache')}"
            )
        if r.get("checksum_receive_s") is not None:
            line += (
                f"; its checksum (xxh3-64 of the bytes) took "
                f"{r['checksum_receive_s'] * 1e3:.2f} ms on the decode side before the "
                f"admission ({r['checksum_share']:.1%} of the transfer's "
                f"{r['pd_s'] * 1e3:.1f} ms, {r['checksum_gbps']:.1f} GB/s) and "
                f"{r['checksum_send_s'] * 1e3:.2f} ms on the prefill side, while its writes "
                f"were in flight"
            )
        if r.get("recompute_s") is not None:
            line += (
                f"; recomputing the prefill here took {r['recompute_s']:.2f} s "
                f"({r['recompute_s'] * 1e3 / pd.median:.0f}x the transfer)"
            )
        words.append(line)
    heading = (
        f"P/D transfer over {rows[0]['link']}: one sequence's KV (bf16) from a prefill "
        "process into this one's cache"
    )
    return "\n".join([heading, verdict.table(table, "transfer"), *words])


def _recompute(args, tokens: int, layers: int, heads: int, dim: int) -> float:
    """Seconds to prefill ``tokens`` here: the tiny decoder with this KV shape, chunked."""
    import jax

    from jax_tpusync.bench import tiny_decoder

    d = heads * dim
    cfg = tiny_decoder.Decoder(
        layers=layers, d_model=d, q_heads=heads, kv_heads=heads, head_dim=dim, ffn=2 * d
    )
    params = tiny_decoder.init_params(cfg, args.seed)
    step = jax.jit(functools.partial(tiny_decoder.forward, cfg), donate_argnums=(2,))
    cache = _cache(tokens, layers, heads, dim, args.block_tokens)
    state = cache.init(admit=False)
    ids = (np.arange(tokens) % cfg.vocab).astype(np.int32)
    chunk = min(args.chunk, tokens)
    state, _ = cache.admit(state, 0, max_tokens=tokens)  # Compiles the chunk shape.
    logits, state = step(params, ids[None, :chunk], state)
    jax.block_until_ready(logits)
    state = cache.release(state, 0)
    state, _ = cache.admit(state, 0, max_tokens=tokens)
    begin = time.perf_counter()
    for lo, n in common.chunks(tokens, chunk):
        logits, state = step(params, ids[None, lo : lo + n], state)
    jax.block_until_ready(logits)
    seconds = time.perf_counter() - begin
    cache.close(state)
    return seconds
