"""Telling a difference from noise: medians with 95% bootstrap intervals, paired where two
systems ran the same workload in the same round, and the sentence a figure may carry.

The benchmarks interleave their systems (every round runs each once, in a new order), so
round i of A and round i of B met the same machine state: their ratio per round is the
paired sample, and its median's interval is what a claimed difference must clear. A
figure whose interval holds 1 is reported as "no difference detected at +-x%", x being
how far the interval reaches from 1 (what this run could have seen).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypedDict

BOOTSTRAP = 4000
SEED = 19


class Interval(TypedDict):
    median: float
    lo: float
    hi: float
    n: int


def _interval(median: float, boot: list[float], n: int) -> Interval:
    """``median`` with the 2.5th and 97.5th percentiles of its bootstrap replicates ``boot``."""
    boot.sort()
    return {"median": median, "lo": boot[int(0.025 * len(boot))], "hi": boot[int(0.975 * len(boot)) - 1], "n": n}


def median_interval(samples: Sequence[float], seed: int = SEED) -> Interval:
    """The median of ``samples`` with a 95% percentile-bootstrap interval (resampled with
    replacement, seeded so a rerun of the report prints the same interval)."""
    if not samples:
        raise ValueError("no samples to take a median of")
    rnd = random.Random(seed)
    xs = list(samples)
    return _interval(statistics.median(xs), [statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(BOOTSTRAP)],
                     len(xs))


def paired_ratio(a: Sequence[float], b: Sequence[float], seed: int = SEED) -> Interval:
    """Median of a[i] / b[i] over rounds with its interval: ``a`` and ``b`` are the same
    rounds of two systems (equal lengths, round i of each run back to back)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    return median_interval([x / y for x, y in zip(a, b, strict=True)], seed)


def unpaired_ratio(a: Sequence[float], b: Sequence[float], seed: int = SEED) -> Interval:
    """median(a) / median(b) with an interval from resampling each side on its own (for
    samples that were not taken in matched pairs)."""
    rnd = random.Random(seed)
    boot = [statistics.median(rnd.choices(list(a), k=len(a))) / statistics.median(rnd.choices(list(b), k=len(b)))
            for _ in range(BOOTSTRAP)]
    return _interval(statistics.median(a) / statistics.median(b), boot, min(len(a), len(b)))


def clustered_paired_ratio(groups: Sequence[tuple[Sequence[float], Sequence[float]]], seed: int = SEED) -> Interval:
    """Median of a[i] / b[i] over every pair of every group, with a 95% interval that
    resamples groups, then pairs within each drawn group: the pairs of one group (the
    requests of one round) share that round's machine state, so resampling them alone
    would make the interval too narrow; ``n`` counts the groups."""
    ratios = [[x / y for x, y in zip(a, b, strict=True)] for a, b in groups]
    ratios = [r for r in ratios if r]
    if not ratios:
        raise ValueError("no pairs to take a median of")
    rnd = random.Random(seed)
    boot = [statistics.median([x for g in rnd.choices(ratios, k=len(ratios)) for x in rnd.choices(g, k=len(g))])
            for _ in range(BOOTSTRAP)]
    return _interval(statistics.median([x for g in ratios for x in g]), boot, len(ratios))


def differs(iv: Interval, around: float = 1.0) -> bool:
    """Whether the interval excludes ``around`` (1 for a ratio, 0 for a difference)."""
    return iv["lo"] > around or iv["hi"] < around


def say(iv: Interval, unit: str = "x") -> str:
    """The figure as the docs may state it: a ratio with its interval when the interval
    excludes 1, else "no difference detected at +-x%"."""
    if differs(iv):
        return f"{iv['median']:.2f}{unit} ({iv['lo']:.2f}-{iv['hi']:.2f})"
    reach = max(1 - iv["lo"], iv["hi"] - 1)
    return f"no difference detected at +-{100 * reach:.0f}% ({iv['median']:.2f}{unit}, {iv['lo']:.2f}-{iv['hi']:.2f})"


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The nearest-rank ``q``-quantile (``q`` in [0, 1]: the smallest value with at least
    that share of the values at or below it); None when there are none."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def spread(samples: list[float]) -> dict[str, Any]:
    """Median, p90, p99 and the samples themselves in round order (what the paired
    comparisons pair on)."""
    return {"median": statistics.median(samples), "p90": percentile(samples, 0.9), "p99": percentile(samples, 0.99),
            "n": len(samples), "samples": list(samples)}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med(d: dict[str, Any], key: str) -> float:
    return float(d[key]["median"])
