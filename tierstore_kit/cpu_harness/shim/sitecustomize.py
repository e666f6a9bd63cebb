"""Test-only: lets `python -m sglang.launch_server --device cpu` run HiCache without a GPU.

Put this directory on PYTHONPATH; Python imports `sitecustomize` at start-up in
the server and in its scheduler subprocess. Four patches, each for one fact, and a
note of which tierstore the server runs:

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
4. The CPU fallback attention (`torch_native`) attends every token of the sequence
   on an extend, cached prefix included; it gets an extend over the new tokens only
   (what GPU backends do), so a prefix hit costs what it costs on real hardware.
5. A run comparing two checkouts of tierstore (``loadtest_tiers.py --tierstore-src``) must
   know which one the server imported: each process that imports `sglang_tierstore`
   prints the file it came from to stderr (the server log).
6. SGLang keeps 10 GiB of RAM free beside any host pool it makes; the test machine runs
   several servers at once on 24 GiB: 1 GiB is kept free instead.
Nothing touches the storage path: tierstore runs as in production.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, Optional, Sequence

from cpu_ops import (StubModule, assign_req_to_token_pool_cpu, patch_assembler, patch_host_reserve, patch_mha,
                     patch_torch_native)

# -- the import hook -----------------------------------------------------------------

def _report_origin(module: types.ModuleType) -> None:
    print(f"cpu harness: sglang_tierstore imported from {module.__file__}", file=sys.stderr, flush=True)


_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.mha": patch_mha,
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler": patch_assembler,
    "sglang.srt.layers.attention.torch_native_backend": patch_torch_native,
    "sglang.srt.mem_cache.pool_host.base": patch_host_reserve,
    "sglang_tierstore": _report_origin,
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
        mod = StubModule(spec.name)
        mod.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder())
