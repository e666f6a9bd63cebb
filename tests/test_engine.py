"""The engine's own contract, over plain byte buffers: no torch, no SGLang (seconds), on a
redis-server and on a valkey-server."""

from __future__ import annotations

import errno
import logging
import mmap
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from tierstore_kit.engine import flip_byte, keys
from tierstore_kit.servers import RedisProc
from monitor import Monitor
from tierstore_kit.engine import Hook, MiB, bury, engine, hooked, housekeep, pages, read, views

from sglang_tierstore import _native
from sglang_tierstore.tools import inspect
from sglang_tierstore import io_engine
from sglang_tierstore.errors import PageIOError
from sglang_tierstore.schema import ALIGN
from sglang_tierstore.store import MAX_RUN_BYTES

HANG_S = 30.0  # a deadline for what must happen without waiting for anything else


def split_pages(src: list[bytearray], aligned: bool) -> list[list[memoryview]]:
    """Copies of pages as two regions each (one if a page is a single aligned block), in
    one page-aligned mapping when ``aligned``."""
    size = len(src[0])
    cut = size // 2 // ALIGN * ALIGN if aligned else size // 3
    mem = memoryview(mmap.mmap(-1, len(src) * size)) if aligned else memoryview(bytearray(b"".join(src)))
    out = []
    for i, p in enumerate(src):
        page = mem[i * size : (i + 1) * size]
        page[:] = p
        out.append([page[:cut], page[cut:]] if cut else [page])
    return out


@pytest.fixture
def cfg(tmp_path: Path, server_proc: RedisProc) -> dict[str, Any]:
    return {"path": str(tmp_path / "store"), "redis_url": server_proc.url, "redis_prefix": "e-" + uuid.uuid4().hex[:10],
            "capacity_gb": 4 * MiB / (1 << 30), "io_threads": 4}


def test_importing_the_engine_needs_neither_torch_nor_sglang() -> None:
    code = ("import sys, sglang_tierstore, sglang_tierstore.store, sglang_tierstore.space, sglang_tierstore.tools.inspect, "
            "sglang_tierstore.tools.cli; "
            "bad = [m for m in ('torch', 'sglang') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("page_bytes", [4096, 65536, 768, 5000])
def test_round_trip_leading_run_and_gaps(cfg: dict[str, Any], page_bytes: int) -> None:
    with_gap = keys(8)
    src = pages(8, page_bytes, 1)
    st = engine(cfg)
    try:
        ns = st.namespace({"model": "m"}, page_bytes)
        stored = [0, 1, 2, 4, 5]
        assert st.write(ns, [with_gap[i] for i in stored], views([src[i] for i in stored]), False) == [True] * 5
        assert st.exists([(ns, with_gap)]) == [[True, True, True, False, True, True, False, False]]
        ok, got = read(st, ns, with_gap)
        assert ok == [True, True, True, False, False, False, False, False]  # only the leading run is read
        assert got[:3] == src[:3]
        ok, got = read(st, ns, with_gap[4:6])
        assert ok == [True, True] and got == src[4:6]
        assert inspect.check(st) == []
    finally:
        st.close()


@pytest.mark.parametrize("page_bytes,aligned", [(4096, True), (65536, True), (65536, False), (5000, False)])
def test_staged_reads_give_the_same_bytes(cfg: dict[str, Any], page_bytes: int, aligned: bool) -> None:
    """With read_timeout_s, reads go through the I/O threads' staging memory: the same
    hits and bytes for coalesced runs and single slots, O_DIRECT and buffered, pages in
    several regions (as host pools lay them out)."""
    st = engine(cfg, read_timeout_s=30)
    try:
        ns = st.namespace({}, page_bytes)
        ks = keys(12)
        src = pages(12, page_bytes, 40)
        assert st.write(ns, ks[:9] + ks[10:], split_pages(src[:9] + src[10:], aligned), aligned) == [True] * 11
        dests = split_pages([bytearray(page_bytes) for _ in ks], aligned)
        assert st.read(ns, ks, dests, aligned) == [True] * 9 + [False] * 3
        assert [b"".join(bytes(r) for r in regions) for regions in dests[:9]] == src[:9]
        assert st.read(ns, ks[9:], dests[9:], aligned) == [False] * 3  # nothing to read: no I/O at all
        assert "error_io_read_timeout" not in st.stats() and "error_internal" not in st.stats()
        assert inspect.check(st) == []
    finally:
        st.close()


@pytest.mark.parametrize("page_bytes,aligned", [(5 * MiB // 2, True), (3 * MiB + 5000, False)])
@pytest.mark.parametrize("read_timeout_s", [0, 30])
def test_pages_larger_than_one_write_go_to_disk_in_pieces(cfg: dict[str, Any], page_bytes: int, aligned: bool,
                                                          read_timeout_s: float) -> None:
    """A page larger than MAX_RUN_BYTES is written as several pwritevs of at most that
    (the unit a read may have to wait behind), cut across its regions: the same bytes
    come back, O_DIRECT or buffered, read directly or staged."""
    sizes: list[int] = []

    def write(real: Hook, ref: Any, offset: int, bufs: Any, nbytes: int, aligned: bool) -> None:
        assert sum(map(len, bufs)) == nbytes
        sizes.append(nbytes)
        real(ref, offset, bufs, nbytes, aligned)

    st = engine(cfg, capacity_gb=96 * MiB / (1 << 30), read_timeout_s=read_timeout_s, page_files=hooked({"write": write}))
    try:
        ns = st.namespace({}, page_bytes)
        ks, src = keys(6), pages(6, page_bytes, 7)
        assert st.write(ns, ks, split_pages(src, aligned), aligned) == [True] * 6
        assert max(sizes) <= MAX_RUN_BYTES < page_bytes and sum(sizes) == 6 * page_bytes
        dests = split_pages([bytearray(page_bytes) for _ in ks], aligned)
        assert st.read(ns, ks, dests, aligned) == [True] * 6
        assert [b"".join(bytes(r) for r in regions) for regions in dests] == src
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_page_whose_pieces_all_fail_is_one_failed_write(cfg: dict[str, Any]) -> None:
    """A page written in pieces is one write to the operator: when every piece fails,
    the error is counted (and logged) once per page, not once per piece, the page is
    not stored, and the store is whole."""
    calls: list[tuple[Any, ...]] = []

    def failing(real: Hook, *args: Any) -> None:
        calls.append(args)
        raise PageIOError(errno.EIO, "I/O error")

    st = engine(cfg, capacity_gb=96 * MiB / (1 << 30), page_files=hooked({"write": failing}))
    try:
        ns = st.namespace({}, 5 * MiB // 2)
        ks = keys(4)
        assert st.write(ns, ks, split_pages(pages(4, 5 * MiB // 2, 3), True), True) == [False] * 4
        assert len(calls) == 4 * 3  # three pieces a page
        assert st.stats()["error_io_write"] == 4
        assert st.exists([(ns, ks)]) == [[False] * 4]
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_read_during_a_large_write_waits_for_one_write_unit_per_thread(cfg: dict[str, Any]) -> None:
    """Both I/O threads are inside units of a 16 MiB write batch when a read comes in:
    it completes once each thread has finished that one unit, while every later unit
    of the batch is still held back (with the reads queued behind the batch, it would
    wait for all of them)."""
    hooks: dict[str, Hook] = {}
    st = engine(cfg, io_threads=2, capacity_gb=64 * MiB / (1 << 30), page_files=hooked(hooks))
    pool = ThreadPoolExecutor(2)
    inside, permits = threading.Semaphore(0), threading.Semaphore(0)
    try:
        ns = st.namespace({}, 256 << 10)
        old, src = keys(8, "old"), pages(8, 256 << 10, 1)
        assert st.write(ns, old, views(src), False) == [True] * 8
        io = st.io
        real_submit = io.submit

        def held_write(real: Hook, *args: Any) -> None:
            inside.release()
            assert permits.acquire(timeout=HANG_S)
            real(*args)

        queued = threading.Event()

        def submit(fn: Any, items: Any, item_bytes: int, inline: bool = True, write: bool = False) -> Any:
            batch = real_submit(fn, items, item_bytes, inline, write)
            if not write:
                queued.set()
            return batch

        hooks["write"] = held_write
        io.submit = submit  # type: ignore[method-assign]
        writer = pool.submit(st.write, ns, keys(64, "new"), views(pages(64, 256 << 10, 2)), False)
        for _ in range(2):
            assert inside.acquire(timeout=HANG_S)
        reader = pool.submit(read, st, ns, old)
        assert queued.wait(HANG_S)
        permits.release(2)
        assert reader.result(timeout=HANG_S) == ([True] * 8, src)
        permits.release(64)
        assert writer.result(timeout=HANG_S) == [True] * 64
        assert inspect.check(st) == []
    finally:
        permits.release(64)
        pool.shutdown()
        st.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_call_that_raises_with_io_in_flight_returns_only_after_that_io(cfg: dict[str, Any], op: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's wait for its batch ends in an exception (a signal handler raising in
    SGLang's thread, or a bug) while runs of the batch are in flight. The call raises only
    once they are done: none of their preadv/pwritev happens after it, when SGLang may
    already have given that host memory to other pages. The store is whole afterwards."""
    hooks: dict[str, Hook] = {}
    st = engine(cfg, capacity_gb=64 * MiB / (1 << 30), page_files=hooked(hooks))
    ns = st.namespace({}, MAX_RUN_BYTES)  # a page per run: 16 runs over 4 threads
    ks, src = keys(16), pages(16, MAX_RUN_BYTES, 5)
    raised, other_started, counting = threading.Event(), threading.Event(), threading.Lock()
    started: list[int] = []  # the preadv/pwritev calls begun
    ended: list[bool] = []  # per call returned: did it return after the failing call raised?
    try:
        if op == "read":
            assert st.write(ns, ks, views(src), False) == [True] * 16
        def held_io(real: Hook, *args: Any) -> None:
            with counting:
                first = not started
                started.append(len(started))
            if first:
                assert other_started.wait(HANG_S)  # the first run completes with another in flight
            else:
                other_started.set()
                raised.wait(1.0)  # time for the call to raise and return, were it not waiting
            real(*args)
            ended.append(raised.is_set())

        def bug(*args: Any) -> Any:  # the caller's thread, waiting for the batch
            assert other_started.wait(HANG_S)
            raise KeyError("a bug")

        hooks[op] = held_io
        monkeypatch.setattr(io_engine.Batch, "wait", bug)
        with pytest.raises(KeyError):
            if op == "read":
                read(st, ns, ks)
            else:
                st.write(ns, ks, views(src), False)
        raised.set()
        assert len(started) >= 2 and len(ended) == len(started) and not any(ended), (started, ended)
        monkeypatch.undo()
        del hooks[op]
        if op == "write":
            assert st.write(ns, ks, views(src), False) == [True] * 16
        assert read(st, ns, ks) == ([True] * 16, src)
        assert inspect.check(st) == []
    finally:
        raised.set()
        st.close()


def test_a_write_that_raises_while_its_pwritevs_outlive_the_deadline_gives_its_slots_up(
        cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's wait for its batch raises while a pwritev is stuck past write_timeout_s:
    the call raises at the deadline, and the slots of that batch are given up, never taken
    again by the thread's next batches, where the late pwritev could overwrite a page."""
    hooks: dict[str, Hook] = {}
    st = engine(cfg, capacity_gb=64 * MiB / (1 << 30), write_timeout_s=0.5, page_files=hooked(hooks))
    ns = st.namespace({}, 64 << 10)
    held, in_flight, stuck = threading.Event(), threading.Event(), []
    offsets: list[int] = []

    def holding(real: Hook, ref: Any, offset: int, *args: Any) -> None:
        offsets.append(offset)
        if not stuck:
            stuck.append(offset)
            in_flight.set()
            held.wait(30)  # the stalled pwritev
        real(ref, offset, *args)

    def bug(*args: Any) -> Any:
        assert in_flight.wait(30)  # raises with the batch's pwritev under way
        raise KeyError("a bug")

    try:
        assert st.write(ns, keys(2, "warm"), views(pages(2, 64 << 10, 1)), False) == [True] * 2  # a stock
        hooks["write"] = holding
        offsets.clear()
        monkeypatch.setattr(io_engine.Batch, "wait", bug)
        with pytest.raises(KeyError):
            st.write(ns, keys(4, "bug"), views(pages(4, 64 << 10, 2)), False)
        monkeypatch.undo()
        failed = set(offsets)
        offsets.clear()
        for i in range(8):
            assert st.write(ns, keys(4, f"next{i}"), views(pages(4, 64 << 10, 3 + i)), False) == [True] * 4, st.stats()
        assert failed and not failed & set(offsets), "a slot of the batch still being written was taken again"
    finally:
        held.set()
        st.close()
    st = engine(cfg, capacity_gb=64 * MiB / (1 << 30))
    try:
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_region_whose_disk_space_stalls_holds_a_write_up_to_write_timeout_s_only(cfg: dict[str, Any]) -> None:
    """Giving a fresh region its disk space (fallocate) stalls: the write waits for it at
    most write_timeout_s and stores its pages anyway (space is taken as they land); later
    writes do not wait while that allocation is still stuck, nor start another."""
    hooks: dict[str, Hook] = {}
    st = engine(cfg, capacity_gb=64 * MiB / (1 << 30), write_timeout_s=0.5, page_files=hooked(hooks))
    held, calls = threading.Event(), []

    def stalled(real: Hook, *args: Any) -> None:
        calls.append(args)
        held.wait(30)
        real(*args)

    hooks["allocate"] = stalled
    try:
        ns = st.namespace({}, 64 << 10)
        src = pages(4, 64 << 10, 1)
        done: list[list[bool]] = []
        t = threading.Thread(target=lambda: done.append(st.write(ns, keys(4), views(src), False)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "a write waited for a stalled fallocate past write_timeout_s"
        assert done == [[True] * 4] and st.stats()["error_allocate_timeout"] == 1
        for i in range(40):  # more regions: none waits, none starts another allocation meanwhile
            assert st.write(ns, keys(4, f"more{i}"), views(pages(4, 64 << 10, 2 + i)), False) == [True] * 4
        assert len(calls) == 1 and st.stats()["error_allocate_timeout"] == 1
        held.set()
        assert read(st, ns, keys(4)) == ([True] * 4, src)
        assert inspect.check(st) == []
    finally:
        held.set()
        st.close()


def test_any_key_string_and_namespaces_apart(cfg: dict[str, Any]) -> None:
    st = engine(cfg)
    try:
        a, b = st.namespace({"model": "a"}, 4096), st.namespace({"model": "b"}, 4096)
        ks = ["not-hex", "x" * 64, keys(1)[0].upper()]
        src = pages(3, 4096, 2)
        assert st.write(a, ks, views(src), False) == [True] * 3
        assert st.exists([(a, ks), (b, ks)]) == [[True] * 3, [False] * 3]
        ok, got = read(st, a, ks)
        assert ok == [True] * 3 and got == src
    finally:
        st.close()


def test_existing_key_keeps_its_first_bytes(cfg: dict[str, Any]) -> None:
    st = engine(cfg)
    try:
        ns = st.namespace({}, 4096)
        k = keys(1)
        first, second = pages(1, 4096, 3), pages(1, 4096, 4)
        assert st.write(ns, k, views(first), False) == [True]
        assert st.write(ns, k, views(second), False) == [True]
        assert st.write(ns, k + k, views(second + second), False) == [True, True]  # a key twice in one batch
        ok, got = read(st, ns, k)
        assert ok == [True] and got == first
        assert st.stats()["write_exists"] == 3
        assert inspect.check(st) == []
    finally:
        st.close()


def test_delete_drops_only_those_pages(cfg: dict[str, Any]) -> None:
    st = engine(cfg)
    try:
        ns = st.namespace({}, 4096)
        ks = keys(6)
        src = pages(6, 4096, 30)
        assert st.write(ns, ks, views(src), False) == [True] * 6
        assert st.delete(ns, ks[1:3] + keys(1, "absent")) == 2
        assert st.exists([(ns, ks)]) == [[True, False, False, True, True, True]]
        ok, got = read(st, ns, ks[3:])
        assert ok == [True] * 3 and got == src[3:]
        assert inspect.check(st) == []
    finally:
        st.close()


def test_bad_buffers_are_clear_errors_and_lose_nothing(cfg: dict[str, Any]) -> None:
    st = engine(cfg)
    try:
        ns = st.namespace({}, 4096)
        ks = keys(2)
        assert st.write(ns, ks, views(pages(2, 4096, 5)), False) == [True, True]
        with pytest.raises(ValueError, match="2 keys but 1 page buffers"):
            st.write(ns, ks, views(pages(1, 4096, 6)), False)
        with pytest.raises(ValueError, match="has 100 bytes, namespace pages have 4096"):
            st.read(ns, ks[:1], views([bytearray(100)]), False)
        with pytest.raises(ValueError, match="page_bytes must be positive"):
            st.namespace({}, 0)
        assert st.exists([(ns, ks)]) == [[True, True]]
        assert inspect.check(st) == []
    finally:
        st.close()


@pytest.mark.parametrize("read_timeout_s", [0, 30], ids=["direct", "staged"])
def test_a_checksum_mismatch_is_a_miss_and_drops_only_that_entry(cfg: dict[str, Any], read_timeout_s: float) -> None:
    st = engine(cfg, o_direct=False, read_timeout_s=read_timeout_s)
    try:
        ns = st.namespace({}, 8192)
        ks = keys(4)
        src = pages(4, 8192, 7)
        assert st.write(ns, ks, views(src), False) == [True] * 4
        where = inspect.where(st, ns, ks[1])
        assert where is not None
        flip_byte(where[0], where[1] + 8191)
        assert [p for p in inspect.check(st, fix=False) if "checksum mismatch" in p] != []
        ok, got = read(st, ns, ks)
        assert ok == [True, False, True, True] and got[0] == src[0] and got[2:] == src[2:]
        assert st.exists([(ns, ks)]) == [[True, False, True, True]]
        assert st.stats()["error_corrupt"] == 1
        assert inspect.check(st) == []
        assert st.write(ns, ks[1:2], views(src[1:2]), False) == [True]  # written again, read right
        ok, got = read(st, ns, ks[1:2])
        assert ok == [True] and got == src[1:2]
    finally:
        st.close()


def test_check_fix_drops_what_does_not_verify(cfg: dict[str, Any]) -> None:
    st = engine(cfg, o_direct=False)
    try:
        ns = st.namespace({}, 4096)
        ks = keys(3)
        assert st.write(ns, ks, views(pages(3, 4096, 8)), False) == [True] * 3
        where = inspect.where(st, ns, ks[2])
        assert where is not None
        flip_byte(where[0], where[1])
        problems = inspect.check(st, fix=True)
        assert len(problems) == 1 and "checksum mismatch" in problems[0]
        assert st.exists([(ns, ks)]) == [[True, True, False]]
        assert inspect.check(st) == []
    finally:
        st.close()


@pytest.mark.parametrize("failure", [PageIOError(errno.EMFILE, "too many open files"),
                                     PageIOError(errno.ENOMEM, "out of memory"),
                                     PageIOError(errno.EINTR, "interrupted"),
                                     PageIOError(errno.EIO, "I/O error"),
                                     pytest.param(RuntimeError("a bug"), marks=pytest.mark.expects_internal_error(
                                         "a RuntimeError from the page files is a bug: counted and logged as internal"))])
def test_a_failure_that_is_not_about_the_page_keeps_it(cfg: dict[str, Any], failure: BaseException,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    hooks: dict[str, Hook] = {}
    st = engine(cfg, page_files=hooked(hooks))
    try:
        ns = st.namespace({}, 4096)
        ks = keys(3)
        src = pages(3, 4096, 9)
        assert st.write(ns, ks, views(src), False) == [True] * 3

        def failing(real: Hook, *a: Any) -> None:
            raise failure

        hooks["read"] = failing
        with caplog.at_level(logging.WARNING):
            ok, _ = read(st, ns, ks)
        assert ok == [False] * 3
        assert st.exists([(ns, ks)]) == [[True] * 3]
        if isinstance(failure, RuntimeError):
            assert "Traceback" in caplog.text and "a bug" in caplog.text  # logged with its traceback
            assert st.stats()["error_internal"] >= 1
        del hooks["read"]
        ok, got = read(st, ns, ks)
        assert ok == [True] * 3 and got == src
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_write_is_one_round_trip_once_the_writer_has_a_stock(cfg: dict[str, Any], server_proc: RedisProc) -> None:
    """Seen by the server: once a writer holds a stock, a write batch is one function call
    and nothing else; a read is one HMGET and nothing else."""
    st = engine(cfg)
    try:
        ns = st.namespace({}, 4096)
        first = Monitor(server_proc.port)
        assert st.write(ns, keys(16, "a"), views(pages(16, 4096, 10)), False) == [True] * 16
        assert first.commands()["FCALL"] >= 2  # the first batch also leases its stock
        writes = Monitor(server_proc.port)
        for tag in ("b", "c", "d"):
            assert st.write(ns, keys(16, tag), views(pages(16, 4096, 11)), False) == [True] * 16
        assert writes.commands() == {"FCALL": 3}
        reads = Monitor(server_proc.port)
        assert st.read(ns, keys(16, "c"), views([bytearray(4096) for _ in range(16)]), False) == [True] * 16
        assert reads.commands() == {"HMGET": 1}
    finally:
        st.close()


def test_a_batch_no_larger_than_a_recent_one_is_one_round_trip(cfg: dict[str, Any], server_proc: RedisProc) -> None:
    """SGLang's backups vary in size: a stock sized after the largest of the writer's last
    batches, not the last one only, lets a large batch after small ones go without a lease
    call first; a batch larger than any recent one still leases."""
    st = engine(cfg)
    try:
        ns = st.namespace({}, 4096)
        assert st.write(ns, keys(16, "a"), views(pages(16, 4096, 10)), False) == [True] * 16
        mon = Monitor(server_proc.port)
        for i, n in enumerate((2, 3, 16, 1, 16)):
            assert st.write(ns, keys(n, f"b{i}"), views(pages(n, 4096, 11)), False) == [True] * n
        assert mon.commands() == {"FCALL": 5}
        mon = Monitor(server_proc.port)
        assert st.write(ns, keys(40, "c"), views(pages(40, 4096, 12)), False) == [True] * 40
        assert mon.commands()["FCALL"] == 2  # larger than any before: a lease, then the commit
    finally:
        st.close()


@pytest.mark.parametrize("page_bytes,n", [(256 << 10, 12), (2 * MAX_RUN_BYTES, 4)])  # one piece; pieces and a hash item
@pytest.mark.parametrize("read_timeout_s", [0.0, 30.0])  # reads into host memory; staged reads
@pytest.mark.parametrize("helper", ["c", "python"])  # pagefile's transfers in the C helper; from Python, run by run
@pytest.mark.expects_internal_error("a transfer that raises on an I/O thread is the bug this test plants")
def test_a_transfer_that_raises_on_an_io_thread_is_an_internal_error_and_a_miss(
        cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, page_bytes: int, n: int,
        read_timeout_s: float, helper: str) -> None:
    """The pages' I/O and checksums run on the I/O threads, a claim at a time (a page cut
    into pieces is hashed by an op of its own): a bug there is counted and logged with its
    traceback as an internal error, and costs the pages it touched (not stored, or misses),
    never an exception in SGLang's thread or a wrong page; the store is whole once the
    transfers work again."""
    from sglang_tierstore import pagefile

    st = engine(cfg, capacity_gb=64 * MiB / (1 << 30), read_timeout_s=read_timeout_s,
                **({} if helper == "c" else {"page_files": hooked({})}))
    try:
        ns = st.namespace({}, page_bytes)
        assert st.space.attached().pages.native == (helper == "c")
        ks, src = keys(n, "ok"), pages(n, page_bytes, 3)
        assert st.write(ns, ks, views(src), False) == [True] * n

        def buggy(real: Callable[..., Any]) -> Callable[..., Any]:
            def bug(*args: Any) -> Any:
                if threading.current_thread().name.startswith("tierstore-io"):
                    raise KeyError("a bug")
                return real(*args)
            return bug

        if helper == "c":
            monkeypatch.setattr(_native, "pageio", SimpleNamespace(transfer=buggy(_native.pageio.transfer)))
        else:
            monkeypatch.setattr(pagefile, "checksums", buggy(pagefile.checksums))
        bad = keys(n, "bad")
        caplog.set_level(logging.WARNING, "sglang_tierstore")
        stored = st.write(ns, bad, views(pages(n, page_bytes, 4)), False)
        hits, _ = read(st, ns, ks)
        assert not all(stored) and not all(hits)
        assert st.stats()["error_internal"] >= 1 and "KeyError: 'a bug'" in caplog.text
        monkeypatch.undo()
        assert read(st, ns, ks) == ([True] * n, src)
        assert st.write(ns, bad, views(pages(n, page_bytes, 4)), False) == [True] * n
        assert read(st, ns, bad) == ([True] * n, pages(n, page_bytes, 4))
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_dead_writers_stock_is_reclaimed_exactly(cfg: dict[str, Any]) -> None:
    """A process dies holding leased slots: after lease_s they are counted dead (or return
    to their region), never lost from the accounting, and the store fills up again."""
    dead = engine(cfg, lease_s=5)
    ns = dead.namespace({}, 65536)
    assert dead.write(ns, keys(6, "dead"), views(pages(6, 65536, 12)), False) == [True] * 6
    assert inspect.usage(dead)["leases"] == 1  # it holds a stock, and then "dies" (no close)
    later = 0.0
    st = engine(cfg, lease_s=5, clock=lambda: __import__("time").time() + later)
    try:
        ns2 = st.namespace({}, 65536)
        assert inspect.check(st) == []  # leased slots are a state of their own
        later = 6.0
        housekeep(st)
        assert inspect.usage(st)["leases"] == 0
        assert inspect.check(st) == []
        src = pages(80, 65536, 13)
        for i in range(0, 80, 8):  # 5x the capacity: every region is reclaimed and reused
            assert st.write(ns2, keys(80, "after")[i : i + 8], views(src[i : i + 8]), False) == [True] * 8
            housekeep(st)
        assert inspect.usage(st)["allocated_bytes"] <= 4 * MiB
        ok, got = read(st, ns2, keys(80, "after")[-8:])
        assert ok == [True] * 8 and got == src[-8:]
        assert inspect.check(st) == []
    finally:
        st.close()
        bury(dead)


def test_a_batch_lands_in_adjacent_slots_and_reads_back_in_few_ios(cfg: dict[str, Any]) -> None:
    """Placement for prefixes: one write batch takes consecutive slots of one region, and a
    read coalesces them into a few preadv calls (spread over the I/O threads), whatever
    order the keys come in."""
    calls: list[int] = []

    def counting(real: Hook, ref: Any, offset: int, bufs: Any, nbytes: int, aligned: bool) -> None:
        calls.append(nbytes)
        real(ref, offset, bufs, nbytes, aligned)

    st = engine(cfg, capacity_gb=16 * MiB / (1 << 30), page_files=hooked({"read": counting}))
    try:
        ns = st.namespace({}, 128 << 10)
        ks, src = keys(16, "prefix"), pages(16, 128 << 10, 4)
        assert st.write(ns, ks, split_pages(src, True), True) == [True] * 16
        where = [inspect.where(st, ns, k) for k in ks]
        assert len({w[0] for w in where if w}) == 1
        offsets = [w[1] for w in where if w]
        assert offsets == [offsets[0] + i * ns.page_bytes for i in range(16)]
        order = ks[::-1]  # keys in the reverse of slot order
        dests = split_pages([bytearray(ns.page_bytes) for _ in ks], True)
        assert st.read(ns, order, dests, True) == [True] * 16
        assert calls == [4 * ns.page_bytes] * 4  # 16 pages in 4 I/Os of 4 adjacent pages, one per thread
        assert [b"".join(bytes(r) for r in d) for d in dests] == src[::-1]
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_store_is_a_context_manager_that_closes(cfg: dict[str, Any]) -> None:
    from sglang_tierstore.errors import StoreClosed

    with engine(cfg) as st:
        ns = st.namespace({}, 4096)
        assert st.write(ns, keys(2), views(pages(2, 4096, 1)), False) == [True, True]
        assert inspect.usage(st)["leases"] == 1  # this thread's stock
    with pytest.raises(StoreClosed):
        st.exists([(ns, keys(2))])
    with engine(cfg) as again:
        assert inspect.usage(again)["leases"] == 0  # given back at close, not left to expire
        assert again.exists([(again.namespace({}, 4096), keys(2))]) == [[True, True]]


@pytest.mark.parametrize("uncached", ["fresh", "fails"])
def test_a_stale_cached_page_on_a_shared_filesystem_is_read_again_past_the_cache(cfg: dict[str, Any],
                                                                                  uncached: str) -> None:
    """With ``shared_fs`` a page failing its checksum is read again uncached before anything
    is dropped: bytes that verify now are a hit; a re-read the disk fails is a miss, never
    an exception out of the read."""
    class StaleCache(hooked({})):  # type: ignore[misc,valid-type]
        def read(self, ref: Any, offset: int, bufs: Any, nbytes: int, aligned: bool) -> None:
            super().read(ref, offset, bufs, nbytes, aligned)
            bufs[0][0] ^= 0x5A  # what this node's page cache still holds: another node's older bytes

        def read_uncached(self, ref: Any, offset: int, nbytes: int) -> bytes:
            if uncached == "fails":
                raise PageIOError(errno.EIO, "I/O error")
            return super().read_uncached(ref, offset, nbytes)

    st = engine(cfg, shared_fs=True, page_files=StaleCache)
    try:
        ns = st.namespace({}, 64 << 10)
        ks, src = keys(3), pages(3, 64 << 10, 9)
        assert st.write(ns, ks, views(src), False) == [True] * 3
        got, out = read(st, ns, ks[:1])
        if uncached == "fresh":
            assert got == [True] and out == src[:1] and st.stats()["error_stale_cache"] == 1
        else:
            assert got == [False] and "error_stale_cache" not in st.stats()
    finally:
        st.close()


def test_without_its_c_helper_the_store_says_so_and_moves_the_same_bytes(
        cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Installed where no C compiler was found, the store warns once and moves every page
    from Python, with the checksums the C helper would have made: pages either wrote read
    back through the other."""
    caplog.set_level(logging.WARNING, "sglang_tierstore")
    cap = 64 * MiB / (1 << 30)
    with engine(cfg, capacity_gb=cap) as fast:
        ns = fast.namespace({}, 256 << 10)
        first, src = keys(16, "c"), pages(16, 256 << 10, 5)
        assert fast.write(ns, first, views(src), False) == [True] * 16
    assert "without its C helper" not in caplog.text
    monkeypatch.setattr(_native, "pageio", None)  # as built where no C compiler was found
    with engine(cfg, capacity_gb=cap) as slow:
        ns = slow.namespace({}, 256 << 10)
        assert "without its C helper" in caplog.text
        second, more = keys(16, "python"), pages(16, 256 << 10, 6)
        assert slow.write(ns, second, views(more), False) == [True] * 16
        assert read(slow, ns, first) == ([True] * 16, src)
        assert read(slow, ns, second) == ([True] * 16, more)
    monkeypatch.undo()
    with engine(cfg, capacity_gb=cap) as fast:
        assert read(fast, fast.namespace({}, 256 << 10), second) == ([True] * 16, more)
