"""A disk that stops answering: reads give up in bounded time, and a read given up on
never lands in the caller's memory, even when the disk answers later.

The disk is real: page files live on a FUSE filesystem (``stallfs.py``) whose reads
block until the test lets them go. It needs ``/dev/fuse`` and root (to mount);
libfuse2 and fusepy come from ``scripts/setup.sh``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import pytest
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, engine, pages, read, views
from stallfs import StalledDisk

from sglang_tierstore import TierStore
from sglang_tierstore.tools import inspect
from sglang_tierstore.io_engine import IOEngine, each
from sglang_tierstore.errors import FileGone, PageIOError
from sglang_tierstore.pagefile import FileRef, PageFiles
from sglang_tierstore.store import Namespace

PAGE = 256 << 10
N = 32  # 8 MiB: runs of 1 MiB on every I/O thread
TIMEOUT_S = 1.0  # long enough for a loaded machine to start the reads before the deadline
SENTINEL = 0xA5
T = TypeVar("T")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[StalledDisk]:
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: these tests need FUSE (a container needs --device /dev/fuse)")
    d = StalledDisk(str(tmp_path / "backing"), str(tmp_path / "mnt"))
    yield d
    d.close()


def page_buffers(aligned: bool) -> list[list[memoryview]]:
    """N pages of two regions each (like K and V blocks), in one page-aligned mapping
    when ``aligned`` (O_DIRECT), else in bytearrays."""
    if aligned:
        mem = memoryview(mmap.mmap(-1, N * PAGE))
        return [[mem[i * PAGE : i * PAGE + PAGE // 2], mem[i * PAGE + PAGE // 2 : (i + 1) * PAGE]] for i in range(N)]
    return [[memoryview(bytearray(PAGE // 2)), memoryview(bytearray(PAGE // 2))] for _ in range(N)]


def page_bytes(bufs: Sequence[Sequence[memoryview]]) -> list[bytes]:
    return [b"".join(bytes(r) for r in regions) for regions in bufs]


def read_in_thread(st: TierStore, ns: Namespace, ks: list[str], bufs: list[list[memoryview]], aligned: bool) -> list[bool]:
    """The read, given 10x read_timeout_s to return (run in a thread, so that a read
    that never returns fails the test instead of hanging it)."""
    out: list[list[bool]] = []
    t = threading.Thread(target=lambda: out.append(st.read(ns, ks, bufs, aligned)), daemon=True)
    t.start()
    t.join(10 * TIMEOUT_S)
    assert not t.is_alive(), f"a read on a stalled disk did not return within 10x read_timeout_s={TIMEOUT_S}"
    return out[0]


@pytest.mark.parametrize("aligned", [False, True], ids=["buffered", "o_direct"])
def test_a_stalled_disk_gives_bounded_misses_and_late_reads_land_nowhere(
        disk: StalledDisk, redis_proc: RedisProc, aligned: bool) -> None:
    st = engine({"path": os.path.join(disk.mountpoint, "store"), "redis_url": redis_proc.url,
                 "redis_prefix": "s-" + uuid.uuid4().hex[:10], "capacity_gb": 32 * MiB / (1 << 30),
                 "io_threads": 4, "read_timeout_s": TIMEOUT_S})
    try:
        ns = st.namespace({}, PAGE)
        ks = keys(N)
        src = [bytes(p) for p in pages(N, PAGE, 1)]
        written = page_buffers(aligned)
        for regions, p in zip(written, src):
            regions[0][:], regions[1][:] = p[: PAGE // 2], p[PAGE // 2 :]
        assert st.write(ns, ks, written, aligned) == [True] * N

        disk.stall()
        dests = page_buffers(aligned)
        assert read_in_thread(st, ns, ks, dests, aligned) == [False] * N  # (a) misses, in bounded time
        disk.wait_blocked()  # the reads did reach the device, which held them
        assert st.stats()["error_io_read_timeout"] == N
        for regions in dests:  # the caller reuses its memory at once
            for r in regions:
                r[:] = bytes([SENTINEL]) * len(r)
        again = page_buffers(aligned)  # every I/O thread is still stuck: a second read is bounded too
        assert read_in_thread(st, ns, ks, again, aligned) == [False] * N
        assert st.exists([(ns, ks)]) == [[True] * N]  # misses that keep the pages

        disk.answer()
        disk.wait_answered(1)  # (b) a held read now returns, late
        deadline = time.monotonic() + 60  # (c) the disk answers: hits again (each try bounded; a loaded
        while True:                       # machine may need more than one to read 8 MiB through FUSE)
            ok = st.read(ns, ks, (fresh := page_buffers(aligned)), aligned)
            if ok == [True] * N or time.monotonic() > deadline:
                break
        assert ok == [True] * N and page_bytes(fresh) == src
        assert inspect.check(st) == []
    finally:
        disk.answer()
        st.close()  # joins the I/O threads: every late preadv has returned
    assert page_bytes(dests) == [bytes([SENTINEL]) * PAGE] * N  # (b) nothing landed in the caller's memory


def test_a_given_up_batch_sends_the_disk_nothing_more() -> None:
    """Items of a batch that were not started when the caller gave up never start: a
    disk that answers again is not handed the backlog of reads nobody waits for."""
    io = IOEngine(1)
    held, started = threading.Event(), []

    def item(i: int) -> int:
        started.append(i)
        held.wait()
        return i

    try:
        batch = io.submit(each(item), [0, 1, 2, 3], 1 << 20, inline=False)
        later = io.submit(each(item), [4, 5], 1 << 20, inline=False)  # queued behind the stuck thread
        assert batch.wait(time.monotonic() + 0.2) == {}
        assert later.wait(time.monotonic()) == {}
        batch.cancel()
        later.cancel()
    finally:
        held.set()
        io.close()  # the pool is idle: whatever was going to start has
    assert started == [0]


def in_thread(fn: Callable[[], T], what: str, bound_s: float = 10 * TIMEOUT_S) -> T:
    """``fn()`` given ``bound_s`` to return (run in a thread, so that a call that never
    returns fails the test instead of hanging it)."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(bound_s)
    assert not t.is_alive(), f"{what} did not return within {bound_s} s"
    return out[0]


def io_idle(st: TierStore, bound_s: float = 60) -> None:
    """Returns once every I/O thread of ``st`` is free at the same time, so that each
    pwritev a given-up batch left running has returned: a batch of one item per thread
    whose items wait for each other."""
    together = threading.Barrier(st.io.threads)
    batch = st.io.submit(each(lambda _: together.wait(bound_s)), range(st.io.threads), 1, inline=False, write=True)
    done = batch.wait(time.monotonic() + bound_s)
    assert sorted(done.values()) == list(range(st.io.threads)), f"the I/O threads were not all free within {bound_s} s"


def test_a_stalled_disk_bounds_writes_and_a_late_write_serves_nothing(disk: StalledDisk, redis_proc: RedisProc) -> None:
    """Writes stall: a batch gives up after write_timeout_s (not stored, counted), so does
    the next (every I/O thread is stuck); the late pwritevs land in slots that were given
    up, which no entry names: when the disk answers, those keys are misses, writing them
    again stores them, and every page reads back as written."""
    st = engine({"path": os.path.join(disk.mountpoint, "store"), "redis_url": redis_proc.url,
                 "redis_prefix": "w-" + uuid.uuid4().hex[:10], "capacity_gb": 32 * MiB / (1 << 30),
                 "io_threads": 4, "write_timeout_s": TIMEOUT_S})
    try:
        ns = st.namespace({}, PAGE)
        first, second = keys(3 * N, "first"), keys(N, "second")
        src1, src2 = pages(3 * N, PAGE, 1), pages(N, PAGE, 2)
        for i in range(0, 3 * N, N):  # 12 of the 16 regions: both page files made
            assert st.write(ns, first[i : i + N], views(src1[i : i + N]), False) == [True] * N

        disk.stall("write")
        assert in_thread(lambda: st.write(ns, second, views(src2), False), "a write") == [False] * N
        disk.wait_blocked()  # the pwritevs reached the device, which holds them
        assert st.stats()["error_io_write_timeout"] == N
        garbage = [bytearray(b"\xee" * PAGE) for _ in range(N)]  # the caller reuses its memory at once
        assert in_thread(lambda: st.write(ns, keys(N, "third"), views(garbage), False), "a second write") == [False] * N

        disk.answer()
        disk.wait_answered(1)  # a held pwritev returns, late
        assert read(st, ns, second)[0] == [False] * N  # never published
        io_idle(st)  # every late pwritev has landed: one still queued for its file (the kernel writes a FUSE file
        # one pwritev at a time) could land on a page written below in a region reclaimed meanwhile, a checksum miss
        deadline = time.monotonic() + 60  # each try bounded by write_timeout_s: a loaded machine may need more
        while (ok := st.write(ns, second, views(src2), False)) != [True] * N and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ok == [True] * N
        hits, got = read(st, ns, second)
        assert hits == [True] * N
        assert [g == p for g, p in zip(got, src2)] == [True] * N  # (not a diff of 8 MiB of bytes on failure)
        hits, got = read(st, ns, first)  # the slots given up took room: older pages may be evicted, never wrong
        assert [g for g, h in zip(got, hits) if h] == [p for p, h in zip(src1, hits) if h]
        assert inspect.check(st) == []
    finally:
        disk.answer()
        st.close()


def test_a_first_write_whose_page_file_stalls_being_made_is_bounded(disk: StalledDisk, redis_proc: RedisProc) -> None:
    """A new store's first write must make a page file, and the disk holds its header's
    write: the write gives up after write_timeout_s (not stored), so do writes while the
    file is still being made, and once the disk answers the file is published and writes
    store."""
    st = engine({"path": os.path.join(disk.mountpoint, "store"), "redis_url": redis_proc.url,
                 "redis_prefix": "f-" + uuid.uuid4().hex[:10], "capacity_gb": 32 * MiB / (1 << 30),
                 "io_threads": 2, "write_timeout_s": TIMEOUT_S})
    try:
        ns = st.namespace({}, PAGE)
        ks, src = keys(4, "f"), pages(4, PAGE, 3)
        disk.stall("write")
        assert in_thread(lambda: st.write(ns, ks, views(src), False), "a write making a page file") == [False] * 4
        assert st.stats()["error_file_create_timeout"] == 1
        assert in_thread(lambda: st.write(ns, ks, views(src), False), "a write while it is made") == [False] * 4
        assert st.stats()["error_file_create_timeout"] == 1  # the file being made is not made again
        disk.answer()
        deadline = time.monotonic() + 30
        while (ok := st.write(ns, ks, views(src), False)) != [True] * 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ok == [True] * 4 and read(st, ns, ks) == ([True] * 4, src)
        assert inspect.check(st) == []
    finally:
        disk.answer()
        st.close()


def test_a_page_file_whose_first_open_stalls_holds_up_no_other_file(disk: StalledDisk) -> None:
    """Opening a page file for the first time blocks on the device: I/O on a file already
    open goes on meanwhile (the open runs outside the files' lock)."""
    d = os.path.join(disk.mountpoint, "files")
    os.makedirs(d)
    identity = {"format": 1, "prefix": "p", "store": "s", "region_bytes": 1 << 20, "regions_per_file": 4}
    a, b = FileRef(1, "d", "ua"), FileRef(2, "d", "ub")
    maker = PageFiles(identity, {"d": d}, o_direct=False)
    maker.create(a)
    maker.create(b)
    maker.close()
    files = PageFiles(identity, {"d": d}, o_direct=False)
    try:
        files.ensure_open(b)
        disk.stall("open")
        opening = threading.Thread(target=files.ensure_open, args=(a,), daemon=True)
        opening.start()
        disk.wait_blocked()  # the open of a is held by the device
        buf = memoryview(bytearray(4096))
        in_thread(lambda: files.read(b, 0, [buf], 4096, False), "a read of an open file")
        assert bytes(buf) == files.header(b)
        disk.answer()
        opening.join(30)
        assert not opening.is_alive() and sorted(files.open_files()) == [1, 2]
    finally:
        disk.answer()
        files.close()

    late = PageFiles(identity, {"d": d}, o_direct=False)  # a file forgotten while its open is held
    failed: list[BaseException] = []

    def open_a() -> None:
        try:
            late.ensure_open(a)
        except PageIOError as e:
            failed.append(e)

    try:
        disk.stall("open")
        opening = threading.Thread(target=open_a, daemon=True)
        opening.start()
        disk.wait_blocked()
        late.forget(1)
        disk.answer()
        opening.join(30)
        assert len(failed) == 1 and not isinstance(failed[0], FileGone)  # a failed I/O, not a file gone
        assert late.open_files() == []
        late.ensure_open(a)  # opened again when asked
    finally:
        disk.answer()
        late.close()


def test_sglangs_backup_call_returns_on_a_stalled_disk(disk: StalledDisk, redis_proc: RedisProc) -> None:
    """``batch_set_v1``, as SGLang's backup thread calls it with a real host pool: on a
    disk whose writes stall it answers False within write_timeout_s, and True once the
    disk answers again."""
    from tierstore_kit.engine import keys as page_keys
    from tierstore_kit.pools import fill, mha_pool, page_indices, storage_config

    from sglang_tierstore import TierStoreBackend

    pool = mha_pool("page_first", page_size=16, layers=4, heads=4, head_dim=64)  # 64 KiB pages
    fill(pool, 3)
    ks = page_keys(16)
    cfg = {"path": os.path.join(disk.mountpoint, "be"), "redis_url": redis_proc.url, "redis_prefix": "be-" + uuid.uuid4().hex[:8],
           "capacity_gb": 32 * MiB / (1 << 30), "interface_v1": 1, "write_timeout_s": TIMEOUT_S, "io_threads": 2}
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(ks[:8], page_indices(range(8), 16)) == [True] * 8
        disk.stall("write")
        assert in_thread(lambda: be.batch_set_v1(ks[8:], page_indices(range(8, 16), 16)), "batch_set_v1") == [False] * 8
        disk.answer()
        deadline = time.monotonic() + 60
        while (ok := be.batch_set_v1(ks[8:], page_indices(range(8, 16), 16))) != [True] * 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ok == [True] * 8
        assert be.batch_get_v1(ks, page_indices(range(16), 16)) == [True] * 16
