-- sweep: housekeeping of a shard, a bounded step at a time.

local MIN_KEEP_CAP = 4  -- a shard of at least this many regions keeps one free, however small

-- args: store id, now, deadline for the caller's leases, the caller's directory ids
-- (csv), the fraction of the capacity to keep free, most regions/leases handled, forget
-- file creations started before this, n, then the caller's lease ids (renewed).
-- Expires leases, shrinks to capacity (free regions first, then the coldest; a region
-- with leased slots drains), keeps free regions ahead of need once the shard cannot grow.
-- Answers {leases expired, slots given back, regions evicted, pages evicted, regions
-- draining, n, holes to punch (in the caller's directories)..., then the caller's lease
-- ids that are gone (expired: their writers must not trust their stocks)}.
local function sweep(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local now, deadline, maxw, cutoff = tonumber(args[2]), args[3], tonumber(args[6]), tonumber(args[7])
  if not conf.pinned then  -- a store made before regions under lease were counted: count them once
    local n = 0
    for _, v in ipairs(redis.call('HVALS', K_REGIONS)) do
      local _, _, _, _, leased = struct.unpack(REGION_FMT, v)
      if leased > 0 then n = n + 1 end
    end
    conf.pinned = n
  end
  -- free regions kept ready once the shard is full; a shard of a few regions keeps one,
  -- so that the commit after the open region fills finds it (one round trip a write)
  local keep = math.floor(tonumber(args[5]) * conf.cap)
  if keep < 1 and conf.cap >= MIN_KEEP_CAP then keep = 1 end
  set_reach(args[4])
  local missing = {}
  for i = 9, 8 + tonumber(args[8]) do
    if redis.call('HEXISTS', K_LEASES, args[i]) == 1 then redis.call('ZADD', K_DEADLINES, deadline, args[i])
    else missing[#missing + 1] = args[i] end
  end
  local expired, slots = 0, 0
  for _, lease_id in ipairs(redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, maxw)) do
    for _, x in ipairs(parse_ranges(redis.call('HGET', K_LEASES, lease_id))) do
      if x[3] > 0 then give_back(x[1], x[2], x[3], false); slots = slots + x[3] end
    end
    redis.call('HDEL', K_LEASES, lease_id); redis.call('ZREM', K_DEADLINES, lease_id)
    expired = expired + 1
  end
  if tonumber(redis.call('HGET', K_CONF, 'creating') or '0') > 0 then
    local all = redis.call('HGETALL', K_FILES)
    for k = 1, #all, 2 do
      local rec = parse_file(all[k + 1])
      if rec.state == CREATING and tonumber(rec.since) < cutoff then
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
  for _, lease_id in ipairs(missing) do out[#out + 1] = lease_id end
  return out
end

-- args: store id, then regions whose space the caller punched out of their files.
-- They become allocatable holes. Answers how many.
local function punched(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local n = 0
  for i = 2, #args do
    if redis.call('ZREM', K_PUNCH, args[i]) == 1 then
      redis.call('ZADD', K_HOLES, place(tonumber(args[i])), args[i])
      n = n + 1
    end
  end
  return n
end

register('sweep', sweep)
register('punched', punched)
