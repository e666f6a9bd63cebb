#!/usr/bin/env python3
"""The benchmark's target ratios over several runs of scripts/bench_io.py: each run's, and
their median (these machines swing +-10% from run to run).

    python3 scripts/bench_summary.py scripts/results/bench_io*.json > scripts/results/bench_summary.txt
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any, Callable

Ratio = Callable[[dict[str, Any]], float]


def med(row: dict[str, Any], system: str, metric: str) -> float:
    return float(row[system][metric]["median"])


def ratio(a: str, b: str, metric: str) -> Ratio:
    return lambda row: med(row, a, metric) / med(row, b, metric)


ROWS: list[tuple[str, Ratio, str]] = [
    ("cold read / O_DIRECT read", ratio("ts_v1", "disk", "read_cold_gbps"), ">= 0.9 at >= 1 MiB"),
    ("write / O_DIRECT write", ratio("ts_v1", "disk", "write_gbps"), ">= 0.9 at >= 1 MiB, >= 0.85 at 256 KiB"),
    ("steady / same footprint never evicting: write", ratio("ts_steady", "ts_cycle", "write_gbps"), ">= 0.95"),
    ("steady / same footprint never evicting: cold read", ratio("ts_steady", "ts_cycle", "read_cold_gbps"), ">= 0.95"),
    ("steady / ts_v1 (store emptied each round): write", ratio("ts_steady", "ts_v1", "write_gbps"), ""),
    ("steady / ts_v1 (store emptied each round): cold read", ratio("ts_steady", "ts_v1", "read_cold_gbps"), ""),
    ("coalescing on / off: write", ratio("ts_v1", "ts_v1_nocoal", "write_gbps"), ""),
    ("coalescing on / off: cold read", ratio("ts_v1", "ts_v1_nocoal", "read_cold_gbps"), ""),
    ("tierstore / HiCacheFile: write", ratio("ts_v1", "hicache", "write_gbps"), ""),
    ("tierstore / HiCacheFile: cold read", ratio("ts_v1", "hicache", "read_cold_gbps"), ""),
]


def main() -> int:
    runs = [json.load(open(p)) for p in sys.argv[1:]]
    print(f"{len(runs)} runs: " + "; ".join(f"seed {r['seed']}, repeat {r['repeat']}" for r in runs))
    for spec in runs[0]["sizes"]:
        print(f"\n{spec} pages: per run, then the median of the runs")
        for name, fn, target in ROWS:
            vals = [fn(r["sizes"][spec]) for r in runs]
            line = "  ".join(f"{v:.2f}" for v in vals)
            print(f"  {name:<52} {line}   median {statistics.median(vals):.2f}   {target}")
    print("\nprobe of 128 keys / one MGET of 128 keys (target <= 1.3)")
    for case in ("probe_all_hit", "probe_first_missing", "probe_last_missing"):
        vals = [r["probe"][case]["median"] / r["probe"]["mget_128"]["median"] for r in runs]
        print(f"  {case:<20} " + "  ".join(f"{v:.2f}" for v in vals) + f"   median {statistics.median(vals):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
