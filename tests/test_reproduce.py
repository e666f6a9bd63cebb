"""The committed results and the scripts that make them: every script's smoke run
(``reproduce.py --quick``) finishes and stamps its outputs, every file under
``scripts/results/`` is a job's output and carries its stamp, and the comparison helpers
say a difference only where the interval excludes it."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Optional

import pytest

from tierstore_kit import jobs, provenance, stats
from tierstore_kit.checkout import ROOT, load_script

def smoke_runs() -> list[list[jobs.Job]]:
    """The smoke runs the suite makes: one per distinct script and arguments (interference's
    is the load test's), a job whose arguments read another's results (``{results}/<job>``:
    the planner validates the load test's run) made after that one, in the same run."""
    runs: list[list[jobs.Job]] = []
    for j in jobs.JOBS:
        reads = [r for r in runs if any(f"{{results}}/{o.name}" in j.quick for o in r)]
        if reads:
            reads[0].append(j)
        elif not any((o.script, o.quick) == (j.script, j.quick) for r in runs for o in r):
            runs.append([j])
    return runs


SMOKE_S = 600  # what one smoke run may take: the load tests' starts one CPU server


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_S + 60)  # (the suite's 300 s per test would cut the load test's off first)
@pytest.mark.parametrize("jobs", [pytest.param(r, marks=[pytest.mark.server] if any(j.server for j in r) else [])
                                  for r in smoke_runs()], ids=lambda r: "+".join(j.name for j in r))
def test_every_script_has_a_smoke_run_that_finishes_and_stamps(jobs: list[jobs.Job], tmp_path: Path) -> None:
    """A hang or a crash of a benchmark, the stress run, the load test or the suite's own
    timing fails here, not in the next session that tries to regenerate its results. A smoke
    run checks that a job runs and stamps its outputs, not its figures."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--quick", "--only",
                          ",".join(j.name for j in jobs), "--results", str(tmp_path)],
                         capture_output=True, text=True, timeout=SMOKE_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for job in jobs:
        for name in job.outputs:
            path = tmp_path / job.name / name
            s = provenance.read_stamp(path)
            assert s and s["commit"] == commit and s["command"].startswith(f"python3 scripts/{job.script}"), (path, s)
            assert {"servers", "server_flags", "packages", "machine", "dirty"} <= set(s)
            assert {"cores", "cpu", "mem_gib", "kernel", "disk"} <= set(s["machine"])
            if path.suffix == ".json":
                json.loads(path.read_text())


def test_the_load_test_jobs_share_one_smoke_run_whose_workload_the_planner_validates() -> None:
    """loadtest, interference and planner make one smoke run between them (one server start),
    and the planner can validate it only because it ran plan_validate.py's smoke workload."""
    assert [[j.name for j in r] for r in smoke_runs() if any(j.server for j in r)] == [["loadtest", "planner"]]
    plan_validate = load_script("plan_validate")

    args = jobs.QUICK_LOADTEST
    given = {args[i][2:]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    first = next(iter(plan_validate.VARIANTS.values()))
    for key, value in {**plan_validate.WORKLOAD, **first, **plan_validate.QUICK}.items():
        assert float(given[key]) == float(value), (key, given.get(key), value)


def test_every_committed_result_is_a_jobs_output_and_the_record_of_a_clean_commit() -> None:
    """What lies under scripts/results/ is exactly what reproduce.py regenerates: each file
    is an output of its job's directory and the record of a run (``jobs.problem``):
    stamped, clean, on this checkout's engine. A stale result (code changed since) is not
    failed here: figures.py marks it where its figures stand (test_figures.py)."""
    outputs = {f"scripts/results/{j.name}/{o}" for j in jobs.JOBS for o in j.outputs}
    patterns = [f"scripts/results/{j.name}/{g}" for j in jobs.JOBS for g in j.also]
    stray = [rel for p in sorted((ROOT / "scripts" / "results").rglob("*")) if p.is_file()
             for rel in [str(p.relative_to(ROOT))]
             if rel not in outputs and not any(fnmatch.fnmatch(rel, g) for g in patterns)]
    broken = [line for j in jobs.JOBS for line in jobs.problems(j)]
    assert stray == [] and broken == []


def test_a_result_is_no_record_when_missing_unstamped_dirty_or_another_checkouts_and_stale_when_older(
        tmp_path: Path) -> None:
    """What ``reproduce.py --stale`` and ``--list`` go by, on a job's files stamped by hand:
    HEAD's clean commit is fresh; a commit before the engine's code changed is stale and
    still a record; a dirty stamp, another checkout's engine, no stamp or a missing output
    is no record (what CI fails on)."""
    job = jobs.job_named("bench_tags")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = tmp_path / job.name
    out.mkdir()

    def stamp(commit: Optional[str], dirty: bool = False, engine: str = ".") -> None:
        s = {"commit": commit, "dirty": dirty, "engine": engine, "command": "python3 scripts/bench_tags.py"} if commit else None
        (out / "bench_tags.json").write_text(json.dumps({"stamp": s, "x": 1} if s else {"x": 1}))
        (out / "bench_tags.txt").write_text((provenance.header(s) + "\n" if s else "") + "figures\n")

    def whys(lines: list[str]) -> list[str]:
        return [w.split(": ", 1)[1] for w in lines]

    stamp(head)
    if not jobs.changed_since(head, jobs.sources(job)):  # (uncommitted code stales even HEAD)
        assert jobs.why_stale(job, tmp_path) == [] and jobs.measured(job, tmp_path) is None
    engine_before = "2c494a6"  # the base bench_caller measures against: the engine's code changed since
    assert jobs.changed_since(engine_before, jobs.sources(job))
    stamp(engine_before)
    why = jobs.why_stale(job, tmp_path)
    assert len(why) == 2 and all(f"changed since {engine_before}" in w for w in why), why
    assert jobs.problems(job, tmp_path) == []
    commit, behind = jobs.measured(job, tmp_path) or ("", 0)
    assert commit.startswith(engine_before) and behind >= 1
    stamp(head, dirty=True)
    assert whys(jobs.problems(job, tmp_path)) == ["stamped dirty"] * 2
    stamp(head, engine="/tmp/x")
    assert whys(jobs.problems(job, tmp_path)) == ["measured another checkout's engine (/tmp/x)"] * 2
    assert jobs.measured(job, tmp_path) is None
    stamp(None)
    assert sorted(whys(jobs.problems(job, tmp_path))) == ["unstamped", "unstamped"]
    (out / "bench_tags.txt").unlink()
    assert any(w.endswith("bench_tags.txt: missing") for w in jobs.problems(job, tmp_path))


def test_code_is_the_syntax_tree_for_python_and_the_uncommented_text_for_c_and_lua() -> None:
    """Comments, docstrings and formatting are not code; a changed value, a string that
    looks like a comment, or a statement are."""
    py = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    assert jobs.code("a.py", py) == jobs.code("a.py", "def f( x ):\n    '''Other doc.'''\n\n    return (x+1)\n")
    assert jobs.code("a.py", py) != jobs.code("a.py", py.replace("x + 1", "x + 2"))
    assert jobs.code("a.py", py) != jobs.code("a.py", py.replace('"""Doc."""', 'print("Doc.")'))
    c = 'int f(void) {\n    /* block\n       comment */\n    return g("a//b", \'/\'); // line\n}\n'
    assert jobs.code("x.c", c) == jobs.code("x.c", 'int f(void) {\n\n  return g("a//b", \'/\');\n}\n')
    assert jobs.code("x.c", c) != jobs.code("x.c", c.replace("a//b", "a/b"))
    assert jobs.code("x.c", c) != jobs.code("x.c", c.replace("/* block", "/* block */ x++; /*"))
    lua = 'local a = "x--y" -- note\n--[[ long\ncomment ]]\nreturn [[raw -- kept]]\n'
    assert jobs.code("s.lua", lua) == jobs.code("s.lua", 'local a  =  "x--y"\n\nreturn [[raw -- kept]]\n')
    assert jobs.code("s.lua", lua) != jobs.code("s.lua", lua.replace("x--y", "x"))
    assert jobs.code("s.lua", lua) != jobs.code("s.lua", lua.replace("raw -- kept", "raw"))
    assert jobs.code("f.json", "{ }") != jobs.code("f.json", "{}")


PROBE = """
import json, sys
from tierstore_kit import jobs
from tierstore_kit.checkout import load_script
figures = load_script("figures")
current = not any(figures.stale(page) for page in figures.PAGES)
if sys.argv[1] == "write":
    for page in figures.PAGES:
        page.write_text(figures.rewrite(page.read_text()))
print(json.dumps({"jobs": {j.name: jobs.measured(j) for j in jobs.JOBS if not jobs.problems(j)},
                  "current": current}))
"""


def test_a_comment_stales_nothing_and_a_code_change_puts_every_job_one_commit_behind(tmp_path: Path) -> None:
    """In a clone: a commit that changes only comments, a docstring and blank lines of an
    engine module leaves every job as it was; one line of code, uncommitted and then
    committed, puts every job one commit further behind, and figures.py's lines say so once
    rewritten (until then they are not current: test_figures.py fails). (Jobs whose results
    are no record are the committed-results test's.)"""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True, timeout=60)

    def probe(write: bool = False) -> tuple[dict[str, Any], bool]:
        """Each job's (commit measured, commits behind) or None, and whether the docs' lines
        were current (then, with ``write``, they are rewritten)."""
        out = subprocess.run([sys.executable, "-c", PROBE, "write" if write else "read"], cwd=clone,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        return {k: tuple(v) if v else None for k, v in got["jobs"].items()}, got["current"]

    before, _ = probe(write=True)  # (whether HEAD's own lines are current is test_figures.py's to say)
    git("commit", "-qam", "figures as they stand", "--allow-empty")
    errors = clone / "sglang_tierstore" / "errors.py"
    text = errors.read_text()
    doc_end = text.index('"""', 3)
    errors.write_text(text[:doc_end] + "\nA docstring grown by a sentence.\n" + text[doc_end:] + "\n\n# a comment\n")
    git("commit", "-qam", "comments only")
    assert probe() == (before, True)
    errors.write_text(errors.read_text() + "_CODE = 1\n")
    uncommitted, current = probe(write=True)
    assert not current  # the lines read one commit short, until rewritten
    for name, was in before.items():
        now = uncommitted[name]
        assert now is not None and now[1] == (was[1] if was else 0) + 1, (name, was, now)
    git("commit", "-qam", "code")  # the lines rewritten before the commit are current after it
    assert probe() == (uncommitted, True)
    readme = (clone / "README.md").read_text()
    assert f"`bench_io` measured at {uncommitted['bench_io'][0][:7]}, {uncommitted['bench_io'][1]} commit" in readme


def test_list_shows_each_jobs_state_and_stale_reruns_only_stale_results(tmp_path: Path) -> None:
    """``--list`` says of each committed job what the staleness functions say; ``--stale``
    leaves a job whose results describe this code alone (here, results stamped by hand with
    HEAD under ``--results``) and refuses a smoke run."""
    listed = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--list"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert listed.returncode == 0
    states = {line.split()[0]: line.split("min", 1)[1].split("scripts/")[0].strip()
              for line in listed.stdout.splitlines() if not line.startswith(" ")}
    assert states == {j.name: "no record" if jobs.problems(j) else "stale" if jobs.why_stale(j) else "fresh"
                      for j in jobs.JOBS}
    job = jobs.job_named("bench_tags")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (tmp_path / job.name).mkdir()
    s = {"commit": head, "dirty": False, "engine": ".", "command": "python3 scripts/bench_tags.py"}
    (tmp_path / job.name / "bench_tags.json").write_text(json.dumps({"stamp": s}))
    (tmp_path / job.name / "bench_tags.txt").write_text(provenance.header(s) + "\n")
    if jobs.changed_since(head, jobs.sources(job)):
        pytest.skip("the working tree's code differs from HEAD's: nothing is fresh")  # (never in CI's clean clone)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--stale", "--only", job.name,
                          "--results", str(tmp_path), "--no-figures"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "reproduce: stale: none" in out.stderr, out.stderr[-2000:]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--stale", "--quick"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--stale: regenerates measurements" in bad.stderr


def test_the_sources_of_a_result_hold_the_engine_and_what_its_script_imports() -> None:
    """The staleness check above is only as good as this list: the engine's modules and its
    Lua are in every job's, helpers where a script imports them, the planners only there."""
    bench = set(jobs.sources(jobs.job_named("bench_io")))
    assert {"sglang_tierstore/store.py", "sglang_tierstore/adapter.py", "sglang_tierstore/index/__init__.py",
            "sglang_tierstore/space/lua/writes.lua", "scripts/bench_io.py", "tierstore_kit/stats.py", "tierstore_kit/pools.py",
            "tierstore_kit/iobench.py"} <= bench
    assert not {"sglang_tierstore/tools/plan.py", "sglang_tierstore/tools/predict.py", "sglang_tierstore/tools/cli.py"} & bench
    assert {str(p.relative_to(jobs.ROOT)) for p in jobs.ENGINE_ENTRIES} <= bench
    load = set(jobs.sources(jobs.job_named("loadtest")))
    assert {"sglang_tierstore/tools/plan.py", "scripts/multiturn_loadtest.py", "tierstore_kit/multiturn.py",
            "tierstore_kit/cpu_harness/server.py", "tierstore_kit/cpu_harness/shim/sitecustomize.py"} <= load
    assert {"sglang_tierstore/tools/predict.py", "scripts/loadtest_tiers.py"} <= set(jobs.sources(jobs.job_named("planner")))


def test_a_job_that_fails_or_leaves_an_unstamped_output_fails_reproduce(tmp_path: Path) -> None:
    """reproduce.py's own checks, on scripts that exit 0 stamping nothing, or exit 3."""
    (tmp_path / "nostamp.py").write_text("print('figures, no stamp')\n")
    (tmp_path / "fails.py").write_text("raise SystemExit(3)\n")
    quiet = jobs.Job("nostamp", str(tmp_path / "nostamp.py"), (), (), ("nostamp.txt",), "nostamp.txt", 1)
    with pytest.raises(SystemExit, match="unstamped"):
        jobs.run_job(quiet, tmp_path / "r", quick=False, timeout_s=60)
    failing = jobs.Job("fails", str(tmp_path / "fails.py"), (), (), ("fails.txt",), "fails.txt", 1)
    with pytest.raises(SystemExit, match="exited 3"):
        jobs.run_job(failing, tmp_path / "r", quick=False, timeout_s=60)


def test_reproduce_refuses_to_measure_another_checkouts_engine(tmp_path: Path) -> None:
    """With the engine imported from elsewhere (an editable install left pointing at another
    clone), no job runs: its results would carry this commit's stamp over that engine."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "sglang_tierstore", other / "sglang_tierstore",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(other)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--only", "index_memory",
                          "--no-figures", "--results", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert out.returncode == 2 and f"the engine imported is {other}'s" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "r").exists()
    assert jobs.engine_problem(measuring=True) is None  # this checkout's own engine and helper, as CI installs them


def test_reproduce_measures_only_with_the_c_helper_built_from_this_source(tmp_path: Path) -> None:
    """A measurement stamped with this commit must have moved pages through the C helper this
    commit's source builds: none loaded, or one built before the source last changed, is refused."""
    source, built = tmp_path / "_pageio.c", tmp_path / "_pageio.so"
    source.write_text("/* source */")
    built.write_bytes(b"")
    os.utime(built, (source.stat().st_mtime - 10,) * 2)
    assert jobs.helper_problem(None, [source]) == "the engine's C helper (_pageio) is not built, so pages would move from Python"
    assert jobs.helper_problem(built, [source]) == "the engine's C helper _pageio.so was built before _pageio.c last changed"
    os.utime(built, (source.stat().st_mtime + 10,) * 2)
    assert jobs.helper_problem(built, [source]) is None
    other = tmp_path / "_exchange.c"  # a second source of the same module, changed after the build
    other.write_text("/* source */")
    os.utime(other, (built.stat().st_mtime + 10,) * 2)
    assert jobs.helper_problem(built, [source, other]) == "the engine's C helper _pageio.so was built before _exchange.c last changed"
    ext = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
    assert [ROOT / src for m in ext for src in m["sources"]] == list(jobs.HELPER_SOURCES)  # every source it builds from


FAKE_LOADTEST = """
import argparse, json, sys
from tierstore_kit.provenance import header
ap = argparse.ArgumentParser()
for a in ("--configs", "--rounds", "--label", "--output-dir", "--log", "--runs"):
    ap.add_argument(a)
ap.add_argument("--report-only", action="store_true")
a = ap.parse_args()
stamp = {{"commit": open(a.log + ".commit").read().strip(), "dirty": False, "engine": ".", "command": "python3 scripts/fake.py"}}
with open(a.log, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if a.report_only:
    for name in ("rounds.json", "planner.json"):
        json.dump({{"stamp": stamp}}, open(f"{{a.output_dir}}/{{name}}", "w"))
    open(f"{{a.output_dir}}/summary.txt", "w").write(header(stamp) + "\\nreport\\n")
else:
    for c in a.configs.split(","):
        json.dump({{"stamp": stamp}}, open(f"{{a.output_dir}}/{{c}}@{{a.label}}.summary.json", "w"))
    json.dump({{"stamp": stamp}}, open(f"{{a.output_dir}}/calibration@{{a.label}}.json", "w"))
"""


def test_a_rounds_job_runs_one_labelled_round_at_a_time_and_resumes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A load test's rounds run as labelled invocations, configurations rotated as the
    script's own --rounds rotates them, then one report; run again, only a round that
    is no longer fresh runs (a regeneration cut off mid-job goes on where it stopped). A
    commit landing meanwhile (the kept rounds' stamps name an older commit of the same
    code) is no reason to fail or rerun."""
    source = "deploy/tierstore.json"  # the fake's results "come from" a file the suite never edits
    monkeypatch.setattr(jobs, "sources", lambda j: [source])
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    older = subprocess.run([*git, "log", "-1", "--format=%H", "--", source], capture_output=True, text=True,
                           check=True).stdout.strip()  # the last commit changing it: the same code as HEAD's
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_LOADTEST.format())
    log = tmp_path / "calls.log"
    Path(f"{log}.commit").write_text(older)
    job = jobs.Job("lt", str(fake), ("--configs", "a,b", "--rounds", "3", "--output-dir", "{dir}", "--log", str(log)),
                        (), ("summary.txt", "rounds.json", "planner.json", "calibration@r1.json"), None, 1, rounds=True)
    results = tmp_path / "results"
    jobs.run_job(job, results, quick=False, timeout_s=60)
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [(c[c.index("--configs") + 1], c[c.index("--label") + 1]) for c in calls[:3]] == [
        ("a,b", "r1"), ("b,a", "r2"), ("a,b", "r3")]
    assert "--report-only" in calls[3] and calls[3][calls[3].index("--rounds") + 1] == "3" and len(calls) == 4
    assert calls[3][calls[3].index("--runs") + 1] == "a@r1,a@r2,a@r3,b@r1,b@r2,b@r3"
    assert sorted(p.name for p in (results / "lt").glob("calibration@*")) == ["calibration@r1.json"]
    stale = results / "lt" / "b@r2.summary.json"
    stale.write_text(json.dumps({"stamp": {"commit": head, "dirty": True, "engine": "."}}))
    log.unlink()
    Path(f"{log}.commit").write_text(head)
    jobs.run_job(job, results, quick=False, timeout_s=60)
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len(calls) == 2 and calls[0][calls[0].index("--label") + 1] == "r2" and "--report-only" in calls[1]
    assert provenance.read_stamp(results / "lt" / "calibration@r1.json")["commit"] == older  # kept
    assert provenance.read_stamp(results / "lt" / "summary.txt")["commit"] == head
    assert jobs.why_stale(job, results) == []


def test_a_stamp_round_trips_through_json_and_text(tmp_path: Path) -> None:
    s = provenance.stamp(["scripts/x.py", "--flag"], directory=str(tmp_path), server_flags=["--save ''"])
    assert s["command"] == "python3 scripts/x.py --flag" and s["server_flags"] == ["--save ''"]
    (tmp_path / "r.txt").write_text(provenance.header(s) + "\nfigures\n")
    (tmp_path / "r.json").write_text(json.dumps({"stamp": s, "x": 1}))
    assert provenance.read_stamp(tmp_path / "r.txt") == s == provenance.read_stamp(tmp_path / "r.json")
    (tmp_path / "bare.txt").write_text("figures only\n")
    assert provenance.read_stamp(tmp_path / "bare.txt") is None


def test_a_difference_is_said_only_where_the_interval_excludes_it() -> None:
    same = stats.paired_ratio([1.0, 1.1, 0.9, 1.05, 0.95], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert same["lo"] < 1 < same["hi"] and not stats.differs(same)
    assert stats.say(same).startswith("no difference detected at +-")
    faster = stats.paired_ratio([2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert stats.differs(faster) and stats.say(faster).startswith("2.00x (")
    # pairing removes a drift both systems share: unpaired, the same samples hold 1
    a = [1.0 * k for k in (1, 2, 3, 4, 5, 6)]
    b = [0.9 * k for k in (1, 2, 3, 4, 5, 6)]
    assert stats.differs(stats.paired_ratio(a, b)) and not stats.differs(stats.unpaired_ratio(a, b))
    with pytest.raises(ValueError, match="differ in length"):
        stats.paired_ratio([1.0], [1.0, 2.0])
