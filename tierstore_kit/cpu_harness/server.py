"""Start, query and stop a real `sglang.launch_server` (on CPU with the shim, or on a GPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

import requests

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")

BASE_FLAGS = [
    "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch", "--disable-cuda-graph", "--skip-server-warmup",
    "--page-size", "16", "--max-total-tokens", "2048", "--max-running-requests", "4",
    "--chunked-prefill-size", "512", "--context-length", "1024", "--enable-cache-report",
]
HICACHE_FLAGS = [
    "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
    "--hicache-mem-layout", "page_first_direct", "--hicache-storage-prefetch-policy", "wait_complete",
    "--hicache-write-policy", "write_through_selective",
]


def cpu_args(storage: Optional[dict[str, Any]] = None, hicache: Optional[bool] = None) -> list[str]:
    """Flags for the tiny model on CPU: HiCache if ``hicache`` (default: if ``storage``),
    with tierstore as L3 configured by ``storage``. An idle scheduler sleeps
    (``--sleep-on-idle``): without it each one spins half a core while it waits, which
    servers kept up beside others (the suite's) cannot spare on 2 cores."""
    args = [*BASE_FLAGS, "--sleep-on-idle", *(HICACHE_FLAGS if (storage is not None if hicache is None else hicache) else [])]
    return args + storage_args(storage) if storage is not None else args


def storage_args(storage: dict[str, Any]) -> list[str]:
    return ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(storage)]


def tierstore_config(**overrides: Any) -> dict[str, Any]:
    return {
        "backend_name": "tierstore", "module_path": "sglang_tierstore", "class_name": "TierStoreBackend",
        "interface_v1": 1, "prefetch_threshold": 16, **overrides,
    }


# runs the command after it (execvp) as a process the kernel kills when the one that started it
# dies (PR_SET_PDEATHSIG, kept across exec; SGLang's own children die with it): a test or a
# script killed mid-run leaves no server behind
DIE_WITH_PARENT = "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); os.execvp(sys.argv[1], sys.argv[1:])"

CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def tp_env(tp: int) -> dict[str, str]:
    """What ``--tp N`` needs on CPU besides the shim, one fact each:
    - one core list per rank in SGLANG_CPU_OMP_THREADS_BIND (SGLang refuses more ranks
      than NUMA nodes without it): here rank i gets the i-th core this process may use;
    - no NCCL: the torch wheel here ships libnccl, and SGLang then builds a PyNccl
      communicator for every group, which needs CUDA; with SGLANG_NCCL_SO_PATH pointing
      at nothing it skips it, as on a CPU-only torch (the groups themselves are gloo);
    - TORCH_COMPILE_DISABLE: with tp > 1 the vocabulary embedding's masking goes through
      torch.compile, whose C++ build takes a minute per rank on the first request.
    """
    cores = sorted(os.sched_getaffinity(0))
    return {
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(cores[i % len(cores)]) for i in range(tp)),
        "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
        "TORCH_COMPILE_DISABLE": "1",
    }


class Server:
    """One server process. ``cpu`` (default) runs it under the CPU shim; ``args`` are its flags;
    with ``admin_key`` it is started with ``--admin-api-key``, which its admin endpoints need.
    ``cwd``: where it runs (``python -m`` puts that directory first on its sys.path, ahead of
    PYTHONPATH: a checkout there is the ``sglang_tierstore`` it imports).

    ``started`` lists this process's servers (tests/conftest.py reads their logs after every
    test). Where ``TIERSTORE_SERVER_STARTS`` names a file, each start appends a line to it:
    the suite's timing counts them."""

    started: "list[Server]" = []

    def __init__(self, model: str, port: int, log_path: str, args: Sequence[str],
                 env: Optional[dict[str, str]] = None, cpu: bool = True, admin_key: Optional[str] = None,
                 cwd: Optional[str] = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        cmd = [sys.executable, "-c", DIE_WITH_PARENT, sys.executable, "-m", "sglang.launch_server", "--model-path", model,
               "--host", "127.0.0.1", "--port", str(port), *args, *(["--admin-api-key", admin_key] if admin_key else [])]
        full_env = dict(os.environ)
        if cpu:
            full_env.update(CPU_ENV)
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM, os.environ.get("PYTHONPATH", "")) if p)
        full_env.update(env or {})
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        Server.started.append(self)
        if counter := os.environ.get("TIERSTORE_SERVER_STARTS"):
            with open(counter, "a") as f:
                f.write(f"{' '.join(sys.argv[:2])} port {port}\n")

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:  # its directory cleaned up
            return 0

    def tierstore_tracebacks(self, since: int = 0) -> list[str]:
        """The tierstore log lines after byte ``since`` of the server's log that a traceback
        follows: each an internal error the backend logged (expected failures have none)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return [a.strip() for a, b in zip(lines, lines[1:]) if "tierstore " in a and b.startswith("Traceback (most recent")]

    def wait_ready(self, timeout: float = 400) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy in {timeout}s; see {self.log_path}")

    def generate(self, prompt: str | list[int], max_new_tokens: int = 8) -> tuple[str, dict[str, Any]]:
        """Greedy output and meta_info; ``prompt`` is text or token ids."""
        r = requests.post(self.url + "/generate", timeout=300, json={
            **_prompt(prompt), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        })
        r.raise_for_status()
        body = r.json()
        return body["text"], body["meta_info"]

    def ttft(self, prompt: str | list[int]) -> float:
        """Seconds from sending a streamed request to its first output chunk."""
        t0 = time.perf_counter()
        with requests.post(self.url + "/generate", timeout=300, stream=True, json={
            **_prompt(prompt), "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        }) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    return time.perf_counter() - t0
        raise RuntimeError("stream ended without output")

    def flush(self, timeout: float = 60) -> None:
        """Flush L1 and L2 (retried: SGLang refuses while write-through is in flight)."""
        deadline = time.monotonic() + timeout
        while "Cache flushed" not in self.admin("POST", "/flush_cache").text:
            if time.monotonic() > deadline:
                raise TimeoutError("flush_cache kept failing")
            time.sleep(0.5)

    def admin(self, method: str, path: str, body: Optional[dict[str, Any]] = None) -> requests.Response:
        """An admin request (``/flush_cache``, ``/hicache/...``), with the admin key if any."""
        return requests.request(method, self.url + path, headers=self.admin_headers, json=body, timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _prompt(prompt: str | list[int]) -> dict[str, Any]:
    return {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}


def conversation(turns: int = 3, salt: str = "") -> list[str]:
    """Prompts of a multi-turn chat: each turn repeats the whole history and adds to it.
    ``salt`` opens the system prompt: chats of different salts share no cached prefix."""
    system = "<|system|>" + salt + "You are a careful assistant that remembers long contexts. " * 6 + "<|end|>"
    asks = [
        "Explain how a radix tree finds the longest cached prefix of a prompt. ",
        "Now explain why reading pages back from disk is cheaper than recomputing them. ",
        "Finally, say what happens to a page whose checksum does not match. ",
        "And what if the index is lost while the files remain? ",
    ]
    prompts, history = [], system
    for i in range(turns):
        history += "<|user|>" + asks[i % len(asks)] * 3 + "<|end|><|assistant|>"
        prompts.append(history)
        history += "Understood, here is the answer in detail. " * 2 + "<|end|>"
    return prompts
