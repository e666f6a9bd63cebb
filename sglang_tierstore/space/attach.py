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

Attaching (under a lock on every directory) adopts the store the markers name if
the index knows it, and otherwise creates one. At start-up a known store is dropped
and re-created (it is a cache; one log line says why) when its format is not this
build's or its region size is 4x off what ``capacity_gb`` calls for. Stores of the
layout before regions (keys ``<prefix>:bytes``, ``<prefix>:e:...``, files
``<dir>/c<bytes>/f*.slots``) are dropped the same way.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time as mod_time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import xxhash

from sglang_tierstore.errors import ConfigError, NoStore
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.perms import PRIVATE, Modes, own_dir, write_file
from sglang_tierstore.schema import CONF_FIELDS, FORMAT, glob_escape, meta_key, shard_keys, store_keys, store_tag
from sglang_tierstore.space.geometry import Geometry, needs_new_geometry, region_bytes_for, regions_per_file_for
from sglang_tierstore.space.library import LIBRARY
from sglang_tierstore.tags import load_key

logger = logging.getLogger(__name__)

MARKER = "store.json"
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
    entry_key: bytes  # the store's key for entry tags (:mod:`sglang_tierstore.tags`)

    def shard_keys(self, shard: int) -> list[str]:
        """Every key of a shard, in the order its functions take them."""
        return shard_keys(self.tag, shard)

    def file_identity(self) -> dict[str, object]:
        """What the header of each of its page files says of the store."""
        g = self.geometry
        return {"format": FORMAT, "prefix": self.prefix, "store": g.store_id, "region_bytes": g.region_bytes,
                "regions_per_file": g.regions_per_file}


@contextmanager
def _locked(paths: Sequence[str], prefix: str, m: Modes) -> Iterator[None]:
    with ExitStack() as stack:
        for p in sorted(os.path.abspath(x) for x in paths):
            d = prefix_dir(p, prefix)
            own_dir(d, m)
            fd = os.open(os.path.join(d, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, m.file)
            stack.callback(os.close, fd)
            os.fchmod(fd, m.file)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield


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


def find_store(index: RedisIndex, prefix: str, paths: Sequence[str]) -> str:
    """The id of the store these directories belong to, creating nothing (``attach``
    creates a store where none is): for operators' tools that look before they attach.
    NoStore saying why when the directories carry no marker or the index does not hold
    the store they name in this build's format (then ``attach`` would drop it)."""
    ids = _one_store([_read_marker(p, prefix) for p in paths])
    if not ids:
        raise NoStore(f"no store with prefix {prefix!r} in {', '.join(paths)} "
                      "(no server has used these directories with this prefix yet)")
    meta = index.hgetall(meta_key(store_tag(prefix, ids[0]), "meta"))
    if not meta:
        raise NoStore(f"the directories name store {ids[0]} (prefix {prefix!r}), but the index holds nothing for it "
                      "(Redis lost its data, or this is not the Redis its servers use)")
    if int(meta.get(b"format", 0)) != FORMAT:
        raise NoStore(f"store {ids[0]} (prefix {prefix!r}) is in format {meta.get(b'format', b'?').decode()}; this build "
                      f"reads format {FORMAT} (a server of this build drops and re-creates it at start-up)")
    return ids[0]


def drop_legacy(index: RedisIndex, prefix: str, paths: Sequence[str]) -> bool:
    """Drop a store of the layout before regions (its keys and slot files)."""
    p = glob_escape(prefix.encode()).decode()
    old_dirs = [os.path.join(path, n) for path in paths if os.path.isdir(path) for n in os.listdir(path)
                if _LEGACY_DIR.match(n) and os.path.isdir(os.path.join(path, n))]
    marker_keys = [f"{prefix}:bytes", f"{prefix}:gen"]
    if not index.exists(marker_keys) and not old_dirs:
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


def _drop_store(index: RedisIndex, prefix: str, store_id: str, shards: int, paths: Sequence[str], why: str) -> None:
    tag = store_tag(prefix, store_id)
    index.unlink(store_keys(tag, max(1, shards)))
    for p in paths:
        shutil.rmtree(store_dir(p, prefix, store_id), ignore_errors=True)
    logger.warning("tierstore: dropped store %s (prefix %r): %s; starting an empty one", store_id, prefix, why)


def attach(index: RedisIndex, prefix: str, paths: Sequence[str], capacity: int, shards: int,
           startup: bool, now: float, access: Modes = PRIVATE) -> Home:
    """Adopt or create the store these directories belong to (see module docstring).

    ``startup``: this is the process's first attach, so the store may be re-formatted
    for ``capacity`` and the recorded capacity is set to it. A later attach (the store
    went away under a running process) only adopts or creates.
    """
    index.load(LIBRARY)
    with _locked(paths, prefix, access):
        markers = [_read_marker(p, prefix) for p in paths]
        ids = _one_store(markers)
        if startup:
            drop_legacy(index, prefix, paths)
        store_id = ids[0] if ids else None
        meta: dict[str, str] = {}
        if store_id is not None:
            meta = {k.decode(): v.decode() for k, v in index.hgetall(meta_key(store_tag(prefix, store_id), "meta")).items()}
            why = None
            if not meta:
                why = "the index holds nothing for it (Redis lost its data, or it was dropped)"
            elif int(meta.get("format", 0)) != FORMAT:
                why = f"it was written in format {meta.get('format')} and this build reads format {FORMAT}"
            elif startup and needs_new_geometry(int(meta["region_bytes"]), capacity):
                why = (f"its {int(meta['region_bytes']) >> 10} KiB regions do not suit capacity {capacity >> 20} MiB "
                       f"({region_bytes_for(capacity) >> 10} KiB would)")
            if why:
                _drop_store(index, prefix, store_id, int(meta.get("shards", 1)), paths, why)
                store_id, meta = None, {}
        if store_id is None:
            store_id = secrets.token_hex(8)
            rb = region_bytes_for(capacity)
            shards = max(1, min(shards, capacity // rb))  # every shard gets a region at least
            meta = {"format": str(FORMAT), "region_bytes": str(rb), "shards": str(shards), "capacity": str(capacity),
                    "regions_per_file": str(regions_per_file_for(capacity, rb, len(paths))), "created": repr(mod_time.time())}
        tag = store_tag(prefix, store_id)
        meta = index.hsetnx_all(meta_key(tag, "meta"), meta)
        geometry = Geometry(store_id, int(meta["region_bytes"]), int(meta["regions_per_file"]), int(meta["shards"]))
        for s in range(geometry.shards):
            index.hsetnx_all(shard_keys(tag, s)[0], shard_conf(geometry, s, int(meta["capacity"])))
        if startup and int(meta["capacity"]) != capacity:
            set_capacity(index, tag, geometry, capacity)
            logger.info("tierstore: store %s capacity %d MiB -> %d MiB", store_id, int(meta["capacity"]) >> 20, capacity >> 20)
        dirs: dict[str, str] = {}
        for p, m in zip(paths, markers):
            dir_id = m["dir"] if m else secrets.token_hex(4)
            if not m or m["store"] != store_id:
                _write_marker(p, prefix, store_id, dir_id, access)
            sd = store_dir(p, prefix, store_id)
            own_dir(sd, access)
            dirs[dir_id] = sd
            for other in os.listdir(prefix_dir(p, prefix)):  # pages of stores dropped meanwhile
                if other != store_id and re.match(r"^[0-9a-f]{16}$", other):
                    shutil.rmtree(os.path.join(prefix_dir(p, prefix), other), ignore_errors=True)
        entry_key = load_key(list(dirs.values()), access)
        report_dirs(index, tag, dirs, now)
    return Home(prefix, geometry, dirs, tag, entry_key)


def set_capacity(index: RedisIndex, tag: str, geometry: Geometry, capacity: int) -> None:
    """Record a new capacity; housekeeping in every process evicts down to it."""
    index.hset(meta_key(tag, "meta"), {"capacity": capacity})
    for s in range(geometry.shards):
        index.hset(shard_keys(tag, s)[0], {"cap": geometry.capacity_share(capacity, s)})


def report_dirs(index: RedisIndex, tag: str, dirs: dict[str, str], now: float) -> None:
    """Say this process has these directories now (see :func:`retired_dirs`)."""
    index.hset(meta_key(tag, "dirs"), {d: json.dumps({"path": p, "host": socket.gethostname(), "seen": now})
                                      for d, p in dirs.items()})


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


def forget_dir(index: RedisIndex, tag: str, dir_id: str) -> None:
    index.hdel(meta_key(tag, "dirs"), dir_id)


def shard_conf(geometry: Geometry, shard: int, capacity: int) -> dict[str, object]:
    """A new shard's conf hash (``schema.CONF_FIELDS``)."""
    return dict(zip(CONF_FIELDS, (geometry.store_id, geometry.capacity_share(capacity, shard), 0, geometry.region_bytes,
                                  geometry.regions_per_file, geometry.shards, shard, 0, 0)))
