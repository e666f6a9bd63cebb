"""The Redis index: the only module that speaks Redis.

Layout (``P`` = ``redis_prefix``, ``C`` = slot class, i.e. slot size in bytes)::

    P:e:<ns>:<key>   string "C:slot:gen:checksum"   a committed page
    P:c:C            hash spf/next/files           class geometry and growth
    P:free:C         list of slot ids              reusable slots
    P:pend:C         zset slot -> lease deadline   reserved, being written (never evicted)
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
    """A committed page as the index holds it; ``raw`` is the stored value."""

    slot_size: int
    slot: int
    gen: int
    cks: int
    raw: bytes


def parse_entry(raw: bytes) -> Entry:
    c, s, g, k = raw.split(b":")
    return Entry(int(c), int(s), int(g), int(k), raw)


def format_entry(slot_size: int, slot: int, gen: int, cks: int) -> bytes:
    return b"%d:%d:%d:%d" % (slot_size, slot, gen, cks)


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

    # KEYS[1] - class hash   KEYS[2] - free list   KEYS[3] - pending zset   KEYS[4] - LRU zset
    # KEYS[5] - allocated bytes   KEYS[6] - generation counter   KEYS[7..] - entry keys
    # ARGV[1] - lease deadline   ARGV[2] - capacity bytes   ARGV[3] - slot size
    # ARGV[4] - slots per file   ARGV[5] - generation seed
    # returns {first generation, pages evicted, r_1..r_n}: r_i = slot id, -1 exists, -2 full;
    #         {-3} if the class was created with another slots-per-file
    RESERVE = _EVICT_ONE + """
local spf = redis.call('HGET', KEYS[1], 'spf')
if not spf then redis.call('HSET', KEYS[1], 'spf', ARGV[4]); spf = ARGV[4] end
if spf ~= ARGV[4] then return {-3} end
spf = tonumber(spf)
local file_bytes = spf * tonumber(ARGV[3])
local nxt = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
local files = tonumber(redis.call('HGET', KEYS[1], 'files') or '0')
local cap = tonumber(ARGV[2])
local out = {0, 0}
local n = 0
for i = 7, #KEYS do
  local r = -2
  if redis.call('EXISTS', KEYS[i]) == 1 then
    r = -1
  else
    local s = redis.call('LPOP', KEYS[2])
    if not s then
      if nxt < files * spf then
        s = nxt; nxt = nxt + 1
      elseif tonumber(redis.call('GET', KEYS[5]) or '0') + file_bytes <= cap then
        redis.call('INCRBY', KEYS[5], file_bytes)
        files = files + 1; s = nxt; nxt = nxt + 1
      else
        s = evict_one(KEYS[4])
        if s then out[2] = out[2] + 1 end
      end
    end
    if s then
      r = tonumber(s)
      redis.call('ZADD', KEYS[3], ARGV[1], s)
      n = n + 1
    end
  end
  out[#out + 1] = r
end
redis.call('HSET', KEYS[1], 'next', nxt, 'files', files)
if n > 0 then
  if redis.call('EXISTS', KEYS[6]) == 0 then redis.call('SET', KEYS[6], ARGV[5]) end
  out[1] = redis.call('INCRBY', KEYS[6], n) - n + 1
end
return out
"""

    # KEYS[1] - pending zset   KEYS[2] - free list   KEYS[3] - LRU zset   KEYS[4] - quarantine zset
    # KEYS[5..] - entry keys, one per reserved slot
    # ARGV[1] - now; then per slot: action ('c' commit, 'f' free, 'q' quarantine), slot, value
    # returns per slot: 1 if the key is now stored (by us or a racing writer), else 0.
    #         A slot whose lease was lost (reclaimed) is left alone: it belongs to someone else.
    FINISH = """
local out = {}
for i = 5, #KEYS do
  local j = 2 + (i - 5) * 3
  local action, slot = ARGV[j], ARGV[j + 1]
  local ok = 0
  if redis.call('ZREM', KEYS[1], slot) == 1 then
    if action == 'c' then
      if redis.call('EXISTS', KEYS[i]) == 1 then
        redis.call('RPUSH', KEYS[2], slot)
      else
        redis.call('SET', KEYS[i], ARGV[j + 2])
        redis.call('ZADD', KEYS[3], ARGV[1], KEYS[i])
      end
      ok = 1
    elseif action == 'q' then
      redis.call('ZADD', KEYS[4], ARGV[1], slot)
    else
      redis.call('RPUSH', KEYS[2], slot)
    end
  end
  out[#out + 1] = ok
end
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
    redis.call('ZREM', ARGV[1] .. ':lru:' .. cls, k)
    redis.call('RPUSH', ARGV[1] .. ':free:' .. cls, slot)
    n = n + 1
  end
end
return n
"""

    # KEYS[1] - class hash   KEYS[2] - free list   KEYS[3] - pending zset   KEYS[4] - LRU zset
    # KEYS[5] - allocated bytes   KEYS[6] - quarantine zset
    # ARGV[1] - now   ARGV[2] - slot size   ARGV[3] - capacity bytes   ARGV[4] - free slots wanted
    # ARGV[5] - most slots moved per kind   ARGV[6] - release quarantined slots older than this
    # returns {leases reclaimed, pages evicted, slots released from quarantine}
    SWEEP = _EVICT_ONE + """
local maxw = tonumber(ARGV[5])
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[1], 'LIMIT', 0, maxw)
for _, s in ipairs(expired) do redis.call('ZREM', KEYS[3], s); redis.call('RPUSH', KEYS[2], s) end
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
return {#expired, evicted, #released}
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
        args = [repr(now + lease_s), capacity, cls.slot_size, cls.slots_per_file, int(now * 1e6)]
        out = self._call(lambda: self._reserve(keys=keys, args=args))
        if out[0] == _GEOMETRY_MISMATCH:
            raise TierStoreError(f"slot class {cls.name} exists with another slots_per_file")
        return int(out[0]), int(out[1]), [int(x) for x in out[2:]]

    def finish(self, cls: SlotClass, ops: Sequence[tuple[str, str, int, bytes]]) -> list[bool]:
        """Commit, free or quarantine reserved slots: ops are (entry key, 'c'|'f'|'q', slot, value)."""
        if not ops:
            return []
        ck = self._class_keys(cls)
        keys = [ck[2], ck[1], ck[3], ck[5], *(op[0] for op in ops)]
        args: list[Any] = [repr(self._clock())]
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
        mapping = dict.fromkeys(entry_keys, now)
        if mapping:
            self._call(lambda: self._r.zadd(f"{self.prefix}:lru:{cls_name}", mapping, xx=True))

    def sweep(self, cls: SlotClass, capacity: int, free_slots: int, max_work: int, quarantine_s: float) -> tuple[int, int, int]:
        """Reclaim expired leases, release old quarantines, evict ahead of need."""
        now = self._clock()
        keys = list(self._class_keys(cls))
        args = [repr(now), cls.slot_size, capacity, free_slots, max_work, repr(now - quarantine_s)]
        a, b, c = self._call(lambda: self._sweep(keys=keys, args=args))
        return int(a), int(b), int(c)

    def classes(self) -> list[int]:
        """Slot sizes of every class in this store."""
        pat = f"{self.prefix}:c:*"
        names = self._call(lambda: list(self._r.scan_iter(match=pat, count=1000)))
        return sorted(int(n.rsplit(b":", 1)[1]) for n in names)

    def slots_per_file(self, slot_size: int) -> Optional[int]:
        v = self._call(lambda: self._r.hget(f"{self.prefix}:c:{slot_size}", "spf"))
        return None if v is None else int(v)

    def namespace_keys(self, ns: str) -> list[str]:
        pat = f"{self.prefix}:e:{ns}:*"
        return self._call(lambda: [k.decode() for k in self._r.scan_iter(match=pat, count=1000)])

    def usage(self, cls: SlotClass) -> dict[str, int]:
        """Counts for one class, and bytes allocated over all classes."""
        ck = self._class_keys(cls)

        def run() -> list[Any]:
            p = self._r.pipeline(transaction=False)
            p.hgetall(ck[0]).llen(ck[1]).zcard(ck[2]).zcard(ck[3]).get(ck[4]).zcard(ck[5])
            return p.execute()

        h, free, pend, pages, used, bad = self._call(run)
        return {
            "files": int(h.get(b"files", 0)),
            "slots": int(h.get(b"next", 0)),
            "free": free,
            "pending": pend,
            "pages": pages,
            "quarantined": bad,
            "allocated_bytes": int(used or 0),
        }

    def lru_members(self, cls: SlotClass) -> list[bytes]:
        return self._call(lambda: self._r.zrange(self._class_keys(cls)[3], 0, -1))

    def ping(self) -> bool:
        return bool(self._call(self._r.ping))

    def close(self) -> None:
        self._r.close()
