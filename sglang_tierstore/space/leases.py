"""Writers' leases and the slots each writer holds: the Python side of ``leases.lua``.

A region is filled append-only (``fill`` counts slots handed out). A writer takes slots
from its own stock: a lease (``leases``: ranges of slots; ``deadlines``: expiry), one
per writing thread, so two threads never pick the same slots. A batch takes consecutive
slots from its stock, writes, then one ``commit`` call publishes the entries, gives up
the slots it could not use and tops the stock up for the next batch: a write is one
round trip once a stock exists. A writer that dies holds its stock until the lease
expires; then those slots count as dead (or return to the region if they were its
last). Slots never leave a region except with the whole region, so accounting stays
exact: ``fill = live + leased + dead`` for every region. A region with a slot under
lease is never reclaimed; one that must leave drains.

Policy here: a stock is the size of the largest of a thread's last ``RECENT_BATCHES``
batches (SGLang's backups vary in size: sized after the last one only, a larger batch
after a small one costs a lease round trip), but never more than 1/16 of the
shard's capacity (a stock holds space while it waits); a stock is trusted only while
its lease was renewed within half its term (housekeeping renews it every pass).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

from sglang_tierstore.errors import IndexUnavailable
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.schema import NEED_FILE, TOO_BIG, round_up
from sglang_tierstore.space.attach import Home

STOCK_SHARE = 16  # a stock holds at most 1/STOCK_SHARE of a shard's capacity
RECENT_BATCHES = 8  # a stock holds as many slots as the largest of this many last batches


class Range(NamedTuple):
    """Consecutive slots of one region, leased to one writer."""

    region: int
    start: int
    slots: int
    page_bytes: int
    gen: int  # the region's generation: part of each entry's tag


class Slot(NamedTuple):
    region: int
    slot: int
    gen: int


class Commits(NamedTuple):
    """The pages of one shard to publish, in slot order: their slots, entry fields and
    entry tails (checksum and tag), position by position."""

    slots: Sequence[Slot]
    fields: Sequence[bytes]
    tails: Sequence[bytes]


class Reply(NamedTuple):
    """What a ``lease`` or ``commit`` call answered for one shard."""

    status: list[int]  # per page committed: STORED, EXISTS (its slot is dead) or NOT_STORED
    stock: list[Range]  # the lease's slots after the call
    fresh: list[int]  # regions just allocated: they need disk space before use
    need_file: bool  # no region left without a new page file
    too_big: bool  # the page size does not fit a region
    evicted: int
    pages_evicted: int
    capacity_regions: int  # the shard's capacity as the index has it now


Answer = Union[Reply, IndexUnavailable]  # a shard's reply, or the error its call ended in (its node failed)


class _Stock:
    """One writing thread's lease and the slots it holds, per shard. ``lock`` is held
    for a whole write (slots taken, written, committed), so housekeeping can tell an idle
    writer from a busy one."""

    __slots__ = ("lease", "thread", "lock", "ranges", "epoch", "renewed", "answered", "batches", "leased", "orphaned")

    def __init__(self, lease: str, epoch: int) -> None:
        self.lease = lease
        self.thread = threading.current_thread()
        self.lock = threading.RLock()
        self.ranges: dict[int, list[Range]] = {}
        self.epoch = epoch
        self.renewed: dict[int, float] = {}  # shard -> when its lease was last renewed
        self.answered: dict[int, int] = {}  # shard -> Leases.mark() when a reply last set its stock there
        self.batches: dict[tuple[int, int], deque[int]] = {}  # (shard, page bytes) -> sizes of the last batches
        self.leased = False  # the lease may exist in the index: a call was sent since it was last given back
        self.orphaned = False  # its thread writes under a new lease now (see Leases.writing): tidy gives it back


class Leases:
    """This process's leases in one store, and the calls that move slots between them
    and the regions. Knows regions and slots, not keys or files."""

    def __init__(self, index: RedisIndex, home: Home, dirs: str, lease_s: float, token: str,
                 clock: Callable[[], float]) -> None:
        self.index = index
        self.geometry = home.geometry
        self.dirs = dirs  # this process's directory ids (csv): which regions it can use
        self.lease_s = lease_s
        self.clock = clock
        self._keys = [home.shard_keys(s) for s in range(home.geometry.shards)]
        self._token = token
        self._local = threading.local()
        self._stocks: dict[str, _Stock] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._epoch = 0  # bumped when slots of some stock may have been taken away (a file lost)
        self._answers = 0  # replies that set a stock so far: orders them against sweeps (see renewed)
        self.capacity_regions = [0] * home.geometry.shards  # per shard, as the last reply said (0: none yet)

    # -- stocks ------------------------------------------------------------------------

    def _mine(self) -> _Stock:
        st: Optional[_Stock] = getattr(self._local, "stock", None)
        if st is None:
            st = self._new_stock()
        if st.epoch != self._epoch:  # start over from what the lease holds in Redis
            st.ranges, st.epoch = {}, self._epoch
        return st

    def _new_stock(self, locked: bool = False) -> _Stock:
        """A stock under a lease of its own for this thread (none in the index until its first
        call); ``locked``: its lock taken before housekeeping can see it."""
        with self._lock:
            st = _Stock(f"{self._token}.{self._next}", self._epoch)
            if locked:
                st.lock.acquire()
            self._next += 1
            self._stocks[st.lease] = st
        self._local.stock = st
        return st

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Held around a write, from taking slots to their commit: this thread's stock is
        its own meanwhile. Never waits: housekeeping holds a stock only while it gives the
        stock back (a Redis round trip), and a writer that finds it so takes a stock under a
        new lease (its next call leases anew) and leaves the old one to housekeeping."""
        st = self._mine()
        if not st.lock.acquire(blocking=False):
            new = self._new_stock(locked=True)
            new.batches = {k: deque(v, maxlen=RECENT_BATCHES) for k, v in st.batches.items()}
            st.orphaned = True
            st = new
        try:
            yield
        finally:
            st.lock.release()

    def _stock(self, shard: int) -> list[Range]:
        """This thread's slots in a shard, if its lease there was renewed within half its
        term: a writer that stalled longer may have lost the lease, and its slots with it,
        so it starts over from what the next call answers."""
        mine = self._mine()
        if self.clock() - mine.renewed.get(shard, -1e18) > self.lease_s / 2:
            mine.ranges[shard] = []
        return mine.ranges.setdefault(shard, [])

    def invalidate(self) -> None:
        """Every thread drops its stock before its next batch (slots may have been taken
        away: a file lost); the next call answers what each lease holds."""
        self._epoch += 1

    def forget_stock(self, shard: int) -> None:
        """After a call whose outcome is unknown: start over from what the lease holds."""
        self._stock(shard).clear()

    def stocked(self, shard: int, page_bytes: int) -> int:
        return sum(r.slots for r in self._stock(shard) if r.page_bytes == page_bytes)

    def batch_of(self, shard: int, page_bytes: int, n: int) -> None:
        """This thread wrote a batch of ``n`` pages of this size to ``shard``: what its
        stock is sized by (:meth:`stock_target`)."""
        self._mine().batches.setdefault((shard, page_bytes), deque(maxlen=RECENT_BATCHES)).append(n)

    def stock_target(self, shard: int, page_bytes: int, capacity: int) -> int:
        """Slots to keep in stock: as many as the largest of this thread's last batches
        there (:meth:`batch_of`), but never more than 1/16 of the shard's capacity
        (``capacity``: the store's, until a reply told)."""
        g = self.geometry
        recent = self._mine().batches.get((shard, page_bytes)) or [1]
        regions = self.capacity_regions[shard] or g.capacity_share(capacity, shard)
        return max(1, min(max(recent), regions * g.region_bytes // STOCK_SHARE // round_up(page_bytes)))

    def take(self, shard: int, page_bytes: int, n: int) -> list[Slot]:
        """Up to ``n`` slots of this size from this thread's stock, in order (consecutive
        where the stock is)."""
        out: list[Slot] = []
        stock = self._stock(shard)
        kept: list[Range] = []
        for rg in stock:
            if rg.page_bytes == page_bytes and len(out) < n:
                k = min(n - len(out), rg.slots)
                out.extend(Slot(rg.region, rg.start + j, rg.gen) for j in range(k))
                if k < rg.slots:
                    kept.append(rg._replace(start=rg.start + k, slots=rg.slots - k))
            else:
                kept.append(rg)
        stock[:] = kept
        return out

    # -- calls -------------------------------------------------------------------------

    def _head(self, lease: str) -> list[Any]:
        now = self.clock()
        return [self.geometry.store_id, lease, repr(now), repr(now + self.lease_s), self.dirs]

    def _answered(self, mine: _Stock, shards: Sequence[int], sent: float, outs: Sequence[Any],
                  all_or_raise: bool = True) -> list[Answer]:
        """Each shard's reply, or the IndexUnavailable its call ended in (that shard's stock
        is forgotten: the call may have run). Raises any other error (a detached store, a
        refused user) at once, and with ``all_or_raise`` the first when every call failed."""
        for o in outs:
            if isinstance(o, Exception) and not isinstance(o, IndexUnavailable):
                raise o
        if all_or_raise and outs and all(isinstance(o, Exception) for o in outs):
            for s in shards:
                mine.ranges.pop(s, None)
            raise outs[0]
        replies: list[Answer] = [o if isinstance(o, Exception) else _reply(o) for o in outs]
        with self._lock:  # against renewed(): a sweep sent before this reply must not undo it
            self._answers += 1
            for s, rep in zip(shards, replies):
                if isinstance(rep, Exception):
                    mine.ranges.pop(s, None)
                    continue
                mine.ranges[s] = rep.stock
                mine.renewed[s] = sent
                mine.answered[s] = self._answers
                self.capacity_regions[s] = rep.capacity_regions
        return replies

    def lease(self, page_bytes: int, want: dict[int, int]) -> dict[int, Answer]:
        """Lease slots of this size, up to ``want[shard]`` in this thread's stock, evicting
        where nothing is free (they are needed now): one round trip for every shard. A
        shard whose node failed answers its error (see :meth:`_answered`)."""
        mine = self._mine()
        with mine.lock:
            sent = self.clock()
            shards = list(want)
            mine.leased = True
            outs = self.index.calls_each([("lease", self._keys[s], [*self._head(mine.lease), page_bytes, want[s]])
                                          for s in shards])
            return dict(zip(shards, self._answered(mine, shards, sent, outs, all_or_raise=False)))

    def commit(self, page_bytes: int, calls: Sequence[tuple[int, Commits, Sequence[Slot], int]]) -> list[Answer]:
        """One ``commit`` per (shard, commits, give-ups, slots wanted in stock afterwards),
        in one round trip.

        commits: pages written, in slot order (consecutive slots of a region travel, and
        are committed, as one run); give-ups: slots written in vain, in slot order.
        Statuses come back in the order of the commits. Each reply's stock replaces this thread's for
        that shard (the slots taken by :meth:`take` are gone from both). A shard whose node
        failed answers its error (see :meth:`_answered`): its pages may or may not be stored."""
        mine = self._mine()
        with mine.lock:
            sent = self.clock()
            mine.leased = True
            outs = self.index.calls_each([("commit", self._keys[s], self._commit_args(mine.lease, page_bytes, c, gu, want))
                                          for s, c, gu, want in calls])
            return self._answered(mine, [s for s, _, _, _ in calls], sent, outs)

    def _commit_args(self, lease: str, page_bytes: int, commits: Commits, give_up: Sequence[Slot],
                     want: int) -> list[Any]:
        runs = _runs(commits.slots)
        args: list[Any] = [*self._head(lease), page_bytes, want, len(runs)]
        for a, b in runs:
            first = commits.slots[a]
            args += [first.region, first.gen, first.slot, b - a, b"".join(commits.fields[a:b]), b"".join(commits.tails[a:b])]
        gruns = _runs(give_up)
        args.append(len(gruns))
        for a, b in gruns:
            args += [give_up[a].region, give_up[a].slot, b - a]
        return args

    def tidy(self, draining: bool, idle: bool = False) -> int:
        """Housekeeping of stocks: a thread that exited (or left its stock, see
        :meth:`writing`) gives its whole lease back; with
        the process ``idle`` (nothing read or written for a while) so does every thread not
        writing (its next write leases anew), so that an idle process holds no lease that
        housekeeping must wake up to renew; with regions ``draining``, an idle thread gives
        back its slots in them (a busy one does at its next commit). Returns how many
        stocks were tidied."""
        with self._lock:
            stocks = list(self._stocks.values())
        done = 0
        for st in stocks:
            gone = st.orphaned or not st.thread.is_alive()
            if not (gone or draining or (idle and st.leased)):
                continue
            if not st.lock.acquire(blocking=False):
                continue  # writing now: its commit settles its slots
            try:
                if gone:
                    self._release(st)
                    with self._lock:
                        self._stocks.pop(st.lease, None)
                elif idle:
                    self._release(st)
                else:
                    for shard in list(st.ranges):
                        out = self.index.call("release_draining", self._keys[shard],
                                              [self.geometry.store_id, st.lease, repr(self.clock() + self.lease_s)])
                        st.ranges[shard] = _stock(out)
                done += 1
            finally:
                st.lock.release()
        return done

    def _release(self, st: _Stock) -> None:
        """Give a lease back whole, in every shard (caller holds its lock). The stock is
        emptied first: should a shard's call fail, or its reply be lost after it ran, the
        writer must not take slots the index may have given to another; the lease stays
        marked ``leased``, to be given back at the next tidy (or, failing that, to expire)."""
        st.ranges, st.renewed = {}, {}
        self.index.calls([("release", keys, [self.geometry.store_id, st.lease]) for keys in self._keys])
        st.leased = False

    def release_all(self) -> int:
        """Give every idle lease of this process back (on close): its unused slots are
        not held until they expire. A lease whose writer is mid-batch is kept (giving its
        slots away while its pwritev may still land could overwrite another's page): it
        expires. Returns how many were kept."""
        with self._lock:
            stocks = list(self._stocks.values())
        kept = 0
        for st in stocks:
            if not st.lock.acquire(blocking=False):
                kept += 1
                continue
            try:
                self._release(st)
            finally:
                st.lock.release()
        return kept

    def holding(self) -> bool:
        """Whether some thread's lease may exist in the index (it leased or committed since
        it last gave the lease back), which housekeeping must renew within ``lease_s``."""
        with self._lock:
            return any(st.leased for st in self._stocks.values())

    # -- renewal (housekeeping's sweep) ------------------------------------------------

    def lease_ids(self) -> list[str]:
        with self._lock:
            return list(self._stocks)

    def mark(self) -> int:
        """Taken before a sweep is sent: a reply applied to a stock after it came from a call
        the sweep cannot have seen the outcome of (see :meth:`renewed`)."""
        with self._lock:
            return self._answers

    def renewed(self, shard: int, at: float, gone: set[str], mark: int) -> None:
        """A sweep renewed this process's leases in a shard at ``at``, except those in
        ``gone`` (not in the index when it ran: expired meanwhile, their slots may be someone
        else's by now). Never waits for a writer: a stock whose lease is gone is no longer
        trusted (see :meth:`_stock`), and its writer drops it before its next batch, or its
        commit's reply replaces it. ``mark`` (:meth:`mark`, taken before the sweep was sent):
        a stock a reply set since then is left alone, whatever the sweep said of its lease,
        as that call may have run after the sweep (a writer's first lease, which the sweep
        found missing); one that ran before it saved its slots with a fresh deadline, so the
        sweep found it unless it held nothing."""
        with self._lock:
            for st in self._stocks.values():
                if st.answered.get(shard, -1) > mark:
                    continue
                if st.lease in gone:
                    st.renewed.pop(shard, None)
                else:
                    st.renewed[shard] = at


def _runs(slots: Sequence[Slot]) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``slots`` that are consecutive slots of one region."""
    out: list[tuple[int, int]] = []
    start = 0
    for k in range(1, len(slots) + 1):
        if k == len(slots) or slots[k].region != slots[k - 1].region or slots[k].slot != slots[k - 1].slot + 1:
            out.append((start, k))
            start = k
    return out


def _stock(flat: Sequence[Any]) -> list[Range]:
    nums = [int(x) for x in flat]
    return [Range(*nums[j : j + 5]) for j in range(0, len(nums), 5)]


def _reply(out: Sequence[Any]) -> Reply:
    flags, evicted, pages, cap, n = (int(x) for x in out[:5])
    status = [int(x) for x in out[5 : 5 + n]]
    k = 5 + n
    nfresh = int(out[k])
    fresh = [int(x) for x in out[k + 1 : k + 1 + nfresh]]
    return Reply(status, _stock(out[k + 1 + nfresh :]), fresh, bool(flags & NEED_FILE), bool(flags & TOO_BIG), evicted,
                 pages, cap)
