"""No SGLang call waits for an attach: a probe, read or write that finds no attachment
answers at once (misses; writes refused as ``not_attached``) while housekeeping attaches, and
the fleet's attach lock lapses within ``LOCK_TTL_MS`` of a holder that died or stalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import redis
from tierstore_kit.servers import RedisProc, wait_for
from tierstore_kit.engine import attached, engine, keys
from tierstore_kit.pools import fill, mha_pool, page_indices, storage_config

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.errors import AttachBusy
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.space import attach
from sglang_tierstore.space.library import LIBRARY

CALLS = 1000






def test_calls_answer_at_once_while_another_node_holds_the_attach_lock(tmp_path: Path, redis_proc: RedisProc) -> None:
    """Another node holds the attach lock (for 60 s, as it could mid-attach): a rank starting
    now comes up, and each of 1,000 probes, reads and writes returns within
    ``redis_timeout_s`` (+50 ms), answering misses and refusing writes as ``not_attached``;
    once the lock goes, the rank's housekeeping attaches and the store serves."""
    prefix = "aw-" + uuid.uuid4().hex[:8]
    admin = redis.Redis.from_url(redis_proc.url)
    admin.set(attach.lock_key(prefix), "another-node:1:0", px=60_000)
    cfg = {"path": str(tmp_path / "s"), "redis_url": redis_proc.url, "redis_prefix": prefix, "interface_v1": 1,
           "capacity_gb": 0.05, "redis_timeout_s": 0.5}
    pool = mha_pool("page_first")
    fill(pool, 3)
    ks = keys(4)
    slowest = 0.0
    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        calls: list[Callable[[], Any]] = [lambda: be.batch_exists(ks), lambda: be.batch_get_v1(ks, page_indices(range(8, 12), 4)),
                                          lambda: be.batch_set_v1(ks, page_indices(range(4), 4))]
        for i in range(CALLS):
            t0 = time.monotonic()
            got = calls[i % 3]()
            slowest = max(slowest, time.monotonic() - t0)
            assert got in (0, [False] * 4)
        assert slowest < cfg["redis_timeout_s"] + 0.05, slowest
        assert be.store.stats()["write_not_attached"] == 4 * (CALLS // 3 + (CALLS % 3 > 2))
        admin.delete(attach.lock_key(prefix))
        wait_for(lambda: be.batch_set_v1(ks, page_indices(range(4), 4)) == [True] * 4, 10, "housekeeping attaching")
        assert be.batch_get_v1(ks, page_indices(range(8, 12), 4)) == [True] * 4
    admin.close()


HOLDER = """
import sys, time
from sglang_tierstore.index import RedisIndex
from sglang_tierstore.space import attach
from sglang_tierstore.space.library import LIBRARY
index = RedisIndex(sys.argv[1], 1.0, 1.0)
index.load(LIBRARY)
with attach._index_locked(index, sys.argv[2], "doomed"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_process_killed_holding_the_attach_lock_delays_the_next_attach_by_its_expiry_at_most(
        tmp_path: Path, redis_proc: RedisProc) -> None:
    prefix = "ak-" + uuid.uuid4().hex[:8]
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), redis_proc.url, prefix],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    killed = time.monotonic()
    st = engine({"path": str(tmp_path / "s"), "redis_url": redis_proc.url, "redis_prefix": prefix, "capacity_gb": 0.05})
    try:
        st.start_housekeeping()
        st.namespace({"m": "after"}, 4096)
        wait_for(lambda: attached(st), 2 * attach.LOCK_TTL_MS / 1000, "an attach after the holder's death")
        assert time.monotonic() - killed <= attach.LOCK_TTL_MS / 1000 + 1.0
    finally:
        st.close()


def test_a_stalled_holder_loses_the_lock_and_its_check_stops_it(redis_proc: RedisProc,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder that stops renewing (its process frozen) loses the lock after ``LOCK_TTL_MS``:
    another takes it, and the stalled one's ``still_held`` refuses to go on writing."""
    monkeypatch.setattr(attach, "LOCK_TTL_MS", 300)
    index = RedisIndex(redis_proc.url, 1.0, 1.0)
    index.load(LIBRARY)
    prefix = "as-" + uuid.uuid4().hex[:8]
    try:
        monkeypatch.setattr(attach, "RENEW_S", 0.05)
        with attach._index_locked(index, prefix, "renewing") as lock:
            time.sleep(1.0)  # over three expiries: renewed
            lock.still_held()
        monkeypatch.setattr(attach, "RENEW_S", 60.0)  # a renewer that does not come back in time
        with attach._index_locked(index, prefix, "stalled") as lock:
            wait_for(lambda: index.set_nx(attach.lock_key(prefix), "another", 10_000), 5.0, "the lock lapsing")
            with pytest.raises(AttachBusy, match="lapsed"):
                lock.still_held()
        assert index.get(attach.lock_key(prefix)) == b"another"  # its release took nothing of the other's
    finally:
        index.close()
