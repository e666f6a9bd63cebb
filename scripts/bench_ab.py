#!/usr/bin/env python3
"""Two engines, one benchmark, alternated: does a change move the I/O benchmark's numbers?

    python3 scripts/bench_ab.py --old 31afb9e --new HEAD --runs 3 --out scripts/results/bench_ab \
        -- --repeat 5 --probe-repeat 300 --sizes 256K,2M,8M > scripts/results/bench_ab/summary.txt
    python3 scripts/bench_ab.py --report scripts/results/bench_ab [more dirs]   (the table again, from
        the JSON; several directories of the same two commits and arguments are pooled)

Checks each ref out into its own worktree and runs that checkout's own
``scripts/bench_io.py`` (its engine, its script) with the arguments after ``--``, old and new
in turn (old, new, new, old, old, new, ...: each engine as often first as second), each run a
new seed. Every run measures tierstore beside the disk's O_DIRECT limit in the same process,
so the figures compared are ratios within a run (tierstore / O_DIRECT, probe / MGET) and
Python microseconds per 4 KiB page, which the machine's drift between runs moves far less
than raw GB/s. Prints, per figure, each run's value, the median per engine, new / old of the
medians with a 95% bootstrap interval (runs resampled, seeded), and the old runs' own spread
(max / min): a difference inside that spread, or an interval holding 1, is not one.

A checkout's bench_io.py from before the layout change hangs in its coalescing-off run (it
sets ``MAX_RUN_BYTES = 0``, and cutting a page into pieces of at most 0 bytes never ends):
where that line is found, the driver patches it, in the worktree only, to what the script
now does (one page per I/O), and says so in its output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

from tierstore_kit.stats import med as median_of, unpaired_ratio

HANG = 'mock.patch.object(ts_store, "MAX_RUN_BYTES", 0)'
UNHUNG = 'mock.patch.object(ts_store, "MAX_RUN_BYTES", min(ts_store.MAX_RUN_BYTES, be._pool("kv").ns.page_bytes))'

Figure = Callable[[dict[str, Any], str], float]


def med(run: dict[str, Any], size: str, system: str, metric: str) -> float:
    """The median of ``metric`` in one bench_io run (its JSON), for one page size and system."""
    return median_of(run["sizes"][size][system], metric)


FIGURES: list[tuple[str, bool, Figure]] = [  # (name, per page size, value)
    ("write / O_DIRECT write", True, lambda r, s: med(r, s, "ts_v1", "write_gbps") / med(r, s, "disk", "write_gbps")),
    ("cold read / O_DIRECT read", True, lambda r, s: med(r, s, "ts_v1", "read_cold_gbps") / med(r, s, "disk", "read_cold_gbps")),
    ("warm read / O_DIRECT read", True, lambda r, s: med(r, s, "ts_v1", "read_warm_gbps") / med(r, s, "disk", "read_cold_gbps")),
    ("v2 cold read / O_DIRECT read", True, lambda r, s: med(r, s, "ts_v2", "read_cold_gbps") / med(r, s, "disk", "read_cold_gbps")),
    ("MLA cold read / O_DIRECT read", True, lambda r, s: med(r, s, "ts_mla", "read_cold_gbps") / med(r, s, "disk", "read_cold_gbps")),
    ("MLA write / O_DIRECT write", True, lambda r, s: med(r, s, "ts_mla", "write_gbps") / med(r, s, "disk", "write_gbps")),
    ("steady (evicting) write / O_DIRECT write", True,
     lambda r, s: med(r, s, "ts_steady", "write_gbps") / med(r, s, "disk", "write_gbps")),
    ("probe all hit / MGET", False, lambda r, _: r["probe"]["probe_all_hit"]["median"] / r["probe"]["mget_128"]["median"]),
    ("Python us per 4 KiB page written", False, lambda r, _: r["probe"]["python_us_per_page_set_4k"]["median"]),
    ("Python us per 4 KiB page read", False, lambda r, _: r["probe"]["python_us_per_page_get_4k"]["median"]),
]


def sh(*cmd: str, cwd: str | None = None) -> str:
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def worktree(repo: str, name: str, ref: str, into: str) -> tuple[str, str, bool]:
    """(path, commit, patched) of a detached worktree of ``ref`` for engine ``name`` (its own
    even where both engines are one commit: an A/A run shows the noise), its C helper built in place
    where it has one: a checkout holds no build, and its engine would otherwise move pages
    from Python, which is not the engine being compared."""
    commit = sh("git", "rev-parse", ref, cwd=repo)
    path = os.path.join(into, f"{name}-{commit[:12]}")
    sh("git", "worktree", "add", "--detach", path, commit, cwd=repo)
    if os.path.exists(os.path.join(path, "sglang_tierstore", "_pageio.c")):
        sh(sys.executable, "-c", "from setuptools import setup; setup()", "build_ext", "--inplace", "-q", cwd=path)
        print(f"{ref} ({commit[:12]}): its C helper built in the worktree", file=sys.stderr, flush=True)
    script = os.path.join(path, "scripts", "bench_io.py")
    text = open(script).read()
    patched = HANG in text
    if patched:
        open(script, "w").write(text.replace(HANG, UNHUNG))
    return path, commit, patched


def run(path: str, args: list[str], seed: int, out: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, os.path.join(path, "scripts", "bench_io.py"), *args, "--seed", str(seed), "--out", out]
    with open(out.replace(".json", ".txt"), "w") as log:
        subprocess.run(cmd, cwd=path, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(out) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", metavar="DIR", nargs="+", help="print the table of the runs in DIR(s) and stop")
    ap.add_argument("--old")
    ap.add_argument("--new")
    ap.add_argument("--runs", type=int, default=3, help="runs per engine")
    ap.add_argument("--out", help="directory for each run's JSON and text")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_io.py's arguments")
    a = ap.parse_args()
    if a.report:
        report(*a.report)
        return 0
    if not a.old or not a.new or not a.out:
        ap.error("--old, --new and --out are required (or --report DIR)")
    args = [x for x in a.bench_args if x != "--"]
    repo = sh("git", "rev-parse", "--show-toplevel")
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        trees = {}
        try:
            for name, ref in (("old", a.old), ("new", a.new)):
                trees[name] = worktree(repo, name, ref, tmp)
            order = [("old", "new") if k % 2 == 0 else ("new", "old") for k in range(a.runs)]
            runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            seed = 0
            for pair in order:
                for name in pair:
                    seed += 1
                    path = trees[name][0]
                    out = os.path.abspath(os.path.join(a.out, f"{name}_{len(runs[name]) + 1}.json"))
                    print(f"run {seed}: {name} ({trees[name][1][:12]}), seed {seed}", file=sys.stderr, flush=True)
                    runs[name].append(run(path, args, seed, out))
        finally:
            for path, _, _ in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", path], cwd=repo, capture_output=True)
    print(f"command: python3 scripts/bench_ab.py --old {a.old} --new {a.new} --runs {a.runs} --out {a.out} -- "
          + " ".join(args))
    report(a.out)
    return 0


def report(*outs: str) -> None:
    """The table of the runs whose JSON lies in ``outs`` (old_N.json, new_N.json), pooled."""
    def of(name: str, out: str) -> list[dict[str, Any]]:
        found = [f for f in os.listdir(out) if re.fullmatch(rf"{name}_\d+\.json", f)]
        return [json.load(open(os.path.join(out, f))) for f in sorted(found, key=lambda f: int(f[len(name) + 1 : -5]))]

    runs = {name: [r for out in outs for r in of(name, out)] for name in ("old", "new")}
    print(f"runs from: {', '.join(outs)}")
    for name, rs in runs.items():
        commit = (rs[0].get("stamp") or rs[0]["package"])["commit"]  # "package": bench_io.py before stamps
        shown = subprocess.run(["git", "show", f"{commit}:scripts/bench_io.py"], capture_output=True, text=True).stdout
        note = " (its bench_io.py's coalescing-off line patched to one page per I/O: it hangs as committed)" if HANG in shown else ""
        print(f"{name}: {commit}{note}; seeds {', '.join(str(r['seed']) for r in rs)}")
    first = runs["new"][0].get("stamp") or runs["new"][0]
    print(f"bench_io arguments: {first['command']}")
    print(f"machine: {json.dumps(first.get('machine', {}))}")
    sizes = list(runs["new"][0]["sizes"])
    width = 5 * max(len(runs["old"]), len(runs["new"]))
    print(f"\n{'figure':<44} {'size':>5}  {'old runs':<{width}} {'new runs':<{width}} {'old med':>8} {'new med':>8} "
          f"{'new/old':>8} {'95% interval':>13} {'old spread':>10}")
    for fig, per_size, fn in FIGURES:
        for size in sizes if per_size else [""]:
            try:
                old = [fn(r, size) for r in runs["old"]]
                new = [fn(r, size) for r in runs["new"]]
            except KeyError:  # a system the runs left out (bench_io --systems): not a row
                continue
            mo, mn = statistics.median(old), statistics.median(new)
            spread = max(old) / min(old) if min(old) > 0 else float("nan")
            iv = unpaired_ratio(new, old)
            lo, hi = iv["lo"], iv["hi"]
            print(f"{fig:<44} {size:>5}  {' '.join(f'{v:.2f}' for v in old):<{width}} "
                  f"{' '.join(f'{v:.2f}' for v in new):<{width}} {mo:8.2f} {mn:8.2f} {mn / mo:8.2f} "
                  f"{f'{lo:.2f}-{hi:.2f}':>13} {spread:10.2f}")


if __name__ == "__main__":
    sys.exit(main())
