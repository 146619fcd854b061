"""Lines a reader follows along one path through kvtier: the functions,
methods and classes a path file names, each counted whole (signature,
docstring, body), a line counted once however many names cover it.

    python scripts/read_path.py scripts/paths/redis_get.txt

A path file lists ``module qualname`` pairs, one a line (``#`` comments).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path


def spans(path: Path) -> dict[str, tuple[int, int]]:
    """Every function's and class's qualified name -> (first line, last line)."""
    tree = ast.parse(path.read_text())
    found: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found[name] = (first, child.end_lineno or child.lineno)
                visit(child, name + ".")

    visit(tree, "")
    return found


def main(path_file: str) -> None:
    wanted: dict[str, list[str]] = defaultdict(list)
    for line in Path(path_file).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            module, qualname = line.split()
            wanted[module].append(qualname)
    total = 0
    for module, names in wanted.items():
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise SystemExit(f"no module {module}")
        source = Path(spec.origin)
        known = spans(source)
        lines: set[int] = set()
        for name in names:
            if name not in known:
                raise SystemExit(f"{module} has no {name}")
            first, last = known[name]
            lines.update(range(first, last + 1))
        count = len(lines)
        total += count
        size = len(source.read_text().splitlines())
        print(f"{count:5d}  {module} ({len(names)} functions of {size} lines)")
    print(f"{total:5d}  total")


if __name__ == "__main__":
    main(sys.argv[1])
