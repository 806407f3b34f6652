"""No import cycles between megart's modules (a style rule of the project): every import of one
megart module by another, at the top or inside a function, counted as an edge, except imports
for type checking only (``if TYPE_CHECKING:``) and imports of a package's ``__init__`` (which
re-exports its modules by design)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PYTHON = Path(__file__).resolve().parents[1] / "python"


def _modules(root: Path) -> dict[str, ast.Module]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] != "__init__":
            out[".".join(parts)] = ast.parse(path.read_text())
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def import_graph(root: Path = PYTHON) -> dict[str, set[str]]:
    """Module -> the megart modules it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif node.module in modules:
                        graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_megart_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the package
    assert cycles(graph) == []


def test_a_cycle_is_found_even_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "megart" / "training"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from megart.training.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from megart.training import c\n")
    (pkg / "c.py").write_text("import megart.training.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megart.training.a import x\n"
    )
    (tmp_path / "megart" / "training" / "e.py").write_text("from megart.training.d import y\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["megart.training.a", "megart.training.b", "megart.training.c"]]
    assert graph["megart.training.d"] == set()  # type checking only
