"""The bytes layer on its own: page files at offsets, no index and no store."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import zipfile
import threading
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tierstore import _native
from sglang_tierstore.errors import FileGone, PageIOError
from sglang_tierstore.pagefile import HASH, READ, WRITE, FileRef, PageFiles, Transfer, checksums

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


@pytest.fixture(params=["c", "python"])
def both(request: pytest.FixtureRequest, files: PageFiles, monkeypatch: pytest.MonkeyPatch) -> PageFiles:
    """The same page files, transfers run by the C helper or (as where it was not built)
    from Python run by run."""
    if request.param == "c":
        assert _native.pageio is not None, "the C helper is not built: `pip install -e .` (needs a C compiler)"
    else:
        monkeypatch.setattr(_native, "pageio", None)
    assert files.native == (request.param == "c")
    return files


def test_transfers_move_bytes_and_checksum_each_page_across_its_regions(both: PageFiles) -> None:
    """A claim of writes, reads and a hash-only op: bytes land where written, and each
    page's checksum is xxh3 of its regions concatenated, whichever buffers cut it."""
    ref = FileRef(1, "d0", "1")
    both.create(ref)
    both.allocate(ref, 4096, 65536)
    pages = [os.urandom(12288) for _ in range(3)]
    regions = [memoryview(p)[a:b] for p in pages for a, b in ((0, 4096), (4096, 12288))]  # 2 regions a page
    want = [xxhash.xxh3_64_intdigest(p) for p in pages]
    out = bytearray(3 * 12288)
    got = both.transfer([
        Transfer(WRITE, ref, 4096, regions, 3 * 12288, False, [12288] * 3),
        Transfer(READ, ref, 4096, [memoryview(out)[:5000], memoryview(out)[5000:]], 3 * 12288, False, [12288] * 3),
        Transfer(HASH, None, 0, regions, 3 * 12288, False, [12288, 24576]),
        Transfer(WRITE, ref, 4096 + 3 * 12288, regions[:1], 4096, False, []),
    ])
    assert got == [want, want, [want[0], xxhash.xxh3_64_intdigest(pages[1] + pages[2])], []]
    assert bytes(out) == b"".join(pages)
    assert checksums([memoryview(out)], [12288] * 3) == want
    both.close()


def test_a_transfer_reports_each_failure_with_its_op_and_goes_on(both: PageFiles, tmp_path: Path) -> None:
    """One op's failure (a file gone, a short read, a file of another identity) is that op's
    outcome, as read() and write() raise it; the claim's other ops still run."""
    ref, gone = FileRef(1, "d0", "1"), FileRef(2, "d0", "2")
    both.create(ref)
    page = os.urandom(4096)
    end = both.file_bytes()
    got = both.transfer([
        Transfer(READ, gone, 4096, [memoryview(bytearray(4096))], 4096, False, [4096]),
        Transfer(WRITE, ref, 4096, [memoryview(page)], 4096, False, [4096]),
        Transfer(READ, ref, end - 2048, [memoryview(bytearray(4096))], 4096, False, [4096]),
    ])
    assert isinstance(got[0], FileGone) and "was deleted" in str(got[0])
    assert got[1] == [xxhash.xxh3_64_intdigest(page)]
    assert isinstance(got[2], PageIOError) and str(got[2]).endswith(f"short read at {end - 2048} of "
                                                                     f"{both.path(1, 'd0')} (2048 of 4096 bytes)")
    both.close()


def test_a_transfer_stops_between_ops_once_a_flag_is_set_never_before_the_first(both: PageFiles) -> None:
    ref = FileRef(1, "d0", "1")
    both.create(ref)
    ops = [Transfer(WRITE, ref, 4096 * (1 + i), [memoryview(os.urandom(4096))], 4096, False, [4096]) for i in range(4)]
    go, stop = bytearray(1), bytearray(b"\x01")
    assert len(both.transfer(ops, [go])) == 4
    assert len(both.transfer(ops, [go, stop])) == 1
    both.close()


def test_page_files_open_for_reading_only_refuse_a_transfer_that_writes(tmp_path: Path, both: PageFiles) -> None:
    ref = FileRef(1, "d0", "1")
    both.create(ref)
    ro = PageFiles(IDENTITY, both.dirs, o_direct=False, read_only=True)
    [refused, hashed] = ro.transfer([Transfer(WRITE, ref, 4096, [memoryview(bytes(4096))], 4096, False, []),
                                     Transfer(HASH, None, 0, [memoryview(bytes(4096))], 4096, False, [4096])])
    assert isinstance(refused, PageIOError) and refused.errno == errno.EROFS
    assert hashed == [xxhash.xxh3_64_intdigest(bytes(4096))]
    ro.close()
    both.close()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=1, max_size=70000), cuts=st.lists(st.integers(0, 70000), max_size=6),
       span_cuts=st.lists(st.integers(1, 70000), max_size=4))
def test_the_c_helpers_checksums_are_xxhashs_however_buffers_and_pages_are_cut(data: bytes, cuts: list[int],
                                                                             span_cuts: list[int]) -> None:
    """xxh3 has separate paths for inputs up to 16, 128, 240 bytes and beyond, and the C
    helper hashes a page from one buffer or streams it over several: every way agrees with
    the xxhash package (the checksums in the index were made by either)."""
    assert _native.pageio is not None, "the C helper is not built: `pip install -e .` (needs a C compiler)"
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    bufs = [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]
    span_bounds = sorted({0, len(data), *(c % len(data) for c in span_cuts)} - {0}) if len(data) > 1 else [len(data)]
    spans = [b - a for a, b in zip([0, *span_bounds], span_bounds)]
    [(err, moved, sums)] = _native.pageio.transfer([(HASH, -1, 0, bufs, spans, 0, 0)], [])
    starts = [0, *span_bounds]
    assert (err, moved) == (0, 0)
    assert list(sums) == [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in zip(starts, span_bounds)] == checksums(bufs, spans)


def test_the_c_helper_refuses_an_op_past_iov_max_alone_and_spans_past_its_bytes() -> None:
    """A read or write of more buffers than preadv/pwritev take fails as they would (EINVAL),
    that op only; hashing has no such limit; spans beyond the buffers are a ValueError
    before anything runs, however large the numbers."""
    native = _native.pageio
    assert native is not None, "the C helper is not built: `pip install -e .` (needs a C compiler)"
    many = [memoryview(bytearray(1)) for _ in range(1025)]
    got = native.transfer([(READ, 0, 0, many, [], 0, 0), (HASH, -1, 0, many, [1025], 0, 0)], [])
    assert got == [(errno.EINVAL, 0, ()), (0, 0, (xxhash.xxh3_64_intdigest(bytes(1025)),))]
    with pytest.raises(ValueError, match=f"span 1 of {2**63 - 1} bytes is not within the op's 1 bytes"):
        native.transfer([(HASH, -1, 0, [b"x"], [1, 2**63 - 1, 2**63 - 1, 3], 0, 0)], [])


def test_without_a_c_compiler_the_package_still_builds_leaving_the_helper_out(tmp_path: Path) -> None:
    """The README's promise for a machine with no C compiler: ``pip install`` builds the
    package without ``_pageio`` (an optional extension) instead of failing; the store then
    moves pages from Python (tests/test_engine.py, without its C helper)."""
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    shutil.copytree(root / "sglang_tierstore", src / "sglang_tierstore",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(root / f, src / f)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "wheel"), str(src)], env={**os.environ, "CC": "/bin/false"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sglang_tierstore/pagefile.py" in names
    assert not [n for n in names if n.startswith("sglang_tierstore/_pageio") and n.endswith(".so")]
