-- core: what every function starts with, and what one call keeps while it runs.
--
-- The library's locals outlive a call (a function library is loaded once), so each
-- function starts with begin(), which binds the shard's keys and resets the call's
-- state: the region records read so far, which of them changed, what was dropped.

local SCAN = 32  -- candidates looked at when choosing a region: bounds every choice

local conf        -- the shard's conf: cap, alloc (as read, and as changed), rb, rpf,
                  -- pinned: regions with a slot under lease (nil: not counted yet)
local regions     -- region id -> record table, or false (none)
local dirty       -- region id -> true: record to write back
local reach       -- directory id -> true: the caller's directories
local fstate      -- file number -> whether its regions are usable by the caller
local zeroed      -- region id -> members to zero (pages that left their slots)
local unlinked    -- region id -> record: regions that lost pages, to settle
local pages_dropped, flags, evicted, fresh

-- Start a call on a shard: false if the shard does not belong to the store the caller
-- attached to (dropped, re-created, or the index was lost).
local function begin(keys, store)
  bind_keys(keys)
  regions, dirty, reach, fstate, zeroed, unlinked, fresh = {}, {}, {}, {}, {}, {}, {}
  pages_dropped, flags, evicted = 0, 0, 0
  local v = redis.call('HMGET', K_CONF, 'store', 'cap', 'alloc', 'rb', 'rpf', 'pinned')
  if v[1] ~= store then return false end
  conf = {cap = tonumber(v[2]), alloc = tonumber(v[3]), rb = tonumber(v[4]), rpf = tonumber(v[5]), pinned = tonumber(v[6])}
  conf.alloc0, conf.pinned0 = conf.alloc, conf.pinned
  return true
end
local function stale() return redis.error_reply(STALE) end

local function save_conf()
  if conf.alloc ~= conf.alloc0 then redis.call('HSET', K_CONF, 'alloc', conf.alloc) end
  if conf.pinned ~= conf.pinned0 then redis.call('HSET', K_CONF, 'pinned', conf.pinned) end
end

-- a region's record (cached for the call), or nil
local function region(r)
  local g = regions[r]
  if g == nil then
    local v = redis.call('HGET', K_REGIONS, r)
    if not v then regions[r] = false; return nil end
    local pb, gen, fill, live, leased, state = struct.unpack(REGION_FMT, v)
    g = {pb = pb, gen = gen, fill = fill, live = live, leased = leased, state = state, pinned = leased > 0}
    regions[r] = g
  end
  return g or nil
end
local function touch(r) dirty[r] = true end
-- count a region in or out of conf.pinned as its leased slots come and go (every change
-- of a record is written by flush, or, for a record removed, passes here first)
local function note_pin(g)
  local now_pinned = g.leased > 0
  if now_pinned ~= g.pinned then
    g.pinned = now_pinned
    if conf.pinned then conf.pinned = conf.pinned + (now_pinned and 1 or -1) end
  end
end
local function flush()
  for r in pairs(dirty) do
    local g = regions[r]
    if g then
      note_pin(g)
      redis.call('HSET', K_REGIONS, r, struct.pack(REGION_FMT, g.pb, g.gen, g.fill, g.live, g.leased, g.state))
    end
  end
end

local function slots_of(pb) return math.floor(conf.rb / (math.ceil(pb / ALIGN) * ALIGN)) end
-- placement order of regions: the first region of every file, then the second...
local function place(r) return (r % conf.rpf) * 16777216 + math.floor(r / conf.rpf) end

-- which regions the caller can use: those in ready files of its directories (csv)
local function set_reach(csv) for d in string.gmatch(csv, '[^,]+') do reach[d] = true end end
local function usable(r)
  local f = math.floor(r / conf.rpf)
  local ok = fstate[f]
  if ok == nil then
    local rec = parse_file(redis.call('HGET', K_FILES, f))
    ok = rec ~= nil and rec.state == READY and reach[rec.dir] == true
    fstate[f] = ok
  end
  return ok
end

local function is_open(r, g) return tonumber(redis.call('HGET', K_OPEN, g.pb) or '-1') == r end
