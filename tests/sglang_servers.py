"""The real SGLang servers the server lane shares (tests marked ``server``).

A CPU server takes 20-60 s to start on 2 cores, most of what the suite spends, so the tests
of every module share these, each started on first use and stopped when the session ends:

- ``plain_server``: HiCache without a storage backend, with an admin key. Its answers to
  prompts it has not seen are the reference (greedy outputs computed with nothing cached);
  it is the L3-off side of ``scripts/e2e_gpu.py``'s comparison, and the server tierstore is
  attached to and detached from at runtime (``test_admin.py``, which detaches it again).
- ``tierstore_pair``: two servers on one store directory and one 3-master cluster index,
  each with its own ``node_name``, writing through to L3 with ``--enable-metrics``: the
  multi-turn chat, ``scripts/demo_cpu.py``'s scenario, the load test, e2e_gpu.py's L3-on
  side; the second is the "new server on the same store" (a process that never saw the
  pages reads them from storage); both behind sglang-router in ``test_router.py``, which
  stops one (the pair starts it again if a later test asks for it).

Each test sends prompts of its own (``conversation(salt=...)``), so that none depends on what
another left cached, and flushes L1 and L2 before it relies on them being empty. Under
pytest-xdist these tests share one worker (``xdist_group("sglang")``, ``--dist loadgroup``).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from tierstore_kit.servers import free_port
from tierstore_kit.cpu_harness.server import Server, cpu_args, tierstore_config

from sglang_tierstore.tools import inspect
from sglang_tierstore.config import TierStoreConfig

GROUP = pytest.mark.xdist_group("sglang")  # every test that uses these: one worker holds them

TORCH_EXTENSIONS = os.path.expanduser("~/.cache/sglang-tierstore/torch_extensions")  # SGLang's page hash, built once


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama every CPU server serves."""
    from tierstore_kit.cpu_harness import tiny_model

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS)
    return tiny_model.build(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def plain_server(model: str, server_logs: Path) -> Iterator[Server]:
    with Server(model, free_port(), str(server_logs / "plain.log"), cpu_args(hicache=True),
                admin_key=uuid.uuid4().hex) as s:
        yield s.wait_ready()


class Pair:
    """Two servers on one store and one index (``cfg``, less each one's ``node_name``)."""

    def __init__(self, start: Callable[[str], Server], cfg: dict[str, Any], cluster: Any) -> None:
        self._start = start
        self.cfg = cfg
        self.cluster = cluster
        self.servers = {n: start(n) for n in ("a", "b")}
        for s in self.servers.values():
            s.wait_ready()

    def __getitem__(self, name: str) -> Server:
        """The server ``name``, started again if a test stopped it."""
        s = self.servers[name]
        if s.proc.poll() is not None:
            s.stop()
            s = self.servers[name] = self._start(name).wait_ready()
        return s

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


@pytest.fixture(scope="session")
def tierstore_pair(model: str, server_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from tierstore_kit.clusters import ClusterProc  # (clusters imports conftest, which imports this)

    cluster = ClusterProc(tmp_path_factory.mktemp("pair-cluster"), "redis-server", replicas=0)
    cfg = tierstore_config(redis_cluster=cluster.seeds, redis_prefix="pair-" + uuid.uuid4().hex[:6],
                           path=str(tmp_path_factory.mktemp("pair-store")), capacity_gb=0.5)

    def start(name: str) -> Server:
        return Server(model, free_port(), str(server_logs / f"pair-{name}.log"), pair_args({**cfg, "node_name": f"node-{name}"}))

    pair = Pair(start, cfg, cluster)
    try:
        yield pair
    finally:
        pair.stop()
        cluster.stop()


def pair_args(cfg: dict[str, Any]) -> list[str]:
    """A pair server's flags: write_through (a page reaches L3 after its first use: the load
    test flushes between turns) and ``--enable-metrics``."""
    return [*("write_through" if f == "write_through_selective" else f for f in cpu_args(cfg)), "--enable-metrics"]


def stored_pages(cfg: dict[str, Any]) -> int:
    """Pages the store of ``cfg`` holds, as its index counts them (any index: one server, a
    cluster, the embedded one), joined as ``tierstore`` joins it, writing nothing."""
    opened = inspect.open_store(TierStoreConfig.from_dict(cfg), start_redis=False)
    try:
        return inspect.usage(opened.store)["pages"]
    finally:
        opened.store.close()


def wait_for_backup(cfg: dict[str, Any], timeout: float = 30) -> int:
    """Write-through to L3 is asynchronous: wait until the stored page count settles."""
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = stored_pages(cfg)
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n > 0 and time.monotonic() - stable_since > 1.0:
            return n
        time.sleep(0.2)
    raise TimeoutError(f"L3 page count did not settle (last {last})")


def chat(s: Server, prompts: list[str]) -> tuple[list[str], list[dict[str, int]]]:
    """Each prompt's greedy output and where its cached tokens came from."""
    outs, tiers = [], []
    for p in prompts:
        text, meta = s.generate(p)
        outs.append(text)
        tiers.append(meta.get("cached_tokens_details") or {})
    return outs, tiers


def reference(plain: Server, prompts: list[str]) -> list[str]:
    """The outputs of ``prompts`` computed with nothing cached (prompts no test sent before)."""
    plain.flush()
    return chat(plain, prompts)[0]
