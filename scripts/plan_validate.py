#!/usr/bin/env python3
"""The residency planner against the real server: predicted before each run, measured by it.

    python3 scripts/plan_validate.py --output-dir scripts/results/planner     # ~25 min on 2 cores
    python3 scripts/plan_validate.py --quick --output-dir /tmp/plan-smoke     # one tiny run
    python3 scripts/plan_validate.py --quick --reuse DIR --output-dir ...     # the load test's smoke run in DIR

For each variant (think times and pool sizes that move the shares between tiers) it
runs ``loadtest_tiers.py --configs l2+tierstore`` into ``<output-dir>/<variant>/``, then
asks :func:`sglang_tierstore.tools.predict.predict` what that run should measure, from what was
known before the load started: the workload's arguments, the pools' sizes from the server's
flags, the model's KV bytes per token, and the calibration the load test takes on that server
before sending any user (prefill cost per token from the cold prefix; the device-hit TTFT
as the time of one decode step). ``validation.json`` and ``validation.txt`` put each tier's
predicted share next to the measured one (token-weighted, a user's own history, as
loadtest_tiers.py measures it), with the range in which 95% of single draws of the same
workload land, and what the same model gives on the run's own draw (its measured arrivals
and send times, :func:`~sglang_tierstore.tools.predict.replay`): a gap beyond 10 points is
explained when the run's own draw is within 10 points of what it measured (``draw`` says
how that draw differs from the mean one: its arrivals' span and median think time). Each
variant has its own seed, so the three runs are three draws.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


from tierstore_kit.multiturn import load_rows, shares
from tierstore_kit.provenance import header, stamp

from sglang_tierstore.tools.plan import TIERS, GiB, LogNormalGaps
from sglang_tierstore.tools.predict import Schedule, Workload, predict, replay

HERE = os.path.dirname(os.path.abspath(__file__))

TOLERANCE = 0.10  # the bound on |predicted - measured| per tier
WORKLOAD = {"num-clients": 48, "request-rate": 0.2, "num-rounds": 3, "request-length": 512,
            "sub-question-input-length": 256, "output-length": 32, "system-prompt-length": 1024,
            "num-tenants": 4, "think-time-sigma": 0.8, "page-size": 16, "max-running-requests": 3, "max-total-tokens": 8192, "hicache-ratio": 2.0,
            "l3-gb": 8.0}
VARIANTS = {  # what differs per run
    "think10": {"think-time-median": 10.0, "seed": 1},
    "think30": {"think-time-median": 30.0, "seed": 2},  # each its own draw: three runs, not one draw thrice
    "think30-gpu12k": {"think-time-median": 30.0, "max-total-tokens": 12288, "seed": 3},
}
# the smoke's workload: the load test's own smoke run (reproduce.QUICK_LOADTEST) is this one, so --reuse can validate it
QUICK = {"num-clients": 2, "request-rate": 2.0, "num-rounds": 2, "request-length": 32, "sub-question-input-length": 16,
         "output-length": 4, "system-prompt-length": 32, "num-tenants": 1, "max-total-tokens": 2048,
         "think-time-median": 1.0}
QUICK_MODEL = ("--hidden", "64", "--layers", "2")
TAG = "l2+tierstore"


def run(variant: str, opts: dict[str, float], out: str, workdir: str, model: tuple[str, ...]) -> None:
    argv = [sys.executable, os.path.join(HERE, "loadtest_tiers.py"), "--configs", TAG, "--label", variant,
            "--idle-s", "1", "--workdir", workdir, "--output-dir", out, *model]
    for k, v in opts.items():
        argv += [f"--{k}", str(v)]
    print(f"== {variant}: {' '.join(argv[1:])}", flush=True)
    subprocess.run(argv, check=True, stdout=sys.stderr)


def validate(variant: str, opts: dict[str, float], out: str) -> dict[str, Any]:
    """The prediction for one finished run, from its inputs, next to what it measured."""
    tag = f"{TAG}@{variant}"
    _, rows = load_rows(os.path.join(out, f"{tag}.summary.json"))
    with open(os.path.join(out, f"calibration@{variant}.json")) as f:
        calib = json.load(f)
    with open(os.path.join(out, "planner.json")) as f:
        bpt = json.load(f)[tag]["raw"]["inputs"]["bytes_per_token"]
    w = Workload(
        users=int(opts["num-clients"]), arrival_rate=opts["request-rate"], turns=int(opts["num-rounds"]),
        first_tokens=int(opts["request-length"]), later_tokens=int(opts["sub-question-input-length"]),
        output_tokens=int(opts["output-length"]), system_tokens=int(opts["system-prompt-length"]),
        tenants=int(opts["num-tenants"]), think=LogNormalGaps(opts["think-time-median"], opts["think-time-sigma"]),
        prefill_s_per_token=calib["recompute_s"] / calib["prefix_tokens"], decode_s_per_token=calib["device_ttft_s"],
        page_tokens=int(opts["page-size"]), max_running=int(opts["max-running-requests"]),
    )
    gpu = opts["max-total-tokens"]
    pools = {"gpu_tokens": gpu, "host_tokens": gpu * opts["hicache-ratio"], "l3_tokens": opts["l3-gb"] * GiB / bpt}
    pred = predict(w, **pools)
    on_its_draw = replay(w, measured_schedule(rows, w), **pools)
    returning = [r for r in rows if not r["error"] and r["turn"] > 1]
    measured = shares(returning, int(opts["system-prompt-length"]))
    tiers = {}
    for t in (*TIERS, "miss"):
        lo, hi = pred.share_ranges[t]
        gap = pred.shares[t] - measured[t]
        tiers[t] = {"predicted": pred.shares[t], "range95": [lo, hi], "on_its_schedule": on_its_draw[t],
                    "measured": measured[t], "gap": gap, "within": abs(gap) <= TOLERANCE,
                    "in_range": lo - 1e-9 <= measured[t] <= hi + 1e-9,
                    "explained": abs(on_its_draw[t] - measured[t]) <= TOLERANCE}
    return {"workload": opts, "returns_measured": len(returning), "errors": sum(1 for r in rows if r["error"]),
            "prediction": pred.to_json(), "tiers": tiers,
            "draw": draw_stats(rows, w), "ok": all(v["within"] or v["explained"] for v in tiers.values())}


def draw_stats(rows: list[dict[str, Any]], w: Workload) -> dict[str, float]:
    """How this run's draw compares with the workload's mean one: the span of the users'
    arrivals (expected (users - 1) / arrival rate) and the median think time (the gap since
    the reply less the wait for a request slot)."""
    first = [r["start_s"] for r in rows if r["turn"] == 1 and not r.get("backup")]
    thinks = sorted(r["gap_s"] - r["wait_s"] for r in rows if r["turn"] > 1 and r["gap_s"] is not None)
    return {"arrival_span_s": max(first) - min(first), "expected_arrival_span_s": (w.users - 1) / w.arrival_rate,
            "think_median_s": thinks[len(thinks) // 2] if thinks else 0.0, "expected_think_median_s": w.think.quantile(0.5)}


def measured_schedule(rows: list[dict[str, Any]], w: Workload) -> Schedule:
    """The run's own draw, from its JSONL: when each turn of each user was sent (every turn
    the load generator sent has a row, failed ones too)."""
    sent = {(r["user"], r["turn"]): r["start_s"] for r in rows if not r.get("backup")}
    missing = [k for k in ((u, t) for u in range(w.users) for t in range(1, w.turns + 1)) if k not in sent]
    if missing:
        raise ValueError(f"the run has no row for (user, turn) {missing[:5]}: it did not finish")
    return Schedule(tuple(sent[(u, 1)] for u in range(w.users)), (),
                    sends=tuple(tuple(sent[(u, t)] for t in range(2, w.turns + 1)) for u in range(w.users)))


def table(runs: dict[str, dict[str, Any]]) -> str:
    width = max(12, *map(len, runs)) + 2
    lines = [f"{'run':<{width}}{'tier':<9}{'predicted':>10}{'95% of draws':>14}{'its draw':>10}{'measured':>10}"
             f"{'gap':>6}  verdict"]
    for name, r in runs.items():
        for i, (t, v) in enumerate(r["tiers"].items()):
            lo, hi = v["range95"]
            verdict = ("within 10 points" if v["within"] else "beyond 10 points; the run's own draw within 10"
                       if v["explained"] else "beyond 10 points, UNEXPLAINED")
            lines.append(f"{name if i == 0 else '':<{width}}{t:<9}{100 * v['predicted']:>9.0f}%{f'{100 * lo:.0f}-{100 * hi:.0f}%':>14}"
                         f"{100 * v['on_its_schedule']:>9.0f}%{100 * v['measured']:>9.0f}%{100 * v['gap']:>+6.0f}  {verdict}")
        p = r["prediction"]
        rates, win = p["rates"], p["windows_s"]
        lines.append(f"{'':<{width}}predicted: {rates['computed']:.0f} tokens/s computed, placed device/host/storage "
                     f"{rates['placed_device']:.0f}/{rates['placed_host']:.0f}/{rates['placed_storage']:.0f}, touched "
                     f"{rates['touched']:.0f}; hot shared {p['hot_shared_tokens']:.0f} and in flight "
                     f"{p['in_flight_tokens']:.0f} tokens; windows device/host {win['device']:.0f}/{win['host']:.0f} s; "
                     f"{r['returns_measured']} returns measured")
        d = r["draw"]
        lines.append(f"{'':<{width}}this run's draw: users arrived over {d['arrival_span_s']:.0f} s (expected "
                     f"{d['expected_arrival_span_s']:.0f} s), median think {d['think_median_s']:.1f} s (expected "
                     f"{d['expected_think_median_s']:.1f} s)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", default=os.path.join(HERE, "results", "planner"))
    ap.add_argument("--workdir", default="/var/tmp/tierstore-planner")
    ap.add_argument("--quick", action="store_true", help="one tiny run: the code paths, not a measurement")
    ap.add_argument("--reuse", metavar="DIR", help="with --quick: validate the load test's smoke run of the same workload "
                    f"in DIR ({TAG}@r1, as reproduce.py --quick leaves it) instead of running one")
    a = ap.parse_args()
    if a.reuse and not a.quick:
        ap.error("--reuse: only a smoke run reuses another's run; a validation runs its own")
    out = os.path.abspath(a.output_dir)
    variants = dict(list(VARIANTS.items())[:1]) if a.quick else VARIANTS
    runs = {}
    for name, opts in variants.items():
        full = {**WORKLOAD, **opts, **(QUICK if a.quick else {})}
        if a.reuse:
            runs[name] = validate("r1", full, os.path.abspath(a.reuse))
            continue
        run(name, full, os.path.join(out, name), a.workdir, QUICK_MODEL if a.quick else ())
        runs[name] = validate(name, full, os.path.join(out, name))
    s = stamp(directory=a.workdir)
    with open(os.path.join(out, "validation.json"), "w") as f:
        json.dump({"stamp": s, "tolerance": TOLERANCE, "runs": runs}, f, indent=1)
    text = "\n".join([header(s), ("the planner's shares, predicted from the workload, the pool sizes and the "
                                  "calibration before each run, against the shares the run measured (a user's own "
                                  "history, token-weighted):"), table(runs)])
    with open(os.path.join(out, "validation.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if a.quick or all(r["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
