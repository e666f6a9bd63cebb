#!/usr/bin/env python3
"""End to end on a GPU, without the CPU shim: cached tokens per tier, and TTFT with L3 on and off.

    python3 scripts/e2e_gpu.py [--model PATH] [--workdir /tmp/tierstore-gpu] [--out report.json]
    python3 scripts/e2e_gpu.py --cpu      # the same flow on CPU with the tiny model (checks the script)

Without --model it builds a random-weight Llama locally (8 layers, 8 KV heads of 128: 2 MiB per
64-token page; no hub is needed, the device machine reaches none). Steps:
  1. L3 off: HiCache without a storage backend. Per prompt: send it, flush L1+L2, send it again
     and time the first token: everything is recomputed.
  2. L3 on: tierstore (embedded Redis) as the dynamic backend with interface_v1. Per prompt: send
     it twice (write_through_selective backs up on the second hit), wait for L3, flush, send it
     again and time the first token: the prefix comes back from storage.
Prints a table (median TTFT each way, their ratio, cached tokens per tier) and writes JSON.
Exits non-zero unless storage hits appear and outputs are identical with L3 on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from typing import Any


from tierstore_kit.cpu_harness import tiny_model
from tierstore_kit.cpu_harness.server import Server, cpu_args, storage_args, tierstore_config
from tierstore_kit.servers import free_port

from sglang_tierstore.embedded import pid_file

GPU_FLAGS = [
    "--page-size", "64", "--mem-fraction-static", "0.5", "--enable-cache-report", "--disable-cuda-graph",
    "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", "write_through_selective",
    "--hicache-storage-prefetch-policy", "wait_complete",
]




def server_args(cpu: bool, storage: dict[str, Any] | None, context: int) -> list[str]:
    """HiCache always; tierstore as L3 only with ``storage``."""
    if cpu:
        return cpu_args(storage, hicache=True)
    return [*GPU_FLAGS, "--context-length", str(context), *(storage_args(storage) if storage else [])]


def measure(s: Server, prompts: list[list[int]], with_l3: bool) -> dict[str, Any]:
    ttfts, tiers, outs = [], [], []
    for p in prompts:
        s.generate(p)
        if with_l3:
            s.generate(p)  # second hit: backed up to L3
    if with_l3:
        time.sleep(5)  # let write-through reach L3
    s.flush()
    for p in prompts:
        ttfts.append(s.ttft(p))
    s.flush()
    for p in prompts:
        text, meta = s.generate(p)
        outs.append(text)
        tiers.append(meta.get("cached_tokens_details") or {})
    total = {k: sum(int(t.get(k, 0)) for t in tiers) for k in ("device", "host", "storage")}
    return {"ttft_s": ttfts, "ttft_median_s": statistics.median(ttfts), "cached_tokens": total, "outputs": outs}


def token_prompts(model: str, n: int, tokens: int) -> list[list[int]]:
    """``n`` prompts of ``tokens`` random token ids of the model's vocabulary (seeded)."""
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rnd = random.Random(0)
    return [[rnd.randrange(10, vocab) for _ in range(tokens)] for _ in range(n)]


def conclude(report: dict[str, Any]) -> bool:
    """Compare the report's two sides (``l3_off``, ``l3_on``: :func:`measure`'s) in place,
    print the table; whether storage hits appeared with outputs identical either way."""
    off, on = report["l3_off"], report["l3_on"]
    report["ttft_ratio_off_over_on"] = off["ttft_median_s"] / on["ttft_median_s"]
    same = off.pop("outputs") == on.pop("outputs")
    report["outputs_identical"] = same
    print(f"model {report['model']}: {report['prompts']} prompts of {report['prompt_tokens']} tokens, after flushing L1+L2")
    print(f"{'':8} {'TTFT median':>12} {'device':>8} {'host':>8} {'storage':>8}")
    for label in ("l3_off", "l3_on"):
        r = report[label]
        c = r["cached_tokens"]
        print(f"{label:8} {1000 * r['ttft_median_s']:10.1f}ms {c['device']:8d} {c['host']:8d} {c['storage']:8d}")
    print(f"TTFT L3 off / L3 on: {report['ttft_ratio_off_over_on']:.2f}x; outputs identical: {same}")
    return same and on["cached_tokens"]["storage"] > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--workdir", default="/tmp/tierstore-gpu")
    ap.add_argument("--cpu", action="store_true", help="run on CPU with the tiny model and the test shim")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default: 4096 on GPU, 256 on CPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tokens = a.prompt_tokens or (256 if a.cpu else 4096)
    if a.model:
        model = a.model
    elif a.cpu:
        model = tiny_model.build(os.path.join(a.workdir, "tiny"))
    else:
        model = tiny_model.build(os.path.join(a.workdir, "llama-8l"), hidden=1024, layers=8, heads=8, kv_heads=8)
    prompts = token_prompts(model, a.prompts, tokens)
    store = os.path.join(a.workdir, "store")
    storage = tierstore_config(path=store, capacity_gb=4 if a.cpu else 64)
    log = os.path.join(a.workdir, "server.log")
    os.makedirs(a.workdir, exist_ok=True)

    report: dict[str, Any] = {"model": model, "prompts": a.prompts, "prompt_tokens": tokens, "cpu": a.cpu}
    for label, cfg in (("l3_off", None), ("l3_on", storage)):
        with Server(model, free_port(), log, server_args(a.cpu, cfg, tokens + 64), cpu=a.cpu) as s:
            s.wait_ready(timeout=900)
            report[label] = measure(s, prompts, with_l3=cfg is not None)
    os.kill(int(open(pid_file(store)).read()), signal.SIGTERM)
    ok = conclude(report)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
