"""``prefix``: time to first token with a shared prefix cached, against a full prefill.

Output: by default a short summary per tier: the TTFT with the prefix cached (and after a
restart, and from the remote level where one ran) against a full prefill with nothing
cached, and the decode step on the shared blocks against private ones, each as the median
and interquartile range of its samples, in words ("9.7x faster than a full prefill") with
"within noise" where the medians differ by no more than the wider IQR (see
:mod:`jax_tpusync.bench.verdict`). ``--details`` prints the developer's table and targets
instead. Progress goes to stderr. The defaults (a 4096-token prefix, the host tier) take
about a minute on two cores; the figures in docs/benchmarks.md are of ``--tiers host file
--prefix-tokens 32768``.

R requests share a P-token prefix (a document or a system prompt) and add U tokens each. A
small decoder (:mod:`jax_tpusync.bench.tiny_decoder`) prefills each request in chunks of
``--chunk`` tokens and computes the logits of its last token. Per tier, in one run:

* ``ttft_full``: request 0, nothing cached: the whole prompt is prefilled
  (``ttft_full_ms_all``: that and the last prompt's full prefill into private blocks);
* ``ttft_cached``: requests 1..R-1, the prefix's full blocks mapped from the prefix store
  (``admit(tokens=...)``), only the unique tokens prefilled (median);
* ``decode_shared`` / ``decode_private``: decode steps of one sequence over the shared
  blocks, and of the same prompt prefilled into private blocks (alternated);
* tokens prefilled, bytes fetched, hit rate, blocks shared, tier blocks held against a copy
  per request; ``logits_max_abs_err``: the last request's first logits, cached prefix vs
  its full prefill.

* ``release_first``: the first request's release, which indexes its blocks (and, with a
  remote level, publishes them: ``publish_release_ms`` and ``blocks_published`` in the
  remote row);

* ``ttft_restart``: the last request again after the cache was closed (its state
  committed: the prefix index with it) and re-opened from the tier as a restarted process
  would (shm for the host tier, the named file for the file tier), so its prefix comes from
  the re-attached index; ``reattach_ms`` is the re-open itself, checksums of the
  committed blocks verified. Its logits are checked against the full prefill too.

Both tiers are persistent here (a shm-backed host tier, a named tier file), so that the
restart can re-attach them.

``--tiers spill``: the two-level store (:mod:`jax_tpusync.core.spill`): a DRAM tier of one
sequence's blocks (plus one) in front of a file tier. After the full prefill a sequence
that needs every DRAM block comes and goes, so the cached prefix is demoted to the file
tier (all but its first block, the most recently used) and the cached requests and the
shared decode read it there in place (``promote_after=None``: it stays there); the
private decode reads DRAM only. ``decode_shared_over_private`` is then the cost of
reading from the file tier instead of DRAM, ``decode_private_spill_over_host`` (from a
plain host tier measured in the same run, if ``host`` is among ``--tiers``) the cost of a
second fetch per unit with nothing on the file tier. No restart row (a two-level cache
does not persist).

``--remote mooncake`` (or ``--remote-master HOST:PORT``, a running master): a remote row.
The first host or file tier's cache is opened with ``remote_prefix=`` a Mooncake Store
(:mod:`jax_tpusync.mooncake.level`), so that its ``release(tokens=...)`` of request 0
publishes the prompt's full blocks there; after its private prefill, a second cache of the
same configuration, its local index empty and its client giving the pool no memory, admits
the last request: its prefix is found only in the remote level, so ``ttft_remote`` is the
import of every prefix block over the network plus the unique tokens' prefill, against the
full prefill and the local hit (``ttft_cached``) of that run. The first tokens (argmax of
the first logits) are compared, and the level's counts reported (blocks and bytes loaded,
misses, faults). Both caches connect to the store before any timing (an admit of other
tokens: a miss); with the remote level on, the publishing cache's timed admits include its
one lookup past the local index (a miss). Without ``--remote-master`` the benchmark starts
a ``mooncake_master`` on free loopback ports and stops it at exit
(:mod:`jax_tpusync.bench.mooncake_master`); object names carry the run's own namespace, so a
running master's earlier objects are never hit.

Over loopback by default. ``--reader-netns NS --publisher-host A --reader-host B`` (implies
``--remote mooncake``) puts the reading cache in a process of its own (started with
``spawn``) that joins network namespace ``NS`` before it opens a socket (needs root), so
the blocks cross whatever links the namespaces, e.g. a veth pair: the publisher (and the
benchmark's master, unless ``--remote-master``) are at ``A``, the reader at ``B``. The
reader compiles its step before the timed admit, like the in-process one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from jax_tpusync.bench import common, mooncake_master, tiny_decoder, verdict

COLUMNS = [
    ("tier", "tier", "s"),
    ("prefix_tokens", "prefix", "d"),
    ("ttft_full_ms", "TTFT full ms", ".1f"),
    ("ttft_cached_ms", "TTFT cached ms", ".1f"),
    ("ttft_cached_over_full", "cached/full", ".3f"),
    ("ttft_restart_ms", "TTFT restart ms", ".1f"),
    ("ttft_restart_over_full", "restart/full", ".3f"),
    ("hit_rate", "hit rate", ".3f"),
    ("decode_shared_ms", "decode shared ms", ".1f"),
    ("decode_private_ms", "decode private ms", ".1f"),
    ("decode_shared_over_private", "shared/private", ".3f"),
    ("tier_blocks_used", "blocks used", "d"),
    ("tier_blocks_unshared", "blocks unshared", "d"),
    ("ttft_remote_ms", "TTFT remote ms", ".1f"),
    ("ttft_remote_over_full", "remote/full", ".3f"),
    ("logits_max_abs_err", "logits err", ".2g"),
    ("first_token", "first token", "s"),
]

# The master starts evicting at 90% of the pool (its eviction_high_watermark_ratio): the
# publishing cache's segment leaves room above what the run publishes.
_SEGMENT_FILL = 0.8


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``prefix`` subcommand."""
    p = subparsers.add_parser(
        "prefix",
        help="TTFT with a shared prefix cached vs a full prefill; decode on shared blocks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tiers", nargs="+", choices=("host", "file", "spill"), default=["host"]
    )
    p.add_argument("--path", default=None, help="directory of the file tier (default: cwd)")
    p.add_argument("--prefix-tokens", type=int, default=4096, help="shared prefix P")
    p.add_argument("--unique-tokens", type=int, default=256, help="unique tokens U per request")
    p.add_argument("--requests", type=int, default=4, help="requests R sharing the prefix")
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per call")
    p.add_argument("--decode-steps", type=int, default=6)
    tiny_decoder.add_arguments(p)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--staging-bytes", type=common.parse_bytes, default=32 * common.MiB)
    p.add_argument("--prefetch-depth", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="OUT.png", help="bar chart of the TTFTs")
    common.add_remote_arguments(
        p, "a remote row: the prefix admitted by a fresh cache from a Mooncake Store",
        "at --publisher-host",
    )  # fmt: skip
    p.add_argument(
        "--reader-netns",
        default=None,
        metavar="NAME",
        help="network namespace (/var/run/netns/NAME) the remote row's reader process joins "
        "(implies --remote mooncake)",
    )
    p.add_argument("--publisher-host", default="127.0.0.1", help="the publishing cache's address")
    p.add_argument("--reader-host", default="127.0.0.1", help="the reading cache's address")
    common.add_engine_arguments(p)
    common.add_cpu_arguments(p)
    common.add_details_argument(p, "every tier's row, ratios and targets")
    common.add_json_argument(p)
    p.set_defaults(run=run, columns=COLUMNS)
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    worker_cpus = common.apply_cpu_arguments(args)  # Before JAX starts its backend.
    if args.requests < 2:
        raise SystemExit("--requests must be >= 2 (one full prefill, then cached ones)")
    if args.prefix_tokens % args.block_tokens:
        raise SystemExit("--prefix-tokens must be a multiple of --block-tokens (full blocks)")
    common.require_netns("--reader-netns", args.reader_netns)
    if args.remote_master is not None or args.reader_netns is not None:
        args.remote = "mooncake"
    remote_at = None  # The index in --tiers of the tier that gets the remote row.
    if args.remote:
        remote_at = next((i for i, t in enumerate(args.tiers) if t in ("host", "file")), None)
        if remote_at is None:
            raise SystemExit(
                "--remote needs host or file among --tiers (the cache that publishes the prefix)"
            )
    params, step = _model(args)
    rng = np.random.default_rng(args.seed + 1)
    prefix_ids = rng.integers(0, args.vocab, args.prefix_tokens)
    prompts = [
        np.concatenate([prefix_ids, rng.integers(0, args.vocab, args.unique_tokens)])
        for _ in range(args.requests)
    ]
    prompt_len = len(prompts[0])
    max_len = prompt_len + args.decode_steps + 1
    blocks_per_seq = -(-max_len // args.block_tokens)
    results = []
    with contextlib.ExitStack() as stack:
        master = mooncake_master.for_run(args, stack, host=args.publisher_host)
        remote = _remote_urls(args, master, len(prompts), blocks_per_seq)
        for i, tier in enumerate(args.tiers):
            path = None
            if tier in ("file", "spill"):
                path = tempfile.mkdtemp(
                    prefix="tpusync-prefix-", dir=os.path.abspath(args.path or os.getcwd())
                )
            try:
                common.progress(f"prefix: {tier} tier ...")
                results += _one_tier(
                    args,
                    tier,
                    path,
                    worker_cpus,
                    params,
                    prompts,
                    max_len,
                    blocks_per_seq,
                    step,
                    remote if i == remote_at else None,
                )
            finally:
                if path:
                    shutil.rmtree(path, ignore_errors=True)
    by_tier = {r["tier"]: r for r in results if "publisher_tier" not in r}
    if "spill" in by_tier and "host" in by_tier:
        by_tier["spill"]["decode_private_spill_over_host"] = (
            by_tier["spill"]["decode_private_ms"] / by_tier["host"]["decode_private_ms"]
        )
    if args.plot:
        _plot(results, args.plot)
    common.summary_or_details(args, summary(results))
    return results


def summary(results: list[dict[str, Any]]) -> str:
    """Per tier, in words: the cached TTFTs against a full prefill, the decode step on
    shared blocks against private ones (see the module)."""
    remote = {r["publisher_tier"]: r for r in results if "publisher_tier" in r}
    parts = []
    for r in results:
        if "publisher_tier" in r:
            continue
        full = verdict.Spread.of(r.get("ttft_full_ms_all") or [r["ttft_full_ms"]])
        rows = [("library: prefix cached", verdict.Spread.of(r["ttft_cached_ms_all"]))]
        if r.get("ttft_restart_ms") is not None:
            restart = verdict.Spread.of([r["ttft_restart_ms"]])
            rows.append(("library: cached, after a restart", restart))
        if r["tier"] in remote:
            from_remote = verdict.Spread.of([remote[r["tier"]]["ttft_remote_ms"]])
            rows.append(("library: from the remote level", from_remote))
        lines = [
            f"prefix, {r['tier']} tier: {r['requests']} requests sharing a "
            f"{r['prefix_tokens']}-token prefix + {r['unique_tokens']} tokens each",
            verdict.table([*rows, ("full prefill, nothing cached", full)], "TTFT"),
        ]
        lines += [
            f"  TTFT, {label.removeprefix('library: ')}: "
            f"{verdict.compare(spread, full, 'a full prefill')}"
            for label, spread in rows
        ]
        shared = r.get("decode_shared_ms_all")
        private = r.get("decode_private_ms_all")
        if shared and private:
            lines.append(
                "  a decode step on the shared blocks is "
                + verdict.compare(
                    verdict.Spread.of(shared), verdict.Spread.of(private), "on private blocks"
                )
            )
        lines.append(
            f"  first logits, prefix cached against the full prefill: max abs difference "
            f"{r['logits_max_abs_err']:.2g}, first token {r['first_token']}"
        )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _model(args):
    """(params, jitted step) of the benchmark's tiny decoder: the same in every process."""
    import jax

    model = tiny_decoder.Decoder.of(args)
    params = tiny_decoder.init_params(model, args.seed)
    return params, jax.jit(functools.partial(tiny_decoder.forward, model), donate_argnums=(2,))


def _remote_urls(args, master, requests: int, blocks_per_seq: int) -> tuple[str, str] | None:
    """(the publishing cache's, the reading cache's) ``remote_prefix`` addresses, or None
    without a master; each names the address other clients reach it at. The publisher's
    segment holds every block the run publishes (each request's full blocks, and the
    decoded ones); the reader gives the pool no memory."""
    if master is None:
        return None
    payload = args.layers * 2 * args.block_tokens * args.kv_heads * args.head_dim * 2  # bf16
    published = blocks_per_seq + requests * (-(-args.unique_tokens // args.block_tokens) + 1)
    segment_mb = max(16, -(-int(published * payload / _SEGMENT_FILL) // common.MiB))
    # A namespace of this run's own: the same seed makes the same keys in every run.
    query = f"namespace=bench-prefix-{os.getpid()}-{time.time_ns()}"
    return (
        f"mooncake://{master}?segment_mb={segment_mb}&local_host={args.publisher_host}&{query}",
        f"mooncake://{master}?segment_mb=0&local_host={args.reader_host}&{query}",
    )


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How this run makes a cache of one tier; picklable, so that a reader process makes
    the same cache (``where``: the tier's place, e.g. its shm or file name)."""

    args: argparse.Namespace
    tier: str
    path: str | None
    worker_cpus: tuple[int, ...]
    max_len: int
    num_blocks: int

    def open(self, where: dict, **kwargs):
        import jax.numpy as jnp

        import jax_tpusync as tps

        args = self.args
        return tps.OffloadedKVCache(
            num_layers=args.layers,
            batch=1,
            max_len=self.max_len,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=jnp.bfloat16,
            tier=self.tier,
            path=self.path,
            block_tokens=args.block_tokens,
            num_blocks=self.num_blocks,
            staging_bytes=args.staging_bytes,
            prefetch_depth=args.prefetch_depth,
            engine=common.engine_config(args, self.worker_cpus),
            model_id="bench-prefix",
            **where,
            **kwargs,
        )


@dataclasses.dataclass(frozen=True)
class _Reader:
    """The cache that finds the prefix in the remote level alone: its tier's place, its
    ``remote_prefix`` address, and the network namespace of its process (None: it runs in
    this process)."""

    where: dict
    url: str
    netns: str | None = None


def _one_tier(
    args, tier, path, worker_cpus, params, prompts, max_len, blocks_per_seq, step, remote
):
    # One copy of the prefix, R tails, a private copy for the decode comparison, slack.
    num_blocks = 2 * blocks_per_seq + len(prompts) * (
        -(-args.unique_tokens // args.block_tokens) + 2
    )
    # Persistent, so that the restart row can re-attach the tier and its prefix index.
    where: dict = (
        dict(shm_name=f"tpusync-bench-prefix-{os.getpid()}")
        if tier == "host"
        else dict(file_name="prefix")
    )
    if tier == "spill":  # DRAM for one sequence: the cached prefix has to move.
        num_blocks = blocks_per_seq + 1
        where = dict(spill_path=path, spill_blocks=2 * blocks_per_seq, promote_after=None)
        tier, path = "host", None
    recipe = _Recipe(args, tier, path, worker_cpus, max_len, num_blocks)
    reader = writer_url = None
    if remote is not None:
        writer_url, reader_url = remote
        # Its own tier (a plain host tier, or another file): nothing local.
        reader_where = {"file_name": "prefix-remote", "overwrite": True} if tier == "file" else {}
        reader = _Reader(reader_where, reader_url, args.reader_netns)

    def open_cache(**kwargs):
        return recipe.open(where, **{"remote_prefix": writer_url, **kwargs})

    try:
        return _measure(args, recipe, open_cache, reader, params, prompts, step)
    finally:
        if "shm_name" in where:
            _remove_shm(where["shm_name"])


def _remove_shm(name: str) -> None:
    from jax_tpusync import Engine
    from jax_tpusync.persist import commit as persistence

    try:
        Engine.unlink_shm(name)
    except Exception:  # noqa: BLE001 - never created.
        pass
    try:
        os.unlink(os.path.join(persistence.SHM_DIRECTORY, name + persistence.MANIFEST_SUFFIX))
    except FileNotFoundError:
        pass


def _measure(args, recipe, open_cache, reader, params, prompts, step):
    import jax
    import jax.numpy as jnp

    tier, max_len = recipe.tier, recipe.max_len
    cache = open_cache(overwrite=True)
    with cache:
        label = "spill" if cache.spec.spill_blocks else tier  # For the progress lines.
        common.progress(f"  {label}: compiling the prefill and decode steps ...")
        _compile(args, step, params, cache, prompts)
        state = cache.init(admit=False)

        def prefill(state, tokens, *, share: bool, cache=cache):
            return _prefill(args, max_len, step, params, cache, state, tokens, share=share)

        def decode(state, steps):
            times = []
            tok = jnp.zeros((1, 1), jnp.int32)
            for _ in range(steps):
                t0 = time.perf_counter()
                logits, state = step(params, tok, state)
                jax.block_until_ready(logits)
                times.append(time.perf_counter() - t0)
            return times, state

        # Other tokens than the prompts': an admit that connects to the remote level (a miss).
        other_ids = np.random.default_rng(args.seed + 2).integers(
            0, args.vocab, 2 * args.block_tokens
        )
        if reader is not None:
            state, _ = _connect(cache, state, other_ids, max_len)
        cache.engine.reset_stats()
        common.progress(f"  {label}: full prefill of {len(prompts[0])} tokens ...")
        ttft_full, _, state, _ = prefill(state, prompts[0], share=True)
        # The first release indexes the prompt's blocks and, with a remote level, publishes
        # them: a cost the serving loop pays on its thread.
        published = cache.prefix_stats.get("mooncake_published", 0)
        t0 = time.perf_counter()
        state = cache.release(state, 0, tokens=prompts[0])
        release_first = time.perf_counter() - t0
        published = cache.prefix_stats.get("mooncake_published", 0) - published
        two_level = cache.spec.spill_blocks > 0
        if two_level:  # A sequence taking every DRAM block: the prefix is demoted.
            state, _ = cache.admit(state, 0, max_tokens=max_len)
            state = cache.release(state, 0)
        fetched_full = cache.engine.stats()["tiers"][cache.tier]["fetch"]["bytes"]
        ttft_cached, cached_tokens, last_logits = [], [], None
        shared_decode, private_decode = [], []
        common.progress(f"  {label}: {len(prompts) - 1} requests with the prefix cached, decode ...")
        for i, prompt in enumerate(prompts[1:], start=1):
            dt, logits, state, cached = prefill(state, prompt, share=True)
            ttft_cached.append(dt)
            cached_tokens.append(cached)
            last_logits = logits
            if i == len(prompts) - 1:
                blocks_used = int(cache.spec.num_blocks - cache.free_blocks)
                times, state = decode(state, args.decode_steps)
                shared_decode += times[1:]
                prompt = np.concatenate([prompt, np.zeros(args.decode_steps, np.int64)])
            state = cache.release(state, 0, tokens=prompt)
        # The last prompt again, into private blocks: its full prefill and decode.
        ttft_private, full_logits, state, _ = prefill(state, prompts[-1], share=False)
        times, state = decode(state, args.decode_steps)
        private_decode += times[1:]
        state = cache.release(state, 0)
        # Alternate once more, so that drift does not favour one side.
        _, _, state, _ = prefill(state, prompts[-1], share=True)
        times, state = decode(state, args.decode_steps)
        shared_decode += times[1:]
        decoded = np.concatenate([prompts[-1], np.zeros(args.decode_steps, np.int64)])
        state = cache.release(state, 0, tokens=decoded)
        stats = cache.prefix_stats
        remote_hit = None
        if reader is not None:  # While this cache, whose segment holds the blocks, is open.
            if reader.netns is None:
                remote_hit = _remote_hit(recipe, reader, step, params, prompts[-1], other_ids)
            else:
                remote_hit = _remote_hit_in_namespace(recipe, reader, prompts[-1], other_ids)
        cache.close(state)  # Commits the state, and the prefix index with it.
    ttft_restart = reattach = restart_logits = restart_cached = None
    if not two_level:
        # A restart: the tier and its committed prefix index re-attached by a new cache.
        common.progress(f"  {label}: restart: re-attach the tier, the last request again ...")
        t0 = time.perf_counter()
        reopened = open_cache(remote_prefix=None)
        reattach = time.perf_counter() - t0
        with reopened:
            state = reopened.init(admit=False)
            ttft_restart, restart_logits, state, restart_cached = prefill(
                state, prompts[-1], share=True, cache=reopened
            )
            reopened.close(state)
    prompt_tokens = sum(len(p) for p in prompts[1:])
    res = dict(
        tier="spill" if two_level else tier,
        prefix_tokens=args.prefix_tokens,
        unique_tokens=args.unique_tokens,
        requests=len(prompts),
        block_tokens=args.block_tokens,
        ttft_full_ms=ttft_full * 1e3,
        ttft_full_ms_all=[ttft_full * 1e3, ttft_private * 1e3],
        release_first_ms=release_first * 1e3,
        blocks_published_first_release=published,
        ttft_cached_ms=statistics.median(ttft_cached) * 1e3,
        ttft_cached_ms_all=[t * 1e3 for t in ttft_cached],
        ttft_restart_ms=None if two_level else ttft_restart * 1e3,
        reattach_ms=None if two_level else reattach * 1e3,
        tokens_cached_restart=restart_cached,
        logits_max_abs_err_restart=None
        if two_level
        else float(np.max(np.abs(restart_logits - full_logits))),
        tokens_prefilled_full=len(prompts[0]),
        tokens_prefilled_cached=[len(p) - c for p, c in zip(prompts[1:], cached_tokens)],
        hit_rate=sum(cached_tokens) / prompt_tokens,
        bytes_fetched_full_prefill=fetched_full,
        blocks_shared=args.prefix_tokens // args.block_tokens,
        tier_blocks_used=blocks_used,
        tier_blocks_unshared=len(prompts) * -(-len(prompts[0]) // args.block_tokens),
        tier_blocks_one_prefix_plus_tails=args.prefix_tokens // args.block_tokens
        + len(prompts) * -(-args.unique_tokens // args.block_tokens),
        decode_shared_ms=statistics.median(shared_decode) * 1e3,
        decode_private_ms=statistics.median(private_decode) * 1e3,
        decode_shared_ms_all=[t * 1e3 for t in shared_decode],
        decode_private_ms_all=[t * 1e3 for t in private_decode],
        logits_max_abs_err=float(np.max(np.abs(last_logits - full_logits))),
        first_token=_same_token(last_logits, full_logits),
        prefix_index=stats,
    )
    res["ttft_cached_over_full"] = res["ttft_cached_ms"] / res["ttft_full_ms"]
    res["decode_shared_over_private"] = res["decode_shared_ms"] / res["decode_private_ms"]
    res["targets"] = {
        "ttft cached <= 0.1 x full prefill": res["ttft_cached_over_full"] <= 0.1,
        "decode on shared blocks <= 1.05 x private": res["decode_shared_over_private"] <= 1.05,
    }
    res["ttft_restart_over_full"] = None
    if not two_level:
        res["ttft_restart_over_full"] = res["ttft_restart_ms"] / res["ttft_full_ms"]
        res["targets"]["ttft after a restart <= 0.1 x full prefill"] = (
            res["ttft_restart_over_full"] <= 0.1
        )
    common.progress(
        f"{res['tier']}: TTFT full {res['ttft_full_ms']:.0f} ms, cached "
        f"{res['ttft_cached_ms']:.0f} ms ({res['ttft_cached_over_full']:.3f}x), after a "
        f"restart {'-' if two_level else f'{ttft_restart * 1e3:.0f} ms'}, decode "
        f"shared/private {res['decode_shared_over_private']:.3f}, logits err "
        f"{res['logits_max_abs_err']:.2g}"
    )
    if remote_hit is None:
        return [res]
    row = _remote_row(res, remote_hit, full_logits, stats, len(prompts[-1]))
    row["link"] = (
        "loopback"
        if reader.netns is None
        else f"{args.publisher_host} -> netns {reader.netns} {args.reader_host}"
    )
    return [res, row]


def _compile(args, step, params, cache, prompts) -> None:
    """Compiles every chunk shape the prompts' prefills and the decode take, on a state
    that moves no bytes."""
    import jax
    import jax.numpy as jnp

    tails = {_chunks_tail(len(p), c, args.chunk) for p in prompts for c in (0, args.prefix_tokens)}
    for n in ({args.chunk, 1} | tails) - {0}:
        jax.block_until_ready(step(params, jnp.zeros((1, n), jnp.int32), cache.inert_state()))


def _prefill(args, max_len, step, params, cache, state, tokens, *, share: bool):
    """``tokens`` prefilled into slot 0, its cached prefix mapped if ``share``: (seconds to
    the first token's logits, those logits, state, cached tokens)."""
    import jax.numpy as jnp

    t0 = time.perf_counter()
    state, cached = cache.admit(state, 0, tokens=tokens if share else None, max_tokens=max_len)
    logits = None
    for lo in range(cached, len(tokens), args.chunk):
        chunk = jnp.asarray(tokens[lo : lo + args.chunk][None], jnp.int32)
        logits, state = step(params, chunk, state)
    logits = np.asarray(logits)
    return time.perf_counter() - t0, logits, state, cached


def _connect(cache, state, other_ids, max_len):
    """Admits and releases ``other_ids`` (no prefix of theirs is anywhere): the cache's
    remote level connects to the store, outside any timing. (state, seconds)."""
    t0 = time.perf_counter()
    state, _ = cache.admit(state, 0, tokens=other_ids, max_tokens=max_len)
    state = cache.release(state, 0)
    return state, time.perf_counter() - t0


def _remote_hit(recipe, reader, step, params, prompt, other_ids) -> dict:
    """``prompt`` prefilled by a fresh cache whose prefix is only in the remote level."""
    args = recipe.args
    with recipe.open(reader.where, remote_prefix=reader.url) as cache:
        _compile(args, step, params, cache, [prompt])  # Its own states: nothing compiles timed.
        state = cache.init(admit=False)
        state, connect = _connect(cache, state, other_ids, recipe.max_len)
        before = cache.prefix_stats
        ttft, logits, state, cached = _prefill(
            args, recipe.max_len, step, params, cache, state, prompt, share=True
        )
        after = cache.prefix_stats
        cache.close(state)
    delta = {k: after[k] - before.get(k, 0) for k in after if k.startswith("mooncake_")}
    return {
        "ttft": ttft,
        "logits": logits,
        "cached": cached,
        "connect": connect,
        "connect_faults": before.get("mooncake_faults", 0),
        "stats": delta,
    }


def _remote_hit_in_namespace(recipe, reader, prompt, other_ids) -> dict:
    """:func:`_remote_hit` in a process of its own that joins ``reader.netns`` first."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    replies = ctx.Queue()
    child = common.start_child(ctx, _reader_process, recipe, reader, prompt, other_ids, replies)
    try:
        got = common.child_reply(replies, child, 600, f"the reader process (netns {reader.netns})")
        if isinstance(got, str):
            raise SystemExit(got)
        child.join(60)
        return got
    finally:
        if child.is_alive():
            child.kill()


def _reader_process(recipe, reader, prompt, other_ids, replies) -> None:
    """The remote row's reader, in a spawned process: joins the namespace, then puts the
    hit (or what went wrong, as a string) on ``replies``."""
    try:
        common.join_netns(reader.netns)
        params, step = _model(recipe.args)
        replies.put(_remote_hit(recipe, reader, step, params, prompt, other_ids))
    except BaseException as e:  # noqa: BLE001 - told to the parent, which stops the run.
        replies.put(f"the reader process (netns {reader.netns}): {type(e).__name__}: {e}")


def _remote_row(local, hit, full_logits, publisher_stats, prompt_len) -> dict:
    """The remote row: the remote hit against the full prefill and local hit of ``local``."""
    row = {
        "tier": f"{local['tier']} <- mooncake",
        "publisher_tier": local["tier"],
        "prefix_tokens": local["prefix_tokens"],
        "unique_tokens": local["unique_tokens"],
        "block_tokens": local["block_tokens"],
        "ttft_full_ms": local["ttft_full_ms"],
        "ttft_cached_ms": local["ttft_cached_ms"],
        "ttft_remote_ms": hit["ttft"] * 1e3,
        # What publishing cost the publisher: its first release, which put every block.
        "publish_release_ms": local["release_first_ms"],
        "blocks_published": local["blocks_published_first_release"],
        "remote_connect_ms": hit["connect"] * 1e3,
        # A fault while connecting pauses the level: the timed admit would then be a miss.
        "remote_connect_faults": hit["connect_faults"],
        "tokens_cached_remote": hit["cached"],
        "hit_rate": hit["cached"] / prompt_len,
        "blocks_imported": hit["stats"]["mooncake_imported"],
        "bytes_loaded": hit["stats"]["mooncake_bytes_loaded"],
        "logits_max_abs_err": float(np.max(np.abs(hit["logits"] - full_logits))),
        "first_token": _same_token(hit["logits"], full_logits),
        "first_token_full": int(np.argmax(full_logits[0])),
        "first_token_remote": int(np.argmax(hit["logits"][0])),
        # The reader's counts during the timed admit; the publisher's over the whole run.
        "remote_level": hit["stats"],
        "publisher_level": {k: v for k, v in publisher_stats.items() if k.startswith("mooncake_")},
    }
    row["ttft_remote_over_full"] = row["ttft_remote_ms"] / row["ttft_full_ms"]
    row["ttft_remote_over_cached"] = row["ttft_remote_ms"] / row["ttft_cached_ms"]
    row["targets"] = {
        "ttft remote hit <= 0.2 x full prefill": row["ttft_remote_over_full"] <= 0.2,
        "remote hit's first token = full prefill's": row["first_token"] == "same",
        "the reader connected without a fault": row["remote_connect_faults"] == 0,
    }
    common.progress(
        f"{row['tier']}: TTFT remote {row['ttft_remote_ms']:.0f} ms "
        f"({row['ttft_remote_over_full']:.3f}x full, {row['ttft_remote_over_cached']:.2f}x "
        f"cached), {row['blocks_imported']} blocks ({common.format_bytes(row['bytes_loaded'])}) "
        f"imported, first token {row['first_token']}, faults "
        f"{hit['stats']['mooncake_faults']}"
    )
    return row


def _same_token(logits, full_logits) -> str:
    """Whether the first token (the argmax of [1, vocab] logits) equals the full prefill's."""
    return "same" if np.argmax(logits[0]) == np.argmax(full_logits[0]) else "differs"


def _chunks_tail(length: int, start: int, chunk: int) -> int:
    """Tokens in the last prefill call of ``[start, length)`` in chunks of ``chunk``."""
    n = length - start
    return n % chunk or (chunk if n else 0)


def _plot(results, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    remote = {r["publisher_tier"]: r["ttft_remote_ms"] for r in results if "publisher_tier" in r}
    results = [
        dict(r, ttft_remote_ms=remote.get(r["tier"])) for r in results if "publisher_tier" not in r
    ]
    names = [r["tier"] for r in results]
    x = np.arange(len(names))
    bars = [
        ("ttft_full_ms", "full prefill"),
        ("ttft_cached_ms", "prefix cached"),
        ("ttft_restart_ms", "cached, after a restart"),
    ]
    if remote:
        bars.append(("ttft_remote_ms", "from the remote level only"))
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        heights = [r[key] or 0 for r in results]  # No restart bar for a two-level cache.
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, heights, width, label=label)
    ax.set_xticks(x, names)
    ax.set_yscale("log")  # The cached bars are a hundredth of the full prefill's.
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{results[0]['prefix_tokens']}-token shared prefix")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
