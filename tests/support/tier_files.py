"""Where a persistent tier's files are, from the keyword arguments that made its cache
(``tier`` and ``path``/``file_name`` or ``shm_name``): the library's own rule."""

from __future__ import annotations

from pathlib import Path

from jax_tpusync.persist import manifest


def data_path(where: dict) -> Path:
    return _paths(where)[0]


def manifest_path(where: dict) -> Path:
    return _paths(where)[1]


def _paths(where: dict) -> tuple[Path, Path]:
    paths = manifest.tier_paths(
        where["tier"], where.get("path"), where.get("shm_name"), where.get("file_name")
    )
    assert paths is not None, f"{where} is not a persistent tier"
    return paths
