"""Instances of different TP sizes share pages (``tp_lcm_size``, heads.py), on SGLang's real
``page_head`` host pools: 4 KV heads at TP 1, 2 per rank at TP 2, ``tp_lcm_size`` 2 (the
config as SGLang's cache controller builds it). Pages a TP 1 process writes, a TP 2 process
(``proc_tp2.py``) reads byte for byte, and the other way round; a page some of whose slices
are missing is a miss; without ``tp_lcm_size``, or in another layout, the sizes stay apart.

(A real TP 1 and TP 2 server cannot run this on CPU: SGLang 0.5.23 moves ``page_head``
pages only with ``--hicache-io-backend kernel``, whose transfer ops are CUDA kernels.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
from tierstore_kit.engine import keys
from tierstore_kit.pools import mha_pool, page_bytes, page_indices, storage_config, tp_pools

from sglang_tierstore import TierStoreBackend

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, PAGE, LAYERS = 4, 16, 2


def tp1(extra: dict[str, Any], lcm: int | None = 2, layout: str = "page_head") -> TierStoreBackend:
    return TierStoreBackend(storage_config(extra, tp_rank=0, tp_size=1, tp_lcm_size=lcm, layout=layout), {})


def tp2(extra: dict[str, Any], rank: int, lcm: int | None = 2, layout: str = "page_head") -> TierStoreBackend:
    return TierStoreBackend(storage_config(extra, tp_rank=rank, tp_size=2, tp_lcm_size=lcm, layout=layout), {})


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 8], ids=["zero-copy-slices", "unaligned-slices"])
def test_pages_written_at_one_tp_size_read_back_at_the_other(extra: dict[str, Any], head_dim: int) -> None:
    whole, halves = tp_pools("page_head", HEADS, head_dim, PAGE, LAYERS)
    with tp1(extra) as one:
        one.register_mem_pool_host(whole)
        assert one.zero_copy() == (head_dim == 64)
        with tp2(extra, 0) as other:  # one namespace for both sizes
            other.register_mem_pool_host(halves[0])
            assert other.namespace().ns == one.namespace().ns and other.zero_copy() == (head_dim == 64)
        assert one.batch_set_v1(keys(3, "tp1"), page_indices([0, 1, 2], PAGE)) == [True] * 3
        child = subprocess.run([sys.executable, os.path.join(HERE, "proc_tp2.py"), json.dumps(extra), str(head_dim)],
                               timeout=240, check=False)
        assert child.returncode == 0, f"the TP 2 process failed at step {child.returncode}"
        target = mha_pool("page_head", page_size=PAGE, layers=LAYERS, heads=HEADS, head_dim=head_dim, tokens=8 * PAGE)
        target.kv_buffer.zero_()
        one.register_mem_pool_host(target)
        assert one.batch_exists(keys(2, "tp2")) == 2
        assert one.batch_get_v1(keys(2, "tp2"), page_indices([6, 7], PAGE)) == [True] * 2
        assert page_bytes(target, 6) == page_bytes(whole, 3) and page_bytes(target, 7) == page_bytes(whole, 4)


def test_a_page_with_a_slice_missing_is_a_miss(extra: dict[str, Any]) -> None:
    """Only rank 0 of a TP 2 instance wrote these pages: half of each page's heads."""
    whole, halves = tp_pools("page_head", HEADS, 64, PAGE, LAYERS)
    with tp1(extra) as one, tp2(extra, 0) as r0, tp2(extra, 1) as r1:
        for be, pool in ((one, whole), (r0, halves[0]), (r1, halves[1])):
            be.register_mem_pool_host(pool)
        ks = keys(2, "half")
        assert r0.batch_set_v1(ks, page_indices([0, 1], PAGE)) == [True] * 2
        assert one.batch_exists(ks) == 0 and one.batch_get_v1(ks, page_indices([0, 1], PAGE)) == [False] * 2
        assert r0.batch_exists(ks) == 2 and r1.batch_exists(ks) == 0


@pytest.mark.parametrize("lcm,layout", [(None, "page_head"), (2, "page_first")], ids=["no-lcm", "page_first"])
def test_without_tp_lcm_size_or_page_head_the_sizes_stay_apart(extra: dict[str, Any], lcm: int | None, layout: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Each rank keeps its own namespace; a pool given ``tp_lcm_size`` that cannot share says why."""
    whole, halves = tp_pools(layout, HEADS, 64, PAGE, LAYERS)
    with tp1(extra, lcm, layout) as one, tp2(extra, 0, lcm, layout) as r0, tp2(extra, 1, lcm, layout) as r1:
        with caplog.at_level(logging.WARNING, logger="sglang_tierstore"):
            for be, pool in ((one, whole), (r0, halves[0]), (r1, halves[1])):
                be.register_mem_pool_host(pool)
        said = [r.getMessage() for r in caplog.records if "not shared across TP sizes" in r.getMessage()]
        assert len(said) == (3 if lcm else 0) and all("is not page_head" in m for m in said), said
        assert len({one.namespace().ns, r0.namespace().ns, r1.namespace().ns}) == 3
        ks = keys(2, "apart")
        assert one.batch_set_v1(ks, page_indices([0, 1], PAGE)) == [True] * 2
        assert [r0.batch_exists(ks), r1.batch_exists(ks)] == [0, 0]
