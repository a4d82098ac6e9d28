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
KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels"

# Each folder of the package (a "room"; ``caches`` alone is caches/protocol.py and
# caches/parts.py, each ``caches.<kind>`` one kind of storage) and the rooms its modules may
# import besides their own. The same table is docs/architecture.md's, checked below.
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    "core": {"runtime"},
    "persist": {"runtime", "core"},
    "mooncake": {"runtime", "core"},
    "step": {"runtime", "core", "kernels"},
    "weights": {"runtime", "mooncake"},
    "caches": {"runtime", "core", "persist"},
    "caches.offloaded": {"runtime", "core", "persist", "mooncake", "caches"},
    "caches.pool": {"runtime", "core", "persist", "mooncake", "caches"},
    "caches.hybrid": {"runtime", "core", "persist", "caches", "caches.offloaded", "caches.pool"},
    "pd": {"runtime", "core", "mooncake", "caches", "caches.offloaded", "caches.pool"},
    "serving": {"core"},
}
# The public face: the flat modules a user imports (and the package's old-path aliases).
FACE: dict[str, set[str]] = {
    "attention": {"runtime", "core", "step"},
    "factory": {"runtime", "core", "caches", "caches.offloaded", "caches.pool", "caches.hybrid"},
    "_moved": set(),
}
# At most this many modules lie flat in jax_tpusync/ (the face and __init__).
MAX_FLAT = 12
EVERYTHING = {*ALLOWED, *FACE, "kernels"}


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


def _room(module: str) -> str:
    """The room of a package module: its folder (``caches.<kind>`` for a kind of cache), or
    the flat module itself."""
    parts = module.split(".")
    if parts[0] == "caches" and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0]


def _may_import(room: str) -> set[str]:
    if room in ("__init__", "bench"):
        return EVERYTHING
    if room in FACE:
        return FACE[room]
    if room not in ALLOWED:
        raise AssertionError(f"room {room} has no import rule: add it to ALLOWED")
    return ALLOWED[room]


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


def test_every_module_has_a_room_with_a_rule():
    for module in MODULES:
        _may_import(_room(module))


def test_at_most_a_dozen_modules_lie_flat():
    flat = sorted(m for m in MODULES if "." not in m and (PACKAGE / f"{m}.py").is_file())
    assert len(flat) <= MAX_FLAT, flat
    assert set(flat) <= {*FACE, "__init__"}, flat


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


def test_no_module_imports_a_room_it_may_not():
    bad = []
    for module in MODULES:
        room = _room(module)
        for target, _, line in _imports(module):
            if target == "__init__" or target not in MODULES and not target.startswith("kernels"):
                continue
            other = "kernels" if target.startswith("kernels") else _room(target)
            if other != room and other not in _may_import(room):
                bad.append(f"{module}:{line} imports {target} ({room} may not import {other})")
    assert not bad, "\n".join(bad)


def test_kernels_import_nothing_from_the_package():
    """kernels/ ships as jax_tpusync.kernels but stands alone: relative imports only."""
    bad = []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] == "jax_tpusync"]
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
    low.write_text(
        "from jax_tpusync.caches.offloaded import cache\nfrom jax_tpusync.core.prefix import _chain\n"
    )
    fake["core.blocks"] = low
    monkeypatch.setattr(__import__(__name__), "MODULES", fake, raising=False)
    globals()["MODULES"] = fake
    try:
        with pytest.raises(
            AssertionError,
            match=r"core.blocks:1 imports caches.offloaded.cache \(core may not import caches.offloaded\)",
        ):
            test_no_module_imports_a_room_it_may_not()
        with pytest.raises(AssertionError, match=r"core.blocks:2 imports core.prefix._chain"):
            test_no_module_reads_another_modules_private_names()
    finally:
        globals()["MODULES"] = MODULES_REAL


MODULES_REAL = MODULES
