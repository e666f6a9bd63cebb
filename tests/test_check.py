"""check() finds every corruption of the index and the page files it claims to look for.

One store in a known state (a full region A, a region B holding 4 pages and 12 slots
leased to the writer's stock, holes), then one corruption per case, written straight
into Redis or onto disk, and the problem check() must name. Over plain bytes.
"""

from __future__ import annotations

import os
import re
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import redis
from tierstore_kit.engine import flip_byte, keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import engine, pages, views

from sglang_tierstore import TierStore
from sglang_tierstore.tools import inspect
from sglang_tierstore.schema import (
    DRAINING,
    ENTRY,
    FIELD_BYTES,
    HOLE,
    REGION,
    USED,
    entry_fields,
    meta_key,
    ns_value,
    parse_ranges,
    shard_of,
    unpack_entry,
    unpack_region,
)
from sglang_tierstore.store import Namespace

PAGE = 4096
SLOTS = 16  # a 1 MiB store has 64 KiB regions


@dataclass
class Store:
    st: TierStore
    r: redis.Redis
    ns: Namespace
    fields: list[bytes]  # the 20 pages written, in slot order
    a: int  # region holding pages 0..15 (full)
    b: int  # region holding pages 16..19, the rest of it leased
    hole: int  # a region that is a hole

    def key(self, name: str) -> str:
        return self.st.space.attached().key(0, name)

    def region(self, r: int) -> list[int]:
        return list(unpack_region(self.r.hget(self.key("regions"), r)))

    def set_region(self, r: int, **fields: int) -> None:
        rec = self.region(r)
        for name, v in fields.items():
            rec[("page_bytes", "gen", "fill", "live", "leased", "state").index(name)] = v
        self.r.hset(self.key("regions"), r, REGION.pack(*rec))

    def entry(self, i: int) -> bytes:
        raw = self.r.hget(self.key("entries"), self.fields[i])
        assert raw is not None
        return raw

    def lease(self) -> tuple[bytes, str]:
        ((lease, ranges),) = self.r.hgetall(self.key("leases")).items()
        return lease, ranges.decode()

    def page_file(self, n: int) -> str:
        where = inspect.where(self.st, self.ns, keys(20)[n])
        assert where is not None
        return where[0]


@pytest.fixture
def store(tmp_path: Path, redis_proc: RedisProc) -> Any:
    cfg = {"path": str(tmp_path / "s"), "redis_url": redis_proc.url, "redis_prefix": "chk-" + uuid.uuid4().hex[:8],
           "capacity_gb": 1 / 1024, "io_threads": 2, "o_direct": False}
    st = engine(cfg)
    ns = st.namespace({"m": 1}, PAGE)
    assert st.write(ns, keys(20), views(pages(20, PAGE, 1)), False) == [True] * 20
    r = redis.Redis.from_url(redis_proc.url)
    regions = [unpack_entry(v).region for v in r.hmget(st.space.attached().key(0, "entries"), entry_fields(ns.ns_id, keys(20)))]
    a, b = regions[0], regions[-1]
    assert regions == [a] * 16 + [b] * 4 and a != b
    holes = [int(x) for x in r.zrange(st.space.attached().key(0, "holes"), 0, -1)]
    s = Store(st, r, ns, entry_fields(ns.ns_id, keys(20)), a, b, holes[0])
    assert s.region(b)[2:5] == [SLOTS, 4, 12]  # fill, live, leased: B is full, the stock (16) goes on in another
    assert inspect.check(st) == []
    yield s
    r.close()
    st.close()


def _zero_member(s: Store, r: int, slot: int) -> None:
    blob = s.r.hget(s.key("members"), r)
    s.r.hset(s.key("members"), r, blob[: slot * FIELD_BYTES] + b"\0" * FIELD_BYTES + blob[(slot + 1) * FIELD_BYTES :])


def _entry_at_slot(s: Store, i: int, slot: int) -> None:
    raw = bytearray(s.entry(i))
    struct.pack_into("<I", raw, 8, slot)
    s.r.hset(s.key("entries"), s.fields[i], bytes(raw))


def _drain(s: Store, r: int, **fields: int) -> None:
    """Region r as a draining region would be (no pages, in the drain set), then ``fields``."""
    s.r.hdel(s.key("members"), r)
    s.r.hdel(s.key("entries"), *s.fields[16:])
    s.r.zrem(s.key("lru"), r)
    s.r.hdel(s.key("open"), PAGE)
    s.r.zadd(s.key("drain"), {str(r): 1})
    s.set_region(r, live=0, state=DRAINING, **fields)


def _stray_file(s: Store) -> None:
    d = os.path.dirname(s.page_file(0))
    with open(os.path.join(d, "f000099.pages"), "wb") as f:
        f.write(b"\0" * 4096)


def _bad_header(s: Store) -> None:
    path = s.page_file(0)
    s.st.space.attached().pages.forget(int(os.path.basename(path)[1:7]))
    with open(path, "r+b") as f:
        f.write(b'{"magic": "someone else"}')


# (what is corrupted, how, the problem check() must report)
CASES: dict[str, tuple[Callable[[Store], None], str]] = {
    # the shard's counters against its sets
    "a region record in no set": (lambda s: s.r.hset(s.key("regions"), 999, REGION.pack(0, 0, 0, 0, 0, HOLE)),
                                  r"regions but \d+ in use, free, draining or holes"),
    "the allocation counter": (lambda s: s.r.hincrby(s.key("conf"), "alloc", 1), r"regions counted allocated, \d+ are"),
    "allocation beyond capacity": (lambda s: s.r.hset(s.key("conf"), "cap", 1), r"regions allocated \(0 draining\), capacity is 1"),
    # a region's record and the one set that holds it
    "an unreadable region record": (lambda s: s.r.hset(s.key("regions"), s.a, b"xx"), r"region A: unreadable record"),
    "an unknown region state": (lambda s: s.set_region(s.a, state=9), r"region A: unknown state 9"),
    "a region in two sets": (lambda s: s.r.zadd(s.key("free"), {str(s.a): 1}),
                             r"region A: state 2 but in lru/free/holes/punch/drain = \(True, True, False, False, False\)"),
    "a region in the wrong set": (lambda s: (s.r.zrem(s.key("holes"), s.hole), s.r.zadd(s.key("lru"), {str(s.hole): 1})),
                                  r"region HOLE: state 0 but in lru/free/holes/punch/drain = \(True, False, False, False, False\)"),
    "a draining region holding pages": (lambda s: (s.set_region(s.b, state=DRAINING), s.r.zrem(s.key("lru"), s.b),
                                                   s.r.zadd(s.key("drain"), {str(s.b): 1})),
                                        r"region B: draining but holds pages"),
    "a draining region's leased counter": (lambda s: _drain(s, s.b, leased=5),
                                           r"region B: draining with 5 slots counted leased, leases hold 12"),
    "a hole holding slots": (lambda s: s.set_region(s.hole, fill=3), r"region HOLE: not in use but holds slots \(fill 3"),
    # slots of a region in use: each in exactly one state
    "fill beyond the region's slots": (lambda s: s.set_region(s.a, fill=SLOTS + 1), rf"region A: fill {SLOTS + 1} beyond its {SLOTS} slots"),
    "members beyond fill": (lambda s: s.set_region(s.b, fill=2, leased=0), r"region B: members beyond fill 2"),
    "the live counter": (lambda s: s.set_region(s.a, live=15), rf"region A: 15 pages counted live, {SLOTS} members"),
    "a member without an entry": (lambda s: s.r.hdel(s.key("entries"), s.fields[3]), r"region A slot 3: member [0-9a-f]+ has no entry"),
    "a member whose entry names another slot": (lambda s: _entry_at_slot(s, 3, 5), r"region A slot 3: member [0-9a-f]+ points elsewhere \(A/\d+/5\)"),
    "a lease beyond fill": (lambda s: s.r.hset(s.key("leases"), s.lease()[0], f"{s.b}:4:40"), r"region B: lease \S+ holds slots 4\.\.43 beyond fill 16"),
    "a slot both leased and live": (lambda s: s.r.hset(s.key("leases"), s.lease()[0], s.lease()[1] + f",{s.a}:0:1"),
                                    r"region A: slots 0\.\.0 of lease \S+ are also leased or live"),
    "the leased counter": (lambda s: s.set_region(s.b, leased=11), r"region B: 11 slots counted leased, leases hold 12"),
    "fill below live and leased": (lambda s: s.set_region(s.b, fill=15), r"region B: fill 15 < live 4 \+ leased 12"),
    "a region in use holding nothing": (lambda s: (s.set_region(s.hole, state=USED, page_bytes=PAGE), s.r.zrem(s.key("holes"), s.hole),
                                                   s.r.zadd(s.key("lru"), {str(s.hole): 1})),
                                        r"region HOLE: holds nothing and takes no pages, yet is not free"),
    # entries, the other way round
    "an unparsable entry": (lambda s: s.r.hset(s.key("entries"), s.fields[0], b"junk"), r"entry [0-9a-f]+: unparsable entry"),
    "an entry naming no region": (lambda s: s.r.hset(s.key("entries"), s.fields[0], struct.pack("<I", 999) + s.entry(0)[4:]),
                                  r"entry [0-9a-f]+: names region 999, which does not exist"),
    "an entry of another generation": (lambda s: s.set_region(s.a, gen=s.region(s.a)[1] + 1),
                                       r"entry [0-9a-f]+: names region A generation \d+, which now is state 2 generation \d+"),
    "an entry without a member": (lambda s: _zero_member(s, s.a, 3), r"entry [0-9a-f]+: slot 3 of region A does not name it"),
    "an unknown namespace": (lambda s: s.r.hdel(meta_key(s.st.space.attached().tag, "ns"), s.ns.ns),
                             r"entry [0-9a-f]+: namespace [0-9a-f]+ is unknown"),
    "a namespace of another page size": (lambda s: s.r.hset(meta_key(s.st.space.attached().tag, "ns"), s.ns.ns, ns_value(8192, "x")),
                                         r"namespace pages have 8192 bytes, region A holds 4096-byte pages"),
    "an entry's tag": (lambda s: s.r.hset(s.key("entries"), s.fields[0], s.entry(0)[:-1] + bytes([s.entry(0)[-1] ^ 1])),
                       r"entry [0-9a-f]+: its tag is not valid for it"),
    # pages and page files
    "a page's bytes": (lambda s: flip_byte(*_where(s, 2)), r"entry [0-9a-f]+: checksum mismatch"),
    "a page file the index does not know": (_stray_file, r"page file \S+f000099\.pages is not in the index"),
    "a page file replaced": (_bad_header, r"page file \d+: .* is not page file \d+"),
}


def _where(s: Store, i: int) -> tuple[str, int]:
    where = inspect.where(s.st, s.ns, keys(20)[i])
    assert where is not None
    return where[0], where[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_finds_each_corruption(store: Store, case: str) -> None:
    corrupt, want = CASES[case]
    pattern = want.replace("region A", f"region {store.a}").replace("region B", f"region {store.b}")
    pattern = pattern.replace("region HOLE", f"region {store.hole}").replace("(A/", f"({store.a}/")
    corrupt(store)
    problems = inspect.check(store.st)
    assert any(re.search(pattern, p) for p in problems), (pattern, problems)


def test_an_entry_value_is_what_check_reads() -> None:
    """The cases above build entries by hand: ENTRY's layout is (region, gen, slot, ...)."""
    raw = ENTRY.pack(7, 8, 9, 10, b"t" * 16)
    assert struct.unpack_from("<I", raw, 8)[0] == 9 and unpack_entry(raw)[:3] == (7, 8, 9)
    assert parse_ranges(b"3:4:5,6:0:1") == [(3, 4, 5), (6, 0, 1)]


def test_check_fix_drops_a_misplaced_entry_where_it_found_it(tmp_path: Path, redis_proc: RedisProc) -> None:
    """An entry copied into another shard's hash (where its field does not belong): check
    reports it there, and fix drops that copy, never the real entry in the field's own shard."""
    cfg = {"path": str(tmp_path / "s"), "redis_url": redis_proc.url, "redis_prefix": "chk-" + uuid.uuid4().hex[:8],
           "capacity_gb": 1 / 1024, "io_threads": 2, "index_shards": 2}
    st = engine(cfg)
    r = redis.Redis.from_url(redis_proc.url)
    try:
        ns = st.namespace({"m": 1}, PAGE)
        src = pages(8, PAGE, 2)
        assert st.write(ns, keys(8), views(src), False) == [True] * 8
        a = st.space.attached()
        field = entry_fields(ns.ns_id, keys(8))[0]
        home = shard_of(field, 2)
        value = r.hget(a.key(home, "entries"), field)
        r.hset(a.key(1 - home, "entries"), field, value)  # the same entry, in the other shard's hash
        assert any(f"entry {field.hex()}" in p for p in inspect.check(st, fix=True))
        assert inspect.check(st) == []
        assert r.hget(a.key(home, "entries"), field) == value and r.hget(a.key(1 - home, "entries"), field) is None
        assert st.read(ns, keys(8)[:1], views([bytearray(PAGE)]), False) == [True]
    finally:
        r.close()
        st.close()


@pytest.mark.parametrize("rereads", [3, 0])
def test_a_check_of_a_large_store_of_small_pages_is_bounded_per_call(tmp_path: Path, redis_proc: RedisProc,
                                                                     rereads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 MiB regions of 4 KiB pages (16,384 slots, a 512 KiB member blob each): every
    function call of a check reads at most CHECK_SLOTS slots and copies at most
    CHECK_BYTES of member blobs (a call reading one region whole did 16x that), while the
    check still finds one corrupted entry among 20,000 pages, and a region changing
    between the calls that read it is read again (or, out of rereads, left for the next
    check: busy, not a problem, and the count of regions with leased slots not compared)."""
    monkeypatch.setattr(inspect, "REREADS", rereads)
    cfg = {"path": str(tmp_path / "big"), "redis_url": redis_proc.url, "redis_prefix": "big-" + uuid.uuid4().hex[:8],
           "capacity_gb": 1, "io_threads": 2}
    st = engine(cfg)
    try:
        ns = st.namespace({"m": "big"}, PAGE)
        n = 20_000
        ks = keys(n, "big")
        data = pages(500, PAGE, 7)
        for i in range(0, n, 500):
            assert all(st.write(ns, ks[i : i + 500], views(data), False))
        a = st.space.attached()
        assert a.geometry.region_bytes == 64 << 20

        calls: list[tuple[str, list[Any], list[Any]]] = []
        changed: list[int] = []
        real = st.index.call

        def recording(name: str, keys_: list[str], args: list[Any]) -> Any:
            reply = real(name, keys_, args)
            calls.append((name, args, reply))
            if name == "snapshot_regions" and not changed and int(reply[0]) and int(reply[2]) > 0 \
                    and int(reply[4]) < 16_384:  # the open region is being read in parts: it changes meanwhile
                changed.append(int(reply[1]))
                assert st.write(ns, keys(1, "meanwhile"), views(pages(1, PAGE, 8)), False) == [True]
            return reply

        r = redis.Redis.from_url(redis_proc.url)
        victim = entry_fields(ns.ns_id, [ks[12_345]])[0]
        value = bytearray(r.hget(a.key(0, "entries"), victim))
        value[-1] ^= 1  # its tag no longer matches
        r.hset(a.key(0, "entries"), victim, bytes(value))
        st.index.call = recording  # type: ignore[method-assign]
        problems = inspect.check(st, verify_pages=False)
        st.index.call = real  # type: ignore[method-assign]
        assert len(problems) == 1 and victim.hex() in problems[0], problems

        regions = [c for c in calls if c[0] == "snapshot_regions"]
        assert len(regions) >= n // inspect.CHECK_SLOTS
        starts: dict[int, int] = {}
        for _, _, reply in regions:
            pos, slots, blobs = 1, 0, 0
            for _ in range(int(reply[0])):
                first, stop, total, n_values = int(reply[pos + 1]), int(reply[pos + 2]), int(reply[pos + 3]), int(reply[pos + 12])
                starts[int(reply[pos])] = starts.get(int(reply[pos]), 0) + (first == 0)
                slots += stop - first
                blobs += total * FIELD_BYTES
                assert n_values <= stop - first
                pos += 13 + n_values
            assert slots <= inspect.CHECK_SLOTS and blobs <= inspect.CHECK_BYTES, (slots, blobs)
        assert changed and starts[changed[0]] == 1 + (rereads > 0)  # the region that changed mid-read read again, whole
        entries = [c for c in calls if c[0] == "snapshot_entries"]
        assert entries and all(int(reply[0]) <= inspect.CHECK_SLOTS for _, _, reply in entries)
        r.close()
    finally:
        st.close()
