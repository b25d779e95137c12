"""The import graph of inflight/ keeps its layers (docs/architecture.md#layers): read with `ast`, every
import counts (module level, inside functions, under TYPE_CHECKING), so a circle cannot hide in a
function-local import and the CLI cannot slide back into a library package.

- every top-level package (or module) of inflight/ sits in one layer of LAYERS;
- no module imports a module of a higher layer;
- the top-level packages import each other without a circle (sim -> server -> sim would fail);
- no module circle anywhere;
- no circle between sibling subpackages and modules either (operator/children <-> operator/autoscaling
  would fail even when no two modules import each other).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "inflight"
PACKAGE = "inflight"

# Bottom to top; a module may import its own layer and the layers below.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("leaves", frozenset({"cache", "download", "openai_errors"})),
    ("core", frozenset({"engine", "sizing", "checkpoints", PACKAGE})),
    ("services", frozenset({"sim", "server", "bench", "router", "operator"})),
    ("cli", frozenset({"cli"})),
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a package's __init__ is the package's name)
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


@cache
def module_names() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` refers to: itself, or the package it is an attribute of."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from inflight import sizing` imports the module inflight.sizing, not the package.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for target in targets:
            known = _known(target, modules) if target.split(".")[0] == PACKAGE else None
            if known is not None and known != name:
                found.append(Import(name, known, node.lineno))
    return found


@cache
def import_graph() -> list[Import]:
    modules = module_names()
    found = {edge for name, path in modules.items() for edge in imports_of(name, path, modules)}
    return sorted(found, key=lambda edge: (edge.source, edge.line, edge.target))


def top_level(module: str) -> str:
    """The top-level package or module of `module` (`inflight` itself for the package's __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def layer_of(unit: str) -> int:
    for index, (_, units) in enumerate(LAYERS):
        if unit in units:
            return index
    raise KeyError(unit)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The circles of `graph`: its strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _edges_inside(circle: set[str], edges: list[Import], key: dict[str, str]) -> str:
    return "\n".join(
        f"    {edge}"
        for edge in edges
        if key[edge.source] != key[edge.target] and {key[edge.source], key[edge.target]} <= circle
    )


def test_every_top_level_package_has_a_layer() -> None:
    units = {top_level(name) for name in module_names()}
    placed = set().union(*(members for _, members in LAYERS))
    assert units - placed == set(), "place the new top-level package in LAYERS (and docs/architecture.md)"
    assert placed - units == set(), "LAYERS names a package that no longer exists"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for edge in import_graph():
        source, target = layer_of(top_level(edge.source)), layer_of(top_level(edge.target))
        if target > source:
            upward.append(f"{edge}: {LAYERS[source][0]} imports {LAYERS[target][0]}")
    assert upward == [], "imports that run up a layer:\n" + "\n".join(upward)


def test_top_level_packages_import_no_circle() -> None:
    edges = import_graph()
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        if top_level(edge.source) != top_level(edge.target):
            graph[top_level(edge.source)].add(top_level(edge.target))
    key = {edge.source: top_level(edge.source) for edge in edges} | {
        edge.target: top_level(edge.target) for edge in edges
    }
    circles = strongly_connected(graph)
    assert circles == [], "\n".join(
        f"packages {sorted(circle)} import each other:\n{_edges_inside(circle, edges, key)}"
        for circle in circles
    )


def test_no_module_circle() -> None:
    edges = import_graph()
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        graph[edge.source].add(edge.target)
    circles = strongly_connected(graph)
    identity = {name: name for name in module_names()}
    assert circles == [], "\n".join(
        f"modules {sorted(circle)} import each other:\n{_edges_inside(circle, edges, identity)}"
        for circle in circles
    )


def sibling_circles(edges: list[Import]) -> set[tuple[str, frozenset[str]]]:
    """Circles between the children (subpackages and modules) of each package below the top level."""
    by_parent: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for edge in edges:
        source, target = edge.source.split("."), edge.target.split(".")
        common = 0
        while common < min(len(source), len(target)) and source[common] == target[common]:
            common += 1
        if common < 2 or common == len(source) or common == len(target):
            continue  # top level (its own test), or a package and its own submodule
        by_parent[".".join(source[:common])][source[common]].add(target[common])
    return {
        (parent, frozenset(circle))
        for parent, graph in by_parent.items()
        for circle in strongly_connected(graph)
    }


def test_sibling_subpackages_import_no_circle() -> None:
    circles = sorted((parent, sorted(names)) for parent, names in sibling_circles(import_graph()))
    assert circles == [], f"sibling subpackages (and modules) of one package import each other: {circles}"


def test_the_reader_sees_function_local_and_relative_imports(tmp_path: Path) -> None:
    source = tmp_path / "inflight" / "server" / "demo.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "def f():\n    from inflight.cli import serve\n    from ..sim import live\n    from . import app\n"
    )
    modules = {
        "inflight.server.demo": source,
        "inflight.cli": tmp_path,
        "inflight.cli.serve": tmp_path,
        "inflight.sim.live": tmp_path,
        "inflight.server.app": tmp_path,
        "inflight.sim": tmp_path,
    }
    targets = [edge.target for edge in imports_of("inflight.server.demo", source, modules)]
    assert targets == ["inflight.cli.serve", "inflight.sim.live", "inflight.server.app"]
