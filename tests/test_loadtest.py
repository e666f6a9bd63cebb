"""scripts/multiturn_loadtest.py: end to end against the real CPU server, and its pieces.

One server (tiny model, tierstore as L3: ``sglang_servers.py``'s) takes two short runs: users who think for a
couple of seconds while the load test flushes L1 and L2 every second, so every returning
turn finds its prefix only in storage; then ``--compare`` over both runs. The pieces
(workload from a seed, metrics parsing, buckets, the tier-skipping share) run without a
server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sglang_servers import GROUP, Pair
from tierstore_kit.checkout import ROOT, SCRIPTS, load_script
from tierstore_kit.multiturn import shares, summarize

SCRIPT = SCRIPTS / "multiturn_loadtest.py"
PLOTS = ("ttft_cdf", "ttft_by_turn", "residency", "hits_over_time")
RESULT_FIELDS = {
    "user", "tenant", "turn", "start_s", "gap_s", "wait_s", "ttft_s", "e2e_s", "itl_s", "prompt_tokens",
    "prefix_tokens", "output_tokens", "cached_tokens", "cached", "output_sha", "error", "backup",
}


lt = load_script("multiturn_loadtest")


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False)


WORKLOAD = [
    "--num-clients", "4", "--num-rounds", "3", "--request-length", "48", "--sub-question-input-length", "32",
    "--output-length", "6", "--request-rate", "4", "--system-prompt-length", "64", "--num-tenants", "2",
    "--think-time-dist", "fixed", "--think-time-median", "2.5", "--flush-interval", "1", "--max-parallel", "4",
    "--gap-buckets", "1,2,5",
]


@pytest.mark.server
@GROUP
def test_end_to_end_against_the_cpu_server(model: str, tmp_path: Path, tierstore_pair: Pair) -> None:
    """On a shared tierstore server (writing through, so every page reaches L3 after its first
    use, with --enable-metrics), whose L1 and L2 the load test itself flushes between turns."""
    out = tmp_path / "out"
    s = tierstore_pair["a"]
    runs = [loadtest("--base-url", s.url, "--model-path", model, "--output-dir", str(out), "--tag", tag,
                     "--seed", "7", *WORKLOAD) for tag in ("first", "second")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "returning turns" in r.stdout and "storage" in r.stdout  # the printed table

    summary = json.loads((out / "first.summary.json").read_text())
    rows = [json.loads(line) for line in (out / summary["jsonl"]).read_text().splitlines()]
    assert len(rows) == 4 * 3 and all(set(r) == RESULT_FIELDS for r in rows)
    assert all(r["error"] is None and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in rows)
    for r in rows:  # one gap per token after the first, however the server grouped them into chunks
        assert len(r["itl_s"]) == r["output_tokens"] - 1 == 5
        assert sum(r["itl_s"]) <= r["e2e_s"] - r["ttft_s"] + 1e-6
    assert sorted((r["user"], r["turn"]) for r in rows) == [(u, t) for u in range(4) for t in (1, 2, 3)]
    for r in rows:  # the whole history resent: system prompt, earlier turns and replies
        assert r["prompt_tokens"] == r["prefix_tokens"] + (48 if r["turn"] == 1 else 32)
        assert r["prefix_tokens"] == 64 + (r["turn"] > 1) * (48 + 6) + max(0, r["turn"] - 2) * (32 + 6)
        assert (r["gap_s"] is None) == (r["turn"] == 1)
    assert summary["config"]["num_clients"] == 4 and summary["config"]["seed"] == 7
    for key in ("overall", "returning", "by_turn", "by_gap"):
        assert key in summary["summary"]
    overall = summary["summary"]["overall"]
    assert {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "e2e_p90_s", "storage_share", "host_share"} <= set(overall)
    assert set(summary["summary"]["by_turn"]) == {"1", "2", "3"}
    assert sum(v["requests"] for v in summary["summary"]["by_gap"].values()) == 12
    # the server's and the backend's counters, before and after
    assert any(k.startswith("sglang:prompt_tokens_total") for k in summary["metrics_after"])
    assert any(k.startswith("tierstore_pages_total") and 'op="write"' in k for k in summary["metrics_delta"])

    # returning users whose L1 and L2 were flushed since their previous turn (and its backup to
    # L3 had half a second to finish) read their own history from storage; the tenant's system
    # prompt may have come back to the device with another user of the tenant
    assert summary["flushes_s"], "no flush succeeded"
    flushed = [r for r in rows if r["turn"] > 1
               and any(r["start_s"] - r["gap_s"] + 0.5 < f < r["start_s"] for f in summary["flushes_s"])]
    assert len(flushed) >= 4
    with_storage = [r for r in flushed if r["cached"]["storage"] >= r["prefix_tokens"] - 64 - 16]
    assert len(with_storage) >= 0.75 * len(flushed), [(r["cached"], r["prefix_tokens"]) for r in flushed]
    assert summary["summary"]["returning"]["storage_tokens"] > 0

    for tag in ("first", "second"):
        for name in PLOTS:
            assert (out / f"{tag}_{name}.png").stat().st_size > 5000
    # same seed, same server: same requests and the same greedy outputs
    second = json.loads((out / "second.summary.json").read_text())
    assert second["outputs"] == summary["outputs"]

    cmp = loadtest("--compare", str(out / "first.summary.json"), str(out / "second.summary.json"),
                   "--output-dir", str(out / "cmp"))
    assert cmp.returncode == 0, cmp.stderr
    assert "first" in cmp.stdout and "second" in cmp.stdout and "turn 3" in cmp.stdout
    for name in PLOTS:
        assert (out / "cmp" / f"compare_{name}.png").stat().st_size > 5000


def test_workload_is_reproducible_from_the_seed(model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    args = lt.parser().parse_args(["--model-path", model, *WORKLOAD, "--time-scale", "0.5"])
    a_users, a_sys = lt.build_workload(args, tok)
    b_users, b_sys = lt.build_workload(args, tok)
    assert a_users == b_users and a_sys == b_sys
    args.seed = 2
    assert lt.build_workload(args, tok)[0] != a_users
    for u in a_users:
        assert [len(t.user_ids) for t in u.turns] == [48, 32, 32]
        assert [t.think_s for t in u.turns] == [0.0, 1.25, 1.25]  # fixed 2.5 s, time-scaled
    assert [len(ids) for ids, _ in a_sys] == [64, 64]
    # exact token counts also as text (the chat API path)
    for u in a_users:
        for t in u.turns:
            assert tok.encode(t.user_text, add_special_tokens=False) == t.user_ids
    arrivals = [u.arrival_s for u in a_users]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_backup_users_leave_the_conversations_as_they_were(model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    args = lt.parser().parse_args(["--model-path", model, *WORKLOAD])
    plain, systems = lt.build_workload(args, tok)
    args.backup_rate, args.backup_length = 2.0, 40
    users, with_backup_systems = lt.build_workload(args, tok)
    assert users[: len(plain)] == plain and with_backup_systems == systems
    backup = users[len(plain):]
    horizon = max(u.arrival_s + sum(t.think_s for t in u.turns) for u in plain)  # 2 rounds of 2.5 s after the last arrival
    assert 3 <= len(backup) and all(u.backup and u.tenant == -1 and 0 < u.arrival_s <= horizon for u in backup)
    assert [u.uid for u in backup] == list(range(len(plain), len(users)))
    assert all(len(u.turns) == 1 and len(u.turns[0].user_ids) == 40 for u in backup)
    assert len({tuple(u.turns[0].user_ids) for u in backup}) == len(backup)  # no shared prefix: all differ
    assert lt.build_workload(args, tok)[0] == users  # reproducible too


def test_sharegpt_turns(model: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    data = [{"conversations": [{"from": "human", "value": "The radix tree finds the longest prefix " * 20},
                               {"from": "gpt", "value": "ok"}, {"from": "human", "value": "A page is a fixed number"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tok = AutoTokenizer.from_pretrained(model)
    args = lt.parser().parse_args(["--model-path", model, *WORKLOAD, "--dataset-path", str(path)])
    users, _ = lt.build_workload(args, tok)
    first, second, third = users[0].turns
    assert len(first.user_ids) == 48  # cut to --request-length
    assert tok.decode(second.user_ids).startswith("A page")
    assert tok.decode(third.user_ids).startswith("The radix")  # conversations shorter than the run wrap around
    path.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "x"}]}]))
    with pytest.raises(SystemExit, match="no conversations"):
        lt.build_workload(args, tok)


def test_summary_buckets_and_metrics() -> None:
    def row(turn: int, gap: Any, ttft: float, dev: int, host: int, sto: int, prefix: int = 100) -> dict[str, Any]:
        return {"turn": turn, "gap_s": gap, "ttft_s": ttft, "e2e_s": ttft + 1, "itl_s": [0.1], "error": None,
                "prefix_tokens": prefix, "prompt_tokens": prefix + 10, "cached_tokens": dev + host + sto,
                "cached": {"device": dev, "host": host, "storage": sto}}

    rows = [row(1, None, 0.5, 0, 0, 0, 50), row(2, 0.5, 0.1, 100, 0, 0), row(2, 3.0, 0.2, 0, 100, 0),
            row(3, 30.0, 0.3, 0, 0, 80), row(3, 40.0, 2.0, 0, 0, 0),
            row(2, 50.0, 0.4, 90, 0, 30)]  # cached into its new text too: only the prefix counts
    s = summarize(rows, [1.0, 10.0])
    assert set(s["by_gap"]) == {"first turn", "0-1s", "1-10s", ">10s"}
    assert s["by_gap"][">10s"]["storage_share"] == pytest.approx(90 / 300)
    assert s["by_gap"][">10s"]["device_share"] == pytest.approx(90 / 300)
    assert s["by_gap"][">10s"]["recomputed_share"] == pytest.approx(120 / 300)
    assert s["returning"]["requests"] == 5 and s["returning"]["ttft_p50_s"] == 0.3
    assert s["returning"]["ttft_p99_s"] == 2.0 and s["overall"]["ttft_p90_s"] == 2.0
    assert s["by_turn"]["3"]["storage_tokens"] == 80 and s["by_turn"]["2"]["storage_tokens"] == 10

    # backup users' requests are reported apart and nowhere else
    backup = [{**row(1, None, 9.0, 0, 0, 0, 0), "backup": True, "prompt_tokens": 2048},
              {**row(1, None, 8.0, 0, 0, 0, 0), "backup": True, "error": "boom"}]
    with_backup = summarize(rows + backup, [1.0, 10.0])
    assert {k: v for k, v in with_backup.items() if k != "backup"} == s and "backup" not in s
    assert with_backup["backup"]["requests"] == 1 and with_backup["backup"]["errors"] == 1
    assert with_backup["backup"]["ttft_p50_s"] == 9.0 and with_backup["backup"]["prompt_tokens"] == 2048
    assert "backup users" in lt.table([{"tag": "x", "config": {"gap_buckets": [1.0, 10.0]}, "summary": with_backup}])

    text = """# HELP sglang:cached_tokens_total x
sglang:cached_tokens_total{cache_source="storage"} 12.0
sglang:ttft_bucket{le="0.1"} 3.0
tierstore_pages_total{op="read",outcome="hit"} 5.0
tierstore_batch_seconds_bucket{le="0.05",op="read"} 2.0
process_cpu_seconds_total 9.0
sglang:gen_throughput 1.5
"""
    m = lt.parse_metrics(text)
    assert m == {'sglang:cached_tokens_total{cache_source="storage"}': 12.0,
                 'tierstore_pages_total{op="read",outcome="hit"}': 5.0, 'tierstore_batch_seconds_bucket{le="0.05",op="read"}': 2.0,
                 "sglang:gen_throughput": 1.5}  # tierstore's buckets kept (its batch latencies), SGLang's not
    after = {**m, 'sglang:cached_tokens_total{cache_source="storage"}': 20.0, "sglang:gen_throughput": 3.0,
             'tierstore_batch_seconds_bucket{le="0.05",op="read"}': 3.0}
    assert lt.metric_deltas(m, after) == {'sglang:cached_tokens_total{cache_source="storage"}': 8.0,
                                          'tierstore_batch_seconds_bucket{le="0.05",op="read"}': 1.0}


@pytest.mark.parametrize("bad", ["5,1", "0,3", "a,b", ""])
def test_bad_gap_buckets_are_named(bad: str) -> None:
    r = loadtest("--model-path", "x", "--gap-buckets", bad)
    assert r.returncode == 2 and "--gap-buckets" in r.stderr


def test_a_model_is_required_to_build_prompts(tmp_path: Path) -> None:
    r = loadtest("--output-dir", str(tmp_path))
    assert r.returncode == 2 and "--model-path" in r.stderr


def test_a_failed_request_is_listed_apart_not_counted_as_a_divergence() -> None:
    """As in the committed load test's third round: one request got no output (the server
    dropped its connection), which the report lists as failed and leaves out of the greedy
    comparison everywhere; a different output is still a divergence."""
    tiers = load_script("loadtest_tiers")
    def run(outputs: dict[str, str], errors: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        rows = [{"user": int(k.split("/")[0]), "turn": int(k.split("/")[1]), "error": "Server disconnected" if k in errors else None}
                for k in outputs]
        return {"outputs": outputs}, rows

    ref = {"1/1": "a", "1/2": "b", "2/1": "c"}
    runs = {"no-hicache@r1": run(ref), "l2+tierstore@r3": run({**ref, "1/2": "e3b0"}, errors=("1/2",)),
            "l2@r1": run({**ref, "2/1": "x"})}
    differing, failed = tiers.divergence(runs)
    assert differing == {"no-hicache@r1": [], "l2+tierstore@r3": [], "l2@r1": ["2/1"]}
    assert failed == {"no-hicache@r1": [], "l2+tierstore@r3": ["1/2"], "l2@r1": []}


def test_planner_shares_leave_the_system_prompt_out() -> None:
    rows = [{"prefix_tokens": 300, "cached": {"device": 150, "host": 50, "storage": 100}},  # system on device
            {"prefix_tokens": 300, "cached": {"device": 40, "host": 0, "storage": 260}}]  # system partly evicted
    own = shares(rows, 100)
    # own history: 200 tokens each; row 1: device 50, host 50, storage 100; row 2: storage 200
    assert own == pytest.approx({"device": 50 / 400, "host": 50 / 400, "storage": 300 / 400, "miss": 0.0})
    whole = shares(rows, 0)
    assert whole["device"] == pytest.approx(190 / 600) and whole["miss"] == pytest.approx(0.0)


def test_stream_chunks_fold_into_tokens() -> None:
    def fresh() -> dict[str, Any]:
        return {"output_ids": [], "text": "", "meta": {}, "usage": {}, "details": None}

    out = fresh()
    assert lt._absorb({"output_ids": [5], "text": "a", "meta_info": {"completion_tokens": 1}}, out, "native") == 1
    chunk = {"output_ids": [5, 6, 7], "text": "abc",
             "meta_info": {"completion_tokens": 3, "cached_tokens_details": {"storage": 32}}}
    assert lt._absorb(chunk, out, "native") == 2  # two tokens merged into one chunk
    assert out["output_ids"] == [5, 6, 7] and out["text"] == "abc" and out["details"] == {"storage": 32}
    inc = fresh()  # --incremental-streaming-output: each chunk carries only its new tokens
    assert lt._absorb({"output_ids": [5], "text": "a", "meta_info": {"completion_tokens": 1}}, inc, "native") == 1
    assert lt._absorb({"output_ids": [6, 7], "text": "bc", "meta_info": {"completion_tokens": 3}}, inc, "native") == 2
    assert inc["output_ids"] == [5, 6, 7] and inc["text"] == "abc"
    chat = fresh()
    assert lt._absorb({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat, "openai") == 0
    assert lt._absorb({"choices": [{"delta": {"reasoning_content": "hm"}}]}, chat, "openai") == 1
    assert lt._absorb({"choices": [{"delta": {"content": "hi"}}]}, chat, "openai") == 1
    assert lt._absorb({"choices": [], "sglext": {"cached_tokens_details": {"device": 16, "storage": 0}}}, chat, "openai") == 0
    assert lt._absorb({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}}, chat, "openai") == 0
    assert chat["text"] == "hi" and chat["details"] == {"device": 16, "storage": 0} and chat["usage"]["prompt_tokens"] == 30
    with pytest.raises(RuntimeError, match="boom"):
        lt._absorb({"error": "boom"}, chat, "native")


def test_storage_io_and_paired_differences() -> None:
    tiers = load_script("loadtest_tiers")
    rank = 'dp_rank="0",tp_rank="0"'
    delta = {f'tierstore_pages_total{{op="write",outcome="stored",{rank}}}': 300.0,
             f'tierstore_pages_total{{op="write",outcome="exists",{rank}}}': 20.0,
             f'tierstore_pages_total{{op="read",outcome="hit",{rank}}}': 100.0,
             f'tierstore_bytes_total{{op="write",{rank}}}': 600e6, f'tierstore_bytes_total{{op="read",{rank}}}': 200e6,
             f'tierstore_batch_seconds_sum{{op="read",{rank}}}': 1.0, f'tierstore_batch_seconds_count{{op="read",{rank}}}': 10.0}
    # cumulative buckets: 5 read batches within 20 ms, 9 within 100 ms, the last within 500 ms
    delta.update({f'tierstore_batch_seconds_bucket{{le="{le}",op="read",{rank}}}': n
                  for le, n in (("0.02", 5.0), ("0.05", 5.0), ("0.1", 9.0), ("0.5", 10.0), ("+Inf", 10.0))})
    io = tiers.storage_io({"metrics_delta": delta, "duration_s": 60.0})
    assert (io["pages_written"], io["pages_not_written"], io["pages_read"]) == (300, 20, 100)
    assert io["mb_per_s_written"] == pytest.approx(10.0) and io["mb_read"] == pytest.approx(200.0)
    assert io["read_batch_mean_s"] == pytest.approx(0.1) and io["write_batches"] == 0
    assert (io["read_batch_p50_below_s"], io["read_batch_p90_below_s"], io["read_batch_p99_below_s"]) == (0.02, 0.1, 0.5)
    assert "l2+tierstore@x" in tiers.storage_table({"l2+tierstore@x": {"metrics_delta": delta, "duration_s": 60.0}})

    def rows(ttfts: list[float]) -> list[dict[str, Any]]:
        return ([{"user": u, "turn": 2, "ttft_s": t, "backup": False} for u, t in enumerate(ttfts)]
                + [{"user": 99, "turn": 1, "ttft_s": 5.0, "backup": True}])  # neither first turns nor backups pair

    pair = tiers.paired(rows([1.0, 2.0, 3.0, 4.0]), rows([0.9, 1.9, 2.9, 4.2])[1:])  # user 0 missing from the second
    assert pair["n"] == 3 and pair["median_s"] == pytest.approx(-0.1) and pair["faster"] == 2
    lo, hi = pair["ci95_s"]
    assert lo <= pair["median_s"] <= hi
    first = tiers.paired(rows([1.0]) + [{"user": 0, "turn": 1, "ttft_s": 2.0}], rows([1.0]) + [{"user": 0, "turn": 1, "ttft_s": 1.5}],
                         returning=False)
    assert first["n"] == 1 and first["median_s"] == pytest.approx(-0.5)  # backup users are first turns too, but left out


def test_provenance_names_the_checkout_the_server_imported(tmp_path: Path) -> None:
    tiers = load_script("loadtest_tiers")
    init = str(ROOT / "sglang_tierstore" / "__init__.py")
    log = tmp_path / "server.log"
    log.write_text(f"{tiers.IMPORT_NOTE}/elsewhere/sglang_tierstore/__init__.py\n")  # an earlier run's
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write(f"[x] starting\n{tiers.IMPORT_NOTE}{init}\n{tiers.IMPORT_NOTE}{init}\n")
    files = tiers.imported_from(str(log), offset)
    assert files == [init]
    prov = tiers.provenance(files, str(ROOT))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert prov["head"] == head.strip() and prov["checkout"] == str(ROOT) and len(prov["package_sha256"]) == 64
    with pytest.raises(RuntimeError, match="not from --tierstore-src"):
        tiers.provenance(files, str(tmp_path))
    with pytest.raises(RuntimeError, match="imported sglang_tierstore from"):
        tiers.provenance([init, "/elsewhere/sglang_tierstore/__init__.py"], None)
