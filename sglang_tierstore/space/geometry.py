"""Regions and files, as numbers: how a store is cut, and where a slot lies. Pure.

A store has one region size ``R`` (:func:`region_bytes_for`: capacity / 16 rounded down
to a power of two, clamped to 64 KiB..64 MiB; fixed when the store is created). At least
16 regions means eviction never takes more than 1/16 of the store at once and two or
three page sizes each find room even in a store of a few MiB. At most 64 MiB keeps what
one eviction drops to a blink of a 500 GB store (0.013%) while a 128-page write of
256 KiB pages still fits one region, so prefixes land in consecutive slots; 10 TB is
160k regions, a few MB of index. A page larger than ``R`` cannot be stored.

A page file holds ``regions_per_file`` regions after a 4 KiB header; file ``n`` holds
regions ``n * regions_per_file ...``, and belongs to shard ``n % shards``. A region is
cut into slots of the page size rounded up to 4 KiB (the O_DIRECT alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_tierstore.schema import HEADER_BYTES, round_up

MiB = 1 << 20
MIN_REGION = 64 << 10
MAX_REGION = 64 * MiB
MIN_REGIONS = 16
MAX_REGIONS_PER_FILE = 64
REFORMAT_RATIO = 4  # a start-up re-cuts a store whose region size is this far from its capacity's


def region_bytes_for(capacity: int) -> int:
    """Region size for a store of ``capacity`` bytes (see module docstring)."""
    r = 1 << max(0, (capacity // MIN_REGIONS).bit_length() - 1)
    return max(MIN_REGION, min(MAX_REGION, r))


def regions_per_file_for(capacity: int, region_bytes: int, dirs: int) -> int:
    """Files hold half a directory's share of the store (so a store spreads over its
    directories from the start), at most 64 regions (4 GiB files at 64 MiB regions)."""
    return max(1, min(MAX_REGIONS_PER_FILE, capacity // region_bytes // (2 * dirs)))


def needs_new_geometry(region_bytes: int, capacity: int) -> bool:
    """Whether a store of ``region_bytes`` regions is too far from what ``capacity`` calls for."""
    ideal = region_bytes_for(capacity)
    return max(ideal, region_bytes) >= REFORMAT_RATIO * min(ideal, region_bytes)


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
        """Byte offset of a region inside its file (after the header block)."""
        return HEADER_BYTES + (region % self.regions_per_file) * self.region_bytes

    def slot_offset(self, region: int, slot: int, page_bytes: int) -> int:
        return self.region_offset(region) + slot * self.slot_bytes(page_bytes)

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
