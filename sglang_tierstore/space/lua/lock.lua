-- lock: the attach lock's renewal and release (space.attach takes it with SET NX PX).

-- keys: the lock. args: the holder's token, the new expiry (ms). Extends the lock only if
-- this holder still holds it (it may have lapsed and been taken by another). Answers 1 if so.
local function relock(keys, args)
  if redis.call('GET', keys[1]) == args[1] then
    redis.call('SET', keys[1], args[1], 'XX', 'PX', args[2])
    return 1
  end
  return 0
end
register('relock', relock)

-- keys: the lock. args: the holder's token. Deletes the lock only if this holder still
-- holds it. Answers 1 if deleted.
local function unlock(keys, args)
  if redis.call('GET', keys[1]) == args[1] then return redis.call('DEL', keys[1]) end
  return 0
end
register('unlock', unlock)
