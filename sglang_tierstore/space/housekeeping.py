"""Housekeeping: the space's work off the hot path, and when it runs.

Every ``housekeeping_s`` a pass sends the batched recency updates, forgets page files
found gone, and sweeps every shard: expires dead writers' leases (renewing ours),
shrinks to capacity (punching the space out of the files), and, once the store is full,
evicts the least recently used regions until ``free_target`` of them are free, so that
writes seldom evict inline. Every ``audit_s`` (first in its pass) the page files are
audited (:meth:`Files.audit`). Each sweep call handles at most ``MAX_WORK`` regions or
leases; a pass repeats them while they do that much. Eviction moves index entries and
never waits on a file, so no single bad file can wedge it.

A pass with nothing to do costs one ``sweep`` call per shard; after one, the thread waits
four times as long, until pages are read or written again (:meth:`Housekeeper.wake`), up to
``idle_max_s``: 5 s (or ``lease_s / 4``) while the process holds a lease to renew. Once
nothing was read or written for ``IDLE_MAX_S`` the process gives its leases back (its
next write leases anew), and then waits up to ``lease_s``, auditing the files only every
``idle_audit_s`` (``lease_s``) instead of every ``audit_s``: each wake-up is the cost
(on a virtual machine whose idle core comes back cold, over a millisecond of CPU for a
pass that takes a tenth of that hot), so an idle store wakes once a ``lease_s``, whatever
``housekeeping_s`` is. Once per ``orphan_gc_s``, where the index is the embedded one under
the page directories, orphaned store directories unchanged that long are removed
(:mod:`.orphans`). Tests drive :meth:`Housekeeper.run_once` with an injected clock.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import IndexUnavailable, NoStoreYet, StoreDetached, StoreUnavailable, TierStoreError
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.io_engine import name_os_thread
from sglang_tierstore.metrics import Metrics, RateLimitedLog
import sglang_tierstore.space.orphans as orphans
from sglang_tierstore.space.attachment import Attachment

MAX_WORK = 256  # regions or leases handled per shard and call: bounds each call
IDLE_BACKOFF = 4  # each idle pass waits this many times longer than the last (a read or write wakes it)
IDLE_MAX_S = 5.0  # idle this long, a process gives its leases back; till then its longest wait between passes
DIR_RETIRE_LEASES = 10  # a directory no process reported for this many lease_s is forgotten


class Kept(Protocol):
    """What housekeeping needs of the space it keeps (:class:`sglang_tierstore.space.Space`)."""

    cfg: TierStoreConfig
    index: RedisIndex
    metrics: Metrics
    log: RateLimitedLog
    clock: Callable[[], float]
    activity: int

    def attach(self) -> Attachment: ...

    def detach(self, e: StoreDetached, a: Optional[Attachment] = None) -> None: ...


class Housekeeper:
    """One space's housekeeping: :meth:`run_once`, and a daemon thread that calls it."""

    def __init__(self, space: Kept) -> None:
        self.space = space
        self._on_index_down: Optional[Callable[[], None]] = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and wake()
        self._backing_off = False  # idle: waits grow from housekeeping_s to idle_max_s
        self._activity = 0  # the space's activity count at the last pass
        self._draining = False
        self._thread: Optional[threading.Thread] = None
        self._last_audit = float("-inf")
        self._idle_since: Optional[float] = None  # the first pass that found nothing read or written
        self._holding = True  # whether the last pass left this process a lease to renew
        self._next_reap = float("-inf")  # when orphaned store directories are looked for next

    @property
    def audit_s(self) -> float:
        """Between audits while pages are read or written."""
        return min(5.0, self.space.cfg.lease_s / 2)

    @property
    def idle_audit_s(self) -> float:
        """Between audits while nothing is read or written: the store's directories are
        still reported far within ``DIR_RETIRE_LEASES * lease_s``, and a file lost
        meanwhile is found by the first read or write that meets it."""
        return max(self.audit_s, self.space.cfg.lease_s)

    def run_once(self, audit: Optional[bool] = None) -> bool:
        """One pass; ``audit`` forces (True) or skips (False) the file audit. Index
        trouble ends the pass (logged); nothing raises. Whether there was anything to do
        (pages read or written since the last pass, work done, or trouble)."""
        space = self.space
        a: Optional[Attachment] = None
        seen = space.activity
        try:
            a = space.attach()  # (the one place a serving process attaches after its start)
            a.flush_touches()
            now = space.clock()
            idle = seen == self._activity
            if not idle:
                self._idle_since = None
            elif self._idle_since is None:
                self._idle_since = now
            if audit or (audit is None and now >= self._last_audit + (self.idle_audit_s if idle else self.audit_s)):
                self._last_audit = now
                a.files.audit(DIR_RETIRE_LEASES * space.cfg.lease_s)
            a.files.forget_lost(MAX_WORK)
            release = self._idle_since is not None and now - self._idle_since >= IDLE_MAX_S
            work = self.sweep(a, release)
            while work >= MAX_WORK:  # shrinking a lot at once: keep going, a bounded call at a time
                work = self.sweep(a, release)
            work += self.reap_orphans(a, now)
            self._holding = a.leases.holding()
            return work > 0 or space.activity != self._activity or self._draining
        except StoreUnavailable as e:  # the index down, full or read-only, the disk full, no store yet
            if e.kind == NoStoreYet.kind:
                return False  # nothing to keep yet (a namespace registered wakes the thread)
            space.log.warning("housekeeping", "housekeeping skipped: %s", e)
            if e.kind == IndexUnavailable.kind and self._on_index_down is not None:
                self._on_index_down()
        except StoreDetached as e:
            space.detach(e, a)
        except TierStoreError as e:
            space.metrics.error("housekeeping")
            space.log.warning("housekeeping", "housekeeping failed: %s", e)
        finally:
            self._activity = seen
        return True

    @property
    def idle_max_s(self) -> float:
        """The longest wait between passes of an idle store: while this process holds a
        lease, leases are renewed well within their term and a capacity change reaches
        it within seconds; once it gave them back, ``idle_audit_s`` (a capacity change
        then waits for a process that reads or writes, or for that)."""
        cfg = self.space.cfg
        return max(cfg.housekeeping_s, min(IDLE_MAX_S, cfg.lease_s / 4) if self._holding else self.idle_audit_s)

    def next_wait(self, busy: bool, wait: float) -> float:
        """How long the thread waits for the next pass after one that was ``busy`` (or not),
        which followed a wait of ``wait``: ``housekeeping_s`` while busy, else four times as
        long as the last, up to :attr:`idle_max_s` (a read or write cuts it short: :meth:`wake`)."""
        base = self.space.cfg.housekeeping_s
        wait = base if busy else min(self.idle_max_s, IDLE_BACKOFF * wait)
        self._backing_off = wait > base
        return wait

    @property
    def running(self) -> bool:
        """Whether the thread runs passes (:meth:`start`, until :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def wake(self) -> None:
        """Pages are being read or written: an idle-backed-off thread runs a pass now."""
        if self._backing_off:
            self._backing_off = False
            self._wake.set()

    def sweep(self, a: Attachment, release_idle: bool = False) -> int:
        """Every shard's sweep in one round trip (one call per shard, so one per master by
        default), then what they freed punched out of the files and reported back in another,
        then the stocks tidied (``release_idle``: every lease not writing given back); the
        regions and leases handled in all. A shard whose call failed is skipped this pass;
        the first such error is raised once the others are handled."""
        space, leases, g = self.space, a.leases, a.geometry
        now = space.clock()
        mark = leases.mark()  # before the sweeps are sent: replies after it are newer than their view
        ours = leases.lease_ids()
        args = [g.store_id, repr(now), repr(now + space.cfg.lease_s), a.files.dirs, repr(space.cfg.free_target),
                MAX_WORK, repr(now - space.cfg.lease_s), len(ours), *ours]
        replies = space.index.calls_each([("sweep", a.shard_keys(s), args) for s in range(g.shards)])
        work = draining = 0
        punches = []
        for s, raw in enumerate(replies):
            if isinstance(raw, Exception):
                continue
            expired, slots, evicted, pages, drain, npunch = (int(x) for x in raw[:6])
            leases.renewed(s, now, {x.decode() if isinstance(x, bytes) else str(x) for x in raw[6 + npunch :]}, mark)
            space.metrics.housekeeping("leases_expired", expired)
            space.metrics.housekeeping("slots_reclaimed", slots)
            space.metrics.housekeeping("evicted", evicted)
            space.metrics.housekeeping("pages_evicted", pages)
            punched = a.files.punch(int(x) for x in raw[6 : 6 + npunch])
            if punched:
                punches.append(("punched", a.shard_keys(s), [g.store_id, *punched]))
            draining += drain
            work += expired + evicted + len(punched)
        if punches:
            space.metrics.housekeeping("deallocated", sum(int(n) for n in space.index.calls(punches)))
        failed = next((raw for raw in replies if isinstance(raw, Exception)), None)
        if failed is not None:
            raise failed
        self._draining = draining > 0
        space.metrics.housekeeping("stocks_tidied", leases.tidy(draining > 0, release_idle))
        return work

    def reap_orphans(self, a: Attachment, now: float) -> int:
        """Remove the store directories no store in the index claims and where nothing
        changed for ``orphan_gc_s``, where this process may (:func:`.orphans.reaped`), at
        most once per ``orphan_gc_s`` (each look reads the index once per store directory);
        the directories removed (``tierstore_housekeeping_total{action="orphans_removed"}``)."""
        space, cfg = self.space, self.space.cfg
        if not orphans.reaped(cfg, a.shared) or now < self._next_reap:
            return 0
        self._next_reap = now + cfg.orphan_gc_s
        removed = 0
        for o in orphans.find(space.index, cfg.redis_prefix, cfg.path):
            if o.store_id == a.geometry.store_id or o.newest > now - cfg.orphan_gc_s:
                continue
            try:
                orphans.remove(o)
            except OSError as e:
                space.log.warning("orphans:remove", "cannot remove the orphaned store directory %s: %s", o.path, e)
                continue
            removed += 1
            space.log.warning(f"orphans:{o.path}", "removed store directory %s (%.1f MiB on disk): the embedded index "
                              "holds nothing for store %s and nothing in it changed for %g s (orphan_gc_s)", o.path,
                              o.disk_bytes / orphans.MiB, o.store_id, cfg.orphan_gc_s)
        space.metrics.housekeeping("orphans_removed", removed)
        return removed

    def _loop(self) -> None:
        name_os_thread("tierstore-hk")
        wait = self.space.cfg.housekeeping_s
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            busy = True
            try:
                busy = self.run_once()
            except Exception as e:  # never let the thread die: it is how the store heals
                self.space.metrics.error("internal")
                self.space.log.exception("internal:housekeeping", "housekeeping crashed; continuing", exc=e)
            wait = self.next_wait(busy, wait)

    def start(self, on_index_down: Optional[Callable[[], None]] = None) -> None:
        """Run a pass every ``housekeeping_s`` in a daemon thread; ``on_index_down`` is
        called when a pass finds the index unreachable (the adapter restarts an embedded
        Redis that died)."""
        self._on_index_down = on_index_down
        self._thread = threading.Thread(target=self._loop, name="tierstore-housekeeping", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop after the pass in progress, waiting for it at most ``timeout`` s (one stuck
        on a stalled disk ends on its own). True if the thread has exited."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()
