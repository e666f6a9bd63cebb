"""Through the real router: `sglang-router` (PyPI) in front of two real SGLang CPU servers on
the tiny model, both on one 3-master cluster index and one store directory
(``scripts/router_fleet.py``'s scenario, which runs the same on a GPU fleet with ``--model``).
The router's cache-aware policy keeps a user's turns on one worker; that worker is stopped (a
node dies or is drained); the user's next request lands on the other, whose first request for
that history is served from storage with the same greedy output."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from clusters import ClusterProc
from conftest import free_port
from cpu_harness import tiny_model
from cpu_harness.server import Server, conversation, cpu_args, tierstore_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from router_fleet import Router, scenario  # noqa: E402

pytestmark = pytest.mark.server


@pytest.fixture(scope="module", autouse=True)
def _extensions_cache() -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/sglang-tierstore/torch_extensions"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProc]:
    c = ClusterProc(tmp_path_factory.mktemp("router-cluster"), "redis-server", replicas=0)
    yield c
    c.stop()


def test_a_users_next_turn_on_another_worker_is_served_from_storage(tmp_path: Path, cluster: ClusterProc) -> None:
    model = tiny_model.build(str(tmp_path / "model"))
    prefix = "router-" + uuid.uuid4().hex[:6]
    logs = {n: str(tmp_path / f"{n}.log") for n in ("a", "b", "router")}
    servers = {n: Server(model, free_port(), logs[n], cpu_args(tierstore_config(
        redis_cluster=cluster.seeds, redis_prefix=prefix, path=str(tmp_path / "shared-store"), capacity_gb=0.5,
        node_name=f"node-{n}"))) for n in ("a", "b")}
    router = None
    try:
        for s in servers.values():
            s.wait_ready()
        router = Router([s.url for s in servers.values()], logs["router"])
        result = scenario(servers, logs, router, conversation(3))
    finally:
        if router is not None:
            router.stop()
        for s in servers.values():
            s.stop()
    assert len(result["took_the_turns"]) == 1, f"the cache-aware router kept the user on one worker: {result}"
    assert result["then_served_by"] is not None, result
    assert result["cached"].get("storage", 0) > 0, result
    assert result["same_output"], result
