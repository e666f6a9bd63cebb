#!/usr/bin/env python3
"""I/O benchmark: tierstore beside the disk's own limit and SGLang's HiCacheFile, in one run.

    python3 scripts/bench_io.py --repeat 11 --probe-repeat 1000 --out scripts/results/bench_io.json \
        > scripts/results/bench_io.txt     (the committed run; about 15 minutes)

Everything runs on the same directory, one page size at a time, batches of 128 pages:
  disk      O_DIRECT pwritev/preadv of the same pages from aligned buffers, with the
            same number of threads as tierstore's io_threads (the limit to compare with)
  hicache   SGLang's HiCacheFile called as SGLang calls it (legacy batch_set/batch_get of
            flat page copies through a real host pool, then set_from_flat_data_page)
  ts_v1     tierstore batch_set_v1/batch_get_v1 on a real MHA page_first_direct host pool
  ts_mla    the same on an MLA page_first host pool (its page size is the nearest MLA one)
  ts_v2     tierstore batch_set_v2/batch_get_v2 (the KV pool registered as a v2 pool)
  ts_v1_nocks  diagnostic: ts_v1 with the checksum replaced by a constant (what hashing and
               verifying the bytes costs, all else equal)
  ts_v1_nocoal diagnostic: ts_v1 with every page its own I/O (what coalescing adjacent slots
               into one preadv/pwritev buys)
  ts_steady    ts_v1 in steady state: the store holds 4 batches of this size and of a second
               page size (half as large), written in turn, so every round evicts regions of
               both sizes (inline or by housekeeping running alongside); nothing is cleared
  ts_cycle     control for ts_steady: a store of the same capacity, one page size, that drops
               the batch written 5 rounds before, so it writes across as much of the disk as
               ts_steady does without ever evicting (ts_steady / ts_cycle: what eviction costs)

Reads are "cold" after fdatasync and POSIX_FADV_DONTNEED on every file written (the page
cache dropped for them; the disk rounds too, though O_DIRECT bypasses it, so every system's
reads start with its writes flushed) and "warm" right after.

Every tierstore system is a store of 4 batches' worth (regions of capacity / 16) that starts
as a store in use (4,096 entries that stay, see in_use(); Redis keeps a hash of at most 128
entries as a listpack, which it scans linearly) and has written all its regions once before
it is timed: the first write into newly allocated space costs ext4 extra (unwritten
extents), which only a store's first fill pays. Every round writes new keys; tierstore then
drops them, which frees their regions for the next round, as a full store reuses evicted
ones (and as the disk rounds overwrite the same file range), so these rounds never evict.
ts_steady instead never drops anything and evicts every round. Rounds of all systems are
interleaved, in a new random order (--seed) each time.

Then the probe of 128 keys (all hit / first missing / last missing) in a store of 4,224
entries, against one redis-py MGET of 128 string keys named like the entries (and one HMGET
of the entries), and per-page cost with 4 KiB pages, where I/O is negligible. Each figure
is the median of --repeat rounds (p90, p99 too); ratios compare medians of the same run.
Starts its own redis-server.

--mixed: prefetch reads while backups write (issue 12), tierstore beside the disk's limit:

    PYTHONPATH=<checkout> python3 scripts/bench_io.py --mixed --repeat 15 --out scripts/results/bench_mixed.json \
        > scripts/results/bench_mixed.txt     (4 to 6 minutes; PYTHONPATH picks the engine measured, and
                                                the report records its file and commit: bench_mixed.* the
                                                reads-first engine, bench_mixed_before.* the one before, 83788d2)

In SGLang the prefetch of a waiting request's pages and the write-through backups run on
their own controller threads at the same time; a prefetch delays the request's first token,
a backup delays nobody. Per page size (256K, 2M, 8M; MHA page_first_direct, so tierstore
does zero-copy O_DIRECT from the host pool), two systems do the same mix from the same host
memory on the same disk:
  ts    one backend (so one I/O engine, --threads I/O threads) called from two threads
        through SGLang's calls: batch_get_v1 of stored keys (read batches of 32 MiB: 128 x
        256K, 16 x 2M, 4 x 8M, from 4 stored batches in turn) and batch_set_v1 of new keys
        (batches of 128 pages, as SGLang's backup thread sends them). The stream keeps its
        last 2 batches and deletes older ones, whose regions the next batches reuse, so
        the capacity (the read batches + 4 write batches) never evicts: every read must
        hit, every write must store, and the store must not have evicted (asserted).
  disk  plain O_DIRECT preadv/pwritev, one per page, reads on their own pool of --threads
        threads and writes on their own, each batch cut into contiguous per-thread runs
        as tierstore cuts a batch: the disk's own contention under this mix, with no
        queueing of ours, so ts / disk under writes is what our queueing adds.
Each system runs three phases, all six interleaved in a new random order each round (--seed):
  read   --reads read batches alone, each after a random pause of up to --pause (idle latency)
  write  write batches back to back, at least --write-mib a round (1 GiB: the write limit)
  mixed  one thread writes batches back to back; from the end of its first batch the reads
         run as in "read" while it goes on (read latency under writes; write GB/s of the
         batches after the first, which overlap the reads)
Targets (issue 12): read p50, p90 and p99 under writes <= 1.3x disk's; write alone >= 0.9x.
Read latency is per batch (ms), write GB/s per batch; each pooled over all rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from types import SimpleNamespace
from unittest import mock
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Generator, Optional, Protocol, TypeVar

import torch
from tierstore_kit.iobench import BATCH, GEOMETRY, backend, drop_cache, page_nbytes, sgl_key
from tierstore_kit.pools import fill, mha_pool, mla_pool, page_indices, storage_config
from tierstore_kit.provenance import header, stamp
from tierstore_kit.servers import RedisProc
from tierstore_kit.stats import Interval, med, paired_ratio, say, spread, timed, unpaired_ratio
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.tools import inspect
from sglang_tierstore import _native
from sglang_tierstore import store as ts_store
from sglang_tierstore.hostmem import ALIGN
from sglang_tierstore.schema import entry_field

REAL_PAGEIO = _native.pageio
if REAL_PAGEIO is None:
    raise SystemExit("bench_io: tierstore's C helper is not built (pip install -e .; it needs a C compiler)")

MLA_LAYERS = {64 << 10: 1, 256 << 10: 4, 1 << 20: 14, 2 << 20: 28, 8 << 20: 112}  # 64 tokens x 1152 B per layer


# -- the systems compared: each yields (write, cold read, warm read) seconds per round --------
#    Rounds of all systems are interleaved (random order) so they share the machine's moods.

Round = tuple[float, float, float]
T = TypeVar("T")


def disk_rounds(path: str, page: int, threads: int, pool: Any) -> Generator[Round, None, None]:
    """O_DIRECT pwritev/preadv of BATCH pages of `page` bytes straight from/into the host
    pool's own buffer (the very memory tierstore moves), with `threads` threads each taking
    a contiguous run of pages, as tierstore's I/O engine cuts a batch."""
    f = os.path.join(path, "odirect.bin")
    fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, page * BATCH)
    bufs = host_pages(pool, page, BATCH)
    offsets = [i * page for i in range(BATCH)]
    ex = ThreadPoolExecutor(threads)
    try:
        while True:
            w = timed(lambda: direct_io(ex, threads, fd, bufs, offsets, True))
            drop_cache(path, only=f)  # as every system's reads: after its writes are flushed
            yield w, timed(lambda: direct_io(ex, threads, fd, bufs, offsets, False)), \
                timed(lambda: direct_io(ex, threads, fd, bufs, offsets, False))
    finally:
        ex.shutdown()
        os.close(fd)
        os.remove(f)


def host_pages(pool: Any, page: int, n: int) -> list[memoryview]:
    """``n`` slices of ``page`` bytes of the host pool's own buffer (4 KiB aligned, as
    O_DIRECT needs): the very memory tierstore moves."""
    whole = memoryview(pool.kv_buffer.view(-1).view(torch.uint8).numpy())
    assert pool.kv_buffer.data_ptr() % ALIGN == 0 and page % ALIGN == 0 and len(whole) >= n * page
    return [whole[i * page : (i + 1) * page] for i in range(n)]


def direct_io(ex: ThreadPoolExecutor, threads: int, fd: int, bufs: list[memoryview], offsets: list[int], write: bool) -> None:
    """One pwritev/preadv per page at its offset, the batch cut into at most ``threads``
    contiguous runs of pages, one per thread of ``ex``, as tierstore's I/O engine cuts a batch."""
    n = len(bufs)
    chunks = min(threads, n)
    op = os.pwritev if write else os.preadv

    def chunk(t: int) -> None:
        for i in range(n * t // chunks, n * (t + 1) // chunks):
            assert op(fd, [bufs[i]], offsets[i]) == len(bufs[i])

    list(ex.map(chunk, range(chunks)))


def hicache_rounds(path: str, pool: Any) -> Generator[Round, None, None]:
    """SGLang's HiCacheFile, called as cache_controller's _generic_page_set/_generic_page_get do."""
    d = os.path.join(path, "hicache")
    hf = HiCacheFile(storage_config({}), file_path=d)
    ps = pool.page_size
    try:
        while True:
            keys = [sgl_key() for _ in range(BATCH)]

            def set_() -> None:
                assert hf.batch_set(keys, [pool.get_data_page(i * ps) for i in range(BATCH)])

            def get_() -> None:
                got = hf.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
                for i, page in enumerate(got):
                    assert page is not None
                    pool.set_from_flat_data_page((BATCH + i) * ps, page)

            w = timed(set_)
            drop_cache(d)
            yield w, timed(get_), timed(get_)
    finally:
        hf.clear()
        shutil.rmtree(d, ignore_errors=True)


def unhashed(calls: list[tuple[Any, ...]], stop: Any) -> list[tuple[int, int, tuple[int, ...]]]:
    """The C helper's transfer with no span hashed: every checksum 0."""
    done = REAL_PAGEIO.transfer([(*c[:4], (), *c[5:]) for c in calls], stop)
    return [(err, n, (0,) * len(c[4])) for (err, n, _), c in zip(done, calls)]


def tierstore_rounds(path: str, redis_url: str, pool: Any, threads: int, v2: bool, mla: bool, info: dict[str, Any],
                     checksum: bool = True, coalesce: bool = True) -> Generator[Round, None, None]:
    """tierstore's calls. Diagnostics: ``checksum=False`` replaces the checksum by a
    constant on writes and reads (the C helper moves the bytes and hashes nothing);
    ``coalesce=False`` makes every page its own I/O."""
    d = os.path.join(path, "tierstore-" + uuid.uuid4().hex[:6])
    ps = pool.page_size
    src, dst = page_indices(range(BATCH), ps), page_indices(range(BATCH, 2 * BATCH), ps)
    be = backend(d, redis_url, threads, mla=mla, capacity_gb=4 * BATCH * page_nbytes(pool) / (1 << 30))
    be.register_mem_pool_host(pool)
    be.register_mem_host_pool_v2(pool, PoolName.KV)
    in_use(be)
    for _ in range(4):  # every region written once: rounds overwrite, as the disk rounds do
        assert all(be.batch_set_v1([sgl_key() for _ in range(BATCH)], src))
        be.store.clear([be.namespace()])
    info["o_direct_zero_copy"] = be.zero_copy()
    redis_s = count_redis_time(be)
    write_redis_ms: list[float] = []
    read_redis_ms: list[float] = []
    try:
        while True:
            keys = [sgl_key() for _ in range(BATCH)]
            if v2:
                set_ = lambda: be.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys)])["kv"]  # noqa: E731
                get_ = lambda: be.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys)])["kv"]  # noqa: E731
            else:
                set_ = lambda: be.batch_set_v1(keys, src)  # noqa: E731
                get_ = lambda: be.batch_get_v1(keys, dst)  # noqa: E731
            out: list[Any] = []
            with contextlib.ExitStack() as patches:
                if not checksum:
                    patches.enter_context(mock.patch.object(_native, "pageio", SimpleNamespace(transfer=unhashed)))
                if not coalesce:
                    # one page per I/O: runs and pieces of at most a page (larger pages stay cut at MAX_RUN_BYTES)
                    one_page = min(ts_store.MAX_RUN_BYTES, be.namespace().page_bytes)
                    patches.enter_context(mock.patch.object(ts_store, "MAX_RUN_BYTES", one_page))
                redis_s.s = 0.0
                w = timed(lambda: out.append(set_()))
                write_redis_ms.append(1e3 * redis_s.s)
                drop_cache(d)
                redis_s.s = 0.0
                cold = timed(lambda: out.append(get_()))
                read_redis_ms.append(1e3 * redis_s.s)
                warm = timed(lambda: out.append(get_()))
            assert all(all(x) for x in out), "a tierstore call failed during the benchmark"
            yield w, cold, warm
            be.store.clear([be.namespace()])  # frees their regions: the next round reuses them, as a full store reuses evicted ones
    finally:
        info["write_redis_ms"] = spread(write_redis_ms) if write_redis_ms else None
        info["read_redis_ms"] = spread(read_redis_ms) if read_redis_ms else None
        be.clear()
        be.close()
        shutil.rmtree(d, ignore_errors=True)


def in_use(be: TierStoreBackend) -> None:
    """4,096 entries of another namespace (4 KiB pages) that stay: the index of a store in
    use. (Redis keeps a hash of at most 128 entries as a listpack it scans linearly; a store
    emptied every round would time that instead of a store's index.)"""
    ns = be.store.namespace({"filler": 1}, 4096)
    page = [memoryview(bytearray(4096))]
    for _ in range(32):
        assert all(be.store.write(ns, [sgl_key() for _ in range(BATCH)], [page] * BATCH, False))


def steady_rounds(path: str, redis_url: str, pool: Any, other: Any, threads: int, info: dict[str, Any]) -> Generator[Round, None, None]:
    """ts_v1 with the store full and evicting: two models (page sizes P and about P/2)
    share a store that holds 4 batches of each; every round writes a new batch of the
    other size (untimed), then the timed batch, so each round evicts both sizes' regions."""
    d = os.path.join(path, "steady-" + uuid.uuid4().hex[:6])
    p_bytes, o_bytes = page_nbytes(pool), page_nbytes(other)
    prefix = "bench-" + uuid.uuid4().hex[:8]
    cap = 4 * BATCH * (p_bytes + o_bytes) / (1 << 30)
    main = backend(d, redis_url, threads, model="p", redis_prefix=prefix, capacity_gb=cap)
    side = backend(d, redis_url, threads, model="other", redis_prefix=prefix, capacity_gb=cap)
    main.register_mem_pool_host(pool)
    side.register_mem_pool_host(other)
    src, dst = page_indices(range(BATCH), pool.page_size), page_indices(range(BATCH, 2 * BATCH), pool.page_size)
    osrc = page_indices(range(BATCH), other.page_size)
    redis_s = count_redis_time(main)
    write_redis_ms: list[float] = []
    evicted: list[int] = []
    try:
        for _ in range(6):  # fill: from here on every batch evicts
            assert all(side.batch_set_v1([sgl_key() for _ in range(BATCH)], osrc))
            assert all(main.batch_set_v1([sgl_key() for _ in range(BATCH)], src))
        while True:
            before = main.store.stats().get("evicted", 0) + side.store.stats().get("evicted", 0)
            assert all(side.batch_set_v1([sgl_key() for _ in range(BATCH)], osrc))
            keys = [sgl_key() for _ in range(BATCH)]
            out: list[Any] = []
            redis_s.s = 0.0
            w = timed(lambda: out.append(main.batch_set_v1(keys, src)))
            write_redis_ms.append(1e3 * redis_s.s)
            drop_cache(d)
            cold = timed(lambda: out.append(main.batch_get_v1(keys, dst)))
            warm = timed(lambda: out.append(main.batch_get_v1(keys, dst)))
            assert all(all(x) for x in out), "a tierstore call failed during the benchmark"
            evicted.append(main.store.stats().get("evicted", 0) + side.store.stats().get("evicted", 0) - before)
            yield w, cold, warm
    finally:
        info["write_redis_ms"] = spread(write_redis_ms) if write_redis_ms else None
        info["regions_evicted_per_round"] = spread([float(e) for e in evicted]) if evicted else None
        info["region_bytes"] = inspect.usage(main.store)["region_bytes"]
        info["other_page_bytes"] = o_bytes
        assert inspect.check(main.store, verify_pages=False) == []
        main.close()
        side.close()
        shutil.rmtree(d, ignore_errors=True)


def cycle_rounds(path: str, redis_url: str, pool: Any, other: Any, threads: int) -> Generator[Round, None, None]:
    """ts_steady's footprint without eviction: the steady store's capacity (4 batches of
    both page sizes), this page size only, and the batch written 5 rounds ago dropped."""
    d = os.path.join(path, "cycle-" + uuid.uuid4().hex[:6])
    cap = 4 * BATCH * (page_nbytes(pool) + page_nbytes(other)) / (1 << 30)
    be = backend(d, redis_url, threads, capacity_gb=cap)
    be.register_mem_pool_host(pool)
    ns = be.namespace()
    src, dst = page_indices(range(BATCH), pool.page_size), page_indices(range(BATCH, 2 * BATCH), pool.page_size)
    written: list[list[str]] = []

    def next_batch() -> list[str]:
        written.append([sgl_key() for _ in range(BATCH)])
        if len(written) > 5:
            be.store.delete(ns, written.pop(0))
        return written[-1]

    try:
        for _ in range(6):  # every region written once
            assert all(be.batch_set_v1(next_batch(), src))
        while True:
            keys = next_batch()
            out: list[Any] = []
            w = timed(lambda: out.append(be.batch_set_v1(keys, src)))
            drop_cache(d)
            cold = timed(lambda: out.append(be.batch_get_v1(keys, dst)))
            warm = timed(lambda: out.append(be.batch_get_v1(keys, dst)))
            assert all(all(x) for x in out), "a tierstore call failed during the benchmark"
            assert be.store.stats().get("evicted", 0) == 0, "the control evicted"
            yield w, cold, warm
    finally:
        be.close()
        shutil.rmtree(d, ignore_errors=True)


SYSTEMS = ("disk", "hicache", "ts_v1", "ts_v2", "ts_mla", "ts_v1_nocks", "ts_v1_nocoal", "ts_steady", "ts_cycle")


def rates(nbytes: int, rounds: list[Round]) -> dict[str, Any]:
    gb = nbytes * BATCH / 1e9
    out = {}
    for i, name in enumerate(("write_gbps", "read_cold_gbps", "read_warm_gbps")):
        out[name] = spread([gb / r[i] for r in rounds])
    return out


def interleave(systems: dict[str, Generator[T, None, None]], repeat: int, rng: random.Random,
               only: Optional[frozenset[str]] = None) -> dict[str, list[T]]:
    """``repeat`` rounds of every system (or of those in ``only``), in a new random order
    each time: a round runs while the disk still works off the one before (the VM's host
    caches writes), so no system may always follow the same one (a rotating order put ts_v1
    after HiCacheFile's buffered writes every time)."""
    names = [n for n in systems if only is None or n in only]
    samples: dict[str, list[T]] = {n: [] for n in names}
    try:
        for _ in range(repeat):
            for name in rng.sample(names, len(names)):
                samples[name].append(next(systems[name]))
    finally:
        for g in systems.values():
            g.close()
    return samples


def bench_probe(path: str, redis_url: str, repeat: int) -> dict[str, Any]:
    pool = mha_pool("page_first_direct", page_size=16, layers=1, heads=2, head_dim=32, tokens=BATCH * 16)
    ps = pool.page_size
    with backend(os.path.join(path, "probe"), redis_url, 8) as be:
        be.register_mem_pool_host(pool)
        for _ in range(32):  # a store in use: 4,096 more entries, so the entry hash is a hashtable
            assert all(be.batch_set_v1([sgl_key() for _ in range(BATCH)], page_indices(range(BATCH), ps)))
        keys = [sgl_key() for _ in range(BATCH)]
        assert all(be.batch_set_v1(keys, page_indices(range(BATCH), ps)))
        import redis

        r = redis.Redis.from_url(redis_url)
        a = be.store.space.attached()
        ns = be.namespace()
        fields = [entry_field(ns.ns_id, k) for k in keys]
        entries = a.key(0, "entries")
        names = [f"{{{a.home.shard_tags[0]}}}:".encode() + f for f in fields]  # string keys as long as a shard key + field
        values = r.hmget(entries, fields)
        r.mset(dict(zip(names, values)))
        missing = sgl_key()
        cases = {
            "mget_128": lambda: r.mget(names),
            "hmget_128": lambda: r.hmget(entries, fields),
            "probe_all_hit": lambda: be.batch_exists(keys),
            "probe_first_missing": lambda: be.batch_exists([missing] + keys[1:]),
            "probe_last_missing": lambda: be.batch_exists(keys[:-1] + [missing]),
        }
        for fn in cases.values():
            for _ in range(20):
                fn()
        order = list(cases)
        ms: dict[str, list[float]] = {n: [] for n in order}
        for i in range(repeat):  # interleaved, rotating order
            for name in order[i % len(order):] + order[: i % len(order)]:
                ms[name].append(1e3 * timed(cases[name]))
        out: dict[str, Any] = {n: spread(v) for n, v in ms.items()}
        r.delete(*names)
        # per-page cost with 4 KiB pages through the page cache: I/O is negligible
        src, dst = page_indices(range(BATCH), ps), page_indices(range(BATCH, 2 * BATCH), ps)
    with backend(os.path.join(path, "tiny"), redis_url, 8, o_direct=False) as be:
        be.register_mem_pool_host(pool)
        redis_s = count_redis_time(be)
        sets, gets, set_py, get_py = [], [], [], []
        for _ in range(max(20, repeat // 10)):
            keys = [sgl_key() for _ in range(BATCH)]
            for op, total, py in ((lambda: be.batch_set_v1(keys, src), sets, set_py), (lambda: be.batch_get_v1(keys, dst), gets, get_py)):
                redis_s.s = 0.0
                t = timed(op)
                total.append(1e6 * t / BATCH)
                py.append(1e6 * (t - redis_s.s) / BATCH - SYSCALL_US["set" if total is sets else "get"])
            be.clear()  # next round rewrites these slots, as SYSCALL_US was measured (no new page-cache pages)
        out["us_per_page_set_4k"] = spread(sets)
        out["us_per_page_get_4k"] = spread(gets)
        out["python_us_per_page_set_4k"] = spread(set_py)
        out["python_us_per_page_get_4k"] = spread(get_py)
        out["syscall_us_per_page_4k"] = dict(SYSCALL_US)
        be.clear()
    return out


SYSCALL_US = {"get": 0.0, "set": 0.0}


def measure_syscall(path: str) -> None:
    """Cost of one preadv / pwritev of a 4 KiB page (its K and V halves) through the page
    cache: what a 4 KiB-page get / set spends in the kernel, subtracted to get Python's share."""
    f = os.path.join(path, "syscall.bin")
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, 4096 * BATCH)
    bufs = [memoryview(bytearray(2048)), memoryview(bytearray(2048))]
    n = BATCH * 50
    for op, fn in (("get", os.preadv), ("set", os.pwritev)):
        SYSCALL_US[op] = 1e6 * timed(lambda: [fn(fd, bufs, (i % BATCH) * 4096) for i in range(n)]) / n
    os.close(fd)
    os.remove(f)


class RedisTime(threading.local):
    """Seconds spent waiting on Redis, each thread's own (``s``): the housekeeping thread's
    calls, or a concurrent reader's, do not count in a writer's."""

    s = 0.0


def count_redis_time(be: TierStoreBackend) -> RedisTime:
    """Wrap the backend's index calls to add up the time spent waiting on Redis."""
    acc = RedisTime()
    idx = be.store.index
    for name in ("hmget_each", "calls_each"):  # the leaves every index call of a batch goes through
        fn = getattr(idx, name)

        def timed_call(*a: Any, _fn: Callable[..., Any] = fn, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc.s += time.perf_counter() - t0

        setattr(idx, name, timed_call)
    return acc


# -- --mixed: read batches while a write stream runs, tierstore beside the O_DIRECT limit --------

READ_BYTES = 32 << 20  # one read batch: 128 x 256K, 16 x 2M, 4 x 8M pages (a prefetch of 2K-8K tokens)
READ_SETS = 4  # distinct read batches, read in turn, so no read finds a cache of the one before
KEEP = 2  # write batches the stream keeps stored; older ones are deleted and their space reused


class Mix(Protocol):
    """A system doing the mixed load: read batches of stored pages, write batches of new ones."""

    page: int
    read_pages: int

    def read(self, k: int) -> None:
        """Read stored batch ``k`` (mod READ_SETS) into the read pages, every page a hit."""

    def write(self) -> float:
        """Write one batch of BATCH new pages; seconds the batch took."""

    def close(self) -> None: ...


class TierstoreMix:
    """tierstore's SGLang-facing calls, one backend (so one I/O engine) for both, as
    SGLang's prefetch and backup threads share a rank's backend: batch_get_v1 of stored
    keys, batch_set_v1 of new keys (as the backup thread sends them). The stream keeps
    the last KEEP batches and deletes older ones, whose regions the next batches reuse
    (as a full store reuses evicted ones), so the capacity never evicts the read keys."""

    def __init__(self, path: str, redis_url: str, pool: Any, page: int, threads: int) -> None:
        self.page, self.read_pages = page, READ_BYTES // page
        self.dir = os.path.join(path, "mixed-" + uuid.uuid4().hex[:6])
        ps = pool.page_size
        self.src = page_indices(range(BATCH), ps)
        self.dst = page_indices(range(BATCH, BATCH + self.read_pages), ps)
        # twice what it holds: deleted slots come back only with their region, and writers' stocks run ahead
        cap = 2 * (READ_SETS * self.read_pages + (KEEP + 2) * BATCH) * page / (1 << 30)
        self.be = backend(self.dir, redis_url, threads, capacity_gb=cap)
        self.be.register_mem_pool_host(pool)
        assert self.be.zero_copy(), "not zero-copy O_DIRECT"
        self.ns = self.be.namespace()
        self.reads = [[sgl_key() for _ in range(self.read_pages)] for _ in range(READ_SETS)]
        for keys in self.reads:
            assert all(self.be.batch_set_v1(keys, self.src[: self.read_pages * ps]))
        self.written: list[list[str]] = []
        self.redis = count_redis_time(self.be)
        self.write_redis_ms: list[float] = []  # of each write batch: its COMMIT (and stock refills) in Redis
        for _ in range(KEEP + 2):  # every region the stream uses written once before it is timed
            self.write()

    def read(self, k: int) -> None:
        assert all(self.be.batch_get_v1(self.reads[k % READ_SETS], self.dst)), "a read key missed"

    def write(self) -> float:
        keys = [sgl_key() for _ in range(BATCH)]
        out: list[list[bool]] = []
        self.redis.s = 0.0
        t = timed(lambda: out.append(self.be.batch_set_v1(keys, self.src)))
        self.write_redis_ms.append(1e3 * self.redis.s)
        assert all(out[0]), "a write was not stored"
        self.written.append(keys)
        if len(self.written) > KEEP:
            self.be.store.delete(self.ns, self.written.pop(0))
        return t

    def close(self) -> None:
        try:
            assert self.be.store.stats().get("evicted", 0) == 0, "the store evicted"
            self.be.clear()
        finally:
            self.be.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class DiskMix:
    """The same mix as plain O_DIRECT preadv/pwritev of the same host-pool memory, reads
    and writes each on their own pool of ``threads`` threads (as SGLang's prefetch and
    backup run on their own threads): what the disk itself does under this mix. Reads
    come from READ_SETS batches' worth of file, writes overwrite one batch's worth."""

    def __init__(self, path: str, pool: Any, page: int, threads: int) -> None:
        self.page, self.read_pages, self.threads = page, READ_BYTES // page, threads
        self.file = os.path.join(path, "mixed-" + uuid.uuid4().hex[:6] + ".bin")
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        os.posix_fallocate(self.fd, 0, (READ_SETS * self.read_pages + BATCH) * page)
        bufs = host_pages(pool, page, BATCH + self.read_pages)
        self.src, self.dst = bufs[:BATCH], bufs[BATCH:]
        self.readers, self.writers = ThreadPoolExecutor(threads), ThreadPoolExecutor(threads)
        for k in range(READ_SETS):  # written once, as tierstore's are (no unwritten extents left)
            direct_io(self.writers, threads, self.fd, self.src[: self.read_pages], self._offsets(k), True)
        self.write()

    def _offsets(self, k: int) -> list[int]:
        """Read batch ``k``'s page offsets; READ_SETS: the write batch's."""
        base = k * self.read_pages * self.page
        n = BATCH if k == READ_SETS else self.read_pages
        return [base + i * self.page for i in range(n)]

    def read(self, k: int) -> None:
        direct_io(self.readers, self.threads, self.fd, self.dst, self._offsets(k % READ_SETS), False)

    def write(self) -> float:
        return timed(lambda: direct_io(self.writers, self.threads, self.fd, self.src, self._offsets(READ_SETS), True))

    def close(self) -> None:
        self.readers.shutdown()
        self.writers.shutdown()
        os.close(self.fd)
        os.remove(self.file)


def read_batches(mix: Mix, n: int, pause: float, rng: random.Random, first: int) -> list[float]:
    """Latencies (ms) of ``n`` read batches, each after a random pause of up to
    ``pause`` s (prefetches arrive when requests do, not in step with the writes)."""
    out = []
    for k in range(first, first + n):
        time.sleep(rng.uniform(0, pause))
        out.append(1e3 * timed(lambda: mix.read(k)))
    return out


def mixed_rounds(mix: Mix, phase: str, reads: int, writes: int, pause: float, rng: random.Random) -> Generator[dict[str, list[float]], None, None]:
    """One phase of one system per round: "read" (read batches alone: idle latency),
    "write" (``writes`` batches back to back: the write limit), "mixed" (the read
    batches while one thread writes batches back to back, from the end of its first
    batch until the reads are done: read latency and write GB/s under both)."""
    gb = mix.page * BATCH / 1e9
    k = 0
    while True:
        if phase == "read":
            yield {"read_ms": read_batches(mix, reads, pause, rng, k)}
        elif phase == "write":
            yield {"write_gbps": [gb / mix.write() for _ in range(writes)]}
        else:
            secs: list[float] = []
            failed: list[BaseException] = []
            started, stop = threading.Event(), threading.Event()

            def stream() -> None:
                try:
                    while not stop.is_set():
                        secs.append(mix.write())
                        started.set()
                except BaseException as e:
                    failed.append(e)
                    started.set()

            writer = threading.Thread(target=stream, name="bench-writes")
            writer.start()
            started.wait()
            try:
                lat = read_batches(mix, reads, pause, rng, k) if not failed else []
            finally:
                stop.set()
                writer.join()
            if failed:
                raise failed[0]
            yield {"read_ms": lat, "write_gbps": [gb / s for s in secs[1:]]}  # the first batch ran alone
        k += reads


def bench_mixed(work: str, url: str, size: int, threads: int, repeat: int, reads: int, pause: float,
                rng: random.Random, write_bytes: int = 1 << 30) -> dict[str, Any]:
    """tierstore ("ts") and the O_DIRECT limit ("disk") at one page size, all phases of
    both interleaved, in a new random order each round."""
    p, layers, heads, dim = GEOMETRY[size]
    read_pages = READ_BYTES // size
    pool = mha_pool("page_first_direct", page_size=p, layers=layers, heads=heads, head_dim=dim,
                    tokens=-(-(BATCH + read_pages) // 2) * p)  # host pool: twice that, the write and read pages
    assert page_nbytes(pool) == size
    fill(pool, 0)
    writes = max(2, write_bytes // (size * BATCH))  # at least write_bytes per round (1 GiB: the write limit)
    mixes: dict[str, Mix] = {}
    redis_ms: list[float] = []
    try:
        ts_mix = TierstoreMix(work, url, pool, size, threads)
        mixes["ts"] = ts_mix
        mixes["disk"] = DiskMix(work, pool, size, threads)
        samples = interleave({f"{name}:{phase}": mixed_rounds(mix, phase, reads, writes, pause, rng)
                              for name, mix in mixes.items() for phase in ("read", "write", "mixed")}, repeat, rng)
        redis_ms = ts_mix.write_redis_ms[KEEP + 2 :]  # the timed batches'
    finally:
        for mix in mixes.values():
            mix.close()
    row: dict[str, Any] = {"page_bytes": size, "read_pages": read_pages, "write_batches_alone": writes}
    for name in mixes:
        got = {ph: {m: [x for r in samples[f"{name}:{ph}"] for x in r[m]] for m in samples[f"{name}:{ph}"][0]}
               for ph in ("read", "write", "mixed")}
        row[name] = {"read_idle_ms": spread(got["read"]["read_ms"]), "read_mixed_ms": spread(got["mixed"]["read_ms"]),
                     "write_alone_gbps": spread(got["write"]["write_gbps"]), "write_mixed_gbps": spread(got["mixed"]["write_gbps"])}
    ts, disk = row["ts"], row["disk"]
    ts["write_redis_ms"] = spread(redis_ms)
    # write alone with the time each batch waits on Redis taken out: what tierstore's own I/O reaches
    batch_s = size * BATCH / 1e9 / ts["write_alone_gbps"]["median"]
    ts["write_alone_without_redis_gbps"] = size * BATCH / 1e9 / (batch_s - ts["write_redis_ms"]["median"] / 1e3)
    row["ts_over_disk"] = {
        "read_mixed": {q: ts["read_mixed_ms"][q] / disk["read_mixed_ms"][q] for q in ("median", "p90", "p99")},
        "read_idle": {q: ts["read_idle_ms"][q] / disk["read_idle_ms"][q] for q in ("median", "p90", "p99")},
        "write_alone": ts["write_alone_gbps"]["median"] / disk["write_alone_gbps"]["median"],
        "write_mixed": ts["write_mixed_gbps"]["median"] / disk["write_mixed_gbps"]["median"],
        "write_alone_without_redis": ts["write_alone_without_redis_gbps"] / disk["write_alone_gbps"]["median"],
    }
    row["intervals"] = {f"{m}": unpaired_ratio(ts[m]["samples"], disk[m]["samples"])
                        for m in ("read_mixed_ms", "read_idle_ms", "write_alone_gbps", "write_mixed_gbps")}
    return row


def print_mixed(spec: str, row: dict[str, Any]) -> None:
    size, n = row["page_bytes"], row["read_pages"]
    print(f"\n{spec} pages ({size} B): read batches of {n} pages ({n * size >> 20} MiB), write batches of {BATCH}"
          f" ({BATCH * size >> 20} MiB); read ms, write GB/s: median [p90 p99] (n)")
    cols = (("read idle", "read_idle_ms"), ("read under writes", "read_mixed_ms"),
            ("write alone", "write_alone_gbps"), ("write under reads", "write_mixed_gbps"))
    print("        " + "".join(f"{c:<28}" for c, _ in cols))
    for name in ("ts", "disk"):
        cells = []
        for _, k in cols:
            st = row[name][k]
            cells.append(f"{st['median']:7.2f} [{st['p90']:.2f} {st['p99']:.2f}] ({st['n']})")
        print(f"  {name:<6}" + "".join(f"{c:<28}" for c in cells))
    r = row["ts_over_disk"]
    mixed, idle = r["read_mixed"], r["read_idle"]
    print(f"  ts / disk, read under writes: p50 {mixed['median']:.2f}, p90 {mixed['p90']:.2f}, p99 {mixed['p99']:.2f}"
          f" (target <= 1.3); read idle: p50 {idle['median']:.2f}, p90 {idle['p90']:.2f}, p99 {idle['p99']:.2f}")
    print(f"  ts / disk, write alone {r['write_alone']:.2f} (target >= 0.9), write under reads {r['write_mixed']:.2f}")
    print("  ts / disk, medians of all batches with a 95% interval (each side resampled):")
    for m, iv in row["intervals"].items():
        print(f"    {m:<18} {say(iv)}")
    gb, rms = size * BATCH / 1e9, row["ts"]["write_redis_ms"]["median"]
    print(f"  ts write batch alone: {1e3 * gb / row['ts']['write_alone_gbps']['median']:.1f} ms, of which {rms:.1f} ms"
          f" waiting on Redis (median of all batches); without it / disk: {r['write_alone_without_redis']:.2f}")


def bench_size(work: str, url: str, size: int, threads: int, repeat: int, rng: random.Random,
               systems: Optional[frozenset[str]] = None) -> dict[str, Any]:
    """The I/O benchmark's systems (all, or those named in ``systems``) at one page size,
    rounds interleaved. A generator does nothing before its first round, so a system left
    out costs nothing."""
    p, layers, heads, dim = GEOMETRY[size]
    mha = mha_pool("page_first_direct", page_size=p, layers=layers, heads=heads, head_dim=dim, tokens=BATCH * p)
    mla = mla_pool("page_first", page_size=64, layers=MLA_LAYERS[size], kv_lora_rank=512, rope_dim=64, tokens=BATCH * 64)
    fill(mha, 0)
    fill(mla, 1)
    half = mha_pool("page_first_direct", page_size=p, layers=max(1, layers // 2), heads=heads, head_dim=dim, tokens=BATCH * p)
    info: dict[str, dict[str, Any]] = {"ts_v1": {}, "ts_v2": {}, "ts_mla": {}, "ts_steady": {}}
    samples = interleave({
        "disk": disk_rounds(work, size, threads, mha),
        "hicache": hicache_rounds(work, mha),
        "ts_v1": tierstore_rounds(work, url, mha, threads, False, False, info["ts_v1"]),
        "ts_v2": tierstore_rounds(work, url, mha, threads, True, False, info["ts_v2"]),
        "ts_mla": tierstore_rounds(work, url, mla, threads, False, True, info["ts_mla"]),
        "ts_v1_nocks": tierstore_rounds(work, url, mha, threads, False, False, {}, checksum=False),
        **({"ts_v1_nocoal": tierstore_rounds(work, url, mha, threads, False, False, {}, coalesce=False)}
           if size < ts_store.MAX_RUN_BYTES else {}),  # pages as large as a run: coalescing off is the same code
        "ts_steady": steady_rounds(work, url, mha, half, threads, info["ts_steady"]),
        "ts_cycle": cycle_rounds(work, url, mha, half, threads),
    }, repeat, rng, systems)
    row: dict[str, Any] = {"page_bytes": page_nbytes(mha)}
    for name, rounds in samples.items():
        nbytes = page_nbytes(mla) if name == "ts_mla" else size
        row[name] = {**rates(nbytes, rounds), **info.get(name, {})}
    if "ts_mla" in row:
        row["ts_mla"]["page_bytes"] = page_nbytes(mla)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/tierstore-bench")
    ap.add_argument("--mixed", action="store_true", help="the mixed read/write benchmark instead")
    ap.add_argument("--sizes", help="default 256K,1M,2M,8M; with --mixed 256K,2M,8M (64K: for smoke runs)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--probe-repeat", type=int, default=300)
    ap.add_argument("--reads", type=int, default=20, help="--mixed: read batches per phase and round")
    ap.add_argument("--pause", type=float, default=0.01, help="--mixed: longest random pause before a read batch (s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round order")
    ap.add_argument("--write-mib", type=int, default=1024,
                    help="--mixed: MiB written per round in the write phase, at least (1 GiB: the write limit)")
    ap.add_argument("--systems", type=lambda v: frozenset(v.split(",")),
                    help=f"without --mixed: only these of {','.join(SYSTEMS)} (default all)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.systems and (a.mixed or not a.systems <= set(SYSTEMS)):
        ap.error(f"--systems: a subset of {','.join(SYSTEMS)}, without --mixed")
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=a.dir)
    redis = RedisProc(Path(work))
    url = redis.url
    units = {"K": 1 << 10, "M": 1 << 20}
    rng = random.Random(a.seed)
    report: dict[str, Any] = {
        "stamp": stamp(directory=a.dir, server_flags=redis.flags()),
        "threads": a.threads, "batch": BATCH, "repeat": a.repeat, "seed": a.seed, "sizes": {},
    }
    print(header(report["stamp"]))
    if a.mixed:
        report.update(reads=a.reads, pause_s=a.pause, read_bytes=READ_BYTES, read_sets=READ_SETS, keep=KEEP)
    try:
        for spec in (a.sizes or ("256K,2M,8M" if a.mixed else "256K,1M,2M,8M")).split(","):
            size = int(spec[:-1]) * units[spec[-1]]
            if a.mixed:
                row = bench_mixed(work, url, size, a.threads, a.repeat, a.reads, a.pause, rng, a.write_mib << 20)
                print_mixed(spec, row)
            else:
                row = bench_size(work, url, size, a.threads, a.repeat, rng, a.systems)
                row["ratios"] = size_ratios(row)
                print_row(spec, row)
            report["sizes"][spec] = row
            sys.stdout.flush()
        if not a.mixed:
            measure_syscall(work)
            report["probe"] = bench_probe(work, url, a.probe_repeat)
            report["probe"]["ratios"] = probe_ratios(report["probe"])
            print_probe(report["probe"])
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


# (figure, system over system, metric): the paired comparisons each page size reports
RATIOS: tuple[tuple[str, str, str, str], ...] = (
    ("cold read / O_DIRECT read", "ts_v1", "disk", "read_cold_gbps"),
    ("write / O_DIRECT write", "ts_v1", "disk", "write_gbps"),
    ("v2 cold read / O_DIRECT read", "ts_v2", "disk", "read_cold_gbps"),
    ("MLA cold read / O_DIRECT read", "ts_mla", "disk", "read_cold_gbps"),
    ("eviction (steady / same footprint never evicting): write", "ts_steady", "ts_cycle", "write_gbps"),
    ("eviction (steady / same footprint never evicting): cold read", "ts_steady", "ts_cycle", "read_cold_gbps"),
    ("coalescing on / off: write", "ts_v1", "ts_v1_nocoal", "write_gbps"),
    ("coalescing on / off: cold read", "ts_v1", "ts_v1_nocoal", "read_cold_gbps"),
    ("tierstore / HiCacheFile: write", "ts_v1", "hicache", "write_gbps"),
    ("tierstore / HiCacheFile: cold read", "ts_v1", "hicache", "read_cold_gbps"),
    ("tierstore / HiCacheFile: warm read", "ts_v1", "hicache", "read_warm_gbps"),
    ("diagnostic, no hashing / with: write", "ts_v1_nocks", "ts_v1", "write_gbps"),
)


def size_ratios(row: dict[str, Any]) -> dict[str, Interval]:
    """Every figure of RATIOS whose two systems ran at this size: per-round ratios (round i
    of both systems ran in the same shuffled round), median and 95% interval."""
    return {fig: paired_ratio(row[a][m]["samples"], row[b][m]["samples"])
            for fig, a, b, m in RATIOS if a in row and b in row}


def print_row(spec: str, row: dict[str, Any]) -> None:
    mla = f"; MLA {row['ts_mla']['page_bytes']} B" if "ts_mla" in row else ""
    print(f"\n{spec} pages ({row['page_bytes']} B{mla}), batch {BATCH}: GB/s median [p90 p99]")
    for name in SYSTEMS:
        if name not in row:
            continue
        r = row[name]
        line = "  ".join(f"{k[:-5]:>10} {med(r, k):6.2f} [{r[k]['p90']:.2f} {r[k]['p99']:.2f}]" for k in ("write_gbps", "read_cold_gbps", "read_warm_gbps"))
        print(f"  {name:<12} {line}")
    rounds = next(row[name]["write_gbps"]["n"] for name in SYSTEMS if name in row)
    print(f"  paired per round ({rounds} rounds), median ratio and 95% interval:")
    for fig, iv in row["ratios"].items():
        print(f"    {fig:<62} {say(iv)}")
    if "ts_v1_nocoal" not in row and row["page_bytes"] >= ts_store.MAX_RUN_BYTES:
        print(f"    coalescing on / off: not run (pages of {row['page_bytes']} B are as large as a coalesced run: the same code)")
    if "ts_v1" in row and "disk" in row:
        v1, gb = row["ts_v1"], row["page_bytes"] * BATCH / 1e9
        disk_r, disk_w = med(row["disk"], "read_cold_gbps"), med(row["disk"], "write_gbps")
        for op, calls, rate, limit in (("write", "commit", "write_gbps", disk_w), ("cold read", "HMGET", "read_cold_gbps", disk_r)):
            rms, secs = v1[op.split()[-1] + "_redis_ms"]["median"], gb / med(v1, rate)
            print(f"  ts_v1 {op} batch: {1e3 * secs:.1f} ms, of which {rms:.1f} ms in Redis ({calls});"
                  f" without it / disk: {gb / (secs - rms / 1e3) / limit:.2f}")
    if "ts_steady" in row:
        st = row["ts_steady"]
        ev = st["regions_evicted_per_round"]["median"] if st.get("regions_evicted_per_round") else 0
        print(f"  steady state: store full, {ev:.0f} regions of {st['region_bytes'] >> 20} MiB evicted per round, second page"
              f" size {st['other_page_bytes']} B")


def probe_ratios(p: dict[str, Any]) -> dict[str, Interval]:
    """Each probe case over one MGET of the same 128 keys, paired per repetition."""
    return {k: paired_ratio(p[k]["samples"], p["mget_128"]["samples"])
            for k in ("hmget_128", "probe_all_hit", "probe_first_missing", "probe_last_missing")}


def print_probe(p: dict[str, Any]) -> None:
    print(f"\nprobe of {BATCH} keys, ms median [p90 p99], ratio to one MGET of the same keys (paired per repetition, 95% interval)")
    for k in ("mget_128", "hmget_128", "probe_all_hit", "probe_first_missing", "probe_last_missing"):
        iv = p["ratios"].get(k)
        print(f"  {k:<20} {med(p, k):.3f} [{p[k]['p90']:.3f} {p[k]['p99']:.3f}]  {say(iv) if iv else ''}")
    sc = p["syscall_us_per_page_4k"]
    print(f"4 KiB pages, us per page median [p90 p99]; python = total - time in Redis calls - one "
          f"pwritev ({sc['set']:.1f} us) / preadv ({sc['get']:.1f} us)")
    for op in ("set", "get"):
        t, py = p[f"us_per_page_{op}_4k"], p[f"python_us_per_page_{op}_4k"]
        print(f"  batch_{op}_v1  total {t['median']:5.1f} [{t['p90']:.1f} {t['p99']:.1f}]   python {py['median']:5.1f} [{py['p90']:.1f} {py['p99']:.1f}]")


if __name__ == "__main__":
    sys.exit(main())
