"""No circle of imports between forerun's modules, counting the imports
inside functions (a lazy import hides a circle from the layer contract, not
from the design).  Imports under ``if TYPE_CHECKING:`` do not run and do not
count."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "forerun"

#: Circles still to break; none are left (issue 55 broke the last ones).
KNOWN: set[frozenset[str]] = set()


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The forerun modules ``path`` imports when it runs, at any depth."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            names: list[str] = []
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("forerun"):
                names = [f"{child.module}.{a.name}" for a in child.names]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names if a.name.startswith("forerun")]
            for name in names:
                while name not in modules and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in modules:
                    found.add(name)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: set[frozenset[str]] = set()

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
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.add(frozenset(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_new_circle_of_imports():
    modules = module_names()
    graph = {name: runtime_imports(path, modules) - {name} for name, path in modules.items()}
    found = circles(graph)
    assert found - KNOWN == set(), f"new circles of imports: {found - KNOWN}"
    assert KNOWN - found == set(), f"broken, so strike from KNOWN: {KNOWN - found}"


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == {frozenset("abc")}
    assert circles({"a": {"b"}, "b": set()}) == set()
