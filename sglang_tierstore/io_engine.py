"""Parallel page I/O: runs one function per page over a thread pool.

preadv/pwritev and xxhash release the GIL, so ``threads`` workers keep that many
requests in flight (the queue depth NVMe needs). A batch is cut into at most
``threads`` contiguous chunks of at least ``MIN_CHUNK_BYTES``, one task each, so
the per-page cost is a function call, not a future, and a batch of tiny pages
runs inline instead of paying thread hand-offs. A failure stays with its page:
the result list holds either the function's value or the exception it raised.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar, Union

A = TypeVar("A")
R = TypeVar("R")

Outcome = Union[R, BaseException]


def _run_chunk(fn: Callable[[A], R], items: Sequence[A]) -> list[Outcome[R]]:
    out: list[Outcome[R]] = []
    for item in items:
        try:
            out.append(fn(item))
        except Exception as e:  # kept per page; the caller decides what it means
            out.append(e)
    return out


MIN_CHUNK_BYTES = 1 << 20


class IOEngine:
    """A fixed pool of I/O threads; ``map`` keeps results in input order."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-io")

    def map(self, fn: Callable[[A], R], items: Sequence[A], item_bytes: int) -> list[Outcome[R]]:
        """``fn`` over ``items`` (each moving about ``item_bytes``), in input order."""
        n = len(items)
        chunks = min(self.threads, n, max(1, n * item_bytes // MIN_CHUNK_BYTES))
        if chunks <= 1:
            return _run_chunk(fn, items)
        bounds = [n * i // chunks for i in range(chunks + 1)]
        futures = [
            self._pool.submit(_run_chunk, fn, items[bounds[i] : bounds[i + 1]]) for i in range(1, chunks)
        ]
        out = _run_chunk(fn, items[bounds[0] : bounds[1]])  # the caller's thread takes a chunk too
        for f in futures:
            out.extend(f.result())
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
