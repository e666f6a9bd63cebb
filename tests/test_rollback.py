"""Deterministic twins of what an asynchronous failover does to the index, without timing:
the index rolled back to an earlier moment (a promoted replica that missed the last writes:
every store key DUMPed at T0 and RESTOREd over what came after, keys created since
removed) and every function call run twice (a reply lost, the call sent again). In both:
0 wrong pages, check() clean after housekeeping, writes go on; a rollback loses only
entries committed after T0 (counted)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Sequence

import pytest
import redis
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import engine, housekeep
from scaleout_kit import Workload, settle_and_check

from sglang_tierstore import TierStore

pytestmark = pytest.mark.slow


def store_on(tmp: Path, r: RedisProc, **kw: Any) -> TierStore:
    """4 MiB of 4 KiB pages: 32 batches of the workload's fill it."""
    return engine({"path": str(tmp / "pages"), "redis_url": r.url, "redis_prefix": "rb" + uuid.uuid4().hex[:8],
                   "capacity_gb": 4 / 1024, "io_threads": 2, **kw})


def store_keys(r: redis.Redis, prefix: str) -> list[bytes]:
    return [k for k in r.scan_iter(match=f"{{{prefix}:*", count=1000)]


def test_an_index_rolled_back_under_traffic_gives_no_wrong_page(tmp_path: Path, private_server: RedisProc) -> None:
    r = redis.Redis.from_url(private_server.url)
    with store_on(tmp_path, private_server) as st:
        ns = st.namespace({"m": "rollback"}, 4096)
        w = Workload(st, ns)
        for _ in range(10):
            w.write()
            housekeep(st)
        before = list(w.keys)
        hits_t0 = w.read(before)
        t0 = {k: r.dump(k) for k in store_keys(r, st.cfg.redis_prefix)}
        for _ in range(30):  # past capacity: regions are evicted and reused, files added
            w.write()
            w.read(w.keys[-64:])
            housekeep(st)
        after = [k for k in w.keys if k not in set(before)]
        with r.pipeline(transaction=True) as p:  # the promoted replica's view: T0, nothing since
            for k in store_keys(r, st.cfg.redis_prefix):
                if k not in t0:
                    p.delete(k)
            for k, v in t0.items():
                p.restore(k, 0, v, replace=True)
            p.execute()
        hits = w.read()
        assert w.tally.wrong == 0 and not w.tally.errors
        lost_after_t0 = sum(h for k, h in zip(w.keys, hits) if k in set(after))
        # entries committed after T0 are gone with the rollback; those of T0 hit unless their
        # slot was reused after T0 (then they are checksum misses, never another page)
        assert lost_after_t0 == 0
        assert sum(hits[: len(before)]) <= sum(hits_t0)
        for _ in range(15):
            w.write()
            housekeep(st)
        assert all(w.read(w.keys[-32:])), "writes after the rollback are stored and read back"
        assert w.tally.wrong == 0 and not w.tally.errors
        assert settle_and_check(st) == []


def test_every_function_call_run_twice_gives_no_wrong_page(tmp_path: Path, private_server: RedisProc) -> None:
    with store_on(tmp_path, private_server) as st:
        real = st.index._send
        replayed = [0]

        def twice(items: Sequence[Any], hold: bool = False) -> list[Any]:
            first = real(items, hold)
            again = [k for k, (_, cmds) in enumerate(items) if cmds[0][0] in ("FCALL", "EVALSHA")]
            if not again:
                return first
            replayed[0] += len(again)
            second = real([items[k] for k in again], hold)  # the first reply was lost: the caller sees the second
            for k, o in zip(again, second):
                first[k] = o
            return first

        st.index._send = twice  # type: ignore[method-assign]
        ns = st.namespace({"m": "replay"}, 4096)
        w = Workload(st, ns)
        for _ in range(50):  # past capacity: eviction, leases, new files all replayed
            w.write()
            w.read(w.keys[-64:])
            housekeep(st)
        assert replayed[0] > 100
        hits = w.read(w.keys[-64:])
        assert sum(hits) > 0 and w.tally.wrong == 0 and not w.tally.errors
        st.index._send = real  # type: ignore[method-assign]
        assert settle_and_check(st) == []
