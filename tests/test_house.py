"""The package's layout as docs/design.md states it, checked on the source: the runtime SGLang
loads (adapter and engine) never imports the operator tools, and a tool loads only what it
needs. Imports are read from the syntax tree, every one of them: inside functions and under
``TYPE_CHECKING`` too, since each is an edge a reader or a later change follows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sglang_tierstore"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports anywhere in it, relative imports resolved."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {m for m in found if m in modules}


def test_the_runtime_never_imports_the_tools() -> None:
    runtime = [p for p in PACKAGE.rglob("*.py")  # (__main__ is ``python -m sglang_tierstore``: the CLI)
               if "tools" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py"]
    assert len(runtime) > 10
    bad = {module_name(p): sorted(m for m in imports(p) if m.startswith("sglang_tierstore.tools")) for p in runtime}
    assert {k: v for k, v in bad.items() if v} == {}


def test_a_tool_loads_neither_redis_nor_torch_unless_it_needs_them() -> None:
    """The planner is arithmetic: importing it must not start the engine's imports (the
    package's ``__init__`` exports lazily)."""
    code = ("import sys, sglang_tierstore.tools.plan, sglang_tierstore.tools.predict; "
            "bad = [m for m in ('redis', 'torch', 'sglang', 'sglang_tierstore.store') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_module_imports_its_way_back_to_itself() -> None:
    """The package is layered (docs/design.md): following imports from any module never
    leads back to it, with ``TYPE_CHECKING`` and function-level imports counted."""
    graph = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]  # (a package importing its own submodule names itself)
    assert cycles == []


def test_no_module_is_over_600_lines() -> None:
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in sizes.items() if n > 600} == {}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


# Where the runtime may sleep, reviewed: none of these runs under a lock an SGLang call takes
# (the embedded index's start-up and restart, on the backend's construction or the housekeeping
# thread; a tool's wait for a loading index). A new sleep fails here until it is reviewed.
SLEEPS_REVIEWED = {
    ("sglang_tierstore.embedded", "_stop_unprotected"),
    ("sglang_tierstore.embedded", "_run"),
    ("sglang_tierstore.embedded", "stop_embedded_redis"),
    ("sglang_tierstore.index.admin", "wait_loaded"),
}


def test_the_runtime_sleeps_only_where_reviewed() -> None:
    found = set()
    for p in PACKAGE.rglob("*.py"):
        if "tools" in p.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(p.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sleep":
                        found.add((module_name(p), fn.name))
    assert found == SLEEPS_REVIEWED
