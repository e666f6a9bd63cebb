"""The Lua library on the server: Redis Functions where the server has them, scripts where
it does not, reloaded when the server lost it, kept across a restart from the AOF. Each on
redis-server and valkey-server."""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, engine, housekeep, pages, read, views
from monitor import Monitor

from sglang_tierstore import IndexUnavailable
from sglang_tierstore.tools import inspect
from sglang_tierstore.space.library import LIBRARY, LUA_FILES


def cfg_for(tmp_path: Path, proc: RedisProc) -> dict[str, Any]:
    return {"path": str(tmp_path / "s"), "redis_url": proc.url, "redis_prefix": "lib-" + uuid.uuid4().hex[:8],
            "capacity_gb": 2 * MiB / (1 << 30), "io_threads": 2}


def round_trip(st: Any, tag: str) -> None:
    ns = st.namespace({"m": 1}, 65536)
    src = pages(4, 65536, len(tag))
    assert st.write(ns, keys(4, tag), views(src), False) == [True] * 4
    assert read(st, ns, keys(4, tag)) == ([True] * 4, src)


def test_the_library_is_every_lua_file_after_the_generated_prelude() -> None:
    """One function per job, registered once each; read-only functions flagged for replicas."""
    assert LUA_FILES == ("core", "regions", "leases", "writes", "sweep", "files", "inspect", "lock")
    assert sorted(LIBRARY.scripts) == sorted(["lease", "commit", "release", "release_draining", "drop", "sweep", "punched",
                                              "add_file", "file_ready", "lose_file", "snapshot_regions",
                                              "snapshot_entries", "counts", "unlink_members", "relock", "unlock"])
    assert LIBRARY.code.startswith(f"#!lua name={LIBRARY.name}\n") and re.fullmatch(r"tierstore_[0-9a-f]{12}", LIBRARY.name)
    assert "local K_CONF," in LIBRARY.code  # the generated prelude, then the files
    for name, text in LIBRARY.scripts.items():
        assert text.rstrip().endswith(f"return FUNCTIONS['{name}'](KEYS, ARGV)")


def test_functions_are_loaded_once_and_kept_across_a_restart_from_the_aof(tmp_path: Path, server: str) -> None:
    proc = RedisProc(tmp_path / "redis", appendonly=True, args=("--appendfsync", "always"), server=server)
    try:
        cfg = cfg_for(tmp_path, proc)
        mon = Monitor(proc.port)
        st = engine(cfg)
        try:
            round_trip(st, "a")
            assert st.index.uses_functions
        finally:
            st.close()
        first = mon.commands()
        assert first["FUNCTION"] == 1 and first["FCALL"] >= 2 and "EVALSHA" not in first
        proc.kill()
        proc.start()  # from its AOF: the library with it
        assert redis.Redis.from_url(proc.url).function_list(library=LIBRARY.name)
        mon = Monitor(proc.port)
        st = engine(cfg)
        try:
            round_trip(st, "b")
        finally:
            st.close()
        again = mon.commands()
        assert "FUNCTION" not in again and again["FCALL"] >= 2
    finally:
        proc.stop()


def test_a_flushed_library_is_loaded_again(tmp_path: Path, private_server: RedisProc) -> None:
    st = engine(cfg_for(tmp_path, private_server))
    try:
        round_trip(st, "a")
        redis.Redis.from_url(private_server.url).function_flush()
        mon = Monitor(private_server.port)
        round_trip(st, "b")  # the first call answers "Function not found": nothing ran, so it is sent again
        assert mon.commands()["FUNCTION"] == 1
        assert inspect.check(st) == []
    finally:
        st.close()


def test_an_argument_redis_cannot_carry_raises_before_anything_is_sent(tmp_path: Path,
                                                                      private_server: RedisProc) -> None:
    """A round trip's requests are packed before any is written: an argument that is not
    str, bytes, int or float (None, a bool, a bytearray) in the last command of a
    transaction raises redis.DataError, not one of its commands reaches the server (no
    MULTI left open), and the connection goes on serving."""
    st = engine(cfg_for(tmp_path, private_server))
    try:
        round_trip(st, "a")
        mon = Monitor(private_server.port)
        for bad in (None, True, bytearray(b"v")):
            with pytest.raises(redis.DataError):
                st.index.hsetnx_all("tierstore-test-hash", {"a": "x", "b": bad})
        assert not {"MULTI", "HSETNX", "EXEC"} & set(mon.commands())
        assert st.index.hsetnx_all("tierstore-test-hash", {"a": "x", "b": "y"}) == {"a": "x", "b": "y"}
        round_trip(st, "b")
    finally:
        st.close()


def test_a_request_packs_what_redis_can_carry_and_refuses_the_rest() -> None:
    """What ``_pack`` promises of each argument type: str, bytes, a memoryview, int and
    float go out as their bytes; None, a bool and a bytearray are a DataError."""
    from sglang_tierstore.index import wire as wire_mod

    wire = b"*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\nmv\r\n$1\r\nb\r\n$2\r\n12\r\n$3\r\n2.5\r\n"
    assert wire_mod._pack([("SET", "k", memoryview(b"mv"), b"b", 12, 2.5)]) == [wire]
    for bad in (None, True, bytearray(b"v")):
        with pytest.raises(redis.DataError):
            wire_mod._pack([("SET", "k", bad)])


def test_a_server_without_functions_runs_the_library_as_scripts(tmp_path: Path, server: str) -> None:
    """FCALL and FUNCTION renamed away, as some proxies and managed services do: the same
    library runs as one script per function, by EVALSHA; a flushed script cache reloads."""
    proc = RedisProc(tmp_path / "redis", args=("--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""),
                     server=server)
    try:
        cfg = cfg_for(tmp_path, proc)
        mon = Monitor(proc.port)
        st = engine(cfg, lease_s=5)
        try:
            round_trip(st, "a")
            assert not st.index.uses_functions
            for i in range(8):  # past capacity: eviction inline and by housekeeping
                round_trip(st, f"more{i}")
                housekeep(st)
            redis.Redis.from_url(proc.url).script_flush()
            round_trip(st, "after-flush")
            st.space.set_capacity(1 * MiB)
            housekeep(st)
            assert inspect.check(st, fix=True) == []
            assert st.clear([st.namespace({"m": 1}, 65536)]) > 0
        finally:
            st.close()
        seen = mon.commands()
        assert seen["EVALSHA"] > 10 and seen["SCRIPT"] >= 2 and "FCALL" not in seen
    finally:
        proc.stop()


class ReplyDropper:
    """A TCP relay to a Redis server that, once armed, lets the next request naming
    ``FCALL`` through and then closes the client's connection in place of relaying its
    reply: the call ran, and the client sees a dropped connection."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            drop_reply = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, drop_reply), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, drop_reply), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, drop_reply: threading.Event) -> None:
        while chunk := _recv(client):
            if self.armed.is_set() and b"FCALL" in chunk.upper():
                self.armed.clear()
                drop_reply.set()
            server.sendall(chunk)
        server.close()

    def _replies(self, server: socket.socket, client: socket.socket, drop_reply: threading.Event) -> None:
        while chunk := _recv(server):
            if drop_reply.is_set():  # the call has run: its reply is lost with the connection
                self.dropped.set()  # before the client can see the drop
                client.shutdown(socket.SHUT_RDWR)
                client.close()
                return
            client.sendall(chunk)

    def close(self) -> None:
        self.listener.close()


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(1 << 16)
    except OSError:
        return b""


def test_a_function_call_whose_reply_is_lost_is_not_sent_again(tmp_path: Path, private_server: RedisProc) -> None:
    """The connection drops after a commit ran and before its reply came back: the call
    may have run (here it did), so it is not sent again on a fresh connection. The write
    raises IndexUnavailable; the commit ran once, and every slot is accounted for."""
    relay = ReplyDropper(private_server.port)
    later = [0.0]
    st = engine({**cfg_for(tmp_path, private_server), "redis_url": f"redis://127.0.0.1:{relay.port}/0"},
                redis_timeout_s=0.5, redis_retry_s=0.2, lease_s=10, clock=lambda: time.time() + later[0])
    try:
        round_trip(st, "a")  # a stock: the next write is one commit call
        ns = st.namespace({"m": 1}, 65536)
        mon = Monitor(private_server.port)
        relay.armed.set()
        with pytest.raises(IndexUnavailable):
            st.write(ns, keys(4, "lost"), views(pages(4, 65536, 9)), False)
        assert relay.dropped.is_set()
        assert mon.commands()["FCALL"] == 1
        later[0] += 1  # past the breaker
        assert inspect.check(st) == []
        round_trip(st, "after")
    finally:
        st.close()
        relay.close()
