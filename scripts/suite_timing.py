#!/usr/bin/env python3
"""What the test suite takes in a clean clone of this commit: the whole suite as CI runs it
(``bash .ci/run``), then the fast lane.

    python3 scripts/suite_timing.py --out scripts/results/suite/suite.json > scripts/results/suite/suite.txt
    python3 scripts/suite_timing.py --quick ...     (one small test file: checks this script)

Clones HEAD into a temporary directory (so nothing of the working tree but its commit counts),
runs each command there with ``--durations=15`` and records its wall time, pytest's summary line,
its slowest tests and how many real SGLang servers it started (each start appends a line to the
file ``TIERSTORE_SERVER_STARTS`` names: ``tierstore_kit/cpu_harness/server.py``). Exits non-zero if a
command fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierstore_kit.provenance import header, stamp

HERE = Path(__file__).resolve().parent

LANES = {
    "full": "bash .ci/run",
    "fast": "bash scripts/setup.sh && python3 -m pytest -q -n 4 --durations=15 -m 'not server' tests",
}
QUICK = {"quick": "python3 -m pytest -q -n 0 --durations=15 tests/test_docs.py"}
SUMMARY = re.compile(r"^=* ?(\d+ passed.*?) ?=*$", re.M)
DURATION = re.compile(r"^\s*\d+(?:\.\d+)?s (?:call|setup|teardown)\s+\S+", re.M)  # a line of --durations


def run_lane(clone: Path, command: str) -> dict[str, Any]:
    starts = clone.parent / f"server-starts-{time.monotonic_ns()}"
    starts.touch()
    t0 = time.monotonic()
    env = {**os.environ, "TIERSTORE_SERVER_STARTS": str(starts)}
    out = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    text = out.stdout + out.stderr
    found = SUMMARY.findall(text)
    # pytest prints the durations on stdout; the tests' own log lines (stderr) are not among them
    block = out.stdout.split("slowest 15 durations", 1)[1] if "slowest 15 durations" in out.stdout else ""
    slowest = [m.group(0).strip() for m in DURATION.finditer(block)]
    return {"command": command, "returncode": out.returncode, "wall_s": round(wall, 1),
            "summary": found[-1].strip("= ") if found else None, "slowest": slowest,
            "server_starts": len(starts.read_text().splitlines()), "tail": text[-2000:] if out.returncode else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON of the lanes; the report goes to stdout")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="suite-"))
    clone = work / "ci"
    subprocess.run(["git", "clone", "-q", str(HERE.parent), str(clone)], check=True)
    lanes: dict[str, dict[str, Any]] = {}
    report = {"stamp": stamp(directory=str(work)), "lanes": lanes}
    print(header(report["stamp"]))
    try:
        for name, command in (QUICK if a.quick else LANES).items():
            lane = run_lane(clone, command)
            lanes[name] = lane
            mins, secs = divmod(int(lane["wall_s"]), 60)
            print(f"\n{name}: {command}\n  {lane['summary']}; wall {mins}:{secs:02d} for the whole command; "
                  f"{lane['server_starts']} SGLang server starts")
            for line in lane["slowest"]:
                print(f"    {line}")
            if lane["returncode"]:
                print(lane["tail"])
    finally:
        if not a.quick:  # setup.sh pointed the editable install at the clone: point it back at this checkout
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(HERE.parent)],
                           capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 1 if any(lane["returncode"] for lane in lanes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
