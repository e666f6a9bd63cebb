"""``check(fix=False)``: does the index agree with itself and with the page files?

With ``fix``, entries that fail are dropped and members whose entry is not theirs
stop counting as pages.

Every slot of every region must be in exactly one state: beyond ``fill`` (free), in
one writer's lease, holding a committed page (its member field names an entry that
points back at it), or dead (none of those; reclaimed with the region). Every region
is in exactly one state, matching the one set that holds it: in use (``lru``), free
(``free``), draining (``drain``: leaving, waiting for leased slots), or a hole
(``holes``, or ``punch`` while its space is still to be punched out). Checked in
both directions: region -> members -> entries, and entry -> region -> member; every
entry's tag must be valid for its field (:mod:`sglang_tierstore.mac`). The shard's counters must match the sets, allocation (less draining regions) must
be within capacity, every ready page file in our directories must be the file the index names,
and no page file may sit in them that the index does not know. With
``verify_pages`` every committed page is read and its checksum compared.

Cost, and why live traffic does not notice: the store is streamed in chunks: ``chunk``
entries, or as many regions as hold at most ``16 * chunk`` slots. Per chunk: one
HSCAN step, then one read-only script that snapshots those regions (with their
members' entries and the lease table) or those entries (with their regions and
members) atomically, so a chunk is consistent however traffic moves between chunks,
and no call does more than a few thousand field reads. In all: O(regions + entries) Redis work in
``(regions + entries) / chunk`` short calls (a 10 TB store of 256 KiB pages: ~40M
entries, ~160k calls), plus one ``pread`` per committed page with ``verify_pages``.
A checksum mismatch is reported only if the entry still holds the value that was
read after the page was (a page evicted meanwhile is not a problem).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from sglang_tierstore.allocator import slots_per_region
from sglang_tierstore.errors import PageIOError
from sglang_tierstore.pagefile import checksum
from sglang_tierstore.schema import (
    ALIGN,
    DRAINING,
    ENTRY,
    FIELD_BYTES,
    FREE,
    HOLE,
    REGION,
    USED,
    unpack_entry,
    unpack_region,
)

if TYPE_CHECKING:
    from sglang_tierstore.store import TierStore, _Attached

ZERO = b"\0" * FIELD_BYTES


def check(store: "TierStore", fix: bool = False, verify_pages: bool = True, chunk: int = 256) -> list[str]:
    """Problems found (empty if none), as they were before any fix."""
    a = store.attached()
    ns_pages = {bytes.fromhex(k): v for k, v in store.namespaces().items()}
    problems: list[str] = []
    for shard in range(a.att.geometry.shards):
        problems += _counts(a, shard)
        problems += _regions(store, a, shard, chunk, fix)
        problems += _entries(store, a, shard, chunk, ns_pages, verify_pages, fix)
    problems += _files(store, a)
    return problems


def _counts(a: "_Attached", shard: int) -> list[str]:
    c = a.alloc.counts(shard)
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


def _scan(store: "TierStore", key: str, chunk: int) -> Any:
    cursor = 0
    while True:
        cursor, got = store.index.hscan(key, cursor, chunk)
        if got:
            yield got
        if cursor == 0:
            return


def _ranges(lease_table: dict[bytes, bytes]) -> dict[int, list[tuple[bytes, int, int]]]:
    """region -> [(lease, start, count)]"""
    out: dict[int, list[tuple[bytes, int, int]]] = {}
    for lease, spec in lease_table.items():
        for part in spec.split(b","):
            if part:
                r, s, c = (int(x) for x in part.split(b":"))
                out.setdefault(r, []).append((lease, s, c))
    return out


def _regions(store: "TierStore", a: "_Attached", shard: int, chunk: int, fix: bool) -> list[str]:
    g = a.att.geometry
    keys = a.alloc.keys(shard)
    out: list[str] = []
    dangling: list[tuple[int, int, bytes]] = []
    per_call = max(1, chunk * 16 // max(1, g.region_bytes // ALIGN))  # at most chunk * 16 slots per call
    for got in _scan(store, a.alloc.key(shard, "regions"), per_call):
        ids = sorted(int(r) for r in got)
        snap = store.index.script("SNAPSHOT_REGIONS", keys, [g.store_id, *ids])
        pos = 0
        views = []
        for r in ids:
            rec, blob, lru, in_free, in_holes, in_punch, in_drain, open_r, n = snap[pos : pos + 9]
            values = snap[pos + 9 : pos + 9 + int(n)]
            pos += 9 + int(n)
            views.append((r, rec, blob, lru, (bool(lru), bool(in_free), bool(in_holes), bool(in_punch), bool(in_drain)),
                          open_r, values))
        nleases = int(snap[pos])
        flat = snap[pos + 1 : pos + 1 + 2 * nleases]
        leased = _ranges(dict(zip(flat[::2], flat[1::2])))
        for view in views:
            out += _region_problems(g, view, leased.get(view[0], []), dangling)
    if fix:
        a.alloc.unlink_members(shard, sorted(set(dangling)))  # HSCAN may return a region twice
    return out


def _region_problems(g: Any, view: tuple[Any, ...], ranges: list[tuple[bytes, int, int]],
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
        held = {i for _, s0, c in ranges for i in range(s0, s0 + c)}
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
    for lease, s, c in ranges:
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


def _entries(store: "TierStore", a: "_Attached", shard: int, chunk: int, ns_pages: dict[bytes, int],
             verify_pages: bool, fix: bool) -> list[str]:
    g = a.att.geometry
    keys = a.alloc.keys(shard)
    out: list[str] = []
    for got in _scan(store, a.alloc.key(shard, "entries"), chunk):
        fields = list(got)
        snap = store.index.script("SNAPSHOT_ENTRIES", keys, [g.store_id, *fields])
        bad: list[tuple[bytes, bytes]] = []
        for k, f in enumerate(fields):
            value, rec, member = snap[3 * k : 3 * k + 3]
            why = _entry_problem(g, f, value, rec, member, ns_pages)
            if why is None and value and not a.tags.valid(f, value):
                why = "its tag is not valid for it (forged or moved in the index, or the store's entry key changed)"
            if why is None and verify_pages and value:
                why = _verify_page(store, a, shard, f, value, ns_pages[f[:8]])
            if why:
                out.append(f"entry {f.hex()}: {why}")
                bad.append((f, value))
        if fix and bad:
            a.alloc.drop(shard, bad)
    return out


def _entry_problem(g: Any, f: bytes, value: bytes, rec: bytes, member: bytes, ns_pages: dict[bytes, int]) -> Optional[str]:
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


def _verify_page(store: "TierStore", a: "_Attached", shard: int, f: bytes, value: bytes, page_bytes: int) -> Optional[str]:
    g = a.att.geometry
    e = unpack_entry(value)
    rec = store.record(g.file_of(e.region))
    if rec is not None and rec.dir_id not in a.files.dirs:
        return None  # in a directory this process does not have: another process verifies it
    data = bytearray(page_bytes)
    try:
        a.files.read(g.file_of(e.region), g.slot_offset(e.region, e.slot, page_bytes), [memoryview(data)], page_bytes, False)
    except PageIOError as err:
        why = f"unreadable: {err}"
    else:
        if checksum([memoryview(data)]) == e.checksum:
            return None
        why = "checksum mismatch"
    again = store.index.script("SNAPSHOT_ENTRIES", a.alloc.keys(shard), [g.store_id, f])[0]
    return why if again == value else None


def _files(store: "TierStore", a: "_Attached") -> list[str]:
    out = []
    on_disk = a.files.on_disk()  # before the records: a file is recorded before it is created
    records: dict[int, tuple[str, str, str]] = {}
    for s in range(a.att.geometry.shards):
        records.update(a.alloc.files(s))
    for f, where in on_disk.items():
        for dir_id, path in where:
            rec = records.get(f)
            if rec is None or rec[0] != dir_id:
                out.append(f"page file {path} is not in the index")
    for f, (dir_id, _, state) in records.items():
        if state == "r" and dir_id in a.files.dirs:
            try:
                a.files.ensure_open(f)
                a.files.still_there(f)
            except PageIOError as e:
                out.append(f"page file {f}: {e}")
    return out
