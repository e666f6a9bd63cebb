"""Where the index's keys live: one server, the primary a Sentinel group names, or the
masters of a Redis/Valkey Cluster, each a :class:`Node` with a breaker of its own.

A cluster's slot map comes from ``CLUSTER SLOTS`` (Redis 3 on, Valkey; still answered
where ``CLUSTER SHARDS`` exists) asked of any node that answers; a MOVED reply points
its slot at the node it names at once and has the whole map read again on the next
round trip, as does a node that stops answering (its slots may have a new master). A
Sentinel group's primary is asked of the sentinels at every new connection, and a
connection to a primary that was demoted meanwhile (READONLY) is dropped (redis-py's
``SentinelManagedConnection``), so the next one reaches the new primary.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry
from redis.sentinel import Sentinel

from sglang_tierstore.config import ClusterSeeds, SentinelGroup, Target, host_port, redact_url
from sglang_tierstore.errors import ConfigError, IndexUnavailable, TierStoreError
from sglang_tierstore.perms import TlsFiles

SLOTS = REDIS_CLUSTER_HASH_SLOTS


def tls_kwargs(secure: bool, tls: Optional[TlsFiles]) -> dict[str, Any]:
    """redis-py's TLS arguments (but ``ssl=True``, which a ``rediss://`` URL says itself): a
    TLS index must show a certificate that the CA signed *for the host it is reached at*
    (redis-py before 6 checks no host name unless told)."""
    verify = {"ssl_cert_reqs": "required", "ssl_check_hostname": True} if secure else {}
    files = {"ssl_ca_certs": tls.ca_file, "ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file} if tls else {}
    return {**verify, **files}


class Node:
    """One server of the index: a connection pool and a breaker. After a failure the
    breaker stays open for ``retry_s``: calls to this node fail at once instead of
    waiting on timeouts again, while other nodes go on serving."""

    def __init__(self, name: str, client: redis.Redis, clock: Callable[[], float], retry_s: float,
                 on_trip: Callable[[], None] = lambda: None) -> None:
        """``on_trip``: told when the breaker opens (a cluster then reads its slot map again)."""
        self.name = name
        self.client = client
        self._clock = clock
        self._retry_s = retry_s
        self._on_trip = on_trip
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def trip(self) -> None:
        self._down_until = self._clock() + self._retry_s
        self._on_trip()
        self.disconnect()  # idle pooled sockets are likely stale too (a restarted server)

    def disconnect(self) -> None:
        """Drop the idle pooled connections (one in use is dropped when its call returns)."""
        self.client.connection_pool.disconnect(inuse_connections=False)


class Topology:
    """Which node serves a key. Thread-safe: the map is replaced whole."""

    name: str  # for messages (no password)

    def node_for(self, key: str) -> Node:
        raise NotImplementedError

    def masters(self) -> list[Node]:
        raise NotImplementedError

    def slot_owners(self) -> list[Optional[str]]:
        """Per slot (of 16384), the name of the master serving it in the map as it is (None:
        none known). One server serves every slot."""
        raise NotImplementedError

    def node_at(self, host: str, port: int) -> Node:
        """The node at an address a redirect named."""
        raise NotImplementedError

    def moved(self, slot: int, host: str, port: int) -> None:
        """A MOVED reply: that slot is served there now."""
        raise NotImplementedError

    def failed(self) -> None:
        """A node stopped answering: the map is read again before the next round trip."""

    def refresh_if_stale(self, now: bool = False) -> None:
        """Read the map again if something said it changed (rate-limited, unless ``now``:
        a slot it has no master for, which no call can be sent for until it is read)."""

    def close(self) -> None:
        for n in self.masters():
            n.disconnect()


class _Single(Topology):
    """Every key on one node."""

    def __init__(self, name: str, node: Node) -> None:
        self.name = name
        self._node = node

    def node_for(self, key: str) -> Node:
        return self._node

    def masters(self) -> list[Node]:
        return [self._node]

    def slot_owners(self) -> list[Optional[str]]:
        return [self._node.name] * SLOTS

    def node_at(self, host: str, port: int) -> Node:
        raise self._not_cluster()

    def moved(self, slot: int, host: str, port: int) -> None:
        raise self._not_cluster()

    def _not_cluster(self) -> ConfigError:
        return ConfigError(f"tierstore config key 'redis_url': {self.name} is a Redis Cluster node (it answered MOVED "
                           "or ASK); give its nodes as redis_cluster instead")


class Cluster(Topology):
    """The masters of a Redis/Valkey Cluster, by slot."""

    REFRESH_S = 0.25  # at most one slot-map read per this while nodes fail

    def __init__(self, seeds: ClusterSeeds, make: Callable[[str, int, Callable[[], None]], Node],
                 clock: Callable[[], float]) -> None:
        self._seeds = [host_port(s) for s in seeds.seeds]
        self.name = "redis_cluster " + ",".join(f"{h}:{p}" for h, p in self._seeds)
        self._make = make
        self._clock = clock
        self._nodes: dict[tuple[str, int], Node] = {}
        self._lock = threading.Lock()
        self._slots: list[Optional[Node]] = [None] * SLOTS
        self._stale = True
        self._next_refresh = 0.0
        self._refreshing = threading.Lock()

    def node_at(self, host: str, port: int) -> Node:
        with self._lock:
            n = self._nodes.get((host, port))
            if n is None:
                n = self._nodes[(host, port)] = self._make(host, port, self.failed)
            return n

    def node_for(self, key: str) -> Node:
        n = self._slots[key_slot(key.encode())]
        if n is None:
            self._stale = True  # read again before the next round trip
            raise IndexUnavailable(f"{self.name}: no master serves slot {key_slot(key.encode())} (key {key!r})")
        return n

    def masters(self) -> list[Node]:
        return list({id(n): n for n in self._slots if n is not None}.values())

    def slot_owners(self) -> list[Optional[str]]:
        return [None if n is None else n.name for n in self._slots]

    def close(self) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for n in nodes:  # seeds, redirect targets and former masters too
            n.disconnect()

    def moved(self, slot: int, host: str, port: int) -> None:
        node = self.node_at(host, port)
        with self._lock:
            slots = list(self._slots)
            slots[slot] = node
            self._slots = slots
            self._stale = True
            self._next_refresh = 0.0

    def failed(self) -> None:
        self._stale = True

    def refresh_if_stale(self, now: bool = False) -> None:
        """One thread reads the map at a time; the others go on with the map they have."""
        if not (self._stale and (now or self._clock() >= self._next_refresh)) or not self._refreshing.acquire(blocking=False):
            return
        try:
            self.refresh()
        except IndexUnavailable:
            pass  # the calls that follow fail on their own nodes' breakers
        finally:
            self._next_refresh = self._clock() + self.REFRESH_S
            self._refreshing.release()

    def refresh(self) -> None:
        """Read the slot map from the first node that answers: known masters whose
        breakers are closed, then the seeds. IndexUnavailable if none does."""
        asked = [n for n in self.masters() if n.available] + [self.node_at(h, p) for h, p in self._seeds]
        seen: set[int] = set()
        errors = []
        for node in asked:
            if id(node) in seen:
                continue
            seen.add(id(node))
            try:
                raw = node.client.execute_command("CLUSTER SLOTS")
            except redis.exceptions.NoPermissionError as e:
                raise TierStoreError(f"{self.name}: redis refused this user ({e}); it needs the ACL rules of "
                                     "sglang_tierstore.index.acl.acl_rule(redis_prefix)") from e
            except redis.ResponseError as e:
                if "cluster support disabled" in str(e).lower():
                    raise ConfigError(f"tierstore config key 'redis_cluster': {node.name} is not a cluster node "
                                      f"({e}); give a single server as redis_url") from e
                errors.append(f"{node.name}: {e}")
                continue
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                errors.append(f"{node.name}: {e}")
                continue
            slots = self._parse(raw, node)
            with self._lock:
                self._slots = slots
                self._stale = False
            return
        raise IndexUnavailable(f"{self.name}: no node answers CLUSTER SLOTS ({'; '.join(errors)})")

    def _parse(self, raw: Any, asked: Node) -> list[Optional[Node]]:
        """CLUSTER SLOTS as redis-py returns it: a dict ``{(start, end): {"primary": (host, port), ...}}``
        (redis-py's callback), or the server's array ``[[start, end, [host, port, id], replicas...], ...]``."""
        slots: list[Optional[Node]] = [None] * SLOTS
        if isinstance(raw, dict):
            ranges = [(int(a), int(b), v["primary"]) for (a, b), v in raw.items()]
        else:
            ranges = [(int(r[0]), int(r[1]), r[2]) for r in raw]
        for start, end, primary in ranges:
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            if not host or host == "?":  # the node asked does not know its own address: the one used
                host = asked.name.rsplit(":", 1)[0]
            node = self.node_at(host, int(primary[1]))
            for s in range(start, end + 1):
                slots[s] = node
        return slots


def open_topology(target: Target, timeout_s: float, retry_s: float, clock: Callable[[], float],
                  password: Optional[str], tls: Optional[TlsFiles]) -> Topology:
    """The nodes of ``target`` (connections are opened on first use)."""
    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                              # idempotent commands (redis-py's own calls: INFO, SCAN, CLUSTER SLOTS) get one
                              # immediate retry on a fresh connection; the index's round trips never retry
                              "retry": Retry(NoBackoff(), 1)}
    if password is not None:
        common["password"] = password
    if isinstance(target, str):
        client = redis.Redis.from_url(target, **common, **tls_kwargs(target.startswith("rediss://"), tls))
        name = redact_url(target)
        return _Single(name, Node(name, client, clock, retry_s))
    if isinstance(target, SentinelGroup):
        secure = target.tls
        ssl = {"ssl": True} if secure else {}
        sentinels = [host_port(n) for n in target.nodes]
        sentinel_kwargs = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, **ssl,
                           **tls_kwargs(secure, tls)}
        if target.auth and password is not None:
            sentinel_kwargs["password"] = password
        s = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)
        client = s.master_for(target.master, redis_class=redis.Redis, **common, **ssl, **tls_kwargs(secure, tls))
        name = f"redis_sentinel {target.master} via " + ",".join(f"{h}:{p}" for h, p in sentinels)
        return _Single(name, Node(name, client, clock, retry_s))
    first = target.seeds[0]
    u = urlsplit(first) if "://" in first else None
    secure = u is not None and u.scheme == "rediss"
    ssl = {"ssl": True} if secure else {}
    user = {"username": u.username} if u is not None and u.username else {}

    def make(host: str, port: int, on_trip: Callable[[], None]) -> Node:
        client = redis.Redis(host=host, port=port, **common, **user, **ssl, **tls_kwargs(secure, tls))
        return Node(f"{host}:{port}", client, clock, retry_s, on_trip)

    return Cluster(target, make, clock)


def owners_seen(topology: Topology) -> list[Optional[str]]:
    """Per slot, the master serving it now (a cluster's map is read first)."""
    if isinstance(topology, Cluster):
        topology.refresh()
    return topology.slot_owners()


def spread_suffixes(tag: str, shards: int, owners: Sequence[Optional[str]]) -> list[str]:
    """A hash-tag suffix per shard (``s``, else ``s.j`` with the least ``j``) so that shard
    ``s``'s tag ``{tag}:{suffix}`` hashes into a slot of the ``s``-th master (modulo their
    number), masters taken in the order of their first slot in ``owners`` (per slot, the
    master serving it: :func:`owners_seen`). So ``shards`` equal to the masters puts one on
    each, whatever ranges the slots are split into (CRC16 alone puts 3 shards on 3 masters
    all three only half the time; equal ranges miss by a slot where ``redis-cli --cluster
    create`` splits them)."""
    masters = list(dict.fromkeys(o for o in owners if o is not None))
    if not masters:
        raise IndexUnavailable("no master serves any slot of the index: the store's shards cannot be placed")
    out = []
    for s in range(shards):
        target, j = masters[s % len(masters)], 0
        while owners[key_slot(f"{tag}:{s if j == 0 else f'{s}.{j}'}".encode())] != target:
            j += 1  # a master holding a single slot takes ~16384 tries: milliseconds, once per store
        out.append(str(s) if j == 0 else f"{s}.{j}")
    return out
