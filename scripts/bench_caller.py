#!/usr/bin/env python3
"""What one call costs the thread SGLang makes it on: CPU per call and per page, against a
baseline engine, interleaved.

    python3 scripts/bench_caller.py --base 5d013e9 --runs 6 --out scripts/results/bench_caller/bench_caller.json \
        > scripts/results/bench_caller/bench_caller.txt

Each run is a fresh process (``PYTHONPATH`` at one engine's tree: ``--base`` is checked out
into a temporary worktree, the other engine is this checkout) with a private
redis-server on a Unix socket (as the embedded index is) and a real SGLang MHA host pool
of the interference load test's page (16 tokens x 12,288 bytes: 192 KiB, 2 regions per
page in ``page_first_direct``). For each batch size it calls ``batch_set_v1`` on fresh
SGLang-style keys (64 hex digits), then ``batch_exists`` and ``batch_get_v1`` on them,
sizes in rotating order, and records per call the calling thread's CPU time
(``time.thread_time``: what SGLang's backup and prefetch threads spend inside tierstore),
the whole process's (every thread: tierstore's I/O and housekeeping threads too, so work
moved off the caller is not hidden) and the wall time. A run reports each figure's
median per size, and fits CPU = per call + per page x pages over the sizes (least squares
over the medians). Runs alternate the engines (base, new, new, base, ...); the summary
gives each engine's median over runs with a 95% interval, and new / base paired run by
run. Tierstore's own CPU only: the index server's and the kernel's work in other
processes is not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ("set", "exists", "get")
CLOCKS = ("caller_us", "process_us", "wall_us")
REDIS_FLAGS = ["--port", "0", "--save", "", "--appendonly", "no"]


def fit(sizes: list[int], values: list[float]) -> tuple[float, float]:
    """(per call, per page) of the least-squares line through (size, value)."""
    mx, my = statistics.fmean(sizes), statistics.fmean(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, values)) / sum((x - mx) ** 2 for x in sizes)
    return my - slope * mx, slope


def worker(sizes: list[int], reps: int, warmup: int, seed: int) -> dict[str, Any]:
    """One run in this process, on the engine ``PYTHONPATH`` names."""
    sys.path[:0] = [os.path.join(ROOT, "tests")]
    import hashlib
    import random

    import torch
    from pools import fill, mha_pool, page_indices, storage_config

    import sglang_tierstore
    from sglang_tierstore import TierStoreBackend

    rnd = random.Random(seed)
    work = tempfile.mkdtemp(prefix="bench-caller-", dir="/var/tmp")
    sock = os.path.join(work, "redis.sock")
    proc = subprocess.Popen(["redis-server", *REDIS_FLAGS, "--unixsocket", sock, "--dir", work],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        big = max(sizes)
        pool = mha_pool("page_first_direct", page_size=16, layers=8, heads=3, head_dim=64, dtype=torch.float32,
                        tokens=16 * 2 * big)
        fill(pool, seed)
        cfg = {"redis_url": f"unix://{sock}", "path": os.path.join(work, "store"), "capacity_gb": 8}
        be = TierStoreBackend(storage_config(cfg, model="bench-caller"), {})
        try:
            be.register_mem_pool_host(pool)
            ps = pool.page_size
            src = {n: page_indices(list(range(n)), ps) for n in sizes}
            dst = {n: page_indices(list(range(big, big + n)), ps) for n in sizes}
            samples: dict[str, dict[int, dict[str, list[float]]]] = {
                op: {n: {c: [] for c in CLOCKS} for n in sizes} for op in OPS}

            def timed(op: str, n: int, call: Callable[[], list[bool]], keep: bool) -> None:
                c, p, w = time.thread_time(), time.process_time(), time.perf_counter()
                ok = call()
                c, p, w = time.thread_time() - c, time.process_time() - p, time.perf_counter() - w
                if not all(ok):
                    raise RuntimeError(f"{op} of {n} pages: {ok.count(False)} failed")
                if keep:
                    for clock, v in zip(CLOCKS, (c, p, w)):
                        samples[op][n][clock].append(1e6 * v)

            for rep in range(warmup + reps):
                order = sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]
                for n in order:
                    keys = [hashlib.sha256(rnd.randbytes(16)).hexdigest() for _ in range(n)]
                    keep = rep >= warmup
                    timed("set", n, lambda: be.batch_set_v1(keys, src[n]), keep)
                    timed("exists", n, lambda: [be.batch_exists(keys) == n], keep)
                    timed("get", n, lambda: be.batch_get_v1(keys, dst[n]), keep)
            medians = {op: {str(n): {c: statistics.median(samples[op][n][c]) for c in CLOCKS} for n in sizes}
                       for op in OPS}
            fits = {op: {c: dict(zip(("per_call_us", "per_page_us"),
                                     fit(sizes, [medians[op][str(n)][c] for n in sizes]))) for c in CLOCKS}
                    for op in OPS}
            return {"engine": os.path.dirname(os.path.abspath(sglang_tierstore.__file__)), "medians": medians,
                    "fits": fits, "page_bytes": be.namespace().page_bytes, "errors": {
                        k: v for k, v in be.store.stats().items() if k.startswith("error_")}}
        finally:
            be.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def run_worker(tree: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--sizes", args.sizes, "--reps", str(args.reps),
           "--warmup", str(args.warmup), "--seed", str(seed)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"worker on {tree} failed:\n{out.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if os.path.realpath(res["engine"]) != os.path.realpath(os.path.join(tree, "sglang_tierstore")):
        raise RuntimeError(f"the run meant for {tree} imported tierstore from {res['engine']}")
    return res


def summarize(runs: dict[str, list[dict[str, Any]]], sizes: list[int]) -> dict[str, Any]:
    sys.path.insert(0, HERE)
    from compare import median_interval, paired_ratio

    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {op: {c: {
            **{f"{n}_pages": median_interval([r["medians"][op][str(n)][c] for r in rs]) for n in sizes},
            "per_call_us": median_interval([r["fits"][op][c]["per_call_us"] for r in rs]),
            "per_page_us": median_interval([r["fits"][op][c]["per_page_us"] for r in rs]),
        } for c in CLOCKS} for op in OPS}
    if "base" in runs and "new" in runs:
        b, n = runs["base"], runs["new"]
        out["new/base"] = {op: {c: {
            **{f"{k}_pages": paired_ratio([r["medians"][op][str(k)][c] for r in n], [r["medians"][op][str(k)][c] for r in b])
               for k in sizes},
        } for c in CLOCKS} for op in OPS}
    return out


def report(doc: dict[str, Any], sizes: list[int]) -> None:
    sys.path.insert(0, HERE)
    from compare import say
    from provenance import header

    s = doc["summary"]
    print(f"# caller CPU of tierstore's calls: {doc['page_bytes'] // 1024} KiB pages (real SGLang MHA host pool, "
          f"page_first_direct), private redis-server on a Unix socket; {doc['runs']} runs per engine, interleaved, "
          f"{doc['reps']} calls per size and op in each")
    print(header(doc["stamp"]))
    print("# engines: " + ", ".join(f"{k} at {v}" for k, v in doc["commits"].items()))
    print("medians over runs (95% interval) of each run's median, in us; per call / per page: least-squares fit over sizes")
    for name in doc["commits"]:
        for op in OPS:
            for c in CLOCKS:
                row = s[name][op][c]
                cells = "  ".join(f"{n:>3}p {row[f'{n}_pages']['median']:7.0f}" for n in sizes)
                print(f"{name:<5} {op:<6} {c:<11} {cells}   per call {row['per_call_us']['median']:6.0f} "
                      f"({row['per_call_us']['lo']:.0f}-{row['per_call_us']['hi']:.0f})   per page "
                      f"{row['per_page_us']['median']:5.1f} ({row['per_page_us']['lo']:.1f}-{row['per_page_us']['hi']:.1f})")
    if "new/base" in s:
        print("new / base, paired run by run (median ratio, 95% interval):")
        for op in OPS:
            for c in CLOCKS:
                print(f"{op:<6} {c:<11} " + "   ".join(f"{n}p {say(s['new/base'][op][c][f'{n}_pages'])}" for n in sizes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="a commit to measure beside this checkout (checked out into a temporary worktree)")
    ap.add_argument("--runs", type=int, default=6, help="runs per engine")
    ap.add_argument("--sizes", default="1,4,16,64", help="batch sizes in pages, comma-separated")
    ap.add_argument("--reps", type=int, default=40, help="calls per size and op in each run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke run: this checkout only, 1 run, 2 sizes, 3 calls")
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.base, a.runs, a.sizes, a.reps, a.warmup = None, 1, "1,4", 3, 1
    sizes = sorted({int(x) for x in a.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] < 1:
        ap.error(f"--sizes needs at least two positive batch sizes, got {a.sizes!r}")
    if a.worker:
        print(json.dumps(worker(sizes, a.reps, a.warmup, a.seed)))
        return 0
    base_dir = tempfile.mkdtemp(prefix="bench-caller-base-", dir="/var/tmp") if a.base else None
    trees = {"new": ROOT}
    try:
        if base_dir:
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base_dir, a.base], check=True,
                           capture_output=True)
            trees = {"base": base_dir, **trees}
        commits = {name: subprocess.run(["git", "-C", d, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True).stdout.strip() for name, d in trees.items()}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        names = list(trees)
        for i in range(a.runs):
            for name in (names if i % 2 == 0 else names[::-1]):  # each engine as often first as second
                runs[name].append(run_worker(trees[name], a, seed=1 + i))
                print(f"run {i + 1} {name}: set {runs[name][-1]['fits']['set']['caller_us']}", file=sys.stderr)
    finally:
        if base_dir:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_dir], check=False, capture_output=True)
            shutil.rmtree(base_dir, ignore_errors=True)
    sys.path.insert(0, HERE)
    from provenance import stamp

    doc = {"stamp": stamp(directory="/var/tmp", server_flags=["redis-server", *REDIS_FLAGS, "--unixsocket", "<run dir>"]),
           "commits": commits, "sizes": sizes, "runs": a.runs, "reps": a.reps, "page_bytes": runs["new"][0]["page_bytes"],
           "per_run": runs, "summary": summarize(runs, sizes)}
    report(doc, sizes)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
