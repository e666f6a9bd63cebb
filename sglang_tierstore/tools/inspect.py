"""Operator queries and ``check(fix=False)``: what the index says, and whether it agrees
with itself and with the page files. For tools (the CLI, the exporter, tests), never
the hot path.

``check``: every slot of every region must be in exactly one state: beyond ``fill``
(free), in one writer's lease, holding a committed page (its member field names an entry
that points back at it), or dead (none of those; reclaimed with the region). Every
region is in exactly one state, matching the one set that holds it: in use (``lru``),
free (``free``), draining (``drain``: leaving, waiting for leased slots), or a hole
(``holes``, or ``punch`` while its space is still to be punched out). Checked in both
directions: region -> members -> entries, and entry -> region -> member; every entry's
tag must be valid for its field (:mod:`sglang_tierstore.tags`). The shard's counters
must match the sets, allocation (less draining regions) must be within capacity, every
ready page file in our directories must be the file the index names, and no page file
may sit in them that the index does not know. With ``verify_pages`` every committed
page is read and its checksum compared. With ``fix``, entries that fail are dropped and
members whose entry is not theirs stop counting as pages.

Cost, and why live traffic does not notice: the store is streamed in HSCAN steps of
``chunk`` regions or entries, and each step is read in read-only function calls bounded
by work, whatever the page size: a call reads at most ``CHECK_SLOTS`` (1,024) member
slots and the entries they name, and copies at most ``CHECK_BYTES`` (1 MiB) of member
blobs, or one region's blob where that is larger (a 64 MiB region of 4 KiB pages has
16,384 slots, a 512 KiB blob: read in 16 calls; a 1 GiB region of 4 KiB pages, an 8 MiB
blob copied by each of its 256 calls). Each call is atomic; a region read over several calls counts as one snapshot
only if its record (generation, fill, live and leased counts) is the same in all of
them, and is read again (up to ``REREADS`` times, then left for the next check) if not,
so a check is consistent however traffic moves between calls. In all: O(regions +
entries) Redis work in about ``slots / CHECK_SLOTS + entries / chunk`` short calls,
plus one ``pread`` per committed page with ``verify_pages``. A checksum mismatch is
reported only if the entry still holds the value that was read after the page was (a
page evicted meanwhile is not a problem).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from sglang_tierstore.config import Target, TierStoreConfig, describe_target
from sglang_tierstore.embedded import ensure_embedded_redis, join_embedded_redis, socket_path
from sglang_tierstore.errors import IndexUnavailable, NoStore, PageIOError, TierStoreError
from sglang_tierstore.index.admin import wait_loaded
from sglang_tierstore.pagefile import FileRef, checksum
from sglang_tierstore.schema import (
    DRAINING,
    ENTRY,
    FIELD_BYTES,
    FREE,
    HOLE,
    READY,
    REGION,
    USED,
    LeaseRange,
    entry_field,
    parse_ranges,
    unpack_entry,
    unpack_region,
)
from sglang_tierstore.perms import modes
import sglang_tierstore.space.orphans as orphans
from sglang_tierstore.space.attachment import Attachment
from sglang_tierstore.space.geometry import Geometry, slots_per_region
from sglang_tierstore.store import Namespace, TierStore

ZERO = b"\0" * FIELD_BYTES
# check()'s bound on each call's work (snapshot_regions, snapshot_entries): member slots
# read (with the entries they name), bytes of member blobs copied
CHECK_SLOTS = 1024
CHECK_BYTES = 1 << 20
REREADS = 3  # a region that changes while read in parts is read again this often
LOAD_WAIT_S = 60.0  # how long a tool that started the embedded index waits for it to load its AOF
COUNTS = ("capacity_regions", "allocated_regions", "regions", "used_regions", "free_regions", "hole_regions",
          "punch_regions", "draining_regions", "leases", "files", "next_file", "pinned_regions")


# -- queries --------------------------------------------------------------------------


def counts(store: TierStore, a: Attachment, shard: int) -> dict[str, int]:
    """A shard's region, lease and file counts (``COUNTS``), as its conf and sets say."""
    out = store.index.call("counts", a.shard_keys(shard), [a.geometry.store_id])
    return dict(zip(COUNTS, (int(x) for x in out)))


def usage(store: TierStore) -> dict[str, int]:
    """Regions and capacity over every shard (``COUNTS``), bytes and pages."""
    a = store.space.attached()
    g = a.geometry
    total: dict[str, int] = {}
    for s in range(g.shards):
        for k, v in counts(store, a, s).items():
            total[k] = total.get(k, 0) + v
    total["region_bytes"] = g.region_bytes
    total["allocated_bytes"] = total["allocated_regions"] * g.region_bytes
    total["capacity_bytes"] = total["capacity_regions"] * g.region_bytes
    total["pages"] = sum(store.index.hlen(a.key(s, "entries")) for s in range(g.shards))
    return total


def _scan(store: TierStore, key: str, chunk: int, match: Optional[bytes] = None) -> Iterator[dict[bytes, bytes]]:
    """A hash in HSCAN steps (bounded work per call)."""
    cursor = 0
    while True:
        cursor, got = store.index.hscan(key, cursor, chunk, match)
        if got:
            yield got
        if cursor == 0:
            return


def page_sizes(store: TierStore) -> dict[int, dict[str, int]]:
    """Regions in use and their slots (live, leased, dead), by page size: each size's
    share of the store. Streams the region records."""
    a = store.space.attached()
    out: dict[int, dict[str, int]] = {}
    for s in range(a.geometry.shards):
        for chunk in _scan(store, a.key(s, "regions"), 1000):
            for raw in chunk.values():
                reg = unpack_region(raw)
                if reg.state == USED:
                    d = out.setdefault(reg.page_bytes, {"regions": 0, "live": 0, "leased": 0, "dead": 0})
                    d["regions"] += 1
                    d["live"] += reg.live
                    d["leased"] += reg.leased
                    d["dead"] += reg.fill - reg.live - reg.leased
    return out


def pages_by_namespace(store: TierStore) -> dict[str, int]:
    """Committed pages per namespace id. Streams the entries: O(pages) Redis work."""
    a = store.space.attached()
    out: dict[str, int] = {}
    for s in range(a.geometry.shards):
        for chunk in _scan(store, a.key(s, "entries"), 1000):
            for f in chunk:
                ns = f[:8].hex()
                out[ns] = out.get(ns, 0) + 1
    return out


def where(store: TierStore, ns: Namespace, key: str) -> Optional[tuple[str, int, int]]:
    """(page file path, byte offset, region) of a committed page, or None."""
    a = store.space.attached()
    raw = a.lookup([entry_field(ns.ns_id, key)])[0]
    if raw is None:
        return None
    e = unpack_entry(raw)
    file_no, offset = a.geometry.place(e.region, e.slot, ns.page_bytes)
    ref = a.files.ref(file_no)
    if ref is None or ref.dir_id not in a.pages.dirs:
        return None
    return a.pages.path(ref.number, ref.dir_id), offset, e.region


def index_facts(store: TierStore) -> dict[str, Any]:
    """What the index says of the whole store (no process's own counts): usage, page sizes,
    Redis memory (None where INFO is refused, as the ACL of ``index.acl.acl_rule`` does),
    and the store directories beside it that no store in the index claims (their number,
    disk bytes and paths: :mod:`sglang_tierstore.space.orphans`)."""
    used = usage(store)
    lost = orphans.find(store.index, store.cfg.redis_prefix, store.cfg.path)
    sizes = page_sizes(store)
    try:
        memory: Optional[int] = store.index.memory_used()
    except IndexUnavailable:
        raise
    except TierStoreError:
        memory = None
    return {
        "usage": used,
        "used_bytes": sum(pb * d["live"] for pb, d in sizes.items()),
        "leased_slots": sum(d["leased"] for d in sizes.values()),
        "page_sizes": [{"page_bytes": pb, **d} for pb, d in sorted(sizes.items())],
        "index_memory_bytes": memory,
        "orphans": {"dirs": len(lost), "bytes": sum(o.disk_bytes for o in lost), "paths": [o.path for o in lost]},
    }



# -- joining a store as an operator's tool ---------------------------------------------


@dataclass
class Opened:
    """A store joined for an operator's command, and how its index was reached."""

    store: TierStore
    store_id: str
    url: Target  # a URL with the password: show only ``describe_target(url)``
    embedded: bool

    def close(self) -> None:
        self.store.close()


def _check_paths(cfg: TierStoreConfig) -> None:
    """Every directory of ``path`` is there: NoStore if none is (nothing was ever stored), an
    error if some are missing (a device not mounted: attaching would create an empty directory
    in its place) or cannot be entered."""
    missing = [p for p in cfg.path if not os.path.lexists(p)]
    if len(missing) == len(cfg.path):
        raise NoStore(f"no store: {', '.join(cfg.path)} does not exist (config key 'path')")
    if missing:
        raise TierStoreError(f"directory {', '.join(missing)} of config key 'path' does not exist (not mounted?)")
    for p in cfg.path:
        if not os.path.isdir(p) or not os.access(p, os.R_OK | os.X_OK):
            raise TierStoreError(f"config key 'path': {p} is not a directory this user can read")


def index_url(cfg: TierStoreConfig, start_redis: bool) -> tuple[Target, bool]:
    """(Where the index is, whether it is the embedded Redis). The embedded one is joined
    only if running, or started with ``start_redis``."""
    if cfg.index_target is not None:
        return cfg.index_target, False
    path = cfg.path[0]
    if start_redis:
        url = ensure_embedded_redis(path, modes(cfg.file_access), cfg.redis_server).url
        wait_loaded(url, LOAD_WAIT_S)  # what it holds, not LOADING
        return url, True
    url = join_embedded_redis(path)
    if url is None:
        raise TierStoreError(f"the embedded Redis of {path} is not running (socket {socket_path(path)}); "
                             "start it with `tierstore redis start`, or pass --start-redis")
    return url, True


def open_store(cfg: TierStoreConfig, start_redis: bool) -> Opened:
    """Join the store ``cfg`` names, as it is (``TierStore(observe=True)``: nothing is
    written on disk, and its config's capacity is not applied), as any user that can read
    it; NoStore if there is none, TierStoreError if its directories or index cannot be
    reached. Starts no Redis unless ``start_redis``."""
    _check_paths(cfg)
    url, embedded = index_url(cfg, start_redis)
    try:
        store = TierStore(cfg, url, observe=True)
        try:
            store_id = store.space.attached().geometry.store_id
        except BaseException:
            store.close()
            raise
    except IndexUnavailable as e:
        raise IndexUnavailable(f"cannot reach the index at {describe_target(url)}: {e}") from None
    return Opened(store, store_id, url, embedded)


# -- check ----------------------------------------------------------------------------


def check(store: TierStore, fix: bool = False, verify_pages: bool = True, chunk: int = 256) -> list[str]:
    """Problems found (empty if none), as they were before any fix."""
    a = store.space.attached()
    ns_pages = {bytes.fromhex(k): pb for k, (pb, _) in store.namespaces().items()}
    problems: list[str] = []
    for shard in range(a.geometry.shards):
        before = counts(store, a, shard)
        problems += _counts(shard, before)
        found, pinned = _regions(store, a, shard, chunk, fix)
        problems += found
        after = counts(store, a, shard)["pinned_regions"]
        if pinned is not None and before["pinned_regions"] == after >= 0 and pinned != after:  # steady across the scan
            problems.append(f"shard {shard}: {after} regions counted with leased slots, {pinned} have them")
        problems += _entries(store, a, shard, chunk, ns_pages, verify_pages, fix)
    problems += _files(a)
    return problems


def _counts(shard: int, c: dict[str, int]) -> list[str]:
    out = []
    states = c["used_regions"] + c["free_regions"] + c["hole_regions"] + c["punch_regions"] + c["draining_regions"]
    if c["regions"] != states:
        out.append(f"shard {shard}: {c['regions']} regions but {states} in use, free, draining or holes")
    allocated = c["used_regions"] + c["free_regions"] + c["draining_regions"]
    if c["allocated_regions"] != allocated:
        out.append(f"shard {shard}: {c['allocated_regions']} regions counted allocated, {allocated} are")
    if c["allocated_regions"] - c["draining_regions"] > c["capacity_regions"]:
        out.append(f"shard {shard}: {c['allocated_regions']} regions allocated ({c['draining_regions']} draining), "
                   f"capacity is {c['capacity_regions']}")
    return out


def _leased(lease_table: dict[bytes, bytes]) -> dict[int, list[tuple[bytes, LeaseRange]]]:
    """region -> [(lease, range)] of a lease table."""
    out: dict[int, list[tuple[bytes, LeaseRange]]] = {}
    for lease, spec in lease_table.items():
        for rg in parse_ranges(spec):
            out.setdefault(rg.region, []).append((lease, rg))
    return out


def _regions(store: TierStore, a: Attachment, shard: int, chunk: int, fix: bool) -> tuple[list[str], Optional[int]]:
    """Problems of a shard's regions, and how many regions hold leased slots (None if
    some region changed too often to be read: busy, left for the next check)."""
    pinned = 0
    out: list[str] = []
    dangling: list[tuple[int, int, bytes]] = []
    seen: set[int] = set()  # HSCAN may return a region twice
    busy: list[int] = []
    for got in _scan(store, a.key(shard, "regions"), chunk):
        ids = sorted(int(r) for r in got if int(r) not in seen)
        seen.update(ids)
        for view, leased in _region_views(store, a, shard, ids, busy):
            out += _region_problems(a.geometry, view, leased.get(view[0], []), dangling)
            pinned += len(view[1]) == REGION.size and unpack_region(view[1]).leased > 0
    if fix and dangling:
        unlink_members(store, a, shard, sorted(set(dangling)))
    return out, None if busy else pinned


def _region_views(store: TierStore, a: Attachment, shard: int, ids: list[int], busy: list[int]
                  ) -> Iterator[tuple[tuple[Any, ...], dict[int, list[tuple[bytes, LeaseRange]]]]]:
    """Each region's snapshot, with the lease table of the call that finished it, read in
    calls bounded by CHECK_SLOTS and CHECK_BYTES. A region read over several calls is one
    snapshot only if its record stayed the same throughout (any change to its slots
    changes its counters or generation): one that changed is read again, up to REREADS
    times, then left for the next check (appended to ``busy``)."""
    keys = a.shard_keys(shard)
    todo = [(r, 0) for r in ids]
    parts: dict[int, list[list[Any]]] = {}
    tries: dict[int, int] = {}
    while todo:
        snap = store.index.call("snapshot_regions", keys, [a.geometry.store_id, CHECK_SLOTS, CHECK_BYTES,
                                                           *(x for r_first in todo for x in r_first)])
        pos, answered = 1, int(snap[0])
        finished: list[int] = []
        resume: list[tuple[int, int]] = []
        for _ in range(answered):
            r, stop, total, n = int(snap[pos]), int(snap[pos + 2]), int(snap[pos + 3]), int(snap[pos + 12])
            parts.setdefault(r, []).append(snap[pos + 4 : pos + 12] + [snap[pos + 13 : pos + 13 + n]])
            pos += 13 + n
            (finished.append(r) if stop >= total else resume.append((r, stop)))
        flat = snap[pos + 1 : pos + 1 + 2 * int(snap[pos])]
        leased = _leased(dict(zip(flat[::2], flat[1::2])))
        todo = resume + todo[answered:]
        for r in finished:
            got = parts.pop(r)
            rec = got[0][0]
            if any(p[0] != rec for p in got):  # it changed between calls
                tries[r] = tries.get(r, 0) + 1
                if tries[r] <= REREADS:
                    todo.insert(0, (r, 0))
                else:
                    busy.append(r)
                continue
            last = got[-1]
            sets = (bool(last[2]), *(bool(int(x)) for x in last[3:7]))  # in lru, free, holes, punch, drain
            yield (r, rec, b"".join(p[1] for p in got), last[2], sets, last[7], [v for p in got for v in p[8]]), leased


def unlink_members(store: TierStore, a: Attachment, shard: int, members: list[tuple[int, int, bytes]]) -> int:
    """Stop counting members (region, slot, field) whose entry is not theirs; how many."""
    return int(store.index.call("unlink_members", a.shard_keys(shard),
                                [a.geometry.store_id, *(x for m in members for x in m)]))


def _region_problems(g: Geometry, view: tuple[Any, ...], ranges: list[tuple[bytes, LeaseRange]],
                     dangling: list[tuple[int, int, bytes]]) -> list[str]:
    """Problems of one region; members whose entry is not theirs go to ``dangling``."""
    r, rec, blob, lru, sets, open_r, values = view
    where = f"region {r}"
    if len(rec) != REGION.size:
        return [f"{where}: unreadable record"]
    reg = unpack_region(rec)
    # in (lru, free, holes, punch, drain): a hole is allocatable once punched
    want = {USED: [(True, False, False, False, False)], FREE: [(False, True, False, False, False)],
            HOLE: [(False, False, True, False, False), (False, False, False, True, False)],
            DRAINING: [(False, False, False, False, True)]}.get(reg.state)
    out = []
    if want is None:
        return [f"{where}: unknown state {reg.state}"]
    if sets not in want:
        out.append(f"{where}: state {reg.state} but in lru/free/holes/punch/drain = {sets}")
    if reg.state == DRAINING:
        if reg.live or blob or not reg.leased or (open_r and int(open_r) == r):
            out.append(f"{where}: draining but holds pages, no leased slot, or takes new ones")
        held = {i for _, (_, s0, c) in ranges for i in range(s0, s0 + c)}
        if len(held) != reg.leased or any(i >= reg.fill for i in held):
            out.append(f"{where}: draining with {reg.leased} slots counted leased, leases hold {len(held)}")
        return out
    if reg.state != USED:
        if reg.fill or reg.live or reg.leased or blob or ranges:
            out.append(f"{where}: not in use but holds slots (fill {reg.fill}, live {reg.live}, leased {reg.leased})")
        return out
    per = slots_per_region(g.region_bytes, reg.page_bytes)
    if reg.fill > per:
        out.append(f"{where}: fill {reg.fill} beyond its {per} slots")
    members = [blob[i : i + FIELD_BYTES] for i in range(0, len(blob), FIELD_BYTES)]
    live = {i: f for i, f in enumerate(members) if f != ZERO}
    if any(i >= reg.fill for i in live):
        out.append(f"{where}: members beyond fill {reg.fill}")
    if len(live) != reg.live:
        out.append(f"{where}: {reg.live} pages counted live, {len(live)} members")
    for (i, f), v in zip(sorted(live.items()), values):
        if len(v) != ENTRY.size:
            out.append(f"{where} slot {i}: member {f.hex()} has no entry")
            dangling.append((r, i, f))
            continue
        e = unpack_entry(v)
        if (e.region, e.gen, e.slot) != (r, reg.gen, i):
            out.append(f"{where} slot {i}: member {f.hex()} points elsewhere ({e.region}/{e.gen}/{e.slot})")
            dangling.append((r, i, f))
    slots: set[int] = set()
    for lease, (_, s, c) in ranges:
        span = set(range(s, s + c))
        if s < 0 or s + c > reg.fill:
            out.append(f"{where}: lease {lease.decode()} holds slots {s}..{s + c - 1} beyond fill {reg.fill}")
        if span & slots or span & set(live):
            out.append(f"{where}: slots {s}..{s + c - 1} of lease {lease.decode()} are also leased or live")
        slots |= span
    if len(slots) != reg.leased:
        out.append(f"{where}: {reg.leased} slots counted leased, leases hold {len(slots)}")
    if reg.fill - reg.live - reg.leased < 0:
        out.append(f"{where}: fill {reg.fill} < live {reg.live} + leased {reg.leased}")
    if not reg.live and not reg.leased and (not open_r or int(open_r) != r):
        out.append(f"{where}: holds nothing and takes no pages, yet is not free")
    return out


def _entries(store: TierStore, a: Attachment, shard: int, chunk: int, ns_pages: dict[bytes, int],
             verify_pages: bool, fix: bool) -> list[str]:
    g = a.geometry
    keys = a.shard_keys(shard)
    out: list[str] = []
    for got in _scan(store, a.key(shard, "entries"), chunk):
        bad: list[tuple[bytes, bytes]] = []
        by_region = sorted(got, key=lambda f: got[f][:4])  # calls then copy each region's member blob once
        for f, (value, rec, member) in _entry_views(store, keys, g.store_id, by_region):
            why = _entry_problem(g, f, value, rec, member, ns_pages)
            if why is None and value and not a.tags.valid(f, value):
                why = "its tag is not valid for it (forged or moved in the index, or the store's entry key changed)"
            if why is None and verify_pages and value:
                why = _verify_page(store, a, shard, f, value, ns_pages[f[:8]])
            if why:
                out.append(f"entry {f.hex()}: {why}")
                bad.append((f, value))
        if fix and bad:
            a.drop(bad, shard)  # where it was found, even if it does not belong there
    return out


def _entry_views(store: TierStore, keys: list[str], store_id: str, fields: list[bytes]
                 ) -> Iterator[tuple[bytes, tuple[bytes, bytes, bytes]]]:
    """(field, (value, its region's record, the member at its slot)) of each field, read
    in calls that look up at most CHECK_SLOTS entries and copy at most CHECK_BYTES of
    member blobs."""
    while fields:
        snap = store.index.call("snapshot_entries", keys, [store_id, CHECK_BYTES, *fields[:CHECK_SLOTS]])
        k = int(snap[0])
        for i, f in enumerate(fields[:k]):
            yield f, tuple(snap[1 + 3 * i : 4 + 3 * i])  # type: ignore[misc]
        fields = fields[k:]


def _entry_problem(g: Geometry, f: bytes, value: bytes, rec: bytes, member: bytes, ns_pages: dict[bytes, int]) -> Optional[str]:
    if not value:
        return None  # dropped since the scan saw it
    if len(value) != ENTRY.size:
        return "unparsable entry"
    e = unpack_entry(value)
    if len(rec) != REGION.size:
        return f"names region {e.region}, which does not exist"
    reg = unpack_region(rec)
    if reg.state != USED or reg.gen != e.gen:
        return f"names region {e.region} generation {e.gen}, which now is state {reg.state} generation {reg.gen}"
    if e.slot >= reg.fill or member != f:
        return f"slot {e.slot} of region {e.region} does not name it"
    pb = ns_pages.get(f[:8])
    if pb is None:
        return f"namespace {f[:8].hex()} is unknown"
    if pb != reg.page_bytes:
        return f"namespace pages have {pb} bytes, region {e.region} holds {reg.page_bytes}-byte pages"
    return None


def _verify_page(store: TierStore, a: Attachment, shard: int, f: bytes, value: bytes, page_bytes: int) -> Optional[str]:
    e = unpack_entry(value)
    file_no, offset = a.geometry.place(e.region, e.slot, page_bytes)
    ref = a.files.ref(file_no)
    if ref is not None and ref.dir_id not in a.pages.dirs:
        return None  # in a directory this process does not have: another process verifies it
    data = bytearray(page_bytes)
    try:
        if ref is None:
            raise PageIOError(2, f"page file {file_no} is not ready in the index")
        a.pages.read(ref, offset, [memoryview(data)], page_bytes, False)
    except PageIOError as err:
        why = f"unreadable: {err}"
    else:
        if checksum([memoryview(data)]) == e.checksum:
            return None
        why = "checksum mismatch"
    again = store.index.call("snapshot_entries", a.shard_keys(shard), [a.geometry.store_id, CHECK_BYTES, f])[1]
    return why if again == value else None


def _files(a: Attachment) -> list[str]:
    out = []
    on_disk = a.pages.on_disk()  # before the records: a file is recorded before it is created
    records = {f: rec for s in range(a.geometry.shards) for f, rec in a.files.records(s).items()}
    for f, where in on_disk.items():
        for dir_id, path in where:
            rec = records.get(f)
            if rec is None or rec.dir_id != dir_id:
                out.append(f"page file {path} is not in the index")
    for f, rec in records.items():
        if rec.state == READY and rec.dir_id in a.pages.dirs:
            try:
                a.pages.ensure_open(FileRef(f, rec.dir_id, rec.uid))
                a.pages.still_there(f)
            except PageIOError as e:
                out.append(f"page file {f}: {e}")
    return out
