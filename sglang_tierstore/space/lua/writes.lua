-- writes: a writer's lease and commit, and dropping pages.
--
-- lease and commit answer {flags, regions evicted, pages evicted, shard capacity
-- (regions), n, status of each committed page (n), n fresh, fresh regions..., then the
-- lease's stock: (region, start, count, page bytes, generation) per range}. Fresh
-- regions were holes: the caller gives them disk space before use.

local function reply(status, ranges)
  local out = {flags, evicted, pages_dropped, conf.cap, #status}
  for _, s in ipairs(status) do out[#out + 1] = s end
  out[#out + 1] = #fresh
  for _, r in ipairs(fresh) do out[#out + 1] = r end
  return stock_reply(out, ranges)
end

-- args: store id, lease id, now, lease deadline, the caller's directory ids (csv),
-- page bytes, slots wanted. Leases slots of that size up to what is wanted, evicting
-- the coldest region if none is free (the writer needs them now).
local function lease(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local lease_id, now = args[2], tonumber(args[3])
  set_reach(args[5])
  local ranges = parse_ranges(redis.call('HGET', K_LEASES, lease_id))
  restock(ranges, tonumber(args[6]), tonumber(args[7]), now, true)
  save_lease(lease_id, ranges, args[4])
  flush(); save_conf()
  return reply({}, ranges)
end

-- args: store id, lease id, now, lease deadline, the caller's directory ids (csv),
-- page bytes and slots wanted in stock afterwards, then n runs written, per run: region,
-- its generation as the writer leased it, first slot, count, the entry fields of its
-- pages (FIELD bytes each, concatenated), their entry tails (checksum and tag, TAIL bytes
-- each); then n runs written in vain, per run: region, first slot, count.
-- Publishes the pages whose slots the lease still holds in a region of that generation
-- (status STORED; EXISTS for a key stored already, whose slot is then dead; NOT_STORED
-- otherwise), gives the slots written in vain back, and tops the stock up for the next
-- batch from free space only (never evicting for a stock ahead of need), and only while
-- under a quarter of the shard's regions hold leased slots: one call per batch, so a
-- write costs one round trip once the writer holds a stock.
local function commit(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local lease_id, now = args[2], tonumber(args[3])
  set_reach(args[5])
  local ranges = parse_ranges(redis.call('HGET', K_LEASES, lease_id))
  local runs, fields, i = {}, {}, 9
  for k = 1, tonumber(args[8]) do
    local r, gen, s0, n, fblob = tonumber(args[i]), tonumber(args[i + 1]), tonumber(args[i + 2]), tonumber(args[i + 3]), args[i + 4]
    local first = #fields + 1
    for j = 0, n - 1 do fields[first + j] = string.sub(fblob, j * FIELD + 1, (j + 1) * FIELD) end
    runs[k] = {r, s0, n, first, fblob, args[i + 5], gen}
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
      local st = NOT_STORED
      if got[j] then
        taken = taken + 1
        local f = fields[first + j]
        if present[f] then
          st = EXISTS  -- stored already (or earlier in this batch): this slot is dead
          close_stretch(j)
        else
          present[f] = true
          new[#new + 1] = f
          new[#new + 1] = struct.pack(ENTRY_HEAD, r, g.gen, s0 + j) .. string.sub(tblob, j * TAIL + 1, (j + 1) * TAIL)
          st = STORED
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
  for c = 1, tonumber(args[i]) do
    local r, s0, n = tonumber(args[i + 1]), tonumber(args[i + 2]), tonumber(args[i + 3])
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
  if may_stock_ahead() then restock(ranges, tonumber(args[6]), tonumber(args[7]), now, false) end
  save_lease(lease_id, ranges, args[4])
  flush(); save_conf()
  return reply(status, ranges)
end

-- args: store id, lease id. The writer is done (it closes, or its thread exited): every
-- slot of its lease goes back.
local function release(keys, args)
  if not begin(keys, args[1]) then return stale() end
  for _, x in ipairs(parse_ranges(redis.call('HGET', K_LEASES, args[2]))) do
    if x[3] > 0 then give_back(x[1], x[2], x[3], true) end
  end
  redis.call('HDEL', K_LEASES, args[2]); redis.call('ZREM', K_DEADLINES, args[2])
  flush(); save_conf()
  return 1
end

-- args: store id, lease id, lease deadline. An idle writer gives back its slots in
-- draining regions, so that they can leave. Answers the stock it keeps (as lease does).
local function release_draining(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local kept = {}
  for _, x in ipairs(parse_ranges(redis.call('HGET', K_LEASES, args[2]))) do
    local g = region(x[1])
    if x[3] > 0 and g and g.state == DRAINING then give_back(x[1], x[2], x[3], true) else kept[#kept + 1] = x end
  end
  save_lease(args[2], kept, args[3])
  flush(); save_conf()
  return stock_reply({}, kept)
end

-- args: store id, then pairs: entry field, the value the caller saw ('' = any).
-- Drops entries that still hold that value; their slots are dead (their region is free
-- again once nothing in it lives). Answers how many were dropped.
local function drop(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local n = 0
  for i = 2, #args, 2 do
    local field, seen = args[i], args[i + 1]
    local v = redis.call('HGET', K_ENTRIES, field)
    if v and (seen == '' or v == seen) then
      redis.call('HDEL', K_ENTRIES, field)
      n = n + 1
      if #v >= ENTRY_HEAD_BYTES then
        local r, gen, slot = struct.unpack(ENTRY_HEAD, v)
        local g = region(r)
        if g and g.state == USED and g.gen == gen then unlink_page(r, g, slot) end
      end
    end
  end
  finish_unlinks()
  flush()
  return n
end

register('lease', lease)
register('commit', commit)
register('release', release)
register('release_draining', release_draining)
register('drop', drop)
