"""Through the real router: `sglang-router` (PyPI) in front of two real SGLang CPU servers on
the tiny model, both on one 3-master cluster index and one store directory (the server lane's
shared pair, ``sglang_servers.py``; ``scripts/router_fleet.py``'s scenario, which runs the
same on a GPU fleet with ``--model``). The router's cache-aware policy keeps a user's turns on
one worker; that worker is stopped (a node dies or is drained); the user's next request lands
on the other, whose first request for that history is served from storage with the same
greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierstore_kit.checkout import load_script
from tierstore_kit.cpu_harness.server import conversation
from sglang_servers import GROUP, Pair

router_fleet = load_script("router_fleet")
Router, scenario = router_fleet.Router, router_fleet.scenario

pytestmark = [pytest.mark.server, GROUP]


def test_a_users_next_turn_on_another_worker_is_served_from_storage(tmp_path: Path, tierstore_pair: Pair) -> None:
    servers = {n: tierstore_pair[n] for n in ("a", "b")}
    for s in servers.values():
        s.flush()
    logs = {**{n: s.log_path for n, s in servers.items()}, "router": str(tmp_path / "router.log")}
    router = Router([s.url for s in servers.values()], logs["router"])
    try:
        result = scenario(servers, logs, router, conversation(3, salt="router "))
    finally:
        router.stop()
    assert len(result["took_the_turns"]) == 1, f"the cache-aware router kept the user on one worker: {result}"
    assert result["then_served_by"] is not None, result
    assert result["cached"].get("storage", 0) > 0, result
    assert result["same_output"], result
