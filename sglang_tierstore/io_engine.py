"""Parallel page I/O: runs a batch's items over a pool of threads, a claim at a time, reads first.

A worker hands each claim (a stretch of a batch's items) to the batch's work function
in one call, which may run the whole claim without the GIL (``pagefile``'s C helper
does: every preadv/pwritev and checksum of the claim in one release), so ``threads``
workers keep that many requests in flight (the queue depth NVMe needs) and take the
GIL, which they share with SGLang's scheduler, once per claim rather than once per
syscall or page: each time a thread takes the GIL back costs a thread spinning in
Python beside it tens of microseconds (docs/performance.md, "The GIL"). The caller's
thread waits once per batch, woken when its last item is done (or at its deadline).
What an item needs beside its I/O (its pages' checksums) runs in the item, on the
worker, spreading the hashing of a large batch over the workers. A failure stays with
its item: an outcome is the value the work function gave it or the error it met (a work
function that raises, a bug, gives its exception to every item it was handed).

Scheduling. SGLang prefetches (reads a waiting request needs before its first token)
and backs up (write-through of pages already in host memory) on different threads at
the same time. A read is on a request's critical path; a write is background work that
can wait. So the engine keeps two queues of batches, reads and writes, and a worker
that becomes free takes its next claim from the oldest read batch if there is one (but
see below: nothing starves). Writes are cut finely: the store hands them over as units
of at most ``MAX_RUN_BYTES`` (with the hash of the pages a unit writes), cutting pages
larger than that into pieces and hashing such a page in a unit of its own. A worker
claims an even share of a write batch, a contiguous stretch (sequential writes per
thread; threads taking turns at single units wrote large pages more slowly), but between
units (the work function looks at the engine's "reads queued" flag between items, without
the GIL) it hands the rest of its claim back as soon as a read is queued: first in line,
and cut into even shares again, so that once the reads are done it spreads over every
free thread. So a read arriving while every thread
is writing waits for at most one small write unit per thread, never for the rest of a
backup, as long as at most ``reads_per_write`` read claims wait in a row (8 MiB of
pages up to 1 MiB, with the defaults); beyond that one write unit goes through after
every ``reads_per_write`` read claims. Alternatives weighed:
- threads kept for reads: reads would wait for nothing, but a batch of reads would get
  fewer threads than the disk needs in flight, and writes would lose those threads
  even when no read is waiting;
- a priority queue of units: the same order, but one heap entry per unit and no
  contiguous stretch per thread.
Nothing starves: while writes wait, every ``reads_per_write + 1``-th claim goes to them
and runs at least one unit (at least 1/(reads_per_write + 1) of the claims under a
stream of reads that never lets up; claims, not bytes: a read claim of 8 MiB pages is
one page, a write claim given way at once is one 1 MiB unit). With no reads waiting,
every worker writes, as before.

Reads are claimed several items at a time (about ``CLAIM_BYTES``, and no more than an
even share of the batch per thread): a claim costs one call and one lock, not a future
per item, and a read batch spreads over whichever threads are free. A batch too small
to share (under ``INLINE_BYTES``, or any batch with one thread) runs inline, in the
caller's thread, instead of paying thread hand-offs: it waits in no queue, read or
write.

Giving up on a disk that stops answering: a preadv in a thread cannot be cancelled,
and a late one would land wherever it was told to, long after the caller has moved
on. A caller that may stop waiting (``wait(deadline)``, then ``cancel``)
therefore has its items read into :class:`Staging` memory owned by the I/O thread
and copied into the caller's memory through a :class:`Gate`, which the caller shuts
before it returns: a read that finishes after that lands in the thread's own buffer,
which that thread reuses only once the read has returned. Every other caller settles
its batch (``with batch:``) before it returns or raises: the items not started are
dropped and the running ones waited for. The threads are daemons:
one stuck in a preadv on a dead disk does not keep the interpreter from exiting.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time as mod_time
from collections import deque
from typing import Callable, Generic, Optional, Sequence, TypeVar, Union

A = TypeVar("A")
R = TypeVar("R")

Outcome = Union[R, BaseException]
Stop = Sequence[bytearray]  # flags a work function looks at between items: it stops once a first byte is set
Work = Callable[[Sequence[A], Stop], "Sequence[Outcome[R]]"]

CLAIM_BYTES = 4 << 20  # what a worker takes from a read batch at a time (at most an even share of it)
INLINE_BYTES = 2 << 20  # a batch moving less runs in the caller's thread
READS_PER_WRITE = 8  # claims that go to reads, while writes wait, before one goes to a write
_PR_SET_NAME = 15  # prctl option (Linux)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux keeps 15 bytes of it), so
    that ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm`` tell tierstore's threads
    from the server's (Python before 3.14 names its threads for itself only)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name stays Python's
        pass


def each(fn: Callable[[A], R]) -> Work[A, R]:
    """A work function that runs ``fn`` on the first item of what it is given (the engine
    calls it again for the next, recording each outcome as it comes): ``fn``'s value or
    the exception it raised."""
    def work(items: Sequence[A], stop: Stop) -> list[Outcome[R]]:
        try:
            return [fn(items[0])]
        except BaseException as e:  # kept per item (the caller decides what it means)
            return [e]
    return work


class Batch(Generic[R]):
    """The items of one ``IOEngine.submit``, running or done."""

    def __init__(self, work: Work[A, R], items: Sequence[A], claim: int = 1, write: bool = False) -> None:
        self._work = work
        self._items = items
        self._n = len(items)
        self._claim = claim
        self.write = write
        # what nobody has claimed (the engine's lock guards both): items from _next on,
        # and ranges a write handed back to let reads go first
        self._next = 0
        self._returned: list[tuple[int, int]] = []
        self._cancelled = False
        self._stop = bytearray(1)  # set with _cancelled, for work running without the GIL
        self._cond = threading.Condition()  # guards _outcomes and _active, and _cancelled once settling
        self._outcomes: dict[int, Outcome[R]] = {}
        self._active = 0  # threads inside _run

    def _unclaimed(self) -> bool:
        return not self._cancelled and (bool(self._returned) or self._next < self._n)

    def _take(self) -> tuple[int, int]:
        """Claim the next items: [first, stop). Caller holds the engine's lock."""
        if self._returned:
            return self._returned.pop()
        first = self._next
        self._next = min(self._n, first + self._claim)
        return first, self._next

    def _run(self, first: int, stop: int, give_way: Optional[bytearray] = None) -> int:
        """Run items [first, stop), calling the work function on what is left until it is
        done (its outcomes recorded after each call); return where it stopped: ``stop``,
        or the first item not run because ``give_way`` was set (looked at between items,
        by the work function too). Once cancelled, no item starts (a stalled disk gets
        no new requests). One notify, once the batch's last outcome or last thread is in."""
        flags = (self._stop,) if give_way is None else (self._stop, give_way)
        k = first
        with self._cond:
            self._active += 1
        try:
            while k < stop and not self._cancelled and not (k > first and give_way is not None and give_way[0]):
                try:
                    outs = self._work(self._items[k:stop], flags)
                except BaseException as e:  # a bug in the work function: every item it was given gets it
                    outs = [e] * (stop - k)  # (always reported: the caller waits for every item)
                if not 0 < len(outs) <= stop - k:
                    outs = [RuntimeError(f"{len(outs)} outcomes for {stop - k} items")] * (stop - k)
                with self._cond:
                    self._outcomes.update(zip(range(k, k + len(outs)), outs))
                k += len(outs)
            return stop if self._cancelled else k
        finally:
            with self._cond:
                self._active -= 1
                if not self._active or len(self._outcomes) == self._n:
                    self._cond.notify_all()

    def wait(self, deadline: Optional[float] = None) -> dict[int, Outcome[R]]:
        """Item position -> outcome of the items done, once every item is, or at
        ``deadline`` (``time.monotonic()``) if one is given: items not done by then are
        left out, and so are those a call of the work function still running was handed
        (outcomes are recorded as each call returns). One wake-up of the caller, however
        many items."""
        with self._cond:
            if deadline is None:
                self._cond.wait_for(self._all_done)
            else:
                self._cond.wait_for(self._all_done, max(0.0, deadline - mod_time.monotonic()))
            return dict(self._outcomes)

    def _all_done(self) -> bool:
        return len(self._outcomes) == self._n

    def results(self) -> list[Outcome[R]]:
        """Every outcome, in item order, once all are done."""
        done = self.wait()
        return [done[k] for k in range(self._n)]

    def cancel(self) -> None:
        """Items not started yet never start (a running one cannot be stopped)."""
        self._cancelled = True
        self._stop[0] = 1

    def __enter__(self) -> Batch[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.settle()

    def settle(self, deadline: Optional[float] = None) -> bool:
        """Cancel, then wait for the items running now (until ``deadline``, if given:
        ``time.monotonic()``); whether none runs any more. However the caller's block
        ends (an exception while outcomes were still coming in included), once this has
        returned True nothing of this batch touches the caller's memory any more: no
        late preadv into host memory SGLang has reused. Without a deadline unbounded, as
        waiting for every item is; a caller that may give up on a stalled disk gives one
        (or cancels instead)."""
        with self._cond:
            self.cancel()
            if deadline is None:
                return self._cond.wait_for(lambda: not self._active)
            return self._cond.wait_for(lambda: not self._active, max(0.0, deadline - mod_time.monotonic()))


class Gate:
    """Lets threads into a section only until it is shut.

    A thread is inside between an ``enter`` that returned True and its ``leave``;
    ``close`` shuts the gate and waits for the threads inside. Used to let I/O threads
    write into a caller's memory only until the caller gives up (their work there is a
    memory copy, never disk I/O: once ``close`` returns, nothing writes into that memory
    any more), and to let a backend's close wait for the calls in flight.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._inside = 0

    def enter(self) -> bool:
        with self._cond:
            if self._open:
                self._inside += 1
            return self._open

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if not self._inside:
                self._cond.notify_all()

    def close(self, timeout: Optional[float] = None) -> bool:
        """Shut the gate; wait for the threads inside, at most ``timeout`` s (None: for
        as long as they take). True if none is left inside."""
        with self._cond:
            self._open = False
            return self._cond.wait_for(lambda: not self._inside, timeout)


class Staging:
    """Read buffers owned by I/O threads, for reads a caller may give up on.

    Each thread has one buffer, grown to the largest read it has staged and kept for
    the thread's life (at most ``threads`` x the largest run of a batch). Only its
    own thread uses it, one read at a time, so a buffer whose read was given up is
    not reused before that read has returned. An anonymous mapping is page-aligned, so
    O_DIRECT reads into it work wherever they work into the caller's memory; it is
    private (``MAP_PRIVATE``, where ``mmap(-1, n)`` would map shared memory) because
    nothing else ever sees it.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def buffer(self, nbytes: int) -> memoryview:
        """This thread's buffer, ``nbytes`` long."""
        mem: Optional[memoryview] = getattr(self._local, "mem", None)
        if mem is None or len(mem) < nbytes:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            mem = memoryview(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=flags))
            self._local.mem = mem
        return mem[:nbytes]


class IOEngine:
    """A fixed pool of I/O threads serving a queue of reads before a queue of writes."""

    def __init__(self, threads: int, reads_per_write: int = READS_PER_WRITE) -> None:
        self.threads = threads
        self.staging = Staging()
        self._reads_per_write = reads_per_write
        self._cond = threading.Condition()
        self._reads: deque[Batch[object]] = deque()
        self._writes: deque[Batch[object]] = deque()
        self._reads_in_a_row = 0  # read claims since the last write claim, while writes waited
        self._reads_queued = bytearray(1)  # whether a read batch is queued: writes give way when set
        self._closing = False
        self._threads = [threading.Thread(target=self._work, name=f"tierstore-io_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, work: Work[A, R], items: Sequence[A], item_bytes: int, inline: bool = True,
               write: bool = False) -> Batch[R]:
        """Start ``work`` over ``items`` (each moving about ``item_bytes``), a claim per
        call, as reads or as ``write``s (which wait while reads are queued: a write item
        should be one small I/O, see the module docstring). ``work(claim, stop)`` returns
        the outcomes of a prefix of its claim, its first item at least, stopping before
        an item once a ``stop`` flag is set (:func:`each` makes one of a function per
        item). A batch too small to share runs inline, done when this returns, unless
        ``inline`` is False (a caller that may give up must not be the one stuck in a
        preadv)."""
        n = len(items)
        share = -(-n // self.threads)
        claim = share if write else max(1, min(share, CLAIM_BYTES // max(1, item_bytes)))
        batch: Batch[R] = Batch(work, items, claim, write)
        if not n or (inline and (self.threads == 1 or n == 1 or n * item_bytes < INLINE_BYTES)):
            batch._run(0, n)
            return batch
        with self._cond:
            if self._closing:
                raise RuntimeError("I/O engine closed")
            if write:
                self._writes.append(batch)  # type: ignore[arg-type]
            else:
                self._reads.append(batch)  # type: ignore[arg-type]
                self._reads_queued[0] = 1
            self._cond.notify(min(self.threads, -(-n // batch._claim)))
        return batch

    def _next_locked(self) -> Optional[tuple[Batch[object], int, int]]:
        """The next claim: reads first, but a write after ``reads_per_write`` reads in
        a row while writes wait. Caller holds the lock."""
        for q in (self._reads, self._writes):
            while q and not q[0]._unclaimed():
                q.popleft()
        self._reads_queued[0] = bool(self._reads)
        if self._writes and (not self._reads or self._reads_in_a_row >= self._reads_per_write):
            q, self._reads_in_a_row = self._writes, 0
        elif self._reads:
            q, self._reads_in_a_row = self._reads, (self._reads_in_a_row + 1 if self._writes else 0)
        else:
            return None
        batch = q[0]
        first, stop = batch._take()
        if not batch._unclaimed():
            q.popleft()  # so that a read queued means a read waiting
            self._reads_queued[0] = bool(self._reads)
        return batch, first, stop

    def _work(self) -> None:
        name_os_thread("tierstore-io")
        while True:
            with self._cond:
                while (job := self._next_locked()) is None:
                    if self._closing:
                        return
                    self._cond.wait()
            batch, first, stop = job
            left = batch._run(first, stop, self._reads_queued if batch.write else None)
            if left < stop:
                self._hand_back(batch, left, stop)

    def _hand_back(self, batch: Batch[object], first: int, stop: int) -> None:
        """A write giving way to reads: the rest of its claim goes back, first in line,
        cut in even shares again, so that once the reads are done it spreads over every
        free thread instead of running on whichever one comes back first."""
        step = -(-(stop - first) // self.threads)
        with self._cond:
            batch._returned += [(k, min(stop, k + step)) for k in reversed(range(first, stop, step))]  # popped lowest first
            if batch not in self._writes:
                self._writes.appendleft(batch)
            self._cond.notify(len(batch._returned))  # sleeping threads take reads first, then these

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop the threads once the items already submitted are done (a caller may be
        waiting for any of them); wait for that at most ``timeout`` s (None: as long as
        it takes). A thread stuck in a preadv on a disk that stopped answering is not
        waited for past ``timeout``: it exits when the call returns. True if every
        thread has exited."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else mod_time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - mod_time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
