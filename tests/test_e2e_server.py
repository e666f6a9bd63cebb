"""The real `sglang.launch_server` on CPU with the tiny model, tierstore as its L3.

Each server takes 30-60 s to start on 2 cores, so the module starts as few as the
claims allow: server A, whose first chat (nothing in L2 or L3 yet) is the reference the
others' outputs must equal; server B, started beside A on the same store, whose first
request (a fresh process's) is served from storage; one under fault injection; and one
with two TP ranks and --enable-metrics.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import dashboard
import pytest
import redis
import requests
from conftest import RedisProc, free_port
from cpu_harness import tiny_model
from cpu_harness.server import Server, conversation, cpu_args, tierstore_config, tp_env
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server

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
def store_cfg(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProc) -> dict[str, Any]:
    return tierstore_config(
        redis_url=redis_proc.url, redis_prefix="e2e-" + uuid.uuid4().hex[:8],
        path=str(tmp_path_factory.mktemp("e2e-store")), capacity_gb=0.5,
    )


@dataclass
class First:
    """Server A, running, and the outputs of its first chat."""

    server: Server
    outputs: list[str]


@pytest.fixture(scope="module")
def server_a(model: str, logdir: Path, store_cfg: dict[str, Any]) -> Iterator[First]:
    """Server A after its first chat: greedy outputs computed with nothing in L2 or L3
    (turns after the first reuse the device cache), the reference every later output of
    every server must equal. The test that uses A stops it when done."""
    with Server(model, free_port(), str(logdir / "a.log"), cpu_args(store_cfg)) as a:
        a.wait_ready()
        outputs, tiers = chat(a)
        assert all(t.get("host", 0) == 0 and t.get("storage", 0) == 0 for t in tiers), tiers
        yield First(a, outputs)


@pytest.fixture(scope="module")
def reference(server_a: First) -> list[str]:
    return server_a.outputs


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
    model: str, logdir: Path, server_a: First, store_cfg: dict[str, Any]
) -> None:
    a, reference = server_a.server, server_a.outputs
    second, tiers = chat(a)  # second hit: write_through_selective backs these up
    assert all(t.get("device", 0) > 0 for t in tiers)
    wait_for_backup(store_cfg)
    a.flush()
    third, tiers = chat(a)
    # every turn reads from storage what the flush took: the first its whole prefix, the
    # later ones their new part beyond what the turn before brought back to the device
    assert all(t.get("storage", 0) > 0 for t in tiers), tiers
    assert second == third == reference
    # server B, a fresh process beside A on the same Redis and path, starts with nothing cached
    with Server(model, free_port(), str(logdir / "b.log"), cpu_args(store_cfg)) as b:
        b.wait_ready()
        text, meta = b.generate(PROMPTS[-1])
        assert meta["cached_tokens_details"].get("storage", 0) > 0, meta
        assert meta["cached_tokens_details"].get("device", 0) == 0
        assert text == reference[-1]
    a.stop()


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


Scrape = dict[str, list[dict[str, str]]]  # sample name -> the labels of each of its series


def scrape(s: Server) -> tuple[Scrape, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    r = requests.get(s.url + "/metrics", timeout=30)
    r.raise_for_status()
    series: Scrape = {}
    values = {}
    for fam in text_string_to_metric_families(r.text):
        for x in fam.samples:
            series.setdefault(x.name, []).append(x.labels)
            values[(x.name, frozenset(x.labels.items()))] = x.value
    return series, values


def test_two_tp_ranks_report_tierstore_and_storage_metrics_in_the_servers_metrics(
    model: str, logdir: Path, redis_proc: RedisProc, tmp_path: Path
) -> None:
    """SGLang's /metrics runs in multiprocess mode: each TP rank's scheduler writes its own
    tierstore series, labelled by rank, and its get_stats() feeds SGLang's storage histograms."""
    cfg = tierstore_config(redis_url=redis_proc.url, redis_prefix="tp2-" + uuid.uuid4().hex[:8],
                           path=str(tmp_path / "store"), capacity_gb=0.5)
    args = [*cpu_args(cfg), "--tp", "2", "--enable-metrics"]
    with Server(model, free_port(), str(logdir / "tp2-metrics.log"), args, env=tp_env(2)) as s:
        s.wait_ready()
        chat(s)
        chat(s)  # second hit: backed up
        wait_for_backup(cfg)
        s.flush()
        assert chat(s)[1][0].get("storage", 0) > 0
        # SGLang hands get_stats() to its collector on each scheduler step: wait until it did
        deadline = time.monotonic() + 30
        while True:
            series, values = scrape(s)
            try:
                check_rank_metrics(values)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    tierstore = [labels for name, each in series.items() if name.startswith("tierstore_") for labels in each]
    assert tierstore and {(x.get("tp_rank"), x.get("pp_rank"), x.get("dp_rank"), x.get("attn_cp_rank")) for x in tierstore} == {("0", "0", "0", "0"), ("1", "0", "0", "0")}
    assert any(x.get("cache_source") == "storage" for x in series["sglang:cached_tokens_total"])
    # every series the Grafana dashboard selects is served, with the labels it uses
    # (tierstore_errors_total appears with the first error: none here)
    for where, expr in dashboard.queries(dashboard.load()):
        for ref in dashboard.refs(expr):
            if ref.name == "tierstore_errors_total":
                continue
            assert ref.name in series, f"{where}: /metrics has no {ref.name}"
            served = set().union(*map(set, series[ref.name]))
            assert ref.labels - dashboard.SCRAPE_LABELS <= served, f"{where}: {ref.name} lacks {ref.labels - served}"


def check_rank_metrics(values: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> None:
    """Each rank's pages, as tierstore counted them and as SGLang's histograms got them."""
    for r in ("0", "1"):
        ours = {"tp_rank": r, "pp_rank": "0", "dp_rank": "0", "attn_cp_rank": "0"}
        theirs = {"storage_backend": "dynamic", "tp_rank": r, "dp_rank": "0", "pp_rank": "0", "pp_size": "1",
                  "attn_cp_rank": "0", "attn_cp_size": "1"}

        def v(name: str, labels: dict[str, str]) -> float:
            return values.get((name, frozenset(labels.items())), 0.0)

        stored = v("tierstore_pages_total", {"op": "write", "outcome": "stored", **ours})
        read = v("tierstore_pages_total", {"op": "read", "outcome": "hit", **ours})
        assert stored > 0 and read > 0 and v("tierstore_pages_total", {"op": "probe", "outcome": "hit", **ours}) >= read
        assert v("tierstore_bytes_total", {"op": "read", **ours}) > 0
        assert v("tierstore_batch_seconds_count", {"op": "read", **ours}) == v("sglang:prefetch_pgs_count", theirs) > 0
        # one rank's pages, not the sum over ranks: SGLang's histograms are per rank
        assert v("sglang:prefetch_pgs_sum", theirs) == read
        exists = v("tierstore_pages_total", {"op": "write", "outcome": "exists", **ours})
        assert v("sglang:backup_pgs_sum", theirs) == stored + exists
        assert v("sglang:prefetch_bandwidth_count", theirs) > 0 and v("sglang:backup_bandwidth_count", theirs) > 0
