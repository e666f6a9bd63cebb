"""Writers' stocks under shrinking and across threads and processes; the members a check
repairs. Over plain bytes (no torch, no SGLang)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from tierstore_kit.engine import keys, page_files_bytes
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import Hook, MiB, engine, hooked, housekeep, pages, read, sweep_all, views

from sglang_tierstore import IndexUnavailable
from sglang_tierstore.tools import inspect
from sglang_tierstore.tools.inspect import unlink_members

HANG_S = 30.0


@pytest.fixture
def cfg(tmp_path: Path, redis_proc: RedisProc) -> dict[str, Any]:
    return {"path": str(tmp_path / "d1"), "redis_url": redis_proc.url, "redis_prefix": "ls-" + uuid.uuid4().hex[:10],
            "capacity_gb": 64 * MiB / (1 << 30), "io_threads": 2}


def test_a_shrink_never_takes_slots_a_writer_holds(cfg: dict[str, Any]) -> None:
    """Process A shrinks the store to one region while both processes hold leased slots:
    their regions drain instead of being punched under them. B's next batch (from its
    stock) is not stored, the slots come back (B's by its COMMIT, A's idle stock by A's
    housekeeping), the regions become holes, their space returns, and B writes again."""
    a, b = engine(cfg), engine(cfg)
    try:
        ns_a, ns_b = a.namespace({"m": 1}, MiB), b.namespace({"m": 1}, MiB)
        assert b.write(ns_b, keys(4, "b"), views(pages(4, MiB, 1)), False) == [True] * 4
        assert inspect.usage(b)["leases"] == 1  # its stock
        assert a.write(ns_a, keys(4, "a"), views(pages(4, MiB, 2)), False) == [True] * 4
        a.space.set_capacity(4 * MiB)
        sweep_all(a)
        u = inspect.usage(a)
        assert u["draining_regions"] >= 1 and u["allocated_regions"] - u["draining_regions"] <= 1
        assert inspect.check(a, verify_pages=False) == []
        ok = b.write(ns_b, keys(4, "b2"), views(pages(4, MiB, 3)), False)  # from its stock, in the draining region
        assert ok == [False] * 4
        for st in (a, b, a):
            housekeep(st)
        u = inspect.usage(a)
        assert u["draining_regions"] == 0 and u["allocated_regions"] <= 1 and u["punch_regions"] == 0
        assert page_files_bytes(cfg["path"]) <= 4 * MiB + 2 * 4096  # the header, and an extent-tree block of the sparse file
        # the one region left is held by A's stock: B's write finds every region pinned,
        # which drains it; A, idle, gives its slots back at its next housekeeping
        assert b.write(ns_b, keys(4, "b3"), views(pages(4, MiB, 4)), False) == [False] * 4
        assert inspect.usage(a)["draining_regions"] == 1 and b.stats()["write_full"] == 4
        for st in (a, b):
            housekeep(st)
        src = pages(4, MiB, 5)
        assert b.write(ns_b, keys(4, "b4"), views(src), False) == [True] * 4  # B goes on within the capacity
        assert page_files_bytes(cfg["path"]) <= 4 * MiB + 8192
        ok, got = read(b, ns_b, keys(4, "b4"))
        assert ok == [True] * 4 and got == src
        assert inspect.check(a) == []
    finally:
        a.close()
        b.close()


def test_an_idle_writers_slots_in_a_draining_region_come_back(cfg: dict[str, Any]) -> None:
    """A writer that does not write again gives its slots in a draining region back at the
    next housekeeping of its process (it is idle: nobody is in the middle of a batch)."""
    st = engine(cfg)
    try:
        ns = st.namespace({"m": 1}, MiB)
        assert st.write(ns, keys(4), views(pages(4, MiB, 5)), False) == [True] * 4
        st.space.set_capacity(4 * MiB)
        sweep_all(st)
        drained = st.stats().get("stocks_tidied", 0)
        st.space.set_capacity(0)  # even the region holding its stock must go
        sweep_all(st)  # which drains it, and the writer (idle: nobody is writing) gives its slots back
        assert st.stats()["stocks_tidied"] > drained
        housekeep(st)  # the hole's space is punched out
        u = inspect.usage(st)
        assert u["draining_regions"] == 0 and u["allocated_regions"] == 0 and u["punch_regions"] == 0
        assert page_files_bytes(cfg["path"]) <= 4096
        assert inspect.check(st) == []
    finally:
        st.close()


def test_holes_in_a_directory_only_another_process_has_are_punched_by_it(cfg: dict[str, Any], tmp_path: Path) -> None:
    d1, d2 = cfg["path"], str(tmp_path / "d2")
    a = engine(cfg, path=[d1, d2])
    b = engine(cfg, path=[d1])  # the same store, without d2
    try:
        ns = a.namespace({"m": 1}, MiB)
        for j in range(4):
            assert all(a.write(ns, keys(16, f"x{j}"), views(pages(16, MiB, j)), False))
        assert page_files_bytes(d2) > 16 * MiB
        b.space.set_capacity(16 * MiB)
        sweep_all(b)
        assert b.stats().get("error_punch", 0) == 0  # b does not even try d2's holes
        assert inspect.usage(a)["punch_regions"] > 0
        sweep_all(a)
        sweep_all(a)  # and what its own stock gave back meanwhile
        u = inspect.usage(a)
        assert u["punch_regions"] == 0 and u["allocated_regions"] <= 4
        assert page_files_bytes(d1) + page_files_bytes(d2) <= 16 * MiB + u["files"] * 8192  # regions + header, extent blocks
        assert inspect.check(a) == []
    finally:
        a.close()
        b.close()


def test_every_process_keeps_free_regions_for_the_stores_capacity(cfg: dict[str, Any]) -> None:
    """B started with 64 MiB; A lowers the capacity: B's housekeeping keeps free_target of
    the new capacity free, not of its own start-up value (which would empty the store)."""
    a, b = engine(cfg, free_target=0.25), engine(cfg, free_target=0.25)
    try:
        ns = a.namespace({"m": 1}, MiB)
        assert all(a.write(ns, keys(64), views(pages(64, MiB, 6)), False))
        a.space.set_capacity(16 * MiB)  # 4 regions of 4 MiB: one is kept free
        sweep_all(a)
        fresh = keys(8, "new")
        assert a.write(ns, fresh, views(pages(8, MiB, 7)), False) == [True] * 8
        sweep_all(a)
        sweep_all(b)
        u = inspect.usage(a)
        assert u["free_regions"] == 1 and u["used_regions"] >= 2
        assert a.exists([(ns, fresh)]) == [[True] * 8]
        assert inspect.check(a) == []
    finally:
        a.close()
        b.close()


def test_a_writer_never_waits_for_housekeeping_giving_its_stock_back(cfg: dict[str, Any],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Housekeeping gives an idle writer's stock back (a Redis round trip, holding that
    stock) just as the writer writes again: the write goes on under a new lease instead of
    waiting, and the stock it left is given back at the next tidy."""
    st = engine(cfg)
    try:
        ns = st.namespace({"m": "no-wait"}, 64 << 10)
        assert all(st.write(ns, keys(4, "a"), views(pages(4, 64 << 10, 1)), False))
        a = st.space.attached()
        in_release, go_on = threading.Event(), threading.Event()
        real_calls = st.index.calls

        def slow_release(calls: Any) -> Any:
            if calls and calls[0][0] == "release" and not go_on.is_set():
                in_release.set()
                go_on.wait(10)
            return real_calls(calls)

        monkeypatch.setattr(st.index, "calls", slow_release)
        tidy = threading.Thread(target=a.leases.tidy, args=(False, True))  # the process idle: stocks go back
        tidy.start()
        try:
            assert in_release.wait(10)
            assert all(st.write(ns, keys(4, "b"), views(pages(4, 64 << 10, 2)), False))
            assert tidy.is_alive()  # written while the release still hung (a writer waiting for it would come after)
        finally:
            go_on.set()
            tidy.join(30)
        assert a.leases.tidy(False) == 1  # the stock it left, given back
        assert st.exists([(ns, keys(4, "a") + keys(4, "b"))]) == [[True] * 8]
        assert inspect.check(st) == []
    finally:
        st.close()


def test_stocks_of_threads_that_exited_are_given_back(cfg: dict[str, Any]) -> None:
    st = engine(cfg, lease_s=1.0)
    try:
        ns = st.namespace({"m": 1}, MiB)

        def one(i: int) -> None:
            assert st.write(ns, keys(3, f"t{i}"), views(pages(3, MiB, i)), False) == [True] * 3

        for i in range(6):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            t.join()
        assert inspect.usage(st)["leases"] >= 2  # stocks ahead of need, as far as the store lets them pin
        housekeep(st)
        assert inspect.usage(st)["leases"] == 0
        assert all(d["leased"] == 0 for d in inspect.page_sizes(st).values())
        assert inspect.check(st) == []
    finally:
        st.close()


def test_stocks_never_pin_more_than_a_quarter_of_a_small_store(cfg: dict[str, Any]) -> None:
    """Twenty-four writer threads of 256 KiB pages keep a stock (a batch's worth) after
    their batch, in a store of sixteen 4 MiB regions: unbounded, their stocks would pin
    twelve regions (and a few more writers would find none left to evict). Stocks topped
    up ahead of need stop once a quarter of the regions hold leased slots; every batch is
    still stored."""
    st = engine(cfg, lease_s=60.0)
    try:
        pb = 256 * 1024
        ns = st.namespace({"m": 1}, pb)
        go = threading.Event()
        done = threading.Barrier(25)
        stored: list[list[bool]] = []

        def writer(i: int) -> None:
            try:
                stored.append(st.write(ns, keys(4, f"w{i}"), views(pages(4, pb, i)), False))
            finally:
                done.wait(30)
            go.wait(30)  # the thread lives on, holding its stock

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        done.wait(30)
        assert stored == [[True] * 4] * 24
        u = inspect.usage(st)
        assert u["files"] <= 3  # writers that found the store full at once added a file, not one each
        assert u["capacity_regions"] == 16 and u["leases"] >= 1
        assert 1 <= u["pinned_regions"] <= 16 // 4 + 1  # the bound, and the region one top-up opens
        assert inspect.check(st) == []
        go.set()
        for t in threads:
            t.join()
        housekeep(st)
        assert inspect.usage(st)["pinned_regions"] == 0 and inspect.check(st) == []
    finally:
        st.close()


def test_a_member_unlinked_twice_in_one_call_counts_once(cfg: dict[str, Any]) -> None:
    st = engine(cfg)
    try:
        ns = st.namespace({"m": 1}, 4096)
        ks = keys(4)
        assert st.write(ns, ks, views(pages(4, 4096, 9)), False) == [True] * 4
        a = st.space.attached()
        where = inspect.where(st, ns, ks[0])
        assert where is not None
        region = where[2]
        field = ns.ns_id + bytes.fromhex(ks[0])[:24]
        st.index.hdel(a.key(0, "entries"), field)  # its entry vanished (as if unparsable and dropped)
        slot = 0
        assert unlink_members(st, a, 0, [(region, slot, field), (region, slot, field)]) == 1
        ok, _ = read(st, ns, ks[1:])
        assert ok == [True] * 3
        assert inspect.check(st) == []
    finally:
        st.close()


def test_stock_ranges_survive_an_index_hiccup_after_io(cfg: dict[str, Any], private_redis: RedisProc) -> None:
    """A COMMIT that fails (index down) leaves the written slots in the lease: the next
    COMMIT returns them, so nothing leaks and the store fills up normally afterwards."""
    later = [0.0]
    st = engine(cfg, redis_url=private_redis.url, redis_timeout_s=0.3, redis_retry_s=0.2,
                clock=lambda: time.time() + later[0])
    try:
        ns = st.namespace({"m": 1}, MiB)
        assert st.write(ns, keys(4, "a"), views(pages(4, MiB, 10)), False) == [True] * 4
        private_redis.kill()
        with pytest.raises(IndexUnavailable):
            st.write(ns, keys(4, "b"), views(pages(4, MiB, 11)), False)
        private_redis.start()  # empty: the store attaches anew
        later[0] += 1.0  # past the breaker's redis_retry_s
        assert st.write(ns, keys(4, "c"), views(pages(4, MiB, 12)), False) == [False] * 4  # the store is gone...
        housekeep(st)  # ...and made anew by housekeeping
        assert st.write(ns, keys(4, "c"), views(pages(4, MiB, 12)), False) == [True] * 4
        for j in range(20):  # past capacity
            assert all(st.write(ns, keys(4, f"d{j}"), views(pages(4, MiB, j)), False))
            housekeep(st)
        assert inspect.check(st) == []
    finally:
        st.close()


def test_a_stalled_writer_never_clobbers_slots_its_expired_lease_held(cfg: dict[str, Any]) -> None:
    """A process neither writes nor runs housekeeping for longer than lease_s (stalled);
    another expires its lease and writes. When the stalled one writes again, its old stock
    is not trusted: every page of both reads back, and check() finds every slot right."""
    later = [0.0]
    clock = lambda: time.time() + later[0]  # noqa: E731
    a, b = engine(cfg, lease_s=10, clock=clock), engine(cfg, lease_s=10, clock=clock)
    try:
        ns_a, ns_b = a.namespace({"m": 1}, 12288), b.namespace({"m": 1}, 12288)
        assert a.write(ns_a, keys(4, "a"), views(pages(4, 12288, 20)), False) == [True] * 4
        assert inspect.usage(a)["leases"] == 1  # its stock
        later[0] += 12  # a stalls past its lease; b's housekeeping expires it
        housekeep(b)
        src_b = pages(8, 12288, 21)
        assert b.write(ns_b, keys(8, "b"), views(src_b), False) == [True] * 8
        src_a = pages(4, 12288, 22)
        assert a.write(ns_a, keys(4, "a2"), views(src_a), False) == [True] * 4
        ok, got = read(b, ns_b, keys(8, "b"))
        assert ok == [True] * 8 and got == src_b
        ok, got = read(a, ns_a, keys(4, "a2"))
        assert ok == [True] * 4 and got == src_a
        assert inspect.check(a) == []
    finally:
        a.close()
        b.close()


def test_housekeeping_never_waits_for_a_writer_whose_lease_expired(cfg: dict[str, Any]) -> None:
    """A writer is stuck inside a pwritev (holding its stock for the batch) past its lease,
    which another process expires. This process's next housekeeping pass sees the lease
    gone and finishes all the same, while the writer is still stuck: nothing it does waits
    on a disk. The writer's batch then stores nothing, and every slot is accounted for."""
    later = [0.0]
    clock = lambda: time.time() + later[0]  # noqa: E731
    inside, go_on = threading.Event(), threading.Event()
    hooks: dict[str, Hook] = {}
    a = engine(cfg, lease_s=10, clock=clock, page_files=hooked(hooks))
    b = engine(cfg, lease_s=10, clock=clock)
    try:
        ns = a.namespace({"m": 1}, 4096)
        assert a.write(ns, keys(4, "a"), views(pages(4, 4096, 1)), False) == [True] * 4

        def stuck(real: Hook, *args: Any) -> None:
            inside.set()
            assert go_on.wait(HANG_S)
            real(*args)

        hooks["write"] = stuck
        result: list[list[bool]] = []
        writer = threading.Thread(target=lambda: result.append(a.write(ns, keys(4, "stuck"), views(pages(4, 4096, 2)), False)))
        writer.start()
        assert inside.wait(HANG_S)
        later[0] += 11  # past a's lease, which b's housekeeping expires
        housekeep(b)
        hk = threading.Thread(target=housekeep, args=(a,))
        hk.start()
        hk.join(HANG_S)
        assert not hk.is_alive(), "housekeeping waited for the stuck writer"
        go_on.set()
        writer.join(HANG_S)
        assert result == [[False] * 4]  # its lease was gone: nothing stored
        del hooks["write"]
        assert a.write(ns, keys(4, "after"), views(pages(4, 4096, 3)), False) == [True] * 4
        assert inspect.check(a) == []
    finally:
        go_on.set()
        a.close()
        b.close()


def test_an_idle_store_costs_redis_next_to_nothing_whatever_housekeeping_s(cfg: dict[str, Any],
                                                                           redis_proc: RedisProc) -> None:
    """At the fastest ``housekeeping_s`` allowed, the passes of a store nobody reads or
    writes come four times further apart each time, up to ``idle_max_s`` (5 s while it holds
    a lease to renew), each costing Redis one sweep call per shard; a write brings the short
    wait back and wakes a thread that was waiting long."""
    from monitor import Monitor

    st = engine(cfg, housekeeping_s=0.05, index_shards=2)
    hk = st.space.housekeeping
    try:
        ns = st.namespace({"m": "idle"}, 64 << 10)
        assert all(st.write(ns, keys(4, "idle"), views(pages(4, 64 << 10, 1)), False))
        assert hk.run_once()  # the write's pass
        waits, wait = [], 0.05
        for _ in range(5):
            wait = hk.next_wait(hk.run_once(audit=False), wait)
            waits.append(wait)
        assert waits == [0.2, 0.8, 3.2, 5.0, 5.0]  # where one pass per 50 ms would be 100 passes in 5 s
        mon = Monitor(redis_proc.port)
        assert not hk.run_once(audit=False)
        assert mon.commands() == {"FCALL": 2}  # one sweep per shard (what the sweeps run inside not counted)
        assert all(st.write(ns, keys(4, "woken"), views(pages(4, 64 << 10, 2)), False))
        assert hk._wake.is_set()  # the waiting thread runs its next pass now...
        assert hk.next_wait(hk.run_once(audit=False), wait) == 0.05  # ...and the next comes soon after
    finally:
        st.close()


def test_an_idle_process_gives_its_leases_back_and_then_wakes_once_a_lease_s(cfg: dict[str, Any], redis_proc: RedisProc,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes on an injected clock: nothing read or written, a writer keeps its stock (and
    housekeeping its 5 s cap, to renew it) until the process has been idle for IDLE_MAX_S,
    and never while it is writing; then the stock goes back to the regions (free, not
    left to expire dead), the cap becomes lease_s and the audit waits as long. A release
    whose call fails leaves the writer no slot to take (the index may have given them
    away) and is tried again. The next write leases anew; its activity brings the short
    waits back."""
    from sglang_tierstore.space.housekeeping import IDLE_MAX_S

    later = [0.0]
    st = engine(cfg, lease_s=60, clock=lambda: time.time() + later[0])
    try:
        ns = st.namespace({"m": "idle-release"}, 64 << 10)
        assert all(st.write(ns, keys(4, "before"), views(pages(4, 64 << 10, 1)), False))
        hk, a = st.space.housekeeping, st.space.attached()
        audits = []
        real_audit = a.files.audit
        monkeypatch.setattr(a.files, "audit", lambda *x: audits.append(later[0]) or real_audit(*x))
        before = inspect.page_sizes(st)[64 << 10]
        assert before["leased"] > 0  # the writer's stock
        hk.run_once()  # the write's pass: busy, audits
        assert hk.idle_max_s == IDLE_MAX_S and a.leases.holding() and audits == [0.0]
        hk.run_once()  # the first idle pass: idle from now, the stock kept
        later[0] += IDLE_MAX_S
        with a.leases.writing():  # idle long enough, but this thread is mid-write: its stock stays
            t = threading.Thread(target=hk.run_once)
            t.start()
            t.join()
        assert a.leases.holding() and a.leases.stocked(0, 64 << 10) > 0 and hk.idle_max_s == IDLE_MAX_S

        real_calls = st.index.calls

        def release_fails(calls: Any) -> Any:
            if calls and calls[0][0] == "release":
                raise IndexUnavailable("test: the release's node failed")
            return real_calls(calls)

        monkeypatch.setattr(st.index, "calls", release_fails)
        hk.run_once()
        assert a.leases.stocked(0, 64 << 10) == 0 and a.leases.holding()  # nothing to take; to be released again
        monkeypatch.setattr(st.index, "calls", real_calls)
        hk.run_once()  # released now
        assert not a.leases.holding() and hk.idle_max_s == 60 == hk.idle_audit_s
        after = inspect.page_sizes(st)[64 << 10]
        assert after["leased"] == 0 and after["dead"] == before["dead"]  # given back, not left to expire dead
        assert audits == [0.0]  # idle: none since the busy pass
        later[0] += 60
        hk.run_once()
        assert audits == [0.0, later[0]]  # once a lease_s
        assert inspect.check(st) == []
        assert all(st.write(ns, keys(4, "after"), views(pages(4, 64 << 10, 2)), False))
        assert a.leases.holding()
        assert st.read(ns, keys(4, "after"), views(pages(4, 64 << 10, 0)), False) == [True] * 4
        hk.run_once()  # activity: busy again
        assert hk.idle_max_s == IDLE_MAX_S and a.leases.holding()
    finally:
        st.close()


def test_a_full_small_store_keeps_a_free_region_so_each_write_is_one_round_trip(cfg: dict[str, Any],
                                                                                 redis_proc: RedisProc) -> None:
    """16 regions (2% of them is none): once full, housekeeping still keeps one region
    free, so the commit that fills the open region restocks from it and every batch of a
    steady writer is one function call."""
    from monitor import Monitor

    small = {**cfg, "capacity_gb": 1 * MiB / (1 << 30)}  # sixteen 64 KiB regions
    st = engine(small)
    try:
        ns = st.namespace({"m": "small"}, 16 << 10)  # 4 pages per region
        data = pages(2, 16 << 10, 1)
        for i in range(40):  # full, and evicting
            assert st.write(ns, keys(2, f"warm{i}"), views(data), False) == [True] * 2
            housekeep(st)
        calls = []
        for i in range(24):  # six regions filled
            mon = Monitor(redis_proc.port)
            assert st.write(ns, keys(2, f"steady{i}"), views(data), False) == [True] * 2
            calls.append(mon.commands()["FCALL"])
            housekeep(st)
        assert calls == [1] * len(calls), calls
        assert inspect.usage(st)["free_regions"] >= 1
    finally:
        st.close()
