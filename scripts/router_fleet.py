#!/usr/bin/env python3
"""Two SGLang servers behind `sglang-router` on one index and one shared store directory: the
worker that served a user's turns stops, and the other's first request for that history must
be served from storage with the same greedy output.

    python3 scripts/router_fleet.py --model meta-llama/Llama-3.1-8B-Instruct \
        --redis-cluster n1:6379 n2:6379 n3:6379 --path /mnt/shared/tierstore

On a GPU node (each server gets one GPU: ``CUDA_VISIBLE_DEVICES`` 0 and 1), or with ``--cpu``
on the tiny model and the suite's CPU shim (what ``tests/test_router.py`` runs). The index:
``--redis-url`` or ``--redis-cluster`` seeds. Prints what each step saw; exits 1 if storage
hits are missing or an output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Optional

import requests


from tierstore_kit.cpu_harness.server import HICACHE_FLAGS, Server, conversation, cpu_args, storage_args, tierstore_config
from tierstore_kit.servers import free_port




class Router:
    """`python -m sglang_router.launch_router` with the cache-aware policy over ``workers``."""

    def __init__(self, workers: list[str], log: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *workers, "--policy", "cache_aware", "--retry-max-retries", "3", "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
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
        """Greedy output and meta_info (retried while the router still tries a stopped worker)."""
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
    """Requests a server's log shows it served."""
    with open(log, "rb") as f:
        return f.read().count(b"POST /generate")


def scenario(servers: dict[str, Server], logs: dict[str, str], router: Router, prompts: list[str]) -> dict[str, Any]:
    """A user's turns through the router, the worker that took them stopped, the last turn
    again: which worker took what, the other's storage hits, whether outputs match."""
    before = {n: served(logs[n]) for n in servers}
    reference = [router.generate(p)[0] for p in prompts]
    took = [n for n in servers if served(logs[n]) > before[n]]
    first = took[0] if len(took) == 1 else None
    out: dict[str, Any] = {"took_the_turns": took}
    if first is None:
        return out
    other = next(n for n in servers if n != first)
    time.sleep(3)  # write-through of the last turn (asynchronous) reaches L3
    servers[first].stop()
    text, meta = router.generate(prompts[-1])
    out.update(stopped=first, then_served_by=other if served(logs[other]) > before[other] else None,
               cached=meta.get("cached_tokens_details") or {}, same_output=text == reference[-1])
    return out


def ok(result: dict[str, Any]) -> bool:
    return (len(result["took_the_turns"]) == 1 and result.get("then_served_by") is not None
            and result.get("cached", {}).get("storage", 0) > 0 and bool(result.get("same_output")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model path or name (with --cpu: default the suite's tiny model, built here)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU with the suite's shim and flags")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--redis-url")
    where.add_argument("--redis-cluster", nargs="+", metavar="HOST:PORT")
    ap.add_argument("--path", required=True, help="the store directory both servers use (a shared mount across nodes)")
    ap.add_argument("--capacity-gb", type=float, default=64.0)
    ap.add_argument("--logs", default=".", help="directory for the servers' and the router's logs")
    a = ap.parse_args()
    model: Optional[str] = a.model
    if model is None:
        if not a.cpu:
            ap.error("--model is required without --cpu")
        from tierstore_kit.cpu_harness import tiny_model

        model = tiny_model.build(os.path.join(a.logs, "tiny-model"))
    index = {"redis_url": a.redis_url} if a.redis_url else {"redis_cluster": a.redis_cluster}
    prefix = "router-" + uuid.uuid4().hex[:6]
    logs = {n: os.path.join(a.logs, f"{n}.log") for n in ("a", "b", "router")}
    servers: dict[str, Server] = {}
    for i, n in enumerate(("a", "b")):
        cfg = tierstore_config(**index, redis_prefix=prefix, path=a.path, capacity_gb=a.capacity_gb, node_name=f"node-{n}")
        args = cpu_args(cfg) if a.cpu else [*HICACHE_FLAGS, "--enable-cache-report", *storage_args(cfg)]
        servers[n] = Server(model, free_port(), logs[n], args, cpu=a.cpu,
                            env=None if a.cpu else {"CUDA_VISIBLE_DEVICES": str(i)})
    router = None
    try:
        for s in servers.values():
            s.wait_ready()
        router = Router([s.url for s in servers.values()], logs["router"])
        result = scenario(servers, logs, router, conversation(3))
    finally:
        if router is not None:
            router.stop()
        for s in servers.values():
            s.stop()
    print(json.dumps(result, indent=1))
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
