#!/usr/bin/env python3
"""What entry tags (``sglang_tierstore.tags``) cost per batch, next to the batch itself.

    python3 scripts/bench_tags.py --out scripts/results/bench_tags.json > scripts/results/bench_tags.txt
        (the committed run; about a minute)

A write makes one tag per page (on the caller's thread, while the pages are being
written) and a read checks one per page (before its bytes are read). In one run, on an
embedded Redis and page files under ``--dir``: the median time to make and to check
the tags of a batch, and the median time of a whole write and read batch of the same
pages through the store, at 4 KiB pages (where tags weigh most: little I/O per page)
and 256 KiB pages; the tag cost is reported as a share of the batch. Three ways of
computing a tag are timed for the choice in ``mac.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable


from tierstore_kit.engine import engine, pages, views
from tierstore_kit.provenance import header, stamp

from sglang_tierstore.embedded import ensure_embedded_redis, stop_embedded_redis
from sglang_tierstore.perms import PRIVATE
from sglang_tierstore.schema import ENTRY_HEAD, entry_fields
from sglang_tierstore.store import TierStore


def median_s(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def tag_costs(st: TierStore, n: int, reps: int) -> dict[str, float]:
    """Median seconds to make ``n`` entry tails (checksum and tag) and to check ``n`` entries."""
    tags = st.space.attached().tags
    fields = entry_fields(b"\x01" * 8, [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)])
    places = [(7, 3, i, i) for i in range(n)]
    values = [ENTRY_HEAD.pack(7, 3, i) + t for i, t in enumerate(tags.tails(fields, places))]
    make = median_s(lambda: tags.tails(fields, places), reps)
    check = median_s(lambda: [tags.valid(f, v) for f, v in zip(fields, values)], reps)
    assert all(tags.valid(f, v) for f, v in zip(fields, values))
    return {"make_s": make, "check_s": check}


def tag_functions(n: int, reps: int) -> dict[str, float]:
    """Median seconds per tag of three keyed constructions over the same 52-byte messages."""
    key = os.urandom(32)
    msgs = [os.urandom(52) for _ in range(n)]
    keyed = hashlib.blake2b(key=key, digest_size=16)

    def copied(m: bytes) -> bytes:
        h = keyed.copy()
        h.update(m)
        return h.digest()

    ways: dict[str, Callable[[bytes], bytes]] = {
        "blake2b-128, keyed once and copied (used)": copied,
        "blake2b-128, keyed per tag": lambda m: hashlib.blake2b(m, key=key, digest_size=16).digest(),
        "hmac-sha256 truncated to 128 bits": lambda m: hmac.digest(key, m, "sha256")[:16],
    }
    return {name: median_s(lambda f=f: [f(m) for m in msgs], reps) / n for name, f in ways.items()}  # type: ignore[misc]


def batch_costs(st: TierStore, page_bytes: int, n: int, reps: int, seed: int) -> dict[str, float]:
    """Median seconds of a write batch of ``n`` new pages and a read batch of them."""
    ns = st.namespace({"bench": "tags"}, page_bytes)
    src = views(pages(n, page_bytes, seed))
    dst = views([bytearray(page_bytes) for _ in range(n)])
    writes, reads = [], []
    for r in range(reps):
        keys = [hashlib.sha256(f"{page_bytes}/{n}/{seed}/{r}/{i}".encode()).hexdigest() for i in range(n)]
        t0 = time.perf_counter()
        assert st.write(ns, keys, src, False) == [True] * n
        t1 = time.perf_counter()
        assert st.read(ns, keys, dst, False) == [True] * n
        writes.append(t1 - t0)
        reads.append(time.perf_counter() - t1)
        st.delete(ns, keys)
    return {"write_s": statistics.median(writes), "read_s": statistics.median(reads)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/tierstore-bench-tags")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=a.dir)
    url = ensure_embedded_redis(work, PRIVATE, "redis-server").url
    st = engine({"path": work, "redis_url": url, "capacity_gb": 2.0, "io_threads": 8})
    run_stamp = stamp(directory=a.dir, server_flags=["embedded default: unix socket, AOF"])
    rows = []
    try:
        for page_bytes, sizes in ((4096, (16, 128, 1024)), (256 << 10, (16, 128))):
            for n in sizes:
                batch = batch_costs(st, page_bytes, n, a.reps, seed=len(rows))  # first: the first write creates the store
                tags = tag_costs(st, n, a.reps)
                rows.append({"page_bytes": page_bytes, "pages": n, **tags, **batch,
                             "write_share": tags["make_s"] / batch["write_s"], "read_share": tags["check_s"] / batch["read_s"]})
        ways = tag_functions(1024, a.reps)
    finally:
        st.close()
        stop_embedded_redis(work)
        shutil.rmtree(work, ignore_errors=True)
    print(header(run_stamp))
    print(f"entry tags: median of {a.reps} batches each (make: tails of a write batch; check: entries of a read batch)")
    print(f"{'page':>8} {'pages':>6} {'make us':>8} {'write batch ms':>15} {'share':>6} {'check us':>9} {'read batch ms':>14} {'share':>6}")
    for r in rows:
        print(f"{r['page_bytes'] >> 10:>6}Ki {r['pages']:>6} {r['make_s'] * 1e6:>8.0f} {r['write_s'] * 1e3:>15.2f} "
              f"{r['write_share']:>6.1%} {r['check_s'] * 1e6:>9.0f} {r['read_s'] * 1e3:>14.2f} {r['read_share']:>6.1%}")
    print("per tag (1024 tags, median):")
    for name, s in ways.items():
        print(f"  {s * 1e9:7.0f} ns  {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"stamp": run_stamp, "rows": rows,
                       "seconds_per_tag": ways}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
