"""Byte-exact round trips through every call family, on real SGLang host pools."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tierstore_kit.engine import keys
from tierstore_kit.pools import MHA_LAYOUTS, MLA_LAYOUTS, fill, mha_pool, mla_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.tools import inspect

POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def make_pool(kind: str, layout: str, **kw: Any) -> Any:
    return mha_pool(layout, **kw) if kind == "mha" else mla_pool(layout, **kw)


@pytest.mark.parametrize("kind,layout", POOLS)
def test_v1_round_trip_every_layout(extra: dict[str, Any], kind: str, layout: str) -> None:
    src, dst = make_pool(kind, layout), make_pool(kind, layout)
    fill(src, 1)
    fill(dst, 2)
    ks = keys(10)
    src_pages, dst_pages = list(range(3, 13)), list(range(40, 50))
    with TierStoreBackend(storage_config(extra, mla=kind == "mla"), {}) as be:
        be.register_mem_pool_host(src)
        assert be.batch_set_v1(ks, page_indices(src_pages, src.page_size)) == [True] * 10
        assert be.batch_exists(ks) == 10
    with TierStoreBackend(storage_config(extra, mla=kind == "mla"), {}) as be:
        be.register_mem_pool_host(dst)
        assert be.batch_get_v1(ks, page_indices(dst_pages, dst.page_size)) == [True] * 10
        for s, d in zip(src_pages, dst_pages):
            assert page_bytes(dst, d) == page_bytes(src, s)
        assert inspect.check(be.store) == []


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_legacy_and_zero_copy_store_the_same_bytes(extra: dict[str, Any], layout: str) -> None:
    pool = mha_pool(layout)
    fill(pool, 3)
    ps = pool.page_size
    ks = keys(6)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        # legacy write (flat copies, as SGLang's _generic_page_set) -> zero-copy read
        assert be.batch_set(ks[:3], [pool.get_data_page(p * ps) for p in (1, 2, 3)]) is True
        assert be.batch_get_v1(ks[:3], page_indices([20, 21, 22], ps)) == [True] * 3
        for s, d in zip((1, 2, 3), (20, 21, 22)):
            assert page_bytes(pool, d) == page_bytes(pool, s)
        # zero-copy write -> legacy read into dummy flat pages
        assert be.batch_set_v1(ks[3:], page_indices([4, 5, 6], ps)) == [True] * 3
        got = be.batch_get(ks[3:], [pool.get_dummy_flat_data_page() for _ in range(3)])
        for p, t in zip((4, 5, 6), got):
            assert t is not None and t.view(torch.uint8).numpy().tobytes() == page_bytes(pool, p)
        # single-key calls
        assert be.exists(ks[0]) and not be.exists(keys(1, "absent")[0])
        one = be.get(ks[4], pool.get_dummy_flat_data_page())
        assert one is not None and one.view(torch.uint8).numpy().tobytes() == page_bytes(pool, 5)
        assert be.get(keys(1, "absent")[0], pool.get_dummy_flat_data_page()) is None
        assert be.set(keys(1, "single")[0], pool.get_data_page(7 * ps)) is True
        assert be.exists(keys(1, "single")[0])
        assert inspect.check(be.store) == []


def test_leading_hits_with_gaps(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first_direct")
    fill(pool, 4)
    ps = pool.page_size
    ks = keys(6)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        stored = [0, 1, 3, 4]
        assert be.batch_set_v1([ks[i] for i in stored], page_indices(stored, ps)) == [True] * 4
        assert be.batch_exists(ks) == 2
        assert be.batch_exists(ks[3:]) == 2
        assert be.batch_exists(ks[2:]) == 0
        # only the leading run is read; pages past the gap are reported missing
        assert be.batch_get_v1(ks, page_indices(range(30, 36), ps)) == [True, True, False, False, False, False]
        assert be.batch_get_v1(ks[3:5], page_indices([40, 41], ps)) == [True, True]
        assert page_bytes(pool, 40) == page_bytes(pool, 3)
        # writing an existing key again is a success that keeps the first bytes
        assert be.batch_set_v1([ks[0]], page_indices([9], ps)) == [True]
        assert be.batch_get_v1([ks[0]], page_indices([42], ps)) == [True]
        assert page_bytes(pool, 42) == page_bytes(pool, 0)


def test_bad_input_is_a_clear_failure_and_loses_nothing(extra: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    pool = mha_pool("page_first")
    fill(pool, 5)
    ps = pool.page_size
    ks = keys(3)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks, page_indices([0, 1, 2], ps)) == [True] * 3
        # host_indices that do not match the keys: all False, with a message naming the mismatch
        assert be.batch_get_v1(ks, page_indices([5, 6], ps)) == [False] * 3
        assert "3 keys need 12 host indices, got 8" in caplog.text
        # a page buffer of the wrong size
        assert be.batch_get(ks[:1], [torch.zeros(3, dtype=torch.bfloat16)]) == [None]
        assert "has 6 bytes" in caplog.text
        assert be.batch_get_v1(ks, page_indices([5, 6, 7], ps)) == [True] * 3


def test_get_stats_reports_pages(extra: dict[str, Any]) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = mha_pool("page_first")
    fill(pool, 6)
    with TierStoreBackend(storage_config(extra), {}) as quiet:
        quiet.register_mem_pool_host(pool)
        for _ in range(3):
            quiet.batch_get_v1(keys(4), page_indices([8, 9, 10, 11], 4))
        assert quiet.get_stats() is None  # nothing kept unasked (SGLang collects none without metrics)
    with TierStoreBackend(storage_config(extra, metrics=True), {}) as be:
        be.register_mem_pool_host(pool)
        be.batch_set_v1(keys(4), page_indices([0, 1, 2, 3], 4))
        be.batch_get_v1(keys(4), page_indices([8, 9, 10, 11], 4))
        s = be.get_stats()
        assert isinstance(s, StorageMetrics)
        assert s.backup_pgs == [4] and s.prefetch_pgs == [4]
        assert be.get_stats() is None  # nothing since: SGLang reports an empty StorageMetrics itself
        counts = be.store.stats()
        assert counts["write_stored"] == 4 and counts["read_hit"] == 4


def test_clear_drops_only_this_backends_pages(extra: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    fill(pool, 7)
    with TierStoreBackend(storage_config(extra), {}) as a, TierStoreBackend(storage_config(extra, model="other/model"), {}) as b:
        a.register_mem_pool_host(pool)
        b.register_mem_pool_host(pool)
        assert a.batch_set_v1(keys(3), page_indices([0, 1, 2], 4)) == [True] * 3
        assert b.batch_set_v1(keys(3), page_indices([0, 1, 2], 4)) == [True] * 3
        a.clear()
        assert a.batch_exists(keys(3)) == 0
        assert b.batch_exists(keys(3)) == 3
        assert a.batch_set_v1(keys(3), page_indices([0, 1, 2], 4)) == [True] * 3
        assert inspect.check(a.store) == []
