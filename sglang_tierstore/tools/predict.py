"""Residency before the run: which tier will serve returning users, from what a user knows.

:mod:`sglang_tierstore.tools.plan` needs the rate tokens enter the cache, which only a running
server shows, and assumes a steady state. This module starts from the workload itself:
arrival rate, turns per user, tokens per turn, system prompts and how many users share each,
think times, output length, pool sizes and the model's prefill and decode speed. It draws
that workload many times (arrivals and think times, seeded) and replays each draw through
HiCache's inclusive LRU tiers, so a short run that is not in steady state (users arrive,
then finish) is predicted as it will go. It reports what enters each tier (tokens computed,
reloaded from below, and touched ahead of an entry), the hot shared system prompts and the
KV of running requests it takes out of the pools, the windows that follow, and the share of
returning histories each tier serves, with the range one run may land in by chance.

Standard library only; run before any server exists::

    python -m sglang_tierstore.tools.predict --users 48 --arrival-rate 0.2 --turns 3 --first-tokens 512 \\
        --later-tokens 256 --output-tokens 32 --system-tokens 1024 --tenants 4 --think-median 30 \\
        --think-sigma 0.8 --prefill-ms-per-1k-tokens 1300 --decode-ms-per-token 100 --page-tokens 16 \\
        --gpu-tokens 8192 --host-tokens 16384 --l3-gb 8 --bytes-per-token 12288
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sglang_tierstore.tools.plan import TIERS, Gaps, GiB, LogNormalGaps, require

SHARES = (*TIERS, "miss")


def _count(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int)


@dataclass(frozen=True, slots=True)
class Workload:
    """What a user knows of the traffic before any server runs (multiturn_loadtest.py's terms).

    ``users`` conversations arrive as a Poisson process of ``arrival_rate`` per second; each
    resends its whole history every turn: its tenant's system prompt (``tenants`` of them, user
    ``i`` belongs to tenant ``i % tenants``), then per turn new text (``first_tokens``, then
    ``later_tokens``) and the reply (``output_tokens``). Between a reply and the next turn the
    user thinks for a draw of ``think``. A request takes ``prefill_s_per_token`` per token it
    computes plus ``decode_s_per_token`` per reply token; at most ``max_running`` run at once
    (SGLang's ``--max-running-requests``; 0: no limit), the others wait. ``backup_rate`` adds
    one-turn users of ``backup_tokens`` (and a reply) with nothing shared, until the last
    conversation turn is planned to be sent. The cache holds whole pages of ``page_tokens``
    (SGLang's ``--page-size``) of every token but a reply's last: a history's last partial
    page is computed again on every return.
    """

    users: int
    arrival_rate: float
    turns: int
    first_tokens: int
    later_tokens: int
    output_tokens: int
    system_tokens: int
    tenants: int
    think: Gaps
    prefill_s_per_token: float
    decode_s_per_token: float
    backup_rate: float = 0.0
    backup_tokens: int = 0
    page_tokens: int = 1
    max_running: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "turns", "tenants", "page_tokens"):
            v = getattr(self, name)
            require(_count(v) and v > 0, name, v, "a positive integer")
        for name in ("first_tokens", "later_tokens", "output_tokens", "system_tokens", "backup_tokens", "max_running"):
            v = getattr(self, name)
            require(_count(v) and v >= 0, name, v, "a non-negative integer")
        require(0 < self.arrival_rate < math.inf, "arrival_rate", self.arrival_rate, "a positive number of users/s")
        for name in ("prefill_s_per_token", "decode_s_per_token", "backup_rate"):
            v = getattr(self, name)
            require(0 <= v < math.inf, name, v, "a non-negative finite number")


@dataclass(frozen=True, slots=True)
class Prediction:
    """What :func:`predict` expects a run of a :class:`Workload` to measure.

    ``shares``: token-weighted, over the returning turns' own histories (the tenant's system
    prompt left out), as loadtest_tiers.py measures them; ``share_ranges``: where the middle
    95% of single draws' shares lie, how far one run may land from the mean by chance.
    ``rates`` (tokens/s over the busy period, the 10th to 90th percentile of the returns' send
    times, as loadtest_tiers.py takes it): ``computed`` (new text, replies and recomputed
    misses), ``placed_<tier>`` (computed plus what is reloaded into that tier from below) and
    ``touched`` (what moves ahead of an entry in LRU order: new tokens and the whole histories
    of returning users). ``windows_s``: each tier's capacity for histories (less the hot
    system prompts, and on the device the KV in flight) over ``touched``.
    ``in_flight_tokens``: mean KV of other running requests when a user returns.
    """

    shares: dict[str, float]
    share_ranges: dict[str, tuple[float, float]]
    rates: dict[str, float]
    windows_s: dict[str, float]
    hot_shared_tokens: float
    in_flight_tokens: float
    returns: int
    inputs: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: an unbounded window becomes ``"inf"``."""
        return {
            "shares": dict(self.shares),
            "share_ranges": {k: list(v) for k, v in self.share_ranges.items()},
            "rates": dict(self.rates),
            "windows_s": {k: "inf" if v == math.inf else v for k, v in self.windows_s.items()},
            "hot_shared_tokens": self.hot_shared_tokens,
            "in_flight_tokens": self.in_flight_tokens,
            "returns": self.returns,
            "inputs": dict(self.inputs),
        }


class _Recency:
    """Tokens per entry in LRU order, as a Fenwick tree over touch numbers: what lies ahead
    of an entry is the sum over the touches after its own, in O(log n)."""

    def __init__(self, touches: int) -> None:
        self._tree = [0] * (touches + 1)
        self._next = 0
        self._at: dict[int, tuple[int, int]] = {}  # entry -> (its touch number, tokens)
        self.total = 0

    def _add(self, i: int, v: int) -> None:
        i += 1
        while i < len(self._tree):
            self._tree[i] += v
            i += i & -i

    def touch(self, key: int, tokens: int) -> None:
        """Make ``key`` the most recent entry, ``tokens`` long."""
        old = self._at.get(key)
        if old is not None:
            self._add(old[0], -old[1])
            self.total -= old[1]
        self._add(self._next, tokens)
        self._at[key] = (self._next, tokens)
        self._next += 1
        self.total += tokens

    def ahead(self, key: int) -> int:
        """Tokens of the entries touched since ``key`` was."""
        i, s = self._at[key][0] + 1, 0
        while i > 0:
            s += self._tree[i]
            i -= i & -i
        return self.total - s


@dataclass(frozen=True, slots=True)
class Schedule:
    """When each user's turns are sent, and when each one-turn user arrives: one draw of a
    :class:`Workload`, or what a run measured.

    ``arrivals[i]`` is user i's first turn. A later turn is sent ``thinks[i][k]`` after the
    reply before it ends (a draw), or at ``sends[i][k]`` (a measurement: the model's reply
    then only decides whether the turn waits for it).
    """

    arrivals: tuple[float, ...]
    thinks: tuple[tuple[float, ...], ...]
    backups: tuple[float, ...] = ()
    sends: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        later = [*(t for ts in self.thinks for t in ts), *(t for ts in self.sends or () for t in ts)]
        for name, xs in (("arrivals", self.arrivals), ("thinks", later), ("backups", self.backups)):
            bad = next((x for x in xs if not 0 <= x < math.inf), None)  # also NaN
            require(bad is None, f"schedule.{name}", bad, "non-negative finite seconds")

    @staticmethod
    def draw(w: Workload, rng: random.Random) -> Schedule:
        """Poisson arrivals from 0, think times from ``w.think``; one-turn users until the
        last conversation turn is planned to be sent (arrival plus think times), as
        multiturn_loadtest.py draws them."""
        arrivals, t = [0.0], 0.0
        for _ in range(w.users - 1):
            t += rng.expovariate(w.arrival_rate)
            arrivals.append(t)
        thinks = tuple(tuple(w.think.quantile(rng.random()) for _ in range(w.turns - 1)) for _ in range(w.users))
        horizon = max(a + sum(ts) for a, ts in zip(arrivals, thinks))
        backups, t = [], 0.0
        while w.backup_rate:
            t += rng.expovariate(w.backup_rate)
            if t > horizon:
                break
            backups.append(t)
        return Schedule(tuple(arrivals), thinks, tuple(backups))


def _replay(w: Workload, caps: Mapping[str, float], hot: int, plan: Schedule) -> list[dict[str, float]]:
    """One schedule of the workload through the tiers: a row per request (send time, tokens
    computed and touched, reloaded from host and from storage) and, for a return, what each
    tier served of the user's own history and the KV then in flight.

    Every tier keeps the same LRU order (HiCache refreshes a node in every tier that holds
    it, and inclusive write-through puts every computed page in all of them), so what lies
    ahead of a history is the same everywhere and each tier serves the part of it that fits
    under its capacity, oldest pages first. A history is touched when its turn is admitted
    and again, grown by the turn's text and reply, when the reply ends; the device's capacity
    also leaves out the KV of the requests running at that moment. At most ``w.max_running``
    requests run at once; the others wait in order of sending. The cache holds KV of every
    token but a reply's last (never fed back), in whole pages.
    """
    first = [(t, uid) for uid, t in enumerate(plan.arrivals)] + [(t, w.users + i) for i, t in enumerate(plan.backups)]
    starts = list(first)  # (send time, user) of each user's next turn
    heapq.heapify(starts)
    lru = _Recency(2 * len(first) * w.turns)
    turn = [0] * len(first)
    own = [0] * len(first)
    ends: list[tuple[float, int, int]] = []  # (time, user, tokens its history grows by)
    waiting: deque[tuple[float, int]] = deque()
    running = in_flight = 0
    held: dict[int, int] = {}  # running user -> the KV its request holds
    rows: list[dict[str, float]] = []

    def admit(now: float, sent: float, uid: int) -> None:
        nonlocal running, in_flight
        backup = uid >= w.users
        text = w.backup_tokens if backup else w.first_tokens if turn[uid] == 0 else w.later_tokens
        reply = w.output_tokens
        row = {"start_s": sent, "host": 0.0, "storage": 0.0, "touched": float(own[uid] + text + reply)}
        miss = 0.0
        if turn[uid]:
            ahead = lru.ahead(uid)
            cap = {"device": caps["device"] - hot - in_flight, "host": caps["host"] - hot, "storage": caps["storage"]}
            kept = w.system_tokens + own[uid] - (1 if reply else 0)
            whole = max(0, kept // w.page_tokens * w.page_tokens - w.system_tokens)
            got = 0.0
            for tier in TIERS:
                reach = max(got, min(whole, max(0.0, cap[tier] - ahead)))
                row[tier] = reach - got
                got = reach
            miss = own[uid] - got
            row.update(own=float(own[uid]), miss=miss, in_flight=float(in_flight))
            lru.touch(uid, own[uid])
        row["computed"] = text + reply + miss
        rows.append(row)
        running += 1
        held[uid] = int(text + reply + miss)
        in_flight += held[uid]
        e2e = (text + miss) * w.prefill_s_per_token + reply * w.decode_s_per_token
        heapq.heappush(ends, (now + e2e, uid, text + reply))

    while starts or ends:
        if ends and (not starts or ends[0][0] <= starts[0][0]):
            now, uid, new = heapq.heappop(ends)
            running -= 1
            in_flight -= held.pop(uid)
            own[uid] += new
            lru.touch(uid, own[uid])
            turn[uid] += 1
            if uid < w.users and turn[uid] < w.turns:
                k = turn[uid] - 1
                at = max(now, plan.sends[uid][k]) if plan.sends else now + plan.thinks[uid][k]
                heapq.heappush(starts, (at, uid))
            if waiting:
                admit(now, *waiting.popleft())
            continue
        now, uid = heapq.heappop(starts)
        if w.max_running and running >= w.max_running:
            waiting.append((now, uid))
            continue
        admit(now, now, uid)
    return rows


def _pools(gpu_tokens: float, host_tokens: float, l3_tokens: float | None) -> dict[str, float]:
    require(0 <= gpu_tokens < math.inf, "gpu_tokens", gpu_tokens, "a non-negative number of tokens")
    require(0 <= host_tokens < math.inf, "host_tokens", host_tokens, "a non-negative number of tokens")
    require(l3_tokens is None or l3_tokens >= 0, "l3_tokens", l3_tokens, "None or a non-negative number of tokens")
    return {"device": gpu_tokens, "host": host_tokens, "storage": 0.0 if l3_tokens is None else l3_tokens}


def _shares(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    own = sum(r["own"] for r in rows)
    return {k: sum(r[k] for r in rows) / own if own else 0.0 for k in SHARES}


def _returning(w: Workload) -> None:
    require(w.turns > 1, "turns", w.turns, "more than one turn per user (nothing returns)")
    require(w.first_tokens + w.output_tokens > 0, "first_tokens", w.first_tokens,
           "a first turn that leaves a history (text or reply tokens)")


def replay(w: Workload, schedule: Schedule, *, gpu_tokens: float, host_tokens: float,
           l3_tokens: float | None) -> dict[str, float]:
    """The shares one schedule gives (what a run measured of arrivals and send times, say):
    what :func:`predict` would say of that run had it known its draw."""
    _returning(w)
    require(len(schedule.arrivals) == w.users, "schedule.arrivals", len(schedule.arrivals), f"{w.users} users")
    name, later = ("schedule.thinks", schedule.thinks) if schedule.sends is None else ("schedule.sends", schedule.sends)
    require(len(later) == w.users and all(len(t) >= w.turns - 1 for t in later), name, len(later),
           f"{w.users} users of {w.turns - 1} later turns each")
    rows = _replay(w, _pools(gpu_tokens, host_tokens, l3_tokens), min(w.tenants, w.users) * w.system_tokens, schedule)
    return _shares([r for r in rows if "own" in r])


def _middle95(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (0.0, 0.0)
    q = statistics.quantiles(xs, n=40, method="inclusive")
    return q[0], q[-1]


def predict(
    w: Workload, *, gpu_tokens: float, host_tokens: float, l3_tokens: float | None, draws: int = 64, seed: int = 0,
) -> Prediction:
    """Shares each tier serves of returning histories, from the workload and the pools' sizes
    alone (tokens; ``l3_tokens=None``: no L3), over ``draws`` seeded draws of the workload.

    The tenants' system prompts are hot (every user of a tenant touches theirs): they take
    their tokens from the device's and the host's capacity and are left out of the shares.
    """
    caps = _pools(gpu_tokens, host_tokens, l3_tokens)
    require(_count(draws) and draws > 0, "draws", draws, "a positive integer")
    _returning(w)
    hot = min(w.tenants, w.users) * w.system_tokens
    served = dict.fromkeys((*SHARES, "own"), 0.0)
    busy = dict.fromkeys(("computed", "host", "storage", "touched", "span"), 0.0)
    in_flight, returns = 0.0, 0
    per_draw: list[dict[str, float]] = []
    for d in range(draws):
        rows = _replay(w, caps, hot, Schedule.draw(w, random.Random(f"{seed}/{d}")))
        ret = [r for r in rows if "own" in r]
        for k in served:
            served[k] += sum(r[k] for r in ret)
        per_draw.append(_shares(ret))
        in_flight += sum(r["in_flight"] for r in ret)
        returns += len(ret)
        times = sorted(r["start_s"] for r in ret)
        lo, hi = times[len(times) // 10], times[len(times) * 9 // 10]
        if hi <= lo:  # too few returns for a busy period: the whole replay
            lo, hi = min(r["start_s"] for r in rows), max(r["start_s"] for r in rows)
        busy["span"] += hi - lo
        for r in rows:
            if lo <= r["start_s"] <= hi:
                for k in ("computed", "host", "storage", "touched"):
                    busy[k] += r[k]
    shares = {k: served[k] / served["own"] if served["own"] else 0.0 for k in SHARES}
    ranges = {k: _middle95(sorted(d[k] for d in per_draw)) for k in SHARES}
    span = busy["span"]
    rates = {k: (v / span if span > 0 else 0.0) for k, v in (
        ("computed", busy["computed"]), ("placed_device", busy["computed"] + busy["host"] + busy["storage"]),
        ("placed_host", busy["computed"] + busy["storage"]), ("placed_storage", busy["computed"]),
        ("touched", busy["touched"]))}
    mean_in_flight = in_flight / returns
    usable = {"device": max(0.0, gpu_tokens - hot - mean_in_flight), "host": max(0.0, host_tokens - hot),
              "storage": caps["storage"]}
    windows = {t: usable[t] / rates["touched"] if rates["touched"] > 0 else math.inf for t in TIERS}
    inputs = {f.name: float(getattr(w, f.name)) for f in fields(w) if f.name != "think"}
    inputs.update(think_median_s=w.think.quantile(0.5), gpu_tokens=gpu_tokens, host_tokens=host_tokens,
                  draws=float(draws))
    if l3_tokens is not None:
        inputs["l3_tokens"] = l3_tokens
    return Prediction(shares=shares, share_ranges=ranges, rates=rates, windows_s=windows, hot_shared_tokens=float(hot),
                      in_flight_tokens=mean_in_flight, returns=returns, inputs=inputs)


def render(p: Prediction) -> str:
    """The readable table the CLI prints."""
    has_l3 = "l3_tokens" in p.inputs
    lines = [f"{'tier':<8} {'window':>12} {'share':>8} {'one run, 95%':>14}"]
    for t in SHARES:
        w = p.windows_s.get(t)
        window = "" if w is None else "no L3" if t == "storage" and not has_l3 else (
            "unbounded" if w == math.inf else f"{w:,.1f} s")
        lo, hi = p.share_ranges[t]
        lines.append(f"{t:<8} {window:>12} {p.shares[t]:>8.1%} {f'{lo:.0%}-{hi:.0%}':>14}")
    r = p.rates
    lines.append(f"tokens/s: computed {r['computed']:,.0f}, placed device {r['placed_device']:,.0f} / host "
                 f"{r['placed_host']:,.0f} / storage {r['placed_storage']:,.0f}, touched {r['touched']:,.0f}")
    lines.append(f"hot shared system prompts {p.hot_shared_tokens:,.0f} tokens; in flight {p.in_flight_tokens:,.0f} "
                 f"tokens; {p.returns} returns over {p.inputs['draws']:.0f} draws")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_tierstore.tools.predict",
                                description="Predict which HiCache tier serves returning users, before the run.")
    w = p.add_argument_group("workload")
    for name, kind, what in (
        ("users", int, "conversations"), ("arrival-rate", float, "new users per second (Poisson)"),
        ("turns", int, "turns per user"), ("first-tokens", int, "new text in the first turn, tokens"),
        ("later-tokens", int, "new text in every later turn, tokens"), ("output-tokens", int, "reply per turn, tokens"),
        ("system-tokens", int, "each tenant's shared system prompt, tokens"),
        ("tenants", int, "system prompts, each shared by the users of one tenant"),
        ("think-median", float, "lognormal think time between a reply and the next turn: median seconds"),
        ("think-sigma", float, "lognormal think time: sigma of log(seconds)"),
        ("prefill-ms-per-1k-tokens", float, "prefill time per 1000 tokens computed"),
        ("decode-ms-per-token", float, "decode time per output token"),
    ):
        w.add_argument(f"--{name}", type=kind, required=True, help=what)
    w.add_argument("--backup-rate", type=float, default=0.0, help="one-turn users per second with nothing shared")
    w.add_argument("--backup-tokens", type=int, default=0, help="tokens of a one-turn user's prompt")
    w.add_argument("--page-tokens", type=int, default=1, help="SGLang --page-size")
    w.add_argument("--max-running", type=int, default=0, help="SGLang --max-running-requests (default 0: no limit)")
    c = p.add_argument_group("pools")
    c.add_argument("--gpu-tokens", type=float, required=True, help="device KV pool, tokens")
    c.add_argument("--host-tokens", type=float, required=True, help="host KV pool, tokens")
    c.add_argument("--l3-gb", type=float, help="L3 capacity, GiB (tierstore capacity_gb); omit for no L3")
    c.add_argument("--bytes-per-token", type=int, help="KV bytes per token, all layers (needed with --l3-gb)")
    p.add_argument("--draws", type=int, default=64, help="draws of the workload to average (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.l3_gb is not None and not a.bytes_per_token:
        p.error("--l3-gb needs --bytes-per-token")
    try:
        w = Workload(
            users=a.users, arrival_rate=a.arrival_rate, turns=a.turns, first_tokens=a.first_tokens,
            later_tokens=a.later_tokens, output_tokens=a.output_tokens, system_tokens=a.system_tokens,
            tenants=a.tenants, think=LogNormalGaps(a.think_median, a.think_sigma),
            prefill_s_per_token=a.prefill_ms_per_1k_tokens / 1e6, decode_s_per_token=a.decode_ms_per_token / 1e3,
            backup_rate=a.backup_rate, backup_tokens=a.backup_tokens, page_tokens=a.page_tokens,
            max_running=a.max_running,
        )
        result = predict(w, gpu_tokens=a.gpu_tokens, host_tokens=a.host_tokens,
                         l3_tokens=None if a.l3_gb is None else a.l3_gb * GiB / a.bytes_per_token,
                         draws=a.draws, seed=a.seed)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result.to_json(), indent=2) if a.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
