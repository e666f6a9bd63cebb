"""Never a wrong byte: fingerprints, bit rot, torn/uncommitted writes, races, lost index or files."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

import redis
import torch
from pools import fill, keys, mha_pool, mla_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.index import RedisIndex, parse_entry


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
    raw = be.store.index.lookup([be.store.index.entry_key(ns.ns, key)])[0]
    assert raw is not None
    e = parse_entry(raw)
    file_no, off = be.store.files.locate(ns.cls, e.slot)
    return be.store.files.file_path(ns.cls, file_no), off, ns.page_bytes


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_flipped_bytes_are_misses_and_drop_the_entry(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first_direct")
    fill(pool, 3)
    ks = keys(4)
    with TierStoreBackend(storage_config({**extra, "o_direct": False}), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
        path, off, n = _slot_offset(be, ks[1])
        _flip(path, off + n - 1)  # last byte of page 1
        path, off, _ = _slot_offset(be, ks[3])
        _flip(path, off)  # first byte of page 3
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


def test_unparsable_index_value_is_a_miss_and_is_dropped(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 6)
    ks = keys(3)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(3), 4)) == [True] * 3
        ekey = be.store.index.entry_key(be._pool("kv").ns.ns, ks[1])
        redis.Redis.from_url(extra["redis_url"]).set(ekey, b"not:an:entry")
        assert [p for p in be.check() if "unparsable" in p] == [f"{ekey}: unparsable entry"]
        assert be.batch_get_v1(ks[:2], page_indices([10, 11], 4)) == [True, False]
        assert page_bytes(pool, 10) == page_bytes(pool, 0)
        assert be.store.stats()["error_corrupt"] == 1
        assert be.batch_exists(ks) == 1
        assert be.batch_exists(ks[2:]) == 1


def test_uncommitted_write_is_invisible_and_its_slot_reclaimed(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 4)
    ks = keys(2)
    with TierStoreBackend(storage_config({**extra, "lease_s": 0.2, "housekeeping_s": 3600}), {}) as be:
        be.register_mem_pool_host(pool)
        ns = be._pool("kv").ns
        ekey = be.store.index.entry_key(ns.ns, ks[0])
        # the writer "crashes" after reserving and writing, before FINISH
        gen, _, slots = be.store.index.reserve(ns.cls, [ekey], 0.2, be.cfg.capacity_bytes)
        be.store.files.write_slot(ns.cls, slots[0], be._pool("kv").plan.regions(0), ns.page_bytes, False)
        assert be.batch_exists(ks) == 0
        assert be.batch_get_v1(ks[:1], page_indices([5], 4)) == [False]
        assert be.store.index.usage(ns.cls)["pending"] == 1
        threading.Event().wait(0.3)
        be.housekeeper.run_once()
        u = be.store.index.usage(ns.cls)
        assert u["pending"] == 0 and u["free"] == 1
        assert be.batch_set_v1(ks, page_indices([0, 1], 4)) == [True, True]
        assert be.check() == []


class PausingIndex(RedisIndex):
    """A real RedisIndex whose lookup stops after MGET until the test lets it go on."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.looked_up = threading.Event()
        self.go_on = threading.Event()
        self.pause = False

    def lookup(self, entry_keys: Sequence[str]) -> list[Optional[bytes]]:
        out = super().lookup(entry_keys)
        if self.pause:
            self.looked_up.set()
            assert self.go_on.wait(10)
        return out


def test_read_racing_eviction_and_slot_reuse_never_returns_other_bytes(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 5)
    a, b = keys(1, "a")[0], keys(1, "b")[0]
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        racy = PausingIndex(extra["redis_url"], be.store.index.prefix, 0.5, 1.0)
        be.store.index = racy
        assert be.batch_set_v1([a], page_indices([0], 4)) == [True]
        slot_a = parse_entry(racy.lookup([racy.entry_key(be._pool("kv").ns.ns, a)])[0] or b"").slot
        racy.pause = True
        result: list[list[bool]] = []
        reader = threading.Thread(target=lambda: result.append(be.batch_get_v1([a], page_indices([20], 4))))
        reader.start()
        assert racy.looked_up.wait(10)
        # meanwhile: a is evicted (dropped) and its slot reused by b, with other bytes
        racy.pause = False
        assert racy.drop([(racy.entry_key(be._pool("kv").ns.ns, a), b"")]) == 1
        assert be.batch_set_v1([b], page_indices([1], 4)) == [True]
        assert parse_entry(racy.lookup([racy.entry_key(be._pool("kv").ns.ns, b)])[0] or b"").slot == slot_a
        racy.go_on.set()
        reader.join()
        assert result == [[False]]
        assert be.batch_get_v1([b], page_indices([21], 4)) == [True]
        assert page_bytes(pool, 21) == page_bytes(pool, 1)
        assert be.check() == []


def test_lost_index_or_lost_files_serve_nothing_stale(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 6)
    ks = keys(4)
    r = redis.Redis.from_url(extra["redis_url"])
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4
        # the Redis data is lost, page files remain
        for k in r.scan_iter(match=extra["redis_prefix"] + ":*"):
            r.delete(k)
        assert be.batch_exists(ks) == 0
        assert be.batch_get_v1(ks, page_indices(range(10, 14), 4)) == [False] * 4
        # writing again reuses the old files from slot 0: new pages read back right
        fill(pool, 7)
        assert be.batch_set_v1(ks[2:], page_indices([2, 3], 4)) == [True, True]
        assert be.batch_get_v1(ks[2:], page_indices([20, 21], 4)) == [True, True]
        assert page_bytes(pool, 21) == page_bytes(pool, 3)
        assert be.check() == []
        # now the page files are lost while Redis keeps the entries
        be.store.files.close()
        for f in be.store.files.files():
            os.remove(f)
        assert be.batch_exists(ks[2:]) == 2  # the index still believes...
        assert be.batch_get_v1(ks[2:], page_indices([30, 31], 4)) == [False, False]  # ...reads do not
        assert be.batch_exists(ks[2:]) == 0
        assert be.check() == []
