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
:mod:`.files` (page files' lives), :mod:`.housekeeping` (when background work runs).
This module joins them: :class:`Space` attaches, detaches and closes; an
:class:`Attachment` reserves slots for a write (adding page files and giving fresh
regions disk space itself), commits them, takes recency, and drops pages. The page
files layer below is handed a file ref with each call and never calls back up.
"""

from __future__ import annotations

import threading
import time as mod_time
from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Type
from typing import Counter as CounterT

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import (
    IndexRefusesWrites,
    IndexUnavailable,
    NoStoreYet,
    PageIOError,
    StoreClosed,
    StoreDetached,
    StoreUnavailable,
    TierStoreError,
)
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import FileRef, PageFiles
from sglang_tierstore.perms import Modes
from sglang_tierstore.schema import NOT_STORED, shard_key, shard_of
from sglang_tierstore.space import attach
from sglang_tierstore.space.attach import Home
from sglang_tierstore.space.files import Files
from sglang_tierstore.space.geometry import Geometry, check_capacity
from sglang_tierstore.space.housekeeping import Housekeeper
from sglang_tierstore.space.leases import Commits, Leases, Reply, Slot
from sglang_tierstore.space.library import LIBRARY
from sglang_tierstore.tags import EntryTags

LEASE_ROUNDS = 4  # lease calls a reserve may make while it adds page files


class Place(NamedTuple):
    """Where one page of a batch lies: its position in the batch, its file, the byte
    offset there."""

    pos: int
    file: FileRef
    offset: int


def by_shard(fields: Sequence[bytes], shards: int) -> dict[int, list[int]]:
    """Positions of ``fields`` by the shard each belongs to."""
    if shards == 1:
        return {0: list(range(len(fields)))} if fields else {}
    parts: dict[int, list[int]] = {}
    for i, f in enumerate(fields):
        parts.setdefault(shard_of(f, shards), []).append(i)
    return parts


class Reservation:
    """Slots for one write batch, held by this thread from :meth:`Attachment.reserve` to
    :meth:`commit` (use it as a context manager: housekeeping then knows the writer is
    busy). Pages it has no place for (every region pinned, pages larger than a region)
    are not stored. Slots it placed and that no commit published or gave up stay in the
    writer's lease: the next call answers them back into the stock. Why each page it did
    not store was not stored goes into ``outcomes`` (the caller counts them)."""

    def __init__(self, a: "Attachment", page_bytes: int, fields: Sequence[bytes], outcomes: CounterT[str]) -> None:
        self._a = a
        self.page_bytes = page_bytes
        self.fields = fields
        self.outcomes = outcomes
        self.parts = by_shard(fields, a.geometry.shards)
        self.places: list[Place] = []  # the pages placed, in batch order
        self.slots: dict[int, Slot] = {}  # batch position -> slot, placed or not
        self._lock = a.leases.writing()

    def __enter__(self) -> "Reservation":
        self._lock.acquire()
        try:
            self._place()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def _place(self) -> None:
        a, pb = self._a, self.page_bytes
        failed = a.fill_stock(pb, {s: len(idx) for s, idx in self.parts.items()})
        slots: dict[int, Slot] = {}
        for s, idx in self.parts.items():
            slots.update(zip(idx, a.leases.take(s, pb, len(idx))))
        unreached = sum(len(self.parts[s]) for s in failed)  # counted as their shard's failure
        at = dict(zip(slots, a.geometry.places([(sl.region, sl.slot) for sl in slots.values()], pb)))
        refs = a.files.refs({f for f, _ in at.values()})
        for i, (f, offset) in at.items():
            if f in refs:  # the rest (a file not ready any more): given up at commit
                self.places.append(Place(i, refs[f], offset))
        self.slots = slots
        self.outcomes["unreached"] += unreached
        self.outcomes["file_unready"] += len(slots) - len(self.places)
        full = len(self.fields) - len(slots) - unreached
        if full > 0:
            self.outcomes["full" if a.geometry.holds(pb) else "too_big"] += full
            a.log.warning("full", "no slot for %d page(s) of %d bytes (every region pinned by writers, or pages larger "
                          "than the store's %d-byte regions)", full, pb, a.geometry.region_bytes)

    def commit(self, written: Iterable[int], tails: Mapping[int, bytes], sync: bool) -> dict[int, int]:
        """Publish the pages at these positions (their pwritevs returned), with their
        entry tails; every other placed page is given up. A file deleted or replaced
        under the batch takes no commits; with ``sync`` each file written is
        fdatasync'ed first. One ``commit`` call per shard, in one round trip. Returns
        each committed position's status (STORED, EXISTS, NOT_STORED)."""
        a = self._a
        files = {p.pos: p.file for p in self.places}
        ok = set(written) & files.keys()
        checked = len(ok)
        for ref in {files[i] for i in ok}:
            try:
                a.pages.still_there(ref.number)
                if sync:
                    a.pages.sync(ref)
            except PageIOError as e:
                a.files.failure("io_write", ref.number, e)
                ok -= {i for i in ok if files[i] == ref}
        self.outcomes["file_gone"] += checked - len(ok)
        slots = self.slots
        calls = []
        for s, idx in self.parts.items():
            done = sorted((i for i in idx if i in ok), key=slots.__getitem__)  # runs of slots
            commits = Commits([slots[i] for i in done], [self.fields[i] for i in done], [tails[i] for i in done])
            give_up = sorted(slots[i] for i in idx if i in slots and i not in ok)
            a.leases.batch_of(s, self.page_bytes, len(idx))
            calls.append((s, done, commits, give_up, a.leases.stock_target(s, self.page_bytes, a.capacity)))
        try:
            replies = a.leases.commit(self.page_bytes, [(s, c, gu, want) for s, _, c, gu, want in calls])
        except IndexUnavailable:
            for s in self.parts:
                a.leases.forget_stock(s)  # the next call answers the lease as Redis has it
            raise
        status: dict[int, int] = {}
        for (s, done, _, _, _), rep in zip(calls, replies):
            if isinstance(rep, IndexUnavailable):
                a.shard_failed(s, rep)
                self.outcomes["unreached"] += len(done)
                continue
            status.update(zip(done, rep.status))
            self.outcomes["refused"] += rep.status.count(NOT_STORED)  # lease lost, or its region reclaimed
            a.settled(rep)
        return status


class Attachment:
    """One attachment to a store: what every call works against until the store goes
    (then :class:`Space` attaches anew and this one answers nothing more)."""

    def __init__(self, home: Home, index: RedisIndex, cfg: TierStoreConfig, modes: Modes, token: str,
                 clock: Callable[[], float], metrics: Metrics, log: RateLimitedLog, page_files: Type[PageFiles],
                 read_only: bool = False, on_use: Callable[[], None] = lambda: None) -> None:
        """``on_use`` is called with every batch read or written (housekeeping wakes)."""
        self.home = home
        self.on_use = on_use
        self.geometry: Geometry = home.geometry
        self.tag = home.tag
        self.index = index
        self.capacity = home.capacity  # the store's; replies from the index keep it current
        self.clock = clock
        self.metrics = metrics
        self.log = log
        self.tags = EntryTags(home.entry_key)
        self.pages = page_files(home.file_identity(), home.dirs, cfg.o_direct, modes, read_only, cfg.shared_fs)
        self.leases = Leases(index, home, ",".join(home.dirs), cfg.lease_s, token, clock)
        self.files = Files(index, home, self.pages, self.leases, metrics, log, clock, cfg.write_timeout_s)
        self._touch: dict[int, dict[int, float]] = {}
        self._lock = threading.Lock()

    def shard_keys(self, shard: int) -> list[str]:
        """Every key of a shard, in the order its functions take them."""
        return self.home.shard_keys(shard)

    def key(self, shard: int, name: str) -> str:
        """One key of a shard by its name in ``schema.SHARD_KEYS``."""
        return shard_key(self.home.shard_tags[shard], name)

    # -- writes ------------------------------------------------------------------------

    def reserve(self, page_bytes: int, fields: Sequence[bytes], outcomes: CounterT[str]) -> Reservation:
        """Slots for a batch of pages of this size (``with a.reserve(...) as r:``),
        leased, consecutive where the stock is: a page file is added where no region is
        left without one, and fresh regions get their disk space, here. Pages not stored
        are counted in ``outcomes`` by why."""
        self.on_use()
        return Reservation(self, page_bytes, fields, outcomes)

    def fill_stock(self, page_bytes: int, need: Mapping[int, int]) -> set[int]:
        """Make this thread's stock hold ``need[shard]`` slots of this size where it can:
        one lease call for every short shard; more only to add page files. Returns the
        shards whose calls failed (their nodes are down) while others answered, counted
        and logged; raises the first IndexUnavailable when every shard of the batch failed."""
        failed: dict[int, IndexUnavailable] = {}
        self._lease_rounds(page_bytes, need, failed)
        if failed and len(failed) == len(need):
            raise next(iter(failed.values()))
        for s, e in failed.items():
            self.shard_failed(s, e)
        return set(failed)

    def _lease_rounds(self, page_bytes: int, need: Mapping[int, int], failed: dict[int, IndexUnavailable]) -> None:
        for _ in range(LEASE_ROUNDS):
            short = {s: n for s, n in need.items() if s not in failed and self.leases.stocked(s, page_bytes) < n}
            if not short:
                return
            retry = False
            for s, rep in self.leases.lease(page_bytes, short).items():
                if isinstance(rep, IndexUnavailable):
                    failed[s] = rep
                    continue
                self.settled(rep)
                if rep.too_big:  # its pages get no slot: counted by the reservation, as each unstored page is
                    return
                if rep.need_file:
                    self.files.add(s)
                    retry = True
            if not retry:
                return

    def shard_failed(self, shard: int, e: IndexUnavailable) -> None:
        """A shard's call failed while others answered (its node is down: a cluster master):
        counted and logged; its pages are misses or not stored."""
        self.metrics.error(e.kind)
        self.log.warning(f"shard_{e.kind}", "index shard %d failed (%s): its pages are misses or not stored; the other "
                         "shards go on", shard, e)

    def settled(self, rep: Reply) -> None:
        """After a lease or commit call: count its evictions, give its fresh regions space."""
        self.metrics.housekeeping("evicted", rep.evicted)
        self.metrics.housekeeping("pages_evicted", rep.pages_evicted)
        self.files.allocate(rep.fresh)

    # -- pages -------------------------------------------------------------------------

    def touch(self, regions: Iterable[int]) -> None:
        """These regions were just used: their recency goes to the index with the next
        housekeeping pass (one ZADD XX GT per shard)."""
        self.on_use()
        now = self.clock()
        g = self.geometry
        with self._lock:
            for r in regions:
                self._touch.setdefault(g.shard_of_region(r), {})[r] = now

    def flush_touches(self) -> None:
        with self._lock:
            pending, self._touch = self._touch, {}
        for shard, regions in pending.items():
            self.index.zadd_newer(self.key(shard, "lru"), regions)

    def drop(self, entries: Sequence[tuple[bytes, bytes]], shard: Optional[int] = None) -> int:
        """Drop (entry field, value seen or b'': any) pairs whose entry still holds that
        value; their slots are dead. One ``drop`` call per shard (each field's own, or the
        one ``shard`` named: where check() found the entry); returns how many."""
        if shard is not None:
            parts = {shard: list(range(len(entries)))} if entries else {}
        else:
            parts = by_shard([f for f, _ in entries], self.geometry.shards)
        calls = [("drop", self.shard_keys(s), [self.geometry.store_id, *(x for i in idx for x in entries[i])])
                 for s, idx in parts.items()]
        return sum(int(n) for n in self.index.calls(calls)) if calls else 0

    def close(self) -> int:
        """Send the last recency updates, give idle leases back and close the page files;
        the number of leases kept (a writer mid-batch: they expire)."""
        try:
            self.flush_touches()
            return self.leases.release_all()
        finally:
            self.files.close()
            self.pages.close()


def _not_attached(e: StoreUnavailable) -> StoreUnavailable:
    """The last attach's failure again, until its retry is due: the same class and kind
    (an index that could not be reached is IndexUnavailable to every caller meanwhile)."""
    msg = f"the store is not attached ({e}); trying again shortly"
    again = IndexRefusesWrites(msg, e.kind) if isinstance(e, IndexRefusesWrites) else type(e)(msg)
    again.kind = e.kind
    return again


class Space:
    """Where bytes may go in the store a process's config names: attached on first use,
    attached anew when the store goes from the index, and housekept."""

    def __init__(self, cfg: TierStoreConfig, index: RedisIndex, modes: Modes, token: str, metrics: Metrics,
                 log: RateLimitedLog, clock: Callable[[], float] = mod_time.time, observe: bool = False,
                 page_files: Type[PageFiles] = PageFiles) -> None:
        """``observe``: an operator's tool, which joins the store as it is and writes
        nothing on disk (:func:`attach.observe`); else a serving process, which adopts the
        store or creates it once it knows its pages (:meth:`expect_pages`,
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
        self._lock = threading.Lock()
        self._closed = False
        self._retry_at = -float("inf")  # after an attach that could not be done, when to try again
        self._failure: StoreUnavailable = StoreUnavailable("not attached yet")  # the last attach's
        self._listeners: list[Callable[[Attachment], None]] = []

    def used(self) -> None:
        """A batch was read or written."""
        self.activity += 1
        self.housekeeping.wake()

    def on_attach(self, fn: Callable[[Attachment], None]) -> None:
        """Call ``fn`` with every new attachment (the store registers its namespaces)."""
        self._listeners.append(fn)

    def expect_pages(self, page_bytes: int) -> None:
        """Pages of this size will be stored: a store this process creates from now on
        holds them (and the next call tries to attach at once)."""
        if self.largest_page is None or page_bytes > self.largest_page:
            self.largest_page = page_bytes
            self._retry_at = -float("inf")

    def attached(self) -> Attachment:
        """The store this process works on, attaching first if needed.

        StoreUnavailable (its ``kind`` says why) while that cannot be done for a reason a
        cache rides out: the index down, full or read-only, the directories full, no store
        yet and no pages known to create it for. After such a failure the next try waits
        ``redis_retry_s``. An operator's tool gets NoStore where there is no store."""
        a = self._att
        if a is not None:
            return a
        with self._lock:
            if self._closed:
                raise StoreClosed("the store is closed")
            if self._att is None:
                self._att = self._attach()
            return self._att

    def _attach(self) -> Attachment:
        """Caller holds the lock."""
        cfg = self.cfg
        if self.clock() < self._retry_at:
            raise _not_attached(self._failure)
        try:
            if self.observe:
                home = attach.observe(self.index, cfg.redis_prefix, cfg.path)
            else:
                home = attach.attach(self.index, cfg.redis_prefix, cfg.path, cfg.capacity_bytes, cfg.index_shards,
                                     self.clock(), self._first, self.largest_page, self.modes, cfg.node_name)
        except NoStoreYet:
            raise  # no waiting: another process may create it any moment
        except StoreUnavailable as e:
            self._retry_at = self.clock() + cfg.redis_retry_s
            self._failure = e
            raise
        self._first = False
        a = Attachment(home, self.index, cfg, self.modes, self._token, self.clock, self.metrics, self.log,
                       self._page_files, read_only=self.observe, on_use=self.used)
        for fn in self._listeners:
            fn(a)
        return a

    def detach(self, e: StoreDetached, a: Optional[Attachment] = None) -> None:
        """The store is gone from the index: drop the attachment (``a``, or whatever is
        current); the next call attaches again."""
        with self._lock:
            if self._att is not None and (a is None or self._att is a):
                self._att.files.close()
                self._att.pages.close()
                self._att = None
        self.metrics.error("store_detached")
        self.log.warning("detached", "%s; attaching again", e)

    def set_capacity(self, capacity: int) -> None:
        """Change the store's capacity (bytes): housekeeping in every process evicts down to
        it and punches the space out of the files. ValueError unless it is 0 (hold
        nothing) or holds a region (the region size is the store's for good)."""
        a = self.attached()
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
