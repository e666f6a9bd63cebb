"""Real SGLang host pools on CPU (pin_memory=False) and storage configs for tests."""

from __future__ import annotations

from typing import Any, Optional

import sglang.srt.mem_cache.pool_host.base as host_base
import torch
from tierstore_kit.cpu_harness.shim.cpu_ops import patch_host_reserve
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

patch_host_reserve(host_base)  # several test processes and servers share 24 GiB (cpu_ops.py, 6.)

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def mha_pool(layout: str, page_size: int = 4, layers: int = 3, heads: int = 2, head_dim: int = 8,
             dtype: torch.dtype = torch.bfloat16, tokens: int = 256) -> MHATokenToKVPoolHost:
    kv = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, start_layer=0, end_layer=layers)
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout, pin_memory=False,
        device_capacity_tokens=kv.size, start_layer=0, end_layer=layers,
    )


def mla_pool(layout: str, page_size: int = 4, layers: int = 3, kv_lora_rank: int = 16, rope_dim: int = 8,
             dtype: torch.dtype = torch.bfloat16, tokens: int = 256) -> MLATokenToKVPoolHost:
    kv = MLATokenToKVPool(tokens, page_size, dtype, kv_lora_rank, rope_dim, layers, "cpu", False, start_layer=0, end_layer=layers)
    return MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout, pin_memory=False,
        device_capacity_tokens=kv.size, start_layer=0, end_layer=layers, target_layer_num=layers,
    )


def tp_pools(layout: str, heads: int, head_dim: int, page_size: int = 16, layers: int = 2, tokens: int = 128,
             seed: int = 7) -> tuple[MHATokenToKVPoolHost, list[MHATokenToKVPoolHost]]:
    """A TP 1 host pool of ``heads`` KV heads, filled (``seed``), and the two TP 2 ranks'
    pools: in ``page_head``, each holds its half of the heads of the same pages (what each
    rank of a TP 2 instance holds of what a TP 1 instance computed); in other layouts,
    bytes of their own."""
    def pool(n: int) -> MHATokenToKVPoolHost:
        return mha_pool(layout, page_size=page_size, layers=layers, heads=n, head_dim=head_dim, tokens=tokens)

    whole, halves = pool(heads), [pool(heads // 2) for _ in range(2)]
    fill(whole, seed)
    for r, h in enumerate(halves):
        if layout == "page_head":  # (2, pages, heads, page_size, layers, head_dim)
            h.kv_buffer.copy_(whole.kv_buffer[:, :, r * heads // 2:(r + 1) * heads // 2])
        else:
            fill(h, seed + 1 + r)
    return whole, halves


def fill(pool: Any, seed: int) -> None:
    """Random bytes in the whole host buffer (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def storage_config(extra: dict[str, Any], mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   model: Optional[str] = "test/model", metrics: bool = False, tp_lcm_size: Optional[int] = None,
                   layout: str = "page_first") -> HiCacheStorageConfig:
    """The config SGLang's cache controller builds; with ``tp_lcm_size`` as it does from the
    extra config (``should_split_heads``: page_head, MHA, a TP size below the lcm)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name=model, extra_config=dict(extra), tp_lcm_size=tp_lcm_size,
        should_split_heads=bool(tp_lcm_size) and not mla and layout == "page_head" and tp_lcm_size > tp_size,
    )


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """Host token indices covering the given host pages, as SGLang passes them."""
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)], dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


