"""No circle of imports between forerun's modules, counting the imports
inside functions (a lazy import hides a circle from the layer contract, not
from the design), and an import of a forerun module inside a function only
where it keeps something heavy out until it is needed.  Imports under
``if TYPE_CHECKING:`` do not run and do not count."""

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


#: Dependencies a user may not have installed (extras), which forerun
#: imports only where they are used, and those that take a start-up's time
#: (torch takes seconds; numpy and pydantic a tenth of one each): the
#: command line imports them only once a command needs them.
HEAVY = {"torch", "numpy", "pydantic", "llama_cpp", "fastapi", "uvicorn", "starlette",
         "transformers", "openai", "prometheus_client", "sse_starlette", "huggingface_hub"}


def top_level_imports(path: Path) -> list[str]:
    """What ``path`` imports when it is imported (not inside functions)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    return out


def loads(modules: dict[str, Path]) -> dict[str, set[str]]:
    """The third-party top-level packages each module brings in when it is
    imported, through forerun's modules (and their packages) at any depth."""
    memo: dict[str, set[str]] = {}

    def of(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        if name in memo:
            return memo[name]
        if name in seen:
            return set()
        seen = seen | {name}
        out: set[str] = set()
        parts = name.split(".")
        for i in range(1, len(parts)):        # the packages above it run first
            out |= of(".".join(parts[:i]), seen)
        for imported in top_level_imports(modules[name]):
            if not imported.startswith("forerun"):
                out.add(imported.split(".")[0])
                continue
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                out |= of(imported, seen)
        memo[name] = out
        return out

    return {name: of(name) for name in modules}


#: The command line's entry: it installs the handlers of Ctrl-C and SIGTERM
#: (forerun.cli.exits.run_command), and until then a signal ends Python
#: with a traceback; it imports each command's module once it runs, so that
#: the window before its handlers stays a few hundredths of a second.
STARTS_FIRST = {"forerun.cli.main"}


def lazy_imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """The forerun modules ``path`` imports inside functions: (function, module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in node.body:
                for child in ast.walk(inner):
                    if isinstance(child, ast.ImportFrom) and (child.module or "").startswith(
                            "forerun"):
                        for alias in child.names:
                            name = f"{child.module}.{alias.name}"
                            while name not in modules and "." in name:
                                name = name.rsplit(".", 1)[0]
                            out.append((node.name, name))
    return out


def test_a_forerun_module_is_imported_inside_a_function_only_to_keep_something_heavy_out():
    """Where a function imports a forerun module, importing it at the top
    would bring in what its importer does not have yet: torch, numpy or
    pydantic (the command line, and the modules that check options before
    anything loads, start without them) or an optional dependency
    (llama-cpp-python, fastapi, transformers).  Anything else is imported at
    the top of the module."""
    modules = module_names()
    brings = loads(modules)
    needless = []
    for name, path in modules.items():
        if name in STARTS_FIRST:
            continue
        heavy_here = brings[name]
        for function, imported in lazy_imports(path, modules):
            heavy = (brings[imported] | {imported}) & HEAVY
            if not heavy - heavy_here:
                needless.append(f"{name}.{function} imports {imported}")
    assert needless == [], "import these at the top of the module:\n" + "\n".join(needless)
