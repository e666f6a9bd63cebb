"""The real `sglang.launch_server` on CPU with the tiny model, tierstore as its L3.

Each server takes about a minute to start on 2 cores, so the module starts as
few as the claims allow: a reference server without HiCache, servers A and B
sharing one store, A again after a restart, and one under fault injection.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import RedisProc, free_port
from cpu_harness import tiny_model
from cpu_harness.server import Server, conversation, cpu_args, tierstore_config

PROMPTS = conversation(3)


@pytest.fixture(scope="module", autouse=True)
def _extensions_cache() -> None:
    # SGLang's page-hash C++ extension compiles on first use (~20 s): once per machine.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/sglang-tierstore/torch_extensions"))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model.build(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def reference(model: str, logdir: Path) -> list[str]:
    """Greedy outputs of a server without hierarchical cache."""
    with Server(model, free_port(), str(logdir / "reference.log"), cpu_args()) as s:
        s.wait_ready()
        return [s.generate(p)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def store_cfg(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProc) -> dict[str, Any]:
    return tierstore_config(
        redis_url=redis_proc.url, redis_prefix="e2e-" + uuid.uuid4().hex[:8],
        path=str(tmp_path_factory.mktemp("e2e-store")), capacity_gb=0.5,
    )


def chat(s: Server) -> tuple[list[str], list[dict[str, int]]]:
    outs, tiers = [], []
    for p in PROMPTS:
        text, meta = s.generate(p)
        outs.append(text)
        tiers.append(meta.get("cached_tokens_details") or {})
    return outs, tiers


def wait_for_backup(cfg: dict[str, Any], timeout: float = 30) -> int:
    """Write-through to L3 is asynchronous: wait until the stored page count settles."""
    r = redis.Redis.from_url(cfg["redis_url"])
    pattern = "{" + cfg.get("redis_prefix", "tierstore") + ":*}:entries"  # every shard's entry hash
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = sum(r.hlen(k) for k in r.scan_iter(match=pattern, count=1000))
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n > 0 and time.monotonic() - stable_since > 1.0:
            return n
        time.sleep(0.2)
    raise TimeoutError(f"L3 page count did not settle (last {last})")


def test_multi_turn_chat_hits_storage_after_flush_and_a_second_server_shares_it(
    model: str, logdir: Path, reference: list[str], store_cfg: dict[str, Any]
) -> None:
    with Server(model, free_port(), str(logdir / "a.log"), cpu_args(store_cfg)) as a:
        a.wait_ready()
        first, _ = chat(a)
        second, tiers = chat(a)  # second hit: write_through_selective backs these up
        assert all(t.get("device", 0) > 0 for t in tiers)
        wait_for_backup(store_cfg)
        a.flush()
        third, tiers = chat(a)
        assert tiers[0].get("storage", 0) > 0, tiers
        assert sum(t.get("storage", 0) for t in tiers) >= tiers[0]["storage"]
        assert first == second == third == reference
        # server B, running beside A on the same Redis and path, starts with nothing cached
        with Server(model, free_port(), str(logdir / "b.log"), cpu_args(store_cfg)) as b:
            b.wait_ready()
            text, meta = b.generate(PROMPTS[-1])
            assert meta["cached_tokens_details"].get("storage", 0) > 0, meta
            assert meta["cached_tokens_details"].get("device", 0) == 0
            assert text == reference[-1]


def test_warm_restart_serves_the_first_request_from_storage(
    model: str, logdir: Path, reference: list[str], store_cfg: dict[str, Any]
) -> None:
    with Server(model, free_port(), str(logdir / "restart.log"), cpu_args(store_cfg)) as s:
        s.wait_ready()
        text, meta = s.generate(PROMPTS[-1])
        assert meta["cached_tokens_details"].get("storage", 0) > 0, meta
        assert text == reference[-1]


def test_fault_injection_and_redis_outage_keep_outputs_identical(
    model: str, logdir: Path, reference: list[str], tmp_path: Path
) -> None:
    redis_proc = RedisProc(tmp_path / "redis", appendonly=True)  # a restarted Redis keeps the index, as deployed
    cfg = tierstore_config(redis_url=redis_proc.url, path=str(tmp_path / "store"), capacity_gb=0.5,
                           redis_timeout_s=0.3, redis_retry_s=0.5)
    env = {"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.2"}
    try:
        with Server(model, free_port(), str(logdir / "faults.log"), cpu_args(cfg), env=env) as s:
            s.wait_ready()
            for _ in range(2):
                assert chat(s)[0] == reference
            wait_for_backup(cfg)
            redis_proc.kill()
            s.flush()
            outs, tiers = chat(s)  # L3 unreachable: recomputed, same answers
            assert outs == reference
            assert all(t.get("storage", 0) == 0 for t in tiers)
            redis_proc.start()
            for _ in range(2):
                assert chat(s)[0] == reference
            s.flush()
            assert chat(s)[0] == reference
            assert s.proc.poll() is None
            log = open(s.log_path, errors="replace").read()
            assert "redis unavailable" in log  # the outage was seen, logged, and survived
    finally:
        redis_proc.stop()
