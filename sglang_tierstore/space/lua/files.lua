-- files: a page file's life in the index: creating, ready, lost, forgotten.

-- args: store id, now, the caller's directory ids (csv, in order of preference), a uid
-- (random: an index rolled back by a failover never issues a file's identity twice).
-- Starts a new page file (state CREATING) in the caller's directory holding the fewest
-- files. Answers {file number, directory id, uid}.
local function add_file(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local count, order = {}, {}
  for d in string.gmatch(args[3], '[^,]+') do count[d] = 0; order[#order + 1] = d end
  local all = redis.call('HGETALL', K_FILES)
  for k = 1, #all, 2 do
    local rec = parse_file(all[k + 1])
    if rec.uid == args[4] then return {tonumber(all[k]), rec.dir, rec.uid} end  -- this call, sent again
    if rec.state ~= LOST and count[rec.dir] then count[rec.dir] = count[rec.dir] + 1 end
  end
  local best = order[1]
  for _, d in ipairs(order) do if count[d] < count[best] then best = d end end
  local f = tonumber(redis.call('HGET', K_CONF, 'next_file'))
  redis.call('HSET', K_CONF, 'next_file', f + tonumber(redis.call('HGET', K_CONF, 'shards')))
  local uid = args[4]
  redis.call('HSET', K_FILES, f, file_value({dir = best, uid = uid, state = CREATING, since = args[2]}))
  redis.call('HINCRBY', K_CONF, 'creating', 1)
  return {f, best, uid}
end

-- args: store id, file number, its uid. The file exists on disk: its regions become
-- holes (allocatable). Answers 1 (also when sent again), or 0 if the creation was
-- forgotten meanwhile (too slow: the caller removes the file).
local function file_ready(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local f = tonumber(args[2])
  local rec = parse_file(redis.call('HGET', K_FILES, f))
  if rec and rec.uid == args[3] and rec.state == READY then return 1 end
  if not rec or rec.uid ~= args[3] or rec.state ~= CREATING then return 0 end
  rec.state = READY
  redis.call('HSET', K_FILES, f, file_value(rec))
  redis.call('HINCRBY', K_CONF, 'creating', -1)
  for i = 0, conf.rpf - 1 do
    local r = f * conf.rpf + i
    redis.call('HSET', K_REGIONS, r, struct.pack(REGION_FMT, 0, 0, 0, 0, 0, HOLE))
    redis.call('ZADD', K_HOLES, place(r), r)
  end
  return 1
end

-- args: store id, file number, its uid, most regions handled.
-- The file is gone (deleted, replaced, or its directory retired): its pages are
-- dropped, its regions leave the store and its capacity comes back. Call again until
-- it answers {0, ...}. Answers {regions left, pages dropped}.
local function lose_file(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local f, maxw = tonumber(args[2]), tonumber(args[4])
  local rec = parse_file(redis.call('HGET', K_FILES, f))
  if not rec or rec.uid ~= args[3] then return {0, 0} end
  if rec.state == CREATING then
    redis.call('HDEL', K_FILES, f); redis.call('HINCRBY', K_CONF, 'creating', -1)
    return {0, 0}
  end
  if rec.state ~= LOST then
    rec.state = LOST
    redis.call('HSET', K_FILES, f, file_value(rec))
  end
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
        note_pin(g)
        redis.call('HDEL', K_REGIONS, r)
        regions[r] = false
        work = work + 1
      end
    end
  end
  if left == 0 then redis.call('HDEL', K_FILES, f) end
  flush(); save_conf()
  return {left, pages_dropped}
end

register('add_file', add_file)
register('file_ready', file_ready)
register('lose_file', lose_file)
