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
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Iterator, Sequence, TypeVar, Union

A = TypeVar("A")
R = TypeVar("R")

Outcome = Union[R, BaseException]

MIN_CHUNK_BYTES = 1 << 20


class Batch(Generic[R]):
    """The pages of one ``IOEngine.submit``, running or done."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._done: queue.SimpleQueue[tuple[int, Outcome[R]]] = queue.SimpleQueue()

    def _run(self, fn: Callable[[A], R], items: Sequence[A], first: int) -> None:
        for k, item in enumerate(items, first):
            try:
                out: Outcome[R] = fn(item)
            except BaseException as e:  # kept per page (the caller decides what it means),
                out = e  # and always reported: the caller waits for every item
            self._done.put((k, out))

    def as_completed(self) -> Iterator[tuple[int, Outcome[R]]]:
        """(item position, outcome) of every item, in completion order; blocks."""
        for _ in range(self._n):
            yield self._done.get()

    def results(self) -> list[Outcome[R]]:
        """Every outcome, in item order, once all are done."""
        out: list[Outcome[R]] = [None] * self._n  # type: ignore[list-item]
        for k, o in self.as_completed():
            out[k] = o
        return out


class IOEngine:
    """A fixed pool of I/O threads."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-io")

    def submit(self, fn: Callable[[A], R], items: Sequence[A], item_bytes: int) -> Batch[R]:
        """Start ``fn`` over ``items`` (each moving about ``item_bytes``); a batch too
        small to share runs inline, done when this returns."""
        n = len(items)
        batch: Batch[R] = Batch(n)
        chunks = min(self.threads, n, max(1, n * item_bytes // MIN_CHUNK_BYTES))
        if chunks <= 1:
            batch._run(fn, items, 0)
            return batch
        bounds = [n * i // chunks for i in range(chunks + 1)]
        for i in range(chunks):
            self._pool.submit(batch._run, fn, items[bounds[i] : bounds[i + 1]], bounds[i])
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True)
