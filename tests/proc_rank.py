"""Scheduler ranks' storage traffic, each in a process of its own (used by test_metrics.py).

python proc_rank.py EXTRA_JSON RANK:PAGES [RANK:PAGES ...]: with PROMETHEUS_MULTIPROC_DIR
set, as SGLang sets it for its schedulers, one process per rank (forked once SGLang is
imported: an import costs seconds of CPU) runs a TierStoreBackend of that TP rank (of 2):
it writes PAGES pages in one batch, reads them back, probes PAGES absent keys, and hands
its get_stats() to SGLang's own StorageMetricsCollector with the labels SGLang gives it,
as UnifiedRadixCache does after each step. Exits with the first failing rank's code.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tierstore_kit.engine import attached, keys
from tierstore_kit.pools import fill, mha_pool, page_indices, storage_config
from sglang.srt.observability.metrics_collector import StorageMetricsCollector

from sglang_tierstore import TierStoreBackend


def rank_main(extra: dict[str, object], rank: int, n: int) -> int:
    collector = StorageMetricsCollector(labels={
        "storage_backend": "dynamic", "tp_rank": rank, "dp_rank": 0, "pp_rank": 0, "pp_size": 1,
        "attn_cp_rank": 0, "attn_cp_size": 1,
    })
    pool = mha_pool("page_first")
    fill(pool, rank)
    with TierStoreBackend(storage_config(extra, tp_rank=rank, tp_size=2, metrics=True), {}) as be:
        be.register_mem_pool_host(pool)
        deadline = time.monotonic() + 30
        while not attached(be.store):  # the other rank may be attaching now: this one attaches at its next housekeeping pass
            if time.monotonic() > deadline:
                return 5
            time.sleep(0.05)
        if be.batch_set_v1(keys(n), page_indices(list(range(n)), 4)) != [True] * n:
            return 2
        if be.batch_get_v1(keys(n), page_indices(list(range(n, 2 * n)), 4)) != [True] * n:
            return 3
        if be.batch_exists(keys(n, "absent")) != 0:
            return 4
        collector.log_storage_metrics(be.get_stats())
    return 0


def main() -> int:
    extra = json.loads(sys.argv[1])
    children = []
    for spec in sys.argv[2:]:
        rank, n = (int(x) for x in spec.split(":"))
        pid = os.fork()
        if pid == 0:  # the rank's process: its own pid, so its own multiprocess files, as a scheduler's
            code = 1
            try:
                code = rank_main(extra, rank, n)
            finally:
                os._exit(code)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
