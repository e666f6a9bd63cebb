"""One allocator for every page size, on real SGLang host pools: capacity follows use,
shrinks on demand (disk space returned), and any capacity from a few MiB up works."""

from __future__ import annotations

import logging
import os
import random
import uuid
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from tierstore_kit.engine import page_files_bytes
from tierstore_kit.mounts import mounted
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from sglang_tierstore import ConfigError, TierStoreBackend
from sglang_tierstore.tools import inspect

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
        assert inspect.check(a.store) == []


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
        assert inspect.check(a.store) == []


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
        assert inspect.check(be.store) == []


def test_lowering_capacity_while_traffic_runs_returns_disk_space(extra: dict[str, Any]) -> None:
    cfg = {**extra, "capacity_gb": 8 * MiB / GiB, "housekeeping_s": 3600, "lease_s": 4 * 3600}  # passes run here, between batches
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
        assert inspect.check(be.store) == []


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
        assert inspect.check(be.store) == []


def test_a_process_started_with_another_capacity_keeps_the_stores(extra: dict[str, Any],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A serves a 64 MiB store; C starts on it with capacity_gb for 8 MiB (a typo on one
    node, one rank): the store keeps its capacity, regions and every page, and C says both
    values in one log line. Shrinking is an operator's act: a resize evicts down to it, the
    store's id and regions unchanged, the disk space returned."""
    pool = mha_pool("page_first_direct", **A_POOL)
    fill(pool, 9)
    cfg = {**extra, "capacity_gb": 64 * MiB / GiB}
    with TierStoreBackend(storage_config(cfg), {}) as a:
        a.register_mem_pool_host(pool)
        assert all(all(r) for r in write_batches(a, "w", 600, 40))  # 600 pages of 64 KiB: 37.5 MiB
        first = a.store.space.attached().geometry
        with caplog.at_level(logging.WARNING):
            with TierStoreBackend(storage_config({**extra, "capacity_gb": 8 * MiB / GiB}), {}) as c:
                c.register_mem_pool_host(pool)
                assert [r.getMessage() for r in caplog.records if "is not applied" in r.getMessage()] == [
                    f"tierstore: store {first.store_id} (prefix {extra['redis_prefix']!r}) has capacity 0.062 GiB; this "
                    "process's capacity_gb 0.008 is not applied (a store's capacity is its own: `tierstore resize` "
                    "changes it)"]
                c.store.space.housekeeping.run_once()
                assert c.store.space.attached().geometry == first
                assert inspect.usage(c.store)["capacity_bytes"] == 64 * MiB
                assert c.batch_exists(keys(600, "w")) == 600 and readable(c, pool, "w", 584, 16)
                c.store.space.set_capacity(8 * MiB)  # the operator's act (tierstore resize)
                for _ in range(4):
                    c.store.space.housekeeping.run_once()
                assert c.store.space.attached().geometry == first
                assert inspect.usage(c.store)["allocated_bytes"] <= 8 * MiB
                assert page_files_bytes(extra["path"]) <= 8 * MiB + 64 * 1024
                assert inspect.check(c.store) == []
        assert "dropped store" not in caplog.text


@pytest.mark.parametrize("page", [96 * MiB + 4096, GiB])
def test_a_store_is_cut_for_the_pages_it_is_created_for(page: int) -> None:
    """Pages of any size up to 1 GiB get regions that hold them, when the store is created
    for them and is large enough (four regions at least); the region size is a power of
    two at least the page. Unit: the sizes a new store chooses."""
    from sglang_tierstore.space.geometry import region_bytes_for

    rb = region_bytes_for(8 * page, page)
    assert rb >= page and rb & (rb - 1) == 0 and rb < 2 * page + 8192
    assert region_bytes_for(64 * GiB, 256 << 10) == 64 * MiB  # ordinary pages: as before
    with pytest.raises(ValueError, match=rf"needs at least 4 of them: capacity_gb {4 * rb / GiB:g} or more"):
        region_bytes_for(2 * page, page)
    with pytest.raises(ValueError, match="larger than the largest a store holds"):
        region_bytes_for(64 * GiB, 2 * GiB)


def test_pages_of_96_mib_are_stored_and_read_back(tmp_path: Any, redis_proc: Any) -> None:
    """A large model with a large --page-size (80 layers x 8 KV heads x 128 x 2 x 2 bytes x
    256 tokens = 80 MiB per page, and more): its pages round-trip through a store created
    for them, which cuts 128 MiB regions."""
    import uuid

    from tierstore_kit.engine import engine, pages, views

    page = 96 * MiB
    with engine({"path": str(tmp_path / "s"), "redis_url": redis_proc.url, "redis_prefix": "big-" + uuid.uuid4().hex[:8],
                 "capacity_gb": 0.5, "io_threads": 4}) as st:
        ns = st.namespace({"model": "big"}, page)
        assert inspect.usage(st)["region_bytes"] == 128 * MiB
        src = pages(2, page, 3)
        assert st.write(ns, keys(2, "big"), views(src), False) == [True, True]
        out = [bytearray(page) for _ in range(2)]
        assert st.read(ns, keys(2, "big"), views(out), False) == [True, True] and out == src
        assert inspect.check(st) == []


def test_a_pool_whose_pages_do_not_fit_the_stores_regions_is_refused_alone(
        extra: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A store created for 64 KiB pages cuts 1 MiB regions (a 16 MiB store); a second model
    whose KV pages are 2 MiB starts on it: nothing raises (its own config is fine), one log
    line names the page size, the region size and the ways out, its KV pages are never
    stored (outcome too_big, asking the index nothing) and its probes miss, while its side
    pool and the first model work. A store too small for the pages it would be created
    for is still refused, naming the capacity it needs."""
    small = mha_pool("page_first_direct", **A_POOL)
    big = mha_pool("page_first_direct", page_size=16, layers=128, heads=4, head_dim=64, tokens=64)  # 2 MiB pages
    side = mha_pool("page_first_direct", page_size=16, layers=1, heads=1, head_dim=64, tokens=64)
    for i, p in enumerate((small, big, side)):
        fill(p, 40 + i)
    cfg = {**extra, "capacity_gb": 16 * MiB / GiB}
    ks = keys(4, "big")
    with TierStoreBackend(storage_config(cfg, model="small"), {}) as a:
        a.register_mem_pool_host(small)
        with caplog.at_level(logging.WARNING), TierStoreBackend(storage_config(cfg, model="big"), {}) as b:
            b.register_mem_pool_host(big)
            b.register_mem_host_pool_v2(side, PoolName.SWA)
            b.on_host_pools_registered()
            for _ in range(3):
                assert b.batch_set_v1(ks, page_indices(range(4), 16)) == [False] * 4
            assert b.store.stats()["write_too_big"] == 12 and "write_raised" not in b.store.stats()
            assert b.batch_exists(ks) == 0
            assert b.batch_get_v1(ks, page_indices(range(4), 16)) == [False] * 4
            swa = [PoolTransfer(name=PoolName.SWA, host_indices=page_indices(range(4), 16), keys=ks)]
            assert b.batch_set_v2(swa) == {"swa": [True] * 4}
            swa = [PoolTransfer(name=PoolName.SWA, host_indices=page_indices(range(4, 8), 16), keys=ks)]
            assert b.batch_get_v2(swa) == {"swa": [True] * 4}
            assert page_bytes(side, 7) == page_bytes(side, 3)
            assert a.batch_set_v1(ks, page_indices(range(4), 16)) == [True] * 4
            assert a.batch_get_v1(ks, page_indices(range(10, 14), 16)) == [True] * 4
            said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(said) == 1, said
            assert all(w in said[0] for w in ("pages of 2097152 bytes", "1048576-byte regions", "too_big",
                                              "another redis_prefix", "tierstore drop")), said[0]
            assert inspect.check(b.store) == []
    tiny = {**extra, "redis_prefix": extra["redis_prefix"] + "-tiny", "capacity_gb": 4 * MiB / GiB}
    with TierStoreBackend(storage_config(tiny, model="big"), {}) as be:
        with pytest.raises(ConfigError, match=r"'capacity_gb': a store for pages of 2097152 bytes has 2097152-byte "
                                              r"regions and needs at least 4 of them: capacity_gb 0.0078125 or more"):
            be.register_mem_pool_host(big)


def page_files_size(path: str) -> int:
    """The page files' apparent size: what a filesystem without holes keeps on disk."""
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path)
               for n in names if n.endswith(".pages"))


def test_capacity_bounds_the_files_where_holes_cannot_be_punched(tmp_path: Path, redis_proc: Any) -> None:
    """ramfs cannot punch holes (FALLOC_FL_PUNCH_HOLE answers EOPNOTSUPP, as on NFSv3 and
    many FUSE filesystems): a 16 MiB store cut to 4 MiB and raised back, twice, keeps its
    page files at 16 MiB, the regions taken out reused in place (before the fix its files
    grew 16 -> 28 -> 40 MiB, with the cut regions queued to punch forever)."""
    with mounted(tmp_path / "ramfs", "ramfs") as disk:
        cfg = {"redis_url": redis_proc.url, "redis_prefix": "nopunch-" + uuid.uuid4().hex[:8],
               "path": str(disk / "store"), "capacity_gb": 16 * MiB / GiB, "interface_v1": 1}
        pool = mha_pool("page_first_direct", **A_POOL)
        fill(pool, 5)
        with TierStoreBackend(storage_config(cfg), {}) as be:
            be.register_mem_pool_host(pool)
            sizes = []
            for turn in range(3):
                assert all(all(r) for r in write_batches(be, f"t{turn}", 320, 32))  # 20 MiB of 64 KiB pages
                assert readable(be, pool, f"t{turn}", 288, 32)
                sizes.append(page_files_size(cfg["path"]))
                if turn == 2:
                    break
                be.store.space.set_capacity(4 * MiB)
                for _ in range(20):
                    be.store.space.housekeeping.run_once()
                    u = inspect.usage(be.store)
                    if u["allocated_bytes"] <= 4 * MiB and u["punch_regions"] == 0:
                        break
                else:
                    raise AssertionError(inspect.usage(be.store))
                be.store.space.set_capacity(16 * MiB)
            assert sizes[0] <= 16 * MiB + 64 * 1024 and sizes == sizes[:1] * 3  # capacity and the files' headers
            assert inspect.usage(be.store)["punch_regions"] == 0
            assert inspect.check(be.store) == []
