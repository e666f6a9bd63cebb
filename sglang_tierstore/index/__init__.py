"""The Redis index connection: the only module that speaks Redis.

It knows commands and how to run a Lua library, not what the keys mean (``schema``
names them and their values; the space layer's library holds the functions that change
them). Every call goes through :meth:`RedisIndex._call`: connection trouble raises
:class:`IndexUnavailable` and opens a breaker for ``retry_s``, during which calls fail
at once instead of waiting on timeouts again. A function that finds its store gone
raises :class:`StoreDetached`. Nothing is sent twice after a timeout or a dropped
connection (a function whose reply was lost may have run); only replies that prove a
call did not run (its library or script not loaded) are followed by a retry.

A library runs as Redis Functions (FCALL) where the server has them, else as one script
per function (EVALSHA): see :mod:`sglang_tierstore.space.library` for why. Several calls
(one per shard) go out in one pipeline.

A Redis shared with others can give tierstore an ACL user of its own that may touch only
its keys with only the commands it sends (:func:`acl_rule`), and be reached over TLS
(``rediss://`` with :class:`~sglang_tierstore.perms.TlsFiles`).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
import time as mod_time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sglang_tierstore.config import redact_url
from sglang_tierstore.errors import ConfigError, IndexRefusesWrites, IndexUnavailable, StoreDetached, TierStoreError
from sglang_tierstore.perms import TlsFiles
from sglang_tierstore.schema import STALE, key_globs

T = TypeVar("T")

# Every command tierstore sends, its functions' included (Redis checks the commands a function
# calls against its caller's ACL too; EVALSHA and SCRIPT LOAD for servers without functions). INFO is left out: only ``memory_used`` sends it, for
# scripts/index_memory.py against an embedded Redis.
ACL_COMMANDS = (
    "fcall", "function|load", "evalsha", "script|load", "multi", "exec", "exists", "unlink", "scan",
    "hexists", "hget", "hmget", "hgetall", "hvals", "hlen", "hstrlen", "hscan", "hset", "hsetnx", "hincrby", "hdel",
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
# Replies of a server that cannot serve now (redis-py strips the codes it maps to classes).
_NOT_SERVING = (redis.exceptions.MasterDownError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)
_BUSY = "BUSY"  # a script or function running too long
# Replies of a server that reads but refuses writes: a replica, a persistence error, too few replicas.
_READ_ONLY = ("MISCONF", "NOREPLICAS")


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


@dataclass(frozen=True)
class Library:
    """A Lua library in both forms a server may run it in: ``code`` for FUNCTION LOAD
    (its functions registered as ``<name>_<function>``), and ``scripts``, one per
    function, for EVALSHA on a server without functions."""

    name: str
    code: str
    scripts: Mapping[str, str]

    def function(self, name: str) -> str:
        """The server's name of one of the library's functions."""
        return f"{self.name}_{name}"


def _unknown_command(o: Any) -> bool:
    return isinstance(o, redis.ResponseError) and "unknown command" in str(o).lower()


def _not_loaded(o: Any) -> bool:
    """A reply proving the call did not run: its function or script is not loaded."""
    return isinstance(o, redis.exceptions.NoScriptError) or (
        isinstance(o, redis.ResponseError) and str(o).startswith("Function not found"))


def _load_functions(r: redis.Redis, code: str) -> None:
    try:
        r.function_load(code)
    except redis.ResponseError as e:
        if "already exists" not in str(e):  # loaded meanwhile by another process: the same code
            raise


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
        self._url = url
        self._clock = clock
        self._down_until = 0.0
        self._down_lock = threading.Lock()

        def client(retries: int) -> redis.Redis:
            return redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), retries),
                **({"password": password} if password is not None else {}), **_tls_kwargs(url, tls))

        # Plain commands (each idempotent) get one immediate retry on a fresh connection,
        # which covers a Redis restart (stale pooled sockets); the library's calls get
        # none: one whose reply was lost to a timeout or a dropped connection may have run.
        # The breaker bounds everything else.
        self._r = client(1)
        self._f = client(0)
        self._library: Optional[Library] = None
        self._shas: dict[str, str] = {}
        self._mode = "functions"  # until the server answers FCALL with "unknown command"
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
            self._disconnect()  # idle pooled sockets are likely stale too (a restarted server)
            raise IndexUnavailable(f"redis unavailable: {e}") from e
        except redis.ResponseError as e:
            msg = str(e)
            if isinstance(e, redis.exceptions.NoPermissionError) or msg.startswith(_SCRIPT_DENIED):
                raise TierStoreError(f"redis refused this user ({msg}); it needs the ACL rules of "
                                     "sglang_tierstore.index.acl_rule(redis_prefix)") from e
            if msg.startswith(STALE):
                raise StoreDetached("the store is not in the index any more (dropped, or the index was lost)") from e
            if isinstance(e, redis.exceptions.OutOfMemoryError):  # reads go on: no breaker
                raise IndexRefusesWrites(f"the index is full (maxmemory, noeviction): writes refused: {msg}",
                                         "index_full") from e
            if isinstance(e, redis.exceptions.ReadOnlyError) or msg.startswith(_READ_ONLY):
                raise IndexRefusesWrites(f"the index refuses writes: {msg}", "index_read_only") from e
            if isinstance(e, _NOT_SERVING) or msg.startswith(_BUSY):
                self._trip()
                raise IndexUnavailable(f"redis not serving: {msg}") from e
            if "DB index is out of range" in msg:
                raise ConfigError(f"tierstore config key 'redis_url': {redact_url(self._url)} names a database the "
                                  f"server does not have ({msg})") from e
            raise TierStoreError(f"redis error: {msg}") from e
        finally:
            if self._closed:  # closed while this call ran: the connection it used (or opened) goes too
                self._disconnect()

    def _trip(self) -> None:
        with self._down_lock:
            self._down_until = self._clock() + self.retry_s

    # -- the Lua library ------------------------------------------------------------

    def load(self, library: Library) -> None:
        """Make the library's functions callable (it reaches the server on first use)."""
        self._library = library
        self._shas = {f: hashlib.sha1(text.encode()).hexdigest() for f, text in library.scripts.items()}

    def call(self, function: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run one function of the library: one round trip."""
        return self.calls([(function, keys, args)])[0]

    def calls(self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Run several functions in one pipelined round trip; results in call order.

        As FCALL where the server has functions, else as EVALSHA (see
        :mod:`sglang_tierstore.space.library`). A call whose reply says its library or
        script is not loaded (first use, FUNCTION FLUSH, SCRIPT FLUSH, a restart without
        persistence) did not run: the library is loaded and that call, and only that one,
        sent again. Nothing else is ever sent twice."""
        if self._library is None:
            raise TierStoreError("no Lua library loaded into this index connection")
        library = self._library

        def send(mode: str, todo: Sequence[int]) -> list[Any]:
            """Replies to the calls at positions ``todo``, in one round trip."""
            def one(c: redis.Redis | Any, k: int) -> Any:
                f, keys, args = calls[k]
                if mode == "functions":
                    return c.fcall(library.function(f), len(keys), *keys, *args)
                return c.evalsha(self._shas[f], len(keys), *keys, *args)

            if len(todo) == 1:  # no pipeline for one call: less Python on the hot path
                try:
                    return [one(self._f, todo[0])]
                except redis.ResponseError as e:
                    return [e]
            pipe = self._f.pipeline(transaction=False)
            for k in todo:
                one(pipe, k)
            return list(pipe.execute(raise_on_error=False))

        def run() -> list[Any]:
            out: list[Any] = [None] * len(calls)
            todo = list(range(len(calls)))
            loaded = False
            while True:  # sent again: only calls whose reply proves they did not run (at most twice more)
                mode = self._mode
                for k, o in zip(todo, send(mode, todo)):
                    out[k] = o
                if mode == "functions" and any(_unknown_command(out[k]) for k in todo):
                    self._mode = "scripts"  # a server without functions: the same code as scripts
                    todo = [k for k in todo if _unknown_command(out[k])]
                    continue
                missing = [k for k in todo if _not_loaded(out[k])]
                if missing and not loaded:
                    if mode == "functions":
                        _load_functions(self._r, library.code)
                    else:
                        for f in {calls[k][0] for k in missing}:
                            self._r.script_load(library.scripts[f])
                    loaded, todo = True, missing
                    continue
                for o in out:
                    if isinstance(o, Exception):
                        raise o
                return out

        return self._call(run)

    @property
    def uses_functions(self) -> bool:
        """Whether the library runs as Redis Functions (else as scripts), as far as known."""
        return self._mode == "functions"

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
        self._disconnect()

    def _disconnect(self) -> None:
        """Drop the idle pooled connections (one in use is dropped when its call returns)."""
        for c in (self._r, self._f):
            c.connection_pool.disconnect(inuse_connections=False)
