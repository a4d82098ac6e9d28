"""The module paths from before 0.2.0 keep importing (``jax_tpusync/_moved.py``), and the
public names still import.

Each old path is the very module at its new path (so a patch through either patches both),
warns with a ``DeprecationWarning`` naming the new path when it is first imported, and is
listed in CHANGELOG.md's 0.2.0 "Moved" section. A name that never existed still fails.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings
from unittest import mock

import pytest

import jax_tpusync
from jax_tpusync._moved import MOVED

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _import_quietly(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_path(old):
    new = importlib.import_module(f"jax_tpusync.{MOVED[old]}")
    assert _import_quietly(f"jax_tpusync.{old}") is new
    assert getattr(jax_tpusync, old) is new  # what `import jax_tpusync.<old>` binds
    assert new.__name__ == f"jax_tpusync.{MOVED[old]}"  # the module keeps its own name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_naming_the_new_one(old, monkeypatch):
    # Imported once already (or not): drop the alias so this import finds it afresh.
    monkeypatch.delitem(sys.modules, f"jax_tpusync.{old}", raising=False)
    message = (
        f"jax_tpusync.{old} moved to jax_tpusync.{MOVED[old]} in jax_tpusync 0.2.0; "
        "the old path goes in 0.3.0"
    )
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        module = importlib.import_module(f"jax_tpusync.{old}")
    assert module is importlib.import_module(f"jax_tpusync.{MOVED[old]}")


def test_the_warning_comes_once_per_process_and_the_package_itself_uses_no_old_path():
    """In a fresh interpreter: importing the package warns nothing (no module of it uses an
    old path); the first import of an old path warns, the next ones do not."""
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import jax_tpusync
        print("package:", [str(w.message) for w in caught if "moved to" in str(w.message)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import jax_tpusync.weight_sync
            import jax_tpusync.weight_sync
            from jax_tpusync.weight_sync import WeightPublisher
            from jax_tpusync import pool_cache
        print("old paths:", [(w.category.__name__, str(w.message)) for w in caught])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd="/",  # Not the source tree, whose package has no built extension.
    ).stdout
    assert "package: []" in out, out
    assert (
        "old paths: [('DeprecationWarning', 'jax_tpusync.weight_sync moved to "
        "jax_tpusync.weights.sync in jax_tpusync 0.2.0; the old path goes in 0.3.0'), "
        "('DeprecationWarning', 'jax_tpusync.pool_cache moved to jax_tpusync.caches.pool.cache "
        "in jax_tpusync 0.2.0; the old path goes in 0.3.0')]"
    ) in out, out


def test_the_documented_old_imports_still_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax_tpusync.weight_sync import WeightPublisher, WeightPuller
    from jax_tpusync import weights
    from jax_tpusync.serving import ServingLoop
    from jax_tpusync.serving.loop import ServingLoop as loop_serving_loop

    assert WeightPublisher is weights.WeightPublisher
    assert WeightPuller is weights.WeightPuller
    assert ServingLoop is loop_serving_loop


def test_a_name_that_never_existed_still_fails():
    with pytest.raises(ModuleNotFoundError, match="jax_tpusync.no_such_module"):
        importlib.import_module("jax_tpusync.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        _import_quietly("jax_tpusync.cache.no_such_module")  # below an old path too
    with pytest.raises(ImportError):
        exec("from jax_tpusync import no_such_module")


def test_patching_through_an_old_path_patches_the_real_module():
    from jax_tpusync.caches.offloaded import cache
    from jax_tpusync.weights import sync

    real = cache.MAX_PREFETCH_DEPTH
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mock.patch("jax_tpusync.cache.MAX_PREFETCH_DEPTH", real + 1):
            assert cache.MAX_PREFETCH_DEPTH == real + 1
        assert cache.MAX_PREFETCH_DEPTH == real
        with mock.patch("jax_tpusync.weight_sync.open_weight_store") as patched:
            assert sync.open_weight_store is patched
            assert jax_tpusync.weights.sync.open_weight_store is patched
        assert sync.open_weight_store is not patched


@pytest.mark.parametrize(
    "package", ["jax_tpusync", "jax_tpusync.serving", "jax_tpusync.weights"]
)
def test_every_public_name_imports(package):
    module = importlib.import_module(package)
    assert module.__all__
    for name in module.__all__:
        namespace: dict = {}
        exec(f"from {package} import {name}", namespace)
        assert namespace[name] is getattr(module, name)


def test_the_changelog_lists_every_moved_module():
    """CHANGELOG.md's 0.2.0 "Moved" section names each old path with its new one."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    release = changelog.split("\n## 0.2.0", 1)[1].split("\n## ", 1)[0]
    moved = release.split("\n### Moved\n", 1)[1].split("\n### ", 1)[0]
    listed = dict(re.findall(r"`jax_tpusync\.([\w.]+)` -> `jax_tpusync\.([\w.]+)`", moved))
    assert listed == MOVED


def _doc_paths(pattern: str) -> list[tuple[str, str]]:
    """``(match, "<doc>:<line>")`` of ``pattern`` in README.md and docs/*.md."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            out += [(m.group(1), f"{doc.name}:{number}") for m in re.finditer(pattern, line)]
    return out


def _resolve(dotted: str):
    """The module, or the attribute of the longest importable module, ``dotted`` names."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for name in parts[end:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


def test_the_docs_name_only_paths_that_exist_and_no_old_ones():
    """Every ``jax_tpusync.<...>`` the docs name imports (or is an attribute of a module that
    does) by its path since 0.2.0, not through an old one, and every ``jax_tpusync/<file>``
    they name exists."""
    dotted = _doc_paths(r"`(jax_tpusync(?:\.\w+)+)")
    assert dotted
    bad = []
    for name, where in dotted:
        old = name.split(".")[1]
        if old in MOVED:
            bad.append(f"{where}: {name} is an old path (now jax_tpusync.{MOVED[old]})")
            continue
        try:
            _resolve(name)
        except (ImportError, AttributeError) as error:
            bad.append(f"{where}: {name} does not resolve ({error})")
    for path, where in _doc_paths(r"`(jax_tpusync/[\w/.]+)`"):
        # kernels/ ships as jax_tpusync/kernels (pyproject.toml's wheel.packages).
        if not (ROOT / path.replace("jax_tpusync/kernels", "kernels", 1)).exists():
            bad.append(f"{where}: {path} does not exist")
    assert not bad, "\n".join(bad)
