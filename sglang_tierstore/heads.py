"""Pages shared by instances of different TP sizes: a ``page_head`` page stored as its head
slices.

SGLang's ``page_head`` host layout holds a page as ``(2, 1, heads, page_size, layers,
head_dim)``: K's heads then V's, each head's bytes contiguous. A rank at TP ``t`` holds
``heads`` of the model's KV heads; at TP ``lcm`` (``tp_lcm_size``, which every instance of a
fleet sets alike) a rank holds ``heads * t / lcm``. So a page splits into ``s = lcm / t``
slices, slice ``i`` being K's and V's ``i``-th group of ``heads / s`` heads, and that slice is
byte for byte the page rank ``tp_rank * s + i`` holds at TP ``lcm``. Each slice is stored as
a page of its own, keyed ``<key>_<rank at lcm>``, in a namespace without the TP rank or size:
any TP size dividing ``lcm`` writes and finds the same slices. A page is a hit only where
every one of its slices is (a partly stored page is a miss); each slice has its checksum.
Mooncake's store keys its slices the same way (``<key>_<rank at lcm>_k``/``_v``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_tierstore.schema import ALIGN  # what O_DIRECT needs of a slice's length (its start follows from the page's)

HEADS_AXIS = 2  # of a page_head page's shape (2, 1, heads, page_size, layers, head_dim)
PAGE_HEAD_DIMS = 6


def split_factor(layout: str, shape: Sequence[int], regions: Sequence[int], tp_size: int,
                 tp_lcm_size: int) -> tuple[Optional[int], str]:
    """How many slices a page of this pool splits into for sharing across TP sizes (1 at TP
    ``lcm`` itself), or None with the reason it does not share: a layout other than
    ``page_head`` (its pages interleave the heads), an unexpected page shape, or heads that
    do not divide (GQA heads replicated over ranks)."""
    if layout != "page_head":
        return None, f"layout {layout!r} is not page_head"
    if len(shape) != PAGE_HEAD_DIMS or shape[0] != 2 or len(regions) != 2 or regions[0] != regions[1]:
        return None, f"a page_head page of shape {tuple(shape)} in regions {tuple(regions)} is not K then V"
    if tp_lcm_size % tp_size:
        return None, f"tp_lcm_size {tp_lcm_size} is not a multiple of tp_size {tp_size}"
    s = tp_lcm_size // tp_size
    if shape[HEADS_AXIS] % s:
        return None, f"{shape[HEADS_AXIS]} heads per rank do not split in {s}"
    return s, ""


def slice_shape(shape: Sequence[int], s: int) -> tuple[int, ...]:
    """A slice's shape: the page's with ``1/s`` of its heads (the same at every TP size)."""
    out = list(shape)
    out[HEADS_AXIS] //= s
    return tuple(out)


def slice_aligned(aligned: bool, regions: Sequence[int], s: int) -> bool:
    """Whether slices of an O_DIRECT-aligned page are aligned too (each a multiple of 4 KiB)."""
    return aligned and all((r // s) % ALIGN == 0 for r in regions)


def slice_keys(keys: Sequence[str], tp_rank: int, s: int) -> list[str]:
    """Each page's slices' keys, page by page: ``<key>_<rank at lcm>``."""
    return [f"{k}_{tp_rank * s + i}" for k in keys for i in range(s)]


def slice_pages(pages: Sequence[Sequence[memoryview]], s: int) -> list[list[memoryview]]:
    """Each page's ``[K, V]`` regions (or its one flat region, K then V) as ``s`` slices of
    ``[K_i, V_i]``, page by page, in the order of :func:`slice_keys`; views, no copies."""
    out: list[list[memoryview]] = []
    for regions in pages:
        if len(regions) == 1:
            half = len(regions[0]) // 2
            regions = [regions[0][:half], regions[0][half:]]
        k, v = regions
        a, b = len(k) // s, len(v) // s
        out.extend([k[i * a:(i + 1) * a], v[i * b:(i + 1) * b]] for i in range(s))
    return out


def whole_pages(flags: Sequence[bool], s: int) -> list[bool]:
    """Per page, whether every one of its ``s`` slices is (present, read, stored)."""
    return [all(flags[i:i + s]) for i in range(0, len(flags), s)]
