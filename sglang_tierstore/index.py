"""The Redis index connection: the only module that speaks Redis.

It knows commands and scripts, not what the keys mean (``schema`` names them,
``allocator`` holds the scripts that change them). Every call goes through
:meth:`RedisIndex._call`: connection trouble raises :class:`IndexUnavailable` and
opens a breaker for ``retry_s``, during which calls fail at once instead of waiting
on timeouts again. A script that finds its store gone raises :class:`StoreDetached`.

Scripts are registered once and called by EVALSHA, reloaded on NOSCRIPT (a Redis
restart or SCRIPT FLUSH). Several calls (one per shard) go out in one pipeline.

A Redis shared with others can give tierstore an ACL user of its own that may touch only
its keys with only the commands it sends (:func:`acl_rule`), and be reached over TLS
(``rediss://`` with :class:`~sglang_tierstore.private.TlsFiles`).
"""

from __future__ import annotations

import hashlib
import threading
import time as mod_time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sglang_tierstore.errors import IndexUnavailable, StoreDetached, TierStoreError
from sglang_tierstore.private import TlsFiles
from sglang_tierstore.schema import key_globs

T = TypeVar("T")

# Every command tierstore sends, its scripts' included (Redis checks the commands a script
# calls against its caller's ACL too). INFO is left out: only ``memory_used`` sends it, for
# scripts/index_memory.py against an embedded Redis.
ACL_COMMANDS = (
    "evalsha", "script|load", "multi", "exec", "exists", "unlink", "scan",
    "hexists", "hget", "hmget", "hgetall", "hlen", "hscan", "hset", "hsetnx", "hincrby", "hdel",
    "zadd", "zcard", "zrange", "zrangebyscore", "zscore", "zrem",
)


def acl_rule(prefix: str) -> str:
    """ACL rules for a Redis user that may do what a tierstore with ``redis_prefix`` needs
    and nothing else: its keys (:func:`~sglang_tierstore.schema.key_globs`), no channels,
    the commands in ``ACL_COMMANDS``. For ``ACL SETUSER <name> on >password <rules>``."""
    keys = " ".join(f"~{g}" for g in key_globs(prefix))
    commands = " ".join(f"+{c}" for c in ACL_COMMANDS)
    return f"resetkeys {keys} resetchannels -@all {commands}"


# Redis 7.0 answers a command a script calls that its caller may not run with a plain
# error starting so (7.2 and later answer NOPERM, which redis-py raises as NoPermissionError).
_SCRIPT_DENIED = "The user executing the script "
_NOT_SERVING = ("LOADING", "BUSY", "MASTERDOWN", "OOM", "READONLY", "NOREPLICAS", "TRYAGAIN", "CLUSTERDOWN")


def password_state(url: str, password: str, timeout_s: float) -> str:
    """Whether the server at ``url`` guards itself with ``password``: ``ok``; ``unset``
    when it answers without any (an embedded Redis that a build before passwords
    started; such a server also accepts any AUTH, so AUTH alone proves nothing);
    ``refused`` when it wants another; ``down`` when nothing answers. Start-up only."""

    def ping(pw: Optional[str]) -> None:
        r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, password=pw)
        try:
            r.ping()
        finally:
            r.close()

    try:
        try:
            ping(None)
            return "unset"
        except redis.AuthenticationError:  # NOAUTH: it wants a password
            ping(password)
            return "ok"
    except redis.AuthenticationError:
        return "refused"
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return "down"


def shutdown_unprotected(url: str, timeout_s: float) -> None:
    """Stop a server that takes no password (it syncs its AOF first, so nothing is lost)."""
    r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        r.shutdown(nosave=True)
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        pass  # it closed the connection as it went
    except redis.RedisError as e:
        raise TierStoreError(f"redis did not shut down: {e}") from e
    finally:
        r.close()


def _tls_kwargs(url: str, tls: Optional[TlsFiles]) -> dict[str, Any]:
    """redis-py's TLS arguments: a ``rediss://`` index must show a certificate that the CA
    signed *for the host in the URL* (redis-py before 6 checks no host name unless told)."""
    verify = {"ssl_cert_reqs": "required", "ssl_check_hostname": True} if url.startswith("rediss://") else {}
    files = {"ssl_ca_certs": tls.ca_file, "ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file} if tls else {}
    return {**verify, **files}


class RedisIndex:
    """One connection pool to the index's Redis (or Valkey), with a breaker."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        retry_s: float,
        clock: Callable[[], float] = mod_time.time,
        password: Optional[str] = None,
        tls: Optional[TlsFiles] = None,
    ) -> None:
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
            **({"password": password} if password is not None else {}),
            **_tls_kwargs(url, tls),
        )
        self._scripts: dict[str, tuple[str, str]] = {}  # name -> (sha1, text)
        self._closed = False

    # -- failure handling -----------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker is open after a failure."""
        return self._clock() >= self._down_until

    def _call(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise IndexUnavailable("the index connection is closed")
        if not self.available:
            raise IndexUnavailable("redis unavailable (backing off after a failure)")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self._trip()
            raise IndexUnavailable(f"redis unavailable: {e}") from e
        except redis.ResponseError as e:
            msg = str(e)
            if isinstance(e, redis.exceptions.NoPermissionError) or msg.startswith(_SCRIPT_DENIED):
                raise TierStoreError(f"redis refused this user ({msg}); it needs the ACL rules of "
                                     "sglang_tierstore.index.acl_rule(redis_prefix)") from e
            if msg.startswith("TSSTALE"):
                raise StoreDetached("the store is not in the index any more (dropped, or the index was lost)") from e
            if msg.startswith(_NOT_SERVING):
                self._trip()
                raise IndexUnavailable(f"redis not serving: {msg}") from e
            raise TierStoreError(f"redis error: {msg}") from e
        finally:
            if self._closed:  # closed while this call ran: the connection it used (or opened) goes too
                self._r.connection_pool.disconnect(inuse_connections=False)

    def _trip(self) -> None:
        with self._down_lock:
            self._down_until = self._clock() + self.retry_s

    # -- scripts ----------------------------------------------------------------

    def register(self, scripts: Mapping[str, str]) -> None:
        """Make scripts callable by name (their text is loaded on first use)."""
        for name, text in scripts.items():
            self._scripts[name] = (hashlib.sha1(text.encode()).hexdigest(), text)

    def script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run one script: one round trip (two after a Redis restart)."""
        return self.scripts([(name, keys, args)])[0]

    def scripts(self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Run several scripts in one pipelined round trip; results in call order."""

        def run() -> list[Any]:
            for attempt in (0, 1):
                if len(calls) == 1:
                    name, keys, args = calls[0]
                    try:
                        return [self._r.evalsha(self._scripts[name][0], len(keys), *keys, *args)]
                    except redis.exceptions.NoScriptError:
                        if attempt:
                            raise
                        self._r.script_load(self._scripts[name][1])
                        continue
                pipe = self._r.pipeline(transaction=False)
                for name, keys, args in calls:
                    pipe.evalsha(self._scripts[name][0], len(keys), *keys, *args)
                out = pipe.execute(raise_on_error=False)
                missing = {calls[i][0] for i, o in enumerate(out) if isinstance(o, redis.exceptions.NoScriptError)}
                if missing and not attempt:
                    for name in missing:
                        self._r.script_load(self._scripts[name][1])
                    continue
                for o in out:
                    if isinstance(o, Exception):
                        raise o
                return list(out)
            raise AssertionError("unreachable")

        return self._call(run)

    # -- commands -----------------------------------------------------------------

    def hmget(self, parts: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[Optional[bytes]]]:
        """HMGET of fields in several hashes, in one round trip (one command per hash)."""
        if not any(f for _, f in parts):
            return [[] for _ in parts]

        def run() -> list[list[Optional[bytes]]]:
            if len(parts) == 1:
                return [cast(list[Optional[bytes]], self._r.hmget(parts[0][0], list(parts[0][1])))]
            pipe = self._r.pipeline(transaction=False)
            for key, fields in parts:
                if fields:
                    pipe.hmget(key, list(fields))
            res = iter(pipe.execute())
            return [next(res) if fields else [] for _, fields in parts]

        return self._call(run)

    def zadd_newer(self, key: str, members: Mapping[int, float]) -> None:
        """Raise the recency of members that still exist (ZADD XX GT)."""
        if members:
            mapping = {str(m): score for m, score in members.items()}
            self._call(lambda: self._r.zadd(key, mapping, xx=True, gt=True))

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return cast(dict[bytes, bytes], self._call(lambda: self._r.hgetall(key)))

    def hset(self, key: str, mapping: Mapping[str, Any]) -> None:
        self._call(lambda: self._r.hset(key, mapping=cast(Any, dict(mapping))))

    def hsetnx_all(self, key: str, mapping: Mapping[str, Any]) -> dict[str, str]:
        """Set fields not yet set, atomically as a whole; return the hash afterwards."""

        def run() -> dict[str, str]:
            pipe = self._r.pipeline(transaction=True)
            for k, v in mapping.items():
                pipe.hsetnx(key, k, v)
            pipe.hgetall(key)
            got: dict[bytes, bytes] = pipe.execute()[-1]
            return {k.decode(): v.decode() for k, v in got.items()}

        return self._call(run)

    def hdel(self, key: str, *fields: str) -> int:
        return int(self._call(lambda: self._r.hdel(key, *fields)))

    def hscan(self, key: str, cursor: int, count: int, match: Optional[bytes] = None) -> tuple[int, dict[bytes, bytes]]:
        """One HSCAN step: bounded work per call."""
        return cast(tuple[int, dict[bytes, bytes]], self._call(lambda: self._r.hscan(key, cursor, match=match, count=count)))

    def hlen(self, key: str) -> int:
        return int(self._call(lambda: self._r.hlen(key)))

    def unlink(self, keys: Sequence[str]) -> int:
        """Remove keys (one command each, pipelined: they may live on different cluster slots)."""
        return sum(self._each(keys, lambda p, k: p.unlink(k)))

    def exists(self, keys: Sequence[str]) -> int:
        """How many of these keys exist (one command each, pipelined)."""
        return sum(self._each(keys, lambda p, k: p.exists(k)))

    def _each(self, keys: Sequence[str], op: Callable[[Any, str], Any]) -> list[int]:
        if not keys:
            return []

        def run() -> list[int]:
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                op(pipe, k)
            return [int(x) for x in pipe.execute()]

        return self._call(run)

    def scan_keys(self, match: str) -> Iterator[bytes]:
        """Keys matching a pattern, a bounded SCAN step per round trip."""
        cursor = 0
        while True:
            cursor, keys = cast(tuple[int, list[bytes]], self._call(lambda: self._r.scan(cursor, match=match, count=1000)))
            yield from keys
            if cursor == 0:
                return

    def memory_used(self) -> int:
        return int(self._call(lambda: self._r.info("memory"))["used_memory"])

    def close(self) -> None:
        """Disconnect; every later call raises :class:`IndexUnavailable`. A call running
        now is left to finish (no socket is shut under it, so nothing is sent twice by
        a retry): its connection is dropped when it returns."""
        self._closed = True
        self._r.connection_pool.disconnect(inuse_connections=False)
