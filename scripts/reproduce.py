#!/usr/bin/env python3
"""Regenerate the committed results under ``scripts/results/`` on the engine as it stands.

    python3 scripts/reproduce.py                       # every job, in order (hours on 2 cores)
    python3 scripts/reproduce.py --only bench_io,stress
    python3 scripts/reproduce.py --quick --results /tmp/smoke   # every script in seconds (what CI runs)
    python3 scripts/reproduce.py --list                # the jobs, and which committed results are stale
    python3 scripts/reproduce.py --stale               # only the jobs whose committed results are stale

Each job runs one script with the arguments of its committed run (or, with ``--quick``, the
smallest that still takes every code path) and writes ``<results>/<job>/``: the script's
JSON and its printed report, each stamped by ``tierstore_kit/provenance.py`` (commit and dirty flag,
command, index server versions and flags, packages, machine). After a full run the figures
the README and docs quote are regenerated from those files (``figures.py --write``).
A job that fails, hangs past its bound or leaves an output unstamped, another checkout's or
stamped with a commit whose code differs from what ran fails the command (the other jobs
still run, and their outputs stay). No job runs while the engine Python imports is another
checkout's, and no measurement (all but ``--quick``) while that engine's C helper is missing
or older than its source.

What makes a result stale or no record at all: ``tierstore_kit/jobs.py``.

``--quick`` never writes under ``scripts/results/`` unless ``--results`` says so: its
figures are smoke, not measurements.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tierstore_kit.jobs import JOBS, RESULTS, ROOT, SCRIPTS, engine_problem, job_named, problems, run_job, why_stale


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated jobs (default: all)")
    ap.add_argument("--quick", action="store_true", help="the smoke run of each job: seconds, not measurements")
    ap.add_argument("--results", help="where job directories go (default scripts/results/; with --quick a temporary directory)")
    ap.add_argument("--list", action="store_true", help="list the jobs, whether their committed results are stale, and stop")
    ap.add_argument("--stale", action="store_true", help="of the jobs chosen, run only those whose results (committed, "
                    "or under --results) are stale")
    ap.add_argument("--skip-server", action="store_true", help="leave out jobs that start real SGLang servers")
    ap.add_argument("--no-figures", action="store_true", help="do not regenerate the docs' figures afterwards")
    a = ap.parse_args()
    if a.list:
        for j in JOBS:
            why = why_stale(j)
            state = "no record" if problems(j) else "stale" if why else "fresh"
            print(f"{j.name:<14} {j.minutes:>5.0f} min  {state}  scripts/{j.script} {' '.join(j.full)}")
            for line in why[:3]:
                print(f"{'':<22}{line}")
            if len(why) > 3:
                print(f"{'':<22}... and {len(why) - 3} more")
        return 0
    if a.stale and a.quick:
        ap.error("--stale: regenerates measurements, which --quick does not make")
    jobs = [job_named(n) for n in a.only.split(",")] if a.only else list(JOBS)
    if a.skip_server:
        jobs = [j for j in jobs if not j.server]
    results = Path(a.results) if a.results else (Path(tempfile.mkdtemp(prefix="reproduce-")) if a.quick else RESULTS)
    if a.stale:
        jobs = [j for j in jobs if why_stale(j, results)]
        print(f"reproduce: stale: {', '.join(j.name for j in jobs) or 'none'} "
              f"({sum(j.minutes for j in jobs):.0f} min as planned)", file=sys.stderr, flush=True)
    if (refused := engine_problem(measuring=not a.quick)) is not None:
        ap.error(f"{refused}: pip install --no-deps -e {ROOT} first")
    failed = []
    for j in jobs:
        try:
            secs = run_job(j, results, a.quick, timeout_s=300 if a.quick else j.minutes * 60 * 3)
        except SystemExit as e:  # the next jobs still run: one broken script costs its own results only
            print(e, file=sys.stderr, flush=True)
            failed.append(j.name)
            continue
        print(f"reproduce: {j.name} done in {secs:.0f} s -> {results / j.name}", file=sys.stderr, flush=True)
    if failed:
        print(f"reproduce: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not a.quick and not a.no_figures and results == RESULTS:
        subprocess.run([sys.executable, str(SCRIPTS / "figures.py"), "--write"], check=True, cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
