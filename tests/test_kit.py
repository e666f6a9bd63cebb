"""How tests/ and scripts/ share code (issue 45, item 5): through one installed package,
``tierstore_kit``, never through ``sys.path``. A script imports the package and the kit, no
other script and nothing under tests/, so it runs where the package and its ``loadtest``
extra are installed and no test dependency is; a helper is written once."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tierstore_kit.checkout import ROOT, SCRIPTS

TESTS = ROOT / "tests"
KIT = ROOT / "tierstore_kit"
PACKAGE = ROOT / "sglang_tierstore"
# what only the ``test`` extra installs: a script must run without any of it
TEST_ONLY = ("pytest", "_pytest", "xdist", "pytest_timeout", "hypothesis", "fuse", "promql_parser", "kubernetes_validate")


def sources(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def imported(path: Path) -> set[str]:
    """Every module name ``path`` imports, anywhere in it (functions and ``TYPE_CHECKING`` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_nothing_edits_sys_path() -> None:
    """No script, test or kit module inserts into, appends to or assigns ``sys.path``."""
    edits = []
    for path in sources(SCRIPTS, TESTS, KIT):
        for node in ast.walk(ast.parse(path.read_text())):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value  # sys.path.insert(...), .append, .extend
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
            if isinstance(target, ast.Attribute) and target.attr == "path" and getattr(target.value, "id", None) == "sys":
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert edits == []


def test_a_script_imports_the_package_and_the_kit_only() -> None:
    """No script imports another script, conftest or a module of tests/, and neither a
    script nor the kit imports what only the test extra installs (so a smoke run needs none
    of it either); the runtime and its tools never import the kit."""
    local = {p.stem for p in SCRIPTS.glob("*.py")} | {p.stem for p in TESTS.glob("*.py")}
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m.split(".")[0] in local)
           for p in SCRIPTS.glob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}
    test_only = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m.split(".")[0] in TEST_ONLY)
                 for p in [*SCRIPTS.glob("*.py"), *sources(KIT)]}
    assert {k: v for k, v in test_only.items() if v} == {}
    kit = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m.split(".")[0] == "tierstore_kit")
           for p in sources(PACKAGE)}
    assert {k: v for k, v in kit.items() if v} == {}


def code_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function's body as code: its name, docstring and formatting left out."""
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) and isinstance(fn.body[0].value.value, str) else fn.body
    return ast.dump(ast.Module(body=body, type_ignores=[]), annotate_fields=False) + ast.dump(fn.args)


def test_each_helper_is_written_once() -> None:
    """No two module-level functions across scripts/, tests/ and the kit have the same code
    (a copy-paste twin of a helper, such as a free-port finder in each script). One-line
    bodies are left out: a ``return`` of one expression may well be said twice."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sources(SCRIPTS, TESTS, KIT):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) > 1:
                seen[code_of(node)].append(f"{path.relative_to(ROOT)}:{node.name}")
    assert [where for where in seen.values() if len(where) > 1] == []


BLOCK_AND_HELP = """
import runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None  # import raises ImportError, as where the module is not installed
failed = []
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
        failed.append(f"{{script}}: --help returned without exiting")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{{script}}: --help exited {{e.code}}")
    except BaseException as e:
        failed.append(f"{{script}}: {{type(e).__name__}}: {{e}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_script_explains_itself_without_a_test_dependency() -> None:
    """``--help`` of every script, in one process in which the test extra's modules cannot be
    imported and scripts/ is not on ``sys.path`` (``runpy``, not ``python script.py``): what
    each imports at its top resolves from the package, the kit and the ``loadtest`` extra,
    and its arguments parse."""
    scripts = [str(p) for p in sorted(SCRIPTS.glob("*.py"))]
    assert len(scripts) > 15
    out = subprocess.run([sys.executable, "-c", BLOCK_AND_HELP.format(blocked=TEST_ONLY), *scripts], cwd="/",
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]


def test_a_relay_holds_each_reply_for_its_delay_and_passes_every_byte(tmp_path: Path) -> None:
    """What bench_index's fleet regime stands on: a round trip through a relay takes at least
    its delay, a pipeline of 100 commands one delay (not 100), and large values come back whole."""
    import time

    import redis

    from tierstore_kit.relay import Relays
    from tierstore_kit.servers import RedisProc

    server = RedisProc(tmp_path / "redis")
    try:
        with Relays([server.port], 0.05) as relays:
            c = redis.Redis(port=relays.ports[0])
            c.ping()
            value = bytes(range(256)) * 4096  # 1 MiB: several chunks each way
            t0 = time.monotonic()
            c.set("k", value)
            assert c.get("k") == value
            assert time.monotonic() - t0 >= 2 * 0.05
            pipe = c.pipeline(transaction=False)
            for _ in range(100):
                pipe.incr("n")
            t0 = time.monotonic()
            assert pipe.execute()[-1] == 100
            assert 0.05 <= time.monotonic() - t0 < 100 * 0.05 / 4
            c.close()
    finally:
        server.stop()
