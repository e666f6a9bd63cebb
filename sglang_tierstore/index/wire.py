"""The wire: one round trip to the index's nodes, and everything that reaches into redis-py.

redis-py gives connections, a pool per node and hiredis's reply reader; a round trip here
writes every node's pipelined request before reading any reply, and a probe's short round
trip to a local node is made by the C helper holding the GIL (:func:`exchange`). Both need
what redis-py does not publish: a connection's socket (``_sock``), its reply reader
(``_parser._reader``), ``send_packed_command`` and ``read_response``. :func:`supported`
says whether an installed redis-py has them, as the suite checks on the version it runs
(pyproject pins the range), so a redis-py that moved them fails a test, not a server.
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Optional, Sequence

import hiredis
import redis

from sglang_tierstore._native import pageio
from sglang_tierstore.errors import IndexUnavailable
from sglang_tierstore.index.topology import Node, Topology

# a round trip holding the GIL (see exchange); without the C helper every round trip lets it go
_held_exchange: Optional[Callable[[int, bytes, int], tuple[int, bytes]]] = getattr(pageio, "exchange", None)

Command = tuple[Any, ...]
# One unit of a round trip: the key that routes it, and its commands, sent together in order
# (MULTI ... EXEC, or ASKING before a command). Its reply is the last command's, or its first error.
Item = tuple[str, Sequence[Command]]

LINK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
REDIRECTS = 5  # MOVED/ASK followed at most this often per item
# Replies of a cluster that cannot run a command now, from a healthy node: a slot being
# migrated with the call's keys split (TRYAGAIN), a slot no master serves (CLUSTERDOWN).
CLUSTER_BUSY = (redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)
_NONE = object()
# How long a probe's round trip waits for its reply holding the GIL (see exchange): a local
# index answers an HMGET of a batch in tens of us; past this bound the wait lets the GIL go.
HOLD_NS = 200_000
HOLD_MAX_BYTES = 65536  # a larger request (a batch of thousands of keys) goes the usual way
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _pack(commands: Sequence[Command]) -> list[bytes]:
    """One node's pipelined request, in hiredis's packer: arguments are str, bytes, a
    memoryview (its bytes), int or float (redis-py's own packer checks and converts each one
    in Python, which on a write cost more than the rest of the call). Anything else (None, a
    bool, a bytearray) raises ``redis.DataError``, before any request of the round trip is sent."""
    try:
        return [b"".join([hiredis.pack_command(tuple(c)) for c in commands])]
    except TypeError as e:
        raise redis.DataError(str(e)) from None


def send(topo: Topology, items: Sequence[Item], hold: bool = False) -> list[Any]:
    """Each item's reply, or the exception it ended in (a redis ``ResponseError`` as the
    server gave it; :class:`IndexUnavailable` for a node that failed or whose breaker is
    open), in one round trip per try (:func:`exchange`); redirects followed: MOVED (the
    slot map is read again), ASK (resent with ASKING to the node named). TRYAGAIN and
    CLUSTERDOWN are answered as they are (the slot map is read again for the next call):
    nothing here sleeps, as a caller may hold a lock an SGLang call waits for.
    ``hold``: a short call someone waits for (see :func:`exchange`)."""
    out: list[Any] = [None] * len(items)
    todo = list(range(len(items)))
    ask: dict[int, Node] = {}
    unmapped: list[int] = []
    for attempt in range(REDIRECTS + 1):
        topo.refresh_if_stale(now=attempt == 1 and bool(unmapped))  # (unmapped items are tried again once)
        groups: dict[int, tuple[Node, list[int]]] = {}
        unmapped = []  # slots the map has no master for (read while the cluster was failing over)
        for k in todo:
            try:
                node = ask.get(k) or topo.node_for(items[k][0])
            except IndexUnavailable as e:
                out[k] = e
                unmapped.append(k)
                continue
            groups.setdefault(id(node), (node, []))[1].append(k)
        replies = exchange([(node, [_commands(items[k], k in ask) for k in ks]) for node, ks in groups.values()],
                           hold)
        retry = list(unmapped) if attempt == 0 else []  # (the map read again at once, once: see refresh_if_stale)
        ask = {}
        for (node, ks), got in zip(groups.values(), replies):
            for k, o in zip(ks, got):
                out[k] = o
                if isinstance(o, (redis.exceptions.MovedError, redis.exceptions.AskError)):
                    # an empty host: the node that replied; '?': not known to it (the map is read again)
                    host = o.host or node.name.rsplit(":", 1)[0]
                    if host == "?":
                        topo.failed()
                    elif isinstance(o, redis.exceptions.MovedError):
                        topo.moved(o.slot_id, host, int(o.port))
                    else:
                        ask[k] = topo.node_at(host, int(o.port))
                elif isinstance(o, CLUSTER_BUSY):  # answered as it is: resent at once it would be again
                    topo.failed()
                    continue
                else:
                    continue
                retry.append(k)
        if not retry or attempt == REDIRECTS:
            break
        todo = retry
    return out


def _commands(item: Item, asking: bool) -> Sequence[Command]:
    return [("ASKING",), *item[1]] if asking else item[1]


def _held(conn: Any) -> bool:
    """Whether a connection's round trip can be made by ``_pageio.exchange``: a plain socket
    (not TLS) to this machine (a Unix socket, or loopback: a remote index rarely answers
    within ``HOLD_NS``, and the scheduler would lose the wait for nothing) whose replies
    hiredis parses (fed what it read)."""
    sock = getattr(conn, "_sock", None)
    return (type(sock) is socket.socket and not supported(conn)
            and (sock.family == socket.AF_UNIX or getattr(conn, "host", None) in _LOOPBACK))


def exchange(groups: Sequence[tuple[Node, Sequence[Sequence[Command]]]], hold: bool = False) -> list[list[Any]]:
    """One round trip to several nodes: every node's pipelined request is written before
    any reply is read. Per node, each item's reply (its last command's, or its first
    error); a node whose breaker is open, or that fails, gives every item of its group
    :class:`IndexUnavailable` (and opens its breaker). Nothing is retried.

    ``hold``, to one node over a connection :func:`_held` accepts, with a request of at most
    ``HOLD_MAX_BYTES``: the request is sent, and its reply read as far as it comes within
    ``HOLD_NS``, without letting the GIL go. Each send and wait that lets it go beside a
    thread spinning in Python (SGLang's scheduler) waits a switch interval (5 ms) to take it
    back: for a prefetch probe, which a request waits for, that is most of its time. The
    scheduler loses about ``HOLD_NS`` at most instead (and a reply still not in then is
    read as any other, letting the GIL go)."""
    out: list[list[Any]] = []
    sent: list[tuple[int, Node, Any, Sequence[Sequence[Command]]]] = []
    requests = [_pack([c for cmds in items for c in cmds]) for _, items in groups]  # DataError here
    try:
        for (node, items), request in zip(groups, requests):
            if not node.available:
                out.append([IndexUnavailable(f"{node.name}: unavailable (backing off after a failure)")] * len(items))
                continue
            pool = node.client.connection_pool
            conn = None
            try:
                conn = pool.get_connection()
                exchange = _held_exchange if hold and len(groups) == 1 and len(request[0]) <= HOLD_MAX_BYTES else None
                if exchange is not None and _held(conn):
                    n, early = exchange(conn._sock.fileno(), request[0], HOLD_NS)
                    if n < len(request[0]):
                        conn._sock.sendall(memoryview(request[0])[n:])
                    elif early:
                        conn._parser._reader.feed(early)
                else:
                    conn.send_packed_command(request, check_health=False)
            except LINK_ERRORS as e:
                out.append([_failed(node, pool, conn, e)] * len(items))
                continue
            except redis.ResponseError as e:  # refused while connecting (AUTH, SELECT of a database it lacks)
                out.append([e] * len(items))
                continue
            except BaseException:
                if conn is not None:
                    conn.disconnect()
                    pool.release(conn)
                raise
            out.append([])
            sent.append((len(out) - 1, node, conn, items))
    except BaseException:  # what was sent may have run: its connections are dropped, its replies never read
        for _, node, conn, _ in sent:
            conn.disconnect()
            node.client.connection_pool.release(conn)
        raise
    for n, (slot, node, conn, items) in enumerate(sent):
        pool = node.client.connection_pool
        try:
            for cmds in items:
                reply: Any = _NONE
                for _ in cmds:
                    try:
                        r = conn.read_response()
                    except redis.ResponseError as e:
                        r = e
                    if not isinstance(reply, Exception):  # an item's first error is its reply
                        reply = r
                out[slot].append(reply)
        except LINK_ERRORS as e:
            err = _failed(node, pool, conn, e)
            out[slot] += [err] * (len(items) - len(out[slot]))
            continue
        except BaseException:  # this connection and those not read yet are dropped: their replies stay unread
            for _, other, c, _ in sent[n:]:
                c.disconnect()
                other.client.connection_pool.release(c)
            raise
        pool.release(conn)
    return out



def _failed(node: Node, pool: Any, conn: Any, e: BaseException) -> IndexUnavailable:
    """A node that failed mid-exchange: its connection dropped, its breaker opened."""
    if conn is not None:
        conn.disconnect()
        pool.release(conn)
    node.trip()
    return IndexUnavailable(f"redis unavailable ({node.name}): {e}")


def supported(conn: Any) -> list[str]:
    """What this module uses of a connected redis-py ``Connection`` that ``conn`` lacks
    (empty: all there). Where something is missing no round trip is held (:func:`_held`);
    the suite fails on it (``test_wire.py``)."""
    missing = [name for name in ("send_packed_command", "read_response", "disconnect") if not callable(getattr(conn, name, None))]
    if not isinstance(getattr(conn, "_sock", None), socket.socket):
        missing.append("_sock (a socket once connected)")
    if not isinstance(getattr(getattr(conn, "_parser", None), "_reader", None), hiredis.Reader):
        missing.append("_parser._reader (hiredis's Reader)")
    return missing
