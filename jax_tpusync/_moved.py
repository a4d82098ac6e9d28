"""Module paths from before 0.2.0, when the package was flat, kept importing.

0.2.0 moved every module into a subpackage by role (``jax_tpusync.cache`` is now
``jax_tpusync.caches.offloaded.cache``, ``jax_tpusync.weight_sync`` is
``jax_tpusync.weights.sync``, ...; CHANGELOG.md lists them all). ``import jax_tpusync.cache``
still works: :func:`install` puts a finder on ``sys.meta_path`` that answers each old name
with the module now at the new one (the same module object, so patching either patches
both) and warns once with a ``DeprecationWarning`` naming the new path. The old paths go
in 0.3.0.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# Old module (under jax_tpusync) -> its home since 0.2.0.
MOVED: dict[str, str] = {
    "_cuda": "runtime._cuda",
    "backend": "runtime.backend",
    "blocks": "core.blocks",
    "cache": "caches.offloaded.cache",
    "cache_assembly": "caches.offloaded.assembly",
    "cache_factory": "factory",
    "cache_protocol": "caches.protocol",
    "checksums": "persist.checksums",
    "config": "core.config",
    "deadline_worker": "runtime.deadline_worker",
    "effects": "runtime.effects",
    "engine": "runtime.engine",
    "history": "core.history",
    "host_copy": "runtime.host_copy",
    "host_io": "core.host_io",
    "host_pool": "core.pool_state",
    "hybrid": "caches.hybrid.cache",
    "hybrid_config": "caches.hybrid.config",
    "hybrid_record": "caches.hybrid.record",
    "layer_groups": "core.hybrid_state",
    "layout": "core.layout",
    "levels": "core.levels",
    "live_state": "caches.offloaded.live_state",
    "manifest": "persist.manifest",
    "mesh": "caches.offloaded.mesh",
    "mesh_layout": "core.mesh_layout",
    "mooncake_block_format": "mooncake.block_format",
    "mooncake_client": "mooncake.client",
    "mooncake_level": "mooncake.level",
    "mooncake_level_calls": "mooncake.level_calls",
    "mooncake_url": "mooncake.url",
    "ops": "runtime.ops",
    "parts": "caches.parts",
    "pd_channel": "pd.channel",
    "pd_endpoint": "pd.endpoint",
    "pd_pool_staging": "pd.pool_staging",
    "pd_pools": "pd.pools",
    "pd_quarantine": "pd.quarantine",
    "pd_tier_endpoint": "pd.tier_endpoint",
    "pd_transfer": "pd.transfer",
    "pd_writes": "pd.writes",
    "persisted_kv": "persist.persisted_kv",
    "persistence": "persist.commit",
    "pool_assembly": "caches.pool.assembly",
    "pool_batch_shards": "caches.pool.batch_shards",
    "pool_blocks": "caches.pool.blocks",
    "pool_cache": "caches.pool.cache",
    "pool_imports": "caches.pool.imports",
    "pool_persistence": "caches.pool.persistence",
    "pool_rows": "caches.pool.rows",
    "pool_spill": "caches.pool.spill",
    "pool_stored_rows": "caches.pool.stored_rows",
    "pool_windows": "caches.pool.windows",
    "prefix": "core.prefix",
    "quantize": "core.quantize",
    "serving_checks": "serving.checks",
    "shared_blocks": "core.shared_blocks",
    "slots": "core.slots",
    "spill": "core.spill",
    "state": "core.state",
    "timeline": "runtime.timeline",
    "transfer_memory": "mooncake.transfer_memory",
    "weight_file_pool": "weights.file_pool",
    "weight_mooncake_objects": "weights.mooncake_objects",
    "weight_mooncake_reader": "weights.mooncake_reader",
    "weight_mooncake_writer": "weights.mooncake_writer",
    "weight_plan": "weights.plan",
    "weight_staging": "weights.staging",
    "weight_store": "weights.store",
    "weight_store_mooncake": "weights.store_mooncake",
    "weight_sync": "weights.sync",
    "window_prefix": "core.window_prefix",
    "window_ring": "core.window_ring",
    "xla_cpu": "runtime.xla_cpu",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new one."""

    def __init__(self, new: str):
        self._new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        module = importlib.import_module(self._new)
        # The import system sets __spec__ on what this returns; the module keeps its own.
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``jax_tpusync.<old>`` for every old name in :data:`MOVED`."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != __package__ or old not in MOVED:
            return None
        new = f"{__package__}.{MOVED[old]}"
        warnings.warn(
            f"{fullname} moved to {new} in jax_tpusync 0.2.0; the old path goes in 0.3.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
