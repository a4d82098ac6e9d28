"""A hybrid cache's arguments checked, and each layer group's cache arguments planned.

:class:`~jax_tpusync.caches.hybrid.cache.HybridKVCache` makes one cache per layer group
(:func:`jax_tpusync.core.hybrid_state.plan_groups`). Everything about those caches that follows
from the hybrid cache's own arguments is decided here, before anything is made: the
arguments' checks (:func:`check_arguments`), and per group (:func:`group_arguments`) its
blocks (a bounded sliding group's rings, and its cached windows), its share of the device
budget (:func:`staging_shares`), its persistence names and its prefix salt
(:func:`group_salt`), each one-device group's configuration checked as its cache will
check it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_tpusync.core import layout, window_ring
from jax_tpusync.core.config import (
    CacheConfig,
    check_prefix_salt,
    default_block_tokens,
    is_int,
)
from jax_tpusync.core.hybrid_state import LayerGroups
from jax_tpusync.runtime.engine import Engine, EngineConfig

__all__ = [
    "DEFAULT_STEP_TOKENS",
    "HYBRID_KEYWORDS",
    "check_arguments",
    "check_host_pool_arguments",
    "group_arguments",
    "group_salt",
    "host_pool_groups",
    "staging_shares",
]

# Rows a step may add per slot unless told (a decode step adds 1, a prefill chunk its size).
DEFAULT_STEP_TOKENS = 512


def check_arguments(
    *,
    num_layers: Any,
    batch: Any,
    max_len: Any,
    max_step_tokens: Any,
    bound_windows: Any,
    window_cache_blocks: Any,
    staging_bytes: Any,
    engine: Any,
    shm_name: Any,
    file_name: Any,
    mesh: Any,
    kv_heads_axis: Any,
    batch_axis: Any,
    options: dict,
    host_pool: Any = False,
) -> np.dtype:
    """Checks a hybrid cache's own arguments (each group's are checked by
    :func:`group_arguments`); returns the KV dtype.

    Raises:
      ValueError: an argument out of its range, named with it; a combination not
        supported (persistence on a mesh; a per-group keyword; what host-pool groups
        do not do yet).
      TypeError: ``engine`` of another type.
    """
    persistent = shm_name is not None or file_name is not None
    if not isinstance(host_pool, (bool, np.bool_)):
        raise ValueError(f"host_pool={host_pool!r} must be a bool (True or False)")
    if host_pool:
        check_host_pool_arguments(engine, batch_axis)
    if mesh is not None and persistent:
        raise ValueError(
            "a persistent hybrid cache on a mesh is not supported yet (its groups' "
            "shards would need one common commit): drop shm_name / file_name or mesh"
        )
    if mesh is None and (kv_heads_axis is not None or batch_axis is not None):
        raise ValueError(
            f"kv_heads_axis={kv_heads_axis!r} and batch_axis={batch_axis!r} name axes of "
            f"a mesh: pass mesh= too"
        )
    for name in ("num_blocks", "resident", "max_step_tokens_per_group"):
        if name in options:
            raise ValueError(f"{name} is per group in a hybrid cache and cannot be given")
    for name, value in (("num_layers", num_layers), ("batch", batch), ("max_len", max_len)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if not is_int(max_step_tokens) or not 1 <= max_step_tokens <= max_len:
        raise ValueError(
            f"max_step_tokens={max_step_tokens!r} must be an int in [1, max_len={max_len}]"
        )
    if not isinstance(bound_windows, (bool, np.bool_)):
        raise ValueError(f"bound_windows={bound_windows!r} must be a bool (True or False)")
    if window_cache_blocks is not None and (
        not is_int(window_cache_blocks) or window_cache_blocks < 0
    ):
        raise ValueError(f"window_cache_blocks={window_cache_blocks!r} must be None or an int >= 0")
    if not is_int(staging_bytes) or staging_bytes < 1:
        raise ValueError(f"staging_bytes={staging_bytes!r} must be a positive int")
    if engine is not None and not isinstance(engine, (Engine, EngineConfig)):
        raise TypeError(
            f"engine must be an Engine, an EngineConfig or None; got {type(engine).__name__}"
        )
    for name, value in (("shm_name", shm_name), ("file_name", file_name)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name}={value!r} must be a non-empty str or None")
    check_prefix_salt(options.get("prefix_salt"))  # Each group's salt is built from it.
    block_tokens = options.get("block_tokens")
    if block_tokens is not None and (not is_int(block_tokens) or block_tokens < 1):
        raise ValueError(f"block_tokens={block_tokens!r} must be a power of two (1, 2, 4, ...)")
    try:
        return np.dtype(options.get("dtype", jnp.bfloat16))
    except TypeError:
        raise ValueError(
            f"dtype={options.get('dtype')!r} must be bfloat16, float16 or float32"
        ) from None


def check_host_pool_arguments(engine: Any, batch_axis: Any) -> None:
    """Refuses, by name and before anything is made, what a hybrid cache whose groups are
    host pools (:class:`~jax_tpusync.caches.pool.cache.HostPoolKVCache`) does not do yet.

    Raises:
      ValueError: ``engine`` given (a pool moves its bytes in the step, with no engine);
        ``batch_axis`` (a pool splits the heads over a mesh, not the slots).
    """
    if engine is not None:
        raise ValueError(
            f"engine={type(engine).__name__}: host-pool groups move their bytes in the step, "
            f"with no engine; drop engine= (host_pool=True)"
        )
    if batch_axis is not None:
        raise ValueError(
            f"batch_axis={batch_axis!r}: host-pool groups split the KV heads over a mesh "
            f"(kv_heads_axis), not the slots (host_pool=True)"
        )


def group_arguments(
    plan: LayerGroups,
    *,
    batch: int,
    max_len: int,
    max_step_tokens: int,
    bound_windows: bool,
    window_cache_blocks: int | None,
    staging_bytes: int,
    shm_name: str | None,
    file_name: str | None,
    options: dict,
    mesh: Any = None,
    axes: tuple[str | None, str | None] = (None, None),
    host_pool: bool = False,
) -> list[dict]:
    """Per group of ``plan``, its cache's keyword arguments (but the engine), each
    group's configuration checked as its cache will check it (one device's: a mesh
    group's shards check theirs as they open; a host-pool group's the configuration
    every cache shares, the pool checking its own layout as it is made). With a mesh,
    each group's KV heads are split over its ``axes`` (``kv_heads_axis``, ``batch_axis``).

    Raises:
      ValueError: a group's configuration out of range, or a persistent cache whose
        sliding groups keep only their windows.
    """
    persistent = shm_name is not None or file_name is not None
    if persistent and bound_windows and any(g.window is not None for g in plan.groups):
        raise ValueError(
            "bound_windows=True keeps only each sliding group's window, whose ring "
            "overwrites committed rows as it moves, so no commit would survive a crash: "
            "pass bound_windows=False to persist a hybrid cache (shm_name / file_name), "
            "or drop them"
        )
    if options.get("sparse") is not None and all(g.window is not None for g in plan.groups):
        raise ValueError(
            "sparse= selects blocks of global layers' contexts; every layer of this hybrid "
            "cache has a sliding window (which it reads whole): drop sparse="
        )
    shares = staging_shares(plan, staging_bytes, batch, max_step_tokens, options)
    out = []
    for i, group in enumerate(plan.groups):
        bounded = bound_windows and group.window is not None
        num_blocks = None
        if bounded:
            t = options.get("block_tokens")
            t = default_block_tokens(max_len) if t is None else t  # As KVGeometry does.
            ring = window_ring.ring_blocks(group.window, max_step_tokens, t)
            ring = min(ring, -(-max_len // t))
            extra = batch * ring if window_cache_blocks is None else window_cache_blocks
            num_blocks = batch * ring + int(extra)
        kwargs = dict(
            num_layers=len(group.layers),
            batch=batch,
            max_len=max_len,
            num_kv_heads=group.num_kv_heads,
            head_dim=group.head_dim,
            sliding_window=group.window,
            max_step_tokens=max_step_tokens if bounded else None,
            num_blocks=num_blocks,
            staging_bytes=shares[i],
            shm_name=None if shm_name is None else f"{shm_name}.g{i}",
            file_name=None if file_name is None else f"{file_name}.g{i}",
            prefix_salt=group_salt(options, group.layers),
            # Sparse decode is the global groups' (a sliding group reads its window).
            **{
                k: v
                for k, v in options.items()
                if k != "prefix_salt" and not (k == "sparse" and group.window is not None)
            },
        )
        if group.window is not None:  # A sliding group reads its window whole.
            kwargs.pop("sparse", None)
        if host_pool:
            CacheConfig.from_kwargs(**kwargs)
        elif mesh is None:
            layout.plan(CacheConfig.from_kwargs(**kwargs))
        if mesh is not None:
            kwargs.update(mesh=mesh, kv_heads_axis=axes[0], batch_axis=axes[1])
        out.append(kwargs)
    return out


def staging_shares(
    plan: LayerGroups, budget: int, batch: int, max_step_tokens: int, options: dict
) -> list[int]:
    """The device budget per group: a sliding group gets what whole units of its window
    take (four staging slots of them, at most an equal share), the global groups the
    rest, in proportion to their bytes per token (their units span the context)."""
    itemsize = np.dtype(options.get("dtype", jnp.bfloat16)).itemsize
    groups = plan.groups
    row = [g.num_kv_heads * g.head_dim * itemsize for g in groups]
    shares = [0] * len(groups)
    for i, g in enumerate(groups):
        if g.window is not None:
            whole = 4 * 2 * batch * (g.window + max_step_tokens) * row[i]
            shares[i] = max(1, min(whole, budget // len(groups)))
    rest = budget - sum(shares)
    weights = {i: len(g.layers) * row[i] for i, g in enumerate(groups) if g.window is None}
    for i, w in weights.items():
        shares[i] = max(1, rest * w // sum(weights.values()))
    if not weights:  # Only sliding groups: the budget left over is theirs.
        shares = [s + rest // len(groups) for s in shares]
    return shares


def group_salt(options: dict, layers: tuple[int, ...]) -> str:
    """Two groups of one geometry (a sliding and a global group of Gemma 3) hold other
    layers' KV: their prefix blocks are kept apart by the layers they hold."""
    base = options.get("prefix_salt") or options.get("model_id") or ""
    if isinstance(base, bytes):
        base = base.hex()
    return f"{base}|layers {list(layers)}"


# Keywords only a hybrid cache takes (beside per-layer num_kv_heads / head_dim): a cache's
# keywords holding one of them describe a HybridKVCache.
HYBRID_KEYWORDS = ("host_pool", "kv_sharing", "bound_windows", "window_cache_blocks")


def host_pool_groups(
    keywords: dict, *, max_len: int | None = None
) -> tuple[LayerGroups, list[CacheConfig], int, np.dtype]:
    """What ``HybridKVCache(host_pool=True, **keywords)`` would make, planned without
    making anything: ``(plan, one CacheConfig per group, max_step_tokens, dtype)``, each
    group's configuration checked as its host pool checks it (``max_len``: in place of the
    keywords'). One device's groups: a mesh is the caller's to split over.

    Raises:
      ValueError: what :class:`~jax_tpusync.caches.hybrid.cache.HybridKVCache` refuses
        (named as it names it): ``host_pool=False``, an engine, ``batch_axis``, an
        argument out of range, a ``kv_sharing`` it cannot serve.
    """
    from jax_tpusync.core.config import normalize_windows
    from jax_tpusync.core.hybrid_state import plan_groups

    options = dict(keywords)
    if options.pop("host_pool", True) is not True:
        raise ValueError(
            "host_pool=False plans an engine cache: a TPU's hybrid cache is host pools "
            "(host_pool=True)"
        )
    for name in ("mesh", "kv_heads_axis"):
        if options.pop(name, None) is not None:
            raise ValueError(f"{name}= is the planner's to give (one device's groups here)")
    if max_len is not None:
        options["max_len"] = max_len
    num_layers = options.pop("num_layers", None)
    batch = options.pop("batch", None)
    max_len = options.pop("max_len", None)
    num_kv_heads = options.pop("num_kv_heads", None)
    head_dim = options.pop("head_dim", None)
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value is None:
            raise ValueError(f"{name} is missing: give an int or one per layer")
    windows = options.pop("sliding_window", None)
    kv_sharing = options.pop("kv_sharing", None)
    max_step_tokens = options.pop("max_step_tokens", None)
    bound_windows = options.pop("bound_windows", True)
    window_cache_blocks = options.pop("window_cache_blocks", None)
    staging_bytes = options.pop("staging_bytes", 256 << 20)
    engine = options.pop("engine", None)
    batch_axis = options.pop("batch_axis", None)
    shm_name = options.pop("shm_name", None)
    file_name = options.pop("file_name", None)
    if max_step_tokens is None and is_int(max_len):
        max_step_tokens = min(DEFAULT_STEP_TOKENS, int(max_len))
    dtype = check_arguments(
        num_layers=num_layers, batch=batch, max_len=max_len, max_step_tokens=max_step_tokens,
        bound_windows=bound_windows, window_cache_blocks=window_cache_blocks,
        staging_bytes=staging_bytes, engine=engine, shm_name=shm_name, file_name=file_name,
        mesh=None, kv_heads_axis=None, batch_axis=batch_axis, options=options, host_pool=True,
    )  # fmt: skip
    plan = plan_groups(
        num_layers, num_kv_heads, head_dim, normalize_windows(windows, num_layers), kv_sharing
    )
    made = group_arguments(
        plan, batch=batch, max_len=max_len, max_step_tokens=int(max_step_tokens),
        bound_windows=bool(bound_windows), window_cache_blocks=window_cache_blocks,
        staging_bytes=staging_bytes, shm_name=shm_name, file_name=file_name,
        options=options, host_pool=True,
    )  # fmt: skip
    configs = [CacheConfig.from_kwargs(**kwargs) for kwargs in made]
    return plan, configs, int(max_step_tokens), dtype
