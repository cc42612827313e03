"""The import graph of ``lightning_3d``: no cycles (type-only and function-local imports included) and layers.

Every module is parsed with ``ast`` (nothing is imported); relative imports are resolved against the
module's package. ``from X import Y`` counts as an import of the module ``X.Y`` when that is a module of the
package, else of ``X``. Importing ``a.b.c`` also runs the package ``a.b``'s ``__init__``, but that edge is
left out: every submodule would otherwise be in a cycle with a package ``__init__`` that re-exports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_3d"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE  # parsed, not imported
# What the parallel machinery must never reach for: the orchestrator, its features and the applications.
CORE_FORBIDDEN = (
    "lightning_3d.tools",
    "lightning_3d.train",
    "lightning_3d.strategy",
    "lightning_3d.reliability",
    "lightning_3d.checkpoint",
)


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that module ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
    edges = set()
    for target in targets:
        while target and target not in modules:  # `import a.b.c.function`-like spellings: the module part
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` for every module of the package at ``root``."""
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) for every strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_within(graph, sorted(c)) for c in components]


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A closed path through ``component`` starting at its first member (breadth-first, for the message)."""
    start, members = component[0], set(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    return component


def test_the_graph_sees_relative_type_only_and_local_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from .sub.b import B\nA = 1\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    import pkg.sub.c\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import A\n")
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},  # type-only; os is not in the package
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.sub.c"},  # function-local, absolute and relative
        "pkg.sub.c": {"pkg.a"},
    }
    assert sorted(map(sorted, find_cycles(graph))) == [sorted(["pkg.a", "pkg.sub.b", "pkg.a"])]
    real = import_graph()
    assert "lightning_3d.core.partition" in real["lightning_3d.core.parallelize"]  # from . import partition
    assert "lightning_3d.strategy" in real["lightning_3d"]


def test_cycle_finder_finds_a_cycle():
    cycles = find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_core_imports_no_outer_layer():
    bad = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        if name.startswith("lightning_3d.core")
        for target in sorted(targets)
        if target.startswith(CORE_FORBIDDEN)
    ]
    assert not bad, "\n".join(bad)
