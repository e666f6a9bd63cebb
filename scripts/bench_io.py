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
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from unittest import mock
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402
from pools import mha_pool, mla_pool, page_indices, storage_config  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer  # noqa: E402

from sglang_tierstore import TierStoreBackend  # noqa: E402
from sglang_tierstore import store as ts_store  # noqa: E402
from sglang_tierstore.hostmem import ALIGN  # noqa: E402
from sglang_tierstore.schema import entry_field  # noqa: E402

BATCH = 128
# page bytes -> MHA geometry (tokens per page, layers, KV heads, head dim), bf16, K and V
GEOMETRY = {
    256 << 10: (16, 8, 8, 64),
    1 << 20: (64, 8, 8, 64),
    2 << 20: (64, 16, 8, 64),
    8 << 20: (64, 32, 8, 128),  # 64 tokens of Llama-3-8B
}
MLA_LAYERS = {256 << 10: 4, 1 << 20: 14, 2 << 20: 28, 8 << 20: 112}  # 64 tokens x 1152 B per layer


def sgl_key() -> str:
    """A page key as SGLang makes them: 64 hex digits of a SHA-256 chain."""
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"median": statistics.median(s), "p90": pick(0.9), "p99": pick(0.99), "n": len(s)}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(root: str, only: str = "") -> None:
    """fdatasync, then POSIX_FADV_DONTNEED, on every file under root (or just ``only``):
    the writes are on the disk, not in a cache (the guest's or, through the flush, the
    VM host's), before reads are timed. Needs no privileges."""
    for d, _, names in os.walk(root):
        for n in names:
            if only and os.path.join(d, n) != only:
                continue
            try:
                fd = os.open(os.path.join(d, n), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


# -- the systems compared: each yields (write, cold read, warm read) seconds per round --------
#    Rounds of all systems are interleaved (random order) so they share the machine's moods.

Round = tuple[float, float, float]


def disk_rounds(path: str, page: int, threads: int, pool: Any) -> Iterator[Round]:
    """O_DIRECT pwritev/preadv of BATCH pages of `page` bytes straight from/into the host
    pool's own buffer (the very memory tierstore moves), with `threads` threads each taking
    a contiguous run of pages, as tierstore's I/O engine cuts a batch."""
    f = os.path.join(path, "odirect.bin")
    fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, page * BATCH)
    whole = memoryview(pool.kv_buffer.view(-1).view(torch.uint8).numpy())
    assert pool.kv_buffer.data_ptr() % ALIGN == 0 and len(whole) >= 2 * page * BATCH
    bufs = [whole[i * page : (i + 1) * page] for i in range(BATCH)]
    pool = ThreadPoolExecutor(threads)

    def run(write: bool) -> None:
        def chunk(t: int) -> None:
            for i in range(BATCH * t // threads, BATCH * (t + 1) // threads):
                (os.pwritev if write else os.preadv)(fd, [bufs[i]], i * page)

        list(pool.map(chunk, range(threads)))

    try:
        while True:
            w = timed(lambda: run(True))
            drop_cache(path, only=f)  # as every system's reads: after its writes are flushed
            yield w, timed(lambda: run(False)), timed(lambda: run(False))
    finally:
        pool.shutdown()
        os.close(fd)
        os.remove(f)


def hicache_rounds(path: str, pool: Any) -> Iterator[Round]:
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


def backend(path: str, redis_url: str, threads: int, mla: bool = False, model: str = "bench", **extra: Any) -> TierStoreBackend:
    cfg = {"redis_url": redis_url, "redis_prefix": "bench-" + uuid.uuid4().hex[:8], "path": path,
           "capacity_gb": 64, "io_threads": threads, "interface_v1": 1, **extra}
    return TierStoreBackend(storage_config(cfg, mla=mla, model=model), {})


def tierstore_rounds(path: str, redis_url: str, pool: Any, threads: int, v2: bool, mla: bool, info: dict[str, Any],
                     checksum: bool = True, coalesce: bool = True) -> Iterator[Round]:
    """tierstore's calls. Diagnostics: ``checksum=False`` replaces the checksum by a
    constant on writes and reads; ``coalesce=False`` makes every page its own I/O."""
    d = os.path.join(path, "tierstore-" + uuid.uuid4().hex[:6])
    ps = pool.page_size
    src, dst = page_indices(range(BATCH), ps), page_indices(range(BATCH, 2 * BATCH), ps)
    be = backend(d, redis_url, threads, mla=mla, capacity_gb=4 * BATCH * page_bytes(pool) / (1 << 30))
    be.register_mem_pool_host(pool)
    be.register_mem_host_pool_v2(pool, PoolName.KV)
    in_use(be)
    for _ in range(4):  # every region written once: rounds overwrite, as the disk rounds do
        assert all(be.batch_set_v1([sgl_key() for _ in range(BATCH)], src))
        be.store.clear([be._pool("kv").ns])
    info["o_direct_zero_copy"] = be._pool("kv").plan.aligned
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
                    patches.enter_context(mock.patch.object(ts_store, "checksum", lambda regions: 0))
                if not coalesce:
                    patches.enter_context(mock.patch.object(ts_store, "MAX_RUN_BYTES", 0))
                redis_s[0] = 0.0
                w = timed(lambda: out.append(set_()))
                write_redis_ms.append(1e3 * redis_s[0])
                drop_cache(d)
                redis_s[0] = 0.0
                cold = timed(lambda: out.append(get_()))
                read_redis_ms.append(1e3 * redis_s[0])
                warm = timed(lambda: out.append(get_()))
            assert all(all(x) for x in out), "a tierstore call failed during the benchmark"
            yield w, cold, warm
            be.store.clear([be._pool("kv").ns])  # frees their regions: the next round reuses them, as a full store reuses evicted ones
    finally:
        info["write_redis_ms"] = stats(write_redis_ms) if write_redis_ms else None
        info["read_redis_ms"] = stats(read_redis_ms) if read_redis_ms else None
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


def steady_rounds(path: str, redis_url: str, pool: Any, other: Any, threads: int, info: dict[str, Any]) -> Iterator[Round]:
    """ts_v1 with the store full and evicting: two models (page sizes P and about P/2)
    share a store that holds 4 batches of each; every round writes a new batch of the
    other size (untimed), then the timed batch, so each round evicts both sizes' regions."""
    d = os.path.join(path, "steady-" + uuid.uuid4().hex[:6])
    p_bytes, o_bytes = page_bytes(pool), page_bytes(other)
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
            redis_s[0] = 0.0
            w = timed(lambda: out.append(main.batch_set_v1(keys, src)))
            write_redis_ms.append(1e3 * redis_s[0])
            drop_cache(d)
            cold = timed(lambda: out.append(main.batch_get_v1(keys, dst)))
            warm = timed(lambda: out.append(main.batch_get_v1(keys, dst)))
            assert all(all(x) for x in out), "a tierstore call failed during the benchmark"
            evicted.append(main.store.stats().get("evicted", 0) + side.store.stats().get("evicted", 0) - before)
            yield w, cold, warm
    finally:
        info["write_redis_ms"] = stats(write_redis_ms) if write_redis_ms else None
        info["regions_evicted_per_round"] = stats([float(e) for e in evicted]) if evicted else None
        info["region_bytes"] = main.store.usage()["region_bytes"]
        info["other_page_bytes"] = o_bytes
        assert main.check(verify_pages=False) == []
        main.close()
        side.close()
        shutil.rmtree(d, ignore_errors=True)


def cycle_rounds(path: str, redis_url: str, pool: Any, other: Any, threads: int) -> Iterator[Round]:
    """ts_steady's footprint without eviction: the steady store's capacity (4 batches of
    both page sizes), this page size only, and the batch written 5 rounds ago dropped."""
    d = os.path.join(path, "cycle-" + uuid.uuid4().hex[:6])
    cap = 4 * BATCH * (page_bytes(pool) + page_bytes(other)) / (1 << 30)
    be = backend(d, redis_url, threads, capacity_gb=cap)
    be.register_mem_pool_host(pool)
    ns = be._pool("kv").ns
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


def rates(nbytes: int, rounds: list[Round]) -> dict[str, Any]:
    gb = nbytes * BATCH / 1e9
    out = {}
    for i, name in enumerate(("write_gbps", "read_cold_gbps", "read_warm_gbps")):
        out[name] = stats([gb / r[i] for r in rounds])
    return out


def interleave(systems: dict[str, Iterator[Round]], repeat: int, rng: random.Random) -> dict[str, list[Round]]:
    """``repeat`` rounds of every system, in a new random order each time: a round runs
    while the disk still works off the one before (the VM's host caches writes), so no
    system may always follow the same one (a rotating order put ts_v1 after HiCacheFile's
    buffered writes every time)."""
    names = list(systems)
    samples: dict[str, list[Round]] = {n: [] for n in names}
    try:
        for _ in range(repeat):
            for name in rng.sample(names, len(names)):
                samples[name].append(next(systems[name]))
    finally:
        for g in systems.values():
            g.close()
    return samples


def page_bytes(pool: Any) -> int:
    return int(pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize)


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
        a = be.store.attached()
        ns = be._pool("kv").ns
        fields = [entry_field(ns.ns_id, k) for k in keys]
        entries = a.alloc.key(0, "entries")
        names = [f"{{{a.att.tag}:0}}:".encode() + f for f in fields]  # string keys as long as a shard key + field
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
        out: dict[str, Any] = {n: stats(v) for n, v in ms.items()}
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
                redis_s[0] = 0.0
                t = timed(op)
                total.append(1e6 * t / BATCH)
                py.append(1e6 * (t - redis_s[0]) / BATCH - SYSCALL_US["set" if total is sets else "get"])
            be.clear()  # next round rewrites these slots, as SYSCALL_US was measured (no new page-cache pages)
        out["us_per_page_set_4k"] = stats(sets)
        out["us_per_page_get_4k"] = stats(gets)
        out["python_us_per_page_set_4k"] = stats(set_py)
        out["python_us_per_page_get_4k"] = stats(get_py)
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


def count_redis_time(be: TierStoreBackend) -> list[float]:
    """Wrap the backend's index calls to add up the time spent waiting on Redis."""
    acc = [0.0]
    idx = be.store.index
    for name in ("hmget", "scripts"):
        fn = getattr(idx, name)

        def timed_call(*a: Any, _fn: Callable[..., Any] = fn, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t0

        setattr(idx, name, timed_call)
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/tierstore-bench")
    ap.add_argument("--sizes", default="256K,1M,2M,8M")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--probe-repeat", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0, help="seed of the round order")
    ap.add_argument("--out")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=a.dir)
    redis_proc, url = start_redis(work)
    units = {"K": 1 << 10, "M": 1 << 20}
    rng = random.Random(a.seed)
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "threads": a.threads, "batch": BATCH, "repeat": a.repeat, "seed": a.seed, "sizes": {},
        "machine": {"cpus": os.cpu_count(), "dir": a.dir},
    }
    try:
        for spec in a.sizes.split(","):
            size = int(spec[:-1]) * units[spec[-1]]
            p, layers, heads, dim = GEOMETRY[size]
            mha = mha_pool("page_first_direct", page_size=p, layers=layers, heads=heads, head_dim=dim, tokens=BATCH * p)
            mla = mla_pool("page_first", page_size=64, layers=MLA_LAYERS[size], kv_lora_rank=512, rope_dim=64, tokens=BATCH * 64)
            g = torch.Generator().manual_seed(0)
            for pool in (mha, mla):
                raw = pool.kv_buffer.view(-1).view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
            half = mha_pool("page_first_direct", page_size=p, layers=max(1, layers // 2), heads=heads, head_dim=dim, tokens=BATCH * p)
            info: dict[str, dict[str, Any]] = {"ts_v1": {}, "ts_v2": {}, "ts_mla": {}, "ts_steady": {}}
            samples = interleave({
                "disk": disk_rounds(work, size, a.threads, mha),
                "hicache": hicache_rounds(work, mha),
                "ts_v1": tierstore_rounds(work, url, mha, a.threads, False, False, info["ts_v1"]),
                "ts_v2": tierstore_rounds(work, url, mha, a.threads, True, False, info["ts_v2"]),
                "ts_mla": tierstore_rounds(work, url, mla, a.threads, False, True, info["ts_mla"]),
                "ts_v1_nocks": tierstore_rounds(work, url, mha, a.threads, False, False, {}, checksum=False),
                "ts_v1_nocoal": tierstore_rounds(work, url, mha, a.threads, False, False, {}, coalesce=False),
                "ts_steady": steady_rounds(work, url, mha, half, a.threads, info["ts_steady"]),
                "ts_cycle": cycle_rounds(work, url, mha, half, a.threads),
            }, a.repeat, rng)
            row: dict[str, Any] = {"page_bytes": page_bytes(mha)}
            for name, rounds in samples.items():
                nbytes = page_bytes(mla) if name == "ts_mla" else size
                row[name] = {**rates(nbytes, rounds), **info.get(name, {})}
            row["ts_mla"]["page_bytes"] = page_bytes(mla)
            del mha, mla, half
            report["sizes"][spec] = row
            print_row(spec, row)
        measure_syscall(work)
        report["probe"] = bench_probe(work, url, a.probe_repeat)
        print_probe(report["probe"])
    finally:
        redis_proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def med(d: dict[str, Any], key: str) -> float:
    return float(d[key]["median"])


def print_row(spec: str, row: dict[str, Any]) -> None:
    disk_r, disk_w, hf = med(row["disk"], "read_cold_gbps"), med(row["disk"], "write_gbps"), row["hicache"]
    print(f"\n{spec} pages ({row['page_bytes']} B; MLA {row['ts_mla']['page_bytes']} B), batch {BATCH}: GB/s median [p90 p99]")
    for name in ("disk", "hicache", "ts_v1", "ts_v2", "ts_mla", "ts_v1_nocks", "ts_v1_nocoal", "ts_steady", "ts_cycle"):
        r = row[name]
        line = "  ".join(f"{k[:-5]:>10} {med(r, k):6.2f} [{r[k]['p90']:.2f} {r[k]['p99']:.2f}]" for k in ("write_gbps", "read_cold_gbps", "read_warm_gbps"))
        print(f"  {name:<12} {line}")
    v1 = row["ts_v1"]
    print(f"  ts_v1 / disk: write {med(v1, 'write_gbps') / disk_w:.2f}, cold read {med(v1, 'read_cold_gbps') / disk_r:.2f};"
          f"  ts_v1 / hicache: write {med(v1, 'write_gbps') / med(hf, 'write_gbps'):.2f}, cold read "
          f"{med(v1, 'read_cold_gbps') / med(hf, 'read_cold_gbps'):.2f}, warm read {med(v1, 'read_warm_gbps') / med(hf, 'read_warm_gbps'):.2f}")
    nc, gb = row["ts_v1_nocks"], row["page_bytes"] * BATCH / 1e9
    for op, calls, rate, limit in (("write", "COMMIT", "write_gbps", disk_w), ("cold read", "HMGET", "read_cold_gbps", disk_r)):
        rms, secs = v1[op.split()[-1] + "_redis_ms"]["median"], gb / med(v1, rate)
        print(f"  ts_v1 {op} batch: {1e3 * secs:.1f} ms, of which {rms:.1f} ms in Redis ({calls});"
              f" without it / disk: {gb / (secs - rms / 1e3) / limit:.2f}")
    print(f"  diagnostic: ts_v1 without hashing the bytes / disk: write {med(nc, 'write_gbps') / disk_w:.2f},"
          f" cold read {med(nc, 'read_cold_gbps') / disk_r:.2f}")
    co = row["ts_v1_nocoal"]
    print(f"  coalescing adjacent slots: ts_v1 / ts_v1_nocoal: write {med(v1, 'write_gbps') / med(co, 'write_gbps'):.2f},"
          f" cold read {med(v1, 'read_cold_gbps') / med(co, 'read_cold_gbps'):.2f}")
    st = row["ts_steady"]
    ev = st["regions_evicted_per_round"]["median"] if st.get("regions_evicted_per_round") else 0
    print(f"  steady state (store full, {ev:.0f} regions of {st['region_bytes'] >> 20} MiB evicted per round, second page size"
          f" {st['other_page_bytes']} B): ts_steady / ts_v1: write {med(st, 'write_gbps') / med(v1, 'write_gbps'):.2f},"
          f" cold read {med(st, 'read_cold_gbps') / med(v1, 'read_cold_gbps'):.2f}; ts_steady / disk: write"
          f" {med(st, 'write_gbps') / disk_w:.2f}, cold read {med(st, 'read_cold_gbps') / disk_r:.2f}")
    cy = row["ts_cycle"]
    print(f"  what eviction costs, ts_steady / ts_cycle (the same footprint, never evicting): write"
          f" {med(st, 'write_gbps') / med(cy, 'write_gbps'):.2f}, cold read {med(st, 'read_cold_gbps') / med(cy, 'read_cold_gbps'):.2f}")


def print_probe(p: dict[str, Any]) -> None:
    mget = med(p, "mget_128")
    print(f"\nprobe of {BATCH} keys, ms median [p90 p99], ratio to one MGET of the same keys")
    for k in ("mget_128", "hmget_128", "probe_all_hit", "probe_first_missing", "probe_last_missing"):
        print(f"  {k:<20} {med(p, k):.3f} [{p[k]['p90']:.3f} {p[k]['p99']:.3f}]  {med(p, k) / mget:.2f}x")
    sc = p["syscall_us_per_page_4k"]
    print(f"4 KiB pages, us per page median [p90 p99]; python = total - time in Redis calls - one "
          f"pwritev ({sc['set']:.1f} us) / preadv ({sc['get']:.1f} us)")
    for op in ("set", "get"):
        t, py = p[f"us_per_page_{op}_4k"], p[f"python_us_per_page_{op}_4k"]
        print(f"  batch_{op}_v1  total {t['median']:5.1f} [{t['p90']:.1f} {t['p99']:.1f}]   python {py['median']:5.1f} [{py['p90']:.1f} {py['p99']:.1f}]")


if __name__ == "__main__":
    sys.exit(main())
