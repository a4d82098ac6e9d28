"""Plain-JAX decode baselines for ``bench decode``: the step a user writes without this library.

Both run the ``resident`` variant's model (the same parameters and per-layer math, through
:func:`.tiny_decoder.step` on one layer at a time) over the same KV, and append the new token's K/V
to it each step, like a real decode:

* ``plain_jax`` (``--baselines plain``): the KV lives in a NumPy memmap file
  ``[layers, K|V, batch, max_len, kv_heads, head_dim]`` in the benchmark's temporary
  directory (on both tiers; see "page cache" below). Per layer, on the Python side: read the
  layer's K/V out of the memmap (``np.array``, a copy), ``jax.device_put`` it, call one
  jitted layer function (projections, attention over the whole cache plus the new token,
  output projection, MLP), and write the new token's K/V back into the memmap. The
  write-back waits for the layer's compute, so reads and compute never overlap.
* ``tuned_jax`` (``--baselines tuned``): the same, with the next layer's read +
  ``device_put`` on a background thread (``concurrent.futures``, one worker pinned to the
  engine's CPUs like the ``plain`` reader) while the current layer computes; during the
  last layer it reads the next step's layer 0, so it prefetches across steps as
  ``prefetch`` does.

The attention is a ``fori_loop`` of :func:`kernels.reference.chunk_attention_reference` over
slices of the cache of as many rows as the resident step reads at a time
(``step.unit.block_len_for``: 512 rows of 8 x 64 on a CPU, a whole unit elsewhere), keys at or
past ``lengths`` masked, merged online with the new token's. So the compute costs about what
the resident step's does and the rows differ in how the KV moves (per layer at 32K tokens on
XLA's CPU backend: about 170 ms for one softmax over all keys, 45 ms in 4096-row slices, 30
ms in 512-row slices, the resident step 22 ms). The resident step
walks units and blocks and gathers its rows, so ``max_abs_err_plain_jax`` /
``max_abs_err_tuned_jax`` (against ``resident``, after the first and after the last step) are
float rounding of two code paths, not necessarily zero. Each step reads
``max_len`` rows per layer (the context plus the few tokens the run appends), the same
bytes as the other variants up to those rows.

Page cache: on the file tier the memmap's pages are dropped before each step (``msync``,
``madvise(MADV_DONTNEED)``, ``posix_fadvise(POSIX_FADV_DONTNEED)``, outside the timed step),
so its reads come from the disk, as the engine's ``O_DIRECT`` reads do and as they would
for a KV larger than DRAM; on the host tier the file stays in the page cache, so its reads
are DRAM-to-DRAM copies (``--baseline-page-cache`` overrides either). On a CPU,
``jax.device_put`` of a NumPy array aliases it (no copy), so the memmap read is the
transfer; on an accelerator it adds the host-to-device copy.

``memcpy_ms`` (:func:`memcpy_ms`): one ``np.copyto`` of a step's KV bytes, DRAM to DRAM, a
floor for any host tier.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import mmap
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_tpusync.bench import tiny_decoder
from jax_tpusync.bench.common import XLA_CPU_ALIGNMENT

# --baselines values -> variant names (the decode bench has a ``plain`` variant already: the
# platform's O_DIRECT reader).
CHOICES = {"plain": "plain_jax", "tuned": "tuned_jax"}
VARIANTS = tuple(CHOICES.values())
NOTES = {
    "plain_jax": "memmap read + device_put per layer, then its jitted layer; no overlap",
    "tuned_jax": "the same, next layer's read + device_put on a background thread",
}
# The largest copy memcpy_ms makes; larger steps are timed on this many bytes and scaled.
MEMCPY_MAX_BYTES = 1 << 30


def parse_baselines(text: str) -> list[str]:
    """``"plain,tuned"`` -> ``["plain_jax", "tuned_jax"]`` (argparse ``type``)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in CHOICES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown baseline(s) {unknown}; choose from {','.join(CHOICES)}"
        )
    return [CHOICES[n] for n in dict.fromkeys(names)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--baselines",
        type=parse_baselines,
        default=[],
        metavar="plain,tuned",
        help="also time plain-JAX decode steps over a memmap file: plain (read + device_put "
        "between layer calls) and/or tuned (the next layer's on a background thread); "
        "rows t_plain_jax_ms, t_tuned_jax_ms (default: none)",
    )
    p.add_argument(
        "--baseline-page-cache",
        choices=("drop", "keep"),
        default=None,
        help="the baselines' memmap pages before each step: drop (read from the disk) or "
        "keep (read from DRAM); default drop on the file tier, keep on the host tier",
    )


def page_cache(args: argparse.Namespace) -> str:
    """``--baseline-page-cache``, or its default: drop on the file tier, keep on the host's."""
    return args.baseline_page_cache or ("drop" if args.tier == "file" else "keep")


class MemmapDecode:
    """One plain-JAX decoder over a memmap'd KV cache (``plain_jax`` or ``tuned_jax``).

    ``step()`` runs one decode step from ``x0`` and returns its output ``[B, 1, d_model]``;
    ``prepare()`` (untimed) drops the memmap's pages when ``drop_page_cache``.
    """

    def __init__(
        self,
        name: str,
        file_path: str,
        kv_layers: Sequence[tuple[np.ndarray, np.ndarray]],  # per layer [B, max_len, H, D]
        lengths: np.ndarray,  # int32[B]: cached tokens per sequence
        params: list[dict[str, Any]],
        x0: Any,  # [B, 1, d_model]
        shape: tiny_decoder.Shape,
        *,
        block_len: int,
        background: bool,
        loader_cpus: Sequence[int] = (),
        drop_page_cache: bool = False,
    ):
        import jax
        import jax.numpy as jnp

        from jax_tpusync.kernels import reference as kref

        self.name, self.params, self.x0 = name, params, x0
        self.lengths = np.array(lengths, np.int32)
        self.drop_page_cache = drop_page_cache
        batch, max_len, heads, head_dim = kv_layers[0][0].shape
        dtype = kv_layers[0][0].dtype
        # 16-bit floats are kept and moved as uint16 words: XLA's CPU backend slices those in
        # place, but copies a whole bfloat16 array around a dynamic slice (as resident does).
        words = dtype.itemsize == 2
        self.kv = np.memmap(
            file_path,
            dtype=np.uint16 if words else dtype,
            mode="w+",
            shape=(len(kv_layers), 2, batch, max_len, heads, head_dim),
        )
        for layer, (k, v) in enumerate(kv_layers):
            self.kv[layer, 0], self.kv[layer, 1] = k.view(self.kv.dtype), v.view(self.kv.dtype)
        self.kv.flush()  # Written back now, not by the kernel in the middle of a timed step.
        self.layer_bytes = self.kv[0].nbytes
        scale = 1.0 / math.sqrt(head_dim)

        full_units, tail = divmod(max_len, block_len)

        def cached_attention(q, kv, lengths):
            """q [B, 1, Hq, D] over the cached rows (< lengths) of kv [2, B, max_len, H, D],
            ``block_len`` rows at a time (their f32 copies stay in cache on a CPU); returns
            the f32 partial (out [B, 1, Hq, D], lse [B, 1, Hq])."""

            def rows(lo, n):
                kv_rows = jax.lax.dynamic_slice_in_dim(kv, lo, n, axis=2)
                if words:
                    kv_rows = jax.lax.bitcast_convert_type(kv_rows, dtype)
                return kv_rows[0], kv_rows[1]

            def unit(lo, n, carry):
                valid = jnp.clip(lengths - lo, 0, n)
                o, lse = kref.chunk_attention_reference(
                    q, *rows(lo, n), jnp.full_like(lengths, lo), valid, lengths, scale=scale
                )
                return kref.merge_partials(*carry, o, lse)

            carry = (
                jnp.zeros(q.shape, jnp.float32),
                jnp.full(q.shape[:3], -jnp.inf, jnp.float32),
            )
            carry = jax.lax.fori_loop(
                0, full_units, lambda u, c: unit(u * block_len, block_len, c), carry
            )
            if tail:  # The last rows, a static slice (a dynamic one would be shifted back).
                carry = unit(full_units * block_len, tail, carry)
            return carry

        def layer_step(p, x, kv, lengths):
            """x [B, 1, d_model], kv [2, B, max_len, H, D], lengths int32[B] ->
            (x, k_new, v_new), the new token's K/V [B, 1, H, D]."""

            def attend(_, q, k, v, cache):
                k, v = k.astype(dtype), v.astype(dtype)
                o, lse = cached_attention(q, kv, lengths)
                o_new, lse_new = kref.chunk_attention_reference(
                    q, k, v, lengths, jnp.ones_like(lengths), lengths, scale=scale
                )
                o, _ = kref.merge_partials(o, lse, o_new, lse_new)
                return o.astype(q.dtype), (k, v)

            x, (k_new, v_new) = tiny_decoder.step([p], shape, x, None, attend)
            return x, k_new, v_new

        self.layer_jit = jax.jit(layer_step)
        self.pool = None
        self.pending: concurrent.futures.Future | None = None
        if background:

            def pin():
                if loader_cpus:
                    os.sched_setaffinity(0, loader_cpus)  # 0: this thread only.

            self.pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=name, initializer=pin
            )

    def _load(self, layer: int):
        """The layer's K/V read out of the memmap and put on the device: [2, B, max_len, H, D]."""
        import jax

        # The read (from the page cache or the disk), into a fresh buffer aligned as XLA's CPU
        # buffers are, which device_put then aliases: one copy on a CPU, as on an accelerator
        # (where device_put is the copy). From NumPy's own allocation it would copy twice.
        kv = _xla_aligned_empty(self.kv[layer].shape, self.kv.dtype)
        np.copyto(kv, self.kv[layer])
        return jax.block_until_ready(jax.device_put(kv))

    def _write_back(self, layer: int, x, k_new, v_new) -> None:
        """Appends the new token's K/V [B, 1, H, D] at ``lengths``; waits for the layer."""
        import jax

        jax.block_until_ready(x)
        k_new = np.asarray(k_new).view(self.kv.dtype)
        v_new = np.asarray(v_new).view(self.kv.dtype)
        for b, pos in enumerate(self.lengths):
            self.kv[layer, 0, b, pos] = k_new[b, 0]
            self.kv[layer, 1, b, pos] = v_new[b, 0]

    def prepare(self) -> None:
        """Drops the memmap's pages (``drop_page_cache``), except a layer read ahead already."""
        if not self.drop_page_cache:
            return
        mapping = self.kv._mmap  # np.memmap's mmap.mmap (offset 0: same offsets as the file).
        mapping.flush()  # Dirty rows to the file: fadvise drops clean pages only.
        start = self.layer_bytes if self.pending is not None else 0
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        if start < len(mapping):
            mapping.madvise(mmap.MADV_DONTNEED, start, len(mapping) - start)
            fd = os.open(self.kv.filename, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, start, len(mapping) - start, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def step(self):
        """One decode step over every layer; returns x [B, 1, d_model]."""
        x = self.x0
        layers = len(self.params)
        if self.pool is None:
            for layer in range(layers):
                kv = self._load(layer)
                x, k_new, v_new = self.layer_jit(self.params[layer], x, kv, self.lengths)
                self._write_back(layer, x, k_new, v_new)
        else:
            if self.pending is None:
                self.pending = self.pool.submit(self._load, 0)
            for layer in range(layers):
                kv = self.pending.result()
                # Layer l + 1's rows do not depend on layer l's write-back, and the next
                # step's layer 0 has had its row written (at layer 0 of this step).
                self.pending = self.pool.submit(self._load, (layer + 1) % layers)
                x, k_new, v_new = self.layer_jit(self.params[layer], x, kv, self.lengths)
                self._write_back(layer, x, k_new, v_new)
        self.lengths += 1
        return x

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = self.pending = None
        mapping = getattr(self.kv, "_mmap", None)
        del self.kv
        if mapping is not None:
            mapping.close()


def _xla_aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized array starting at a multiple of XLA's CPU buffer alignment."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + XLA_CPU_ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % XLA_CPU_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def memcpy_ms(nbytes: int, repeats: int = 5) -> tuple[float, int]:
    """Median ms of one ``np.copyto`` of ``nbytes`` (DRAM to DRAM, both buffers faulted in
    first), and the bytes actually copied: past :data:`MEMCPY_MAX_BYTES` the copy is timed
    on that many and scaled linearly (a copy that size runs at the memory's stream rate)."""
    n = max(1, min(nbytes, MEMCPY_MAX_BYTES))
    src = np.ones(n, np.uint8)
    dst = np.zeros(n, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3 * nbytes / n, n


def ratios(res: dict[str, Any]) -> dict[str, float | None]:
    """``prefetch_over_best_jax``, ``library_over_best_jax`` (the faster of the streamed
    and the resident-mode step, what the library gives this context) and
    ``host_over_floor`` of a decode row (None: missing)."""
    t_pf = res["t_prefetch_ms"]
    jax_times = [res.get(f"t_{n}_ms") for n in VARIANTS]
    jax_times = [t for t in jax_times if t]
    t_lib = min(t for t in (t_pf, res.get("t_resident_mode_ms")) if t)
    t_res, t_copy = res.get("t_resident_ms"), res.get("memcpy_ms")
    return {
        "prefetch_over_best_jax": t_pf / min(jax_times) if jax_times else None,
        "library_over_best_jax": t_lib / min(jax_times) if jax_times else None,
        "host_over_floor": t_pf / max(t_res, t_copy or 0.0) if t_res else None,
    }


def plot_sweep(rows: Sequence[dict[str, Any]], out: str, names: Sequence[str]) -> None:
    """Log-log step time (ms) vs context, one line per variant in ``names`` present in
    ``rows`` (``t_<name>_ms``), plus the memcpy floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    contexts = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ms = [r.get(f"t_{name}_ms") for r in rows]
        if any(ms):
            style = "--" if name in VARIANTS else "-"
            ax.plot(contexts, [m or math.nan for m in ms], style, marker="o", label=name)
    if any(r.get("memcpy_ms") for r in rows):
        copy = [r.get("memcpy_ms") or math.nan for r in rows]
        ax.plot(contexts, copy, ":", color="gray", label="memcpy of the step's KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [tokens(c) for c in contexts])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step (ms, median)")
    r0 = rows[0]
    ax.set_title(
        f"decode step vs context: {r0['tier']} tier, {r0['layers']} layers x "
        f"{r0['kv_heads']} kv heads x {r0['head_dim']} ({r0['dtype']}), batch {r0['batch']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def tokens(n: int) -> str:
    """4096 -> "4K", 1048576 -> "1M" (other counts as they are)."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def require_matplotlib() -> None:
    """Fails before any measuring when ``--plot`` cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'jax-tpusync[bench]' (or matplotlib)"
        ) from None
