#!/usr/bin/env python3
"""Side by side: one multi-turn workload against four cache configurations of a real server.

    python3 scripts/loadtest_tiers.py                      # CPU: a random-weight model built here
    python3 scripts/loadtest_tiers.py --model /models/x --server-args "--tp 1"   # a GPU machine

Two checkouts of tierstore against each other, under backup traffic (what
``scripts/results/loadtest_backups`` holds; see "Before and after" below)::

    OPTS="--configs l2+tierstore --hidden 256 --layers 16 --heads 8 --kv-heads 8 --head-dim 128 \\
          --output-length 4 --backup-rate 0.05 --backup-length 2048 --workdir /tmp/tierstore-loadtest-backups \\
          --output-dir scripts/results/loadtest_backups"
    python3 scripts/loadtest_tiers.py $OPTS --tierstore-src OLD_CHECKOUT --label before
    python3 scripts/loadtest_tiers.py $OPTS --tierstore-src NEW_CHECKOUT --label after
    python3 scripts/loadtest_tiers.py $OPTS --report-only --runs l2+tierstore@before,l2+tierstore@after

Starts ``sglang.launch_server`` four times with the same model and runs
``multiturn_loadtest.py`` with the same seed against each: no HiCache, HiCache with host
memory only (L2), L2 + SGLang's ``file`` backend, L2 + tierstore. Before the tierstore run
it measures, for a prefix as long as a returning user's, what recomputing it costs against
reading it back from each tier. Then it writes the comparison (table, plots), checks that
greedy outputs are identical across the four runs, and puts the residency planner's
prediction for each run next to the shares that run measured.

Results go to ``--output-dir`` (default ``scripts/results/loadtest``): per run its JSONL and
summary JSON, ``compare_*.png``, ``calibration.json``, ``planner.json`` and ``summary.txt``.

Before and after: ``--tierstore-src DIR`` puts DIR first on the server's PYTHONPATH, so the
server imports that checkout's ``sglang_tierstore``; the CPU harness's shim prints the file
each server process imported it from, and the run fails unless that is DIR's. ``--label L``
names the run ``<config>@L`` (its files, its curves), so runs of several checkouts share one
output directory; the summary JSON of a tierstore run gets a ``tierstore`` entry: the file
imported, its checkout's ``git rev-parse HEAD``, whether the package differs from that
commit, and a hash of the package's sources. ``--runs`` chooses the runs the report compares
(default: this invocation's). ``--backup-rate``/``--backup-length`` add one-turn users whose
pages are written through to L3 while the returning users prefetch from it (see
multiturn_loadtest.py); the report then adds each run's storage I/O from /metrics: pages
and MB written and read, and tierstore's batch latencies.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import requests


from tierstore_kit.cpu_harness import tiny_model
from tierstore_kit.cpu_harness.server import BASE_FLAGS, Server, storage_args, tierstore_config
from tierstore_kit.multiturn import TIERS, decode_itl, load_rows, shares
from tierstore_kit.provenance import header, stamp
from tierstore_kit.servers import free_port

from sglang_tierstore.embedded import pid_file
from sglang_tierstore.tools.plan import EmpiricalGaps, kv_bytes_per_token, plan

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = ("no-hicache", "l2", "l2+file", "l2+tierstore")
LOADTEST = os.path.join(HERE, "multiturn_loadtest.py")




def replace_flags(flags: list[str], **values: str) -> list[str]:
    """``flags`` with the values of ``--some-flag`` given as ``some_flag=...`` replaced."""
    out = list(flags)
    for name, value in values.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = value
    return out


def server_flags(args: argparse.Namespace, config: str, workdir: str) -> list[str]:
    """The same server for every run; only the cache tiers differ."""
    if args.model:
        base = ["--page-size", str(args.page_size), "--enable-cache-report", "--enable-metrics", *args.server_args.split()]
        hicache = ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
                   "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", str(args.prefetch_policy)]
    else:
        base = replace_flags(BASE_FLAGS, dtype=args.dtype, page_size=str(args.page_size),
                             max_total_tokens=str(args.max_total_tokens),
                             max_running_requests=str(args.max_running_requests), chunked_prefill_size="4096",
                             context_length=str(args.context_length)) + ["--enable-metrics", *args.server_args.split()]
        hicache = ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio), "--hicache-io-backend",
                   "direct", "--hicache-mem-layout", "page_first_direct", "--hicache-write-policy", "write_through",
                   "--hicache-storage-prefetch-policy", str(args.prefetch_policy)]
    if config == "no-hicache":
        return base
    if config == "l2":
        return base + hicache
    if config == "l2+file":
        path = os.path.join(workdir, "file-backend")
        shutil.rmtree(path, ignore_errors=True)
        return base + hicache + ["--hicache-storage-backend", "file", "--file-storage-path", path,
                                 "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 16})]
    store = os.path.join(workdir, "tierstore")
    shutil.rmtree(store, ignore_errors=True)
    return base + hicache + storage_args(tierstore_config(path=store, capacity_gb=args.l3_gb))


# -- calibration: what a returning prefix costs from each tier -----------------------------


def request(url: str, ids: list[int]) -> tuple[float, dict[str, Any]]:
    """TTFT of one streamed request (one output token) and its cached-token split."""
    t0 = time.perf_counter()
    ttft, meta = None, {}
    with requests.post(url + "/generate", stream=True, timeout=600, json={
        "input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
    }) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                ttft = ttft or time.perf_counter() - t0
                meta = json.loads(line[5:])["meta_info"]
    assert ttft is not None, "no output"
    return ttft, meta.get("cached_tokens_details") or {}


def device_pool_tokens(url: str) -> int:
    """The server's device KV pool (``sglang:max_total_num_tokens``), whatever flags set it."""
    text = requests.get(url + "/metrics", timeout=30).text
    return int(next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("sglang:max_total_num_tokens")))


def calibrate(server: Server, vocab: list[int], prefix: int, rng: random.Random, reps: int = 3) -> dict[str, Any]:
    """TTFT of one prefix cold, as a device hit, as a host hit (after enough other prompts to
    push it off the device) and as a storage hit (after a flush): medians of ``reps``. Each
    hit must come from the tier it is measuring, or this fails."""
    def fresh(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    device_tokens = device_pool_tokens(server.url)
    out: dict[str, Any] = {"prefix_tokens": prefix, "device_pool_tokens": device_tokens, "runs": []}
    for _ in range(reps):
        ids = fresh(prefix) + fresh(16)  # the prefix, then one page of new text
        run: dict[str, Any] = {}
        run["cold"] = request(server.url, ids)
        run["device"] = request(server.url, ids)
        for _ in range(device_tokens // prefix + 2):  # other users' prompts evict it from the device
            request(server.url, fresh(prefix))
        run["host"] = request(server.url, ids)
        time.sleep(2)  # write-through to storage finishes
        server.flush()
        run["storage"] = request(server.url, ids)
        for tier in TIERS:
            served = run[tier][1].get(tier, 0)
            if served < prefix:
                raise RuntimeError(f"calibration: the {tier} hit was served {run[tier][1]}, not {prefix} tokens from {tier}")
        out["runs"].append({k: {"ttft_s": t, "cached": d} for k, (t, d) in run.items()})
    for kind in ("cold", "device", "host", "storage"):
        out[f"{kind}_ttft_s"] = statistics.median(r[kind]["ttft_s"] for r in out["runs"])
    base = out["device_ttft_s"]
    out["recompute_s"] = max(1e-6, out["cold_ttft_s"] - base)
    for tier in ("host", "storage"):
        out[f"{tier}_read_s"] = max(1e-6, out[f"{tier}_ttft_s"] - base)
        out[f"recompute_over_{tier}_read"] = out["recompute_s"] / out[f"{tier}_read_s"]
    out["cold_over_storage_ttft"] = out["cold_ttft_s"] / out["storage_ttft_s"]
    server.flush()
    return out


# -- planner against measurement ----------------------------------------------------------------


def gauge(metrics: dict[str, float], name: str) -> float:
    """A gauge from a /metrics sample, whatever its labels."""
    return next((v for k, v in metrics.items() if k.split("{")[0] == name), 0.0)


def predict(summary: dict[str, Any], rows: list[dict[str, Any]], config: str, bpt: int, calib: dict[str, Any],
            l3_tokens: float | None) -> dict[str, Any]:
    """The planner's shares for one run, from that run's own capacities, return gaps and
    per-tier placement rates, next to the shares it measured.

    Two predictions: ``raw`` takes the pools' sizes as they are and the rates averaged over
    the whole run; ``effective`` first takes out what user histories cannot use (the tenants'
    system prompts, which every user of a tenant keeps touching, hot on the device and in host
    memory; on the device, the KV of requests in flight, by Little's law) and takes the rates
    over the busy period, from the 10th to the 90th percentile of the returns' send times: the
    load is not stationary (users arrive, then finish), and the average over the whole run
    includes an idle tail in which few returns happen. The planner counts a return as served by
    one tier; the measured shares are token-weighted (a prefix's newest pages leave a tier
    first, so one return can be served by two tiers).
    """
    ok = [r for r in rows if not r["error"]]
    returning = [r for r in ok if r["turn"] > 1]
    gaps = EmpiricalGaps(tuple(sorted(r["gap_s"] for r in returning)))
    after = summary["metrics_after"]
    gpu = gauge(after, "sglang:max_total_num_tokens")
    host = gauge(after, "sglang:hicache_host_total_tokens")
    cfg = summary["config"]
    hot = cfg["num_tenants"] * cfg["system_prompt_length"]
    starts = sorted(r["start_s"] for r in returning)
    busy = (starts[len(starts) // 10], starts[len(starts) * 9 // 10])

    def rates(lo: float, hi: float) -> tuple[dict[str, float], float, float]:
        """Tokens/s placed in each tier, computed tokens/s and KV held by requests in flight
        (Little's law), over requests sent in [lo, hi]."""
        span = [r for r in ok if lo <= r["start_s"] <= hi]
        secs = max(1e-9, hi - lo)
        computed = sum(r["prompt_tokens"] - r["cached_tokens"] + r["output_tokens"] for r in span)
        loaded = {t: sum(r["cached"][t] for r in span) for t in TIERS}
        # what enters each tier: every computed token (write-through), plus what is loaded into
        # it from the tiers below (a host hit goes to the device; a storage hit to host and device)
        placed = {"device": computed + loaded["host"] + loaded["storage"], "host": computed + loaded["storage"],
                  "storage": computed}
        in_flight = sum((r["e2e_s"] or 0.0) * (r["prompt_tokens"] + r["output_tokens"]) for r in span) / secs
        return {t: n / secs for t, n in placed.items()}, computed / secs, in_flight

    def run_plan(gpu_tokens: float, host_tokens: float, lo: float, hi: float) -> dict[str, Any]:
        placed, computed, _ = rates(lo, hi)
        return plan(
            gpu_tokens=gpu_tokens, host_tokens=host_tokens, l3_tokens=l3_tokens, insert_rate=computed,
            gaps=gaps, bytes_per_token=bpt, prefix_tokens=statistics.fmean(r["prefix_tokens"] for r in returning),
            recompute_s_per_token=calib["recompute_s"] / calib["prefix_tokens"],
            host_read_bytes_per_s=calib["prefix_tokens"] * bpt / calib["host_read_s"],
            l3_read_bytes_per_s=calib["prefix_tokens"] * bpt / calib["storage_read_s"],
            tier_rates=placed,
        ).to_json()

    whole = (0.0, max(r["start_s"] + (r["e2e_s"] or 0) for r in ok))
    in_flight = rates(*busy)[2]
    own = shares(returning, int(cfg["system_prompt_length"]))
    reach = 0.0
    measured_windows = {}
    for t in TIERS:  # the window each tier behaved as if it had: the gap quantile at its cumulative share
        reach += own[t]
        measured_windows[t] = gaps.quantile(min(1.0, reach)) if reach > 1e-9 else 0.0
    return {
        "raw": run_plan(gpu, host, *whole),
        "effective": run_plan(max(1.0, gpu - hot - in_flight), max(1.0, host - hot), *busy),
        "hot_shared_tokens": hot, "in_flight_tokens": in_flight, "busy_period_s": busy,
        "measured_shares": shares(returning, 0),
        "measured_own_shares": own, "measured_windows_s": measured_windows,
    }


def divergence(runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Per run (``tag -> (summary, rows)``, the first the reference): the requests
    (``"user/turn"``) whose greedy output differs from the reference's, and those that
    failed. A failed request (no output: a dropped connection, a timeout) is no divergence:
    it is listed apart and left out of the comparison in every run."""
    failed = {t: sorted(f"{r['user']}/{r['turn']}" for r in rows if r.get("error") and not r.get("backup"))
              for t, (_, rows) in runs.items()}
    ref = next(iter(runs.values()))[0]["outputs"]
    compared = set(ref) - {k for f in failed.values() for k in f}
    return {t: sorted(k for k in compared if s["outputs"].get(k) != ref[k]) for t, (s, _) in runs.items()}, failed


def planner_table(preds: dict[str, dict[str, Any]]) -> str:
    cols = (*TIERS, "miss")
    width = max(14, 2 + max(map(len, preds)))
    lines = [f"{'run':<{width}}{'':<12}" + "".join(f"{t:>9}" for t in cols) + "   windows device/host/storage (s)"]
    for tag, d in preds.items():
        for i, (label, key) in enumerate((("planner", "raw"), ("planner*", "effective"))):
            w = d[key]["windows_s"]
            win = "/".join(f"{w[t]:.0f}" if isinstance(w[t], float) else str(w[t]) for t in TIERS)
            lines.append(f"{tag if i == 0 else '':<{width}}{label:<12}"
                         + "".join(f"{100 * d[key]['shares'][t]:>8.0f}%" for t in cols) + f"   {win}")
        mw = d["measured_windows_s"]
        lines.append(f"{'':<{width}}{'measured':<12}" + "".join(f"{100 * d['measured_own_shares'][t]:>8.0f}%" for t in cols)
                     + "   " + "/".join(f"{mw[t]:.0f}" for t in TIERS) + " (gap quantiles at these shares)")
        lines.append(f"{'':<{width}}{'(+system)':<12}" + "".join(f"{100 * d['measured_shares'][t]:>8.0f}%" for t in cols))
    return "\n".join(lines)


# -- before and after: which tierstore, what L3 did, paired differences -----------------------

IMPORT_NOTE = "cpu harness: sglang_tierstore imported from "  # printed by tierstore_kit/cpu_harness/shim


def imported_from(log: str, offset: int) -> list[str]:
    """The files the server's processes imported ``sglang_tierstore`` from, as the CPU
    harness's shim printed them in ``log`` after ``offset``."""
    with open(log, errors="replace") as f:
        f.seek(offset)
        return sorted({line.split(IMPORT_NOTE, 1)[1].strip() for line in f if IMPORT_NOTE in line})


def provenance(files: list[str], src: str | None) -> dict[str, Any] | None:
    """Which tierstore a run's server ran: the files it imported (``files``; on a GPU
    machine, without the shim, none are known and ``src`` is taken at its word), the
    checkout's commit, whether the package differs from that commit, and a hash of the
    package's sources. Raises if the server imported it from anywhere but ``src``."""
    pkgs = {os.path.dirname(f) for f in files}
    if len(pkgs) > 1:
        raise RuntimeError(f"the server's processes imported sglang_tierstore from {sorted(pkgs)}")
    if pkgs:
        root = os.path.dirname(pkgs.pop())
        if src and os.path.realpath(root) != os.path.realpath(src):
            raise RuntimeError(f"the server imported sglang_tierstore from {files}, not from --tierstore-src {src}")
    elif src:
        root = src
    else:
        return None
    pkg = os.path.join(root, "sglang_tierstore")
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(pkg, "*.py"))):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, check=True).stdout.strip()

    return {"imported_from": files or None, "checkout": root, "head": git("rev-parse", "HEAD"),
            "package_modified": bool(git("status", "--porcelain", "--", "sglang_tierstore")),
            "package_sha256": digest.hexdigest()}


def storage_io(summary: dict[str, Any]) -> dict[str, Any]:
    """What L3 did during one run, from its /metrics counters: pages and MB written and read
    by tierstore, MB/s written over the run, and tierstore's batch latencies per operation
    (mean, and the histogram bucket bound under which the 50th/90th/99th percentile lies)."""
    d: dict[str, float] = summary["metrics_delta"]

    def total(name: str, **labels: str) -> float:
        return sum(v for k, v in d.items()
                   if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()))

    out: dict[str, Any] = {
        "pages_written": total("tierstore_pages_total", op="write", outcome="stored"),
        "pages_not_written": total("tierstore_pages_total", op="write") - total("tierstore_pages_total", op="write", outcome="stored"),
        "pages_read": total("tierstore_pages_total", op="read", outcome="hit"),
        "pages_read_missed": total("tierstore_pages_total", op="read", outcome="miss"),
        "mb_written": total("tierstore_bytes_total", op="write") / 1e6, "mb_read": total("tierstore_bytes_total", op="read") / 1e6,
        "backuped_tokens": total("sglang:backuped_tokens_total"), "prefetched_tokens": total("sglang:prefetched_tokens_total"),
    }
    out["mb_per_s_written"] = out["mb_written"] / summary["duration_s"]
    for op in ("read", "write"):
        n = total("tierstore_batch_seconds_count", op=op)
        buckets = sorted((float(k.split('le="')[1].split('"')[0]), v) for k, v in d.items()
                         if k.startswith("tierstore_batch_seconds_bucket{") and f'op="{op}"' in k)
        out[f"{op}_batches"] = n
        out[f"{op}_batch_mean_s"] = total("tierstore_batch_seconds_sum", op=op) / n if n else None
        for q in (50, 90, 99):
            out[f"{op}_batch_p{q}_below_s"] = next((le for le, c in buckets if c >= q / 100 * n), None) if n else None
    return out


def storage_table(runs: dict[str, dict[str, Any]]) -> str:
    """One line per run: its L3 traffic and tierstore's read and write batch latencies."""
    width = max(14, 2 + max(map(len, runs)))

    def lat(io: dict[str, Any], op: str) -> str:
        if not io[f"{op}_batches"]:
            return f"{'-':>44}"
        bounds = "/".join(f"{1e3 * io[f'{op}_batch_p{q}_below_s']:g}" for q in (50, 90, 99))
        return f"{io[f'{op}_batches']:>16.0f}{1e3 * io[f'{op}_batch_mean_s']:>9.1f}{'<=' + bounds:>19}"

    lines = [f"{'':<{width}}{'written':>10}{'MB':>8}{'MB/s':>7}{'read':>8}{'MB':>8}"
             + "".join(f"{op + ' batches':>16}{'mean ms':>9}{'p50/90/99 ms':>19}" for op in ("read", "write"))]
    for tag, s in runs.items():
        io = storage_io(s)
        lines.append(f"{tag:<{width}}{io['pages_written']:>10.0f}{io['mb_written']:>8.0f}{io['mb_per_s_written']:>7.1f}"
                     f"{io['pages_read']:>8.0f}{io['mb_read']:>8.0f}{lat(io, 'read')}{lat(io, 'write')}")
    return "\n".join(lines)


def paired(ref_rows: list[dict[str, Any]], rows: list[dict[str, Any]], returning: bool = True,
           reps: int = 2000) -> dict[str, Any] | None:
    """TTFT differences (``rows``' run minus ``ref_rows``') of the returning turns (or, with
    ``returning`` False, the first turns) both runs completed, matched by user and turn (same
    seed: the same request in both): their median, with a 95% bootstrap interval over the
    pairs. The interval covers which requests happened to be sampled, not what differs from
    run to run (the machine, the timing of a queue): first turns, which read nothing from L3,
    show that part."""
    def turns(rs: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
        return {(r["user"], r["turn"]): r["ttft_s"] for r in rs
                if (r["turn"] > 1) == returning and not r.get("backup") and r["ttft_s"] is not None}

    a, b = turns(ref_rows), turns(rows)
    diffs = [b[k] - a[k] for k in sorted(a.keys() & b.keys())]
    if not diffs:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(reps))
    return {"n": len(diffs), "median_s": statistics.median(diffs),
            "ci95_s": (meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]),
            "faster": sum(1 for x in diffs if x < 0)}


# -- interleaved rounds: configurations compared request by request ---------------------------

CALL_OPS = {"batch_exists": "probe", "batch_get_v1": "read", "batch_set_v1": "write"}


def per_request(rows: list[dict[str, Any]], round_no: int) -> dict[tuple[int, int, int], dict[str, Any]]:
    return {(round_no, r["user"], r["turn"]): r for r in rows if not r.get("error") and not r.get("backup")
            and r.get("ttft_s") is not None}


def tierstore_cpu(summary: dict[str, Any]) -> dict[str, Any]:
    """What tierstore cost SGLang's process in one run: caller-thread CPU per page of each
    call (from /metrics), and its I/O and housekeeping threads' and the embedded index's CPU
    per second, busy and idle (from /proc)."""
    delta = summary.get("metrics_delta", {})

    def total(prefix: str, **labels: str) -> float:
        return sum(v for k, v in delta.items() if k.startswith(prefix + "{")
                   and all(f'{n}="{x}"' in k for n, x in labels.items()))

    out: dict[str, Any] = {"per_page_us": {}}
    for call, op in CALL_OPS.items():
        pages = total("tierstore_pages_total", op=op)
        for mode in ("user", "system"):
            secs = total("tierstore_caller_cpu_seconds_total", call=call, mode=mode)
            if pages:
                out["per_page_us"][f"{call} {mode}"] = 1e6 * secs / pages
        calls = total("tierstore_batch_seconds_count", op=op)
        out.setdefault("pages_per_call", {})[call] = pages / calls if calls else None
    for phase in ("busy", "idle"):
        c = summary.get("cpu", {}).get(phase)
        if not c:
            continue
        secs = max(c["seconds"], 1e-9)
        out[phase] = {name: sum(c["threads"].get(name, [0.0, 0.0])) / secs for name in ("tierstore-io", "tierstore-hk")}
        out[phase]["redis"] = sum(c.get("redis", [0.0, 0.0])) / secs
        out[phase]["seconds"] = c["seconds"]
    return out


def rounds_report(out_dir: str, configs: list[str], suffix: str, rounds: int) -> str:
    """Each configuration against the others over interleaved rounds, paired request by
    request within a round (the same seed: the same requests): returning-turn TTFT,
    first-turn TTFT and decode inter-token latency, the median ratio with a 95% interval
    that resamples rounds, then requests (``compare.clustered_paired_ratio``); and what
    tierstore's own work cost. Written to ``rounds.json``."""
    from tierstore_kit.stats import clustered_paired_ratio, say

    reqs: dict[str, dict[tuple[int, int, int], dict[str, Any]]] = {c: {} for c in configs}
    cpu: list[dict[str, Any]] = []
    for c in configs:
        for k in range(rounds):
            summary, rows = load_rows(os.path.join(out_dir, f"{c}{suffix}@r{k + 1}.summary.json"))
            reqs[c].update(per_request(rows, k))
            if c == "l2+tierstore":
                cpu.append(tierstore_cpu(summary))
    metrics = {"returning-turn TTFT": lambda r: r["ttft_s"] if r["turn"] > 1 else None,
               "first-turn TTFT": lambda r: r["ttft_s"] if r["turn"] == 1 else None,
               "decode inter-token latency": decode_itl}
    out: dict[str, Any] = {"stamp": stamp(directory=out_dir), "rounds": rounds, "configs": configs, "pairs": {}, "medians": {},
                           "tierstore_cpu": cpu}
    lines = [f"interleaved: {rounds} rounds of {', '.join(configs)} (round k starts k configurations later), "
             "each run on fresh state; paired request by request within a round, median ratio and 95% interval:"]
    for c in configs:
        out["medians"][c] = {m: statistics.median(v) if (v := [x for r in reqs[c].values() if (x := f(r)) is not None]) else None
                             for m, f in metrics.items()}
    for a, b in [(a, b) for i, a in enumerate(configs) for b in configs[i + 1:]]:
        for m, f in metrics.items():
            both = [k for k in sorted(reqs[a].keys() & reqs[b].keys()) if f(reqs[a][k]) is not None and f(reqs[b][k]) is not None]
            if len(both) < 3:
                continue
            groups = [([f(reqs[b][k]) for k in both if k[0] == r], [f(reqs[a][k]) for k in both if k[0] == r])
                      for r in range(rounds)]
            iv = clustered_paired_ratio(groups)
            out["pairs"][f"{b} / {a}: {m}"] = iv
            lines.append(f"  {b} / {a}, {m} ({len(both)} requests in {iv['n']} rounds): {say(iv)}")
    for k, c in enumerate(cpu):
        lines.append(f"  tierstore, round {k + 1}: caller CPU per page " + ", ".join(f"{n} {v:.1f} us" for n, v in c["per_page_us"].items()))
        for phase in ("busy", "idle"):
            if phase in c:
                lines.append(f"    {phase} ({c[phase]['seconds']:.0f} s): CPU share of a core: I/O threads "
                             f"{c[phase]['tierstore-io']:.2%}, housekeeping {c[phase]['tierstore-hk']:.2%}, "
                             f"embedded index {c[phase]['redis']:.2%}")
    with open(os.path.join(out_dir, "rounds.json"), "w") as f:
        json.dump(out, f, indent=1)
    return "\n".join(lines)


# -- what the processes cost: CPU per thread name, the embedded index ------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat_times(path: str) -> tuple[float, float]:
    """User and system CPU seconds from a /proc ``stat`` file (fields 14 and 15)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def thread_cpu(root: int) -> dict[str, list[float]]:
    """CPU seconds [user, system] of every thread of ``root`` and its descendant processes,
    summed by thread name (tierstore names its threads ``tierstore-io`` and ``tierstore-hk``)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [c for c, pp in parents.items() if pp == pid and c not in tree]
    out: dict[str, list[float]] = {}
    for pid in tree:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process exited meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                u, sy = _stat_times(f"/proc/{pid}/task/{tid}/stat")
            except OSError:
                continue  # the thread exited meanwhile
            acc = out.setdefault(name, [0.0, 0.0])
            acc[0] += u
            acc[1] += sy
    return out


def cpu_snapshot(root: int, store: str | None) -> dict[str, Any]:
    snap: dict[str, Any] = {"t": time.monotonic(), "threads": thread_cpu(root)}
    if store:
        try:
            with open(pid_file(store)) as f:
                snap["redis"] = list(_stat_times(f"/proc/{int(f.read())}/stat"))
        except (OSError, ValueError):
            pass
    return snap


def cpu_between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds [user, system] each thread name (and the embedded index) used from ``a`` to
    ``b`` (a thread that exited between them takes its time with it: at least 0)."""
    names = a["threads"].keys() | b["threads"].keys()
    out: dict[str, Any] = {"seconds": b["t"] - a["t"], "threads": {
        n: [round(max(0.0, y - x), 3) for x, y in zip(a["threads"].get(n, [0.0, 0.0]), b["threads"].get(n, [0.0, 0.0]))]
        for n in names}}
    if "redis" in a and "redis" in b:
        out["redis"] = [round(y - x, 3) for x, y in zip(a["redis"], b["redis"])]
    return out


# -- the runs ---------------------------------------------------------------------------------


def loadtest_args(args: argparse.Namespace, model: str, url: str, tag: str) -> list[str]:
    return [sys.executable, LOADTEST, "--base-url", url, "--model-path", model, "--tag", tag, "--no-plots",
            "--output-dir", args.output_dir, "--seed", str(args.seed), "--num-clients", str(args.num_clients),
            "--num-rounds", str(args.num_rounds), "--request-length", str(args.request_length),
            "--sub-question-input-length", str(args.sub_question_input_length), "--output-length", str(args.output_length),
            "--request-rate", str(args.request_rate), "--system-prompt-length", str(args.system_prompt_length),
            "--num-tenants", str(args.num_tenants), "--think-time-median", str(args.think_time_median),
            "--think-time-sigma", str(args.think_time_sigma), "--max-parallel", str(args.max_parallel),
            "--gap-buckets", args.gap_buckets, "--backup-rate", str(args.backup_rate),
            "--backup-length", str(args.backup_length)]


def stop_embedded_redis(store: str) -> None:
    try:
        with open(pid_file(store)) as f:
            os.kill(int(f.read()), signal.SIGTERM)
    except (OSError, ValueError):
        pass  # not running


def config_of(tag: str) -> str:
    """The cache configuration of a run named ``<config>`` or ``<config>@<label>``."""
    return tag.split("@", 1)[0]


def calibration_path(output_dir: str, tag: str) -> str:
    return os.path.join(output_dir, f"calibration{tag[len(config_of(tag)):]}.json")


def report(args: argparse.Namespace, tags: list[str], model: str, bpt: int) -> int:
    """The comparison of the runs ``tags`` in ``--output-dir``: table and plots
    (``--compare``), the calibrations, the planner next to the measurement, each run's
    tierstore and L3 traffic, the headline (with paired differences), and whether greedy
    outputs were identical; written to ``summary.txt``."""
    calibs: dict[str, dict[str, Any]] = {}
    for tag in tags:
        if os.path.exists(calibration_path(args.output_dir, tag)):
            with open(calibration_path(args.output_dir, tag)) as f:
                calibs[tag] = json.load(f)
    summaries = [os.path.join(args.output_dir, f"{t}.summary.json") for t in tags]
    table = subprocess.run([sys.executable, LOADTEST, "--compare", *summaries, "--output-dir", args.output_dir],
                           check=True, capture_output=True, text=True).stdout
    runs = {t: load_rows(path) for t, path in zip(tags, summaries)}
    ref_outputs = runs[tags[0]][0]["outputs"]
    differing, failed = divergence(runs)
    cfg = runs[tags[0]][0]["config"]
    lines = [f"model {model}: {bpt} KV bytes/token; {len(ref_outputs)} requests per run"]
    if cfg.get("backup_rate"):
        lines.append(f"backup traffic: one-turn users of {cfg['backup_length']} tokens, {cfg['backup_rate']:g}/s "
                     f"(~{cfg['backup_rate'] * cfg['backup_length'] * bpt / 1e6:.0f} MB/s of new KV offered)")
    lines += ["", table, ""]
    for tag, calib in calibs.items():
        lines += [f"calibration ({tag}), a returning prefix of {calib['prefix_tokens']} tokens (medians of 3; TTFT end to end):",
                  (f"  cold {calib['cold_ttft_s'] * 1e3:.0f} ms   device hit {calib['device_ttft_s'] * 1e3:.0f} ms   "
                   f"host hit {calib['host_ttft_s'] * 1e3:.0f} ms   storage hit {calib['storage_ttft_s'] * 1e3:.0f} ms"),
                  (f"  recompute {calib['recompute_s'] * 1e3:.0f} ms vs read back from storage {calib['storage_read_s'] * 1e3:.0f} ms "
                   f"(beyond a device hit): {calib['recompute_over_storage_read']:.1f}x; cold TTFT / storage-hit TTFT "
                   f"{calib['cold_over_storage_ttft']:.1f}x"), ""]
    if calibs:
        l3 = {"l2": None, "l2+file": math.inf, "l2+tierstore": args.l3_gb * 2**30 / bpt}
        first = next(iter(calibs.values()))
        preds = {t: predict(s, rows, config_of(t), bpt, calibs.get(t, first), l3[config_of(t)]) for t, (s, rows) in runs.items()
                 if config_of(t) in l3 and any(r["turn"] > 1 and not r["error"] for r in rows)}
        with open(os.path.join(args.output_dir, "planner.json"), "w") as f:
            json.dump({"stamp": stamp(directory=args.workdir), **preds}, f, indent=1)
        lines += [("residency planner, from each run's pool sizes, measured return gaps and per-tier placement "
                   "rates, against the share of returning prefixes each tier served. planner: the pools as "
                   "sized, rates over the whole run; planner*: less the tenants' system prompts (hot in device "
                   "and host) and, on the device, the KV of requests in flight, rates over the busy period "
                   "(10th to 90th percentile of the returns' send times). measured: a user's own history; "
                   "(+system): with the tenant's system prompt:"), planner_table(preds), ""]
    stored = {t: s for t, (s, _) in runs.items() if config_of(t) == "l2+tierstore"}
    if stored:
        for tag, s in stored.items():
            prov = s.get("tierstore")
            if prov:
                state = "modified since that commit" if prov["package_modified"] else "as committed"
                where = ", ".join(prov["imported_from"]) if prov["imported_from"] else f"{prov['checkout']} (not checked: no shim)"
                lines.append(f"{tag}: tierstore from {where}; commit {prov['head'][:12]}, package {state} "
                             f"(sources sha256 {prov['package_sha256'][:12]})")
            policy = dict(zip(s.get("server_flags", []), s.get("server_flags", [])[1:])).get("--hicache-storage-prefetch-policy")
            if policy:
                lines.append(f"{tag}: --hicache-storage-prefetch-policy {policy}")
        lines += ["", ("L3 traffic per run, from /metrics: pages (and MB) tierstore wrote and read back, MB/s written "
                       "over the run; tierstore's batch calls: how many, mean wall time, and the histogram bucket "
                       "bounds under which the 50th/90th/99th percentile call lies:"), storage_table(stored), ""]
    ret = {t: s["summary"]["returning"] for t, (s, _) in runs.items()}
    ref = next((t for t in tags if config_of(t) == "l2+tierstore" and ret[t].get("ttft_p50_s")), None)
    if ref:
        ts = ret[ref]
        width = max(map(len, tags))
        lines.append(f"headline: returning turns, TTFT p50 / p90 / p99 with {ref} {ts['ttft_p50_s'] * 1e3:.0f} / "
                     f"{ts['ttft_p90_s'] * 1e3:.0f} / {ts['ttft_p99_s'] * 1e3:.0f} ms ({ts['requests']} turns); "
                     f"storage served {100 * ts['storage_share']:.0f}% of their prefix tokens; ratios below are to {ref}'s")
        for other in tags:
            o = ret[other]
            if other == ref or not o.get("ttft_p50_s"):
                continue
            lines.append(f"  vs {other:<{width}} " + ", ".join(
                f"{q} {o[f'ttft_{q}_s'] * 1e3:6.0f} ms ({o[f'ttft_{q}_s'] / ts[f'ttft_{q}_s']:.2f}x)" for q in ("p50", "p90", "p99"))
                + f"; storage served {100 * (o['storage_share'] or 0):.0f}%")
            for kind, ret_turns in (("returning turns", True), ("first turns (no L3 reads: the noise)", False)):
                pair = paired(runs[ref][1], runs[other][1], ret_turns)
                if pair:
                    lo, hi = pair["ci95_s"]
                    lines.append(f"  {'':<{width + 3}} the same {pair['n']} {kind} paired: median TTFT difference "
                                 f"{pair['median_s'] * 1e3:+.0f} ms (95% bootstrap interval {lo * 1e3:+.0f} to "
                                 f"{hi * 1e3:+.0f} ms); {pair['faster']} of {pair['n']} faster than in {ref}")
    same = all(not d for d in differing.values())
    lines.append(f"greedy outputs identical across {', '.join(tags)}: {same}"
                 + ("" if same else f" (differing requests: { {t: d for t, d in differing.items() if d} })"))
    if any(failed.values()):
        lines.append(f"failed requests, left out of that comparison: { {t: f for t, f in failed.items() if f} }")
    text = "\n".join([header(stamp(directory=args.workdir)), *lines])
    with open(os.path.join(args.output_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    # greedy decoding is bit-exact on this CPU setup; GPU kernels may legitimately differ by batch shape
    return 0 if same or args.model else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/tierstore-loadtest",
                    help="model, servers' logs and stores; the servers run in it (so they never import the "
                         "sglang_tierstore of the directory this was started from)")
    ap.add_argument("--output-dir", default=os.path.join(HERE, "results", "loadtest"))
    ap.add_argument("--model", help="a served model (GPU machine); default: build a random-weight Llama for CPU")
    ap.add_argument("--server-args", default="", help="extra server flags, for every run")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    ap.add_argument("--report-only", action="store_true", help="no runs: redo the comparison of those in --output-dir")
    ap.add_argument("--tierstore-src", help="a checkout whose sglang_tierstore the server imports (first on its PYTHONPATH)")
    ap.add_argument("--label", help="names this invocation's runs <config>@LABEL (e.g. before, after)")
    ap.add_argument("--runs", help="comma-separated runs (<config> or <config>@<label>) the report compares "
                                   "(default: this invocation's)")
    srv = ap.add_argument_group("server sizing (CPU defaults: pools that typical think times outlast)")
    srv.add_argument("--hidden", type=int, default=768, help="CPU model: hidden size")
    srv.add_argument("--layers", type=int, default=8, help="CPU model: layers")
    srv.add_argument("--heads", type=int, help="CPU model: attention heads (default hidden/64)")
    srv.add_argument("--kv-heads", type=int, help="CPU model: KV heads (default hidden/256)")
    srv.add_argument("--head-dim", type=int, help="CPU model: head dimension (default hidden/heads); with --kv-heads, "
                                                  "the KV bytes per token apart from the compute")
    srv.add_argument("--dtype", default="float32",
                     help="CPU runs: float32 keeps greedy outputs identical whichever tier a prefix comes from "
                          "(in bfloat16 a recomputed prefix differs in the last bits from a cached one)")
    srv.add_argument("--page-size", type=int, default=16)
    srv.add_argument("--max-total-tokens", type=int, default=8192, help="device KV pool (L1), CPU runs")
    srv.add_argument("--max-running-requests", type=int, default=3)
    srv.add_argument("--context-length", type=int, default=4096)
    srv.add_argument("--hicache-ratio", type=float, default=2.0, help="host pool (L2) over device pool")
    srv.add_argument("--l3-gb", type=float, default=8.0, help="tierstore capacity")
    srv.add_argument("--prefetch-policy", default="wait_complete", choices=("wait_complete", "best_effort", "timeout"),
                     help="--hicache-storage-prefetch-policy: with wait_complete a slow prefetch shows up as TTFT, "
                          "with best_effort as fewer storage hits")
    w = ap.add_argument_group("workload (see multiturn_loadtest.py)")
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--num-clients", type=int, default=24)
    w.add_argument("--num-rounds", type=int, default=4)
    w.add_argument("--request-length", type=int, default=512)
    w.add_argument("--sub-question-input-length", type=int, default=256)
    w.add_argument("--output-length", type=int, default=16)
    w.add_argument("--request-rate", type=float, default=0.25)
    w.add_argument("--system-prompt-length", type=int, default=1024)
    w.add_argument("--num-tenants", type=int, default=4)
    w.add_argument("--think-time-median", type=float, default=50.0)
    w.add_argument("--think-time-sigma", type=float, default=0.8)
    w.add_argument("--max-parallel", type=int, default=8)
    w.add_argument("--gap-buckets", default="10,20,40,80,160")
    w.add_argument("--backup-rate", type=float, default=0.0, help="one-turn users per second whose KV is written through to L3")
    w.add_argument("--backup-length", type=int, default=2048, help="tokens of a backup user's prompt")
    w.add_argument("--rounds", type=int, default=1, help="run every configuration this often, interleaved (round k "
                   "starts k configurations later), each run on fresh state; the report pairs them per request")
    w.add_argument("--idle-s", type=float, default=10.0, help="seconds each server idles after its load test, to "
                   "measure what its threads cost with nothing to do")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}; choose from {CONFIGS}")
    suffix = f"@{args.label}" if args.label else ""
    tags = [t for t in args.runs.split(",") if t] if args.runs else [c + suffix for c in configs]
    if set(map(config_of, tags)) - set(CONFIGS):
        ap.error(f"--runs: names <config> or <config>@<label>, with a config of {CONFIGS}")
    args.workdir, args.output_dir = os.path.abspath(args.workdir), os.path.abspath(args.output_dir)
    if args.tierstore_src:
        args.tierstore_src = os.path.abspath(args.tierstore_src)
        if not os.path.isfile(os.path.join(args.tierstore_src, "sglang_tierstore", "__init__.py")):
            ap.error(f"--tierstore-src {args.tierstore_src}: no sglang_tierstore package there")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (args.tierstore_src, os.environ.get("PYTHONPATH")) if p)

    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(args.output_dir, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(args.workdir, "torch_extensions"))
    heads = args.heads or args.hidden // 64
    kv_heads = args.kv_heads or max(1, args.hidden // 256)
    head_dim = args.head_dim or args.hidden // heads
    model = args.model or tiny_model.build(
        os.path.join(args.workdir, f"model-{args.hidden}x{args.layers}" + (
            "" if (heads, kv_heads, head_dim) == (args.hidden // 64, max(1, args.hidden // 256), 64)
            else f"-h{heads}kv{kv_heads}d{head_dim}")),
        hidden=args.hidden, layers=args.layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    with open(os.path.join(model, "config.json")) as f:
        bpt = kv_bytes_per_token(json.load(f), None if args.model else args.dtype)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    # a typical returning prefix: the history resent by the middle turn
    mid = max(2, (args.num_rounds + 2) // 2)
    prefix = (args.system_prompt_length + args.request_length + args.output_length
              + (mid - 2) * (args.sub_question_input_length + args.output_length))

    plan_runs = [(config, k) for k in range(args.rounds) for config in configs[k % len(configs):] + configs[:k % len(configs)]]
    for config, k in plan_runs if not args.report_only else []:  # round k starts one configuration later
        tag = config + suffix + (f"@r{k + 1}" if args.rounds > 1 else "")
        print(f"== {tag}", flush=True)
        log = os.path.join(args.workdir, f"server-{tag.replace('+', '_')}.log")
        offset = os.path.getsize(log) if os.path.exists(log) else 0
        flags = server_flags(args, config, args.workdir)
        store = os.path.join(args.workdir, "tierstore") if config == "l2+tierstore" else None
        try:
            with Server(model, free_port(), log, flags, cpu=not args.model, cwd=args.workdir) as s:
                s.wait_ready(900)
                request(s.url, [vocab[0]] * 64)  # warm-up: page-hash extension, first forward
                prov = provenance(imported_from(log, offset), args.tierstore_src) if config == "l2+tierstore" else None
                if config == "l2+tierstore" and not args.model and not (prov and prov["imported_from"]):
                    raise RuntimeError(f"{log}: no line saying where the server imported sglang_tierstore from")
                if config == "l2+tierstore" and k == 0:
                    calib = calibrate(s, vocab, prefix, random.Random(args.seed + 1))
                    with open(calibration_path(args.output_dir, tag), "w") as f:
                        json.dump({"stamp": stamp(directory=args.workdir), **calib}, f, indent=1)
                    print(f"  calibration ({prefix} tokens): cold {calib['cold_ttft_s'] * 1e3:.0f} ms, device "
                          f"{calib['device_ttft_s'] * 1e3:.0f} ms, host {calib['host_ttft_s'] * 1e3:.0f} ms, storage "
                          f"{calib['storage_ttft_s'] * 1e3:.0f} ms", flush=True)
                s.flush()
                before = cpu_snapshot(s.proc.pid, store)
                rc = subprocess.call(loadtest_args(args, model, s.url, tag))
                busy = cpu_snapshot(s.proc.pid, store)
                time.sleep(args.idle_s)  # nothing sent: what each thread costs with nothing to do
                cpu = {"busy": cpu_between(before, busy), "idle": cpu_between(busy, cpu_snapshot(s.proc.pid, store))}
        finally:  # the server's embedded index outlives it: stopped whether the run ended well or not
            if store:
                stop_embedded_redis(store)
        if rc:
            print(f"load test against {tag} failed ({rc}); see {log}", file=sys.stderr)
            return rc
        path = os.path.join(args.output_dir, f"{tag}.summary.json")  # what ran, next to what it measured
        with open(path) as f:
            summary = json.load(f)
        summary.update(stamp=stamp(directory=args.workdir, server_flags=flags), server_flags=flags, cpu=cpu, **({"tierstore": prov} if prov else {}))
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)

    if args.rounds > 1 and not args.runs:
        tags = [t for c in configs for t in (f"{c}{suffix}@r{k + 1}" for k in range(args.rounds))]
    rc = report(args, tags, model, bpt)
    if args.rounds > 1 or (args.runs and all(t.endswith("@r1") for t in tags)):  # interleaved rounds, or a report of one
        text = rounds_report(args.output_dir, configs, suffix, args.rounds)
        with open(os.path.join(args.output_dir, "summary.txt"), "a") as f:
            f.write("\n" + text + "\n")
        print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
