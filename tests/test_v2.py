"""The v2 family: side pools, hit policies and restorable_prefix_pages."""

from __future__ import annotations

from typing import Any

import torch
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.tools import inspect

SWA = PoolName.SWA
MAMBA = PoolName.MAMBA


def backend(extra: dict[str, Any]) -> tuple[TierStoreBackend, Any, Any, Any]:
    kv, swa, mamba = mha_pool("page_first"), mha_pool("page_first_direct", layers=1, heads=1), mha_pool("layer_first", layers=2)
    for i, p in enumerate((kv, swa, mamba)):
        fill(p, 10 + i)
    be = TierStoreBackend(storage_config(extra), {})
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(kv, PoolName.KV)
    be.register_mem_host_pool_v2(swa, SWA)
    be.register_mem_host_pool_v2(mamba, MAMBA)
    be.on_host_pools_registered()
    return be, kv, swa, mamba


def transfer(name: PoolName, pages: list[int], ks: list[str], policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES, **kw: Any) -> PoolTransfer:
    return PoolTransfer(name=name, host_indices=page_indices(pages, 4), keys=ks, hit_policy=policy, **kw)


def test_v2_round_trip_side_pools(extra: dict[str, Any]) -> None:
    be, kv, swa, mamba = backend(extra)
    with be:
        ks = keys(5)
        res = be.batch_set_v2([transfer(PoolName.KV, [0, 1, 2, 3, 4], ks), transfer(SWA, [5, 6, 7, 8, 9], ks), transfer(MAMBA, [2, 3, 4, 5, 6], ks)])
        assert res == {"kv": [True] * 5, "swa": [True] * 5, "mamba": [True] * 5}
        got = be.batch_get_v2([transfer(SWA, [20, 21, 22, 23, 24], ks), transfer(MAMBA, [30, 31, 32, 33, 34], ks)])
        assert got == {"swa": [True] * 5, "mamba": [True] * 5}
        for s, d in zip([5, 6, 7, 8, 9], [20, 21, 22, 23, 24]):
            assert page_bytes(swa, d) == page_bytes(swa, s)
        for s, d in zip([2, 3, 4, 5, 6], [30, 31, 32, 33, 34]):
            assert page_bytes(mamba, d) == page_bytes(mamba, s)
        # a pool nobody registered fails alone; the other transfers still run
        got = be.batch_get_v2([transfer(PoolName.INDEXER, [1], ks[:1]), transfer(SWA, [40], ks[:1])])
        assert got == {"indexer": [False], "swa": [True]}
        # a bad transfer (indices do not match keys) fails alone too
        bad = PoolTransfer(name=SWA, host_indices=torch.arange(3), keys=ks[:2])
        assert be.batch_set_v2([bad, transfer(MAMBA, [1], ks[:1])]) == {"swa": [False, False], "mamba": [True]}
        assert be.store.stats()["error_bad_call"] == 2  # the caller's mistakes, not bugs (no internal error)
        assert inspect.check(be.store) == []


def test_all_pages_policy(extra: dict[str, Any]) -> None:
    be, *_ = backend(extra)
    with be:
        ks = keys(6)
        be.batch_set_v1(ks, page_indices(range(6), 4))
        be.batch_set_v2([transfer(SWA, [0, 1, 2], ks[:3])])
        r = be.batch_exists_v2(ks, [transfer(SWA, [], [], PoolHitPolicy.ALL_PAGES)])
        assert r.kv_hit_pages == 3
        assert r.extra_pool_hit_pages == {"kv": 6, "swa": 3}
        assert r.restorable_prefix_pages == [1, 2, 3]
        # no side pools: plain leading KV hits
        r = be.batch_exists_v2(ks[:5])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (5, [1, 2, 3, 4, 5])


def test_trailing_pages_policy_gives_sparse_restorable_prefixes(extra: dict[str, Any]) -> None:
    be, *_ = backend(extra)
    with be:
        ks = keys(8)
        be.batch_set_v1(ks, page_indices(range(8), 4))
        # mamba state exists for pages 2, 3 and 6 (0-based): with a window of 2 pages,
        # prefixes of length 4 (pages 2,3) and ... are restorable; 7 needs pages 5,6
        stored = [2, 3, 6]
        be.batch_set_v2([transfer(MAMBA, stored, [ks[i] for i in stored])])
        r = be.batch_exists_v2(ks, [transfer(MAMBA, [], ks[:2], PoolHitPolicy.TRAILING_PAGES)])
        assert r.restorable_prefix_pages == [4]
        assert r.kv_hit_pages == 4
        assert r.extra_pool_hit_pages["mamba"] == 4
        # window of 1: every page with a state is a restorable end
        r = be.batch_exists_v2(ks, [transfer(MAMBA, [], ks[:1], PoolHitPolicy.TRAILING_PAGES)])
        assert r.restorable_prefix_pages == [3, 4, 7]
        assert r.kv_hit_pages == 7
        # combined with an ALL_PAGES pool, only prefixes both allow survive
        be.batch_set_v2([transfer(SWA, [0, 1, 2], ks[:3])])
        r = be.batch_exists_v2(ks, [transfer(MAMBA, [], ks[:1], PoolHitPolicy.TRAILING_PAGES), transfer(SWA, [], [], PoolHitPolicy.ALL_PAGES)])
        assert r.restorable_prefix_pages == [3]
        assert r.kv_hit_pages == 3


def test_block_groups_policy_reports_its_own_verdict(extra: dict[str, Any]) -> None:
    be, *_ = backend(extra)
    with be:
        ks = keys(8)
        block_keys = keys(5, "block")
        be.batch_set_v1(ks, page_indices(range(8), 4))
        # groups of 2 keys, each covering 4 FULL pages; groups 0 and 1 complete, group 2 half
        assert be.batch_set_v2([transfer(SWA, [0, 1, 2, 3, 4], block_keys)]) == {"swa": [True] * 5}
        t = transfer(SWA, [], block_keys, PoolHitPolicy.BLOCK_GROUPS, block_pages=4, group_pages=2)
        r = be.batch_exists_v2(ks, [t])
        assert r.kv_hit_pages == 8  # never gates the KV hit
        assert r.restorable_prefix_pages == list(range(1, 9))
        assert r.extra_pool_hit_pages["swa"] == 8
        missing_first = transfer(SWA, [], keys(4, "nope"), PoolHitPolicy.BLOCK_GROUPS, block_pages=4, group_pages=2)
        r = be.batch_exists_v2(ks, [missing_first])
        assert r.kv_hit_pages == 8 and "swa" not in r.extra_pool_hit_pages
