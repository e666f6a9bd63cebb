"""One scheduler rank's storage traffic in a process of its own (used by test_metrics.py).

python proc_rank.py EXTRA_JSON TP_RANK PAGES: with PROMETHEUS_MULTIPROC_DIR set, as
SGLang sets it for its schedulers, a TierStoreBackend of TP rank TP_RANK (of 2)
writes PAGES pages in one batch, reads them back, probes PAGES absent keys, and
hands its get_stats() to SGLang's own StorageMetricsCollector with the labels
SGLang gives it, as UnifiedRadixCache does after each step.
"""

from __future__ import annotations

import json
import sys

from pools import fill, keys, mha_pool, page_indices, storage_config
from sglang.srt.observability.metrics_collector import StorageMetricsCollector

from sglang_tierstore import TierStoreBackend


def main() -> int:
    extra, rank, n = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    collector = StorageMetricsCollector(labels={
        "storage_backend": "dynamic", "tp_rank": rank, "dp_rank": 0, "pp_rank": 0, "pp_size": 1,
        "attn_cp_rank": 0, "attn_cp_size": 1,
    })
    pool = mha_pool("page_first")
    fill(pool, rank)
    with TierStoreBackend(storage_config(extra, tp_rank=rank, tp_size=2, metrics=True), {}) as be:
        be.register_mem_pool_host(pool)
        if be.batch_set_v1(keys(n), page_indices(list(range(n)), 4)) != [True] * n:
            return 2
        if be.batch_get_v1(keys(n), page_indices(list(range(n, 2 * n)), 4)) != [True] * n:
            return 3
        if be.batch_exists(keys(n, "absent")) != 0:
            return 4
        collector.log_storage_metrics(be.get_stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
