"""The index on a real 3-master Redis/Valkey Cluster (each master with a replica), built by
the test with CLUSTER MEET/ADDSLOTSRANGE/REPLICATE: one shard per master, a
batch is one pipelined request per master, redirects are followed, and a dead master
costs only its own shards until its replica takes over. Every hit is checked byte for
byte (``scaleout_kit``): 0 wrong pages in every test."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from tierstore_kit.clusters import ClusterProc
from tierstore_kit.servers import wait_for
from redis.crc import key_slot
from scaleout_kit import Workload, settle_and_check, shard_of_key

from sglang_tierstore import TierStore
from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import ConfigError, IndexUnavailable
from sglang_tierstore.index import RedisIndex, spread_suffixes
from sglang_tierstore.schema import shard_key
from sglang_tierstore.space.library import LIBRARY

pytestmark = pytest.mark.slow
SERVERS = ["redis-server", "valkey-server"]


def cluster_store(tmp: Path, cluster: ClusterProc, **kw: Any) -> TierStore:
    cfg = TierStoreConfig.from_dict({"path": str(tmp / f"pages-{uuid.uuid4().hex[:6]}"),
                                     "redis_cluster": [cluster.seeds[0]], "redis_prefix": "c" + uuid.uuid4().hex[:8],
                                     "capacity_gb": 64 / 1024, "io_threads": 2, "redis_retry_s": 0.5, **kw})
    assert cfg.index_target is not None
    return TierStore(cfg, cfg.index_target)


@pytest.fixture(scope="module", params=SERVERS, ids=["redis", "valkey"])
def shared_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProc]:
    c = ClusterProc(tmp_path_factory.mktemp("cluster"), request.param)
    yield c
    c.stop()


@pytest.fixture(params=SERVERS, ids=["redis", "valkey"])
def own_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ClusterProc]:
    c = ClusterProc(tmp_path / "cluster", request.param)
    yield c
    c.stop()


def shard_owner(cluster: ClusterProc, st: TierStore, shard: int) -> str:
    tag = st.space.attached().home.shard_tags[shard]
    return cluster.owner(key_slot(tag.encode())).addr


def hmget_calls(cluster: ClusterProc) -> dict[str, int]:
    return {n.addr: int(n.client().info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))
            for n in cluster.masters()}


def test_one_shard_per_master_and_a_probe_is_one_hmget_per_master(tmp_path: Path, shared_cluster: ClusterProc) -> None:
    """A store learns the masters from one seed and puts one shard on each: a probe of 128
    keys is one HMGET per master. ``index_shards`` 6 puts two on each."""
    masters = sorted(m.addr for m in shared_cluster.masters())
    with cluster_store(tmp_path, shared_cluster) as st:
        ns = st.namespace({"m": "spread"}, 4096)
        assert st.space.attached().geometry.shards == 3
        assert sorted(shard_owner(shared_cluster, st, s) for s in range(3)) == masters
        w = Workload(st, ns)
        for _ in range(8):
            w.write()
        assert w.tally.stored == w.tally.written == 256
        before = hmget_calls(shared_cluster)
        assert st.exists([(ns, w.keys[:128])]) == [[True] * 128]
        after = hmget_calls(shared_cluster)
        assert {m: after[m] - before[m] for m in after} == dict.fromkeys(masters, 1)
        assert all(w.read()) and w.tally.wrong == 0 and not w.tally.errors
        assert settle_and_check(st) == []
    with cluster_store(tmp_path, shared_cluster, index_shards=6) as st:
        st.namespace({"m": "six"}, 4096)
        owners = [shard_owner(shared_cluster, st, s) for s in range(st.space.attached().geometry.shards)]
        assert sorted(owners) == sorted(masters * 2)


def test_shards_follow_the_slot_map_not_equal_ranges() -> None:
    """redis-cli --cluster create's split (0-5460, 5461-10922, 10923-16383) is not three equal
    ranges: each shard still lands on its own master, and shard s on the s-th (modulo)."""
    owners = ["a"] * 5461 + ["b"] * 5462 + ["c"] * 5461
    for tag in (f"t{i}" for i in range(200)):
        tags = spread_suffixes(tag, 6, owners)
        assert [owners[key_slot(f"{tag}:{t}".encode())] for t in tags] == ["a", "b", "c", "a", "b", "c"]
    single = ["a"] + [None] * 16383  # a master holding one slot (the rest unserved) still gets its shard
    assert [single[key_slot(f"x:{t}".encode())] for t in spread_suffixes("x", 2, single)] == ["a", "a"]
    with pytest.raises(IndexUnavailable):
        spread_suffixes("x", 1, [None] * 16384)


def test_a_slot_moved_under_traffic_is_followed_through_ask_and_moved(tmp_path: Path,
                                                                      shared_cluster: ClusterProc) -> None:
    with cluster_store(tmp_path, shared_cluster) as st:
        ns = st.namespace({"m": "reshard"}, 4096)
        w = Workload(st, ns)
        for _ in range(4):
            w.write()
        tag = st.space.attached().home.shard_tags[0]
        slot = key_slot(tag.encode())
        src = shared_cluster.owner(slot)
        dest = next(m for m in shared_cluster.masters() if m.addr != src.addr)
        half: list[bool] = []
        ks = list(w.keys)

        def during() -> None:
            # half the shard's keys moved: its calls, which take all its keys, answer TRYAGAIN (its
            # pages are misses and not stored meanwhile); ASK for keys already moved; the rest serve
            half.extend(w.read(ks))
            w.write()

        assert shared_cluster.move_slot(slot, dest, during) > 0
        assert shared_cluster.owner(slot).addr == dest.addr
        assert all(h for k, h in zip(ks, half) if shard_of_key(st, ns, k) != 0)
        during_batch = w.keys[-w.batch:]
        w.write()  # MOVED, then the new owner
        hits = w.read()
        missing = [(k, shard_of_key(st, ns, k), k in during_batch) for k, h in zip(w.keys, hits) if not h]
        assert all(inb and s == 0 for _, s, inb in missing), missing
        assert w.tally.wrong == 0 and not w.tally.errors
        assert all(w.read(w.write()))  # the moved shard takes writes again
        assert settle_and_check(st) == []
        shared_cluster.move_slot(slot, src)  # the module's cluster as it was


def test_a_killed_master_costs_only_its_shards_until_its_replica_takes_over(tmp_path: Path,
                                                                            own_cluster: ClusterProc) -> None:
    c = own_cluster
    with cluster_store(tmp_path, c) as st:
        ns = st.namespace({"m": "kill"}, 4096)
        w = Workload(st, ns)
        for _ in range(8):
            w.write()
        for m in c.masters():  # what was written has reached the replicas (asynchronous replication)
            m.client().execute_command("WAIT", 1, 2000)
        victim = c.masters()[0]
        dead = {s for s in range(st.space.attached().geometry.shards) if shard_owner(c, st, s) == victim.addr}
        victim.kill()
        t0 = time.monotonic()
        hits = w.read()
        alive = [h for k, h in zip(w.keys, hits) if shard_of_key(st, ns, k) not in dead]
        lost = [h for k, h in zip(w.keys, hits) if shard_of_key(st, ns, k) in dead]
        assert sum(alive) >= 0.99 * len(alive) and not any(lost)
        w.write()  # writes to the surviving shards go on
        bound = c.node_timeout_ms / 1000 + 2 * st.cfg.redis_retry_s + 2
        alive_keys = [k for k in w.keys[:256] if shard_of_key(st, ns, k) not in dead]
        kept = []  # the surviving shards' hit rate, sampled until the dead ones hit again (through the
        while not all(w.read(w.keys[:256])):  # failover: cluster-require-full-coverage no keeps them up)
            kept.append(sum(w.read(alive_keys)) / len(alive_keys))
            assert time.monotonic() - t0 < bound + 10, "the dead master's shards never hit again"
            time.sleep(0.05)
        back = time.monotonic() - t0
        assert kept and sum(kept) / len(kept) >= 0.99, kept
        assert back <= bound + 2, f"hits back after {back:.1f} s, target {bound:.1f} s"  # + the replica's election
        c.wait_ok()
        w.write()
        stored = sorted(w.stored, key=w.keys.index)
        lost = len(stored) - sum(w.read(stored))
        assert lost <= w.batch, f"{lost} stored pages lost: only a batch committed as the master died may be"
        assert w.tally.wrong == 0 and not w.tally.errors
        assert settle_and_check(st) == []


def test_failover_takeover_and_a_stopped_master_under_traffic_give_no_wrong_page(tmp_path: Path,
                                                                                 own_cluster: ClusterProc) -> None:
    c = own_cluster
    with cluster_store(tmp_path, c) as st:
        ns = st.namespace({"m": "faults"}, 4096)
        w = Workload(st, ns, batch=16)
        w.write()
        w.run_in_background()
        try:
            m0 = c.masters()[0]
            c.replica_of(m0).client().execute_command("CLUSTER", "FAILOVER")  # graceful: no write lost
            wait_for(lambda: c.role(m0) == "slave", 20, "a graceful failover")
            m1 = c.masters()[1]
            c.replica_of(m1).client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
            wait_for(lambda: c.role(m1) == "slave", 20, "a takeover")
            c.wait_ok()
            m2 = c.masters()[2]
            m2.pause()  # longer than the node timeout: its replica is promoted; it rejoins as a replica
            wait_for(lambda: len([n for n in c.live() if n is not m2 and c.role(n) == "master" and c.slots_of(n)]) == 3,
                     60, "the stopped master's replica to be promoted")
            m2.resume()
            wait_for(lambda: c.role(m2) == "slave", 30, "the stopped master to rejoin as a replica")
            c.wait_ok()
            time.sleep(1)
        finally:
            w.stop()
        hits = w.read()
        assert sum(hits) > 0 and w.tally.wrong == 0 and not w.tally.errors
        assert settle_and_check(st) == []
        w.write()
        assert all(w.read(w.keys[-w.batch:]))


def test_the_whole_cluster_restarted_from_its_aof_serves_what_it_held(tmp_path: Path, own_cluster: ClusterProc) -> None:
    c = own_cluster
    with cluster_store(tmp_path, c) as st:
        ns = st.namespace({"m": "restart"}, 4096)
        w = Workload(st, ns)
        for _ in range(6):
            w.write()
        for n in c.live():
            n.client().execute_command("BGREWRITEAOF")
        for n in list(c.live()):  # a clean stop: each syncs its AOF
            try:
                n.client().shutdown()
            except redis.ConnectionError:
                pass
            n.proc.wait(10)  # type: ignore[union-attr]
            n.proc = None
        for n in c.nodes:
            n.start()
        c.wait_ok()
        wait_for(lambda: all(w.read(w.keys[:32])), 30, "hits after the restart")
        assert all(w.read()) and w.tally.wrong == 0
        w.write()
        assert all(w.read(w.keys[-w.batch:])) and not w.tally.errors
        assert settle_and_check(st) == []


def test_functions_are_loaded_on_each_master_and_a_flushed_one_reloads(tmp_path: Path,
                                                                       shared_cluster: ClusterProc) -> None:
    with cluster_store(tmp_path, shared_cluster) as st:
        ns = st.namespace({"m": "functions"}, 4096)
        w = Workload(st, ns)
        w.write()
        for m in shared_cluster.masters():
            libs = m.client(decode_responses=True).function_list()
            names = [(lib if isinstance(lib, dict) else dict(zip(lib[::2], lib[1::2])))["library_name"] for lib in libs]
            assert LIBRARY.name in names, m.addr
        shared_cluster.masters()[1].client().execute_command("FUNCTION", "FLUSH")
        for _ in range(3):
            w.write()
        assert w.tally.stored == w.tally.written and all(w.read()) and w.tally.wrong == 0


def test_a_standalone_url_to_a_cluster_node_says_to_use_redis_cluster(shared_cluster: ClusterProc) -> None:
    idx = RedisIndex(f"redis://{shared_cluster.seeds[0]}/0", 1.0, 0.1)
    keys = [shard_key(f"x:{i}", "entries") for i in range(20)]
    with pytest.raises(Exception, match="is a Redis Cluster node.*redis_cluster"):
        idx.hmget([(k, [b"f"]) for k in keys])
    idx.close()


def test_a_slot_the_map_lacks_is_read_again_within_the_call(tmp_path: Path, shared_cluster: ClusterProc) -> None:
    """A slot map read while a master was failing over may have no master for its slots: the
    call that meets such a slot reads the map again and goes on (it did not stay unmapped)."""
    with cluster_store(tmp_path, shared_cluster) as st:
        ns = st.namespace({"m": "unmapped"}, 4096)
        w = Workload(st, ns)
        w.write()
        topo = st.index._topology
        slot = key_slot(st.space.attached().home.shard_tags[0].encode())
        topo._slots = [None if i == slot else n for i, n in enumerate(topo._slots)]  # as such a map reads
        topo._stale = False
        assert all(w.read()) and w.tally.wrong == 0
        assert settle_and_check(st) == []


def test_a_seed_that_is_not_a_cluster_node_is_a_config_error_naming_redis_cluster(tmp_path: Path,
                                                                                   redis_proc: Any) -> None:
    cfg = TierStoreConfig.from_dict({"path": str(tmp_path / "p"), "redis_cluster": [f"127.0.0.1:{redis_proc.port}"]})
    assert cfg.index_target is not None
    with pytest.raises(ConfigError, match=r"'redis_cluster': 127\.0\.0\.1:\d+ is not a cluster node"):
        TierStore(cfg, cfg.index_target).space.attached()
