"""The index on a Redis shared with others: an ACL user of tierstore's own that may touch
only its keys with only the commands it sends, and TLS (``rediss://``) with a client
certificate, against real redis-servers and certificates made here. Refused connections
become misses, bad TLS files stop start-up naming the key, and no password or key ever
reaches a log line (DEBUG), an error or the stats.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import ssl
import subprocess
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, engine, housekeep, pages, read, views
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import ConfigError, TierStoreBackend, TierStoreError
from sglang_tierstore.tools import inspect
from sglang_tierstore.index.acl import ACL_COMMANDS, acl_rule
from sglang_tierstore.space.library import LIBRARY

ROOT = Path(__file__).resolve().parent.parent
USER, USER_PW, ADMIN_PW = "tierstore", "user-pw-5b1e9c", "admin-pw-77d0aa"


# -- certificates and servers -------------------------------------------------------------


class Certs(NamedTuple):
    ca: Path
    server: tuple[Path, Path]  # certificate, key
    client: tuple[Path, Path]
    other_ca: Path  # signed neither
    encrypted_key: Path  # the client's key under a passphrase
    elsewhere: tuple[Path, Path]  # a server's, signed by the CA for another host only


def make_cert(d: Path, name: str, subject: str, *extra: str) -> tuple[Path, Path]:
    """A certificate and its (P-256, 0600) key: self-signed, or signed with ``-CA``."""
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "2", "-subj", f"/CN={subject}", "-keyout", str(key), "-out", str(cert), *extra],
                   check=True, capture_output=True)
    key.chmod(0o600)
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    ca, ca_key = make_cert(d, "ca", "tierstore test CA")
    signed = ("-CA", str(ca), "-CAkey", str(ca_key))
    server = make_cert(d, "server", "localhost", *signed, "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                       "-addext", "basicConstraints=critical,CA:FALSE")
    client = make_cert(d, "client", "tierstore client", *signed, "-addext", "basicConstraints=critical,CA:FALSE")
    elsewhere = make_cert(d, "elsewhere", "elsewhere.invalid", *signed, "-addext", "subjectAltName=DNS:elsewhere.invalid",
                          "-addext", "basicConstraints=critical,CA:FALSE")
    other_ca, _ = make_cert(d, "other-ca", "another CA")
    encrypted = d / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(client[1]), "-aes256", "-passout", "pass:key-pw", "-out", str(encrypted)],
                   check=True, capture_output=True)
    encrypted.chmod(0o600)
    return Certs(ca, server, client, other_ca, encrypted, elsewhere)


class TlsRedis(RedisProc):
    """A redis-server that listens only on TLS and requires a client certificate; it shows
    ``server`` (a certificate and its key; default: the one for 127.0.0.1)."""

    def __init__(self, workdir: Path, certs: Certs, server: tuple[Path, Path] | None = None) -> None:
        self.certs = certs
        self.server = server or certs.server
        super().__init__(workdir)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        c = self.certs
        return super().command() + [
            "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.server[0]),
            "--tls-key-file", str(self.server[1]), "--tls-ca-cert-file", str(c.ca), "--tls-auth-clients", "yes",
        ]

    def ping(self) -> bool:
        """A PING that checks the server's certificate against the CA but not its host name:
        it answers for a server showing ``certs.elsewhere`` too."""
        ctx = ssl.create_default_context(cafile=str(self.certs.ca))
        ctx.check_hostname = False
        ctx.load_cert_chain(*map(str, self.certs.client))
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

    def admin(self) -> redis.Redis:
        c = self.certs
        return redis.Redis.from_url(self.url, ssl_ca_certs=str(c.ca), ssl_certfile=str(c.client[0]),
                                    ssl_keyfile=str(c.client[1]))


@pytest.fixture
def tls_redis(tmp_path: Path, certs: Certs) -> Any:
    r = TlsRedis(tmp_path / "redis-tls", certs)
    yield r
    r.stop()


def lock_down(admin: redis.Redis, prefix: str, rule: str | None = None) -> None:
    """A user that may do only what tierstore with ``prefix`` needs (or ``rule``); the
    default user needs a password from now on."""
    admin.execute_command("ACL", "SETUSER", USER, "reset", "on", f">{USER_PW}", *(rule or acl_rule(prefix)).split())
    admin.config_set("requirepass", ADMIN_PW)


def admin_of(proc: RedisProc) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=proc.port, password=ADMIN_PW)


def denied(admin: redis.Redis) -> list[Any]:
    """ACL LOG entries, less redis-py's CLIENT SETINFO greeting (refused by Redis 7.2 and
    later unless the user may send it; redis-py ignores the refusal)."""
    return [e for e in admin.acl_log() if e["object"] != "client|setinfo"]


def user_url(proc: RedisProc, password: str = USER_PW) -> str:
    return proc.url.replace("://", f"://{USER}:{password}@")


def pw_file(tmp_path: Path, password: str) -> str:
    p = tmp_path / "redis-pw"
    p.write_text(password + "\n")
    p.chmod(0o600)
    return str(p)


def round_trip(be: TierStoreBackend) -> None:
    """Three pages written from one pool's pages 0-2 and read back into its pages 3-5."""
    pool = mha_pool("page_first")
    fill(pool, 7)
    be.register_mem_pool_host(pool)
    ks = keys(3, tag=uuid.uuid4().hex)
    assert be.batch_set_v1(ks, page_indices([0, 1, 2], pool.page_size)) == [True] * 3
    assert be.batch_exists(ks) == 3
    assert be.batch_get_v1(ks, page_indices([3, 4, 5], pool.page_size)) == [True] * 3
    assert [page_bytes(pool, p) for p in (3, 4, 5)] == [page_bytes(pool, p) for p in (0, 1, 2)]


def misses_only(be: TierStoreBackend) -> str:
    """Every call answers misses or False (none raises); returns the stats as text."""
    pool = mha_pool("page_first")
    fill(pool, 8)
    be.register_mem_pool_host(pool)
    ks = keys(3, tag="refused")
    assert be.batch_set_v1(ks, page_indices([0, 1, 2], pool.page_size)) == [False] * 3
    assert be.batch_exists(ks) == 0
    assert be.batch_get_v1(ks, page_indices([3, 4, 5], pool.page_size)) == [False] * 3
    stats = be.store.stats()
    assert stats["error_index_unavailable"] >= 1
    return repr(stats) + repr(be.get_stats())


def key_body(path: Path) -> str:
    """A line from the middle of a PEM private key: what a leaked key would show."""
    return path.read_text().splitlines()[1]


# -- ACL users ------------------------------------------------------------------------------


def test_the_acl_rule_allows_every_command_the_library_calls() -> None:
    called = {c.lower() for c in re.findall(r"redis\.p?call\(\s*['\"](\w+)", LIBRARY.code)}
    assert called and called <= set(ACL_COMMANDS), called - set(ACL_COMMANDS)
    assert not re.search(r"redis\.p?call\(\s*[^'\"\s]", LIBRARY.code)  # no computed command names


def test_the_docs_and_the_deploy_config_show_the_acl_rule() -> None:
    rule = acl_rule("tierstore")
    assert rule in (ROOT / "docs" / "guarantees.md").read_text()
    assert rule in (ROOT / "deploy" / "redis-tierstore.conf").read_text()


def test_an_acl_user_with_only_the_rule_does_everything_the_engine_does(
        tmp_path: Path, private_redis: RedisProc) -> None:
    """Writes past capacity (eviction), reads, housekeeping, check with fix, a capacity
    change, delete, clear, and a restart that re-formats the store, as a user that may
    touch nothing but the prefix's keys: every call works and Redis denied nothing."""
    prefix = "acl-" + uuid.uuid4().hex[:8]
    lock_down(redis.Redis(host="127.0.0.1", port=private_redis.port), prefix)
    admin = admin_of(private_redis)
    admin.set("someone-else:key", "theirs")
    cfg = {"path": str(tmp_path / "store"), "redis_url": user_url(private_redis), "redis_prefix": prefix,
           "capacity_gb": 2 * MiB / (1 << 30), "io_threads": 2}
    st = engine(cfg)
    try:
        ns = st.namespace({"model": "m"}, 65536)
        ks = keys(60)
        for i in range(0, 60, 15):
            assert st.write(ns, ks[i:i + 15], views(pages(15, 65536, i)), False) == [True] * 15
        ok, got = read(st, ns, ks[-4:])
        assert ok == [True] * 4 and got == pages(15, 65536, 45)[-4:]
        housekeep(st)
        assert inspect.check(st, fix=True) == []
        st.space.set_capacity(1 * MiB)
        housekeep(st)
        assert inspect.usage(st)["pages"] > 0 and inspect.page_sizes(st) and st.stats()["pages_evicted"]
        assert st.delete(ns, ks[-2:]) == 2
        assert st.clear([ns]) > 0
    finally:
        st.close()
    engine(cfg, capacity_gb=64 * MiB / (1 << 30)).close()  # regions 4x off: dropped and re-created
    assert denied(admin) == []  # nothing tierstore sent was denied
    assert admin.keys(f"{{{prefix}:*") and set(admin.keys()) - set(admin.keys(f"{{{prefix}:*")) == {b"someone-else:key"}
    user = redis.Redis.from_url(user_url(private_redis))
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.get("someone-else:key")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.flushall()
    assert b"someone-else:key" in user.scan(0, count=1000)[1]  # SCAN is not filtered by key patterns (docs/guarantees.md)


def test_an_acl_user_through_sglang_and_a_wrong_password(
        tmp_path: Path, private_redis: RedisProc, caplog: Any) -> None:
    prefix = "acl-" + uuid.uuid4().hex[:8]
    lock_down(redis.Redis(host="127.0.0.1", port=private_redis.port), prefix)
    caplog.set_level(logging.DEBUG)
    base = {"redis_prefix": prefix, "capacity_gb": 0.1, "interface_v1": 1, "log_interval_s": 0.01}
    with TierStoreBackend(storage_config({**base, "path": str(tmp_path / "a"), "redis_url": user_url(private_redis)}), {}) as be:
        round_trip(be)
    cfg = {**base, "path": str(tmp_path / "b"), "redis_url": user_url(private_redis, "wrong-pw-0c4f")}
    with TierStoreBackend(storage_config(cfg), {}) as be:
        stats = misses_only(be)
    assert "invalid username-password pair" in caplog.text  # the reason is logged...
    for pw in (USER_PW, "wrong-pw-0c4f"):  # ...and no password
        assert pw not in caplog.text and pw not in stats
    assert admin_of(private_redis).acl_log() != []  # Redis saw the refused login


def test_a_prefix_outside_the_acl_users_keys_stops_start_up(tmp_path: Path, private_redis: RedisProc) -> None:
    lock_down(redis.Redis(host="127.0.0.1", port=private_redis.port), "mine")
    cfg = {"path": str(tmp_path / "s"), "redis_url": user_url(private_redis), "redis_prefix": "not-mine",
           "capacity_gb": 0.1}
    with pytest.raises(TierStoreError, match=r"refused this user .*no permissions.* needs the ACL rules") as e:
        TierStoreBackend(storage_config(cfg), {})
    assert USER_PW not in str(e.value)


def test_scan_is_needed_only_to_drop_a_store_of_the_layout_before_regions(
        tmp_path: Path, private_redis: RedisProc) -> None:
    """The engine sends SCAN (which lists key names whatever the user's key patterns) only at
    start-up, when a store of the old layout is there to drop. Without ``+scan`` the engine
    works, and such a store stops start-up naming the rule."""
    rule = " ".join(w for w in acl_rule("tierstore").split() if w != "+scan")
    lock_down(redis.Redis(host="127.0.0.1", port=private_redis.port), "tierstore", rule)
    admin = admin_of(private_redis)
    admin.set("someone-else:key", "theirs")
    cfg = {"path": str(tmp_path / "s"), "redis_url": user_url(private_redis), "capacity_gb": 0.1, "interface_v1": 1}
    with TierStoreBackend(storage_config(cfg), {}) as be:
        round_trip(be)
    assert denied(admin) == []
    admin.set("tierstore:gen", "1")  # what a build before regions left in the index
    with pytest.raises(TierStoreError, match=r"refused this user .*'scan'.* needs the ACL rules"):
        TierStoreBackend(storage_config(cfg), {})


def test_a_command_denied_inside_a_script_fails_the_call_naming_the_acl_rule(
        tmp_path: Path, private_redis: RedisProc, caplog: Any) -> None:
    """HINCRBY is sent only by a script (adding a page file, at the first write; start-up
    runs no script). Redis 7.0 reports a command denied there as a plain error, not
    NOPERM: the write fails and the log line names the ACL rule all the same."""
    rule = [w for w in acl_rule("tierstore").split() if w != "+hincrby"]
    lock_down(redis.Redis(host="127.0.0.1", port=private_redis.port), "tierstore", " ".join(rule))
    caplog.set_level(logging.DEBUG)
    cfg = {"path": str(tmp_path / "s"), "redis_url": user_url(private_redis), "capacity_gb": 0.1, "interface_v1": 1}
    with TierStoreBackend(storage_config(cfg), {}) as be:
        pool = mha_pool("page_first")
        be.register_mem_pool_host(pool)
        assert be.batch_set_v1(keys(2, tag="denied"), page_indices([0, 1], pool.page_size)) == [False] * 2
    assert re.search(r"redis refused this user \(.+\); it needs the ACL rules of sglang_tierstore\.index\.acl\.acl_rule"
                     r"\(redis_prefix\)", caplog.text)
    assert USER_PW not in caplog.text
    assert [e["object"] for e in denied(admin_of(private_redis))] == ["hincrby"]
    assert be.store.stats()["error_index_acl"] >= 1  # an operator's to fix, not a bug (no internal error)


# -- TLS --------------------------------------------------------------------------------------


def tls_config(tmp_path: Path, proc: TlsRedis, **files: Path) -> dict[str, Any]:
    return {"path": str(tmp_path / "store"), "redis_url": proc.url, "capacity_gb": 0.1, "interface_v1": 1,
            "log_interval_s": 0.01, **{f"redis_tls_{k}_file": str(v) for k, v in files.items()}}


def test_pages_round_trip_over_tls_as_an_acl_user(
        tmp_path: Path, certs: Certs, tls_redis: TlsRedis, caplog: Any) -> None:
    """The user from the URL, its password from a file, the client's certificate and key."""
    lock_down(tls_redis.admin(), "tierstore")
    caplog.set_level(logging.DEBUG)
    cfg = tls_config(tmp_path, tls_redis, ca=certs.ca, cert=certs.client[0], key=certs.client[1])
    cfg.update(redis_url=tls_redis.url.replace("://", f"://{USER}@"), redis_password_file=pw_file(tmp_path, USER_PW))
    with TierStoreBackend(storage_config(cfg), {}) as be:
        round_trip(be)
        assert inspect.check(be.store) == []
    assert "rediss://***@127.0.0.1" in caplog.text  # the start-up line names the index, user part hidden
    assert USER_PW not in caplog.text and key_body(certs.client[1]) not in caplog.text


@pytest.mark.parametrize("refused", ["no client certificate", "another CA", "a certificate for another host"])
def test_a_refused_tls_connection_answers_misses(tmp_path: Path, certs: Certs, caplog: Any, refused: str) -> None:
    """The server for another host shows a certificate the CA signed for elsewhere.invalid
    only: its own readiness PING (CA checked, host name not) passes, tierstore's does not."""
    caplog.set_level(logging.DEBUG)
    client = {"cert": certs.client[0], "key": certs.client[1]}
    server, files, why = {
        "no client certificate": (certs.server, {"ca": certs.ca}, "redis unavailable"),
        "another CA": (certs.server, {"ca": certs.other_ca, **client}, "certificate verify failed"),
        "a certificate for another host": (certs.elsewhere, {"ca": certs.ca, **client},
                                           "certificate verify failed: IP address mismatch"),
    }[refused]
    proc = TlsRedis(tmp_path / "redis-tls", certs, server)
    try:
        with TierStoreBackend(storage_config(tls_config(tmp_path, proc, **files)), {}) as be:
            stats = misses_only(be)
    finally:
        proc.stop()
    assert "redis unavailable" in caplog.text and why in caplog.text
    assert key_body(certs.client[1]) not in caplog.text + stats


@pytest.mark.parametrize("url, files, match", [
    ("redis://127.0.0.1:1/0", {"ca": "CA"}, r"key 'redis_tls_ca_file': needs a TLS index \(a rediss:// redis_url or redis_cluster seeds, or redis_sentinel with .tls.: true\), got redis://"),
    (None, {"cert": "CERT", "key": "KEY"},
     r"keys 'redis_tls_cert_file', 'redis_tls_key_file': needs a TLS index \(a rediss:// redis_url or redis_cluster seeds, or redis_sentinel with .tls.: true\), got unset"),
    ("rediss://127.0.0.1:1/0", {"cert": "CERT"}, r"'redis_tls_cert_file' and 'redis_tls_key_file': set both or neither"),
    ("rediss://127.0.0.1:1/0", {"ca": "/nonexistent/ca.pem"}, r"'redis_tls_ca_file': cannot read '/nonexistent/ca.pem'"),
    ("rediss://127.0.0.1:1/0", {"ca": "KEY"}, r"'redis_tls_ca_file': .* holds no PEM certificate"),
    ("rediss://127.0.0.1:1/0", {"cert": "CERT", "key": "WORLD"},
     r"'redis_tls_key_file': .* not readable by others .*mode 644"),
    ("rediss://127.0.0.1:1/0", {"cert": "CERT", "key": "SERVER_KEY"}, r"not a PEM certificate and its private key"),
    ("rediss://127.0.0.1:1/0", {"cert": "CERT", "key": "ENCRYPTED"}, r"'redis_tls_key_file': .* is encrypted"),
    # redis-py lets URL options override tierstore's TLS settings: none is accepted
    (f"rediss://{USER}:{USER_PW}@127.0.0.1:1/0?ssl_cert_reqs=none", {"ca": "CA"},
     rf"key 'redis_url': TLS options cannot be set in the URL \(ssl_cert_reqs\): .* got "
     rf"rediss://{USER}:\*\*\*@127\.0\.0\.1:1/0\?ssl_cert_reqs=none$"),
    ("rediss://127.0.0.1:1/0?db=0&ssl%5Fcheck_hostname=false&ssl_ca_certs=/etc/x.pem&ssl_password=key-pw", {},
     r"key 'redis_url': TLS options cannot be set in the URL \(ssl_ca_certs, ssl_check_hostname, ssl_password\): "
     r".*ssl_password=\*\*\*$"),
])
def test_bad_tls_settings_stop_start_up_naming_the_key(
        tmp_path: Path, certs: Certs, url: str | None, files: dict[str, str], match: str) -> None:
    world = tmp_path / "world.key"
    world.write_bytes(certs.client[1].read_bytes())
    world.chmod(0o644)
    named = {"CA": certs.ca, "CERT": certs.client[0], "KEY": certs.client[1], "WORLD": world,
             "SERVER_KEY": certs.server[1], "ENCRYPTED": certs.encrypted_key}
    cfg = {"path": str(tmp_path / "s"), **({"redis_url": url} if url else {}),
           **{f"redis_tls_{k}_file": str(named.get(v, v)) for k, v in files.items()}}
    with pytest.raises(ConfigError, match=match) as e:
        TierStoreBackend(storage_config(cfg), {})
    assert key_body(certs.client[1]) not in str(e.value)
    assert USER_PW not in str(e.value) and "key-pw" not in str(e.value)
    assert not (tmp_path / "s").exists()  # refused before anything was created
    assert os.listdir(tmp_path) == ["world.key"]
