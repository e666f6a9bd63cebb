"""The checkout the kit belongs to: its root and scripts, and a script loaded as a module
for the tests that check its pieces (scripts import only the package and the kit, so
loading one runs nothing but its own definitions)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (registered in ``sys.modules``, as
    dataclasses and pickling need), loaded once per process."""
    if (mod := sys.modules.get(name)) is not None and getattr(mod, "__file__", None) == str(SCRIPTS / f"{name}.py"):
        return mod
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no script scripts/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
