"""Page files: preallocated files of fixed-size slots. Knows offsets, not keys.

A slot class holds the pages of one size. Its slots (the page size rounded up to
4 KiB, so every slot starts O_DIRECT-aligned) are numbered 0.. and live in files of
``slots_per_file`` slots, file ``n`` in directory ``paths[n % len(paths)]``
(striping over devices)::

    <dir>/c<page_bytes>/f<n>.slots      slot i at offset (i % slots_per_file) * slot_size

A slot holds the page's bytes and nothing else, so a page moves in one contiguous,
aligned I/O of its own size. The index vouches for what a slot holds: its entry
carries the xxh3 checksum of the bytes, so a slot that was reused, half written or
rotted since reads as a miss. (A slot that now holds other bytes identical to the
page's would pass: then the bytes returned are the page's, which is all a read
promises.)
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Sequence

import xxhash

from sglang_tierstore.errors import PageIOError
from sglang_tierstore.hostmem import ALIGN


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def checksum(regions: Sequence[memoryview]) -> int:
    if len(regions) == 1:
        return xxhash.xxh3_64_intdigest(regions[0])
    h = xxhash.xxh3_64()
    for r in regions:
        h.update(r)
    return h.intdigest()


@dataclass(frozen=True, slots=True)
class SlotClass:
    page_bytes: int
    slots_per_file: int

    @property
    def name(self) -> str:
        return str(self.page_bytes)

    @property
    def slot_size(self) -> int:
        return round_up(self.page_bytes)

    @property
    def file_bytes(self) -> int:
        return self.slot_size * self.slots_per_file


class PageFiles:
    """Open (creating and preallocating) page files; positioned I/O of one slot."""

    def __init__(self, paths: Sequence[str], o_direct: bool, fsync: bool) -> None:
        self.paths = tuple(paths)
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self._fds: dict[tuple[int, int], tuple[int, int]] = {}
        self._lock = threading.Lock()
        for p in self.paths:
            os.makedirs(p, exist_ok=True)

    def file_path(self, cls: SlotClass, file_no: int) -> str:
        d = self.paths[file_no % len(self.paths)]
        return os.path.join(d, f"c{cls.name}", f"f{file_no:06d}.slots")

    def locate(self, cls: SlotClass, slot: int) -> tuple[int, int]:
        """(file number, byte offset) of a slot."""
        return slot // cls.slots_per_file, (slot % cls.slots_per_file) * cls.slot_size

    def _open(self, cls: SlotClass, file_no: int) -> tuple[int, int]:
        """(buffered fd, O_DIRECT fd or -1), created and preallocated on first use."""
        key = (cls.page_bytes, file_no)
        fds = self._fds.get(key)
        if fds is not None:
            return fds
        with self._lock:
            fds = self._fds.get(key)
            if fds is not None:
                return fds
            path = self.file_path(cls, file_no)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise PageIOError(e.errno, f"cannot open page file {path}: {e.strerror}") from e
            try:
                if os.fstat(fd).st_size < cls.file_bytes:
                    os.posix_fallocate(fd, 0, cls.file_bytes)
            except OSError as e:
                os.close(fd)
                raise PageIOError(e.errno, f"cannot preallocate {path}: {e.strerror}") from e
            dfd = -1
            if self.o_direct:
                try:
                    dfd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise PageIOError(e.errno, f"cannot open {path}: {e.strerror}") from e
            self._fds[key] = (fd, dfd)
            return fd, dfd

    def write_slot(self, cls: SlotClass, slot: int, data: Sequence[memoryview], nbytes: int, aligned: bool) -> None:
        """Write a page (``nbytes`` in ``data``) into a slot with one pwritev."""
        self._io("write", cls, slot, data, nbytes, aligned)

    def read_slot(self, cls: SlotClass, slot: int, data: Sequence[memoryview], nbytes: int, aligned: bool) -> None:
        """Read a slot's page (``nbytes`` into ``data``) with one preadv."""
        self._io("read", cls, slot, data, nbytes, aligned)

    def _io(self, op: str, cls: SlotClass, slot: int, data: Sequence[memoryview], nbytes: int, aligned: bool) -> None:
        file_no, off = self.locate(cls, slot)
        fd, dfd = self._open(cls, file_no)
        use_fd = dfd if aligned and dfd >= 0 else fd
        try:
            if op == "read":
                n = os.preadv(use_fd, data, off)
            else:
                n = _pwritev_all(use_fd, data, off, nbytes)
                if self.fsync:
                    os.fdatasync(use_fd)
        except OSError as e:
            raise PageIOError(e.errno, f"{op} of slot {slot} in {self.file_path(cls, file_no)} failed: {e.strerror}") from e
        if n != nbytes:
            raise PageIOError(errno.EIO, f"short {op} of slot {slot} ({n} of {nbytes} bytes)")

    def files(self) -> list[str]:
        """Every page file on disk, for checks and tests."""
        out: list[str] = []
        for d in self.paths:
            for root, _, names in os.walk(d):
                out.extend(os.path.join(root, n) for n in names if n.endswith(".slots"))
        return sorted(out)

    def close(self) -> None:
        with self._lock:
            for fd, dfd in self._fds.values():
                for f in (fd, dfd):
                    if f >= 0:
                        os.close(f)
            self._fds.clear()


def _pwritev_all(fd: int, bufs: Sequence[memoryview], off: int, length: int) -> int:
    """pwritev, finishing a partial write (signal, near-full disk) once with pwrite."""
    n = os.pwritev(fd, bufs, off)
    if n == length or n <= 0:
        return n
    rest = b"".join(bytes(b) for b in bufs)[n:]
    return n + os.pwrite(fd, rest, off + n)
