"""The Redis index connection: the only package that speaks Redis.

It knows commands and how to run a Lua library, not what the keys mean (``schema``
names them and their values; the space layer's library holds the functions that change
them). The index is one server, a Sentinel group's primary, or the masters of a
Redis/Valkey Cluster (:mod:`.topology`); every round trip is :meth:`RedisIndex._send`:
commands grouped by the node serving their keys, each node's group one pipelined
request, every node's request written before any reply is read, so a batch over all
masters costs one round trip of wall time. Each node has a breaker: a node that fails
makes its calls :class:`IndexUnavailable` for ``retry_s`` at once, while the others go
on answering (a batch touching a dead master still answers its other shards: see the
``*_each`` calls).

Nothing is sent twice after a timeout or a dropped connection (a function whose reply
was lost may have run). Only replies that prove a command did not run are followed by a
retry: its library or script not loaded on that node (loaded, then resent), and the
cluster's redirects (:func:`.wire.send`). redis-py's ``RedisCluster`` is not used: it
re-sends whole pipelines after connection errors and timeouts, refuses EVALSHA in
pipelines, and has one state for all nodes; valkey-glide brings a runtime of its own for
what is here a slot map and a redirect loop. Everything that reaches into redis-py's
connections is :mod:`.wire`; administering one server (the embedded index's password,
its loading, its shutdown) is :mod:`.admin`.

A library runs as Redis Functions (FCALL) where the server has them, else as one script
per function (EVALSHA): see :mod:`sglang_tierstore.space.library` for why.

A Redis shared with others can give tierstore an ACL user of its own that may touch only
its keys with only the commands it sends (:func:`.acl.acl_rule`), and be reached over TLS
(``rediss://`` with :class:`~sglang_tierstore.perms.TlsFiles`).
"""

from __future__ import annotations

import hashlib
import time as mod_time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import redis

from sglang_tierstore.errors import (ConfigError, IndexRefusesUser, IndexRefusesWrites, IndexUnavailable, StoreDetached,
                                     TierStoreError)
from sglang_tierstore.index.topology import (
    ClusterSeeds,
    Node,
    SentinelGroup,
    Target,
    Topology,
    Cluster,
    owners_seen,
    open_topology,
    spread_suffixes,
)
from sglang_tierstore.perms import TlsFiles
from sglang_tierstore.index import wire
from sglang_tierstore.index.wire import CLUSTER_BUSY, LINK_ERRORS, REDIRECTS, Command, Item
from sglang_tierstore.schema import STALE

__all__ = ["ClusterSeeds", "Library", "RedisIndex", "SentinelGroup", "Target", "spread_suffixes"]

# Redis 7.0 answers a command a script calls that its caller may not run with a plain
# error starting so (7.2 and later answer NOPERM, which redis-py raises as NoPermissionError).
_SCRIPT_DENIED = "The user executing the script "
# Replies of a server that cannot serve now (redis-py strips the codes it maps to classes).
_NOT_SERVING = (redis.exceptions.MasterDownError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)
_BUSY = "BUSY"  # a script or function running too long
# Replies of a server that reads but refuses writes: a replica, a persistence error, too few replicas.
_READ_ONLY = ("MISCONF", "NOREPLICAS")


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


class RedisIndex:
    """The index's nodes (:mod:`.topology`), each with a breaker."""

    def __init__(
        self,
        target: Target,
        timeout_s: float,
        retry_s: float,
        clock: Callable[[], float] = mod_time.time,
        password: Optional[str] = None,
        tls: Optional[TlsFiles] = None,
    ) -> None:
        """``target``: a URL (one server), :class:`ClusterSeeds` or :class:`SentinelGroup`."""
        self.retry_s = retry_s
        self._clock = clock
        self._topology: Topology = open_topology(target, timeout_s, retry_s, clock, password, tls)
        self._library: Optional[Library] = None
        self._shas: dict[str, str] = {}
        self._mode = "functions"  # until a server answers FCALL with "unknown command"
        self._closed = False

    @property
    def name(self) -> str:
        """What the index is, for messages (no password)."""
        return self._topology.name

    @property
    def clustered(self) -> bool:
        """Whether the index is a Redis/Valkey Cluster (its keys spread over masters by slot)."""
        return isinstance(self._topology, Cluster)

    def slot_owners(self) -> list[Optional[str]]:
        """Per slot, the name of the master serving it now (a cluster's slot map is read
        first; one server serves every slot): where a new store's shards go."""
        self._check_open()
        return owners_seen(self._topology)

    # -- round trips ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise IndexUnavailable("the index connection is closed")

    def _send(self, items: Sequence[Item], hold: bool = False) -> list[Any]:
        """Each item's reply, or the exception it ended in (:func:`.wire.send`)."""
        self._check_open()
        try:
            return wire.send(self._topology, items, hold)
        finally:
            if self._closed:  # closed while this ran: the connections it used (or opened) go too
                self._topology.close()

    def _translate(self, o: Any, key: Optional[str]) -> Any:
        """A reply as the caller sees it: a redis error becomes the TierStoreError saying
        what it means (opening the breaker of its node for a server that cannot serve)."""
        if not isinstance(o, Exception) or isinstance(o, TierStoreError):
            return o
        if isinstance(o, LINK_ERRORS):
            return IndexUnavailable(f"{self.name}: {o}")
        msg = str(o)
        if isinstance(o, redis.exceptions.NoPermissionError) or msg.startswith(_SCRIPT_DENIED):
            return IndexRefusesUser(f"redis refused this user ({msg}); it needs the ACL rules of "
                                    "sglang_tierstore.index.acl.acl_rule(redis_prefix)")
        if msg.startswith(STALE):
            return StoreDetached("the store is not in the index any more (dropped, or the index was lost)")
        if isinstance(o, redis.exceptions.OutOfMemoryError):  # reads go on: no breaker
            return IndexRefusesWrites(f"the index is full (maxmemory, noeviction): writes refused: {msg}", "index_full")
        if isinstance(o, redis.exceptions.ReadOnlyError) or msg.startswith(_READ_ONLY):
            return IndexRefusesWrites(f"the index refuses writes: {msg}", "index_read_only")
        if isinstance(o, CLUSTER_BUSY):  # the node is fine: no breaker
            return IndexUnavailable(f"{self.name}: the cluster cannot serve this now ({msg})")
        if isinstance(o, _NOT_SERVING) or msg.startswith(_BUSY):
            if key is not None:
                try:
                    self._topology.node_for(key).trip()
                except IndexUnavailable:
                    pass
            return IndexUnavailable(f"redis not serving: {msg}")
        if "DB index is out of range" in msg:
            return ConfigError(f"tierstore config key 'redis_url': {self.name} names a database the server does not "
                               f"have ({msg})")
        if isinstance(o, (redis.exceptions.MovedError, redis.exceptions.AskError)):
            return IndexUnavailable(f"{self.name}: still redirected after {REDIRECTS} tries ({msg})")
        return TierStoreError(f"redis error: {msg}")

    def _each(self, items: Sequence[Item], hold: bool = False) -> list[Any]:
        return [self._translate(o, it[0]) for o, it in zip(self._send(items, hold), items)]

    def _all(self, items: Sequence[Item]) -> list[Any]:
        """Replies of every item; the first error raised once all are in."""
        out = self._each(items)
        for o in out:
            if isinstance(o, Exception):
                raise o
        return out

    def _one(self, key: str, *command: Any) -> Any:
        return self._all([(key, [command])])[0]

    # -- the Lua library ------------------------------------------------------------

    def load(self, library: Library) -> None:
        """Make the library's functions callable (it reaches each node on first use)."""
        self._library = library
        self._shas = {f: hashlib.sha1(text.encode()).hexdigest() for f, text in library.scripts.items()}

    def call(self, function: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run one function of the library: one round trip."""
        return self.calls([(function, keys, args)])[0]

    def calls(self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Run several functions in one round trip; results in call order, the first
        error raised once all are in."""
        out = self.calls_each(calls)
        for o in out:
            if isinstance(o, Exception):
                raise o
        return out

    def calls_each(self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Run several functions (each on the node serving its keys) in one round trip:
        each call's result, or the TierStoreError it ended in.

        As FCALL where the server has functions, else as EVALSHA (see
        :mod:`sglang_tierstore.space.library`). A call whose reply says its library or
        script is not loaded on its node (first use, FUNCTION FLUSH, SCRIPT FLUSH, a
        restart without persistence) did not run: the library is loaded there and that
        call, and only that one, sent again."""
        if self._library is None:
            raise TierStoreError("no Lua library loaded into this index connection")
        library = self._library
        out: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        loaded = False
        while todo:  # sent again: only calls whose reply proves they did not run (at most twice more)
            mode = self._mode
            items = [(calls[k][1][0], [self._command(library, mode, calls[k])]) for k in todo]
            for k, o in zip(todo, self._send(items)):
                out[k] = o
            if mode == "functions" and any(_unknown_command(out[k]) for k in todo):
                self._mode = "scripts"  # a server without functions: the same code as scripts
                todo = [k for k in todo if _unknown_command(out[k])]
                continue
            missing = [k for k in todo if _not_loaded(out[k])]
            if not missing or loaded:
                break
            loaded, todo = True, []
            for k, o in zip(missing, self._load_on([calls[k] for k in missing], library, mode)):
                if o is None:
                    todo.append(k)
                else:
                    out[k] = o
        return [self._translate(o, calls[k][1][0]) for k, o in enumerate(out)]

    def _command(self, library: Library, mode: str, call: tuple[str, Sequence[str], Sequence[Any]]) -> Command:
        f, keys, args = call
        if mode == "functions":
            return ("FCALL", library.function(f), len(keys), *keys, *args)
        return ("EVALSHA", self._shas[f], len(keys), *keys, *args)

    def _load_on(self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]], library: Library,
                 mode: str) -> list[Any]:
        """Load the library on the nodes serving these calls' keys (one round trip):
        None per call now loaded, else the error loading it there ended in."""
        if mode == "functions":
            items: list[Item] = [(c[1][0], [("FUNCTION", "LOAD", library.code)]) for c in calls]
        else:
            items = [(c[1][0], [("SCRIPT", "LOAD", library.scripts[c[0]])]) for c in calls]
        return [None if not isinstance(o, Exception) or "already exists" in str(o) else o  # loaded by another process
                for o in self._send(items)]

    @property
    def uses_functions(self) -> bool:
        """Whether the library runs as Redis Functions (else as scripts), as far as known."""
        return self._mode == "functions"

    # -- commands -----------------------------------------------------------------

    def hmget(self, parts: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[Optional[bytes]]]:
        """HMGET of fields in several hashes, in one round trip (one command per hash)."""
        out = self.hmget_each(parts)
        for o in out:
            if isinstance(o, Exception):
                raise o
        return out

    def hmget_each(self, parts: Sequence[tuple[str, Sequence[bytes]]]) -> list[Any]:
        """As :meth:`hmget`, each hash's values or the TierStoreError reading it ended in.
        A probe or a read waits for it: sent to one local node, a short request's reply is
        waited for holding the GIL (see :func:`.wire.exchange`)."""
        asked = [k for k, (_, fields) in enumerate(parts) if fields]
        out: list[Any] = [[] for _ in parts]
        got = self._each([(parts[k][0], [("HMGET", parts[k][0], *parts[k][1])]) for k in asked], hold=True) if asked else []
        for k, o in zip(asked, got):
            out[k] = o
        return out

    def zadd_newer(self, key: str, members: Mapping[int, float]) -> None:
        """Raise the recency of members that still exist (ZADD XX GT)."""
        if members:
            flat = [x for m, score in members.items() for x in (repr(float(score)), str(m))]
            self._one(key, "ZADD", key, "XX", "GT", *flat)

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return _pairs(self._one(key, "HGETALL", key))

    def hset(self, key: str, mapping: Mapping[str, Any]) -> None:
        self._one(key, "HSET", key, *(x for kv in mapping.items() for x in kv))

    def hsetnx_all(self, key: str, mapping: Mapping[str, Any]) -> dict[str, str]:
        """Set fields not yet set, atomically as a whole; return the hash afterwards."""
        cmds: list[Command] = [("MULTI",), *(("HSETNX", key, k, v) for k, v in mapping.items()), ("HGETALL", key), ("EXEC",)]
        got = _pairs(self._all([(key, cmds)])[0][-1])
        return {k.decode(): v.decode() for k, v in got.items()}

    def set_nx(self, key: str, value: str, ttl_ms: int) -> bool:
        """SET NX PX: whether this call set the key (a lock taken)."""
        return self._one(key, "SET", key, value, "NX", "PX", ttl_ms) is not None

    def get(self, key: str) -> Optional[bytes]:
        return self._one(key, "GET", key)  # type: ignore[no-any-return]

    def delete_if(self, key: str, value: str) -> bool:
        """Delete the key if it still holds ``value`` (a lock given back by its holder only)."""
        return bool(self.call("unlock", [key], [value]))

    def extend_if(self, key: str, value: str, ttl_ms: int) -> bool:
        """Give the key a new expiry if it still holds ``value`` (a lock renewed by its holder only)."""
        return bool(self.call("relock", [key], [value, ttl_ms]))

    def hdel(self, key: str, *fields: str) -> int:
        return int(self._one(key, "HDEL", key, *fields))

    def hscan(self, key: str, cursor: int, count: int, match: Optional[bytes] = None) -> tuple[int, dict[bytes, bytes]]:
        """One HSCAN step: bounded work per call."""
        nxt, flat = self._one(key, "HSCAN", key, cursor, *(("MATCH", match) if match is not None else ()), "COUNT", count)
        return int(nxt), _pairs(flat)

    def hlen(self, key: str) -> int:
        return int(self._one(key, "HLEN", key))

    def unlink(self, keys: Sequence[str]) -> int:
        """Remove keys (one command each: they may live on different nodes), one round trip."""
        return sum(int(x) for x in self._all([(k, [("UNLINK", k)]) for k in keys]))

    def exists(self, keys: Sequence[str]) -> int:
        """How many of these keys exist (one command each), one round trip."""
        return sum(int(x) for x in self._all([(k, [("EXISTS", k)]) for k in keys]))

    def scan_keys(self, match: str) -> Iterator[bytes]:
        """Keys matching a pattern on every master, a bounded SCAN step per round trip."""
        self._check_open()
        for node in self._topology.masters():
            cursor = 0
            while True:
                cursor, keys = self._on(node, lambda c: c.scan(cursor, match=match, count=1000))
                yield from keys
                if cursor == 0:
                    break

    def memory_used(self) -> int:
        """Bytes of memory the index's masters use, summed."""
        self._check_open()
        return sum(int(self._on(n, lambda c: c.info("memory"))["used_memory"]) for n in self._topology.masters())

    def _on(self, node: Node, fn: Callable[[redis.Redis], Any]) -> Any:
        """A command that is not about a key (SCAN, INFO), sent to one node."""
        if not node.available:
            raise IndexUnavailable(f"{node.name}: unavailable (backing off after a failure)")
        try:
            return fn(node.client)
        except LINK_ERRORS as e:
            node.trip()
            raise IndexUnavailable(f"{node.name}: {e}") from e
        except redis.ResponseError as e:
            if isinstance(e, _NOT_SERVING) and not isinstance(e, CLUSTER_BUSY):
                node.trip()
            raise self._translate(e, None) from e

    def close(self) -> None:
        """Disconnect; every later call raises :class:`IndexUnavailable`. A call running
        now is left to finish (no socket is shut under it, so nothing is sent twice by
        a retry): its connections are dropped when it returns."""
        self._closed = True
        self._topology.close()


def _pairs(flat: Any) -> dict[bytes, bytes]:
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2]))


