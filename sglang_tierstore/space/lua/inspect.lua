-- inspect: consistent snapshots for check() and counts for stats; check's one repair.

-- args: store id, then region ids. Answers per region: {record or '', members or '',
-- lru score or '', in free, in holes, in punch, in drain (0/1), open region of its page
-- size or '', n, the entry values of its n member fields ('' if none)}, then the lease
-- table {n, id, ranges, ...}.
local function snapshot_regions(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local out = {}
  for i = 2, #args do
    local r = args[i]
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
    if #rec == REGION_BYTES then  -- a record check() can read (it reports the others)
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
end

-- args: store id, then entry fields. Answers per field: {value or '', its region's
-- record or '', the member at its slot or ''}.
local function snapshot_entries(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local out = {}
  for i = 2, #args do
    local v = redis.call('HGET', K_ENTRIES, args[i]) or ''
    local rec, member = '', ''
    if #v >= ENTRY_HEAD_BYTES then
      local r, gen, slot = struct.unpack(ENTRY_HEAD, v)
      rec = redis.call('HGET', K_REGIONS, r) or ''
      local blob = redis.call('HGET', K_MEMBERS, r) or ''
      member = string.sub(blob, slot * FIELD + 1, (slot + 1) * FIELD)
    end
    out[#out + 1] = v; out[#out + 1] = rec; out[#out + 1] = member
  end
  return out
end

-- args: store id. Answers {capacity, allocated, regions, in use, free, holes, to punch,
-- draining, leases, files, next file, regions with leased slots (-1: not counted yet)}.
local function counts(keys, args)
  if not begin(keys, args[1]) then return stale() end
  return {conf.cap, conf.alloc, redis.call('HLEN', K_REGIONS), redis.call('ZCARD', K_LRU),
          redis.call('ZCARD', K_FREE), redis.call('ZCARD', K_HOLES), redis.call('ZCARD', K_PUNCH),
          redis.call('ZCARD', K_DRAIN), redis.call('HLEN', K_LEASES), redis.call('HLEN', K_FILES),
          tonumber(redis.call('HGET', K_CONF, 'next_file')), conf.pinned or -1}
end

-- args: store id, then triples: region, slot, entry field.
-- check(fix=True): a member whose entry is gone or names another slot (its entry was
-- dropped without naming its slot: unparsable) stops counting as a live page.
-- Answers how many were unlinked.
local function unlink_members(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local n, seen = 0, {}
  for i = 2, #args, 3 do
    local r, slot, field = tonumber(args[i]), tonumber(args[i + 1]), args[i + 2]
    local g = region(r)
    local blob = redis.call('HGET', K_MEMBERS, r) or ''
    local once = not seen[r .. ':' .. slot]
    seen[r .. ':' .. slot] = true
    if once and g and g.state == USED and string.sub(blob, slot * FIELD + 1, (slot + 1) * FIELD) == field
        and not names_slot(redis.call('HGET', K_ENTRIES, field), r, g.gen, slot) then
      unlink_page(r, g, slot)
      n = n + 1
    end
  end
  finish_unlinks()
  flush()
  return n
end

register('snapshot_regions', snapshot_regions, true)
register('snapshot_entries', snapshot_entries, true)
register('counts', counts, true)
register('unlink_members', unlink_members)
