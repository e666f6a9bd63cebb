#!/usr/bin/env python3
"""Multi-turn load test for an SGLang server: returning users, per-tier hits, TTFT.

    python3 scripts/multiturn_loadtest.py --port 30000 --model-path MODEL --num-clients 64 \\
        --num-rounds 4 --request-rate 0.5 --think-time-median 120 --output-dir results/run1
    python3 scripts/multiturn_loadtest.py --compare results/a.summary.json results/b.summary.json \\
        --output-dir results/compare
    python3 scripts/multiturn_loadtest.py --port 30000 --model-path MODEL --backup-rate 0.05 \\
        --backup-length 2048 --output-dir results/run2     # the same, L3 writing meanwhile

Users arrive as a Poisson process (``--request-rate`` users per second). Each holds a
multi-turn conversation that resends its whole history every turn: a system prompt shared
by its tenant group, then per turn new user text and the model's reply. Between a user's
turns it thinks for a time drawn from ``--think-time-dist`` (lognormal by default), so a
returning prefix has aged by a realistic gap. That gap is what decides which tier still
holds the prefix (device, host or storage), and what this test reports against.

Streaming requests over SGLang's native ``/generate`` (token ids: exact prompt lengths and
exact prefix reuse) or the OpenAI chat API; TTFT is taken where the first token arrives.
Every request is appended to ``<output-dir>/<tag>.jsonl`` as it completes (an interrupted
run keeps what it measured); ``<tag>.summary.json`` holds the configuration, the summary
and the server's ``/metrics`` (SGLang's and the backend's counters) before and after;
PNG plots go next to them. Start the server with ``--enable-cache-report`` (the per-tier
split of cached tokens) and ``--enable-metrics``.

Backup traffic (``--backup-rate``): alongside the conversations, one-turn users with long
prompts of their own (no shared prefix, nothing a cache holds) arrive as a Poisson process for
as long as the conversations are planned to last. With ``--hicache-write-policy write_through``
SGLang copies every page it computes to host memory on its first insert and, once that copy
is acknowledged, queues it for L3 on its backup thread (``write_through_selective`` waits for
a second hit, which a one-turn user never gives), so these users keep L3 writing while the
returning users' prefetches read from it. Their requests are recorded (``"backup": true``)
and summarized apart: every other statistic covers the conversations only.

Options named as in SGLang's ``benchmark/hicache/bench_multiturn.py`` mean the same there,
except ``--request-rate`` and ``--distribution``: here they pace new users only; later turns
follow each user's think time.
Needs the ``loadtest`` extra (aiohttp, aiofiles, tqdm, matplotlib, transformers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import aiofiles
import aiohttp
from tqdm import tqdm

from tierstore_kit.multiturn import TIERS, gap_label, gap_labels, load_rows, summarize, tier_stats
from tierstore_kit.stats import percentile

DEFAULT_GAP_BUCKETS = (5.0, 15.0, 30.0, 60.0, 120.0, 300.0)
KEEPALIVE_S = 2.0  # how long an idle connection is kept for the next request


# -- workload ---------------------------------------------------------------------


@dataclass
class Turn:
    user_ids: list[int]  # the new user text of this turn, as token ids
    user_text: str
    think_s: float  # pause before this turn (0 for the first)


@dataclass
class User:
    uid: int
    tenant: int  # -1: a backup user (no system prompt)
    arrival_s: float
    turns: list[Turn]
    backup: bool = False


class TextSource:
    """Token ids and text of exact lengths from the model's tokenizer: synthetic (random
    ordinary tokens) or cut from a ShareGPT-format file."""

    def __init__(self, tokenizer: Any, rng: random.Random, dataset_path: str | None) -> None:
        self.tok = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        ordinary = [i for i in range(len(tokenizer)) if i not in special]
        # words with a leading space that encode back to themselves: tokenizers split text at
        # such boundaries before merging, so any sequence of them round-trips as text
        words = [i for i in ordinary if _round_trip_word(tokenizer, i)]
        self.vocab = words if len(words) >= 32 else ordinary
        self.sharegpt: list[list[str]] = _load_sharegpt(dataset_path) if dataset_path else []

    def exact(self, n: int, rng: random.Random | None = None) -> tuple[list[int], str]:
        """``n`` token ids and a text that encodes back to exactly them (for the chat API),
        drawn from ``rng`` (default: this source's)."""
        rng = rng or self.rng
        ids = [rng.choice(self.vocab) for _ in range(n)]
        for _ in range(8):
            text = self.tok.decode(ids)
            again = self.tok.encode(text, add_special_tokens=False)
            if again == ids:
                return ids, text
            ids = (again + [rng.choice(self.vocab) for _ in range(n)])[:n]
        return ids, self.tok.decode(ids)

    def user_turns(self, n_turns: int, first_len: int, later_len: int) -> list[tuple[list[int], str]]:
        if not self.sharegpt:
            return [self.exact(first_len if i == 0 else later_len) for i in range(n_turns)]
        conv = self.rng.choice(self.sharegpt)
        out = []
        for i in range(n_turns):
            ids = self.tok.encode(conv[i % len(conv)], add_special_tokens=False)
            limit = first_len if i == 0 else later_len
            ids = ids[:limit] if limit > 0 else ids
            out.append((ids, self.tok.decode(ids)))
        return out


def _round_trip_word(tokenizer: Any, i: int) -> bool:
    text = tokenizer.decode([i])
    return (len(text) > 1 and text[0] == " " and text[1:].isalpha()
            and tokenizer.encode(text, add_special_tokens=False) == [i])


def _load_sharegpt(path: str) -> list[list[str]]:
    """Human turns of every conversation in a ShareGPT JSON file (``conversations`` of
    ``{"from": "human"|"gpt", "value": ...}``)."""
    with open(path) as f:
        data = json.load(f)
    convs = []
    for item in data:
        human = [m["value"] for m in item.get("conversations", []) if m.get("from") in ("human", "user") and m.get("value")]
        if human:
            convs.append(human)
    if not convs:
        raise SystemExit(f"--dataset-path {path}: no conversations with human turns")
    return convs


def think_time(rng: random.Random, args: argparse.Namespace) -> float:
    if args.think_time_dist == "lognormal":
        t = rng.lognormvariate(math.log(args.think_time_median), args.think_time_sigma)
    elif args.think_time_dist == "exponential":
        t = rng.expovariate(1.0 / args.think_time_median)
    else:
        t = args.think_time_median
    return t * args.time_scale


def build_workload(args: argparse.Namespace, tokenizer: Any) -> tuple[list[User], list[tuple[list[int], str]]]:
    """Users, their turns and think times, and the tenants' system prompts: all from
    ``--seed``, so two runs against different servers send the same requests. Backup users
    come last (ids from ``--num-clients`` on), from a random stream of their own: adding
    them leaves the conversations as they were."""
    rng = random.Random(args.seed)
    src = TextSource(tokenizer, rng, args.dataset_path)
    systems = [src.exact(args.system_prompt_length) for _ in range(args.num_tenants)]
    users, t = [], 0.0
    later = args.sub_question_input_length or args.request_length
    for uid in range(args.num_clients):
        if uid:
            gap = rng.expovariate(args.request_rate) if args.distribution == "poisson" else rng.uniform(0, 2 / args.request_rate)
            t += gap * args.time_scale
        texts = src.user_turns(args.num_rounds, args.request_length, later)
        turns = [Turn(ids, text, 0.0 if i == 0 else think_time(rng, args)) for i, (ids, text) in enumerate(texts)]
        users.append(User(uid, uid % args.num_tenants, t, turns))
    return users + backup_users(args, src, users), systems


def backup_users(args: argparse.Namespace, src: TextSource, users: Sequence[User]) -> list[User]:
    """One-turn users of ``--backup-length`` tokens, ``--backup-rate`` per second (Poisson),
    from the start until the last conversation turn is planned to be sent (arrival plus
    think times; the real run ends later by the service times)."""
    if not args.backup_rate:
        return []
    rng = random.Random(f"{args.seed}/backup")
    horizon = max(u.arrival_s + sum(t.think_s for t in u.turns) for u in users)
    out: list[User] = []
    t = 0.0
    while True:
        t += rng.expovariate(args.backup_rate) * args.time_scale
        if t > horizon:
            return out
        ids, text = src.exact(args.backup_length, rng)
        out.append(User(len(users) + len(out), -1, t, [Turn(ids, text, 0.0)], backup=True))


# -- one request -----------------------------------------------------------------------


@dataclass
class Result:
    user: int
    tenant: int
    turn: int
    start_s: float  # when it was sent, from the start of the run
    gap_s: float | None  # since this user's previous turn completed (None for a first turn)
    wait_s: float  # held back by --max-parallel before it was sent
    ttft_s: float | None
    e2e_s: float | None
    itl_s: list[float]
    prompt_tokens: int
    prefix_tokens: int  # history before this turn's new text: what a cache could hold
    output_tokens: int
    cached_tokens: int
    cached: dict[str, int]  # per tier
    output_sha: str  # of the generated token ids (or text): equal outputs across runs
    error: str | None = None
    backup: bool = False  # a backup user's request: kept out of every other statistic
    output_ids: list[int] = field(default_factory=list, repr=False)
    output_text: str = field(default="", repr=False)


async def stream_request(session: Any, args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming request; return timings, the output and the server's token counts."""
    url = args.base_url + ("/generate" if args.api == "native" else "/v1/chat/completions")
    t0 = time.perf_counter()
    ttft, last, itl = None, t0, []
    out: dict[str, Any] = {"output_ids": [], "text": "", "meta": {}, "usage": {}, "details": None}
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            got = _absorb(chunk, out, args.api)
            if got:  # a chunk can carry several tokens (the server merges what piled up)
                if ttft is None:
                    ttft = now - t0
                    itl.extend([0.0] * (got - 1))
                else:
                    itl.extend([(now - last) / got] * got)
                last = now
    out.update(ttft=ttft, e2e=time.perf_counter() - t0, itl=itl)
    return out


def _absorb(chunk: dict[str, Any], out: dict[str, Any], api: str) -> int:
    """Fold one stream chunk into ``out``; how many new tokens (or text pieces) it carried."""
    if "error" in chunk:
        raise RuntimeError(str(chunk["error"])[:200])
    if api == "native":
        ids = chunk.get("output_ids") or []
        meta = chunk.get("meta_info", {})
        if len(ids) < int(meta.get("completion_tokens") or 0):  # --incremental-streaming-output: deltas
            ids = out["output_ids"] + ids
            chunk["text"] = out["text"] + chunk.get("text", "")
        grew = len(ids) - len(out["output_ids"])
        out["output_ids"], out["text"], out["meta"] = ids, chunk.get("text", ""), meta
        out["details"] = meta.get("cached_tokens_details") or out["details"]
        return max(0, grew)
    if chunk.get("usage"):
        out["usage"] = chunk["usage"]
    ext = chunk.get("sglext") or {}
    if ext.get("cached_tokens_details"):
        out["details"] = ext["cached_tokens_details"]
    deltas = [c.get("delta") or {} for c in chunk.get("choices") or []]
    out["text"] += "".join(d.get("content") or "" for d in deltas)
    return sum(1 for d in deltas if d.get("content") or d.get("reasoning_content"))


def payload_for(args: argparse.Namespace, history_ids: list[int], messages: list[dict[str, str]]) -> dict[str, Any]:
    if args.api == "native":
        return {"input_ids": history_ids, "stream": True, "sampling_params": {
            "max_new_tokens": args.output_length, "temperature": 0, "ignore_eos": True}}
    return {"model": args.served_model_name or args.model_path, "messages": messages, "stream": True,
            "max_tokens": args.output_length, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "return_cached_tokens_details": True}


# -- the run -----------------------------------------------------------------------------


class Recorder:
    """Appends each result to the JSONL file as it arrives."""

    def __init__(self, path: str, total: int) -> None:
        self._open = aiofiles.open(path, "w")
        self._f: Any = None
        self.results: list[Result] = []
        self.bar = tqdm(total=total, unit="req", desc="requests", file=sys.stderr)

    async def __aenter__(self) -> Self:
        self._f = await self._open.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._f.close()
        self.bar.close()

    async def add(self, r: Result) -> None:
        self.results.append(r)
        row = asdict(r)
        row.pop("output_ids")
        row.pop("output_text")
        await self._f.write(json.dumps(row) + "\n")
        await self._f.flush()
        self.bar.update(1)
        if r.error:
            self.bar.write(f"user {r.user} turn {r.turn}: {r.error}")


async def run_user(u: User, systems: list[tuple[list[int], str]], args: argparse.Namespace, session: Any,
                   sem: asyncio.Semaphore, rec: Recorder, t_start: float) -> None:
    await asyncio.sleep(max(0.0, t_start + u.arrival_s - time.perf_counter()))
    sys_ids, sys_text = systems[u.tenant] if not u.backup else ([], "")
    history = list(sys_ids)
    messages = [{"role": "system", "content": sys_text}] if not u.backup else []
    prev_end: float | None = None
    prefix = len(sys_ids)  # what this turn resends before its new text
    for n, turn in enumerate(u.turns):
        if n:
            await asyncio.sleep(turn.think_s)
        history += turn.user_ids
        messages.append({"role": "user", "content": turn.user_text})
        ready = time.perf_counter()
        async with sem:
            sent = time.perf_counter()
            gap = None if prev_end is None else sent - prev_end
            try:
                out = await stream_request(session, args, payload_for(args, history, messages))
                error = None if out["ttft"] is not None else "no output"
            except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:  # recorded; the user goes on
                out, error = {"output_ids": [], "text": "", "meta": {}, "usage": {}, "details": None,
                              "ttft": None, "e2e": None, "itl": []}, f"{type(e).__name__}: {e}"
        prev_end = time.perf_counter()
        rec_ = _result(u, n, sent - t_start, gap, sent - ready, prefix, len(history), out, error)
        await rec.add(rec_)
        prefix = rec_.prompt_tokens + rec_.output_tokens
        history += out["output_ids"]
        messages.append({"role": "assistant", "content": out["text"]})


def _result(u: User, n: int, start: float, gap: float | None, wait: float, prefix: int, prompt_len: int,
            out: dict[str, Any], error: str | None) -> Result:
    meta, usage = out["meta"], out["usage"]
    details = out["details"] or {}
    prompt = int(meta.get("prompt_tokens") or usage.get("prompt_tokens") or prompt_len)
    cached = int(meta.get("cached_tokens") or (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    ids = out["output_ids"]
    digest = hashlib.sha256((json.dumps(ids) if ids else out["text"]).encode()).hexdigest()[:16]
    return Result(
        user=u.uid, tenant=u.tenant, turn=n + 1, start_s=start, gap_s=gap, wait_s=wait, ttft_s=out["ttft"],
        e2e_s=out["e2e"], itl_s=out["itl"], prompt_tokens=prompt, prefix_tokens=prefix,
        output_tokens=len(ids) or int(meta.get("completion_tokens") or usage.get("completion_tokens") or 0),
        cached_tokens=cached, cached={t: int(details.get(t) or 0) for t in TIERS}, output_sha=digest,
        error=error, backup=u.backup, output_ids=ids, output_text=out["text"],
    )


async def flusher(args: argparse.Namespace, session: Any, stop: asyncio.Event, log: list[float], t0: float) -> None:
    """POST /flush_cache every --flush-interval seconds (L1 and L2 dropped: what a long
    gap under memory pressure does); ``log`` gets the times (from ``t0``) of those that
    succeeded. SGLang refuses while requests are in flight."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), args.flush_interval)
            return
        except TimeoutError:
            pass
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):  # a refused flush is no flush
            async with session.post(args.base_url + "/flush_cache") as r:
                if r.status == 200 and "flushed" in (await r.text()).lower():
                    log.append(time.perf_counter() - t0)


async def scrape_metrics(session: Any, base_url: str) -> dict[str, float]:
    """SGLang's /metrics (with the backend's own counters), as ``name{labels}`` -> value;
    histogram buckets left out. Empty if the server runs without --enable-metrics."""
    try:
        async with session.get(base_url + "/metrics") as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError):
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or ("_bucket{" in line and not line.startswith("tierstore_")):
            continue  # SGLang's histogram buckets; tierstore's batch latencies keep theirs
        name, _, value = line.rpartition(" ")
        if name.startswith(("sglang:", "tierstore_")):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer  # slow to import: only when running

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model_path)
    users, systems = build_workload(args, tokenizer)
    os.makedirs(args.output_dir, exist_ok=True)
    jsonl = os.path.join(args.output_dir, f"{args.tag}.jsonl")
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # no connection pool limit (--max-parallel is the cap: a request waiting for a connection
    # after its clock started would count as TTFT); idle connections dropped well before the
    # server's keep-alive (SGLANG_TIMEOUT_KEEP_ALIVE, 5 s) closes them, or a request sent on one
    # the server closes at that moment fails with "Server disconnected"; native chunks repeat
    # the output so far
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     read_bufsize=1 << 22) as session:
        before = await scrape_metrics(session, args.base_url)
        sem = asyncio.Semaphore(args.max_parallel)
        stop, flushes = asyncio.Event(), []
        async with Recorder(jsonl, sum(len(u.turns) for u in users)) as rec:
            t0 = time.perf_counter()
            flush_task = asyncio.create_task(flusher(args, session, stop, flushes, t0)) if args.flush_interval else None
            await asyncio.gather(*(run_user(u, systems, args, session, sem, rec, t0) for u in users))
            duration = time.perf_counter() - t0
            stop.set()
            if flush_task:
                await flush_task
        after = await scrape_metrics(session, args.base_url)
    results = sorted(rec.results, key=lambda r: (r.start_s, r.user))
    summary = {
        "tag": args.tag, "config": {k: v for k, v in vars(args).items() if k != "compare"},
        "jsonl": os.path.basename(jsonl), "duration_s": duration, "flushes_s": flushes,
        "summary": summarize([asdict(r) for r in results], args.gap_buckets),
        "outputs": {f"{r.user}/{r.turn}": r.output_sha for r in results},
        "metrics_before": before, "metrics_after": after, "metrics_delta": metric_deltas(before, after),
    }
    async with aiofiles.open(os.path.join(args.output_dir, f"{args.tag}.summary.json"), "w") as f:
        await f.write(json.dumps(summary, indent=1))
    return summary


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters (``*_total``, histogram ``_sum``/``_count``/``_bucket``) over the run."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k.split("{")[0].endswith(("_total", "_sum", "_count", "_bucket")) and v != before.get(k, 0.0)}


# -- summary ------------------------------------------------------------------------------




def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """One block per grouping (overall, returning, by turn, by gap), one row per run."""
    lines = []
    width = max(18, 1 + max(len(s["tag"]) for s in summaries))
    head = f"{'':<24}{'run':<{width}}{'n':>5}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}" + "".join(f"{t:>9}" for t in TIERS) + f"{'recomp':>9}"
    groups: list[tuple[str, list[str]]] = [("overall", ["overall"]), ("returning turns", ["returning"]),
                                           ("backup users", ["backup"])]
    turns = sorted({k for s in summaries for k in s["summary"]["by_turn"]}, key=int)
    gaps = [g for g in gap_labels(summaries[0]["config"]["gap_buckets"]) if any(g in s["summary"]["by_gap"] for s in summaries)]
    groups += [(f"turn {t}", ["by_turn", t]) for t in turns] + [(f"gap {g}", ["by_gap", g]) for g in gaps]
    lines.append(head)
    for label, path in groups:
        first = True
        for s in summaries:
            node: Any = s["summary"]
            for p in path:
                node = node.get(p) if node else None
            if not node:
                continue
            lines.append(f"{label if first else '':<24}{s['tag']:<{width}}{node['requests']:>5}{_ms(node['ttft_p50_s']):>9}"
                         f"{_ms(node['ttft_p90_s']):>9}{_ms(node['ttft_p99_s']):>9}"
                         + "".join(f"{_share(node[f'{t}_share']):>9}" for t in TIERS) + f"{_share(node['recomputed_share']):>9}")
            first = False
    return "\n".join(lines)


# -- plots ------------------------------------------------------------------------------------


def plot(runs: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]], out_dir: str, prefix: str) -> list[str]:
    """TTFT CDF, TTFT by turn, cached share per tier against the return gap, and hits per
    tier over time; one curve (or panel) per run; the conversations only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"device": "tab:green", "host": "tab:blue", "storage": "tab:orange", "recomputed": "tab:gray"}
    paths = []
    runs = [(s, [r for r in rows if not r.get("backup")]) for s, rows in runs]

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out_dir, f"{prefix}{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, returning in zip(axes, (False, True)):
        for s, rows in runs:
            v = sorted(r["ttft_s"] for r in rows if r["ttft_s"] is not None and (r["turn"] > 1 or not returning))
            if v:
                ax.step([1000 * x for x in v], [(i + 1) / len(v) for i in range(len(v))], where="post", label=s["tag"])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("returning turns" if returning else "all requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, "ttft_cdf")

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, rows in runs:
        turns = sorted({r["turn"] for r in rows})
        med = [percentile([r["ttft_s"] for r in rows if r["turn"] == t and r["ttft_s"] is not None], 0.5) for t in turns]
        p90 = [percentile([r["ttft_s"] for r in rows if r["turn"] == t and r["ttft_s"] is not None], 0.9) for t in turns]
        line = ax.plot(turns, [1000 * (m or 0) for m in med], marker="o", label=f"{s['tag']} p50")[0]
        ax.plot(turns, [1000 * (m or 0) for m in p90], marker="x", ls="--", color=line.get_color(), label=f"{s['tag']} p90")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT by turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "ttft_by_turn")

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False, sharey=True)
    for ax, (s, all_rows) in zip(axes[0], runs):
        rows = [r for r in all_rows if not r["error"]]
        edges = s["config"]["gap_buckets"]
        labels = [g for g in gap_labels(edges)[1:] if any(gap_label(r["gap_s"], edges) == g for r in rows)]
        stats = [tier_stats([r for r in rows if gap_label(r["gap_s"], edges) == g]) for g in labels]
        bottom = [0.0] * len(labels)
        for tier in (*TIERS, "recomputed"):
            vals = [(st[f"{tier}_share"] if tier != "recomputed" else st["recomputed_share"]) or 0.0 for st in stats]
            ax.bar(labels, vals, bottom=bottom, color=colors[tier], label=tier)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, st in enumerate(stats):
            ax.text(i, 1.01, f"n={st['requests']}", ha="center", fontsize=7)
        ax.set_ylim(0, 1.1)
        ax.set_xlabel("gap since the user's previous turn")
        ax.set_title(s["tag"])
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    axes[0][0].set_ylabel("share of the resent prefix")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    save(fig, "residency")

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False, sharex=True)
    for ax, (s, rows) in zip(axes[:, 0], runs):
        end = max((r["start_s"] for r in rows), default=0.0)
        width = max(5.0, end / 40)
        bins = [i * width for i in range(int(end / width) + 2)]
        for tier in TIERS:
            sums = [0.0] * len(bins)
            for r in rows:
                sums[int(r["start_s"] // width)] += r["cached"][tier]
            ax.plot(bins, [x / width for x in sums], color=colors[tier], label=tier)
        ax.set_ylabel("cached tok/s")
        ax.set_title(s["tag"], fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("time since start (s)")
    axes[0][0].legend(fontsize=8)
    save(fig, "hits_over_time")
    return paths


# -- command line --------------------------------------------------------------------------


def _gap_buckets(s: str) -> list[float]:
    try:
        edges = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gap-buckets: not a comma-separated list of seconds: {s!r}") from None
    if not edges or edges != sorted(set(edges)) or edges[0] <= 0:
        raise argparse.ArgumentTypeError(f"--gap-buckets: need increasing positive seconds, got {s!r}")
    return edges


def _positive(kind: type) -> Any:
    def parse(s: str) -> Any:
        v = kind(s)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {s}")
        return v
    parse.__name__ = kind.__name__
    return parse


def _non_negative(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {s}")
    return v


def _non_negative_float(s: str) -> float:
    v = float(s)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {s}")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    srv.add_argument("--base-url", help="overrides --host/--port, e.g. http://10.0.0.5:30000")
    srv.add_argument("--api", choices=("native", "openai"), default="native",
                     help="native /generate with token ids (exact lengths and reuse), or /v1/chat/completions with text")
    srv.add_argument("--model-path", help="the served model: its tokenizer builds the prompts")
    srv.add_argument("--tokenizer", help="tokenizer path, if not --model-path's")
    srv.add_argument("--served-model-name", help="model name for the chat API (default: --model-path)")
    srv.add_argument("--request-timeout", type=_positive(float), default=600.0)
    w = p.add_argument_group("workload (bench_multiturn.py names)")
    w.add_argument("--num-clients", type=_positive(int), default=32, help="users (conversations)")
    w.add_argument("--num-rounds", type=_positive(int), default=4, help="turns per user")
    w.add_argument("--request-length", type=_positive(int), default=256, help="tokens of new user text in the first turn")
    w.add_argument("--sub-question-input-length", type=_non_negative, default=0,
                   help="tokens of new user text in later turns (0: --request-length)")
    w.add_argument("--output-length", type=_positive(int), default=64, help="tokens generated per turn (greedy, ignore_eos)")
    w.add_argument("--request-rate", type=_positive(float), default=0.5, help="new users per second")
    w.add_argument("--distribution", choices=("poisson", "uniform"), default="poisson", help="of the gaps between new users")
    w.add_argument("--max-parallel", type=_positive(int), default=16, help="cap on requests in flight")
    w.add_argument("--dataset-path", help="ShareGPT-format JSON: human turns as user text (else synthetic tokens)")
    w.add_argument("--seed", type=int, default=1)
    w2 = p.add_argument_group("returning users")
    w2.add_argument("--system-prompt-length", type=_non_negative, default=512, help="tokens of each tenant group's shared system prompt")
    w2.add_argument("--num-tenants", type=_positive(int), default=4, help="tenant groups, each with its own system prompt")
    w2.add_argument("--think-time-dist", choices=("lognormal", "exponential", "fixed"), default="lognormal")
    w2.add_argument("--think-time-median", type=_positive(float), default=60.0,
                    help="seconds between a user's turns: median (lognormal), mean (exponential) or value (fixed)")
    w2.add_argument("--think-time-sigma", type=_positive(float), default=1.0, help="lognormal sigma")
    w2.add_argument("--time-scale", type=_positive(float), default=1.0,
                    help="multiplies think times and users' arrival gaps, backup users' too (e.g. 0.1 for a short run)")
    w2.add_argument("--flush-interval", type=_non_negative_float, default=0.0,
                    help="POST /flush_cache this often (seconds; 0: never): L1 and L2 emptied, as after a long gap")
    w3 = p.add_argument_group("backup traffic (one-turn users whose KV is written through to L3)")
    w3.add_argument("--backup-rate", type=_non_negative_float, default=0.0,
                    help="backup users per second, for as long as the conversations are planned to last (0: none)")
    w3.add_argument("--backup-length", type=_positive(int), default=2048, help="tokens of each backup user's prompt")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="loadtest_results")
    o.add_argument("--tag", default="run", help="names this run's files and its curves in --compare")
    o.add_argument("--gap-buckets", type=_gap_buckets, default=list(DEFAULT_GAP_BUCKETS),
                   help="comma-separated edges (seconds) of the gap buckets in the summary")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--compare", nargs="+", metavar="SUMMARY_JSON",
                   help="no run: the table and plots of these runs side by side")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(None if argv is None else list(argv))
    os.makedirs(args.output_dir, exist_ok=True)
    if args.compare:
        runs = [load_rows(path) for path in args.compare]
        print(table([s for s, _ in runs]))
        if not args.no_plots:
            for path in plot(runs, args.output_dir, "compare_"):
                print("wrote", path)
        return 0
    if not args.model_path and not args.tokenizer:
        p.error("--model-path (or --tokenizer) is required to build prompts")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    summary = asyncio.run(run(args))
    print(table([summary]))
    if not args.no_plots:
        jsonl = os.path.join(args.output_dir, summary["jsonl"])
        with open(jsonl) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for path in plot([(summary, rows)], args.output_dir, f"{args.tag}_"):
            print("wrote", path)
    return 0 if summary["summary"]["overall"]["requests"] else 1  # every request failed


if __name__ == "__main__":
    sys.exit(main())
