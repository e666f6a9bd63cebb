"""The TP 2 side of test_tp_share.py, a process of its own: both ranks' backends (tp_lcm_size
2, page_head), each reading what the TP 1 process wrote and writing pages it reads back.

python proc_tp2.py EXTRA_JSON HEAD_DIM: waits for keys 'tp1' (3 pages), reads each rank's
heads of them into an empty pool and checks them against its half of the same pages
(``pools.tp_pools``), then writes keys 'tp2' from pages 3-4. Exit 0, or the failing step."""

from __future__ import annotations

import json
import sys
import time

from tierstore_kit.engine import keys
from tierstore_kit.pools import mha_pool, page_bytes, page_indices, storage_config, tp_pools

from sglang_tierstore import TierStoreBackend

HEADS, PAGE, LAYERS = 4, 16, 2


def main() -> int:
    extra, head_dim = json.loads(sys.argv[1]), int(sys.argv[2])
    _, halves = tp_pools("page_head", HEADS, head_dim, PAGE, LAYERS)
    for r, half in enumerate(halves):
        with TierStoreBackend(storage_config(extra, tp_rank=r, tp_size=2, tp_lcm_size=2, layout="page_head"), {}) as be:
            target = mha_pool("page_head", page_size=PAGE, layers=LAYERS, heads=HEADS // 2, head_dim=head_dim, tokens=8 * PAGE)
            target.kv_buffer.zero_()
            be.register_mem_pool_host(target)
            deadline = time.monotonic() + 60
            while be.batch_exists(keys(3, "tp1")) != 3:
                if time.monotonic() > deadline:
                    return 2
                time.sleep(0.05)
            if be.batch_get_v1(keys(3, "tp1"), page_indices([4, 5, 6], PAGE)) != [True] * 3:
                return 3
            if any(page_bytes(target, dst) != page_bytes(half, src) for src, dst in ((0, 4), (1, 5), (2, 6))):
                return 4
            be.register_mem_pool_host(half)
            if be.batch_set_v1(keys(2, "tp2"), page_indices([3, 4], PAGE)) != [True] * 2:
                return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
