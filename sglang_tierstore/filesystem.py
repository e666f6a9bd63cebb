"""What the filesystem under the page files offers, asked of the kernel: space given to or
taken from a range (``fallocate(2)``), a range dropped from the page cache, a filesystem's
id, and whether a mount is one other nodes write too. Knows paths and descriptors, not
page files (:mod:`.pagefile`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from typing import Optional

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_FOLIO = 2 << 20


def fallocate(fd: int, offset: int, nbytes: int, punch: bool = False) -> int:
    """Give a range of a file disk space (the file grows to hold it), or with ``punch``
    make it a hole (the file keeps its size): 0, or the errno it failed with.
    ``fallocate(2)``, not ``posix_fallocate``, which emulates by writing zeros."""
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE if punch else 0
    return 0 if _libc.fallocate(fd, mode, offset, nbytes) == 0 else ctypes.get_errno()


def fsid(path: str) -> Optional[int]:
    """The filesystem id of the filesystem holding ``path`` (None if it cannot be read)."""
    try:
        return os.statvfs(path).f_fsid
    except OSError:
        return None


# Filesystems whose files other nodes write too (mountinfo's type): network and cluster
# filesystems, and FUSE clients of them.
SHARED_TYPES = frozenset({"nfs", "nfs4", "ceph", "lustre", "9p", "cifs", "smb3", "glusterfs", "gpfs", "beegfs",
                          "virtiofs", "afs", "ocfs2", "gfs2", "fuse.ceph-fuse", "fuse.juicefs", "fuse.glusterfs",
                          "fuse.3fs", "fuse.hf3fs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.weka", "wekafs",
                          "fuse.mountpoint-s3", "fuse.rclone", "fuse.dfuse", "fuse.mfs", "fuse.alluxio-fuse",
                          "fuse.blobfuse2"})


def cached_range(offset: int, nbytes: int) -> tuple[int, int]:
    """(offset, length) to drop from the page cache before reading a range: widened to 2 MiB
    boundaries, as the kernel keeps pages a range only partly covers, or large folios
    (best effort still: :meth:`.pagefile.PageFiles.read_uncached` reads through O_DIRECT where it can)."""
    lo = offset // _FOLIO * _FOLIO
    return lo, (offset + nbytes + _FOLIO - 1) // _FOLIO * _FOLIO - lo


def drop_cached(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to forget its cached pages of a range (best effort)."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def shared_fs(path: str) -> bool:
    """Whether ``path`` is on a filesystem other nodes may write (its mount's type, from
    /proc/self/mountinfo; False where that cannot be read)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    real = os.path.realpath(path)
    best, fstype = "", ""
    for ln in lines:
        head, _, tail = ln.partition(" - ")
        parts = head.split()
        if len(parts) < 5 or not tail:
            continue
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # mountinfo's octal escapes
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, tail.split()[0]
    return fstype in SHARED_TYPES
