"""Sharing and restarts: two processes on one store; a new backend serves what was committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.tools import inspect

HERE = os.path.dirname(os.path.abspath(__file__))
N = 32


def test_two_processes_share_one_store_and_restart(extra: dict[str, Any]) -> None:
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "proc_backend.py"), json.dumps(extra)])
    mine, theirs = mha_pool("page_first"), mha_pool("page_first")
    fill(mine, 200)
    fill(theirs, 100)
    try:
        with TierStoreBackend(storage_config(extra), {}) as be:
            be.register_mem_pool_host(mine)
            assert be.batch_set_v1(keys(N, "parent"), page_indices(range(N), 4)) == [True] * N
            # both processes write the same keys (same bytes, as the same prefix would give)
            fill(mine, 100)
            assert be.batch_set_v1(keys(N, "both"), page_indices(range(N), 4)) == [True] * N
            assert child.wait(timeout=240) == 0
    finally:
        if child.poll() is None:
            child.kill()
    # both backends are gone: a new one serves everything they committed
    with TierStoreBackend(storage_config(extra), {}) as be:
        dst = mha_pool("page_first")
        be.register_mem_pool_host(dst)
        for tag in ("child", "both"):
            assert be.batch_get_v1(keys(N, tag), page_indices(range(40, 40 + N), 4)) == [True] * N
            for i in range(N):
                assert page_bytes(dst, 40 + i) == page_bytes(theirs, i)
        assert be.batch_exists(keys(N, "parent")) == N
        assert inspect.check(be.store) == []
        u = inspect.usage(be.store)
        assert u["pages"] == 3 * N and u["leases"] == 0  # both writers gave their stock back


def test_concurrent_writers_and_readers_under_eviction(extra: dict[str, Any]) -> None:
    """Two backends hammer overlapping keys while eviction recycles slots: reads are right or misses."""
    import random
    import threading

    cfg = {**extra, "capacity_gb": 1 / 1024}
    pool = mha_pool("page_first", page_size=16, layers=4, heads=4, head_dim=64)  # 64 KiB pages, ~15 slots
    fill(pool, 7)
    ks = keys(40, "hot")  # key i always carries host page i % 30: bytes are a function of the key
    errors: list[str] = []
    with TierStoreBackend(storage_config(cfg), {}) as a, TierStoreBackend(storage_config(cfg), {}) as b:
        for be in (a, b):
            be.register_mem_pool_host(pool)

        def worker(be: TierStoreBackend, seed: int, dst: int) -> None:
            rnd = random.Random(seed)
            for _ in range(60):
                idx = rnd.sample(range(40), 4)
                be.batch_set_v1([ks[i] for i in idx], page_indices([i % 30 for i in idx], 16))
                i = rnd.randrange(40)
                if be.batch_get_v1([ks[i]], page_indices([dst], 16)) == [True] and page_bytes(pool, dst) != page_bytes(pool, i % 30):
                    errors.append(f"wrong bytes for key {i}")

        threads = [threading.Thread(target=worker, args=(be, s, 31 + s)) for s, be in enumerate((a, b, a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert a.store.stats().get("evicted", 0) + b.store.stats().get("evicted", 0) > 0
        assert inspect.usage(a.store)["allocated_bytes"] <= 1 << 20
        assert inspect.check(a.store) == []
