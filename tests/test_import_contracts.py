"""No import cycles among engine, kernels, app and widgets, and nothing directly in engine/ but its __init__.py.

The graph is built from the source, not from what Python happens to import: every import statement in a file
counts, inside function bodies and `if TYPE_CHECKING:` blocks too, relative ones resolved, and `from pkg import
name` counts both pkg and pkg.name (name may be a module). Which package may import which is stated once, in
pyproject.toml's import-linter contracts (`lint-imports`, run by .ci/run); a cycle is checked here because a
contract speaks of packages, and a cycle between two modules of one package breaks none of them.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "app", "widgets")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, a package named by its __init__.py."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name the file's import statements name, wherever they stand in it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from ..x import y`: level 1 is this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def known_module(name: str, files: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of ours (engine.x.Class -> engine.x); None for torch and the like."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    files = module_files(root, packages)
    graph = {}
    for module, path in files.items():
        targets = {known_module(name, files) for name in imported_names(path, module)}
        graph[module] = {target for target in targets if target is not None and target != module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Kosaraju's two passes, iterative (the graph is deeper than Python's recursion limit likes)."""
    finished, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                finished.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(sorted(graph[child]))))
    importers: dict[str, set[str]] = {module: set() for module in graph}
    for module, targets in graph.items():
        for target in targets:
            importers[target].add(module)
    components, placed = [], set()
    for start in reversed(finished):
        if start in placed:
            continue
        component, stack = [], [start]
        placed.add(start)
        while stack:
            node = stack.pop()
            component.append(node)
            for importer in importers[node] - placed:
                placed.add(importer)
                stack.append(importer)
        components.append(sorted(component))
    return components


def shortest_loop(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete loop through the component's first module (breadth-first, so the shortest), for the message."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & inside):
            if target == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return chain[::-1] + [start]
            if target not in parent:
                parent[target] = node
                queue.append(target)
    raise AssertionError(f"{component} is not strongly connected")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    return [component for component in strongly_connected(graph) if len(component) > 1]


def test_no_import_cycles():
    graph = import_graph(ROOT, PACKAGES)
    cycles = import_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s) (function-level imports count):\n" + "\n".join(
        f"  {' -> '.join(shortest_loop(c, graph))}" + (f"\n    (all of: {', '.join(c)})" if len(c) > 2 else "")
        for c in cycles)


def test_engine_holds_only_packages_at_its_top():
    loose = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules directly in engine/ (each belongs in the package of its side of the step): {loose}"


def test_the_graph_counts_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def build():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "sub" / "c.py").write_text("from ..a import build\nimport torch\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg", "pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert shortest_loop(["pkg.a", "pkg.sub.b"], graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
