"""What the page-I/O benchmarks (bench_io.py, bench_staging.py) share: the batch and the page
geometries they measure, SGLang-like keys, a backend over a host pool, and flushing written
pages out of every cache before reads are timed."""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any

from sglang_tierstore import TierStoreBackend
from tierstore_kit.pools import storage_config

BATCH = 128
# page bytes -> MHA geometry (tokens per page, layers, KV heads, head dim), bf16, K and V
GEOMETRY = {
    64 << 10: (4, 8, 8, 64),  # the smoke runs' size: the same code, a quarter of the bytes
    256 << 10: (16, 8, 8, 64),
    1 << 20: (64, 8, 8, 64),
    2 << 20: (64, 16, 8, 64),
    8 << 20: (64, 32, 8, 128),  # 64 tokens of Llama-3-8B
}


def sgl_key() -> str:
    """A page key as SGLang makes them: 64 hex digits of a SHA-256 chain."""
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


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




def backend(path: str, redis_url: str, threads: int, mla: bool = False, model: str = "bench", **extra: Any) -> TierStoreBackend:
    cfg = {"redis_url": redis_url, "redis_prefix": "bench-" + uuid.uuid4().hex[:8], "path": path,
           "capacity_gb": 64, "io_threads": threads, "interface_v1": 1, **extra}
    return TierStoreBackend(storage_config(cfg, mla=mla, model=model), {})


def page_nbytes(pool: Any) -> int:
    return int(pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize)
