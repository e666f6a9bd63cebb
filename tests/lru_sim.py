"""A trace-driven simulation of HiCache's inclusive LRU tiers, to hold plan.py's window model to.

Three token-weighted LRU caches (device, host, storage). Every insertion and every hit puts
or refreshes the entry in every tier, and each tier evicts its own least recently used
entries: inclusive write-through, as SGLang's HiCache with an L3 backend. A background stream
of unique entries arrives at a steady rate; returning users arrive as a Poisson process,
each inserts its own prefix, comes back once after a drawn gap and is recorded by the
highest tier holding its prefix, which is then reloaded (or recomputed) into every tier.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

TIERS = ("device", "host", "storage")


class LRU:
    """Token-weighted LRU; remembers how long evicted entries stayed after their last use."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[int, tuple[int, float]] = OrderedDict()  # key -> (tokens, last use)
        self.stays: list[float] = []
        self.placed = 0  # tokens put in while absent

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def put(self, key: int, tokens: int, now: float) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
        else:
            self.used += tokens
            self.placed += tokens
        self.entries[key] = (tokens, now)
        while self.used > self.capacity:
            _, (size, last) = self.entries.popitem(last=False)
            self.used -= size
            self.stays.append(now - last)


@dataclass(frozen=True)
class SimResult:
    shares: dict[str, float]  # device, host, storage, miss over measured returns
    returns: int
    insert_rate: float  # unique tokens/s inserted (background + users' first turns)
    placed_rates: dict[str, float]  # tokens/s newly put in each tier, reloads included
    windows_s: dict[str, float]  # median stay after last use of entries each tier evicted


def simulate(
    *,
    gpu_tokens: int,
    host_tokens: int,
    l3_tokens: int | None,
    background_rate: float,
    entry_tokens: int,
    user_rate: float,
    prefix_tokens: int,
    draw_gap: Callable[[random.Random], float],
    warmup_s: float,
    measure_s: float,
    seed: int,
) -> SimResult:
    """Run until every user who arrived in ``[warmup_s, warmup_s + measure_s)`` has returned.

    ``warmup_s`` should exceed the longest window so every tier is full before measuring.
    A gap past ``(largest capacity + entry_tokens) / background_rate`` is a miss without
    simulating it: the background alone has by then put more newer tokens than any tier holds.
    """
    rng = random.Random(seed)
    caches = [LRU(gpu_tokens), LRU(host_tokens)] + ([] if l3_tokens is None else [LRU(l3_tokens)])
    surely_gone = (max(c.capacity for c in caches) + entry_tokens) / background_rate
    end = warmup_s + measure_s
    counts = dict.fromkeys((*TIERS, "miss"), 0)
    unique = 0
    placed_at_start = [0] * len(caches)
    stays_from = [0] * len(caches)
    measuring = False
    ids = itertools.count()  # event order and entry keys
    # events: (time, order, kind, key, measured); kinds: background entry, user arrives, user returns
    events: list[tuple[float, int, str, int, bool]] = [
        (0.0, next(ids), "background", 0, False),
        (rng.expovariate(user_rate), next(ids), "arrive", 0, False),
    ]
    pending = 0  # measured returns still to come
    while events:
        now, _, kind, key, measured = heapq.heappop(events)
        if not measuring and now >= warmup_s:
            measuring = True
            placed_at_start = [c.placed for c in caches]
            stays_from = [len(c.stays) for c in caches]
        if kind == "return":
            tier = next((t for t, c in zip(TIERS, caches) if key in c), "miss")
            if measured:
                counts[tier] += 1
                pending -= 1
            for c in caches:
                c.put(key, prefix_tokens, now)
            continue
        if now >= end and pending == 0:
            break
        key = next(ids)
        size = entry_tokens if kind == "background" else prefix_tokens
        for c in caches:
            c.put(key, size, now)
        measured = warmup_s <= now < end
        unique += size * measured
        if kind == "background":
            heapq.heappush(events, (now + entry_tokens / background_rate, next(ids), kind, 0, False))
            continue
        heapq.heappush(events, (now + rng.expovariate(user_rate), next(ids), kind, 0, False))
        gap = draw_gap(rng)
        if gap >= surely_gone:
            counts["miss"] += measured
        else:
            heapq.heappush(events, (now + gap, next(ids), "return", key, measured))
            pending += measured
    returns = sum(counts.values())
    return SimResult(
        shares={t: n / returns for t, n in counts.items()},
        returns=returns,
        insert_rate=unique / measure_s,
        placed_rates={t: (c.placed - p) / (now - warmup_s) for t, c, p in zip(TIERS, caches, placed_at_start)},
        windows_s={
            t: statistics.median(c.stays[s:]) if len(c.stays) > s else math.inf
            for t, c, s in zip(TIERS, caches, stays_from)
        },
    )
