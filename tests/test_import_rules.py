"""The package's layering: an acyclic import graph, each module importing only its own layer
or below, and no module reading another module's private names.

Read from the source (ast), so a lazy import inside a function counts as much as one at the
top, and nothing is imported to check it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_tpusync"

# Lowest first; a module may import modules of its own layer or a lower one.
LAYERS: dict[str, int] = {
    "engine": 0,
    "blocks": 0,
    "quantize": 0,
    "timeline": 0,
    "xla_cpu": 0,
    "backend": 0,
    "effects": 0,
    "window_ring": 0,
    "transfer_memory": 0,
    "pd_channel": 0,
    "pd_writes": 0,
    "deadline_worker": 0,
    "window_prefix": 2,
    "_cuda": 0,
    "ops": 1,
    "state": 2,
    "prefix": 2,
    "spill": 2,
    "shared_blocks": 2,
    "manifest": 2,
    "history": 2,
    "mesh_layout": 2,
    "layer_groups": 2,
    "weight_plan": 0,
    "weight_file_pool": 0,
    "weight_staging": 0,
    "host_copy": 0,
    "weight_store": 1,
    "weight_sync": 4,
    "weight_store_mooncake": 4,
    "weight_mooncake_objects": 2,
    "weight_mooncake_writer": 3,
    "weight_mooncake_reader": 3,
    "config": 3,
    "layout": 3,
    "levels": 3,
    "mooncake_client": 2,
    "mooncake_block_format": 2,
    "mooncake_url": 2,
    "mooncake_level_calls": 2,
    "mooncake_level": 3,
    "slots": 3,
    "host_io": 3,
    "checksums": 3,
    "persistence": 3,
    "persisted_kv": 3,
    "cache_assembly": 3,
    "live_state": 3,
    "hybrid_config": 3,
    "hybrid_record": 3,
    "host_pool": 3,
    "pool_blocks": 3,
    "pool_stored_rows": 3,
    "pool_windows": 3,
    "pool_imports": 3,
    "cache_protocol": 0,
    "parts": 4,
    "cache": 4,
    "pool_assembly": 4,
    "pool_cache": 4,
    "pool_rows": 4,
    "pool_persistence": 4,
    "pool_spill": 3,
    "mesh": 5,
    "pool_batch_shards": 5,
    "hybrid": 5,
    "pd_pools": 5,
    "pd_pool_staging": 5,
    "pd_quarantine": 5,
    "pd_tier_endpoint": 5,
    "pd_endpoint": 5,
    "pd_transfer": 5,
    "step": 6,
    "cache_factory": 6,
    "attention": 7,
    "bench": 8,
    "serving": 8,
    "serving_checks": 8,
    "__init__": 9,
}


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted name relative to the package: path}`` of every module."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    top = module.split(".")[0]
    if top not in LAYERS:
        raise AssertionError(f"module {module} has no layer: add it to LAYERS")
    return LAYERS[top]


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(imported package module, names taken from it, line)`` of every import of a
    package module in ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jax_tpusync."):
                    out.append((alias.name.removeprefix("jax_tpusync."), [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1] if node.level > 1 else package
                base = ".".join([*parent, base] if base else parent)
            elif base == "jax_tpusync":
                base = ""
            elif base.startswith("jax_tpusync."):
                base = base.removeprefix("jax_tpusync.")
            else:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                if full in MODULES:  # `from pkg import module`
                    out.append((full, [], node.lineno))
                elif base in MODULES or base == "":
                    out.append((base or "__init__", [alias.name], node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module in MODULES:
        graph[module] = {
            target
            for target, _, _ in _imports(module)
            if target != module and target in MODULES and target != "__init__"
            # A package's __init__ may gather its own submodules.
            and not (MODULES[module].name == "__init__.py" and target.startswith(module + "."))
        }
    return graph


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_the_import_graph_is_acyclic():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                pytest.fail(f"import loop: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for module in MODULES:
        for target, _, line in _imports(module):
            if target in MODULES and target != "__init__" and _layer(target) > _layer(module):
                bad.append(f"{module}:{line} imports {target} (layer {_layer(target)} > "
                           f"{_layer(module)})")
    assert not bad, "\n".join(bad)


def test_no_module_reads_another_modules_private_names():
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        imported_as: dict[str, str] = {}  # local name -> package module
        for target, names, line in _imports(module):
            for name in names:
                # The compiled extensions (_tpusync, _tpusync_cuda) are the package's own.
                if (
                    name.startswith("_")
                    and target != module
                    and not name.startswith("__")
                    and not name.startswith("_tpusync")
                ):
                    bad.append(f"{module}:{line} imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    base = (node.module or "").removeprefix("jax_tpusync").lstrip(".")
                    full = f"{base}.{alias.name}" if base else alias.name
                    if full in MODULES:
                        imported_as[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jax_tpusync.") and alias.asname:
                        imported_as[alias.asname] = alias.name.removeprefix("jax_tpusync.")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported_as
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                # The compiled module is the package's own private extension.
                and imported_as[node.value.id] not in ("_tpusync", "_cuda")
            ):
                bad.append(f"{module}:{node.lineno} reads {imported_as[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_the_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """The checks above fail on a module that breaks them (so they cannot pass vacuously)."""
    fake = dict(MODULES)
    low = tmp_path / "blocks_fake.py"
    low.write_text("from jax_tpusync import cache\nfrom jax_tpusync.prefix import _chain\n")
    fake["blocks"] = low
    monkeypatch.setattr(__import__(__name__), "MODULES", fake, raising=False)
    globals()["MODULES"] = fake
    try:
        with pytest.raises(AssertionError, match=r"blocks:1 imports cache"):
            test_no_module_imports_a_layer_above_its_own()
        with pytest.raises(AssertionError, match=r"blocks:2 imports prefix._chain"):
            test_no_module_reads_another_modules_private_names()
    finally:
        globals()["MODULES"] = MODULES_REAL


MODULES_REAL = MODULES
