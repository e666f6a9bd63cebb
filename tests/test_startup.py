"""Start-up and recovery ride out what a cache should: an index at maxmemory, a full disk,
an embedded index that died on a full disk or on a corrupt AOF. Through SGLang's loader
with real host pools, real servers and real full filesystems (small tmpfs mounts: these
tests need root, as the suite's FUSE tests do)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from tierstore_kit.servers import RedisProc, wait_for
from tierstore_kit.mounts import fill_disk, tmpfs
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.embedded import (AOF_ASIDE, AOF_DIR, embedded_running, join_embedded_redis, pid_file, redis_dir,
                                       stop_embedded_redis)
from sglang_tierstore.errors import ConfigError
from sglang_tierstore.tools import inspect

MiB = 1 << 20


def fill_index(r: redis.Redis) -> None:
    """The Redis (noeviction) at its maxmemory, and past it: writes refused for sure."""
    r.set("junk", b"x" * (1 << 20))
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) // 2)


@pytest.fixture
def full_index_server(tmp_path: Path, server: str) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path / "redis-full", args=("--maxmemory", "64mb", "--maxmemory-policy", "noeviction"), server=server)
    yield r
    r.stop()


def test_a_full_index_keeps_reads_refuses_writes_and_a_rank_starting_meanwhile_comes_up(
        tmp_path: Path, full_index_server: RedisProc, caplog: pytest.LogCaptureFixture) -> None:
    """The index reaches maxmemory (noeviction): a running backend serves every page it has
    and refuses writes, counted as index_full with a log line and no traceback; a backend
    starting meanwhile comes up and serves the same pages; when memory is freed, both
    write again."""
    cfg = {"redis_url": full_index_server.url, "redis_prefix": "full-" + uuid.uuid4().hex[:8],
           "path": str(tmp_path / "store"), "capacity_gb": 0.25, "interface_v1": 1}
    pool = mha_pool("page_first")
    fill(pool, 3)
    ks = keys(12)
    admin = redis.Redis.from_url(full_index_server.url)
    with TierStoreBackend(storage_config(cfg), {}) as a:
        a.register_mem_pool_host(pool)
        assert a.batch_set_v1(ks[:6], page_indices(range(6), 4)) == [True] * 6
        fill_index(admin)
        with caplog.at_level(logging.WARNING):
            assert a.batch_exists(ks[:6]) == 6
            assert a.batch_get_v1(ks[:6], page_indices(range(10, 16), 4)) == [True] * 6
            assert page_bytes(pool, 15) == page_bytes(pool, 5)
            assert a.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [False] * 6
            with TierStoreBackend(storage_config(cfg), {}) as b:  # a rank (re)starting now
                b.register_mem_pool_host(pool)
                assert b.batch_get_v1(ks[:6], page_indices(range(20, 26), 4)) == [True] * 6
                assert b.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [False] * 6
                assert a.store.stats()["error_index_full"] >= 1 and b.store.stats()["error_index_full"] >= 1
                assert "error_internal" not in a.store.stats() and "error_internal" not in b.store.stats()
                assert "Traceback" not in caplog.text and "index is full" in caplog.text
                admin.config_set("maxmemory", "64mb")  # memory is back
                assert b.batch_set_v1(ks[6:9], page_indices(range(6, 9), 4)) == [True] * 3
                assert a.batch_set_v1(ks[9:], page_indices(range(9, 12), 4)) == [True] * 3
                assert b.batch_get_v1(ks, page_indices(range(30, 42), 4)) == [True] * 12
                assert inspect.check(b.store) == []
    admin.close()


def refusals(be: TierStoreBackend, kind: str) -> int:
    return int(be.store.stats().get(f"error_{kind}", 0))


def test_an_index_whose_aof_disk_is_full_refuses_writes_as_read_only_and_recovers(
        tmp_path: Path, server: str, caplog: pytest.LogCaptureFixture) -> None:
    """The index's AOF disk fills (MISCONF): writes are refused, counted as
    index_read_only with one line each and no traceback, reads hit; once there is room
    again the server takes writes and so does the backend."""
    with tmpfs(tmp_path / "aof-disk", 16) as disk:
        r = RedisProc(disk / "redis", appendonly=True, server=server)
        try:
            cfg = {"redis_url": r.url, "redis_prefix": "misconf-" + uuid.uuid4().hex[:8], "path": str(tmp_path / "s"),
                   "capacity_gb": 0.25, "interface_v1": 1}
            pool = mha_pool("page_first")
            fill(pool, 3)
            ks = keys(12)
            with TierStoreBackend(storage_config(cfg), {}) as be:
                be.register_mem_pool_host(pool)
                assert be.batch_set_v1(ks[:6], page_indices(range(6), 4)) == [True] * 6
                filler = fill_disk(disk)
                with caplog.at_level(logging.WARNING):
                    wait_for(lambda: be.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [False] * 6
                          and refusals(be, "index_read_only") > 0, 20, "writes refused")
                    assert be.batch_get_v1(ks[:6], page_indices(range(20, 26), 4)) == [True] * 6
                    assert "MISCONF" in caplog.text and "Traceback" not in caplog.text
                    assert "error_internal" not in be.store.stats()
                filler.unlink()
                wait_for(lambda: be.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [True] * 6, 20, "writes again")
                assert be.batch_get_v1(ks, page_indices(range(30, 42), 4)) == [True] * 12
        finally:
            r.stop()


def test_a_backend_on_a_replica_reads_and_refuses_writes_as_read_only(
        tmp_path: Path, server: str, caplog: pytest.LogCaptureFixture) -> None:
    """Pointed at a read-only replica (READONLY): the backend comes up, serves the pages its
    master holds and refuses writes as index_read_only, without a traceback."""
    master = RedisProc(tmp_path / "master", server=server)
    replica = RedisProc(tmp_path / "replica", args=("--replicaof", "127.0.0.1", str(master.port)), server=server)
    try:
        cfg = {"redis_prefix": "ro-" + uuid.uuid4().hex[:8], "path": str(tmp_path / "s"), "capacity_gb": 0.25,
               "interface_v1": 1}
        pool = mha_pool("page_first")
        fill(pool, 3)
        ks = keys(8)
        with TierStoreBackend(storage_config({**cfg, "redis_url": master.url}), {}) as a:
            a.register_mem_pool_host(pool)
            assert a.batch_set_v1(ks[:4], page_indices(range(4), 4)) == [True] * 4
            probe = redis.Redis.from_url(replica.url)
            wait_for(lambda: probe.info("replication")["master_link_status"] == "up"
                  and probe.dbsize() == redis.Redis.from_url(master.url).dbsize(), 20, "replicated")
            with caplog.at_level(logging.WARNING), TierStoreBackend(storage_config({**cfg, "redis_url": replica.url}), {}) as b:
                b.register_mem_pool_host(pool)
                assert b.batch_get_v1(ks[:4], page_indices(range(10, 14), 4)) == [True] * 4
                assert page_bytes(pool, 13) == page_bytes(pool, 3)
                assert b.batch_set_v1(ks[4:], page_indices(range(4, 8), 4)) == [False] * 4
                assert refusals(b, "index_read_only") >= 1 and "error_internal" not in b.store.stats()
                assert "READONLY" in caplog.text or "read only replica" in caplog.text
                assert "Traceback" not in caplog.text
    finally:
        replica.stop()
        master.stop()


def test_a_full_disk_at_start_comes_up_serving_and_writes_again_when_space_returns(
        tmp_path: Path, redis_proc: RedisProc, caplog: pytest.LogCaptureFixture) -> None:
    """The page directory's filesystem is full when a rank (re)starts: it comes up (the
    start-up probe says the disk is full), serves the pages stored and writes what fits the
    space its files already hold, raising nothing. A brand-new store on a full disk comes
    up too, answering misses, and is created once there is room."""
    with tmpfs(tmp_path / "disk", 24) as disk:
        cfg = {"redis_url": redis_proc.url, "redis_prefix": "dfull-" + uuid.uuid4().hex[:8], "path": str(disk / "store"),
               "capacity_gb": 16 * MiB / (1 << 30), "interface_v1": 1}
        pool = mha_pool("page_first")
        fill(pool, 4)
        ks = keys(12)
        with TierStoreBackend(storage_config(cfg), {}) as a:
            a.register_mem_pool_host(pool)
            assert a.batch_set_v1(ks[:6], page_indices(range(6), 4)) == [True] * 6
        filler = fill_disk(disk)
        with caplog.at_level(logging.WARNING):
            with TierStoreBackend(storage_config(cfg), {}) as b:
                b.register_mem_pool_host(pool)
                assert b.batch_get_v1(ks[:6], page_indices(range(10, 16), 4)) == [True] * 6
                write_on_a_full_disk(b, ks[6:], page_indices(range(6, 12), 4))  # what fits the space already held
                assert "is full (No space left on device)" in caplog.text and "error_internal" not in b.store.stats()
                new = {**cfg, "path": str(disk / "new-store"), "redis_prefix": cfg["redis_prefix"] + "-new",
                       "redis_retry_s": 0.2}
                with TierStoreBackend(storage_config(new), {}) as c:  # nothing there yet, and no room to make it
                    c.register_mem_pool_host(pool)
                    assert c.batch_set_v1(ks[:2], page_indices(range(2), 4)) == [False] * 2
                    assert c.store.stats()["error_disk_unavailable"] >= 1
                    filler.unlink()
                    assert b.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [True] * 6
                    assert inspect.check(b.store) == []
                    wait_for(lambda: c.batch_set_v1(ks[:2], page_indices(range(2), 4)) == [True] * 2, 20, "housekeeping creating the store once there is room")
                    assert c.batch_get_v1(ks[:2], page_indices(range(40, 42), 4)) == [True] * 2


def write_on_a_full_disk(be: TierStoreBackend, ks: list[str], indices: Any) -> list[bool]:
    """A write while the disk is full: it raises nothing, and each page is stored (True) or
    counted under one outcome saying why not (the adapter's fallback for an exception would
    return as many Falses, with none counted), and nothing as an internal error."""
    before = be.store.stats()
    got = be.batch_set_v1(ks, indices)
    after = be.store.stats()
    delta = Counter({k: v - before.get(k, 0) for k, v in after.items() if k.startswith("write_") and k != "write_bytes"})
    assert len(got) == len(ks) and sum(delta.values()) == len(ks), delta
    assert sum(got) == delta["write_stored"] + delta["write_exists"], (got, delta)
    assert "error_internal" not in after
    return got




def embedded_pid(path: str) -> int:
    return int(Path(pid_file(path)).read_text().strip())


def rot_aof(path: str) -> Path:
    """One rotten byte in the embedded index's AOF (a command's header), its server stopped."""
    stop_embedded_redis(path)
    incr = next((Path(redis_dir(path)) / AOF_DIR).glob("*.incr.aof"))
    data = bytearray(incr.read_bytes())
    data[data.index(b"*", 1) + 1] = ord("x")  # the header of the second command
    incr.write_bytes(bytes(data))
    return incr


def embedded_cfg(path: Path, server: str) -> dict[str, Any]:
    return {"path": str(path), "capacity_gb": 16 * MiB / (1 << 30), "interface_v1": 1, "redis_server": server,
            "redis_retry_s": 0.2, "housekeeping_s": 0.1}


def test_the_embedded_index_killed_while_the_disk_is_full_comes_back(tmp_path: Path, server: str) -> None:
    """The embedded index dies while its disk is full: housekeeping restarts it without
    rewriting anything (redis.conf is left as it is), reads hit again, and writes come back
    once there is room."""
    with tmpfs(tmp_path / "disk", 24) as disk:
        cfg = embedded_cfg(disk / "store", server)
        pool = mha_pool("page_first")
        fill(pool, 4)
        ks = keys(12)
        try:
            with TierStoreBackend(storage_config(cfg), {}) as be:
                be.register_mem_pool_host(pool)
                assert be.batch_set_v1(ks[:6], page_indices(range(6), 4)) == [True] * 6
                conf = Path(redis_dir(cfg["path"])) / "redis.conf"
                written = conf.stat().st_mtime_ns
                filler = fill_disk(disk)
                pid = embedded_pid(cfg["path"])
                os.kill(pid, 9)
                wait_for(lambda: embedded_running(cfg["path"]) and embedded_pid(cfg["path"]) != pid, 20, "restarted")
                wait_for(lambda: be.batch_get_v1(ks[:6], page_indices(range(10, 16), 4)) == [True] * 6, 20, "reads hit")
                assert page_bytes(pool, 15) == page_bytes(pool, 5)
                assert conf.stat().st_mtime_ns == written
                write_on_a_full_disk(be, ks[6:], page_indices(range(6, 12), 4))
                filler.unlink()
                wait_for(lambda: be.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [True] * 6, 20, "writes again")
                assert be.batch_get_v1(ks, page_indices(range(20, 32), 4)) == [True] * 12
                assert inspect.check(be.store) == []
        finally:
            stop_embedded_redis(cfg["path"])


def index_of(cfg: dict[str, Any]) -> redis.Redis:
    """A client of the store's index: its ``redis_url``, else the embedded index (with its password)."""
    return redis.Redis.from_url(cfg.get("redis_url") or join_embedded_redis(cfg["path"]))


def refuse_writes(r: redis.Redis) -> None:
    """Write to the index until its full AOF disk makes it refuse writes (MISCONF)."""
    def refused() -> bool:
        try:
            r.set("junk", b"x" * 4096)
            return False
        except redis.ResponseError as e:
            return str(e).startswith("MISCONF")
    wait_for(refused, 20, "the index refuses writes")


@pytest.mark.parametrize("index", ["embedded", "external"])
def test_a_rank_starting_while_the_index_aof_disk_is_full_comes_up_and_writes_once_there_is_room(
        tmp_path: Path, server: str, index: str, caplog: pytest.LogCaptureFixture) -> None:
    """The disk under the index's AOF and the page files fills (MISCONF: the index refuses
    every write, PING included) and a rank (re)starts then: it comes up, serves the pages
    stored, refuses writes as index_read_only with one log line and no traceback, and
    writes once there is room again. With the embedded index and with an external one."""
    with tmpfs(tmp_path / "disk", 24) as disk:
        r = RedisProc(disk / "redis", appendonly=True, server=server) if index == "external" else None
        cfg = embedded_cfg(disk / "store", server)
        if r is not None:
            del cfg["redis_server"]
            cfg["redis_url"] = r.url
        pool = mha_pool("page_first")
        fill(pool, 5)
        ks = keys(12)
        try:
            with TierStoreBackend(storage_config(cfg), {}) as a:
                a.register_mem_pool_host(pool)
                assert a.batch_set_v1(ks[:6], page_indices(range(6), 4)) == [True] * 6
            filler = fill_disk(disk)
            with index_of(cfg) as admin:
                refuse_writes(admin)
                with caplog.at_level(logging.WARNING), TierStoreBackend(storage_config(cfg), {}) as b:
                    b.register_mem_pool_host(pool)
                    assert b.batch_get_v1(ks[:6], page_indices(range(10, 16), 4)) == [True] * 6
                    assert page_bytes(pool, 15) == page_bytes(pool, 5)
                    for _ in range(3):
                        assert b.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [False] * 6
                    assert refusals(b, "index_read_only") == 3 and "error_internal" not in b.store.stats()
                    said = [m.getMessage() for m in caplog.records]
                    assert sum("batch_set_v1" in m and "MISCONF" in m for m in said) == 1, said
                    assert "Traceback" not in caplog.text
                    filler.unlink()
                    wait_for(lambda: b.batch_set_v1(ks[6:], page_indices(range(6, 12), 4)) == [True] * 6, 20, "writes again")
                    assert b.batch_get_v1(ks, page_indices(range(20, 32), 4)) == [True] * 12
                    assert inspect.check(b.store) == []
        finally:
            if r is not None:
                r.stop()
            else:
                stop_embedded_redis(cfg["path"])


@pytest.mark.parametrize("when", ["at_start", "while_running"])
def test_an_unreadable_embedded_aof_is_moved_aside_and_the_index_starts_empty(
        tmp_path: Path, server: str, when: str, caplog: pytest.LogCaptureFixture) -> None:
    """One rotten byte in the embedded index's AOF: the server it restarts exits reading
    it. Whether that is found at construction or by housekeeping of a running backend, the
    AOF is moved aside (one log line names where), the index starts empty, the backend
    raises nothing and stores pages again within seconds, not after 30 s or never."""
    cfg = embedded_cfg(tmp_path / "store", server)
    pool = mha_pool("page_first")
    fill(pool, 4)
    ks = keys(8)
    aside = Path(redis_dir(cfg["path"])) / AOF_ASIDE
    try:
        with TierStoreBackend(storage_config(cfg), {}) as be:
            be.register_mem_pool_host(pool)
            assert be.batch_set_v1(ks[:4], page_indices(range(4), 4)) == [True] * 4
            if when == "while_running":
                rot_aof(cfg["path"])
                with caplog.at_level(logging.WARNING):
                    wait_for(lambda: embedded_running(cfg["path"]), 20, "restarted")
                    wait_for(lambda: be.batch_set_v1(ks[4:], page_indices(range(4, 8), 4)) == [True] * 4, 20, "writes")
        if when == "at_start":
            rot_aof(cfg["path"])
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING), TierStoreBackend(storage_config(cfg), {}) as be:
                assert time.monotonic() - t0 < 10
                be.register_mem_pool_host(pool)
                wait_for(lambda: be.batch_set_v1(ks[4:], page_indices(range(4, 8), 4)) == [True] * 4, 20, "writes")
                assert be.batch_get_v1(ks[4:], page_indices(range(10, 14), 4)) == [True] * 4
        assert aside.is_dir() and any(aside.glob("*.incr.aof"))
        assert [r.getMessage() for r in caplog.records].count(next(
            (r.getMessage() for r in caplog.records if str(aside) in r.getMessage()), "none")) == 1
        assert "Bad file format reading the append only file" in caplog.text
    finally:
        stop_embedded_redis(cfg["path"])


def test_a_database_the_server_lacks_names_redis_url_and_never_the_password(
        tmp_path: Path, server: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/99`` on a server with 16 databases, the password in the URL, in an environment
    variable or in a file: a ConfigError naming ``redis_url`` and the database, and the
    password in neither the error nor any log line; a malformed URL likewise."""
    secret = "pw-" + uuid.uuid4().hex
    r = RedisProc(tmp_path / "redis-pw", server=server)
    with redis.Redis(port=r.port) as admin:
        admin.config_set("requirepass", secret)
    pw_file = tmp_path / "pw"
    pw_file.write_text(secret)
    pw_file.chmod(0o600)
    monkeypatch.setenv("TS_TEST_PW", secret)
    at = f"127.0.0.1:{r.port}"
    base = {"path": str(tmp_path / "store"), "redis_prefix": "db99", "capacity_gb": 0.05, "interface_v1": 1}
    try:
        for how in ({"redis_url": f"redis://:{secret}@{at}/99"},
                    {"redis_url": f"redis://{at}/99", "redis_password_env": "TS_TEST_PW"},
                    {"redis_url": f"redis://{at}/99", "redis_password_file": str(pw_file)},
                    {"redis_url": f"redis//{at}/0", "redis_password_env": "TS_TEST_PW"},
                    {"redis_url": f"redis:/:{secret}@{at}/0"}):
            with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as e:
                TierStoreBackend(storage_config({**base, **how}), {})
            assert "'redis_url'" in str(e.value), how
            assert secret not in str(e.value) and secret not in caplog.text, how
            if how["redis_url"].endswith("/99"):
                assert "99" in str(e.value) and "database" in str(e.value), str(e.value)
        with TierStoreBackend(storage_config({**base, "redis_url": f"redis://{at}/0",
                                              "redis_password_env": "TS_TEST_PW"}), {}) as be:
            assert be.store.stats() is not None  # the same password, a database it has: it serves
    finally:
        r.stop()
