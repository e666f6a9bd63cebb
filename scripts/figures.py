#!/usr/bin/env python3
"""The figures the README and docs quote, computed from the committed results.

    python3 scripts/figures.py --write     # rewrite every marked figure in README.md and docs/
    python3 scripts/figures.py --check     # exit 1 naming each figure that differs (tests/test_figures.py)
    python3 scripts/figures.py --list      # every figure and its value

In the Markdown a figure is ``<!--f:NAME-->value<!--/f-->`` (a cell, a phrase or a whole
table; the comments do not render): ``--write`` puts each NAME's value from its result file
there, so a figure is never typed by hand and a rerun of ``reproduce.py`` carries into the
docs. A NAME this file does not know, or a result file that is missing, is an error.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from functools import cache, wraps
from pathlib import Path
from typing import Any, TypeVar

from tierstore_kit import jobs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARK = re.compile(r"<!--f:([\w.+-]+)-->(.*?)<!--/f-->", re.S)
SIZES = {"256K": "256 KiB", "1M": "1 MiB", "2M": "2 MiB", "8M": "8 MiB"}


_read: set[str] = set()  # the jobs whose results the figure being computed has read (:func:`jobs_of`)
F = TypeVar("F", bound=Callable[..., Any])


def memo(fn: F) -> F:
    """``functools.cache`` that also replays, on a cached answer, which jobs' results the
    first call read, so that every figure built on it names them (:func:`jobs_of`)."""
    done: dict[tuple[Any, ...], tuple[Any, set[str]]] = {}

    @wraps(fn)
    def inner(*args: Any) -> Any:
        if args not in done:
            outer = set(_read)
            _read.clear()
            try:
                done[args] = (fn(*args), set(_read))
            finally:
                _read.update(outer)
        value, read = done[args]
        _read.update(read)
        return value

    return inner  # type: ignore[return-value]


def result(rel: str) -> Path:
    """The committed result file ``rel`` (under scripts/results/), counted as read by its job."""
    path = RESULTS / rel
    if not path.exists():
        raise SystemExit(f"figures: {path.relative_to(ROOT)} is missing (run scripts/reproduce.py)")
    _read.add(rel.split("/", 1)[0])
    return path


def load(rel: str) -> Any:
    return _parsed(result(rel))


@cache
def _parsed(path: Path) -> Any:
    return json.loads(path.read_text())


def x(v: float) -> str:
    return f"{v:.2f}x"


def iv(i: Mapping[str, float]) -> str:
    """A ratio with its 95% interval."""
    return f"{i['median']:.2f}x ({i['lo']:.2f}-{i['hi']:.2f})"


def n(v: float) -> str:
    return f"{v:,.0f}"


def io_hicache_write_swing() -> str:
    """How far HiCacheFile's write rate moved between rounds: the largest ratio of its
    fastest round to its slowest at one page size (it writes through the page cache)."""
    swings = [max(r["hicache"]["write_gbps"]["samples"]) / min(r["hicache"]["write_gbps"]["samples"])
              for r in load("bench_io/bench_io.json")["sizes"].values()]
    return f"{max(swings):.0f}x"


def io_range(fig: str) -> Callable[[], str]:
    """The medians of one bench_io ratio over the page sizes, as ``lo-hi x``."""
    def value() -> str:
        meds = [r["ratios"][fig]["median"] for r in load("bench_io/bench_io.json")["sizes"].values() if fig in r["ratios"]]
        return f"{min(meds):.2f}-{max(meds):.2f}x"
    return value


def io_table() -> str:
    """performance.md's main table: every paired ratio of bench_io at each page size."""
    sizes = load("bench_io/bench_io.json")["sizes"]
    figs = list(next(iter(sizes.values()))["ratios"])
    rows = ["| figure (median of per-round ratios, 95% interval) | " + " | ".join(SIZES[s] for s in sizes) + " |",
            "|---|" + "---|" * len(sizes)]
    for fig in figs:
        cells = [iv(r["ratios"][fig]) if fig in r["ratios"] else "(same code)" for r in sizes.values()]
        rows.append(f"| {fig} | " + " | ".join(cells) + " |")
    return "\n" + "\n".join(rows) + "\n"


IO_TARGETS = (  # (figure, sizes it applies to, least median)
    ("cold read / O_DIRECT read", ("1M", "2M", "8M"), 0.9),
    ("write / O_DIRECT write", ("1M", "2M", "8M"), 0.9),
    ("write / O_DIRECT write", ("256K",), 0.85),
    ("eviction (steady / same footprint never evicting): write", ("256K", "1M", "2M", "8M"), 0.95),
    ("eviction (steady / same footprint never evicting): cold read", ("256K", "1M", "2M", "8M"), 0.95),
)


def io_targets() -> str:
    """Which of bench_io's targets the committed run met, and by how much each missed one."""
    sizes = load("bench_io/bench_io.json")["sizes"]
    missed = [f"{fig} at {SIZES[sz]}: {iv(sizes[sz]['ratios'][fig])} against at least {least}"
              for fig, where, least in IO_TARGETS for sz in where
              if sz in sizes and sizes[sz]["ratios"][fig]["median"] < least]
    return "every one met" if not missed else "missed: " + "; ".join(missed)


def probe(case: str) -> Callable[[], str]:
    return lambda: iv(load("bench_io/bench_io.json")["probe"]["ratios"][case])


def probe_target() -> str:
    """bench_io's probe against its target: at most 1.3 times one MGET of as many keys."""
    return within(load("bench_io/bench_io.json")["probe"]["ratios"]["probe_all_hit"], 1.3, "x", "the probe")


def python_us(op: str) -> Callable[[], str]:
    return lambda: f"{load('bench_io/bench_io.json')['probe'][f'python_us_per_page_{op}_4k']['median']:.1f} us"


def mixed_table() -> str:
    """tierstore / O_DIRECT under the mixed read/write load, per page size."""
    sizes = load("bench_mixed/bench_mixed.json")["sizes"]
    rows = ["| page size | read under writes, p50 | read idle, p50 | write alone | write under reads |", "|---|---|---|---|---|"]
    for s, r in sizes.items():
        i = r["intervals"]
        rows.append(f"| {SIZES[s]} | {iv(i['read_mixed_ms'])} | {iv(i['read_idle_ms'])} | {iv(i['write_alone_gbps'])} | "
                    f"{iv(i['write_mixed_gbps'])} |")
    return "\n" + "\n".join(rows) + "\n"


def staging_table() -> str:
    """Staged over direct read throughput per page size and store, paired per round (the
    same batch read both ways in turn), with the copy alone."""
    from tierstore_kit.stats import paired_ratio, say

    rows = ["| page size | copy alone, us per page | store | staged / direct, cold | staged / direct, warm |",
            "|---|---|---|---|---|"]
    for size, r in load("bench_staging/bench_staging.json")["sizes"].items():
        for store in ("O_DIRECT", "buffered"):
            s, d = r[store]["staged"], r[store]["direct"]
            cells = [say(paired_ratio(s[k]["samples"], d[k]["samples"])) for k in ("read_cold_gbps", "read_warm_gbps")]
            rows.append(f"| {SIZES[size]} | {r['copy_us_per_page']['median']:.0f} | {store} | {' | '.join(cells)} |")
    return "\n" + "\n".join(rows) + "\n"


def tags_table() -> str:
    rows = ["| page | pages | make, us | share of the write batch | check, us | share of the read batch |",
            "|---|---|---|---|---|---|"]
    for r in load("bench_tags/bench_tags.json")["rows"]:
        rows.append(f"| {r['page_bytes'] >> 10} KiB | {r['pages']:,} | {r['make_s'] * 1e6:.0f} | {r['write_share']:.1%} | "
                    f"{r['check_s'] * 1e6:.0f} | {r['read_share']:.1%} |")
    return "\n" + "\n".join(rows) + "\n"


def tag_ns(way: str) -> Callable[[], str]:
    return lambda: f"{load('bench_tags/bench_tags.json')['seconds_per_tag'][way] * 1e9:,.0f} ns"


def memory_per_page() -> str:
    return f"{load('index_memory/index_memory.json')['bytes_per_page']:.0f} bytes"


def memory_per_tb(size: str) -> Callable[[], str]:
    return lambda: f"{load('index_memory/index_memory.json')['index_bytes_per_tb_of_pages'][size] / 2**30:.2f} GiB"


def check_max() -> str:
    m = load("check_cost/check_cost.json")["medians"]["engine"]
    return f"{m['max_us'] / 1e3:.1f} ms"


def stress(path: str) -> Callable[[], str]:
    def value() -> str:
        v: Any = load("stress/stress.json")
        for k in path.split("."):
            v = v[k]
        return n(v) if isinstance(v, (int, float)) else str(v)
    return value


def stress_store_back() -> str:
    """How long after the restarted embedded Redis served the stress run's store answered again."""
    r = load("stress/stress.json")["redis_restarts"]["store_back_s"]
    return f"{r['median']} s (median, max {r['max']} s)"


def stress_no_slot() -> str:
    s = load("stress/stress.json")
    return f"{100 * (s['no_slot_share_once_warm'] or 0):.2f}%"


def stress_minutes() -> str:
    return f"{load('stress/stress.json')['seconds'] / 60:.0f}-minute"


def drill(server: str, what: str) -> Callable[[], str]:
    def value() -> str:
        d = next(d for d in load("bench_index/bench_index.json")["drills"] if d["server"] == server)
        if what == "hits_back":
            return f"{d['hits_back_s']:.2f} s"
        if what == "surviving":
            return f"{100 * d['surviving_shards_hit_rate']:.0f}%"
        return f"{d['pages_lost']} of {d['pages']}"
    return value


def paired_run(server: str, what: str) -> dict[str, Any]:
    """The paired one-node-against-cluster comparison of ``server`` for ``what`` ("probe", "commit")."""
    return next(p for p in load("bench_index/bench_index.json")["paired"] if p["server"] == server)[what]


def paired_cluster(server: str, what: str) -> Callable[[], str]:
    def value() -> str:
        p = paired_run(server, what)
        return f"{p['ratio']:.2f}x ({p['ratio_ci95'][0]:.2f}-{p['ratio_ci95'][1]:.2f})"
    return value


def paired_vs_4_per_master(server: str, what: str, of: str) -> Callable[[], str]:
    """One shard per master against 4, in the same paired run: the cluster's wall p50
    (``of="wall"``) or its client thread's CPU (``of="cpu"``), ratio with its 95% interval."""
    def value() -> str:
        p = paired_run(server, what)
        key = "vs_4_per_master" if of == "wall" else "client_cpu_vs_4_per_master"
        return f"{p[key]:.2f}x ({p[key + '_ci95'][0]:.2f}-{p[key + '_ci95'][1]:.2f})"
    return value


def relayed(server: str, what: str, key: str) -> Callable[[], str]:
    """Behind the relays that hold each reply a fixed delay: the cluster against one node
    (``key="ratio"``) or against 4 shards per master (``"vs_4_per_master"``), with its interval."""
    def value() -> str:
        q = next(p for p in load("bench_index/bench_index.json")["paired"] if p["server"] == server)["relayed"][what]
        return f"{q[key]:.2f}x ({q[key + '_ci95'][0]:.2f}-{q[key + '_ci95'][1]:.2f})"
    return value


def relay_delay() -> str:
    return f"{load('bench_index/bench_index.json')['paired'][0]['relayed']['delay_ms']:g} ms"


def paired_cpu(server: str, what: str, side: str) -> Callable[[], str]:
    """Where the paired comparison's time went: the client thread's CPU per call (p50,
    ``client one node`` or ``client cluster``) or the servers' per call (``one node server``,
    ``cluster masters``, ``cluster replicas``), in ms."""
    def value() -> str:
        p = paired_run(server, what)
        v = p["client_cpu_ms_p50"][side.removeprefix("client ")] if side.startswith("client ") else \
            p["servers_cpu_ms_per_call"][side]
        return f"{v:.2f} ms"
    return value


def paired_client_ratio(server: str, what: str) -> Callable[[], str]:
    """How many times the one node's client CPU per call the cluster's client spent (p50s)."""
    def value() -> str:
        cpu = paired_run(server, what)["client_cpu_ms_p50"]
        return f"{cpu['cluster'] / cpu['one node']:.1f}x"
    return value


def paired_budget(server: str, cores: int = 2, target: float = 1.5) -> Callable[[], str]:
    """The CPU a cluster write batch took (client thread, masters, replicas) against what
    ``cores`` cores supply within ``target`` times the one node's COMMIT p50: whether the
    target is out of the machine's reach, as the docs say."""
    def value() -> str:
        p = paired_run(server, "commit")
        need = p["client_cpu_ms_p50"]["cluster"] + p["servers_cpu_ms_per_call"]["cluster masters"] + \
            p["servers_cpu_ms_per_call"]["cluster replicas"]
        supply = cores * target * p["one_node_p50"]
        digits = 1 if f"{need:.1f}" != f"{supply:.1f}" else 2  # two figures that round alike would read as equal
        return f"{need:.{digits}f} ms of CPU, {'more' if need > supply else 'less'} than the {supply:.{digits}f} ms"
    return value


LOADTEST_RUNS = (("no-hicache", "no HiCache"), ("l2", "HiCache L2 only"), ("l2+file", "L2 + SGLang `file` backend"),
                 ("l2+tierstore", "L2 + tierstore"))


@memo
def loadtest_rounds() -> range:
    """The four-configuration load test's interleaved rounds (run ``<config>@r<k>``)."""
    return range(1, int(load("loadtest/rounds.json")["rounds"]) + 1)


@memo
def loadtest_pooled(config: str) -> dict[str, Any]:
    """One configuration's returning turns, every round's requests pooled: TTFT quantiles
    and the token-weighted share of the resent prefix each tier served, as the load test
    summarizes a run (``tierstore_kit.multiturn.summarize``)."""
    from tierstore_kit.multiturn import summarize

    rows = [json.loads(ln) for k in loadtest_rounds()
            for ln in result(f"loadtest/{config}@r{k}.jsonl").read_text().splitlines() if ln.strip()]
    return dict(summarize([r for r in rows if "user" in r], [])["returning"])


def loadtest(run: str, what: str) -> Callable[[], str]:
    """From the four-configuration load test: a returning turn's TTFT quantile ("p50", "p90"), rounds pooled."""
    return lambda: f"{1e3 * loadtest_pooled(run)[f'ttft_{what}_s']:,.0f} ms"


def loadtest_table() -> str:
    """Returning turns of the four-configuration load test, rounds pooled: TTFT and the share each tier served."""
    rows = ["| configuration | TTFT p50 | TTFT p90 | device | host | storage | recomputed |", "|---|---|---|---|---|---|---|"]
    for run, label in LOADTEST_RUNS:
        r = loadtest_pooled(run)
        rows.append(f"| {label} | {1e3 * r['ttft_p50_s']:,.0f} ms | {1e3 * r['ttft_p90_s']:,.0f} ms | {r['device_share']:.0%} | "
                    f"{r['host_share']:.0%} | {r['storage_share']:.0%} | {r['recomputed_share']:.0%} |")
    return "\n" + "\n".join(rows) + "\n"


def loadtest_planner(config: str) -> dict[str, dict[str, float]]:
    """The planner's shares of a returning user's own history (whole-run rates, ``raw``; hot
    prefixes and busy period taken out, ``effective``) and the measured ones, each the mean
    over the rounds."""
    runs = [load("loadtest/planner.json")[f"{config}@r{k}"] for k in loadtest_rounds()]
    parts = {"raw": [r["raw"]["shares"] for r in runs], "effective": [r["effective"]["shares"] for r in runs],
             "measured": [r["measured_own_shares"] for r in runs]}
    return {name: {t: sum(d[t] for d in ds) / len(ds) for t in ds[0]} for name, ds in parts.items()}


def planner_table() -> str:
    """What the planner predicted for a returning user's own history against what was measured (means over the rounds)."""
    rows = ["| configuration | planner, rates over the whole run | planner, hot prefixes and busy period taken out | measured |",
            "|---|---|---|---|"]
    for run, label in LOADTEST_RUNS[1:]:
        p = loadtest_planner(run)

        def shares(d: dict[str, float]) -> str:
            return " / ".join(f"{d[t]:.0%}" for t in ("device", "host", "storage"))

        rows.append(f"| {label} | {shares(p['raw'])} | {shares(p['effective'])} | {shares(p['measured'])} |")
    return "\n" + "\n".join(rows) + "\n"


def validation_table() -> str:
    """loadtest.md's planner validation: per run and tier, predicted (95% of draws), on the
    run's own draw, and measured."""
    runs = load("planner/validation.json")["runs"]
    tiers = ("device", "host", "storage", "miss")
    rows = ["| run (think median, device pool) | " + " | ".join(tiers) + " |", "|---|" + "---|" * len(tiers)]
    for name, r in runs.items():
        w = r["workload"]
        cells = []
        for t in tiers:
            v = r["tiers"][t]
            lo, hi = v["range95"]
            cells.append(f"{v['predicted']:.0%} ({lo:.0%}-{hi:.0%}) / {v['on_its_schedule']:.0%} / {v['measured']:.0%}")
        rows.append(f"| {name} ({w['think-time-median']:g} s, {w['max-total-tokens']:,} tokens) | " + " | ".join(cells) + " |")
    return "\n" + "\n".join(rows) + "\n"


# validation_count's keys: (which tier shares it counts among, which of those it counts)
VALIDATION_COUNTS: dict[str, tuple[Callable[[dict[str, Any]], bool], Callable[[dict[str, Any]], bool]]] = {
    "within": (lambda v: True, lambda v: v["within"]),
    "explained": (lambda v: not v["within"], lambda v: v["explained"]),
    "outside": (lambda v: True, lambda v: not v["in_range"]),
    "outside.explained": (lambda v: not v["in_range"], lambda v: v["explained"]),
}


def validation_count(key: str) -> Callable[[], str]:
    """"n of m" over the validation's tier shares: within 10 points of the measured one
    (``within``); measured outside the range 95% of the model's draws land in (``outside``);
    and, of the shares beyond 10 points or outside that range, those within 10 points on the
    run's own draw (``explained``, ``outside.explained``)."""
    among, counted = VALIDATION_COUNTS[key]

    def value() -> str:
        cells = [v for r in load("planner/validation.json")["runs"].values() for v in r["tiers"].values() if among(v)]
        return f"{sum(1 for v in cells if counted(v))} of {len(cells)}"
    return value


def calibration(key: str) -> Callable[[], str]:
    """From the load test's calibration (its first round): a TTFT (ms) or a ratio of them."""
    def value() -> str:
        v = load("loadtest/calibration@r1.json")[key]
        return x(v) if "over" in key else f"{1e3 * v:,.0f} ms"
    return value


def prefix_tokens() -> str:
    """The returning prefix the load test's calibration timed (its first round)."""
    return f"{load('loadtest/calibration@r1.json')['prefix_tokens']:,}-token"


def speedup(base: str, q: str) -> Callable[[], str]:
    """How many times sooner L2 + tierstore's returning turns got their first token than
    ``base``'s: the ratio of the two quantiles, rounds pooled."""
    def value() -> str:
        def t(run: str) -> float:
            return float(loadtest_pooled(run)[f"ttft_{q}_s"])
        return f"{t(base) / t('l2+tierstore'):.1f}x"
    return value


def share(run: str, tier: str, own: bool = False) -> Callable[[], str]:
    """The share of returning turns' prefix tokens (rounds pooled) or, ``own``, of the users'
    own histories (the mean over the rounds) that a tier served."""
    def value() -> str:
        if own:
            return f"{loadtest_planner(run)['measured'][tier]:.0%}"
        return f"{loadtest_pooled(run)[f'{tier}_share']:.0%}"
    return value


def index_row(page: int, batch: int, topology: str = "1 node") -> dict[str, Any]:
    """bench_index's redis-server row for pages of ``page`` bytes in batches of ``batch``."""
    for r in load("bench_index/bench_index.json")["configs"]:
        if (r["server"], r["topology"], r["page_bytes"], r["batch"]) == ("redis-server", topology, page, batch):
            return dict(r)
    raise SystemExit(f"figures: bench_index has no {topology} redis-server row for {page} B x {batch}")


def batch_us(page: int, batch: int) -> float:
    """Index server time of one write batch: its COMMIT and two HMGETs (probe, read)."""
    su = index_row(page, batch)["server_us"]
    return float(su["commit"]["p50"] + 2 * su["HMGET"]["p50"])


# (fleet, page bytes, batch, write batches/s over all ranks, capacity TiB, the index while one Redis will do)
SIZING = (
    ("1 node, 8 ranks, 2 TiB", 256 << 10, 16, 200, 2, "one Redis: the embedded one, or node-local"),
    ("8 nodes, 16 TiB shared", 2 << 20, 128, 128, 16, "one Redis, with Sentinel for its failover"),
    ("32 nodes, 64 TiB shared", 2 << 20, 128, 512, 64, "one Redis, with Sentinel for its failover"),
    ("32 nodes, 64 TiB shared", 256 << 10, 16, 6400, 64, "one Redis, with Sentinel for its failover"),
)
BUSY = 0.5  # the share of a core a Redis is kept under (queueing grows past it)
MIN_MASTERS = 3  # a cluster's least


def sizing_table() -> str:
    """The README's index sizing: CPU = batches/s x server time per batch, memory = bytes per
    page x pages the capacity holds; past half a core, a cluster of as many masters as keep
    each under half (at least three), with its share per master."""
    per_page = load("index_memory/index_memory.json")["bytes_per_page"]
    rows = ["| fleet | pages, batch | write batches/s, all ranks | index CPU | index memory | index |", "|---|---|---|---|---|---|"]
    for fleet, page, batch, rate, tib, single in SIZING:
        cpu = rate * batch_us(page, batch) / 1e6
        mem = per_page * (tib << 40) / page / 2**30
        masters = 1 if cpu <= BUSY else max(MIN_MASTERS, math.ceil(cpu / BUSY))
        index = single if masters == 1 else \
            f"a cluster of {masters} masters ({cpu / masters:.0%} and {mem / masters:.1f} GiB each)"
        size = f"{page >> 10} KiB" if page < 1 << 20 else f"{page >> 20} MiB"
        rows.append(f"| {fleet} | {size}, {batch} | {rate:,} | {cpu:.0%} of a core | {mem:.1f} GiB | {index} |")
    return "\n" + "\n".join(rows) + "\n"


def server_us(page: int, batch: int, call: str) -> Callable[[], str]:
    return lambda: f"{index_row(page, batch)['server_us'][call]['p50']:,.0f} µs"


def batch_total(page: int, batch: int) -> Callable[[], str]:
    return lambda: f"{batch_us(page, batch):,.0f} µs"


def aof(page: int, batch: int, topology: str) -> Callable[[], str]:
    """AOF bytes a write batch appends over the masters (redis-server)."""
    return lambda: f"{index_row(page, batch, topology)['aof_bytes_per_write_batch'] / 1e3:,.1f} KB"


def stress_table() -> str:
    """testing.md's summary of the committed stress run."""
    d = load("stress/stress.json")
    ops, pg, f, r, fail = d["operations"], d["pages"], d["faults"], d["redis_restarts"], d["failures"]
    a = d["args"]
    causes: dict[str, int] = {}
    for ph in d["not_stored_by_phase"].values():
        for c, k in ph["causes"].items():
            causes[c] = causes.get(c, 0) + k
    why = ", ".join(f"{k:,} {c}" for c, k in causes.items() if k) or "none"
    rows = [f"| | {d['seconds']:.0f} s, {a['procs']} processes x {a['threads']} threads, {a['capacity_mb']} MiB store |", "|---|---|",
            f"| operations | {sum(ops.values()):,} batches ({ops['get_batches']:,} get, {ops['set_batches']:,} set, "
            f"{ops['exists_calls']:,} exists, {ops['delete_calls']:,} delete, {ops['clear_calls']:,} clear) |",
            f"| pages | {pg['pages_stored']:,} stored, {pg['pages_not_stored']:,} not stored ({why}; "
            f"{sum(max(0, x['unattributed']) for x in d['not_stored_by_phase'].values()):,} without a cause); "
            f"{pg['hits']:,} hits, each verified byte for byte; {pg['misses']:,} misses |",
            f"| pages finding no slot once warm | {100 * (d['no_slot_share_once_warm'] or 0):.2f}% of those offered (target at most 1%) |",
            f"| evictions | {d['evicted_regions']:,} regions, {d['evicted_pages']:,} pages |",
            f"| faults | {f['worker_kills']} worker kill -9s ({f['worker_kills_mid_write']} inside `write`), {f['redis_kills']} Redis "
            f"kill -9s and restarts, {f['bit_flips']} bit flips, {f['capacity_lowered']} capacity cuts |",
            f"| after a Redis restart | serving after {r['loading_s']['median']} s (max {r['loading_s']['max']} s) of AOF loading; "
            f"the store answering {r['store_back_s']['median']} s (max {r['store_back_s']['max']} s) later |",
            f"| writes while the index was down | {d['index_unavailable']:,} calls raised `IndexUnavailable` (not offered) |",
            f"| pages failing verification | {d['pages_failed_verification']:,} (misses, dropped); the final read-back verified "
            f"{d['scrub']['verified']:,} of {d['scrub']['present']:,} stored pages |",
            f"| wrong pages, unexpected exceptions, leases left, `check()` problems | {fail['wrong_pages']}, "
            f"{fail['unexpected_errors']}, {fail['leases_left']}, {fail['check_problems']} |"]
    return "\n" + "\n".join(rows) + "\n"


def suite_table() -> str:
    """testing.md's timing of the suite in a clean clone: each lane's wall time (its setup
    included), pytest's summary and the SGLang servers it started."""
    rows = ["| lane | command | wall time | pytest | SGLang server starts |", "|---|---|---|---|---|"]
    for name, lane in load("suite/suite.json")["lanes"].items():
        m, sec = divmod(round(lane["wall_s"]), 60)
        starts = lane.get("server_starts")
        rows.append(f"| {name} | `{lane['command']}` | {m}:{sec:02d} | {lane['summary']} | "
                    f"{'not counted' if starts is None else starts} |")
    return "\n" + "\n".join(rows) + "\n"


def pair(job: str, key: str) -> Callable[[], str]:
    """A paired comparison of the interleaved load-test rounds (``rounds.json``), as the docs may say it."""
    from tierstore_kit.stats import say
    return lambda: say(load(f"{job}/rounds.json")["pairs"][key])


def caller_us(job: str, call: str) -> Callable[[], str]:
    """tierstore's CPU on SGLang's thread per page of ``call`` (user + system), the range over the rounds."""
    def value() -> str:
        per = [c["per_page_us"].get(f"{call} user", 0) + c["per_page_us"].get(f"{call} system", 0)
               for c in load(f"{job}/rounds.json")["tierstore_cpu"] if f"{call} user" in c["per_page_us"]]
        lo, hi = f"{min(per):.1f}", f"{max(per):.1f}"
        return f"{lo} us" if lo == hi else f"{lo}-{hi} us"
    return value


def thread_share(job: str, phase: str, name: str) -> Callable[[], str]:
    """A thread group's CPU as a share of one core, the range over the rounds, busy or idle."""
    def value() -> str:
        v = [c[phase][name] for c in load(f"{job}/rounds.json")["tierstore_cpu"] if phase in c]
        lo, hi = f"{100 * min(v):.2f}", f"{100 * max(v):.2f}"
        return f"{lo}%" if lo == hi else f"{lo}-{hi}%"
    return value


CALLS = {"set": "batch_set_v1", "get": "batch_get_v1", "exists": "batch_exists"}


def us(i: Mapping[str, float]) -> str:
    """A time in microseconds with its 95% interval."""
    digits = 1 if i["median"] < 100 else 0
    return f"{i['median']:.{digits}f} us ({i['lo']:.{digits}f}-{i['hi']:.{digits}f})"


def caller_fit(op: str, term: str, engine: str = "new", clock: str = "caller_us") -> Callable[[], str]:
    """bench_caller: an engine's CPU per call or per page (``term``) of one call, median over runs."""
    return lambda: us(load("bench_caller/bench_caller.json")["summary"][engine][op][clock][term])


def caller_gil(op: str, term: str, engine: str = "new") -> Callable[[], str]:
    """One fitted term of what an engine's ``op`` takes from bench_caller's spinning Python thread."""
    return lambda: us(load("bench_caller/bench_caller.json")["summary"][engine]["gil"][op][term])


def caller_base() -> str:
    """The commit bench_caller's baseline engine ran at."""
    return str(load("bench_caller/bench_caller.json")["commits"]["base"])


def caller_sizes(key: str) -> Callable[[], str]:
    """bench_caller's batch sizes (``sizes``), or those its fit is over (``fit_sizes``), as a list in words."""
    def value() -> str:
        *rest, last = [str(k) for k in load("bench_caller/bench_caller.json")[key]]
        return f"{', '.join(rest)} and {last}" if rest else last
    return value


def caller_table() -> str:
    """performance.md's table of bench_caller: CPU per call and per page, on SGLang's thread and in
    the whole process, baseline and this engine, and the ratio at the batch sizes."""
    from tierstore_kit.stats import say

    d = load("bench_caller/bench_caller.json")
    s, base, new = d["summary"], d["commits"]["base"], d["commits"]["new"]
    big = max(d["sizes"])
    rows = [f"| call | CPU on the caller's thread, per call: {base} → {new} | per page: {base} → {new} | whole process, "
            f"per page: {base} → {new} | caller, {new} / {base} at {big} pages |",
            "|---|---|---|---|---|"]
    for op, call in CALLS.items():
        c, p = s["base"][op], s["new"][op]
        rows.append(f"| `{call}` | {us(c['caller_us']['per_call_us'])} → {us(p['caller_us']['per_call_us'])} | "
                    f"{us(c['caller_us']['per_page_us'])} → {us(p['caller_us']['per_page_us'])} | "
                    f"{us(c['process_us']['per_page_us'])} → {us(p['process_us']['per_page_us'])} | "
                    f"{say(s['new/base'][op]['caller_us'][f'{big}_pages'])} |")
    return "\n" + "\n".join(rows) + "\n"


def caller_gil_table() -> str:
    """performance.md's table of bench_caller's GIL phase: what a call takes from a Python thread
    spinning beside it, per call and per page, baseline and this engine."""
    d = load("bench_caller/bench_caller.json")
    s, base, new = d["summary"], d["commits"]["base"], d["commits"]["new"]
    rows = [f"| call | GIL taken from the spinning thread, per call: {base} → {new} | per page: {base} → {new} |",
            "|---|---|---|"]
    for op, call in CALLS.items():
        c, p = s["base"]["gil"][op], s["new"]["gil"][op]
        rows.append(f"| `{call}` | {us(c['per_call_us'])} → {us(p['per_call_us'])} | "
                    f"{us(c['per_page_us'])} → {us(p['per_page_us'])} |")
    return "\n" + "\n".join(rows) + "\n"


def caller_busy_table() -> str:
    """performance.md's table of each call's wall time beside bench_caller's spinning thread
    (what a thread waiting for the call waits), at the smallest and largest batch, baseline
    and this engine, and the ratio paired run by run."""
    from tierstore_kit.stats import say

    d = load("bench_caller/bench_caller.json")
    s, base, new = d["summary"], d["commits"]["base"], d["commits"]["new"]
    lo, hi = min(d["sizes"]), max(d["sizes"])
    rows = [f"| call | wall time, {lo} page: {base} → {new} | {new} / {base} | {hi} pages: {base} → {new} | "
            f"{new} / {base} |", "|---|---|---|---|---|"]
    for op, call in CALLS.items():
        c, p, r = s["base"]["gil"][op]["wall_us"], s["new"]["gil"][op]["wall_us"], s["new/base"][op]["busy_wall_us"]
        rows.append(f"| `{call}` | {us(c[f'{lo}_pages'])} → {us(p[f'{lo}_pages'])} | {say(r[f'{lo}_pages'])} | "
                    f"{us(c[f'{hi}_pages'])} → {us(p[f'{hi}_pages'])} | {say(r[f'{hi}_pages'])} |")
    return "\n" + "\n".join(rows) + "\n"


def caller_ratio(op: str, clock: str, pages: int) -> Callable[[], str]:
    """bench_caller: this engine's ``clock`` of ``op`` on ``pages`` pages over the baseline's, paired run by run."""
    def figure() -> str:
        from tierstore_kit.stats import say

        return str(say(load("bench_caller/bench_caller.json")["summary"]["new/base"][op][clock][f"{pages}_pages"]))
    return figure


def caller_idle(key: str, engine: str = "new") -> Callable[[], str]:
    """What an engine's idle threads cost per second in bench_caller: the GIL taken
    (``gil``) or one thread's CPU (its name)."""
    def value() -> str:
        g = load("bench_caller/bench_caller.json")["summary"][engine]["gil"]
        return us(g["idle_us_per_s"] if key == "gil" else g["idle_cpu_us_per_s"][key])
    return value


def within(i: Mapping[str, float], limit: float, unit: str, what: str) -> str:
    """Whether a figure meets an upper bound: by its whole 95% interval, by its median only, or not."""
    fmt = (lambda v: f"{v:.2f}{unit}") if unit == "x" else (lambda v: f"{v:.1f} {unit}")
    if i["hi"] <= limit:
        return f"{what}: met (the interval's upper end {fmt(i['hi'])}, at most {fmt(limit)})"
    if i["median"] <= limit:
        return (f"{what}: the median {fmt(i['median'])} is within {fmt(limit)}, but the interval reaches "
                f"{fmt(i['hi'])}, so the runs do not exclude more")
    span = f"{fmt(i['median'])}, {fmt(i['lo'])}-{fmt(i['hi'])}" if unit == "x" else us(i)
    return f"{what}: missed ({span}, against at most {fmt(limit)})"


def interference_targets() -> str:
    """Item 4's targets against the committed runs: tierstore over the file backend in the
    interference job (no slowdown beyond 3%), and bench_caller's CPU per page (at most 10 us)."""
    pairs = load("interference/rounds.json")["pairs"]
    caller = load("bench_caller/bench_caller.json")["summary"]["new"]
    parts = [within(pairs[f"l2+tierstore / l2+file: {k}"], 1.03, "x", name)
             for k, name in (("decode inter-token latency", "decode ITL"), ("first-turn TTFT", "first-turn TTFT"))]
    verbs = (("set", "written"), ("get", "read"), ("exists", "probed"))
    parts += [within(caller[op]["caller_us"]["per_page_us"], 10.0, "us", f"CPU per page {verb} on the caller")
              for op, verb in verbs]
    parts += [within(caller["gil"][op]["per_page_us"], 10.0, "us", f"GIL taken per page {verb}") for op, verb in verbs]
    return "; ".join(parts)


def jobs_of(page: Path) -> list[jobs.Job]:
    """The jobs whose results the figures marked on ``page`` are computed from."""
    read: set[str] = set()
    for m in MARK.finditer(page.read_text()):
        if not m.group(1).startswith("stale."):
            _read.clear()
            compute(m.group(1))
            read |= _read
    return [j for j in jobs.JOBS if j.name in read]


@memo
def measured(name: str) -> tuple[str, int] | None:
    return jobs.measured(jobs.job_named(name))


STALENESS_LINK = {"README.md": "docs/testing.md", "docs/testing.md": ""}  # where testing.md is, seen from a page


def stale_jobs(page: str) -> Callable[[], str]:
    """A line for each job the figures on ``page`` come from whose results predate the code
    as it stands: the commit it measured and how many commits to the code it runs came after
    (``jobs.measured``). A result is the record of its commit; a later change makes it
    older, not wrong, and this says so where the figures stand."""
    def value() -> str:
        lines = []
        for job in jobs_of(ROOT / page):
            if (m := measured(job.name)) is not None:
                commit, behind = m
                lines.append(f"- `{job.name}` measured at {commit[:7]}, {behind} commit{'s' * (behind != 1)} to the code "
                             "it runs before this one")
        if not lines:
            return "\n*Every figure here was measured on the code as it stands.*\n"
        return ("\n*Measured before the code as it stands* (`python3 scripts/reproduce.py --stale` reruns them; "
                f"[what counts]({STALENESS_LINK.get(page, 'testing.md')}#results-and-staleness)):\n"
                + "\n".join(lines) + "\n")
    return value


FIGURES: dict[str, Callable[[], str]] = {
    "io.cold_read.range": io_range("cold read / O_DIRECT read"),
    "io.write.range": io_range("write / O_DIRECT write"),
    "io.hicache_write.range": io_range("tierstore / HiCacheFile: write"),
    "io.hicache_cold_read.range": io_range("tierstore / HiCacheFile: cold read"),
    "io.hicache_write.swing": io_hicache_write_swing,
    "io.table": io_table,
    "io.targets": io_targets,
    "io.probe": probe("probe_all_hit"),
    "io.probe.target": probe_target,
    "io.probe_first_missing": probe("probe_first_missing"),
    "io.hmget": probe("hmget_128"),
    "io.python_set": python_us("set"),
    "io.python_get": python_us("get"),
    "mixed.table": mixed_table,
    "staging.table": staging_table,
    "tags.table": tags_table,
    "tags.used": tag_ns("blake2b-128, keyed once and copied (used)"),
    "tags.hmac": tag_ns("hmac-sha256 truncated to 128 bits"),
    "memory.per_page": memory_per_page,
    "memory.per_tb_256k": memory_per_tb("256 KiB"),
    "memory.per_tb_2m": memory_per_tb("2 MiB"),
    "memory.per_tb_8m": memory_per_tb("8 MiB"),
    "check.max": check_max,
    "stress.minutes": stress_minutes,
    "stress.table": stress_table,
    "suite.table": suite_table,
    "stress.hits": stress("pages.hits"),
    "stress.wrong": stress("failures.wrong_pages"),
    "stress.stored": stress("pages.pages_stored"),
    "stress.not_stored": stress("pages.pages_not_stored"),
    "stress.no_slot_warm": stress_no_slot,
    "stress.redis_kills": stress("faults.redis_kills"),
    "stress.worker_kills": stress("faults.worker_kills"),
    "stress.bit_flips": stress("faults.bit_flips"),
    "stress.store_back": stress_store_back,
    "index.commit_16x256k": server_us(256 << 10, 16, "commit"),
    "index.commit_128x2m": server_us(2 << 20, 128, "commit"),
    "cluster.surviving.redis": drill("redis-server", "surviving"),
    "cluster.hits_back.redis": drill("redis-server", "hits_back"),
    "cluster.hits_back.valkey": drill("valkey-server", "hits_back"),
    "cluster.lost.redis": drill("redis-server", "lost"),
    "cluster.paired_probe.redis": paired_cluster("redis-server", "probe"),
    "cluster.relay.delay": relay_delay,
    "cluster.relay.probe.redis": relayed("redis-server", "probe", "ratio"),
    "cluster.relay.commit.redis": relayed("redis-server", "commit", "ratio"),
    "cluster.relay.probe.valkey": relayed("valkey-server", "probe", "ratio"),
    "cluster.relay.commit.valkey": relayed("valkey-server", "commit", "ratio"),
    "cluster.relay.commit.vs4.redis": relayed("redis-server", "commit", "vs_4_per_master"),
    "cluster.vs4.probe.wall.redis": paired_vs_4_per_master("redis-server", "probe", "wall"),
    "cluster.vs4.probe.cpu.redis": paired_vs_4_per_master("redis-server", "probe", "cpu"),
    "cluster.vs4.commit.wall.redis": paired_vs_4_per_master("redis-server", "commit", "wall"),
    "cluster.vs4.commit.cpu.redis": paired_vs_4_per_master("redis-server", "commit", "cpu"),
    "cluster.vs4.commit.masters.redis": paired_cpu("redis-server", "commit", "cluster 4/master masters"),
    "cluster.paired_commit.redis": paired_cluster("redis-server", "commit"),
    "loadtest.tierstore_p50": loadtest("l2+tierstore", "p50"),
    "loadtest.no_hicache_p50": loadtest("no-hicache", "p50"),
    "loadtest.table": loadtest_table,
    "sizing.table": sizing_table,
    "index.aof_128x4k": aof(4 << 10, 128, "1 node"),
    "index.aof_128x256k": aof(256 << 10, 128, "1 node"),
    "index.aof_128x256k.cluster": aof(256 << 10, 128, "3-master cluster"),
    "index.hmget_16x256k": server_us(256 << 10, 16, "HMGET"),
    "index.hmget_128x2m": server_us(2 << 20, 128, "HMGET"),
    "index.lease_128x2m": server_us(2 << 20, 128, "lease"),
    "index.batch_16x256k": batch_total(256 << 10, 16),
    "index.batch_128x2m": batch_total(2 << 20, 128),
    "cluster.paired_probe.valkey": paired_cluster("valkey-server", "probe"),
    "cluster.cpu.probe.client1": paired_cpu("redis-server", "probe", "client one node"),
    "cluster.cpu.probe.clientN": paired_cpu("redis-server", "probe", "client cluster"),
    "cluster.cpu.probe.server1": paired_cpu("redis-server", "probe", "one node server"),
    "cluster.cpu.probe.masters": paired_cpu("redis-server", "probe", "cluster masters"),
    "cluster.cpu.commit.client1": paired_cpu("redis-server", "commit", "client one node"),
    "cluster.cpu.commit.clientN": paired_cpu("redis-server", "commit", "client cluster"),
    "cluster.cpu.commit.server1": paired_cpu("redis-server", "commit", "one node server"),
    "cluster.cpu.commit.masters": paired_cpu("redis-server", "commit", "cluster masters"),
    "cluster.cpu.commit.replicas": paired_cpu("redis-server", "commit", "cluster replicas"),
    "cluster.paired_commit.valkey": paired_cluster("valkey-server", "commit"),
    "cluster.cpu.probe.client_ratio": paired_client_ratio("redis-server", "probe"),
    "cluster.cpu.commit.budget.redis": paired_budget("redis-server"),
    "cluster.cpu.commit.budget.valkey": paired_budget("valkey-server"),
    "loadtest.vs_none.returning": pair("loadtest", "l2+tierstore / no-hicache: returning-turn TTFT"),
    "loadtest.vs_l2.returning": pair("loadtest", "l2+tierstore / l2: returning-turn TTFT"),
    "loadtest.vs_file.returning": pair("loadtest", "l2+tierstore / l2+file: returning-turn TTFT"),
    "loadtest.vs_file.first": pair("loadtest", "l2+tierstore / l2+file: first-turn TTFT"),
    "loadtest.vs_l2.first": pair("loadtest", "l2+tierstore / l2: first-turn TTFT"),
    "loadtest.vs_file.itl": pair("loadtest", "l2+tierstore / l2+file: decode inter-token latency"),
    "loadtest.planner": planner_table,
    "planner.validation": validation_table,
    "planner.within": validation_count("within"),
    "planner.explained": validation_count("explained"),
    "planner.outside": validation_count("outside"),
    "planner.outside.explained": validation_count("outside.explained"),
    "interference.itl.file": pair("interference", "l2+tierstore / l2+file: decode inter-token latency"),
    "interference.itl.file_l2": pair("interference", "l2+file / l2: decode inter-token latency"),
    "interference.itl.l2": pair("interference", "l2+tierstore / l2: decode inter-token latency"),
    "interference.first.file": pair("interference", "l2+tierstore / l2+file: first-turn TTFT"),
    "interference.first.l2": pair("interference", "l2+tierstore / l2: first-turn TTFT"),
    "interference.returning.file": pair("interference", "l2+tierstore / l2+file: returning-turn TTFT"),
    "caller.table": caller_table,
    "caller.sizes": caller_sizes("sizes"),
    "caller.fit_sizes": caller_sizes("fit_sizes"),
    "caller.gil_table": caller_gil_table,
    "caller.busy_table": caller_busy_table,
    "caller.set.per_page.base": caller_fit("set", "per_page_us", "base"),
    "caller.exists.wall.1p": caller_ratio("exists", "wall_us", 1),
    "caller.gil.idle": caller_idle("gil"),
    "caller.cpu.idle.housekeeping": caller_idle("tierstore-housekeeping"),
    "caller.cpu.idle.io": caller_idle("tierstore-io"),
    "caller.gil.idle.base": caller_idle("gil", "base"),
    "caller.cpu.idle.housekeeping.base": caller_idle("tierstore-housekeeping", "base"),
    "caller.gil.set.per_page": caller_gil("set", "per_page_us"),
    "caller.gil.get.per_page": caller_gil("get", "per_page_us"),
    "caller.gil.exists.per_page": caller_gil("exists", "per_page_us"),
    "caller.gil.set.per_page.base": caller_gil("set", "per_page_us", "base"),
    "caller.gil.get.per_page.base": caller_gil("get", "per_page_us", "base"),
    "caller.base": caller_base,
    "interference.targets": interference_targets,
    "interference.rounds": lambda: str(load("interference/rounds.json")["rounds"]),
    "caller.set.per_page": caller_fit("set", "per_page_us"),
    "caller.get.per_page": caller_fit("get", "per_page_us"),
    "caller.exists.per_page": caller_fit("exists", "per_page_us"),
    "caller.set.per_call": caller_fit("set", "per_call_us"),
    "caller.get.per_call": caller_fit("get", "per_call_us"),
    "caller.exists.per_call": caller_fit("exists", "per_call_us"),
    "interference.caller.write": caller_us("interference", "batch_set_v1"),
    "interference.caller.read": caller_us("interference", "batch_get_v1"),
    "interference.caller.probe": caller_us("interference", "batch_exists"),
    "interference.busy.io": thread_share("interference", "busy", "tierstore-io"),
    "interference.busy.hk": thread_share("interference", "busy", "tierstore-hk"),
    "interference.busy.redis": thread_share("interference", "busy", "redis"),
    "interference.idle.io": thread_share("interference", "idle", "tierstore-io"),
    "interference.idle.hk": thread_share("interference", "idle", "tierstore-hk"),
    "interference.idle.redis": thread_share("interference", "idle", "redis"),
    "loadtest.prefix_tokens": prefix_tokens,
    "loadtest.cold": calibration("cold_ttft_s"),
    "loadtest.storage_hit": calibration("storage_ttft_s"),
    "loadtest.device_hit": calibration("device_ttft_s"),
    "loadtest.storage_read": calibration("storage_read_s"),
    "loadtest.cold_over_storage": calibration("cold_over_storage_ttft"),
    "loadtest.recompute_over_read": calibration("recompute_over_storage_read"),
    "loadtest.speedup.p50.none": speedup("no-hicache", "p50"),
    "loadtest.speedup.p90.none": speedup("no-hicache", "p90"),
    "loadtest.speedup.p50.l2": speedup("l2", "p50"),
    "loadtest.speedup.p90.l2": speedup("l2", "p90"),
    "loadtest.storage_share": share("l2+tierstore", "storage"),
    "loadtest.own_storage_share": share("l2+tierstore", "storage", own=True),
    "stale.readme": stale_jobs("README.md"),
    "stale.performance": stale_jobs("docs/performance.md"),
    "stale.loadtest": stale_jobs("docs/loadtest.md"),
    "stale.testing": stale_jobs("docs/testing.md"),
}


def compute(name: str) -> str:
    if name not in FIGURES:
        raise SystemExit(f"figures: no figure named {name!r} (known: {', '.join(sorted(FIGURES))})")
    return FIGURES[name]()


def rewrite(text: str) -> str:
    return MARK.sub(lambda m: f"<!--f:{m.group(1)}-->{compute(m.group(1))}<!--/f-->", text)


def stale(page: Path) -> list[str]:
    """Each marked figure on ``page`` whose text differs from its result file's value."""
    return [f"{page.relative_to(ROOT)}: {m.group(1)} reads {m.group(2)!r}, its result gives {compute(m.group(1))!r}"
            for m in MARK.finditer(page.read_text()) if m.group(2) != compute(m.group(1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    g.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list:
        for name in FIGURES:
            print(f"{name:<28} {compute(name).strip()[:100]}")
        return 0
    if a.write:
        for page in PAGES:
            text = page.read_text()
            new = rewrite(text)
            if new != text:
                page.write_text(new)
                print(f"figures: rewrote {page.relative_to(ROOT)}")
        return 0
    bad = [line for page in PAGES for line in stale(page)]
    print("\n".join(bad) or "figures: every marked figure matches its result file")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
