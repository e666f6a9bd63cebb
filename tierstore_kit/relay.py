"""Relays on loopback that hold every reply for a fixed delay: a fleet's network in front of
local Redis/Valkey servers, where this kernel has no netem. A client's bytes go through at
once; each chunk a server sends back is delivered ``delay_s`` after it arrived, in order, so
a round trip costs one delay however many commands it pipelines, and round trips to several
servers at once overlap. The relays run in a process of their own (an asyncio loop), so
the benchmark's client keeps its core and its GIL."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from types import TracebackType
from typing import Optional, Sequence

CHUNK = 1 << 16


class Relays:
    """One relay per target port, started on entering: ``ports[i]`` relays to ``targets[i]``."""

    def __init__(self, targets: Sequence[int], delay_s: float) -> None:
        self.targets, self.delay_s = list(targets), delay_s
        self.ports: list[int] = []
        self._proc: Optional[subprocess.Popen[str]] = None

    def __enter__(self) -> Relays:
        self._proc = subprocess.Popen([sys.executable, "-m", "tierstore_kit.relay", "--delay-s", repr(self.delay_s),
                                       *map(str, self.targets)], stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # its ports, once it listens
        if not line:
            self.close()
            raise RuntimeError("the relays did not start")
        self.ports = json.loads(line)
        return self

    def __exit__(self, t: Optional[type[BaseException]], e: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None


async def _main(targets: list[int], delay_s: float) -> None:
    ports = []
    for target in targets:
        server = await asyncio.start_server(lambda r, w, t=target: _relay(r, w, t, delay_s), "127.0.0.1", 0)
        ports.append(server.sockets[0].getsockname()[1])
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()  # until killed


async def _relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: int, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        client_w.close()
        return
    replies: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def up() -> None:  # requests: at once; the client gone, so is the server's connection
        try:
            while data := await client_r.read(CHUNK):
                server_w.write(data)
                await server_w.drain()
        finally:
            server_w.close()

    async def received() -> None:  # replies: stamped with when they are due
        while data := await server_r.read(CHUNK):
            replies.put_nowait((loop.time() + delay_s, data))
        replies.put_nowait((0.0, b""))

    async def down() -> None:  # ... and delivered then, in order
        while True:
            due, data = await replies.get()
            if not data:
                return
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            client_w.write(data)
            await client_w.drain()

    try:
        await asyncio.gather(up(), received(), down())
    except (ConnectionError, OSError):
        pass
    finally:
        client_w.close()
        server_w.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="relays on loopback holding every reply for --delay-s; prints their ports")
    ap.add_argument("--delay-s", type=float, required=True)
    ap.add_argument("targets", type=int, nargs="+", help="loopback ports to relay to")
    a = ap.parse_args()
    asyncio.run(_main(a.targets, a.delay_s))
