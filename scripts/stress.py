#!/usr/bin/env python3
"""Stress: processes x threads of random set / get / exists / delete / clear on one store, with faults.

    python3 scripts/stress.py --procs 3 --threads 2 --seconds 600 --seed 1 \
        --json scripts/results/stress/stress.json > scripts/results/stress/stress.txt
        (the committed run, about 11 minutes; faults on at their default rates)

Every page's bytes are derived from its key and page size (``page_for``), so every hit is
compared byte for byte with what any writer wrote for that key: a hit that differs is a
wrong page, and the run fails on the first. Each worker process runs its own
``TierStore`` and housekeeping thread (as an SGLang rank does) and ``--threads`` threads of
random batches; keys are skewed so that reads hit and the store evicts. Unless
``--redis-url`` is given the index is the embedded default (a private redis-server with
AOF under ``<path>/redis``), which the supervisor can kill and restart.

Faults, each a Poisson process with the mean interval given (0 turns it off):
  --kill-every     kill -9 of a random worker (whatever it is doing; the flags each thread
                   sets around its store call say whether it was mid-call), restarted at once
  --redis-every    kill -9 of the embedded redis-server, started again from its AOF after
                   0.2-3 s down; the supervisor's own store measures how long after the
                   restart its calls succeed again
  --flip-every     one bit flipped at a random offset of a random stored page, in its page
                   file (the store must then serve a miss, never the rotten bytes)
  --capacity-every capacity set to 50-80% of --capacity-mb for a while (``set_capacity``,
                   evicting down to it), then back; the last 5 s of traffic run at full
                   capacity, so that the final scrub reads a refilled store

At the end the workers stop, every key is read back and verified (a scrub: rotten pages
nobody read are dropped by the read path), the dead workers' leases expire (``--lease-s``)
and ``check()`` must find nothing. Counts come from per-worker report files rewritten
every second: what a killed worker did since its last report is lost (at most a second
of its counts; wrong pages are reported at once). The exit status is non-zero on a wrong
page, an exception other than ``StoreUnavailable`` (the index down or refusing, no store
attached yet) out of a store call, a worker that
died by itself or hung, an entry of the store's own failing its tag, a problem
``check()`` found or a lease left after expiry.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import logging
import mmap
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import xxhash
from tqdm import tqdm


from sglang_tierstore import TierStore, TierStoreConfig
from sglang_tierstore.errors import StoreUnavailable
from sglang_tierstore.config import redact_url
from sglang_tierstore.embedded import ensure_embedded_redis, pid_file
from sglang_tierstore.tools import inspect
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.perms import modes
from sglang_tierstore.store import Namespace

from tierstore_kit.provenance import header, stamp

MiB = 1 << 20
ALIGN = 4096
REFILL_S = 5.0  # the traffic's last seconds run at full capacity (see Run.lower_capacity)
OPS = ("get", "set", "exists", "delete", "clear")
IDLE, IN_WRITE, IN_READ, IN_OTHER = 0, 1, 2, 3  # what a thread is doing, in its busy flag
SAMPLES = 20  # wrong pages and errors kept verbatim per worker
REPORT_S = 1.0

log = logging.getLogger("stress")


# -- the workload -------------------------------------------------------------------


def page_for(key: str, size: int) -> bytes:
    """The only bytes any writer ever writes for ``key`` at this page size."""
    return random.Random(xxhash.xxh3_64_intdigest(f"{size}/{key}".encode())).randbytes(size)


def keys_for(size: int, n: int) -> list[str]:
    """SGLang-like page keys (64 hex digits) of one page size's key space."""
    return [hashlib.sha256(f"{size}/{i}".encode()).hexdigest() for i in range(n)]


@dataclass(frozen=True)
class Workload:
    """What every thread draws its batches from."""

    sizes: tuple[int, ...]
    keys_per_size: tuple[int, ...]
    max_batch: int
    mix: tuple[float, ...]  # weights of OPS

    @classmethod
    def make(cls, sizes: Sequence[int], capacity: int, key_factor: float, max_batch: int, mix: Sequence[float]) -> "Workload":
        """Key spaces of ``key_factor`` times the capacity in all, split evenly by size."""
        share = key_factor * capacity / len(sizes)
        return cls(tuple(sizes), tuple(max(max_batch, int(share // s)) for s in sizes), max_batch, tuple(mix))


def store_config(path: str, redis_url: Optional[str], prefix: str, capacity: int, lease_s: float,
                 retry_s: float, read_timeout_s: float = 0.0) -> dict[str, Any]:
    """The extra_config every process of one run uses."""
    return {"path": path, "redis_url": redis_url, "redis_prefix": prefix, "capacity_gb": capacity / (1 << 30),
            "io_threads": 2, "lease_s": lease_s, "redis_timeout_s": 0.5, "redis_retry_s": retry_s,
            "read_timeout_s": read_timeout_s, "log_interval_s": 30.0}


def namespaces(store: TierStore, sizes: Sequence[int]) -> dict[int, Namespace]:
    return {s: store.namespace({"stress": 1}, s) for s in sizes}


class Tally:
    """One worker process's counts, shared by its threads, and samples of what went wrong."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self.urgent = threading.Event()  # something went wrong: report it now

    def add(self, **kw: int) -> None:
        with self._lock:
            self.counts.update(kw)

    def wrong_page(self, what: str) -> None:
        log.error("WRONG PAGE: %s", what)
        with self._lock:
            self.counts["wrong_pages"] += 1
            if len(self.wrong) < SAMPLES:
                self.wrong.append(what)
        self.urgent.set()

    def error(self, what: str) -> None:
        log.error("unexpected exception: %s", what)
        with self._lock:
            self.counts["unexpected_errors"] += 1
            if len(self.errors) < SAMPLES:
                self.errors.append(what)
        self.urgent.set()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"counts": dict(self.counts), "wrong": list(self.wrong), "errors": list(self.errors)}


class Pages:
    """A thread's page buffers: 4 KiB-aligned slots in an anonymous mapping, so that pages
    whose size is a multiple of 4 KiB go through O_DIRECT as host-pool pages do."""

    def __init__(self, max_batch: int, max_size: int) -> None:
        self.stride = -(-max_size // ALIGN) * ALIGN
        self.buf = mmap.mmap(-1, max_batch * self.stride)

    def views(self, n: int, size: int) -> list[list[memoryview]]:
        m = memoryview(self.buf)
        return [[m[i * self.stride : i * self.stride + size]] for i in range(n)]


def verify(tally: Tally, size: int, keys: Sequence[str], ok: Sequence[bool], views: Sequence[list[memoryview]]) -> int:
    """Compare every hit with its key's bytes; returns the hits."""
    for k, hit, v in zip(keys, ok, views):
        if hit and v[0] != page_for(k, size):
            tally.wrong_page(f"size {size} key {k}: read a hit whose bytes differ from the key's page")
    return sum(ok)


def do_get(store: TierStore, ns: Namespace, keys: Sequence[str], pages: Pages, tally: Tally, busy: Any, t: int) -> None:
    views = pages.views(len(keys), ns.page_bytes)
    for v in views:
        v[0][:] = bytes(ns.page_bytes)  # a hit must bring the bytes: nothing is left from before
    busy[t] = IN_READ
    ok = store.read(ns, keys, views, ns.page_bytes % ALIGN == 0)
    busy[t] = IDLE
    hits = verify(tally, ns.page_bytes, keys, ok, views)
    tally.add(get_batches=1, hits=hits, misses=len(keys) - hits)


def do_set(store: TierStore, ns: Namespace, keys: Sequence[str], pages: Pages, tally: Tally, busy: Any, t: int) -> None:
    views = pages.views(len(keys), ns.page_bytes)
    for k, v in zip(keys, views):
        v[0][:] = page_for(k, ns.page_bytes)
    busy[t] = IN_WRITE
    ok = store.write(ns, keys, views, ns.page_bytes % ALIGN == 0)
    busy[t] = IDLE
    tally.add(set_batches=1, pages_stored=sum(ok), pages_not_stored=len(keys) - sum(ok))


def do_exists(store: TierStore, ns: Namespace, keys: Sequence[str], pages: Pages, tally: Tally, busy: Any, t: int) -> None:
    busy[t] = IN_OTHER
    found = store.exists([(ns, keys)])[0]
    busy[t] = IDLE
    tally.add(exists_calls=1, exists_found=sum(found))


def do_delete(store: TierStore, ns: Namespace, keys: Sequence[str], pages: Pages, tally: Tally, busy: Any, t: int) -> None:
    busy[t] = IN_OTHER
    n = store.delete(ns, keys)
    busy[t] = IDLE
    tally.add(delete_calls=1, pages_deleted=n)


def do_clear(store: TierStore, ns: Namespace, keys: Sequence[str], pages: Pages, tally: Tally, busy: Any, t: int) -> None:
    busy[t] = IN_OTHER
    n = store.clear([ns])
    busy[t] = IDLE
    tally.add(clear_calls=1, pages_cleared=n)


OP_FNS: dict[str, Callable[[TierStore, Namespace, Sequence[str], Pages, Tally, Any, int], None]] = {
    "get": do_get, "set": do_set, "exists": do_exists, "delete": do_delete, "clear": do_clear}


def pick(rnd: random.Random, w: Workload, keys: dict[int, list[str]]) -> tuple[str, int, list[str]]:
    """(op, page size, a run of consecutive keys): starts skewed to the front of the key
    space, so that part of it is hot, as a shared prefix is."""
    op = rnd.choices(OPS, w.mix)[0]
    size = rnd.choice(w.sizes)
    ks = keys[size]
    start = int(len(ks) * rnd.random() ** 2)
    n = rnd.randint(1, w.max_batch)
    return op, size, ks[start : start + n]


def thread_loop(store: TierStore, nss: dict[int, Namespace], w: Workload, keys: dict[int, list[str]], tally: Tally,
                busy: Any, t: int, seed: int, end_at: float) -> None:
    rnd = random.Random(seed)
    pages = Pages(w.max_batch, max(w.sizes))
    while time.time() < end_at:
        op, size, ks = pick(rnd, w, keys)
        try:
            OP_FNS[op](store, nss[size], ks, pages, tally, busy, t)
        except StoreUnavailable:
            tally.add(index_unavailable=1)
            time.sleep(0.01)  # the breaker answers at once: do not spin
        except Exception as e:
            tally.error(f"{op}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            busy[t] = IDLE


@dataclass(frozen=True)
class Job:
    """What one worker process (one life of a worker slot) is told."""

    slot: int
    life: int
    cfg: dict[str, Any]
    url: str
    workload: Workload
    threads: int
    seed: int
    end_at: float  # time.time()
    report: str


def write_report(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def run_worker(job: Job, busy: Any) -> None:
    """A worker process: a store, its housekeeping, ``job.threads`` threads of batches,
    and a report of its counts every second."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s w{job.slot}.{job.life} %(message)s")
    store = TierStore(TierStoreConfig.from_dict(job.cfg), job.url)
    store.start_housekeeping()
    nss = namespaces(store, job.workload.sizes)
    keys = {s: keys_for(s, n) for s, n in zip(job.workload.sizes, job.workload.keys_per_size)}
    tally = Tally()
    threads = [threading.Thread(target=thread_loop, args=(store, nss, job.workload, keys, tally, busy, t,
                                                           job.seed * 1000 + t, job.end_at)) for t in range(job.threads)]
    for th in threads:
        th.start()

    def report() -> None:
        write_report(job.report, {**tally.snapshot(), "metrics": store.metrics.snapshot()})

    while any(th.is_alive() for th in threads):
        report()
        tally.urgent.wait(REPORT_S)
        tally.urgent.clear()
    store.space.housekeeping.stop()
    store.close()
    report()


# -- faults -------------------------------------------------------------------------


class EmbeddedRedis:
    """The embedded redis-server of a store directory, which the supervisor kills and restarts."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.url = ensure_embedded_redis(path, modes("private")).url

    def pid(self) -> int:
        with open(pid_file(self.path)) as f:
            return int(f.read())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        pid = self.pid()
        os.kill(pid, sig)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # not our child: wait for it to be gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)
        raise RuntimeError(f"redis-server {pid} did not exit")

    def start(self) -> None:
        ensure_embedded_redis(self.path, modes("private"))


def flip_bit(path: str, offset: int, bit: int) -> None:
    """Bit rot: one bit of a page file changes under the store."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


def scrub(store: TierStore, nss: dict[int, Namespace], keys: dict[int, list[str]], tally: Tally, batch: int = 64) -> None:
    """Read back and verify every stored key of the key space (pages that fail
    verification are dropped by the read, as any read would)."""
    for size, ns in nss.items():
        ks = keys[size]
        present = []
        for i in range(0, len(ks), 1024):
            part = ks[i : i + 1024]
            present += [k for k, found in zip(part, store.exists([(ns, part)])[0]) if found]
        pages = Pages(batch, size)
        for i in range(0, len(present), batch):
            part = present[i : i + batch]
            views = pages.views(len(part), size)
            ok = store.read(ns, part, views, size % ALIGN == 0)
            tally.add(scrub_present=len(part), scrub_hits=verify(tally, size, part, ok, views))


# -- the supervisor -----------------------------------------------------------------


@dataclass
class Worker:
    proc: Any  # multiprocessing Process
    busy: Any  # multiprocessing Array of per-thread flags
    life: int
    killed: bool = False


PHASES = ("warm-up", "steady", "capacity cut", "index restart")


class Phases:
    """Where the pages not stored went wrong, by phase of the run: ``warm-up`` until the
    store first evicts (it is full), ``capacity cut`` while capacity is lowered and for
    ``lease_s`` after it is back (regions drain while writers hold slots there), ``index
    restart`` for the samples that cover a Redis kill, ``steady`` the rest. Sampled about
    every second from the workers' reports (counts a killed worker had not reported yet
    are lost, as everywhere in this run)."""

    CAUSES = ("full", "too_big", "unreached", "file_unready", "io_error", "io_timeout", "file_gone", "refused", "detached")
    # pages of write calls that raised (StoreUnavailable: the index down, no store attached): counted by the store,
    # never offered in the tally
    FIELDS = ("pages_stored", "pages_not_stored", "write_raised", "write_not_attached", *(f"write_{c}" for c in CAUSES))

    def __init__(self) -> None:
        self.totals = {p: Counter[str]() for p in PHASES}
        self.seconds: Counter[str] = Counter()
        self._last: Counter[str] = Counter()
        self._at = time.time()

    def sample(self, phase: str, counts: Counter[str], metrics: Counter[str]) -> None:
        now = {k: (counts if k.startswith("pages_") else metrics)[k] for k in self.FIELDS}
        for k in self.FIELDS:
            self.totals[phase][k] += max(0, now[k] - self._last[k])
        self._last = Counter(now)
        t = time.time()
        self.seconds[phase] += t - self._at
        self._at = t

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per phase: pages offered, not stored, and each cause the store counted for them
        (its ``write`` outcomes), and the pages of write calls that raised; ``unattributed``
        is what no cause covers: above 0 a cause the store does not count, below 0 only a
        write that ended between a worker's report of its tally and of its metrics."""
        out = {}
        for p in PHASES:
            c = self.totals[p]
            offered = c["pages_stored"] + c["pages_not_stored"]
            causes = {k: c[f"write_{k}"] for k in self.CAUSES}
            out[p] = {"seconds": round(self.seconds[p], 1), "pages_offered": offered,
                      "not_stored": c["pages_not_stored"], "causes": causes, "no_slot": causes["full"],
                      "raised": c["write_raised"] + c["write_not_attached"],
                      "unattributed": c["pages_not_stored"] - sum(causes.values()),
                      "no_slot_share": round(causes["full"] / offered, 5) if offered else None}
        return out


class Run:
    """Starts and restarts workers, injects faults, gathers reports, checks the store."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rnd = random.Random(a.seed)
        self.capacity = a.capacity_mb * MiB
        self.current_capacity = self.capacity
        self.dir = a.path or tempfile.mkdtemp(prefix="tierstore-stress-")
        self.reports_dir = os.path.join(self.dir, "reports")
        os.makedirs(self.reports_dir, exist_ok=True)
        self.redis = None if a.redis_url else EmbeddedRedis(os.path.join(self.dir, "store"))
        self.url: str = self.redis.url if self.redis else a.redis_url
        self.workload = Workload.make(a.page_sizes, self.capacity, a.key_factor, a.max_batch, a.mix)
        self.cfg = store_config(os.path.join(self.dir, "store"), a.redis_url, "stress-" + os.urandom(4).hex(),
                                self.capacity, a.lease_s, a.redis_retry_s, a.read_timeout_s)
        self.ctx = mp.get_context("forkserver")
        self.workers: dict[int, Worker] = {}
        self.faults: Counter[str] = Counter()
        self.redis_recovery_s: list[float] = []  # from Redis serving again to this process's store answering
        self.redis_loading_s: list[float] = []  # from listening to serving (loading the AOF)
        self.end_at = 0.0
        self.store = TierStore(TierStoreConfig.from_dict(self.cfg), self.url)
        self.nss = namespaces(self.store, self.workload.sizes)
        self.keys = {s: keys_for(s, n) for s, n in zip(self.workload.sizes, self.workload.keys_per_size)}
        means = {"kill": a.kill_every, "redis": a.redis_every, "flip": a.flip_every, "capacity": a.capacity_every}
        self.means = {k: v for k, v in means.items() if v > 0}
        self.next_at: dict[str, float] = {}
        self.capacity_back_at = 0.0
        self.cut_settled_at = 0.0  # a cut's effects (regions draining) last until then
        self.restarted = False  # a Redis restart since the last sample
        self.phases = Phases()

    # workers

    def start_worker(self, slot: int) -> None:
        life = self.workers[slot].life + 1 if slot in self.workers else 0
        busy = self.ctx.Array("b", self.a.threads, lock=False)
        cfg = {**self.cfg, "capacity_gb": self.current_capacity / (1 << 30)}
        job = Job(slot, life, cfg, self.url, self.workload, self.a.threads, self.a.seed * 100_000 + slot * 1000 + life,
                  self.end_at, os.path.join(self.reports_dir, f"w{slot}-{life}.json"))
        p = self.ctx.Process(target=run_worker, args=(job, busy), name=f"stress-w{slot}.{life}", daemon=True)
        p.start()
        self.workers[slot] = Worker(p, busy, life)

    def reap(self) -> None:
        """Restart workers that died (killed by us, or by themselves: a failure)."""
        for slot, w in list(self.workers.items()):
            if w.proc.is_alive() or time.time() >= self.end_at:
                continue
            w.proc.join()
            if not w.killed:
                self.faults["worker_crashes"] += 1
                log.error("worker %d.%d exited by itself with status %s", slot, w.life, w.proc.exitcode)
            self.start_worker(slot)

    def kill_worker(self) -> None:
        slot = self.rnd.choice(sorted(self.workers))
        w = self.workers[slot]
        if not w.proc.is_alive():
            return
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.join()
        w.killed = True
        flags = list(w.busy)
        self.faults["worker_kills"] += 1
        self.faults["worker_kills_mid_call"] += any(flags)
        self.faults["worker_kills_mid_write"] += IN_WRITE in flags
        self.reap()

    # faults

    def restart_redis(self) -> None:
        """kill -9, a while down, start from the AOF; then time how long Redis takes to
        serve (loading its AOF) and how long after that this process's store is back."""
        assert self.redis is not None
        self.redis.kill()
        self.faults["redis_kills"] += 1
        self.restarted = True
        time.sleep(self.rnd.uniform(0.2, 3.0))
        self.redis.start()
        listening = time.monotonic()
        probe = RedisIndex(self.url, 0.5, 0.001)
        serving = self.until(lambda: probe.hlen("stress-probe"))
        probe.close()
        ns = self.nss[self.workload.sizes[0]]
        back = self.until(lambda: self.store.exists([(ns, self.keys[ns.page_bytes][:1])]))
        if serving is None or back is None:
            self.faults["redis_not_recovered"] += 1
            return
        self.redis_loading_s.append(serving - listening)
        self.redis_recovery_s.append(back - serving)

    @staticmethod
    def until(call: Callable[[], object], limit_s: float = 60) -> Optional[float]:
        """When ``call`` first returns without StoreUnavailable (monotonic), or None."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                call()
                return time.monotonic()
            except StoreUnavailable:
                time.sleep(0.01)
        return None

    def flip(self) -> None:
        """Flip a bit of a page that is stored now (found among hot keys)."""
        size = self.rnd.choice(self.workload.sizes)
        ns = self.nss[size]
        hot = self.keys[size][: len(self.keys[size]) // 2]
        candidates = self.rnd.sample(hot, min(64, len(hot)))
        try:
            stored = [k for k, f in zip(candidates, self.store.exists([(ns, candidates)])[0]) if f]
            where = inspect.where(self.store, ns, self.rnd.choice(stored)) if stored else None
        except StoreUnavailable:
            return
        if where is not None:
            path, offset, _ = where
            flip_bit(path, offset + self.rnd.randrange(size), self.rnd.randrange(8))
            self.faults["bit_flips"] += 1

    def lower_capacity(self) -> None:
        """A cut ends ``REFILL_S`` before the traffic does, and none starts later: a store
        kept at half its capacity to the end can hold nothing at all (writers' stocks and
        regions draining for ``--lease-s`` take all of it), which says nothing about the
        store, and the final scrub is meant to read a store refilled at its capacity."""
        last = self.end_at - REFILL_S
        if self.capacity_back_at or time.time() >= last:
            return
        cap = int(self.capacity * self.rnd.uniform(0.5, 0.8))
        if self.set_capacity(cap):
            self.faults["capacity_lowered"] += 1
            self.capacity_back_at = min(last, time.time() + self.rnd.uniform(3, 15))

    def set_capacity(self, cap: int) -> bool:
        try:
            self.store.space.set_capacity(cap)
        except StoreUnavailable:
            return False
        self.current_capacity = cap
        return True

    def inject(self) -> None:
        now = time.time()
        if self.capacity_back_at and now >= self.capacity_back_at and self.set_capacity(self.capacity):
            self.capacity_back_at = 0.0
            self.cut_settled_at = time.time() + self.a.lease_s
        inject = {"kill": self.kill_worker, "redis": self.restart_redis, "flip": self.flip, "capacity": self.lower_capacity}
        for fault, at in list(self.next_at.items()):
            if now >= at:
                inject[fault]()
                self.next_at[fault] = time.time() + self.rnd.expovariate(1 / self.means[fault])

    # reports

    def reports(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(glob.glob(os.path.join(self.reports_dir, "w*.json"))):
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError), open(p) as f:
                out.append(json.load(f))
        return out

    def totals(self) -> tuple[Counter[str], Counter[str], list[str], list[str]]:
        counts: Counter[str] = Counter()
        metrics: Counter[str] = Counter()
        wrong: list[str] = []
        errors: list[str] = []
        for r in self.reports():
            counts.update(r["counts"])
            metrics.update(r["metrics"])
            wrong += r["wrong"]
            errors += r["errors"]
        return counts, metrics, wrong, errors

    # the run

    def traffic(self) -> None:
        """The timed part: workers running, faults injected, progress shown."""
        start = time.time()
        self.end_at = start + self.a.seconds
        self.store.start_housekeeping()
        for slot in range(self.a.procs):
            self.start_worker(slot)
        self.next_at = {f: start + self.rnd.expovariate(1 / m) for f, m in self.means.items()}
        with tqdm(total=self.a.seconds, unit="s", file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 30,
                  bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}") as bar:
            shown = sampled = 0.0
            while time.time() < self.end_at:
                self.reap()
                self.inject()
                time.sleep(0.1)
                if time.time() - sampled >= 1:
                    sampled = time.time()
                    counts, metrics, _, _ = self.totals()
                    self.phases.sample(self.phase(metrics), counts, metrics)
                bar.update(min(self.a.seconds, time.time() - start) - bar.n)
                if time.time() - shown >= 5:
                    shown = time.time()
                    bar.set_postfix_str(self.progress())

    def phase(self, metrics: Counter[str]) -> str:
        """The phase the last second belongs to (see :class:`Phases`)."""
        if self.restarted:
            self.restarted = False
            return "index restart"
        if self.capacity_back_at or time.time() < self.cut_settled_at:
            return "capacity cut"
        return "steady" if metrics["evicted"] else "warm-up"

    def progress(self) -> str:
        counts = self.totals()[0]
        faults = sum(self.faults[k] for k in ("worker_kills", "redis_kills", "bit_flips", "capacity_lowered"))
        return (f"batches {counts['get_batches'] + counts['set_batches']:,} hits {counts['hits']:,} faults {faults} "
                f"wrong {counts['wrong_pages']}")

    def wind_down(self) -> None:
        """Workers finish their batch and exit; the index is back; capacity as configured."""
        if self.redis is not None:
            self.redis.start()
        for slot, w in self.workers.items():
            w.proc.join(timeout=30 + 2 * self.a.lease_s)
            if w.proc.is_alive():
                self.faults["worker_hung"] += 1
                log.error("worker %d.%d did not finish: killed", slot, w.life)
                w.proc.kill()
                w.proc.join()
            elif w.proc.exitcode != 0:
                self.faults["worker_crashes"] += 1
        self.store.space.housekeeping.stop()
        self.wait_for_index()
        self.store.space.set_capacity(self.capacity)

    def wait_for_index(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                inspect.usage(self.store)
                return
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def final_check(self) -> dict[str, Any]:
        """Scrub, let the dead workers' leases expire, then ``check()``."""
        tally = Tally()
        scrub(self.store, self.nss, self.keys, tally)
        deadline = time.monotonic() + 3 * self.a.lease_s + 30
        while True:
            self.store.space.housekeeping.run_once(audit=True)
            leases = inspect.usage(self.store)["leases"]
            if leases == 0 or time.monotonic() > deadline:
                break
            time.sleep(min(1.0, self.a.lease_s / 4))
        problems = inspect.check(self.store)
        return {**tally.snapshot(), "leases_left": leases, "check_problems": problems}

    def close(self) -> None:
        self.store.close()
        if self.redis is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self.redis.kill(signal.SIGTERM)
        if not self.a.path and not self.a.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def median_and_max(xs: Sequence[float]) -> Optional[dict[str, float]]:
    return {"median": round(sorted(xs)[len(xs) // 2], 3), "max": round(max(xs), 3)} if xs else None


def summarize(run: Run, final: dict[str, Any], seconds: float) -> dict[str, Any]:
    counts, metrics, wrong, errors = run.totals()
    counts.update(final["counts"])
    metrics.update(run.store.metrics.snapshot())
    wrong += final["wrong"]
    faults = {k: run.faults[k] for k in ("worker_kills", "worker_kills_mid_call", "worker_kills_mid_write", "redis_kills",
                                         "bit_flips", "capacity_lowered", "worker_crashes", "worker_hung", "redis_not_recovered")}
    by_phase = run.phases.summary()
    failures = {
        "wrong_pages": counts["wrong_pages"],
        "unexpected_errors": counts["unexpected_errors"],
        "worker_crashes": run.faults["worker_crashes"],
        "worker_hung": run.faults["worker_hung"],
        "redis_not_recovered": run.faults["redis_not_recovered"],
        "check_problems": len(final["check_problems"]),
        "leases_left": final["leases_left"],
        "forged_entries": metrics["error_forged"],  # our own entries failing their tag: a bug, even as a miss
        # a page not stored that the store gave no cause for: an outcome the engine does not count
        "unattributed_pages": sum(max(0, x["unattributed"]) for x in by_phase.values()),
    }
    warm = [x for p, x in by_phase.items() if p != "warm-up"]
    warm_offered = sum(x["pages_offered"] for x in warm)
    return {
        "stamp": stamp(directory=run.dir,
                       server_flags=["embedded default: redis-server on a unix socket, AOF everysec"] if not run.a.redis_url else []),
        "args": {k: v for k, v in vars(run.a).items() if k != "json"},
        "redis": redact_url(run.url),
        "workload": asdict(run.workload),
        "seconds": round(seconds, 1),
        "operations": {k: counts[k] for k in ("get_batches", "set_batches", "exists_calls", "delete_calls", "clear_calls")},
        "pages": {k: counts[k] for k in ("pages_stored", "pages_not_stored", "hits", "misses", "pages_deleted", "pages_cleared",
                                         "exists_found")},
        "index_unavailable": counts["index_unavailable"],
        "store_metrics": {k: metrics[k] for k in sorted(metrics)},
        "evicted_regions": metrics["evicted"],
        "evicted_pages": metrics["pages_evicted"],
        "pages_failed_verification": metrics["error_corrupt"],
        "faults": faults,
        "redis_restarts": {"loading_s": median_and_max(run.redis_loading_s), "store_back_s": median_and_max(run.redis_recovery_s),
                           "bound_s": 2 * run.a.redis_retry_s},
        "scrub": {"present": counts["scrub_present"], "verified": counts["scrub_hits"]},
        "not_stored_by_phase": by_phase,
        "no_slot_share_once_warm": round(sum(x["no_slot"] for x in warm) / warm_offered, 5) if warm_offered else None,
        "failures": failures,
        "ok": not any(failures.values()),
        "wrong_samples": wrong[:SAMPLES],
        "error_samples": errors[:SAMPLES],
        "check_problems": final["check_problems"][:50],
        "note": ("counts of a killed worker since its last report (at most 1 s) are lost; a wrong page or an "
                 "unexpected exception is reported at once"),
    }


def table(s: dict[str, Any]) -> str:
    ops, pages, f, r, fail = s["operations"], s["pages"], s["faults"], s["redis_restarts"], s["failures"]
    restarts = "-" if not f["redis_kills"] else (
        f"serving after {r['loading_s']['median']} s (max {r['loading_s']['max']} s) of loading its AOF; the "
        f"supervisor's store answering {r['store_back_s']['median']} s (max {r['store_back_s']['max']} s) after that "
        f"(2 x redis_retry_s = {r['bound_s']} s)")
    rows = [
        ("command", f"{s['stamp']['command']} (at {s['stamp']['commit'][:12]}{', dirty' if s['stamp']['dirty'] else ''})"),
        ("run", (f"{s['seconds']:.0f} s, {s['args']['procs']} processes x {s['args']['threads']} threads, page sizes "
                 f"{', '.join(map(str, s['workload']['sizes']))}, capacity {s['args']['capacity_mb']} MiB")),
        ("operations", (f"{sum(ops.values()):,} (get {ops['get_batches']:,}, set {ops['set_batches']:,}, exists "
                        f"{ops['exists_calls']:,}, delete {ops['delete_calls']:,}, clear {ops['clear_calls']:,})")),
        ("pages written", (f"{pages['pages_stored']:,} stored, {pages['pages_not_stored']:,} not stored; once warm "
                           f"{100 * (s['no_slot_share_once_warm'] or 0):.3f}% of the pages offered found no slot (every "
                           "region pinned by writers' stocks or draining; target at most 1%)")),
        ("pages read", f"{pages['hits']:,} hits (each verified byte for byte), {pages['misses']:,} misses"),
        *((f"  {p}", (f"{x['seconds']:.0f} s: {x['pages_offered']:,} pages offered, {x['not_stored']:,} not stored: "
                      + ", ".join(f"{n:,} {c}" for c, n in x["causes"].items() if n)
                      + (", " if any(x["causes"].values()) else "") + f"{x['unattributed']:,} unattributed; "
                      f"{x['raised']:,} more in calls that raised; "
                      f"{100 * (x['no_slot_share'] or 0):.2f}% of those offered found no slot"))
          for p, x in s["not_stored_by_phase"].items()),
        ("evictions", f"{s['evicted_regions']:,} regions, {s['evicted_pages']:,} pages"),
        ("faults", (f"{f['worker_kills']} worker kill -9s ({f['worker_kills_mid_call']} mid-call, "
                    f"{f['worker_kills_mid_write']} mid-write), {f['redis_kills']} Redis kill -9s and restarts, "
                    f"{f['bit_flips']} bit flips, {f['capacity_lowered']} capacity cuts")),
        ("Redis restarts", restarts),
        ("StoreUnavailable", f"{s['index_unavailable']:,} calls (the index down or refusing, or no store attached)"),
        ("failed verification", f"{s['pages_failed_verification']:,} pages (misses, dropped)"),
        ("final scrub", f"{s['scrub']['verified']:,} of {s['scrub']['present']:,} stored pages verified, the rest misses"),
        ("wrong pages", str(fail["wrong_pages"])),
        ("unexpected exceptions", str(fail["unexpected_errors"])),
        ("workers crashed / hung", f"{fail['worker_crashes']} / {fail['worker_hung']}"),
        ("leases left after expiry", str(fail["leases_left"])),
        ("entries failing their tag", str(fail["forged_entries"])),
        ("check() problems", str(fail["check_problems"])),
        ("result", "OK" if s["ok"] else "FAILED"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=3, help="worker processes")
    ap.add_argument("--threads", type=int, default=2, help="threads per worker process")
    ap.add_argument("--seconds", type=float, default=60, help="length of the traffic phase")
    ap.add_argument("--page-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[4096, 20000, 65536],
                    help="comma-separated page sizes in bytes (sizes not a multiple of 4 KiB use buffered I/O)")
    ap.add_argument("--capacity-mb", type=int, default=64)
    ap.add_argument("--key-factor", type=float, default=2.0, help="key space, as a multiple of the capacity")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--mix", type=lambda v: [float(x) for x in v.split(",")], default=[45, 35, 15, 4.9, 0.1],
                    help=f"weights of {', '.join(OPS)}")
    ap.add_argument("--kill-every", type=float, default=10.0, help="mean seconds between worker kill -9s (0: off)")
    ap.add_argument("--redis-every", type=float, default=45.0, help="mean seconds between Redis kill -9s (0: off)")
    ap.add_argument("--flip-every", type=float, default=2.0, help="mean seconds between bit flips (0: off)")
    ap.add_argument("--capacity-every", type=float, default=30.0, help="mean seconds between capacity cuts (0: off)")
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--redis-retry-s", type=float, default=0.5)
    ap.add_argument("--read-timeout-s", type=float, default=0.0,
                    help="the stores' read_timeout_s (>0: reads staged through the I/O threads' own memory)")
    ap.add_argument("--redis-url", help="an existing Redis for the index (default: the embedded one, which can be killed)")
    ap.add_argument("--path", help="store directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    if a.redis_url and a.redis_every > 0:
        ap.error("--redis-every kills the embedded Redis: with --redis-url, pass --redis-every 0")
    if len(a.mix) != len(OPS) or any(x < 0 for x in a.mix) or not sum(a.mix):
        ap.error(f"--mix: {len(OPS)} non-negative weights ({', '.join(OPS)})")
    if a.procs < 1 or a.threads < 1 or a.seconds <= 0 or a.capacity_mb < 4 or not a.page_sizes or min(a.page_sizes) < 1:
        ap.error("--procs, --threads, --seconds, --page-sizes and --capacity-mb (>= 4) must be positive")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s supervisor %(message)s")
    run = Run(a)
    try:
        t0 = time.time()
        run.traffic()
        run.wind_down()
        final = run.final_check()
        s = summarize(run, final, time.time() - t0)
    finally:
        run.close()
    print(header(s["stamp"]))
    print(table(s))
    for what in ("wrong_samples", "error_samples", "check_problems"):
        for line in s[what][:5]:
            print(f"{what}: {line.splitlines()[0]}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
