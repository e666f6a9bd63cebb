#!/usr/bin/env python3
"""Regenerate the committed results under ``scripts/results/`` on the engine as it stands.

    python3 scripts/reproduce.py                       # every job, in order (hours on 2 cores)
    python3 scripts/reproduce.py --only bench_io,stress
    python3 scripts/reproduce.py --quick --results /tmp/smoke   # every script in seconds (what CI runs)
    python3 scripts/reproduce.py --list                # the jobs, and which committed results are stale
    python3 scripts/reproduce.py --stale               # only the jobs whose committed results are stale

Each job runs one script with the arguments of its committed run (or, with ``--quick``, the
smallest that still takes every code path) and writes ``<results>/<job>/``: the script's
JSON and its printed report, each stamped by ``provenance.py`` (commit and dirty flag,
command, index server versions and flags, packages, machine). After a full run the figures
the README and docs quote are regenerated from those files (``figures.py --write``).
A job that fails, hangs past its bound or leaves an output unstamped or stamped with
another commit fails the command (the other jobs still run, and their outputs stay). No job
runs while the engine Python imports is another checkout's, and no measurement (all but
``--quick``) while that engine's C helper is missing or older than its source.

A committed result is stale when an output is missing, unstamped or stamped dirty, or
when a file it comes from (:func:`sources`) changed since the commit its stamp names
(``tests/test_reproduce.py`` fails CI on one). ``--stale`` runs just those jobs, and a
load test runs one labelled round at a time, keeping the rounds already fresh: a
regeneration longer than one sitting goes on where it stopped.

``--quick`` never writes under ``scripts/results/`` unless ``--results`` says so: its
figures are smoke, not measurements.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from provenance import _git, read_stamp  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
ENGINE_ENTRY = ROOT / "sglang_tierstore" / "__init__.py"  # what SGLang's server loads, lazily the adapter
CPU_HARNESS = ROOT / "tests" / "cpu_harness"  # the CPU server's flags, model and the shim it imports


@dataclass(frozen=True)
class Job:
    """One script's committed run: ``{dir}`` in its arguments is the job's output directory,
    ``stdout`` the file its printed report goes to, ``outputs`` every file it leaves there."""

    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    outputs: tuple[str, ...]
    stdout: str | None
    minutes: float
    server: bool = False  # starts real SGLang servers (its smoke run is in the suite's server lane)
    also: tuple[str, ...] = ()  # glob patterns of further files it leaves (per-run files, plots)
    rounds: bool = False  # a load test whose --rounds run one labelled round at a time (see run_rounds)


# the load tests' smoke: two configurations, two rounds, a model too small to mean anything
QUICK_LOADTEST = ("--rounds", "2", "--configs", "l2,l2+tierstore", "--hidden", "64", "--layers", "2", "--num-clients", "2",
                  "--num-rounds", "2", "--request-length", "32", "--sub-question-input-length", "16",
                  "--system-prompt-length", "32", "--num-tenants", "1", "--output-length", "4", "--think-time-median", "1",
                  "--request-rate", "2", "--max-total-tokens", "2048", "--idle-s", "1",
                  "--workdir", "/var/tmp/tierstore-loadtest-smoke", "--output-dir", "{dir}")
LOADTEST_OUTPUTS = ("summary.txt", "rounds.json", "planner.json", "calibration@r1.json")
LOADTEST_ALSO = ("*.jsonl", "*.summary.json", "compare_*.png")

JOBS: tuple[Job, ...] = (
    Job("bench_io", "bench_io.py", ("--repeat", "11", "--probe-repeat", "1000", "--out", "{dir}/bench_io.json"),
        ("--sizes", "256K", "--repeat", "3", "--probe-repeat", "20", "--out", "{dir}/bench_io.json"),
        ("bench_io.json", "bench_io.txt"), "bench_io.txt", 10),
    Job("bench_mixed", "bench_io.py", ("--mixed", "--repeat", "15", "--out", "{dir}/bench_mixed.json"),
        ("--mixed", "--sizes", "256K", "--repeat", "3", "--reads", "3", "--out", "{dir}/bench_mixed.json"),
        ("bench_mixed.json", "bench_mixed.txt"), "bench_mixed.txt", 12),
    Job("bench_staging", "bench_staging.py", ("--repeat", "11", "--out", "{dir}/bench_staging.json"),
        ("--sizes", "256K", "--repeat", "3", "--out", "{dir}/bench_staging.json"),
        ("bench_staging.json", "bench_staging.txt"), "bench_staging.txt", 6),
    Job("bench_tags", "bench_tags.py", ("--reps", "15", "--out", "{dir}/bench_tags.json"),
        ("--reps", "3", "--out", "{dir}/bench_tags.json"), ("bench_tags.json", "bench_tags.txt"), "bench_tags.txt", 2),
    Job("index_memory", "index_memory.py", ("--pages", "100000", "--out", "{dir}/index_memory.json"),
        ("--pages", "2000", "--out", "{dir}/index_memory.json"),
        ("index_memory.json", "index_memory.txt"), "index_memory.txt", 2),
    Job("check_cost", "check_cost.py", ("--tree", "engine=.", "--runs", "3", "--out", "{dir}/check_cost.json"),
        ("--tree", "engine=.", "--runs", "1", "--pages", "3000", "--out", "{dir}/check_cost.json"),
        ("check_cost.json", "check_cost.txt"), "check_cost.txt", 4),
    Job("bench_caller", "bench_caller.py", ("--base", "2c494a6", "--runs", "6", "--out", "{dir}/bench_caller.json"),
        ("--quick", "--out", "{dir}/bench_caller.json"), ("bench_caller.json", "bench_caller.txt"), "bench_caller.txt", 8),
    Job("bench_index", "bench_index.py", ("--out", "{dir}"), ("--quick", "--out", "{dir}"),
        ("bench_index.json", "bench_index.txt"), "bench_index.txt", 5),
    Job("stress", "stress.py", ("--procs", "3", "--threads", "2", "--seconds", "600", "--seed", "1", "--json", "{dir}/stress.json"),
        ("--procs", "2", "--threads", "1", "--seconds", "6", "--seed", "1", "--kill-every", "2", "--redis-every", "3",
         "--json", "{dir}/stress.json"),
        ("stress.json", "stress.txt"), "stress.txt", 12),
    Job("loadtest", "loadtest_tiers.py",
        ("--configs", "no-hicache,l2,l2+file,l2+tierstore", "--rounds", "3", "--num-clients", "20", "--num-rounds", "3",
         "--workdir", "/var/tmp/tierstore-loadtest",
         "--output-dir", "{dir}"),
        QUICK_LOADTEST, LOADTEST_OUTPUTS, None, 130, server=True, also=LOADTEST_ALSO, rounds=True),
    Job("interference", "loadtest_tiers.py",
        ("--configs", "l2,l2+file,l2+tierstore", "--rounds", "5", "--num-clients", "16", "--num-rounds", "3",
         "--think-time-median", "20", "--request-rate", "0.4", "--output-length", "32", "--idle-s", "20",
         "--workdir", "/var/tmp/tierstore-interference", "--output-dir", "{dir}"),
        QUICK_LOADTEST, LOADTEST_OUTPUTS, None, 75, server=True, also=LOADTEST_ALSO, rounds=True),
    Job("planner", "plan_validate.py", ("--output-dir", "{dir}"), ("--quick", "--output-dir", "{dir}"),
        ("validation.json", "validation.txt"), None, 30, server=True, also=("*/*",)),
    Job("suite", "suite_timing.py", ("--out", "{dir}/suite.json"), ("--quick", "--out", "{dir}/suite.json"),
        ("suite.json", "suite.txt"), "suite.txt", 25),
)


def _imports(path: Path) -> set[Path]:
    """The repository's files that ``path`` imports anywhere in it (inside functions too):
    the package's modules (relative imports resolved), and scripts' or tests' helpers by
    their bare names."""
    found: set[Path] = set()
    package = path.parent.relative_to(ROOT).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            parts = [p for p in name.split(".") if p]
            if not parts:
                continue
            bases = [ROOT] if parts[0] == "sglang_tierstore" else [ROOT / "scripts", ROOT / "tests"]
            for base_dir in bases:
                for cand in (base_dir.joinpath(*parts).with_suffix(".py"), base_dir.joinpath(*parts, "__init__.py")):
                    if cand.is_file():
                        found.add(cand)
    return found


# Earlier versions of a file whose outputs are the same as the file's now (shown by
# tests/test_reproduce.py::test_equivalent_versions_give_the_same_outputs): a result made
# with one is not stale for the change. Only refactors go here; a change in what a file
# computes never does.
EQUIVALENT = {"scripts/compare.py": ("a65415b",)}  # 4ada918 gave the three bootstraps one percentile step


def show(commit: str, path: str) -> str:
    """``path`` as it was at ``commit``."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def changed_since(commit: str, files: list[str]) -> list[str]:
    """The files of ``files`` that differ between ``commit`` and HEAD, less those whose
    version at ``commit`` is one of their EQUIVALENT versions."""
    out = subprocess.run(["git", "-C", str(ROOT), "diff", "--name-only", commit, "HEAD", "--", *files],
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if not any(show(commit, f) == show(c, f) for c in EQUIVALENT.get(f, ()))]


def sources(job: Job) -> list[str]:
    """The files a job's results come from: the job's script and everything it imports,
    directly or through its helpers (scripts/, tests/), the engine's modules with the Lua the
    index runs and the C the page I/O runs, and for a job that starts SGLang servers the CPU
    harness they run in (a planning module no job imports is not the engine)."""
    todo, seen = [ENGINE_ENTRY, HERE / job.script], set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(_imports(f))
    seen |= set((ROOT / "sglang_tierstore").rglob("*.lua")) | set((ROOT / "sglang_tierstore").rglob("*.c"))
    if job.server:
        seen |= {f for f in CPU_HARNESS.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    return sorted(str(f.relative_to(ROOT)) for f in seen)


def _why(path: Path, deps: list[str], changes_ok: bool = False) -> Optional[str]:
    """Why ``path`` does not describe HEAD (None: it does): missing, unstamped, stamped
    dirty, or (unless ``changes_ok``) one of ``deps`` changed since its commit."""
    if not path.exists():
        return "missing"
    if path.suffix not in (".json", ".txt"):
        return None
    s = read_stamp(path) or {}
    if not s.get("commit") or s.get("dirty") is not False:
        return "stamped dirty" if s.get("commit") else "unstamped"
    if not changes_ok and (changed := changed_since(s["commit"], deps)):
        return f"{', '.join(changed)} changed since {s['commit'][:12]}"
    return None


def why_stale(job: Job, results: Path = RESULTS, changes_ok: bool = False) -> list[str]:
    """Why the job's results under ``results`` no longer describe HEAD, one line per file
    (empty: they do). Covers the outputs the job must leave and every stamped file it left;
    a stray file is not the job's concern (tests/test_reproduce.py catches those).
    ``changes_ok``: only missing, unstamped and dirty files count (a job being rerun)."""
    out = results / job.name
    files = {out / o for o in job.outputs} | {p for g in job.also for p in out.glob(g) if p.suffix in (".json", ".txt")}
    deps = sources(job)
    return [f"{path.relative_to(results.parent) if results == RESULTS else path}: {why}"
            for path in sorted(files) if (why := _why(path, deps, changes_ok))]


def job_named(name: str) -> Job:
    for j in JOBS:
        if j.name == name:
            return j
    raise SystemExit(f"reproduce: no job {name!r}; jobs: {', '.join(j.name for j in JOBS)}")


def labelled_rounds(args: Sequence[str]) -> tuple[list[tuple[list[str], list[str]]], list[str]]:
    """A load test's ``--configs C --rounds N`` as N invocations of one round each, labelled
    ``rK`` and with its configurations rotated K-1 places as the script's own ``--rounds``
    runs them ((configurations, arguments) each), then the report over them all
    (``--report-only``)."""
    a = list(args)
    i = a.index("--rounds")
    n = int(a[i + 1])
    del a[i : i + 2]
    j = a.index("--configs")
    configs = a[j + 1].split(",")
    rounds = []
    for k in range(n):
        rotated = configs[k % len(configs) :] + configs[: k % len(configs)]
        rounds.append((rotated, [*a[: j + 1], ",".join(rotated), *a[j + 2 :], "--label", f"r{k + 1}"]))
    return rounds, [*args, "--report-only"]


def _run(job: Job, argv: list[str], out: Path, sink_name: Optional[str], timeout_s: float) -> None:
    argv = [sys.executable, str(HERE / job.script), *(a.replace("{dir}", str(out)) for a in argv)]
    print(f"reproduce: {job.name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    with open(out / sink_name, "w") if sink_name else open("/dev/null", "w") as sink:
        try:
            rc = subprocess.run(argv, stdout=sink, cwd=HERE.parent, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise SystemExit(f"reproduce: {job.name} ran past {timeout_s:.0f} s") from None
    if rc != 0:
        raise SystemExit(f"reproduce: {job.name} exited {rc} (its report so far: {out / (sink_name or '')})")


def run_rounds(job: Job, args: Sequence[str], out: Path, timeout_s: float) -> None:
    """A rounds job, resumable: each round whose every run left a fresh summary (stamped
    clean, nothing it comes from changed since) is kept, the others run again, one
    labelled invocation each; then the extra calibrations go (round 1's is the job's)
    and the report runs over every round. A regeneration cut off mid-job goes on from
    the first round it had not finished."""
    out.mkdir(parents=True, exist_ok=True)
    deps = sources(job)
    rounds, report = labelled_rounds(args)
    for k, (configs, argv) in enumerate(rounds, 1):
        if all(_why(out / f"{c}@r{k}.summary.json", deps) is None for c in configs):
            print(f"reproduce: {job.name}: round r{k} kept (fresh)", file=sys.stderr, flush=True)
            continue
        _run(job, argv, out, None, timeout_s)
    for extra in out.glob("calibration@r*.json"):
        if extra.name != "calibration@r1.json":
            extra.unlink()
    _run(job, report, out, job.stdout, timeout_s)


def run_job(job: Job, results: Path, quick: bool, commit: str, timeout_s: float) -> float:
    """Run ``job`` into ``results/<name>``, replacing what was there (a rounds job keeps
    its fresh rounds: :func:`run_rounds`); returns its seconds. Raises SystemExit naming
    the job when it fails or an output is missing or misstamped."""
    out = results / job.name
    args = job.quick if quick else job.full
    t0 = time.monotonic()
    if job.rounds:
        run_rounds(job, args, out, timeout_s)
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        _run(job, list(args), out, job.stdout, timeout_s)
    for name in job.outputs:
        path = out / name
        if not path.exists():
            raise SystemExit(f"reproduce: {job.name} left no {path}")
        s = read_stamp(path) if path.suffix in (".json", ".txt") else {"commit": commit}
        kept = job.rounds and name.startswith("calibration@") and _why(path, sources(job)) is None  # a kept round's
        if not kept and (not s or s.get("commit") != commit):
            raise SystemExit(f"reproduce: {path} is not stamped with this commit ({commit[:12]}): {s and s.get('commit')}")
    return time.monotonic() - t0


def engine_problem(measuring: bool) -> Optional[str]:
    """Why the jobs must not run on the engine Python imports, or None. A result is stamped
    with this checkout's commit, so it must have measured this checkout's engine: ``pip
    install -e`` of another clone (a CI run's) repoints the import without a word. A
    measurement must also run the C helper built from this checkout's ``_pageio.c``, which
    the stamp does not show (see ``helper_problem``); a smoke run need not."""
    out = subprocess.run([sys.executable, "-c", "import sglang_tierstore, sglang_tierstore.pagefile as p; "
                          "print(sglang_tierstore.__file__); print(getattr(p._pageio, '__file__', ''))"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"reproduce: the engine does not import: {out.stderr.strip().splitlines()[-1:]}")
    engine, helper = out.stdout.splitlines()
    root = Path(engine).resolve().parent.parent
    if root != ROOT:
        return f"the engine imported is {root}'s, not this checkout's ({ROOT})"
    return helper_problem(Path(helper) if helper else None, ROOT / "sglang_tierstore" / "_pageio.c") if measuring else None


def helper_problem(built: Optional[Path], source: Path) -> Optional[str]:
    """Why the C helper the engine loaded (``built``, None where it loaded none) is not the
    one ``source`` builds, or None: the engine runs without it where it was never built, and
    an old build keeps loading after the source changes. Built before the source's last
    change means built from older source (a checkout's files are as new as the checkout)."""
    if built is None:
        return "the engine's C helper (_pageio) is not built, so pages would move from Python"
    if built.stat().st_mtime < source.stat().st_mtime:
        return f"the engine's C helper {built.name} was built before {source.name} last changed"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated jobs (default: all)")
    ap.add_argument("--quick", action="store_true", help="the smoke run of each job: seconds, not measurements")
    ap.add_argument("--results", help="where job directories go (default scripts/results/; with --quick a temporary directory)")
    ap.add_argument("--list", action="store_true", help="list the jobs, whether their committed results are stale, and stop")
    ap.add_argument("--stale", action="store_true", help="of the jobs chosen, run only those whose committed results are stale")
    ap.add_argument("--skip-server", action="store_true", help="leave out jobs that start real SGLang servers")
    ap.add_argument("--no-figures", action="store_true", help="do not regenerate the docs' figures afterwards")
    a = ap.parse_args()
    if a.list:
        for j in JOBS:
            why = why_stale(j)
            print(f"{j.name:<14} {j.minutes:>5.0f} min  {'stale' if why else 'fresh'}  scripts/{j.script} {' '.join(j.full)}")
            for line in why[:3]:
                print(f"{'':<22}{line}")
            if len(why) > 3:
                print(f"{'':<22}... and {len(why) - 3} more")
        return 0
    if a.stale and (a.quick or a.results):
        ap.error("--stale: regenerates committed results, so neither --quick nor --results")
    jobs = [job_named(n) for n in a.only.split(",")] if a.only else list(JOBS)
    if a.skip_server:
        jobs = [j for j in jobs if not j.server]
    if a.stale:
        jobs = [j for j in jobs if why_stale(j)]
        print(f"reproduce: stale: {', '.join(j.name for j in jobs) or 'none'} "
              f"({sum(j.minutes for j in jobs):.0f} min as planned)", file=sys.stderr, flush=True)
    if (problem := engine_problem(measuring=not a.quick)) is not None:
        ap.error(f"{problem}: pip install --no-deps -e {ROOT} first")
    results = Path(a.results) if a.results else (Path(tempfile.mkdtemp(prefix="reproduce-")) if a.quick else RESULTS)
    commit = _git("rev-parse", "HEAD")
    failed = []
    for j in jobs:
        try:
            secs = run_job(j, results, a.quick, commit, timeout_s=300 if a.quick else j.minutes * 60 * 3)
        except SystemExit as e:  # the next jobs still run: one broken script costs its own results only
            print(e, file=sys.stderr, flush=True)
            failed.append(j.name)
            continue
        print(f"reproduce: {j.name} done in {secs:.0f} s -> {results / j.name}", file=sys.stderr, flush=True)
    if failed:
        print(f"reproduce: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not a.quick and not a.no_figures and results == RESULTS:
        subprocess.run([sys.executable, str(HERE / "figures.py"), "--write"], check=True, cwd=HERE.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
