"""A node shared with other users: start-up that fails clean, private files, an embedded
index that is ours or refused, and passwords that never reach a log line or an error.

Some cases need a second uid (a directory or a socket owned by someone else): they run
when the tests run as root, as CI does, and are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_indices, storage_config

from sglang_tierstore import ConfigError, EmbeddedRedisError, TierStoreBackend
from sglang_tierstore.config import TierStoreConfig, redact_url
from sglang_tierstore.embedded import (
    embedded_running,
    ensure_embedded_redis,
    pid_file,
    redis_dir,
    socket_path,
    stop_embedded_redis,
)
from sglang_tierstore.perms import PRIVATE, check_dirs, remove_created, secret

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user")


def stop_embedded(path: Path) -> None:
    try:
        os.kill(int(Path(pid_file(str(path))).read_text()), 9)
    except (OSError, ValueError):
        pass


@pytest.fixture
def umask_zero() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def write_some_pages(be: TierStoreBackend) -> None:
    pool = mha_pool("page_first")
    fill(pool, 3)
    be.register_mem_pool_host(pool)
    assert be.batch_set_v1(keys(3), page_indices([0, 1, 2], 4)) == [True] * 3


def modes_under(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if not stat.S_ISSOCK(st.st_mode):
                out[os.path.relpath(p, root)] = stat.S_IMODE(st.st_mode)
    return out


# -- validate before starting anything ------------------------------------------------


def test_a_bad_directory_stops_start_up_and_leaves_nothing_behind(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    new = tmp_path / "new" / "deeper"
    cfg = {"path": [str(new), str(a_file / "sub")], "capacity_gb": 0.1}  # embedded Redis: none may start
    with pytest.raises(ConfigError, match=r"'path': .*a-file/sub.* not a writable directory"):
        TierStoreBackend(storage_config(cfg), {})
    assert not (tmp_path / "new").exists()  # what the check created is gone again
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
    assert not os.path.exists(socket_path(str(new)))


def test_a_store_that_cannot_attach_leaves_no_thread_connection_or_new_directory(tmp_path: Path, private_redis: RedisProc) -> None:
    cfg = {"redis_url": private_redis.url, "redis_prefix": "attach-fails", "capacity_gb": 0.1}
    for d in ("d1", "d2"):  # two stores of their own (two nodes' disks, say), made for their first pages
        with TierStoreBackend(storage_config({**cfg, "path": str(tmp_path / d)}), {}) as be:
            be.register_mem_pool_host(mha_pool("page_first"))
    threads = {t.name for t in threading.enumerate()}
    new = tmp_path / "new" / "d3"
    with pytest.raises(ConfigError, match="different stores"):
        TierStoreBackend(storage_config({**cfg, "path": [str(tmp_path / "d1"), str(tmp_path / "d2"), str(new)]}), {})
    assert not (tmp_path / "new").exists()
    assert {t.name for t in threading.enumerate()} == threads  # no I/O threads left running
    clients = redis.Redis.from_url(private_redis.url)
    deadline = time.monotonic() + 10  # the server notices closed sockets as it gets to them
    while int(clients.info("clients")["connected_clients"]) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(clients.info("clients")["connected_clients"]) == 1  # this one: the failed store's are closed
    clients.close()


def test_a_failed_start_stops_the_embedded_redis_it_started(tmp_path: Path) -> None:
    d1, d2, new = tmp_path / "d1", tmp_path / "d2", tmp_path / "new" / "d0"
    try:
        for d in (d1, d2):  # two stores of their own, each with its embedded Redis, made for their first pages
            with TierStoreBackend(storage_config({"path": str(d), "capacity_gb": 0.1}), {}) as be:
                be.register_mem_pool_host(mha_pool("page_first"))
        with pytest.raises(ConfigError, match="different stores"):
            TierStoreBackend(storage_config({"path": [str(new), str(d1), str(d2)], "capacity_gb": 0.1}), {})
        assert not (tmp_path / "new").exists()
        assert not embedded_running(str(new))
    finally:
        for d in (d1, d2, new):
            stop_embedded_redis(str(d))


def test_start_up_removes_only_directories_it_created_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks start together: a directory another rank creates between this rank's look and
    its mkdir is the other rank's, and this rank's failed start must leave it alone."""
    theirs = tmp_path / "nvme" / "ts"
    real_mkdir = os.mkdir

    def racing_mkdir(path: Any, mode: int = 0o777) -> None:
        if Path(path) == theirs and not theirs.exists():
            real_mkdir(path, mode)  # the other rank got there first
            (theirs / "their-file").write_text("x")
        real_mkdir(path, mode)

    theirs.parent.mkdir()
    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    created = check_dirs([str(theirs), str(tmp_path / "mine")], PRIVATE)
    monkeypatch.undo()
    assert created == [str(tmp_path / "mine")]
    remove_created(created)  # a later step of this rank's start failed
    assert (theirs / "their-file").exists() and not (tmp_path / "mine").exists()


def test_ranks_starting_together_read_one_whole_secret(tmp_path: Path) -> None:
    for round_ in range(30):
        path = str(tmp_path / f"secret{round_}")
        got: list[object] = []
        threads = [threading.Thread(target=lambda: got.append(_secret_or_error(path))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(map(str, got))) == 1 and isinstance(got[0], str), got


def _secret_or_error(path: str) -> object:
    try:
        return secret(path, PRIVATE)
    except ConfigError as e:
        return e


def test_an_uncreatable_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'path': '/proc/tierstore-test' is not a writable directory"):
        TierStoreBackend(storage_config({"path": "/proc/tierstore-test", "redis_url": "redis://127.0.0.1:1/0"}), {})


@pytest.mark.parametrize("url, shown", [
    ("http://admin:hunter2@h:6379/0", "http://admin:***@h:6379/0"),
    ("redis://:hunter2@h:99999/0", "redis://:***@h:99999/0"),
    ("redis://:hunter2@h/zero", "redis://:***@h/zero"),
    ("rediss://hunter2@/0", "rediss://***@/0"),
])
def test_bad_redis_urls_are_named_without_their_password(url: str, shown: str) -> None:
    with pytest.raises(ConfigError) as e:
        TierStoreConfig.from_dict({"path": "/tmp/x", "redis_url": url})
    assert "redis_url" in str(e.value) and shown in str(e.value) and "hunter2" not in str(e.value)


def test_redact_url() -> None:
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("unix:///run/r.sock?db=0&password=pw") == "unix:///run/r.sock?db=0&password=***"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


# -- private by default -------------------------------------------------------------------


@pytest.mark.parametrize("access, dirs, files", [("private", 0o700, 0o600), ("group", 0o750, 0o640)])
def test_every_directory_and_file_has_the_mode_whatever_the_umask(
        tmp_path: Path, umask_zero: None, access: str, dirs: int, files: int) -> None:
    root = tmp_path / "store"
    cfg = {"path": str(root), "capacity_gb": 0.1, "interface_v1": 1, "file_access": access}
    try:
        with TierStoreBackend(storage_config(cfg), {}) as be:
            write_some_pages(be)
    finally:
        stop_embedded(root)
    found = modes_under(root)
    names = {os.path.basename(p) for p in found}
    assert {"redis.conf", "secret", "redis.pid", "redis.log", "store.json", ".lock"} <= names
    assert any(p.endswith(".pages") for p in found) and any("appendonly" in p for p in found)
    want = {p: (dirs if (root / p).is_dir() else files) for p in found}
    assert found == want
    assert stat.S_IMODE(os.stat(root).st_mode) == dirs  # created by tierstore: its mode too


# -- the embedded index is ours or refused -----------------------------------------------------


def test_the_embedded_redis_requires_its_password(tmp_path: Path, server: str) -> None:
    root = tmp_path / "store"
    try:
        with TierStoreBackend(storage_config({"path": str(root), "capacity_gb": 0.1, "redis_server": server}), {}):
            secret = (Path(redis_dir(str(root))) / "secret").read_text().strip()
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(socket_path(str(root)))
                s.sendall(b"PING\r\n")
                assert s.recv(64).startswith(b"-NOAUTH")
                s.sendall(f"AUTH {secret}\r\nPING\r\n".encode())
                time.sleep(0.2)
                assert s.recv(64) == b"+OK\r\n+PONG\r\n"
            assert secret not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    finally:
        stop_embedded(root)


def test_an_embedded_redis_of_a_build_before_passwords_is_restarted_with_its_data_and_a_password(
        tmp_path: Path, server: str) -> None:
    """An upgraded node: the embedded Redis an earlier build started (no password) still
    runs. The new build stops it (AOF synced) and starts it with the password; the data stays."""
    root = tmp_path / "store"
    d = Path(redis_dir(str(root)))
    d.mkdir(parents=True, mode=0o700)
    sock = socket_path(str(root))
    subprocess.run([server, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700", "--dir", str(d),
                    "--appendonly", "yes", "--save", "", "--daemonize", "yes", "--pidfile", pid_file(str(root))], check=True)
    try:
        old = redis.Redis(unix_socket_path=sock)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                old.set("kept", "yes")
                break
            time.sleep(0.05)
        old_pid = int(old.info("server")["process_id"])
        old.close()
        url = ensure_embedded_redis(str(root), PRIVATE, server).url
        new = redis.Redis.from_url(url)
        kept = None
        for _ in range(200):  # it listens while it still loads its AOF (the backend rides that out as misses)
            with contextlib.suppress(redis.BusyLoadingError):
                kept = new.get("kept")
                break
            time.sleep(0.05)
        assert kept == b"yes" and int(new.info("server")["process_id"]) != old_pid
        new.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=sock).ping()
        other = "ab" * 32
        (d / "secret").write_text(other)  # the server now wants a password this store does not hold
        with pytest.raises(EmbeddedRedisError, match="refuses the password") as e:
            ensure_embedded_redis(str(root), PRIVATE, server)
        assert other not in str(e.value)
    finally:
        stop_embedded(root)


def long_path(tmp_path: Path) -> Path:
    p = tmp_path / ("d" * 100)
    assert len(os.path.join(redis_dir(str(p)), "redis.sock")) >= 104
    return p


@as_root
def test_a_socket_directory_someone_else_owns_is_refused(tmp_path: Path) -> None:
    path = long_path(tmp_path)
    sock_dir = Path(socket_path(str(path))).parent
    created = not sock_dir.exists()
    if created:
        sock_dir.mkdir(mode=0o700)
    try:
        os.chown(sock_dir, NOBODY, NOBODY)
        with pytest.raises(ConfigError, match="refusing to use a socket there"):
            TierStoreBackend(storage_config({"path": str(path), "capacity_gb": 0.1}), {})
        assert not path.exists()  # created for this start, removed when it failed
    finally:
        os.chown(sock_dir, 0, 0)
        if created:
            sock_dir.rmdir()
    assert not os.path.exists(pid_file(str(path)))  # no redis-server was started


@as_root
def test_an_impostor_on_the_socket_is_refused(tmp_path: Path) -> None:
    """Another user's server bound where tierstore's socket goes (moved into place after it
    bound: SO_PEERCRED still names its owner) is never joined."""
    path = long_path(tmp_path)
    sock = socket_path(str(path))
    Path(sock).parent.mkdir(mode=0o700, exist_ok=True)
    shared = Path(tempfile.mkdtemp(prefix="ts-impostor-", dir="/tmp"))  # where the other user can bind
    os.chmod(shared, 0o777)
    bound = str(shared / "imp.sock")
    imp = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", bound, "--unixsocketperm", "777", "--save", ""],
        user=NOBODY, group=NOBODY, cwd="/tmp", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(bound):
            assert time.monotonic() < deadline, "impostor did not start"
            time.sleep(0.05)
        os.replace(bound, sock)
        with pytest.raises(EmbeddedRedisError, match=f"served by uid {NOBODY}.*refusing to join"):
            TierStoreBackend(storage_config({"path": str(path), "capacity_gb": 0.1}), {})
    finally:
        imp.kill()
        imp.wait()
        for leftover in (sock, bound):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        shared.rmdir()


# -- secrets never logged -----------------------------------------------------------------------


def test_a_server_that_refuses_its_config_is_quoted_without_the_password(tmp_path: Path) -> None:
    """Redis and Valkey quote the config line at fault when they refuse one: the error shows
    what the server said, with the password (a line of that config) masked."""
    refusing = tmp_path / "refusing-server"
    refusing.write_text('#!/bin/sh\necho "*** FATAL CONFIG FILE ERROR ***" >&2; cat "$1" >&2; exit 1\n')
    refusing.chmod(0o700)
    root = tmp_path / "store"
    with pytest.raises(EmbeddedRedisError, match=r"(?s)starting the embedded index failed: .*FATAL CONFIG FILE ERROR"
                                                  r".*requirepass \*\*\*") as e:
        ensure_embedded_redis(str(root), PRIVATE, str(refusing))
    assert (Path(redis_dir(str(root))) / "secret").read_text().strip() not in str(e.value)


def test_a_password_is_never_logged(tmp_path: Path, private_redis: RedisProc, caplog: Any) -> None:
    """A Redis that refuses the password: the failures are logged and counted, the password
    appears in no log line (DEBUG included), error text or stats."""
    with socket.create_connection(("127.0.0.1", private_redis.port)) as s:
        s.sendall(b"CONFIG SET requirepass the-right-one\r\n")
        assert s.recv(16).startswith(b"+OK")
    caplog.set_level(logging.DEBUG)
    url = private_redis.url.replace("redis://", "redis://default:hunter2-secret@")
    cfg = {"path": str(tmp_path / "s"), "redis_url": url, "capacity_gb": 0.1, "interface_v1": 1, "log_interval_s": 0.01}
    with TierStoreBackend(storage_config(cfg), {}) as be:
        pool = mha_pool("page_first")
        fill(pool, 2)
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(keys(2), page_indices([0, 1], 4)) == [False, False]
        assert be.batch_exists(keys(2)) == 0
        stats = repr(be.get_stats()) + repr(be.store.stats())
    assert "redis://default:***@" in caplog.text  # the start-up line names the index, redacted
    assert "hunter2" not in caplog.text and "hunter2" not in stats


def refusing_redis(proc: RedisProc, password: str) -> None:
    with socket.create_connection(("127.0.0.1", proc.port)) as s:
        s.sendall(f"CONFIG SET requirepass {password}\r\n".encode())
        assert s.recv(16).startswith(b"+OK")


def test_the_index_password_from_an_environment_variable_or_a_file(
        tmp_path: Path, private_redis: RedisProc, caplog: Any, monkeypatch: Any) -> None:
    refusing_redis(private_redis, "s3cret-pw")
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("TS_TEST_REDIS_PASSWORD", "s3cret-pw")
    pw_file = tmp_path / "pw"
    pw_file.write_text("s3cret-pw\n")
    os.chmod(pw_file, 0o600)
    base = {"redis_url": private_redis.url, "capacity_gb": 0.1, "interface_v1": 1}
    for i, extra in enumerate(({"redis_password_env": "TS_TEST_REDIS_PASSWORD"}, {"redis_password_file": str(pw_file)})):
        with TierStoreBackend(storage_config({**base, **extra, "path": str(tmp_path / f"s{i}")}), {}) as be:
            write_some_pages(be)
            assert be.batch_exists(keys(3)) == 3
    assert "s3cret-pw" not in caplog.text


@pytest.mark.parametrize("extra, match", [
    ({"redis_password_env": "TS_TEST_UNSET_VARIABLE"}, "'redis_password_env': environment variable 'TS_TEST_UNSET_VARIABLE' is unset"),
    ({"redis_password_file": "/nonexistent/pw"}, "'redis_password_file': cannot read '/nonexistent/pw'"),
    ({"redis_password_file": "WORLD"}, "'redis_password_file': .* not readable by others .*mode 644"),
    ({"redis_password_env": "X", "redis_password_file": "WORLD"}, "set one, not both"),
])
def test_a_bad_password_source_is_named_without_the_password(tmp_path: Path, extra: dict[str, str], match: str) -> None:
    world = tmp_path / "pw"
    world.write_text("visible-pw")
    os.chmod(world, 0o644)
    extra = {k: str(world) if v == "WORLD" else v for k, v in extra.items()}
    cfg = {"path": str(tmp_path / "s"), "redis_url": "redis://127.0.0.1:1/0", **extra}
    with pytest.raises(ConfigError, match=match) as e:
        TierStoreBackend(storage_config(cfg), {})
    assert "visible-pw" not in str(e.value)
    assert not (tmp_path / "s").exists()  # refused before anything was created


@pytest.mark.parametrize("fails", ["write", "fsync", "replace", "link"])
def test_a_file_whose_write_fails_leaves_no_temporary_file_and_the_old_one_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """write_file stages under a temporary name: a failing write, sync, rename or link (a
    full disk, EIO) leaves neither that name nor a part of the new bytes behind."""
    from sglang_tierstore import perms

    target = tmp_path / "marker.json"
    target.write_bytes(b"old")

    def broken(*a: Any, **k: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(perms.os, fails, broken)
    with pytest.raises(OSError, match="No space left"):
        perms.write_file(str(target), b"new", perms.PRIVATE, replace=fails != "link")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker.json"] and target.read_bytes() == b"old"
