"""Measures what persistence costs on a file tier: the first commit (hashing all rows),
an incremental commit after one decode-sized append, and a full verify.

    python examples/verify_cost.py --path DIR [--mib 256] [--repeats 3]

The file is created in DIR and deleted at the end. The first verify after writing may be
served partly from the page cache where O_DIRECT is refused; the tier's mode is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import xxhash

import jax_tpusync as tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="directory of the file tier (default: cwd)")
    parser.add_argument("--mib", type=int, default=256, help="KV bytes in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    layers, heads, head_dim = 4, 8, 64  # bf16: 1 KiB per token row.
    row_bytes = heads * head_dim * 2
    max_len = (args.mib << 20) // (layers * 2 * row_bytes)
    directory = tempfile.mkdtemp(prefix="tpusync-verify-", dir=args.path or os.getcwd())
    try:
        cache = tps.OffloadedKVCache(
            num_layers=layers,
            batch=1,
            max_len=max_len,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=jnp.bfloat16,
            tier="file",
            path=directory,
            file_name="kv",
            staging_bytes=8 << 20,
        )
        info = cache.engine.tier_info(cache.tier)
        print(f"tier: {info.description}; {cache.kv_bytes / 2**20:.0f} MiB of KV")
        rng = np.random.default_rng(0)
        state = cache.init()
        n = max_len - 2
        for layer in range(layers):
            kv = rng.standard_normal((2, 1, n, heads, head_dim)).astype(jnp.bfloat16)
            state = cache.load(state, layer, kv[0], kv[1])
        t0 = time.perf_counter()
        state = cache.commit(state)
        first = time.perf_counter() - t0
        print(f"first commit (fsync + hash {n * layers * 2 * row_bytes / 1e9:.2f} GB): "
              f"{first:.2f} s")
        # One more committed row per region, as after a decode step (whose write-backs the
        # engine made; here the row is already in the file): only that row is hashed.
        state = state.replace(lengths=state.lengths + 1)
        t0 = time.perf_counter()
        state = cache.commit(state)
        print(f"commit after a decode step (+1 row per region): "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
        # load() rewriting a committed row: its whole chunk is hashed again.
        for layer in range(layers):
            state = cache.load(state, layer, kv[0][:, :1], kv[1][:, :1], start=n - 1)
        t0 = time.perf_counter()
        state = cache.commit(state)
        print(f"commit after load() rewrote a row per region: "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
        rates = []
        for _ in range(args.repeats):
            result = cache.verify()
            rates.append(result.gb_per_s)
            print(f"verify: {result.bytes / 2**20:.0f} MiB in {result.seconds:.3f} s = "
                  f"{result.gb_per_s:.2f} GB/s")
        print(f"verify median: {statistics.median(rates):.2f} GB/s")
        buf = np.ones(32 << 20, np.uint8)
        t0 = time.perf_counter()
        for _ in range(8):
            xxhash.xxh3_64_intdigest(buf)
        rate = 8 * buf.nbytes / (time.perf_counter() - t0) / 1e9
        print(f"xxh3_64 alone, in memory: {rate:.1f} GB/s")
        cache.close(state)
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


if __name__ == "__main__":
    main()
