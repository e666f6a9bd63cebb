"""One allocator for every page size, on real SGLang host pools: capacity follows use,
shrinks on demand (disk space returned), and any capacity from a few MiB up works."""

from __future__ import annotations

import logging
import random
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
from conftest import page_files_bytes
from pools import fill, keys, mha_pool, page_bytes, page_indices, storage_config
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from sglang_tierstore import TierStoreBackend, inspect

MiB = 1 << 20
GiB = 1 << 30
A_POOL = dict(page_size=16, layers=4, heads=4, head_dim=64, tokens=512)  # 64 KiB pages
B_POOL = dict(page_size=16, layers=3, heads=2, head_dim=64, tokens=512)  # 24 KiB pages


def write_batches(be: TierStoreBackend, tag: str, pages: int, batch: int, ps: int = 16) -> list[list[bool]]:
    ks = keys(pages, tag)
    out = []
    for i in range(0, pages, batch):
        host = [(i + j) % 24 for j in range(len(ks[i : i + batch]))]
        out.append(be.batch_set_v1(ks[i : i + batch], page_indices(host, ps)))
        be.store.space.housekeeping.run_once()
    return out


def readable(be: TierStoreBackend, pool: Any, tag: str, first: int, count: int) -> bool:
    """Pages first..first+count of a write_batches run read back with the right bytes."""
    ks = keys(first + count, tag)[first:]
    ok = be.batch_get_v1(ks, page_indices(range(24, 24 + count), 16))
    return ok == [True] * count and all(page_bytes(pool, 24 + j) == page_bytes(pool, (first + j) % 24) for j in range(count))


@contextmanager
def two_models(cfg: dict[str, Any], seed: int) -> Iterator[tuple[TierStoreBackend, Any, TierStoreBackend, Any]]:
    """Backends of two models with different page sizes on one store: (a, its pool, b, its pool)."""
    a_pool, b_pool = mha_pool("page_first_direct", **A_POOL), mha_pool("page_first_direct", **B_POOL)
    fill(a_pool, seed)
    fill(b_pool, seed + 1)
    with TierStoreBackend(storage_config(cfg, model="a"), {}) as a, TierStoreBackend(storage_config(cfg, model="b"), {}) as b:
        a.register_mem_pool_host(a_pool)
        b.register_mem_pool_host(b_pool)
        yield a, a_pool, b, b_pool


def test_a_page_size_that_comes_after_the_store_filled_gets_its_share(extra: dict[str, Any]) -> None:
    """Model A fills the store twice over; then model B (another page size) writes half of
    it: B's batches are all stored and readable, and A keeps its newest pages."""
    cfg = {**extra, "capacity_gb": 4 * MiB / GiB}
    with two_models(cfg, 1) as (a, a_pool, b, b_pool):
        assert all(all(r) for r in write_batches(a, "a", 128, 16))  # 8 MiB of 64 KiB pages
        assert all(all(r) for r in write_batches(b, "b", 80, 16))  # 2 MiB of 24 KiB pages
        assert readable(b, b_pool, "b", 64, 16)
        assert readable(a, a_pool, "a", 112, 16) or readable(a, a_pool, "a", 120, 8)
        sizes = inspect.page_sizes(a.store)
        assert set(sizes) == {a.namespace().page_bytes, b.namespace().page_bytes}
        assert inspect.usage(a.store)["allocated_bytes"] <= 4 * MiB
        assert page_files_bytes(cfg["path"]) <= 4 * MiB + 64 * 1024
        assert a.check() == []


def test_two_models_alternating_past_capacity_share_it_by_use(extra: dict[str, Any]) -> None:
    cfg = {**extra, "capacity_gb": 4 * MiB / GiB}
    with two_models(cfg, 3) as (a, a_pool, b, b_pool):
        a_pb, b_pb = a.namespace().page_bytes, b.namespace().page_bytes
        for rnd in range(4):  # 4 rounds of 1 MiB each: 2x capacity in all
            assert all(all(r) for r in write_batches(a, f"a{rnd}", 16, 8))
            assert all(all(r) for r in write_batches(b, f"b{rnd}", 40, 8))
            assert readable(a, a_pool, f"a{rnd}", 0, 16) and readable(b, b_pool, f"b{rnd}", 0, 40)
            assert inspect.usage(a.store)["allocated_bytes"] <= 4 * MiB
        # then only B writes: its share grows at A's expense, by recency
        before = inspect.page_sizes(a.store)
        assert all(all(r) for r in write_batches(b, "b-only", 120, 8))
        after = inspect.page_sizes(a.store)
        assert after[b_pb]["regions"] > before[b_pb]["regions"]
        assert after.get(a_pb, {"regions": 0})["regions"] < before[a_pb]["regions"]
        assert readable(b, b_pool, "b-only", 80, 40)
        assert a.check() == []


def test_hybrid_kv_and_side_pool_under_capacity_pressure(extra: dict[str, Any]) -> None:
    """A full + side-pool model writes prefixes past capacity with v2 calls: the newest
    prefixes keep both pools (ALL_PAGES hits), housekeeping never empties the side pool."""
    cfg = {**extra, "capacity_gb": 4 * MiB / GiB}
    kv, swa = mha_pool("page_first_direct", **A_POOL), mha_pool("page_first_direct", page_size=16, layers=1, heads=1, head_dim=64, tokens=512)
    fill(kv, 5)
    fill(swa, 6)
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(kv)
        be.register_mem_host_pool_v2(kv, PoolName.KV)
        be.register_mem_host_pool_v2(swa, PoolName.SWA)
        be.on_host_pools_registered()

        def transfer(name: PoolName, ks: list[str], host: list[int]) -> PoolTransfer:
            return PoolTransfer(name=name, host_indices=page_indices(host, 16), keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)

        for p in range(24):  # 24 prefixes of 8 pages: 12 MiB of KV, 3x the capacity
            ks = keys(8, f"prefix{p}")
            host = [(p + j) % 16 for j in range(8)]
            res = be.batch_set_v2([transfer(PoolName.KV, ks, host), transfer(PoolName.SWA, ks, host)])
            assert res == {"kv": [True] * 8, "swa": [True] * 8}
            be.store.space.housekeeping.run_once()
            for q in range(max(0, p - 2), p + 1):  # the newest prefixes are whole, in both pools
                qk = keys(8, f"prefix{q}")
                hit = be.batch_exists_v2(qk, [PoolTransfer(name=PoolName.SWA, keys=qk, hit_policy=PoolHitPolicy.ALL_PAGES)])
                assert hit.kv_hit_pages == 8 and hit.extra_pool_hit_pages.get("swa") == 8, (p, q, hit)
        got = be.batch_get_v2([transfer(PoolName.KV, keys(8, "prefix23"), list(range(16, 24))),
                               transfer(PoolName.SWA, keys(8, "prefix23"), list(range(16, 24)))])
        assert got == {"kv": [True] * 8, "swa": [True] * 8}
        assert page_bytes(swa, 16) == page_bytes(swa, 23 % 16)
        assert inspect.usage(be.store)["allocated_bytes"] <= 4 * MiB
        assert be.check() == []


def test_lowering_capacity_while_traffic_runs_returns_disk_space(extra: dict[str, Any]) -> None:
    cfg = {**extra, "capacity_gb": 8 * MiB / GiB, "housekeeping_s": 3600}  # passes run here, between batches
    pool = mha_pool("page_first_direct", **A_POOL)
    fill(pool, 7)
    errors: list[str] = []
    stop = threading.Event()
    batches = [0]
    progress = threading.Condition()

    def more_batches(n: int) -> None:
        """Wait until the traffic has done ``n`` more batches."""
        with progress:
            target = batches[0] + n
            assert progress.wait_for(lambda: batches[0] >= target or stop.is_set(), 60)

    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert all(all(r) for r in write_batches(be, "fill", 128, 16))  # 8 MiB: full
        assert page_files_bytes(cfg["path"]) > 7 * MiB

        def traffic() -> None:
            rnd = random.Random(1)
            n = 0
            try:
                while not stop.is_set():
                    ks = keys(8, f"t{n}")
                    host = [rnd.randrange(16) for _ in range(8)]
                    be.batch_set_v1(ks, page_indices(host, 16))
                    got = be.batch_get_v1(ks, page_indices(range(16, 24), 16))
                    for j, r in enumerate(got):
                        if r and page_bytes(pool, 16 + j) != page_bytes(pool, host[j]):
                            errors.append(f"wrong bytes for {ks[j]}")
                    n += 1
                    with progress:
                        batches[0] = n
                        progress.notify_all()
            finally:
                stop.set()
                with progress:
                    progress.notify_all()

        t = threading.Thread(target=traffic)
        t.start()
        try:
            more_batches(4)
            be.store.space.set_capacity(2 * MiB)
            for _ in range(50):  # housekeeping passes while the traffic goes on
                be.store.space.housekeeping.run_once()
                if inspect.usage(be.store)["allocated_bytes"] <= 2 * MiB and page_files_bytes(cfg["path"]) <= 2 * MiB + 64 * 1024:
                    break
                more_batches(1)  # writers' commits give back slots in draining regions
            else:
                raise AssertionError((inspect.usage(be.store), page_files_bytes(cfg["path"])))
            more_batches(8)  # traffic goes on at the new size
        finally:
            stop.set()
            t.join()
        assert errors == []
        assert inspect.usage(be.store)["allocated_bytes"] <= 2 * MiB
        assert be.store.stats().get("error_internal", 0) == 0
        assert be.check() == []


def test_a_16_mib_store_works_with_default_settings(extra: dict[str, Any]) -> None:
    cfg = {**extra, "capacity_gb": 16 * MiB / GiB}
    pool = mha_pool("page_first_direct", **A_POOL)
    fill(pool, 8)
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert inspect.usage(be.store)["region_bytes"] == MiB
        assert all(all(r) for r in write_batches(be, "w", 768, 32))  # 48 MiB: 3x
        assert readable(be, pool, "w", 736, 32)
        assert be.batch_exists(keys(1, "w")) == 0  # the oldest are gone
        assert inspect.usage(be.store)["allocated_bytes"] <= 16 * MiB
        assert page_files_bytes(cfg["path"]) <= 16 * MiB + 64 * 1024
        assert be.check() == []


def test_a_smaller_capacity_at_the_next_start(extra: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Restarting with a smaller capacity_gb evicts down to it; one far too small for the
    store's regions re-cuts the store (it is a cache), saying so in one log line."""
    pool = mha_pool("page_first_direct", **A_POOL)
    fill(pool, 9)
    with TierStoreBackend(storage_config({**extra, "capacity_gb": 16 * MiB / GiB}), {}) as be:
        be.register_mem_pool_host(pool)
        assert all(all(r) for r in write_batches(be, "w", 256, 32))
        first = be.store.space.attached().geometry.store_id
    with TierStoreBackend(storage_config({**extra, "capacity_gb": 8 * MiB / GiB}), {}) as be:
        be.register_mem_pool_host(pool)
        be.store.space.housekeeping.run_once()
        assert be.store.space.attached().geometry.store_id == first
        assert inspect.usage(be.store)["allocated_bytes"] <= 8 * MiB
        assert page_files_bytes(extra["path"]) <= 8 * MiB + 64 * 1024
        assert readable(be, pool, "w", 240, 16)
        assert be.check() == []
    with caplog.at_level(logging.WARNING):
        with TierStoreBackend(storage_config({**extra, "capacity_gb": 2 * MiB / GiB}), {}) as be:
            be.register_mem_pool_host(pool)
            assert be.store.space.attached().geometry.store_id != first
            assert inspect.usage(be.store)["region_bytes"] == 128 * 1024
            assert be.batch_exists(keys(256, "w")[-16:]) == 0
            assert all(all(r) for r in write_batches(be, "x", 64, 16))
            assert page_files_bytes(extra["path"]) <= 2 * MiB + 64 * 1024
            assert be.check() == []
    assert len([r for r in caplog.records if "dropped store" in r.getMessage()]) == 1


def test_pages_larger_than_a_region_fail_clearly(extra: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    cfg = {**extra, "capacity_gb": 1 * MiB / GiB}  # 64 KiB regions
    pool = mha_pool("page_first_direct", page_size=16, layers=8, heads=4, head_dim=64, tokens=256)  # 128 KiB pages
    fill(pool, 10)
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        with caplog.at_level(logging.WARNING):
            assert be.batch_set_v1(keys(2), page_indices([0, 1], 16)) == [False, False]
        assert "larger than the store's 65536-byte regions" in caplog.text
        assert be.store.stats()["write_too_big"] == 2
        assert be.check() == []
