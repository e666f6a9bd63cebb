"""Key names and record formats of the index: the one source for Python and Lua.

A store is ``(redis_prefix, store id)``; the id lives in the index and in a marker
in each of the store's directories (:mod:`sglang_tierstore.home`). Its keys, with
``T = <prefix>:<store id>``::

    {T}:meta          hash   geometry (format, region bytes, regions per file, shards), capacity
    {T}:ns            hash   namespace id (hex) -> readable description (for check and operators)
    {T}:dirs          hash   directory id -> JSON {path, host, seen}: who last saw each directory
    {T:s}:conf        hash   shard s: store id, capacity and allocated regions, geometry, counters
    {T:s}:entries     hash   entry field (namespace 8 B + key 24 B) -> ENTRY value
    {T:s}:regions     hash   region id -> REGION record
    {T:s}:members     hash   region id -> the entry field of each slot (FIELD_BYTES per slot)
    {T:s}:lru         zset   region id -> last use (regions holding pages)
    {T:s}:free        zset   region id -> placement order (allocated, empty)
    {T:s}:holes       zset   region id -> placement order (not allocated: no disk space)
    {T:s}:punch       zset   region id -> placement order (not allocated, disk space still to punch out)
    {T:s}:drain       zset   region id -> since (leaving: waits for its leased slots to come back)
    {T:s}:open        hash   page bytes -> the region now being filled for that page size
    {T:s}:leases      hash   lease id -> "region:start:count,..." slots leased to one writer
    {T:s}:deadlines   zset   lease id -> expiry time
    {T:s}:files       hash   file number -> "dir id|uid|state|since" (state: c creating, r ready, l lost)

Every key a shard's scripts touch carries the shard's hash tag ``{T:s}``, and the
scripts get them all in KEYS (``shard_keys``), so each script call runs on one
Redis Cluster slot. Which shard a page belongs to: see :func:`shard_of`.
"""

from __future__ import annotations

import binascii
import hashlib
import re
import struct
from typing import NamedTuple, Sequence

import xxhash

FORMAT = 3  # bump when any record below changes; older stores are dropped at attach

FIELD_BYTES = 32  # namespace id (8 bytes) + key (24 bytes)
KEY_BYTES = 24

# An entry: where a committed page lives, the xxh3-64 of its bytes and a tag over the
# entry field and all of that under the store's key (:mod:`sglang_tierstore.mac`). Lua
# reads only the head; the writer sends the rest (checksum and tag, a Lua double could
# not hold the checksum) as one TAIL_BYTES string per page.
ENTRY = struct.Struct("<IIIQ16s")  # region, region generation, slot, checksum, tag
ENTRY_HEAD = struct.Struct("<III")
ENTRY_HEAD_LUA = "<I4I4I4"
TAG_BYTES = 16
SIGNED_BYTES = ENTRY.size - TAG_BYTES  # what the tag covers, after the entry field
TAIL_BYTES = ENTRY.size - ENTRY_HEAD.size

# A region record. state: HOLE (not allocated: no disk space once punched), FREE
# (allocated, empty), USED (holds or is receiving pages of one size), DRAINING (leaving
# the store while writers still hold some of its slots: no pages, no new leases). fill: slots handed out so far (append-only);
# live: slots holding a committed page; leased: slots handed out and not yet
# committed or given up. Slots below fill that are neither are dead until the
# region is reclaimed as a whole.
REGION_FIELDS = (("page_bytes", 4), ("gen", 4), ("fill", 4), ("live", 4), ("leased", 4), ("state", 1))
REGION = struct.Struct("<" + "".join({4: "I", 1: "B"}[n] for _, n in REGION_FIELDS))
REGION_LUA = "<" + "".join(f"I{n}" for _, n in REGION_FIELDS)
HOLE, FREE, USED, DRAINING = 0, 1, 2, 3

SHARD_KEYS = ("conf", "entries", "regions", "members", "lru", "free", "holes", "open", "leases", "deadlines", "files",
              "punch", "drain")
HEADER_BYTES = 4096  # a page file's header block; region 0 starts right after it
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and slot sizes


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


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def unpack_entry(raw: bytes) -> Entry:
    """Raises ``struct.error`` on a value that is not an entry."""
    return Entry(*ENTRY.unpack(raw))


def unpack_region(raw: bytes) -> Region:
    return Region(*REGION.unpack(raw))


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


def shard_of(field: bytes, shards: int) -> int:
    """A page's shard: a hash of its entry field. A batch is split by shard and each
    part is one script call (with one shard, the default, a batch is one call)."""
    return 0 if shards == 1 else xxhash.xxh3_64_intdigest(field) % shards


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


def shard_keys(tag: str, shard: int) -> list[str]:
    """Every key of one shard, in the order the scripts read them from KEYS."""
    return [f"{{{tag}:{shard}}}:{name}" for name in SHARD_KEYS]


def lua_prelude() -> str:
    """Lua constants for the scripts, generated from the definitions above."""
    names = ", ".join(f"K_{n.upper()}" for n in SHARD_KEYS)
    return (
        f"local {names} = unpack(KEYS, 1, {len(SHARD_KEYS)})\n"
        f"local ENTRY_HEAD, REGION_FMT, FIELD, TAIL = '{ENTRY_HEAD_LUA}', '{REGION_LUA}', {FIELD_BYTES}, {TAIL_BYTES}\n"
        f"local HOLE, FREE, USED, DRAINING, ALIGN = {HOLE}, {FREE}, {USED}, {DRAINING}, {ALIGN}\n"
    )
