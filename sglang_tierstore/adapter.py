"""The SGLang adapter: ``HiCacheStorage`` over one :class:`TierStore`.

The only module that imports SGLang. It maps SGLang's call families onto the
store, derives each pool's namespace fingerprint and host-memory page plan, and
turns every exception into misses / ``False`` with a counter and a rate-limited
log line: SGLang aborts a whole batch on an exception, so none may escape.

SGLang builds it as ``TierStoreBackend(storage_config, kwargs)`` and registers
the host pools afterwards (``register_mem_pool_host`` for the KV anchor,
``register_mem_host_pool_v2`` per side pool).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from sglang_tierstore import heads
from sglang_tierstore.config import TierStoreConfig, describe_target
from sglang_tierstore.embedded import embedded_running, ensure_embedded_redis, redis_dir, stop_embedded_redis
from sglang_tierstore.errors import EmbeddedNotStarted, IndexRefusesUser, StoreDetached, StoreUnavailable, TierStoreError
from sglang_tierstore.hostmem import PagePlan, tensor_bytes
from sglang_tierstore.io_engine import Gate
from sglang_tierstore.metrics import Metrics, thread_cpu
from sglang_tierstore.perms import check_dirs, modes, redis_password, redis_tls, remove_created
from sglang_tierstore.store import Namespace, TierStore

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
IO_STATS_MAX = 4096
RESTART_BACKOFF_MAX_S = 30.0  # the longest wait between two failed starts of the embedded index
CLOSE_WAIT_S = 10.0  # what close() waits for calls in flight and threads, in all (SGLang gives its own threads 10 s)
KV = str(PoolName.KV)


@dataclass(frozen=True)
class _Pool:
    """A registered host pool: its namespace and how to reach its page bytes."""

    host_pool: Any
    ns: Namespace
    plan: Optional[PagePlan]  # None: the pool's layout needs the copy path
    split: Optional[int] = None  # stored as this many head slices, shared across TP sizes (heads.py)

    def keys(self, keys: List[str], tp_rank: int) -> List[str]:
        """The store's keys for these pages: theirs, or their slices' (page by page)."""
        return keys if self.split is None else heads.slice_keys(keys, tp_rank, self.split)

    def pages(self, regions: List[List[memoryview]]) -> List[List[memoryview]]:
        """The store's pages for these regions: the pages, or their slices."""
        return regions if self.split is None else heads.slice_pages(regions, self.split)

    def aligned(self) -> bool:
        """Whether the store's pages of this pool may move with O_DIRECT."""
        if self.plan is None:
            return False
        return self.plan.aligned if self.split is None else heads.slice_aligned(self.plan.aligned, self.plan.region_sizes, self.split)

    def per_page(self, flags: List[bool]) -> List[bool]:
        """The store's answer per key back to one per page (a page: every slice)."""
        return flags if self.split is None else heads.whole_pages(flags, self.split)


def _guarded(fallback: Callable[..., Any]) -> Callable[[F], F]:
    """Turn any exception into ``fallback(*args)``, a counter and a log line; count the
    call in flight for :meth:`TierStoreBackend.close` (after which it is ``fallback``), and
    the CPU time it took on SGLang's thread (``tierstore_caller_cpu_seconds_total``)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: "TierStoreBackend", *args: Any, **kwargs: Any) -> Any:
            if not self._calls.enter():
                self.store.log.warning("closed", "%s called after close: answering misses", fn.__name__)
                return fallback(*args, **kwargs)
            cpu = thread_cpu()
            try:
                return fn(self, *args, **kwargs)
            except (StoreUnavailable, IndexRefusesUser) as e:  # the index down, full, read-only or refusing this
                self.store.metrics.error(e.kind)                # user; the disk full: ridden out
                self.store.log.warning(e.kind, "%s: %s; answering misses", fn.__name__, e)
            except StoreDetached as e:
                self.store.space.detach(e)
            except (ValueError, LookupError) as e:  # bad input from the caller: the message says what
                self.store.metrics.error("bad_call")
                self.store.log.warning(f"bad_call:{fn.__name__}", "%s failed: %s", fn.__name__, e)
            except Exception as e:
                self.store.metrics.error("internal")
                self.store.log.exception(f"internal:{fn.__name__}", "%s failed", fn.__name__, exc=e)
            finally:
                self.store.metrics.cpu(fn.__name__, cpu)
                self._calls.leave()
            return fallback(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def _no_pages(keys: List[str], *_: Any, **__: Any) -> List[bool]:
    return [False] * len(keys)


def _no_pool_results(transfers: List[PoolTransfer], *_: Any, **__: Any) -> dict[str, List[bool]]:
    return {str(t.name): [False] * len(t.keys or []) for t in transfers}


def _geometry(pool: Any) -> tuple[tuple[str, object], ...]:
    """Shape attributes of a pool whose pages can only be copied flat."""
    names = ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim")
    return tuple((n, getattr(pool, n)) for n in names if hasattr(pool, n))


def _rank(c: HiCacheStorageConfig) -> dict[str, int]:
    """The rank labels of this backend's Prometheus series: the ranks SGLang's own
    storage series carry (its storage config's ``tp_rank``, with DP attention the
    rank within the attention group, ``dp_rank`` and ``attn_cp_rank``, which tells apart
    ranks with the same attention TP rank), one scheduler process each."""
    return {"tp_rank": c.tp_rank, "pp_rank": c.pp_rank, "dp_rank": c.dp_rank, "attn_cp_rank": c.attn_cp_rank}


def _leading(flags: List[bool]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))


class TierStoreBackend(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no type information
    """SGLang HiCache L3 backend: pages in regions of page files on local disks, indexed
    in Redis or Valkey; every call SGLang 0.5.23 makes, none of which raises."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict[str, Any]] = None) -> None:
        self.cfg = TierStoreConfig.from_dict(storage_config.extra_config)
        self.storage_config = storage_config
        self.modes = modes(self.cfg.file_access)
        # Named errors, before anything starts:
        redis_password(self.cfg.redis_password_env, self.cfg.redis_password_file)
        redis_tls(self.cfg.redis_tls_ca_file, self.cfg.redis_tls_cert_file, self.cfg.redis_tls_key_file)
        created = check_dirs(self.cfg.path, self.modes)
        target = self.cfg.index_target
        embedded = target is None
        started = False
        try:
            if target is None:
                try:
                    target, started = ensure_embedded_redis(self.cfg.path[0], self.modes, self.cfg.redis_server)
                except EmbeddedNotStarted as e:  # up answering misses; housekeeping starts it again
                    logger.warning("%s; answering misses until it runs", e)
                    target = e.url
            self.store = TierStore(self.cfg, target, metrics=Metrics(_rank(storage_config)))
        except BaseException:  # a failed start leaves nothing behind: what it started, what it created
            if started:
                stop_embedded_redis(self.cfg.path[0])
            shared = embedded and embedded_running(self.cfg.path[0])  # another rank's: it stays, with its directory
            remove_created(created, keep=redis_dir(self.cfg.path[0]) if shared else None)
            raise
        self._restart_at = self._restart_wait_s = 0.0
        self.store.start_housekeeping(self._restart_embedded_redis if embedded else None)
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        # Per-batch samples for SGLang's StorageMetrics: only kept when SGLang collects them
        # (it calls get_stats() only with storage metrics on), and never more than IO_STATS_MAX.
        self._io_stats: Optional[dict[str, Deque[float]]] = (
            {k: deque(maxlen=IO_STATS_MAX) for k in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")}
            if storage_config.enable_storage_metrics else None
        )
        self._closed = False
        self._calls = Gate()  # SGLang's calls in flight, which close() waits for
        logger.info("tierstore: index %s%s, page files under %s, capacity %.1f GiB", "embedded " if embedded else "",
                    describe_target(target), ", ".join(self.cfg.path), self.cfg.capacity_gb)

    def _restart_embedded_redis(self) -> None:
        """Housekeeping found the index down: start the embedded Redis again if it died
        (not once this backend is closed: a detach must not bring it back). After a failed
        start the next waits twice as long, up to ``RESTART_BACKOFF_MAX_S``."""
        now = time.monotonic()
        if getattr(self, "_closed", False) or now < self._restart_at:
            return
        try:
            ensure_embedded_redis(self.cfg.path[0], self.modes, self.cfg.redis_server)
            self._restart_wait_s = 0.0
        except TierStoreError as e:
            self._restart_wait_s = min(RESTART_BACKOFF_MAX_S, max(1.0, 2 * self._restart_wait_s))
            self._restart_at = time.monotonic() + self._restart_wait_s
            self.store.metrics.error("embedded_redis")
            self.store.log.warning("embedded", "cannot restart the embedded Redis (next try in %.0f s): %s",
                                   self._restart_wait_s, e)

    # -- registration -----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._register(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(str(host_pool_name), host_pool)

    def _register(self, name: str, host_pool: Any) -> None:
        if self._closed:
            raise TierStoreError("tierstore: a host pool registered with a closed backend (attach a new one)")
        page_size = int(host_pool.page_size)
        num_pages = int(host_pool.size) // page_size
        plan: Optional[PagePlan]
        try:
            plan = PagePlan(lambda i: host_pool.get_data_page(i, flat=False), page_size, num_pages)
            page_bytes = plan.page_bytes
        except Exception as e:  # a layout we cannot address in place: copy through flat pages
            logger.info("tierstore: pool %s uses the copy path (%s)", name, e)
            plan = None
            page_bytes = host_pool.get_dummy_flat_data_page().numel() * host_pool.dtype.itemsize
        split = self._split(name, host_pool, plan)
        fields = self._fingerprint(name, host_pool, plan, split)
        ns = self.store.namespace(fields, page_bytes // (split or 1))
        with self._lock:
            self._pools[name] = _Pool(host_pool, ns, plan, split)
        logger.info("tierstore: pool %s -> namespace %s (%s)%s", name, ns.ns, ns.description,
                    "" if split is None else f", {split} head slice(s) a page, shared by TP sizes dividing {fields['tp_lcm']}")

    def _split(self, name: str, pool: Any, plan: Optional[PagePlan]) -> Optional[int]:
        """How many head slices a page of this pool is stored as, to share it with instances
        of other TP sizes (``tp_lcm_size`` in the storage config; heads.py), or None: the
        pool's pages are this rank's own."""
        c = self.storage_config
        lcm = c.tp_lcm_size
        if not lcm or name != KV or c.is_mla_model:
            return None  # (MLA's KV is the same on every rank already: one namespace for all)
        if plan is None:
            s, why = None, "its layout takes the copy path"
        else:
            s, why = heads.split_factor(getattr(pool, "layout", ""), plan.page_shape, plan.region_sizes, c.tp_size, lcm)
        if s is None:
            logger.warning("tierstore: pool %s is not shared across TP sizes (tp_lcm_size %s): %s", name, lcm, why)
        return s

    def _fingerprint(self, name: str, pool: Any, plan: Optional[PagePlan], split: Optional[int] = None) -> dict[str, object]:
        """Everything that makes this pool's page bytes incompatible with another's. Head
        slices (``split``) leave the TP rank and size out: a slice is the same bytes at every
        TP size dividing ``tp_lcm_size``, which goes in instead."""
        c = self.storage_config
        shared_mla = c.is_mla_model and name == KV  # MLA KV is identical on every TP rank
        fields: dict[str, object] = {
            "model": c.model_name or "",
            "pool": name,
            "pool_class": type(pool).__name__,
            "dtype": str(pool.dtype),
            "layout": getattr(pool, "layout", ""),
            "page_size": pool.page_size,
            # Geometry: the page view's shape (layers, heads, dims...) and its byte regions.
            "shape": plan.page_shape if plan is not None else _geometry(pool),
            "regions": plan.region_sizes if plan is not None else "flat",
            "pp": f"{c.pp_rank}/{c.pp_size}",
            "cp": f"{c.attn_cp_rank}/{c.attn_cp_size}",
            "dcp": f"{c.dcp_rank}/{c.dcp_size}",
            "tp": f"*/{c.tp_size}" if shared_mla and c.dcp_size > 1 else "*" if shared_mla else f"{c.tp_rank}/{c.tp_size}",
            "split_heads": c.should_split_heads,
        }
        if split is not None and plan is not None:
            del fields["tp"], fields["split_heads"]
            fields.update(shape=heads.slice_shape(plan.page_shape, split),
                          regions=tuple(r // split for r in plan.region_sizes), tp_lcm=c.tp_lcm_size)
        return fields

    def namespace(self, pool: str = KV) -> Namespace:
        """The namespace a registered host pool's pages are stored in (LookupError if none)."""
        return self._pool(pool).ns

    def zero_copy(self, pool: str = KV) -> bool:
        """Whether this pool's pages move straight between host memory and the page files
        with O_DIRECT (its layout is page-aligned); else through the page cache or copies."""
        p = self._pool(pool)
        return p.plan is not None and p.plan.aligned

    def _pool(self, name: str) -> _Pool:
        pool = self._pools.get(name)
        if pool is None:
            raise LookupError(f"no host pool registered under {name!r}")
        return pool

    # -- page buffers -------------------------------------------------------------

    def _host_pages(self, pool: _Pool, keys: List[str], host_indices: torch.Tensor) -> list[int]:
        ps = pool.plan.page_size if pool.plan is not None else int(pool.host_pool.page_size)
        if host_indices is None or host_indices.numel() != len(keys) * ps:
            got = None if host_indices is None else host_indices.numel()
            raise ValueError(f"{len(keys)} keys need {len(keys) * ps} host indices, got {got}")
        return host_indices[::ps].tolist() if keys else []

    def _read_into_pool(self, pool: _Pool, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        starts = self._host_pages(pool, keys, host_indices)
        if pool.plan is not None:
            tp = self.storage_config.tp_rank
            return pool.per_page(self.store.read(pool.ns, pool.keys(keys, tp), pool.pages(pool.plan.regions(starts)),
                                                 pool.aligned()))
        pages = [pool.host_pool.get_dummy_flat_data_page() for _ in keys]
        ok = self.store.read(pool.ns, keys, [[tensor_bytes(p)] for p in pages], False)
        for start, page, hit in zip(starts, pages, ok):
            if hit:
                pool.host_pool.set_from_flat_data_page(start, page)
        return ok

    def _write_from_pool(self, pool: _Pool, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        starts = self._host_pages(pool, keys, host_indices)
        if pool.plan is not None:
            tp = self.storage_config.tp_rank
            return pool.per_page(self.store.write(pool.ns, pool.keys(keys, tp), pool.pages(pool.plan.regions(starts)),
                                                  pool.aligned()))
        pages = [pool.host_pool.get_data_page(s, flat=True).contiguous() for s in starts]
        return self.store.write(pool.ns, keys, [[tensor_bytes(p)] for p in pages], False)

    def _record(self, kind: str, ok: List[bool], page_bytes: int, t0: float) -> None:
        if self._io_stats is None:
            return
        pages = _leading(ok)
        dt = max(time.perf_counter() - t0, 1e-9)
        with self._lock:
            self._io_stats[f"{kind}_pgs"].append(pages)
            self._io_stats[f"{kind}_bandwidth"].append(pages * page_bytes / dt / 1e9)

    # -- v1: zero-copy KV ---------------------------------------------------------

    @_guarded(lambda keys, *a, **k: 0)
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading keys have a page in the KV pool's namespace: one HMGET round trip.
        A page counted may still miss at the read (evicted meanwhile, rotten, forged)."""
        pool = self._pool(KV)
        (found,) = self.store.exists([(pool.ns, pool.keys(keys, self.storage_config.tp_rank))])
        hits = _leading(pool.per_page(found))
        self.store.metrics.pages("probe", "hit", hits)
        self.store.metrics.pages("probe", "miss", len(keys) - hits)
        return hits

    @_guarded(_no_pages)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read the leading run of present keys straight into the KV host pool at
        ``host_indices`` (``TierStore.read``); True per page whose bytes verified. Never raises."""
        t0 = time.perf_counter()
        pool = self._pool(KV)
        ok = self._read_into_pool(pool, keys, host_indices)
        self._record("prefetch", ok, pool.ns.page_bytes * (pool.split or 1), t0)
        return ok

    @_guarded(_no_pages)
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store the KV host pool's pages at ``host_indices`` (``TierStore.write``): True per
        page stored, now or before. One round trip once this thread holds a stock. Never raises."""
        t0 = time.perf_counter()
        pool = self._pool(KV)
        ok = self._write_from_pool(pool, keys, host_indices)
        self._record("backup", ok, pool.ns.page_bytes * (pool.split or 1), t0)
        return ok

    # -- v2: every pool, with hit policies ------------------------------------------

    @_guarded(lambda keys, *a, **k: PoolTransferResult.empty())
    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """The probe of a hybrid model's pools: the KV pool's leading hits, then each side
        pool's verdict by its hit policy (ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS), in one
        round trip for every pool. Never raises: trouble is an empty result."""
        transfers = list(pool_transfers or [])
        kv = self._pool(KV)
        groups = [(kv.ns, kv.keys(keys, self.storage_config.tp_rank))]
        for t in transfers:
            pool_keys = t.keys if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS and t.keys is not None else keys
            groups.append((self._pool(str(t.name)).ns, pool_keys))
        found = self.store.exists(groups)
        kv_pages = _leading(kv.per_page(found[0]))
        self.store.metrics.pages("probe", "hit", kv_pages)
        self.store.metrics.pages("probe", "miss", len(keys) - kv_pages)
        hit_count: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t, present in zip(transfers, found[1:]):
            name = str(t.name)
            if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                # Its own verdict, never a gate on the KV hit.
                covered = self._block_group_pages(t, present)
                if covered:
                    hit_count[name] = min(covered, kv_pages)
                continue
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = _leading(present[:kv_pages])
                pool_ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                pool_ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])}
                boundary = max(pool_ok, default=0)
            else:
                raise ValueError(f"unsupported hit policy {t.hit_policy!r} for pool {name}")
            if boundary:
                hit_count[name] = boundary
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)

    @staticmethod
    def _block_group_pages(t: PoolTransfer, present: List[bool]) -> int:
        if t.group_pages <= 0 or t.block_pages <= 0:
            raise ValueError(f"pool {t.name}: BLOCK_GROUPS needs positive group_pages and block_pages")
        groups = 0
        while (groups + 1) * t.group_pages <= len(present) and all(present[groups * t.group_pages : (groups + 1) * t.group_pages]):
            groups += 1
        return int(groups * t.block_pages)

    @_guarded(_no_pool_results)
    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """``batch_get_v1`` for each pool's transfer: {pool name: True per page read}."""
        return self._each_transfer(transfers, self._read_into_pool)

    @_guarded(_no_pool_results)
    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """``batch_set_v1`` for each pool's transfer: {pool name: True per page stored}."""
        return self._each_transfer(transfers, self._write_from_pool)

    def _each_transfer(self, transfers: List[PoolTransfer], op: Callable[[_Pool, List[str], torch.Tensor], List[bool]]) -> dict[str, List[bool]]:
        out: dict[str, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            try:
                out[str(t.name)] = op(self._pool(str(t.name)), keys, t.host_indices)
            except (StoreUnavailable, StoreDetached, IndexRefusesUser):  # the whole call's: _guarded's
                raise
            except (ValueError, LookupError) as e:  # a bad transfer from the caller fails alone, as in _guarded
                self.store.metrics.error("bad_call")
                self.store.log.warning(f"bad_call:{t.name}", "pool %s transfer failed: %s", t.name, e)
                out[str(t.name)] = [False] * len(keys)
            except Exception as e:  # a bug: one transfer's does not sink the others
                self.store.metrics.error("internal")
                self.store.log.exception(f"transfer:{t.name}", "pool %s transfer failed", t.name, exc=e)
                out[str(t.name)] = [False] * len(keys)
        return out

    # -- legacy: flat page tensors ------------------------------------------------

    @_guarded(lambda keys, *a, **k: [None] * len(keys))
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Legacy read into flat page tensors (given, or fresh ones): the tensor per hit, None per miss."""
        pool = self._pool(KV)
        pages = list(target_locations) if target_locations is not None else [pool.host_pool.get_dummy_flat_data_page() for _ in keys]
        ok = pool.per_page(self.store.read(pool.ns, pool.keys(keys, self.storage_config.tp_rank),
                                           pool.pages([[tensor_bytes(p)] for p in pages]), False))
        return [p if hit else None for p, hit in zip(pages, ok)]

    @_guarded(lambda keys, *a, **k: False)
    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Legacy write of flat page tensors, one per key: True if every page is stored."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set needs one page tensor per key: {len(keys)} keys")
        pages = [v.contiguous() for v in values]
        pool = self._pool(KV)
        return all(self.store.write(pool.ns, pool.keys(keys, self.storage_config.tp_rank),
                                    pool.pages([[tensor_bytes(p)] for p in pages]), False))

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping and lifecycle -------------------------------------------------

    @_guarded(lambda *a, **k: None)
    def clear(self) -> None:
        """Drop every page of this backend's namespaces (other models' pages stay).
        SGLang calls it on ``POST /hicache/storage-backend/clear``; a write in flight may
        still land afterwards. A failure is logged (SGLang answers 200 all the same)."""
        with self._lock:
            namespaces = [p.ns for p in self._pools.values()]
        n = self.store.clear(namespaces)
        logger.info("tierstore: cleared %d pages", n)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the batches since the last call, or None where
        there were none (SGLang, which calls this on every scheduler step while storage
        metrics are on, reports an empty ``StorageMetrics`` for None itself)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        if self._io_stats is None or not any(self._io_stats.values()):  # (read unlocked: a batch
            return None  # recorded meanwhile is reported at the next call)
        with self._lock:
            stats = {k: list(samples) for k, samples in self._io_stats.items()}
            for samples in self._io_stats.values():
                samples.clear()
        return StorageMetrics(**stats)

    def close(self) -> None:
        """Release everything: threads, page files, Redis connections, leases. SGLang
        calls it on ``DELETE /hicache/storage-backend`` (once its storage threads have
        stopped) and at exit; a new backend may be attached afterwards.

        Calls in flight are waited for, and the threads, at most ``CLOSE_WAIT_S`` in all;
        later calls are misses and open nothing. Whatever a call stuck on a disk that
        stopped answering still holds is released when that call returns. The embedded
        Redis keeps running: the node's other processes share it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + CLOSE_WAIT_S
        calls_done = self._calls.close(CLOSE_WAIT_S)
        released = self.store.close(max(0.0, deadline - time.monotonic()))
        if calls_done and released:
            logger.info("tierstore: closed")
        else:
            logger.warning("tierstore: closed with work still running after %.0f s (a disk that stopped answering?): "
                           "calls done %s, housekeeping and I/O threads stopped and leases given back %s; "
                           "what it holds is released when it returns, its leases expire after lease_s",
                           CLOSE_WAIT_S, calls_done, released)

    def __enter__(self) -> "TierStoreBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
