"""A write/read workload whose every hit is checked byte for byte, for the failover tests.

A page's bytes are a function of its key (and the page size), so a read can tell a hit that
returned another key's (or a stale) page: ``wrong``. Nothing else is assumed of the store:
misses and failed writes are counted; an exception other than StoreUnavailable is an error.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from tierstore_kit.engine import housekeep, views

from sglang_tierstore import TierStore
from sglang_tierstore.tools import inspect
from sglang_tierstore.errors import StoreUnavailable
from sglang_tierstore.schema import entry_field, shard_of
from sglang_tierstore.store import Namespace

PAGE = 4096


def content(key: str, size: int = PAGE) -> bytearray:
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return bytearray((seed * (size // len(seed) + 1))[:size])


@dataclass
class Tally:
    written: int = 0
    stored: int = 0
    hits: int = 0
    misses: int = 0
    wrong: int = 0
    errors: list[str] = field(default_factory=list)


class Workload:
    """Writes batches of new keys and reads back everything written so far."""

    def __init__(self, st: TierStore, ns: Namespace, prefix: str = "k", batch: int = 32) -> None:
        self.st, self.ns, self.prefix, self.batch = st, ns, prefix, batch
        self.keys: list[str] = []
        self.stored: set[str] = set()
        self.tally = Tally()
        self._n = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def write(self, n: Optional[int] = None) -> list[str]:
        ks = [f"{self.prefix}{self._n + i}" for i in range(n or self.batch)]
        self._n += len(ks)
        try:
            ok = self.st.write(self.ns, ks, views([content(k) for k in ks]), False)
        except StoreUnavailable:  # the engine's way to say so (the adapter makes it failed writes)
            ok = [False] * len(ks)
        except Exception as e:  # noqa: BLE001 - anything else is a defect; counted
            self.tally.errors.append(f"write: {e!r}")
            ok = [False] * len(ks)
        self.keys += ks
        self.tally.written += len(ks)
        self.tally.stored += sum(ok)
        self.stored |= {k for k, o in zip(ks, ok) if o}
        return ks

    def read(self, ks: Optional[Sequence[str]] = None) -> list[bool]:
        """Hit or miss per key (a read serves the leading run of keys present: the rest is
        read again past each miss), every hit checked."""
        ks = list(self.keys if ks is None else ks)
        out = [bytearray(PAGE) for _ in ks]
        hits = [False] * len(ks)
        i = 0
        while i < len(ks):
            try:
                got = self.st.read(self.ns, ks[i:], views(out[i:]), False)
            except StoreUnavailable:  # every shard of these keys unreachable: misses
                got = [False] * (len(ks) - i)
            except Exception as e:  # noqa: BLE001 - anything else is a defect; counted
                self.tally.errors.append(f"read: {e!r}")
                return [False] * len(ks)
            lead = next((j for j, h in enumerate(got) if not h), len(got))
            hits[i : i + lead] = got[:lead]
            i += lead + 1
        for k, h, b in zip(ks, hits, out):
            if h:
                self.tally.hits += 1
                if b != content(k):
                    self.tally.wrong += 1
            else:
                self.tally.misses += 1
        return hits

    def run_in_background(self, every_s: float = 0.01) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self.write()
                self.read(self.keys[-4 * self.batch:])
                time.sleep(every_s)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            assert not self._thread.is_alive(), "the workload hung"


def shard_of_key(st: TierStore, ns: Namespace, key: str) -> int:
    return shard_of(entry_field(ns.ns_id, key), st.space.attached().geometry.shards)


def settle_and_check(st: TierStore, rounds: int = 3) -> list[str]:
    """Housekeeping passes, then check() (repairing what it can, then checking again)."""
    for _ in range(rounds):
        housekeep(st)
    inspect.check(st, fix=True)
    housekeep(st)
    return inspect.check(st)
