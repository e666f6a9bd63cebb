#!/usr/bin/env python3
"""What one call costs the thread SGLang makes it on: CPU per call and per page, against a
baseline engine, interleaved.

    python3 scripts/bench_caller.py --base 2c494a6 --runs 6 --out scripts/results/bench_caller/bench_caller.json \
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
median per size, and fits CPU = per call + per page x pages (least squares over the
medians) over the sizes the engine shares out over its I/O threads: a batch moving under
``io_engine.INLINE_BYTES`` (2 MiB) runs inline, its pwritevs/preadvs and hashing on the
calling thread, a cost of another kind that a fit across both would mix into the slope.
The smaller sizes are reported as they are, per call. Runs alternate the engines (base, new, new, base, ...); the summary
gives each engine's median over runs with a 95% interval, and new / base paired run by
run. Tierstore's own CPU only: the index server's and the kernel's work in other
processes is not in it.

CPU is not the GIL: hashing and syscalls burn CPU without it, and handing it over costs
time no thread's CPU shows. So each run then makes ``--gil-reps`` calls per size and op
beside a :class:`GilProbe`, a thread spinning in Python as SGLang's scheduler does, and
records what the probe lost to the GIL over each call: tierstore's threads' hold on it and
the hand-overs, what SGLang's own Python pays. Fitted like the CPU; then, with nothing
asked of the engine for ``IDLE_S``, what the probe loses per second to its idle I/O threads
and housekeeping, and each of those threads' CPU per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ("set", "exists", "get")
CLOCKS = ("caller_us", "process_us", "wall_us")
REDIS_FLAGS = ["--port", "0", "--save", "", "--appendonly", "no"]
IDLE_S = 5.0  # how long the GIL phase watches the engine with nothing asked of it


def queued_ns(tid: int) -> int:
    """The ns a thread of this process has spent runnable and waiting for a core, as the kernel counts them."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[1])


class GilProbe:
    """A thread that spins in Python whenever it holds the GIL, as SGLang's scheduler thread
    does between steps. Whatever of a window it spends neither on a core (its CPU clock, exact
    to the ns) nor queued for one (schedstat) it spends waiting for the GIL, which is the time
    the process's other threads held it: what tierstore's threads take from SGLang's Python,
    whether or not they burn CPU meanwhile."""

    def __init__(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._spin, name="gil-probe", daemon=True)
        self._thread.start()
        assert self._thread.ident is not None and self._thread.native_id is not None
        self._clock = time.pthread_getcpuclockid(self._thread.ident)
        self._tid = self._thread.native_id

    def _spin(self) -> None:
        while not self._stop:
            pass

    def mark(self) -> tuple[int, int, int]:
        """A reading to pass to :meth:`held_us`: wall, the probe's CPU and its queued ns."""
        return time.perf_counter_ns(), time.clock_gettime_ns(self._clock), queued_ns(self._tid)

    @staticmethod
    def held_us(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
        """The GIL held by other threads between two marks, in us."""
        return ((b[0] - a[0]) - (b[1] - a[1]) - (b[2] - a[2])) / 1e3

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def fit(sizes: list[int], values: list[float]) -> tuple[float, float]:
    """(per call, per page) of the least-squares line through (size, value)."""
    mx, my = statistics.fmean(sizes), statistics.fmean(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, values)) / sum((x - mx) ** 2 for x in sizes)
    return my - slope * mx, slope


def gil_phase(probe_calls: Callable[[str, int], Callable[[], list[bool]]], sizes: list[int], fit_sizes: list[int],
              reps: int, idle_s: float = IDLE_S) -> dict[str, Any]:
    """The GIL other threads held while each call ran beside a :class:`GilProbe` (less an empty
    call's: the marks' own), fitted per call and per page like the CPU, and each call's wall
    time there (what a thread waiting for it, as a request waits for its prefetch probe,
    waits with SGLang's scheduler busy in Python); then, over ``idle_s`` with nothing asked,
    the GIL held and each tierstore thread's CPU per second."""
    probe = GilProbe()
    try:
        def window(call: Callable[[], list[bool]]) -> tuple[float, float]:
            """(GIL held by others, wall) over one call, in us."""
            a = probe.mark()
            ok = call()
            b = probe.mark()
            if not all(ok):
                raise RuntimeError(f"a call beside the GIL probe failed: {ok.count(False)} of {len(ok)}")
            return probe.held_us(a, b), (b[0] - a[0]) / 1e3

        empty = statistics.median(window(lambda: [True])[0] for _ in range(20))
        held: dict[str, dict[int, list[float]]] = {op: {n: [] for n in sizes} for op in OPS}
        walls: dict[str, dict[int, list[float]]] = {op: {n: [] for n in sizes} for op in OPS}
        for rep in range(reps):
            for n in sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]:
                for op in OPS:
                    h, w = window(probe_calls(op, n))
                    held[op][n].append(h - empty)
                    walls[op][n].append(w)
        medians = {op: {str(n): statistics.median(held[op][n]) for n in sizes} for op in OPS}
        fits = {op: dict(zip(("per_call_us", "per_page_us"), fit(fit_sizes, [medians[op][str(n)] for n in fit_sizes])))
                for op in OPS}
        time.sleep(1.0)  # what the last calls left to the I/O threads and housekeeping is not idling
        threads = [(t.name.rstrip("_0123456789"), time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
                   if t.name.startswith("tierstore") and t.ident]
        before = [time.clock_gettime_ns(c) for _, c in threads]
        a = probe.mark()
        time.sleep(idle_s)
        b = probe.mark()
        cpu: dict[str, float] = {}
        for (name, c), t0 in zip(threads, before):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile (a page file made) has no clock
                cpu[name] = cpu.get(name, 0.0) + (time.clock_gettime_ns(c) - t0) / 1e3 / idle_s
        return {"empty_us": empty, "medians": medians, "fits": fits,
                "walls": {op: {str(n): statistics.median(walls[op][n]) for n in sizes} for op in OPS},
                "idle_us_per_s": probe.held_us(a, b) / idle_s, "idle_cpu_us_per_s": cpu}
    finally:
        probe.close()


def worker(sizes: list[int], reps: int, warmup: int, seed: int, gil_reps: int, idle_s: float = IDLE_S) -> dict[str, Any]:
    """One run in this process, on the engine ``PYTHONPATH`` names."""
    import hashlib
    import random

    import torch
    from tierstore_kit.pools import fill, mha_pool, page_indices, storage_config

    import sglang_tierstore
    from sglang_tierstore import TierStoreBackend
    from sglang_tierstore import io_engine

    inline_bytes = getattr(io_engine, "INLINE_BYTES", 0) or 2 * io_engine.CLAIM_BYTES  # (what engines before it used)

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
            page_bytes = be.namespace().page_bytes
            shared = [n for n in sizes if n * page_bytes >= inline_bytes]
            if len(shared) < 2:
                raise SystemExit(f"--sizes {','.join(map(str, sizes))}: the fit needs two sizes of at least "
                                 f"{inline_bytes} bytes ({-(-inline_bytes // page_bytes)} pages of {page_bytes})")
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

            written: dict[int, list[str]] = {}

            def call(op: str, n: int) -> Callable[[], list[bool]]:
                """``op`` on ``n`` pages: a write on fresh keys, a probe or read on the last ones written."""
                if op == "set":
                    keys = written[n] = [hashlib.sha256(rnd.randbytes(16)).hexdigest() for _ in range(n)]
                    return lambda: be.batch_set_v1(keys, src[n])
                keys = written[n]
                return (lambda: [be.batch_exists(keys) == n]) if op == "exists" else (lambda: be.batch_get_v1(keys, dst[n]))

            for rep in range(warmup + reps):
                for n in sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]:
                    for op in OPS:
                        timed(op, n, call(op, n), rep >= warmup)
            medians = {op: {str(n): {c: statistics.median(samples[op][n][c]) for c in CLOCKS} for n in sizes}
                       for op in OPS}
            fits = {op: {c: dict(zip(("per_call_us", "per_page_us"),
                                     fit(shared, [medians[op][str(n)][c] for n in shared]))) for c in CLOCKS}
                    for op in OPS}
            return {"engine": os.path.dirname(os.path.abspath(sglang_tierstore.__file__)), "medians": medians,
                    "fits": fits, "fit_sizes": shared, "page_bytes": page_bytes,
                    "gil": gil_phase(call, sizes, shared, gil_reps, idle_s), "errors": {
                        k: v for k, v in be.store.stats().items() if k.startswith("error_")}}
        finally:
            be.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def run_worker(tree: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--sizes", args.sizes, "--reps", str(args.reps),
           "--gil-reps", str(args.gil_reps), "--warmup", str(args.warmup), "--seed", str(seed), "--idle-s", str(args.idle_s)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"worker on {tree} failed:\n{out.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if os.path.realpath(res["engine"]) != os.path.realpath(os.path.join(tree, "sglang_tierstore")):
        raise RuntimeError(f"the run meant for {tree} imported tierstore from {res['engine']}")
    return res


def summarize(runs: dict[str, list[dict[str, Any]]], sizes: list[int]) -> dict[str, Any]:
    from tierstore_kit.stats import median_interval, paired_ratio

    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {op: {c: {
            **{f"{n}_pages": median_interval([r["medians"][op][str(n)][c] for r in rs]) for n in sizes},
            "per_call_us": median_interval([r["fits"][op][c]["per_call_us"] for r in rs]),
            "per_page_us": median_interval([r["fits"][op][c]["per_page_us"] for r in rs]),
        } for c in CLOCKS} for op in OPS}
        out[name]["gil"] = {
            **{op: {**{f"{n}_pages": median_interval([r["gil"]["medians"][op][str(n)] for r in rs]) for n in sizes},
                    **{term: median_interval([r["gil"]["fits"][op][term] for r in rs]) for term in ("per_call_us", "per_page_us")},
                    "wall_us": {f"{n}_pages": median_interval([r["gil"]["walls"][op][str(n)] for r in rs]) for n in sizes}}
               for op in OPS},
            "idle_us_per_s": median_interval([r["gil"]["idle_us_per_s"] for r in rs]),
            "idle_cpu_us_per_s": {t: median_interval([r["gil"]["idle_cpu_us_per_s"].get(t, 0.0) for r in rs])
                                  for t in sorted({t for r in rs for t in r["gil"]["idle_cpu_us_per_s"]})}}
    if "base" in runs and "new" in runs:
        b, n = runs["base"], runs["new"]
        out["new/base"] = {op: {c: {
            **{f"{k}_pages": paired_ratio([r["medians"][op][str(k)][c] for r in n], [r["medians"][op][str(k)][c] for r in b])
               for k in sizes},
        } for c in CLOCKS} for op in OPS}
        for op in OPS:
            out["new/base"][op]["busy_wall_us"] = {
                f"{k}_pages": paired_ratio([r["gil"]["walls"][op][str(k)] for r in n], [r["gil"]["walls"][op][str(k)] for r in b])
                for k in sizes}
    return out


def report(doc: dict[str, Any], sizes: list[int]) -> None:
    from tierstore_kit.stats import say
    from tierstore_kit.provenance import header

    s = doc["summary"]
    print(f"# caller CPU of tierstore's calls: {doc['page_bytes'] // 1024} KiB pages (real SGLang MHA host pool, "
          f"page_first_direct), private redis-server on a Unix socket; {doc['runs']} runs per engine, interleaved, "
          f"{doc['reps']} calls per size and op in each")
    print(header(doc["stamp"]))
    print("# engines: " + ", ".join(f"{k} at {v}" for k, v in doc["commits"].items()))
    print("medians over runs (95% interval) of each run's median, in us; per call / per page: least-squares fit over "
          f"{', '.join(map(str, doc['fit_sizes']))} pages (the sizes run on the I/O threads; smaller batches run inline)")
    for name in doc["commits"]:
        for op in OPS:
            for c in CLOCKS:
                row = s[name][op][c]
                cells = "  ".join(f"{n:>3}p {row[f'{n}_pages']['median']:7.0f}" for n in sizes)
                print(f"{name:<5} {op:<6} {c:<11} {cells}   per call {row['per_call_us']['median']:6.0f} "
                      f"({row['per_call_us']['lo']:.0f}-{row['per_call_us']['hi']:.0f})   per page "
                      f"{row['per_page_us']['median']:5.1f} ({row['per_page_us']['lo']:.1f}-{row['per_page_us']['hi']:.1f})")
    print(f"GIL held by tierstore's threads while a call ran beside a spinning Python thread ({doc['gil_reps']} calls per "
          "size and op in each run; an empty call's marks taken out), in us; idle: with nothing asked, per second")
    for name in doc["commits"]:
        g = s[name]["gil"]
        for op in OPS:
            cells = "  ".join(f"{n:>3}p {g[op][f'{n}_pages']['median']:7.0f}" for n in sizes)
            print(f"{name:<5} {op:<6} {'gil_us':<11} {cells}   per call {g[op]['per_call_us']['median']:6.0f} "
                  f"({g[op]['per_call_us']['lo']:.0f}-{g[op]['per_call_us']['hi']:.0f})   per page "
                  f"{g[op]['per_page_us']['median']:5.1f} ({g[op]['per_page_us']['lo']:.1f}-{g[op]['per_page_us']['hi']:.1f})")
        for op in OPS:
            cells = "  ".join(f"{n:>3}p {g[op]['wall_us'][f'{n}_pages']['median']:7.0f}" for n in sizes)
            print(f"{name:<5} {op:<6} {'busy_wall_us':<12}{cells}   (the call's wall time beside the spinning thread)")
        cpu = ", ".join(f"{t} {v['median']:.0f}" for t, v in g["idle_cpu_us_per_s"].items())
        print(f"{name:<5} idle   GIL held {g['idle_us_per_s']['median']:.0f} us/s "
              f"({g['idle_us_per_s']['lo']:.0f}-{g['idle_us_per_s']['hi']:.0f}); threads' CPU, us/s: {cpu}")
    if "new/base" in s:
        print("new / base, paired run by run (median ratio, 95% interval):")
        for op in OPS:
            for c in CLOCKS:
                print(f"{op:<6} {c:<11} " + "   ".join(f"{n}p {say(s['new/base'][op][c][f'{n}_pages'])}" for n in sizes))
        for op in OPS:
            print(f"{op:<6} busy_wall_us " + "   ".join(f"{n}p {say(s['new/base'][op]['busy_wall_us'][f'{n}_pages'])}"
                                                     for n in sizes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="a commit to measure beside this checkout (checked out into a temporary worktree)")
    ap.add_argument("--runs", type=int, default=6, help="runs per engine")
    ap.add_argument("--sizes", default="1,4,16,32,64,128", help="batch sizes in pages, comma-separated (at most 128, "
                    "SGLang's STORAGE_BATCH_SIZE; two at least 2 MiB, for the fit)")
    ap.add_argument("--reps", type=int, default=40, help="calls per size and op in each run")
    ap.add_argument("--gil-reps", type=int, default=10, help="calls per size and op beside the GIL probe in each run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--idle-s", type=float, default=IDLE_S, help="seconds the GIL phase watches the engine idle")
    ap.add_argument("--quick", action="store_true", help="smoke run: this checkout only, 1 run, 3 sizes, 3 calls, 0.5 s idle")
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.base, a.runs, a.sizes, a.reps, a.gil_reps, a.warmup, a.idle_s = None, 1, "1,16,32", 3, 2, 1, 0.5
    sizes = sorted({int(x) for x in a.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] < 1 or sizes[-1] > 128:
        ap.error(f"--sizes needs at least two batch sizes of 1 to 128 pages, got {a.sizes!r}")
    if a.worker:
        print(json.dumps(worker(sizes, a.reps, a.warmup, a.seed, a.gil_reps, a.idle_s)))
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
    from tierstore_kit.provenance import stamp

    doc = {"stamp": stamp(directory="/var/tmp", server_flags=["redis-server", *REDIS_FLAGS, "--unixsocket", "<run dir>"]),
           "commits": commits, "sizes": sizes, "fit_sizes": runs["new"][0]["fit_sizes"], "runs": a.runs, "reps": a.reps, "gil_reps": a.gil_reps,
           "page_bytes": runs["new"][0]["page_bytes"],
           "per_run": runs, "summary": summarize(runs, sizes)}
    report(doc, sizes)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
