"""The scripts no ``reproduce.py`` job runs, as a user would run them: the engine A/B
benchmark (``bench_ab.py``; every script's ``--help`` is test_kit.py's). A hang or a crash fails here, not
in front of the operator or the session that reaches for them. The scenarios of the
README's main job (``demo_cpu.py``) and of the GPU check's CPU mode (``e2e_gpu.py --cpu``)
run in test_e2e_server.py, on the servers the server lane shares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def run(*args: str, timeout: int) -> str:
    """``args`` run from the checkout; its output (stdout and stderr) once it exits 0."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.path.expanduser("~/.cache/sglang-tierstore/torch_extensions")}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_ab_builds_each_engines_helper_and_tables_both(tmp_path: Path) -> None:
    """HEAD against itself, one run each of the two systems the compared row needs, at
    bench_io's smoke size (its smoke run covers every system): each worktree's C helper is
    built (else its engine would move pages from Python), both runs land, and the table
    compares them."""
    before = worktrees()
    out = run(str(SCRIPTS / "bench_ab.py"), "--old", "HEAD", "--new", "HEAD", "--runs", "1",
              "--out", str(tmp_path), "--", "--sizes", "64K", "--repeat", "2", "--probe-repeat", "5", "--systems", "disk,ts_v1", timeout=280)
    assert out.count("its C helper built in the worktree") == 2, out[-2000:]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    for name in ("old", "new"):  # each ran its own worktree's engine ("." is the stamping script's checkout)
        stamp = json.loads((tmp_path / f"{name}_1.json").read_text())["stamp"]
        assert (stamp["engine"], stamp["commit"]) == (".", head), stamp
    rows = [line for line in out.splitlines() if line.startswith("cold read / O_DIRECT read")]
    assert len(rows) == 1 and "64K" in rows[0], out[-2000:]
    assert worktrees() == before  # its worktrees are gone again


def worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
