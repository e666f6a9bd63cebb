"""What the load-test scripts share (multiturn_loadtest.py, loadtest_tiers.py, plan_validate.py):
a run's rows as the load test wrote them, and the figures every report takes from them
(TTFT quantiles, the share of a resent prefix each tier served, by turn and by return gap)."""

from __future__ import annotations

import bisect
import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from sglang_tierstore.tools.plan import TIERS
from tierstore_kit.stats import percentile


def decode_itl(row: dict[str, Any]) -> float | None:
    """A request's median inter-token latency after its first two tokens (the first gaps
    still hold prefill and the first scheduling); None for a request with no such gaps."""
    gaps = (row.get("itl_s") or [])[2:]
    return statistics.median(gaps) if gaps else None


def load_rows(summary_path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with open(summary_path) as f:
        s = json.load(f)
    with open(os.path.join(os.path.dirname(os.path.abspath(summary_path)), s["jsonl"])) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return s, rows


def shares(returning: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Token-weighted share of the resent prefixes each tier served, leaving out the first
    ``skip`` tokens of each (the tenant's system prompt, kept hot by every user of the
    tenant: the planner models a user's own history). Cached tokens are a prefix in tier
    order, device first, so the skipped tokens come off the device count first."""
    served = dict.fromkeys(TIERS, 0)
    total = 0
    for r in returning:
        left = skip
        for t in TIERS:
            n = r["cached"][t]
            served[t] += max(0, n - left)
            left = max(0, left - n)
        total += max(0, r["prefix_tokens"] - skip)
    out = {t: n / max(1, total) for t, n in served.items()}
    out["miss"] = max(0.0, 1 - sum(out.values()))
    return out


def gap_label(gap: float | None, edges: Sequence[float]) -> str:
    if gap is None:
        return "first turn"
    i = bisect.bisect_right(list(edges), gap)
    lo = 0 if i == 0 else edges[i - 1]
    return f">{lo:g}s" if i == len(edges) else f"{lo:g}-{edges[i]:g}s"


def gap_labels(edges: Sequence[float]) -> list[str]:
    return ["first turn"] + [gap_label(x, edges) for x in [0.0, *edges]]


def tier_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT percentiles and cached shares of successful requests."""
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    prefix = sum(r["prefix_tokens"] for r in rows)
    out: dict[str, Any] = {
        "requests": len(rows),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9), "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "prefix_tokens": prefix, "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
    }
    served = [_served(r) for r in rows]
    for t in TIERS:
        n = sum(s[t] for s in served)
        out[f"{t}_tokens"] = n
        out[f"{t}_share"] = n / prefix if prefix else None
    cached = sum(sum(s.values()) for s in served)
    out["recomputed_share"] = max(0.0, 1 - cached / prefix) if prefix else None
    return out


def _served(r: dict[str, Any]) -> dict[str, int]:
    """Tokens of the resent prefix each tier served. A cache can also match into this turn's
    new text (a rerun of the same seed): that part is left out, from the last tier back."""
    left = r["prefix_tokens"]
    out = {}
    for t in TIERS:
        out[t] = min(r["cached"][t], left)
        left -= out[t]
    return out


def summarize(rows: list[dict[str, Any]], edges: Sequence[float]) -> dict[str, Any]:
    """TTFT percentiles overall, for returning turns, by turn and by gap bucket; cached
    share per tier of the prefix each turn resent (the history before its new text).
    Backup users' requests only count under ``backup`` (present when there are some)."""
    backup = [r for r in rows if r.get("backup")]
    rows = [r for r in rows if not r.get("backup")]
    ok = [r for r in rows if not r["error"]]
    returning = [r for r in ok if r["turn"] > 1]
    itl = [x for r in ok for x in r["itl_s"]]
    e2e = [r["e2e_s"] for r in ok if r["e2e_s"] is not None]
    by_turn: dict[str, list[dict[str, Any]]] = {}
    by_gap: dict[str, list[dict[str, Any]]] = {label: [] for label in gap_labels(edges)}
    for r in ok:
        by_turn.setdefault(str(r["turn"]), []).append(r)
        by_gap[gap_label(r["gap_s"], edges)].append(r)
    return {
        "overall": {**tier_stats(ok), "errors": len(rows) - len(ok), "e2e_p50_s": percentile(e2e, 0.5), "e2e_p90_s": percentile(e2e, 0.9),
                    "itl_p50_s": percentile(itl, 0.5), "itl_p90_s": percentile(itl, 0.9), "itl_p99_s": percentile(itl, 0.99)},
        "returning": tier_stats(returning),
        "by_turn": {k: tier_stats(v) for k, v in sorted(by_turn.items(), key=lambda kv: int(kv[0]))},
        "by_gap": {k: tier_stats(v) for k, v in by_gap.items() if v},
        **({"backup": {**tier_stats([r for r in backup if not r["error"]]), "errors": sum(1 for r in backup if r["error"])}}
           if backup else {}),
    }
