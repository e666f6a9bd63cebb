"""An attachment to a store: what every read and write works against until the store goes
from the index (then :class:`~sglang_tierstore.space.Space` attaches anew).

It owns the store's keys in the index for the layers above: the entries (looked up,
dropped, cleared), the namespaces, recency, and through :mod:`.leases` and :mod:`.files`
the slots and page files; the store above reads and writes pages through it and never
touches an index key, an entry tag or a page file itself.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Type

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import IndexUnavailable
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.metrics import Metrics, RateLimitedLog
from sglang_tierstore.pagefile import FileRef, Moved, PageFiles, Transfer
from sglang_tierstore.perms import Modes
from sglang_tierstore.schema import glob_escape, meta_key, parse_ns_value, shard_key, shards_of
from sglang_tierstore.space.attach import Home
from sglang_tierstore.space.files import Files
from sglang_tierstore.space.geometry import Geometry
from sglang_tierstore.space.leases import Leases, Reply
from sglang_tierstore.tags import EntryTags

LEASE_ROUNDS = 4  # lease calls a reservation may make while it adds page files


class Place(NamedTuple):
    """Where one page of a batch lies: its position in the batch, its file, the byte
    offset there."""

    pos: int
    file: FileRef
    offset: int


def by_shard(fields: Sequence[bytes], shards: int) -> dict[int, list[int]]:
    """Positions of ``fields`` by the shard each belongs to (shards in order)."""
    if shards == 1:
        return {0: list(range(len(fields)))} if fields else {}
    groups: list[list[int]] = [[] for _ in range(shards)]
    for i, s in enumerate(shards_of(fields, shards)):
        groups[s].append(i)
    return {s: g for s, g in enumerate(groups) if g}


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

    # -- the entries and the namespaces: read and changed here only ----------------------

    def lookup(self, fields: Sequence[bytes]) -> list[Optional[bytes]]:
        """Entry values of fields (any shards): one round trip (one HMGET per shard). A shard
        whose node is down answers misses (counted) while the others answer; IndexUnavailable
        when every shard failed."""
        shards = self.geometry.shards
        if shards == 1:
            return self.index.hmget([(self.key(0, "entries"), fields)])[0]
        parts = by_shard(fields, shards)
        got = self.index.hmget_each([(self.key(s, "entries"), [fields[i] for i in idx]) for s, idx in parts.items()])
        errors = [v for v in got if isinstance(v, Exception)]
        if errors and (len(errors) == len(got) or any(not isinstance(e, IndexUnavailable) for e in errors)):
            raise errors[0]
        out: list[Optional[bytes]] = [None] * len(fields)
        for s, idx, vals in zip(parts, parts.values(), got):
            if isinstance(vals, IndexUnavailable):  # that shard's node is down: its pages are misses, the rest answer
                self.shard_failed(s, vals)
                continue
            for i, v in zip(idx, vals):
                out[i] = v
        return out

    def clear(self, ns_ids: Iterable[bytes]) -> int:
        """Drop every page of these namespaces; returns how many. Streams the entries
        (HSCAN, bounded steps): O(pages) Redis work."""
        n = 0
        for ns_id in set(ns_ids):
            pattern = glob_escape(ns_id) + b"*"
            for s in range(self.geometry.shards):
                key, cursor = self.key(s, "entries"), 0
                while True:
                    cursor, chunk = self.index.hscan(key, cursor, 1000, match=pattern)
                    n += self.drop([(f, b"") for f in chunk if f.startswith(ns_id)])
                    if cursor == 0:
                        break
        return n

    def register(self, namespaces: Mapping[str, str]) -> None:
        """Record namespaces (id -> ``schema.ns_value``) for operators: one HSET."""
        if namespaces:
            self.index.hset(meta_key(self.tag, "ns"), namespaces)

    def namespaces(self) -> dict[str, tuple[int, str]]:
        """Every namespace the store has seen: id -> (page bytes, the fingerprint's description)."""
        return {k.decode(): parse_ns_value(v) for k, v in self.index.hgetall(meta_key(self.tag, "ns")).items()}

    # -- what a read or a write of the store uses of the parts below -------------------

    def verified(self, field: bytes, raw: bytes) -> bool:
        """Whether an entry's tag is this store's for this field (:mod:`sglang_tierstore.tags`)."""
        return self.tags.valid(field, raw)

    def tails(self, fields: Sequence[bytes], slots: Sequence[tuple[int, int, int, int]]) -> list[bytes]:
        """The entry tails (tags) for pages written at (region, generation, slot, checksum)."""
        return self.tags.tails(fields, slots)

    def refs(self, files: Iterable[int]) -> dict[int, FileRef]:
        """The refs of those of these page files that are ready."""
        return self.files.refs(files)

    def current(self, file_no: int) -> bool:
        """Whether the page file read is still the one the index names (so a bad page in it is the entry's fault)."""
        return self.files.current(file_no)

    def io_failed(self, kind: str, file_no: int, e: BaseException) -> None:
        """An I/O on a page file failed: counted, and a file found gone is acted on."""
        self.files.failure(kind, file_no, e)

    @property
    def shared(self) -> bool:
        """Whether the page files are on a filesystem other nodes write too."""
        return self.pages.shared

    def transfer(self, ops: Sequence[Transfer], stop: Sequence[bytearray] = ()) -> list[Moved]:
        """Move a claim of runs (:meth:`.pagefile.PageFiles.transfer`), for the I/O engine."""
        return self.pages.transfer(ops, stop)

    def read_uncached(self, ref: FileRef, offset: int, nbytes: int) -> bytes:
        """A range read past this node's page cache (a shared filesystem's page read again)."""
        return self.pages.read_uncached(ref, offset, nbytes)

    def close(self) -> int:
        """Send the last recency updates, give idle leases back and close the page files;
        the number of leases kept (a writer mid-batch: they expire)."""
        try:
            self.flush_touches()
            return self.leases.release_all()
        finally:
            self.close_files()

    def close_files(self) -> None:
        """Close the page files (a detached store's: its leases went with it)."""
        self.files.close()
        self.pages.close()
