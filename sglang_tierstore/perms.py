"""Permissions: files no other user can read, directories checked before anything starts, secrets.

KV pages are derived from users' prompts, and the index decides which bytes are served for
which key: on a node shared with other users, every directory tierstore creates is 0700 and
every file 0600 (or 0750/0640 with ``"file_access": "group"``, for an operator's tools running
as another user of the group), set explicitly rather than left to the umask. Directories in
``path`` are checked (created if missing, a probe file written, synced and removed) before an
embedded Redis starts or a store is attached, and what the check created is removed again if
it fails, so a failed start leaves nothing behind. The index's secrets (a password, a TLS
client key) are read from files only their owner can read, and checked before anything starts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import secrets
import shutil
import socket
import ssl
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from sglang_tierstore.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Modes:
    dir: int
    file: int


PRIVATE = Modes(0o700, 0o600)
GROUP = Modes(0o750, 0o640)


def modes(access: str) -> Modes:
    return GROUP if access == "group" else PRIVATE


def make_dir(path: str, m: Modes, made: Optional[list[str]] = None) -> None:
    """``path`` and missing parents, each created with mode ``m.dir`` whatever the umask;
    an existing directory keeps its mode (it may be a mount point the operator owns).
    Appends to ``made`` each directory this call created, as it goes (never one another
    process created meanwhile: that one is theirs to remove)."""
    p = os.path.abspath(path)
    for d in reversed(_missing_ancestors(p)):
        try:
            os.mkdir(d, m.dir)
        except FileExistsError:
            continue  # created meanwhile by another process
        if made is not None:
            made.append(d)
        os.chmod(d, m.dir)
    if not os.path.isdir(p):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), p)


def own_dir(path: str, m: Modes) -> None:
    """A directory that is tierstore's own (a store's directory, the embedded Redis's):
    created if missing, and its mode set to ``m.dir`` every time."""
    make_dir(path, m)
    os.chmod(path, m.dir)


def create_file(path: str, m: Modes, flags: int = os.O_WRONLY) -> int:
    """A new file (``O_EXCL``) with mode ``m.file`` whatever the umask; its descriptor."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, m.file)
    os.fchmod(fd, m.file)
    return fd


def write_file(path: str, data: bytes, m: Modes, replace: bool = True) -> bool:
    """``path`` holding ``data`` whole, with mode ``m.file``, or left as it was: written
    under a temporary name and synced, then renamed over ``path`` (``replace``) or linked
    there only if nothing is (False if something was), so a reader never sees a part."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a crashed process with our pid
    fd = create_file(tmp, m)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:  # nothing left under the temporary name, whatever failed (a full disk, EIO)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: a passing condition, not a configuration's


def check_dirs(paths: Sequence[str], m: Modes) -> list[str]:
    """Every directory in ``paths`` exists or can be created, and takes a written, synced and
    removed probe file; or ConfigError naming the directory (and, for one this process may
    not write, who owns it), with whatever this created removed again. A directory whose
    filesystem is full is not an error (the store comes up serving what it has, and writes
    once there is room): one log line says so. Returns the directories it created (see
    :func:`remove_created`)."""
    created: list[str] = []
    try:
        for path in paths:
            try:
                make_dir(path, m, created)
                _probe(os.path.abspath(path), m)
            except OSError as e:
                if e.errno in FULL and os.path.isdir(path):
                    logger.warning("tierstore: %s is full (%s): serving what is stored, writes fail until there "
                                   "is room", path, e.strerror)
                    continue
                owner = f"; {describe_owner(path)}" if isinstance(e, PermissionError) else ""
                raise ConfigError(
                    f"tierstore config key 'path': {path!r} is not a writable directory ({e.strerror or e}{owner})"
                ) from None
    except ConfigError:
        remove_created(created)
        raise
    return created


def remove_created(created: Sequence[str], keep: Optional[str] = None) -> None:
    """Undo :func:`check_dirs` after a later step of start-up failed: the directories it
    created, with what start-up put in them (nothing there predates this process), except
    those holding ``keep``."""
    for d in sorted(created, key=len, reverse=True):
        if keep is None or not _within(keep, d):
            shutil.rmtree(d, ignore_errors=True)


def _within(path: str, d: str) -> bool:
    """Whether ``path`` is ``d`` or lies under it."""
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(d)]) == os.path.abspath(d)


def _missing_ancestors(p: str) -> list[str]:
    out = []
    while not os.path.lexists(p):
        out.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return out


def _probe(d: str, m: Modes) -> None:
    probe = os.path.join(d, f".tierstore-probe-{os.getpid()}-{secrets.token_hex(4)}")
    fd = create_file(probe, m)
    try:
        os.write(fd, b"tierstore")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def write_changed(path: str, data: bytes, m: Modes) -> bool:
    """``path`` holding ``data`` with mode ``m.file``, written (as :func:`write_file` does)
    only when it holds something else: a restart on a full disk needs no space for files
    that are already right. Whether it wrote."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        if f.read() == data:
            os.fchmod(f.fileno(), m.file)
            return False
    return write_file(path, data, m)


def secret(path: str, m: Modes) -> str:
    """The secret kept in ``path`` (created with a fresh random value if missing). A file
    readable by anyone but its owner (and, with group access, the group) is refused. Ranks
    starting together all read the one value that got there first, never a part of it."""
    if not os.path.exists(path):
        write_file(path, secrets.token_hex(32).encode(), m, replace=False)
    return read_secret(path, os.getuid(), m.file)


def read_secret(path: str, owner: int, mode: int = GROUP.file) -> str:
    """The secret in ``path``, which must be ``owner``'s and open to no one beyond ``mode``
    allows: ConfigError otherwise (never the value)."""
    with open(path) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != owner or st.st_mode & 0o777 & ~mode:
            raise ConfigError(f"tierstore: {path} must be owned by uid {owner} with mode {mode:o} or stricter")
        value = f.read().strip()
    if len(value) < 32:
        raise ConfigError(f"tierstore: {path} does not hold a secret (expected 64 hex characters)")
    return value


def redis_password(env: str | None, path: str | None) -> str | None:
    """The index's password from an environment variable or a file (``redis_password_env``,
    ``redis_password_file``): ConfigError naming the key, never the value, if it is missing,
    empty, or in a file others can read."""
    if env is not None and path is not None:
        raise ConfigError("tierstore config keys 'redis_password_env' and 'redis_password_file': set one, not both")
    if env is not None:
        value = os.environ.get(env, "")
        if not value:
            raise ConfigError(f"tierstore config key 'redis_password_env': environment variable {env!r} is unset or empty")
        return value
    if path is None:
        return None
    value = _key_file_text("redis_password_file", path, owner_only=True).strip()
    if not value:
        raise ConfigError(f"tierstore config key 'redis_password_file': {path!r} is empty")
    return value


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for a ``rediss://`` index (``redis_tls_*``): the CA that signed its
    certificate (None: the system's CAs), and this client's certificate and key (None: none)."""

    ca_file: str | None
    cert_file: str | None
    key_file: str | None


def redis_tls(ca_file: str | None, cert_file: str | None, key_file: str | None) -> TlsFiles | None:
    """The ``redis_tls_*`` files, checked before anything starts by loading them into a TLS
    context as redis-py will at each connection: ConfigError naming the key if a file cannot
    be read or does not hold what the key says, if only one of certificate and key is given,
    or if the key file is readable by others or encrypted (OpenSSL would then ask for its
    passphrase on the terminal at every connection)."""
    if ca_file is None and cert_file is None and key_file is None:
        return None
    if (cert_file is None) != (key_file is None):
        raise ConfigError("tierstore config keys 'redis_tls_cert_file' and 'redis_tls_key_file': set both or neither")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_file is not None:
        _key_file_text("redis_tls_ca_file", ca_file, owner_only=False)
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except ssl.SSLError as e:
            raise ConfigError(
                f"tierstore config key 'redis_tls_ca_file': {ca_file!r} holds no PEM certificate ({e.reason or e})"
            ) from None
    if cert_file is not None and key_file is not None:
        _key_file_text("redis_tls_cert_file", cert_file, owner_only=False)
        _key_file_text("redis_tls_key_file", key_file, owner_only=True)
        try:
            ctx.load_cert_chain(cert_file, key_file, password=_no_passphrase(key_file))
        except ssl.SSLError as e:
            raise ConfigError(
                f"tierstore config keys 'redis_tls_cert_file' and 'redis_tls_key_file': {cert_file!r} and {key_file!r} "
                f"are not a PEM certificate and its private key ({e.reason or e})"
            ) from None
    return TlsFiles(ca_file, cert_file, key_file)


def _no_passphrase(key_file: str) -> Callable[[], str]:
    """OpenSSL's passphrase callback for ``key_file``: only called for an encrypted key."""

    def refuse() -> str:
        raise ConfigError(f"tierstore config key 'redis_tls_key_file': {key_file!r} is encrypted; "
                          "give an unencrypted key in a file only its owner can read")

    return refuse


def _key_file_text(key: str, path: str, owner_only: bool) -> str:
    """The text of the file that config key ``key`` names: ConfigError naming both if it
    cannot be read or, with ``owner_only``, if another user owns it or others can read it."""
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except OSError as e:
        raise ConfigError(f"tierstore config key {key!r}: cannot read {path!r} ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"tierstore config key {key!r}: {path!r} is not a text file") from None
    if owner_only and (st.st_uid != os.getuid() or st.st_mode & 0o007):
        raise ConfigError(
            f"tierstore config key {key!r}: {path!r} must be owned by uid {os.getuid()} and not "
            f"readable by others (found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        )
    return text


def describe_owner(path: str) -> str:
    """Who owns ``path`` (or its nearest existing parent) and its mode, against who this
    process is: for errors about a directory this process may not write."""
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.lstat(p)
    except OSError:
        return f"this process runs as uid {os.getuid()}"
    return (f"{p} is owned by uid {st.st_uid} ({_user(st.st_uid)}), gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o}; "
            f"this process runs as uid {os.getuid()} ({_user(os.getuid())})")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no name"


def check_owned_dir(path: str, m: Modes = PRIVATE) -> None:
    """``path`` is a real directory (no symlink) owned by this user that no one else (but,
    with group access, the group) can enter: where a socket may live without another user
    taking its name first."""
    st = os.lstat(path)
    others = 0o077 if m == PRIVATE else 0o027
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & others:
        raise ConfigError(
            f"tierstore: {path} must be a directory owned by uid {os.getuid()} that no other user can enter "
            f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); refusing to use a socket there"
        )


def peer_uid(sock_path: str, timeout_s: float = 0.5) -> int:
    """The uid of the process listening on a unix socket (``SO_PEERCRED``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(sock_path)
        _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return int(uid)
