"""The bytes layer on its own: page files at offsets, no index and no store."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from sglang_tierstore.errors import FileGone, PageIOError
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


def test_files_are_full_size_and_a_header_or_page_not_there_yet_is_a_miss_not_a_lost_file(files: PageFiles) -> None:
    """A shared filesystem's client may show a file before its data: a zero or short header,
    or a short read, proves nothing (PageIOError, a miss), unlike a header naming another file."""
    ref = FileRef(1, "d0", "9")
    files.create(ref)
    path = files.path(1, "d0")
    assert os.path.getsize(path) == files.file_bytes() == 4096 + 2 * 65536  # sparse, at its full size from the start
    with open(path, "r+b") as f:
        f.write(bytes(4096))  # the header not there yet
    with pytest.raises(PageIOError, match="not readable yet") as e:
        files.ensure_open(ref)
    assert not isinstance(e.value, FileGone)
    files.create(ref)
    os.truncate(path, 4096 + 8192)  # a length lagging behind
    with pytest.raises(PageIOError, match="short read") as e2:
        files.read(ref, 4096 + 65536, [memoryview(bytearray(4096))], 4096, False)
    assert not isinstance(e2.value, FileGone)
    files.close()


def test_a_directory_is_identified_by_its_own_marker_on_the_filesystem_seen_at_start(tmp_path: Path) -> None:
    d = tmp_path / "d0"
    d.mkdir()
    (d / "store.json").write_text(json.dumps({"prefix": "p", "store": IDENTITY["store"], "dir": "d0"}))
    files = PageFiles(IDENTITY, {"d0": str(d)}, o_direct=False)
    assert files.identified("d0")
    (d / "store.json").write_text(json.dumps({"prefix": "p", "store": "another", "dir": "d0"}))
    assert not files.identified("d0")
    (d / "store.json").unlink()
    assert not files.identified("d0") and not files.identified("d9")
    files.close()
