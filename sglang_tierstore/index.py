"""The Redis index: the only module that speaks Redis.

Layout (``P`` = ``redis_prefix``, ``C`` = slot class, i.e. page size in bytes)::

    P:e:<ns>:<key>   string "C:slot:gen:checksum"   a committed page
    P:c:C            hash spf/next/files/pending   class geometry, growth, slots under lease
    P:free:C         list of slot ids              reusable slots
    P:pend:C         zset lease id -> deadline     leases: slots reserved by one write batch
    P:lease:C:<id>   string "slot,slot,..."        the slots of one lease (never evicted)
    P:lru:C          zset entry key -> last use    committed pages, eviction order
    P:bad:C          zset slot -> since            quarantined after a write error
    P:bytes          string                        page-file bytes allocated, all classes
    P:gen            string                        generation counter (seeded from the clock)

Hot path: a probe or a read is one MGET; a write is one RESERVE and one FINISH
script call. Recency updates (ZADD XX) and SWEEP run from housekeeping.

Every call goes through :meth:`RedisIndex._call`: connection trouble raises
:class:`IndexUnavailable` and opens a breaker for ``retry_s``, during which calls
fail at once instead of waiting on timeouts again.
"""

from __future__ import annotations

import threading
import time as mod_time
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sglang_tierstore.errors import IndexUnavailable, TierStoreError
from sglang_tierstore.pagefile import SlotClass

T = TypeVar("T")

EXISTS = -1  # reserve: the key is already committed
FULL = -2  # reserve: no slot could be had
_GEOMETRY_MISMATCH = -3


class Entry(NamedTuple):
    """A committed page as the index holds it."""

    page_bytes: int  # its slot class
    slot: int
    gen: int
    cks: int


def entry_fields(raw: bytes) -> tuple[int, int, int, int]:
    """(slot class, slot, generation, checksum) of a stored value: the read path's parse."""
    c, s, g, k = raw.split(b":")
    return int(c), int(s), int(g), int(k)


def parse_entry(raw: bytes) -> Entry:
    return Entry(*entry_fields(raw))


def format_entry(page_bytes: int, slot: int, gen: int, cks: int) -> bytes:
    return b"%d:%d:%d:%d" % (page_bytes, slot, gen, cks)


# Pops LRU victims until one still has an entry; returns its slot id or nil.
_EVICT_ONE = """
local function evict_one(lru)
  while true do
    local victim = redis.call('ZPOPMIN', lru)
    if #victim == 0 then return nil end
    local v = redis.call('GET', victim[1])
    if v then
      redis.call('DEL', victim[1])
      return string.match(v, '^%d+:(%d+):')
    end
  end
end
"""


class RedisIndex:
    """Key -> slot index, free slots, leases, recency and capacity, in Redis."""

    # KEYS[1] - class hash   KEYS[2] - free list   KEYS[3] - lease zset   KEYS[4] - LRU zset
    # KEYS[5] - allocated bytes   KEYS[6] - generation counter   KEYS[7..] - entry keys
    # ARGV[1] - lease deadline   ARGV[2] - capacity bytes   ARGV[3] - slot size
    # ARGV[4] - slots per file   ARGV[5] - generation seed   ARGV[6] - lease key prefix
    # returns {first generation, pages evicted, r_1..r_n}: r_i = slot id, -1 exists, -2 full;
    #         {-3} if the class was created with another slots-per-file.
    # Reserved slot i (in key order) gets generation first+i-1; the first generation also
    # names the batch's lease, which only FINISH (the writer) or SWEEP (expiry) ends.
    RESERVE = _EVICT_ONE + """
local spf = redis.call('HGET', KEYS[1], 'spf')
if not spf then redis.call('HSET', KEYS[1], 'spf', ARGV[4]); spf = ARGV[4] end
if spf ~= ARGV[4] then return {-3} end
spf = tonumber(spf)
local file_bytes = spf * tonumber(ARGV[3])
local n = #KEYS - 6
local present = redis.call('MGET', unpack(KEYS, 7))
local need = 0
for i = 1, n do if not present[i] then need = need + 1 end end
local got, evicted = {}, 0
if need > 0 then
  got = redis.call('LPOP', KEYS[2], need) or {}
  local nxt = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
  local files = tonumber(redis.call('HGET', KEYS[1], 'files') or '0')
  while #got < need do
    if nxt < files * spf then
      got[#got + 1] = string.format('%d', nxt); nxt = nxt + 1
    elseif tonumber(redis.call('GET', KEYS[5]) or '0') + file_bytes <= tonumber(ARGV[2]) then
      redis.call('INCRBY', KEYS[5], file_bytes); files = files + 1
    else
      local s = evict_one(KEYS[4])
      if not s then break end
      got[#got + 1] = s; evicted = evicted + 1
    end
  end
  redis.call('HSET', KEYS[1], 'next', nxt, 'files', files)
end
local out = {0, evicted}
if #got > 0 then
  if redis.call('EXISTS', KEYS[6]) == 0 then redis.call('SET', KEYS[6], ARGV[5]) end
  local first = redis.call('INCRBY', KEYS[6], #got) - #got + 1
  local lease = string.format('%d', first)
  out[1] = first
  redis.call('SET', ARGV[6] .. lease, table.concat(got, ','))
  redis.call('ZADD', KEYS[3], ARGV[1], lease)
  redis.call('HINCRBY', KEYS[1], 'pending', #got)
end
local j = 0
for i = 1, n do
  if present[i] then
    out[#out + 1] = -1
  elseif got[j + 1] then
    j = j + 1
    out[#out + 1] = tonumber(got[j])
  else
    out[#out + 1] = -2
  end
end
return out
"""

    # KEYS[1] - lease zset   KEYS[2] - free list   KEYS[3] - LRU zset   KEYS[4] - quarantine zset
    # KEYS[5] - class hash   KEYS[6..] - entry keys, one per reserved slot
    # ARGV[1] - now   ARGV[2] - lease key prefix   ARGV[3] - lease id
    # then per slot: ARGV[3i+1] action ('c' commit, 'f' free, 'q' quarantine), slot, value
    # returns per slot: 1 if the key is now stored (by us or a racing writer), else 0.
    #         If the lease was reclaimed (expired), nothing is touched: the slots may be
    #         someone else's by now.
    FINISH = """
local n = #KEYS - 5
local out = {}
if redis.call('ZREM', KEYS[1], ARGV[3]) == 0 then
  for i = 1, n do out[i] = 0 end
  return out
end
local leased = {}
local count = 0
for slot in string.gmatch(redis.call('GET', ARGV[2] .. ARGV[3]) or '', '%d+') do
  leased[slot] = true; count = count + 1
end
redis.call('DEL', ARGV[2] .. ARGV[3])
redis.call('HINCRBY', KEYS[5], 'pending', -count)
local stored = redis.call('MGET', unpack(KEYS, 6))
local mset, lru, free, bad = {}, {}, {}, {}
for i = 1, n do
  local action, slot, value = ARGV[3 * i + 1], ARGV[3 * i + 2], ARGV[3 * i + 3]
  local ok = 0
  if leased[slot] then
    leased[slot] = nil
    if action == 'c' then
      ok = 1
      if stored[i] then
        free[#free + 1] = slot
      else
        stored[i] = value  -- a key twice in one batch: the first one wins
        mset[#mset + 1] = KEYS[5 + i]; mset[#mset + 1] = value
        lru[#lru + 1] = ARGV[1]; lru[#lru + 1] = KEYS[5 + i]
      end
    elseif action == 'q' then
      bad[#bad + 1] = ARGV[1]; bad[#bad + 1] = slot
    else
      free[#free + 1] = slot
    end
  end
  out[i] = ok
end
for slot in pairs(leased) do free[#free + 1] = slot end  -- leased but not reported: free it
if #mset > 0 then redis.call('MSET', unpack(mset)); redis.call('ZADD', KEYS[3], unpack(lru)) end
if #free > 0 then redis.call('RPUSH', KEYS[2], unpack(free)) end
if #bad > 0 then redis.call('ZADD', KEYS[4], unpack(bad)) end
return out
"""

    # KEYS[1..] - entry keys   ARGV[1] - key prefix
    # ARGV[1 + i] - the value the caller saw for KEYS[i] ('' = whatever it is)
    # returns how many entries were dropped (their slots go back to the free list)
    DROP = """
local n = 0
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v and (ARGV[i + 1] == '' or v == ARGV[i + 1]) then
    local cls, slot = string.match(v, '^(%d+):(%d+):')
    redis.call('DEL', k)
    if cls then  -- an unparsable value names no slot: the key just goes
      redis.call('ZREM', ARGV[1] .. ':lru:' .. cls, k)
      redis.call('RPUSH', ARGV[1] .. ':free:' .. cls, slot)
    end
    n = n + 1
  end
end
return n
"""

    # KEYS[1] - class hash   KEYS[2] - free list   KEYS[3] - lease zset   KEYS[4] - LRU zset
    # KEYS[5] - allocated bytes   KEYS[6] - quarantine zset
    # ARGV[1] - now   ARGV[2] - slot size   ARGV[3] - capacity bytes   ARGV[4] - free slots wanted
    # ARGV[5] - most leases/slots handled per kind   ARGV[6] - release quarantined slots older than this
    # ARGV[7] - lease key prefix
    # returns {slots reclaimed from expired leases, pages evicted, slots released from quarantine}
    SWEEP = _EVICT_ONE + """
local maxw = tonumber(ARGV[5])
local reclaimed = 0
for _, lease in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[1], 'LIMIT', 0, maxw)) do
  for slot in string.gmatch(redis.call('GET', ARGV[7] .. lease) or '', '%d+') do
    redis.call('RPUSH', KEYS[2], slot); reclaimed = reclaimed + 1
  end
  redis.call('DEL', ARGV[7] .. lease)
  redis.call('ZREM', KEYS[3], lease)
end
if reclaimed > 0 then redis.call('HINCRBY', KEYS[1], 'pending', -reclaimed) end
local released = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', ARGV[6], 'LIMIT', 0, maxw)
for _, s in ipairs(released) do redis.call('ZREM', KEYS[6], s); redis.call('RPUSH', KEYS[2], s) end
local evicted = 0
local spf = tonumber(redis.call('HGET', KEYS[1], 'spf') or '0')
if spf > 0 then
  local nxt = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
  local files = tonumber(redis.call('HGET', KEYS[1], 'files') or '0')
  local used = tonumber(redis.call('GET', KEYS[5]) or '0')
  if nxt >= files * spf and used + spf * tonumber(ARGV[2]) > tonumber(ARGV[3]) then
    local want = math.min(tonumber(ARGV[4]) - redis.call('LLEN', KEYS[2]), maxw)
    while evicted < want do
      local s = evict_one(KEYS[4])
      if not s then break end
      redis.call('RPUSH', KEYS[2], s)
      evicted = evicted + 1
    end
  end
end
return {reclaimed, evicted, #released}
"""

    def __init__(
        self,
        url: str,
        prefix: str,
        timeout_s: float,
        retry_s: float,
        clock: Callable[[], float] = mod_time.time,
    ) -> None:
        self.prefix = prefix
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = 0.0
        self._down_lock = threading.Lock()
        # One immediate retry on a fresh connection covers a Redis restart
        # (stale pooled sockets); the breaker bounds everything else.
        self._r = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
            retry_on_timeout=False,
        )
        self._reserve = self._r.register_script(self.RESERVE)
        self._finish = self._r.register_script(self.FINISH)
        self._drop = self._r.register_script(self.DROP)
        self._sweep = self._r.register_script(self.SWEEP)

    # -- naming ---------------------------------------------------------------

    def entry_key(self, ns: str, key: str) -> str:
        return f"{self.prefix}:e:{ns}:{key}"

    def _class_keys(self, cls: SlotClass) -> tuple[str, str, str, str, str, str]:
        c, p = cls.name, self.prefix
        return (f"{p}:c:{c}", f"{p}:free:{c}", f"{p}:pend:{c}", f"{p}:lru:{c}", f"{p}:bytes", f"{p}:bad:{c}")

    def _lease_prefix(self, cls: SlotClass) -> str:
        return f"{self.prefix}:lease:{cls.name}:"

    # -- failure handling -----------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker is open after a failure."""
        return self._clock() >= self._down_until

    def _call(self, fn: Callable[[], T]) -> T:
        if not self.available:
            raise IndexUnavailable("redis unavailable (backing off after a failure)")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self._trip()
            raise IndexUnavailable(f"redis unavailable: {e}") from e
        except redis.ResponseError as e:
            msg = str(e)
            if msg.startswith(("LOADING", "BUSY", "MASTERDOWN", "OOM", "READONLY", "NOREPLICAS")):
                self._trip()
                raise IndexUnavailable(f"redis not serving: {msg}") from e
            raise TierStoreError(f"redis error: {msg}") from e

    def _trip(self) -> None:
        with self._down_lock:
            self._down_until = self._clock() + self.retry_s

    # -- hot path -------------------------------------------------------------

    def lookup(self, entry_keys: Sequence[str]) -> list[Optional[bytes]]:
        """Raw entry values (None = absent): one MGET."""
        if not entry_keys:
            return []
        return self._call(lambda: self._r.mget(entry_keys))

    def reserve(self, cls: SlotClass, entry_keys: Sequence[str], lease_s: float, capacity: int) -> tuple[int, int, list[int]]:
        """Reserve a slot per key: (first generation, pages evicted, [slot | EXISTS | FULL])."""
        now = self._clock()
        keys = [*self._class_keys(cls)[:5], f"{self.prefix}:gen", *entry_keys]
        args = [repr(now + lease_s), capacity, cls.slot_size, cls.slots_per_file, int(now * 1e6), self._lease_prefix(cls)]
        out = self._call(lambda: self._reserve(keys=keys, args=args))
        if out[0] == _GEOMETRY_MISMATCH:
            raise TierStoreError(f"slot class {cls.name} exists with another slots_per_file")
        return int(out[0]), int(out[1]), [int(x) for x in out[2:]]

    def finish(self, cls: SlotClass, lease: int, ops: Sequence[tuple[str, str, int, bytes]]) -> list[bool]:
        """End a write's lease: per slot (entry key, 'c'ommit|'f'ree|'q'uarantine, slot, value)."""
        if not ops:
            return []
        ck = self._class_keys(cls)
        keys = [ck[2], ck[1], ck[3], ck[5], ck[0], *(op[0] for op in ops)]
        args: list[Any] = [repr(self._clock()), self._lease_prefix(cls), lease]
        for _, action, slot, value in ops:
            args += [action, slot, value]
        return [bool(x) for x in self._call(lambda: self._finish(keys=keys, args=args))]

    # -- housekeeping -----------------------------------------------------------

    def drop(self, entries: Sequence[tuple[str, bytes]]) -> int:
        """Drop entries still holding the value seen (b'' = any); free their slots."""
        if not entries:
            return 0
        keys = [k for k, _ in entries]
        args = [self.prefix, *(v for _, v in entries)]
        return int(self._call(lambda: self._drop(keys=keys, args=args)))

    def touch(self, cls_name: str, entry_keys: Iterable[str]) -> None:
        """Refresh recency of committed pages (ZADD XX: evicted ones stay evicted)."""
        now = self._clock()
        mapping: dict[str | bytes, float] = dict.fromkeys(entry_keys, now)
        if mapping:
            self._call(lambda: self._r.zadd(f"{self.prefix}:lru:{cls_name}", mapping, xx=True))

    def sweep(self, cls: SlotClass, capacity: int, free_slots: int, max_work: int, quarantine_s: float) -> tuple[int, int, int]:
        """Reclaim expired leases, release old quarantines, evict ahead of need."""
        now = self._clock()
        keys = list(self._class_keys(cls))
        args = [repr(now), cls.slot_size, capacity, free_slots, max_work, repr(now - quarantine_s), self._lease_prefix(cls)]
        a, b, c = self._call(lambda: self._sweep(keys=keys, args=args))
        return int(a), int(b), int(c)

    def classes(self) -> list[int]:
        """Page sizes (class names) of every class in this store."""
        pat = f"{self.prefix}:c:*"
        names = self._call(lambda: list(self._r.scan_iter(match=pat, count=1000)))
        return sorted(int(n.rsplit(b":", 1)[1]) for n in names)

    def slots_per_file(self, cls: SlotClass) -> Optional[int]:
        v = self._call(lambda: self._r.hget(self._class_keys(cls)[0], "spf"))
        return None if v is None else int(v)

    def namespace_keys(self, ns: str) -> list[str]:
        pat = f"{self.prefix}:e:{ns}:*"
        return self._call(lambda: [k.decode() for k in self._r.scan_iter(match=pat, count=1000)])

    def usage(self, cls: SlotClass) -> dict[str, int]:
        """Counts for one class, and bytes allocated over all classes."""
        ck = self._class_keys(cls)

        def run() -> list[Any]:
            p = self._r.pipeline(transaction=False)
            p.hgetall(ck[0]).llen(ck[1]).zcard(ck[3]).get(ck[4]).zcard(ck[5])
            return p.execute()

        h, free, pages, used, bad = self._call(run)
        return {
            "files": int(h.get(b"files", 0)),
            "slots": int(h.get(b"next", 0)),
            "free": free,
            "pending": int(h.get(b"pending", 0)),
            "pages": pages,
            "quarantined": bad,
            "allocated_bytes": int(used or 0),
        }

    def lru_members(self, cls: SlotClass) -> list[bytes]:
        return self._call(lambda: self._r.zrange(self._class_keys(cls)[3], 0, -1))

    def close(self) -> None:
        self._r.close()
