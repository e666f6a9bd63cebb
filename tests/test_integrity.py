"""Never a wrong byte: fingerprints, bit rot, torn/uncommitted writes, races, lost index or files."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import redis
import torch
from conftest import flip_byte
from pools import fill, keys, mha_pool, mla_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.allocator import ALL_SCRIPTS
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.schema import entry_field, unpack_entry


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
    ns = be._pool("kv").ns
    where = be.store.where(ns, key)
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
        assert be.check() != []  # check sees both before any read does
        fill(pool, 99)
        before = page_bytes(pool, 10)
        assert be.batch_get_v1(ks[:2], page_indices([10, 11], 4)) == [True, False]
        assert be.batch_get_v1(ks[3:], page_indices([12], 4)) == [False]
        assert page_bytes(pool, 10) != before  # page 0 was really read
        # both entries are gone, their slots free again; the rest is intact
        assert be.batch_exists(ks) == 1
        assert be.batch_exists(ks[2:3]) == 1
        assert be.check() == []
        assert be.store.stats()["error_corrupt"] == 2
        # the key can be written again and reads back right
        assert be.batch_set_v1(ks[1:2], page_indices([1], 4)) == [True]


def _entries(be: TierStoreBackend) -> tuple[redis.Redis, str]:
    """A plain Redis client and the hash holding the backend's entries (one shard)."""
    return redis.Redis.from_url(be.cfg.redis_url or ""), be.store.attached().alloc.key(0, "entries")


def test_unparsable_index_value_is_a_miss_and_is_dropped(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 6)
    ks = keys(3)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(3), 4)) == [True] * 3
        r, entries = _entries(be)
        field = entry_field(be._pool("kv").ns.ns_id, ks[1])
        good = r.hget(entries, field)
        r.hset(entries, field, b"not an entry")
        assert [p for p in be.check() if "unparsable" in p] == [f"entry {field.hex()}: unparsable entry"]
        assert be.batch_get_v1(ks[:2], page_indices([10, 11], 4)) == [True, False]
        assert page_bytes(pool, 10) == page_bytes(pool, 0)
        assert be.store.stats()["error_corrupt"] == 1
        assert be.batch_exists(ks) == 1
        assert be.batch_exists(ks[2:]) == 1
        # the dropped value named no slot, so its region still counts the page: check sees
        # the member whose entry is gone, and fix makes the slot dead
        assert good is not None and be.check(fix=True) == [f"region {_region_of(good)} slot {_slot_of(good)}: member {field.hex()} has no entry"]
        assert be.check() == []


def test_uncommitted_write_is_invisible_and_its_slots_reclaimed(extra: dict[str, Any]) -> None:
    """A writer dies after taking slots and writing them, before COMMIT."""
    pool = mha_pool("page_first")
    fill(pool, 4)
    ks = keys(2)
    cfg = {**extra, "lease_s": 0.3, "housekeeping_s": 3600}
    with TierStoreBackend(storage_config(cfg), {}) as dying, TierStoreBackend(storage_config(cfg), {}) as be:
        for b in (dying, be):
            b.register_mem_pool_host(pool)
        ns = dying._pool("kv").ns
        a = dying.store.attached()
        dying.store._fill_stock(a, ns.page_bytes, {0: 2})
        slots = a.alloc.take(0, ns.page_bytes, 2)
        g = a.att.geometry
        for (r, sl, _), page in zip(slots, (0, 1)):
            a.files.write(g.file_of(r), g.slot_offset(r, sl, ns.page_bytes), dying._pool("kv").plan.regions(page * 4),
                          ns.page_bytes, False)
        dying.housekeeper.stop()
        dying.store.index.close()  # "killed": no COMMIT, its lease stays
        assert be.batch_exists(ks) == 0
        assert be.batch_get_v1(ks[:1], page_indices([5], 4)) == [False]
        assert be.store.usage()["leases"] >= 1
        assert be.check() == []  # leased slots are a state of their own
        threading.Event().wait(0.4)
        be.housekeeper.run_once()
        assert be.store.usage()["leases"] == 0
        assert be.check() == []
        assert be.batch_set_v1(ks, page_indices([0, 1], 4)) == [True, True]
        assert be.check() == []
        dying.store._att = None  # nothing left for close() to give back


def _region_of(raw: bytes) -> int:
    return unpack_entry(raw).region


def _slot_of(raw: bytes) -> int:
    return unpack_entry(raw).slot


class PausingIndex(RedisIndex):
    """A real RedisIndex whose HMGET stops after it returns until the test lets it go on."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.looked_up = threading.Event()
        self.go_on = threading.Event()
        self.pause = False

    def hmget(self, parts: Any) -> list[list[Optional[bytes]]]:
        out = super().hmget(parts)
        if self.pause:
            self.pause = False
            self.looked_up.set()
            assert self.go_on.wait(10)
        return out


def test_read_racing_eviction_and_slot_reuse_never_returns_other_bytes(extra: dict[str, Any]) -> None:
    """A read looks a page up; before it reads the slot, the page's region is evicted and
    the slot reused by another page with other bytes. The read must be a miss."""
    pool = mha_pool("page_first_direct", page_size=16, layers=4, heads=4, head_dim=64)  # 64 KiB pages
    fill(pool, 5)
    cfg = {**extra, "capacity_gb": 1 / 1024}  # 16 regions of 64 KiB: one page each
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        racy = PausingIndex(extra["redis_url"], 0.5, 1.0)
        racy.register(ALL_SCRIPTS)
        be.store.index = racy
        be.store.attached().alloc.index = racy
        a = keys(1, "a")[0]
        assert be.batch_set_v1([a], page_indices([0], 16)) == [True]
        ns = be._pool("kv").ns
        slot_a = be.store.where(ns, a)
        racy.pause = True
        result: list[list[bool]] = []
        reader = threading.Thread(target=lambda: result.append(be.batch_get_v1([a], page_indices([20], 16))))
        reader.start()
        assert racy.looked_up.wait(10)
        # meanwhile: new pages push a's region out and one of them lands in a's slot
        others = keys(64, "b")
        for i, k in enumerate(others):
            assert be.batch_set_v1([k], page_indices([1 + i % 15], 16)) == [True]
            be.housekeeper.run_once()
            where = be.store.where(ns, k)
            if where is not None and where[:2] == slot_a[:2]:
                reused, host = k, 1 + i % 15
                break
        else:
            raise AssertionError("a's slot was never reused")
        assert be.batch_exists([a]) == 0
        racy.go_on.set()
        reader.join()
        assert result == [[False]]
        assert be.batch_get_v1([reused], page_indices([21], 16)) == [True]
        assert page_bytes(pool, 21) == page_bytes(pool, host)
        assert be.check() == []


def test_lost_index_or_lost_files_serve_nothing_stale(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 6)
    ks = keys(4)
    r = redis.Redis.from_url(extra["redis_url"])
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
        old_store = be.store.attached().att.geometry.store_id
        # the Redis data is lost, page files remain
        for k in r.scan_iter(match=extra["redis_prefix"] + "*"):
            r.delete(k)
        for k in r.scan_iter(match="{" + extra["redis_prefix"] + "*"):
            r.delete(k)
        assert be.batch_exists(ks) == 0
        assert be.batch_get_v1(ks, page_indices(range(10, 14), 4)) == [False] * 4
        # the next writes find the store gone and start a new one (old files removed)
        fill(pool, 7)
        deadline = time.monotonic() + 10
        while be.batch_set_v1(ks[2:], page_indices([2, 3], 4)) != [True, True]:
            assert time.monotonic() < deadline, "the store did not come back"
            time.sleep(0.1)
        assert be.store.attached().att.geometry.store_id != old_store
        assert not any(old_store in f for f in _page_files(extra["path"]))
        assert be.batch_get_v1(ks[2:], page_indices([20, 21], 4)) == [True, True]
        assert page_bytes(pool, 21) == page_bytes(pool, 3)
        assert be.check() == []
        # now the page files are lost while Redis keeps the entries
        files = be.store.attached().files
        for n in files.open_files():  # our handles go (a closed PageFiles would open nothing more)
            files.forget(n)
        for f in _page_files(extra["path"]):
            os.remove(f)
        assert be.batch_exists(ks[2:]) == 2  # the index still believes...
        assert be.batch_get_v1(ks[2:], page_indices([30, 31], 4)) == [False, False]  # ...reads do not
        deadline = time.monotonic() + 10
        while be.batch_exists(ks[2:]) != 0:  # housekeeping forgets the lost file and its pages
            assert time.monotonic() < deadline, "the lost file was not forgotten"
            time.sleep(0.1)
        assert be.check() == []
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4  # and a new file takes pages
        assert be.check() == []


def _page_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".pages")]
