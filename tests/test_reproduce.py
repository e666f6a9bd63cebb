"""The committed results and the scripts that make them: every script's smoke run
(``reproduce.py --quick``) finishes and stamps its outputs, every file under
``scripts/results/`` is a job's output and carries its stamp, and the comparison helpers
say a difference only where the interval excludes it."""

from __future__ import annotations

import ast
import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import compare  # noqa: E402
import provenance  # noqa: E402
import reproduce  # noqa: E402

# Files under scripts/results/ from before stamps, still quoted: the four-configuration load
# test of b823e0f (one run each). They go when reproduce.py regenerates the job; the list may
# only shrink.
UNREGENERATED = frozenset(f"scripts/results/loadtest/{name}" for name in (
    "calibration.json", "planner.json", "summary.txt", "compare_hits_over_time.png", "compare_residency.png",
    "compare_ttft_by_turn.png", "compare_ttft_cdf.png",
    *(f"{run}.{ext}" for run in ("no-hicache", "l2", "l2+file", "l2+tierstore") for ext in ("jsonl", "summary.json")),
))
ENGINE_ENTRY = ROOT / "sglang_tierstore" / "__init__.py"  # what SGLang's server loads, lazily the adapter


def _imports(path: Path) -> set[Path]:
    """The repository's files that ``path`` imports anywhere in it (inside functions too):
    the package's modules, and scripts' or tests' helpers by their bare names."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            parts = name.split(".")
            bases = [ROOT] if parts[0] == "sglang_tierstore" else [ROOT / "scripts", ROOT / "tests"]
            for base in bases:
                for cand in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
                    if cand.is_file():
                        found.add(cand)
    return found


def package_sources(script: str) -> list[str]:
    """The package's files a job's results come from: every module the engine imports and
    every one the job's script imports, directly or through its helpers (a planning module
    no job imports is not the engine)."""
    todo, seen = [ENGINE_ENTRY, ROOT / "scripts" / script], set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(_imports(f))
    return sorted(str(f.relative_to(ROOT)) for f in seen if f.parts[len(ROOT.parts)] == "sglang_tierstore")


SMOKES = list({(j.script, j.quick): j for j in reversed(reproduce.JOBS)}.values())[::-1]  # one per distinct smoke run


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=[pytest.mark.server] if j.server else []) for j in SMOKES],
                         ids=lambda j: j.name)
def test_every_script_has_a_smoke_run_that_finishes_and_stamps(job: reproduce.Job, tmp_path: Path) -> None:
    """A hang or a crash of a benchmark, the stress run, the load test or the suite's own
    timing fails here, not in the next session that tries to regenerate its results."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--quick", "--only", job.name,
                          "--results", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name in job.outputs:
        path = tmp_path / job.name / name
        s = provenance.read_stamp(path)
        assert s and s["commit"] == commit and s["command"].startswith(f"python3 scripts/{job.script}"), (path, s)
        assert {"servers", "server_flags", "packages", "machine", "dirty"} <= set(s)
        assert {"cores", "cpu", "mem_gib", "kernel", "disk"} <= set(s["machine"])
        if path.suffix == ".json":
            json.loads(path.read_text())


def test_every_committed_result_is_a_jobs_output_and_stamped() -> None:
    """What lies under scripts/results/ is exactly what reproduce.py regenerates: each
    file is an output of its job's directory, names the clean commit and the command it came
    from, and neither the engine, nor a package module the job's script imports, nor the
    script itself has changed since that commit."""
    outputs = {f"scripts/results/{j.name}/{o}" for j in reproduce.JOBS for o in j.outputs}
    patterns = [f"scripts/results/{j.name}/{g}" for j in reproduce.JOBS for g in j.also]
    stray, unstamped, stale = [], [], []
    sources = {j.script: package_sources(j.script) for j in reproduce.JOBS}
    for p in sorted((ROOT / "scripts" / "results").rglob("*")):
        rel = str(p.relative_to(ROOT))
        if not p.is_file() or rel in UNREGENERATED:
            continue
        if rel not in outputs and not any(fnmatch.fnmatch(rel, g) for g in patterns):
            stray.append(rel)
        elif p.suffix in (".json", ".txt"):
            s = provenance.read_stamp(p) or {}
            job = next(j for j in reproduce.JOBS if rel.startswith(f"scripts/results/{j.name}/"))
            if not s.get("commit") or s.get("dirty") is not False:
                unstamped.append(rel)
            elif subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", s["commit"], "HEAD", "--",
                                 *sources[job.script], f"scripts/{job.script}"], check=False).returncode != 0:
                stale.append(f"{rel}: the engine, the package modules or scripts/{job.script} changed since "
                             f"{s['commit'][:12]}")
    assert stray == [] and unstamped == [] and stale == []


def test_the_sources_of_a_result_hold_the_engine_and_what_its_script_imports() -> None:
    """The staleness check above is only as good as this list: the engine's modules are in
    every job's, the planners only where a script imports them."""
    bench = package_sources("bench_io.py")
    assert {"sglang_tierstore/store.py", "sglang_tierstore/adapter.py", "sglang_tierstore/index/__init__.py"} <= set(bench)
    assert "sglang_tierstore/plan.py" not in bench and "sglang_tierstore/predict.py" not in bench
    assert "sglang_tierstore/plan.py" in package_sources("loadtest_tiers.py")
    assert {"sglang_tierstore/plan.py", "sglang_tierstore/predict.py"} <= set(package_sources("plan_validate.py"))


def test_a_job_that_fails_or_leaves_an_unstamped_output_fails_reproduce(tmp_path: Path) -> None:
    """reproduce.py's own checks, on scripts that exit 0 stamping nothing, or exit 3."""
    (tmp_path / "nostamp.py").write_text("print('figures, no stamp')\n")
    (tmp_path / "fails.py").write_text("raise SystemExit(3)\n")
    quiet = reproduce.Job("nostamp", str(tmp_path / "nostamp.py"), (), (), ("nostamp.txt",), "nostamp.txt", 1)
    with pytest.raises(SystemExit, match="not stamped"):
        reproduce.run_job(quiet, tmp_path / "r", quick=False, commit="0" * 40, timeout_s=60)
    failing = reproduce.Job("fails", str(tmp_path / "fails.py"), (), (), ("fails.txt",), "fails.txt", 1)
    with pytest.raises(SystemExit, match="exited 3"):
        reproduce.run_job(failing, tmp_path / "r", quick=False, commit="0" * 40, timeout_s=60)


def test_a_stamp_round_trips_through_json_and_text(tmp_path: Path) -> None:
    s = provenance.stamp(["scripts/x.py", "--flag"], directory=str(tmp_path), server_flags=["--save ''"])
    assert s["command"] == "python3 scripts/x.py --flag" and s["server_flags"] == ["--save ''"]
    (tmp_path / "r.txt").write_text(provenance.header(s) + "\nfigures\n")
    (tmp_path / "r.json").write_text(json.dumps({"stamp": s, "x": 1}))
    assert provenance.read_stamp(tmp_path / "r.txt") == s == provenance.read_stamp(tmp_path / "r.json")
    (tmp_path / "bare.txt").write_text("figures only\n")
    assert provenance.read_stamp(tmp_path / "bare.txt") is None


def test_a_difference_is_said_only_where_the_interval_excludes_it() -> None:
    same = compare.paired_ratio([1.0, 1.1, 0.9, 1.05, 0.95], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert same["lo"] < 1 < same["hi"] and not compare.differs(same)
    assert compare.say(same).startswith("no difference detected at +-")
    faster = compare.paired_ratio([2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert compare.differs(faster) and compare.say(faster).startswith("2.00x (")
    # pairing removes a drift both systems share: unpaired, the same samples hold 1
    a = [1.0 * k for k in (1, 2, 3, 4, 5, 6)]
    b = [0.9 * k for k in (1, 2, 3, 4, 5, 6)]
    assert compare.differs(compare.paired_ratio(a, b)) and not compare.differs(compare.unpaired_ratio(a, b))
    with pytest.raises(ValueError, match="differ in length"):
        compare.paired_ratio([1.0], [1.0, 2.0])
