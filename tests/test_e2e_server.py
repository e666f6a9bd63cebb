"""The real `sglang.launch_server` on CPU with the tiny model, tierstore as its L3.

The chat, the README's main job (``scripts/demo_cpu.py``'s scenario) and the GPU check's CPU
mode (``scripts/e2e_gpu.py``'s) run on the servers the server lane shares
(``sglang_servers.py``: the reference server without L3, and two tierstore servers on one
store); two scenarios start a server of their own, because what they test is fixed when a
server starts: SGLang's fault injector, and two TP ranks with ``--enable-metrics``.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import dashboard
import pytest
import requests
from tierstore_kit.checkout import load_script
from tierstore_kit.servers import RedisProc, free_port
from tierstore_kit.cpu_harness.server import Server, conversation, cpu_args, tierstore_config, tp_env
from prometheus_client.parser import text_string_to_metric_families
from sglang_servers import GROUP, Pair, chat, reference, wait_for_backup

demo_cpu = load_script("demo_cpu")
e2e_gpu = load_script("e2e_gpu")

pytestmark = [pytest.mark.server, GROUP]


def test_multi_turn_chat_hits_storage_after_flush_and_a_second_server_shares_it(
        plain_server: Server, tierstore_pair: Pair) -> None:
    prompts = conversation(3, salt="chat ")
    expected = reference(plain_server, prompts)
    a = tierstore_pair["a"]
    a.flush()
    first, tiers = chat(a, prompts)  # nothing of this chat anywhere yet: computed
    assert all(t.get("host", 0) == 0 and t.get("storage", 0) == 0 for t in tiers), tiers
    second, tiers = chat(a, prompts)
    assert all(t.get("device", 0) > 0 for t in tiers)
    wait_for_backup(tierstore_pair.cfg)
    a.flush()
    third, tiers = chat(a, prompts)
    # every turn reads from storage what the flush took: the first its whole prefix, the
    # later ones their new part beyond what the turn before brought back to the device
    assert all(t.get("storage", 0) > 0 for t in tiers), tiers
    assert first == second == third == expected
    # server B, a process beside A on the same index and directory, has nothing of it cached
    text, meta = tierstore_pair["b"].generate(prompts[-1])
    assert meta["cached_tokens_details"].get("storage", 0) > 0, meta
    assert meta["cached_tokens_details"].get("device", 0) == 0
    assert text == expected[-1]


def test_the_readmes_main_job_shows_storage_hits_with_outputs_equal_to_the_reference(
        plain_server: Server, tierstore_pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    """``scripts/demo_cpu.py``'s three steps, each on the shared server it starts its own of:
    the reference without L3, the chat on tierstore with a flush, and a server new to the
    chat on the same store."""
    prompts = conversation(3, salt="demo ")
    plain_server.flush()
    expected = demo_cpu.reference_phase(plain_server, prompts)
    tierstore_pair["a"].flush()
    passes = demo_cpu.l3_phase(tierstore_pair["a"], prompts)
    hits = demo_cpu.restart_phase(tierstore_pair["b"], prompts)
    assert demo_cpu.verdict(expected, passes, hits)
    out = capsys.readouterr().out
    assert "greedy outputs identical to the reference: True" in out and "OK: L3 turned the misses into hits" in out
    after_flush = [line for line in out.splitlines() if line.lstrip().startswith("after flush")]
    assert len(after_flush) == 3 and all(" storage    0)" not in line for line in after_flush), out


def test_the_gpu_check_in_its_cpu_mode_reads_prefixes_back_from_storage(
        plain_server: Server, tierstore_pair: Pair, model: str) -> None:
    """``scripts/e2e_gpu.py --cpu``'s comparison: the same token prompts with L3 off (HiCache
    alone) and on, flushed before each timed pass."""
    prompts = e2e_gpu.token_prompts(model, 2, 256)
    report: dict[str, Any] = {"model": model, "prompts": 2, "prompt_tokens": 256, "cpu": True,
                              "l3_off": e2e_gpu.measure(plain_server, prompts, with_l3=False),
                              "l3_on": e2e_gpu.measure(tierstore_pair["a"], prompts, with_l3=True)}
    assert e2e_gpu.conclude(report)
    assert report["outputs_identical"] and report["l3_on"]["cached_tokens"]["storage"] > 0
    assert report["l3_off"]["cached_tokens"]["storage"] == 0


def test_fault_injection_and_redis_outage_keep_outputs_identical(
        model: str, server_logs: Path, plain_server: Server, tmp_path: Path) -> None:
    prompts = conversation(3, salt="faults ")
    expected = reference(plain_server, prompts)
    redis_proc = RedisProc(tmp_path / "redis", appendonly=True)  # a restarted Redis keeps the index, as deployed
    cfg = tierstore_config(redis_url=redis_proc.url, path=str(tmp_path / "store"), capacity_gb=0.5,
                           redis_timeout_s=0.3, redis_retry_s=0.5)
    env = {"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.2"}
    try:
        with Server(model, free_port(), str(server_logs / "faults.log"), cpu_args(cfg), env=env) as s:
            s.wait_ready()
            for _ in range(2):
                assert chat(s, prompts)[0] == expected
            wait_for_backup(cfg)
            redis_proc.kill()
            s.flush()
            outs, tiers = chat(s, prompts)  # L3 unreachable: recomputed, same answers
            assert outs == expected
            assert all(t.get("storage", 0) == 0 for t in tiers)
            redis_proc.start()
            for _ in range(2):
                assert chat(s, prompts)[0] == expected
            s.flush()
            assert chat(s, prompts)[0] == expected
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
    model: str, server_logs: Path, redis_proc: RedisProc, tmp_path: Path
) -> None:
    """SGLang's /metrics runs in multiprocess mode: each TP rank's scheduler writes its own
    tierstore series, labelled by rank, and its get_stats() feeds SGLang's storage histograms."""
    prompts = conversation(3, salt="tp2 ")
    cfg = tierstore_config(redis_url=redis_proc.url, redis_prefix="tp2-" + uuid.uuid4().hex[:8],
                           path=str(tmp_path / "store"), capacity_gb=0.5)
    args = [*cpu_args(cfg), "--tp", "2", "--enable-metrics"]
    with Server(model, free_port(), str(server_logs / "tp2-metrics.log"), args, env=tp_env(2)) as s:
        s.wait_ready()
        chat(s, prompts)
        chat(s, prompts)  # second hit: backed up
        wait_for_backup(cfg)
        s.flush()
        assert chat(s, prompts)[1][0].get("storage", 0) > 0
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
