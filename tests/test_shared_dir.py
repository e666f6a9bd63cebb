"""One store directory shared by several nodes: each "node" is an engine with its own
``node_name`` and its own FUSE mount (``stallfs.py``, a passthrough: ``direct_io``, no
``fallocate``, file locks local to each mount, as on NFS with ``local_lock`` or FUSE) of
one backing directory, all on one index. What must hold: B hits every page A committed;
nodes attaching at the same moment get one store; a node whose mount goes away misses and
removes nothing, and hits again once it is back; a node given the wrong index starts a store
of its own beside the shared one and removes nothing. Every hit is checked byte for byte."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import engine, housekeep
from scaleout_kit import Workload, settle_and_check
from stallfs import StalledDisk, _umount

from sglang_tierstore import TierStore
from sglang_tierstore.tools.cli import main as cli
from sglang_tierstore.schema import meta_key
from sglang_tierstore.space.attach import prefix_dir

pytestmark = pytest.mark.slow


class Fleet:
    """Mounts of one backing directory, one per node."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.backing = tmp / "backing"
        self.mounts: dict[str, StalledDisk] = {}

    def mount(self, node: str, cached: bool = False) -> str:
        d = StalledDisk(str(self.backing), str(self.tmp / f"mnt-{node}"), cached)
        self.mounts[node] = d
        return d.mountpoint

    def close(self) -> None:
        for d in self.mounts.values():
            d.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.close()


def node(fleet: Fleet, name: str, url: str, prefix: str, **kw: Any) -> TierStore:
    path = fleet.mounts[name].mountpoint if name in fleet.mounts else fleet.mount(name)
    return engine({"path": path, "redis_url": url, "redis_prefix": prefix, "node_name": name,
                   "capacity_gb": 32 / 1024, "io_threads": 2, **kw})


def store_dirs(fleet: Fleet, prefix: str) -> list[str]:
    d = fleet.backing / f"tierstore-{prefix}"
    return sorted(n for n in os.listdir(d) if len(n) == 16) if d.exists() else []


def test_b_hits_every_page_a_committed(fleet: Fleet, redis_proc: RedisProc) -> None:
    prefix = "sh" + uuid.uuid4().hex[:8]
    with node(fleet, "a", redis_proc.url, prefix) as a:
        wa = Workload(a, a.namespace({"m": "shared"}, 4096))
        for _ in range(6):
            wa.write()
        assert wa.tally.stored == wa.tally.written
        with node(fleet, "b", redis_proc.url, prefix) as b:
            wb = Workload(b, b.namespace({"m": "shared"}, 4096))
            assert all(wb.read(wa.keys)) and wb.tally.wrong == 0
            assert b.space.attached().geometry.store_id == a.space.attached().geometry.store_id
            wb.write()
            assert all(wa.read(wb.keys)) and wa.tally.wrong == 0  # and A hits B's
            assert settle_and_check(b) == []


def test_nodes_attaching_at_the_same_moment_get_one_store_and_remove_nothing(fleet: Fleet, redis_proc: RedisProc) -> None:
    prefix = "sh" + uuid.uuid4().hex[:8]
    names = ["a", "b", "c"]
    for n in names:
        fleet.mount(n)  # three mounts: flock on one does not hold the others
    start = threading.Barrier(len(names))
    stores: dict[str, TierStore] = {}
    errors: list[BaseException] = []

    def attach(n: str) -> None:
        try:
            start.wait(30)
            st = node(fleet, n, redis_proc.url, prefix)
            stores[n] = st
            st.namespace({"m": "race"}, 4096)  # creates the store (the first pages' size)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=attach, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        for st in stores.values():  # those that found another attaching attach at their next housekeeping pass
            st.space.housekeeping.run_once()
        ids = {st.space.attached().geometry.store_id for st in stores.values()}
        assert len(ids) == 1 and store_dirs(fleet, prefix) == sorted(ids)
        ws = {n: Workload(st, st.namespace({"m": "race"}, 4096), prefix=f"{n}-") for n, st in stores.items()}
        for w in ws.values():
            w.write()
        for w in ws.values():
            for other in ws.values():
                assert all(w.read(other.keys)), "every node hits every other node's pages"
            assert w.tally.wrong == 0
    finally:
        for st in stores.values():
            st.close()


def test_a_node_whose_mount_goes_misses_removes_nothing_and_hits_again_when_it_is_back(
        fleet: Fleet, redis_proc: RedisProc) -> None:
    prefix = "sh" + uuid.uuid4().hex[:8]
    with node(fleet, "a", redis_proc.url, prefix) as a, node(fleet, "b", redis_proc.url, prefix) as b:
        ns = {"m": "unmount"}
        wa, wb = Workload(a, a.namespace(ns, 4096)), Workload(b, b.namespace(ns, 4096))
        for _ in range(4):
            wa.write()
        assert all(wb.read(wa.keys))
        files_before = sorted(p.name for p in (fleet.backing / f"tierstore-{prefix}").rglob("*.pages"))
        mnt = fleet.mounts["b"].mountpoint
        _umount(mnt)  # lazily: B's open files go on, every path under its mount is gone
        assert not os.path.ismount(mnt)
        for _ in range(3):
            housekeep(b)  # its audit finds every file "gone"
            wb.read(wa.keys)
            wb.write()
        assert b.metrics.snapshot().get("error_file_unverified", 0) > 0
        assert b.metrics.snapshot().get("error_file_gone", 0) == 0
        housekeep(a)
        assert all(wa.read(wa.keys)), "A's pages survive B's lost mount"
        assert sorted(p.name for p in (fleet.backing / f"tierstore-{prefix}").rglob("*.pages"))[: len(files_before)] \
            == files_before
        fleet.mounts["b"].close()
        fleet.mount("b")  # back
        housekeep(b)
        assert all(wb.read(wa.keys)), "B hits again once its mount is back"
        assert wa.tally.wrong == 0 and wb.tally.wrong == 0
        assert settle_and_check(a) == []


def test_a_stale_page_cache_on_b_while_a_reuses_a_region_keeps_as_entries(fleet: Fleet, redis_proc: RedisProc) -> None:
    """B's mount keeps what it read in its page cache (``kernel_cache``) after A rewrites
    the slots: B reads A's new pages past its cache (``shared_fs``) and drops nothing."""
    prefix = "sh" + uuid.uuid4().hex[:8]
    fleet.mount("b", cached=True)
    small = {"capacity_gb": 4 / 1024, "shared_fs": True}
    with node(fleet, "a", redis_proc.url, prefix, **small) as a, node(fleet, "b", redis_proc.url, prefix, **small) as b:
        ns = {"m": "stale"}
        wa, wb = Workload(a, a.namespace(ns, 4096)), Workload(b, b.namespace(ns, 4096))
        first = wa.write(64)
        assert all(wb.read(first))  # B's cache now holds these slots
        rounds = 0
        while any(a.exists([(wa.ns, first)])[0]) and rounds < 40:  # until A's first regions are reused
            new = wa.write(64)                                      # (a probe touches no recency)
            housekeep(a)
            assert all(wb.read(new)), "B reads each batch A wrote, past what its cache held of those slots"
            rounds += 1
        assert not any(a.exists([(wa.ns, first)])[0]), "A's first regions were reclaimed and written again"
        assert wb.tally.wrong == 0  # with shared_fs false, B reads its cached bytes: misses, and drops A's entries
        assert all(wa.read(wa.keys[-64:])), "no entry of A's was dropped by B"
        assert settle_and_check(a) == []


def test_a_node_on_the_wrong_index_leaves_the_shared_directory_intact(fleet: Fleet, redis_proc: RedisProc,
                                                                       private_redis: RedisProc) -> None:
    prefix = "sh" + uuid.uuid4().hex[:8]
    with node(fleet, "a", redis_proc.url, prefix) as a:
        wa = Workload(a, a.namespace({"m": "wrong"}, 4096))
        for _ in range(4):
            wa.write()
        ours = a.space.attached().geometry.store_id
        with node(fleet, "c", private_redis.url, prefix) as c:  # another index: it knows no store here
            wc = Workload(c, c.namespace({"m": "wrong"}, 4096), prefix="c-")
            wc.write()
            theirs = c.space.attached().geometry.store_id
            assert theirs != ours and store_dirs(fleet, prefix) == sorted([ours, theirs])
            housekeep(c)
        housekeep(a)
        assert all(wa.read(wa.keys)) and wa.tally.wrong == 0
    with node(fleet, "a", redis_proc.url, prefix) as a2:  # a restart adopts its own store, not the newer one
        assert a2.space.attached().geometry.store_id == ours
        w2 = Workload(a2, a2.namespace({"m": "wrong"}, 4096))
        assert all(w2.read(wa.keys)) and w2.tally.wrong == 0
    cfg = f'{{"path": "{fleet.mounts["a"].mountpoint}", "redis_url": "{redis_proc.url}", "redis_prefix": "{prefix}"}}'
    assert cli(["gc", "--config", cfg, "--min-age-s", "0"]) == 0  # lists the other index's store, removes nothing
    assert store_dirs(fleet, prefix) == sorted([ours, theirs])
    assert cli(["gc", "--config", cfg, "--min-age-s", "0", "--yes"]) == 0
    assert store_dirs(fleet, prefix) == [ours]


def test_a_node_whose_marker_names_a_store_the_index_lacks_adopts_the_one_in_use(tmp_path: Path,
                                                                                  redis_proc: RedisProc) -> None:
    """Two stores the index holds sit in one directory (an orphan and the one the fleet uses) and
    the marker names neither (a node on another index rewrote it): a starting node adopts the
    store whose directories were reported last, not the first by name."""
    prefix = "ad" + uuid.uuid4().hex[:8]
    cfg = {"path": str(tmp_path / "pages"), "redis_url": redis_proc.url, "redis_prefix": prefix,
           "capacity_gb": 16 / 1024, "io_threads": 2}
    r = redis.Redis.from_url(redis_proc.url)
    ids = []
    for _ in range(2):  # two stores beside each other: the index forgets the first while the second is made
        with engine(cfg) as st:
            st.namespace({"m": "adopt"}, 4096)
            a = st.space.attached()
            ids.append((a.geometry.store_id, a.tag, {k: v for k, v in r.hgetall(meta_key(a.tag, "meta")).items()}))
        if len(ids) == 1:
            r.rename(meta_key(ids[0][1], "meta"), "hidden-meta")
    r.rename("hidden-meta", meta_key(ids[0][1], "meta"))  # both held by the index now
    orphan, in_use = sorted(ids, key=lambda x: x[0])  # the orphan first by name, where a scan would look first
    for store, seen in ((orphan, 1.0), (in_use, time.time())):
        r.hset(meta_key(store[1], "dirs"), mapping={d: json.dumps({"path": "x", "host": "h", "seen": seen})
                                                    for d in r.hkeys(meta_key(store[1], "dirs"))})
    marker = Path(prefix_dir(cfg["path"], prefix)) / "store.json"
    doc = json.loads(marker.read_text())
    marker.write_text(json.dumps({**doc, "store": "f" * 16}))  # a store this index never held
    with engine(cfg) as st:
        assert st.space.attached().geometry.store_id == in_use[0]
