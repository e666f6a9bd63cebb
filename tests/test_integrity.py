"""Never a wrong byte: fingerprints, bit rot, torn/uncommitted writes, races, lost index or files."""

from __future__ import annotations

from collections import Counter
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from tierstore_kit.engine import flip_byte
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import Hook, bury, engine, hooked, housekeep, pages, read, views
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, mla_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.tools import inspect
from sglang_tierstore.schema import entry_field, entry_fields, unpack_entry
from sglang_tierstore.space.reservation import Reservation

HANG_S = 30.0


def test_fingerprints_keep_incompatible_pages_apart(extra: dict[str, Any]) -> None:
    base = mha_pool("page_first")
    fill(base, 1)
    ks = keys(4)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(base)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
    variants = {
        "model": (storage_config(extra, model="other/model"), mha_pool("page_first")),
        "tp_rank": (storage_config(extra, tp_rank=1, tp_size=2), mha_pool("page_first")),
        "tp_size": (storage_config(extra, tp_rank=0, tp_size=2), mha_pool("page_first")),
        "dtype": (storage_config(extra), mha_pool("page_first", dtype=torch.float16)),
        "layout": (storage_config(extra), mha_pool("page_first_direct")),
        "page_size": (storage_config(extra), mha_pool("page_first", page_size=2, layers=6)),
        "heads": (storage_config(extra), mha_pool("page_first", heads=1, head_dim=16)),
        "namespace": (storage_config({**extra, "namespace": "rev2"}), mha_pool("page_first")),
    }
    for what, (cfg, pool) in variants.items():
        with TierStoreBackend(cfg, {}) as be:
            be.register_mem_pool_host(pool)
            assert be.batch_exists(ks) == 0, what
            assert be.batch_get_v1(ks[:1], page_indices([0], pool.page_size)) == [False], what
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(mha_pool("page_first"))
        assert be.batch_exists(ks) == 4


def test_mla_pages_are_shared_across_tp_ranks(extra: dict[str, Any]) -> None:
    src = mla_pool("page_first")
    fill(src, 2)
    ks = keys(3)
    with TierStoreBackend(storage_config(extra, mla=True, tp_rank=0, tp_size=4), {}) as writer:
        writer.register_mem_pool_host(src)
        assert writer.batch_set_v1(ks, page_indices([0, 1, 2], 4)) == [True] * 3
    dst = mla_pool("page_first")
    with TierStoreBackend(storage_config(extra, mla=True, tp_rank=3, tp_size=4), {}) as reader:
        reader.register_mem_pool_host(dst)
        assert reader.batch_get_v1(ks, page_indices([7, 8, 9], 4)) == [True] * 3
        assert page_bytes(dst, 8) == page_bytes(src, 1)


def _slot_offset(be: TierStoreBackend, key: str) -> tuple[str, int, int]:
    """(page file, byte offset of the slot, page bytes) of a committed key."""
    ns = be.namespace()
    where = inspect.where(be.store, ns, key)
    assert where is not None
    return where[0], where[1], ns.page_bytes


def test_flipped_bytes_are_misses_and_drop_the_entry(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first_direct")
    fill(pool, 3)
    ks = keys(4)
    with TierStoreBackend(storage_config({**extra, "o_direct": False}), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
        path, off, n = _slot_offset(be, ks[1])
        flip_byte(path, off + n - 1)  # last byte of page 1
        path, off, _ = _slot_offset(be, ks[3])
        flip_byte(path, off)  # first byte of page 3
        assert inspect.check(be.store) != []  # check sees both before any read does
        fill(pool, 99)
        before = page_bytes(pool, 10)
        assert be.batch_get_v1(ks[:2], page_indices([10, 11], 4)) == [True, False]
        assert be.batch_get_v1(ks[3:], page_indices([12], 4)) == [False]
        assert page_bytes(pool, 10) != before  # page 0 was really read
        # both entries are gone, their slots free again; the rest is intact
        assert be.batch_exists(ks) == 1
        assert be.batch_exists(ks[2:3]) == 1
        assert inspect.check(be.store) == []
        assert be.store.stats()["error_corrupt"] == 2
        # the key can be written again and reads back right
        assert be.batch_set_v1(ks[1:2], page_indices([1], 4)) == [True]


def _entries(be: TierStoreBackend) -> tuple[redis.Redis, str]:
    """A plain Redis client and the hash holding the backend's entries (one shard)."""
    return redis.Redis.from_url(be.cfg.redis_url or ""), be.store.space.attached().key(0, "entries")


def test_unparsable_index_value_is_a_miss_and_is_dropped(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 6)
    ks = keys(3)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(3), 4)) == [True] * 3
        r, entries = _entries(be)
        field = entry_field(be.namespace().ns_id, ks[1])
        good = r.hget(entries, field)
        r.hset(entries, field, b"not an entry")
        assert [p for p in inspect.check(be.store) if "unparsable" in p] == [f"entry {field.hex()}: unparsable entry"]
        assert be.batch_get_v1(ks[:2], page_indices([10, 11], 4)) == [True, False]
        assert page_bytes(pool, 10) == page_bytes(pool, 0)
        assert be.store.stats()["error_corrupt"] == 1
        assert be.batch_exists(ks) == 1
        assert be.batch_exists(ks[2:]) == 1
        # the dropped value named no slot, so its region still counts the page: check sees
        # the member whose entry is gone, and fix makes the slot dead
        assert good is not None and inspect.check(be.store, fix=True) == [f"region {_region_of(good)} slot {_slot_of(good)}: member {field.hex()} has no entry"]
        assert inspect.check(be.store) == []


@pytest.fixture
def cfg(tmp_path: Path, redis_proc: RedisProc) -> dict[str, Any]:
    return {"path": str(tmp_path / "store"), "redis_url": redis_proc.url, "redis_prefix": "i-" + uuid.uuid4().hex[:10],
            "capacity_gb": 1 / 1024, "io_threads": 2}


def test_uncommitted_write_is_invisible_and_its_slots_reclaimed(cfg: dict[str, Any]) -> None:
    """A writer dies after reserving slots and writing them, before its commit."""
    later = [0.0]
    clock = lambda: time.time() + later[0]  # noqa: E731
    dying, st = engine(cfg, clock=clock, lease_s=10), engine(cfg, clock=clock, lease_s=10)
    try:
        ns = dying.namespace({"m": 1}, 65536)
        ks, src = keys(2), pages(2, 65536, 4)
        a = dying.space.attached()
        with Reservation(a, ns.page_bytes, entry_fields(ns.ns_id, ks), Counter()) as res:
            assert len(res.places) == 2
            for place in res.places:
                a.pages.write(place.file, place.offset, [memoryview(src[place.pos])], ns.page_bytes, False)
        dying.index.close()  # "killed": no commit, its lease stays
        ns2 = st.namespace({"m": 1}, 65536)
        assert st.exists([(ns2, ks)]) == [[False, False]]
        assert read(st, ns2, ks[:1])[0] == [False]
        assert inspect.usage(st)["leases"] >= 1
        assert inspect.check(st) == []  # leased slots are a state of their own
        later[0] = 11.0
        housekeep(st)
        assert inspect.usage(st)["leases"] == 0
        assert inspect.check(st) == []
        assert st.write(ns2, ks, views(src), False) == [True, True]
        assert read(st, ns2, ks) == ([True, True], src)
        assert inspect.check(st) == []
    finally:
        st.close()
        bury(dying)


def _region_of(raw: bytes) -> int:
    return unpack_entry(raw).region


def _slot_of(raw: bytes) -> int:
    return unpack_entry(raw).slot


def test_read_racing_eviction_and_slot_reuse_never_returns_other_bytes(cfg: dict[str, Any]) -> None:
    """A read looks a page up; before it reads the slot, the page's region is evicted and
    the slot reused by another page with other bytes. The read must be a miss."""
    looked_up, go_on = threading.Event(), threading.Event()
    pause = [False]

    def paused_read(real: Hook, *args: Any) -> None:  # between the lookup and the preadv
        if pause[0]:
            pause[0] = False
            looked_up.set()
            assert go_on.wait(HANG_S)
        real(*args)

    st = engine(cfg, page_files=hooked({"read": paused_read}))  # 16 regions of 64 KiB: one page each
    try:
        ns = st.namespace({"m": 1}, 65536)
        a, src = keys(1, "a")[0], pages(65, 65536, 5)
        assert st.write(ns, [a], views(src[:1]), False) == [True]
        slot_a = inspect.where(st, ns, a)
        assert slot_a is not None
        pause[0] = True
        result: list[tuple[list[bool], list[bytearray]]] = []
        reader = threading.Thread(target=lambda: result.append(read(st, ns, [a])))
        reader.start()
        assert looked_up.wait(HANG_S)
        # meanwhile: new pages push a's region out and one of them lands in a's slot
        for i, k in enumerate(keys(64, "b")):
            assert st.write(ns, [k], views(src[1 + i : 2 + i]), False) == [True]
            housekeep(st, audit=False)
            where = inspect.where(st, ns, k)
            if where is not None and where[:2] == slot_a[:2]:
                reused, page = k, src[1 + i]
                break
        else:
            raise AssertionError("a's slot was never reused")
        assert st.exists([(ns, [a])]) == [[False]]
        go_on.set()
        reader.join(HANG_S)
        assert result[0][0] == [False]
        assert read(st, ns, [reused]) == ([True], [page])
        assert inspect.check(st) == []
    finally:
        go_on.set()
        st.close()


def test_lost_index_or_lost_files_serve_nothing_stale(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 6)
    ks = keys(4)
    r = redis.Redis.from_url(extra["redis_url"])
    with TierStoreBackend(storage_config({**extra, "housekeeping_s": 3600, "lease_s": 4 * 3600}), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
        old_store = be.store.space.attached().geometry.store_id
        # the Redis data is lost, page files remain
        for k in r.scan_iter(match=extra["redis_prefix"] + "*"):
            r.delete(k)
        for k in r.scan_iter(match="{" + extra["redis_prefix"] + "*"):
            r.delete(k)
        assert be.batch_exists(ks) == 0
        assert be.batch_get_v1(ks, page_indices(range(10, 14), 4)) == [False] * 4
        # the next write finds the store gone (a miss, the attachment dropped); so do the writes
        # until housekeeping attaches again: it starts a new store beside the old one, whose
        # files stay (another index may hold it: `tierstore gc` removes them)
        fill(pool, 7)
        assert be.batch_set_v1(ks[2:], page_indices([2, 3], 4)) == [False, False]
        assert be.batch_set_v1(ks[2:], page_indices([2, 3], 4)) == [False, False]  # not attached: at once
        be.store.space.housekeeping.run_once()
        assert be.batch_set_v1(ks[2:], page_indices([2, 3], 4)) == [True, True]
        assert be.store.space.attached().geometry.store_id != old_store
        assert any(old_store in f for f in _page_files(extra["path"]))
        assert be.batch_get_v1(ks[2:], page_indices([20, 21], 4)) == [True, True]
        assert page_bytes(pool, 21) == page_bytes(pool, 3)
        assert inspect.check(be.store) == []
        # now the page files are lost while Redis keeps the entries
        files = be.store.space.attached().pages
        for n in files.open_files():  # our handles go (a closed PageFiles would open nothing more)
            files.forget(n)
        for f in _page_files(extra["path"]):
            os.remove(f)
        assert be.batch_exists(ks[2:]) == 2  # the index still believes...
        assert be.batch_get_v1(ks[2:], page_indices([30, 31], 4)) == [False, False]  # ...reads do not
        be.store.space.housekeeping.run_once()  # which forgets the lost file and its pages
        assert be.batch_exists(ks[2:]) == 0
        assert inspect.check(be.store) == []
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4  # and a new file takes pages
        assert inspect.check(be.store) == []


def _page_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".pages")]
