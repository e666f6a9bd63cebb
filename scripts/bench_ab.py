#!/usr/bin/env python3
"""Two engines, one benchmark, alternated: does a change move the I/O benchmark's numbers?

    python3 scripts/bench_ab.py --old 31afb9e --new HEAD --runs 3 --out scripts/results/bench_ab \
        -- --repeat 5 --probe-repeat 300 --sizes 256K,2M,8M

Checks each ref out into its own worktree and runs that checkout's own
``scripts/bench_io.py`` (its engine, its script) with the arguments after ``--``, old and new
in turn (old, new, new, old, old, new, ...: each engine as often first as second), each run a
new seed. Every run measures tierstore beside the disk's O_DIRECT limit in the same process,
so the figures compared are ratios within a run (tierstore / O_DIRECT, probe / MGET) and
Python microseconds per 4 KiB page, which the machine's drift between runs moves far less
than raw GB/s. Prints, per figure, each run's value, the median per engine, new / old of the
medians, and the old runs' own spread (max / min): a difference inside that spread is not one.

A checkout's bench_io.py from before the layout change hangs in its coalescing-off run (it
sets ``MAX_RUN_BYTES = 0``, and cutting a page into pieces of at most 0 bytes never ends):
where that line is found, the driver patches it, in the worktree only, to what the script
now does (one page per I/O), and says so in its output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

HANG = 'mock.patch.object(ts_store, "MAX_RUN_BYTES", 0)'
UNHUNG = 'mock.patch.object(ts_store, "MAX_RUN_BYTES", min(ts_store.MAX_RUN_BYTES, be._pool("kv").ns.page_bytes))'

Figure = Callable[[dict[str, Any], str], float]


def med(run: dict[str, Any], size: str, system: str, metric: str) -> float:
    return float(run["sizes"][size][system][metric]["median"])


FIGURES: list[tuple[str, bool, Figure]] = [  # (name, per page size, value)
    ("write / O_DIRECT write", True, lambda r, s: med(r, s, "ts_v1", "write_gbps") / med(r, s, "disk", "write_gbps")),
    ("cold read / O_DIRECT read", True, lambda r, s: med(r, s, "ts_v1", "read_cold_gbps") / med(r, s, "disk", "read_cold_gbps")),
    ("warm read / O_DIRECT read", True, lambda r, s: med(r, s, "ts_v1", "read_warm_gbps") / med(r, s, "disk", "read_cold_gbps")),
    ("MLA write / O_DIRECT write", True, lambda r, s: med(r, s, "ts_mla", "write_gbps") / med(r, s, "disk", "write_gbps")),
    ("steady (evicting) write / O_DIRECT write", True,
     lambda r, s: med(r, s, "ts_steady", "write_gbps") / med(r, s, "disk", "write_gbps")),
    ("probe all hit / MGET", False, lambda r, _: r["probe"]["probe_all_hit"]["median"] / r["probe"]["mget_128"]["median"]),
    ("Python us per 4 KiB page written", False, lambda r, _: r["probe"]["python_us_per_page_set_4k"]["median"]),
    ("Python us per 4 KiB page read", False, lambda r, _: r["probe"]["python_us_per_page_get_4k"]["median"]),
]


def sh(*cmd: str, cwd: str | None = None) -> str:
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def worktree(repo: str, ref: str, into: str) -> tuple[str, str, bool]:
    """(path, commit, patched) of a detached worktree of ``ref``."""
    commit = sh("git", "rev-parse", ref, cwd=repo)
    path = os.path.join(into, commit[:12])
    sh("git", "worktree", "add", "--detach", path, commit, cwd=repo)
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
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--runs", type=int, default=3, help="runs per engine")
    ap.add_argument("--out", required=True, help="directory for each run's JSON and text")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_io.py's arguments")
    a = ap.parse_args()
    args = [x for x in a.bench_args if x != "--"]
    repo = sh("git", "rev-parse", "--show-toplevel")
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        trees = {}
        try:
            for name, ref in (("old", a.old), ("new", a.new)):
                trees[name] = worktree(repo, ref, tmp)
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
    report(a, args, trees, runs)
    return 0


def report(a: argparse.Namespace, args: list[str], trees: dict[str, tuple[str, str, bool]],
           runs: dict[str, list[dict[str, Any]]]) -> None:
    print(f"command: python3 scripts/bench_ab.py --old {a.old} --new {a.new} --runs {a.runs} --out {a.out} -- "
          + " ".join(args))
    for name, (_, commit, patched) in trees.items():
        note = " (its bench_io.py's coalescing-off line patched to one page per I/O: it hangs as committed)" if patched else ""
        print(f"{name}: {commit}{note}")
    print(f"order: {', '.join('old new' if k % 2 == 0 else 'new old' for k in range(a.runs))}; seeds 1..{2 * a.runs}")
    print(f"machine: {json.dumps(runs['new'][0].get('machine', {}))}")
    sizes = list(runs["new"][0]["sizes"])
    print(f"\n{'figure':<44} {'size':>5}  {'old runs':<20} {'new runs':<20} {'old med':>8} {'new med':>8} {'new/old':>8} {'old spread':>10}")
    for fig, per_size, fn in FIGURES:
        for size in sizes if per_size else [""]:
            old = [fn(r, size) for r in runs["old"]]
            new = [fn(r, size) for r in runs["new"]]
            mo, mn = statistics.median(old), statistics.median(new)
            spread = max(old) / min(old) if min(old) > 0 else float("nan")
            print(f"{fig:<44} {size:>5}  {' '.join(f'{v:.2f}' for v in old):<20} {' '.join(f'{v:.2f}' for v in new):<20} "
                  f"{mo:8.2f} {mn:8.2f} {mn / mo:8.2f} {spread:10.2f}")


if __name__ == "__main__":
    sys.exit(main())
