"""Regions and files, as numbers: how a store is cut, and where a slot lies. Pure.

A store has one region size ``R``, fixed when it is created (:func:`region_bytes_for`):
capacity / 16 rounded down to a power of two, clamped to 64 KiB..64 MiB, and at least the
largest page the store is created for (rounded up to a power of two, up to 1 GiB). At
least 16 regions means eviction never takes more than 1/16 of the store at once and two or
three page sizes each find room even in a store of a few MiB; at most 64 MiB for ordinary
pages keeps what one eviction drops to a blink of a 500 GB store (0.013%) and the slots of
a region few enough for one call to walk (16,384 of 4 KiB), while a 128-page write of
256 KiB pages still fits one region. A store's capacity may later change to anything that
holds a region, or to 0 (:func:`check_capacity`): the region size stays.

A page file holds ``regions_per_file`` regions after a 4 KiB header; file ``n`` holds
regions ``n * regions_per_file ...``, and belongs to shard ``n % shards``. A region is
cut into slots of the page size rounded up to 4 KiB (the O_DIRECT alignment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from sglang_tierstore.schema import HEADER_BYTES, round_up

MiB = 1 << 20
GiB = 1 << 30
MIN_REGION = 64 << 10
MAX_REGION = 64 * MiB  # for pages up to this size
MAX_PAGE = 1 * GiB  # the largest page a store can be created for
REGIONS = 16  # a new store's regions, when its pages allow
MIN_REGIONS = 4  # the fewest regions a store is created with
MIN_CAPACITY = REGIONS * MIN_REGION  # 1 MiB
MAX_REGIONS_PER_FILE = 64


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def region_bytes_for(capacity: int, largest_page: int = 0) -> int:
    """Region size for a new store of ``capacity`` bytes whose largest page is
    ``largest_page`` bytes (see module docstring). ValueError, saying what capacity would
    do, if the capacity cannot hold :data:`MIN_REGIONS` regions of pages that large."""
    r = 1 << max(0, (capacity // REGIONS).bit_length() - 1)
    r = max(MIN_REGION, min(MAX_REGION, r))
    if largest_page > r:
        if largest_page > MAX_PAGE:
            raise ValueError(f"pages of {largest_page} bytes are larger than the largest a store holds ({MAX_PAGE} bytes)")
        r = _pow2_at_least(round_up(largest_page))
    if capacity < MIN_REGIONS * r:
        raise ValueError(f"a store for pages of {largest_page} bytes has {r}-byte regions and needs at least "
                         f"{MIN_REGIONS} of them: capacity_gb {MIN_REGIONS * r / GiB:g} or more (got {capacity / GiB:g})")
    return r


def check_capacity(region_bytes: int, capacity: int, shards: int = 1) -> None:
    """ValueError unless ``capacity`` (a store's new capacity) is 0 (the store holds
    nothing: everything is evicted) or holds at least one of its regions per shard."""
    least = shards * region_bytes
    if capacity != 0 and capacity < least:
        raise ValueError(f"capacity {capacity} bytes holds too few of the store's {region_bytes}-byte regions (one per "
                         f"shard, {shards} shard(s)): 0 (hold nothing) or at least {least} bytes "
                         f"(capacity_gb {least / GiB:g})")


def regions_per_file_for(capacity: int, region_bytes: int, dirs: int) -> int:
    """Files hold half a directory's share of the store (so a store spreads over its
    directories from the start), at most 64 regions (4 GiB files at 64 MiB regions)."""
    return max(1, min(MAX_REGIONS_PER_FILE, capacity // region_bytes // (2 * dirs)))


def slots_per_region(region_bytes: int, page_bytes: int) -> int:
    return region_bytes // round_up(page_bytes)


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a store's index says its files look like; the only source of offsets."""

    store_id: str
    region_bytes: int
    regions_per_file: int
    shards: int

    def file_of(self, region: int) -> int:
        return region // self.regions_per_file

    def region_offset(self, region: int) -> int:
        """Byte offset of a region inside its file (after the header block): its first slot's."""
        return self.place(region, 0, 0)[1]

    def place(self, region: int, slot: int, page_bytes: int) -> tuple[int, int]:
        """(file, byte offset) of one slot."""
        return self.places(((region, slot),), page_bytes)[0]

    def places(self, slots: Iterable[tuple[int, int]], page_bytes: int) -> list[tuple[int, int]]:
        """(file, byte offset) of each (region, slot) of a batch in one call (a read's
        per-page loop): the one place a slot's position is worked out."""
        rpf, rb, sb = self.regions_per_file, self.region_bytes, self.slot_bytes(page_bytes)
        return [(r // rpf, HEADER_BYTES + r % rpf * rb + s * sb) for r, s in slots]

    def holds(self, page_bytes: int) -> bool:
        """Whether a region holds a page of this size (fixed when the store was created)."""
        return slots_per_region(self.region_bytes, page_bytes) >= 1

    @staticmethod
    def slot_bytes(page_bytes: int) -> int:
        """A slot's size: the page's, rounded up to the O_DIRECT alignment."""
        return round_up(page_bytes)

    def shard_of_file(self, file_no: int) -> int:
        return file_no % self.shards

    def shard_of_region(self, region: int) -> int:
        return self.shard_of_file(self.file_of(region))

    def capacity_share(self, capacity: int, shard: int) -> int:
        """Regions shard ``shard`` may allocate out of ``capacity`` bytes."""
        total = capacity // self.region_bytes
        return total // self.shards + (1 if shard < total % self.shards else 0)
