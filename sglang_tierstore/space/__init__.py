"""The space layer: every decision about where page bytes may go.

Page files are cut into regions (:mod:`.geometry`); a region holds pages of one size
while in use, and a free region goes to whichever page size needs one. The index keeps,
per shard, each region's state and slots, writers' leases, recency and capacity, and
changes them only through the Lua library (:mod:`.library`, one function per job).

Eviction: region-granular LRU across page sizes
    Each region in use has one recency (the last write or read of any of its pages).
    When no free region is left, the least recently used region with no slot under
    lease is reclaimed whole, whatever its page size, and handed to the page size that
    asked. A page size's share of the store therefore follows its recent use: nothing
    is reserved per size, and no size can hold space it does not use. Per-size slot LRU
    gave capacity to whoever came first; page LRU with compaction rewrites live pages
    and needs a recency record per page. CacheLib's Navy BlockCache does what is done
    here (regions written append-only, reclaimed whole), without its reinsertion of hot
    items: a KV prefix is read and written as a unit, so a region's pages age together.

Shards
    The index may be split into ``shards`` (fixed at creation; default 1). A page
    belongs to shard ``xxh3(entry field) % shards``; a file, and the regions in it, to
    shard ``file number % shards``. A batch is cut into one part per shard and each part
    is one function call, in one pipelined round trip. Every call gets every key of its
    shard, all under the shard's hash tag, so on Redis/Valkey Cluster it runs on one slot.

Rooms: :mod:`.attach` (which store a path belongs to), :mod:`.leases` (writers' slots),
:mod:`.files` (page files' lives), :mod:`.housekeeping` (when background work runs),
:mod:`.orphans` (store directories the index lost).
:class:`Space` (here) attaches, detaches and closes; an :class:`~.attachment.Attachment`
owns the store's keys for the layers above (entries, namespaces, recency) and drops pages;
a :class:`~.reservation.Reservation` leases slots for a write (adding page files and
giving fresh regions disk space itself) and commits them. The page files layer below is
handed a file ref with each call and never calls back up.
"""

from __future__ import annotations

import threading
import time as mod_time
from typing import Callable, Optional, Type

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import (
    AttachBusy,
    IndexRefusesWrites,
    NoStoreYet,
    StoreClosed,
    StoreDetached,
    StoreUnavailable,
    TierStoreError,
)
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import PageFiles
from sglang_tierstore.perms import Modes
from sglang_tierstore.schema import ns_value
import sglang_tierstore.space.attach as attach
import sglang_tierstore.space.orphans as orphans
from sglang_tierstore.space.attachment import Attachment
from sglang_tierstore.space.geometry import check_capacity
from sglang_tierstore.space.housekeeping import Housekeeper
from sglang_tierstore.space.library import LIBRARY


def _not_attached(e: StoreUnavailable) -> StoreUnavailable:
    """The last attach's failure again, until its retry is due: the same class and kind
    (an index that could not be reached is IndexUnavailable to every caller meanwhile)."""
    msg = f"the store is not attached ({e}); trying again shortly"
    again = IndexRefusesWrites(msg, e.kind) if isinstance(e, IndexRefusesWrites) else type(e)(msg)
    again.kind = e.kind
    return again


class Space:
    """Where bytes may go in the store a process's config names: attached at start (or by
    housekeeping, while that cannot be done), attached anew when the store goes from the
    index, and housekept."""

    def __init__(self, cfg: TierStoreConfig, index: RedisIndex, modes: Modes, token: str, metrics: Metrics,
                 log: RateLimitedLog, clock: Callable[[], float] = mod_time.time, observe: bool = False,
                 page_files: Type[PageFiles] = PageFiles) -> None:
        """``observe``: an operator's tool, which joins the store as it is and writes
        nothing on disk (:func:`attach.observe`); else a serving process, which adopts the
        store or creates it once it knows its pages (:meth:`expect`,
        :func:`attach.attach`). ``page_files``: the class that moves bytes (tests inject
        one that fails or waits)."""
        self.cfg = cfg
        self.index = index
        index.load(LIBRARY)
        self.modes = modes
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self.observe = observe
        self.housekeeping = Housekeeper(self)
        self.activity = 0  # batches read or written (housekeeping backs off while it stays put)
        self.largest_page: Optional[int] = None  # of this process's namespaces: what a new store is created for
        self._token = token
        self._page_files = page_files
        self._first = True
        self._att: Optional[Attachment] = None
        self._lock = threading.Lock()  # the attachment's swap (detach, close): held across no I/O
        self._attaching = threading.Lock()  # an attach in progress: never waited for
        self._closed = False
        self._retry_at = -float("inf")  # after an attach that could not be done, when to try again
        self._failure: StoreUnavailable = AttachBusy("not attached yet")  # the last attach's
        self._namespaces: dict[str, tuple[int, str]] = {}  # this process's: id -> (page bytes, description)
        self._said_unfit: set[tuple[str, str]] = set()  # (store id, namespace) whose pages its regions cannot hold

    def used(self) -> None:
        """A batch was read or written."""
        self.activity += 1
        self.housekeeping.wake()

    def expect(self, ns_id: str, page_bytes: int, description: str) -> None:
        """A namespace whose pages will be stored: recorded in the index for operators
        (now where attached, and on every attach), and a store this process creates from
        now on holds its pages (the next attach is tried at once). A store whose regions
        cannot hold them (another process's pages cut it) gets one log line naming the ways
        out; its other namespaces work."""
        self._namespaces[ns_id] = (page_bytes, description)
        if self.largest_page is None or page_bytes > self.largest_page:
            self.largest_page = page_bytes
            self._retry_at = -float("inf")
            self.housekeeping.wake()  # (a pass that found no store to adopt backed off: a store can be made now)
        if self._att is not None:
            self._register(self._att)

    def _register(self, a: Attachment) -> None:
        namespaces = dict(self._namespaces)
        self._say_unfit(a, namespaces)
        try:
            a.register({ns: ns_value(pb, desc) for ns, (pb, desc) in namespaces.items()})
        except TierStoreError as e:  # they are for operators: recorded again with the next namespace or attach
            self.log.warning("namespaces", "recording the namespaces in the index failed: %s", e)

    def _say_unfit(self, a: Attachment, namespaces: dict[str, tuple[int, str]]) -> None:
        """One log line per store for each namespace whose pages its regions cannot hold."""
        g = a.geometry
        for ns, (pb, desc) in namespaces.items():
            if g.holds(pb) or (g.store_id, ns) in self._said_unfit:
                continue
            self._said_unfit.add((g.store_id, ns))
            self.log.warning(
                f"unfit:{ns}", "pages of %d bytes (namespace %s: %s) do not fit store %s's %d-byte regions "
                "(a store's region size is fixed when it is created, for its first pages and its capacity_gb): they are "
                "not stored (write outcome too_big) and their probes miss, while other namespaces work. Give these pages "
                "a store of their own (another redis_prefix), or drop this one (`tierstore drop`) while only servers with "
                "pages this large run, so that they create it anew for them", pb, ns, desc, g.store_id, g.region_bytes)

    def attached(self) -> Attachment:
        """The store this process works on. A serving process never attaches here (a probe,
        a read or a write must not wait for an attach): while none is attached this raises
        at once the last attach's failure (StoreUnavailable, its ``kind`` says why: the index
        down, full or read-only, the directories full, another process attaching, no store
        yet) and housekeeping attaches (:meth:`attach`). An operator's tool, or an engine whose
        housekeeping thread is not running, makes one try here (:meth:`attach`, which waits for
        no lock; an operator's tool gets NoStore where there is no store)."""
        a = self._att
        if a is not None:
            return a
        if self._closed:
            raise StoreClosed("the store is closed")
        if self.observe or not self.housekeeping.running:  # (no thread to attach: the caller's one try)
            return self.attach()
        self.housekeeping.wake()
        raise _not_attached(self._failure)

    def attach(self) -> Attachment:
        """The attachment, attaching now if there is none: one try, which waits for no lock
        another thread or process holds (AttachBusy meanwhile) and, after a failure, is not
        made again before ``redis_retry_s`` (that failure is raised again meanwhile). Made at
        start, when a namespace is added, and by housekeeping; never by a probe, read or write."""
        a = self._att
        if a is not None:
            return a
        if not self._attaching.acquire(blocking=False):
            raise AttachBusy("another thread of this process is attaching")
        try:
            a = self._att
            if a is None:
                a = self._attach()
                with self._lock:
                    if self._closed:  # closed meanwhile: what it opened goes too
                        a.close_files()
                        raise StoreClosed("the store is closed")
                    self._att = a
            return a
        finally:
            self._attaching.release()

    def _attach(self) -> Attachment:
        """Caller holds ``_attaching``."""
        cfg = self.cfg
        if self._closed:
            raise StoreClosed("the store is closed")
        if self.clock() < self._retry_at:
            raise _not_attached(self._failure)
        try:
            if self.observe:
                home = attach.observe(self.index, cfg.redis_prefix, cfg.path)
            else:
                home = attach.attach(self.index, cfg.redis_prefix, cfg.path, cfg.capacity_bytes, cfg.index_shards,
                                     self.clock(), self._first, self.largest_page, self.modes, cfg.node_name)
        except NoStoreYet as e:
            self._failure = e  # no waiting: another process may create it any moment
            raise
        except StoreUnavailable as e:
            if e.kind != AttachBusy.kind:  # (busy: the next pass tries again)
                self._retry_at = self.clock() + cfg.redis_retry_s
            self._failure = e
            raise
        except TierStoreError as e:  # a config error, a user the index refuses: the calls meanwhile say so
            self._retry_at = self.clock() + cfg.redis_retry_s
            self._failure = StoreUnavailable(str(e))
            self._failure.kind = getattr(e, "kind", "store_unavailable")
            raise
        first, self._first = self._first, False
        a = Attachment(home, self.index, cfg, self.modes, self._token, self.clock, self.metrics, self.log,
                       self._page_files, read_only=self.observe, on_use=self.used)
        if not self.observe:
            self._register(a)
            if first:
                self._say_orphans(a)
        return a

    def _say_orphans(self, a: Attachment) -> None:
        """At a serving process's first attach, one warning naming the store directories no
        store in the index claims (:mod:`.orphans`): they hold disk space nothing counts."""
        try:
            found = orphans.find(self.index, self.cfg.redis_prefix, self.cfg.path)
        except TierStoreError as e:  # a hint: the store works without it
            self.log.warning("orphans", "looking for orphaned store directories failed: %s", e)
            return
        orphans.say(self.log, found, self.cfg, a.shared)

    def detach(self, e: StoreDetached, a: Optional[Attachment] = None) -> None:
        """The store is gone from the index: drop the attachment (``a``, or whatever is
        current); housekeeping attaches again."""
        with self._lock:
            if self._att is not None and (a is None or self._att is a):
                self._att.close_files()
                self._att = None
                self._failure = StoreUnavailable(f"{e}; attaching again")
                self._failure.kind = "store_detached"
        self.metrics.error("store_detached")
        self.log.warning("detached", "%s; attaching again", e)
        self.housekeeping.wake()

    def set_capacity(self, capacity: int) -> None:
        """Change the store's capacity (bytes): housekeeping in every process evicts down to
        it and punches the space out of the files. ValueError unless it is 0 (hold
        nothing) or holds a region (the region size is the store's for good)."""
        a = self.attach()
        check_capacity(a.geometry.region_bytes, capacity, a.geometry.shards)
        attach.set_capacity(self.index, a.home, capacity)
        a.capacity = capacity
        self.cfg = self.cfg.with_capacity(capacity)  # a store created anew gets it too

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop housekeeping (waiting for a pass in progress at most ``timeout`` s, None:
        5 s), then close the attachment (:meth:`Attachment.close`); later calls raise
        :class:`StoreClosed`. True if housekeeping stopped and no lease was kept."""
        stopped = self.housekeeping.stop(5.0 if timeout is None else timeout)
        with self._lock:
            if self._closed:
                return stopped
            self._closed = True
            a, self._att = self._att, None
        kept = 0
        if a is not None:
            try:
                kept = a.close()
            except TierStoreError as e:  # the leases expire; recency updates are a hint
                self.log.warning("close", "giving the leases back on close failed: %s", e)
        return stopped and not kept
