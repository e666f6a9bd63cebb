"""Capacity: usage stays within capacity_gb, the newest pages stay, one bad file cannot wedge eviction."""

from __future__ import annotations

import os
from typing import Any

from conftest import page_files_bytes
from pools import fill, keys, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend

MiB = 1 << 20
# 64 KiB pages (16 tokens x 4 layers x 4 heads x 64 dims x K,V x bf16): 16 slots per 1 MiB file
POOL = dict(page_size=16, layers=4, heads=4, head_dim=64, tokens=256)


def cfg(extra: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {**extra, "capacity_gb": 4 * MiB / (1 << 30), "file_size_mb": 1, **kw}


BATCH = 15


def write_rounds(be: TierStoreBackend, pool: Any, tag: str, pages: int, batch: int = BATCH) -> list[tuple[str, int, bool]]:
    """Write `pages` new keys in batches; return (key, host page, stored) in write order."""
    ks = keys(pages, tag)
    out = []
    for i in range(0, pages, batch):
        host = [(i + j) % 30 for j in range(len(ks[i : i + batch]))]
        ok = be.batch_set_v1(ks[i : i + batch], page_indices(host, 16))
        out += list(zip(ks[i : i + batch], host, ok))
        be.housekeeper.run_once()
    return out


def assert_newest_readable(be: TierStoreBackend, pool: Any, written: list[tuple[str, int, bool]], n: int) -> None:
    """The newest ``n`` stored pages read back, less one batch: the pages of a batch share
    one LRU time, so where eviction cuts into a batch depends on the keys' order."""
    newest = [(k, h) for k, h, ok in written if ok][-(n - BATCH) :]
    for k, h in newest:
        assert be.batch_get_v1([k], page_indices([31], 16)) == [True], k
        assert page_bytes(pool, 31) == page_bytes(pool, h)


def test_three_times_capacity_stays_within_it(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first_direct", **POOL)
    fill(pool, 1)
    c = cfg(extra)
    with TierStoreBackend(storage_config(c), {}) as be:
        be.register_mem_pool_host(pool)
        ns = be._pool("kv").ns
        slots = (4 * MiB // ns.cls.file_bytes) * ns.cls.slots_per_file
        written = write_rounds(be, pool, "w", 3 * slots)
        assert all(ok for _, _, ok in written)
        assert page_files_bytes(c["path"]) <= 4 * MiB
        u = be.store.index.usage(ns.cls)
        assert u["allocated_bytes"] <= 4 * MiB and u["files"] == 4
        assert u["pages"] >= slots - 16
        assert_newest_readable(be, pool, written, slots - 16)
        # the oldest are gone
        assert be.batch_exists([written[0][0]]) == 0
        assert be.store.stats()["evicted"] > 0
        assert be.check() == []


def test_one_unwritable_file_does_not_stop_eviction(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first_direct", **POOL)
    fill(pool, 2)
    c = cfg(extra, lease_s=600)
    with TierStoreBackend(storage_config(c), {}) as be:
        be.register_mem_pool_host(pool)
        ns = be._pool("kv").ns
        slots = (4 * MiB // ns.cls.file_bytes) * ns.cls.slots_per_file
        write_rounds(be, pool, "fill", slots)
        bad = be.store.files.file_path(ns.cls, 2)
    os.remove(bad)
    os.mkdir(bad)  # file 2 can no longer be opened: its slots cannot be written
    with TierStoreBackend(storage_config(c), {}) as be:
        be.register_mem_pool_host(pool)
        written = write_rounds(be, pool, "after", 3 * slots)
        stored = sum(ok for _, _, ok in written)
        u = be.store.index.usage(ns.cls)
        assert 0 < u["quarantined"] <= ns.cls.slots_per_file
        assert stored >= len(written) - ns.cls.slots_per_file
        assert all(ok for _, _, ok in written[-slots // 2 :])
        assert_newest_readable(be, pool, written, slots // 2)
        assert page_files_bytes(c["path"]) <= 4 * MiB
        assert be.store.stats()["error_io_write"] > 0
        assert be.check() == []
