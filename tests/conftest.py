"""Shared fixtures: a real redis-server per test session (and private ones on demand)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytest

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProc:
    """A private redis-server on a loopback port, which tests may kill and restart."""

    def __init__(self, workdir: Path, appendonly: bool = False, args: Sequence[str] = ()) -> None:
        if REDIS_SERVER is None:
            pytest.fail("redis-server not installed (apt-get install redis-server); .ci/setup.sh installs it")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.args = list(args)  # more redis-server options, e.g. ("--appendfsync", "always")
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--protected-mode", "no", *self.args,
        ]

    def ping(self) -> bool:
        """One PING; raises OSError while the server does not accept connections."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.ping():
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        self.kill()


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path_factory.mktemp("redis"))
    yield r
    r.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisProc]:
    """A redis-server of this test's own, for outages."""
    r = RedisProc(tmp_path / "redis-private")
    yield r
    r.stop()


@pytest.fixture
def extra(tmp_path: Path, redis_proc: RedisProc) -> dict[str, Any]:
    """An extra_config for a fresh store: its own Redis prefix and directory."""
    return {
        "backend_name": "tierstore",
        "module_path": "sglang_tierstore",
        "class_name": "TierStoreBackend",
        "interface_v1": 1,
        "redis_url": redis_proc.url,
        "redis_prefix": "t-" + uuid.uuid4().hex[:12],
        "path": str(tmp_path / "store"),
        "capacity_gb": 0.25,
        "io_threads": 4,
    }


def keys(n: int, tag: str = "k") -> list[str]:
    """SGLang-like page keys: 64-hex SHA-256 strings."""
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def flip_byte(path: str, offset: int) -> None:
    """Bit rot: one byte of a file changes under the store."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def page_files_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            if n.endswith(".pages"):
                total += os.stat(os.path.join(root, n)).st_blocks * 512
    return total
