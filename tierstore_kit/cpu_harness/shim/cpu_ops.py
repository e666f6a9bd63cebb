"""The CPU stand-ins behind the shim: torch versions of CUDA-only ops, and pool patches.

Imported by `sitecustomize` (server processes) and by in-process tests
(`test_tree.py`), so both run the same code. See sitecustomize.py for why each exists.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

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


# -- 6. a host-memory reserve a test machine can keep --------------------------------

TEST_HOST_RESERVE_BYTES = 1 << 30


def patch_host_reserve(mod: types.ModuleType) -> None:
    """SGLang refuses a host pool unless 10 GiB of RAM stay free beside it
    (``pool_host/base.py``'s ``HICACHE_HOST_MEMORY_RESERVE_BYTES``), a margin for a GPU
    node's other work. The test machine (24 GiB) runs several servers and test processes at
    once, whose pools are a few MB each: 1 GiB is kept free instead."""
    mod.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_RESERVE_BYTES  # type: ignore[attr-defined]


# -- 4. extend attention over the new tokens only -----------------------------------


def patch_torch_native(mod: types.ModuleType) -> None:
    """SGLang's CPU fallback attention (`torch_native`) runs an extend as if the whole
    sequence were new: it attends ``seq_len`` queries and keeps the last ones, so a
    request whose prefix is cached still pays attention over the full prefix squared.
    That makes a prefix hit look almost as expensive as a recompute, which GPU backends
    (and the cost a storage tier saves) are not. This computes only the extend queries,
    each attending to the keys up to its own position (every key when not causal), and
    leaves sliding windows and encoder-decoder attention to the original."""
    cls = mod.TorchNativeAttnBackend
    original = cls._run_sdpa_forward_extend

    def extend(self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, encoder_lens: Any = None,
               scaling: Any = None, enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
               sliding_window_size: Any = None) -> torch.Tensor:
        if encoder_lens is not None or is_cross_attn or (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                            is_cross_attn, sliding_window_size)
        q_all = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_q, prefix, n_kv = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            q = q_all[:, start_q:start_q + n_q, :]
            tokens = req_to_token[req_pool_indices[i], :n_kv]
            k = k_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
            v = v_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
            mask = None
            if causal and prefix:
                mask = (torch.arange(n_kv, device=q.device).unsqueeze(0)
                        <= (prefix + torch.arange(n_q, device=q.device)).unsqueeze(1))
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=enable_gqa,
                scale=scaling, is_causal=causal and not prefix)
            output[start_q:start_q + n_q] = out.squeeze(0).movedim(query.dim() - 2, 0)
            start_q += n_q
        return output

    cls._run_sdpa_forward_extend = extend
