"""Capabilities are small protocols (jax_tpusync.caches.capabilities): each cache claims
the ones it has and no other, with the protocols' parameter names; P/D transfer picks its
endpoint by capability; and no module outside the factory asks which concrete cache class
it holds (read from the source with ast, so a check in any function counts)."""

from __future__ import annotations

import ast
import inspect
import pathlib

import jax
import jax.numpy as jnp
import pytest

import jax_tpusync as tps
from jax_tpusync.caches.capabilities import (
    EngineTierRows,
    HeadSplit,
    KeptFrom,
    PrefixStats,
    SplitState,
    StagedRows,
    StoredRows,
    TierPart,
    Verifiable,
)
from jax_tpusync.caches.protocol import KVCache
from jax_tpusync.pd.endpoint import slot_rows_endpoint
from jax_tpusync.pd.pool_staging import PoolStagingEndpoint
from jax_tpusync.pd.pools import head_split, layout_of
from jax_tpusync.pd.tier_endpoint import EngineTierEndpoint

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jax_tpusync"
ARGS = dict(num_layers=2, batch=2, max_len=32, block_tokens=8, dtype=jnp.float32)
HEADS = 4

CAPABILITIES = (
    Verifiable,
    PrefixStats,
    KeptFrom,
    SplitState,
    StoredRows,
    HeadSplit,
    EngineTierRows,
    StagedRows,
)
ENGINE = {Verifiable, PrefixStats, HeadSplit, EngineTierRows}
POOL = {Verifiable, PrefixStats, KeptFrom, StoredRows, HeadSplit, StagedRows}


def _mesh(*shape, names):
    n = 1
    for s in shape:
        n *= s
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def one():
    return tps.OffloadedKVCache(num_kv_heads=HEADS, head_dim=4, **ARGS)


def mesh():
    return tps.ShardedKVCache(
        mesh=_mesh(2, names=("model",)),
        kv_heads_axis="model",
        num_kv_heads=HEADS,
        head_dim=4,
        **ARGS,
    )


def pool():
    return tps.HostPoolKVCache(num_kv_heads=HEADS, head_dim=4, **ARGS)


def pool_mesh():
    return tps.HostPoolKVCache(
        mesh=_mesh(2, names=("model",)),
        kv_heads_axis="model",
        num_kv_heads=HEADS,
        head_dim=4,
        **ARGS,
    )


def batch_shards():
    return tps.BatchShardedPoolKVCache(
        mesh=_mesh(2, 2, names=("data", "model")),
        batch_axis="data",
        kv_heads_axis="model",
        num_kv_heads=HEADS,
        head_dim=4,
        **{**ARGS, "batch": 4},
    )


def hybrid():
    return tps.HybridKVCache(
        num_kv_heads=[2, 2], head_dim=[4, 4], sliding_window=[8, None], max_step_tokens=4, **ARGS
    )


# What each cache claims: every capability it has, and (by omission) those it has not.
CLAIMS = {
    one: ENGINE | {KeptFrom},  # A window ring of its own; its state is one.
    mesh: ENGINE | {SplitState},  # Its shards' states; no ring of its own.
    pool: POOL,
    pool_mesh: POOL,  # Heads over devices within one pool: still one state.
    # Stored rows per batch shard, but no single head split: not a P/D cache (yet).
    batch_shards: {Verifiable, PrefixStats, KeptFrom, SplitState, StoredRows},
    hybrid: {SplitState, Verifiable, PrefixStats},  # Its groups' states; checksums and counters per group.
}
CLASS_OF = {
    one: tps.OffloadedKVCache,
    mesh: tps.ShardedKVCache,
    pool: tps.HostPoolKVCache,
    pool_mesh: tps.HostPoolKVCache,
    batch_shards: tps.BatchShardedPoolKVCache,
    hybrid: tps.HybridKVCache,
}


@pytest.mark.parametrize("make", list(CLAIMS), ids=lambda f: f.__name__)
def test_each_cache_has_the_capabilities_it_claims_and_no_other(make):
    with make() as cache:
        assert isinstance(cache, KVCache)
        have = {c.__name__ for c in CAPABILITIES if isinstance(cache, c)}
        assert have == {c.__name__ for c in CLAIMS[make]}


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in list(inspect.signature(function).parameters.values())[1:]]


@pytest.mark.parametrize("make", list(CLAIMS), ids=lambda f: f.__name__)
def test_each_claimed_method_takes_the_protocols_parameters(make):
    """isinstance checks only that a member exists: the names and kinds of its parameters,
    and property or method, are checked here (as protocol.mismatches does for KVCache)."""
    cls = CLASS_OF[make]
    for capability in CLAIMS[make]:
        for name, member in vars(capability).items():
            if name.startswith("_"):
                continue
            ours = inspect.getattr_static(cls, name, None)
            if isinstance(member, property):
                # An instance attribute may stand for a property (ShardedKVCache.shard_spec).
                assert not inspect.isfunction(ours), f"{cls.__name__}.{name} is a method"
            elif inspect.isfunction(member):
                assert inspect.isfunction(ours), f"{cls.__name__}.{name} is not a method"
                assert _parameters(ours) == _parameters(member), f"{cls.__name__}.{name}"


@pytest.mark.parametrize(
    "make, ranges",
    [(one, [(0, 4)]), (mesh, [(0, 2), (2, 4)]), (pool, [(0, 4)]), (pool_mesh, [(0, 2), (2, 4)])],
    ids=["one", "mesh", "pool", "pool_mesh"],
)
def test_a_cache_says_how_its_heads_are_split(make, ranges):
    with make() as cache:
        assert cache.kv_head_ranges == ranges
        assert cache.shard_spec.num_kv_heads == ranges[0][1] - ranges[0][0]
        assert head_split(cache) == [list(r) for r in ranges]
        assert layout_of(cache)["num_kv_heads"] == HEADS


def test_an_engine_cache_names_its_one_device_parts():
    with one() as cache:
        assert cache.tier_parts() == [TierPart(None, cache, slice(0, HEADS), slice(0, 2))]
    with mesh() as cache:
        parts = cache.tier_parts()
        assert [p.shard for p in parts] == sorted(cache.shards)
        assert [(p.heads.start, p.heads.stop) for p in parts] == [(0, 2), (2, 4)]
        assert all(p.cache is cache.shards[p.shard] for p in parts)
        assert all((p.rows.start, p.rows.stop) == (0, 2) for p in parts)


@pytest.mark.parametrize(
    "make, endpoint",
    [(one, EngineTierEndpoint), (mesh, EngineTierEndpoint), (pool, PoolStagingEndpoint)],
    ids=["one", "mesh", "pool"],
)
def test_pd_picks_the_endpoint_by_capability(make, endpoint):
    with make() as cache:
        chosen = slot_rows_endpoint(
            cache, "KVReceiver", populate_pools=False, populate_staging=False
        )
        assert type(chosen) is endpoint


@pytest.mark.parametrize("make", [batch_shards, hybrid], ids=["batch_shards", "hybrid"])
def test_pd_refuses_a_cache_without_the_capabilities_by_the_same_message(make):
    with make() as cache:
        with pytest.raises(
            TypeError,
            match=r"KVSender needs an OffloadedKVCache, a ShardedKVCache or a HostPoolKVCache; "
            rf"got {type(cache).__name__}",
        ):
            slot_rows_endpoint(cache, "KVSender", populate_pools=False, populate_staging=False)


# -- no isinstance on a concrete cache class ------------------------------------------------

KNOWN_CACHES = {
    "OffloadedKVCache",
    "ShardedKVCache",
    "HostPoolKVCache",
    "BatchShardedPoolKVCache",
    "HybridKVCache",
}
# The one module that may choose by class: it builds the caches.
FACTORY = "factory"


def cache_classes(root: pathlib.Path = PACKAGE) -> set[str]:
    """The concrete cache classes: every class under ``caches/`` named ``...KVCache`` that
    is not a protocol."""
    out = set()
    for path in (root / "caches").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("KVCache"):
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                if "Protocol" not in bases:
                    out.add(node.name)
    return out


class _ClassChecks(ast.NodeVisitor):
    """``(function, line, class)`` of every ``isinstance(x, C)``, ``issubclass(x, C)``
    (``C`` alone, in a tuple, or as ``module.C``, under any alias) and ``type(x) is C`` of a
    class in ``classes``."""

    def __init__(self, tree: ast.Module, classes: set[str]):
        self.classes = classes
        self.aliases = {
            alias.asname or alias.name: alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []
        self.visit(tree)

    def _named(self, node: ast.expr) -> list[str]:
        if isinstance(node, ast.Tuple):
            return [n for e in node.elts for n in self._named(e)]
        if isinstance(node, ast.Name):
            name = self.aliases.get(node.id, node.id)
        elif isinstance(node, ast.Attribute):
            name = node.attr
        else:
            return []
        return [name] if name in self.classes else []

    def _note(self, node: ast.AST, target: ast.expr) -> None:
        where = ".".join(self.scope) or "<module>"
        self.found += [(where, node.lineno, name) for name in self._named(target)]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass"):
            if len(node.args) == 2:
                self._note(node, node.args[1])
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        left = node.left
        if (
            isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name)
            and left.func.id == "type"
        ):
            if all(isinstance(op, (ast.Is, ast.Eq, ast.IsNot, ast.NotEq)) for op in node.ops):
                for target in node.comparators:
                    self._note(node, target)
        self.generic_visit(node)


def concrete_class_checks(path: pathlib.Path, classes: set[str]) -> list[tuple[str, int, str]]:
    """``(function, line, class)`` of every check of a concrete cache class in ``path``."""
    return _ClassChecks(ast.parse(path.read_text()), classes).found


def _package_modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[0] == "kernels":  # A link to the top-level kernels/, which knows no cache.
            continue
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def test_the_scan_knows_every_cache_class():
    assert cache_classes() >= KNOWN_CACHES


def test_no_module_outside_the_factory_checks_a_concrete_cache_class():
    classes = cache_classes()
    bad = []
    for module, path in _package_modules().items():
        if module == FACTORY:
            continue
        for function, line, name in concrete_class_checks(path, classes):
            bad.append(f"{module}:{line} ({function}) checks isinstance(..., {name})")
    assert not bad, "ask the cache, or isinstance on a capability protocol:\n" + "\n".join(bad)


def test_the_scan_catches_a_planted_check(tmp_path):
    """The scan is not vacuous: a module that checks cache classes every way it knows is
    caught at each, and checks on capabilities or other classes are not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from jax_tpusync.caches.pool.cache import HostPoolKVCache as Pool\n"
        "from jax_tpusync.caches.capabilities import StagedRows\n"
        "import jax_tpusync.caches.offloaded.mesh as mesh\n"
        "\n"
        "def choose(cache):\n"
        "    if isinstance(cache, (int, Pool)):\n"
        "        return 1\n"
        "    if isinstance(cache, mesh.ShardedKVCache) or type(cache) is OffloadedKVCache:\n"
        "        return 2\n"
        "    return isinstance(cache, (StagedRows, dict))\n"
        "\n"
        "class Chooser:\n"
        "    def pick(self, cls):\n"
        "        return issubclass(cls, HybridKVCache)\n"
    )
    found = concrete_class_checks(planted, cache_classes())
    assert found == [
        ("choose", 6, "HostPoolKVCache"),
        ("choose", 8, "ShardedKVCache"),
        ("choose", 8, "OffloadedKVCache"),
        ("Chooser.pick", 14, "HybridKVCache"),
    ]
