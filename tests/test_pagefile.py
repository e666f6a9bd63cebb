"""The bytes layer on its own: page files at offsets, no index and no store."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from sglang_tierstore.errors import FileGone
from sglang_tierstore.pagefile import FileRef, PageFiles

HANG_S = 30.0
IDENTITY = {"format": 3, "prefix": "p", "store": "0123456789abcdef", "region_bytes": 65536, "regions_per_file": 2}


@pytest.fixture
def files(tmp_path: Path) -> PageFiles:
    (tmp_path / "d0").mkdir()
    return PageFiles(IDENTITY, {"d0": str(tmp_path / "d0")}, o_direct=True)


def test_bytes_go_where_they_are_written_and_a_file_of_another_identity_is_gone(files: PageFiles) -> None:
    ref = FileRef(3, "d0", "7")
    files.create(ref)
    files.allocate(ref, 4096, 65536)
    page = os.urandom(8192)
    files.write(ref, 4096 + 8192, [memoryview(page[:4096]), memoryview(page[4096:])], 8192, False)
    out = bytearray(8192)
    files.read(ref, 4096 + 8192, [memoryview(out)], 8192, False)
    assert out == page
    files.punch(ref, 4096, 65536)
    files.read(ref, 4096 + 8192, [memoryview(out)], 8192, False)
    assert out == bytes(8192)  # a punched range reads as zeros
    assert files.on_disk() == {3: [("d0", files.path(3, "d0"))]}
    files.forget(3)
    with pytest.raises(FileGone, match="is not page file 3 \\(uid 8\\)"):
        files.ensure_open(FileRef(3, "d0", "8"))  # the index says another uid: not this file
    files.close()


def test_a_file_forgotten_during_io_keeps_its_fds_until_the_io_ends(files: PageFiles) -> None:
    """A file forgotten while an I/O on another thread uses it keeps its descriptors
    (their numbers are not reused under the I/O) until that I/O ends."""
    ref = FileRef(1, "d0", "1")
    files.create(ref)
    files.ensure_open(ref)
    inside, done = threading.Event(), threading.Event()
    fds: list[int] = []

    def slow_io() -> None:
        with files._using(ref) as h:  # an I/O in flight on another thread
            fds.extend(fd for fd in (h.fd, h.dfd) if fd >= 0)
            inside.set()
            assert done.wait(HANG_S)

    t = threading.Thread(target=slow_io)
    t.start()
    assert inside.wait(HANG_S)
    files.forget(1)
    assert 1 not in files.open_files()
    for fd in fds:
        os.fstat(fd)  # still ours: not closed, its number not reusable
    done.set()
    t.join(HANG_S)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by the last user
    files.close()
