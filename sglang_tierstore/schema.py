"""Key names and value formats of the index: the one definition, for Python and for Lua.

A store is ``(redis_prefix, store id)``; the id lives in the index and in a marker in
each of the store's directories (:mod:`sglang_tierstore.space.attach`). Its keys, with
``T = <prefix>:<store id>``::

    {T}:meta          hash   geometry (format, region bytes, regions per file, shards), capacity, shard tags
    {T}:ns            hash   namespace id (hex) -> NS value: page bytes and readable description
    {T}:dirs          hash   directory id -> JSON {path, host, seen}: who last saw each directory
    {T:s}:conf        hash   shard s: CONF_FIELDS (store id, capacity, allocation, geometry, counters)
    {T:s}:entries     hash   entry field (namespace 8 B + key 24 B) -> ENTRY value
    {T:s}:regions     hash   region id -> REGION record
    {T:s}:members     hash   region id -> the entry field of each slot (FIELD_BYTES per slot)
    {T:s}:lru         zset   region id -> last use (regions holding pages)
    {T:s}:free        zset   region id -> placement order (allocated, empty)
    {T:s}:holes       zset   region id -> placement order (not allocated: no disk space)
    {T:s}:punch       zset   region id -> placement order (not allocated, disk space still to punch out)
    {T:s}:drain       zset   region id -> since (leaving: waits for its leased slots to come back)
    {T:s}:open        hash   page bytes -> the region now being filled for that page size
    {T:s}:leases      hash   lease id -> RANGES: the slots leased to one writer
    {T:s}:deadlines   zset   lease id -> expiry time
    {T:s}:files       hash   file number -> FILE record

Every key a shard's functions touch carries the shard's hash tag ``{T:s}``, and the
functions get them all in KEYS (``shard_keys``), so each call runs on one Redis Cluster
slot. A store created since shards spread over a cluster records each shard's tag in
meta (``shard_tags``: the suffixes after ``T:``, e.g. ``0,1.7,2``), chosen so that shard
``s`` of ``n`` hashes into the ``s``-th of ``n`` equal slot ranges; a store without it
uses ``T:s``. Which shard a page belongs to: :func:`shard_of`.

The Lua library reads and writes the same records: :func:`lua_prelude` generates its
constants and its parsers/formatters from the definitions here.
"""

from __future__ import annotations

import binascii
import hashlib
import re
import struct
from typing import Any, NamedTuple, Sequence

import xxhash

FORMAT = 3  # bump when any stored record below changes; older stores are dropped at attach

FIELD_BYTES = 32  # namespace id (8 bytes) + key (24 bytes)
KEY_BYTES = 24
NS_ID_BYTES = 8

# An entry: where a committed page lives, the xxh3-64 of its bytes and a tag over the
# entry field and all of that under the store's key (:mod:`sglang_tierstore.tags`). Lua
# reads only the head; the writer sends the rest (checksum and tag: a Lua double could
# not hold the checksum) as one TAIL_BYTES string per page.
ENTRY = struct.Struct("<IIIQ16s")  # region, region generation, slot, checksum, tag
ENTRY_HEAD = struct.Struct("<III")
TAG_BYTES = 16
SIGNED_BYTES = ENTRY.size - TAG_BYTES  # what the tag covers, after the entry field
TAIL_BYTES = ENTRY.size - ENTRY_HEAD.size

# A region record. state: HOLE (not allocated: no disk space once punched), FREE
# (allocated, empty), USED (holds or is receiving pages of one size), DRAINING (leaving
# the store while writers still hold some of its slots: no pages, no new leases).
# fill: slots handed out so far (append-only); live: slots holding a committed page;
# leased: slots handed out and not yet committed or given up. Slots below fill that are
# neither are dead until the region is reclaimed as a whole.
REGION_FIELDS = (("page_bytes", 4), ("gen", 4), ("fill", 4), ("live", 4), ("leased", 4), ("state", 1))
REGION = struct.Struct("<" + "".join({4: "I", 1: "B"}[n] for _, n in REGION_FIELDS))
HOLE, FREE, USED, DRAINING = 0, 1, 2, 3

# A page file's record: "dir id|uid|state|since" (since: when its creation began).
FILE_SEP = "|"
CREATING, READY, LOST = "c", "r", "l"

# A lease's slots: "region:start:count,region:start:count,..."
RANGE_SEP, RANGES_SEP = ":", ","

# A namespace's value in {T}:ns: "page_bytes=<n>;<description>"
NS_PAGE_BYTES, NS_SEP = "page_bytes=", ";"

# A shard's conf hash, as a new shard starts it (Lua reads these fields by name).
CONF_FIELDS = ("store", "cap", "alloc", "rb", "rpf", "shards", "next_file", "creating", "pinned")

# What a commit says of each page, and the flags of a lease or commit reply.
NOT_STORED, STORED, EXISTS = 0, 1, 2
NEED_FILE, TOO_BIG = 1, 2

SHARD_KEYS = ("conf", "entries", "regions", "members", "lru", "free", "holes", "open", "leases", "deadlines", "files",
              "punch", "drain")
HEADER_BYTES = 4096  # a page file's header block; region 0 starts right after it
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and slot sizes
STALE = "TSSTALE"  # a function's error for a call against a store the shard no longer holds


class Region(NamedTuple):
    page_bytes: int
    gen: int
    fill: int
    live: int
    leased: int
    state: int


class Entry(NamedTuple):
    region: int
    gen: int
    slot: int
    checksum: int
    tag: bytes


class FileRecord(NamedTuple):
    """A page file as the index records it."""

    dir_id: str
    uid: str
    state: str  # CREATING, READY or LOST
    since: str


class LeaseRange(NamedTuple):
    """Consecutive slots of one region in a lease."""

    region: int
    start: int
    count: int


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def unpack_entry(raw: bytes) -> Entry:
    """Raises ``struct.error`` on a value that is not an entry."""
    return Entry(*ENTRY.unpack(raw))


def unpack_region(raw: bytes) -> Region:
    return Region(*REGION.unpack(raw))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_file_record(raw: Any) -> FileRecord:
    return FileRecord(*_text(raw).split(FILE_SEP, 3))


def parse_ranges(raw: Any) -> list[LeaseRange]:
    return [LeaseRange(*(int(x) for x in part.split(RANGE_SEP))) for part in _text(raw).split(RANGES_SEP) if part]


def ns_value(page_bytes: int, description: str) -> str:
    return f"{NS_PAGE_BYTES}{page_bytes}{NS_SEP}{description}"


def parse_ns_value(raw: Any) -> tuple[int, str]:
    """(page bytes, description) of a namespace's value."""
    head, _, desc = _text(raw).partition(NS_SEP)
    return int(head.removeprefix(NS_PAGE_BYTES)), desc


def key_bytes(key: str) -> bytes:
    """24 bytes naming a page key: the first 192 bits of SGLang's 64-hex SHA-256 chain
    keys, anything else through BLAKE2b-192 (so any string is a valid key). 192 bits keep
    accidental collisions out of reach (birthday bound ~2^96 keys) at 8 bytes less per
    page in the entry and in its region's member list than the whole hash."""
    if len(key) == 64:
        try:
            return _unhex(key[:_KEY_HEX])
        except (binascii.Error, ValueError):
            pass
    return hashlib.blake2b(key.encode(), digest_size=KEY_BYTES).digest()


_unhex = binascii.unhexlify
_KEY_HEX = 2 * KEY_BYTES


def entry_field(ns_id: bytes, key: str) -> bytes:
    return ns_id + key_bytes(key)


def entry_fields(ns_id: bytes, keys: Sequence[str]) -> list[bytes]:
    """Entry fields of a batch: the hot path's one loop over keys (SGLang's hex keys are
    converted without a function call per key)."""
    try:
        return [ns_id + _unhex(k[:_KEY_HEX]) if len(k) == 64 else ns_id + key_bytes(k) for k in keys]
    except (binascii.Error, ValueError):  # a 64-character key that is not hex
        return [entry_field(ns_id, k) for k in keys]


def shards_of(fields: Sequence[bytes], shards: int) -> list[int]:
    """Each page's shard: a hash of its entry field. A batch is split by shard and each
    part is one function call per shard (by default one shard per master: one call per
    master). One comprehension for a batch: the hot path's."""
    if shards == 1:
        return [0] * len(fields)
    h = xxhash.xxh3_64_intdigest
    return [h(f) % shards for f in fields]


def shard_of(field: bytes, shards: int) -> int:
    """One page's shard (:func:`shards_of`)."""
    return shards_of([field], shards)[0]


def glob_escape(raw: bytes) -> bytes:
    """A literal for Redis SCAN/HSCAN MATCH patterns."""
    return re.sub(rb"([\\*?\[\]])", rb"\\\1", raw)


def key_globs(prefix: str) -> list[str]:
    """Glob patterns of every key under ``prefix``: its stores' (``{<prefix>:<id>...}:...``)
    and those of the layout before regions (``<prefix>:...``, looked for at start-up)."""
    p = glob_escape(prefix.encode()).decode()
    return [f"{{{p}:*", f"{p}:*"]


def store_tag(prefix: str, store_id: str) -> str:
    return f"{prefix}:{store_id}"


def meta_key(tag: str, name: str) -> str:
    """``{T}:meta``, ``{T}:ns``, ``{T}:dirs``."""
    return f"{{{tag}}}:{name}"


def shard_tags(tag: str, meta: dict[str, str]) -> tuple[str, ...]:
    """The hash tag of each shard of a store, from its meta (see the module docstring)."""
    recorded = meta.get("shard_tags")
    suffixes = recorded.split(",") if recorded else [str(s) for s in range(int(meta.get("shards", 1)))]
    return tuple(f"{tag}:{x}" for x in suffixes)


def shard_keys(stag: str) -> list[str]:
    """Every key of the shard with hash tag ``stag``, in the order the functions read them from KEYS."""
    return [f"{{{stag}}}:{name}" for name in SHARD_KEYS]


def shard_key(stag: str, name: str) -> str:
    """One key of a shard by its name in ``SHARD_KEYS``."""
    return f"{{{stag}}}:{name}"


def store_keys(tag: str, stags: Sequence[str]) -> list[str]:
    """Every key of a store."""
    keys = [meta_key(tag, n) for n in ("meta", "ns", "dirs")]
    for st in stags:
        keys += shard_keys(st)
    return keys


def _lua_struct(fmt: str) -> str:
    """A ``struct`` format string of Python's for Lua's struct library (sizes explicit)."""
    sizes = {"I": 4, "B": 1, "Q": 8}
    return fmt[0] + "".join(f"I{sizes[c]}" for c in fmt[1:])


def _lua_literal(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _lua_pattern(s: str) -> str:
    """``s`` as a Lua pattern matching it literally."""
    return re.sub(r"([%^$().\[\]*+\-?])", r"%\1", s)


def lua_prelude() -> str:
    """The Lua library's first lines: keys bound per call, record formats and constants,
    generated from the definitions above."""
    names = ", ".join(f"K_{n.upper()}" for n in SHARD_KEYS)
    fs, rs, ls = _lua_literal(FILE_SEP), _lua_literal(RANGE_SEP), _lua_literal(RANGES_SEP)
    fp, rp = _lua_pattern(FILE_SEP), _lua_pattern(RANGE_SEP)
    zero = "\\0" * FIELD_BYTES
    return "\n".join([
        "-- generated by sglang_tierstore.schema.lua_prelude: the index's formats",
        f"local {names}",
        f"local function bind_keys(keys) {names} = unpack(keys, 1, {len(SHARD_KEYS)}) end",
        f"local ENTRY_HEAD, ENTRY_HEAD_BYTES = '{_lua_struct(ENTRY_HEAD.format)}', {ENTRY_HEAD.size}",
        f"local REGION_FMT, REGION_BYTES = '<{''.join(f'I{n}' for _, n in REGION_FIELDS)}', {REGION.size}",
        f"local FIELD, TAIL, ALIGN = {FIELD_BYTES}, {TAIL_BYTES}, {ALIGN}",
        f"local ZERO = '{zero}'  -- the member field of a slot holding no page",
        f"local HOLE, FREE, USED, DRAINING = {HOLE}, {FREE}, {USED}, {DRAINING}",
        f"local NOT_STORED, STORED, EXISTS = {NOT_STORED}, {STORED}, {EXISTS}",
        f"local NEED_FILE, TOO_BIG = {NEED_FILE}, {TOO_BIG}",
        f"local STALE = '{STALE}'",
        f"local CREATING, READY, LOST = '{CREATING}', '{READY}', '{LOST}'",
        "-- a page file's record",
        "local function parse_file(v)",
        "  if not v then return nil end",
        f"  local dir, uid, state, since = string.match(v, '^([^{fp}]*){fp}([^{fp}]*){fp}(%a){fp}(.*)$')",
        "  return {dir = dir, uid = uid, state = state, since = since}",
        "end",
        f"local function file_value(rec) return table.concat({{rec.dir, rec.uid, rec.state, rec.since}}, {fs}) end",
        "-- a lease's slots: a list of {region, start, count}",
        "local function parse_ranges(s)",
        "  local out = {}",
        "  if s then",
        f"    for r, a, c in string.gmatch(s, '(%d+){rp}(%d+){rp}(%d+)') do out[#out + 1] = {{tonumber(r), tonumber(a), tonumber(c)}} end",
        "  end",
        "  return out",
        "end",
        "local function format_ranges(t)",
        "  local parts = {}",
        f"  for _, x in ipairs(t) do if x[3] > 0 then parts[#parts + 1] = x[1] .. {rs} .. x[2] .. {rs} .. x[3] end end",
        f"  return table.concat(parts, {ls})",
        "end",
        "",
    ])
