#!/usr/bin/env python3
"""How long one call of ``check()`` holds Redis, on a large store of small pages, for
two trees side by side (a baseline and this one), interleaved.

    git worktree add /tmp/check-base <baseline commit>
    python3 scripts/check_cost.py --tree base=/tmp/check-base --tree new=. --runs 3 \
        --out scripts/results/check_cost.json > scripts/results/check_cost.txt

Each run (a fresh process, with ``PYTHONPATH`` at the tree) starts a private
redis-server, writes ``--pages`` 4 KiB pages into a 1 GiB store (64 MiB regions:
16,384 slots and a 512 KiB member blob each), then runs ``check(verify_pages=False)``
with Redis's SLOWLOG recording every command (``slowlog-log-slower-than 0``): each
function call's execution time inside Redis, the time every other client of that Redis
waits behind it. Reported per tree: calls per check, median, p99 and largest call (µs),
Redis time in all (ms); ratios new/base of the medians over runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REDIS_FLAGS = ["--port", "0", "--save", "", "--appendonly", "no"]


def worker(pages: int, redis_server: str) -> dict[str, object]:
    import redis
    from tierstore_kit.engine import engine

    from sglang_tierstore.tools import inspect

    work = tempfile.mkdtemp(prefix="check-cost-", dir="/var/tmp")
    sock = os.path.join(work, "redis.sock")
    proc = subprocess.Popen([redis_server, *REDIS_FLAGS, "--unixsocket", sock, "--dir", work],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        st = engine({"path": os.path.join(work, "pages"), "redis_url": f"unix://{sock}", "redis_prefix": "cost",
                     "capacity_gb": 1.0, "o_direct": False})
        try:
            ns = st.namespace({"model": "cost"}, 4096)
            buf = [[memoryview(bytearray(os.urandom(4096)))] for _ in range(500)]
            for i in range(0, pages, 500):
                keys = [hashlib.sha256(b"%d" % j).hexdigest() for j in range(i, min(pages, i + 500))]
                assert all(st.write(ns, keys, buf[: len(keys)], False))
            assert inspect.usage(st)["pages"] == pages
            r = redis.Redis(unix_socket_path=sock)
            r.config_set("slowlog-max-len", 1_000_000)
            r.config_set("slowlog-log-slower-than", 0)
            r.slowlog_reset()
            t0 = time.perf_counter()
            problems = inspect.check(st, verify_pages=False)
            wall = time.perf_counter() - t0
            r.config_set("slowlog-log-slower-than", 10_000)
            log = r.slowlog_get(1_000_000)
            calls = sorted(int(e["duration"]) for e in log
                           if e["command"].upper().startswith((b"FCALL", b"EVALSHA")))
            return {"problems": len(problems), "calls": len(calls), "median_us": statistics.median(calls),
                    "p99_us": calls[int(0.99 * (len(calls) - 1))], "max_us": calls[-1], "redis_ms": sum(calls) / 1000,
                    "check_s": round(wall, 3), "region_bytes": st.space.attached().geometry.region_bytes,
                    "module": inspect.__file__}
        finally:
            st.close()
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["rm", "-rf", work], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR", help="a source tree; repeatable")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pages", type=int, default=50_000)
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.pages, a.redis_server)))
        return 0
    trees = dict(t.split("=", 1) for t in a.tree)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in trees}
    for i in range(a.runs):
        for name, d in trees.items():  # interleaved: base, new, base, new, ...
            d = os.path.abspath(d)
            out = subprocess.run([sys.executable, os.path.join(HERE, "check_cost.py"), "--worker", "--tree", "x=.",
                                  "--pages", str(a.pages), "--redis-server", a.redis_server],
                                 env={**os.environ, "PYTHONPATH": d}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {i + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    commits = {name: subprocess.run(["git", "-C", d, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() for name, d in trees.items()}
    from tierstore_kit.provenance import header, stamp

    doc = {"stamp": stamp(directory="/var/tmp", server_flags=[a.redis_server, *REDIS_FLAGS, "--unixsocket", "<run dir>"]),
           "commits": commits, "pages": a.pages, "runs": runs,
           "redis": subprocess.run([a.redis_server, "--version"], capture_output=True, text=True).stdout.strip()}
    med = {name: {k: statistics.median(float(r[k]) for r in rs) for k in ("calls", "median_us", "p99_us", "max_us",
                                                                            "redis_ms", "check_s")}
           for name, rs in runs.items()}
    doc["medians"] = med
    print(f"# check() on {a.pages:,} pages of 4 KiB in 64 MiB regions, check(verify_pages=False), SLOWLOG times")
    print(header(doc["stamp"]))
    print(f"# trees: {', '.join(f'{n} at {c}' for n, c in commits.items())}; {a.runs} runs each, interleaved; {doc['redis']}")
    print(f"{'tree':<8} {'calls':>7} {'median µs':>10} {'p99 µs':>8} {'max µs':>8} {'Redis ms':>9} {'check s':>8}"
          "   (medians over runs; per-run max in brackets)")
    for name, m in med.items():
        maxes = ", ".join(str(r["max_us"]) for r in runs[name])
        print(f"{name:<8} {m['calls']:>7.0f} {m['median_us']:>10.0f} {m['p99_us']:>8.0f} {m['max_us']:>8.0f} "
              f"{m['redis_ms']:>9.1f} {m['check_s']:>8.2f}   [{maxes}]")
    names = list(trees)
    if len(names) == 2:
        b, n = (med[x] for x in names)
        print(f"ratio {names[1]}/{names[0]}: largest call x{n['max_us'] / b['max_us']:.3f}, "
              f"Redis time in all x{n['redis_ms'] / b['redis_ms']:.2f}, calls x{n['calls'] / b['calls']:.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
