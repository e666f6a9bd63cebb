"""Real filesystems of the suite's own, mounted for one test (the suite runs as root, as
its FUSE tests do): a small tmpfs that really fills up, a ramfs that cannot punch holes."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def mounted(where: Path, fstype: str, options: str = "mode=0700") -> Iterator[Path]:
    """A fresh ``fstype`` filesystem (tmpfs, ramfs) at ``where``, unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def tmpfs(where: Path, size_mib: int) -> contextlib.AbstractContextManager[Path]:
    """A tmpfs of ``size_mib``: a filesystem that really fills up."""
    return mounted(where, "tmpfs", f"size={size_mib}m,mode=0700")


def fill_disk(d: Path) -> Path:
    """Fill the filesystem of ``d`` to the last byte; the filler file to remove."""
    filler = d / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError:
            pass
    return filler
