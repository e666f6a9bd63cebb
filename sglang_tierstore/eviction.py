"""Housekeeping off the hot path: recency flushes, lease reclaim, eviction ahead of need.

Eviction itself is index work (LRU per slot class, in Lua); this module owns the
policy of when it runs and how far: once a class can no longer grow, keep
``free_target`` of capacity (at least 8 slots) free so RESERVE seldom evicts
inline. Eviction only moves index entries, never deletes files, so no single bad
slot or file can wedge it; a slot that failed a write sits in quarantine for
``lease_s`` and is then tried again.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from sglang_tierstore.errors import IndexUnavailable, TierStoreError
from sglang_tierstore.pagefile import SlotClass
from sglang_tierstore.store import TierStore

logger = logging.getLogger(__name__)

MAX_WORK = 1024  # slots moved per class and kind in one sweep: bounds each script call


def free_slots_wanted(store: TierStore, cls: SlotClass) -> int:
    return max(8, int(store.cfg.free_target * store.cfg.capacity_bytes / cls.slot_size))


class Housekeeper:
    """A daemon thread calling :meth:`run_once` every ``housekeeping_s``."""

    def __init__(self, store: TierStore, on_index_down: Optional[Callable[[], None]] = None) -> None:
        self.store = store
        self._on_index_down = on_index_down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tierstore-housekeeping", daemon=True)

    def run_once(self) -> None:
        store = self.store
        try:
            store.flush_touches()
            for cls in store.known_classes():
                reclaimed, evicted, released = store.index.sweep(
                    cls, store.cfg.capacity_bytes, free_slots_wanted(store, cls), MAX_WORK, store.cfg.lease_s
                )
                store.metrics.housekeeping("leases_reclaimed", reclaimed)
                store.metrics.housekeeping("evicted", evicted)
                store.metrics.housekeeping("quarantine_released", released)
        except IndexUnavailable as e:
            store.log.warning("housekeeping", "housekeeping skipped: %s", e)
            if self._on_index_down is not None:
                self._on_index_down()
        except TierStoreError as e:
            store.metrics.error("housekeeping")
            store.log.warning("housekeeping", "housekeeping failed: %s", e)

    def _loop(self) -> None:
        while not self._stop.wait(self.store.cfg.housekeeping_s):
            try:
                self.run_once()
            except Exception:  # never let the thread die: it is how the store heals
                logger.exception("tierstore housekeeping crashed; continuing")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
