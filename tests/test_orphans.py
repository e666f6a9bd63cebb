"""Orphans: store directories the index lost (a FLUSHALL under traffic) are counted by
``tierstore stats`` and the exporter, named once at each start, removed by housekeeping
only with the embedded index, and by ``tierstore gc``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import MiB, engine, pages, views

from sglang_tierstore import TierStore, TierStoreConfig
from sglang_tierstore.embedded import ensure_embedded_redis, stop_embedded_redis
from sglang_tierstore.errors import TierStoreError
from sglang_tierstore.perms import PRIVATE
from sglang_tierstore.space.attach import store_dir
from sglang_tierstore.tools import cli, exporter, inspect

PAGE = 64 * 1024
N = 24  # pages per batch


def write(st: TierStore, tag: str) -> list[bool]:
    ns = st.namespace({"model": "m-orphans", "pool": "kv"}, PAGE)
    return st.write(ns, keys(N, tag), views(pages(N, PAGE, len(tag))), False)


def read(st: TierStore, tag: str) -> list[bool]:
    ns = st.namespace({"model": "m-orphans", "pool": "kv"}, PAGE)
    return st.read(ns, keys(N, tag), views([bytearray(PAGE) for _ in range(N)]), False)


def wipe_under_traffic(st: TierStore, url: str) -> tuple[str, str]:
    """Pages written, the index flushed between batches, housekeeping finding the store gone
    and attaching anew, and writes going on: (the lost store's id, the new one's)."""
    assert all(write(st, "a"))
    old = st.space.attached().geometry.store_id
    with redis.Redis.from_url(url) as r:
        r.flushall()
    with contextlib.suppress(TierStoreError):  # the batch that meets the wipe
        write(st, "b")
    st.space.housekeeping.run_once()  # finds the store gone
    st.space.housekeeping.run_once()  # attaches anew: a new store beside the lost one
    assert all(write(st, "c"))
    new = st.space.attached().geometry.store_id
    assert new != old
    return old, new


def disk_bytes(d: str) -> int:
    return sum(e.stat().st_blocks * 512 for e in os.scandir(d))


def said(caplog: pytest.LogCaptureFixture, d: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "`tierstore gc`" in r.getMessage() and d in r.getMessage()]


def stats(capsys: pytest.CaptureFixture[str], conf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    assert cli.main(["stats", "--json", "--config", json.dumps(conf)]) == cli.OK
    doc = json.loads(capsys.readouterr().out)
    assert cli.main(["stats", "--config", json.dumps(conf)]) == cli.OK
    return doc, capsys.readouterr().out


def test_an_external_index_wiped_under_traffic_leaves_an_orphan_that_is_reported_and_kept(
        tmp_path: Path, private_redis: RedisProc, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    conf = {"path": str(tmp_path / "store"), "redis_url": private_redis.url, "redis_prefix": "o-" + uuid.uuid4().hex[:8],
            "capacity_gb": 16 / 1024, "io_threads": 2}
    with engine(conf) as st:
        old, new = wipe_under_traffic(st, private_redis.url)
    lost = store_dir(conf["path"], conf["redis_prefix"], old)
    size = disk_bytes(lost)
    assert size >= N * PAGE

    doc, text = stats(capsys, conf)
    assert doc["store"]["id"] == new
    assert doc["orphans"] == {"dirs": 1, "bytes": size, "paths": [lost]}
    assert f"1 store directory no store in the index claims, {size / MiB:.1f} MiB on disk: {lost}" in text
    collector = exporter.StoreCollector(TierStoreConfig.from_dict(conf), start_redis=False, interval_s=0)
    try:
        got = {m.name: m.samples[0].value for m in collector.collect() if m.samples}
    finally:
        collector.close()
    assert got["tierstore_store_orphan_dirs"] == 1 and got["tierstore_store_orphan_bytes"] == size

    os.utime(lost, (time.time() - 86400,) * 2)  # long unchanged: still never removed with an external index
    for e in os.scandir(lost):
        os.utime(e.path, (time.time() - 86400,) * 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang_tierstore"), engine(conf) as st:
        assert all(read(st, "c"))
        for _ in range(3):
            st.space.housekeeping.run_once(audit=True)
        assert os.path.isdir(lost) and "orphans_removed" not in st.metrics.snapshot()
    assert len(said(caplog, lost)) == 1, "one warning at the start names it and `tierstore gc`"
    assert "orphan_gc_s" not in said(caplog, lost)[0]

    assert cli.main(["gc", "--config", json.dumps(conf), "--min-age-s", "0", "--yes"]) == cli.OK
    assert f"removed {lost}" in capsys.readouterr().out and not os.path.exists(lost)
    doc, _ = stats(capsys, conf)
    assert doc["orphans"] == {"dirs": 0, "bytes": 0, "paths": []} and doc["usage"]["pages"] == N


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """A config with the embedded index (no redis_url) and that index's URL."""
    conf = {"path": str(tmp_path / "e"), "redis_prefix": "o-" + uuid.uuid4().hex[:8], "capacity_gb": 16 / 1024,
            "io_threads": 2, "redis_timeout_s": 5.0}
    yield conf, ensure_embedded_redis(conf["path"], PRIVATE).url
    stop_embedded_redis(conf["path"])


def test_with_the_embedded_index_housekeeping_removes_orphans_once_old_and_leaves_the_live_store(
        embedded: tuple[dict[str, Any], str], capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    conf, url = embedded
    shift = [0.0]
    clock: Callable[[], float] = lambda: time.time() + shift[0]  # noqa: E731
    cfg = TierStoreConfig.from_dict(conf)
    with TierStore(cfg, url, clock) as st:  # wiped twice
        first, _ = wipe_under_traffic(st, url)
        second, new = wipe_under_traffic(st, url)
        st.space.housekeeping.run_once()
    lost = [store_dir(conf["path"], conf["redis_prefix"], x) for x in (first, second)]
    assert all(os.path.isdir(d) for d in lost), "fresh orphans stay"
    doc = stats(capsys, conf)[0]
    assert sorted(doc["orphans"]["paths"]) == sorted(lost)
    assert doc["orphans"]["bytes"] == sum(map(disk_bytes, lost)) >= 2 * N * PAGE

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang_tierstore"), TierStore(cfg, url, clock) as st:
        assert st.space.attached().geometry.store_id == new
        st.space.housekeeping.run_once()
        assert all(os.path.isdir(d) for d in lost), "changed within orphan_gc_s: kept"
        shift[0] = 1800.0
        for p in [*lost, *(e.path for d in lost for e in os.scandir(d))]:
            os.utime(p, (time.time() - 86400,) * 2)
        st.space.housekeeping.run_once()
        assert all(os.path.isdir(d) for d in lost), "looked for once per orphan_gc_s, not at every pass"
        shift[0] = cfg.orphan_gc_s + 1
        st.space.housekeeping.run_once()
        assert not any(os.path.exists(d) for d in lost)
        assert st.metrics.snapshot()["orphans_removed"] == 2
        assert all(read(st, "c")) and all(write(st, "d"))
        assert inspect.check(st) == []
    warned = [m for m in said(caplog, lost[0]) if lost[1] in m]
    assert len(warned) == 1 and "2 store directories" in warned[0] and "orphan_gc_s" in warned[0]
    assert all(any(f"removed store directory {d} " in r.getMessage() for r in caplog.records) for d in lost)
    assert stats(capsys, conf)[0]["orphans"]["dirs"] == 0


@pytest.mark.parametrize("setting", [{"orphan_gc_s": 0}, {"shared_fs": True}], ids=["off", "shared_fs"])
def test_housekeeping_keeps_them_when_off_or_on_a_shared_filesystem(
        embedded: tuple[dict[str, Any], str], setting: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Another node's index may hold a store in a shared directory: only the warning, and gc."""
    conf, url = embedded
    cfg = TierStoreConfig.from_dict({**conf, **setting})
    with TierStore(cfg, url) as st:
        old, _ = wipe_under_traffic(st, url)
    lost = store_dir(conf["path"], conf["redis_prefix"], old)
    for p in [lost, *(e.path for e in os.scandir(lost))]:
        os.utime(p, (time.time() - 86400,) * 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang_tierstore"), TierStore(cfg, url) as st:
        st.space.housekeeping.run_once()
        assert os.path.isdir(lost) and "orphans_removed" not in st.metrics.snapshot()
    assert len(said(caplog, lost)) == 1 and "orphan_gc_s" not in said(caplog, lost)[0]
