"""Helpers the tests share, imported as ``support`` (pyproject.toml's pytest ``pythonpath``
puts tests/ on the test process's path), and what a child interpreter needs to import them.

Kept free of JAX and of the package: a spawned child imports this before it sets up JAX.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent.parent


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment with tests/ first on PYTHONPATH (a child interpreter then
    imports ``support``), updated with ``overrides``.

    No empty entry is kept: it would put the child's working directory on its path (the
    source tree, where a child runs from there) ahead of the installed package.
    """
    paths = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), **overrides)


def load_module(path: str | os.PathLike) -> ModuleType:
    """The Python file at ``path`` imported as a module named after the file (a child
    process running a test file's helpers); registered in ``sys.modules``."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
