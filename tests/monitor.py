"""Redis MONITOR for tests: every command a server ran, as it saw it."""

from __future__ import annotations

import socket
import threading
import uuid
from collections import Counter

HANG_S = 30.0


def monitor_args(line: str) -> list[str]:
    """The quoted arguments of one MONITOR line (escapes kept as written)."""
    out, i = [], line.index('"')
    while i < len(line):
        if line[i] != '"':
            i += 1
            continue
        j, buf = i + 1, []
        while line[j] != '"':
            if line[j] == "\\":
                buf.append(line[j : j + 2])
                j += 2
            else:
                buf.append(line[j])
                j += 1
        out.append("".join(buf))
        i = j + 1
    return out


class Monitor:
    """MONITOR on a raw connection, collected in a thread. :meth:`lines` ends it once a
    marker sent after everything else has come back: every command before it is in."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.buf = b""
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        with self.cond:  # only once the server answered MONITOR does it show other clients' commands
            assert self.cond.wait_for(lambda: self.buf.startswith(b"+OK\r\n"), HANG_S), "MONITOR was not answered"

    def _run(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            with self.cond:
                self.buf += chunk
                self.cond.notify_all()

    def lines(self) -> list[str]:
        marker = f"monitor-end-{uuid.uuid4().hex}".encode()
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(b"ECHO " + marker + b"\r\n")
            s.recv(256)
        with self.cond:
            assert self.cond.wait_for(lambda: marker in self.buf, HANG_S), "MONITOR did not see the marker"
            raw = self.buf[: self.buf.index(marker)]
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv
        self.thread.join(HANG_S)
        self.sock.close()
        lines = raw.decode("latin-1").split("\r\n")[:-1]  # the last one is the marker's
        return [ln for ln in lines if ln.startswith("+") and '"' in ln]

    def commands(self) -> Counter[str]:
        """Commands clients sent (not those the server's functions ran), by name."""
        return Counter(monitor_args(ln)[0].upper() for ln in self.lines() if "lua]" not in ln)
