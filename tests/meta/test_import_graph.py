"""dcache's modules import each other without cycles, function-local imports included.

A cycle hidden behind a function-local import still couples the modules both ways: neither can be read, tested or
moved without the other, and the import order decides what works. The graph below has one edge per import
statement of a dcache module that names another dcache module, wherever the statement is (module level, inside a
function or a class), except under `if TYPE_CHECKING:` (annotations only, never run). `from package import name`
is an edge to the submodule `package.name` when that is a module, else to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def source_modules() -> dict[str, Path]:
    """Every module of the dcache distribution: dotted name -> file, from pyproject's package-dir."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in sorted(package_dirs.items()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            # a package-dir inside another one (none today) would list its files twice: the first name wins
            modules.setdefault(name, path)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, not descending into `if TYPE_CHECKING:` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(child) if not isinstance(child, (ast.Import, ast.ImportFrom)) else [child]
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the dcache modules it imports (see the module docstring for what counts)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base)
                           for alias in node.names]
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_local_imports_and_skips_type_checking_ones(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                              "from .a import f\n")
    (pkg / "c.py").write_text("from pkg.b import f\n")
    modules = {"pkg": pkg / "__init__.py", **{f"pkg.{m}": pkg / f"{m}.py" for m in "abc"}}
    graph = import_graph(modules)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.b"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_dcache_has_no_import_cycles():
    modules = source_modules()
    assert "dcache.api" in modules and "dcache.schedules.fbcache" in modules  # the scan found the packages
    found = cycles(import_graph(modules))
    assert not found, ("import cycles (each a set of dcache modules that import each other, function-local imports "
                       "included): " + "; ".join(" <-> ".join(c) for c in found) + ". Move the shared piece below "
                       "both modules, or pass it in, instead of importing it inside a function.")
