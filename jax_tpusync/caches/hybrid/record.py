"""The record of a persistent hybrid cache's layers, beside its groups' tiers.

A persistent :class:`~jax_tpusync.caches.hybrid.cache.HybridKVCache` persists each layer group under
``<name>.g<i>`` and records every layer's geometry in ``<name>.tpusync.layers.json``, so
that a re-attach with other layers is refused naming the first layer that differs, before
any group's tier is opened (:func:`check_layers_record`). The record is written atomically
(:func:`write_layers_record`), which returns what a refused construction puts back
(:func:`put_back`): the record as it was, and no group file it did not find.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from jax_tpusync.core.hybrid_state import LayerGroups
from jax_tpusync.persist.manifest import SHM_DIRECTORY, tier_paths
from jax_tpusync.runtime.engine import Engine

logger = logging.getLogger(__name__)

__all__ = [
    "LAYERS_SUFFIX",
    "check_layers_record",
    "layers_record",
    "put_back",
    "record_path",
    "write_layers_record",
]

LAYERS_SUFFIX = ".tpusync.layers.json"

# What a refused construction puts back, per path: (path, its earlier text or None, the
# shm segment to unlink or None).
Undo = list[tuple[Path, str | None, str | None]]


def layers_record(plan: LayerGroups) -> dict:
    """The record of ``plan``'s layers: per layer its geometry, window and KV source."""
    return {
        "layers": [
            {
                "num_kv_heads": plan.group(layer).num_kv_heads,
                "head_dim": plan.group(layer).head_dim,
                "sliding_window": plan.group(layer).window,
                "kv_sharing": plan.source_of[layer],
            }
            for layer in range(plan.num_layers)
        ]
    }


def record_path(shm_name: str | None, file_name: str | None, options: dict) -> Path | None:
    """Where the record of a cache persisted as ``shm_name`` / ``file_name`` lives (the
    file tier's ``path``, or the shm directory); None: not persistent."""
    if file_name is not None:
        return Path(options["path"]) / f"{file_name}{LAYERS_SUFFIX}"
    if shm_name is not None:
        return Path(SHM_DIRECTORY) / f"{shm_name}{LAYERS_SUFFIX}"
    return None


def group_paths(
    num_groups: int, shm_name: str | None, file_name: str | None, options: dict
) -> list[tuple[Path, Path]]:
    """Each group's (data, manifest) paths."""
    tier = options.get("tier", "host")
    return [
        tier_paths(
            tier,
            options.get("path"),
            None if shm_name is None else f"{shm_name}.g{i}",
            None if file_name is None else f"{file_name}.g{i}",
        )
        for i in range(num_groups)
    ]


def check_layers_record(
    plan: LayerGroups, shm_name: str | None, file_name: str | None, options: dict
) -> Path | None:
    """Refuses a re-attach whose layers differ from the recorded ones, naming the first
    that differs; returns the record's path (None: not persistent). A record with no
    group's manifest beside it describes no KV (a crash before any group was made): it is
    replaced, not compared. ``overwrite=True`` in ``options`` compares nothing.

    Raises:
      ValueError: groups on disk without a record, or a record of other layers.
    """
    path = record_path(shm_name, file_name, options)
    if path is None or options.get("overwrite", False):
        return path
    held = any(m.exists() for _, m in group_paths(len(plan.groups), shm_name, file_name, options))
    if not held:
        return path
    if not path.exists():
        raise ValueError(
            f"{path.parent} holds a cache's groups but no record of its layers ({path}): "
            f"pass overwrite=True to start empty"
        )
    theirs = json.loads(path.read_text())
    mine = layers_record(plan)
    for layer, (a, b) in enumerate(zip(theirs["layers"], mine["layers"])):
        if a != b:
            raise ValueError(
                f"the persisted hybrid cache at {path} has layer {layer} as {a}, this "
                f"cache has it as {b} (pass overwrite=True to start empty)"
            )
    if len(theirs["layers"]) != len(mine["layers"]):
        raise ValueError(
            f"the persisted hybrid cache at {path} has {len(theirs['layers'])} "
            f"layers, this cache {len(mine['layers'])} (pass overwrite=True to start "
            f"empty)"
        )
    return path


def write_layers_record(
    path: Path | None,
    plan: LayerGroups,
    shm_name: str | None,
    file_name: str | None,
    options: dict,
) -> Undo:
    """Writes the record of ``plan``'s layers at ``path`` (atomically) unless it holds them
    already; returns what a failed construction puts back: ``(path, its earlier text or
    None, shm segment name or None)`` of the record and of every group file not made yet."""
    if path is None:
        return []
    mine = layers_record(plan)
    before = path.read_text() if path.exists() else None
    undo: Undo = []
    for i, (data, manifest) in enumerate(
        group_paths(len(plan.groups), shm_name, file_name, options)
    ):
        segment = None if shm_name is None else f"{shm_name}.g{i}"
        undo += [(data, None, segment), (manifest, None, None)]
    undo = [u for u in undo if not u[0].exists()]
    try:
        same = before is not None and json.loads(before) == mine
    except ValueError:
        same = False
    if not same:
        undo.append((path, before, None))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(mine))
        os.replace(tmp, path)
    return undo


def put_back(undo: Undo) -> None:
    """Puts back what :func:`write_layers_record` listed: files made since removed, a
    record replaced written back (never raises: the construction's error is what the
    caller sees)."""
    for path, text, segment in undo:
        try:
            if text is not None:
                path.write_text(text)
            elif segment is not None:
                if path.exists():
                    Engine.unlink_shm(segment)
            else:
                path.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - cleanup: report and go on.
            logger.warning("could not remove %s after a refused construction: %s", path, e)
