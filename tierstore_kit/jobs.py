"""The jobs behind the committed results under ``scripts/results/`` and what makes a result
the record of a commit (``scripts/reproduce.py`` runs them, ``scripts/figures.py`` quotes them).

A committed result is the record of the commit its stamp names. It is no record at all
(:func:`problem`; ``tests/test_reproduce.py`` fails CI on one) when an output is missing,
unstamped, stamped dirty or stamped with another checkout's engine. It is stale, which is
shown and never fatal, when the code of a file it comes from (:func:`sources`) changed since
that commit: :func:`code` compares syntax trees, so comments, docstrings and formatting
stale nothing. ``figures.py`` writes a line per stale job beside the figures it quotes
(:func:`measured`); ``reproduce.py --stale`` reruns just those jobs, and a load test runs one
labelled round at a time, keeping the rounds still fresh: a regeneration longer than one
sitting goes on where it stopped.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Optional, Sequence

from tierstore_kit.checkout import ROOT, SCRIPTS
from tierstore_kit.provenance import read_stamp

RESULTS = SCRIPTS / "results"
# what SGLang's server loads: the package, which exports the adapter and the engine lazily (by name,
# which no import statement shows), and those two
ENGINE_ENTRIES = tuple(ROOT / "sglang_tierstore" / n for n in ("__init__.py", "adapter.py", "store.py"))
CPU_HARNESS = ROOT / "tierstore_kit" / "cpu_harness"  # the CPU server's flags, model and the shim it imports


@dataclass(frozen=True)
class Job:
    """One script's committed run: ``{dir}`` in its arguments is the job's output directory
    (``{results}``: the directory of every job's), ``stdout`` the file its printed report
    goes to, ``outputs`` every file it leaves there."""

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
    extra: tuple[str, ...] = ()  # glob patterns (from the checkout's root) of further files its results come from


# the load-test jobs' one smoke run (loadtest, interference, and planner's --reuse of it): one configuration,
# one round, a model too small to mean anything, plan_validate.py's smoke workload
QUICK_LOADTEST = ("--rounds", "1", "--configs", "l2+tierstore", "--hidden", "64", "--layers", "2", "--num-clients", "2",
                  "--num-rounds", "2", "--request-length", "32", "--sub-question-input-length", "16",
                  "--system-prompt-length", "32", "--num-tenants", "1", "--output-length", "4", "--think-time-median", "1",
                  "--request-rate", "2", "--max-total-tokens", "2048", "--idle-s", "1", "--seed", "1",
                  "--think-time-sigma", "0.8", "--page-size", "16", "--max-running-requests", "3", "--hicache-ratio", "2",
                  "--l3-gb", "8", "--workdir", "/var/tmp/tierstore-loadtest-smoke", "--output-dir", "{dir}")
LOADTEST_OUTPUTS = ("summary.txt", "rounds.json", "planner.json", "calibration@r1.json")
LOADTEST_ALSO = ("*.jsonl", "*.summary.json", "compare_*.png")

# what the suite's time comes from beyond the engine: every test, every script the tests run, what CI installs
SUITE = ("tests/**/*", "tierstore_kit/**/*", "scripts/*.py", "scripts/setup.sh", "scripts/requirements-sglang.txt", "pyproject.toml", ".ci/run")

JOBS: tuple[Job, ...] = (
    Job("bench_io", "bench_io.py", ("--repeat", "11", "--probe-repeat", "1000", "--out", "{dir}/bench_io.json"),
        ("--sizes", "64K", "--repeat", "2", "--probe-repeat", "5", "--out", "{dir}/bench_io.json"),
        ("bench_io.json", "bench_io.txt"), "bench_io.txt", 10),
    Job("bench_mixed", "bench_io.py", ("--mixed", "--repeat", "15", "--out", "{dir}/bench_mixed.json"),
        ("--mixed", "--sizes", "256K", "--repeat", "2", "--reads", "2", "--write-mib", "64", "--out", "{dir}/bench_mixed.json"),
        ("bench_mixed.json", "bench_mixed.txt"), "bench_mixed.txt", 12),
    Job("bench_staging", "bench_staging.py", ("--repeat", "11", "--out", "{dir}/bench_staging.json"),
        ("--sizes", "64K", "--repeat", "2", "--out", "{dir}/bench_staging.json"),
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
        ("--procs", "2", "--threads", "1", "--seconds", "3", "--seed", "1", "--kill-every", "1", "--redis-every", "2",
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
    Job("planner", "plan_validate.py", ("--output-dir", "{dir}"), ("--quick", "--reuse", "{results}/loadtest", "--output-dir", "{dir}"),
        ("validation.json", "validation.txt"), None, 30, server=True, also=("*/*",)),
    Job("suite", "suite_timing.py", ("--out", "{dir}/suite.json"), ("--quick", "--out", "{dir}/suite.json"),
        ("suite.json", "suite.txt"), "suite.txt", 25, extra=SUITE),
)


def _imports(path: Path) -> frozenset[Path]:
    """The repository's files that ``path`` imports anywhere in it (inside functions too):
    the package's modules and the kit's (relative imports resolved), and the scripts it runs,
    named by their file names. Scripts import nothing else of the repository's: no other
    script, nothing under tests/."""
    return _imports_of(path, path.stat().st_mtime_ns)


@cache
def _imports_of(path: Path, mtime_ns: int) -> frozenset[Path]:
    found: set[Path] = set()
    package = path.parent.relative_to(ROOT).parts if path.is_relative_to(ROOT) else ()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".py"):
            if (SCRIPTS / node.value).is_file():  # a script it runs: os.path.join(HERE, "multiturn_loadtest.py")
                found.add(SCRIPTS / node.value)
            continue
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
            if parts[0] in ("sglang_tierstore", "tierstore_kit"):
                for cand in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
                    if cand.is_file():
                        found.add(cand)
    return frozenset(found)


# what of a C or Lua text is code: strings kept whole, comments and runs of blanks dropped
_C_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/|[ \t]+', re.S)
_LUA_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|\[(=*)\[.*?\]\1\]'
                         r'|--\[(=*)\[.*?\]\2\]|--[^\n]*|[ \t]+', re.S)


def _uncommented(text: str, tokens: re.Pattern[str]) -> str:
    def keep(m: re.Match[str]) -> str:
        t = m.group(0)
        return t if t[0] in "\"'[" else " "  # a string stays; a comment or a run of blanks is one blank
    return "\n".join(s for line in tokens.sub(keep, text).splitlines() if (s := line.strip()))


_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def _without_docstrings(node: ast.AST) -> ast.AST:
    """``node`` with the docstring of every module, class and function in it dropped
    (descending statement lists only: no docstring hides in an expression)."""
    body = getattr(node, "body", None)
    if isinstance(node, _DOCSTRING_OWNERS) and body and isinstance(body[0], ast.Expr) \
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    for field in _STATEMENT_LISTS:
        for child in getattr(node, field, None) or ():
            if isinstance(child, ast.AST):
                _without_docstrings(child)
    return node


def code(path: str, text: str) -> str:
    """What of a source file's text its results depend on: for Python its syntax tree less
    docstrings (comments, docstrings and formatting are not code), for C and Lua the text
    less comments, blank lines and runs of blanks, for anything else the text itself."""
    if path.endswith(".py"):
        try:
            return ast.dump(_without_docstrings(ast.parse(text)))
        except SyntaxError:
            return text
    if path.endswith((".c", ".h")):
        return _uncommented(text, _C_TOKENS)
    if path.endswith(".lua"):
        return _uncommented(text, _LUA_TOKENS)
    return text


# digests of code() by text, kept across runs (figures.py and the tests ask the same questions
# many times); keyed by this file too, so that a change to code() forgets them
_DIGESTS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-tierstore" / "code-digests"
_SALT = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _digest(path: str, text: bytes) -> str:
    """A digest of ``code(path, text)``: equal digests, equal code."""
    key = hashlib.sha256(f"{_SALT}:{Path(path).suffix}:".encode() + text).hexdigest()
    kept = _DIGESTS / key[:2] / key
    try:
        return kept.read_text()
    except OSError:
        pass
    digest = hashlib.sha256(code(path, text.decode(errors="replace")).encode()).hexdigest()
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}")
        tmp.write_text(digest)
        tmp.replace(kept)
    except OSError:  # a cache: computed again next time
        pass
    return digest


WORKTREE = "worktree"  # as a commit: the files as they are now, committed or not


def _code_at(commit: str, path: str) -> Optional[str]:
    """A digest of ``path``'s code at ``commit`` (a full hash, or WORKTREE); None where it is absent."""
    if commit != WORKTREE:
        return _committed_code(commit, path)
    try:
        return _file_code(path, (ROOT / path).stat().st_mtime_ns)
    except FileNotFoundError:
        return None


@cache
def _file_code(path: str, mtime_ns: int) -> str:
    return _digest(path, (ROOT / path).read_bytes())


@cache
def _committed_code(commit: str, path: str) -> Optional[str]:
    text = _blobs().read(f"{commit}:{path}")
    return None if text is None else _digest(path, text)


class _Blobs:
    """One ``git cat-file --batch`` for the process: a file's bytes at a commit, without a
    process per file."""

    def __init__(self) -> None:
        self._git = subprocess.Popen(["git", "-C", str(ROOT), "cat-file", "--batch"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)

    def read(self, spec: str) -> Optional[bytes]:
        """The bytes of ``commit:path``, or None where the commit has no such file."""
        assert self._git.stdin is not None and self._git.stdout is not None
        self._git.stdin.write(spec.encode() + b"\n")
        self._git.stdin.flush()
        header = self._git.stdout.readline().split()
        if len(header) != 3 or header[1] != b"blob":
            return None
        data = self._git.stdout.read(int(header[2]))
        self._git.stdout.read(1)  # the newline after the object
        return data


@cache
def _blobs() -> _Blobs:
    return _Blobs()


def _same_code(path: str, a: str, b: str) -> bool:
    """Whether ``path`` holds the same code at ``a`` and ``b``."""
    return _code_at(a, path) == _code_at(b, path)


def _git_lines(*args: str) -> list[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.split()


def _rev(commit: str) -> str:
    return _git_lines("rev-parse", commit)[0]


def changed_since(commit: str, files: list[str]) -> list[str]:
    """The files of ``files`` whose code (:func:`code`) differs between ``commit`` and the
    working tree."""
    touched = {*_git_lines("diff", "--name-only", commit, "--", *files),
               *_git_lines("ls-files", "--others", "--exclude-standard", "--", *files)}
    at = _rev(commit)
    return sorted(f for f in touched if not _same_code(f, at, WORKTREE))


def code_commits(commit: str, files: list[str]) -> int:
    """How many commits after ``commit`` change the code of one of ``files`` (the working
    tree counting as one more where it changes it): how far a result stamped with ``commit``
    lies behind."""
    # one git log for every commit since: each one's first parent and the files it touched
    log = subprocess.run(["git", "-C", str(ROOT), "log", "--first-parent", "--format=%x00%H %P", "--name-only",
                          f"{commit}..HEAD", "--", *files], capture_output=True, text=True, check=True).stdout
    behind = 0
    for record in log.split("\0")[1:]:
        head_line, *names = record.split("\n")
        rev, parent = head_line.split()[:2]
        behind += any(not _same_code(f, parent, rev) for f in names if f)
    return behind + bool(changed_since(_rev("HEAD"), files))


def show(commit: str, path: str) -> str:
    """``path`` as it was at ``commit``."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def sources(job: Job) -> list[str]:
    """The files a job's results come from: the job's script and everything it imports,
    directly or through the kit (tierstore_kit/), the engine's modules with the Lua the
    index runs and the C the page I/O runs, for a job that starts SGLang servers the CPU
    harness they run in (a planning module no job imports is not the engine), and the files
    its ``extra`` patterns name."""
    todo, seen = [*ENGINE_ENTRIES, SCRIPTS / job.script], set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(_imports(f))
    seen |= set((ROOT / "sglang_tierstore").rglob("*.lua")) | set((ROOT / "sglang_tierstore").rglob("*.c"))
    if job.server:
        seen |= {f for f in CPU_HARNESS.rglob("*") if f.is_file()}
    seen |= {f for g in job.extra for f in ROOT.glob(g) if f.is_file()}
    return sorted(str(f.relative_to(ROOT)) for f in seen if f.is_relative_to(ROOT) and "__pycache__" not in f.parts)


def problem(path: Path, dirty_ok: bool = False) -> Optional[str]:
    """Why ``path`` is not the record of a commit's run of this checkout (None: it is):
    missing, unstamped, stamped dirty (the tree differed from its commit; unless
    ``dirty_ok``), or stamped with another checkout's engine (an editable install pointing
    elsewhere). Fatal in CI for a committed result."""
    if not path.exists():
        return "missing"
    if path.suffix not in (".json", ".txt"):
        return None
    s = read_stamp(path) or {}
    if not s.get("commit"):
        return "unstamped"
    if s.get("dirty") is not False and not dirty_ok:
        return "stamped dirty"
    if s.get("engine") != ".":
        return f"measured another checkout's engine ({s.get('engine')})"
    return None


def _why(path: Path, deps: list[str], dirty_ok: bool = False) -> Optional[str]:
    """Why ``path`` does not describe the code as it stands (None: it does): a
    :func:`problem`, or the code of one of ``deps`` changed since its clean commit (stale).
    A dirty stamp (with ``dirty_ok``: a run just made) measured the files as they are."""
    if (p := problem(path, dirty_ok)) is not None:
        return p
    s = read_stamp(path) if path.suffix in (".json", ".txt") else None
    if s and s.get("dirty") is False and (changed := changed_since(s["commit"], deps)):
        return f"{', '.join(changed)} changed since {s['commit'][:12]}"
    return None


def job_files(job: Job, results: Path = RESULTS) -> list[Path]:
    """The files of a job under ``results``: the outputs it must leave and every stamped
    file it left (a stray file is not the job's concern: tests/test_reproduce.py catches those)."""
    out = results / job.name
    return sorted({out / o for o in job.outputs} | {p for g in job.also for p in out.glob(g) if p.suffix in (".json", ".txt")})


def _shown(path: Path, results: Path) -> Path:
    return path.relative_to(results.parent) if results == RESULTS else path


def problems(job: Job, results: Path = RESULTS) -> list[str]:
    """The job's files under ``results`` that are no record of a run (:func:`problem`), one line each."""
    return [f"{_shown(p, results)}: {why}" for p in job_files(job, results) if (why := problem(p))]


def why_stale(job: Job, results: Path = RESULTS) -> list[str]:
    """Why the job's results under ``results`` no longer describe the code as it stands, one
    line per file (empty: they do): its problems, or code changed since (:func:`_why`)."""
    deps = sources(job)
    return [f"{_shown(p, results)}: {why}" for p in job_files(job, results) if (why := _why(p, deps))]


def measured(job: Job, results: Path = RESULTS) -> Optional[tuple[str, int]]:
    """Where a stale job's committed results stand: the oldest commit its files were stamped
    with and how many commits to the code it runs came after it (:func:`code_commits`); None
    where its results describe the code as it stands or are no record at all."""
    deps = sources(job)
    files = job_files(job, results)
    if any(problem(p) for p in files):
        return None
    stamps = {s["commit"] for p in files if p.suffix in (".json", ".txt") and (s := read_stamp(p))}
    behind = {c: code_commits(c, deps) for c in stamps if changed_since(c, deps)}
    if not behind:
        return None
    oldest = max(behind, key=lambda c: (behind[c], len(_git_lines("rev-list", f"{c}..HEAD"))))
    return oldest, behind[oldest]


def job_named(name: str) -> Job:
    for j in JOBS:
        if j.name == name:
            return j
    raise SystemExit(f"reproduce: no job {name!r}; jobs: {', '.join(j.name for j in JOBS)}")


def labelled_rounds(args: Sequence[str]) -> tuple[list[tuple[list[str], list[str]]], list[str]]:
    """A load test's ``--configs C --rounds N`` as N invocations of one round each, labelled
    ``rK`` and with its configurations rotated K-1 places as the script's own ``--rounds``
    runs them ((configurations, arguments) each), then the report over them all
    (``--report-only``, naming every labelled run)."""
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
    runs = ",".join(f"{c}@r{k + 1}" for c in configs for k in range(n))
    return rounds, [*args, "--report-only", "--runs", runs]


def _run(job: Job, argv: list[str], out: Path, sink_name: Optional[str], timeout_s: float) -> None:
    argv = [sys.executable, str(SCRIPTS / job.script), *(a.replace("{dir}", str(out)).replace("{results}", str(out.parent))
                                                      for a in argv)]
    print(f"reproduce: {job.name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    with open(out / sink_name, "w") if sink_name else open("/dev/null", "w") as sink:
        try:
            rc = subprocess.run(argv, stdout=sink, cwd=SCRIPTS.parent, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise SystemExit(f"reproduce: {job.name} ran past {timeout_s:.0f} s") from None
    if rc != 0:
        tail = "".join((out / sink_name).read_text(errors="replace").splitlines(keepends=True)[-15:]) if sink_name else ""
        raise SystemExit(f"reproduce: {job.name} exited {rc}; the end of its report ({out / (sink_name or '')}):\n{tail}")


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


def run_job(job: Job, results: Path, quick: bool, timeout_s: float) -> float:
    """Run ``job`` into ``results/<name>``, replacing what was there (a rounds job keeps
    its fresh rounds: :func:`run_rounds`); returns its seconds. Raises SystemExit naming
    the job when it fails or an output is missing, unstamped, another checkout's, or
    stamped with a commit whose code differs from what ran (:func:`_why`)."""
    out = results / job.name
    args = job.quick if quick else job.full
    t0 = time.monotonic()
    if job.rounds:
        run_rounds(job, args, out, timeout_s)
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        _run(job, list(args), out, job.stdout, timeout_s)
    deps = sources(job)
    for name in job.outputs:
        if (why := _why(out / name, deps, dirty_ok=True)) is not None:
            raise SystemExit(f"reproduce: {job.name}'s {out / name} is no record of this code: {why}")
    return time.monotonic() - t0


def engine_problem(measuring: bool) -> Optional[str]:
    """Why the jobs must not run on the engine Python imports, or None. A result is stamped
    with this checkout's commit, so it must have measured this checkout's engine: ``pip
    install -e`` of another clone (a CI run's) repoints the import without a word. A
    measurement must also run the C helper built from this checkout's ``_pageio.c``, which
    the stamp does not show (see ``helper_problem``); a smoke run need not."""
    out = subprocess.run([sys.executable, "-c", "import sglang_tierstore, sglang_tierstore._native as n; "
                          "print(sglang_tierstore.__file__); print(getattr(n.pageio, '__file__', ''))"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"reproduce: the engine does not import: {out.stderr.strip().splitlines()[-1:]}")
    engine, helper = out.stdout.splitlines()
    root = Path(engine).resolve().parent.parent
    if root != ROOT:
        return f"the engine imported is {root}'s, not this checkout's ({ROOT})"
    return helper_problem(Path(helper) if helper else None, HELPER_SOURCES) if measuring else None


HELPER_SOURCES = tuple(ROOT / "sglang_tierstore" / n for n in ("_pageio.c", "_exchange.c"))  # pyproject's ext-modules


def helper_problem(built: Optional[Path], sources: Sequence[Path]) -> Optional[str]:
    """Why the C helper the engine loaded (``built``, None where it loaded none) is not the
    one ``sources`` build, or None: the engine runs without it where it was never built, and
    an old build keeps loading after a source changes. Built before a source's last change
    means built from older source (a checkout's files are as new as the checkout)."""
    if built is None:
        return "the engine's C helper (_pageio) is not built, so pages would move from Python"
    for source in sources:
        if built.stat().st_mtime < source.stat().st_mtime:
            return f"the engine's C helper {built.name} was built before {source.name} last changed"
    return None
