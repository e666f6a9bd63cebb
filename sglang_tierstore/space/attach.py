"""Which store a set of directories belongs to, and attaching to it (adopt or create).

A store is ``(redis_prefix, store id)``. The id is written into a marker in each of
its directories (``<dir>/tierstore-<prefix>/store.json``, with that directory's own
id) and names every key of the store in the index. Each store directory also holds
the store's entry key (:mod:`sglang_tierstore.tags`). So:

- stores with different prefixes on one path use different subdirectories;
- two nodes sharing one Redis and one prefix, each with its own local path, get two
  stores (their markers differ): neither ever sees the other's entries;
- processes on one node with the same path and prefix share one store;
- a directory added to ``path`` joins the store (new files may go there); one
  removed keeps its files where they are, and the store forgets them once no process
  has reported that directory for ``10 * lease_s``.

A serving process attaches (:func:`attach`) under a lock in the index (``SET NX`` with a
token and an expiry: one attach at a time per prefix over the whole fleet, which a shared
filesystem's ``flock`` cannot promise: node-local on NFS with ``local_lock``, ENOSYS on
Lustre with ``noflock``, per mount on FUSE) and, as well, ``flock`` on every directory
(where the filesystem has no locks, one log line). Neither lock is waited for: while another
process holds one the attach is AttachBusy, and the caller (housekeeping) tries again at its
next pass; the index's lock expires within ``LOCK_TTL_MS`` unless its holder renews it, so a
holder killed or frozen mid-attach delays the others by that much at most (one stuck past
``HOLD_MAX_S`` stops renewing it), and a stalled one finds it lost before its next step that
changes the store (:meth:`_Lock.still_held`). It adopts the store the markers name if
the index knows it, else another store directory under the prefix that the index knows
(each store directory carries a marker of its own), and otherwise creates one, once it
knows the largest page the store is for (its region size depends on it; until then the
process answers misses). Attaching never removes a directory because this index lacks
its store: on a shared filesystem another node's index may hold it (or this node was given
the wrong ``redis_url``); the process starts a store of its own beside it and says why.
Such directories are orphans (:mod:`.orphans`): counted, and removed by ``tierstore gc``,
or by housekeeping only where the index is the embedded one under them. A store is never
re-cut for a capacity: the first process's
``capacity_gb`` and pages set it, and a process started with another ``capacity_gb`` logs
both values and uses the store's (``tierstore resize`` changes it). At its first attach a
process drops a store of another format version, or of the layout before regions (keys
``<prefix>:bytes``, ``<prefix>:e:...``, files ``<dir>/c<bytes>/f*.slots``): it is a cache;
one log line says why. Operators' tools join (:func:`observe`): they read the markers, the
index and the entry key, and write nothing.

What a full index or a full disk refuses is ridden out: attaching to a store that exists
reads first and writes only what is missing (an index at ``maxmemory`` refuses every write,
even one that would change nothing), and reporting this process's directories is a hint
that may fail; a directory that cannot be written for want of permission is a ConfigError
naming it and its owner.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time as mod_time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import xxhash

from sglang_tierstore.errors import (
    AttachBusy,
    ConfigError,
    IndexRefusesWrites,
    IndexUnavailable,
    NoStore,
    NoStoreYet,
    StoreDirsUnavailable,
    TierStoreError,
)
from sglang_tierstore.index import RedisIndex, spread_suffixes
from sglang_tierstore.perms import PRIVATE, Modes, describe_owner, own_dir, write_file
from sglang_tierstore.schema import CONF_FIELDS, FORMAT, glob_escape, meta_key, shard_keys, shard_tags, store_keys, store_tag
from sglang_tierstore.space.geometry import Geometry, region_bytes_for, regions_per_file_for
from sglang_tierstore.tags import load_key, read_key

logger = logging.getLogger(__name__)

GiB = 1 << 30

MARKER = "store.json"
LOCK_TTL_MS = 5_000  # an attach lock whose holder died or stalled lapses after this
RENEW_S = 1.0  # how often a holder renews it while it attaches
HOLD_MAX_S = 60.0  # an attach stuck longer (a hung filesystem) stops renewing: the lock lapses for the others
SHARDS_PER_MASTER = 1  # a store's default shards per master: a batch is one call per master (docs/design.md)
_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")
_LEGACY_KINDS = ("e", "c", "free", "pend", "lease", "lru", "bad")
_LEGACY_DIR = re.compile(r"^c\d+$")


def prefix_dir(path: str, prefix: str) -> str:
    """``<path>/tierstore-<prefix>``, with a hash suffix if the prefix is not a safe name."""
    if _SAFE.match(prefix):
        name = prefix
    else:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", prefix) + "-" + xxhash.xxh3_64_hexdigest(prefix.encode())[:8]
    return os.path.join(os.path.abspath(path), f"tierstore-{name}")


def store_dir(path: str, prefix: str, store_id: str) -> str:
    return os.path.join(prefix_dir(path, prefix), store_id)


@dataclass(frozen=True)
class Home:
    """Where the store this process works on lives: its geometry, its directories here,
    its keys' hash tag and its entry key."""

    prefix: str
    geometry: Geometry
    dirs: dict[str, str]  # directory id -> the store's page directory in it
    tag: str  # the hash tag of its keys (schema.store_tag)
    shard_tags: tuple[str, ...]  # each shard's hash tag (schema.shard_tags)
    entry_key: bytes  # the store's key for entry tags (:mod:`sglang_tierstore.tags`)
    capacity: int  # the store's capacity when joined (bytes); replies from the index keep it current
    node: str = ""  # this node's name (``node_name``), in the directories' reports

    def shard_keys(self, shard: int) -> list[str]:
        """Every key of a shard, in the order its functions take them."""
        return shard_keys(self.shard_tags[shard])

    def file_identity(self) -> dict[str, object]:
        """What the header of each of its page files says of the store."""
        g = self.geometry
        return {"format": FORMAT, "prefix": self.prefix, "store": g.store_id, "region_bytes": g.region_bytes,
                "regions_per_file": g.regions_per_file}


_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
_said_no_locks: set[str] = set()


@contextmanager
def _locked(paths: Sequence[str], prefix: str, m: Modes) -> Iterator[None]:
    """``flock`` on every directory: processes of one node (the index lock is the fleet's).
    Never waits: a directory another process holds (it attaches now) is AttachBusy."""
    with ExitStack() as stack:
        for p in sorted(os.path.abspath(x) for x in paths):
            d = prefix_dir(p, prefix)
            own_dir(d, m)
            fd = os.open(os.path.join(d, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, m.file)
            stack.callback(os.close, fd)
            os.fchmod(fd, m.file)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise AttachBusy(f"another process of this node is attaching to {d}") from None
                if e.errno not in _NO_LOCKS:
                    raise
                if d not in _said_no_locks:
                    _said_no_locks.add(d)
                    logger.warning("tierstore: %s has no file locks (%s): attaching relies on the index's lock alone",
                                   d, os.strerror(e.errno))
        yield


def lock_key(prefix: str) -> str:
    """The index's attach lock of a prefix (under the prefix's key globs, for ACL rules)."""
    return f"{{{prefix}:attach}}:lock"


@dataclass
class _Lock:
    """The fleet's attach lock as this attach holds it (``held`` False: without it),
    renewed every ``RENEW_S`` by a thread of its own while the attach runs, so that it
    lapses within ``LOCK_TTL_MS`` of its holder's death or stall."""

    index: RedisIndex
    key: str
    token: str
    held: bool
    lost: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def still_held(self) -> None:
        """Before each step that changes the store (dropping one, its meta, the markers):
        AttachBusy if the lock lapsed meanwhile (a stalled attach: another may be attaching now)."""
        if self.held and (self.lost.is_set() or self.index.get(self.key) != self.token.encode()):
            raise AttachBusy(f"the attach lock {self.key} lapsed during this attach: trying again later")

    def renew(self) -> None:
        """The renewing thread: until the attach is done, the lock is found lost, or the
        attach has held it ``HOLD_MAX_S`` (stuck: the lock lapses, and ``still_held`` stops it)."""
        deadline = mod_time.monotonic() + HOLD_MAX_S
        while not self.done.wait(RENEW_S) and mod_time.monotonic() < deadline:
            try:
                if not self.index.extend_if(self.key, self.token, LOCK_TTL_MS):
                    self.lost.set()
                    return
            except TierStoreError:  # the next renewal tries again; a lapse shows in still_held
                pass


@contextmanager
def _index_locked(index: RedisIndex, prefix: str, node: str) -> Iterator[_Lock]:
    """The fleet's attach lock, or AttachBusy at once while another holds it (it lapses
    within ``LOCK_TTL_MS`` of its holder's death). An index that refuses writes (full,
    read-only) can take no lock: the attach then only adopts (drops nothing)."""
    token = f"{node}:{os.getpid()}:{secrets.token_hex(6)}"
    key = lock_key(prefix)
    try:
        if not index.set_nx(key, token, LOCK_TTL_MS) and index.get(key) != token.encode():  # (ours: its reply was lost)
            raise AttachBusy(f"another process holds the attach lock {key}")
    except IndexRefusesWrites as e:
        logger.warning("tierstore: attaching without the index's lock (%s): adopting only, dropping nothing", e)
        yield _Lock(index, key, token, False)
        return
    lock = _Lock(index, key, token, True)
    renewer = threading.Thread(target=lock.renew, name="tierstore-attach-lock", daemon=True)
    renewer.start()
    try:
        yield lock
    finally:
        lock.done.set()
        renewer.join()
        try:
            index.delete_if(key, token)
        except IndexUnavailable:  # it lapses by itself
            pass


def _read_marker(path: str, prefix: str) -> Optional[dict[str, str]]:
    try:
        with open(os.path.join(prefix_dir(path, prefix), MARKER)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"tierstore config key 'path': {path} has an unreadable store marker ({e})") from None
    if not isinstance(doc, dict) or doc.get("prefix") != prefix or not doc.get("store") or not doc.get("dir"):
        raise ConfigError(f"tierstore config key 'path': {path} has a store marker for another store: {doc!r}")
    return {"store": str(doc["store"]), "dir": str(doc["dir"])}


def _one_store(markers: Sequence[Optional[dict[str, str]]]) -> list[str]:
    """The store id the markers name (none, or one); ConfigError if they name several."""
    ids = sorted({m["store"] for m in markers if m})
    if len(ids) > 1:
        raise ConfigError(f"tierstore config key 'path': the directories belong to different stores ({', '.join(ids)}); "
                          "give each store its own directories")
    return ids


def _write_marker(path: str, prefix: str, store_id: str, dir_id: str, m: Modes) -> None:
    doc = json.dumps({"prefix": prefix, "store": store_id, "dir": dir_id}).encode()
    write_file(os.path.join(prefix_dir(path, prefix), MARKER), doc, m)


def stored_meta(index: RedisIndex, prefix: str, store_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in index.hgetall(meta_key(store_tag(prefix, store_id), "meta")).items()}


def _geometry(store_id: str, meta: dict[str, str]) -> Geometry:
    return Geometry(store_id, int(meta["region_bytes"]), int(meta["regions_per_file"]), int(meta["shards"]))


def observe(index: RedisIndex, prefix: str, paths: Sequence[str]) -> Home:
    """Join the store these directories belong to as it is, writing nothing anywhere (no
    lock, marker, key, mode or directory report): for operators' tools, run as any user
    that can read the store (its owner, root, a member of a ``file_access: group`` store's
    group). Directories that carry no marker of the store are left out. NoStore saying why
    when there is none, or the index does not hold it in this build's format."""
    markers = [_read_marker(p, prefix) for p in paths]
    ids = _one_store(markers)
    if not ids:
        raise NoStore(f"no store with prefix {prefix!r} in {', '.join(paths)} "
                      "(no server has used these directories with this prefix yet)")
    store_id = ids[0]
    meta = stored_meta(index, prefix, store_id)
    if not meta:
        raise NoStore(f"the directories name store {store_id} (prefix {prefix!r}), but the index holds nothing for it "
                      "(Redis lost its data, or this is not the Redis its servers use)")
    if int(meta.get("format", 0)) != FORMAT:
        raise NoStore(f"store {store_id} (prefix {prefix!r}) is in format {meta.get('format', '?')}; this build "
                      f"reads format {FORMAT} (a server of this build drops and re-creates it at start-up)")
    dirs = {m["dir"]: store_dir(p, prefix, store_id) for p, m in zip(paths, markers) if m and m["store"] == store_id}
    tag = store_tag(prefix, store_id)
    return Home(prefix, _geometry(store_id, meta), dirs, tag, shard_tags(tag, meta), read_key(list(dirs.values())),
                int(meta["capacity"]))


def drop_legacy(index: RedisIndex, prefix: str, paths: Sequence[str]) -> bool:
    """Drop a store of the layout before regions (its keys and slot files)."""
    p = glob_escape(prefix.encode()).decode()
    old_dirs = [os.path.join(path, n) for path in paths if os.path.isdir(path) for n in os.listdir(path)
                if _LEGACY_DIR.match(n) and os.path.isdir(os.path.join(path, n))]
    marker_keys = [f"{prefix}:bytes", f"{prefix}:gen"]
    if not index.exists(marker_keys):  # slot files alone prove nothing: another prefix's, another fleet's
        return False
    n = index.unlink(marker_keys)
    for kind in _LEGACY_KINDS:
        batch: list[str] = []
        for k in index.scan_keys(f"{p}:{kind}:*"):
            batch.append(k.decode())
            if len(batch) >= 1000:
                n += index.unlink(batch)
                batch = []
        n += index.unlink(batch)
    files = 0
    for d in old_dirs:
        for name in os.listdir(d):
            if name.endswith(".slots"):
                os.unlink(os.path.join(d, name))
                files += 1
        try:
            os.rmdir(d)
        except OSError:
            pass
    logger.warning("tierstore: dropped a store of the previous layout (prefix %r: %d index keys, %d page files); "
                   "this build keeps pages in regions and starts empty", prefix, n, files)
    return True


def _drop_store(index: RedisIndex, prefix: str, store_id: str, meta: dict[str, str], paths: Sequence[str]) -> None:
    """Its keys, its directories and the markers naming it (the next attach starts a store
    without saying the index lost this one)."""
    tag = store_tag(prefix, store_id)
    index.unlink(store_keys(tag, shard_tags(tag, meta)))
    for p in paths:
        shutil.rmtree(store_dir(p, prefix, store_id), ignore_errors=True)
        m = _read_marker(p, prefix)
        if m is not None and m["store"] == store_id:
            os.unlink(os.path.join(prefix_dir(p, prefix), MARKER))


def drop(index: RedisIndex, prefix: str, paths: Sequence[str], store_id: str, node: Optional[str] = None) -> bool:
    """Drop a store (its index keys, directories and markers) under the fleet's attach
    lock: ``tierstore drop``. Processes attached to it detach at their next call of the
    index's functions and attach anew; the first creates a new store, cut for its own
    largest page. False if the index holds nothing for it."""
    with _index_locked(index, prefix, node or socket.gethostname()) as lock:
        meta = stored_meta(index, prefix, store_id)
        if not meta:
            return False
        lock.still_held()
        _drop_store(index, prefix, store_id, meta, paths)
    return True


def attach(index: RedisIndex, prefix: str, paths: Sequence[str], capacity: int, shards: Optional[int], now: float,
           first: bool, largest_page: Optional[int], access: Modes = PRIVATE, node: Optional[str] = None) -> Home:
    """Adopt or create the store these directories belong to (see the module docstring).

    ``first``: this process's first attach (stores of other formats and the layout before
    regions are dropped then). ``largest_page``: the largest page the process knows it
    will store; None: adopt only (NoStoreYet when there is no store to adopt). Creating
    a store: ``capacity`` and ``shards`` (None: one per master, so 1 on one server;
    ConfigError if ``capacity`` cannot hold pages that large). IndexUnavailable (IndexRefusesWrites) if the index cannot do what is
    needed; StoreDirsUnavailable if the directories cannot take what must be written
    (a full disk: ``perms.check_dirs`` has shown them writable). ``node``: this node's
    name (``node_name``), in the lock's token and the directories' reports."""
    node = node or socket.gethostname()
    try:
        # the fleet's lock first: flock, where it works across nodes, is taken in each node's
        # order of its own paths, which may differ between nodes
        with _index_locked(index, prefix, node) as lock, _locked(paths, prefix, access):
            return _attach_locked(index, prefix, paths, capacity, shards, now, first and lock.held, largest_page,
                                  access, node, lock)
    except TierStoreError:
        raise
    except PermissionError as e:
        where = e.filename or paths[0]
        raise ConfigError(f"tierstore config key 'path': {where} cannot be written by this process "
                          f"({describe_owner(where)}): {e.strerror}") from None
    except OSError as e:
        raise StoreDirsUnavailable(f"the store's directories cannot be written now ({e.filename}: {e.strerror})") from e


def store_dirs(paths: Sequence[str], prefix: str) -> Iterator[tuple[str, str]]:
    """(store id, directory) of every directory under the prefix in these paths named like a store."""
    for p in paths:
        try:
            names = sorted(os.listdir(prefix_dir(p, prefix)))
        except OSError:
            continue
        for name in names:
            d = os.path.join(prefix_dir(p, prefix), name)
            if re.match(r"^[0-9a-f]{16}$", name) and os.path.isdir(d):
                yield name, d


def _stores_here(paths: Sequence[str], prefix: str) -> list[str]:
    """Ids of the store directories under the prefix in these paths that carry their own marker."""
    found: list[str] = []
    for name, d in store_dirs(paths, prefix):
        if name not in found and _read_own_marker(d, prefix, name) is not None:
            found.append(name)
    return found


def _adopt(index: RedisIndex, prefix: str, paths: Sequence[str], ids: Sequence[str],
           may_drop: bool) -> tuple[Optional[str], dict[str, str]]:
    """The store to adopt (the markers' first, then any other store directory here), and its
    meta. The markers' store in an older format that the index holds is dropped, files and
    all (``may_drop``: under the attach lock); one in a newer format (a rolling upgrade's
    newer nodes) or found only beside it is left alone, and a new store starts beside it."""
    unknown = []
    found: list[tuple[float, str, dict[str, str]]] = []
    for store_id in [*ids, *(x for x in _stores_here(paths, prefix) if x not in ids)]:
        meta = stored_meta(index, prefix, store_id)
        if not meta:
            unknown.append(store_id)
        elif int(meta.get("format", 0)) != FORMAT:
            if may_drop and store_id in ids and int(meta.get("format", 0)) < FORMAT:
                _drop_store(index, prefix, store_id, meta, paths)
                logger.warning("tierstore: dropped store %s (prefix %r): it was written in format %s and this build "
                               "reads format %d; starting an empty one", store_id, prefix, meta.get("format"), FORMAT)
            else:
                unknown.append(store_id)
        elif store_id in ids:
            return store_id, meta
        else:
            found.append((_last_seen(index, store_tag(prefix, store_id)), store_id, meta))
    if found:  # the store the other nodes use now: the one whose directories were reported last
        _, store_id, meta = max(found)
        logger.warning("tierstore: this index holds nothing for store(s) %s in %s; adopting store %s, which is in use "
                       "beside them", ", ".join(unknown) or "(none)", ", ".join(paths), store_id)
        return store_id, meta
    if unknown:
        logger.warning("tierstore: this index holds nothing for store(s) %s in %s (Redis lost its data, it was dropped, "
                       "or another node's index holds it: check redis_url); their directories stay (`tierstore gc` "
                       "removes them, and with the embedded index housekeeping after orphan_gc_s) and a new store "
                       "starts beside them", ", ".join(unknown),
                       ", ".join(paths))
    return None, {}


def _attach_locked(index: RedisIndex, prefix: str, paths: Sequence[str], capacity: int, shards: Optional[int], now: float,
                   first: bool, largest_page: Optional[int], access: Modes, node: str, lock: _Lock) -> Home:
    markers = [_read_marker(p, prefix) for p in paths]
    ids = _one_store(markers)
    if first:
        lock.still_held()
        drop_legacy(index, prefix, paths)
    lock.still_held()
    store_id, meta = _adopt(index, prefix, paths, ids, lock.held)
    if store_id is None:
        if largest_page is None:
            raise NoStoreYet(f"no store with prefix {prefix!r} in {', '.join(paths)} yet: it is created with the "
                             "first pages' size")
        lock.still_held()
        store_id = secrets.token_hex(8)
        try:
            rb = region_bytes_for(capacity, largest_page)
        except ValueError as e:
            raise ConfigError(f"tierstore config key 'capacity_gb': {e}") from None
        owners = index.slot_owners()
        if shards is None:
            shards = SHARDS_PER_MASTER * len({o for o in owners if o is not None})
        shards = max(1, min(shards, capacity // rb))  # every shard gets a region at least
        meta = {"format": str(FORMAT), "region_bytes": str(rb), "shards": str(shards), "capacity": str(capacity),
                "shard_tags": ",".join(spread_suffixes(store_tag(prefix, store_id), shards, owners)),
                "regions_per_file": str(regions_per_file_for(capacity, rb, len(paths))), "created": repr(mod_time.time())}
        meta = index.hsetnx_all(meta_key(store_tag(prefix, store_id), "meta"), meta)
    tag = store_tag(prefix, store_id)
    geometry = _geometry(store_id, meta)
    stags = shard_tags(tag, meta)
    for s in range(geometry.shards):  # a creator that died between the two leaves them to the next
        if not index.exists([shard_keys(stags[s])[0]]):
            index.hsetnx_all(shard_keys(stags[s])[0], shard_conf(geometry, s, int(meta["capacity"])))
    if int(meta["capacity"]) != capacity:
        logger.warning("tierstore: store %s (prefix %r) has capacity %.3f GiB; this process's capacity_gb %.3f is not "
                       "applied (a store's capacity is its own: `tierstore resize` changes it)",
                       store_id, prefix, int(meta["capacity"]) / GiB, capacity / GiB)
    dirs: dict[str, str] = {}
    lock.still_held()
    for p, m in zip(paths, markers):
        sd = store_dir(p, prefix, store_id)
        own = _read_own_marker(sd, prefix, store_id)
        dir_id = own or (m["dir"] if m and m["store"] == store_id else secrets.token_hex(4))
        if not m or m["store"] != store_id or m["dir"] != dir_id:
            _write_marker(p, prefix, store_id, dir_id, access)
        own_dir(sd, access)
        if own is None:
            write_file(os.path.join(sd, MARKER), json.dumps({"prefix": prefix, "store": store_id, "dir": dir_id}).encode(),
                       access)
        dirs[dir_id] = sd
    entry_key = load_key(list(dirs.values()), access)
    try:
        report_dirs(index, tag, dirs, now, node)
    except IndexRefusesWrites as e:  # a hint for retiring directories: the next audit reports again
        logger.warning("tierstore: reporting this process's directories failed (%s); the next audit does", e)
    return Home(prefix, geometry, dirs, tag, stags, entry_key, int(meta["capacity"]), node)


def set_capacity(index: RedisIndex, home: Home, capacity: int) -> None:
    """Record a new capacity; housekeeping in every process evicts down to it."""
    index.hset(meta_key(home.tag, "meta"), {"capacity": capacity})
    for s in range(home.geometry.shards):
        index.hset(home.shard_keys(s)[0], {"cap": home.geometry.capacity_share(capacity, s)})


def report_dirs(index: RedisIndex, tag: str, dirs: dict[str, str], now: float, node: str) -> None:
    """Say this process (on node ``node``) has these directories now (see :func:`retired_dirs`)."""
    index.hset(meta_key(tag, "dirs"), {d: json.dumps({"path": p, "host": node, "seen": now}) for d, p in dirs.items()})


def _read_own_marker(sd: str, prefix: str, store_id: str) -> Optional[str]:
    """The directory id a store directory's own marker gives, if it names this store."""
    try:
        with open(os.path.join(sd, MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and doc.get("prefix") == prefix and doc.get("store") == store_id and doc.get("dir"):
        return str(doc["dir"])
    return None


def retired_dirs(index: RedisIndex, tag: str, mine: Sequence[str], older_than: float) -> list[str]:
    """Directories of the store no process has reported since ``older_than``."""
    out = []
    for d, raw in index.hgetall(meta_key(tag, "dirs")).items():
        dir_id = d.decode()
        if dir_id in mine:
            continue
        try:
            seen = float(json.loads(raw)["seen"])
        except (ValueError, KeyError, TypeError):
            seen = 0.0
        if seen < older_than:
            out.append(dir_id)
    return out


def _last_seen(index: RedisIndex, tag: str) -> float:
    """When a process last reported one of the store's directories (0: never)."""
    seen = [0.0]
    for raw in index.hgetall(meta_key(tag, "dirs")).values():
        try:
            seen.append(float(json.loads(raw)["seen"]))
        except (ValueError, KeyError, TypeError):
            pass
    return max(seen)


def forget_dir(index: RedisIndex, tag: str, dir_id: str) -> None:
    index.hdel(meta_key(tag, "dirs"), dir_id)


def shard_conf(geometry: Geometry, shard: int, capacity: int) -> dict[str, object]:
    """A new shard's conf hash (``schema.CONF_FIELDS``)."""
    return dict(zip(CONF_FIELDS, (geometry.store_id, geometry.capacity_share(capacity, shard), 0, geometry.region_bytes,
                                  geometry.regions_per_file, geometry.shards, shard, 0, 0)))
