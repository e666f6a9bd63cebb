"""The ``tierstore`` command against real stores and a real Redis: its output, its exit codes,
what it refuses and what it leaves alone. Most cases call ``main(argv)`` in this process;
a few run ``python -m sglang_tierstore`` as a user would (no terminal, HTTP scrapes)."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from tierstore_kit.engine import flip_byte, keys
from tierstore_kit.servers import free_port
from tierstore_kit.engine import MiB, engine, pages, views
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import MetricsHandler
from prometheus_client.parser import text_string_to_metric_families
from users import NOBODY, as_root, run_as

from sglang_tierstore.tools import cli, exporter, inspect
from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.embedded import ensure_embedded_redis, pid_file, redis_dir, stop_embedded_redis
from sglang_tierstore.perms import PRIVATE, modes

ROOT = Path(__file__).resolve().parent.parent
SIZES = {4096: 20, 8192: 10}  # page bytes -> pages written, one namespace each


def write(extra: dict[str, Any], page_bytes: int, n: int, tag: str) -> str:
    """``n`` pages of one namespace into the store; its id."""
    st = engine(extra)
    try:
        ns = st.namespace({"model": f"m-{tag}", "pool": "kv"}, page_bytes)
        assert all(st.write(ns, keys(n, tag), views(pages(n, page_bytes, 1)), False))
        return ns.ns
    finally:
        st.close()


@pytest.fixture
def filled(extra: dict[str, Any]) -> dict[str, int]:
    """A store holding SIZES: namespace id -> pages."""
    return {write(extra, pb, n, f"ns{pb}"): n for pb, n in SIZES.items()}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stats(capsys: pytest.CaptureFixture[str], extra: dict[str, Any]) -> dict[str, Any]:
    code, out, _ = run(capsys, "stats", "--json", "--config", json.dumps(extra))
    assert code == cli.OK
    doc: dict[str, Any] = json.loads(out)
    return doc


def python_m(*argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_tierstore", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, **kw)


class Tty(io.StringIO):
    """A terminal the user types ``answer`` on."""

    def isatty(self) -> bool:
        return True


def test_the_command_needs_neither_torch_nor_sglang_and_is_declared() -> None:
    code = ("import sys, sglang_tierstore.tools.cli; "
            "bad = [m for m in ('torch', 'sglang') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tierstore": "sglang_tierstore.tools.cli:main"}
    helped = python_m("--help")
    assert helped.returncode == 0
    assert all(c in helped.stdout for c in ("stats", "check", "clear", "drop", "redis", "plan", "predict", "exporter"))


def test_stats_shows_the_store_by_page_size_and_namespace(extra: dict[str, Any], filled: dict[str, int],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    s = stats(capsys, extra)
    assert s["store"]["prefix"] == extra["redis_prefix"] and s["store"]["paths"] == [extra["path"]]
    assert s["usage"]["pages"] == sum(SIZES.values())
    assert s["usage"]["capacity_bytes"] == TierStoreConfig.from_dict(extra).capacity_bytes
    assert s["used_bytes"] == sum(pb * n for pb, n in SIZES.items())
    assert {d["page_bytes"]: d["live"] for d in s["page_sizes"]} == SIZES
    assert {n["id"]: n["pages"] for n in s["namespaces"]} == filled
    assert {n["page_bytes"] for n in s["namespaces"]} == set(SIZES)
    assert all(f"model=m-ns{n['page_bytes']}" in n["description"] for n in s["namespaces"])
    assert s["index"] == {"url": extra["redis_url"], "embedded": False, "used_memory_bytes": s["index"]["used_memory_bytes"]}
    assert s["index"]["used_memory_bytes"] > 0
    assert s["counters"] is None

    code, out, _ = run(capsys, "stats", "--config", json.dumps(extra))
    assert code == cli.OK
    assert s["store"]["id"] in out and "30 pages" in out
    for ns, n in filled.items():
        line = next(line for line in out.splitlines() if line.startswith(ns))
        assert line.split()[3] == str(n)
    assert "--metrics-url" in out  # says why no counters are shown


def test_stats_sums_a_servers_counters_over_ranks(extra: dict[str, Any], filled: dict[str, int],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A /metrics as SGLang serves it in multiprocess mode: one series per rank."""
    reg = CollectorRegistry()
    pages_total = Counter("tierstore_pages_total", "", ["op", "outcome", "tp_rank"], registry=reg)
    pages_total.labels("read", "hit", "0").inc(3)
    pages_total.labels("read", "hit", "1").inc(4)
    pages_total.labels("read", "miss", "1").inc(2)
    Counter("sglang_other_total", "", registry=reg).inc(9)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MetricsHandler.factory(reg))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        code, out, _ = run(capsys, "stats", "--json", "--metrics-url", url, "--config", json.dumps(extra))
        assert code == cli.OK
        assert json.loads(out)["counters"] == {'tierstore_pages_total{op="read",outcome="hit"}': 7.0,
                                               'tierstore_pages_total{op="read",outcome="miss"}': 2.0}
        code, out, _ = run(capsys, "stats", "--metrics-url", url, "--config", json.dumps(extra))
        assert code == cli.OK
        assert [line.split() for line in out.splitlines()[-2:]] == [['tierstore_pages_total{op="read",outcome="hit"}', "7"],
                                                                   ['tierstore_pages_total{op="read",outcome="miss"}', "2"]]
    finally:
        server.shutdown()
        server.server_close()
    code, out, err = run(capsys, "stats", "--metrics-url", url, "--config", json.dumps(extra))
    assert code == cli.UNREACHABLE and url in err and out == ""


def test_check_reports_fixes_and_exits_by_what_remains(extra: dict[str, Any], filled: dict[str, int],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    conf = json.dumps(extra)
    assert run(capsys, "check", "--config", conf)[:2] == (cli.OK, f"store {stats(capsys, extra)['store']['id']}: no problems\n")
    st = engine(extra)
    try:
        ns = st.namespace({"model": "m-ns4096", "pool": "kv"}, 4096)
        where = inspect.where(st, ns, keys(20, "ns4096")[3])
        assert where is not None
        flip_byte(where[0], where[1] + 100)
    finally:
        st.close()
    code, out, _ = run(capsys, "check", "--no-verify", "--config", conf)
    assert code == cli.OK  # pages not read: the index agrees with itself
    code, out, _ = run(capsys, "check", "--config", conf)
    assert code == cli.PROBLEMS and "checksum mismatch" in out and out.rstrip().endswith("1 problem(s)")
    code, out, _ = run(capsys, "check", "--fix", "--config", conf)
    assert code == cli.OK and "1 problem(s) found and fixed where possible; 0 remain" in out
    assert run(capsys, "check", "--config", conf)[0] == cli.OK
    assert stats(capsys, extra)["usage"]["pages"] == sum(SIZES.values()) - 1


def test_clear_asks_refuses_without_a_terminal_and_drops_what_it_names(
        extra: dict[str, Any], filled: dict[str, int], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    conf = json.dumps(extra)
    small, large = sorted(filled, key=lambda ns: filled[ns])

    def left() -> dict[str, int]:
        return {n["id"]: n["pages"] for n in stats(capsys, extra)["namespaces"]}

    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal
    code, out, err = run(capsys, "clear", "--config", conf)
    assert code == cli.USAGE and "--yes" in err and left() == filled

    monkeypatch.setattr(sys, "stdin", Tty("n\n"))
    code, out, _ = run(capsys, "clear", "--config", conf)
    assert code == cli.DECLINED and "Drop 30 pages of every namespace" in out and "nothing dropped" in out
    assert left() == filled

    code, _, err = run(capsys, "clear", "--namespace", "0123456789abcdef", "--yes", "--config", conf)
    assert code == cli.USAGE and "unknown namespace(s) 0123456789abcdef" in err and small in err

    monkeypatch.setattr(sys, "stdin", Tty("yes\n"))
    code, out, _ = run(capsys, "clear", "--namespace", small, "--config", conf)
    assert code == cli.OK and f"Drop {filled[small]} pages of namespace(s) {small}" in out
    assert left() == {small: 0, large: filled[large]}

    code, out, _ = run(capsys, "clear", "--yes", "--config", conf)
    assert code == cli.OK and f"dropped {filled[large]} pages of every namespace" in out
    assert left() == {small: 0, large: 0}
    assert run(capsys, "check", "--config", conf)[0] == cli.OK


def test_stats_names_pages_the_regions_cannot_hold_and_drop_lets_a_new_store_be_cut_for_them(
        extra: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MiB store cut for 64 KiB pages (1 MiB regions) and a process whose pages are
    2 MiB: ``stats`` lists that namespace as not fitting; ``drop`` asks, then drops the
    store (its keys and directory), and the process, once it has found the store gone,
    creates a new one whose regions hold its pages."""
    extra = {**extra, "capacity_gb": 16 * MiB / (1 << 30)}
    conf = json.dumps(extra)
    small = write(extra, 64 << 10, 4, "small")
    st = engine(extra)
    try:
        ns = st.namespace({"model": "big", "pool": "kv"}, 2 * MiB)
        assert st.write(ns, keys(2, "big"), views(pages(2, 2 * MiB, 1)), False) == [False, False]
        s = stats(capsys, extra)
        assert {n["id"]: n["fits"] for n in s["namespaces"]} == {small: True, ns.ns: False}
        code, out, _ = run(capsys, "stats", "--config", conf)
        assert code == cli.OK and f"pages of {ns.ns} do not fit the 1.0 MiB regions" in out and "tierstore drop" in out

        old = s["store"]["id"]
        monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal
        code, _, err = run(capsys, "drop", "--config", conf)
        assert code == cli.USAGE and "drop asks before it deletes" in err and stats(capsys, extra)["store"]["id"] == old
        code, out, _ = run(capsys, "drop", "--yes", "--config", conf)
        assert code == cli.OK and f"dropped store {old}" in out
        assert not list(Path(extra["path"]).glob(f"tierstore-*/{old}"))
        st.space.housekeeping.run_once(audit=False)  # finds the store gone...
        st.space.housekeeping.run_once(audit=False)  # ...and attaches anew, creating one cut for its pages
        assert st.write(ns, keys(2, "big"), views(pages(2, 2 * MiB, 1)), False) == [True, True]
        s = stats(capsys, extra)
        assert s["store"]["id"] != old and s["usage"]["region_bytes"] >= 2 * MiB
        assert [(n["id"], n["fits"], n["pages"]) for n in s["namespaces"]] == [(ns.ns, True, 2)]
        assert run(capsys, "check", "--config", conf)[0] == cli.OK
    finally:
        st.close()


def test_clear_run_by_a_script_without_yes_deletes_nothing(extra: dict[str, Any], filled: dict[str, int],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    done = python_m("clear", "--config", json.dumps(extra), stdin=subprocess.DEVNULL)
    assert done.returncode == cli.USAGE and "no terminal" in done.stderr
    assert stats(capsys, extra)["usage"]["pages"] == sum(SIZES.values())


def test_read_only_commands_create_nothing_where_no_store_is(tmp_path: Path, extra: dict[str, Any],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "never"
    for command in ("stats", "check", "clear"):
        code, _, err = run(capsys, command, "--config", json.dumps({**extra, "path": str(missing)}))
        assert code == cli.NO_STORE and "does not exist" in err
    assert not missing.exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "stats", "--config", json.dumps({**extra, "path": str(empty)}))
    assert code == cli.NO_STORE and "no store with prefix" in err
    code, _, err = run(capsys, "stats", "--config", json.dumps({"path": str(empty)}))  # the embedded Redis
    assert code == cli.UNREACHABLE and "is not running" in err and "--start-redis" in err
    assert list(empty.iterdir()) == []  # no store directory, no embedded Redis

    code, _, err = run(capsys, "stats", "--config", json.dumps({**extra, "path": [str(empty), str(missing)]}))
    assert code == cli.UNREACHABLE and str(missing) in err and not missing.exists()


def test_a_store_is_looked_at_as_it_is(extra: dict[str, Any], filled: dict[str, int],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Another capacity_gb in the command's config is shown, never applied (a server's start-up would)."""
    code, out, _ = run(capsys, "stats", "--config", json.dumps({**extra, "capacity_gb": 2}))
    assert code == cli.OK and "(the config says 2.0 GiB" in out
    assert stats(capsys, extra)["usage"]["capacity_bytes"] == TierStoreConfig.from_dict(extra).capacity_bytes


def test_resize_changes_the_stores_capacity_for_every_process(extra: dict[str, Any], filled: dict[str, int],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Capacity is the store's: a process started with another capacity_gb keeps it, and
    ``resize`` is how an operator changes it; a value no region fits is refused, changing nothing."""
    cfg = TierStoreConfig.from_dict(extra)
    region = stats(capsys, extra)["usage"]["region_bytes"]
    code, out, err = run(capsys, "resize", "--capacity-gb", "1e-9", "--config", json.dumps(extra))
    assert code == cli.USAGE and "--capacity-gb" in err
    code, out, err = run(capsys, "resize", "--capacity-gb", f"{region / 2 / (1 << 30)!r}", "--config", json.dumps(extra))
    assert code == cli.USAGE and "--capacity-gb" in err and "regions" in err
    assert stats(capsys, extra)["usage"]["capacity_bytes"] == cfg.capacity_bytes

    new = cfg.capacity_bytes // 2
    code, out, _ = run(capsys, "resize", "--capacity-gb", f"{new / (1 << 30)!r}", "--config", json.dumps(extra))
    assert code == cli.OK and "capacity 256.0 MiB -> 128.0 MiB" in out
    st = engine(extra)  # a serving process with the old capacity_gb in its config
    try:
        assert st.space.attached().capacity == new
    finally:
        st.close()
    assert stats(capsys, extra)["usage"]["capacity_bytes"] == new
    assert stats(capsys, extra)["usage"]["pages"] == sum(SIZES.values())  # room for them all still


def test_unreachable_redis_exits_3_without_the_password(extra: dict[str, Any], filled: dict[str, int]) -> None:
    conf = {**extra, "redis_url": f"redis://:pw-s3cret@127.0.0.1:{free_port()}/0"}  # nothing listens there
    done = python_m("stats", "--config", json.dumps(conf))
    assert done.returncode == cli.UNREACHABLE
    assert "cannot reach the index at redis://:***@127.0.0.1" in done.stderr
    assert "pw-s3cret" not in done.stdout + done.stderr
    conf = {**extra, "redis_url": f"redis://127.0.0.1:{free_port()}/0", "redis_password_env": "TS_PW"}
    done = python_m("check", "--config", json.dumps(conf), env={**os.environ, "TS_PW": "pw-s3cret"})
    assert done.returncode == cli.UNREACHABLE and "pw-s3cret" not in done.stdout + done.stderr


@pytest.mark.parametrize("conf,named", [
    ({"io_threads": 0}, "'io_threads'"),
    ({"capacity": 1}, "'capacity'"),
    ({"redis_url": "http://:pw-s3cret@host/0"}, "'redis_url'"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           conf: dict[str, Any], named: str) -> None:
    code, _, err = run(capsys, "stats", "--config", json.dumps({"path": str(tmp_path), **conf}))
    assert code == cli.USAGE and named in err and "pw-s3cret" not in err


def test_config_from_a_file_or_the_environment(tmp_path: Path, extra: dict[str, Any], filled: dict[str, int],
                                               capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "tierstore.json"
    f.write_text(json.dumps(extra))
    assert run(capsys, "check", "--config", f"@{f}")[0] == cli.OK
    monkeypatch.setenv(cli.CONFIG_ENV, f"@{f}")
    assert run(capsys, "check")[0] == cli.OK
    monkeypatch.delenv(cli.CONFIG_ENV)
    code, _, err = run(capsys, "check")
    assert code == cli.USAGE and cli.CONFIG_ENV in err
    code, _, err = run(capsys, "check", "--config", "{not json")
    assert code == cli.USAGE and "--config" in err
    code, _, err = run(capsys, "check", "--config", f"@{tmp_path / 'absent.json'}")
    assert code == cli.USAGE and "absent.json" in err
    assert run(capsys, "check", "--config", str(f))[0] == cli.OK  # a path without @, as operators type it
    quoted = "'" + json.dumps({**extra, "redis_url": "redis://:pw-s3cret@127.0.0.1:1/0"}) + "'"  # quotes kept by an env file
    code, _, err = run(capsys, "check", "--config", quoted)
    assert code == cli.USAGE and "<json>" in err and "pw-s3cret" not in err
    code, _, err = run(capsys, "check", "--config", str(tmp_path / "absent.json"))
    assert code == cli.USAGE and "absent.json" in err and "No such file" in err


@pytest.fixture
def embedded_conf(tmp_path: Path) -> Iterator[dict[str, Any]]:
    path = tmp_path / "e"
    yield {"path": str(path), "capacity_gb": 0.25}
    stop_embedded_redis(str(path))


def test_redis_start_status_stop(embedded_conf: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    conf = json.dumps(embedded_conf)
    path = embedded_conf["path"]
    code, out, _ = run(capsys, "redis", "status", "--config", conf)
    assert code == cli.UNREACHABLE and "not running" in out
    code, out, _ = run(capsys, "redis", "start", "--config", conf)
    assert code == cli.OK and "started" in out and "running" in out
    assert run(capsys, "redis", "start", "--config", conf)[1].startswith(f"embedded Redis of {path}: already running")
    code, out, _ = run(capsys, "redis", "status", "--json", "--config", conf)
    status = json.loads(out)
    password = (Path(redis_dir(path)) / "secret").read_text().strip()
    assert code == cli.OK and status["running"] and status["used_memory_bytes"] > 0
    assert status["pid"] == int(Path(pid_file(path)).read_text())
    code, out, _ = run(capsys, "redis", "status", "--config", conf)
    assert code == cli.OK and f"pid             {status['pid']}" in out and password not in out

    code, _, err = run(capsys, "stats", "--config", conf)  # Redis runs, no store yet
    assert code == cli.NO_STORE
    write({**embedded_conf, "redis_url": ensure_embedded_redis(path, PRIVATE).url}, 4096, 5, "e")  # as a server joins it
    code, out, _ = run(capsys, "stats", "--config", conf)
    assert code == cli.OK and "(embedded)" in out and "5 pages" in out and password not in out

    assert run(capsys, "redis", "stop", "--config", conf)[:2] == (cli.OK, f"embedded Redis of {path}: stopped\n")
    assert run(capsys, "redis", "status", "--config", conf)[0] == cli.UNREACHABLE
    assert run(capsys, "stats", "--config", conf)[0] == cli.UNREACHABLE  # not started by a look
    code, out, _ = run(capsys, "stats", "--start-redis", "--config", conf)
    assert code == cli.OK and "5 pages" in out  # the AOF kept the index

    code, _, err = run(capsys, "redis", "status", "--config", json.dumps({**embedded_conf, "redis_url": "redis://:pw@h/0"}))
    assert code == cli.USAGE and "redis_url" in err and ":pw@" not in err


def test_a_redis_start_that_fails_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new" / "store"
    conf = {"path": str(path), "redis_server": str(tmp_path / "no-such-server")}
    code, _, err = run(capsys, "redis", "start", "--config", json.dumps(conf))
    assert code == cli.UNREACHABLE and "no-such-server" in err
    assert not (tmp_path / "new").exists()


def test_plan_is_the_residency_planner(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--help"])
    assert exited.value.code == 0 and "--gpu-tokens" in capsys.readouterr().out
    code, out, _ = run(capsys, "plan", "--bytes-per-token", "131072", "--gpu-tokens", "1000", "--host-tokens", "4000",
                       "--l3-gb", "100", "--insert-rate", "100", "--gap-median", "60", "--gap-sigma", "1",
                       "--prefix-tokens", "1000", "--recompute-ms-per-1k-tokens", "50", "--host-gbps", "10",
                       "--l3-gbps", "2", "--json")
    assert code == cli.OK and set(json.loads(out)["shares"]) == {"device", "host", "storage", "miss"}


def test_predict_is_the_planner_from_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "predict", "--users", "8", "--arrival-rate", "1", "--turns", "2", "--first-tokens", "64",
                       "--later-tokens", "32", "--output-tokens", "8", "--system-tokens", "0", "--tenants", "1",
                       "--think-median", "5", "--think-sigma", "0.5", "--prefill-ms-per-1k-tokens", "10",
                       "--decode-ms-per-token", "1", "--gpu-tokens", "100000", "--host-tokens", "200000", "--json")
    shares = json.loads(out)["shares"]
    # everything fits: all of the 72 own tokens on the device but the reply's last, never cached
    assert code == cli.OK and shares["miss"] == pytest.approx(1 / 72) and shares["device"] == pytest.approx(1 - 1 / 72)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def listening(port: int) -> list[str]:
    """The IPv4 addresses a socket listens on at ``port`` (from /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [socket.inet_ntoa(bytes.fromhex(addr)[::-1]) for local, state in ((r[1], r[3]) for r in rows)
            for addr, p in [local.split(":")] if int(p, 16) == port and state == "0A"]


def test_exporter_serves_index_gauges_over_http(extra: dict[str, Any], filled: dict[str, int]) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_tierstore", "exporter", "--port", str(port),
                             "--config", json.dumps(extra)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                got = scrape(url)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the exporter did not start"
                time.sleep(0.1)
        assert listening(port) == ["127.0.0.1"], "the exporter listens beyond loopback unless told to"
        cfg = TierStoreConfig.from_dict(extra)
        assert got["tierstore_store_up"] == 1
        assert got["tierstore_store_capacity_bytes"] == cfg.capacity_bytes
        assert got["tierstore_store_pages"] == sum(SIZES.values())
        assert got["tierstore_store_used_bytes"] == sum(pb * n for pb, n in SIZES.items())
        for pb, n in SIZES.items():
            assert got[f"tierstore_store_slots,page_bytes={pb},state=live"] == n
            assert got[f"tierstore_store_page_size_regions,page_bytes={pb}"] >= 1
        assert got["tierstore_store_regions,state=used"] >= len(SIZES)
        assert got["tierstore_store_leases"] == 0 and got["tierstore_store_page_files"] >= 1
        assert got["tierstore_store_index_memory_bytes"] > 0
        write(extra, 4096, 25, "more")  # every scrape reads the index again
        assert scrape(url)["tierstore_store_pages"] == sum(SIZES.values()) + 25
    finally:
        proc.terminate()
        proc.wait(10)


def test_exporter_reports_down_until_the_store_appears(extra: dict[str, Any]) -> None:
    collector = exporter.StoreCollector(TierStoreConfig.from_dict(extra), start_redis=False, interval_s=0)
    try:
        assert [(m.name, m.samples[0].value) for m in collector.collect()] == [("tierstore_store_up", 0)]
        write(extra, 4096, 3, "late")
        by_name = {m.name: m.samples for m in collector.collect()}
        assert by_name["tierstore_store_up"][0].value == 1 and by_name["tierstore_store_pages"][0].value == 3
    finally:
        collector.close()


def _serve(conf: dict[str, Any], n: int) -> int:
    """The service's part: start the embedded Redis of the store and write ``n`` pages;
    how many were stored."""
    url = ensure_embedded_redis(conf["path"][0], modes(conf.get("file_access", "private"))).url
    st = engine({**conf, "redis_url": url})
    try:
        ns = st.namespace({"model": "m-users", "pool": "kv"}, 4096)
        return sum(st.write(ns, keys(n, "users"), views(pages(n, 4096, 1)), False))
    finally:
        st.close()


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _tree(*dirs: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``dirs``: (owner, group, mode)."""
    return {str(p): (st.st_uid, st.st_gid, st.st_mode) for d in dirs for p in [d, *d.rglob("*")]
            for st in [p.lstat()]}


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A directory every user may enter, for stores of other users."""
    base = Path(tempfile.mkdtemp(prefix="ts-users-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@as_root
def test_root_looking_at_a_service_users_store_creates_nothing(shared_base: Path) -> None:
    """The service runs as another user; the operator adds a directory to ``path`` and runs
    the read-only commands as root: nothing appears anywhere, and the service's next start
    says why it cannot use a directory it may not write (naming ``path`` and the owner)."""
    store, added = shared_base / "s", shared_base / "added"
    store.mkdir(mode=0o700)
    os.chown(store, NOBODY, NOBODY)
    added.mkdir(mode=0o755)  # root's, as an operator makes it
    conf = {"path": [str(store)], "capacity_gb": 0.05, "redis_prefix": "users"}
    try:
        assert run_as(NOBODY, NOBODY, _serve, conf, 12) == 12
        before = _tree(store, added)
        wider = json.dumps({**conf, "path": [str(store), str(added)]})
        code, out, err = _cli("stats", "--json", "--config", wider)
        assert code == cli.OK, err
        assert json.loads(out)["usage"]["pages"] == 12
        code, out, err = _cli("check", "--config", wider)
        assert code == cli.OK and "no problems" in out, out + err
        assert _tree(store, added) == before and list(added.iterdir()) == []

        with pytest.raises(AssertionError, match=rf"ConfigError: .*'path': {added}/tierstore-users cannot be written"
                                                 rf".*{added} is owned by uid 0 \(root\)"):
            run_as(NOBODY, NOBODY, _serve, {**conf, "path": [str(store), str(added)]}, 1)
        os.chown(added, NOBODY, NOBODY)  # the operator's fix
        assert run_as(NOBODY, NOBODY, _serve, {**conf, "path": [str(store), str(added)]}, 12) == 12
    finally:
        run_as(NOBODY, NOBODY, stop_embedded_redis, str(store))


@as_root
def test_a_group_member_runs_the_read_only_commands_and_creates_nothing(shared_base: Path) -> None:
    """A ``file_access: group`` store: a member of its group (not its owner, not root) runs
    stats and check on it, joining its embedded Redis, and nothing on disk changes."""
    store = shared_base / "g"
    store.mkdir(mode=0o750)
    os.chown(store, NOBODY, NOBODY)
    conf = {"path": [str(store)], "capacity_gb": 0.05, "redis_prefix": "users", "file_access": "group"}
    member = 4242
    try:
        assert run_as(NOBODY, NOBODY, _serve, conf, 9) == 9
        before = _tree(store)
        code, out, err = run_as(member, member, _cli, "stats", "--json", "--config", json.dumps(conf), groups=[NOBODY])
        assert code == cli.OK, err
        assert json.loads(out)["usage"]["pages"] == 9
        code, out, err = run_as(member, member, _cli, "check", "--config", json.dumps(conf), groups=[NOBODY])
        assert code == cli.OK and "no problems" in out, out + err
        code, _, err = run_as(member, member, _cli, "stats", "--config", json.dumps(conf))  # not in the group
        assert code == cli.UNREACHABLE and "is not a directory this user can read" in err
        assert _tree(store) == before
    finally:
        run_as(NOBODY, NOBODY, stop_embedded_redis, str(store))


def test_a_tool_reads_the_index_it_started_once_it_has_loaded(tmp_path: Path) -> None:
    """A restarted Redis answers LOADING while it reads its data (here an RDB file, slowed to
    1 ms a key and answering between every KiB): what ``--start-redis`` waits for
    (``index.admin.wait_loaded``) before a tool reads it."""
    import redis

    from tierstore_kit.servers import RedisProc
    from sglang_tierstore.index.admin import wait_loaded

    proc = RedisProc(tmp_path / "r", args=("--key-load-delay", "1000", "--loading-process-events-interval-bytes", "1024"))
    try:
        r = redis.Redis.from_url(proc.url, retry=None)
        r.mset({f"k{i}": i for i in range(2000)})
        r.save()
        proc.kill()
        proc.proc = subprocess.Popen(proc.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:  # listening, and still loading
            try:
                r.dbsize()
                raise AssertionError("loaded before it could be seen loading")
            except redis.BusyLoadingError:
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        wait_loaded(proc.url, 30)
        assert r.dbsize() == 2000
    finally:
        proc.stop()
