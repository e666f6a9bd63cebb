"""The store: keys to verified page bytes, over the Redis index and page files.

Owns namespaces, the write protocol and verification; knows nothing of SGLang.

- probe: one MGET of entry keys.
- read: one MGET, then a parallel preadv of each page straight into the caller's
  buffers; a page is a hit only if its bytes hash to the committed checksum (hashed
  by the caller's thread as pages arrive). Anything else is a miss and the entry is
  dropped (conditionally: only if it still holds what was read). Only the leading
  run of present keys is read, as SGLang uses no more.
- write: RESERVE (slots pending, never evicted) -> parallel pwritev, the caller's
  thread hashing the pages meanwhile -> FINISH (commit with the checksums, or free /
  quarantine the slot). A crash before FINISH leaves only a pending slot,
  reclaimed when its lease expires; nothing is visible.

Index trouble raises :class:`IndexUnavailable`; per-page I/O trouble is a miss
or a failed write, counted and logged here.
"""

from __future__ import annotations

import logging
import threading
import time as mod_time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import xxhash

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import PageIOError, TierStoreError
from sglang_tierstore.index import EXISTS, FULL, RedisIndex, entry_fields, format_entry
from sglang_tierstore.io_engine import IOEngine
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import PageFiles, SlotClass, checksum, round_up

logger = logging.getLogger(__name__)

Regions = Sequence[memoryview]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Pages that are byte-compatible: same fingerprint, same page size."""

    ns: str
    page_bytes: int
    cls: SlotClass
    description: str


def _fields(raw: Optional[bytes]) -> Optional[tuple[int, int, int, int]]:
    """An index value's fields, or None if it does not parse (read as a corrupt page)."""
    try:
        return entry_fields(raw) if raw is not None else None
    except ValueError:
        return None


def fingerprint(fields: Mapping[str, object]) -> tuple[str, str]:
    """(short id, readable description) of everything that makes pages compatible."""
    desc = ",".join(f"{k}={fields[k]}" for k in sorted(fields))
    return xxhash.xxh3_64_hexdigest(desc.encode()), desc


class TierStore:
    """Verified page store over one Redis index and one set of page files."""

    def __init__(self, cfg: TierStoreConfig, redis_url: str, clock: Callable[[], float] = mod_time.time) -> None:
        self.cfg = cfg
        self.index = RedisIndex(redis_url, cfg.redis_prefix, cfg.redis_timeout_s, cfg.redis_retry_s, clock)
        self.files = PageFiles(cfg.path, cfg.o_direct, cfg.fsync == "commit")
        self.io = IOEngine(cfg.io_threads)
        self.metrics = Metrics()
        self.log = RateLimitedLog(logger, cfg.log_interval_s)
        self._classes: dict[int, SlotClass] = {}
        self._touch: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    # -- namespaces ---------------------------------------------------------------

    def namespace(self, fields: Mapping[str, object], page_bytes: int) -> Namespace:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        ns, desc = fingerprint({**fields, "page_bytes": page_bytes, "namespace": self.cfg.namespace})
        return Namespace(ns, page_bytes, self._slot_class(page_bytes), desc)

    def _slot_class(self, page_bytes: int, refresh: bool = False) -> SlotClass:
        """The class for a page size; its file geometry is whatever Redis recorded first."""
        with self._lock:
            cls = self._classes.get(page_bytes)
        if cls is not None and not refresh:
            return cls
        cls = SlotClass(page_bytes, max(1, self.cfg.file_bytes // round_up(page_bytes)))
        try:
            cls = SlotClass(page_bytes, self.index.slots_per_file(cls) or cls.slots_per_file)
        except TierStoreError:
            pass  # Redis down: RESERVE re-checks the geometry before any write
        with self._lock:
            self._classes[page_bytes] = cls
        return cls

    def known_classes(self) -> list[SlotClass]:
        with self._lock:
            return list(self._classes.values())

    # -- probe --------------------------------------------------------------------

    def exists(self, groups: Sequence[tuple[Namespace, Sequence[str]]]) -> list[list[bool]]:
        """Presence of each key of each (namespace, keys) group, in one MGET."""
        ekeys = [self.index.entry_key(ns.ns, k) for ns, keys in groups for k in keys]
        found = self.index.lookup(ekeys)
        out, i = [], 0
        for _, keys in groups:
            out.append([v is not None for v in found[i : i + len(keys)]])
            i += len(keys)
        return out

    # -- read ---------------------------------------------------------------------

    def read(self, ns: Namespace, keys: Sequence[str], dests: Sequence[Regions], aligned: bool) -> list[bool]:
        """Read the leading run of present keys into ``dests``; True per verified page."""
        self._check_sizes(ns, keys, dests)
        t0 = mod_time.perf_counter()
        ekeys = [self.index.entry_key(ns.ns, k) for k in keys]
        raws = self.index.lookup(ekeys)
        lead = next((i for i, v in enumerate(raws) if v is None), len(raws))
        # (key position, entry fields or None if unparsable), in slot order: each I/O
        # thread then reads a run of ascending offsets, sequential where slots are adjacent
        jobs = sorted(((i, _fields(raws[i])) for i in range(lead)), key=lambda j: j[1][1] if j[1] else -1)

        cls, nbytes = ns.cls, ns.page_bytes

        def read_one(job: tuple[int, Optional[tuple[int, int, int, int]]]) -> bool:
            """Read a page; False if the entry names no slot of this class."""
            i, fields = job
            if fields is None or fields[0] != cls.page_bytes:
                return False
            self.files.read_slot(cls, fields[1], dests[i], nbytes, aligned)
            return True

        results = [False] * len(keys)
        bad: list[tuple[str, bytes]] = []
        for k, o in self.io.submit(read_one, jobs, nbytes).as_completed():
            i, fields = jobs[k]
            if o is True and fields is not None and checksum(dests[i]) == fields[3]:
                results[i] = True
                continue
            raw = raws[i]
            assert raw is not None
            bad.append((ekeys[i], raw))
            if isinstance(o, BaseException):
                self._page_error("io_read", o)
            else:
                self.metrics.error("corrupt")
                self.log.warning("corrupt", "page %s failed verification (stale, torn or rotten slot): dropped", ekeys[i])
        hits = sum(results)
        self.metrics.pages("read", "hit", hits)
        self.metrics.pages("read", "miss", len(keys) - hits)
        self.metrics.bytes("read", hits * ns.page_bytes)
        self._queue_touch(ns.cls, [k for k, ok in zip(ekeys, results) if ok])
        if bad:
            self.index.drop(bad)
        self.metrics.observe("read", mod_time.perf_counter() - t0)
        return results

    # -- write --------------------------------------------------------------------

    def write(self, ns: Namespace, keys: Sequence[str], srcs: Sequence[Regions], aligned: bool) -> list[bool]:
        """Store each page; True per page now stored (by this call or earlier)."""
        self._check_sizes(ns, keys, srcs)
        if not keys:
            return []
        t0 = mod_time.perf_counter()
        ekeys = [self.index.entry_key(ns.ns, k) for k in keys]
        cls = ns.cls
        try:
            gen0, evicted, slots = self.index.reserve(cls, ekeys, self.cfg.lease_s, self.cfg.capacity_bytes)
        except TierStoreError as e:
            if "slots_per_file" not in str(e):
                raise
            cls = self._slot_class(cls.page_bytes, refresh=True)
            gen0, evicted, slots = self.index.reserve(cls, ekeys, self.cfg.lease_s, self.cfg.capacity_bytes)
        self.metrics.housekeeping("evicted", evicted)
        results = [s == EXISTS for s in slots]
        jobs: list[tuple[int, int, int]] = []
        for i, s in enumerate(slots):
            if s >= 0:
                jobs.append((i, s, gen0 + len(jobs)))
        jobs.sort(key=lambda j: j[1])  # ascending offsets per I/O thread, as in read()

        def write_one(job: tuple[int, int, int]) -> None:
            self.files.write_slot(cls, job[1], srcs[job[0]], ns.page_bytes, aligned)

        batch = self.io.submit(write_one, jobs, ns.page_bytes)
        sums = [checksum(srcs[i]) for i, _, _ in jobs]  # while the pages are being written
        ops = []
        for (i, slot, gen), cks, o in zip(jobs, sums, batch.results()):
            if isinstance(o, BaseException):
                self._page_error("io_write", o)
                ops.append((ekeys[i], "q" if isinstance(o, PageIOError) else "f", slot, b""))
            else:
                ops.append((ekeys[i], "c", slot, format_entry(cls.page_bytes, slot, gen, cks)))
        written = 0
        for (i, _, _), op, ok in zip(jobs, ops, self.index.finish(cls, gen0, ops)):
            results[i] = ok
            written += ok and op[1] == "c"
        self.metrics.pages("write", "stored", written)
        self.metrics.pages("write", "exists", slots.count(EXISTS))
        full = slots.count(FULL)
        self.metrics.pages("write", "full", full)
        self.metrics.pages("write", "failed", len(keys) - sum(results))
        self.metrics.bytes("write", written * ns.page_bytes)
        if full:
            self.log.warning("full", "no slot for %d page(s) of %d bytes: capacity in use by other slot classes", full, ns.page_bytes)
        self._queue_touch(cls, [k for k, s in zip(ekeys, slots) if s == EXISTS])
        self.metrics.observe("write", mod_time.perf_counter() - t0)
        return results

    # -- housekeeping -------------------------------------------------------------

    def _queue_touch(self, cls: SlotClass, ekeys: list[str]) -> None:
        if ekeys:
            with self._lock:
                self._touch.setdefault(cls.name, set()).update(ekeys)

    def flush_touches(self) -> None:
        """Send batched recency updates: one ZADD XX per slot class."""
        with self._lock:
            pending, self._touch = self._touch, {}
        for name, keys in pending.items():
            self.index.touch(name, keys)

    def clear(self, namespaces: Sequence[Namespace]) -> int:
        """Drop every page of these namespaces; returns how many."""
        n = 0
        for ns in {x.ns for x in namespaces}:
            keys = self.index.namespace_keys(ns)
            for i in range(0, len(keys), 512):
                n += self.index.drop([(k, b"") for k in keys[i : i + 512]])
        return n

    def check(self, fix: bool = False) -> list[str]:
        """Compare index and page files; with ``fix``, drop what does not verify."""
        problems: list[str] = []
        for page_bytes in self.index.classes():
            cls = self._slot_class(page_bytes, refresh=True)
            u = self.index.usage(cls)
            accounted = u["free"] + u["pending"] + u["pages"] + u["quarantined"]
            if accounted != u["slots"]:
                problems.append(f"class {page_bytes}: {u['slots']} slots allocated but {accounted} accounted for")
            members = [m.decode() for m in self.index.lru_members(cls)]
            raws = self.index.lookup(members)
            bad = []
            for ekey, raw in zip(members, raws):
                why = "no entry" if raw is None else self._verify_slot(cls, _fields(raw))
                if why:
                    problems.append(f"{ekey}: {why}")
                    bad.append((ekey, raw or b""))
            if fix:
                self.index.drop(bad)
        return problems

    def _verify_slot(self, cls: SlotClass, fields: Optional[tuple[int, int, int, int]]) -> Optional[str]:
        if fields is None:
            return "unparsable entry"
        page_bytes, slot, _, cks = fields
        if page_bytes != cls.page_bytes:
            return f"entry names class {page_bytes}"
        data = bytearray(page_bytes)
        try:
            self.files.read_slot(cls, slot, [memoryview(data)], page_bytes, False)
        except PageIOError as err:
            return f"unreadable: {err}"
        return None if checksum([memoryview(data)]) == cks else "checksum mismatch"

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.metrics.snapshot())
        try:
            out["classes"] = {c.name: self.index.usage(c) for c in self.known_classes()}
        except TierStoreError:
            pass
        return out

    # -- helpers ------------------------------------------------------------------

    def _check_sizes(self, ns: Namespace, keys: Sequence[str], bufs: Sequence[Regions]) -> None:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} page buffers")
        for k, regions in zip(keys, bufs):
            if sum(map(len, regions)) != ns.page_bytes:
                n = sum(map(len, regions))
                raise ValueError(f"page buffer for key {k!r} has {n} bytes, namespace pages have {ns.page_bytes}")

    def _page_error(self, kind: str, e: BaseException) -> None:
        self.metrics.error(kind)
        self.log.warning(kind, "%s: %s", kind, e)

    def close(self) -> None:
        try:
            self.flush_touches()
        except TierStoreError:
            pass
        self.io.close()
        self.files.close()
        self.index.close()
