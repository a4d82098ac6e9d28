"""The ``decode`` benchmark's variants, one registered builder each (see :mod:`.decode`).

A variant is a function of the run (:class:`Bench`) that returns the :class:`Step` to time,
or None to leave the variant out; ``@variant(name)`` registers it under the name that
``--variants`` takes (the registration order is the CLI's order and the rotation's). A
variant that runs on a cache of its own names a function that opens it (``cache=``, which
may raise :class:`Skip` with the note the row reports); variants naming the same function
share one cache. ``keeps_kv=True``: the builder reads the filled KV as host arrays
(``Bench.resident_kv``); ``brings``: variants that run whenever this one does.

``VARIANTS`` lists the names in order; :func:`resolve` completes a list of names;
:func:`build` runs every wanted builder, then the plain-JAX baselines (:mod:`.baselines`).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_tpusync.bench import baselines, common, tiny_decoder
from jax_tpusync.bench.decode_units import absolute_regions, tag, unit_attention, unit_table
from jax_tpusync.bench.tiny_decoder import prefetch_attend

# What one step cost the whole process (all threads: XLA's, the engine's, the kernel's).
COSTS = ("cpu_user", "cpu_system", "minor_faults")


class Step:
    """A step plus its carried (donated) state; ``once()`` runs one step, timed.

    ``fn(*args, state) -> (out, state)``; ``prepare()`` (if any) runs untimed before each step.
    """

    def __init__(self, fn: Callable, state: Any, args: tuple = (), prepare: Callable | None = None):
        self.fn, self.state, self.args, self.prepare = fn, state, args, prepare
        self.out = None
        self.steps = 0

    def once(self) -> tuple[float, dict[str, float]]:
        """Runs one step; returns its wall seconds and its ``COSTS``."""
        import jax

        if self.prepare is not None:
            self.prepare()
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out, self.state = self.fn(*self.args, self.state)
        jax.block_until_ready((out, self.state))
        dt = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        self.out = out
        self.steps += 1
        return dt, {
            "cpu_user": c1.ru_utime - c0.ru_utime,
            "cpu_system": c1.ru_stime - c0.ru_stime,
            "minor_faults": c1.ru_minflt - c0.ru_minflt,
        }


class Skip(Exception):
    """Raised by a variant's cache opener: the variant does not run here (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    build: Callable[[Bench], Step | None]
    cache: Callable[[Bench], Any] | None = None  # Opens the variant's own cache (or None).
    init_state: bool = True  # The step carries a state of its own cache's init().
    keeps_kv: bool = False
    brings: tuple[str, ...] = ()


REGISTRY: dict[str, Variant] = {}


def variant(name: str, *, cache=None, init_state=True, keeps_kv=False, brings=()):
    """Registers the decorated ``build(bench) -> Step | None`` as variant ``name``."""

    def register(build):
        REGISTRY[name] = Variant(name, build, cache, init_state, keeps_kv, tuple(brings))
        return build

    return register


def resolve(names) -> list[str]:
    """``names``, ``prefetch`` (every row's reference) and what they bring, in registry order."""
    wanted = {"prefetch", *names}
    wanted |= {b for n in wanted for b in REGISTRY[n].brings}
    return [n for n in REGISTRY if n in wanted]


class Bench:
    """One ``--context``'s run: settings, model, KV and caches, read by the builders."""

    def __init__(self, args, shape, depth: int, max_len: int, path, tmpdir, worker_cpus):
        self.args, self.shape, self.depth, self.max_len = args, shape, depth, max_len
        self.path, self.tmpdir, self.worker_cpus = path, tmpdir, worker_cpus
        self.slots = depth + 1
        self.caches: list = []  # Every cache opened, closed by close().
        self.own: dict[Callable, list] = {}  # Cache opener -> [cache or None, state].
        self.notes: dict[str, str] = {}  # Variant -> why it was skipped.
        self.closers: list = []  # The plain reader and the baselines' decoders.
        self.memo: dict[str, Any] = {}  # Built once for several variants.
        self.jax_offload_label: str | None = None
        self.config = common.engine_config(args, worker_cpus)

    def new_cache(self, record: bool = False, file_name: str | None = None, **kwargs):
        """A cache of the benchmark's shape and settings (``file_name`` on the file tier)."""
        import jax_tpusync as tps

        s, a = self.shape, self.args
        c = tps.OffloadedKVCache(
            num_layers=s.layers,
            batch=s.batch,
            max_len=self.max_len,
            num_kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            dtype=s.dtype,
            tier=a.tier,
            path=self.path,
            file_name=file_name if self.path else None,
            staging_bytes=a.staging_bytes,
            prefetch_depth=self.depth,
            engine=dataclasses.replace(self.config, record_timeline=record),
            **{"block_tokens": a.block_tokens, **kwargs},
        )
        self.caches.append(c)
        return c

    def open(self, wanted: list[str]) -> None:
        """Opens the caches of ``wanted``, fills them with the same KV, draws the model."""
        import jax.numpy as jnp

        args, shape = self.args, self.shape
        # Named, so that the plain reader can open the same file.
        self.pf_cache = self.new_cache(
            record=bool(args.plot_timeline or args.trace), file_name="kv"
        )
        self.spec = spec = self.pf_cache.spec
        wanted = [v for n, v in REGISTRY.items() if n in wanted]  # In registration order.
        for v in wanted:
            if v.cache is not None and v.cache not in self.own:
                try:
                    self.own[v.cache] = [v.cache(self), None]
                except Skip as e:
                    self.notes[v.name] = str(e)
        print(
            f"decode: {args.tier} tier, context {args.context}, {shape.layers} layers x "
            f"{shape.kv_heads} kv heads x {shape.head_dim} ({args.dtype}), batch {shape.batch}, "
            f"q heads {shape.q_heads}, ffn {shape.ffn}; chunk_len {spec.chunk_len}, "
            f"{-(-args.context // spec.chunk_len)} units/layer, "
            f"{shape.kv_bytes_per_step / common.MiB:.1f} MiB of KV read per step",
            file=sys.stderr,
            flush=True,
        )
        # The measured state first: it takes the staging buffer the file tier was aligned to.
        lengths = [args.context] * shape.batch
        self.pf_state = self.pf_cache.init(lengths)
        carried = [self.own[v.cache] for v in wanted if v.init_state and v.cache in self.own]
        carried = [entry for entry in carried if entry[0] is not None]
        for entry in carried:
            entry[1] = entry[0].init(lengths)
        # Fill: the same random KV into every tier and the resident arrays.
        t0 = time.perf_counter()
        others = [c for c, _ in self.own.values() if c is not None]
        keep = any(v.keeps_kv for v in wanted) or bool(args.baselines)
        self.resident_kv = tiny_decoder.fill(
            shape, self.max_len, [self.pf_cache, *others], args.seed, keep
        )
        self.pf_state = self.pf_cache.drain(self.pf_state)  # The live state (fill made others).
        for entry in carried:
            entry[1] = entry[0].drain(entry[1])
        print(
            f"filled {args.context} tokens x {shape.layers} layers in "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        self.params = tiny_decoder.init_step_params(shape, args.seed)
        x0 = np.random.default_rng(args.seed + 7).standard_normal(
            (shape.batch, 1, shape.d_model), dtype=np.float32
        )
        self.x0 = jnp.asarray(x0, shape.dtype)
        # A numpy constant: closures must not capture a device array a step donates.
        self.context_lengths = np.full((shape.batch,), args.context, np.int32)

    def cache_of(self, name: str) -> tuple[Any, Any]:
        """(cache, state) of variant ``name``'s own cache ((None, None): it has none)."""
        cache, state = self.own.get(REGISTRY[name].cache, (None, None))
        return cache, state

    def model(self, params, x, state, attend: Callable, mark: Callable | None = None):
        return tiny_decoder.step(params, self.shape, x, state, attend, mark)

    def unit_attention(self, q, k, v, get_unit: Callable, staging):
        """The fixed context's attention, unit by unit (see :mod:`.decode_units`)."""
        lengths = self.context_lengths
        return unit_attention(q, k, v, get_unit, staging, self.shape, self.spec, lengths)

    def jit_step(self, fn: Callable, state: Any) -> Step:
        """``fn(params, x, state)`` jitted (the state donated), run from ``x0``."""
        import jax

        return Step(jax.jit(fn, donate_argnums=(2,)), state, (self.params, self.x0))

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def close(self) -> None:
        for c in self.closers:
            c.close()
        for c in self.caches:
            try:
                c.engine.drain()
            finally:
                c.close()


def build(b: Bench, wanted: list[str]) -> dict[str, Step]:
    """The wanted variants' steps (in registration order), then the baselines'."""
    steps = {}
    for name, v in REGISTRY.items():
        if name in wanted:
            s = v.build(b)
            if s is not None:
                steps[name] = s
    steps.update(_baseline_steps(b))
    b.resident_kv = None  # The host copies of the KV are no longer needed.
    b.memo.clear()
    return steps


# -- helpers -------------------------------------------------------------------------------------


def as_words(kv: np.ndarray) -> np.ndarray:
    """16-bit float KV as the uint16 words ``resident_attention`` keeps in place on CPU."""
    return kv.view(np.uint16) if kv.dtype.itemsize == 2 else kv


def marker(engine_id: int):
    import jax.numpy as jnp

    from jax_tpusync.runtime import ops

    def mark(begin: bool, x, layer: int):
        kind = ops.MARK_COMPUTE_BEGIN if begin else ops.MARK_COMPUTE_END
        return ops.mark(engine_id, kind, x, jnp.asarray([layer, -1], jnp.int32))

    return mark


# -- the variants, in --variants order -----------------------------------------------------------


@variant("resident", keeps_kv=True)
def _resident(b: Bench) -> Step:
    import jax.numpy as jnp

    import jax_tpusync as tps

    unit_len, dtype = b.spec.chunk_len, b.shape.dtype

    def attend(layer, q, k, v, cache):
        ks, vs, lengths = cache
        out, ks[layer], vs[layer] = tps.resident_attention(
            q, k, v, ks[layer], vs[layer], lengths, unit_len=unit_len, kv_dtype=dtype
        )
        return out, (ks, vs, lengths)

    def step(params, x, cache):
        ks, vs, lengths = cache
        y, (ks, vs, _) = b.model(params, x, (list(ks), list(vs), lengths), attend)
        return y, (ks, vs, lengths + 1)

    ks = [jnp.asarray(as_words(k)) for k, _ in b.resident_kv]
    vs = [jnp.asarray(as_words(v)) for _, v in b.resident_kv]
    return b.jit_step(step, (ks, vs, jnp.asarray(b.context_lengths)))


def _compute_step(b: Bench):
    """(the compute step, jitted; the staging slots it reads, holding the first units of
    layer 0, which no transfer ever refills), shared by compute and platform."""

    def make():
        import jax

        def attend(layer, q, k, v, staging):
            def get_unit(u, staging, deps):
                return staging, u % b.slots

            return b.unit_attention(q, k, v, get_unit, staging)

        spec, chunk = b.spec, b.spec.chunk_len
        k0, v0 = b.resident_kv[0]
        k0, v0 = k0.view(spec.staging_dtype), v0.view(spec.staging_dtype)
        staged = np.zeros(spec.unit_staging_shape, spec.staging_dtype)
        for s in range(b.slots):
            n = max(0, min(chunk, k0.shape[1] - s * chunk))
            staged[s, 0, :, :n] = k0[:, s * chunk : s * chunk + n]
            staged[s, 1, :, :n] = v0[:, s * chunk : s * chunk + n]
        step = jax.jit(lambda p, x, st: b.model(p, x, st, attend), donate_argnums=(2,))
        return step, staged

    return b.once("compute", make)


@variant("compute", keeps_kv=True)
def _compute(b: Bench) -> Step:
    import jax.numpy as jnp

    step, staged = _compute_step(b)
    return Step(step, jnp.asarray(staged), (b.params, b.x0))


def _aux_cache(b: Bench):
    # sync and transfer read the same bytes through one more engine of their own. On the
    # file tier that is a file of their own: a tier file has one writer at a time, and sync
    # writes back. Two files of the same bytes, written alike, were read at speeds up to
    # 1.6x apart on one VM (which of the two was faster changed between runs), so compare
    # the transfer row with prefetch over several runs.
    return b.new_cache(file_name="kv_aux")


@variant("transfer", cache=_aux_cache, init_state=False)
def _transfer(b: Bench) -> Step:
    import jax
    import jax.numpy as jnp

    from jax_tpusync.runtime import ops

    aux, _ = b.cache_of("transfer")
    eid, tier, regions = aux.engine.id, aux.tier, absolute_regions(aux)
    slots, depth = b.slots, b.depth
    # The units a decode step reads: the context plus the tokens decoded since, which fill
    # a last, small unit per layer (its fetch costs a disk round trip).
    step_table = unit_table(aux, b.args.context + 1, slots)
    flat = step_table.reshape(-1, slots, 2 * b.shape.batch, 4)  # [L*U, slots, 2B, 4]
    flat = np.stack([flat[i, i % slots] for i in range(flat.shape[0])])  # alternate slots
    n_fetch = flat.shape[0]

    def step(x, staging):
        # Unit i lands in slot i % slots, `depth` units ahead of the one waited for, as in
        # the prefetching step.
        segs = jnp.asarray(flat)
        ahead = min(depth, n_fetch)
        tickets = jnp.full((slots,), ops.NO_TICKET, jnp.int32)

        def start(i, x):
            return ops.start_fetch(
                eid,
                tier,
                x,
                segs[i],
                tag(-1, i),
                dst_bytes=ops.buffer_bytes(staging),
                regions=regions,
            )

        for i in range(ahead):
            x, t = start(i, x)
            tickets = tickets.at[i % slots].set(t)

        def wait(i, staging, tickets):
            return ops.wait_fetch(
                eid, tier, staging, tickets[i % slots], segs[i], tag(-1, i), regions=regions
            )

        def body(i, carry):
            x, staging, tickets = carry
            j = i + depth  # Into the slot of unit i - 1, waited for last.
            x, t = start(j, x)
            staging = wait(i, staging, tickets)
            return x, staging, tickets.at[j % slots].set(t)

        if n_fetch > ahead:
            x, staging, tickets = jax.lax.fori_loop(0, n_fetch - ahead, body, (x, staging, tickets))
        for i in range(n_fetch - ahead, n_fetch):
            staging = wait(i, staging, tickets)
        return x, staging

    staging = jnp.zeros(aux.spec.unit_staging_shape, aux.spec.staging_dtype)
    return Step(jax.jit(step, donate_argnums=(1,)), staging, (b.x0,))


@variant("sync", cache=_aux_cache, init_state=False)
def _sync(b: Bench) -> Step:
    import jax.numpy as jnp

    from jax_tpusync.runtime import ops

    aux, _ = b.cache_of("sync")
    eid, tier, regions = aux.engine.id, aux.tier, absolute_regions(aux)
    table = unit_table(aux, b.args.context, b.slots)

    def attend(layer, q, k, v, staging):
        segs = jnp.asarray(table[layer, :, 0])  # [U, 2B, 4], slot 0

        def get_unit(u, staging, deps):
            staging = ops.wait_fetch(
                eid,
                tier,
                staging,
                ops.NO_TICKET,
                segs[u],
                tag(layer, u),
                deps=deps,
                regions=regions,
            )
            return staging, 0

        return b.unit_attention(q, k, v, get_unit, staging)

    staging = jnp.zeros(aux.spec.unit_staging_shape, aux.spec.staging_dtype)
    return b.jit_step(lambda p, x, st: b.model(p, x, st, attend), staging)


@variant("prefetch")
def _prefetch(b: Bench) -> Step:
    mark = marker(b.pf_cache.engine.id)
    return b.jit_step(lambda p, x, st: b.model(p, x, st, prefetch_attend, mark), b.pf_state)


def _copy_cache(b: Bench):
    """The same KV, each unit copied into staging first (where ``prefetch`` reads in place)."""
    if not b.spec.reads_in_place:
        raise Skip("skipped: this cache is not read in place")
    return b.new_cache(read_in_place=False)


def _resident_mode_cache(b: Bench):
    """The same KV kept resident in the cache's staging, if it fits the budget."""
    try:
        return b.new_cache(file_name="kv_resident", resident=True)
    except ValueError as e:
        raise Skip(f"skipped: {e}") from None


def _contiguous_cache(b: Bench):
    """One KV block per sequence: the contiguous layout the paged one is measured against."""
    return b.new_cache(file_name="kv_contig", block_tokens=1 << (b.max_len - 1).bit_length())


def _two_level_cache(b: Bench):
    """A two-level cache (host tier only): every block in DRAM, a file tier behind it, so
    each unit is fetched from both tiers with nothing on the file."""
    if b.args.tier != "host":
        raise Skip("skipped: a two-level cache has a host tier in front")
    return b.new_cache(spill_path=b.tmpdir, spill_blocks=1)


def _quantized_cache(b: Bench):
    """Quantized rows (the same staging budget: more tokens per unit), with --tier-dtype."""
    if b.args.tier_dtype:
        return b.new_cache(file_name="kv_quant", tier_dtype=b.args.tier_dtype)
    return None


def _sparse_cache(b: Bench):
    """The same KV read sparsely (``sparse=``, with --sparse BUDGET): each decode row reads
    the blocks its query selects, predicted a step ahead (see jax_tpusync.step.sparse_layer)."""
    if b.args.sparse is not None:
        return b.new_cache(file_name="kv_sparse", sparse=b.args.sparse)
    return None


def _on_own_cache(name: str, opener: Callable) -> None:
    """Registers ``name``: the prefetch step over the cache ``opener`` makes."""

    @variant(name, cache=opener)
    def build(b: Bench) -> Step | None:
        cache, state = b.cache_of(name)
        if cache is None:
            return None
        return b.jit_step(lambda p, x, st: b.model(p, x, st, prefetch_attend), state)


for _name, _opener in (
    ("copy", _copy_cache),
    ("resident_mode", _resident_mode_cache),
    ("contiguous", _contiguous_cache),
    ("two_level", _two_level_cache),
    ("quantized", _quantized_cache),
    ("sparse", _sparse_cache),
):
    _on_own_cache(_name, _opener)


def _plain_reader(b: Bench):
    """The platform's own reader of the step's bytes (plain and platform share it)."""

    def make():
        path = b.path and common.file_tier_path(b.path, "kv")
        reader = common.PlainFetch(path, b.shape.kv_bytes_per_step, b.args.chunk_bytes)
        b.closers.append(reader)
        return reader

    return b.once("plain", make)


@variant("plain")
def _plain(b: Bench) -> Step:
    reader = _plain_reader(b)
    return Step(lambda st: (common.beside(reader, lambda: None, cpus=b.worker_cpus), st), None)


@variant("platform", keeps_kv=True, brings=("plain",))  # The plain row is its reference.
def _platform(b: Bench) -> Step:
    import jax
    import jax.numpy as jnp

    reader, (compute, staged) = _plain_reader(b), _compute_step(b)

    def step(params, x, staging):
        def run():
            return jax.block_until_ready(compute(params, x, staging))

        return common.beside(reader, run, cpus=b.worker_cpus)

    return Step(step, jnp.asarray(staged), (b.params, b.x0))


@variant("jax_offload", keeps_kv=True)
def _jax_offload(b: Bench) -> Step | None:
    import jax
    from jax.sharding import SingleDeviceSharding

    import jax_tpusync as tps

    dev = jax.devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    host_kind = "pinned_host" if "pinned_host" in kinds else None
    if host_kind is None:
        b.jax_offload_label = "unsupported"
        print(
            f"jax_offload: device {dev} has no pinned_host memory (kinds {kinds}); skipped",
            file=sys.stderr,
        )
        return None
    dev_sharding = SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
    host_sharding = SingleDeviceSharding(dev, memory_kind=host_kind)
    unit_len, dtype, lengths = b.spec.chunk_len, b.shape.dtype, b.context_lengths

    def attend(layer, q, k, v, cache):
        ks, vs = cache
        kd = jax.device_put(ks[layer], dev_sharding)
        vd = jax.device_put(vs[layer], dev_sharding)
        out, _, _ = tps.resident_attention(
            q, k, v, kd, vd, lengths, unit_len=unit_len, kv_dtype=dtype
        )
        return out, cache

    def step(params, x, cache):
        y, _ = b.model(params, x, cache, attend)
        return y

    ks = [jax.device_put(as_words(k), host_sharding) for k, _ in b.resident_kv]
    vs = [jax.device_put(as_words(v), host_sharding) for _, v in b.resident_kv]
    jitted = jax.jit(step)
    hlo = jitted.lower(b.params, b.x0, (ks, vs)).compile().as_text()
    copies = sum(
        ("copy-start" in line or "dynamic-update-slice" in line and "S(5)" in line)
        for line in hlo.splitlines()
    )
    if dev.platform == "cpu":
        b.jax_offload_label = "host-copy-on-cpu"
    else:
        b.jax_offload_label = f"{host_kind}->{dev.default_memory().kind}"
    detail = f"memory kinds {kinds}; compiled step has {copies} async host->device copies"
    print(f"jax_offload: {b.jax_offload_label} ({detail})", file=sys.stderr)
    return Step(lambda p, x, c: (jitted(p, x, c), c), (ks, vs), (b.params, b.x0))


VARIANTS: tuple[str, ...] = tuple(REGISTRY)


def _baseline_steps(b: Bench) -> dict[str, Step]:
    """plain_jax, tuned_jax: the same model in plain JAX over a memmap of the same KV."""
    from jax_tpusync.step.unit import staged_block_len

    steps = {}
    for name in b.args.baselines:
        dec = baselines.MemmapDecode(
            name,
            os.path.join(b.tmpdir, f"{name}.kv"),
            b.resident_kv,
            b.context_lengths,
            b.params,
            b.x0,
            b.shape,
            block_len=staged_block_len(b.spec),  # The rows per slice resident reads.
            background=name == "tuned_jax",
            loader_cpus=b.worker_cpus,
            drop_page_cache=baselines.page_cache(b.args) == "drop",
        )
        b.closers.append(dec)
        steps[name] = Step(lambda st, d=dec: (d.step(), st), None, (), dec.prepare)
    return steps
