"""deploy/fleet/: a fleet's files, checked as deploy/'s are.

- docker compose: `docker compose config` resolves deploy/fleet/docker-compose.yml; its six
  Valkey nodes, the one-shot cluster-create, two SGLang nodes on one shared volume and the
  router fit together with tierstore.json;
- Kubernetes: `kubectl kustomize deploy/fleet/k8s`, every object validated against
  Kubernetes' schemas (strict), and wired the same way;
- the Valkey node's command and the cluster-create command run as written (container paths
  and names moved to loopback) on six real valkey-servers, and tierstore serves pages with
  the fleet's tierstore.json on the cluster they make.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import redis
import yaml
from tierstore_kit.servers import wait_for
from tierstore_kit.servers import free_cluster_port, server_path
from tierstore_kit.engine import engine
from scaleout_kit import Workload
from test_deploy import K8S_VERSIONS, docker_compose, run, tool

pytestmark = pytest.mark.slow
FLEET = Path(__file__).resolve().parent.parent / "deploy" / "fleet"
PASSWORD = "fleet-test-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    out = run([docker_compose(), "-f", str(FLEET / "docker-compose.yml"), "config", "--format", "json"],
              env={**os.environ, "MODEL": "some/model", "TIERSTORE_INDEX_PASSWORD": PASSWORD})
    assert out.returncode == 0, out.stderr
    model: dict[str, Any] = json.loads(out.stdout)
    return model


@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    out = run([tool("kubectl"), "kustomize", str(FLEET / "k8s")])
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def by_name(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (o,) = [x for x in objs if x["kind"] == kind and x["metadata"]["name"] == name]
    return o


def test_docker_compose_wiring(compose: dict[str, Any]) -> None:
    s = compose["services"]
    valkeys = sorted(n for n in s if n.startswith("valkey-"))
    assert valkeys == [f"valkey-{i}" for i in range(6)]
    create = " ".join(s["cluster-create"]["command"])
    assert all(f"{n}:6379" in create for n in valkeys) and "--cluster-replicas 1" in create
    ts = json.loads((FLEET / "tierstore.json").read_text())
    assert all(seed.split(":")[0] in valkeys for seed in ts["redis_cluster"])
    for n in ("sglang-a", "sglang-b"):
        vols = {v["target"]: v["source"] for v in s[n]["volumes"]}
        assert vols[ts["path"]] == "shared-pages", "every node mounts the one shared directory at tierstore.json's path"
        assert s[n]["environment"]["TIERSTORE_INDEX_PASSWORD"] == PASSWORD
        assert s[n]["depends_on"]["cluster-create"]["condition"] == "service_completed_successfully"
    router = s["router"]["command"]
    urls = router[router.index("--worker-urls") + 1 :]
    assert urls == ["http://sglang-a:30000", "http://sglang-b:30000"]
    assert PASSWORD not in " ".join(s["valkey-0"]["command"]), "the password is never on a command line"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_objects_validate_against_kubernetes_schemas(k8s: list[dict[str, Any]], version: str) -> None:
    assert sorted(o["kind"] for o in k8s) == sorted(["ConfigMap", "Service", "Service", "Service", "PersistentVolumeClaim",
                                                     "Deployment", "StatefulSet", "StatefulSet", "Job"])
    for obj in k8s:
        kubernetes_validate.validate(obj, version, strict=True)


def test_k8s_wiring(k8s: list[dict[str, Any]]) -> None:
    valkey = by_name(k8s, "StatefulSet", "valkey")["spec"]
    assert valkey["replicas"] == 6 and valkey["serviceName"] == "valkey"
    assert by_name(k8s, "Service", "valkey")["spec"]["clusterIP"] == "None"
    cm = next(o for o in k8s if o["kind"] == "ConfigMap")
    ts = json.loads(cm["data"]["tierstore.json"])
    assert ts["redis_cluster"] == [f"valkey-{i}.valkey:6379" for i in range(3)]
    sglang = by_name(k8s, "StatefulSet", "sglang")["spec"]
    pod = sglang["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    claim = vols[mounts[ts["path"]]]["persistentVolumeClaim"]["claimName"]
    assert by_name(k8s, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert vols[mounts["/etc/tierstore"]]["configMap"]["name"] == cm["metadata"]["name"]
    router = by_name(k8s, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]["command"]
    urls = router[router.index("--worker-urls") + 1 :]
    assert urls == [f"http://sglang-{i}.sglang:30000" for i in range(sglang["replicas"])]


class Node:
    def __init__(self, argv: list[str], env: dict[str, str], port: int) -> None:
        self.port = port
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: redis.Redis(port=port, password=PASSWORD, socket_timeout=2).ping(), 20, f"valkey on {port}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def nodes(tmp_path: Path, compose: dict[str, Any]) -> Iterator[list[Node]]:
    """Six valkey-servers, each started by the compose file's command as written (its paths
    moved under tmp_path, its port to a free one)."""
    argv = compose["services"]["valkey-0"]["command"]
    out = []
    for i in range(6):
        root = tmp_path / f"n{i}"
        (root / "data").mkdir(parents=True)
        (root / "run").mkdir()
        port = free_cluster_port()
        script = (argv[2].replace("$$", "$").replace("/data/", f"{root}/data/").replace("/run/", f"{root}/run/")
                  .replace("--port 6379", f"--port {port} --bind 127.0.0.1 --dir {root}/data")
                  .replace("exec valkey-server", f"exec {server_path('valkey-server')}"))
        env = {**os.environ, "TIERSTORE_INDEX_PASSWORD": PASSWORD}
        out.append(Node([argv[0], argv[1], script], env, port))
    yield out
    for n in out:
        n.stop()


def test_the_fleets_commands_make_a_cluster_that_tierstore_serves(tmp_path: Path, compose: dict[str, Any],
                                                                 nodes: list[Node]) -> None:
    assert redis.Redis(port=nodes[0].port, password=PASSWORD).info("cluster")["cluster_enabled"] == 1
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=nodes[0].port).ping()
    cli = shutil.which("valkey-cli") or shutil.which("redis-cli")
    if cli is None:
        pytest.fail("no valkey-cli or redis-cli (scripts/setup.sh installs redis-server, which brings redis-cli)")
    script = compose["services"]["cluster-create"]["command"][2].replace("$$", "$")
    for i, n in enumerate(nodes):
        script = script.replace(f"valkey-{i}:6379", f"127.0.0.1:{n.port}")
    script = script.replace("-h valkey-0", f"-h 127.0.0.1 -p {nodes[0].port}").replace("valkey-cli", cli)
    env = {**os.environ, "REDISCLI_AUTH": PASSWORD, "VALKEYCLI_AUTH": PASSWORD}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    wait_for(lambda: all(b"cluster_state:ok" in redis.Redis(port=n.port, password=PASSWORD).execute_command("CLUSTER", "INFO")
                         for n in nodes), 30, "the cluster to form")
    again = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, "cluster-create is a no-op once the nodes are one cluster"
    cfg = json.loads((FLEET / "tierstore.json").read_text())
    cfg.update(redis_cluster=[f"127.0.0.1:{n.port}" for n in nodes[:3]], path=str(tmp_path / "shared"),
               capacity_gb=64 / 1024, redis_prefix="fleet-" + uuid.uuid4().hex[:6])
    for k in ("backend_name", "module_path", "class_name", "interface_v1"):
        cfg.pop(k)
    os.environ["TIERSTORE_INDEX_PASSWORD"] = PASSWORD
    try:
        with engine(cfg) as st:
            w = Workload(st, st.namespace({"m": "fleet"}, 4096))
            for _ in range(4):
                w.write()
            assert w.tally.stored == w.tally.written and all(w.read()) and w.tally.wrong == 0
            assert st.space.attached().geometry.shards == 3  # one per master
    finally:
        del os.environ["TIERSTORE_INDEX_PASSWORD"]

