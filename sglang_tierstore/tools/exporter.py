"""``tierstore exporter``: index-level gauges of a node's store for Prometheus.

Counters of pages read, hit and written live in each serving process (SGLang's
``/metrics``, :mod:`sglang_tierstore.metrics`); what only the index knows (capacity,
regions by state, page sizes, pages, leases, Redis memory, store directories it lost) is
served here, read at scrape time (at most once per ``interval_s``) from a store joined as
it is, creating nothing (:func:`sglang_tierstore.tools.inspect.open_store`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time as mod_time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import TierStoreError
from sglang_tierstore.tools.inspect import Opened, index_facts, open_store
from sglang_tierstore.perms import redis_password, redis_tls

logger = logging.getLogger(__name__)


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tierstore_store_{name}", doc, labels=list(labels))


def facts_metrics(f: Mapping[str, Any]) -> list[Metric]:
    """Prometheus gauges of :func:`index_facts`."""
    u = f["usage"]
    out: list[Metric] = []
    for name, value, doc in (
        ("capacity_bytes", u["capacity_bytes"], "Capacity of the store, as recorded in the index."),
        ("allocated_bytes", u["allocated_bytes"], "Disk space held by allocated regions."),
        ("used_bytes", f["used_bytes"], "Bytes of committed pages."),
        ("pages", u["pages"], "Committed pages (index entries)."),
        ("leases", u["leases"], "Writers' leases outstanding (a writer that died holds one until lease_s)."),
        ("leased_slots", f["leased_slots"], "Slots handed to writers and not yet committed or given back."),
        ("page_files", u["files"], "Page files recorded in the index."),
        ("orphan_dirs", f["orphans"]["dirs"], "Store directories under path that no store in the index claims (a "
                                              "wiped or lost index): `tierstore gc` removes them."),
        ("orphan_bytes", f["orphans"]["bytes"], "Disk space the files of those directories take."),
    ):
        g = _gauge(name, doc)
        g.add_metric([], value)
        out.append(g)
    regions = _gauge("regions", "Regions by state (used: holding pages of one size).", ["state"])
    for state in ("used", "free", "hole", "punch", "draining"):
        regions.add_metric([state], u[f"{state}_regions"])
    by_size = _gauge("page_size_regions", "Regions in use by page size.", ["page_bytes"])
    slots = _gauge("slots", "Slots of regions in use, by page size and state (live: committed pages).",
                   ["page_bytes", "state"])
    for d in f["page_sizes"]:
        by_size.add_metric([str(d["page_bytes"])], d["regions"])
        for state in ("live", "leased", "dead"):
            slots.add_metric([str(d["page_bytes"]), state], d[state])
    out += [regions, by_size, slots]
    if f["index_memory_bytes"] is not None:
        mem = _gauge("index_memory_bytes", "Memory the index's Redis uses (INFO used_memory).")
        mem.add_metric([], f["index_memory_bytes"])
        out.append(mem)
    return out


class StoreCollector:
    """Reads the store's index at scrape time (at most once per ``interval_s``): usage and
    page sizes stream the index in bounded steps. Keeps the store joined between scrapes and
    joins it again after any failure, so the exporter may start before the store does."""

    def __init__(self, cfg: TierStoreConfig, start_redis: bool, interval_s: float,
                 clock: Callable[[], float] = mod_time.monotonic) -> None:
        self.cfg = cfg
        self.start_redis = start_redis
        self.interval_s = interval_s
        self.clock = clock
        self._opened: Optional[Opened] = None
        self._last: tuple[float, list[Metric]] = (-float("inf"), [])
        self._why = ""
        self._lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            now = self.clock()
            if now - self._last[0] >= self.interval_s:
                self._last = (now, self._read())
            return list(self._last[1])

    def _read(self) -> list[Metric]:
        up = _gauge("up", "1: the store was read for this scrape; 0: no store yet, or its index or "
                          "directories cannot be reached (the exporter logs why).")
        try:
            if self._opened is None:
                self._opened = open_store(self.cfg, self.start_redis)
            metrics = facts_metrics(index_facts(self._opened.store))
        except (TierStoreError, OSError) as e:
            self._failed(str(e))
            up.add_metric([], 0)
            return [up]
        if self._why:
            logger.warning("tierstore exporter: store %s read again", self._opened.store_id)
            self._why = ""
        up.add_metric([], 1)
        return [up, *metrics]

    def _failed(self, why: str) -> None:
        if why != self._why:
            logger.warning("tierstore exporter: %s", why)
            self._why = why
        self.close()

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None


def run_exporter(cfg: TierStoreConfig, port: int, addr: str, interval_s: float, start_redis: bool) -> None:
    """Serve the gauges on ``addr:port`` until killed (OSError if it cannot listen there)."""
    redis_password(cfg.redis_password_env, cfg.redis_password_file)  # config errors now, not at each scrape
    redis_tls(cfg.redis_tls_ca_file, cfg.redis_tls_cert_file, cfg.redis_tls_key_file)
    collector = StoreCollector(cfg, start_redis, interval_s)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        start_http_server(port, addr, registry=registry)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {addr}:{port}: {e.strerror or e}") from None
    print(f"tierstore exporter: store under {', '.join(cfg.path)} (prefix {cfg.redis_prefix!r}) "
          f"on http://{addr}:{port}/metrics", file=sys.stderr, flush=True)
    try:
        threading.Event().wait()  # serves until killed
    except KeyboardInterrupt:
        pass
    finally:
        collector.close()


