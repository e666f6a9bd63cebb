-- regions: what a region holds (members), and how it moves between states.
--
-- USED (in lru) holds pages of one size; FREE (in free) is allocated and empty; HOLE (in
-- holes, or in punch while its disk space is still to be punched out) is not allocated;
-- DRAINING (in drain) is leaving while writers still hold some of its slots.

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

-- whether an entry value names this slot of this generation of region r
local function names_slot(v, r, gen, slot)
  if not v or #v < ENTRY_HEAD_BYTES then return false end
  local er, eg, es = struct.unpack(ENTRY_HEAD, v)
  return er == r and eg == gen and es == slot
end

-- a page leaves its slot (its entry is gone): the region stops counting it; its member
-- is zeroed, and the region settled, by finish_unlinks
local function unlink_page(r, g, slot)
  g.live = g.live - 1; touch(r); unlinked[r] = g
  local z = zeroed[r]
  if not z then z = {}; zeroed[r] = z end
  z[#z + 1] = {slot, ZERO}
end

-- delete the entries of a region's pages (those that still name their slot here)
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
      if names_slot(vals[k - a + 1], r, g.gen, slots[k]) then del[#del + 1] = fields[k] end
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
-- its directory has punched its space out (punched)
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

-- the least recently used region with nothing under lease
local function coldest(need_usable)
  for _, rs in ipairs(redis.call('ZRANGE', K_LRU, 0, SCAN - 1)) do
    local r = tonumber(rs)
    local g = region(r)
    if g and g.leased == 0 and (not need_usable or usable(r)) then return r, g end
  end
  return nil, nil
end

-- the first usable region of a placement set, taken out of it
local function take(zkey)
  for _, rs in ipairs(redis.call('ZRANGE', zkey, 0, SCAN - 1)) do
    local r = tonumber(rs)
    if usable(r) then redis.call('ZREM', zkey, rs); return r end
  end
  return nil
end

-- an empty region for new pages: free, else a hole (capacity allowing), else (if the
-- pages are needed now, not a stock for later) the coldest region's
local function fresh_region(may_evict, now)
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
    drain_region(c, region(c), now)
    evicted = evicted + 1
  end
  return nil
end
