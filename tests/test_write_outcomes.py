"""Every page a write call is given ends in exactly one ``tierstore_pages_total{op="write"}``
outcome: stored, exists, or the reason it was not stored. An operator (and the stress run)
can then attribute every page not stored to a cause, with nothing left over. Here: stored,
exists, io_error, file_gone, io_timeout and raised; full in test_leases.py; not_attached in
test_attach_wait.py; the rest
(too_big, unreached, file_unready, refused, detached) by the same per-call count."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from tierstore_kit.engine import keys
from tierstore_kit.servers import RedisProc
from tierstore_kit.engine import Hook, MiB, engine, hooked, pages, views

from sglang_tierstore.errors import IndexUnavailable, PageIOError
from sglang_tierstore.store import TierStore

OUTCOMES = ("stored", "exists", "full", "too_big", "unreached", "file_unready", "io_error", "io_timeout", "file_gone",
            "refused", "detached", "not_attached", "raised")


@pytest.fixture
def cfg(tmp_path: Path, redis_proc: RedisProc) -> dict[str, Any]:
    return {"path": str(tmp_path / "store"), "redis_url": redis_proc.url, "redis_prefix": "wo-" + uuid.uuid4().hex[:10],
            "capacity_gb": 64 * MiB / (1 << 30), "io_threads": 2}


def write_outcomes(st: TierStore, ns: Any, ks: list[str], size: int, seed: int) -> tuple[list[bool], dict[str, int]]:
    """One write call and the outcomes it added; asserts they account for every page once."""
    before = st.stats()
    got = st.write(ns, ks, views(pages(len(ks), size, seed)), False)
    after = st.stats()
    added = {o: after.get(f"write_{o}", 0) - before.get(f"write_{o}", 0) for o in OUTCOMES}
    assert sum(added.values()) == len(ks), added
    assert added["stored"] + added["exists"] == sum(got), (added, got)
    return got, {o: n for o, n in added.items() if n}


def test_stored_exists_and_failed_io_are_one_outcome_per_page(cfg: dict[str, Any]) -> None:
    hooks: dict[str, Hook] = {}
    st = engine(cfg, page_files=hooked(hooks))
    try:
        ns = st.namespace({}, 64 << 10)
        ks = keys(8)
        assert write_outcomes(st, ns, ks[:4], 64 << 10, 1) == ([True] * 4, {"stored": 4})
        assert write_outcomes(st, ns, ks[:6], 64 << 10, 1) == ([True] * 6, {"exists": 4, "stored": 2})

        def eio(real: Hook, *args: Any) -> None:
            raise PageIOError(errno.EIO, "I/O error")

        hooks["write"] = eio
        assert write_outcomes(st, ns, keys(3, "eio"), 64 << 10, 2) == ([False] * 3, {"io_error": 3})

        def replaced(real: Hook, ref: Any, *args: Any) -> None:  # the file swapped for another under the batch
            real(ref, *args)
            path = real.__self__._open[ref.number].path  # type: ignore[attr-defined]
            with open(path + ".x", "wb") as f:
                f.truncate(os.path.getsize(path))
            os.replace(path + ".x", path)

        hooks["write"] = replaced
        assert write_outcomes(st, ns, keys(1, "gone"), 64 << 10, 3) == ([False], {"file_gone": 1})
        hooks.clear()
        got, added = write_outcomes(st, ns, keys(2, "after"), 64 << 10, 4)  # (stock slots in the replaced file fail)
        assert set(added) <= {"stored", "io_error", "file_unready"}
    finally:
        st.close()


def test_pages_a_stalled_disk_did_not_write_in_time_are_io_timeouts(cfg: dict[str, Any]) -> None:
    release = threading.Event()
    hooks: dict[str, Hook] = {}
    st = engine(cfg, write_timeout_s=0.3, page_files=hooked(hooks))
    try:
        ns = st.namespace({}, 64 << 10)
        assert write_outcomes(st, ns, keys(2, "warm"), 64 << 10, 5)[0] == [True] * 2

        def stalled(real: Hook, *args: Any) -> None:
            release.wait(10)
            real(*args)

        hooks["write"] = stalled
        assert write_outcomes(st, ns, keys(2, "late"), 64 << 10, 6) == ([False] * 2, {"io_timeout": 2})
    finally:
        release.set()
        st.close()


def test_a_write_that_raises_counts_each_of_its_pages_once(tmp_path: Path, private_redis: RedisProc) -> None:
    """The index goes away under a store that has written before: the write raises
    IndexUnavailable (the adapter turns it into failed writes), and every page of it is
    counted once, as ``raised``."""
    st = engine({"path": str(tmp_path / "s"), "redis_url": private_redis.url, "redis_prefix": "wr", "io_threads": 2,
                 "capacity_gb": 64 * MiB / (1 << 30), "redis_timeout_s": 0.3, "redis_retry_s": 0.3})
    try:
        ns = st.namespace({}, 64 << 10)
        assert write_outcomes(st, ns, keys(2, "before"), 64 << 10, 1) == ([True] * 2, {"stored": 2})
        private_redis.kill()
        before = st.stats().get("write_raised", 0)
        with pytest.raises(IndexUnavailable):
            st.write(ns, keys(5, "down"), views(pages(5, 64 << 10, 2)), False)
        assert st.stats()["write_raised"] - before == 5
    finally:
        st.close()
