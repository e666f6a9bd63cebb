#!/usr/bin/env python3
"""Redis memory the index costs per committed page, and per TB of pages.

    python3 scripts/index_memory.py --pages 100000 --out scripts/results/index_memory.json \
        > scripts/results/index_memory.txt     (the committed run; about a minute)

Starts a private redis-server, attaches a store and writes ``--pages`` pages through
the engine's real write path (4 KiB pages in batches of 128, so no page is evicted),
then reads ``used_memory`` (INFO memory) before and after. Everything the store keeps
per page is in the difference: the entry (hash field: namespace + key, 32 bytes;
value: region, generation, slot, checksum, tag, 36 bytes), the region's member list
(32 bytes per slot), region records and recency. Two namespaces share the store, as
two models would. Per TB figures scale the per-page cost by the pages a TB holds at
each page size (region records add under 0.1 byte per page at 64 MiB regions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


from tierstore_kit.engine import engine
from tierstore_kit.provenance import header, stamp

from sglang_tierstore.tools import inspect

TB = 1 << 40


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--dir", default="/var/tmp/tierstore-memory")
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--out")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=a.dir)
    sock = os.path.join(work, "redis.sock")
    flags = ["--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no"]
    s = stamp(directory=a.dir, server_flags=[a.redis_server, *flags])
    proc = subprocess.Popen([a.redis_server, *flags, "--dir", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        version = subprocess.run([a.redis_server, "--version"], capture_output=True, text=True).stdout.strip()
        page = 4096
        st = engine({"path": os.path.join(work, "pages"), "redis_url": f"unix://{sock}", "redis_prefix": "tierstore",
                     "capacity_gb": max(1.0, 2 * a.pages * page / (1 << 30)), "o_direct": False})
        namespaces = [st.namespace({"model": m}, page) for m in ("a", "b")]
        buf = [memoryview(bytearray(os.urandom(page)))]
        st.space.attached().flush_touches()
        before = st.index.memory_used()
        t0 = time.monotonic()
        for i in range(0, a.pages, 128):
            n = min(128, a.pages - i)
            keys = [hashlib.sha256(f"{i + j}".encode()).hexdigest() for j in range(n)]
            ns = namespaces[(i // 128) % 2]
            assert st.write(ns, keys, [buf] * n, False) == [True] * n
        took = time.monotonic() - t0
        u = inspect.usage(st)
        after = st.index.memory_used()
        assert u["pages"] == a.pages, u
        per_page = (after - before) / a.pages
        st.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    per_tb = {name: per_page * TB / size for name, size in (("256 KiB", 256 << 10), ("2 MiB", 2 << 20), ("8 MiB", 8 << 20))}
    report = {"stamp": s, "redis": version, "pages": a.pages,
              "page_bytes": page, "used_memory_before": before, "used_memory_after": after,
              "bytes_per_page": per_page, "index_bytes_per_tb_of_pages": per_tb, "write_seconds": took}
    print(header(s))
    print(f"{version}")
    print(f"{a.pages} pages committed in {took:.1f} s: used_memory {before} -> {after} bytes")
    print(f"index memory per committed page: {per_page:.1f} bytes (target: at most 200)")
    print("Redis memory per TB of pages (pages per TB x bytes per page):")
    for name, v in per_tb.items():
        print(f"  {name:>8} pages: {v / (1 << 30):6.2f} GiB per TB  ({TB // {'256 KiB': 256 << 10, '2 MiB': 2 << 20, '8 MiB': 8 << 20}[name]} pages)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
