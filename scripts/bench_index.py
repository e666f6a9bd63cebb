#!/usr/bin/env python3
"""What the index costs per call, on one server and on a 3-master cluster, for the capacity
table in the README.

    python3 scripts/bench_index.py --out scripts/results/bench_index > scripts/results/bench_index/bench_index.txt

For redis-server and valkey-server, each as one node (AOF on) and as a 3-master cluster
with a replica per master (AOF on, built with CLUSTER MEET/ADDSLOTSRANGE/REPLICATE), for
pages of 4 KiB, 256 KiB and 2 MiB and batches of 1, 16 and 128 pages: a fresh store on
/dev/shm (no disk in the way), rounds of one write batch, one probe and one read of that
batch, and a housekeeping pass. Measured:

- server-side µs per call of each function and of HMGET (SLOWLOG with
  ``slowlog-log-slower-than 0`` on every master: each call's execution inside the server);
- AOF bytes per write batch (``aof_current_size`` deltas over the masters: a COMMIT rewrites
  its region's member blob, which small pages make large);
- client-side p50/p99 of a probe (``TierStore.exists``) and of a batch's COMMIT round trip.

Then the latency target, paired: a one-node store and two 3-master-cluster stores (a replica
per master, a cluster each: one made as stores are now, one shard per master, and one with 4
shards per master, as they were made before), all up at once, take turns (in rotating order)
writing a batch of 128 pages of 4 KiB, ``--paired`` times each, then take turns probing their
last batch as often; reported are each side's p50 of the COMMIT round trip and of the probe,
and the ratios cluster/one node and one shard/4 shards per master with bootstrap 95% intervals
(the machine's noise hits the sides alike); and where the time goes:
the client's CPU on its calling thread per call, and the servers' CPU per write batch and per
probe (INFO CPU over each phase less each server's idle rate, measured just before it: the one
node; the cluster's masters, and its replicas, which share the same cores here).

Last in the paired run, the regime of a real fleet, where the network and not these 2 cores
sets the time: the same three sides, new stores, every server reached through a relay of
``tierstore_kit.relay`` that holds each reply ``--delay-ms`` (5 ms; the clusters' masters
announce their relays' ports); wall p50 of the COMMIT round trip and of the probe, and the
ratios with their intervals (one round trip over every master at once costs one delay).

Then, on each cluster, a failover drill: 4 KiB pages in batches of 16, a master SIGKILLed,
the surviving shards' hit rate right after, the time until every page hits again, and the
pages lost (committed but not yet replicated). Results are stamped with the commit, the
command, the servers' versions and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator


import redis
from redis.crc import key_slot
from tierstore_kit.clusters import ClusterProc
from tierstore_kit.relay import Relays
from tierstore_kit.servers import RedisProc, wait_for
from tierstore_kit.engine import engine, housekeep

from tierstore_kit.provenance import header, stamp
from tierstore_kit.stats import percentile

from sglang_tierstore.errors import StoreUnavailable
from sglang_tierstore.schema import entry_field, shard_of

HERE = Path(__file__).resolve().parent

KiB, MiB = 1 << 10, 1 << 20
PAGES = (4 * KiB, 256 * KiB, 2 * MiB)
BATCHES = (1, 16, 128)


SERVER_FLAGS = ["1 node: --bind 127.0.0.1 --save '' --appendonly yes --protected-mode no",
                "cluster: --cluster-enabled yes --cluster-node-timeout <drill> --cluster-require-full-coverage no "
                "--appendonly yes --save '' --repl-diskless-sync-delay 0, a replica per master",
                "every master: slowlog-log-slower-than 0"]


class Masters:
    """The clients of the index's masters (one, or a cluster's)."""

    def __init__(self, clients: list[redis.Redis]) -> None:
        self.clients = clients

    def start_slowlog(self) -> None:
        for c in self.clients:
            c.config_set("slowlog-max-len", 1_000_000)
            c.config_set("slowlog-log-slower-than", 0)
            c.slowlog_reset()

    def slowlog(self) -> dict[str, list[int]]:
        """µs per call by function (FCALL's first argument) or command."""
        out: dict[str, list[int]] = {}
        for c in self.clients:
            for e in c.slowlog_get(1_000_000):
                cmd = e["command"].split() if isinstance(e["command"], (str, bytes)) else e["command"]
                words = [w.decode(errors="replace") if isinstance(w, bytes) else str(w) for w in cmd]
                if not words:
                    continue
                name = words[0].upper()
                if name == "FCALL" and len(words) > 1:
                    name = words[1].split("_", 2)[-1]  # tierstore_<digest>_<function>
                elif name not in ("HMGET", "ZADD", "HGETALL", "HSET"):
                    continue
                out.setdefault(name, []).append(int(e["duration"]))
            c.config_set("slowlog-log-slower-than", 10_000)
        return out

    def aof_bytes(self) -> int:
        return sum(int(c.info("persistence")["aof_current_size"]) for c in self.clients)




def one_config(cfg: dict[str, Any], masters: Masters, page: int, n: int, rounds: int) -> dict[str, Any]:
    path = tempfile.mkdtemp(dir=cfg["path"])
    st = engine({**cfg, "redis_prefix": "bi-" + uuid.uuid4().hex[:8], "path": path,
                 "capacity_gb": max(1 << 30, 4 * n * page) / (1 << 30), "o_direct": False,
                 "io_threads": 4, "housekeeping_s": 3600, "lease_s": 4 * 3600})
    try:
        ns = st.namespace({"bench": "index"}, page)
        buf = [[memoryview(bytearray(os.urandom(page)))] for _ in range(n)]
        commit_ms: list[float] = []
        real = st.index.calls_each

        def timed(calls: Any) -> Any:
            t0 = time.perf_counter()
            out = real(calls)
            if any(c[0] == "commit" for c in calls):
                commit_ms.append((time.perf_counter() - t0) * 1e3)
            return out

        st.index.calls_each = timed  # type: ignore[method-assign]
        k = 0

        def batch() -> list[str]:
            nonlocal k
            keys = [uuid.uuid4().hex * 2 for _ in range(n)]
            k += n
            return keys

        for _ in range(3):  # warm: stock leased, files made, library loaded on every master
            st.write(ns, batch(), buf, False)
        commit_ms.clear()
        masters.start_slowlog()
        aof0 = masters.aof_bytes()
        probe_ms: list[float] = []
        stored = 0
        for _ in range(rounds):
            keys = batch()
            stored += sum(st.write(ns, keys, buf, False))
            t0 = time.perf_counter()
            st.exists([(ns, keys)])
            probe_ms.append((time.perf_counter() - t0) * 1e3)
            st.read(ns, keys, buf, False)
            housekeep(st, audit=False)
        aof = masters.aof_bytes() - aof0
        server = masters.slowlog()
        return {"page_bytes": page, "batch": n, "rounds": rounds, "stored": stored, "shards": st.space.attached().geometry.shards,
                "server_us": {f: {"calls": len(v), "p50": statistics.median(v), "p99": percentile(v, 0.99)} for f, v in server.items()},
                "aof_bytes_per_write_batch": aof / rounds,
                "probe_ms": {"p50": statistics.median(probe_ms), "p99": percentile(probe_ms, 0.99)},
                "commit_ms": {"p50": statistics.median(commit_ms), "p99": percentile(commit_ms, 0.99)}}
    finally:
        st.close()
        shutil.rmtree(path, ignore_errors=True)


def drill(cfg: dict[str, Any], cluster: ClusterProc) -> dict[str, Any]:
    """A master SIGKILLed under a 4 KiB, 16-page workload."""
    st = engine({**cfg, "redis_prefix": "drill-" + uuid.uuid4().hex[:6], "path": tempfile.mkdtemp(dir=cfg["path"]),
                 "capacity_gb": 0.25, "o_direct": False, "io_threads": 2})
    try:
        ns = st.namespace({"bench": "drill"}, 4096)
        buf = [[memoryview(bytearray(os.urandom(4096)))] for _ in range(16)]
        written: list[str] = []
        for _ in range(40):
            keys = [uuid.uuid4().hex * 2 for _ in range(16)]
            if all(st.write(ns, keys, buf, False)):
                written += keys
        home = st.space.attached().home
        shards = home.geometry.shards
        victim = cluster.masters()[0]
        dead = {s for s in range(shards) if cluster.owner(key_slot(home.shard_tags[s].encode())).addr == victim.addr}
        victim.kill()
        t0 = time.monotonic()

        def shard(k: str) -> int:
            return shard_of(entry_field(ns.ns_id, k), shards)

        def found(keys: list[str]) -> list[bool]:
            try:
                return st.exists([(ns, keys)])[0]
            except StoreUnavailable:  # every shard of these keys unreachable
                return [False] * len(keys)

        samples = []  # surviving shards' hit rate, every 50 ms until the dead ones hit again
        alive_keys = [k for k in written if shard(k) not in dead]
        back = None
        while time.monotonic() - t0 < 60:
            samples.append(sum(found(alive_keys)) / max(1, len(alive_keys)))
            if all(found(written[:64])):
                back = time.monotonic() - t0
                break
            time.sleep(0.05)
        cluster.wait_ok()
        lost = len(written) - sum(found(written))
        return {"masters": 3, "shards": shards, "dead_shards": len(dead), "pages": len(written),
                "surviving_shards_hit_rate": statistics.mean(samples) if samples else None,
                "surviving_shards_worst_sample": min(samples) if samples else None, "hits_back_s": back, "pages_lost": lost,
                "cluster_node_timeout_ms": cluster.node_timeout_ms, "redis_retry_s": cfg.get("redis_retry_s", 1.0)}
    finally:
        st.close()


def servers_cpu(clients: list[redis.Redis]) -> float:
    """CPU seconds (user + system) the servers behind ``clients`` have used since they started."""
    total = 0.0
    for c in clients:
        info = c.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


# the cluster sides of the paired run, each on a 3-master cluster of its own: a store as
# created now (one shard per master), and one with the 4 shards per master stores had before
CLUSTER_SIDES: dict[str, dict[str, Any]] = {"cluster": {}, "cluster 4/master": {"index_shards": 12}}


BUF = [[memoryview(bytearray(os.urandom(4096)))] for _ in range(128)]


def instrument(st: Any, ns: Any, got: dict[str, list[float]]) -> None:
    """Record the wall time and the calling thread's CPU of each round trip of ``st`` that
    carries a COMMIT (``got["commit"]``, ``got["commit_cpu"]``, ms), after a warm-up."""
    real = st.index.calls_each

    def timed(calls: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = real(calls)
        if any(c[0] == "commit" for c in calls):
            got["commit"].append((time.perf_counter() - t0) * 1e3)
            got["commit_cpu"].append((time.thread_time() - c0) * 1e3)
        return out

    st.index.calls_each = timed
    for _ in range(5):  # warm: stock leased, files made, the library loaded on every master
        st.write(ns, [uuid.uuid4().hex * 2 for _ in range(128)], BUF, False)
    got["commit"].clear()
    got["commit_cpu"].clear()


def behind_relays(sides: dict[str, Any], single: RedisProc, clusters: dict[str, ClusterProc], work: Path,
                  iterations: int, delay_s: float) -> dict[str, Any]:
    """The same sides, new stores, each server reached through a relay holding every reply
    for ``delay_s`` (a cluster's masters announce their relays' ports, so its slot map
    names them): the regime of a fleet, where the network sets the time and a round trip
    over every master at once costs one delay. Wall p50 of the COMMIT round trip and of the
    probe per side, and the ratios with their intervals."""
    masters = {name: c.masters() for name, c in clusters.items()}
    targets = [single.port] + [m.port for ms in masters.values() for m in ms]
    with Relays(targets, delay_s) as relays:
        port = dict(zip(targets, relays.ports))
        for ms in masters.values():
            for m in ms:
                m.client().config_set("cluster-announce-bus-port", m.port + 10000)  # the bus goes direct
                m.client().config_set("cluster-announce-port", port[m.port])
        for ms in masters.values():  # every master's map names the relays
            want = sorted(port[m.port] for m in ms)
            for m in ms:
                wait_for(lambda m=m, want=want: sorted(int(r[2][1]) for r in m.client().execute_command("CLUSTER", "SLOTS"))
                         == want, 30, "the relays' ports in the slot map")
        where = {"one node": {"redis_url": f"redis://127.0.0.1:{port[single.port]}/0"}}
        where |= {name: {"redis_cluster": [f"127.0.0.1:{port[m.port]}" for m in masters[name]], **sides[name]}
                  for name in clusters}
        stores = {}
        try:
            for name, w in where.items():
                st = engine({**w, "path": tempfile.mkdtemp(dir=work), "redis_prefix": "relay-" + uuid.uuid4().hex[:6],
                             "capacity_gb": 1.0, "o_direct": False, "io_threads": 4, "housekeeping_s": 3600,
                             "lease_s": 4 * 3600, "redis_timeout_s": 10 * delay_s + 1})
                stores[name] = (st, st.namespace({"bench": "relay"}, 4096), {"commit": [], "commit_cpu": [], "probe": []})
                instrument(*stores[name])
            order = list(stores)
            for i in range(iterations):
                for name in order[i % len(order):] + order[:i % len(order)]:
                    st, ns, got = stores[name]
                    keys = [uuid.uuid4().hex * 2 for _ in range(128)]
                    st.write(ns, keys, BUF, False)
                    t0 = time.perf_counter()
                    st.exists([(ns, keys)])
                    got["probe"].append((time.perf_counter() - t0) * 1e3)
            out: dict[str, Any] = {"delay_ms": delay_s * 1e3, "iterations": iterations}
            for what in ("commit", "probe"):
                a, b, b4 = (stores[name][2][what] for name in ("one node", "cluster", "cluster 4/master"))
                out[what] = {"p50": {name: statistics.median(got[what]) for name, (_, _, got) in stores.items()},
                             "ratio": statistics.median(b) / statistics.median(a), "ratio_ci95": _bootstrap(a, b),
                             "vs_4_per_master": statistics.median(b) / statistics.median(b4),
                             "vs_4_per_master_ci95": _bootstrap(b4, b)}
            return out
        finally:
            for st, _, _ in stores.values():
                st.close()
            for ms in masters.values():
                for m in ms:
                    m.client().config_set("cluster-announce-port", 0)  # (0: the node's own port again)


def paired(server: str, work: Path, iterations: int, delay_s: float) -> dict[str, Any]:
    """The latency target, paired; with it, where each side's time goes: the client's CPU
    on its calling thread (p50 per call) and the servers' CPU per call (one node; each
    cluster's masters and its replicas), from INFO CPU around each phase. The sides take
    turns round by round: one node, a cluster store as made by default, and one with 4
    shards per master (what one shard per master is measured against)."""
    single = RedisProc(work / f"{server}-pair-single", appendonly=True, server=server)
    clusters = {name: ClusterProc(work / f"{server}-pair-{i}", server, masters=3, replicas=1)
                for i, name in enumerate(CLUSTER_SIDES)}
    stores = {}
    servers: dict[str, dict[str, list[redis.Redis]]] = {"one node": {"server": [redis.Redis.from_url(single.url)]}}
    for name, c in clusters.items():
        servers[name] = {"masters": [n.client() for n in c.masters()],
                         "replicas": [n.client() for n in c.nodes if n not in c.masters()]}
    sides = [("one node", {"redis_url": single.url})] + [(name, {"redis_cluster": c.seeds[:3], **CLUSTER_SIDES[name]})
                                                         for name, c in clusters.items()]
    try:
        for name, where in sides:
            path = tempfile.mkdtemp(dir=work)
            st = engine({**where, "path": path, "redis_prefix": "pair-" + uuid.uuid4().hex[:6], "capacity_gb": 1.0,
                         "o_direct": False, "io_threads": 4, "housekeeping_s": 3600, "lease_s": 4 * 3600})
            stores[name] = (st, st.namespace({"bench": "pair"}, 4096), {"commit": [], "probe": [], "commit_cpu": [],
                                                                      "probe_cpu": []})
        for st, ns, got in stores.values():
            instrument(st, ns, got)
        order = list(stores)
        last: dict[str, list[str]] = {}
        cpu: dict[str, dict[str, float]] = {"commit": {}, "probe": {}}

        def sample() -> tuple[float, dict[tuple[str, str], float]]:
            return time.monotonic(), {(name, role): servers_cpu(cs) for name, roles in servers.items()
                                      for role, cs in roles.items()}

        def phase(what: str, step: Callable[[str], None]) -> None:
            """Run the phase; each server group's CPU per call with its idle rate (cluster bus,
            cron, replication pings: measured over an idle second first) taken out."""
            t0, idle0 = sample()
            time.sleep(1)
            t1, before = sample()
            for i in range(iterations):
                turn = order[i % len(order):] + order[:i % len(order)]  # each side first as often
                for name in (turn if i % 2 == 0 else turn[::-1]):
                    step(name)
            time.sleep(1)  # replication and AOF of the phase settle
            t2, after = sample()
            for k, t in before.items():
                idle_rate = (t - idle0[k]) / (t1 - t0)
                cpu[what][f"{k[0]} {k[1]}"] = max(0.0, after[k] - t - idle_rate * (t2 - t1)) / iterations * 1e3

        def write(name: str) -> None:
            st, ns, _ = stores[name]
            last[name] = [uuid.uuid4().hex * 2 for _ in range(128)]
            st.write(ns, last[name], BUF, False)

        def probe(name: str) -> None:
            st, ns, got = stores[name]
            t0, c0 = time.perf_counter(), time.thread_time()
            st.exists([(ns, last[name])])
            got["probe"].append((time.perf_counter() - t0) * 1e3)
            got["probe_cpu"].append((time.thread_time() - c0) * 1e3)

        phase("commit", write)  # writes, the two stores in turn
        phase("probe", probe)  # then probes of each store's last batch, in turn
        out: dict[str, Any] = {"server": server, "iterations": iterations, "page_bytes": 4096, "batch": 128,
                               "shards": {name: st.space.attached().geometry.shards for name, (st, _, _) in stores.items()}}
        for what in ("commit", "probe"):
            a, b, b4 = (stores[name][2][what] for name in ("one node", "cluster", "cluster 4/master"))
            cpu_of = {name: stores[name][2][f"{what}_cpu"] for name in stores}
            out[what] = {"one_node_p50": statistics.median(a), "cluster_p50": statistics.median(b),
                         "ratio": statistics.median(b) / statistics.median(a), "ratio_ci95": _bootstrap(a, b),
                         "cluster_4_per_master_p50": statistics.median(b4),
                         "vs_4_per_master": statistics.median(b) / statistics.median(b4),
                         "vs_4_per_master_ci95": _bootstrap(b4, b),
                         "client_cpu_ms_p50": {name: statistics.median(v) for name, v in cpu_of.items()},
                         "client_cpu_vs_4_per_master": statistics.median(cpu_of["cluster"]) / statistics.median(cpu_of["cluster 4/master"]),
                         "client_cpu_vs_4_per_master_ci95": _bootstrap(cpu_of["cluster 4/master"], cpu_of["cluster"]),
                         "servers_cpu_ms_per_call": cpu[what]}
        for st, _, _ in stores.values():
            st.close()
        stores.clear()
        if delay_s:
            out["relayed"] = behind_relays(CLUSTER_SIDES, single, clusters, work, iterations, delay_s)
        return out
    finally:
        for st, _, _ in stores.values():
            st.close()
        for c in clusters.values():
            c.stop()
        single.stop()


def _bootstrap(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """95% interval of median(b) / median(a), resampling the rounds (each round has one of each)."""
    import random

    rnd = random.Random(0)
    k = min(len(a), len(b))
    ratios = []
    for _ in range(n):
        idx = [rnd.randrange(k) for _ in range(k)]
        ratios.append(statistics.median(b[i] for i in idx) / statistics.median(a[i] for i in idx))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n)]


def topologies(server: str, work: Path) -> Iterator[tuple[str, dict[str, Any], Masters, Callable[[], Any]]]:
    single = RedisProc(work / f"{server}-single", appendonly=True, server=server)
    try:
        yield "1 node", {"redis_url": single.url}, Masters([redis.Redis.from_url(single.url)]), lambda: None
    finally:
        single.stop()
    cluster = ClusterProc(work / f"{server}-cluster", server, masters=3, replicas=1)
    try:
        ms = [n.client() for n in cluster.masters()]
        yield "3-master cluster", {"redis_cluster": cluster.seeds[:3], "redis_retry_s": 0.5}, Masters(ms), lambda: cluster
    finally:
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "bench_index"))
    ap.add_argument("--quick", action="store_true", help="4 KiB pages, batches of 16, 5 rounds, one server (a smoke run)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds per configuration (fewer for large batches of large pages)")
    ap.add_argument("--paired", type=int, default=150, help="rounds of the paired latency comparison (0: none)")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="the relays' reply delay in the paired run's last part "
                    "(0: none)")
    ap.add_argument("--only-paired", action="store_true", help="run only the paired comparison (and keep the other results)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-index-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    results: dict[str, Any] = {"stamp": stamp(directory=str(work), server_flags=SERVER_FLAGS), "configs": [], "drills": [], "paired": []}
    servers = ("redis-server",) if a.quick else ("redis-server", "valkey-server")
    out_json = os.path.join(a.out, "bench_index.json")
    if a.only_paired and os.path.exists(out_json):
        with open(out_json) as f:
            kept = json.load(f)
        results.update(configs=kept["configs"], drills=kept["drills"])
        results["stamp"]["configs_from"] = kept["stamp"]
    try:
        for server in servers:
            if a.paired:
                results["paired"].append(paired(server, work, 10 if a.quick else a.paired, a.delay_ms / 1e3))
            if a.only_paired:
                continue
            for topo, cfg, masters, cluster in topologies(server, work):
                cfg = {**cfg, "path": str(work / "pages")}
                os.makedirs(cfg["path"], exist_ok=True)
                for page in ((4 * KiB,) if a.quick else PAGES):
                    for n in ((16,) if a.quick else BATCHES):
                        rounds = 5 if a.quick else max(8, min(a.rounds, (512 * MiB) // (n * page)))
                        r = one_config(cfg, masters, page, n, rounds)
                        r.update(server=server, topology=topo)
                        results["configs"].append(r)
                        print(f"# {server} {topo} {page // KiB} KiB x{n}: commit p50 {r['commit_ms']['p50']:.3f} ms, "
                              f"probe p50 {r['probe_ms']['p50']:.3f} ms", file=sys.stderr)
                c = cluster()
                if c is not None and not a.quick:
                    d = drill(cfg, c)
                    d["server"] = server
                    results["drills"].append(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)
    print(report(results))
    return 0


def report(res: dict[str, Any]) -> str:
    s = res["stamp"]
    lines = [header(s),
             "# server us: SLOWLOG medians per call on the masters; AOF: bytes appended per write batch over the masters;",
             "# probe/commit: client wall ms (p50/p99) of TierStore.exists and of a batch's COMMIT round trip",
             f"{'server':13} {'topology':17} {'page':>7} {'n':>4} {'commit us':>9} {'lease us':>8} {'hmget us':>8} "
             f"{'sweep us':>8} {'AOF B/batch':>11} {'probe p50/p99 ms':>17} {'commit p50/p99 ms':>18}"]
    for r in res["configs"]:
        su = r["server_us"]

        def us(f: str) -> str:
            return f"{su[f]['p50']:.0f}" if f in su else "-"

        page = f"{r['page_bytes'] // KiB} KiB" if r["page_bytes"] < MiB else f"{r['page_bytes'] // MiB} MiB"
        lines.append(f"{r['server']:13} {r['topology']:17} {page:>7} {r['batch']:>4} {us('commit'):>9} {us('lease'):>8} "
                     f"{us('HMGET'):>8} {us('sweep'):>8} {r['aof_bytes_per_write_batch']:>11.0f} "
                     f"{r['probe_ms']['p50']:>8.3f}/{r['probe_ms']['p99']:<8.3f} {r['commit_ms']['p50']:>8.3f}/{r['commit_ms']['p99']:<8.3f}")
    if "configs_from" in s:
        lines.append(f"# the table above: from the run at {s['configs_from']['commit'][:12]} ({s['configs_from']['command']})")
    for p in res.get("paired", []):
        for what in ("probe", "commit"):
            q = p[what]
            lines.append(f"# paired, {p['server']}, {p['iterations']} rounds of 128 pages of 4 KiB: {what} p50 one node "
                         f"{q['one_node_p50']:.3f} ms, cluster {q['cluster_p50']:.3f} ms: {q['ratio']:.2f}x "
                         f"(95% interval {q['ratio_ci95'][0]:.2f}-{q['ratio_ci95'][1]:.2f}x; target 1.5x)")
            if "client_cpu_ms_p50" in q:
                c, sv = q["client_cpu_ms_p50"], q["servers_cpu_ms_per_call"]
                lines.append(f"#   CPU per {'write batch' if what == 'commit' else what}: client thread p50 one node {c['one node']:.3f} ms, cluster "
                             f"{c['cluster']:.3f} ms; servers (mean, idle rate taken out) one node {sv['one node server']:.3f} ms, cluster masters "
                             f"{sv['cluster masters']:.3f} ms, its replicas {sv['cluster replicas']:.3f} ms")
            if "vs_4_per_master" in q:
                c, sv = q["client_cpu_ms_p50"], q["servers_cpu_ms_per_call"]
                ci, cc = q["vs_4_per_master_ci95"], q["client_cpu_vs_4_per_master_ci95"]
                lines.append(f"#   against 4 shards per master ({p['shards']['cluster 4/master']} shards; this layout "
                             f"{p['shards']['cluster']}): {what} p50 {q['cluster_4_per_master_p50']:.3f} ms, ratio "
                             f"{q['vs_4_per_master']:.2f}x ({ci[0]:.2f}-{ci[1]:.2f}x); client thread CPU "
                             f"{c['cluster 4/master']:.3f} ms, ratio {q['client_cpu_vs_4_per_master']:.2f}x ({cc[0]:.2f}-{cc[1]:.2f}x); "
                             f"masters {sv['cluster 4/master masters']:.3f} ms, replicas {sv['cluster 4/master replicas']:.3f} ms")
        if "relayed" in p:
            rl = p["relayed"]
            for what in ("probe", "commit"):
                q = rl[what]
                lines.append(f"# behind relays holding each reply {rl['delay_ms']:g} ms, {p['server']}, {rl['iterations']} rounds: "
                             f"{what} p50 one node {q['p50']['one node']:.2f} ms, cluster {q['p50']['cluster']:.2f} ms "
                             f"({q['ratio']:.2f}x, {q['ratio_ci95'][0]:.2f}-{q['ratio_ci95'][1]:.2f}x; target 1.2x), 4 shards "
                             f"per master {q['p50']['cluster 4/master']:.2f} ms (cluster against it {q['vs_4_per_master']:.2f}x, "
                             f"{q['vs_4_per_master_ci95'][0]:.2f}-{q['vs_4_per_master_ci95'][1]:.2f}x)")
    singles = {(r["server"], r["page_bytes"], r["batch"]): r for r in res["configs"] if r["topology"] == "1 node"}
    lines.append("# cluster / 1 node, client p50, from the table's rows (measured at different times, unpaired):")
    for r in res["configs"]:
        base = singles.get((r["server"], r["page_bytes"], r["batch"]))
        if r["topology"] != "1 node" and base is not None:
            lines.append(f"#   {r['server']:13} {r['page_bytes'] // KiB:>5} KiB x{r['batch']:<4} probe "
                         f"{r['probe_ms']['p50'] / base['probe_ms']['p50']:.2f}x  commit "
                         f"{r['commit_ms']['p50'] / base['commit_ms']['p50']:.2f}x")
    for d in res["drills"]:
        lines.append(f"# failover drill, {d['server']}: {d['dead_shards']} of {d['shards']} shards on the killed master; "
                     f"surviving shards hit {100 * d['surviving_shards_hit_rate']:.1f}% on average until then (worst "
                     f"sample {100 * d['surviving_shards_worst_sample']:.0f}%); every page hits "
                     f"again after {d['hits_back_s'] if d['hits_back_s'] is None else round(d['hits_back_s'], 2)} s "
                     f"(cluster-node-timeout {d['cluster_node_timeout_ms']} ms, redis_retry_s {d['redis_retry_s']}); "
                     f"{d['pages_lost']} of {d['pages']} pages lost")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
