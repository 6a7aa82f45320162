"""The package's shape: rooms that import only downward (no import circle, checked the way
../shared/tools/import-cycles does), a root with nothing but the entry points, and device
branches only inside backends/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pypto_serving"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, at any level of the file."""
    is_pkg = path.name == "__init__.py"
    base = module_name(path).split(".") if is_pkg else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + [node.module or ""])
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of 2+ modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        # a package's own __init__ above a module does not count (the tool's rule)
        graph[name] = {m for m in imports_of(path, modules)
                       if m != name and not name.startswith(m + ".")}
    return graph


def test_no_import_circles() -> None:
    assert circles(package_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_root_holds_only_its_entry_points() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"]


def test_device_branches_live_in_the_backends() -> None:
    branch = re.compile(r"device.type|fast:")  # as `grep "device.type\|fast:"` reads it
    found = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py")
             if p.parent.name != "backends"
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []
