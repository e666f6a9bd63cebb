"""Through the real router: `sglang-router` (PyPI) in front of two real SGLang CPU servers on
the tiny model, both on one 3-master cluster index and one store directory. The router's
cache-aware policy keeps a user's turns on one worker; that worker is stopped (a node dies
or is drained); the user's next request lands on the other, whose first request for that
history is served from storage with the same greedy output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from clusters import ClusterProc
from conftest import free_port
from cpu_harness import tiny_model
from cpu_harness.server import Server, conversation, cpu_args, tierstore_config

pytestmark = pytest.mark.server

PROMPTS = conversation(3)


@pytest.fixture(scope="module", autouse=True)
def _extensions_cache() -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/sglang-tierstore/torch_extensions"))


class Router:
    def __init__(self, workers: list[str], log: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *workers, "--policy", "cache_aware", "--retry-max-retries", "3",
             "--log-level", "warn"], stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}; see {log}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router not healthy; see {log}")

    def generate(self, prompt: str, timeout: float = 120) -> tuple[str, dict[str, Any]]:
        """Greedy output and meta_info through the router (retried while it still tries a stopped worker)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = requests.post(self.url + "/generate", timeout=300, json={
                    "text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
                if r.status_code == 200:
                    body = r.json()
                    return body["text"], body["meta_info"]
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the router served no request")
            time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def served(log: str) -> int:
    with open(log, "rb") as f:
        return f.read().count(b"POST /generate")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProc]:
    c = ClusterProc(tmp_path_factory.mktemp("router-cluster"), "redis-server", replicas=0)
    yield c
    c.stop()


def test_a_users_next_turn_on_another_worker_is_served_from_storage(tmp_path: Path, cluster: ClusterProc) -> None:
    model = tiny_model.build(str(tmp_path / "model"))
    shared = str(tmp_path / "shared-store")
    prefix = "router-" + uuid.uuid4().hex[:6]
    logs = {n: str(tmp_path / f"{n}.log") for n in ("a", "b", "router")}
    servers = {}
    for n in ("a", "b"):
        cfg = tierstore_config(redis_cluster=cluster.seeds, redis_prefix=prefix, path=shared, capacity_gb=0.5,
                               node_name=f"node-{n}")
        servers[n] = Server(model, free_port(), logs[n], cpu_args(cfg))
    router = None
    try:
        for s in servers.values():
            s.wait_ready()
        router = Router([s.url for s in servers.values()], logs["router"])
        before = {n: served(logs[n]) for n in servers}
        reference = [router.generate(p)[0] for p in PROMPTS]
        took = [n for n in servers if served(logs[n]) > before[n]]
        assert len(took) == 1, f"the cache-aware router kept the user on one worker: {took}"
        first, other = took[0], next(n for n in servers if n != took[0])
        time.sleep(3)  # write-through of the last turn (asynchronous) reaches L3
        servers[first].stop()  # the node dies
        text, meta = router.generate(PROMPTS[-1])
        assert served(logs[other]) > before[other], "the request went to the other worker"
        details = meta.get("cached_tokens_details") or {}
        assert details.get("storage", 0) > 0, meta
        assert text == reference[-1]
    finally:
        if router is not None:
            router.stop()
        for s in servers.values():
            s.stop()
