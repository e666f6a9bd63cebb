#!/usr/bin/env python3
"""The main job on a CPU-only machine: a real SGLang server with tierstore as its L3.

    python3 scripts/demo_cpu.py [--workdir /tmp/tierstore-demo]

Builds a tiny random Llama (no hub), then runs the real `sglang.launch_server` on
CPU three times: once without hierarchical cache (reference outputs), once with
tierstore on its embedded default (a private redis-server it starts under the
store directory) for a multi-turn chat, `POST /flush_cache` and the same turns
again, and once more after a restart. Prints where each turn's cached tokens came
from (device / host / storage) and exits non-zero unless storage hits appear and
every greedy output equals the reference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time


from tierstore_kit.cpu_harness import tiny_model
from tierstore_kit.cpu_harness.server import Server, conversation, cpu_args, tierstore_config
from tierstore_kit.servers import free_port

from sglang_tierstore.embedded import pid_file




def run_turns(server: Server, prompts: list[str], label: str) -> list[str]:
    outs = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        text, meta = server.generate(p)
        d = meta.get("cached_tokens_details") or {}
        print(f"  {label:<18} turn {i + 1}: prompt {meta['prompt_tokens']:4d} tokens, cached {meta.get('cached_tokens', 0):4d} "
              f"(device {d.get('device', 0):4d}, host {d.get('host', 0):4d}, storage {d.get('storage', 0):4d})"
              f"  {1000 * (time.perf_counter() - t0):6.0f} ms")
        outs.append(text)
    return outs


def storage_hits(server: Server, prompt: str) -> int:
    _, meta = server.generate(prompt)
    return int((meta.get("cached_tokens_details") or {}).get("storage", 0))


def reference_phase(s: Server, prompts: list[str]) -> list[str]:
    """1. The greedy outputs of a server without L3 that has cached none of ``prompts``."""
    print("1. reference: SGLang without hierarchical cache")
    return run_turns(s, prompts, "no HiCache")


def l3_phase(s: Server, prompts: list[str]) -> list[list[str]]:
    """2. The chat on a tierstore server: cold, again (device hits), and after flushing L1
    and L2 (storage hits); each pass's outputs."""
    print("2. tierstore L3 (embedded Redis): chat twice, flush L1+L2, chat again")
    first = run_turns(s, prompts, "cold")
    second = run_turns(s, prompts, "device hits")
    time.sleep(2)  # write-through to L3 runs in the background
    s.flush()
    return [first, second, run_turns(s, prompts, "after flush")]


def restart_phase(s: Server, prompts: list[str]) -> int:
    """3. A server process new to the chat, on the same store: its storage hits."""
    print("3. restart: a new server on the same store")
    hits = storage_hits(s, prompts[-1])
    print(f"  first request after restart: {hits} tokens from storage")
    return hits


def verdict(reference: list[str], passes: list[list[str]], hits_after_restart: int) -> bool:
    same = all(o == reference for o in passes)
    print(f"\ngreedy outputs identical to the reference: {same}")
    print(f"storage hits after restart: {hits_after_restart} tokens")
    ok = same and hits_after_restart > 0
    print("OK: L3 turned the misses into hits" if ok else "FAILED")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/tierstore-demo")
    ap.add_argument("--keep", action="store_true", help="keep the store and its embedded Redis running")
    args = ap.parse_args()
    model = tiny_model.build(os.path.join(args.workdir, "model"))
    store = os.path.join(args.workdir, "store")
    shutil.rmtree(store, ignore_errors=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(args.workdir, "torch_extensions"))
    log = os.path.join(args.workdir, "server.log")
    prompts = conversation(3)
    cfg = tierstore_config(path=store, capacity_gb=1)
    with Server(model, free_port(), log, cpu_args()) as s:
        reference = reference_phase(s.wait_ready(), prompts)
    with Server(model, free_port(), log, cpu_args(cfg)) as s:
        passes = l3_phase(s.wait_ready(), prompts)
    with Server(model, free_port(), log, cpu_args(cfg)) as s:
        hits = restart_phase(s.wait_ready(), prompts)
    if not args.keep:
        os.kill(int(open(pid_file(store)).read()), signal.SIGTERM)
    return 0 if verdict(reference, passes, hits) else 1


if __name__ == "__main__":
    sys.exit(main())
