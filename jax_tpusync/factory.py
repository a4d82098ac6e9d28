"""One entry point: :func:`kv_cache` makes the right cache for a model's configuration.

Which class serves a model follows from what the model is and where it runs:

* **On the TPU backend** the data path is :class:`~jax_tpusync.HostPoolKVCache` (a pool in
  ``pinned_host`` memory carried by the step). It serves a cache of one KV geometry, on
  one device or with its heads split over a mesh's ``kv_heads_axis`` (with its slots split
  over ``batch_axis`` too: a :class:`~jax_tpusync.BatchShardedPoolKVCache`); layers of one
  sliding window keep a ring per slot (``max_step_tokens``, as below) unless
  ``bound_windows=False``. A hybrid model (the cases below) gets a
  :class:`~jax_tpusync.HybridKVCache` whose groups are host pools (``host_pool=True``).
  Anything else (``engine=``, the features the pool refuses by name) is refused naming
  what is not supported on TPU yet.
* **Layers of different KV geometry** (``num_kv_heads`` / ``head_dim`` per layer), layers
  that read another's KV (``kv_sharing``), or ``window_cache_blocks``: a
  :class:`~jax_tpusync.HybridKVCache`.
* **Sliding windows** (``sliding_window``): bounded unless ``bound_windows=False``. Layers
  of one window keep a ring per slot in one cache
  (:class:`~jax_tpusync.OffloadedKVCache` with ``max_step_tokens``); layers of different
  windows (Gemma 3: five sliding layers per global one) a hybrid cache, one group per kind
  of layer, its sliding groups bounded. A configuration that a bounded cache cannot serve
  (a persistent tier, ``resident=True``, ``num_blocks`` over mixed windows) is refused,
  naming the keyword and ``bound_windows=False``: a windowed model never gets a cache that
  keeps every position without asking for it.
* Otherwise one device's :class:`~jax_tpusync.OffloadedKVCache`, and with ``mesh=`` each
  of them is its mesh variant (:class:`~jax_tpusync.ShardedKVCache`, a hybrid cache's
  groups sharded).

``max_step_tokens`` (the most rows a step appends to a slot) sizes the rings; where a cache
keeps only windows it defaults to :data:`~jax_tpusync.caches.hybrid.cache.DEFAULT_STEP_TOKENS` (512), or
``max_len`` if smaller.
"""

from __future__ import annotations

import logging
from typing import Any

from jax_tpusync.caches.hybrid.cache import DEFAULT_STEP_TOKENS, HybridKVCache
from jax_tpusync.caches.offloaded.cache import OffloadedKVCache
from jax_tpusync.caches.offloaded.mesh import ShardedKVCache
from jax_tpusync.caches.pool.batch_shards import BatchShardedPoolKVCache
from jax_tpusync.caches.pool.cache import HostPoolKVCache
from jax_tpusync.caches.protocol import KVCache
from jax_tpusync.core.config import CacheConfig, is_int, normalize_windows, with_config
from jax_tpusync.runtime import backend
from jax_tpusync.runtime.engine import Engine, EngineConfig

logger = logging.getLogger(__name__)

__all__ = ["backend_name", "kv_cache"]


def backend_name() -> str:
    """The JAX backend the caches are for (one function, so that a test can stand in for
    a TPU)."""
    return backend.name()


def kv_cache(
    config: CacheConfig | None = None,
    /,
    *,
    mesh: Any = None,
    kv_heads_axis: str | None = None,
    batch_axis: str | None = None,
    engine: Engine | EngineConfig | None = None,
    kv_sharing: Any = None,
    bound_windows: bool | None = None,
    window_cache_blocks: int | None = None,
    **keywords: Any,
) -> KVCache:
    """The cache of a configuration (see the module for which class serves which model).

    Args:
      config: a :class:`~jax_tpusync.core.config.CacheConfig`, or None: the keywords of
        :meth:`~jax_tpusync.core.config.CacheConfig.from_kwargs` describe it (a keyword the
        config holds too is refused by name). Per-layer ``num_kv_heads`` / ``head_dim``
        are keywords only (a CacheConfig holds one geometry).
      mesh, kv_heads_axis, batch_axis: a device mesh and the axes the KV heads and the
        sequences are split over (see :class:`~jax_tpusync.ShardedKVCache`).
      engine: an :class:`Engine` or :class:`EngineConfig` (not on TPU: the host pool
        needs no engine).
      kv_sharing: per layer, None or the earlier layer whose KV it reads (a hybrid cache).
      bound_windows: None (default) or True: sliding layers keep only their window; False:
        every position (the only choice for a persistent or resident cache of a windowed
        model).
      window_cache_blocks: a hybrid cache's spare blocks per bounded sliding group.
      **keywords: the rest of the configuration.

    Raises:
      ValueError: a configuration no cache here serves, naming the keyword and the way out;
        or any refusal of the cache's own constructor.
      TypeError: ``config`` of another type.
    """
    if bound_windows is not None and not isinstance(bound_windows, bool):
        raise ValueError(f"bound_windows={bound_windows!r} must be None, True or False")
    keywords = with_config(config, keywords)
    per_layer = [
        name
        for name in ("num_kv_heads", "head_dim")
        if isinstance(keywords.get(name), (list, tuple))
    ]
    windows = _windows_of(keywords)
    windowed = any(w is not None for w in windows)
    mixed = windowed and len(set(windows)) > 1
    hybrid_because = (
        [f"per-layer {name}" for name in per_layer]
        + (["kv_sharing"] if kv_sharing is not None else [])
        + (["window_cache_blocks"] if window_cache_blocks is not None else [])
    )
    bounded = windowed and bound_windows is not False
    step_tokens = keywords.get("max_step_tokens")
    if bound_windows is False and step_tokens is not None and windowed and not hybrid_because:
        raise ValueError(
            f"max_step_tokens={step_tokens!r} keeps only each sliding layer's window, "
            f"bound_windows=False every position: drop one of them"
        )
    if backend_name() == "tpu":
        if bounded and not hybrid_because:
            _check_boundable(keywords, mixed)
        if bounded:  # Each window a pool of rings.
            _default_step_tokens(keywords)
        if hybrid_because or (mixed and bounded):  # A HybridKVCache of host-pool groups.
            why = ", ".join(hybrid_because) or "layers of different sliding windows"
            logger.info("kv_cache: a HybridKVCache of host-pool groups (%s)", why)
            _default_step_tokens(keywords)  # Its reading layers' rows too.
            return HybridKVCache(
                host_pool=True,
                engine=engine,
                kv_sharing=kv_sharing,
                bound_windows=bound_windows is not False,
                window_cache_blocks=window_cache_blocks,
                **({} if mesh is None else dict(mesh=mesh, kv_heads_axis=kv_heads_axis)),
                batch_axis=batch_axis,
                **keywords,
            )
        return _tpu_cache(mesh, kv_heads_axis, batch_axis, engine, keywords)
    mesh_args = (
        {}
        if mesh is None
        else dict(mesh=mesh, kv_heads_axis=kv_heads_axis, batch_axis=batch_axis)
    )
    if mesh is None and (kv_heads_axis is not None or batch_axis is not None):
        raise ValueError(
            f"kv_heads_axis={kv_heads_axis!r} and batch_axis={batch_axis!r} name axes of a "
            f"mesh: pass mesh= too"
        )
    # A hybrid cache of layers that differ in geometry checks these itself, by name; the
    # checks here are for a model that one geometry describes.
    if bounded and not hybrid_because:
        _check_boundable(keywords, mixed)
    if bounded:
        _default_step_tokens(keywords)
    if hybrid_because or (mixed and bounded):
        why = ", ".join(hybrid_because) or "layers of different sliding windows"
        logger.info("kv_cache: a HybridKVCache (%s)", why)
        return HybridKVCache(
            engine=engine,
            kv_sharing=kv_sharing,
            bound_windows=bound_windows is not False,
            window_cache_blocks=window_cache_blocks,
            **mesh_args,
            **keywords,
        )
    if step_tokens is not None and not windowed:
        raise ValueError(
            f"max_step_tokens={step_tokens!r} sizes the rings of sliding layers (and the rows "
            f"kept for layers that read another's KV): this model has neither (no "
            f"sliding_window, no kv_sharing); drop it"
        )
    cls = OffloadedKVCache if mesh is None else ShardedKVCache
    return cls(engine=engine, **mesh_args, **keywords)


def _default_step_tokens(keywords: dict) -> None:
    """Sets ``max_step_tokens`` of a bounded cache where the keywords leave it out."""
    max_len = keywords.get("max_len")
    if keywords.get("max_step_tokens") is None and is_int(max_len) and max_len >= 1:
        # A step appends at most max_len rows: a larger ring would hold nothing more.
        keywords["max_step_tokens"] = min(DEFAULT_STEP_TOKENS, int(max_len))


def _windows_of(keywords: dict) -> tuple[int | None, ...]:
    """Per-layer windows of the keywords (none, where ``num_layers`` is not yet a valid
    count: the cache's constructor names that)."""
    num_layers = keywords.get("num_layers")
    if not is_int(num_layers) or num_layers < 1:
        return ()
    return normalize_windows(keywords.get("sliding_window"), int(num_layers))


def _check_boundable(keywords: dict, mixed: bool) -> None:
    """Refuses, by name, a keyword that rules out the bounded cache a windowed model gets,
    pointing at ``bound_windows=False`` (never a silent fall back to every position)."""
    blockers = []
    for name in ("shm_name", "file_name"):
        if keywords.get(name) is not None:
            blockers.append((name, "a ring overwrites committed rows, so no commit survives"))
    if keywords.get("resident") is True:
        blockers.append(("resident", "a resident cache copies every position to the device"))
    if mixed:
        for name in ("num_blocks", "resident"):
            if keywords.get(name) not in (None, False):
                blockers.append((name, "each group of the hybrid cache sizes its own"))
    if blockers:
        name, why = blockers[0]
        raise ValueError(
            f"{name}={keywords[name]!r} rules out keeping only the sliding layers' windows "
            f"({why}): pass bound_windows=False to keep every position, or drop {name}"
        )


def _tpu_cache(
    mesh: Any,
    kv_heads_axis: str | None,
    batch_axis: str | None,
    engine: Any,
    keywords: dict,
) -> HostPoolKVCache | BatchShardedPoolKVCache:
    """The TPU data path's cache of one KV geometry (a cache of one pool per batch shard
    with ``batch_axis``), or a refusal naming what TPU does not have yet."""
    if engine is not None:
        raise ValueError(
            "not supported on the TPU backend yet, whose cache is a HostPoolKVCache: engine= "
            "(the host pool moves its bytes in the step, with no engine)"
        )
    if mesh is None and kv_heads_axis is None and batch_axis is None:
        return HostPoolKVCache(**keywords)
    if batch_axis is not None and mesh is not None:  # One pool cache per batch shard.
        return BatchShardedPoolKVCache(
            mesh=mesh, kv_heads_axis=kv_heads_axis, batch_axis=batch_axis, **keywords
        )
    return HostPoolKVCache(
        mesh=mesh, kv_heads_axis=kv_heads_axis, batch_axis=batch_axis, **keywords
    )
