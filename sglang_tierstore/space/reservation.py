"""A reservation: the slots of one write batch, from leasing them to committing the pages
written (the lease and stock protocol: docs/design.md, "The write path")."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterable, Mapping, Sequence
from typing import Counter as CounterT

from sglang_tierstore.errors import IndexUnavailable, PageIOError
from sglang_tierstore.schema import NOT_STORED
from sglang_tierstore.space.attachment import Attachment, Place, by_shard
from sglang_tierstore.space.leases import Commits, Slot


class Reservation:
    """Slots for one write batch, held by this thread from its creation to
    :meth:`commit` (use it as a context manager: housekeeping then knows the writer is
    busy). Pages it has no place for (every region pinned, pages larger than a region)
    are not stored. Slots it placed and that no commit published or gave up stay in the
    writer's lease: the next call answers them back into the stock. Why each page it did
    not store was not stored goes into ``outcomes`` (the caller counts them)."""

    def __init__(self, a: Attachment, page_bytes: int, fields: Sequence[bytes], outcomes: CounterT[str]) -> None:
        """Slots for pages of this size (``with Reservation(...) as r:``), leased,
        consecutive where the stock is: a page file is added where no region is left
        without one, and fresh regions get their disk space, here. Pages not stored are
        counted in ``outcomes`` by why."""
        a.on_use()
        self._a = a
        self.page_bytes = page_bytes
        self.fields = fields
        self.outcomes = outcomes
        self.parts = by_shard(fields, a.geometry.shards)
        self.places: list[Place] = []  # the pages placed, in batch order
        self.slots: dict[int, Slot] = {}  # batch position -> slot, placed or not

    def __enter__(self) -> "Reservation":
        with ExitStack() as stack:
            stack.enter_context(self._a.leases.writing())
            self._place()
            self._writing = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._writing.close()

    def _place(self) -> None:
        a, pb = self._a, self.page_bytes
        failed = a.fill_stock(pb, {s: len(idx) for s, idx in self.parts.items()})
        slots: dict[int, Slot] = {}
        for s, idx in self.parts.items():
            slots.update(zip(idx, a.leases.take(s, pb, len(idx))))
        unreached = sum(len(self.parts[s]) for s in failed)  # counted as their shard's failure
        at = dict(zip(slots, a.geometry.places([(sl.region, sl.slot) for sl in slots.values()], pb)))
        refs = a.files.refs({f for f, _ in at.values()})
        for i, (f, offset) in at.items():
            if f in refs:  # the rest (a file not ready any more): given up at commit
                self.places.append(Place(i, refs[f], offset))
        self.slots = slots
        self.outcomes["unreached"] += unreached
        self.outcomes["file_unready"] += len(slots) - len(self.places)
        full = len(self.fields) - len(slots) - unreached
        if full > 0:
            self.outcomes["full" if a.geometry.holds(pb) else "too_big"] += full
            a.log.warning("full", "no slot for %d page(s) of %d bytes (every region pinned by writers, or pages larger "
                          "than the store's %d-byte regions)", full, pb, a.geometry.region_bytes)

    def commit(self, written: Iterable[int], tails: Mapping[int, bytes], sync: bool) -> dict[int, int]:
        """Publish the pages at these positions (their pwritevs returned), with their
        entry tails; every other placed page is given up. A file deleted or replaced
        under the batch takes no commits; with ``sync`` each file written is
        fdatasync'ed first. One ``commit`` call per shard, in one round trip. Returns
        each committed position's status (STORED, EXISTS, NOT_STORED)."""
        a = self._a
        files = {p.pos: p.file for p in self.places}
        ok = set(written) & files.keys()
        checked = len(ok)
        for ref in {files[i] for i in ok}:
            try:
                a.pages.still_there(ref.number)
                if sync:
                    a.pages.sync(ref)
            except PageIOError as e:
                a.files.failure("io_write", ref.number, e)
                ok -= {i for i in ok if files[i] == ref}
        self.outcomes["file_gone"] += checked - len(ok)
        slots = self.slots
        calls = []
        for s, idx in self.parts.items():
            done = sorted((i for i in idx if i in ok), key=slots.__getitem__)  # runs of slots
            commits = Commits([slots[i] for i in done], [self.fields[i] for i in done], [tails[i] for i in done])
            give_up = sorted(slots[i] for i in idx if i in slots and i not in ok)
            a.leases.batch_of(s, self.page_bytes, len(idx))
            calls.append((s, done, commits, give_up, a.leases.stock_target(s, self.page_bytes, a.capacity)))
        try:
            replies = a.leases.commit(self.page_bytes, [(s, c, gu, want) for s, _, c, gu, want in calls])
        except IndexUnavailable:
            for s in self.parts:
                a.leases.forget_stock(s)  # the next call answers the lease as Redis has it
            raise
        status: dict[int, int] = {}
        for (s, done, _, _, _), rep in zip(calls, replies):
            if isinstance(rep, IndexUnavailable):
                a.shard_failed(s, rep)
                self.outcomes["unreached"] += len(done)
                continue
            status.update(zip(done, rep.status))
            self.outcomes["refused"] += rep.status.count(NOT_STORED)  # lease lost, or its region reclaimed
            a.settled(rep)
        return status
