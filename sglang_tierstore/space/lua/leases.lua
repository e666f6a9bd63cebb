-- leases: slots handed to one writer (ranges of consecutive slots), taken back when it
-- commits them, gives them up, or stops renewing the lease.

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
      r = fresh_region(may_evict, now)
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

-- at most this share of a shard's regions hold slots under lease before stocks stop
-- being topped up ahead of need: idle or dead writers' stocks never pin a small store
local PIN_SHARE = 4
local function may_stock_ahead()
  for r in pairs(dirty) do if regions[r] then note_pin(regions[r]) end end  -- this call's changes so far
  return conf.pinned == nil or conf.pinned < math.max(1, math.floor(conf.cap / PIN_SHARE))
end

-- top a lease up to want slots of page size pb
local function restock(ranges, pb, want, now, may_evict)
  local have = 0
  for _, x in ipairs(ranges) do
    local g = region(x[1])
    if g and g.pb == pb then have = have + x[3] end
  end
  if have < want then lease_more(ranges, pb, want - have, now, may_evict) end
end

local function save_lease(lease, ranges, deadline)
  local s = format_ranges(ranges)
  if s == '' then
    redis.call('HDEL', K_LEASES, lease); redis.call('ZREM', K_DEADLINES, lease)
  else
    redis.call('HSET', K_LEASES, lease, s); redis.call('ZADD', K_DEADLINES, deadline, lease)
  end
end

-- what a lease holds, as a writer's stock: (region, start, count, page bytes, generation)
local function stock_reply(out, ranges)
  for _, x in ipairs(ranges) do
    if x[3] > 0 then
      local g = region(x[1])
      out[#out + 1] = x[1]; out[#out + 1] = x[2]; out[#out + 1] = x[3]; out[#out + 1] = g.pb; out[#out + 1] = g.gen
    end
  end
  return out
end
