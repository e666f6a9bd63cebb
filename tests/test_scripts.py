"""The scripts no ``reproduce.py`` job runs, each run as a user would: the README's main job
(``demo_cpu.py``), the GPU end-to-end check in its CPU mode (``e2e_gpu.py --cpu``) and the
engine A/B benchmark (``bench_ab.py``). A hang or a crash fails here, not in front of the
operator or the session that reaches for them."""

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
@pytest.mark.server
@pytest.mark.timeout(900)
def test_the_readmes_main_job_shows_storage_hits_with_outputs_equal_to_the_reference(tmp_path: Path) -> None:
    out = run(str(SCRIPTS / "demo_cpu.py"), "--workdir", str(tmp_path), timeout=840)
    assert "greedy outputs identical to the reference: True" in out and "OK: L3 turned the misses into hits" in out
    hits = [line for line in out.splitlines() if line.startswith("storage hits after restart:")]
    assert hits and int(hits[0].split(":")[1].split()[0]) > 0, out[-2000:]


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(900)
def test_the_gpu_check_in_its_cpu_mode_reads_prefixes_back_from_storage(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    run(str(SCRIPTS / "e2e_gpu.py"), "--cpu", "--prompts", "2", "--workdir", str(tmp_path),
        "--out", str(report), timeout=840)
    r = json.loads(report.read_text())
    assert r["cpu"] and r["outputs_identical"] and r["l3_on"]["cached_tokens"]["storage"] > 0
    assert r["l3_off"]["cached_tokens"]["storage"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_ab_builds_each_engines_helper_and_tables_both(tmp_path: Path) -> None:
    """HEAD against itself, one run each with bench_io's smoke arguments: each worktree's C
    helper is built (else its engine would move pages from Python), both runs land, and the
    table compares them."""
    before = worktrees()
    out = run(str(SCRIPTS / "bench_ab.py"), "--old", "HEAD", "--new", "HEAD", "--runs", "1",
              "--out", str(tmp_path), "--", "--sizes", "256K", "--repeat", "3", "--probe-repeat", "20", timeout=280)
    assert out.count("its C helper built in the worktree") == 2, out[-2000:]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    for name in ("old", "new"):  # each ran its own worktree's engine ("." is the stamping script's checkout)
        stamp = json.loads((tmp_path / f"{name}_1.json").read_text())["stamp"]
        assert (stamp["engine"], stamp["commit"]) == (".", head), stamp
    rows = [line for line in out.splitlines() if line.startswith("cold read / O_DIRECT read")]
    assert len(rows) == 1 and "256K" in rows[0], out[-2000:]
    assert worktrees() == before  # its worktrees are gone again


def worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
