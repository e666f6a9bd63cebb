"""The store: keys to verified page bytes, over the index, the allocator and page files.

Owns namespaces, the read and write protocols and verification; knows nothing of
SGLang and needs no torch (its tests run over plain byte buffers).

- probe: one HMGET per shard, in one round trip.
- read: the same HMGET, then the leading run of present pages is read straight into
  the caller's buffers, pages in adjacent slots coalesced into one ``preadv``, runs
  spread over the I/O threads. A page is a hit only if its entry's tag is valid for
  its key (:mod:`sglang_tierstore.mac`: an entry forged or moved in Redis is dropped
  unread) and its bytes hash to the committed checksum (hashed by the caller's thread
  as runs arrive). The probe does not check tags: a forged entry costs a miss at the
  read, never a wrong page. A mismatch drops
  the entry (conditionally: only if it still holds what was read) once our file
  handle is shown to be the file the index names; any other failure (EMFILE, EIO, a
  bug...) is a miss that keeps the entry. With ``read_timeout_s`` the wait for the
  disk is bounded: runs are read into the I/O threads' own staging memory and copied
  into the caller's buffers while the caller still waits; runs not read in time are
  misses (entries kept), and a preadv that returns after that lands in staging memory,
  never in host memory SGLang may have reused (``_read_staged``).
- write: slots come from this thread's stock (leased, consecutive for one batch);
  pages are written in coalesced runs while the caller's thread hashes them; then one
  COMMIT call per shard (one pipelined round trip) publishes them, gives up the slots
  that failed and refills the stock. Only a write that finds its stock short costs a
  second call first. A crash before COMMIT leaves leased slots, reclaimed when the
  lease expires; nothing is visible. A write has no deadline: on a disk that stops
  answering it waits (a pwritev cannot be called back, and giving its slots back
  while it may still land would let it overwrite a later page). Nothing is committed
  before its pwritev returned, so no entry names a slot still being written. A stall
  longer than ``lease_s`` while housekeeping cannot renew the lease (it may be stuck
  on the same disk) expires the lease: its slots stay dead (never handed to another
  writer), the batch's COMMIT stores nothing, and only once their region has been
  reclaimed and refilled could the late pwritev overwrite another page, which then
  fails its checksum: a miss, never a wrong byte.

Index trouble raises :class:`IndexUnavailable`; per-page trouble is a miss or a
failed write, counted and logged here.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time as mod_time
from dataclasses import dataclass, field
from typing import Callable, Generator, Mapping, Optional, Sequence

import xxhash

from sglang_tierstore import home
from sglang_tierstore.allocator import EXISTS, STORED, Allocator, CommitResult, Slot, slots_per_region
from sglang_tierstore.check import check as check_store
from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import FileGone, IndexUnavailable, PageIOError, StoreClosed, StoreDetached, TierStoreError
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.io_engine import Gate, IOEngine
from sglang_tierstore.mac import EntryTags
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import FileRecord, PageFiles, checksum
from sglang_tierstore.private import modes, redis_password, redis_tls
from sglang_tierstore.schema import (
    ENTRY,
    ENTRY_HEAD,
    USED,
    Entry,
    entry_field,
    entry_fields,
    glob_escape,
    meta_key,
    round_up,
    shard_of,
    unpack_entry,
    unpack_region,
)

logger = logging.getLogger(__name__)

Regions = Sequence[memoryview]
IOV_MAX = 1024  # iovecs in one preadv/pwritev
MAX_RUN_BYTES = 1 << 20  # one coalesced I/O at most (larger ones were slower on this VM: README, Performance),
# and the most one write moves: a larger page is written in pieces, so a read waits for at most one of those per thread


@dataclass(frozen=True, slots=True)
class Namespace:
    """Pages that are byte-compatible: same fingerprint, same page size."""

    ns: str  # hex id
    ns_id: bytes  # the 8 bytes that start each entry field
    page_bytes: int
    description: str


def fingerprint(fields: Mapping[str, object]) -> tuple[bytes, str]:
    """(8-byte id, readable description) of everything that makes pages compatible."""
    desc = ",".join(f"{k}={fields[k]}" for k in sorted(fields))
    return xxhash.xxh3_64_digest(desc.encode()), desc


def _by_shard(fields: Sequence[bytes], shards: int) -> dict[int, list[int]]:
    """Positions of ``fields`` by the shard each belongs to."""
    parts: dict[int, list[int]] = {}
    for i, f in enumerate(fields):
        parts.setdefault(shard_of(f, shards), []).append(i)
    return parts


def _scatter(buf: memoryview, dests: Sequence[Regions]) -> None:
    """Copy adjacent pages from ``buf`` into each page's regions."""
    off = 0
    for regions in dests:
        for m in regions:
            m[:] = buf[off : off + len(m)]
            off += len(m)


def _pieces(bufs: Sequence[memoryview], limit: int) -> list[tuple[int, list[memoryview]]]:
    """``bufs`` (adjacent bytes) cut into pieces of at most ``limit`` bytes: (byte
    offset, buffers) of each. ``limit`` is a multiple of the O_DIRECT alignment, so
    pieces of aligned buffers are aligned too."""
    out: list[tuple[int, list[memoryview]]] = []
    piece: list[memoryview] = []
    start = size = 0
    for b in bufs:
        while len(b):
            m = b[: limit - size]
            piece.append(m)
            size += len(m)
            b = b[len(m) :]
            if size == limit:
                out.append((start, piece))
                piece, start, size = [], start + size, 0
    if piece:
        out.append((start, piece))
    return out


def _run_bytes(runs: Sequence[Sequence[object]], page_bytes: int) -> int:
    """Bytes an average run moves: what the I/O engine cuts a batch by."""
    return max(1, sum(map(len, runs)) // max(1, len(runs))) * page_bytes


def open_index(cfg: TierStoreConfig, redis_url: str, clock: Callable[[], float] = mod_time.time) -> RedisIndex:
    """The index connection ``cfg`` calls for: the password of an external Redis (the
    embedded one's is in its URL) and the TLS files, read and checked now."""
    password = redis_password(cfg.redis_password_env, cfg.redis_password_file) if cfg.redis_url else None
    tls = redis_tls(cfg.redis_tls_ca_file, cfg.redis_tls_cert_file, cfg.redis_tls_key_file)
    return RedisIndex(redis_url, cfg.redis_timeout_s, cfg.redis_retry_s, clock, password, tls)


@dataclass
class _Attached:
    """One attachment to a store: what every operation works against."""

    att: home.Attachment
    alloc: Allocator
    files: PageFiles
    tags: EntryTags
    records: dict[int, FileRecord] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_Page = tuple[int, int, int]  # (position in the batch, file number, byte offset)


class TierStore:
    """Verified page store over one Redis index and one set of page directories."""

    def __init__(self, cfg: TierStoreConfig, redis_url: str, clock: Callable[[], float] = mod_time.time,
                 startup: bool = True, metrics: Optional[Metrics] = None) -> None:
        """``startup``: this process owns the store's settings, so its first attach may
        re-format the store for ``cfg.capacity_gb`` and records that capacity (a server).
        False: join the store as it is (an operator's tool, whose config may differ).
        ``metrics``: the caller's (labelled by rank), else the store's own."""
        self.cfg = cfg
        self.modes = modes(cfg.file_access)
        self.clock = clock
        self.index = open_index(cfg, redis_url, clock)
        self.io = IOEngine(cfg.io_threads)
        self.metrics = metrics if metrics is not None else Metrics()
        self.log = RateLimitedLog(logger, cfg.log_interval_s)
        self._token = secrets.token_hex(6)
        self._att: Optional[_Attached] = None
        self._att_lock = threading.Lock()
        self._started = not startup
        self._closed = False
        self._touch: dict[int, dict[int, float]] = {}
        self._lost: dict[int, str] = {}  # file number -> uid: to be forgotten by housekeeping
        self._namespaces: dict[str, Namespace] = {}
        self._lock = threading.Lock()
        try:
            self.attached()
        except IndexUnavailable as e:
            self.log.warning("attach", "index unavailable at start (%s): answering misses until it is back", e)
        except BaseException:  # a store that cannot start holds no threads or connections
            self.io.close()
            self.index.close()
            raise

    # -- attachment ----------------------------------------------------------------

    def attached(self) -> _Attached:
        """The store this process works on, attaching first if needed."""
        a = self._att
        if a is not None:
            return a
        with self._att_lock:
            if self._closed:
                raise StoreClosed("the store is closed")
            if self._att is None:
                cfg = self.cfg
                att = home.attach(self.index, cfg.redis_prefix, cfg.path, cfg.capacity_bytes, cfg.index_shards,
                                  startup=not self._started, now=self.clock(), access=self.modes)
                self._started = True
                alloc = Allocator(self.index, att.tag, att.geometry, list(att.dirs), cfg.lease_s, self._token, self.clock)
                files = PageFiles(cfg.redis_prefix, att.geometry, att.dirs, self.record, cfg.o_direct,
                                  cfg.fsync == "commit", self.modes)
                self._att = _Attached(att, alloc, files, EntryTags(att.entry_key))
                for ns in list(self._namespaces.values()):
                    self._register_ns(ns)
            return self._att

    def detach(self, e: StoreDetached, a: Optional[_Attached] = None) -> None:
        """Our store is gone from the index: drop the attachment (``a``, or whatever
        is current); the next call attaches again."""
        with self._att_lock:
            if self._att is not None and (a is None or self._att is a):
                a = self._att
                self._att = None
                a.files.close()
        self.metrics.error("store_detached")
        self.log.warning("detached", "%s; attaching again", e)

    def record(self, file_no: int) -> Optional[FileRecord]:
        """The index's record of a page file (cached; refreshed when unknown)."""
        a = self._att
        if a is None:
            return None
        rec = a.records.get(file_no)
        if rec is None or rec.state == "c":  # unknown here, or ready by now
            shard = a.att.geometry.shard_of_file(file_no)
            fresh = {f: FileRecord(*v) for f, v in a.alloc.files(shard).items()}
            with a.lock:
                a.records.update(fresh)
            rec = fresh.get(file_no)
        return rec

    # -- namespaces ---------------------------------------------------------------

    def namespace(self, fields: Mapping[str, object], page_bytes: int) -> Namespace:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        ns_id, desc = fingerprint({**fields, "page_bytes": page_bytes, "namespace": self.cfg.namespace})
        ns = Namespace(ns_id.hex(), ns_id, page_bytes, desc)
        with self._lock:
            self._namespaces[ns.ns] = ns
        try:
            self._register_ns(ns)
        except TierStoreError:
            pass  # registered again on the next attach
        return ns

    def _register_ns(self, ns: Namespace) -> None:
        a = self._att
        if a is not None:
            self.index.hset(meta_key(a.att.tag, "ns"), {ns.ns: f"page_bytes={ns.page_bytes};{ns.description}"})

    def namespaces(self) -> dict[str, int]:
        """Every namespace the store has seen: id -> page bytes."""
        return {ns: pb for ns, (pb, _) in self.namespace_descriptions().items()}

    def namespace_descriptions(self) -> dict[str, tuple[int, str]]:
        """Every namespace the store has seen: id -> (page bytes, the fingerprint's description)."""
        a = self.attached()
        out = {}
        for k, v in self.index.hgetall(meta_key(a.att.tag, "ns")).items():
            head, _, desc = v.decode().partition(";")
            out[k.decode()] = (int(head.split("=")[1]), desc)
        return out

    # -- probe --------------------------------------------------------------------

    def _lookup(self, a: _Attached, fields: Sequence[bytes]) -> list[Optional[bytes]]:
        """Entry values of fields (any shards), one round trip."""
        shards = a.att.geometry.shards
        if shards == 1:
            return self.index.hmget([(a.alloc.key(0, "entries"), fields)])[0]
        parts = _by_shard(fields, shards)
        got = self.index.hmget([(a.alloc.key(s, "entries"), [fields[i] for i in idx]) for s, idx in parts.items()])
        out: list[Optional[bytes]] = [None] * len(fields)
        for idx, vals in zip(parts.values(), got):
            for i, v in zip(idx, vals):
                out[i] = v
        return out

    def exists(self, groups: Sequence[tuple[Namespace, Sequence[str]]]) -> list[list[bool]]:
        """Presence of each key of each (namespace, keys) group, in one round trip."""
        a = self.attached()
        fields = [f for ns, keys in groups for f in entry_fields(ns.ns_id, keys)]
        found = self._lookup(a, fields)
        out, i = [], 0
        for _, keys in groups:
            out.append([v is not None for v in found[i : i + len(keys)]])
            i += len(keys)
        return out

    # -- runs ---------------------------------------------------------------------

    def _runs(self, pages: list[_Page], page_bytes: int, iov_per_page: int) -> list[list[_Page]]:
        """Pages in adjacent slots of one file, as runs for one preadv/pwritev each,
        cut so that a batch spreads over the I/O threads."""
        pages.sort(key=lambda p: (p[1], p[2]))
        slot = round_up(page_bytes)
        coalesce = slot == page_bytes
        total = len(pages) * page_bytes
        target = max(page_bytes, min(MAX_RUN_BYTES, total // self.io.threads))
        longest = max(1, min(IOV_MAX // max(1, iov_per_page), target // page_bytes)) if coalesce else 1
        runs: list[list[_Page]] = []
        for p in pages:
            last = runs[-1] if runs else None
            if last is not None and len(last) < longest and last[-1][1] == p[1] and last[-1][2] + slot == p[2]:
                last.append(p)
            else:
                runs.append([p])
        return runs

    # -- read ---------------------------------------------------------------------

    def read(self, ns: Namespace, keys: Sequence[str], dests: Sequence[Regions], aligned: bool) -> list[bool]:
        """Read the leading run of present keys into ``dests``; True per verified page."""
        self._check_sizes(ns, keys, dests)
        t0 = mod_time.perf_counter()
        a = self.attached()
        g = a.att.geometry
        fields = entry_fields(ns.ns_id, keys)
        raws = self._lookup(a, fields)
        lead = next((i for i, v in enumerate(raws) if v is None), len(raws))
        results = [False] * len(keys)
        entries: dict[int, Entry] = {}
        bad: list[tuple[bytes, bytes]] = []
        pages: list[_Page] = []
        per_region = slots_per_region(g.region_bytes, ns.page_bytes)
        for i in range(lead):
            raw = raws[i]
            assert raw is not None
            e = unpack_entry(raw) if len(raw) == ENTRY.size else None
            if e is None or e.slot >= per_region:
                bad.append((fields[i], raw))  # not an entry this store can have written
                self.metrics.error("corrupt")
                continue
            if not a.tags.valid(fields[i], raw):
                bad.append((fields[i], raw))
                self.metrics.error("forged")
                self.log.warning("forged", "entry of page %s has a tag this store did not make (written or moved in "
                                 "the index by someone else, or the store's entry key changed): dropped", fields[i].hex())
                continue
            entries[i] = e
            pages.append((i, g.file_of(e.region), g.slot_offset(e.region, e.slot, ns.page_bytes)))
        runs = self._runs(pages, ns.page_bytes, len(dests[0]) if dests else 1)
        read_runs = self._read_staged if self.cfg.read_timeout_s else self._read_direct
        # closed however this loop ends: before read returns or raises, a direct read waits for
        # the runs in flight (starting no more), a staged read shuts its gate
        with contextlib.closing(read_runs(a, runs, dests, ns.page_bytes, aligned)) as arriving:
            for k, o in arriving:
                run = runs[k]
                if isinstance(o, BaseException):
                    self._io_failure(a, "io_read", run[0][1], o)
                    continue
                for i, f, _ in run:
                    if checksum(dests[i]) == entries[i].checksum:
                        results[i] = True
                    elif self._file_current(a, f):
                        raw = raws[i]
                        assert raw is not None
                        bad.append((fields[i], raw))
                        self.metrics.error("corrupt")
                        self.log.warning("corrupt", "page %s failed verification (stale, torn or rotten slot): dropped", fields[i].hex())
        hits = sum(results)
        self.metrics.pages("read", "hit", hits)
        self.metrics.pages("read", "miss", len(keys) - hits)
        self.metrics.bytes("read", hits * ns.page_bytes)
        self._queue_touch(a, [entries[i].region for i in range(lead) if results[i]])
        if bad:
            self._drop(a, bad)
        self.metrics.observe("read", mod_time.perf_counter() - t0)
        return results

    def _read_direct(self, a: _Attached, runs: list[list[_Page]], dests: Sequence[Regions], page_bytes: int,
                     aligned: bool) -> Generator[tuple[int, object], None, None]:
        """(run position, outcome) of each run, read straight into ``dests``, as runs
        arrive; waits for every run (``read_timeout_s`` 0), and when closed early, for
        the runs in flight, starting no more: none lands in ``dests`` after ``read``."""
        def read_run(run: list[_Page]) -> None:
            bufs = [m for p in run for m in dests[p[0]]]
            a.files.read(run[0][1], run[0][2], bufs, len(run) * page_bytes, aligned)

        with self.io.submit(read_run, runs, _run_bytes(runs, page_bytes)) as batch:
            yield from batch.as_completed()

    def _read_staged(self, a: _Attached, runs: list[list[_Page]], dests: Sequence[Regions], page_bytes: int,
                     aligned: bool) -> Generator[tuple[int, object], None, None]:
        """Like :meth:`_read_direct`, but yields only runs done within ``read_timeout_s``.

        A preadv cannot be cancelled, so runs are read into the I/O threads' staging
        memory and copied into ``dests`` through a gate that this shuts before it
        returns: runs not done by the deadline are not yielded (misses), those not
        started never start, and a preadv that returns later fills staging memory
        only, never ``dests`` (host memory SGLang may have reused by then).
        """
        timeout = self.cfg.read_timeout_s
        gate = Gate()

        def read_run(run: list[_Page]) -> None:
            n = len(run) * page_bytes
            buf = self.io.staging.buffer(n)
            a.files.read(run[0][1], run[0][2], [buf], n, aligned)
            if not gate.enter():
                return  # given up: the bytes stay in this thread's staging buffer
            try:
                _scatter(buf, [dests[p[0]] for p in run])
            finally:
                gate.leave()

        batch = self.io.submit(read_run, runs, _run_bytes(runs, page_bytes), inline=False)
        done = 0
        try:
            for k, o in batch.as_completed(mod_time.monotonic() + timeout):
                done += len(runs[k])
                yield k, o
        finally:
            batch.cancel()
            gate.close()
        late = sum(map(len, runs)) - done
        if late:
            self.metrics.error("io_read_timeout", late)
            self.log.warning("io_read_timeout", "%d page(s) not read within read_timeout_s=%g s (a stalled disk, I/O "
                             "threads still stuck on one, or a queue of other batches' I/O ahead): misses, kept", late, timeout)

    def _file_current(self, a: _Attached, file_no: int) -> bool:
        """Is our handle on this file the file the index names? (If not, what we read
        proves nothing about the page.)"""
        try:
            a.files.still_there(file_no)
            return True
        except FileGone as e:
            self._file_gone(a, file_no, e)
        except PageIOError:
            pass
        return False

    def _io_failure(self, a: _Attached, kind: str, file_no: int, e: BaseException) -> None:
        if isinstance(e, FileGone):
            self._file_gone(a, file_no, e)
        elif isinstance(e, (PageIOError, IndexUnavailable)):
            self.metrics.error(kind)
            self.log.warning(kind, "%s: %s", kind, e)
        else:
            self.metrics.error("internal")
            self.log.exception(f"internal:{kind}", "unexpected error in %s (the page is a miss and is kept)", kind, exc=e)

    def _file_gone(self, a: _Attached, file_no: int, e: BaseException) -> None:
        a.files.forget(file_no)
        a.alloc.invalidate_stocks()
        rec = a.records.get(file_no)
        self.metrics.error("file_gone")
        self.log.warning("file_gone", "%s: its pages are dropped", e)
        if rec is not None:
            with self._lock:
                self._lost[file_no] = rec.uid

    def _drop_now(self, a: _Attached, entries: Sequence[tuple[bytes, bytes]]) -> int:
        """Drop (entry field, value seen or b'') pairs, one DROP call per shard."""
        parts = _by_shard([f for f, _ in entries], a.att.geometry.shards)
        return sum(a.alloc.drop(s, [entries[i] for i in idx]) for s, idx in parts.items())

    def _drop(self, a: _Attached, entries: Sequence[tuple[bytes, bytes]]) -> int:
        """Drop pages a read found bad; index trouble only postpones it."""
        try:
            return self._drop_now(a, entries)
        except StoreDetached as e:
            self.detach(e, a)
        except IndexUnavailable as e:  # the pages were misses all the same; the next read drops them
            self.log.warning("index", "dropping %d bad page(s) failed: %s", len(entries), e)
        return 0

    # -- write --------------------------------------------------------------------

    def write(self, ns: Namespace, keys: Sequence[str], srcs: Sequence[Regions], aligned: bool) -> list[bool]:
        """Store each page; True per page now stored (by this call or earlier)."""
        self._check_sizes(ns, keys, srcs)
        if not keys:
            return []
        t0 = mod_time.perf_counter()
        a = self.attached()
        try:
            with a.alloc.writing():
                results = self._write(a, ns, keys, srcs, aligned)
        except StoreDetached as e:
            self.detach(e, a)
            results = [False] * len(keys)
        self.metrics.pages("write", "failed", len(keys) - sum(results))
        self.metrics.observe("write", mod_time.perf_counter() - t0)
        return results

    def _stock_target(self, a: _Attached, shard: int, page_bytes: int, n: int) -> int:
        """Slots to keep in stock after a batch of ``n``: the same again, but never more
        than 1/16 of the shard's capacity (a stock holds space while it waits)."""
        g = a.att.geometry
        regions = a.alloc.capacity_regions[shard] or g.capacity_share(self.cfg.capacity_bytes, shard)
        return max(1, min(n, regions * g.region_bytes // 16 // round_up(page_bytes)))

    def _write(self, a: _Attached, ns: Namespace, keys: Sequence[str], srcs: Sequence[Regions], aligned: bool) -> list[bool]:
        g, alloc = a.att.geometry, a.alloc
        pb = ns.page_bytes
        fields = entry_fields(ns.ns_id, keys)
        parts = _by_shard(fields, g.shards)
        self._fill_stock(a, pb, {s: len(idx) for s, idx in parts.items()})
        slots: dict[int, Slot] = {}
        for s, idx in parts.items():
            slots.update(zip(idx, alloc.take(s, pb, len(idx))))
        pages = [(i, g.file_of(r), g.slot_offset(r, sl, pb)) for i, (r, sl, _) in slots.items()]
        runs = self._runs(pages, pb, len(srcs[0]))
        units = [(run, off, piece) for run in runs
                 for off, piece in _pieces([m for p in run for m in srcs[p[0]]], MAX_RUN_BYTES)]

        def write_unit(unit: tuple[list[_Page], int, list[memoryview]]) -> None:
            run, off, piece = unit
            a.files.write(run[0][1], run[0][2] + off, piece, sum(map(len, piece)), aligned)

        with self.io.submit(write_unit, units, len(pages) * pb // max(1, len(units)), write=True) as batch:
            tails = {i: self._tail(a, fields[i], slots[i], checksum(srcs[i])) for i in slots}  # while the pages are being written
            outcomes = batch.results()
        failed: set[int] = set()
        touched: set[int] = set()
        for (run, _, _), o in zip(units, outcomes):
            if isinstance(o, BaseException):
                if run[0][0] not in failed:  # once per run, however many of its pieces failed
                    self._io_failure(a, "io_write", run[0][1], o)
                failed.update(p[0] for p in run)
            else:
                touched.add(run[0][1])
        for file_no in touched:  # a file deleted or replaced under us must not take commits
            try:
                a.files.still_there(file_no)
                if self.cfg.fsync == "commit":
                    a.files.sync(file_no)
            except PageIOError as e:
                self._io_failure(a, "io_write", file_no, e)
                failed.update(p[0] for run in runs if run[0][1] == file_no for p in run)
        calls: list[tuple[int, list[int], list[tuple[Slot, bytes, bytes]], list[tuple[int, int]], list[tuple[int, int, bool]]]] = []
        for s, idx in parts.items():
            done = sorted((i for i in idx if i in slots and i not in failed), key=slots.__getitem__)  # runs of slots
            commits = [(slots[i], fields[i], tails[i]) for i in done]
            give_up = sorted((slots[i].region, slots[i].slot) for i in idx if i in failed)
            calls.append((s, done, commits, give_up, [(pb, self._stock_target(a, s, pb, len(idx)), False)]))
        try:
            outs = alloc.commit_many([(s, c, gu, rf) for s, _, c, gu, rf in calls])
        except IndexUnavailable:
            for s in parts:
                alloc.forget_stock(s)  # the next COMMIT returns the lease as Redis has it
            raise
        results = [False] * len(keys)
        status: list[int] = []
        for (s, done, _, _, _), res in zip(calls, outs):
            for i, st in zip(done, res.status):
                results[i] = st in (STORED, EXISTS)
            status += res.status
            self._after_commit(a, s, res)
        full = len(keys) - len(slots)
        self.metrics.pages("write", "stored", status.count(STORED))
        self.metrics.pages("write", "exists", status.count(EXISTS))
        self.metrics.pages("write", "full", full)
        self.metrics.bytes("write", status.count(STORED) * pb)
        if full:
            self.log.warning("full", "no slot for %d page(s) of %d bytes (every region pinned by writers, or pages larger "
                             "than the store's %d-byte regions)", full, pb, g.region_bytes)
        return results

    @staticmethod
    def _tail(a: _Attached, field: bytes, slot: Slot, crc: int) -> bytes:
        """An entry after its head, as the writer sends it: checksum and tag."""
        signed = ENTRY_HEAD.pack(slot.region, slot.gen, slot.slot) + crc.to_bytes(8, "little")
        return signed[ENTRY_HEAD.size :] + a.tags.tag(field, signed)

    def _fill_stock(self, a: _Attached, page_bytes: int, need: Mapping[int, int]) -> None:
        """Make this thread's stock hold ``need[shard]`` slots of this size where it can
        (one COMMIT call for all short shards; more only to add a page file)."""
        alloc = a.alloc
        for _ in range(4):
            short = [s for s, n in need.items() if alloc.stocked(s, page_bytes) < n]
            if not short:
                return
            outs = alloc.commit_many([(s, [], [], [(page_bytes, need[s], True)]) for s in short])
            retry = False
            for s, res in zip(short, outs):
                self._after_commit(a, s, res)
                if res.too_big:
                    self.metrics.pages("write", "too_big", need[s])
                    return
                if res.need_file:
                    self._add_file(a, s)
                    retry = True
            if not retry:
                return

    def _after_commit(self, a: _Attached, shard: int, res: CommitResult) -> None:
        self.metrics.housekeeping("evicted", res.evicted)
        self.metrics.housekeeping("pages_evicted", res.pages_evicted)
        for r in res.fresh:  # regions that were holes: give them disk space before use
            try:
                a.files.allocate(r)
            except TierStoreError as e:  # the write goes on: space is then taken as pages land
                self._io_failure(a, "allocate", a.att.geometry.file_of(r), e)

    def _add_file(self, a: _Attached, shard: int) -> None:
        """A new page file for a shard that has no region left without one."""
        f, dir_id, uid = a.alloc.add_file(shard)
        try:
            a.files.create(f, dir_id, uid)
        except PageIOError as e:
            self._io_failure(a, "create_file", f, e)
            a.alloc.lose_file(shard, f, uid, 0)
            return
        if not a.alloc.file_ready(shard, f, uid):
            a.files.remove(f, dir_id)
            return
        with a.lock:
            a.records[f] = FileRecord(dir_id, uid, "r")
        self.metrics.housekeeping("files_added", 1)

    # -- housekeeping -------------------------------------------------------------

    def _queue_touch(self, a: _Attached, regions: list[int]) -> None:
        if regions:
            now = self.clock()
            g = a.att.geometry
            with self._lock:
                for r in regions:
                    self._touch.setdefault(g.shard_of_region(r), {})[r] = now

    def flush_touches(self) -> None:
        """Send batched recency updates: one ZADD XX GT per shard."""
        self._flush_touches(self.attached())

    def _flush_touches(self, a: _Attached) -> None:
        with self._lock:
            pending, self._touch = self._touch, {}
        for shard, regions in pending.items():
            self.index.zadd_newer(a.alloc.key(shard, "lru"), regions)

    def sweep(self, max_work: int) -> int:
        """One housekeeping pass of the allocator over every shard: expired leases,
        shrinking to capacity, free regions ahead of need. Returns work done."""
        a = self.attached()
        g = a.att.geometry
        work = 0
        draining = 0
        for s in range(g.shards):
            try:
                expired, slots, evicted, pages, drain, punch = a.alloc.sweep(s, self.cfg.free_target, max_work)
            except StoreDetached as e:
                self.detach(e, a)
                return work
            self.metrics.housekeeping("leases_expired", expired)
            self.metrics.housekeeping("slots_reclaimed", slots)
            self.metrics.housekeeping("evicted", evicted)
            self.metrics.housekeeping("pages_evicted", pages)
            punched = []
            for r in punch:  # holes whose space is still on disk
                try:
                    a.files.punch(r)
                    punched.append(r)
                except PageIOError as e:  # stays queued: tried again next time
                    self._io_failure(a, "punch", g.file_of(r), e)
            self.metrics.housekeeping("deallocated", a.alloc.punched(s, punched))
            draining += drain
            work += expired + evicted + len(punched)
        self.metrics.housekeeping("stocks_tidied", a.alloc.tidy(draining > 0))
        return work

    def forget_lost_files(self, max_work: int) -> None:
        """Forget page files found gone: drop their pages, give back their capacity."""
        a = self.attached()
        with self._lock:
            lost, self._lost = self._lost, {}
        for f, uid in lost.items():
            shard = a.att.geometry.shard_of_file(f)
            left, pages = a.alloc.lose_file(shard, f, uid, max_work)
            a.alloc.invalidate_stocks()
            self.metrics.housekeeping("pages_lost", pages)
            if left:
                with self._lock:
                    self._lost[f] = uid
                continue
            with a.lock:
                rec = a.records.pop(f, None)
            if rec is not None and rec.dir_id in a.files.dirs:
                try:  # whatever is at its path now is not a file of this store
                    a.files.remove(f, rec.dir_id)
                except PageIOError as e:
                    self._io_failure(a, "remove_file", f, e)
            self.log.warning("file_forgotten", "page file %d forgotten (%d pages dropped)", f, pages)

    def audit_files(self, dir_retire_s: float) -> None:
        """Compare our files with the index: deleted or replaced files, files the index
        does not know, directories no process has any more."""
        a = self.attached()
        g = a.att.geometry
        for f in a.files.open_files():
            self._file_current(a, f)
        on_disk = a.files.on_disk()  # before the records: a file is recorded before it is created
        records: dict[int, FileRecord] = {}
        for s in range(g.shards):
            records.update({f: FileRecord(*v) for f, v in a.alloc.files(s).items()})
        with a.lock:
            a.records = dict(records)
        for f, where in on_disk.items():
            rec = records.get(f)
            for dir_id, _ in where:
                if rec is None or rec.dir_id != dir_id or rec.state == "l":
                    try:
                        a.files.remove(f, dir_id)
                        self.metrics.housekeeping("files_removed", 1)
                    except PageIOError as e:
                        self._io_failure(a, "remove_file", f, e)
        for f, rec in records.items():
            if rec.state == "r" and rec.dir_id in a.files.dirs and f not in a.files.open_files():
                try:
                    a.files.ensure_open(f)
                except FileGone as e:
                    self._file_gone(a, f, e)
                except PageIOError:
                    pass
        now = self.clock()
        home.report_dirs(self.index, a.att.tag, a.att.dirs, now)
        for dir_id in home.retired_dirs(self.index, a.att.tag, list(a.att.dirs), now - dir_retire_s):
            with self._lock:
                self._lost.update({f: rec.uid for f, rec in records.items() if rec.dir_id == dir_id})
            if not any(rec.dir_id == dir_id for rec in records.values()):
                home.forget_dir(self.index, a.att.tag, dir_id)
                self.log.warning("dir_retired", "directory %s of the store was not seen for %.0f s: forgotten", dir_id, dir_retire_s)

    # -- operator calls -----------------------------------------------------------

    def check(self, fix: bool = False, verify_pages: bool = True) -> list[str]:
        """Compare the index with itself and the page files (see :mod:`check`)."""
        return check_store(self, fix, verify_pages)

    def set_capacity(self, capacity: int) -> None:
        """Change the store's capacity (bytes) while running: housekeeping in every
        process evicts down to it and punches the space out of the files."""
        a = self.attached()
        home.set_capacity(self.index, a.att.tag, a.att.geometry, capacity)
        self.cfg = self.cfg.with_capacity(capacity)

    def clear(self, namespaces: Sequence[Namespace]) -> int:
        """Drop every page of these namespaces; returns how many."""
        a = self.attached()
        n = 0
        for ns_id in {x.ns_id for x in namespaces}:
            pattern = glob_escape(ns_id) + b"*"
            for s in range(a.att.geometry.shards):
                key = a.alloc.key(s, "entries")
                cursor = 0
                while True:
                    cursor, chunk = self.index.hscan(key, cursor, 1000, match=pattern)
                    n += a.alloc.drop(s, [(f, b"") for f in chunk if f.startswith(ns_id)])
                    if cursor == 0:
                        break
        return n

    def delete(self, ns: Namespace, keys: Sequence[str]) -> int:
        """Drop these pages (their slots are dead until their region is reclaimed);
        returns how many were stored."""
        return self._drop_now(self.attached(), [(f, b"") for f in entry_fields(ns.ns_id, keys)])

    def where(self, ns: Namespace, key: str) -> Optional[tuple[str, int, int]]:
        """(page file, byte offset, region) of a committed page, or None."""
        a = self.attached()
        raw = self._lookup(a, [entry_field(ns.ns_id, key)])[0]
        if raw is None:
            return None
        e = unpack_entry(raw)
        g = a.att.geometry
        rec = self.record(g.file_of(e.region))
        if rec is None or rec.dir_id not in a.files.dirs:
            return None
        return a.files.path(g.file_of(e.region), rec.dir_id), g.slot_offset(e.region, e.slot, ns.page_bytes), e.region

    def usage(self) -> dict[str, int]:
        """Regions and capacity over every shard (see ``Allocator.counts``)."""
        a = self.attached()
        total: dict[str, int] = {}
        for s in range(a.att.geometry.shards):
            for k, v in a.alloc.counts(s).items():
                total[k] = total.get(k, 0) + v
        total["region_bytes"] = a.att.geometry.region_bytes
        total["allocated_bytes"] = total["allocated_regions"] * a.att.geometry.region_bytes
        total["capacity_bytes"] = total["capacity_regions"] * a.att.geometry.region_bytes
        total["pages"] = sum(self.index.hlen(a.alloc.key(s, "entries")) for s in range(a.att.geometry.shards))
        return total

    def page_sizes(self) -> dict[int, dict[str, int]]:
        """Regions in use and their slots, by page size: each size's share of the store.
        Streams the region records (HSCAN, bounded steps)."""
        a = self.attached()
        out: dict[int, dict[str, int]] = {}
        for s in range(a.att.geometry.shards):
            key, cursor = a.alloc.key(s, "regions"), 0
            while True:
                cursor, chunk = self.index.hscan(key, cursor, 1000)
                for raw in chunk.values():
                    reg = unpack_region(raw)
                    if reg.state == USED:
                        d = out.setdefault(reg.page_bytes, {"regions": 0, "live": 0, "leased": 0, "dead": 0})
                        d["regions"] += 1
                        d["live"] += reg.live
                        d["leased"] += reg.leased
                        d["dead"] += reg.fill - reg.live - reg.leased
                if cursor == 0:
                    break
        return out

    def pages_by_namespace(self) -> dict[str, int]:
        """Committed pages per namespace id. Streams the entries (HSCAN, bounded steps):
        O(pages) Redis work, for operators' tools rather than a hot path."""
        a = self.attached()
        out: dict[str, int] = {}
        for s in range(a.att.geometry.shards):
            key, cursor = a.alloc.key(s, "entries"), 0
            while True:
                cursor, chunk = self.index.hscan(key, cursor, 1000)
                for f in chunk:
                    ns = f[:8].hex()
                    out[ns] = out.get(ns, 0) + 1
                if cursor == 0:
                    break
        return out

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.metrics.snapshot())
        try:
            out["usage"] = self.usage()
        except TierStoreError:
            pass
        return out

    # -- helpers ------------------------------------------------------------------

    def _check_sizes(self, ns: Namespace, keys: Sequence[str], bufs: Sequence[Regions]) -> None:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} page buffers")
        for k, regions in zip(keys, bufs):
            n = sum(map(len, regions))
            if n != ns.page_bytes:
                raise ValueError(f"page buffer for key {k!r} has {n} bytes, namespace pages have {ns.page_bytes}")

    def close(self, timeout: Optional[float] = None) -> bool:
        """Send the last recency updates, give the leases back, close the page files,
        stop the I/O threads and disconnect from Redis; later calls raise
        :class:`StoreClosed`. Idempotent.

        Whatever a call still running uses is released when it is done with it: a page
        file's descriptors after its last I/O, a mid-batch writer's lease when it expires.
        I/O threads are waited for at most ``timeout`` s (None: as long as they take); one
        stuck on a disk that stopped answering exits once its call returns. True if
        everything was released now."""
        with self._att_lock:
            if self._closed:
                return True
            self._closed = True
            a, self._att = self._att, None
        kept = 0
        if a is not None:
            try:
                self._flush_touches(a)
                kept = a.alloc.release_all()
            except TierStoreError as e:  # the leases expire; recency updates are a hint
                self.log.warning("close", "giving the leases back on close failed: %s", e)
            a.files.close()
        stopped = self.io.close(timeout)
        self.index.close()
        return stopped and not kept
