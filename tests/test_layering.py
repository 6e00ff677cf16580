"""The package's layering: no import cycle among totalreduce's modules, pure algorithms/topology.

A static scan of every ``import`` and ``from`` statement (top level or inside a
function: a lazy import still makes a cycle), resolved to the package's modules.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "totalreduce"

#: Every module takes part in the cycle check.
EXCLUDED_FROM_CYCLES: tuple[str, ...] = ()

#: algorithms/ and topology/ are pure: they import none of these.
PURE = ("totalreduce.algorithms", "totalreduce.topology")
ABOVE_PURE = (
    "totalreduce.native",
    "totalreduce.service",
    "totalreduce.lane",
    "totalreduce.engine",
    "totalreduce.transport",
    "totalreduce.api",
    "totalreduce.torch",
    "totalreduce.daemon",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _known(name: str) -> str | None:
    """The package module ``name`` is, or lies in (``a.b.C`` -> ``a.b``); None if outside."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The package modules ``module`` imports (``from pkg import submodule``: the submodule)."""
    path, is_pkg = MODULES[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            names = subs if len(subs) == len(node.names) else [*subs, target]
        for name in names:
            known = _known(name)
            if known is not None and known != module:
                found.add(known)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_the_package() -> None:
    assert "totalreduce.service.service" in MODULES
    assert "totalreduce.group" in GRAPH["totalreduce.api"]
    assert "totalreduce.service.service" in GRAPH["totalreduce.api"]


def test_the_scan_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = {
        m: {d for d in deps if not _within(d, EXCLUDED_FROM_CYCLES)}
        for m, deps in GRAPH.items()
        if not _within(m, EXCLUDED_FROM_CYCLES)
    }
    assert _cycles(graph) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _within(m, PURE)))
def test_algorithms_and_topology_are_pure(module: str) -> None:
    above = sorted(d for d in GRAPH[module] if _within(d, ABOVE_PURE))
    assert above == [], f"{module} imports {above}"


NATIVE_MODULES = sorted(m for m in MODULES if _within(m, ("totalreduce.native",)))


@pytest.mark.parametrize("module", NATIVE_MODULES)
def test_native_is_the_bottom_layer(module: str) -> None:
    """The compiled building blocks import nothing of the package but each other."""
    above = sorted(d for d in GRAPH[module] if not _within(d, ("totalreduce.native",)))
    assert above in ([], ["totalreduce"]), f"{module} imports {above}"


LANE_MODULES = sorted(m for m in MODULES if _within(m, ("totalreduce.lane",)))
#: What the compiled data plane sits on; the control plane (engine/) and everything above
#: it (service/, daemon/, the API) import the lane, never the other way.
BELOW_THE_LANE = (
    "totalreduce.lane",
    "totalreduce.protocol",
    "totalreduce.transport",
    "totalreduce.kernels",
    "totalreduce.native",
    "totalreduce.algorithms",
    "totalreduce.dtypes",
    "totalreduce.errors",
)


def test_the_scan_sees_the_lane() -> None:
    assert "totalreduce.lane.lane_core" in LANE_MODULES
    assert "totalreduce.lane.lane" in GRAPH["totalreduce.engine.loop"]


@pytest.mark.parametrize("module", LANE_MODULES)
def test_the_lane_imports_only_the_layers_below_it(module: str) -> None:
    """The data plane (lane/) never reaches up into the control plane (engine/) or above."""
    above = sorted(d for d in GRAPH[module] if not _within(d, BELOW_THE_LANE))
    assert above in ([], ["totalreduce"]), f"{module} imports {above}"


def test_group_does_not_reach_up_to_the_api() -> None:
    assert not _within("totalreduce.api", tuple(GRAPH["totalreduce.group"]))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith(".__main__")))
def test_every_module_imports(module: str) -> None:
    if _within(module, ("totalreduce.torch",)):
        pytest.importorskip("torch")
    importlib.import_module(module)
