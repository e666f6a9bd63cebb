"""A first write into a brand-new store, raced by its own process's housekeeping pass
(woken by that very write), stores its pages: a sweep's verdict that the writer's lease
is gone must not undo a newer reply ("no slot for N page(s) ... every region pinned by
writers" with every region but one a hole; the cause of test_e2e_server's intermittent
first prompt without storage hits).

The interleaving (forced here, deterministically):

1. rank B's write: Reservation.__init__ creates the thread's stock (its lease id is now in
   Leases._stocks) right after on_use() woke housekeeping; fill_stock round 1: ``lease``
   answers NEED_FILE with an empty stock (save_lease HDELs the lease: it is not in Redis).
2. B adds a page file (add_file, create, file_ready). Meanwhile rank A writes its first
   batch (its own file, its region), and B's housekeeping pass sends ``sweep`` with B's
   lease id among ``ours``: the lease does not exist in Redis, so the sweep answers it as
   "gone" (missing).
3. fill_stock round 2: B's ``lease`` gets its 15 slots; _answered() sets renewed[0] = sent.
4. Only now does B's housekeeping thread apply the sweep's reply: Leases.renewed() pops
   renewed[0] for the stock "gone" at sweep time, although a newer lease call renewed it.
5. fill_stock returns (round 2 needed no file); take() -> _stock() finds no renewal
   within lease_s / 2, clears the stock: 0 slots, 15 pages "full", none stored.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

from tierstore_kit.engine import keys

from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import Hook, MiB, engine, hooked, housekeep, pages, views

WAIT_S = 30.0


def test_a_first_write_raced_by_its_own_housekeeping_sweep_still_stores(tmp_path: Path, redis_proc: RedisProc) -> None:
    cfg = {"path": str(tmp_path / "store"), "redis_url": redis_proc.url, "redis_prefix": "fw-" + uuid.uuid4().hex[:10],
           "capacity_gb": 0.5, "io_threads": 2}
    hooks_b: dict[str, Hook] = {}
    a = engine(cfg)  # rank 0
    b = engine(cfg, page_files=hooked(hooks_b))  # rank 1
    try:
        ns_a, ns_b = a.namespace({"m": 1, "tp": 0}, 2048), b.namespace({"m": 1, "tp": 1}, 2048)
        att_b = b.space.attached()
        assert att_b.geometry.regions_per_file == 8 and att_b.geometry.region_bytes == 32 * MiB

        # B's housekeeping thread: its sweep runs in Redis now, its reply is applied late
        swept, apply = threading.Event(), threading.Event()
        real_renewed = att_b.leases.renewed

        def late_renewed(*args: Any) -> None:  # (shard, at, gone[, mark])
            swept.set()
            assert apply.wait(WAIT_S)
            real_renewed(*args)

        att_b.leases.renewed = late_renewed  # type: ignore[method-assign]
        hk = threading.Thread(target=housekeep, args=(b, False), daemon=True)

        def create(real: Hook, *args: Any) -> None:  # B's first page file, during fill_stock round 1
            hooks_b.pop("create")
            # rank 0 writes its first batch at the same moment
            assert a.write(ns_a, keys(15, "a"), views(pages(15, 2048, 1)), False) == [True] * 15
            hk.start()
            assert swept.wait(WAIT_S)  # the sweep ran while B's lease is not in Redis
            real(*args)

        hooks_b["create"] = create
        real_answered = att_b.leases._answered
        calls = [0]

        def answered(*args: Any, **kw: Any) -> Any:
            out = real_answered(*args, **kw)
            calls[0] += 1
            if calls[0] == 2 and hk.is_alive():  # round 2's reply is in: now the sweep's is applied
                apply.set()
                hk.join(WAIT_S)
            return out

        att_b.leases._answered = answered  # type: ignore[method-assign]
        stored = b.write(ns_b, keys(15, "b"), views(pages(15, 2048, 2)), False)
        assert calls[0] >= 2 and not hk.is_alive()
        assert stored == [True] * 15, f"rank 1's first write stored {sum(stored)} of 15 pages"
    finally:
        apply.set()
        a.close()
        b.close()
