"""Runtime attach, clear and detach through SGLang 0.5.23's admin endpoints.

The server test runs the real CPU server with HiCache but no storage backend,
attaches tierstore with ``PUT /hicache/storage-backend``, serves storage hits, clears
with ``POST /hicache/storage-backend/clear``, detaches with ``DELETE`` and checks from
outside the scheduler process that nothing of tierstore is left (threads, page-file
descriptors, Redis connections), then attaches another store and serves hits again.

SGLang stops its storage threads before it closes a backend; the other tests close
one under work that cannot finish (a disk that stopped answering: ``stallfs.py``),
which is what a detach meets when a disk hangs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import redis
import requests
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.cpu_harness.server import Server, conversation, tierstore_config
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config
from sglang_servers import GROUP, chat, reference, stored_pages, wait_for_backup
from stallfs import StalledDisk
from test_stall import disk  # noqa: F401  (the fixture)

from sglang_tierstore import adapter
from sglang_tierstore.adapter import TierStoreBackend
from sglang_tierstore.embedded import pid_file

ATTACH = "/hicache/storage-backend"
N = 8  # pages written, then read back


# -- what a process holds of a store --------------------------------------------------


def os_thread_names(pid: int) -> list[str]:
    """Thread names as the OS has them (tierstore names its threads there too)."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return names


def tierstore_threads(pid: int) -> list[str]:
    return [n for n in os_thread_names(pid) if n.startswith("tierstore")]


def open_files_under(pid: int, path: str) -> list[str]:
    """Files under ``path`` that the process has open."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(path.rstrip("/") + "/"):
            out.append(target)
    return out


def other_clients(r: redis.Redis) -> int:
    """Connections to this Redis besides ``r``'s own."""
    me = r.client_id()
    return sum(1 for c in r.client_list() if int(c["id"]) != me)


# -- the real server --------------------------------------------------------------------


def scheduler_pid(s: Server) -> int:
    for p in psutil.Process(s.proc.pid).children(recursive=True):
        if p.cmdline()[:1] == ["sglang::scheduler"]:
            return p.pid
    raise LookupError("no sglang::scheduler process under the server")


def attach(s: Server, extra_config: str) -> None:
    """``extra_config``: what ``--hicache-storage-backend-extra-config`` takes (JSON, or @file)."""
    r = s.admin("PUT", ATTACH, {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config_json": extra_config})
    assert r.status_code == 200 and r.text.startswith("HiCache storage backend attached."), r.text
    assert s.admin("GET", ATTACH).json() == {
        "hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config": extra_config,
        "hicache_storage_prefetch_policy": "wait_complete", "hicache_write_policy": "write_through_selective"}


def detach(s: Server, timeout: float = 60) -> requests.Response:
    """``DELETE`` the backend: SGLang refuses while its scheduler is not idle (a write-through
    in flight), so the refusal is retried."""
    deadline = time.monotonic() + timeout
    while True:
        r = s.admin("DELETE", ATTACH)
        if r.status_code == 200 or "not idle" not in r.text or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def hits_from_storage(s: Server, cfg: dict[str, Any], prompts: list[str]) -> list[str]:
    """The e2e flow: a multi-turn chat twice (write_through_selective backs the pages up
    on the second hit), L1 and L2 flushed, then the first prompt comes from L3. Flushed
    first: SGLang backs up to L3 only what it writes to host memory from now on."""
    s.flush()
    first, _ = chat(s, prompts)
    second, _ = chat(s, prompts)
    wait_for_backup(cfg)
    s.flush()
    third, tiers = chat(s, prompts)
    assert tiers[0].get("storage", 0) > 0, tiers
    assert first == second == third
    return first


@pytest.mark.server
@GROUP
def test_attach_serve_clear_detach_and_attach_another_store_at_runtime(
        plain_server: Server, tmp_path: Path, private_redis: RedisProc) -> None:
    """On the shared server without L3 (left detached again): a store on a Redis of its own,
    then one on the embedded default index, given as @file."""
    s = plain_server
    prompts = conversation(3, salt="admin ")
    answers = reference(s, prompts)
    r = redis.Redis.from_url(private_redis.url)
    store_a = tierstore_config(redis_url=private_redis.url, redis_prefix="admin-a", path=str(tmp_path / "a"), capacity_gb=0.25)
    store_b = tierstore_config(path=str(tmp_path / "b"), capacity_gb=0.25)
    (tmp_path / "b.json").write_text(json.dumps(store_b))
    sched = scheduler_pid(s)
    assert s.admin("GET", ATTACH).json()["hicache_storage_backend"] is None
    assert requests.put(s.url + ATTACH, json={"hicache_storage_backend": "dynamic"}, timeout=60).status_code == 401
    try:
        attach(s, json.dumps(store_a))
        assert "tierstore-hk" in tierstore_threads(sched) and other_clients(r) > 0
        assert hits_from_storage(s, store_a, prompts) == answers
        assert open_files_under(sched, store_a["path"])

        assert s.admin("POST", ATTACH + "/clear").status_code == 200
        assert stored_pages(store_a) == 0
        s.flush()
        outs, tiers = chat(s, prompts)
        assert all(t.get("storage", 0) == 0 for t in tiers), tiers
        assert outs == answers

        detached = detach(s)
        assert detached.status_code == 200 and detached.text.startswith("HiCache storage backend detached."), detached.text
        assert s.admin("GET", ATTACH).json()["hicache_storage_backend"] is None
        assert tierstore_threads(sched) == []
        assert open_files_under(sched, store_a["path"]) == []
        assert other_clients(r) == 0
        assert chat(s, prompts)[0] == answers  # served without L3

        attach(s, "@" + str(tmp_path / "b.json"))
        assert hits_from_storage(s, store_b, prompts) == answers
        assert open_files_under(sched, store_a["path"]) == []
        assert open_files_under(sched, store_b["path"])
    finally:
        if s.admin("GET", ATTACH).json()["hicache_storage_backend"] is not None:
            assert detach(s).status_code == 200  # the shared server, as the other tests know it
        if os.path.exists(pid_file(store_b["path"])):  # the embedded index store B's backend started
            os.kill(int(Path(pid_file(store_b["path"])).read_text()), signal.SIGTERM)


# -- closing under work that cannot finish ------------------------------------------------


@dataclass
class Stalled:
    be: TierStoreBackend
    pool: Any
    path: str
    redis: redis.Redis
    threads_before: set[threading.Thread]

    def new_threads(self) -> list[threading.Thread]:
        """tierstore threads started since the backend was made, still alive."""
        return [t for t in threading.enumerate() if t.name.startswith("tierstore") and t not in self.threads_before]

    def released(self, within_s: float = 10.0) -> bool:
        """Its threads gone, its files and index connections closed, within ``within_s``
        (a thread that was told to stop may still be on its way out on a loaded machine)."""
        deadline = time.monotonic() + within_s
        while True:
            if not self.new_threads() and not open_files_under(os.getpid(), self.path) and other_clients(self.redis) == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


@pytest.fixture
def stalled(disk: StalledDisk, private_redis: RedisProc, request: pytest.FixtureRequest) -> Iterator[Stalled]:
    """A backend over the stalled disk with N pages written (host pages 0..N-1); its
    reads wait for the disk ``read_timeout_s`` (the test's parameter)."""
    before = set(threading.enumerate())
    path = os.path.join(disk.mountpoint, "store")
    extra = {"backend_name": "tierstore", "module_path": "sglang_tierstore", "class_name": "TierStoreBackend",
             "interface_v1": 1, "redis_url": private_redis.url, "redis_prefix": "c-" + uuid.uuid4().hex[:8],
             "path": path, "capacity_gb": 0.05, "io_threads": 2, "read_timeout_s": request.param}
    be = TierStoreBackend(storage_config(extra), {})
    try:
        pool = mha_pool("page_first_direct")
        fill(pool, 1)
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(keys(N), page_indices(list(range(N)), pool.page_size)) == [True] * N
        yield Stalled(be, pool, path, redis.Redis.from_url(private_redis.url), before)
    finally:
        disk.answer()
        be.close()


@pytest.mark.parametrize("stalled", [0.0], indirect=True)
def test_close_waits_for_a_call_in_flight_and_later_calls_are_misses(stalled: Stalled, disk: StalledDisk) -> None:
    be, pool = stalled.be, stalled.pool
    dest = page_indices(list(range(N, 2 * N)), pool.page_size)
    disk.stall()
    got: list[list[bool]] = []
    reader = threading.Thread(target=lambda: got.append(be.batch_get_v1(keys(N), dest)))
    reader.start()
    disk.wait_blocked()
    closer = threading.Thread(target=be.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the read
    assert be.batch_exists(keys(N)) == 0  # a call arriving meanwhile is a miss
    disk.answer()
    closer.join(30)
    reader.join(30)
    assert got == [[True] * N]  # the read in flight finished against an open store
    assert [page_bytes(pool, N + i) for i in range(N)] == [page_bytes(pool, i) for i in range(N)]
    assert stalled.released()


@pytest.mark.parametrize("stalled", [0.5], indirect=True)
def test_close_returns_while_an_io_thread_is_stuck_and_what_it_holds_goes_when_it_returns(
        stalled: Stalled, disk: StalledDisk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "CLOSE_WAIT_S", 1.0)
    be, pool = stalled.be, stalled.pool
    disk.stall()
    assert be.batch_get_v1(keys(N), page_indices(list(range(N, 2 * N)), pool.page_size)) == [False] * N  # gave up
    disk.wait_blocked()  # an I/O thread is still in the preadv
    be.close()
    stuck = stalled.new_threads()
    assert stuck and all(t.name.startswith("tierstore-io") for t in stuck)  # the housekeeper has stopped
    assert open_files_under(os.getpid(), stalled.path)  # not closed under the preadv
    assert other_clients(stalled.redis) == 0
    assert be.batch_exists(keys(N)) == 0  # closed: misses, opening nothing
    assert be.batch_get_v1(keys(N), page_indices(list(range(N, 2 * N)), pool.page_size)) == [False] * N
    disk.answer()
    for t in stuck:
        t.join(30)
    assert stalled.released()
