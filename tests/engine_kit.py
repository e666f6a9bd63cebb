"""The engine over plain bytes: stores, pages and buffers without torch or SGLang."""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Optional, Sequence

from sglang_tierstore import TierStore, TierStoreConfig
from sglang_tierstore.eviction import Housekeeper
from sglang_tierstore.store import Namespace

MiB = 1 << 20


def engine(cfg: dict[str, Any], clock: Optional[Callable[[], float]] = None, **kw: Any) -> TierStore:
    c = TierStoreConfig.from_dict({**cfg, **kw})
    assert c.redis_url is not None
    return TierStore(c, c.redis_url, clock or time.time)


def housekeep(store: TierStore) -> None:
    Housekeeper(store).run_once(audit=True)


def pages(n: int, size: int, seed: int) -> list[bytearray]:
    rnd = random.Random(seed)
    return [bytearray(rnd.randbytes(size)) for _ in range(n)]


def views(bufs: Sequence[bytearray]) -> list[list[memoryview]]:
    return [[memoryview(b)] for b in bufs]


def read(store: TierStore, ns: Namespace, ks: Sequence[str]) -> tuple[list[bool], list[bytearray]]:
    out = [bytearray(ns.page_bytes) for _ in ks]
    return store.read(ns, ks, views(out), False), out
