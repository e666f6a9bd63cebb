"""Where a page lives in host memory, as byte regions for zero-copy preadv/pwritev.

A page's canonical byte order is the row-major order of the pool's own page view
(``get_data_page(index, flat=True)``), whatever the layout: ``layer_first`` gives
2*L regions per page, ``page_first*``/``page_head`` 2 (K and V blocks), MLA 1. The
plan is derived once per pool from the view's strides, so the v1 zero-copy path
and the legacy flat-tensor path store identical bytes, and no layout is
special-cased here. Knows tensors, not SGLang.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from sglang_tierstore.schema import ALIGN


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("expected a contiguous CPU tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _regions_of(view: torch.Tensor, base_ptr: int) -> list[tuple[int, int]]:
    """(offset from base_ptr, length) of each contiguous run of ``view``, row-major."""
    shape, strides, isz = list(view.shape), list(view.stride()), view.element_size()
    run, k = 1, len(shape)
    while k > 0 and strides[k - 1] == run:
        run *= shape[k - 1]
        k -= 1
    offsets = [view.data_ptr() - base_ptr]
    for d in range(k):  # outer dims, row-major
        offsets = [o + i * strides[d] * isz for o in offsets for i in range(shape[d])]
    return [(o, run * isz) for o in offsets]


def _storage_bytes(t: torch.Tensor) -> tuple[int, memoryview]:
    """(base address, writable bytes) of the whole storage behind a CPU tensor view."""
    st = t.untyped_storage()
    if st.device.type != "cpu":
        raise ValueError("host pool storage is not in CPU memory")
    whole = torch.empty(0, dtype=torch.uint8).set_(st)
    return st.data_ptr(), memoryview(whole.numpy())  # type: ignore[arg-type]


class PagePlan:
    """Byte regions of page ``p`` (host token index ``p * page_size``) of one host pool.

    ``page_view(i)`` is the pool's unflattened page view at host token ``i``
    (``get_data_page(i, flat=False)``); every page must live in one storage at an
    even stride, which holds for every SGLang host layout.
    """

    __slots__ = ("page_size", "page_bytes", "page_shape", "num_pages", "aligned", "_mem", "_stride", "_regions", "_spans")

    def __init__(self, page_view: Callable[[int], torch.Tensor], page_size: int, num_pages: int) -> None:
        first = page_view(0)
        self.page_shape = tuple(first.shape)
        base, self._mem = _storage_bytes(first)
        self.page_size = page_size
        self.num_pages = num_pages
        self._regions = _regions_of(first, base)
        self.page_bytes = sum(n for _, n in self._regions)
        self._stride = page_view(page_size).data_ptr() - first.data_ptr() if num_pages > 1 else 0
        last = num_pages - 1
        if last > 1:
            lv = page_view(last * page_size)
            if lv.untyped_storage().data_ptr() != base or lv.data_ptr() - first.data_ptr() != last * self._stride:
                raise ValueError("host pool pages are not evenly strided in one buffer")
        if self._stride < 0 or self._regions[-1][0] + self._regions[-1][1] + last * self._stride > len(self._mem):
            raise ValueError("host pool page views exceed their buffer")
        self._spans = [(o, o + n) for o, n in self._regions]
        self.aligned = (
            base % ALIGN == 0
            and self._stride % ALIGN == 0
            and all(o % ALIGN == 0 and n % ALIGN == 0 for o, n in self._regions)
        )

    @property
    def region_sizes(self) -> tuple[int, ...]:
        """Region lengths of a page: part of the namespace fingerprint."""
        return tuple(n for _, n in self._regions)

    def regions(self, token_indices: Sequence[int]) -> list[list[memoryview]]:
        """Writable views of each page, by the host token index it starts at: the hot
        path's one loop over a batch's pages."""
        ps, n, stride, mem, spans = self.page_size, self.num_pages * self.page_size, self._stride, self._mem, self._spans
        bad = next((i for i in token_indices if i % ps or not 0 <= i < n), None)
        if bad is not None:
            raise IndexError(f"host index {bad} is not a page start in this pool")
        return [[mem[s + a : s + b] for a, b in spans] for s in (i // ps * stride for i in token_indices)]
