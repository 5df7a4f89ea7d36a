"""qsdp's import structure, read statically from its source (``ast``, nothing imported): no import
circle among its modules, and the performance model stands on layers 1-4 alone.

Every ``import`` counts, at module level or inside a function: an import deferred into a function
to break a circle still ties the two modules into one design. Imports under ``if TYPE_CHECKING:``
(annotations only) do not count. A package's ``__init__`` counts as the module of that name; a
module does not depend on its parent packages for importing them first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
APPLICATIONS = ("qsdp.bench", "qsdp.train", "qsdp.check", "qsdp.advise", "qsdp.cli")


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping ``if TYPE_CHECKING:`` blocks."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo += ast.iter_child_nodes(node)
    return found


def import_graph(root: Path = SRC, package: str = "qsdp") -> dict[str, set[str]]:
    """``{module: the modules of package it imports}``."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in modules.items():
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_circle_among_qsdp_modules(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_performance_model_imports_no_application_module(graph):
    seen, todo = set(), [m for m in graph if m == "qsdp.perfmodel" or m.startswith("qsdp.perfmodel.")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    assert "qsdp.perfmodel.step" in seen
    assert not [m for m in seen if m.startswith(APPLICATIONS)]


# The applications, lowest first: each may import the library and those before it, none after it.
APPLICATION_ORDER = ("qsdp.train", "qsdp.check", "qsdp.advise", "qsdp.bench", "qsdp.cli")


def _application(module: str) -> int | None:
    return next((i for i, app in enumerate(APPLICATION_ORDER) if module == app or module.startswith(app + ".")), None)


def test_no_application_imports_one_above_it(graph):
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if (lo := _application(m)) is not None and (hi := _application(t)) is not None and hi > lo)
    assert not upward, "imports that run back up: " + ", ".join(upward)


def test_the_library_imports_no_application(graph):
    library = [m for m in graph if _application(m) is None and m != "qsdp"]
    assert "qsdp.fsdp" in library and "qsdp.results" in library
    wrong = sorted(f"{m} -> {t}" for m in library for t in graph[m] if _application(t) is not None)
    assert not wrong, "library modules importing an application: " + ", ".join(wrong)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_circle_is_found_and_named_also_through_a_function_level_import(tmp_path, deferred):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    body = "def f():\n    from pkg.a import g\n" if deferred else "from . import a\n"
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import h\n" + body)
    (pkg / "c.py").write_text("from .b import g\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]
