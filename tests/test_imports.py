"""The package's modules import each other without cycles: a lower layer never imports a higher one,
even inside a function (a lazy import hides a cycle from Python, not from the layering)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "graph_trainer"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (`backends` is a link into the package: followed)."""
    found = {}
    for folder, _, files in os.walk(PACKAGE, followlinks=True):
        parts = ["graph_trainer", *Path(folder).relative_to(PACKAGE).parts]
        for name in files:
            if name.endswith(".py"):
                stem = parts if name == "__init__.py" else [*parts, name[:-3]]
                found[".".join(stem)] = Path(folder) / name
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` names in any import statement, wherever it stands. `from a import b`
    names `a.b` when that is a module, else `a` (b is defined there)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else source)
    return {t for t in targets if t.partition(".")[0] == "graph_trainer" and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_detector_sees_a_cycle_through_a_function_local_import(tmp_path):
    """Without this the no-cycle test below would pass on a detector that finds nothing."""
    graph = import_graph()
    unresolved = {(name, t) for name, targets in graph.items() for t in targets if t not in graph}
    assert not unresolved, "imports of the package the detector resolves to no module: " + repr(sorted(unresolved))
    assert "graph_trainer.passes.registry" in graph["graph_trainer.passes.memory_policy"]
    assert "graph_trainer.units" in graph["graph_trainer.plan"] or "graph_trainer.config" in graph["graph_trainer.plan"]
    modules = {"graph_trainer.a": tmp_path / "a.py", "graph_trainer.b": tmp_path / "b.py"}
    modules["graph_trainer.a"].write_text("def f():\n    from .b import g\n")
    modules["graph_trainer.b"].write_text("from graph_trainer import a\n")
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    assert _cycles(graph) == [["graph_trainer.a", "graph_trainer.b"]]


def test_no_import_cycle_among_package_modules():
    cycles = _cycles(import_graph())
    assert not cycles, "modules that import each other (directly or around a loop): " + "; ".join(" <-> ".join(c) for c in cycles)
