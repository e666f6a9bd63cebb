"""Real Redis/Valkey Clusters and Sentinel groups on loopback, for the scale-out tests.

A cluster is built the way an operator without ``redis-cli --cluster`` would: CLUSTER MEET,
CLUSTER ADDSLOTSRANGE (equal ranges, master ``i`` the ``i``-th), CLUSTER REPLICATE, then
wait for ``cluster_state:ok`` everywhere. Nodes may be killed, stopped, continued and
restarted (from their AOF); ports are at most 55535, where cluster mode works.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import redis
from tierstore_kit.servers import free_cluster_port, free_port, server_path, wait_for

SLOTS = 16384


class ServerNode:
    """One server process on a loopback port, with its own directory."""

    def __init__(self, binary: str, workdir: Path, port: int, args: Sequence[str]) -> None:
        self.binary, self.dir, self.port, self.args = binary, workdir, port, list(args)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **kw: Any) -> redis.Redis:
        """A client that does not retry: redis-py would retry a dropped or refused connection
        for seconds, while the drills kill, stop and restart nodes (wait_for polls instead)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **{"retry": None, **kw})

    def start(self) -> None:
        log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen([self.binary, *self.args], cwd=self.dir, stdout=log, stderr=log)
        log.close()
        wait_for(lambda: self.client().ping(), 20, f"{self.binary} on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


class ClusterProc:
    """``masters`` masters, each with ``replicas`` replicas, of redis-server or valkey-server."""

    def __init__(self, workdir: Path, server: str = "redis-server", masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = 1000) -> None:
        self.binary = server_path(server)
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ServerNode] = []
        for i in range(masters * (1 + replicas)):
            port = free_cluster_port()
            args = ["--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no", "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                    # a dead master's slots only go dark, not the whole cluster's (docs/configuration.md)
                    "--cluster-require-full-coverage", "no",
                    "--appendonly", "yes", "--save", "", "--repl-diskless-sync-delay", "0",
                    "--dir", str(workdir / f"n{i}")]
            self.nodes.append(ServerNode(self.binary, workdir / f"n{i}", port, args))
        first = self.nodes[0].client()
        for n in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
        wait_for(lambda: all(len(self._known(n)) == len(self.nodes) for n in self.nodes), 20, "every node to meet")
        for i in range(masters):
            lo, hi = i * SLOTS // masters, (i + 1) * SLOTS // masters - 1
            self.nodes[i].client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for j, n in enumerate(self.nodes[masters:]):
            master_id = self.node_id(self.nodes[j % masters])
            wait_for(lambda: n.client().execute_command("CLUSTER", "REPLICATE", master_id), 20, "a replica to attach")
        self.wait_ok()
        wait_for(lambda: all(self.role(n) == "slave" and self._link_up(n) for n in self.nodes[masters:]), 30,
                 "replicas in sync")

    @property
    def seeds(self) -> list[str]:
        return [n.addr for n in self.nodes]

    def _known(self, n: ServerNode) -> list[str]:
        return [ln for ln in n.client().execute_command("CLUSTER", "NODES").decode().splitlines() if ln.strip()]

    def node_id(self, n: ServerNode) -> str:
        return n.client().execute_command("CLUSTER", "MYID").decode()

    def role(self, n: ServerNode) -> str:
        return str(n.client().info("replication")["role"])

    def _link_up(self, n: ServerNode) -> bool:
        return n.client().info("replication").get("master_link_status") == "up"

    def live(self) -> list[ServerNode]:
        return [n for n in self.nodes if n.proc is not None]

    def wait_ok(self, timeout: float = 30) -> None:
        def ok() -> bool:
            for n in self.live():
                info = n.client().execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
            return True

        wait_for(ok, timeout, "cluster_state:ok on every live node")

    def masters(self) -> list[ServerNode]:
        return [n for n in self.live() if self.role(n) == "master" and self.slots_of(n)]

    def slots_of(self, n: ServerNode) -> list[tuple[int, int]]:
        me = self.node_id(n)
        out = []
        for r in n.client().execute_command("CLUSTER", "SLOTS"):
            start, end, primary = int(r[0]), int(r[1]), r[2]
            if (primary[2].decode() if isinstance(primary[2], bytes) else primary[2]) == me:
                out.append((start, end))
        return out

    def owner(self, slot: int) -> ServerNode:
        for n in self.masters():
            if any(a <= slot <= b for a, b in self.slots_of(n)):
                return n
        raise AssertionError(f"no master owns slot {slot}")

    def replica_of(self, master: ServerNode) -> ServerNode:
        mid = self.node_id(master)
        for n in self.live():
            info = n.client().execute_command("CLUSTER", "NODES").decode()
            for ln in info.splitlines():
                parts = ln.split()
                if "myself" in parts[2] and "slave" in parts[2] and parts[3] == mid:
                    return n
        raise AssertionError(f"no replica of {master.addr}")

    def move_slot(self, slot: int, dest: ServerNode, between: Callable[[], None] = lambda: None) -> int:
        """Migrate one slot to ``dest`` the way a reshard does (IMPORTING/MIGRATING, MIGRATE
        each key, SETSLOT NODE everywhere); ``between`` runs while the slot is half moved
        (ASK replies). Returns how many keys moved."""
        src = self.owner(slot)
        s, d = src.client(), dest.client()
        sid, did = self.node_id(src), self.node_id(dest)
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", did)
        moved = 0
        keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        half = keys[: len(keys) // 2]
        if half:
            s.execute_command("MIGRATE", "127.0.0.1", dest.port, "", 0, 5000, "KEYS", *half)
            moved += len(half)
        between()
        while True:
            keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if not keys:
                break
            s.execute_command("MIGRATE", "127.0.0.1", dest.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        for n in self.masters() + [dest]:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", did)
        return moved

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc is not None:
                try:
                    os.kill(n.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            n.kill()


class SentinelProc:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels watching it as ``name``."""

    def __init__(self, workdir: Path, server: str = "redis-server", replicas: int = 2, sentinels: int = 3,
                 down_after_ms: int = 500, name: str = "ts") -> None:
        self.binary = server_path(server)
        self.name = name
        base = ["--bind", "127.0.0.1", "--protected-mode", "no", "--appendonly", "yes", "--save", "",
                "--repl-diskless-sync-delay", "0"]
        self.servers: list[ServerNode] = []
        for i in range(1 + replicas):
            port = free_port()
            args = ["--port", str(port), *base, "--dir", str(workdir / f"s{i}")]
            if i:
                args += ["--replicaof", "127.0.0.1", str(self.servers[0].port)]
            self.servers.append(ServerNode(self.binary, workdir / f"s{i}", port, args))
        self.sentinels: list[ServerNode] = []
        for i in range(sentinels):
            port = free_port()
            d = workdir / f"sentinel{i}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {d}\n"
                            f"sentinel monitor {name} 127.0.0.1 {self.servers[0].port} 2\n"
                            f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
                            f"sentinel failover-timeout {name} 5000\nsentinel parallel-syncs {name} 2\n")
            self.sentinels.append(ServerNode(self.binary, d, port, [str(conf), "--sentinel"]))
        wait_for(lambda: all(s.client().info("replication").get("master_link_status") == "up"
                             for s in self.servers[1:]), 30, "replicas in sync")
        wait_for(lambda: all(self._sees_all(s, replicas, sentinels) for s in self.sentinels), 30,
                 "sentinels to see every replica and each other")

    def _sees_all(self, s: ServerNode, replicas: int, sentinels: int) -> bool:
        m = s.client().execute_command("SENTINEL", "MASTER", self.name)
        d = dict(zip(m[::2], m[1::2])) if isinstance(m, list) else m
        get = lambda k: int(d.get(k.encode(), d.get(k, 0)))  # noqa: E731
        return get("num-slaves") == replicas and get("num-other-sentinels") == sentinels - 1

    @property
    def nodes(self) -> list[str]:
        return [s.addr for s in self.sentinels]

    def primary(self) -> ServerNode:
        addr = self.sentinels[0].client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
        port = int(addr[1])
        return next(s for s in self.servers if s.port == port)

    def stop(self) -> None:
        for n in self.sentinels + self.servers:
            n.kill()
