"""What the wire (``sglang_tierstore.index.wire``) takes from redis-py beyond its published
API, checked on the redis-py installed: a version that moved any of it fails here, and
pyproject's range for redis-py is what this has passed on."""

from __future__ import annotations

import socket
from importlib.metadata import version

import redis
from tierstore_kit.servers import RedisProc

from sglang_tierstore.index import wire


def test_the_installed_redis_py_has_what_the_wire_reaches_into(server_proc: RedisProc) -> None:
    client = redis.Redis.from_url(server_proc.url)
    pool = client.connection_pool
    conn = pool.get_connection()  # (no command name: redis-py >= 6)
    try:
        assert wire.supported(conn) == [], (version("redis"), wire.supported(conn))
        assert isinstance(conn._sock, socket.socket)
        assert wire._held(conn)  # a loopback index: a probe's round trip is held
    finally:
        pool.release(conn)
        client.close()


def test_a_connection_missing_what_the_wire_needs_is_named_and_not_held(server_proc: RedisProc) -> None:
    client = redis.Redis.from_url(server_proc.url)
    conn = client.connection_pool.get_connection()
    try:
        conn._parser._reader = None  # as a redis-py whose parser kept its reader elsewhere
        assert wire.supported(conn) == ["_parser._reader (hiredis's Reader)"]
        assert not wire._held(conn)
    finally:
        conn.disconnect()
        client.connection_pool.release(conn)
        client.close()
