"""The life of a store's page files, as the index records them: added, opened, found
gone, forgotten, audited; and directories retired.

A file's record (``{T:s}:files``: directory, uid, state) is the index's; the page files
layer is handed a :class:`~sglang_tierstore.pagefile.FileRef` with every call and never
asks for one. Records are cached here and refreshed, outside any lock the I/O threads
take, when a number is unknown or was still being created.

A file is added when a writer finds no region left without one: ``add_file`` records
it (creating), the file is written, ``file_ready`` turns its regions into holes. A file
found gone (deleted, replaced, truncated: :class:`~sglang_tierstore.errors.FileGone`)
is queued; housekeeping then forgets it (``lose_file``: its pages dropped, its
capacity back). The audit (every ``audit_s``, or ``idle_audit_s`` while nothing is read or
written: see :mod:`.housekeeping`) checks every file against its path,
removes files the index does not account for, reports this process's directories, and
forgets directories no process has reported for ``10 * lease_s``.
"""

from __future__ import annotations

import errno
import queue
import secrets
import socket
import threading
from typing import Callable, Iterable, Optional

from sglang_tierstore.errors import FileGone, IndexUnavailable, PageIOError, TierStoreError
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import FileRef, PageFiles
from sglang_tierstore.schema import CREATING, LOST, READY, FileRecord, parse_file_record, shard_key
import sglang_tierstore.space.attach as attach
from sglang_tierstore.space.attach import Home
from sglang_tierstore.space.leases import Leases

_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS)  # the filesystem cannot punch holes, or allocate


class Files:
    """The page files of one attachment: their records, and each file's life."""

    def __init__(self, index: RedisIndex, home: Home, pages: PageFiles, leases: Leases, metrics: Metrics,
                 log: RateLimitedLog, clock: Callable[[], float], wait_s: float = 0.0) -> None:
        """``wait_s``: how long a writer waits for a new page file to be made on disk
        (``write_timeout_s``; 0: until it is)."""
        self.index = index
        self.wait_s = wait_s
        self.home = home
        self.pages = pages
        self.leases = leases
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self.dirs = ",".join(home.dirs)
        self._records: dict[int, FileRecord] = {}
        self._lost: dict[int, str] = {}  # file number -> uid: to be forgotten by housekeeping
        self._no_punch: set[str] = set()  # directories whose filesystem cannot punch holes
        self._no_allocate: set[str] = set()  # directories whose filesystem cannot allocate space
        shards = home.geometry.shards
        self._adding = [threading.Lock() for _ in range(shards)]  # one file added at a time per shard
        self._added = [0] * shards
        self._making: list[Optional[threading.Thread]] = [None] * shards  # a file still being made after wait_s
        self._allocator: Optional[threading.Thread] = None  # allocations with wait_s run here, in turn
        self._alloc_jobs: queue.SimpleQueue[Optional[tuple[list[int], threading.Event]]] = queue.SimpleQueue()
        self._alloc_stuck = False  # an allocation outlived wait_s: none starts until it returns
        self._alloc_closed = False
        self._lock = threading.Lock()

    # -- records -----------------------------------------------------------------------

    def records(self, shard: int) -> dict[int, FileRecord]:
        """The index's records of a shard's files (one HGETALL)."""
        raw = self.index.hgetall(shard_key(self.home.shard_tags[shard], "files"))
        return {int(k): parse_file_record(v) for k, v in raw.items()}

    def refs(self, numbers: Iterable[int]) -> dict[int, FileRef]:
        """Refs of the files among ``numbers`` that are ready in the index (cached; one
        HGETALL per shard with a number unknown here or created since)."""
        g = self.home.geometry
        with self._lock:
            recs = {f: self._records.get(f) for f in set(numbers)}
        stale = {g.shard_of_file(f) for f, rec in recs.items() if rec is None or rec.state == CREATING}
        if stale:
            fresh = {f: rec for s in stale for f, rec in self.records(s).items()}
            with self._lock:
                self._records.update(fresh)
            recs.update({f: fresh.get(f) for f, rec in recs.items() if g.shard_of_file(f) in stale})
        return {f: FileRef(f, rec.dir_id, rec.uid) for f, rec in recs.items() if rec is not None and rec.state == READY}

    def ref(self, number: int) -> Optional[FileRef]:
        return self.refs([number]).get(number)

    # -- a file's life -----------------------------------------------------------------

    def add(self, shard: int) -> None:
        """A new page file for a shard that has no region left without one; none if
        another thread of this process added one for it meanwhile (writers that all found
        the shard full at once then lease again, rather than each adding a file), or is
        still making one on a disk slower than ``wait_s``: the writer waits that long at
        most, and the file is made (and published) when the disk answers."""
        seen = self._added[shard]
        with self._adding[shard]:  # writers only: never an I/O thread
            making = self._making[shard]
            if self._added[shard] != seen or (making is not None and making.is_alive()):
                return
            self._added[shard] += 1
            f, dir_id, uid = self.index.call("add_file", self.home.shard_keys(shard),
                                             [self.home.geometry.store_id, repr(self.clock()), self.dirs,
                                              secrets.token_hex(8)])
            ref = FileRef(int(f), _text(dir_id), _text(uid))
            if not self.wait_s:
                self._make(shard, ref)
                return
            t = threading.Thread(target=self._make_logged, args=(shard, ref), name="tierstore-file", daemon=True)
            t.start()
            t.join(self.wait_s)
            if t.is_alive():
                self._making[shard] = t
                self.metrics.error("file_create_timeout")
                self.log.warning("file_create_timeout", "page file %d not made within write_timeout_s=%g s (a stalled "
                                 "disk): writes that need it are not stored until it is", ref.number, self.wait_s)

    def _make_logged(self, shard: int, ref: FileRef) -> None:
        try:
            self._make(shard, ref)
        except TierStoreError as e:  # the index went meanwhile: the file stays creating, for housekeeping
            self.failure("create_file", ref.number, e)

    def _make(self, shard: int, ref: FileRef) -> None:
        """Create the file the index gave this process to make, and publish it (or give
        it up, if it cannot be made)."""
        try:
            self.pages.create(ref)
        except PageIOError as e:
            self.failure("create_file", ref.number, e)
            self.index.call("lose_file", self.home.shard_keys(shard), [self.home.geometry.store_id, ref.number, ref.uid, 0])
            return
        if not self.index.call("file_ready", self.home.shard_keys(shard), [self.home.geometry.store_id, ref.number, ref.uid]):
            self.pages.remove(ref.number, ref.dir_id)
            return
        with self._lock:
            self._records[ref.number] = FileRecord(ref.dir_id, ref.uid, READY, "")
        self.metrics.housekeeping("files_added", 1)

    def allocate(self, regions: Iterable[int]) -> None:
        """Give regions that were holes disk space before use. Never raises: a failure
        (the disk, or the index asked for the file's record) only means space is taken as
        pages land; it is counted and logged. Where the filesystem cannot allocate (found
        once: FUSE filesystems, NFSv3) nothing more is tried there: space is taken as
        pages land, and no emulation writes zeros under pages being written. With
        ``wait_s`` the writer waits that long at most (a stalled disk): the allocation
        goes on in the background, and until it returns no other is started (pages take
        their space as they land)."""
        todo = list(regions)
        if not todo:
            return
        if not self.wait_s:
            self._allocate(todo)
            return
        done = threading.Event()
        with self._lock:
            if self._alloc_stuck or self._alloc_closed:
                return
            if self._allocator is None:
                self._allocator = threading.Thread(target=self._allocations, name="tierstore-alloc", daemon=True)
                self._allocator.start()
            self._alloc_jobs.put((todo, done))
        if not done.wait(self.wait_s):
            with self._lock:
                self._alloc_stuck = True
            self.metrics.error("allocate_timeout")
            self.log.warning("allocate_timeout", "giving %d region(s) disk space took longer than write_timeout_s=%g s "
                             "(a stalled disk): writes go on, taking space as pages land", len(todo), self.wait_s)

    def close(self) -> None:
        """Stop the allocator thread once the allocations queued are done (it exits when
        one stuck on a stalled disk returns); later allocations are not made."""
        with self._lock:
            self._alloc_closed = True
            if self._allocator is not None:
                self._alloc_jobs.put(None)

    def _allocations(self) -> None:
        """The allocator thread: one allocation at a time, in order (daemon: a process
        may exit while it is stuck on a stalled disk)."""
        while (job := self._alloc_jobs.get()) is not None:
            todo, done = job
            try:
                self._allocate(todo)
            except Exception as e:  # never let the thread die; _allocate itself does not raise
                self.failure("allocate", -1, e)
            finally:
                done.set()
                with self._lock:
                    self._alloc_stuck = False

    def _allocate(self, regions: list[int]) -> None:
        g = self.home.geometry
        for r in regions:
            ref = None
            try:
                ref = self.ref(g.file_of(r))
                if ref is not None and ref.dir_id not in self._no_allocate:
                    self.pages.allocate(ref, g.region_offset(r), g.region_bytes)
            except PageIOError as e:
                if e.errno not in _UNSUPPORTED or ref is None:
                    self.failure("allocate", g.file_of(r), e)
                    continue
                self._no_allocate.add(ref.dir_id)
                self.log.warning("allocate", "%s; regions there take disk space as their pages land", e)
            except TierStoreError as e:
                self.failure("allocate", g.file_of(r), e)

    def punch(self, regions: Iterable[int]) -> list[int]:
        """Return holes' disk space; the regions done (the rest stay queued, tried again
        by the next pass). In a directory whose filesystem cannot punch holes (found once:
        ramfs, NFSv3, many FUSE filesystems) a region counts as done as it is: the space
        stays in its file, to be reused before any file grows, so the files never hold
        more than capacity and the regions queued to punch."""
        g = self.home.geometry
        done = []
        for r in regions:
            ref = self.ref(g.file_of(r))
            if ref is None:
                continue
            if ref.dir_id in self._no_punch:
                done.append(r)
                continue
            try:
                self.pages.punch(ref, g.region_offset(r), g.region_bytes)
                done.append(r)
            except PageIOError as e:
                if e.errno not in _UNSUPPORTED:
                    self.failure("punch", ref.number, e)
                    continue
                self._no_punch.add(ref.dir_id)
                self.log.warning("punch", "%s; regions taken out there keep their disk space and are reused in "
                                 "place", e)
                done.append(r)
        return done

    def current(self, number: int) -> bool:
        """Is our handle on this file the file the index names? (If not, what we read
        proves nothing about the page.)"""
        try:
            self.pages.still_there(number)
            return True
        except FileGone as e:
            self.gone(number, e)
        except PageIOError:
            pass
        return False

    def gone(self, number: int, e: BaseException) -> None:
        """The file is not the one the index names: its handle goes now and every writer's
        stock is distrusted; and if its directory is provably the store's (see
        :meth:`PageFiles.identified`), housekeeping forgets it. Otherwise (an unmounted
        share, a directory briefly missing, a cache lagging another node) its pages are
        misses and it is opened afresh on next use."""
        self.pages.forget(number)
        self.leases.invalidate()
        with self._lock:
            rec = self._records.get(number)
        if rec is not None and not self.pages.identified(rec.dir_id):
            self.metrics.error("file_unverified")
            self.log.warning("file_unverified", "%s, but its directory is not provably the store's now (unmounted, "
                             "unreadable, another filesystem): misses, nothing dropped", e)
            return
        if rec is None:  # not a file of ours as far as the index said: nothing to forget
            return
        with self._lock:
            self._lost[number] = rec.uid
        self.metrics.error("file_gone")
        self.log.warning("file_gone", "%s: its pages are dropped", e)

    def failure(self, kind: str, number: int, e: BaseException) -> None:
        """Count and log a failure of an operation on a file (a file gone is lost)."""
        if isinstance(e, FileGone):
            self.gone(number, e)
        elif isinstance(e, (PageIOError, IndexUnavailable)):
            self.metrics.error(kind)
            self.log.warning(kind, "%s: %s", kind, e)
        else:
            self.metrics.error("internal")
            self.log.exception(f"internal:{kind}", "unexpected error in %s (the page is a miss and is kept)", kind, exc=e)

    # -- housekeeping ------------------------------------------------------------------

    def forget_lost(self, max_work: int) -> None:
        """Forget page files found gone: drop their pages, give back their capacity."""
        with self._lock:
            lost, self._lost = self._lost, {}
        for f, uid in lost.items():
            shard = self.home.geometry.shard_of_file(f)
            left, pages = self.index.call("lose_file", self.home.shard_keys(shard),
                                          [self.home.geometry.store_id, f, uid, max_work])
            self.leases.invalidate()
            self.metrics.housekeeping("pages_lost", int(pages))
            if int(left):
                with self._lock:
                    self._lost[f] = uid
                continue
            with self._lock:
                rec = self._records.pop(f, None)
            if rec is not None and rec.dir_id in self.pages.dirs:
                try:  # whatever is at its path now is not a file of this store
                    self.pages.remove(f, rec.dir_id)
                except PageIOError as e:
                    self.failure("remove_file", f, e)
            self.log.warning("file_forgotten", "page file %d forgotten (%d pages dropped)", f, int(pages))

    def audit(self, dir_retire_s: float) -> None:
        """Compare our files with the index: deleted or replaced files, files the index
        does not know, directories no process has any more."""
        for f in self.pages.open_files():
            self.current(f)
        on_disk = self.pages.on_disk()  # before the records: a file is recorded before it is created
        records: dict[int, FileRecord] = {}
        for s in range(self.home.geometry.shards):
            records.update(self.records(s))
        with self._lock:
            self._records = dict(records)
        for f, where in on_disk.items():
            rec = records.get(f)
            for dir_id, _ in where:
                if (rec is None or rec.dir_id != dir_id or rec.state == LOST) and self.pages.identified(dir_id):
                    try:
                        self.pages.remove(f, dir_id)
                        self.metrics.housekeeping("files_removed", 1)
                    except PageIOError as e:
                        self.failure("remove_file", f, e)
        opened = set(self.pages.open_files())
        for f, rec in records.items():
            if rec.state == READY and rec.dir_id in self.pages.dirs and f not in opened:
                try:
                    self.pages.ensure_open(FileRef(f, rec.dir_id, rec.uid))
                except FileGone as e:
                    self.gone(f, e)
                except PageIOError:
                    pass
        if not self.pages.read_only:
            self.pages.heartbeat()
        now = self.clock()
        attach.report_dirs(self.index, self.home.tag, self.home.dirs, now, self.home.node or socket.gethostname())
        for dir_id in attach.retired_dirs(self.index, self.home.tag, list(self.home.dirs), now - dir_retire_s):
            with self._lock:
                self._lost.update({f: rec.uid for f, rec in records.items() if rec.dir_id == dir_id})
            if not any(rec.dir_id == dir_id for rec in records.values()):
                attach.forget_dir(self.index, self.home.tag, dir_id)
                self.log.warning("dir_retired", "directory %s of the store was not seen for %.0f s: forgotten",
                                 dir_id, dir_retire_s)


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
