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
from typing import Iterator, Sequence

import pytest
from conftest import RedisProc, keys
from engine_kit import MiB, engine, pages
from stallfs import StalledDisk

from sglang_tierstore import TierStore, inspect
from sglang_tierstore.io_engine import IOEngine
from sglang_tierstore.store import Namespace

PAGE = 256 << 10
N = 32  # 8 MiB: runs of 1 MiB on every I/O thread
TIMEOUT_S = 1.0  # long enough for a loaded machine to start the reads before the deadline
SENTINEL = 0xA5


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
        batch = io.submit(item, [0, 1, 2, 3], 1 << 20, inline=False)
        later = io.submit(item, [4, 5], 1 << 20, inline=False)  # queued behind the stuck thread
        assert list(batch.as_completed(time.monotonic() + 0.2)) == []
        assert list(later.as_completed(time.monotonic())) == []
        batch.cancel()
        later.cancel()
    finally:
        held.set()
        io.close()  # the pool is idle: whatever was going to start has
    assert started == [0]
