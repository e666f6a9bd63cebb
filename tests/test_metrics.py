"""tierstore's Prometheus series as SGLang's /metrics serves them, and the Grafana dashboard.

SGLang's /metrics reads prometheus_client's multiprocess directory, where every
scheduler process (one per rank) writes its series: two processes of two ranks
here write into one such directory, each with its own backend, and each rank's
series come back apart. Their ``get_stats()`` goes into SGLang's own
``StorageMetricsCollector``, as ``UnifiedRadixCache`` hands it over. The
dashboard's queries must parse as PromQL and name metrics and labels that exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import dashboard
import pytest
import sglang.srt.observability.metrics_collector as sglang_metrics
from tierstore_kit.pools import mha_pool
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from sglang_tierstore import metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def rank(r: int) -> dict[str, str]:
    return {"tp_rank": str(r), "pp_rank": "0", "dp_rank": "0", "attn_cp_rank": "0"}


def test_each_rank_keeps_its_own_series_in_one_multiprocess_dir(extra: dict[str, Any], tmp_path: Path) -> None:
    prom = tmp_path / "prometheus"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    pages = {0: 3, 1: 5}  # different per rank: a sum over ranks would show
    ranks = subprocess.run([sys.executable, os.path.join(HERE, "proc_rank.py"), json.dumps(extra),
                            *(f"{r}:{n}" for r, n in pages.items())], env=env, timeout=240, check=False)
    assert ranks.returncode == 0
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom))  # what SGLang's /metrics does
    page_bytes = mha_pool("page_first").get_dummy_flat_data_page().nbytes
    for r, n in pages.items():
        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {**labels, **rank(r)})

        assert value("tierstore_pages_total", op="write", outcome="stored") == n
        assert value("tierstore_pages_total", op="read", outcome="hit") == n
        assert value("tierstore_pages_total", op="probe", outcome="miss") == n
        assert value("tierstore_bytes_total", op="read") == value("tierstore_bytes_total", op="write") == n * page_bytes
        assert value("tierstore_batch_seconds_count", op="write") == value("tierstore_batch_seconds_count", op="read") == 1
        assert value("tierstore_batch_seconds_bucket", op="read", le="+Inf") == 1
        # SGLang's storage histograms, from get_stats(): one backup and one prefetch batch of n pages
        sg = {"storage_backend": "dynamic", "tp_rank": str(r), "dp_rank": "0", "pp_rank": "0", "pp_size": "1",
              "attn_cp_rank": "0", "attn_cp_size": "1"}
        for kind in ("backup", "prefetch"):
            assert registry.get_sample_value(f"sglang:{kind}_pgs_count", sg) == 1
            assert registry.get_sample_value(f"sglang:{kind}_pgs_sum", sg) == n
            assert registry.get_sample_value(f"sglang:{kind}_bandwidth_count", sg) == 1
            assert (registry.get_sample_value(f"sglang:{kind}_bandwidth_sum", sg) or 0) > 0
    assert registry.get_sample_value("tierstore_pages_total", {"op": "write", "outcome": "stored", **rank(2)}) is None


def test_rank_labels_outside_multiprocess_mode() -> None:
    """A store outside SGLang (scripts, tests) has empty rank labels; unknown ones are refused."""
    labels = {"op": "read", "outcome": "hit", "tp_rank": "7", "pp_rank": "", "dp_rank": "", "attn_cp_rank": ""}
    before = REGISTRY.get_sample_value("tierstore_pages_total", labels) or 0
    metrics.Metrics({"tp_rank": 7}).pages("read", "hit", 2)
    assert REGISTRY.get_sample_value("tierstore_pages_total", labels) == before + 2
    assert metrics.Metrics().rank == {"tp_rank": "", "pp_rank": "", "dp_rank": "", "attn_cp_rank": ""}
    with pytest.raises(ValueError, match="unknown rank labels \\['rank'\\]"):
        metrics.Metrics({"rank": 1})


def test_each_call_counts_the_cpu_it_took_on_the_calling_thread(extra: dict[str, Any]) -> None:
    """Every SGLang-facing call adds its calling thread's CPU time to
    ``tierstore_caller_cpu_seconds_total{call}`` (what tierstore costs SGLang's scheduler
    thread per call, and with the page counters per page), and only that thread's: another
    thread burning CPU for the whole of a call adds nothing to it."""
    import threading
    import time

    from tierstore_kit.engine import keys
    from tierstore_kit.pools import fill, page_indices, storage_config

    from sglang_tierstore import TierStoreBackend
    from sglang_tierstore.metrics import thread_cpu

    pool = mha_pool("page_first")
    fill(pool, 1)
    ks = keys(16)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(pool)
        for i in range(0, 8, 4):
            assert be.batch_set_v1(ks[i:i + 4], page_indices(range(i, i + 4), 4)) == [True] * 4
        st = be.store.stats()
        assert st["calls_batch_set_v1"] == 2 and 0 < st.get("cpu_us_batch_set_v1_user", 0) + st.get("cpu_us_batch_set_v1_system", 0)
        spun: list[float] = []

        def spin() -> None:  # until it has burnt 0.3 s of CPU itself (however busy the machine), 30 s at most
            c0, t0 = sum(thread_cpu()), time.monotonic()
            while sum(thread_cpu()) - c0 < 0.3 and time.monotonic() - t0 < 30:
                pass
            spun.append(sum(thread_cpu()) - c0)

        real_write = be.store.write

        def write_while_spinning(*args: Any) -> list[bool]:  # the call blocks while another thread burns CPU
            t = threading.Thread(target=spin)
            t.start()
            t.join()
            return real_write(*args)

        be.store.write = write_while_spinning  # type: ignore[method-assign]
        before = be.store.stats()
        assert be.batch_set_v1(ks[8:12], page_indices(range(8, 12), 4)) == [True] * 4
        after = be.store.stats()
        took = sum(after.get(f"cpu_us_batch_set_v1_{m}", 0) - before.get(f"cpu_us_batch_set_v1_{m}", 0)
                   for m in ("user", "system"))
        assert spun and spun[0] >= 0.3 and took < 0.5 * spun[0] * 1e6, (took, spun)
    sample = REGISTRY.get_sample_value("tierstore_caller_cpu_seconds_total", {"call": "batch_set_v1", "mode": "user", **rank(0)})
    assert sample is not None and sample > 0


def tierstore_series() -> dict[str, set[str]]:
    """Every tierstore sample name with its label names, as a scrape shows them
    (each family exercised once in this process's default registry)."""
    m = metrics.Metrics({"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0})
    m.pages("probe", "hit")
    m.bytes("read", 1)
    m.error("index_unavailable")  # (any kind: the labels are what counts)
    m.housekeeping("evicted", 1)
    m.observe("read", 0.001)
    m.cpu("batch_get_v1", (0.0, 0.0))
    return {s.name: set(s.labels) for fam in REGISTRY.collect() if fam.name.startswith("tierstore_")
            for s in fam.samples if not s.name.endswith("_created")}


def sglang_families() -> dict[str, str]:
    """SGLang's metric families (name -> counter/gauge/histogram) declared in its installed source."""
    source = Path(sglang_metrics.__file__).read_text()
    found = re.findall(r"= (Counter|Gauge|Histogram)\(\s*name=\"(sglang:\w+)\"", source)
    return {name: kind.lower() for kind, name in found}


def test_dashboard_is_a_grafana_dashboard() -> None:
    d = dashboard.load()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] == "timeseries" and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert [v["name"] for v in d["templating"]["list"]][0] == "datasource"
    titles = " ".join(p["title"] for p in d["panels"]).lower()
    for wanted in ("hits and misses", "writes", "errors", "latency quantiles", "housekeeping", "cached prompt tokens by tier"):
        assert wanted in titles


def test_dashboard_queries_name_metrics_and_labels_that_exist() -> None:
    d = dashboard.load()
    ours, theirs = tierstore_series(), sglang_families()
    used = set()
    for where, expr in dashboard.queries(d):
        refs = dashboard.refs(expr)
        assert refs, f"{where}: selects no series"
        for ref in refs:
            used.add(dashboard.family(ref.name))
            if ref.name.startswith("tierstore_"):
                assert ref.name in ours, f"{where}: no series {ref.name}"
                unknown = ref.labels - ours[ref.name] - dashboard.SCRAPE_LABELS
                assert not unknown, f"{where}: {ref.name} has no labels {sorted(unknown)}"
            else:
                kind = theirs.get(dashboard.family(ref.name))
                assert kind is not None, f"{where}: SGLang 0.5.23 has no metric {ref.name}"
                assert (ref.name != dashboard.family(ref.name)) == (kind == "histogram"), f"{where}: {ref.name} is a {kind}"
    assert {"tierstore_pages_total", "tierstore_bytes_total", "tierstore_errors_total", "tierstore_housekeeping_total",
            "tierstore_batch_seconds", "sglang:cached_tokens_total", "sglang:prefetch_pgs", "sglang:backup_pgs"} <= used
