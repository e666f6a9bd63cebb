"""Parallel page I/O: runs one function per page over a thread pool.

preadv/pwritev release the GIL, so ``threads`` workers keep that many requests in
flight (the queue depth NVMe needs). A batch is cut into at most ``threads``
contiguous chunks of at least ``MIN_CHUNK_BYTES``, one task each, so the per-page
cost is a function call, not a future, and a batch of tiny pages runs inline
instead of paying thread hand-offs. The caller's thread stays free while the
workers do I/O: it checksums pages (xxhash releases the GIL too) as they are
written or as they arrive, so hashing never takes a request out of flight. A
failure stays with its page: an outcome is the function's value or the exception
it raised.

Giving up on a disk that stops answering: a preadv in a thread cannot be cancelled,
and a late one would land wherever it was told to, long after the caller has moved
on. A caller that may stop waiting (``as_completed(deadline)``, then ``cancel``)
therefore has its items read into :class:`Staging` memory owned by the I/O thread
and copied into the caller's memory through a :class:`Gate`, which the caller shuts
before it returns: a read that finishes after that lands in the thread's own buffer,
which that thread reuses only once the read has returned.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
import time as mod_time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generator, Generic, Optional, Sequence, TypeVar, Union

A = TypeVar("A")
R = TypeVar("R")

Outcome = Union[R, BaseException]

MIN_CHUNK_BYTES = 1 << 20
_PR_SET_NAME = 15  # prctl option (Linux)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux keeps 15 bytes of it), so
    that ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm`` tell tierstore's threads
    from the server's (Python before 3.14 names its threads for itself only)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name stays Python's
        pass


class Batch(Generic[R]):
    """The pages of one ``IOEngine.submit``, running or done."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._done: queue.SimpleQueue[tuple[int, Outcome[R]]] = queue.SimpleQueue()
        self._cancelled = False

    def _run(self, fn: Callable[[A], R], items: Sequence[A], first: int) -> None:
        for k, item in enumerate(items, first):
            if self._cancelled:  # nobody waits for it any more: a stalled disk gets no new requests
                return
            try:
                out: Outcome[R] = fn(item)
            except BaseException as e:  # kept per page (the caller decides what it means),
                out = e  # and always reported: the caller waits for every item
            self._done.put((k, out))

    def as_completed(self, deadline: Optional[float] = None) -> Generator[tuple[int, Outcome[R]], None, None]:
        """(item position, outcome) of every item, in completion order; blocks, at most
        until ``deadline`` (``time.monotonic()``) if one is given: items not done by
        then are not yielded."""
        for _ in range(self._n):
            if deadline is None:
                yield self._done.get()
                continue
            try:
                yield self._done.get(timeout=max(0.0, deadline - mod_time.monotonic()))
            except queue.Empty:
                return

    def results(self) -> list[Outcome[R]]:
        """Every outcome, in item order, once all are done."""
        out: list[Outcome[R]] = [None] * self._n  # type: ignore[list-item]
        for k, o in self.as_completed():
            out[k] = o
        return out

    def cancel(self) -> None:
        """Items not started yet never start (a running one cannot be stopped)."""
        self._cancelled = True


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
    """A fixed pool of I/O threads."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.staging = Staging()
        self._started: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-io",
                                        initializer=self._thread_started)

    def _thread_started(self) -> None:
        name_os_thread("tierstore-io")
        with self._lock:
            self._started.append(threading.current_thread())

    def submit(self, fn: Callable[[A], R], items: Sequence[A], item_bytes: int, inline: bool = True) -> Batch[R]:
        """Start ``fn`` over ``items`` (each moving about ``item_bytes``); a batch too
        small to share runs inline, done when this returns, unless ``inline`` is
        False (a caller that may give up must not be the one stuck in a preadv)."""
        n = len(items)
        batch: Batch[R] = Batch(n)
        chunks = min(self.threads, n, max(1, n * item_bytes // MIN_CHUNK_BYTES))
        if not n or (chunks <= 1 and inline):
            batch._run(fn, items, 0)
            return batch
        bounds = [n * i // chunks for i in range(chunks + 1)]
        for i in range(chunks):
            self._pool.submit(batch._run, fn, items[bounds[i] : bounds[i + 1]], bounds[i])
        return batch

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop the threads once the items already submitted are done (a caller may be
        waiting for any of them); wait for that at most ``timeout`` s (None: as long as
        it takes). A thread stuck in a preadv on a disk that stopped answering is not
        waited for past ``timeout``: it exits when the call returns. True if every
        thread has exited."""
        self._pool.shutdown(wait=False)
        deadline = None if timeout is None else mod_time.monotonic() + timeout
        with self._lock:
            threads = list(self._started)
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - mod_time.monotonic()))
        return not any(t.is_alive() for t in threads)
