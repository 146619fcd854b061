"""The installed package's shape: no import circle, no test fixtures shipped."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

import kvtier

PACKAGE = Path(kvtier.__file__).resolve().parent


def import_circles(graph: grimp.ImportGraph) -> list[set[str]]:
    """Every group of modules that import one another, directly or not (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(group)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return circles


def test_the_package_has_no_import_circle() -> None:
    # TYPE_CHECKING imports count: a circle the type checker sees is a
    # circle in the design. A compiled module is seen as its parent package.
    graph = grimp.build_graph("kvtier", cache_dir=None)
    assert "kvtier.tiers.fs.io" in graph.modules
    assert import_circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="a.b")
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a")
    graph.add_import(importer="a.c", imported="a.d")
    assert import_circles(graph) == [{"a", "a.b", "a.c"}]


def test_nothing_shipped_imports_the_test_tree_or_starts_test_servers() -> None:
    assert not (PACKAGE / "testing" / "servers.py").exists()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name == "tests" or name.startswith(("tests.", "kvtier.testing.servers")):
                    offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert offenders == []


def test_the_tiers_type_check_without_ignores() -> None:
    # Tier options keep their static type (``SecondaryTier[Options]``): no
    # tier needs to silence the type checker.
    silenced = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted((PACKAGE / "tiers").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "type: ignore" in line
    ]
    assert silenced == []


#: Most lines a docstring may span: module headers and docstrings say what a
#: thing is and its contract; explanations belong in docs/.
DOCSTRING_LINES = 15


def long_docstrings(source: str, name: str) -> list[str]:
    """``name:line`` of each module, class or function docstring in ``source``
    spanning more than :data:`DOCSTRING_LINES` lines."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, documented) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            assert doc.end_lineno is not None
            if doc.end_lineno - doc.lineno + 1 > DOCSTRING_LINES:
                found.append(f"{name}:{doc.lineno}")
    return found


def test_docstrings_stay_short() -> None:
    long = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in long_docstrings(path.read_text(), str(path.relative_to(PACKAGE)))
    ]
    assert long == []


def test_the_docstring_check_finds_a_long_one() -> None:
    essay = "\n".join(["x"] * (DOCSTRING_LINES + 1))
    source = f'"""Short."""\n\n\ndef f() -> None:\n    """{essay}"""\n'
    assert long_docstrings(source, "m.py") == ["m.py:5"]
    assert long_docstrings('"""Short."""\n', "m.py") == []
