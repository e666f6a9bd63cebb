"""One identity for index and files: every page file belongs to one store and is opened
only if it is the file the index names; directories come and go; old stores are dropped."""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from tierstore_kit.engine import keys, page_files_bytes
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, engine, housekeep, pages, read, views

from sglang_tierstore import TierStore
from sglang_tierstore.tools import inspect
from sglang_tierstore.errors import ConfigError
from sglang_tierstore.schema import FORMAT, meta_key

PAGE = 64 * 1024


@pytest.fixture
def cfg(tmp_path: Path, redis_proc: RedisProc) -> dict[str, Any]:
    return {"path": str(tmp_path / "d1"), "redis_url": redis_proc.url, "redis_prefix": "id-" + uuid.uuid4().hex[:10],
            "capacity_gb": 4 * MiB / (1 << 30), "io_threads": 2, "o_direct": False}


def files_of(root: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".pages"))


def write_all(st: TierStore, tag: str, n: int, seed: int, batch: int = 8) -> list[bytearray]:
    ns = st.namespace({"m": 1}, PAGE)
    src = pages(n, PAGE, seed)
    ks = keys(n, tag)
    for i in range(0, n, batch):
        assert st.write(ns, ks[i : i + batch], views(src[i : i + batch]), False) == [True] * len(ks[i : i + batch])
    return src


def read_all(st: TierStore, tag: str, n: int) -> tuple[list[bool], list[bytearray]]:
    ns = st.namespace({"m": 1}, PAGE)
    oks, outs = [], []
    for k in keys(n, tag):  # one at a time: a miss does not hide the pages after it
        ok, out = read(st, ns, [k])
        oks += ok
        outs += out
    return oks, outs


def test_two_prefixes_on_one_path_are_independent(cfg: dict[str, Any]) -> None:
    a, b = engine(cfg), engine(cfg, redis_prefix=cfg["redis_prefix"] + "-b")
    try:
        src_a = write_all(a, "a", 40, 1)
        src_b = write_all(b, "b", 40, 2)
        ok, got = read_all(a, "a", 40)
        assert ok == [True] * 40 and got == src_a
        ok, got = read_all(b, "b", 40)
        assert ok == [True] * 40 and got == src_b
        assert inspect.check(a) == [] and inspect.check(b) == []
        assert len({os.path.dirname(os.path.dirname(f)) for f in files_of(cfg["path"])}) == 2
    finally:
        a.close()
        b.close()


def test_geometry_is_the_stores_not_a_processs(cfg: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A second process with another capacity uses the store's regions and capacity (and
    says so), so each serves what the other wrote; a setting that would split the geometry
    is refused."""
    a = engine(cfg, capacity_gb=64 * MiB / (1 << 30))
    a.namespace({"m": 1}, PAGE)  # the store is created for its first pages
    with caplog.at_level(logging.INFO):
        b = engine(cfg, capacity_gb=40 * MiB / (1 << 30))
    try:
        assert a.space.attached().geometry == b.space.attached().geometry
        assert "capacity 0.062 GiB; this process's capacity_gb 0.039 is not applied" in caplog.text
        assert inspect.usage(b)["capacity_bytes"] == 64 * MiB
        src = write_all(a, "a", 24, 3)
        ok, got = read_all(b, "a", 24)
        assert ok == [True] * 24 and got == src
        src = write_all(b, "b", 24, 4)
        ok, got = read_all(a, "b", 24)
        assert ok == [True] * 24 and got == src
        with pytest.raises(ConfigError, match="'file_size_mb'"):
            engine(cfg, file_size_mb=4)
        assert inspect.check(a) == []
    finally:
        a.close()
        b.close()


def test_a_page_file_deleted_under_a_running_process(cfg: dict[str, Any]) -> None:
    """Writes into the deleted file are not acknowledged; pages in other files stay;
    every acknowledged write is visible to another process and after a restart."""
    a = engine(cfg)
    ns = a.namespace({"m": 1}, PAGE)
    try:
        src = write_all(a, "w", 48, 5)  # 12 regions of 4 pages: file 0 holds 8, file 1 holds 4
        f0, f1 = files_of(cfg["path"])
        in_f1 = [i for i, k in enumerate(keys(48, "w")) if (inspect.where(a, ns, k) or ("",))[0] == f1]
        assert len(in_f1) == 16
        os.unlink(f0)
        more = pages(40, PAGE, 6)
        acked = []
        for i in range(0, 40, 4):
            ok = a.write(ns, keys(40, "more")[i : i + 4], views(more[i : i + 4]), False)
            acked += [i + j for j, good in enumerate(ok) if good]
            housekeep(a)
        b = engine(cfg)
        try:
            ok, got = read_all(b, "more", 40)
            assert all(ok[i] and got[i] == more[i] for i in acked)
            ok, got = read_all(b, "w", 48)
            assert [i for i, good in enumerate(ok) if good] == in_f1[: sum(ok)]  # nothing from file 0
            assert all(got[i] == src[i] for i in range(48) if ok[i])
            assert inspect.check(b) == []
        finally:
            b.close()
    finally:
        a.close()
    c = engine(cfg)  # after a restart: the same
    try:
        ok, got = read_all(c, "more", 40)
        assert all(ok[i] and got[i] == more[i] for i in acked) and acked
        assert inspect.check(c) == []
    finally:
        c.close()


def test_a_page_file_replaced_by_another_is_never_read(cfg: dict[str, Any]) -> None:
    a = engine(cfg)
    try:
        src = write_all(a, "w", 48, 7)
        f0, f1 = files_of(cfg["path"])
        shutil.copyfile(f1, f0 + ".tmp")
        os.replace(f0 + ".tmp", f0)  # file 0 is now a copy of file 1: valid pages, wrong place
        ok, got = read_all(a, "w", 48)
        assert all(got[i] == src[i] for i in range(48) if ok[i])
        fresh = engine(cfg)
        try:
            ok, got = read_all(fresh, "w", 48)
            assert all(got[i] == src[i] for i in range(48) if ok[i]) and sum(ok) == 16
            housekeep(fresh)
            assert inspect.check(fresh) == []
        finally:
            fresh.close()
    finally:
        a.close()


def test_a_directory_added_to_path(cfg: dict[str, Any], tmp_path: Path) -> None:
    """Existing files stay where they are and stay accounted; new files go to the new one."""
    a = engine(cfg)
    try:
        src = write_all(a, "old", 32, 8)  # file 0, in d1
    finally:
        a.close()
    before = files_of(cfg["path"])
    d2 = str(tmp_path / "d2")
    b = engine(cfg, path=[cfg["path"], d2])
    try:
        ok, got = read_all(b, "old", 32)
        assert ok == [True] * 32 and got == src
        write_all(b, "new", 24, 9)  # needs a second file: it goes to d2, which holds none
        assert files_of(cfg["path"]) == before
        assert len(files_of(d2)) == 1
        assert inspect.usage(b)["allocated_bytes"] <= 4 * MiB
        assert page_files_bytes(cfg["path"]) + page_files_bytes(d2) <= 4 * MiB + 2 * 4096
        assert inspect.check(b) == []
    finally:
        b.close()


def test_a_directory_removed_from_path(cfg: dict[str, Any], tmp_path: Path) -> None:
    """Its pages are misses that nobody drops while some process still has it; once no
    process has reported it for 10 x lease_s, its files are forgotten and their capacity
    comes back."""
    d2 = str(tmp_path / "d2")
    both = {**cfg, "path": [cfg["path"], d2], "lease_s": 1.0}
    a = engine(both)
    try:
        write_all(a, "w", 48, 10)
        assert files_of(cfg["path"]) and files_of(d2)
        ns = a.namespace({"m": 1}, PAGE)
        in_d2 = [k for k in keys(48, "w") if (inspect.where(a, ns, k) or ("",))[0].startswith(d2)]
        assert in_d2
        now = time.time()
        one = engine(both, path=[cfg["path"]], clock=lambda: now)
        try:
            ok, _ = read(one, ns, in_d2[:1])
            assert ok == [False]
            housekeep(one)
            assert one.exists([(ns, in_d2)]) == [[True] * len(in_d2)]  # kept: d2 is someone else's now
            assert inspect.check(one) == []
            now += 20  # no process reports d2 any more (a is idle)
            housekeep(one)
            housekeep(one)
            assert one.exists([(ns, in_d2)]) == [[False] * len(in_d2)]
            assert inspect.usage(one)["allocated_bytes"] <= 4 * MiB
            write_all(one, "after", 48, 11)  # the capacity came back: a full store's worth fits
            assert inspect.check(one) == []
        finally:
            one.close()
    finally:
        a.close()


def test_two_nodes_on_one_redis_and_one_prefix(cfg: dict[str, Any], tmp_path: Path) -> None:
    """Each node's local directory makes its own store: neither reads, drops or evicts
    the other's pages."""
    node_a, node_b = engine(cfg), engine(cfg, path=str(tmp_path / "node-b"))
    try:
        for st in (node_a, node_b):
            st.namespace({"m": 1}, PAGE)
        assert node_a.space.attached().tag != node_b.space.attached().tag
        src = write_all(node_a, "a", 40, 12)
        for i in range(6):
            write_all(node_b, f"b{i}", 32, 13)  # 3x its capacity: it evicts its own pages only
            housekeep(node_b)
        ok, got = read_all(node_b, "a", 40)
        assert ok == [False] * 40
        ok, got = read_all(node_a, "a", 40)
        assert ok == [True] * 40 and got == src
        assert inspect.check(node_a) == [] and inspect.check(node_b) == []
    finally:
        node_a.close()
        node_b.close()


def test_a_store_of_the_previous_layout_is_dropped_at_start(cfg: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Keys and slot files as the build before regions wrote them: dropped with one log
    line, their disk space returned, nothing left that holds capacity."""
    p = cfg["redis_prefix"]
    r = redis.Redis.from_url(cfg["redis_url"])
    r.set(f"{p}:bytes", 2 * MiB)
    r.set(f"{p}:gen", 12345)
    r.hset(f"{p}:c:65536", mapping={"spf": 16, "next": 20, "files": 2, "pending": 0})
    for i in range(20):
        r.set(f"{p}:e:0123456789abcdef:{keys(20)[i]}", f"65536:{i}:{12345 + i}:99")
    r.zadd(f"{p}:lru:65536", {f"{p}:e:0123456789abcdef:{k}": 1.0 for k in keys(20)})
    r.rpush(f"{p}:free:65536", 1, 2)
    old = os.path.join(cfg["path"], "c65536")
    os.makedirs(old)
    for n in range(2):
        with open(os.path.join(old, f"f{n:06d}.slots"), "wb") as f:
            f.truncate(MiB)
            os.posix_fallocate(f.fileno(), 0, MiB)
    with caplog.at_level(logging.WARNING):
        st = engine(cfg)
    try:
        assert len([x for x in caplog.records if "previous layout" in x.getMessage()]) == 1
        assert not os.path.exists(old)
        assert [k for k in r.scan_iter(match=f"{p}:*") if not k.startswith(b"{")] == []
        src = write_all(st, "new", 32, 14)
        ok, got = read_all(st, "new", 32)
        assert ok == [True] * 32 and got == src
        assert page_files_bytes(cfg["path"]) <= 2 * MiB + 2 * 4096  # and an extent-tree block: files are sparse at full size
        assert inspect.check(st) == []
    finally:
        st.close()


def test_slot_files_of_the_previous_layout_without_its_keys_are_left_alone(cfg: dict[str, Any]) -> None:
    """Slot files alone prove nothing (another prefix's, another fleet's on a shared path):
    without the previous layout's keys in this index they stay."""
    old = os.path.join(cfg["path"], "c65536")
    os.makedirs(old)
    with open(os.path.join(old, "f000000.slots"), "wb") as f:
        f.write(b"x" * 4096)
    st = engine(cfg)
    try:
        write_all(st, "new", 8, 3)
        assert os.path.exists(os.path.join(old, "f000000.slots"))
    finally:
        st.close()


def test_a_store_of_an_older_format_is_dropped_at_start(cfg: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    st = engine(cfg)
    write_all(st, "w", 16, 15)
    tag = st.space.attached().tag
    st.close()
    r = redis.Redis.from_url(cfg["redis_url"])
    r.hset(meta_key(tag, "meta"), "format", FORMAT - 1)
    with caplog.at_level(logging.WARNING):
        st = engine(cfg)
    try:
        assert "written in format" in caplog.text
        st.namespace({"m": 1}, PAGE)
        assert st.space.attached().tag != tag and r.exists(meta_key(tag, "meta")) == 0
        assert len(files_of(cfg["path"])) == 0
        ok, _ = read_all(st, "w", 16)
        assert ok == [False] * 16
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_store_of_a_newer_format_is_left_alone(cfg: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A rolling upgrade's newer nodes write a newer format: an older node starts a store beside
    theirs and removes nothing of it."""
    st = engine(cfg)
    write_all(st, "w", 16, 15)
    a = st.space.attached()
    tag, newer = a.tag, list(a.home.dirs.values())[0]
    st.close()
    r = redis.Redis.from_url(cfg["redis_url"])
    r.hset(meta_key(tag, "meta"), "format", FORMAT + 1)
    with caplog.at_level(logging.WARNING):
        st = engine(cfg)
    try:
        st.namespace({"m": 1}, PAGE)
        assert st.space.attached().tag != tag and r.exists(meta_key(tag, "meta")) == 1
        assert os.path.isdir(newer) and any(n.endswith(".pages") for n in os.listdir(newer))
        assert inspect.check(st) == []
    finally:
        st.close()


def test_directories_of_different_stores_are_refused(cfg: dict[str, Any], tmp_path: Path) -> None:
    d2 = str(tmp_path / "d2")
    for path in (cfg["path"], d2):  # each its own store (another node's disk, say)
        with engine(cfg, path=path) as st:
            st.namespace({"m": 1}, PAGE)
    with pytest.raises(ConfigError, match="'path'.*different stores"):
        engine(cfg, path=[cfg["path"], d2])
