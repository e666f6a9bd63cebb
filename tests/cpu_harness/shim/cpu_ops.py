"""The CPU stand-ins behind the shim: torch versions of CUDA-only ops, and pool patches.

Imported by `sitecustomize` (server processes) and by in-process tests
(`test_tree.py`), so both run the same code. See sitecustomize.py for why each exists.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Sequence

import torch

# -- 1. a stand-in sgl_kernel ------------------------------------------------------


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
    end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
) -> None:
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
        pos += e - s


class StubModule(types.ModuleType):
    """Has every ``*_cpu`` op; other names and submodules stay missing, so SGLang's
    own ImportError fallbacks (e.g. quantization scalar types) still apply."""

    def __getattr__(self, name: str) -> Any:
        if not name.endswith("_cpu"):
            raise AttributeError(name)

        def unavailable(*_: Any, **__: Any) -> Any:
            raise NotImplementedError(f"sgl_kernel.{name} is CUDA-only (CPU test shim)")

        return unavailable


# -- 3. torch versions of the direct transfer ops ----------------------------------


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       layer_id: int, page_size: int) -> None:
    """Host page_first_direct [page, layer, token, ...] -> device layer [token, ...]."""
    pages, offs = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices] = src[pages, layer_id, offs].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Device layers (all K, then all V) -> host page_first_direct [page, layer, token, ...]."""
    layers = len(src_ptrs) // 2
    pages, offs = dst_indices // page_size, dst_indices % page_size
    for half, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[pages, layer, offs] = src_ptrs[half * layers + layer][src_indices].to(dst.device)


TRANSFER_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}


def patch_mha(mod: types.ModuleType) -> None:
    for name, fn in TRANSFER_OPS.items():
        setattr(mod, name, fn)


# -- 2. unpinned host pools ------------------------------------------------------------


def unpinned(get_mha_host_pool_cls: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `hybrid_pool_assembler.get_mha_host_pool_cls` so its pools skip cudaHostRegister."""

    def wrapper(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        cls = get_mha_host_pool_cls(*args, **kwargs)

        def make(*a: Any, **kw: Any) -> Any:
            kw["pin_memory"] = False
            return cls(*a, **kw)

        return make

    return wrapper


def patch_assembler(mod: types.ModuleType) -> None:
    mod.get_mha_host_pool_cls = unpinned(mod.get_mha_host_pool_cls)  # type: ignore[attr-defined]
