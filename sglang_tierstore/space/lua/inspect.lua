-- inspect: consistent snapshots for check() and counts for stats; check's one repair.

-- check()'s snapshots are bounded by work, whatever the page size: a call reads at most
-- args[2] member slots (and the entries they name) and copies at most args[3] bytes of
-- member blobs (a region's blob is measured with HSTRLEN before it is read), and always
-- makes progress (one region part, or one entry); the caller calls again for the rest.

-- args: store id, slot budget, byte budget, then pairs: region, first slot. Answers
-- {parts, then per part: region, first slot, next slot, the blob's slot count (the region
-- is done when they are equal), record or '', the members of those slots, lru score or '', in free,
-- in holes, in punch, in drain (0/1), open region of its page size or '', n, the entry
-- values of its n member fields ('' if none)}, then the lease table {n, id, ranges, ...}.
-- Pairs past the parts answered were not reached.
local function snapshot_regions(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local slots, bytes = tonumber(args[2]), tonumber(args[3])
  local out, parts = {0}, 0
  for i = 4, #args, 2 do
    local r, first = args[i], tonumber(args[i + 1])
    local size = redis.call('HSTRLEN', K_MEMBERS, r)
    if parts > 0 and (slots <= 0 or size > bytes) then break end
    local rec = redis.call('HGET', K_REGIONS, r) or ''
    local blob = size > 0 and redis.call('HGET', K_MEMBERS, r) or ''
    bytes = bytes - #blob
    local total = math.floor(#blob / FIELD)
    local stop = math.min(total, first + math.max(slots, 1))
    slots = slots - (stop - first)
    parts = parts + 1
    out[#out + 1] = r
    out[#out + 1] = first
    out[#out + 1] = stop
    out[#out + 1] = total
    out[#out + 1] = rec
    out[#out + 1] = string.sub(blob, first * FIELD + 1, stop * FIELD)
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
    for k = first, stop - 1 do
      local f = string.sub(blob, k * FIELD + 1, (k + 1) * FIELD)
      if f ~= ZERO then fields[#fields + 1] = f end
    end
    out[#out + 1] = #fields
    for a = 1, #fields, 1000 do
      local vals = redis.call('HMGET', K_ENTRIES, unpack(fields, a, math.min(#fields, a + 999)))
      for _, v in ipairs(vals) do out[#out + 1] = v or '' end
    end
    if stop < total then break end  -- the slot budget ran out inside this region
  end
  out[1] = parts
  local leases = redis.call('HGETALL', K_LEASES)
  out[#out + 1] = #leases / 2
  for _, v in ipairs(leases) do out[#out + 1] = v end
  return out
end

-- args: store id, byte budget, then entry fields. Answers {k, then for each of the first
-- k fields: value or '', its region's record or '', the member at its slot or ''}.
local function snapshot_entries(keys, args)
  if not begin(keys, args[1]) then return stale() end
  local bytes = tonumber(args[2])
  local out, blobs = {0}, {}
  local k = 0
  for i = 3, #args do
    local v = redis.call('HGET', K_ENTRIES, args[i]) or ''
    local rec, member = '', ''
    if #v >= ENTRY_HEAD_BYTES then
      local r, gen, slot = struct.unpack(ENTRY_HEAD, v)
      local blob = blobs[r]
      if not blob then
        local size = redis.call('HSTRLEN', K_MEMBERS, r)
        if k > 0 and size > bytes then break end
        blob = size > 0 and redis.call('HGET', K_MEMBERS, r) or ''
        bytes = bytes - #blob
        blobs[r] = blob
      end
      rec = redis.call('HGET', K_REGIONS, r) or ''
      member = string.sub(blob, slot * FIELD + 1, (slot + 1) * FIELD)
    end
    k = k + 1
    out[#out + 1] = v; out[#out + 1] = rec; out[#out + 1] = member
  end
  out[1] = k
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
