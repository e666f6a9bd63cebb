"""Test-only: lets `python -m sglang.launch_server --device cpu` run HiCache without a GPU.

Put this directory on PYTHONPATH; Python imports `sitecustomize` at start-up in
the server and in its scheduler subprocess. Three patches, each for one fact:

1. `sgl_kernel` is CUDA-only, but with SGLANG_USE_CPU_ENGINE=1 SGLang imports its
   `*_cpu` ops at module load. A stand-in module gives every `*_cpu` name; only
   `assign_req_to_token_pool_cpu` (mem_cache/allocation.py) is ever called here,
   so it is real (torch); any other op raises if called.
2. Host pools pin memory with cudaHostRegister by default: the MHA host pool
   class handed out by `hybrid_pool_assembler.get_mha_host_pool_cls` is wrapped
   to pass `pin_memory=False` (as SGLang's own test kit does).
3. The device<->host copies of `--hicache-io-backend direct` come from sgl_kernel:
   `transfer_kv_direct`, `transfer_kv_per_layer_direct_pf_lf` and
   `transfer_kv_all_layer_direct_lf_pf` get torch versions in pool_host/mha.py.
Nothing touches the storage path: tierstore runs as in production.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, Optional, Sequence

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


class _StubModule(types.ModuleType):
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


def _patch_mha(mod: types.ModuleType) -> None:
    mod.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]
    mod.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf  # type: ignore[attr-defined]
    mod.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf  # type: ignore[attr-defined]


# -- 2. unpinned host pools ------------------------------------------------------------


def _patch_assembler(mod: types.ModuleType) -> None:
    original = mod.get_mha_host_pool_cls

    def get_mha_host_pool_cls(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        cls = original(*args, **kwargs)

        def unpinned(*a: Any, **kw: Any) -> Any:
            kw["pin_memory"] = False
            return cls(*a, **kw)

        return unpinned

    mod.get_mha_host_pool_cls = get_mha_host_pool_cls


# -- the import hook -----------------------------------------------------------------

_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler": _patch_assembler,
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if name == "sgl_kernel":
            return importlib.machinery.ModuleSpec(name, self)
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)  # type: ignore[attr-defined]
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_then_patch(module: types.ModuleType, _exec: Any = exec_module) -> None:
                    _exec(module)
                    _PATCHES[name](module)

                spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StubModule(spec.name)
        mod.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder())
