"""The I/O engine's scheduling over plain functions (no Redis, no disk): reads go ahead
of writes, a read waits for at most one write unit per thread, and writes still finish
under reads that never let up. Orders are forced with semaphores and events, never
with timings; the deadlines only turn a hang into a failure."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from sglang_tierstore.io_engine import CLAIM_BYTES, INLINE_BYTES, IOEngine, each

HANG_S = 30.0  # a deadline for what must happen without waiting for anything else


def test_a_read_needs_only_the_write_units_already_running() -> None:
    """Every thread is inside a write unit of a large batch when a read batch comes in:
    once each thread finishes that one unit, the read completes with no other write
    unit allowed to run (a FIFO pool would hand the threads the batch's next units)."""
    threads = 4
    io = IOEngine(threads)
    inside, permits = threading.Semaphore(0), threading.Semaphore(0)

    def write(i: int) -> None:
        inside.release()
        assert permits.acquire(timeout=HANG_S)

    try:
        writes = io.submit(each(write), range(64), CLAIM_BYTES, write=True)
        for _ in range(threads):
            assert inside.acquire(timeout=HANG_S)
        reads = io.submit(each(lambda i: i), range(8), CLAIM_BYTES)
        for _ in range(threads):
            permits.release()  # one more write unit per thread: the ones running now
        assert reads.wait(time.monotonic() + HANG_S) == {i: i for i in range(8)}
        for _ in range(64 - threads):
            permits.release()
        assert all(o is None for o in writes.results())
    finally:
        assert io.close(HANG_S)


def test_reads_queued_behind_a_write_unit_are_served_before_the_next_one() -> None:
    """With one thread the whole order is determined: the running write unit, then every
    read submitted meanwhile, then the rest of the write batch."""
    io = IOEngine(1)
    held, inside = threading.Event(), threading.Event()
    order: list[str] = []

    def write(i: int) -> None:
        order.append(f"w{i}")
        if i == 0:
            inside.set()
            assert held.wait(HANG_S)

    try:
        writes = io.submit(each(write), range(4), CLAIM_BYTES, inline=False, write=True)
        assert inside.wait(HANG_S)
        reads = io.submit(each(lambda i: order.append(f"r{i}")), range(3), CLAIM_BYTES, inline=False)
        held.set()
        reads.results()
        writes.results()
        assert order == ["w0", "r0", "r1", "r2", "w1", "w2", "w3"]
    finally:
        assert io.close(HANG_S)


def test_the_rest_of_a_write_that_gave_way_spreads_over_the_threads_again() -> None:
    """Two threads hold the two halves of an 8-unit write, [0, 4) and [4, 8). A read comes
    in: thread X gives way after unit 0 and reads; Y finishes its half and goes on with
    what X handed back. Units 1-3 do not all go to Y: once X is done reading it takes a
    share of them (X runs unit 3 while Y is still held in unit 1)."""
    io = IOEngine(2)
    go0, go4, go_read, reading, inside0, inside4, in1, three = (threading.Event() for _ in range(8))
    who: dict[int, str] = {}
    held_in_1: list[bool] = []

    def write(i: int) -> None:
        who[i] = threading.current_thread().name
        if i == 0:
            inside0.set()
            assert go0.wait(HANG_S)
        elif i == 4:
            inside4.set()
            assert go4.wait(HANG_S)
        elif i == 1:
            in1.set()
            held_in_1.append(three.wait(HANG_S))
        elif i == 3:
            three.set()

    def read(i: int) -> None:
        reading.set()
        assert go_read.wait(HANG_S)

    try:
        writes = io.submit(each(write), range(8), CLAIM_BYTES, write=True)
        assert inside0.wait(HANG_S) and inside4.wait(HANG_S)
        reads = io.submit(each(read), range(1), CLAIM_BYTES, inline=False)
        go0.set()  # X gives way after unit 0 and takes the read
        assert reading.wait(HANG_S)
        go4.set()  # Y finishes 4-7, then takes the first share of 1-3
        assert in1.wait(HANG_S)
        go_read.set()  # X is free again: it takes the other share
        assert reads.results() == [None] and all(o is None for o in writes.results())
        assert held_in_1 == [True]
        assert who[3] == who[0] != who[1] == who[4]
    finally:
        for e in (go0, go4, go_read, three):
            e.set()
        assert io.close(HANG_S)


def test_writes_finish_under_reads_that_never_let_up() -> None:
    """Both threads are held while a write batch and far more read batches than it has
    units queue up: the writes still get every ``reads_per_write + 1``-th claim, so they
    are done long before the reads run out (with plain priority they would come last)."""
    io = IOEngine(2, reads_per_write=4)
    held = threading.Event()
    done: list[str] = []

    def hold(i: int) -> None:
        assert held.wait(HANG_S)

    try:
        first = io.submit(each(hold), range(2), CLAIM_BYTES)
        writes = io.submit(each(lambda i: done.append("w")), range(10), CLAIM_BYTES, write=True)
        reads = [io.submit(each(lambda i: done.append("r")), range(2), CLAIM_BYTES) for _ in range(100)]
        held.set()
        for b in (first, writes, *reads):
            b.results()
        last_write = max(k for k, x in enumerate(done) if x == "w")
        assert done.count("r") == 200
        assert last_write < 100, f"the last write ran after {done[:last_write].count('r')} of 200 reads"
        assert done[:last_write].count("r") >= 4 * 9  # and the reads did go first in between
    finally:
        assert io.close(HANG_S)


def test_leaving_a_batch_early_waits_for_the_items_running_and_starts_no_more() -> None:
    """A caller whose loop over outcomes raises leaves ``with batch:`` while two items
    are still running: the exit returns only once both have finished, and no other item
    of the batch ever starts (otherwise they would go on writing into memory the caller
    no longer owns)."""
    io = IOEngine(2)
    both_inside, release = threading.Barrier(3, timeout=HANG_S), threading.Event()
    started: list[int] = []
    finished: list[int] = []

    def item(i: int) -> None:
        started.append(i)
        both_inside.wait()
        assert release.wait(HANG_S)
        finished.append(i)

    batch = io.submit(each(item), range(8), CLAIM_BYTES)

    def release_once_settling() -> None:
        deadline = time.monotonic() + HANG_S
        while not batch._cancelled and time.monotonic() < deadline:  # the caller is in the exit
            time.sleep(0.001)
        release.set()

    releaser = threading.Thread(target=release_once_settling)
    try:
        both_inside.wait()
        releaser.start()
        with pytest.raises(KeyError), batch:
            raise KeyError("a bug in the caller's loop")
        assert sorted(finished) == sorted(started) == [0, 1]
        releaser.join(HANG_S)
        assert io.close(HANG_S)  # every thread is idle: whatever the batch had left was dropped
        assert sorted(started) == [0, 1]
    finally:
        release.set()
        io.close(HANG_S)


def test_a_batch_spreads_over_free_threads_in_claims_of_about_one_unit() -> None:
    """Small items are claimed several at a time (one lock per claim, not per item) but
    never more than an even share of the batch, so every thread gets some."""
    threads = 4
    io = IOEngine(threads)
    barrier = threading.Barrier(threads, timeout=HANG_S)
    who: dict[int, str] = {}

    def item(i: int) -> None:
        who[i] = threading.current_thread().name
        if i % 16 == 0:
            barrier.wait()  # the first item of each claim waits until every thread holds a claim

    try:
        assert all(o is None for o in io.submit(each(item), range(64), CLAIM_BYTES // 16).results())
        claims = [{who[i] for i in range(c, c + 16)} for c in range(0, 64, 16)]
        assert all(len(c) == 1 for c in claims)  # a claim runs on one thread
        assert len(set.union(*claims)) == threads
    finally:
        assert io.close(HANG_S)


def test_a_small_batch_runs_in_the_callers_thread_and_close_stops_every_thread() -> None:
    before = set(threading.enumerate())
    io = IOEngine(4)
    me = threading.current_thread().name
    names = io.submit(each(lambda i: threading.current_thread().name), range(3), INLINE_BYTES // 4).results()
    assert names == [me] * 3
    pooled = io.submit(each(lambda i: threading.current_thread().name), range(4), INLINE_BYTES // 2).results()
    assert all(isinstance(n, str) and n.startswith("tierstore-io") for n in pooled)
    assert io.close(HANG_S)
    assert set(threading.enumerate()) <= before


def test_a_thread_stuck_in_an_item_does_not_hold_up_interpreter_exit() -> None:
    """An I/O thread stuck in a preadv on a disk that stopped answering (here: an item
    that never returns) must not keep SGLang's process from exiting."""
    code = ("import threading; from sglang_tierstore.io_engine import IOEngine, each; io = IOEngine(2); "
            "io.submit(each(lambda i: threading.Event().wait()), range(2), 1 << 20, inline=False); print('exiting')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "exiting", out.stderr
