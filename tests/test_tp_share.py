"""Instances of different TP sizes share pages (``tp_lcm_size``, heads.py), on SGLang's real
``page_head`` host pools: 4 KV heads at TP 1, 2 per rank at TP 2, ``tp_lcm_size`` 2, each
backend with its own store connection as each rank's process has. Pages written at one size
read back at the other byte for byte, either way; a page some of whose slices are missing
is a miss; without ``tp_lcm_size`` (or in another layout) the sizes stay apart."""

from __future__ import annotations

import os
from typing import Any

import pytest
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, PAGE, LAYERS = 4, 16, 2


def pools(layout: str, head_dim: int) -> tuple[Any, list[Any]]:
    """A TP 1 pool of HEADS heads, filled, and the two TP 2 ranks' pools: in page_head, its
    heads' halves (what each rank holds of the same pages)."""
    whole = mha_pool(layout, page_size=PAGE, layers=LAYERS, heads=HEADS, head_dim=head_dim, tokens=8 * PAGE)
    fill(whole, 7)
    halves = [mha_pool(layout, page_size=PAGE, layers=LAYERS, heads=HEADS // 2, head_dim=head_dim, tokens=8 * PAGE)
              for _ in range(2)]
    for r, h in enumerate(halves):
        if layout == "page_head":  # (2, pages, heads, page_size, layers, dim)
            h.kv_buffer.copy_(whole.kv_buffer[:, :, r * HEADS // 2:(r + 1) * HEADS // 2])
        else:
            fill(h, 8 + r)
    return whole, halves


def empty(heads: int, head_dim: int) -> Any:
    p = mha_pool("page_head", page_size=PAGE, layers=LAYERS, heads=heads, head_dim=head_dim, tokens=8 * PAGE)
    p.kv_buffer.zero_()
    return p


def backends(extra: dict[str, Any], lcm: int | None, layout: str = "page_head") -> tuple[TierStoreBackend, list[TierStoreBackend]]:
    one = TierStoreBackend(storage_config(extra, tp_rank=0, tp_size=1, tp_lcm_size=lcm, layout=layout), {})
    two = [TierStoreBackend(storage_config(extra, tp_rank=r, tp_size=2, tp_lcm_size=lcm, layout=layout), {}) for r in range(2)]
    return one, two


@pytest.mark.parametrize("head_dim", [64, 8], ids=["aligned-slices", "copy-slices"])
def test_pages_written_at_one_tp_size_read_back_at_the_other(extra: dict[str, Any], head_dim: int) -> None:
    whole, halves = pools("page_head", head_dim)
    one, two = backends(extra, 2)
    try:
        one.register_mem_pool_host(whole)
        for b, h in zip(two, halves):
            b.register_mem_pool_host(h)
        assert one.zero_copy() == (head_dim == 64) and all(b.zero_copy() == (head_dim == 64) for b in two)
        assert {one.namespace().ns} == {b.namespace().ns for b in two}  # one namespace for both sizes

        # TP 1 writes pages 0-2; each TP 2 rank reads its heads of them into an empty pool
        ks = keys(3, "tp1")
        assert one.batch_set_v1(ks, page_indices([0, 1, 2], PAGE)) == [True] * 3
        for r, h in enumerate(halves):
            assert two[r].batch_exists(ks) == 3
            target = empty(HEADS // 2, head_dim)
            with TierStoreBackend(storage_config(extra, tp_rank=r, tp_size=2, tp_lcm_size=2, layout="page_head"), {}) as reader:
                reader.register_mem_pool_host(target)
                assert reader.batch_get_v1(ks, page_indices([4, 5, 6], PAGE)) == [True] * 3
            for src, dst in ((0, 4), (1, 5), (2, 6)):
                assert page_bytes(target, dst) == page_bytes(h, src)

        # both TP 2 ranks write pages 3-4; TP 1 reads the whole heads back
        ks2 = keys(2, "tp2")
        for b in two:
            assert b.batch_set_v1(ks2, page_indices([3, 4], PAGE)) == [True] * 2
        target = empty(HEADS, head_dim)
        with TierStoreBackend(storage_config(extra, tp_rank=0, tp_size=1, tp_lcm_size=2, layout="page_head"), {}) as reader:
            reader.register_mem_pool_host(target)
            assert reader.batch_exists(ks2) == 2
            assert reader.batch_get_v1(ks2, page_indices([6, 7], PAGE)) == [True] * 2
        assert page_bytes(target, 6) == page_bytes(whole, 3) and page_bytes(target, 7) == page_bytes(whole, 4)

        # only rank 0 of TP 2 wrote these: half of each page is missing, a miss at TP 1
        ks3 = keys(2, "half")
        assert two[0].batch_set_v1(ks3, page_indices([0, 1], PAGE)) == [True] * 2
        assert one.batch_exists(ks3) == 0
        assert one.batch_get_v1(ks3, page_indices([0, 1], PAGE)) == [False] * 2
        assert two[0].batch_exists(ks3) == 2 and two[1].batch_exists(ks3) == 0
    finally:
        for b in (one, *two):
            b.close()


@pytest.mark.parametrize("lcm,layout", [(None, "page_head"), (2, "page_first")], ids=["no-lcm", "page_first"])
def test_without_tp_lcm_size_or_page_head_the_sizes_stay_apart(extra: dict[str, Any], lcm: int | None, layout: str) -> None:
    whole, halves = pools(layout, 64)
    one, two = backends(extra, lcm, layout)
    try:
        one.register_mem_pool_host(whole)
        for b, h in zip(two, halves):
            b.register_mem_pool_host(h)
        assert len({one.namespace().ns, *(b.namespace().ns for b in two)}) == 3
        ks = keys(2, "apart")
        assert one.batch_set_v1(ks, page_indices([0, 1], PAGE)) == [True] * 2
        assert [b.batch_exists(ks) for b in two] == [0, 0]
    finally:
        for b in (one, *two):
            b.close()
