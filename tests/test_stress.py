"""Faults under load, bounded in time: writers killed mid-batch, Redis killed and restarted
from its AOF under traffic, and a short run of ``scripts/stress.py`` with every fault on."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from tierstore_kit.checkout import load_script
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, housekeep

from sglang_tierstore import TierStore, TierStoreConfig
from sglang_tierstore.tools import inspect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
stress = load_script("stress")

KILLS_MID_BATCH = 100
LEASE_S = 1.0


def test_a_hit_whose_bytes_differ_is_counted_as_a_wrong_page() -> None:
    """The stress workload's check itself: bytes are the key's, and any other bytes on a hit count."""
    assert stress.page_for("k", 100) == stress.page_for("k", 100) != stress.page_for("k2", 100)
    assert stress.page_for("k", 100) != stress.page_for("k", 101)[:100]
    good = bytearray(stress.page_for("k", 100))
    bad = bytearray(good)
    bad[50] ^= 4
    tally = stress.Tally()
    views = [[memoryview(good)], [memoryview(bad)], [memoryview(bad)]]
    hits = stress.verify(tally, 100, ["k", "k", "k"], [True, True, False], views)
    assert hits == 2 and tally.counts["wrong_pages"] == 1


def start_writer(ctx: Any, cfg: dict[str, Any], w: stress.Workload, n: int, report: str) -> tuple[Any, Any]:
    """A writer process (the stress worker, writes only, one thread) and its busy flag."""
    busy = ctx.Array("b", 1, lock=False)
    job = stress.Job(0, n, cfg, cfg["redis_url"], w, 1, n, time.time() + 120, report)
    p = ctx.Process(target=stress.run_worker, args=(job, busy), daemon=True)
    p.start()
    return p, busy


@pytest.mark.slow
def test_writers_killed_mid_batch_never_leave_a_wrong_page(tmp_path: Path, redis_proc: RedisProc,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer process is started and killed with -9 at a random moment of a write batch
    (its busy flag, frozen by the kill, says it was inside ``write``) at least 100 times,
    while another process reads. Every page anyone reads is the key's bytes or a miss; the
    dead writers' committed pages are served; once their leases expire nothing is leased
    and ``check()`` finds every slot right."""
    capacity = 16 * MiB
    cfg = stress.store_config(str(tmp_path / "store"), redis_proc.url, "kill-" + uuid.uuid4().hex[:8], capacity,
                              LEASE_S, 0.5)
    w = stress.Workload.make((4096, 20000), capacity, 1.0, 16, (0, 1, 0, 0, 0))  # writes only
    # Writers are forks of a single-threaded server that has imported the stress module
    # (Python 3.11's forkserver does not take our sys.path, hence PYTHONPATH): a few ms each.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH", "")]))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["stress"])
    later = [0.0]
    reader = TierStore(TierStoreConfig.from_dict(cfg), redis_proc.url, clock=lambda: time.time() + later[0])
    reader.start_housekeeping()
    nss = stress.namespaces(reader, w.sizes)
    keys = {s: stress.keys_for(s, n) for s, n in zip(w.sizes, w.keys_per_size)}
    tally = stress.Tally()
    rnd = random.Random(1)
    pages = stress.Pages(w.max_batch, max(w.sizes))
    kills = mid_batch = 0
    try:
        while mid_batch < KILLS_MID_BATCH:
            assert kills < 3 * KILLS_MID_BATCH, f"only {mid_batch} of {kills} kills landed inside a write"
            p, busy = start_writer(ctx, cfg, w, kills, str(tmp_path / "report.json"))
            deadline = time.monotonic() + 30
            while busy[0] != stress.IN_WRITE:
                assert p.is_alive() and time.monotonic() < deadline, "the writer never started a batch"
                time.sleep(0.001)
            time.sleep(rnd.uniform(0, 0.02) if kills % 4 else rnd.uniform(0.05, 0.2))  # (one in four lives long
            os.kill(p.pid, signal.SIGKILL)  # enough to commit batches however slow a loaded machine makes the first)
            p.join()
            assert p.exitcode == -signal.SIGKILL
            kills += 1
            mid_batch += busy[0] == stress.IN_WRITE  # frozen at the moment of death
            _, size, ks = stress.pick(rnd, w, keys)
            stress.do_get(reader, nss[size], ks, pages, tally, [0], 0)
        reader.space.housekeeping.stop()
        assert inspect.usage(reader)["leases"] > 0  # dead writers' stocks, still leased
        stress.scrub(reader, nss, keys, tally)
        assert tally.counts["wrong_pages"] == 0, tally.wrong
        assert tally.counts["scrub_hits"] > 0 and tally.counts["scrub_hits"] == tally.counts["scrub_present"]
        later[0] += LEASE_S + 1  # every dead writer's lease has expired
        housekeep(reader)
        assert inspect.usage(reader)["leases"] == 0
        assert inspect.check(reader) == []
    finally:
        reader.close()


@pytest.mark.slow
def test_redis_killed_and_restarted_from_its_aof_under_load(extra: dict[str, Any], tmp_path: Path) -> None:
    """Writers and readers run through the SGLang backend while Redis is killed with -9
    and started again from its AOF on the same port: no call raises or hits a bug (every
    error counted is the index being unavailable), no read returns other bytes, and every
    reader has all its pages again within two ``redis_retry_s`` of Redis serving (and a second)."""
    from tierstore_kit.engine import keys
    from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config
    from sglang_tierstore import TierStoreBackend

    retry_s = 1.0
    redis = RedisProc(tmp_path / "redis-aof", appendonly=True, args=("--appendfsync", "always"))
    cfg = {**extra, "redis_url": redis.url, "redis_timeout_s": 0.3, "redis_retry_s": retry_s}
    pool = mha_pool("page_first")  # 128 host pages
    fill(pool, 11)
    ps = pool.page_size
    zero = pool.get_dummy_flat_data_page()
    base = keys(16, "base")  # key i carries host page i
    stop = threading.Event()
    errors: list[str] = []
    wrong: list[str] = []
    calls: dict[int, list[tuple[float, float, bool]]] = {0: [], 1: []}  # reader -> (start, end, all hit)

    def guarded(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # the backend must never raise
            errors.append(f"{type(e).__name__}: {e}")
            return None

    def reader(r: int) -> None:
        ks, dst = base[8 * r : 8 * r + 8], list(range(64 + 8 * r, 72 + 8 * r))
        while not stop.is_set():
            for d in dst:  # a hit must bring the bytes
                pool.set_from_flat_data_page(d * ps, zero)
            t0 = time.monotonic()
            got = guarded(be.batch_get_v1, ks, page_indices(dst, ps))
            calls[r].append((t0, time.monotonic(), got == [True] * 8))
            for i, hit in enumerate(got or []):
                if hit and page_bytes(pool, dst[i]) != page_bytes(pool, 8 * r + i):
                    wrong.append(ks[i])
            time.sleep(0.01)

    def writer(t: int) -> None:
        rnd = random.Random(t)
        while not stop.is_set():
            js = rnd.sample(range(200), 8)
            guarded(be.batch_set_v1, [f"w-{j}" for j in js], page_indices([16 + j % 48 for j in js], ps))
            time.sleep(0.005)

    def first_full_hit(r: int, after: float) -> float:
        return next(end for _, end, ok in calls[r] if end >= after and ok)

    with TierStoreBackend(storage_config(cfg), {}) as be:
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(base, page_indices(list(range(16)), ps)) == [True] * 16
        threads = [threading.Thread(target=reader, args=(r,)) for r in (0, 1)]
        threads += [threading.Thread(target=writer, args=(t,)) for t in (0, 1)]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while not all(any(ok for *_, ok in calls[r]) for r in (0, 1)):
                assert time.monotonic() < deadline, "readers never hit before the kill"
                time.sleep(0.05)
            redis.kill()
            killed = time.monotonic()
            time.sleep(1.5)  # down under load
            redis.start()  # returns once it answers PING: AOF loaded, serving
            up = time.monotonic()
            deadline = up + 20
            while not all(any(end >= up and ok for _, end, ok in calls[r]) for r in (0, 1)):
                assert time.monotonic() < deadline, "readers never hit again after Redis came back"
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join()
            redis.stop()
        assert errors == [] and wrong == []
        for r in (0, 1):
            assert any(t0 >= killed and end <= up and not ok for t0, end, ok in calls[r]), "no read during the outage"
            # two breaker intervals, and a second of slack for a machine the suite's parallel workers keep busy
            assert first_full_hit(r, up) - up <= 2 * retry_s + 1.0
        stats = be.store.stats()
        assert stats["error_index_unavailable"] >= 1
        assert {k for k in stats if k.startswith("error_")} == {"error_index_unavailable"}


@pytest.mark.slow
def test_stress_script_short_run_with_every_fault(tmp_path: Path) -> None:
    """``scripts/stress.py`` end to end, every fault on, reads staged (``read_timeout_s``;
    the committed run reads straight into buffers): it exits 0 and its summary says the
    faults happened, pages were hit and verified, and nothing went wrong."""
    out = tmp_path / "stress.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "stress.py"), "--procs", "2", "--threads", "2", "--seconds", "9",
           "--kill-every", "2", "--redis-every", "3", "--flip-every", "0.3", "--capacity-every", "2", "--lease-s", "2",
           "--read-timeout-s", "10", "--seed", "3", "--path", str(tmp_path / "run"), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["ok"] and not any(s["failures"].values())
    f = s["faults"]
    assert f["worker_kills"] >= 1 and f["redis_kills"] >= 1 and f["bit_flips"] >= 1 and f["capacity_lowered"] >= 1
    assert s["pages"]["hits"] > 0 and s["pages"]["pages_stored"] > 0 and s["evicted_pages"] > 0
    # pages rotten by a flip that nobody read before the scrub are misses there
    assert s["scrub"]["present"] - f["bit_flips"] <= s["scrub"]["verified"] <= s["scrub"]["present"], p.stdout
    assert s["scrub"]["verified"] > 0, p.stdout
    assert "result" in p.stdout and "OK" in p.stdout
