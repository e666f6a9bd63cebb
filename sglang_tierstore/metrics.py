"""Counters (Prometheus and per-store), and rate-limited logging of failures.

Prometheus metrics live in the process's default registry. Under SGLang with
``--enable-metrics`` that is multiprocess mode: SGLang sets
``PROMETHEUS_MULTIPROC_DIR`` before it spawns its scheduler processes (one per
TP/PP/DP rank, each running its own backend), so their counters and histograms
are written to files there, and the ``/metrics`` endpoint (in the HTTP server's
process) reads every process's files and sums series with equal labels. Each
series therefore carries the rank labels SGLang's own storage and radix-cache
series use (:data:`RANK_LABELS`): without them /metrics would show the sum over
ranks, and with them a rank's tierstore series join its ``sglang:`` series.
There are no gauges (multiprocess mode would need an aggregation for each).

Each store also keeps its own counts, which ``TierStore.stats()`` returns and tests read.
"""

from __future__ import annotations

import logging
import resource
import threading
import time as mod_time
from collections import Counter as _Counter
from typing import Any, Callable, Mapping, Optional, Union

from prometheus_client import Counter, Histogram

RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")
"""Which scheduler a series comes from; empty for a store used outside SGLang."""

PAGES = Counter(
    "tierstore_pages_total",
    "Pages handled by tierstore, by operation and outcome.",
    ["op", "outcome", *RANK_LABELS],
)
BYTES = Counter("tierstore_bytes_total", "Page bytes moved to or from page files.", ["op", *RANK_LABELS])
CPU = Counter(
    "tierstore_caller_cpu_seconds_total",
    "CPU time tierstore spent on SGLang's calling thread during each call, by call and mode (user, system).",
    ["call", "mode", *RANK_LABELS],
)
ERRORS = Counter("tierstore_errors_total", "Failures turned into misses or failed writes, by kind.", ["kind", *RANK_LABELS])
HOUSEKEEPING = Counter(
    "tierstore_housekeeping_total",
    "Work done off the hot path, by action: leases expired, regions and pages evicted, page files added and forgotten, orphaned store directories removed.",
    ["action", *RANK_LABELS],
)
LATENCY = Histogram(
    "tierstore_batch_seconds",
    "Wall time of one batch call, by operation.",
    ["op", *RANK_LABELS],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)


class Metrics:
    """Per-store counts mirrored into the process-wide Prometheus metrics.

    ``rank`` gives the values of :data:`RANK_LABELS` (SGLang's ranks of the
    scheduler that owns the store); labels it leaves out are empty.
    """

    def __init__(self, rank: Optional[Mapping[str, int]] = None) -> None:
        unknown = set(rank or ()) - set(RANK_LABELS)
        if unknown:
            raise ValueError(f"unknown rank labels {sorted(unknown)}; known: {', '.join(RANK_LABELS)}")
        self.rank: dict[str, str] = {k: str((rank or {}).get(k, "")) for k in RANK_LABELS}
        self._ranks = tuple(self.rank.values())
        self._lock = threading.Lock()
        self.counts: _Counter[str] = _Counter()
        self._children: dict[tuple[object, ...], Any] = {}

    def _series(self, metric: Union[Counter, Histogram], *values: str) -> Any:
        """The metric's series for these label values and this store's ranks, looked up
        once (``labels()`` builds and checks them on every call, on the hot path)."""
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values, *self._ranks)
        return child

    def pages(self, op: str, outcome: str, n: int = 1) -> None:
        if n:
            self._series(PAGES, op, outcome).inc(n)
            self._add(f"{op}_{outcome}", n)

    def bytes(self, op: str, n: int) -> None:
        if n:
            self._series(BYTES, op).inc(n)
            self._add(f"{op}_bytes", n)

    def error(self, kind: str, n: int = 1) -> None:
        self._series(ERRORS, kind).inc(n)
        self._add(f"error_{kind}", n)

    def housekeeping(self, action: str, n: int) -> None:
        if n:
            self._series(HOUSEKEEPING, action).inc(n)
            self._add(action, n)

    def cpu(self, call: str, since: tuple[float, float]) -> None:
        """Add the calling thread's CPU time since ``since`` (from :func:`thread_cpu`) to ``call``."""
        user, system = thread_cpu()
        for mode, dt in (("user", user - since[0]), ("system", system - since[1])):
            if dt > 0:
                self._series(CPU, call, mode).inc(dt)
                self._add(f"cpu_us_{call}_{mode}", round(dt * 1e6))
        self._add(f"calls_{call}", 1)

    def observe(self, op: str, seconds: float) -> None:
        self._series(LATENCY, op).observe(seconds)

    def _add(self, name: str, n: int) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def thread_cpu() -> tuple[float, float]:
    """This thread's user and system CPU seconds (``getrusage(RUSAGE_THREAD)``: one syscall)."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return ru.ru_utime, ru.ru_stime


class RateLimitedLog:
    """At most one line per kind of failure per interval, with the count suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock: Callable[[], float] = mod_time.monotonic) -> None:
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: _Counter[str] = _Counter()
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self._emit(kind, msg, args, None)

    def exception(self, kind: str, msg: str, *args: object, exc: BaseException) -> None:
        """Like :meth:`warning`, with the exception's traceback: for failures nobody
        expected (bugs), which a counter alone would hide."""
        self._emit(kind, msg, args, exc)

    def _emit(self, kind: str, msg: str, args: tuple[object, ...], exc: Optional[BaseException]) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last.get(kind, -1e18) < self._interval:
                self._suppressed[kind] += 1
                return
            self._last[kind] = now
            skipped = self._suppressed.pop(kind, 0)
        if skipped:
            msg += " (%d similar suppressed)"
            args = (*args, skipped)
        self._logger.warning("tierstore " + msg, *args, exc_info=exc)
