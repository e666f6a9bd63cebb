"""The embedded default: one private redis-server per store directory, per node.

With no ``redis_url``, every rank and instance using the same ``path`` joins one
redis-server listening on a unix socket, with AOF persistence under
``<path>/redis``. Whoever finds it missing starts it (under a file lock, so one
does); it is daemonized and outlives the process that started it, so restarts and
other ranks find it, and a backend that sees it gone starts it again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import time

import xxhash

from sglang_tierstore.errors import EmbeddedRedisError

_SUN_PATH_MAX = 104  # sockaddr_un limit, with some margin


def redis_dir(path: str) -> str:
    return os.path.join(os.path.abspath(path), "redis")


def socket_path(path: str) -> str:
    """The socket under the store directory, or a per-directory one in /tmp if that is too long."""
    sock = os.path.join(redis_dir(path), "redis.sock")
    if len(sock) < _SUN_PATH_MAX:
        return sock
    return f"/tmp/tierstore-{xxhash.xxh3_64_hexdigest(os.path.abspath(path).encode())}.sock"


def pid_file(path: str) -> str:
    return os.path.join(redis_dir(path), "redis.pid")


def _listening(sock: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(sock)
        return True
    except OSError:
        return False
    finally:
        s.close()


def ensure_embedded_redis(path: str, redis_server: str = "redis-server", timeout_s: float = 30.0) -> str:
    """Start or join the embedded redis-server for ``path``; return its ``unix://`` URL."""
    sock = socket_path(path)
    url = f"unix://{sock}"
    if _listening(sock):
        return url
    binary = shutil.which(redis_server)
    if binary is None:
        raise EmbeddedRedisError(
            f"tierstore: no redis_url given and no {redis_server!r} binary found to start an embedded "
            "Redis. Install one (Debian/Ubuntu: apt-get install redis-server) or set "
            "\"redis_url\": \"redis://host:port/db\" in --hicache-storage-backend-extra-config."
        )
    d = redis_dir(path)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _listening(sock):
            return url
        if os.path.exists(sock):
            os.unlink(sock)  # left by a redis-server that died
        cmd = [
            binary, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700",
            "--dir", d, "--appendonly", "yes", "--save", "",
            "--daemonize", "yes", "--pidfile", pid_file(path), "--logfile", os.path.join(d, "redis.log"),
        ]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError) as e:
            raise EmbeddedRedisError(f"tierstore: starting embedded redis-server failed: {e}") from e
        deadline = time.monotonic() + timeout_s
        while not _listening(sock):
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(
                    f"tierstore: embedded redis-server did not listen on {sock} within {timeout_s}s; see {d}/redis.log"
                )
            time.sleep(0.05)
    return url
