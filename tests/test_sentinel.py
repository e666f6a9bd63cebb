"""The index on a Sentinel group started by the test (a primary, 2 replicas, 3 sentinels,
``down-after-milliseconds 500``): a demoted primary's READONLY makes the connection go to
the new primary, and a primary killed under load costs misses until a replica is promoted.
Every hit is checked byte for byte: 0 wrong pages, check() clean."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from tierstore_kit.clusters import SentinelProc
from tierstore_kit.servers import wait_for
from scaleout_kit import Workload, settle_and_check

from sglang_tierstore import TierStore
from sglang_tierstore.config import TierStoreConfig

pytestmark = pytest.mark.slow
DOWN_AFTER_S = 0.5


@pytest.fixture(params=["redis-server", "valkey-server"], ids=["redis", "valkey"])
def group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SentinelProc]:
    g = SentinelProc(tmp_path / "sentinel", request.param, down_after_ms=int(DOWN_AFTER_S * 1000))
    yield g
    g.stop()


def sentinel_store(tmp: Path, g: SentinelProc) -> TierStore:
    cfg = TierStoreConfig.from_dict({"path": str(tmp / "pages"), "redis_sentinel": {"nodes": g.nodes, "master": g.name},
                                     "redis_prefix": "s" + uuid.uuid4().hex[:8], "capacity_gb": 64 / 1024,
                                     "io_threads": 2, "redis_retry_s": 0.5})
    assert cfg.index_target is not None
    return TierStore(cfg, cfg.index_target)


def test_a_demoted_primary_then_a_killed_one_cost_misses_only(tmp_path: Path, group: SentinelProc) -> None:
    with sentinel_store(tmp_path, group) as st:
        ns = st.namespace({"m": "sentinel"}, 4096)
        w = Workload(st, ns, batch=16)
        for _ in range(4):
            w.write()
        first = group.primary()
        group.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", group.name)  # graceful: READONLY next
        wait_for(lambda: group.primary() is not first, 20, "a sentinel failover")
        wait_for(lambda: all(w.read(w.write())), 20, "writes and reads on the new primary")
        second = group.primary()
        # both replicas follow the new primary before it dies (a full resync takes a moment)
        wait_for(lambda: int(second.client().execute_command("WAIT", 2, 500)) == 2, 30, "both replicas in sync")
        w.run_in_background()
        try:
            time.sleep(0.3)
            second.kill()
            wait_for(lambda: group.primary() is not second, 30, "a replica promoted")
            probe = w.keys[:32]
            # recovery is bounded by wait_for, not timed: under a loaded suite the sentinels'
            # own vote can take longer than the few seconds it takes alone
            wait_for(lambda: all(w.read(probe)), 30, "hits after the failover")
        finally:
            w.stop()
        stored = sorted(w.stored, key=w.keys.index)
        lost = len(stored) - sum(w.read(stored))
        assert lost <= 4 * w.batch, f"{lost} stored pages lost: only batches committed just before the kill may be"
        assert w.tally.wrong == 0 and not w.tally.errors
        assert settle_and_check(st) == []
