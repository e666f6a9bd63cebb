"""Housekeeping off the hot path: when the allocator's background work runs.

Eviction itself is index work (region-granular LRU, in the allocator's Lua); this
module owns its cadence. Every ``housekeeping_s``: flush batched recency updates,
forget page files found gone, expire dead writers' leases, shrink to capacity
(punching the space out of the files) and keep ``free_target`` of the regions free
once the store is full. Every ``audit_s`` (first in its pass): check every page file
against its path, remove files the index does not know, report our directories and
forget those no process has reported for ``10 * lease_s``. Eviction moves index
entries and never waits on a file, so no single bad file can wedge it.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from sglang_tierstore.errors import IndexUnavailable, StoreDetached, TierStoreError
from sglang_tierstore.io_engine import name_os_thread
from sglang_tierstore.store import TierStore

MAX_WORK = 256  # regions or leases handled per shard and script call: bounds each call


class Housekeeper:
    """A daemon thread calling :meth:`run_once` every ``housekeeping_s``."""

    def __init__(self, store: TierStore, on_index_down: Optional[Callable[[], None]] = None) -> None:
        self.store = store
        self._on_index_down = on_index_down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tierstore-housekeeping", daemon=True)
        self._next_audit = 0.0

    @property
    def audit_s(self) -> float:
        return min(5.0, self.store.cfg.lease_s / 2)

    def run_once(self, audit: Optional[bool] = None) -> None:
        """One pass; ``audit`` forces (True) or skips (False) the file audit."""
        store = self.store
        try:
            store.flush_touches()
            now = store.clock()
            if audit or (audit is None and now >= self._next_audit):
                self._next_audit = now + self.audit_s
                store.audit_files(10 * store.cfg.lease_s)
            store.forget_lost_files(MAX_WORK)
            while store.sweep(MAX_WORK) >= MAX_WORK:
                pass  # shrinking a lot at once: keep going, a bounded call at a time
        except IndexUnavailable as e:
            store.log.warning("housekeeping", "housekeeping skipped: %s", e)
            if self._on_index_down is not None:
                self._on_index_down()
        except StoreDetached as e:
            store.detach(e)
        except TierStoreError as e:
            store.metrics.error("housekeeping")
            store.log.warning("housekeeping", "housekeeping failed: %s", e)

    def _loop(self) -> None:
        name_os_thread("tierstore-hk")
        while not self._stop.wait(self.store.cfg.housekeeping_s):
            try:
                self.run_once()
            except Exception as e:  # never let the thread die: it is how the store heals
                self.store.metrics.error("internal")
                self.store.log.exception("internal:housekeeping", "housekeeping crashed; continuing", exc=e)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop after the pass in progress, waiting for it at most ``timeout`` s (one stuck
        on a stalled disk ends on its own). True if the thread has exited."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()
