"""The store: page keys to verified page bytes. Knows nothing of SGLang and needs no
torch (its tests run over plain byte buffers).

It owns namespaces, the page protocol and verification; where bytes may go is the space
layer's (:mod:`sglang_tierstore.space`), moving them the I/O engine's and the page
files'. A read descends store -> index (one HMGET) -> I/O engine -> page files; a write
store -> space.reserve -> I/O engine -> page files -> space commit -> index.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time as mod_time
from dataclasses import dataclass
from collections import Counter
from typing import Callable, Mapping, Optional, Sequence, Type
from typing import Counter as CounterT

import xxhash

import sglang_tierstore._native as _native
from sglang_tierstore.config import Target, TierStoreConfig
from sglang_tierstore.errors import (
    IndexUnavailable,
    NoStoreYet,
    PageIOError,
    StoreDetached,
    StoreUnavailable,
    TierStoreError,
)
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.io_engine import Gate, IOEngine, Outcome, each
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import HASH, READ, WRITE, Moved, PageFiles, Transfer, checksum
from sglang_tierstore.perms import modes, redis_password, redis_tls
from sglang_tierstore.schema import (
    ENTRY,
    EXISTS,
    STORED,
    Entry,
    entry_fields,
    round_up,
    unpack_entry,
)
from sglang_tierstore.space import Space
from sglang_tierstore.space.attachment import Attachment, Place
from sglang_tierstore.space.reservation import Reservation
from sglang_tierstore.space.geometry import slots_per_region

logger = logging.getLogger(__name__)

Regions = Sequence[memoryview]
IOV_MAX = 1024  # iovecs in one preadv/pwritev
_LATE = object()  # the outcome of a write item not done by write_timeout_s
MAX_RUN_BYTES = 1 << 20  # one coalesced I/O at most (larger ones were slower on this VM: docs/performance.md),
# and the most one write item moves: a larger page is written in pieces and hashed by an item of its own, so a
# read waits for at most one piece or one page's hash per thread


@dataclass(frozen=True, slots=True)
class Namespace:
    """Pages that are byte-compatible: same fingerprint, same page size."""

    ns: str  # hex id
    ns_id: bytes  # the 8 bytes that start each entry field
    page_bytes: int
    description: str


Run = list[Place]  # pages in adjacent slots of one file: one preadv/pwritev


def fingerprint(fields: Mapping[str, object]) -> tuple[bytes, str]:
    """(8-byte id, readable description) of everything that makes pages compatible."""
    desc = ",".join(f"{k}={fields[k]}" for k in sorted(fields))
    return xxhash.xxh3_64_digest(desc.encode()), desc


def _scatter(buf: memoryview, dests: Sequence[Regions]) -> None:
    """Copy adjacent pages from ``buf`` into each page's regions."""
    off = 0
    for regions in dests:
        for m in regions:
            m[:] = buf[off : off + len(m)]
            off += len(m)


def _pieces(bufs: Sequence[memoryview], limit: int) -> list[tuple[int, list[memoryview]]]:
    """``bufs`` (adjacent bytes) cut into pieces of at most ``limit`` bytes (> 0): (byte
    offset, buffers) of each. ``limit`` is a multiple of the O_DIRECT alignment, so
    pieces of aligned buffers are aligned too."""
    if limit <= 0:
        raise ValueError(f"pieces need a positive size limit, got {limit}")
    if sum(map(len, bufs)) <= limit:  # the common case: one piece, nothing cut
        return [(0, list(bufs))]
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


def _give_up(res: Reservation) -> None:
    """Give up every slot of a batch that ends in an exception while its pwritevs still
    run (best effort: if the index cannot be told now, a write that lands late can only
    make the page later written there a checksum miss)."""
    with contextlib.suppress(TierStoreError):
        res.commit((), {}, False)


def _run_bytes(runs: Sequence[Sequence[object]], page_bytes: int) -> int:
    """Bytes an average run moves: what the I/O engine cuts a batch by."""
    return max(1, sum(map(len, runs)) // max(1, len(runs))) * page_bytes


def open_index(cfg: TierStoreConfig, target: Target, clock: Callable[[], float] = mod_time.time) -> RedisIndex:
    """The index connection ``cfg`` calls for (``target``: where the index is, the embedded
    Redis's URL when ``cfg`` names none): the password of an external index (the
    embedded one's is in its URL) and the TLS files, read and checked now."""
    password = redis_password(cfg.redis_password_env, cfg.redis_password_file) if cfg.index_target else None
    tls = redis_tls(cfg.redis_tls_ca_file, cfg.redis_tls_cert_file, cfg.redis_tls_key_file)
    return RedisIndex(target, cfg.redis_timeout_s, cfg.redis_retry_s, clock, password, tls)


class TierStore:
    """Verified page store over one Redis index and one set of page directories.

    Pages live in namespaces (:meth:`namespace`): pages of one namespace are
    byte-compatible and of one size. Every batch call takes page buffers as lists of
    ``memoryview`` regions per page (a host pool's page may be several blocks) and moves
    bytes straight between them and the page files. Guarantees: a read never fills a
    buffer with bytes other than those written for its key (anything else is a miss);
    a failing disk or index costs misses and failed writes, never an exception from a
    page's trouble; index trouble as such raises :class:`IndexUnavailable`, bad input
    ``ValueError``. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, cfg: TierStoreConfig, target: Target, clock: Callable[[], float] = mod_time.time,
                 observe: bool = False, metrics: Optional[Metrics] = None, page_files: Type[PageFiles] = PageFiles) -> None:
        """``observe``: an operator's tool, joining the store as it is and writing nothing
        on disk; else a serving process (see :class:`Space`). A serving process comes up
        whatever the index or the disk does (full, down, no store yet): it answers misses
        until it can attach, and its housekeeping thread tries again (without that thread,
        each call makes one try that waits for no lock).
        ``metrics``: the caller's (labelled by rank), else the store's own.
        ``page_files``: the class that moves bytes (tests inject one that fails or waits).
        Housekeeping runs once :meth:`start_housekeeping` is called; until then, passes
        are the caller's (``store.space.housekeeping.run_once()``)."""
        self.cfg = cfg
        self.clock = clock
        self.index = open_index(cfg, target, clock)
        self.io = IOEngine(cfg.io_threads)
        self.metrics = metrics if metrics is not None else Metrics()
        self.log = RateLimitedLog(logger, cfg.log_interval_s)
        if _native.pageio is None and not observe:
            self.log.warning("no_c_helper", "tierstore runs without its C helper (sglang_tierstore._pageio: not built, "
                             "or xxhash's xxh3 functions not found): pages move from Python, taking the GIL from SGLang's "
                             "threads once per I/O and per page hashed (reinstall where a C compiler is found)")
        self.space = Space(cfg, self.index, modes(cfg.file_access), secrets.token_hex(6), self.metrics, self.log, clock,
                           observe, page_files)
        try:
            if not observe:  # an observer attaches on first use, and hears why it cannot
                self.space.attach()
        except NoStoreYet:
            pass  # created with the first namespace
        except StoreUnavailable as e:
            self.metrics.error(e.kind)
            self.log.warning("attach", "cannot attach the store at start (%s): answering misses until it can", e)
        except BaseException:  # a store that cannot start holds no threads or connections
            self.io.close()
            self.index.close()
            raise

    def start_housekeeping(self, on_index_down: Optional[Callable[[], None]] = None) -> None:
        """Run the space's housekeeping every ``housekeeping_s`` in a daemon thread
        (stopped by :meth:`close`); ``on_index_down`` is called when a pass finds the
        index unreachable."""
        self.space.housekeeping.start(on_index_down)

    def __enter__(self) -> "TierStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- namespaces ---------------------------------------------------------------

    def namespace(self, fields: Mapping[str, object], page_bytes: int) -> Namespace:
        """The namespace of pages with these compatibility ``fields`` (model, dtype,
        layout, ranks...) and size; recorded in the index for operators. ValueError for a
        size that is not positive.

        Pages larger than the regions of the store already there are no config error of
        this process (another's pages cut the store): they are never stored (outcome
        ``too_big``), with one log line naming the ways out (:meth:`Space.expect`), and
        every other namespace works."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        ns_id, desc = fingerprint({**fields, "page_bytes": page_bytes, "namespace": self.cfg.namespace})
        ns = Namespace(ns_id.hex(), ns_id, page_bytes, desc)
        self.space.expect(ns.ns, page_bytes, desc)
        try:
            self.space.attach()  # (a store is created once its pages are known)
        except StoreUnavailable:
            pass  # housekeeping attaches
        return ns

    def namespaces(self) -> dict[str, tuple[int, str]]:
        """Every namespace the store has seen: id -> (page bytes, the fingerprint's description)."""
        return self.space.attach().namespaces()

    # -- probe --------------------------------------------------------------------

    def exists(self, groups: Sequence[tuple[Namespace, Sequence[str]]]) -> list[list[bool]]:
        """Whether each key of each (namespace, keys) group has a committed page: one
        round trip (one HMGET per shard) for every group. A forged entry shows here as
        present and costs a miss at the read, never a wrong page."""
        a = self.space.attached()
        fields = [f for ns, keys in groups for f in entry_fields(ns.ns_id, keys)]
        found = a.lookup(fields)
        out, i = [], 0
        for _, keys in groups:
            out.append([v is not None for v in found[i : i + len(keys)]])
            i += len(keys)
        return out

    # -- runs ---------------------------------------------------------------------

    def _runs(self, pages: list[Place], page_bytes: int, iov_per_page: int) -> list[Run]:
        """Pages in adjacent slots of one file, as runs for one preadv/pwritev each,
        cut so that a batch spreads over the I/O threads."""
        pages.sort(key=lambda p: (p.file.number, p.offset))
        slot = round_up(page_bytes)
        coalesce = slot == page_bytes
        total = len(pages) * page_bytes
        target = max(page_bytes, min(MAX_RUN_BYTES, total // self.io.threads))
        longest = max(1, min(IOV_MAX // max(1, iov_per_page), target // page_bytes)) if coalesce else 1
        runs: list[Run] = []
        for p in pages:
            last = runs[-1] if runs else None
            if last is not None and len(last) < longest and last[-1].file == p.file and last[-1].offset + slot == p.offset:
                last.append(p)
            else:
                runs.append([p])
        return runs

    # -- read ---------------------------------------------------------------------

    def read(self, ns: Namespace, keys: Sequence[str], dests: Sequence[Regions], aligned: bool) -> list[bool]:
        """Read the leading run of keys present into ``dests`` (one buffer, as regions,
        per key; ``aligned``: every region is 4 KiB aligned, so O_DIRECT may be used).

        True per page whose bytes verified (its entry's tag, then its checksum); a
        buffer whose page is a miss may have been written to. An entry that fails
        verification is dropped, once the file read is shown to be the one the index
        names. Costs one HMGET round trip, then the runs of adjacent slots in parallel
        preadvs straight into ``dests``; with ``read_timeout_s``, runs go through the I/O
        threads' staging memory and those not read in time are misses. Returns only once
        no preadv of this call can land in ``dests`` any more."""
        self._check_sizes(ns, keys, dests)
        t0 = mod_time.perf_counter()
        a = self.space.attached()
        g = a.geometry
        fields = entry_fields(ns.ns_id, keys)
        raws = a.lookup(fields)
        lead = next((i for i, v in enumerate(raws) if v is None), len(raws))
        results = [False] * len(keys)
        entries: dict[int, Entry] = {}
        bad: list[tuple[bytes, bytes]] = []
        per_region = slots_per_region(g.region_bytes, ns.page_bytes)
        for i in range(lead):
            raw = raws[i]
            assert raw is not None
            e = unpack_entry(raw) if len(raw) == ENTRY.size else None
            if e is None or e.slot >= per_region:
                bad.append((fields[i], raw))  # not an entry this store can have written
                self.metrics.error("corrupt")
                continue
            if not a.verified(fields[i], raw):
                bad.append((fields[i], raw))
                self.metrics.error("forged")
                self.log.warning("forged", "entry of page %s has a tag this store did not make (written or moved in "
                                 "the index by someone else, or the store's entry key changed): dropped", fields[i].hex())
                continue
            entries[i] = e
        at = g.places([(e.region, e.slot) for e in entries.values()], ns.page_bytes)
        refs = a.refs({f for f, _ in at})
        pages = [Place(i, refs[f], off) for i, (f, off) in zip(entries, at) if f in refs]
        runs = self._runs(pages, ns.page_bytes, len(dests[0]) if dests else 1)
        read_runs = self._read_staged if self.cfg.read_timeout_s else self._read_direct
        for k, o in read_runs(a, runs, dests, ns.page_bytes, aligned).items():
            run = runs[k]
            if isinstance(o, BaseException):
                a.io_failed("io_read", run[0].file.number, o)
                continue
            for p, sum_read in zip(run, o):
                if sum_read == entries[p.pos].checksum or self._reread(a, p, dests[p.pos], entries[p.pos], ns.page_bytes):
                    results[p.pos] = True
                elif a.current(p.file.number):
                    raw = raws[p.pos]
                    assert raw is not None
                    bad.append((fields[p.pos], raw))
                    self.metrics.error("corrupt")
                    self.log.warning("corrupt", "page %s failed verification (stale, torn or rotten slot): dropped",
                                     fields[p.pos].hex())
        hits = sum(results)
        self.metrics.pages("read", "hit", hits)
        self.metrics.pages("read", "miss", len(keys) - hits)
        self.metrics.bytes("read", hits * ns.page_bytes)
        a.touch({entries[i].region for i in range(lead) if results[i]})
        if bad:
            self._drop(a, bad)
        self.metrics.observe("read", mod_time.perf_counter() - t0)
        return results

    def _reread(self, a: Attachment, p: Place, dest: Regions, e: Entry, page_bytes: int) -> bool:
        """On a shared filesystem, a page that failed its checksum is read again past this
        node's page cache (another node may have rewritten the slot since this node cached
        it); True, with ``dest`` filled, if it verifies now. Not with ``read_timeout_s``: this
        read runs in the caller's thread, which the deadline bounds."""
        if not a.shared or self.cfg.read_timeout_s:
            return False
        try:
            raw = a.read_uncached(p.file, p.offset, page_bytes)
        except PageIOError:
            return False
        if len(raw) != page_bytes or checksum([memoryview(raw)]) != e.checksum:
            return False
        _scatter(memoryview(raw), [dest])
        self.metrics.error("stale_cache")
        return True

    def _read_direct(self, a: Attachment, runs: list[Run], dests: Sequence[Regions], page_bytes: int,
                     aligned: bool) -> dict[int, Outcome[Moved]]:
        """Run position -> outcome of each run read straight into ``dests``: the
        checksums of its pages (hashed by the thread that read them), or the error it met.
        Returns once every run is done, or, when interrupted, once none is in flight any
        more (starting no more): none lands in ``dests`` after ``read``."""
        ops = [Transfer(READ, run[0].file, run[0].offset, [m for p in run for m in dests[p.pos]], len(run) * page_bytes,
                        aligned, [page_bytes] * len(run)) for run in runs]
        with self.io.submit(a.transfer, ops, _run_bytes(runs, page_bytes)) as batch:
            return batch.wait()

    def _read_staged(self, a: Attachment, runs: list[Run], dests: Sequence[Regions], page_bytes: int,
                     aligned: bool) -> dict[int, Outcome[Moved]]:
        """Like :meth:`_read_direct`, but only the runs done within ``read_timeout_s``.

        A preadv cannot be cancelled, so runs are read into the I/O threads' staging
        memory and copied into ``dests`` through a gate that this shuts before it
        returns: runs not done by the deadline are left out (misses), those not
        started never start, and a preadv that returns later fills staging memory
        only, never ``dests`` (host memory SGLang may have reused by then).
        """
        timeout = self.cfg.read_timeout_s
        gate = Gate()

        def read_run(run: Run) -> list[int]:
            n = len(run) * page_bytes
            buf = self.io.staging.buffer(n)
            [sums] = a.transfer([Transfer(READ, run[0].file, run[0].offset, [buf], n, aligned, [page_bytes] * len(run))])
            if isinstance(sums, Exception):
                raise sums
            if gate.enter():  # else given up: the bytes stay in this thread's staging buffer, and nobody
                try:  # waits for this outcome any more
                    _scatter(buf, [dests[p.pos] for p in run])
                finally:
                    gate.leave()
            return sums

        batch = self.io.submit(each(read_run), runs, _run_bytes(runs, page_bytes), inline=False)
        try:
            done = batch.wait(mod_time.monotonic() + timeout)
        finally:
            batch.cancel()
            gate.close()
        late = sum(map(len, runs)) - sum(len(runs[k]) for k in done)
        if late:
            self.metrics.error("io_read_timeout", late)
            self.log.warning("io_read_timeout", "%d page(s) not read within read_timeout_s=%g s (a stalled disk, I/O "
                             "threads still stuck on one, or a queue of other batches' I/O ahead): misses, kept", late, timeout)
        return done

    def _drop(self, a: Attachment, entries: Sequence[tuple[bytes, bytes]]) -> int:
        """Drop pages a read found bad; index trouble only postpones it."""
        try:
            return a.drop(entries)
        except StoreDetached as e:
            self.space.detach(e, a)
        except IndexUnavailable as e:  # the pages were misses all the same; the next read drops them
            self.log.warning("index", "dropping %d bad page(s) failed: %s", len(entries), e)
        return 0

    # -- write --------------------------------------------------------------------

    def write(self, ns: Namespace, keys: Sequence[str], srcs: Sequence[Regions], aligned: bool) -> list[bool]:
        """Store each page (``srcs``: one buffer, as regions, per key); True per page now
        stored, by this call or earlier (a key keeps the bytes first stored for it). Pages
        larger than the store's regions are not stored (outcome ``too_big``), asking the index nothing.

        Costs one ``commit`` round trip once this thread holds a stock of leased slots
        (a second call first when it does not), and the pages' pwritevs in parallel,
        coalesced over adjacent slots, each run hashed by an I/O thread (the one that wrote
        it, or for a page cut into pieces, an item of its own). Nothing is
        published before its pwritev returned. With ``write_timeout_s`` (> 0) the batch
        waits for the disk that long at most: pages not written by then are not stored (nor
        are the others of an I/O thread's claim still running then), and their slots are
        given up (dead until their region is reclaimed, which a late
        pwritev can only turn into a checksum miss, never another key's page). A writer
        stalled past ``lease_s`` while no housekeeping renews its lease (its process's is
        stuck on the same disk, or the process is frozen) loses it: its slots stay dead
        and its commit stores nothing. Index trouble raises :class:`IndexUnavailable`:
        the pages may not be stored (or, when the commit's reply was lost, may be)."""
        self._check_sizes(ns, keys, srcs)
        if not keys:
            return []
        t0 = mod_time.perf_counter()
        outcomes: CounterT[str] = Counter()  # one per page: stored, exists, or why not
        try:
            try:
                a = self.space.attached()
            except StoreUnavailable:
                outcomes["not_attached"] += len(keys)
                raise
            if not a.geometry.holds(ns.page_bytes):  # said once when registered (Space.expect): no index call
                outcomes["too_big"] += len(keys)
                return [False] * len(keys)
            try:
                results = self._write(a, ns, keys, srcs, aligned, outcomes)
            except StoreDetached as e:
                self.space.detach(e, a)
                results = [False] * len(keys)
                outcomes["detached"] += len(keys) - sum(outcomes.values())
        except BaseException:
            outcomes["raised"] += len(keys) - sum(outcomes.values())  # the index down or refusing, no store yet
            raise
        finally:
            for outcome, n in outcomes.items():
                self.metrics.pages("write", outcome, n)
        self.metrics.observe("write", mod_time.perf_counter() - t0)
        return results

    def _write(self, a: Attachment, ns: Namespace, keys: Sequence[str], srcs: Sequence[Regions], aligned: bool,
               outcomes: CounterT[str]) -> list[bool]:
        pb = ns.page_bytes
        fields = entry_fields(ns.ns_id, keys)
        with Reservation(a, pb, fields, outcomes) as res:
            runs = self._runs(list(res.places), pb, len(srcs[0]))
            units: list[Run] = []  # the run each op writes (a piece of) or hashes
            ops: list[Transfer] = []
            for run in runs:
                bufs = [m for p in run for m in srcs[p.pos]]  # hashed from the buffers written: they do not
                spans = [pb] * len(run)  # change during the call
                pieces = _pieces(bufs, MAX_RUN_BYTES)
                if len(pieces) == 1:
                    run_ops = [Transfer(WRITE, run[0].file, run[0].offset, bufs, len(run) * pb, aligned, spans)]
                else:  # a page cut into pieces is hashed by an op of its own, so that a read waits for at most
                    run_ops = [Transfer(WRITE, run[0].file, run[0].offset + off, piece, sum(map(len, piece)), aligned, [])
                               for off, piece in pieces]  # one piece or one hash per thread
                    run_ops.append(Transfer(HASH, None, 0, bufs, len(run) * pb, aligned, spans))
                ops += run_ops
                units += [run] * len(run_ops)

            timeout = self.cfg.write_timeout_s
            deadline = mod_time.monotonic() + timeout if timeout else None
            batch = self.io.submit(a.transfer, ops, len(res.places) * pb // max(1, len(ops)), inline=not timeout,
                                   write=True)
            try:
                finished = batch.wait(deadline)
            except BaseException:  # pieces not started never start; running ones are waited for until the deadline
                if not batch.settle(deadline):
                    _give_up(res)  # some still run: their slots must not go back into a stock
                raise
            batch.settle(deadline)  # (past it, pieces still running land in slots given up below)
            failed: set[int] = set()
            sums: dict[int, int] = {}  # page position -> its checksum, from the item that hashed its run
            late = 0
            for k, run in enumerate(units):
                o = finished.get(k, _LATE)
                if o is _LATE:
                    late += len(run) * (run[0].pos not in failed)
                elif isinstance(o, BaseException) and run[0].pos not in failed:
                    a.io_failed("io_write", run[0].file.number, o)  # once per run, however many pieces failed
                elif isinstance(o, list):
                    sums.update(zip((p.pos for p in run), o))
                if o is _LATE or isinstance(o, BaseException):
                    failed.update(p.pos for p in run)
            outcomes["io_timeout"] += late
            outcomes["io_error"] += len(failed) - late
            if late:
                self.metrics.error("io_write_timeout", late)
                self.log.warning("io_write_timeout", "%d page(s) not written within write_timeout_s=%g s (a stalled disk, "
                                 "or I/O threads stuck on one): not stored", late, timeout)
            written = [p.pos for p in res.places if p.pos not in failed]
            slots = res.slots
            tails = dict(zip(written, a.tails([fields[i] for i in written],
                                                   [(slots[i].region, slots[i].gen, slots[i].slot, sums[i]) for i in written])))
            status = res.commit(written, tails, self.cfg.fsync == "commit")
        stored = sum(1 for s in status.values() if s == STORED)
        outcomes["stored"] += stored
        outcomes["exists"] += sum(1 for s in status.values() if s == EXISTS)
        self.metrics.bytes("write", stored * pb)
        return [status.get(i) in (STORED, EXISTS) for i in range(len(keys))]

    # -- dropping pages -------------------------------------------------------------

    def clear(self, namespaces: Sequence[Namespace]) -> int:
        """Drop every page of these namespaces; returns how many. Streams the entries
        (HSCAN, bounded steps): O(pages) Redis work."""
        return self.space.attach().clear(x.ns_id for x in namespaces)  # (an operator's: SGLang's clear endpoint)

    def delete(self, ns: Namespace, keys: Sequence[str]) -> int:
        """Drop these pages (their slots are dead until their region is reclaimed);
        returns how many were stored."""
        return self.space.attached().drop([(f, b"") for f in entry_fields(ns.ns_id, keys)])

    # -- helpers ------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """This process's counts (pages by operation and outcome, errors by kind,
        housekeeping by action)."""
        return self.metrics.snapshot()

    def _check_sizes(self, ns: Namespace, keys: Sequence[str], bufs: Sequence[Regions]) -> None:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} page buffers")
        pb = ns.page_bytes
        if all(sum(map(len, regions)) == pb for regions in bufs):
            return
        for k, regions in zip(keys, bufs):
            n = sum(map(len, regions))
            if n != ns.page_bytes:
                raise ValueError(f"page buffer for key {k!r} has {n} bytes, namespace pages have {ns.page_bytes}")

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop housekeeping, send the last recency updates, give the leases back, close
        the page files, stop the I/O threads and disconnect from Redis; later calls raise
        :class:`StoreClosed`. Idempotent.

        Whatever a call still running uses is released when it is done with it: a page
        file's descriptors after its last I/O, a mid-batch writer's lease when it expires.
        Housekeeping and the I/O threads are waited for at most ``timeout`` s in all
        (None: housekeeping 5 s, the I/O threads as long as they take); a thread stuck on
        a disk that stopped answering exits once its call returns. True if everything
        was released now."""
        deadline = None if timeout is None else mod_time.monotonic() + timeout

        def left() -> Optional[float]:
            return None if deadline is None else max(0.0, deadline - mod_time.monotonic())

        released = self.space.close(left())
        stopped = self.io.close(left())
        self.index.close()
        return released and stopped
