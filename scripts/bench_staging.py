#!/usr/bin/env python3
"""What ``read_timeout_s`` costs: the staging copy, per page and per batch read, in one run.

    python3 scripts/bench_staging.py --repeat 11 --out scripts/results/bench_staging.json \
        > scripts/results/bench_staging.txt     (the committed run; about 5 minutes)

With ``read_timeout_s`` > 0 a read goes into the I/O threads' staging memory and is
copied into the host pool (store.py, ``_read_staged``); at 0 it is one zero-copy preadv
into the pool. For each page size (MHA ``page_first_direct`` host pools, as in
bench_io.py; batches of 128 pages, 8 I/O threads) one store is written a new batch per
round, then the batch is read with ``read_timeout_s`` 0 (direct) and 30 (staged: never
reached, so every read pays the copy), in a random order (--seed): the same pages from
the same files, only the read path differs. Each read is timed cold (after fdatasync +
POSIX_FADV_DONTNEED of the store's files) and warm (right after). Two stores per size:

  O_DIRECT  the default: cold and warm reads both come from the device
  buffered  o_direct false: warm reads come from the page cache at memory speed, where an
            extra copy weighs the most

and the copy alone: one thread copying 128 pages from a staging buffer into the pool's
page regions (what an I/O thread does per run), us per page. Figures are medians of
--repeat rounds (p90, p99 too); ratios compare medians of the same run. Starts its own
redis-server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import random
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from tierstore_kit.iobench import BATCH, GEOMETRY, backend, drop_cache, page_nbytes, sgl_key
from tierstore_kit.pools import fill, mha_pool, page_indices
from tierstore_kit.provenance import header, stamp
from tierstore_kit.servers import RedisProc
from tierstore_kit.stats import med, spread, timed

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.hostmem import PagePlan
from sglang_tierstore.store import _scatter

MODES = {"direct": 0.0, "staged": 30.0}  # read path -> read_timeout_s
STORES = {"O_DIRECT": True, "buffered": False}  # -> o_direct


def copy_us_per_page(pool: Any, repeat: int) -> tuple[dict[str, float], int]:
    """(us per page of the staging copy, regions per page) into the pool's own pages."""
    ps = pool.page_size
    plan = PagePlan(lambda i: pool.get_data_page(i, flat=False), ps, int(pool.size) // ps)
    staging = memoryview(mmap.mmap(-1, plan.page_bytes))
    staging[:] = os.urandom(plan.page_bytes)
    pages = [[r] for r in plan.regions([(BATCH + i) * ps for i in range(BATCH)])]

    def copy_batch() -> None:
        for p in pages:
            _scatter(staging, p)

    us = [1e6 * timed(copy_batch) / BATCH for _ in range(max(5, repeat))]
    return spread(us), len(pages[0][0])


def rounds(be: TierStoreBackend, d: str, pool: Any, repeat: int, rng: random.Random) -> dict[str, dict[str, Any]]:
    """GB/s of cold and warm reads of the same batches, each read both ways in turn."""
    ps = pool.page_size
    src, dst = page_indices(list(range(BATCH)), ps), page_indices(list(range(BATCH, 2 * BATCH)), ps)
    ns = be.namespace()
    for _ in range(4):  # every region written once: rounds overwrite, as a store in use does
        assert all(be.batch_set_v1([sgl_key() for _ in range(BATCH)], src))
        be.store.clear([ns])
    gb = page_nbytes(pool) * BATCH / 1e9
    cfg = be.store.cfg
    out: dict[str, dict[str, list[float]]] = {m: {"read_cold_gbps": [], "read_warm_gbps": []} for m in MODES}
    for _ in range(repeat):
        keys = [sgl_key() for _ in range(BATCH)]
        assert all(be.batch_set_v1(keys, src))
        for mode in rng.sample(list(MODES), len(MODES)):
            be.store.cfg = dataclasses.replace(cfg, read_timeout_s=MODES[mode])
            drop_cache(d)
            got: list[Any] = []
            for kind in ("read_cold_gbps", "read_warm_gbps"):
                out[mode][kind].append(gb / timed(lambda: got.append(be.batch_get_v1(keys, dst))))
            assert all(all(x) for x in got), "a read failed during the benchmark"
        be.store.cfg = cfg
        be.store.clear([ns])
    assert "error_io_read_timeout" not in be.store.stats()
    return {m: {k: spread(v) for k, v in r.items()} for m, r in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/tierstore-bench")
    ap.add_argument("--sizes", default="256K,2M,8M")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="seed of the read order")
    ap.add_argument("--out")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=a.dir)
    redis = RedisProc(Path(work))
    url = redis.url
    units = {"K": 1 << 10, "M": 1 << 20}
    report: dict[str, Any] = {"stamp": stamp(directory=a.dir, server_flags=redis.flags()), "threads": a.threads,
                              "batch": BATCH, "repeat": a.repeat, "seed": a.seed, "sizes": {},
                              "machine": {"loadavg_at_start": os.getloadavg()}}
    print(header(report["stamp"]))
    print(f"{os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.1f} (other work on the machine shares them)")
    rng = random.Random(a.seed)
    try:
        for spec in a.sizes.split(","):
            size = int(spec[:-1]) * units[spec[-1]]
            p, layers, heads, dim = GEOMETRY[size]
            pool = mha_pool("page_first_direct", page_size=p, layers=layers, heads=heads, head_dim=dim, tokens=BATCH * p)
            fill(pool, 0)
            row: dict[str, Any] = {"page_bytes": page_nbytes(pool)}
            for store, o_direct in STORES.items():
                d = os.path.join(work, uuid.uuid4().hex[:8])
                with backend(d, url, a.threads, capacity_gb=4 * BATCH * size / (1 << 30), o_direct=o_direct) as be:
                    be.register_mem_pool_host(pool)
                    row[store] = rounds(be, d, pool, a.repeat, rng)
                    row[store]["zero_copy_o_direct"] = o_direct and be.zero_copy()
                shutil.rmtree(d, ignore_errors=True)
            row["copy_us_per_page"], row["regions_per_page"] = copy_us_per_page(pool, a.repeat)
            del pool
            report["sizes"][spec] = row
            print_row(spec, row)
        report["machine"]["loadavg_at_end"] = os.getloadavg()
        print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def print_row(spec: str, row: dict[str, Any]) -> None:
    pb, c = row["page_bytes"], row["copy_us_per_page"]
    print(f"\n{spec} pages ({pb} B, {row['regions_per_page']} regions each), batch {BATCH}: read GB/s median [p90 p99]")
    for store in STORES:
        for mode in MODES:
            r = row[store][mode]
            line = "  ".join(f"{k[5:-5]:>4} {med(r, k):6.2f} [{r[k]['p90']:.2f} {r[k]['p99']:.2f}]"
                             for k in ("read_cold_gbps", "read_warm_gbps"))
            print(f"  {store:<8} {mode:<7} {line}")
    print(f"  copy alone: {c['median']:.1f} us per page [{c['p90']:.1f} {c['p99']:.1f}], "
          f"{pb / c['median'] / 1e3:.1f} GB/s on one thread")
    for store in STORES:
        d, s = row[store]["direct"], row[store]["staged"]
        share = [100 * c["median"] * 1e-6 * med(d, k) * 1e9 / pb for k in ("read_cold_gbps", "read_warm_gbps")]
        print(f"  {store:<8} staged / direct: cold {med(s, 'read_cold_gbps') / med(d, 'read_cold_gbps'):.2f}, warm "
              f"{med(s, 'read_warm_gbps') / med(d, 'read_warm_gbps'):.2f}; the copy on one thread is {share[0]:.0f}% of "
              f"a direct cold read's time, {share[1]:.0f}% of a warm one's")


if __name__ == "__main__":
    sys.exit(main())
