"""The allocator: owns capacity. Page files are cut into regions; a region holds pages
of one size while in use, and a free region goes to whichever page size needs one.

Regions
    A store has one region size ``R`` (:func:`region_bytes_for`: capacity / 16 rounded
    down to a power of two, clamped to 64 KiB..64 MiB; fixed when the store is created).
    At least 16 regions means eviction never takes more than 1/16 of the store at once and
    two or three page sizes each find room even in a store of a few MiB. At most 64 MiB
    keeps what one eviction drops to a blink of a 500 GB store (0.013%) while a
    128-page write of 256 KiB pages still fits one region, so prefixes land in
    consecutive slots; 10 TB is 160k regions, a few MB of index. A page larger than
    ``R`` cannot be stored (only in stores too small to hold a handful of such pages).
    Page files hold ``regions_per_file`` regions after a 4 KiB header; regions that
    are not allocated are holes (punched out of the file: no disk space).

Eviction: region-granular LRU across page sizes
    Each region in use has one recency (the last write or read of any of its pages).
    When no free region is left, the least recently used region with no slot under
    lease is reclaimed whole, whatever its page size, and handed to the page size that
    asked. A page size's share of the store therefore follows its recent use: nothing
    is reserved per size, and no size can hold space it does not use. Alternatives
    considered:

    - Per-size slot LRU (the previous design): capacity went to whoever came first;
      sizes need per-size free targets that starve small side pools.
    - Page LRU with region compaction: exact page recency, but compaction rewrites
      live pages (write amplification on the disk we are trying to spare) and needs a
      per-page recency record (the index memory budget has no room for one).
    - Navy's BlockCache (CacheLib) does what is done here: regions written
      append-only and reclaimed whole in LRU/FIFO order, so eviction costs no I/O.
      Its reinsertion of hot items on reclaim is left out: a KV prefix is read and
      written as a unit, so the pages of one region age together.

    Free space is kept as free regions (``free_target`` of the shard's regions, by
    housekeeping, so writes seldom evict inline); free regions belong to no page size.

Slots and leases
    A region is filled append-only: ``fill`` counts slots handed out. A writer takes
    slots from its own stock, a lease (``leases``: ranges of slots, ``deadlines``:
    expiry). A write batch takes consecutive slots from its stock, writes, then one
    COMMIT call publishes the entries, gives up the slots it could not use and refills
    the stock for the next batch (a write is one round trip once a stock exists). A
    writer that dies holds its stock until the lease expires; then those slots count as
    dead (or return to the region if they were its last). Slots never leave a region
    except with the whole region, so accounting stays exact:
    ``fill = live + leased + dead`` for every region, and every slot is in exactly one
    state. A region with a slot under lease is never reclaimed.

Shards
    The index may be split into ``shards`` (fixed at creation; default 1). A page
    belongs to shard ``xxh3(entry field) % shards``; a file, and the regions in it,
    to shard ``file number % shards``. A batch is cut into one part per shard and each
    part is one script call, in one pipelined round trip. Every script gets every key
    of its shard in KEYS, all under the shard's hash tag, so on Redis/Valkey Cluster a
    call runs on one slot. With one shard (standalone Redis) a batch is one call.

Every script's ARGV[1] is the store id: a call against a store that was dropped or
whose index was lost fails with ``TSSTALE`` and the caller attaches again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

from sglang_tierstore.index import RedisIndex
from sglang_tierstore.schema import HEADER_BYTES, SHARD_KEYS, lua_prelude, round_up, shard_keys

MiB = 1 << 20
MIN_REGION = 64 << 10
MAX_REGION = 64 * MiB
MIN_REGIONS = 16
MAX_REGIONS_PER_FILE = 64
SCAN = 32  # candidates looked at when choosing a region: bounds every choice
REFORMAT_RATIO = 4  # attach re-cuts a store whose region size is this far from its capacity's


def region_bytes_for(capacity: int) -> int:
    """Region size for a store of ``capacity`` bytes (see module docstring)."""
    r = 1 << max(0, (capacity // MIN_REGIONS).bit_length() - 1)
    return max(MIN_REGION, min(MAX_REGION, r))


def regions_per_file_for(capacity: int, region_bytes: int, dirs: int) -> int:
    """Files hold half a directory's share of the store (so a store spreads over its
    directories from the start), at most 64 regions (4 GiB files at 64 MiB regions)."""
    return max(1, min(MAX_REGIONS_PER_FILE, capacity // region_bytes // (2 * dirs)))


def needs_new_geometry(region_bytes: int, capacity: int) -> bool:
    ideal = region_bytes_for(capacity)
    return max(ideal, region_bytes) >= REFORMAT_RATIO * min(ideal, region_bytes)


def slots_per_region(region_bytes: int, page_bytes: int) -> int:
    return region_bytes // round_up(page_bytes)


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a store's index says its files look like; the only source of offsets."""

    store_id: str
    region_bytes: int
    regions_per_file: int
    shards: int

    def file_of(self, region: int) -> int:
        return region // self.regions_per_file

    def region_offset(self, region: int) -> int:
        """Byte offset of a region inside its file (after the header block)."""
        return HEADER_BYTES + (region % self.regions_per_file) * self.region_bytes

    def slot_offset(self, region: int, slot: int, page_bytes: int) -> int:
        return self.region_offset(region) + slot * round_up(page_bytes)

    def shard_of_file(self, file_no: int) -> int:
        return file_no % self.shards

    def shard_of_region(self, region: int) -> int:
        return self.shard_of_file(self.file_of(region))

    def capacity_share(self, capacity: int, shard: int) -> int:
        """Regions shard ``shard`` may allocate out of ``capacity`` bytes."""
        total = capacity // self.region_bytes
        return total // self.shards + (1 if shard < total % self.shards else 0)


class Range(NamedTuple):
    """Consecutive slots of one region, leased to one writer."""

    region: int
    start: int
    slots: int
    page_bytes: int
    gen: int  # the region's generation: part of each entry's tag


class Slot(NamedTuple):
    region: int
    slot: int
    gen: int


class CommitResult(NamedTuple):
    status: list[int]  # per commit: 1 stored, 2 already stored (slot now dead), 0 not stored (lease gone, region draining)
    stock: list[Range]  # the lease's slots after this call
    fresh: list[int]  # regions just allocated: the caller gives them disk space
    need_file: bool  # no region without a new page file
    too_big: bool  # a page size that does not fit a region
    evicted: int
    pages_evicted: int
    capacity_regions: int  # the shard's capacity as the index has it now


STORED, EXISTS = 1, 2  # COMMIT statuses; 0: not stored

_COMMON = r"""
local conf = {}
local function attach()
  local v = redis.call('HMGET', K_CONF, 'store', 'cap', 'alloc', 'rb', 'rpf')
  if v[1] ~= ARGV[1] then return false end
  conf.cap, conf.alloc, conf.rb, conf.rpf = tonumber(v[2]), tonumber(v[3]), tonumber(v[4]), tonumber(v[5])
  conf.alloc0 = conf.alloc
  return true
end
local function save_conf()
  if conf.alloc ~= conf.alloc0 then redis.call('HSET', K_CONF, 'alloc', conf.alloc) end
end

local ZERO = string.rep('\0', FIELD)
local SCAN = __SCAN__
local regions, dirty = {}, {}
local function region(r)
  local g = regions[r]
  if g == nil then
    local v = redis.call('HGET', K_REGIONS, r)
    if not v then regions[r] = false; return nil end
    local pb, gen, fill, live, leased, state = struct.unpack(REGION_FMT, v)
    g = {pb = pb, gen = gen, fill = fill, live = live, leased = leased, state = state}
    regions[r] = g
  end
  return g or nil
end
local function touch(r) dirty[r] = true end
local function flush()
  for r in pairs(dirty) do
    local g = regions[r]
    if g then redis.call('HSET', K_REGIONS, r, struct.pack(REGION_FMT, g.pb, g.gen, g.fill, g.live, g.leased, g.state)) end
  end
end
local function slots_of(pb) return math.floor(conf.rb / (math.ceil(pb / ALIGN) * ALIGN)) end
local function place(r) return (r % conf.rpf) * 16777216 + math.floor(r / conf.rpf) end

-- which regions this process can use: those in ready files of its directories
local reach, fstate = {}, {}
local function set_reach(csv) for d in string.gmatch(csv, '[^,]+') do reach[d] = true end end
local function file_rec(f)
  local v = redis.call('HGET', K_FILES, f)
  if not v then return nil end
  local dir, uid, st, since = string.match(v, '^([^|]*)|([^|]*)|(%a)|(.*)$')
  return {dir = dir, uid = uid, state = st, since = since}
end
local function usable(r)
  local f = math.floor(r / conf.rpf)
  local ok = fstate[f]
  if ok == nil then
    local rec = file_rec(f)
    ok = rec ~= nil and rec.state == 'r' and reach[rec.dir] == true
    fstate[f] = ok
  end
  return ok
end

local function is_open(r, g) return tonumber(redis.call('HGET', K_OPEN, g.pb) or '-1') == r end

-- rewrite a region's member list: list of {first slot, the fields of consecutive slots
-- from there (or ZERO for one slot)}, not overlapping
local function by_slot(a, b) return a[1] < b[1] end
local function set_members(r, list)
  for k = 2, #list do
    if list[k][1] < list[k - 1][1] then table.sort(list, by_slot); break end
  end
  local blob = redis.call('HGET', K_MEMBERS, r) or ''
  local parts, pos = {}, 0
  for _, x in ipairs(list) do
    local off = x[1] * FIELD
    if off > pos then
      local chunk = string.sub(blob, pos + 1, off)
      parts[#parts + 1] = chunk
      if #chunk < off - pos then parts[#parts + 1] = string.rep('\0', off - pos - #chunk) end
    end
    parts[#parts + 1] = x[2]
    pos = off + #x[2]
  end
  parts[#parts + 1] = string.sub(blob, pos + 1)
  redis.call('HSET', K_MEMBERS, r, table.concat(parts))
end

-- a page leaves its slot (its entry is gone): the region stops counting it; its member
-- is zeroed, and the region settled, by finish_unlinks
local zeroed, unlinked = {}, {}
local function unlink_page(r, g, slot)
  g.live = g.live - 1; touch(r); unlinked[r] = g
  local z = zeroed[r]
  if not z then z = {}; zeroed[r] = z end
  z[#z + 1] = {slot, ZERO}
end

-- delete the entries of a region's pages; returns how many
local pages_dropped = 0
local function drop_pages(r, g)
  local blob = redis.call('HGET', K_MEMBERS, r) or ''
  local fields, slots = {}, {}
  for i = 0, math.floor(#blob / FIELD) - 1 do
    local f = string.sub(blob, i * FIELD + 1, (i + 1) * FIELD)
    if f ~= ZERO then fields[#fields + 1] = f; slots[#slots + 1] = i end
  end
  for a = 1, #fields, 1000 do
    local b = math.min(#fields, a + 999)
    local vals = redis.call('HMGET', K_ENTRIES, unpack(fields, a, b))
    local del = {}
    for k = a, b do
      local v = vals[k - a + 1]
      if v and #v >= 12 then
        local er, eg, es = struct.unpack(ENTRY_HEAD, v)
        if er == r and eg == g.gen and es == slots[k] then del[#del + 1] = fields[k] end
      end
    end
    if #del > 0 then redis.call('HDEL', K_ENTRIES, unpack(del)); pages_dropped = pages_dropped + #del end
  end
  redis.call('HDEL', K_MEMBERS, r)
end

-- a region in use loses its pages and its place; the caller decides where it goes
local function clear_region(r, g)
  if g.state == USED then
    drop_pages(r, g)
    redis.call('ZREM', K_LRU, r)
    if is_open(r, g) then redis.call('HDEL', K_OPEN, g.pb) end
  end
  g.gen = g.gen + 1; g.pb = 0; g.fill = 0; g.live = 0; g.leased = 0
  touch(r)
end
local function free_region(r, g)
  clear_region(r, g); g.state = FREE
  redis.call('ZADD', K_FREE, place(r), r)
end
-- a region leaves the allocation; it becomes allocatable again once a process that has
-- its directory has punched its space out (PUNCHED)
local function hole_region(r, g)
  if g.state == FREE then redis.call('ZREM', K_FREE, r) end
  if g.state == DRAINING then redis.call('ZREM', K_DRAIN, r) end
  if g.state ~= HOLE then conf.alloc = conf.alloc - 1 end
  clear_region(r, g); g.state = HOLE
  redis.call('ZADD', K_PUNCH, place(r), r)
end
-- a region that must leave while writers hold some of its slots: its pages go now, the
-- region once its last leased slot is committed, given up or expired (see settle)
local function drain_region(r, g, now)
  drop_pages(r, g)
  redis.call('ZREM', K_LRU, r)
  if is_open(r, g) then redis.call('HDEL', K_OPEN, g.pb) end
  g.live = 0; g.state = DRAINING; touch(r)
  redis.call('ZADD', K_DRAIN, now, r)
end
-- after slots came back: a region whose every slot is dead and that takes no more pages
-- is free again; a draining region with no slot leased any more becomes a hole
local function settle(r, g)
  if g.state == USED and g.live == 0 and g.leased == 0 and not is_open(r, g) then free_region(r, g)
  elseif g.state == DRAINING and g.leased == 0 then hole_region(r, g) end
end

local function finish_unlinks()
  for r, list in pairs(zeroed) do set_members(r, list) end
  for r, g in pairs(unlinked) do settle(r, g) end
end

local function parse_ranges(s)
  local out = {}
  if s then
    for r, a, c in string.gmatch(s, '(%d+):(%d+):(%d+)') do out[#out + 1] = {tonumber(r), tonumber(a), tonumber(c)} end
  end
  return out
end
local function format_ranges(t)
  local parts = {}
  for _, x in ipairs(t) do if x[3] > 0 then parts[#parts + 1] = x[1] .. ':' .. x[2] .. ':' .. x[3] end end
  return table.concat(parts, ',')
end
-- take every leased slot of region r away from its writer (its file is gone): a late
-- write there fails, as the file does not exist any more
local function revoke_leases(r, g)
  if g.leased == 0 then return end
  local leases = redis.call('HGETALL', K_LEASES)
  for k = 1, #leases, 2 do
    local kept = {}
    for _, x in ipairs(parse_ranges(leases[k + 1])) do if x[1] ~= r then kept[#kept + 1] = x end end
    local s = format_ranges(kept)
    if s == '' then redis.call('HDEL', K_LEASES, leases[k]); redis.call('ZREM', K_DEADLINES, leases[k])
    else redis.call('HSET', K_LEASES, leases[k], s) end
  end
  g.leased = 0
  touch(r)
end

-- the least recently used region with nothing under lease
local function coldest(need_usable)
  for _, rs in ipairs(redis.call('ZRANGE', K_LRU, 0, SCAN - 1)) do
    local r = tonumber(rs)
    local g = region(r)
    if g and g.leased == 0 and (not need_usable or usable(r)) then return r, g end
  end
  return nil, nil
end

local flags, evicted, fresh = 0, 0, {}
local NEED_FILE, TOO_BIG = 1, 4
local function take(zkey)
  for _, rs in ipairs(redis.call('ZRANGE', zkey, 0, SCAN - 1)) do
    local r = tonumber(rs)
    if usable(r) then redis.call('ZREM', zkey, rs); return r end
  end
  return nil
end
-- an empty region for new pages: free, else a hole (capacity allowing), else (if the
-- pages are needed now, not a stock for later) the coldest region's
local function fresh_region(may_evict)
  local r = take(K_FREE)
  if r then return r end
  if conf.alloc < conf.cap then
    r = take(K_HOLES)
    if r then conf.alloc = conf.alloc + 1; fresh[#fresh + 1] = r; return r end
    flags = bit.bor(flags, NEED_FILE)
    return nil
  end
  if not may_evict then return nil end
  local g
  r, g = coldest(true)
  if r then clear_region(r, g); evicted = evicted + 1; return r end
  -- every region is pinned by writers' stocks: the coldest drains, so that idle writers
  -- give their slots there back at their next housekeeping and the space comes free
  local lru = redis.call('ZRANGE', K_LRU, 0, 0)
  if #lru > 0 then
    local c = tonumber(lru[1])
    drain_region(c, region(c), tonumber(ARGV[3]))
    evicted = evicted + 1
  end
  return nil
end

-- take one slot out of a lease; false if the lease does not hold it
local function take_slot(ranges, r, slot)
  for i, x in ipairs(ranges) do
    if x[1] == r and slot >= x[2] and slot < x[2] + x[3] then
      if slot == x[2] then x[2] = x[2] + 1; x[3] = x[3] - 1
      elseif slot == x[2] + x[3] - 1 then x[3] = x[3] - 1
      else table.insert(ranges, i + 1, {r, slot + 1, x[2] + x[3] - slot - 1}); x[3] = slot - x[2] end
      return true
    end
  end
  return false
end
-- take slots start..start+n-1 of region r out of a lease at once; false (nothing taken)
-- unless one range holds them all
local function take_span(ranges, r, start, n)
  for i, x in ipairs(ranges) do
    if x[1] == r and start >= x[2] and start + n <= x[2] + x[3] then
      local tail = x[2] + x[3] - start - n
      x[3] = start - x[2]
      if tail > 0 then table.insert(ranges, i + 1, {r, start + n, tail}) end
      return true
    end
  end
  return false
end
-- take a run of slots (usually one range holds it whole): true for each slot the lease
-- held (now taken)
local function take_run(ranges, r, start, n)
  local got = {}
  if take_span(ranges, r, start, n) then
    for j = 0, n - 1 do got[j] = true end
  else
    for j = 0, n - 1 do got[j] = take_slot(ranges, r, start + j) end
  end
  return got
end
-- slots a writer no longer holds: dead, or (given back by the writer itself, which will
-- not write them) back to the region if they were its last. An expired lease's slots stay
-- dead: its writer may only be stalled, and must not find them holding another's page.
local function give_back(r, start, count, by_writer)
  local g = region(r)
  if not g or (g.state ~= USED and g.state ~= DRAINING) then return end
  g.leased = g.leased - count
  if by_writer and start + count == g.fill then g.fill = start end
  touch(r)
  settle(r, g)
end
-- lease n more slots of page size pb, appended to ranges
local function lease_more(ranges, pb, n, now, may_evict)
  local per = slots_of(pb)
  if per < 1 then flags = bit.bor(flags, TOO_BIG); return end
  while n > 0 do
    local r = tonumber(redis.call('HGET', K_OPEN, pb) or '-1')
    local g = r >= 0 and region(r) or nil
    if not g or g.state ~= USED or g.pb ~= pb or g.fill >= per or not usable(r) then
      if r >= 0 then
        redis.call('HDEL', K_OPEN, pb)
        if g then settle(r, g) end
      end
      r = fresh_region(may_evict)
      if not r then return end
      g = region(r)
      g.gen = g.gen + 1; g.pb = pb; g.fill = 0; g.live = 0; g.leased = 0; g.state = USED
      redis.call('ZADD', K_LRU, now, r)
      redis.call('HSET', K_OPEN, pb, r)
    end
    local k = math.min(n, per - g.fill)
    local last = ranges[#ranges]
    if last and last[1] == r and last[2] + last[3] == g.fill then last[3] = last[3] + k
    else ranges[#ranges + 1] = {r, g.fill, k} end
    g.fill = g.fill + k; g.leased = g.leased + k; touch(r)
    n = n - k
    if g.fill >= per then redis.call('HDEL', K_OPEN, pb) end
  end
end
local function save_lease(lease, ranges, deadline)
  local s = format_ranges(ranges)
  if s == '' then
    redis.call('HDEL', K_LEASES, lease); redis.call('ZREM', K_DEADLINES, lease)
  else
    redis.call('HSET', K_LEASES, lease, s); redis.call('ZADD', K_DEADLINES, deadline, lease)
  end
end
"""


def _script(body: str) -> str:
    return lua_prelude() + _COMMON.replace("__SCAN__", str(SCAN)) + body


class Scripts:
    """The allocator's Lua scripts. Each gets the shard's keys (``schema.shard_keys``)."""

    # ARGV[1] store id   ARGV[2] lease id   ARGV[3] now   ARGV[4] lease deadline
    # ARGV[5] this process's directory ids (csv)   ARGV[6] 1: give the whole lease back,
    #   2: give back its slots in draining regions (the writer is idle), 0: neither
    # ARGV[7] n runs written, then per run: region, its generation as the writer leased it,
    #   first slot, count, the entry fields of its pages (FIELD bytes each, concatenated),
    #   their entry tails (checksum and tag, TAIL bytes each)
    # then n runs given up (written in vain), per run: region, first slot, count
    # then n refills, per refill: page bytes, slots wanted in stock, 1 if they are needed now
    #   (eviction allowed) or 0 for a stock ahead of need (free space only)
    # returns {flags, regions evicted, pages evicted, shard capacity (regions), n, status_1..n (per page, in run order),
    #          n fresh, fresh regions..., then (region, start, count, page bytes, generation) per
    #          range left in the lease}
    COMMIT = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local lease, now, deadline = ARGV[2], tonumber(ARGV[3]), ARGV[4]
set_reach(ARGV[5])
local ranges = parse_ranges(redis.call('HGET', K_LEASES, lease))
local runs, fields, i = {}, {}, 8
for k = 1, tonumber(ARGV[7]) do
  local r, gen, s0, n, fblob = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), ARGV[i + 4]
  local first = #fields + 1
  for j = 0, n - 1 do fields[first + j] = string.sub(fblob, j * FIELD + 1, (j + 1) * FIELD) end
  runs[k] = {r, s0, n, first, fblob, ARGV[i + 5], gen}
  i = i + 6
end
local present = {}  -- fields already stored: one HMGET, not a call per page
for a = 1, #fields, 1000 do
  local b = math.min(#fields, a + 999)
  for k, v in ipairs(redis.call('HMGET', K_ENTRIES, unpack(fields, a, b))) do if v then present[fields[a + k - 1]] = true end end
end
local status, members, changed, new = {}, {}, {}, {}
for _, run in ipairs(runs) do
  local r, s0, n, first, fblob, tblob = run[1], run[2], run[3], run[4], run[5], run[6]
  local got = take_run(ranges, r, s0, n)
  local g = region(r)
  -- leaving the store, or not the generation the tags were made for: not stored
  if g and (g.state == DRAINING or g.gen ~= run[7]) then
    local taken = 0
    for j = 0, n - 1 do if got[j] then taken = taken + 1 end; got[j] = false end
    if taken > 0 then g.leased = g.leased - taken; touch(r); changed[r] = g end
  end
  local m = members[r]
  local from = nil  -- start (in the run) of the current stretch of new pages
  local function close_stretch(j)
    if from then
      if not m then m = {}; members[r] = m end
      m[#m + 1] = {s0 + from, string.sub(fblob, from * FIELD + 1, j * FIELD)}
      from = nil
    end
  end
  local taken = 0
  for j = 0, n - 1 do
    local st = 0
    if got[j] then
      taken = taken + 1
      local f = fields[first + j]
      if present[f] then
        st = 2  -- stored already (or earlier in this batch): this slot is dead
        close_stretch(j)
      else
        present[f] = true
        new[#new + 1] = f
        new[#new + 1] = struct.pack(ENTRY_HEAD, r, g.gen, s0 + j) .. string.sub(tblob, j * TAIL + 1, (j + 1) * TAIL)
        st = 1
        if not from then from = j end
      end
    else
      close_stretch(j)
    end
    status[#status + 1] = st
  end
  close_stretch(n)
  if taken > 0 then
    g.leased = g.leased - taken; touch(r); changed[r] = g
  end
end
for a = 1, #new, 2000 do redis.call('HSET', K_ENTRIES, unpack(new, a, math.min(#new, a + 1999))) end
local ngive = tonumber(ARGV[i]); i = i + 1
for c = 1, ngive do
  local r, s0, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  i = i + 3
  local taken = 0
  for _, ok in pairs(take_run(ranges, r, s0, n)) do if ok then taken = taken + 1 end end
  if taken > 0 then
    local g = region(r)
    g.leased = g.leased - taken; touch(r); changed[r] = g
  end
end
for r, list in pairs(members) do
  local g = region(r)
  for _, x in ipairs(list) do g.live = g.live + #x[2] / FIELD end
  set_members(r, list)
  redis.call('ZADD', K_LRU, now, r)
end
for r, g in pairs(changed) do settle(r, g) end
if ARGV[6] == '1' then  -- the writer is done: all its slots
  for _, x in ipairs(ranges) do if x[3] > 0 then give_back(x[1], x[2], x[3], true) end end
  ranges = {}
elseif ARGV[6] == '2' then  -- an idle writer: its slots in draining regions
  local kept = {}
  for _, x in ipairs(ranges) do
    local g = region(x[1])
    if x[3] > 0 and g and g.state == DRAINING then give_back(x[1], x[2], x[3], true) else kept[#kept + 1] = x end
  end
  ranges = kept
end
local nref = tonumber(ARGV[i]); i = i + 1
for c = 1, nref do
  local pb, want, may_evict = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), ARGV[i + 2] == '1'
  i = i + 3
  local have = 0
  for _, x in ipairs(ranges) do
    local g = region(x[1])
    if g and g.pb == pb then have = have + x[3] end
  end
  if have < want then lease_more(ranges, pb, want - have, now, may_evict) end
end
save_lease(lease, ranges, deadline)
flush(); save_conf()
local out = {flags, evicted, pages_dropped, conf.cap, #status}
for _, s in ipairs(status) do out[#out + 1] = s end
out[#out + 1] = #fresh
for _, r in ipairs(fresh) do out[#out + 1] = r end
for _, x in ipairs(ranges) do
  if x[3] > 0 then
    local g = region(x[1])
    out[#out + 1] = x[1]; out[#out + 1] = x[2]; out[#out + 1] = x[3]; out[#out + 1] = g.pb; out[#out + 1] = g.gen
  end
end
return out
""")

    # ARGV[1] store id   ARGV[2..] pairs: entry field, the value the caller saw ('' = any)
    # Drops entries that still hold that value; their slots are dead (their region is
    # free again once nothing in it lives). returns how many were dropped
    DROP = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local n = 0
for i = 2, #ARGV, 2 do
  local field, seen = ARGV[i], ARGV[i + 1]
  local v = redis.call('HGET', K_ENTRIES, field)
  if v and (seen == '' or v == seen) then
    redis.call('HDEL', K_ENTRIES, field)
    n = n + 1
    if #v >= 12 then
      local r, gen, slot = struct.unpack(ENTRY_HEAD, v)
      local g = region(r)
      if g and g.state == USED and g.gen == gen then unlink_page(r, g, slot) end
    end
  end
end
finish_unlinks()
flush()
return n
""")

    # ARGV[1] store id   ARGV[2] now   ARGV[3] deadline for our leases   ARGV[4] our dirs (csv)
    # ARGV[5] fraction of the capacity to keep free   ARGV[6] most regions/leases handled   ARGV[7] forget file
    # creations started before this   ARGV[8] n, then our lease ids (renewed)
    # Expires leases, shrinks to capacity (free regions first, then the coldest; a region
    # with leased slots drains), keeps free regions ahead of need once the shard cannot grow.
    # returns {leases expired, slots given back, regions evicted, pages evicted, regions
    #          draining, n, holes to punch (in our directories)..., then our lease ids that
    #          are gone}
    SWEEP = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local now, deadline, maxw, cutoff = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[6]), tonumber(ARGV[7])
local keep = math.floor(tonumber(ARGV[5]) * conf.cap)
set_reach(ARGV[4])
local missing = {}  -- our leases that are gone (expired): their writers must not trust their stock
for i = 9, 8 + tonumber(ARGV[8]) do
  if redis.call('HEXISTS', K_LEASES, ARGV[i]) == 1 then redis.call('ZADD', K_DEADLINES, deadline, ARGV[i])
  else missing[#missing + 1] = ARGV[i] end
end
local expired, slots = 0, 0
for _, lease in ipairs(redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, maxw)) do
  for _, x in ipairs(parse_ranges(redis.call('HGET', K_LEASES, lease))) do
    if x[3] > 0 then give_back(x[1], x[2], x[3], false); slots = slots + x[3] end
  end
  redis.call('HDEL', K_LEASES, lease); redis.call('ZREM', K_DEADLINES, lease)
  expired = expired + 1
end
if tonumber(redis.call('HGET', K_CONF, 'creating') or '0') > 0 then
  local all = redis.call('HGETALL', K_FILES)
  for k = 1, #all, 2 do
    local st, since = string.match(all[k + 1], '|(%a)|(.*)$')
    if st == 'c' and tonumber(since) < cutoff then
      redis.call('HDEL', K_FILES, all[k]); redis.call('HINCRBY', K_CONF, 'creating', -1)
    end
  end
end
local work = 0
-- shrink: free regions first, then the least recently used; a region with slots under
-- lease drains (its pages go now, the region when the writers give the slots back)
local draining = redis.call('ZCARD', K_DRAIN)
while conf.alloc - draining > conf.cap and work < maxw do
  local r, g
  local any = redis.call('ZRANGE', K_FREE, 0, 0)
  if #any > 0 then r = tonumber(any[1]); g = region(r) else r, g = coldest(false) end
  if r then
    if g.state == USED then evicted = evicted + 1 end
    hole_region(r, g)
  else
    local lru = redis.call('ZRANGE', K_LRU, 0, 0)
    if #lru == 0 then break end
    r = tonumber(lru[1]); g = region(r)
    drain_region(r, g, now)
    evicted = evicted + 1
    draining = draining + 1
  end
  work = work + 1
end
if conf.alloc >= conf.cap then
  while redis.call('ZCARD', K_FREE) < keep and work < maxw do
    local r, g = coldest(true)
    if not r then break end
    free_region(r, g)
    evicted = evicted + 1
    work = work + 1
  end
end
-- holes whose space a process with their directory still has to punch out
local punch = {}
for _, rs in ipairs(redis.call('ZRANGE', K_PUNCH, 0, maxw - 1)) do
  if usable(tonumber(rs)) then punch[#punch + 1] = tonumber(rs) end
end
flush(); save_conf()
local out = {expired, slots, evicted, pages_dropped, redis.call('ZCARD', K_DRAIN), #punch}
for _, r in ipairs(punch) do out[#out + 1] = r end
for _, lease in ipairs(missing) do out[#out + 1] = lease end
return out
""")

    # ARGV[1] store id   ARGV[2..] regions whose space the caller punched out of their files
    # They become allocatable holes. returns how many
    PUNCHED = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local n = 0
for i = 2, #ARGV do
  if redis.call('ZREM', K_PUNCH, ARGV[i]) == 1 then
    redis.call('ZADD', K_HOLES, place(tonumber(ARGV[i])), ARGV[i])
    n = n + 1
  end
end
return n
""")

    # ARGV[1] store id   ARGV[2] now   ARGV[3] our directory ids (csv, in order of preference)
    # Starts a new page file in the directory (of ours) holding the fewest files.
    # returns {file number, directory id, uid}
    ADD_FILE = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local count, order = {}, {}
for d in string.gmatch(ARGV[3], '[^,]+') do count[d] = 0; order[#order + 1] = d end
local all = redis.call('HGETALL', K_FILES)
for k = 1, #all, 2 do
  local d, st = string.match(all[k + 1], '^([^|]*)|[^|]*|(%a)')
  if st ~= 'l' and count[d] then count[d] = count[d] + 1 end
end
local best = order[1]
for _, d in ipairs(order) do if count[d] < count[best] then best = d end end
local f = tonumber(redis.call('HGET', K_CONF, 'next_file'))
redis.call('HSET', K_CONF, 'next_file', f + tonumber(redis.call('HGET', K_CONF, 'shards')))
local uid = redis.call('HINCRBY', K_CONF, 'uid', 1)
redis.call('HSET', K_FILES, f, best .. '|' .. uid .. '|c|' .. ARGV[2])
redis.call('HINCRBY', K_CONF, 'creating', 1)
return {f, best, tostring(uid)}
""")

    # ARGV[1] store id   ARGV[2] file number   ARGV[3] its uid
    # The file exists on disk: its regions become holes (allocatable). returns 1, or 0 if
    # the creation was forgotten meanwhile (too slow: the caller removes the file)
    FILE_READY = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local f = tonumber(ARGV[2])
local rec = file_rec(f)
if not rec or rec.uid ~= ARGV[3] or rec.state ~= 'c' then return 0 end
redis.call('HSET', K_FILES, f, rec.dir .. '|' .. rec.uid .. '|r|' .. rec.since)
redis.call('HINCRBY', K_CONF, 'creating', -1)
for i = 0, conf.rpf - 1 do
  local r = f * conf.rpf + i
  redis.call('HSET', K_REGIONS, r, struct.pack(REGION_FMT, 0, 0, 0, 0, 0, HOLE))
  redis.call('ZADD', K_HOLES, place(r), r)
end
return 1
""")

    # ARGV[1] store id   ARGV[2] file number   ARGV[3] its uid   ARGV[4] most regions handled
    # The file is gone (deleted, replaced, or its directory retired): its pages are
    # dropped, its regions leave the store and its capacity comes back. Call again
    # until it returns {0, ...}. returns {regions left, pages dropped}
    LOSE_FILE = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local f, maxw = tonumber(ARGV[2]), tonumber(ARGV[4])
local rec = file_rec(f)
if not rec or rec.uid ~= ARGV[3] then return {0, 0} end
if rec.state == 'c' then
  redis.call('HDEL', K_FILES, f); redis.call('HINCRBY', K_CONF, 'creating', -1)
  return {0, 0}
end
if rec.state ~= 'l' then redis.call('HSET', K_FILES, f, rec.dir .. '|' .. rec.uid .. '|l|' .. rec.since) end
local left, work = 0, 0
for i = 0, conf.rpf - 1 do
  local r = f * conf.rpf + i
  local g = region(r)
  if g then
    if work >= maxw then
      left = left + 1
    else
      revoke_leases(r, g)
      if g.state ~= HOLE then conf.alloc = conf.alloc - 1 end
      if g.state == FREE then redis.call('ZREM', K_FREE, r) end
      if g.state == HOLE then redis.call('ZREM', K_HOLES, r); redis.call('ZREM', K_PUNCH, r) end
      if g.state == DRAINING then redis.call('ZREM', K_DRAIN, r) end
      clear_region(r, g)
      redis.call('HDEL', K_REGIONS, r)
      regions[r] = false
      work = work + 1
    end
  end
end
if left == 0 then redis.call('HDEL', K_FILES, f) end
flush(); save_conf()
return {left, pages_dropped}
""")

    # ARGV[1] store id   ARGV[2..] triples: region, slot, entry field
    # check(fix=True): a member whose entry is gone or points elsewhere (its entry was
    # dropped without naming its slot: unparsable) stops counting as a live page.
    # returns how many were unlinked
    UNLINK_MEMBERS = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local n, seen = 0, {}
for i = 2, #ARGV, 3 do
  local r, slot, field = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), ARGV[i + 2]
  local g = region(r)
  local blob = redis.call('HGET', K_MEMBERS, r) or ''
  local once = not seen[r .. ':' .. slot]
  seen[r .. ':' .. slot] = true
  if once and g and g.state == USED and string.sub(blob, slot * FIELD + 1, (slot + 1) * FIELD) == field then
    local v = redis.call('HGET', K_ENTRIES, field)
    local here = false
    if v and #v >= 12 then
      local er, eg, es = struct.unpack(ENTRY_HEAD, v)
      here = er == r and eg == g.gen and es == slot
    end
    if not here then
      unlink_page(r, g, slot)
      n = n + 1
    end
  end
end
finish_unlinks()
flush()
return n
""")

    # ARGV[1] store id   ARGV[2..] region ids
    # A consistent snapshot of some regions, for check(). returns per region:
    # {record or '', members or '', lru score or '', in free, in holes, in punch, in drain (0/1), open region
    # of its page size or '', n, entry values for its n member fields ('' if none)},
    # then the lease table {n, id, ranges, ...}
    SNAPSHOT_REGIONS = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local out = {}
for i = 2, #ARGV do
  local r = ARGV[i]
  local rec = redis.call('HGET', K_REGIONS, r) or ''
  local blob = redis.call('HGET', K_MEMBERS, r) or ''
  out[#out + 1] = rec
  out[#out + 1] = blob
  out[#out + 1] = redis.call('ZSCORE', K_LRU, r) or ''
  out[#out + 1] = redis.call('ZSCORE', K_FREE, r) and 1 or 0
  out[#out + 1] = redis.call('ZSCORE', K_HOLES, r) and 1 or 0
  out[#out + 1] = redis.call('ZSCORE', K_PUNCH, r) and 1 or 0
  out[#out + 1] = redis.call('ZSCORE', K_DRAIN, r) and 1 or 0
  local openr = ''
  if #rec > 0 then
    local pb = struct.unpack(REGION_FMT, rec)
    openr = redis.call('HGET', K_OPEN, pb) or ''
  end
  out[#out + 1] = openr
  local fields = {}
  for k = 0, math.floor(#blob / FIELD) - 1 do
    local f = string.sub(blob, k * FIELD + 1, (k + 1) * FIELD)
    if f ~= ZERO then fields[#fields + 1] = f end
  end
  out[#out + 1] = #fields
  for a = 1, #fields, 1000 do
    local vals = redis.call('HMGET', K_ENTRIES, unpack(fields, a, math.min(#fields, a + 999)))
    for _, v in ipairs(vals) do out[#out + 1] = v or '' end
  end
end
local leases = redis.call('HGETALL', K_LEASES)
out[#out + 1] = #leases / 2
for _, v in ipairs(leases) do out[#out + 1] = v end
return out
""")

    # ARGV[1] store id   ARGV[2..] entry fields
    # A consistent snapshot of some entries, for check(). returns per field:
    # {value or '', its region's record or '', the member at its slot or ''}
    SNAPSHOT_ENTRIES = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
local out = {}
for i = 2, #ARGV do
  local v = redis.call('HGET', K_ENTRIES, ARGV[i]) or ''
  local rec, member = '', ''
  if #v >= 12 then
    local r, gen, slot = struct.unpack(ENTRY_HEAD, v)
    rec = redis.call('HGET', K_REGIONS, r) or ''
    local blob = redis.call('HGET', K_MEMBERS, r) or ''
    member = string.sub(blob, slot * FIELD + 1, (slot + 1) * FIELD)
  end
  out[#out + 1] = v; out[#out + 1] = rec; out[#out + 1] = member
end
return out
""")

    # ARGV[1] store id. returns {capacity, allocated, regions, in use, free, holes, to punch,
    #                           draining, leases, files, next file}
    COUNTS = _script(r"""
if not attach() then return redis.error_reply('TSSTALE') end
return {conf.cap, conf.alloc, redis.call('HLEN', K_REGIONS), redis.call('ZCARD', K_LRU),
        redis.call('ZCARD', K_FREE), redis.call('ZCARD', K_HOLES), redis.call('ZCARD', K_PUNCH),
        redis.call('ZCARD', K_DRAIN), redis.call('HLEN', K_LEASES), redis.call('HLEN', K_FILES),
        tonumber(redis.call('HGET', K_CONF, 'next_file'))}
""")


ALL_SCRIPTS = {name: getattr(Scripts, name) for name in vars(Scripts) if name.isupper()}


class _Stock:
    """One writing thread's lease and the slots it holds, per shard. ``lock`` is held
    for a whole write (slots taken, written, committed), so housekeeping can tell an idle
    writer from a busy one."""

    __slots__ = ("lease", "thread", "lock", "ranges", "epoch", "renewed")

    def __init__(self, lease: str, epoch: int) -> None:
        self.lease = lease
        self.thread = threading.current_thread()
        self.lock = threading.RLock()
        self.ranges: dict[int, list[Range]] = {}
        self.epoch = epoch
        self.renewed: dict[int, float] = {}  # shard -> when its lease was last renewed


class Allocator:
    """The Python side of the allocator: leases (one per writing thread), slot stocks,
    and one call per step. Knows regions and slots, not keys or files."""

    def __init__(self, index: RedisIndex, tag: str, geometry: Geometry, dirs: Sequence[str], lease_s: float,
                 token: str, clock: Callable[[], float]) -> None:
        self.index = index
        self.geometry = geometry
        self.dirs = ",".join(dirs)
        self.lease_s = lease_s
        self.clock = clock
        self._keys = [shard_keys(tag, s) for s in range(geometry.shards)]
        self._token = token
        self._local = threading.local()
        self._stocks: dict[str, _Stock] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._epoch = 0  # bumped when slots of some stock may have been taken away (a file lost)
        self.capacity_regions = [0] * geometry.shards  # per shard, as the last COMMIT reported (0: none yet)

    # -- leases and stocks -----------------------------------------------------------

    def _mine(self) -> _Stock:
        """This thread's stock (a writer's stock is per thread, so two threads never pick
        the same slots out of one lease)."""
        st: Optional[_Stock] = getattr(self._local, "stock", None)
        if st is None:
            with self._lock:
                st = _Stock(f"{self._token}.{self._next}", self._epoch)
                self._next += 1
                self._stocks[st.lease] = st
            self._local.stock = st
        if st.epoch != self._epoch:  # start over from what the lease holds in Redis
            st.ranges, st.epoch = {}, self._epoch
        return st

    def writing(self) -> threading.RLock:
        """Hold this (as a context manager) around a write: from taking slots to their COMMIT."""
        return self._mine().lock

    def _stock(self, shard: int) -> list[Range]:
        """This thread's slots in a shard, if its lease there was renewed within half its
        term (housekeeping renews it every pass): a writer that stalled longer may have
        lost the lease, and its slots with it, so it starts over from a COMMIT."""
        mine = self._mine()
        if self.clock() - mine.renewed.get(shard, -1e18) > self.lease_s / 2:
            mine.ranges[shard] = []
        return mine.ranges.setdefault(shard, [])

    def invalidate_stocks(self) -> None:
        """Every thread drops its stock before its next batch (slots may have been taken
        away: a file lost); the next COMMIT returns what each lease holds."""
        self._epoch += 1

    def take(self, shard: int, page_bytes: int, n: int) -> list[Slot]:
        """Up to ``n`` slots of this size from this thread's stock, in order (consecutive
        where the stock is). Fill the stock first (``commit_many`` with a refill) if short."""
        out: list[Slot] = []
        stock = self._stock(shard)
        kept: list[Range] = []
        for rg in stock:
            if rg.page_bytes == page_bytes and len(out) < n:
                k = min(n - len(out), rg.slots)
                out.extend(Slot(rg.region, rg.start + j, rg.gen) for j in range(k))
                if k < rg.slots:
                    kept.append(rg._replace(start=rg.start + k, slots=rg.slots - k))
            else:
                kept.append(rg)
        stock[:] = kept
        return out

    def stocked(self, shard: int, page_bytes: int) -> int:
        return sum(r.slots for r in self._stock(shard) if r.page_bytes == page_bytes)

    def commit_many(
        self,
        calls: Sequence[tuple[int, Sequence[tuple[Slot, bytes, bytes]], Sequence[tuple[int, int]], Sequence[tuple[int, int, bool]]]],
    ) -> list[CommitResult]:
        """One COMMIT per (shard, commits, give-ups, refills), in one round trip.

        commits: (slot, entry field, entry tail: checksum and tag); give-ups: (region,
        slot) written in vain; refills: (page bytes, slots wanted in stock, whether they
        are needed now: only then may a refill evict pages). Statuses come
        back in the order of ``commits``; consecutive slots of a region travel (and are
        committed) as one run, so callers pass them in slot order. The stock each call
        returns replaces this thread's for that shard (the slots taken by :meth:`take` are
        gone from both).
        """
        mine = self._mine()
        with mine.lock:
            sent = self.clock()
            outs = self.index.scripts([("COMMIT", self._keys[s], self._commit_args(mine.lease, c, gu, rf, 0))
                                       for s, c, gu, rf in calls])
            results = [_commit_result(o) for o in outs]
            for (s, _, _, _), res in zip(calls, results):
                mine.ranges[s] = res.stock
                mine.renewed[s] = sent
                self.capacity_regions[s] = res.capacity_regions
        return results

    def tidy(self, draining: bool) -> int:
        """Housekeeping of stocks: a thread that exited gives its whole stock back; with
        regions ``draining``, an idle thread gives back its slots in them (a busy one does
        at its next COMMIT). Returns how many stocks were tidied."""
        with self._lock:
            stocks = list(self._stocks.values())
        done = 0
        for st in stocks:
            gone = not st.thread.is_alive()
            if not gone and not draining:
                continue
            if not st.lock.acquire(blocking=False):
                continue  # writing now: its COMMIT settles its slots
            try:
                for shard in list(st.ranges) if not gone else range(self.geometry.shards):
                    res = _commit_result(self.index.script("COMMIT", self._keys[shard],
                                                           self._commit_args(st.lease, (), (), (), 1 if gone else 2)))
                    st.ranges[shard] = res.stock
                done += 1
                if gone:
                    with self._lock:
                        self._stocks.pop(st.lease, None)
            finally:
                st.lock.release()
        return done

    def forget_stock(self, shard: int) -> None:
        """After a COMMIT whose outcome is unknown: start over from what the lease holds."""
        self._stock(shard).clear()

    def _commit_args(self, lease: str, commits: Sequence[tuple[Slot, bytes, bytes]], give_up: Sequence[tuple[int, int]],
                     refill: Sequence[tuple[int, int, bool]], release: int) -> list[Any]:
        now = self.clock()
        runs = _runs([(c[0].region, c[0].slot) for c in commits])
        args: list[Any] = [self.geometry.store_id, lease, repr(now), repr(now + self.lease_s), self.dirs, release, len(runs)]
        for a, b in runs:
            first = commits[a][0]
            args += [first.region, first.gen, first.slot, b - a, b"".join(c[1] for c in commits[a:b]),
                     b"".join(c[2] for c in commits[a:b])]
        gruns = _runs(give_up)
        args.append(len(gruns))
        for a, b in gruns:
            args += [give_up[a][0], give_up[a][1], b - a]
        args.append(len(refill))
        for pb, want, now_needed in refill:
            args += [pb, want, int(now_needed)]
        return args

    def release_all(self) -> int:
        """Give every idle lease of this process back (on close): its unused slots are
        not held until they expire. A lease whose writer is mid-batch is kept (giving its
        slots away while its pwritev may still land could overwrite another's page): it
        expires. Returns how many were kept."""
        with self._lock:
            stocks = list(self._stocks.values())
        kept = 0
        for st in stocks:
            if not st.lock.acquire(blocking=False):
                kept += 1
                continue
            try:
                for shard in range(self.geometry.shards):
                    self.index.script("COMMIT", self._keys[shard], self._commit_args(st.lease, (), (), (), 1))
            finally:
                st.lock.release()
        return kept

    # -- pages -----------------------------------------------------------------------

    def unlink_members(self, shard: int, members: Sequence[tuple[int, int, bytes]]) -> int:
        """Stop counting members (region, slot, field) whose entry is not theirs."""
        if not members:
            return 0
        args: list[Any] = [self.geometry.store_id]
        for m in members:
            args.extend(m)
        return int(self.index.script("UNLINK_MEMBERS", self._keys[shard], args))

    def drop(self, shard: int, entries: Sequence[tuple[bytes, bytes]]) -> int:
        """Drop entries that still hold the value seen (b'' = any)."""
        if not entries:
            return 0
        args: list[Any] = [self.geometry.store_id]
        for field, seen in entries:
            args += [field, seen]
        return int(self.index.script("DROP", self._keys[shard], args))

    # -- files -------------------------------------------------------------------------

    def add_file(self, shard: int) -> tuple[int, str, str]:
        """Start a new page file: (file number, directory id, uid)."""
        f, d, uid = self.index.script("ADD_FILE", self._keys[shard], [self.geometry.store_id, repr(self.clock()), self.dirs])
        return int(f), _text(d), _text(uid)

    def file_ready(self, shard: int, file_no: int, uid: str) -> bool:
        return bool(self.index.script("FILE_READY", self._keys[shard], [self.geometry.store_id, file_no, uid]))

    def lose_file(self, shard: int, file_no: int, uid: str, max_work: int) -> tuple[int, int]:
        """Forget a page file that is gone: (regions still to do, pages dropped)."""
        left, pages = self.index.script("LOSE_FILE", self._keys[shard], [self.geometry.store_id, file_no, uid, max_work])
        return int(left), int(pages)

    def files(self, shard: int) -> dict[int, tuple[str, str, str]]:
        """File records: number -> (directory id, uid, state)."""
        raw = self.index.hgetall(self.key(shard, "files"))
        out = {}
        for k, v in raw.items():
            d, uid, st, _ = _text(v).split("|", 3)
            out[int(k)] = (d, uid, st)
        return out

    # -- housekeeping ------------------------------------------------------------------

    def sweep(self, shard: int, free_target: float, max_work: int) -> tuple[int, int, int, int, int, list[int]]:
        """(leases expired, slots given back, regions evicted, pages evicted, regions
        draining, holes in our directories whose space the caller is to punch out and
        report with :meth:`punched`)."""
        now = self.clock()
        with self._lock:
            stocks = list(self._stocks.values())
        args: list[Any] = [self.geometry.store_id, repr(now), repr(now + self.lease_s), self.dirs, repr(free_target), max_work,
                           repr(now - self.lease_s), len(stocks), *(st.lease for st in stocks)]
        raw = self.index.script("SWEEP", self._keys[shard], args)
        out = [int(x) for x in raw[:6]]
        punch = [int(x) for x in raw[6 : 6 + out[5]]]
        gone = {_text(x) for x in raw[6 + out[5] :]}
        for st in stocks:
            if st.lease in gone:
                with st.lock:  # expired meanwhile: its slots may be someone else's by now
                    st.ranges[shard] = []
                    st.renewed.pop(shard, None)
            else:
                st.renewed[shard] = now
        return out[0], out[1], out[2], out[3], out[4], punch

    def punched(self, shard: int, regions: Sequence[int]) -> int:
        """These holes' space is punched out: they may be allocated again."""
        if not regions:
            return 0
        return int(self.index.script("PUNCHED", self._keys[shard], [self.geometry.store_id, *regions]))

    def counts(self, shard: int) -> dict[str, int]:
        names = ("capacity_regions", "allocated_regions", "regions", "used_regions", "free_regions", "hole_regions",
                 "punch_regions", "draining_regions", "leases", "files", "next_file")
        out = self.index.script("COUNTS", self._keys[shard], [self.geometry.store_id])
        return dict(zip(names, (int(x) for x in out)))

    def keys(self, shard: int) -> list[str]:
        """Every key of a shard, in the order its scripts take them."""
        return self._keys[shard]

    def key(self, shard: int, name: str) -> str:
        """One key of a shard by its name in ``schema.SHARD_KEYS``."""
        return self._keys[shard][SHARD_KEYS.index(name)]


def _runs(slots: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``slots`` that are consecutive slots of one region."""
    out: list[tuple[int, int]] = []
    start = 0
    for k in range(1, len(slots) + 1):
        if k == len(slots) or slots[k][0] != slots[k - 1][0] or slots[k][1] != slots[k - 1][1] + 1:
            out.append((start, k))
            start = k
    return out


def _commit_result(out: Sequence[Any]) -> CommitResult:
    flags, evicted, pages, cap, n = (int(x) for x in out[:5])
    status = [int(x) for x in out[5 : 5 + n]]
    k = 5 + n
    nfresh = int(out[k])
    fresh = [int(x) for x in out[k + 1 : k + 1 + nfresh]]
    rest = [int(x) for x in out[k + 1 + nfresh :]]
    stock = [Range(*rest[j : j + 5]) for j in range(0, len(rest), 5)]
    return CommitResult(status, stock, fresh, bool(flags & 1), bool(flags & 4), evicted, pages, cap)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def shard_conf(geometry: Geometry, shard: int, capacity: int) -> dict[str, Any]:
    """A new shard's conf hash."""
    return {
        "store": geometry.store_id,
        "cap": geometry.capacity_share(capacity, shard),
        "alloc": 0,
        "rb": geometry.region_bytes,
        "rpf": geometry.regions_per_file,
        "shards": geometry.shards,
        "next_file": shard,
        "uid": 0,
        "creating": 0,
    }

