"""Entry tags: someone who can write to Redis but cannot read the page directory cannot
make tierstore serve one key's page for another (plain bytes, no torch or SGLang; on
redis-server and valkey-server)."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, engine, housekeep, pages, read, views

from sglang_tierstore.tools import inspect
from sglang_tierstore.errors import ConfigError
from sglang_tierstore.schema import ENTRY, entry_field, unpack_entry, unpack_region
from sglang_tierstore.tags import KEY_BYTES, KEY_FILE
from sglang_tierstore.store import TierStore


@pytest.fixture(params=[0, 30], ids=["direct", "staged"])
def cfg(tmp_path: Path, server_proc: RedisProc, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Both read paths: straight into the caller's buffers, and staged (``read_timeout_s``)."""
    return {"path": str(tmp_path / "store"), "redis_url": server_proc.url, "redis_prefix": "m-" + uuid.uuid4().hex[:10],
            "capacity_gb": 4 * MiB / (1 << 30), "io_threads": 2, "read_timeout_s": request.param}


@pytest.fixture
def attacker(server_proc: RedisProc) -> Iterator[redis.Redis]:
    """A client that can write to the index (and nothing else)."""
    r = redis.Redis.from_url(server_proc.url)
    yield r
    r.close()


def _entries_key(st: TierStore) -> str:
    return st.space.attached().key(0, "entries")


def _key_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n == KEY_FILE]


def test_an_entry_moved_to_another_key_is_a_miss_and_is_dropped(cfg: dict[str, Any], attacker: redis.Redis) -> None:
    a, b = keys(2, "moved")
    src = pages(2, 4096, 1)
    st = engine(cfg)
    try:
        ns = st.namespace({"model": "m"}, 4096)
        assert st.write(ns, [a, b], views(src), False) == [True, True]
        ek = _entries_key(st)
        stolen = attacker.hget(ek, entry_field(ns.ns_id, a))
        assert stolen is not None
        attacker.hset(ek, entry_field(ns.ns_id, b), stolen)  # b now names a's slot, checksum and all
        ok, got = read(st, ns, [b])
        assert ok == [False] and got[0] != src[0]  # a's bytes would have verified against the checksum
        assert attacker.hget(ek, entry_field(ns.ns_id, b)) is None  # dropped
        assert st.metrics.snapshot()["error_forged"] == 1
        ok, got = read(st, ns, [a])
        assert ok == [True] and got[0] == src[0]
    finally:
        st.close()


def test_forged_or_edited_entries_are_misses_and_check_names_them(cfg: dict[str, Any], attacker: redis.Redis) -> None:
    ks = keys(3, "forged")
    src = pages(3, 4096, 2)
    st = engine(cfg)
    try:
        ns = st.namespace({"model": "m"}, 4096)
        assert st.write(ns, ks, views(src), False) == [True] * 3
        ek = _entries_key(st)
        e0 = unpack_entry(attacker.hget(ek, entry_field(ns.ns_id, ks[0])))
        e1 = unpack_entry(attacker.hget(ek, entry_field(ns.ns_id, ks[1])))
        # the tag of key 0 kept, its slot pointed at key 1's page (with key 1's checksum)
        attacker.hset(ek, entry_field(ns.ns_id, ks[0]), ENTRY.pack(e1.region, e1.gen, e1.slot, e1.checksum, e0.tag))
        # a made-up tag
        attacker.hset(ek, entry_field(ns.ns_id, ks[2]), ENTRY.pack(*unpack_entry(attacker.hget(ek, entry_field(ns.ns_id, ks[2])))[:4],
                                                                       os.urandom(16)))
        problems = inspect.check(st)
        named = [k for k in ks if any(p.startswith(f"entry {entry_field(ns.ns_id, k).hex()}:") for p in problems)]
        assert named == [ks[0], ks[2]], problems
        assert f"entry {entry_field(ns.ns_id, ks[2]).hex()}: its tag is not valid for it" in "\n".join(problems)
        ok, got = read(st, ns, ks)
        assert ok == [False, True, False] and got[1] == src[1]
        assert st.exists([(ns, ks)]) == [[False, True, False]]  # both dropped by the read
    finally:
        st.close()


def test_a_replayed_old_entry_reads_as_a_miss(cfg: dict[str, Any], attacker: redis.Redis) -> None:
    """An entry saved before its region was reused, put back (as it was, or with the
    region's new generation) after the slot came to hold another page."""
    k = keys(1, "replayed")[0]
    st = engine(cfg)
    try:
        ns = st.namespace({"model": "m"}, 4096)
        assert st.write(ns, [k], views(pages(1, 4096, 3)), False) == [True]
        ek = _entries_key(st)
        old_raw = attacker.hget(ek, entry_field(ns.ns_id, k))
        old = unpack_entry(old_raw)
        st.clear([ns])
        housekeep(st)
        regions_key = st.space.attached().key(0, "regions")
        fillers = keys(3000, "filler")  # three times what the store holds: regions are evicted and used again
        for i in range(0, len(fillers), 100):
            st.write(ns, fillers[i : i + 100], views(pages(100, 4096, 100 + i)), False)
            reg = unpack_region(attacker.hget(regions_key, old.region))
            if reg.gen != old.gen and reg.fill > old.slot:
                break
        else:
            pytest.fail("the old entry's region was never reused")
        for replay in (old_raw, ENTRY.pack(old.region, reg.gen, old.slot, old.checksum, old.tag)):
            attacker.hset(ek, entry_field(ns.ns_id, k), replay)
            assert read(st, ns, [k])[0] == [False]
            assert attacker.hget(ek, entry_field(ns.ns_id, k)) is None
    finally:
        st.close()


def test_the_entry_key_is_private_shared_by_processes_and_never_in_redis(cfg: dict[str, Any], tmp_path: Path,
                                                                         attacker: redis.Redis) -> None:
    dirs = [str(tmp_path / "d1"), str(tmp_path / "d2")]
    ks = keys(4, "shared")
    src = pages(4, 4096, 4)
    one, two = engine(cfg, path=dirs), engine(cfg, path=dirs)
    try:
        ns1, ns2 = one.namespace({"model": "m"}, 4096), two.namespace({"model": "m"}, 4096)
        assert one.write(ns1, ks, views(src), False) == [True] * 4
        ok, got = read(two, ns2, ks)
        assert ok == [True] * 4 and got == src
        files = _key_files(str(tmp_path))
        assert len(files) == 2  # one in each of the store's directories
        contents = {Path(f).read_bytes() for f in files}
        assert len(contents) == 1 and len(next(iter(contents))) == KEY_BYTES
        assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
        key = next(iter(contents))
        for name in attacker.scan_iter(match=f"*{cfg['redis_prefix']}*"):
            kind = attacker.type(name)
            if kind == b"hash":
                blobs = [f + v for f, v in attacker.hgetall(name).items()]
            elif kind == b"zset":
                blobs = attacker.zrange(name, 0, -1)
            else:
                assert kind == b"string", (name, kind)
                blobs = [attacker.get(name) or b""]
            assert blobs and not any(key in blob for blob in blobs), name
    finally:
        one.close()
        two.close()


def test_a_lost_key_turns_every_page_into_a_miss(cfg: dict[str, Any], tmp_path: Path) -> None:
    ks = keys(3, "lost")
    st = engine(cfg)
    try:
        ns = st.namespace({"model": "m"}, 4096)
        assert st.write(ns, ks, views(pages(3, 4096, 5)), False) == [True] * 3
    finally:
        st.close()
    (f,) = _key_files(cfg["path"])
    old = Path(f).read_bytes()
    os.unlink(f)
    st = engine(cfg)  # a new key is made: entries under the old one no longer verify
    try:
        ns = st.namespace({"model": "m"}, 4096)
        assert Path(f).read_bytes() != old
        assert read(st, ns, ks)[0] == [False] * 3
        assert st.exists([(ns, ks)]) == [[False] * 3]
        assert inspect.check(st) == []
    finally:
        st.close()


def test_directories_with_different_keys_or_a_broken_key_are_refused(cfg: dict[str, Any], tmp_path: Path) -> None:
    dirs = [str(tmp_path / "d1"), str(tmp_path / "d2")]
    with engine(cfg, path=dirs) as st:
        st.namespace({"model": "m"}, 4096)  # the store is created for its first pages
    f1, f2 = sorted(_key_files(str(tmp_path)))
    Path(f2).write_bytes(os.urandom(KEY_BYTES))
    with pytest.raises(ConfigError, match="different entry keys") as e:
        engine(cfg, path=dirs)
    assert f1 in str(e.value) and f2 in str(e.value)
    Path(f2).write_bytes(b"short")
    with pytest.raises(ConfigError, match=f"{f2} is not an entry key"):
        engine(cfg, path=dirs)
    os.unlink(f2)  # the operator removes the wrong one: the other directory's key is copied back
    engine(cfg, path=dirs).close()
    assert Path(f2).read_bytes() == Path(f1).read_bytes()

