"""Orphans: store directories under ``path`` that no store in the index claims.

A store's directory outlives its index keys when the index loses the store (a FLUSHALL,
an embedded Redis that lost its AOF, a node given another index): the processes attach
anew and start a store beside it, and its page files keep disk space no capacity counts.
Repeated wipes would fill the disk, so they are seen: :func:`find` lists them with their
size, for ``tierstore stats``, the exporter, one warning at each start of a serving
process (:func:`say`) and ``tierstore gc``, which removes them.

A serving process removes them itself (:func:`reaped`) only where the index's word is
final: the index is the embedded one under these directories (a store it lost, it lost
with its pages), and no other node writes them (on a shared filesystem, or with an
external index, another node's index may hold a store this one lacks). Even then only a
directory where nothing changed for ``orphan_gc_s`` goes: a store in use touches its
markers at each audit.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Sequence

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.metrics import RateLimitedLog
from sglang_tierstore.space.attach import store_dirs, stored_meta

MiB = 1 << 20
NAMED = 5  # a warning names this many directories, then counts the rest


@dataclass(frozen=True)
class Orphan:
    """A store directory the index holds nothing for."""

    store_id: str
    path: str
    disk_bytes: int  # what its files take on disk (allocated blocks, as ``du`` counts)
    newest: float  # the latest change (mtime) of the directory or of a file in it


def find(index: RedisIndex, prefix: str, paths: Sequence[str]) -> list[Orphan]:
    """Every store directory under the prefix in these paths whose store this index does
    not hold (in any format): one index read per store directory, and a ``stat`` of each
    of its files. Reads only; IndexUnavailable if the index cannot say."""
    out = []
    for store_id, d in store_dirs(paths, prefix):
        if stored_meta(index, prefix, store_id):
            continue
        try:
            files = [e.stat(follow_symlinks=False) for e in os.scandir(d)]
            newest = max([os.stat(d).st_mtime, *(st.st_mtime for st in files)])
        except OSError:  # removed meanwhile, or not ours to read
            continue
        out.append(Orphan(store_id, d, sum(st.st_blocks * 512 for st in files), newest))
    return out


def remove(o: Orphan) -> None:
    """Remove its directory: OSError if it stays. Another process removing it at the same
    time (each rank of a node looks) is no error."""
    try:
        shutil.rmtree(o.path)
    except FileNotFoundError:
        shutil.rmtree(o.path, ignore_errors=True)
        if os.path.lexists(o.path):
            raise


def reaped(cfg: TierStoreConfig, shared: bool) -> bool:
    """Whether a serving process with this config removes orphans itself: the embedded
    index (no ``redis_url``, ``redis_cluster`` or ``redis_sentinel``), page files on no
    shared filesystem (``shared``), ``orphan_gc_s`` on."""
    return bool(cfg.orphan_gc_s) and cfg.index_target is None and not shared


def say(log: RateLimitedLog, found: Sequence[Orphan], cfg: TierStoreConfig, shared: bool) -> None:
    """One warning naming them, their size and how they go."""
    if not found:
        return
    total = sum(o.disk_bytes for o in found)
    named = ", ".join(o.path for o in found[:NAMED]) + (f" and {len(found) - NAMED} more" if len(found) > NAMED else "")
    how = (f"; housekeeping removes each once nothing in it changed for {cfg.orphan_gc_s:g} s (orphan_gc_s)"
           if reaped(cfg, shared) else "")
    log.warning("orphans", "%d store director%s (%.1f MiB on disk) that no store in this index claims: %s (a wiped or "
                "lost index, or another node's); `tierstore gc` lists and removes them%s", len(found),
                "y" if len(found) == 1 else "ies", total / MiB, named, how)
