"""jax_tpusync: stream a KV cache through host DRAM and storage tiers inside jitted decode.

The public surface:

* :func:`kv_cache` is the entry point: given a :class:`~jax_tpusync.core.config.CacheConfig`
  (or its keywords) it makes the cache that serves the model, each of which keeps the
  :class:`KVCache` protocol of host-side calls.
* :class:`OffloadedKVCache` describes a cache kept in a host tier (DRAM or a file);
  ``cache.init()`` returns the :class:`KVState` a jitted step carries and donates.
  :class:`ShardedKVCache` is one split over a device mesh; :class:`HybridKVCache` one for
  a model whose layers differ in KV geometry or sliding window (sliding and global layers,
  layers reading another's KV), its state a :class:`HybridState`.
* :class:`HostPoolKVCache` is the TPU data path: its pool is a ``pinned_host`` JAX array
  that the step carries (state: :class:`PoolState`), each layer's units copied to the
  device one unit ahead by the compiled step itself, no custom call (it runs, and is
  tested, on the CPU backend too). :class:`BatchShardedPoolKVCache` is one whose slots are
  split over a mesh's ``batch_axis``.
* :func:`prefetching_attention` replaces a model's attention call: it attends over the
  offloaded cache while the next layer's KV streams in.
* :class:`Engine` is the async transfer engine underneath; :mod:`jax_tpusync.runtime.ops` has the
  in-graph start/wait/write-back ops for building other prefetch schedules.
* ``OffloadedKVCache(tier_dtype="int8" | "float8_e4m3fn")`` keeps quantized rows (codes
  and per-token scales, :mod:`jax_tpusync.core.quantize`) on the tier and in staging.
* :func:`compare_sparse` runs a model's own decode step dense and sparse (sparse
  layer-ahead decode, :mod:`jax_tpusync.sparse`) over its own context and reports per-layer
  recall, the logits' difference and next-token agreement.
* :func:`jax_tpusync.runtime.xla_cpu.use_memory_scheduler` (first thing in a script) keeps XLA's
  CPU backend from converting every layer's 16-bit weights at the start of a one-program
  step.
"""

from jax_tpusync import _moved
from jax_tpusync.runtime import libtpu

_moved.install()  # the module paths from before 0.2.0 (CHANGELOG.md)
libtpu.quiet_on_cpu()  # Before any backend starts: libtpu on a host without a TPU.

from jax_tpusync import tpu as tpu  # jax_tpusync.tpu.plan_step: planning for a TPU
from jax_tpusync.attention import prefetching_attention, resident_attention
from jax_tpusync.caches.hybrid.cache import HybridKVCache
from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.caches.offloaded.mesh import ShardedKVCache
from jax_tpusync.caches.pool.batch_shards import BatchShardedPoolKVCache
from jax_tpusync.caches.pool.cache import HostPoolKVCache
from jax_tpusync.caches.protocol import KVCache
from jax_tpusync.core.hybrid_state import HybridState
from jax_tpusync.core.pool_state import PoolState
from jax_tpusync.core.quantize import QuantizedRows
from jax_tpusync.core.state import KVState
from jax_tpusync.factory import kv_cache
from jax_tpusync.quality import SparseComparison, compare_sparse
from jax_tpusync.runtime.engine import (
    Engine,
    EngineConfig,
    TierDataLossError,
    TierInfo,
    Timeline,
    TpusyncError,
    split_cpus,
)
from jax_tpusync.runtime.xla_cpu import setup as setup_cpu

__all__ = [
    "BatchShardedPoolKVCache",
    "Engine",
    "EngineConfig",
    "HybridKVCache",
    "HybridState",
    "HostPoolKVCache",
    "KVCache",
    "KVState",
    "OffloadedKVCache",
    "PoolState",
    "QuantizedRows",
    "ShardedKVCache",
    "TierDataLossError",
    "SparseComparison",
    "TierInfo",
    "Timeline",
    "TpusyncError",
    "prefetching_attention",
    "resident_attention",
    "setup_cpu",
    "split_cpus",
    "kv_cache",
    "compare_sparse",
]
__version__ = "0.2.0"
