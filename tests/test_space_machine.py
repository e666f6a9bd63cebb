"""A Hypothesis state machine of the space layer and the index against a plain Python model.

Three page sizes (one not 4 KiB aligned) share a 1 MiB store (16 regions of 64 KiB)
through several processes, some of which die between reserving slots, writing them and
committing. After every step: ``check()`` finds every slot in exactly one state and
the page bytes verified, and allocation is within capacity; every hit of a read or a
probe is a key the model holds (acknowledged and not cleared since), with the bytes the
model holds for it. A key the model holds may be a miss (evicted).
"""

from __future__ import annotations

from collections import Counter
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import bury, engine, views
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang_tierstore import TierStore
from sglang_tierstore.tools import inspect
from sglang_tierstore.schema import entry_fields
from sglang_tierstore.store import Namespace
from sglang_tierstore.space.reservation import Reservation

KiB = 1 << 10
PAGE_SIZES = [4 * KiB, 12 * KiB, 20000]
KEYS = keys(40, "m")
LEASE_S = 10.0


def page_bytes_for(ns: int, key: int, size: int) -> bytearray:
    """A page's bytes are a function of (namespace, key): every writer writes the same."""
    seed = (ns * 1000 + key).to_bytes(4, "little")
    return bytearray((seed * (size // 4 + 1))[:size])


class AllocatorMachine(RuleBasedStateMachine):
    shards = 1

    def __init__(self) -> None:
        super().__init__()
        self.now = time.time()
        self.capacity = 1 << 20
        self.procs: list[TierStore] = []
        self.dead: list[TierStore] = []
        self.model: dict[tuple[int, int], bytes] = {}  # acknowledged and not cleared since

    @initialize()
    def start(self) -> None:
        tmp = Path(TMP) / uuid.uuid4().hex[:8]
        self.cfg = {"path": str(tmp), "redis_url": REDIS.url, "redis_prefix": "sm-" + uuid.uuid4().hex[:8],
                    "capacity_gb": self.capacity / (1 << 30), "io_threads": 2, "lease_s": LEASE_S,
                    "index_shards": self.shards, "free_target": 0.1}
        self.spawn()
        for n in range(len(PAGE_SIZES)):  # the store is created for its pages
            self.ns(self.procs[0], n)

    def clock(self) -> float:
        return self.now

    def spawn(self) -> None:
        """A process starting now, with the store's first capacity_gb (it keeps the store's
        capacity, whatever it was given)."""
        p = engine(self.cfg, clock=self.clock)
        self.procs.append(p)

    def ns(self, p: TierStore, i: int) -> Namespace:
        return p.namespace({"model": f"m{i}"}, PAGE_SIZES[i])

    @rule()
    @precondition(lambda self: len(self.procs) < 3)
    def another_process(self) -> None:
        self.spawn()

    @rule(p=st.integers(0, 2), n=st.integers(0, 2), start=st.integers(0, len(KEYS) - 1), length=st.integers(1, 16))
    def write_prefix(self, p: int, n: int, start: int, length: int) -> None:
        """Consecutive keys in one batch, as a write-through backup of a prefix."""
        self.write(p, n, [(start + i) % len(KEYS) for i in range(length)])

    @rule(p=st.integers(0, 2), n=st.integers(0, 2), ks=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=8))
    def write(self, p: int, n: int, ks: list[int]) -> None:
        proc = self.procs[p % len(self.procs)]
        ns = self.ns(proc, n)
        bufs = [page_bytes_for(n, k, ns.page_bytes) for k in ks]
        ok = proc.write(ns, [KEYS[k] for k in ks], views(bufs), False)
        for k, good in zip(ks, ok):
            if good:
                self.model[(n, k)] = bytes(page_bytes_for(n, k, ns.page_bytes))

    @rule(p=st.integers(0, 2), data=st.data())
    @precondition(lambda self: bool(self.model))
    def read_held(self, p: int, data: st.DataObject) -> None:
        """Read keys the model holds (they may have been evicted since: a miss is fine)."""
        held = sorted(self.model)
        n = data.draw(st.sampled_from(sorted({k[0] for k in held})))
        ks = data.draw(st.lists(st.sampled_from([k for ns, k in held if ns == n]), min_size=1, max_size=16))
        self.read(p, n, ks)

    @rule(p=st.integers(0, 2), n=st.integers(0, 2), ks=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=8))
    def read(self, p: int, n: int, ks: list[int]) -> None:
        proc = self.procs[p % len(self.procs)]
        ns = self.ns(proc, n)
        out = [bytearray(ns.page_bytes) for _ in ks]
        ok = proc.read(ns, [KEYS[k] for k in ks], views(out), False)
        for k, good, got in zip(ks, ok, out):
            if good:
                assert (n, k) in self.model, f"hit for a key the model does not hold: {(n, k)}"
                assert bytes(got) == self.model[(n, k)], f"wrong bytes for {(n, k)}"

    @rule(p=st.integers(0, 2), n=st.integers(0, 2))
    def probe(self, p: int, n: int) -> None:
        proc = self.procs[p % len(self.procs)]
        (present,) = proc.exists([(self.ns(proc, n), KEYS)])
        for k, there in enumerate(present):
            if there:
                assert (n, k) in self.model, f"probe hit for a key the model does not hold: {(n, k)}"

    @rule(p=st.integers(0, 2), n=st.integers(0, 2), ks=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=6),
          write=st.booleans())
    @precondition(lambda self: len(self.procs) > 1)
    def crash(self, p: int, n: int, ks: list[int], write: bool) -> None:
        """A process reserves slots, maybe writes junk into them, and dies before its commit."""
        proc = self.procs.pop(p % len(self.procs))
        ns = self.ns(proc, n)
        a = proc.space.attached()
        with Reservation(a, ns.page_bytes, entry_fields(ns.ns_id, [KEYS[k] for k in ks]), Counter()) as res:
            for place in res.places:
                if write:
                    a.pages.write(place.file, place.offset, [memoryview(b"\xee" * ns.page_bytes)], ns.page_bytes, False)
        self.dead.append(proc)  # no commit, no close(): its lease stays until it expires

    @rule(dt=st.sampled_from([1.0, LEASE_S + 1]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(p=st.integers(0, 2))
    def housekeeping(self, p: int) -> None:
        self.procs[p % len(self.procs)].space.housekeeping.run_once(audit=True)

    @rule(p=st.integers(0, 2), n=st.integers(0, 2))
    def clear(self, p: int, n: int) -> None:
        proc = self.procs[p % len(self.procs)]
        proc.clear([self.ns(proc, n)])
        self.model = {k: v for k, v in self.model.items() if k[0] != n}

    @rule(p=st.integers(0, 2), mib=st.sampled_from([0.5, 0.75, 1.0, 1.5]))
    def set_capacity(self, p: int, mib: float) -> None:
        proc = self.procs[p % len(self.procs)]
        self.capacity = int(mib * (1 << 20))
        proc.space.set_capacity(self.capacity)
        proc.space.housekeeping.run_once(audit=False)

    @invariant()
    def consistent(self) -> None:
        if not self.procs:
            return
        proc = self.procs[0]
        assert inspect.check(proc) == []
        u = inspect.usage(proc)
        # regions still holding slots leased to a writer drain out when it gives them back
        assert u["allocated_bytes"] - u["draining_regions"] * u["region_bytes"] <= self.capacity

    def teardown(self) -> None:
        for p in self.procs:
            p.close()
        for p in self.dead:
            bury(p)


class ShardedMachine(AllocatorMachine):
    shards = 2


TMP = ""
REDIS: Any = None


@pytest.fixture(autouse=True)
def _machine_env(tmp_path: Path, redis_proc: RedisProc) -> None:
    global TMP, REDIS
    TMP, REDIS = str(tmp_path), redis_proc


MACHINE_SETTINGS = settings(max_examples=int(os.environ.get("TS_MACHINE_EXAMPLES", "50")), stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_space_against_a_model() -> None:
    AllocatorMachine.TestCase.settings = MACHINE_SETTINGS
    AllocatorMachine.TestCase().runTest()


def test_sharded_space_against_a_model() -> None:
    ShardedMachine.TestCase.settings = MACHINE_SETTINGS
    ShardedMachine.TestCase().runTest()
