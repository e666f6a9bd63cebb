"""The index is laid out for Redis (and Valkey) Cluster: every function declares every key it
touches, the keys of one call share one hash tag, and the whole engine runs on a cluster
node: each on redis-server and valkey-server. check() streams the store in bounded calls
and leaves live traffic alone."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import xxhash
from monitor import Monitor, monitor_args
from tierstore_kit.engine import MiB, engine, housekeep, keys, pages, read, views
from tierstore_kit.servers import RedisProc, free_cluster_port

from sglang_tierstore import TierStore
from sglang_tierstore.tools import inspect
from sglang_tierstore.schema import entry_fields, shard_of
from sglang_tierstore.space.attach import lock_key
from sglang_tierstore.space.attachment import by_shard
from sglang_tierstore.space.library import LIBRARY

# Commands the functions may issue, all with exactly one key, right after the command name.
ONE_KEY = {"HGET", "HSTRLEN", "HSET", "HMGET", "HDEL", "HSETNX", "HEXISTS", "HGETALL", "HLEN", "HINCRBY", "ZADD", "ZREM",
           "ZRANGE", "ZRANGEBYSCORE", "ZSCORE", "ZCARD", "GET", "DEL"}


def _calls(lines: list[str]) -> Iterator[tuple[str, list[str], list[list[str]]]]:
    """(function, declared keys, commands it ran) per FCALL."""
    current: tuple[str, list[str], list[list[str]]] | None = None
    for ln in lines:
        args = monitor_args(ln)
        if "[0 lua]" in ln:
            assert current is not None, ln
            current[2].append(args)
            continue
        if current is not None:
            yield current
            current = None
        if args and args[0].upper() == "FCALL":
            n = int(args[2])
            current = (args[1], args[3 : 3 + n], [])
    if current is not None:
        yield current


def _tag(key: str) -> str:
    return key[key.index("{") + 1 : key.index("}")]


def workload(st: TierStore, later: list[float], tmp: str) -> None:
    """Every function of the library: writes with inline eviction, reads, drops, a repair
    by check, a shrink that drains a writer's region, expiry, a new and a lost file,
    clear (and release, at close)."""
    ns = st.namespace({"m": 1}, 64 * 1024)
    src = pages(96, 64 * 1024, 1)
    ks = keys(96, "w")
    for i in range(0, 96, 8):
        st.write(ns, ks[i : i + 8], views(src[i : i + 8]), False)
        housekeep(st)
    read(st, ns, ks[-8:])
    where = inspect.where(st, ns, ks[-1])
    assert where is not None
    with open(where[0], "r+b") as f:  # a rotten page: the read drops it
        f.seek(where[1])
        f.write(b"\xff" * 16)
    read(st, ns, ks[-1:])
    a = st.space.attached()
    field = entry_fields(ns.ns_id, ks[-2:-1])[0]
    st.index.hset(a.key(shard_of(field, a.geometry.shards), "entries"), {field: b"junk"})  # type: ignore[dict-item]
    read(st, ns, ks[-2:-1])  # dropped unread: its slot's member is left without an entry...
    inspect.check(st, fix=True)  # ...which check repairs
    assert st.write(ns, keys(2, "stock"), views(src[:2]), False) == [True] * 2  # its commit restocks from free regions
    assert inspect.usage(st)["leases"] >= 1
    st.space.set_capacity(0)  # even the region of our stock goes: it drains, and the idle stock gives its slots back
    housekeep(st)
    st.space.set_capacity(2 * MiB)
    later[0] += 3600  # every lease expires
    housekeep(st)
    for i in range(0, 24, 8):
        st.write(ns, ks[i : i + 8], views(src[i : i + 8]), False)
    os.unlink(sorted(p for d, _, n in os.walk(tmp) for p in (os.path.join(d, x) for x in n) if p.endswith(".pages"))[0])
    files = st.space.attached().pages
    for n in files.open_files():  # reopened on the next read: it finds the file gone
        files.forget(n)
    read(st, ns, ks[:24])
    housekeep(st)
    inspect.check(st, fix=True)
    st.clear([ns])
    assert not st.index.extend_if(lock_key(st.cfg.redis_prefix), "not its holder", 1000)  # (an attach renews past RENEW_S)


@pytest.mark.parametrize("shards", [1, 2])
def test_every_function_declares_every_key_it_touches(tmp_path: Path, private_server: RedisProc, shards: int) -> None:
    later = [0.0]
    st = engine({"path": str(tmp_path / "s"), "redis_url": private_server.url, "redis_prefix": "lay",
                 "capacity_gb": 4 * MiB / (1 << 30), "index_shards": shards, "lease_s": 5, "free_target": 0.25},
                clock=lambda: time.time() + later[0])
    mon = Monitor(private_server.port)
    try:
        workload(st, later, str(tmp_path / "s"))
    finally:
        st.close()
    seen_functions: set[str] = set()
    seen_cmds: set[str] = set()
    for function, declared, cmds in _calls(mon.lines()):
        seen_functions.add(function.removeprefix(LIBRARY.name + "_"))
        assert len({_tag(k) for k in declared}) == 1, f"keys of one call under several hash tags: {declared}"
        for c in cmds:
            name = c[0].upper()
            seen_cmds.add(name)
            assert name in ONE_KEY, f"{function} ran {c[:2]}: extend ONE_KEY if it takes one key"
            assert c[1] in declared, f"{name} {c[1]} is not in {function}'s KEYS {declared}"
    assert seen_functions == set(LIBRARY.scripts)  # every function of the library ran
    assert {"HSET", "HDEL", "ZADD", "HMGET"} <= seen_cmds


@pytest.fixture
def cluster_node(tmp_path: Path, server: str) -> Iterator[int]:
    """A redis-server (or valkey-server) in cluster mode owning every hash slot: scripts
    touching keys of two slots fail there with CROSSSLOT, as on a real cluster."""
    import redis

    for attempt in range(3):  # a port can be taken between free_cluster_port() and the bind
        port = free_cluster_port()
        d = tmp_path / f"cluster{attempt}"
        d.mkdir()
        log = d / "redis.log"
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
                                 "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                 "--logfile", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                r.ping()
                break
            except redis.RedisError:
                time.sleep(0.05)
        else:
            proc.kill()
            proc.wait()
            continue
        try:
            r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            while b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            yield port
            return
        finally:
            proc.kill()
            proc.wait()
    raise AssertionError(f"no cluster node started; last log:\n{log.read_text() if log.exists() else '(none)'}")


def test_the_engine_runs_on_a_redis_cluster_node(tmp_path: Path, cluster_node: int) -> None:
    later = [0.0]
    cfg = {"path": str(tmp_path / "s"), "redis_url": f"redis://127.0.0.1:{cluster_node}/0", "redis_prefix": "cl",
           "capacity_gb": 4 * MiB / (1 << 30), "index_shards": 3, "lease_s": 5, "free_target": 0.25}
    st = engine(cfg, clock=lambda: time.time() + later[0])
    try:
        workload(st, later, str(tmp_path / "s"))
        ns = st.namespace({"m": 2}, 4096)
        src = pages(64, 4096, 2)
        assert st.write(ns, keys(64, "c"), views(src), False) == [True] * 64
        ok, got = read(st, ns, keys(64, "c"))
        assert ok == [True] * 64 and got == src
        assert inspect.check(st) == []
        assert st.stats().get("error_internal", 0) == 0
    finally:
        st.close()
    st = engine({**cfg, "capacity_gb": 64 * MiB / (1 << 30)})  # a re-format drops keys of every slot
    st.close()


def test_check_streams_in_bounded_calls_and_leaves_traffic_alone(tmp_path: Path, private_redis: RedisProc) -> None:
    cfg = {"path": str(tmp_path / "s"), "redis_url": private_redis.url, "redis_prefix": "chk-" + uuid.uuid4().hex[:6],
           "capacity_gb": 96 * MiB / (1 << 30), "io_threads": 2}
    st = engine(cfg)
    ns = st.namespace({"m": 1}, 4096)
    page = pages(1, 4096, 3)[0]
    n = 20000
    for i in range(0, n, 500):  # 20,000 entries
        assert all(st.write(ns, keys(n, "p")[i : i + 500], views([page] * 500), False))
    errors: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        other = engine(cfg)
        try:
            j = 0
            while not stop.is_set():
                ks = keys(8, f"t{j}")
                other.write(ns, ks, views([page] * 8), False)
                ok, got = read(other, ns, ks)
                errors.extend(f"wrong bytes {k}" for k, good, b in zip(ks, ok, got) if good and b != page)
                j += 1
            errors.extend(f"{k}={v}" for k, v in other.stats().items() if k.startswith("error_"))
        finally:
            other.close()

    mon = Monitor(private_redis.port)
    t = threading.Thread(target=traffic)
    t.start()
    try:
        problems = inspect.check(st, verify_pages=False)
    finally:
        stop.set()
        t.join()
        st.close()
    assert problems == [] and errors == []
    biggest = 0
    calls = 0
    snapshots = {LIBRARY.function("snapshot_regions"), LIBRARY.function("snapshot_entries")}
    for ln in mon.lines():
        args = monitor_args(ln)
        if "lua]" in ln or not args:
            continue
        name = args[0].upper()
        if name == "HSCAN" or (name == "FCALL" and args[1] in snapshots):
            calls += 1
            biggest = max(biggest, len(args))
            if name == "HSCAN":
                assert int(args[args.index("COUNT") + 1]) <= 256
    assert calls > n // 256  # streamed: many small calls...
    assert biggest <= 2 * 256 + 15  # ...none over the whole store (HSCAN COUNT is a hint: whole buckets come back)


def test_a_batch_splits_by_the_shard_its_pages_hash_to() -> None:
    """The layout every stored page was placed by: shard = xxh3-64 of its entry field modulo
    the shards (a change would strand every store's pages). A batch is split by it, each
    position once, shards in order."""
    fields = entry_fields(b"ns-id-16-bytes!!", keys(300, "split"))
    for shards in (1, 3, 12):
        parts = by_shard(fields, shards)
        assert list(parts) == sorted(parts) and sorted(i for p in parts.values() for i in p) == list(range(300))
        assert all(xxhash.xxh3_64_intdigest(fields[i]) % shards == s for s, p in parts.items() for i in p)
        assert all(shard_of(fields[i], shards) == s for s, p in parts.items() for i in p)
