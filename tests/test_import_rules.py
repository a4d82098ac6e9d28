"""The package's rooms and what each may import: an acyclic import graph, each module
importing only its own room (folder) and the rooms its room's rule names (``ALLOWED``;
``FACE`` for the flat modules), at most a dozen flat modules, ``kernels/`` importing nothing
from the package, and no module reading another module's private names.

docs/architecture.md's module map is checked against the same rules and against the files
on disk: every module has its row, every row its file, every room its rule.

Read from the source (ast), so a lazy import inside a function counts as much as one at the
top, and nothing is imported to check it.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_tpusync"
KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels"

# Each folder of the package (a "room"; ``caches`` alone is caches/protocol.py and
# caches/parts.py, each ``caches.<kind>`` one kind of storage) and the rooms its modules may
# import besides their own. The same table is docs/architecture.md's, checked below.
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    "sparse": set(),
    "core": {"runtime", "sparse"},
    "persist": {"runtime", "core"},
    "mooncake": {"runtime", "core"},
    "step": {"runtime", "sparse", "core", "kernels"},
    "weights": {"runtime", "mooncake"},
    "caches": {"runtime", "sparse", "core", "persist"},
    "caches.offloaded": {"runtime", "sparse", "core", "persist", "mooncake", "caches"},
    "caches.pool": {"runtime", "sparse", "core", "persist", "mooncake", "caches"},
    "caches.hybrid": {
        "runtime",
        "sparse",
        "core",
        "persist",
        "caches",
        "caches.offloaded",
        "caches.pool",
    },
    "pd": {"runtime", "core", "mooncake", "caches", "caches.offloaded", "caches.pool"},
    "serving": {"core"},
    "tpu": {"runtime", "core", "step", "caches.pool", "caches.hybrid"},
}
# The public face: the flat modules a user imports (and the package's old-path aliases).
FACE: dict[str, set[str]] = {
    "attention": {"runtime", "sparse", "core", "step"},
    "factory": {"runtime", "core", "caches", "caches.offloaded", "caches.pool", "caches.hybrid"},
    "_moved": set(),
    "quality": {"sparse", "core", "step", "caches.offloaded"},
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
            if target != module
            and target in MODULES
            and target != "__init__"
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


def _kernel_imports_of_the_package(kernels: pathlib.Path) -> list[str]:
    """``"<file>:<line> imports <module>"`` for every import of ``jax_tpusync`` under
    ``kernels``."""
    bad = []
    for path in sorted(kernels.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [
                f"{path.name}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] == "jax_tpusync"
            ]
    return bad


def test_kernels_import_nothing_from_the_package():
    """kernels/ ships as jax_tpusync.kernels but stands alone: relative imports only."""
    bad = _kernel_imports_of_the_package(KERNELS)
    assert not bad, "\n".join(bad)


def test_a_kernel_importing_the_package_is_caught(tmp_path):
    """The check above fails on a kernel that imports the package (so it cannot pass
    vacuously), whichever form the import takes; relative imports pass."""
    (tmp_path / "fine.py").write_text("from . import reference\nfrom .reference import x\n")
    (tmp_path / "planted.py").write_text(
        "import jax\n"
        "from jax_tpusync.core import state\n"
        "def f():\n"
        "    import jax_tpusync.runtime.ops\n"
        "    from jax_tpusync import KVState\n"
    )
    assert _kernel_imports_of_the_package(tmp_path) == [
        "planted.py:2 imports jax_tpusync.core",
        "planted.py:4 imports jax_tpusync.runtime.ops",
        "planted.py:5 imports jax_tpusync",
    ]


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


# --- docs/architecture.md's module map, checked against the files and the rules above ---

ARCHITECTURE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
_ROOM_HEADING = re.compile(r"### `([\w/]+)/`\s*$")
_FACE_HEADING = "### The public face"
_NOTHING, _EVERY_ROOM = "nothing", "every room"


def _module_files(package: pathlib.Path) -> set[str]:
    """Every module file of the package, relative to it (``core/slots.py``, ``__init__.py``);
    ``kernels/`` ships inside it but is its own tree."""
    return {
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if path.relative_to(package).parts[0] != "kernels"
    }


def _rooms_named(text: str, where: str) -> set[str]:
    """The rooms a "may import" cell or line names: ``nothing``, ``every room``, or rooms in
    backticks as folders (```caches/pool/``` is the room ``caches.pool``)."""
    text = text.strip().rstrip(".")
    if text == _NOTHING:
        return set()
    if text == _EVERY_ROOM:
        return set(EVERYTHING)
    rooms = re.findall(r"`([\w/]+)/`", text)
    if not rooms or re.sub(r"`[\w/]+/`|[,\s]", "", text):
        raise AssertionError(f"{where}: cannot read the rooms in {text!r}")
    return {room.replace("/", ".") for room in rooms}


def _module_map(doc: str) -> list[tuple[str, str, dict[str, set[str]], list[str]]]:
    """The module map's sections in order: ``(heading, folder, {room: rooms it may import},
    module files)``; a room's section states its rule on a ``May import:`` line, the public
    face's table in a ``may import`` column, one rule per flat module."""
    body = doc.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    sections = []
    for i, chunk in enumerate(body.split("\n### ")[1:]):
        heading, _, text = chunk.partition("\n")
        heading = "### " + heading.strip()
        room_match = _ROOM_HEADING.match(heading)
        if room_match:
            folder = room_match.group(1)
        elif heading.startswith(_FACE_HEADING):
            folder = ""
        else:
            raise AssertionError(f"module map: {heading!r} is neither a room nor the public face")
        rules: dict[str, set[str]] = {}
        modules = []
        columns: list[str] = []
        for line in text.splitlines():
            if line.startswith("May import:"):
                rules[folder.replace("/", ".")] = _rooms_named(
                    line.removeprefix("May import:"), heading
                )
            if not line.startswith("|") or set(line) <= set("|-: "):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "module":
                columns = cells
                continue
            name = re.fullmatch(r"`([\w.]+\.py)`", cells[0])
            if not name:
                raise AssertionError(f"module map, {heading}: a row names no `file.py`: {line}")
            modules.append(f"{folder}/{name.group(1)}" if folder else name.group(1))
            if "may import" in columns:
                stem = name.group(1).removesuffix(".py")
                rules[stem] = _rooms_named(cells[columns.index("may import")], f"{heading}, {stem}")
        if room_match and folder.replace("/", ".") not in rules:
            raise AssertionError(f"module map, {heading}: no 'May import:' line")
        sections.append((heading, folder, rules, modules))
    return sections


def _module_map_discrepancies(doc: str, files: set[str]) -> list[str]:
    """What the module map says that the package's files (``files``) and rules do not."""
    sections = _module_map(doc)
    bad = []
    mapped: dict[str, str] = {}
    for heading, _, _, modules in sections:
        for module in modules:
            if module in mapped:
                bad.append(f"{module} is mapped twice ({mapped[module]}, {heading})")
            mapped[module] = heading
    bad += [f"{m} is missing from the module map" for m in sorted(files - set(mapped))]
    bad += [f"the module map names {m}, which does not exist" for m in sorted(set(mapped) - files)]
    documented: set[str] = {"kernels"}  # described above the rooms, below every one of them
    for heading, _, rules, _ in sections:
        for room, stated in rules.items():
            try:
                rule = _may_import(room)
            except AssertionError as error:
                bad.append(f"{heading}: {error}")
                continue
            if stated != rule:
                bad.append(
                    f"{heading}: the docs say {room} may import {sorted(stated)}, "
                    f"the rule is {sorted(rule)}"
                )
        rooms_here = set(rules)
        named = set().union(*rules.values())
        later = sorted(named - documented - rooms_here)
        if later:
            bad.append(f"{heading}: may import {later}, mapped later (the map goes lowest first)")
        documented |= rooms_here
    ruled = {*ALLOWED, *FACE}
    bad += [
        f"the room {room} has a rule but no place in the module map"
        for room in sorted(ruled - documented)
    ]
    return bad


def test_the_module_map_matches_the_files_and_the_rules():
    bad = _module_map_discrepancies(ARCHITECTURE.read_text(), _module_files(PACKAGE))
    assert not bad, "docs/architecture.md's module map:\n" + "\n".join(bad)


def test_the_module_map_check_catches_a_discrepancy(tmp_path):
    """The check above fails on a map that is wrong (so it cannot pass vacuously): a module
    file on disk without a row, a row without a file, a room whose rule the docs misstate, a
    room with a rule and no section, a room mapped before one it imports."""
    doc = ARCHITECTURE.read_text()
    files = _module_files(PACKAGE)
    assert not _module_map_discrepancies(doc, files)

    # A module file planted on disk (the list is computed from the files themselves).
    planted = tmp_path / "jax_tpusync"
    for name in files | {"core/planted.py"}:
        (planted / name).parent.mkdir(parents=True, exist_ok=True)
        (planted / name).touch()
    assert _module_map_discrepancies(doc, _module_files(planted)) == [
        "core/planted.py is missing from the module map"
    ]

    row = next(line for line in doc.splitlines() if line.startswith("| `slots.py` |"))
    assert _module_map_discrepancies(doc.replace(row + "\n", ""), files) == [
        "core/slots.py is missing from the module map"
    ]
    ghost = doc.replace(row, row + "\n| `nowhere.py` | a module that was never written |")
    assert _module_map_discrepancies(ghost, files) == [
        "the module map names core/nowhere.py, which does not exist"
    ]

    rule = "May import: `runtime/`, `sparse/`, `core/`, `persist/`.\n"
    assert doc.count(rule) == 1  # the caches/ room's
    wrong = doc.replace(rule, "May import: `runtime/`, `sparse/`, `core/`.\n")
    assert _module_map_discrepancies(wrong, files) == [
        (
            "### `caches/`: the docs say caches may import ['core', 'runtime', 'sparse'], "
            "the rule is ['core', 'persist', 'runtime', 'sparse']"
        )
    ]
    face = "| `attention.py` | `runtime/`, `sparse/`, `core/`, `step/` |"
    assert doc.count(face) == 1
    wrong_face = doc.replace(face, "| `attention.py` | `runtime/`, `sparse/`, `core/` |")
    assert _module_map_discrepancies(wrong_face, files) == [
        (
            "### The public face: flat in `jax_tpusync/`: the docs say attention may import "
            "['core', 'runtime', 'sparse'], the rule is ['core', 'runtime', 'sparse', 'step']"
        )
    ]

    # A room's whole section gone: its modules and its rule have no place.
    serving = doc.index("### `serving/`")
    face_heading = doc.index(_FACE_HEADING)
    assert _module_map_discrepancies(doc[:serving] + doc[face_heading:], files) == [
        "serving/__init__.py is missing from the module map",
        "serving/checks.py is missing from the module map",
        "serving/compiles.py is missing from the module map",
        "serving/loop.py is missing from the module map",
        # __init__.py and bench/ may import every room, serving too.
        "### The public face: flat in `jax_tpusync/`: may import ['serving'], mapped later "
        "(the map goes lowest first)",
        "### `bench/`: may import ['serving'], mapped later (the map goes lowest first)",
        "the room serving has a rule but no place in the module map",
    ]

    # core/ moved below persist/, which imports it.
    core = doc.index("### `core/`")
    persist = doc.index("### `persist/`")
    mooncake = doc.index("### `mooncake/`")
    swapped = doc[:core] + doc[persist:mooncake] + doc[core:persist] + doc[mooncake:]
    assert _module_map_discrepancies(swapped, files) == [
        "### `persist/`: may import ['core'], mapped later (the map goes lowest first)"
    ]
