"""The engine over plain bytes: stores, pages, buffers and page keys without torch or SGLang,
and what a test does to the files under a store (bit rot, their size on disk)."""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import Any, Callable, Optional, Sequence

from sglang_tierstore import TierStore, TierStoreConfig
from sglang_tierstore.errors import StoreUnavailable
from sglang_tierstore.pagefile import PageFiles
from sglang_tierstore.store import Namespace

MiB = 1 << 20

Hook = Callable[..., Any]  # hook(real, *args): called instead of the real method, which it may call


def hooked(hooks: dict[str, Hook]) -> type[PageFiles]:
    """Page files whose I/O a test may wrap while the store runs: with
    ``hooks["read"] = fn`` every ``read(*args)`` becomes ``fn(real_read, *args)``. Given
    to a store as ``page_files`` (the store's own door for the bytes layer). Their
    transfers run from Python, run by run, without the C helper."""

    def through(name: str, real: Hook, *args: Any) -> Any:
        hook = hooks.get(name)
        return real(*args) if hook is None else hook(real, *args)

    class Hooked(PageFiles):
        def read(self, *args: Any) -> None:
            through("read", super().read, *args)

        def write(self, *args: Any) -> None:
            through("write", super().write, *args)

        def create(self, *args: Any) -> None:
            through("create", super().create, *args)

        def punch(self, *args: Any) -> None:
            through("punch", super().punch, *args)

        def allocate(self, *args: Any) -> None:
            through("allocate", super().allocate, *args)

    return Hooked


# Redis's socket timeout in the stores of tests and scripts, unless they set one (tests of
# timeouts do): the production default, 0.5 s, fires when the suite's parallel processes keep
# a loopback redis-server off the 2 cores that long, which is not what they test.
REDIS_TIMEOUT_S = 5.0


def engine(cfg: dict[str, Any], clock: Optional[Callable[[], float]] = None, **kw: Any) -> TierStore:
    """A store of ``cfg`` (and ``kw``), with the suite's Redis timeout unless they set one."""
    page_files = kw.pop("page_files", PageFiles)
    c = TierStoreConfig.from_dict({"redis_timeout_s": REDIS_TIMEOUT_S, **cfg, **kw})
    assert c.index_target is not None
    return TierStore(c, c.index_target, clock or time.time, page_files=page_files)


def bury(store: TierStore) -> None:
    """What the kernel does for a process killed with ``store`` open, after the test has used
    its death: its page files, index connections and threads go, and it gives nothing back
    (its leases stay in the index until they expire)."""
    a = store.space.attached()
    a.pages.close()
    a.files.close()
    store.index.close()
    store.io.close()


def housekeep(store: TierStore, audit: bool = True) -> None:
    store.space.housekeeping.run_once(audit=audit)


def sweep_all(store: TierStore) -> None:
    """Sweep every shard until a sweep has less than a call's worth of work left."""
    hk = store.space.housekeeping
    while hk.sweep(store.space.attach()) >= 256:
        pass


def pages(n: int, size: int, seed: int) -> list[bytearray]:
    rnd = random.Random(seed)
    return [bytearray(rnd.randbytes(size)) for _ in range(n)]


def views(bufs: Sequence[bytearray]) -> list[list[memoryview]]:
    return [[memoryview(b)] for b in bufs]


def read(store: TierStore, ns: Namespace, ks: Sequence[str]) -> tuple[list[bool], list[bytearray]]:
    out = [bytearray(ns.page_bytes) for _ in ks]
    return store.read(ns, ks, views(out), False), out


def keys(n: int, tag: str = "k") -> list[str]:
    """SGLang-like page keys: 64-hex SHA-256 strings."""
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def flip_byte(path: str, offset: int) -> None:
    """Bit rot: one byte of a file changes under the store."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def page_files_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            if n.endswith(".pages"):
                total += os.stat(os.path.join(root, n)).st_blocks * 512
    return total


def attached(st: TierStore) -> bool:
    """Whether ``st`` is attached to its store now (housekeeping attaches it; a call never does)."""
    try:
        st.space.attached()
        return True
    except StoreUnavailable:
        return False
