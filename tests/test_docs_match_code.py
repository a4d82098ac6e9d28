"""The defaults and keywords that README.md and docs/*.md state, checked against the code.

The docs state them in three forms, each parsed here:

* keyword tables: a paragraph naming callables as ``Name(...)`` in backticks, then a table whose
  header starts ``| keyword | default |``; each row names its keywords in backticks (first
  cell) and a default (second cell): ``required``, or a Python value in backticks
  (``256 << 20``, ``"auto"``, ``jnp.bfloat16``), which must equal the code's default;
* call spans in prose: ```` `Name(a, b, *, c)` ```` (a full signature, with ``*``: it must
  list every parameter) or ```` `Name(..., kw=...)` ```` (an example: each keyword must be
  one the callable takes);
* phrases: ```` `kw` defaults to X ```` under a heading that names a callable: ``kw`` must
  be one it takes, and a literal X must be its default unless the code's default is None
  (computed when the cache is built, which the phrase then describes).

A class whose constructor takes ``**options`` takes ``CacheConfig.from_kwargs``'s keywords
too, with their defaults.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpusync as tps
from jax_tpusync.core.config import CacheConfig
from jax_tpusync.serving import ServingLoop

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

REQUIRED = object()  # A parameter without a default.
NO_DEFAULT_TEXT = "required"

# Names the docs give the public callables, with or without a module prefix.
CALLABLES: dict[str, Any] = {
    **{name: getattr(tps, name) for name in tps.__all__ if callable(getattr(tps, name))},
    "CacheConfig.from_kwargs": CacheConfig.from_kwargs,
    "ServingLoop": ServingLoop,
    "tpu.plan_step": tps.tpu.plan_step,
}
PREFIXES = ("tps.", "jax_tpusync.", "serving.", "jax_tpusync.serving.", "config.")

# HybridKVCache.__init__ forwards its keywords to the method that holds their defaults.
SIGNATURE_OF = {tps.HybridKVCache: tps.HybridKVCache._build}


def parameters(target: Any) -> dict[str, Any]:
    """Every keyword ``target`` takes, with its default (REQUIRED where it has none)."""
    signature = inspect.signature(SIGNATURE_OF.get(target, target))
    taken: dict[str, Any] = {}
    forwards_options = False
    for p in signature.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_KEYWORD:
            forwards_options = True
            continue
        if p.kind is p.VAR_POSITIONAL:
            continue
        taken[p.name] = REQUIRED if p.default is p.empty else p.default
    if forwards_options and target is not CacheConfig.from_kwargs:
        for name, default in parameters(CacheConfig.from_kwargs).items():
            taken.setdefault(name, default)
    if target is tps.HybridKVCache:
        taken.setdefault("config", None)
    return taken


def resolve(name: str) -> Any:
    """The callable a doc names (``tps.kv_cache``, ``serving.ServingLoop``...), or None."""
    for prefix in ("", *PREFIXES):
        if name.startswith(prefix) and name[len(prefix) :] in CALLABLES:
            return CALLABLES[name[len(prefix) :]]
    return None


_NAMES = {"jnp": jnp, "np": np, "None": None, "True": True, "False": False}


def doc_value(text: str) -> Any:
    """The Python value a doc writes: literals, ``a << b`` / ``a * b`` of ints and dotted
    names under jnp / np. ValueError for anything else."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.Mult, ast.Pow)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.LShift):
                return left << right
            return left * right if isinstance(node.op, ast.Mult) else left**right
        if isinstance(node, ast.Name) and node.id in _NAMES:
            return _NAMES[node.id]
        if isinstance(node, ast.Attribute):
            return getattr(value(node.value), node.attr)
        raise ValueError(f"not a value a doc may state as a default: {text!r}")

    return value(ast.parse(text.strip(), mode="eval").body)


def same_default(stated: Any, actual: Any) -> bool:
    if stated is REQUIRED or actual is REQUIRED:
        return stated is actual
    return type(stated) is type(actual) and stated == actual or stated is actual


def table_claims(text: str, where: str):
    """(where, callables, keyword, stated default) for every row of a keyword table."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not (line.lstrip().startswith("|") and cells[:2] == ["keyword", "default"]):
            continue
        above = i - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        lead = []  # The paragraph just above the table.
        while above >= 0 and lines[above].strip():
            lead.insert(0, lines[above])
            above -= 1
        names = re.findall(r"`([\w.]+)\(\.\.\.\)`", " ".join(lead))
        assert names, f"{where}:{i + 1}: a keyword table needs `Name(...)` in the paragraph above"
        for j in range(i + 2, len(lines)):
            row = lines[j].strip()
            if not row.startswith("|"):
                break
            row_cells = [c.strip() for c in row.strip("|").split("|")]
            keywords = re.findall(r"`(\w+)`", row_cells[0])
            assert keywords, f"{where}:{j + 1}: no keyword in backticks in {row_cells[0]!r}"
            default_cell = row_cells[1]
            if default_cell == NO_DEFAULT_TEXT:
                stated = REQUIRED
            else:
                m = re.fullmatch(r"`([^`]+)`(?:\s*\(.*\))?", default_cell)
                assert m, f"{where}:{j + 1}: default {default_cell!r}: neither `value` nor required"
                stated = doc_value(m.group(1))
            for keyword in keywords:
                yield f"{where}:{j + 1}", names, keyword, stated


CALL_SPAN = re.compile(r"`((?:[\w]+\.)*[\w]+)\(([^`()]*(?:\([^`()]*\)[^`()]*)*)\)`")


def call_claims(text: str, where: str):
    """(where, name, [keywords], full) for every `Name(...)` span naming a public callable;
    ``full``: the span is a signature (it has ``*``) and must list every parameter."""
    for m in CALL_SPAN.finditer(text):
        name, inner = m.group(1), m.group(2)
        if resolve(name) is None or inner.strip() in ("", "..."):
            continue
        line = text.count("\n", 0, m.start()) + 1
        depth, parts, current = 0, [], ""
        for ch in inner:  # Split on top-level commas only.
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 0:
                parts.append(current.strip())
                current = ""
            else:
                current += ch
        parts.append(current.strip())
        full = "*" in parts
        keywords = []
        for part in parts:
            if part in ("*", "/", "...", "") or part.startswith("**"):
                continue
            keyword = part.split("=", 1)[0].strip()
            if re.fullmatch(r"\w+", keyword) and ("=" in part or full):
                keywords.append(keyword)
        yield f"{where}:{line}", name, keywords, full


DEFAULTS_TO = re.compile(r"`(\w+)` defaults to `?([^`\s,;()]+)`?")
HEADING_CALLABLE = re.compile(r"^#+ .*?`([\w.]+)\(\)`", re.M)


def phrase_claims(text: str, where: str):
    """(where, callable name, keyword, stated text) for every "`kw` defaults to X" phrase
    under a heading that names a callable."""
    headings = [(m.start(), m.group(1)) for m in HEADING_CALLABLE.finditer(text)]
    for m in DEFAULTS_TO.finditer(text):
        owner = [name for at, name in headings if at < m.start()]
        if not owner:
            continue
        line = text.count("\n", 0, m.start()) + 1
        yield f"{where}:{line}", owner[-1], m.group(1), m.group(2).rstrip(".")


def problems(text: str, where: str) -> list[str]:
    """Every place ``text`` departs from the code."""
    found = []
    for at, names, keyword, stated in table_claims(text, where):
        for name in names:
            target = resolve(name)
            if target is None:
                found.append(f"{at}: {name} is not a public callable")
                continue
            taken = parameters(target)
            if keyword not in taken:
                found.append(f"{at}: {name} takes no keyword {keyword!r}")
            elif not same_default(stated, taken[keyword]):
                shown = NO_DEFAULT_TEXT if stated is REQUIRED else repr(stated)
                real = NO_DEFAULT_TEXT if taken[keyword] is REQUIRED else repr(taken[keyword])
                found.append(f"{at}: {name}({keyword}=) documented {shown}, the code's is {real}")
    for at, name, keywords, full in call_claims(text, where):
        taken = parameters(resolve(name))
        for keyword in keywords:
            if keyword not in taken:
                found.append(f"{at}: {name} takes no keyword {keyword!r}")
        if full:
            own = inspect.signature(SIGNATURE_OF.get(resolve(name), resolve(name))).parameters
            missing = [
                p for p, v in own.items() if v.kind not in (v.VAR_KEYWORD,) and p not in keywords
            ]
            if missing:
                found.append(f"{at}: the signature of {name} leaves out {missing}")
    for at, name, keyword, stated_text in phrase_claims(text, where):
        target = resolve(name)
        if target is None:
            continue
        taken = parameters(target)
        if keyword not in taken:
            found.append(f"{at}: {name} takes no keyword {keyword!r}")
            continue
        try:
            stated = doc_value(stated_text)
        except (ValueError, SyntaxError):
            continue  # Prose ("the step's logits"), not a value.
        if taken[keyword] is not None and not same_default(stated, taken[keyword]):
            found.append(
                f"{at}: {name}({keyword}=) documented {stated!r}, the code's is {taken[keyword]!r}"
            )
    return found


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_docs_state_the_code_defaults_and_keywords(path):
    assert problems(path.read_text(), path.relative_to(ROOT).as_posix()) == []


def test_api_md_has_the_constructor_tables():
    """The tables exist, so that the check above checks something."""
    text = (ROOT / "docs" / "api.md").read_text()
    tabled = {(tuple(names), keyword) for _, names, keyword, _ in table_claims(text, "api.md")}
    keywords = {keyword for _, keyword in tabled}
    assert {"prefetch_depth", "staging_bytes", "block_tokens", "max_step_tokens"} <= keywords
    documented = {name for names, _ in tabled for name in names}
    assert {"OffloadedKVCache", "HybridKVCache", "CacheConfig.from_kwargs"} <= documented
    # Every keyword CacheConfig.from_kwargs takes is in a table.
    assert set(parameters(CacheConfig.from_kwargs)) <= keywords


@pytest.mark.parametrize(
    "doc, expected",
    [
        (
            "`OffloadedKVCache(...)` keywords:\n\n| keyword | default |\n|---|---|\n"
            "| `prefetch_depth` | `1` |\n",
            "OffloadedKVCache(prefetch_depth=) documented 1, the code's is 'auto'",
        ),
        (
            "`OffloadedKVCache(...)`:\n\n| keyword | default | meaning |\n|---|---|---|\n"
            "| `staging_bytes` | `256 << 21` | the budget |\n",
            "documented 536870912, the code's is 268435456",
        ),
        (
            "`HybridKVCache(...)`:\n\n| keyword | default |\n|---|---|\n| `num_layers` | `1` |\n",
            "HybridKVCache(num_layers=) documented 1, the code's is required",
        ),
        (
            "`OffloadedKVCache(...)`:\n\n| keyword | default |\n|---|---|\n"
            "| `stage_bytes` | `1` |\n",
            "OffloadedKVCache takes no keyword 'stage_bytes'",
        ),
        ("call `tps.kv_cache(..., bound_window=False)` here", "kv_cache takes no keyword"),
        ("`prefetching_attention(q, k, v, state, *, layer)`", "leaves out"),
        (
            "## The loop: `ServingLoop()`\n\n`chunk` defaults to `128`.",
            "ServingLoop(chunk=) documented 128, the code's is 256",
        ),
    ],
)
def test_a_wrong_doc_line_is_caught(doc, expected):
    found = problems(doc, "doc.md")
    assert len(found) == 1 and expected in found[0], found


def test_a_true_doc_line_passes():
    doc = (
        "`OffloadedKVCache(...)`, `CacheConfig.from_kwargs(...)`:\n\n"
        "| keyword | default | meaning |\n|---|---|---|\n"
        "| `num_layers`, `batch` | required | geometry |\n"
        "| `staging_bytes` | `256 << 20` (256 MiB) | budget |\n"
        "| `dtype` | `jnp.bfloat16` | |\n"
        "| `prefetch_depth` | `\"auto\"` | |\n\n"
        "`tps.kv_cache(..., bound_windows=False)`\n\n"
        "## The loop: `ServingLoop()`\n\n`chunk` defaults to `256`."
    )
    assert problems(doc, "doc.md") == []
    # HybridKVCache's own keywords are read from its real signature (its _build's).
    taken = parameters(tps.HybridKVCache)
    assert taken["max_step_tokens"] is None  # DEFAULT_STEP_TOKENS, or max_len if smaller.
    assert taken["bound_windows"] is True and taken["staging_bytes"] == 256 << 20


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "docs" / "contributing.md"])
def test_the_test_instructions_state_no_unchecked_suite_figures(path):
    """How many tests the suite has, and how long it took once, go stale with every change:
    the README and contributing.md do not state them (the 20-minute budget is a target)."""
    text = path.read_text()
    assert re.findall(r"\b\d{1,3}(?:,\d{3})+ tests\b", text) == []  # The suite's count.
    assert re.findall(r"\b\d+(?:\.\d+)? minutes on a\b", text) == []
    # Where there is no sudo (root in a container) the command works as written; a user's
    # is said too.
    assert "\napt-get install -y libibverbs1 libnuma1" in text
    assert "sudo apt-get install -y libibverbs1 libnuma1" in text
