"""The real radix tree: UnifiedRadixCache + init_hicache + HybridCacheController threads on CPU.

SGLang's own test kit (`sglang.test.kits.unified_radix_cache`) builds the trees
and drives them; only `_init_hicache` is ours: tierstore as the `dynamic` backend,
`direct` I/O with torch transfer ops and unpinned host pools (the CPU stand-ins
the server shim uses). A producer tree writes to L3; a fresh consumer tree
prefetches from it, loads back to its device pool, and every KV byte is compared.
"""

from __future__ import annotations

import json
import unittest
import uuid
from typing import Any, Optional
from unittest import mock

import pytest
import torch
from tierstore_kit.cpu_harness.shim import cpu_ops
from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE as FLA_CHUNK_SIZE
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import (
    build_fixture,
    drop_hicache_atexit_pin,
    match_prefix,
)
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

import sglang.test.kits.unified_radix_cache.fixtures as kit_fixtures

from sglang_tierstore import TierStoreBackend
from sglang_tierstore.tools import inspect

import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler
import sglang.srt.mem_cache.pool_host.base as host_base
import sglang.srt.mem_cache.pool_host.mha as mha_host

cpu_ops.patch_host_reserve(host_base)  # several test processes and servers share 24 GiB


class TierStoreTree(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, kv_size=512, num_layers=2, head_num=2, head_dim=16)
    interface_v1 = True

    @pytest.fixture(autouse=True)
    def _store(self, extra: dict[str, Any]) -> Any:
        self.extra = {**extra, "redis_prefix": "tree-" + uuid.uuid4().hex[:8]}
        if not self.interface_v1:
            del self.extra["interface_v1"]
        with mock.patch.object(kit_fixtures, "get_device", lambda: "cpu"):  # no accelerator here
            yield

    def _init_hicache(self, cache: Any, *, write_policy: str = "write_through", storage_backend: Optional[str] = None,
                      storage_dir: Optional[str] = None, prefetch_threshold: Optional[int] = None,
                      prefetch_policy: str = "wait_complete", **_: Any) -> None:
        for patcher in [
            mock.patch.object(assembler, "get_mha_host_pool_cls", cpu_ops.unpinned(assembler.get_mha_host_pool_cls)),
            *(mock.patch.object(mha_host, name, fn, create=True) for name, fn in cpu_ops.TRANSFER_OPS.items()),
            get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1),
        ]:
            patcher.__enter__()
            self.addCleanup(patcher.__exit__, None, None, None)
        extra = None
        if storage_backend is not None:
            extra = json.dumps({**self.extra, "path": storage_dir, "prefetch_threshold": prefetch_threshold or 1})
        server_args = ServerArgs(
            model_path="dummy", page_size=self.cfg.page_size, hicache_io_backend="direct",
            hicache_mem_layout="page_first_direct", hicache_write_policy=write_policy,
            hicache_storage_backend="dynamic" if storage_backend else None,
            hicache_storage_backend_extra_config=extra, hicache_storage_prefetch_policy=prefetch_policy,
        )
        server_args._mamba_cache_chunk_size = max(FLA_CHUNK_SIZE, self.cfg.page_size)
        set_global_server_args_for_scheduler(server_args)
        cache.init_hicache(server_args, cache.cache_init_params)
        self.addCleanup(drop_hicache_atexit_pin, cache)
        self.addCleanup(cache.release_host_resources)
        cache.write_through_threshold = 1 << 30
        cache.load_back_threshold = 0
        if storage_backend is not None:
            ctl = cache.cache_controller
            ctl.prefetch_capacity_limit = max(ctl.prefetch_capacity_limit, ctl.mem_pool_host.size)
            self.addCleanup(ctl.detach_storage_backend)  # SGLang's own: its threads stopped, the backend closed

    # -- helpers --------------------------------------------------------------------

    def _buffers(self, allocator: Any, indices: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K or V buffer, slots) of every layer of every pool holding these tokens."""
        kv = allocator.get_kvcache()
        pools = [(getattr(kv, "full_kv_pool", kv), indices)]
        if self.cfg.has_swa:  # SWA layers hold only the window: the last tokens, at mapped slots
            window = indices[-self.cfg.sliding_window_size :]
            pools.append((kv.swa_kv_pool, allocator.full_to_swa_index_mapping[window]))
        return [(buf, idx) for pool, idx in pools for layer in range(pool.layer_num)
                for buf in (pool.get_key_buffer(pool.start_layer + layer), pool.get_value_buffer(pool.start_layer + layer))]

    def _fill_all_layers(self, allocator: Any, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
        """Random K and V in every layer at these tokens' slots; returns what was written."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for buf, idx in self._buffers(allocator, indices):
            vals = torch.randn(buf[idx].shape, generator=g).to(buf.dtype)
            buf[idx] = vals
            out.append(vals)
        return out

    def _read_all_layers(self, allocator: Any, indices: torch.Tensor) -> list[torch.Tensor]:
        return [buf[idx].clone() for buf, idx in self._buffers(allocator, indices)]

    def _produce(self, storage_dir: str, seq: list[int], seed: int) -> list[torch.Tensor]:
        prod, alloc, rtp = build_fixture(self.cfg)
        self._init_hicache(prod, storage_backend="dynamic", storage_dir=storage_dir)
        self._insert(prod, alloc, rtp, seq)
        leaf = match_prefix(prod, seq).last_device_node
        expected = self._fill_all_layers(alloc, prod.path_device_indices(leaf), seed)
        self._backup_node(prod, leaf)
        self._write_path_to_l3(prod, leaf)
        self._flush_l3_backups(prod)
        return expected

    def _consume(self, storage_dir: str, seq: list[int]) -> tuple[list[torch.Tensor], Any]:
        cons, alloc, _ = build_fixture(self.cfg)
        self._init_hicache(cons, storage_backend="dynamic", storage_dir=storage_dir)
        self._consume_prefetch(cons, seq, CacheRequestHandle("r", 0))
        m = match_prefix(cons, seq)
        self.assertEqual(m.host_hit_length, len(seq), "prefetch did not bring the whole sequence to host")
        self._load_back_node(cons, m.last_host_node)
        indices = cons.path_device_indices(match_prefix(cons, seq).last_device_node)
        self.assertEqual(len(indices), len(seq))
        return self._read_all_layers(alloc, indices), cons

    # -- tests ------------------------------------------------------------------------

    def test_l3_round_trip_through_the_tree_is_byte_exact(self) -> None:
        storage_dir = self._make_storage_dir()
        seq = self._make_seq(7, 12)
        expected = self._produce(storage_dir, seq, seed=1)
        v1_reads: list[int] = []
        real_get_v1 = TierStoreBackend.batch_get_v1

        def counting_get_v1(backend: TierStoreBackend, keys: Any, *a: Any, **kw: Any) -> Any:
            v1_reads.append(len(keys))
            return real_get_v1(backend, keys, *a, **kw)

        with mock.patch.object(TierStoreBackend, "batch_get_v1", counting_get_v1):
            got, cons = self._consume(storage_dir, seq)
        self.assertEqual(len(got), len(expected))
        for e, g in zip(expected, got):
            self.assertTrue(torch.equal(e, g))
        backend = cons.cache_controller.storage_backend
        self.assertIsInstance(backend, TierStoreBackend)
        kv_pages, window_pages = len(seq) // self.cfg.page_size, (self.cfg.sliding_window_size or 0) // self.cfg.page_size
        self.assertEqual(backend.store.stats()["read_hit"], kv_pages + window_pages)
        # v1 reads go through batch_get_v1; legacy ones through batch_get
        self.assertEqual(bool(v1_reads), self.interface_v1)
        self.assertEqual(inspect.check(backend.store), [])


    def test_write_through_selective_backs_up_on_the_second_hit(self) -> None:
        storage_dir = self._make_storage_dir()
        prod, alloc, rtp = build_fixture(self.cfg)
        self._init_hicache(prod, write_policy="write_through_selective", storage_backend="dynamic", storage_dir=storage_dir)
        prod.write_through_threshold = 2  # what init_hicache sets for write_through_selective
        seq = self._make_seq(3, 6)
        backend = prod.cache_controller.storage_backend
        pages = 6 * (2 if self.cfg.has_swa else 1)  # KV pages, and as many SWA pages
        self._insert(prod, alloc, rtp, seq)  # first hit: nothing goes to host, so nothing to L3
        self._pump_hicache_until(prod, lambda: (prod.writing_check() or True) and not prod.ongoing_write_through,
                                 "a host backup of the first hit still running")
        self._flush_l3_backups(prod)
        first = backend.store.stats().get("write_stored", 0)
        self._insert(prod, alloc, rtp, seq)  # second hit: backed up to host, then to L3
        self._pump_hicache_until(prod, lambda: backend.store.stats().get("write_stored", 0) >= pages,
                                 "no L3 backup after the second hit")
        self._flush_l3_backups(prod)
        stored = [first, backend.store.stats().get("write_stored", 0)]
        self.assertEqual(stored, [0, pages])


    def test_a_decode_offload_stores_the_answer_a_later_prefill_reads(self) -> None:
        """PD disaggregation below the server (SGLang's PD path cannot run on CPU: the prefill
        side refuses the ``fake`` transfer backend): a prefill tree backs a 2-page prompt up to
        L3; a decode node's ``DecodeKVCacheOffloadManager`` (``--disaggregation-decode-enable-
        offload-kvcache``), on the same store through its own HiCache controller, offloads the
        pages of the answer it generated; a fresh tree then prefetches prompt and answer from
        L3, every KV byte the prefill's or the decode's."""
        if self.cfg.has_swa:
            self.skipTest("the full-attention offload path; hybrid SWA takes the same calls through v2")
        from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager

        storage_dir = self._make_storage_dir()
        ps = self.cfg.page_size
        prompt, answer = self._make_seq(11, 2), self._make_seq(500, 2) + [999]  # the last token has no KV yet
        from_prefill = self._produce(storage_dir, prompt, seed=1)
        dec, alloc, rtp = build_fixture(self.cfg)
        self._init_hicache(dec, storage_backend="dynamic", storage_dir=storage_dir)  # the global args the manager reads
        with mock.patch.object(torch.distributed, "get_world_size", lambda group=None: 1):  # one rank, no process group
            manager = DecodeKVCacheOffloadManager(rtp, alloc, None, dec)
        self.addCleanup(manager.cache_controller.detach_storage_backend)
        self.addCleanup(manager.release_host_resources)
        req, slots = self._make_inflight_req(dec, alloc, rtp, prompt, answer, allocated=True)
        self._fill_all_layers(alloc, slots, seed=2)
        from_decode = self._read_all_layers(alloc, slots[len(prompt):len(prompt) + 2 * ps])
        written: list[list[str]] = []

        def recording(real: Any) -> Any:
            def call(backend: TierStoreBackend, keys: Any, *a: Any, **kw: Any) -> Any:
                written.append(list(keys))
                return real(backend, keys, *a, **kw)
            return call

        with mock.patch.object(TierStoreBackend, "batch_set_v1", recording(TierStoreBackend.batch_set_v1)), \
                mock.patch.object(TierStoreBackend, "batch_set", recording(TierStoreBackend.batch_set)):
            self.assertTrue(manager.offload_kv_cache(req))
            self._pump_hicache_until(dec, lambda: (manager.check_offload_progress() or True) and not manager.ongoing_offload
                                     and not manager.ongoing_backup, "the decode's offload to L3")
        seq = prompt + answer[:-1]
        self.assertEqual(sum(len(k) for k in written), 2)  # the answer's two pages, not the prompt's again
        got, _ = self._consume(storage_dir, seq)
        for b, (p_part, d_part) in enumerate(zip(from_prefill, from_decode)):
            self.assertTrue(torch.equal(got[b][:len(prompt)], p_part), f"buffer {b}: the prompt's KV")
            self.assertTrue(torch.equal(got[b][len(prompt):], d_part), f"buffer {b}: the answer's KV")


class TierStoreTreeLegacy(TierStoreTree):
    """Without interface_v1 SGLang takes the legacy copy path: batch_get / batch_set."""

    interface_v1 = False


class TierStoreTreeSWA(TierStoreTree):
    """A full+SWA hybrid tree: SWA pages go through batch_set_v2 / batch_exists_v2 / batch_get_v2."""

    cfg = CacheConfig(page_size=4, kv_size=512, num_layers=4, head_num=2, head_dim=16,
                      components=(ComponentType.FULL, ComponentType.SWA), full_attention_layer_ids=(1, 3),
                      sliding_window_size=8)
