"""A probe's round trip made holding the GIL (``_pageio.exchange``, ``index.wire.exchange``'s
``hold``): what it sends and reads, on a socket pair and against a real server."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from tierstore_kit.servers import RedisProc

from sglang_tierstore.index import wire
from sglang_tierstore.errors import IndexUnavailable
from sglang_tierstore.index import RedisIndex

pageio = pytest.importorskip("sglang_tierstore._pageio", reason="the C helper is not built")
exchange = pageio.exchange


@pytest.fixture
def pair() -> Any:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_reply_already_there_is_read_with_the_request_sent(pair: Any) -> None:
    a, b = pair
    b.sendall(b"+OK\r\n:7\r\n")  # (the peer cannot answer while the GIL is held: its reply is already queued)
    assert exchange(a.fileno(), b"*1\r\n$4\r\nPING\r\n", 10**9) == (14, b"+OK\r\n:7\r\n")
    assert b.recv(100) == b"*1\r\n$4\r\nPING\r\n"


def test_a_reply_that_comes_while_it_waits_is_read(pair: Any) -> None:
    """The peer, another process (no GIL of ours), answers after reading the request."""
    a, b = pair
    peer = subprocess.Popen([sys.executable, "-c", f"import socket, time; s = socket.socket(fileno={b.fileno()}); "
                             "assert s.recv(100) == b'ping'; time.sleep(0.05); s.sendall(b'pong')"], pass_fds=[b.fileno()])
    try:
        assert exchange(a.fileno(), b"ping", 20 * 10**9) == (4, b"pong")
    finally:
        assert peer.wait(20) == 0


def test_no_reply_within_the_bound_reads_nothing(pair: Any) -> None:
    a, b = pair
    assert exchange(a.fileno(), b"abc", 1_000_000) == (3, b"")
    assert b.recv(10) == b"abc"


def test_a_full_socket_buffer_sends_part_and_reads_nothing(pair: Any) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = bytes(range(256)) * 16384  # 4 MiB: more than any socket buffer holds
    sent, reply = exchange(a.fileno(), big, 10**9)
    assert 0 < sent < len(big) and reply == b""
    got = b""
    while len(got) < sent:
        got += b.recv(1 << 20)
    assert got == big[:sent]


def test_a_reply_larger_than_its_first_buffer_is_read_whole(pair: Any) -> None:
    a, b = pair
    reply = b"x" * 100_000
    b.sendall(reply)
    sent, got = exchange(a.fileno(), b"q", 10**9)
    assert sent == 1 and got == reply


def test_a_closed_peer_or_socket_is_an_oserror(pair: Any) -> None:
    a, b = pair
    b.close()
    with pytest.raises(OSError):
        exchange(a.fileno(), b"q", 0)
    with pytest.raises(OSError):
        exchange(-1, b"q", 0)


def counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The index's calls of the held exchange (the real one runs): request and bytes sent."""
    calls: list[tuple[int, int]] = []
    real: Callable[..., Any] = wire._held_exchange

    def counted(fd: int, request: bytes, spin_ns: int) -> Any:
        out = real(fd, request, spin_ns)
        calls.append((len(request), out[0]))
        return out

    monkeypatch.setattr(wire, "_held_exchange", counted)
    return calls


def test_an_hmget_reads_through_the_held_exchange_what_the_server_holds(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A small request (the reply fed to hiredis as it came) and one that fills a small socket
    buffer (the rest sent after it, the reply read by redis-py) read what the server holds;
    a request over ``HOLD_MAX_BYTES`` and other round trips (an HSET) do not hold the GIL.
    Over a Unix socket, as the embedded index is: what such a socket buffers counts against
    the sender's SO_SNDBUF, which this test shrinks."""
    calls = counting(monkeypatch)
    sock = tmp_path / "redis.sock"
    server = RedisProc(tmp_path / "redis", args=("--unixsocket", str(sock)))
    idx = RedisIndex(f"unix://{sock}", 2.0, 0.1)
    try:
        key = "held:{x}:entries"
        values = {f"f{i:06d}".encode(): f"v{i}".encode() * (1 + i % 7) for i in range(60_000)}
        for i in range(0, len(values), 5000):
            idx.hset(key, dict(list(values.items())[i : i + 5000]))
        assert calls == []
        fields = list(values)
        assert idx.hmget([(key, fields[:3] + [b"absent"])]) == [[values[f] for f in fields[:3]] + [None]]
        pool = idx._topology.node_for(key).client.connection_pool
        conn = pool.get_connection()
        assert wire._held(conn)
        conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the next call's connection
        pool.release(conn)
        some = fields[:3000] + [b"nothing"] * 500  # a request of about 60 KB
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # reading nothing until the send has filled the buffer
        resume = threading.Timer(0.3, server.proc.send_signal, (signal.SIGCONT,))
        resume.start()
        try:
            assert idx.hmget([(key, some)]) == [[values.get(f) for f in some]]
        finally:
            resume.join()
        assert len(calls) == 2 and calls[0][0] == calls[0][1] and calls[1][1] < calls[1][0] <= wire.HOLD_MAX_BYTES
        many = fields + [b"nothing"] * 20_000  # about 1.4 MB
        assert idx.hmget([(key, many)]) == [[values.get(f) for f in many]]
        assert len(calls) == 2
    finally:
        idx.close()
        server.stop()


def test_a_held_probe_to_a_server_gone_is_index_unavailable_and_recovers(private_redis: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch)
    redis_proc = private_redis
    idx = RedisIndex(redis_proc.url, 1.0, 0.0)
    key = "held:{y}:entries"
    try:
        idx.hset(key, {"a": "1"})
        assert idx.hmget([(key, [b"a"])]) == [[b"1"]]
        redis_proc.kill()
        with pytest.raises(IndexUnavailable):
            idx.hmget([(key, [b"a"])])
        redis_proc.start()
        idx.hset(key, {"a": "2"})
        assert idx.hmget([(key, [b"a"])]) == [[b"2"]]
        assert len(calls) >= 2
    finally:
        idx.close()
