"""``TieredHiCacheStorage``: SGLang's HiCache L3 backend over a ``TieredStore``.

SGLang's cache controller calls it from its storage threads (prefetch and backup), never from
the scheduler's forward loop:

* ``batch_exists`` answers from the tiers' in-memory indexes (``TieredStore.lookup``): no I/O.
* ``batch_set_v1`` gathers the host pages straight from SGLang's host pool into a staging slab
  (the only copy; checksums on the way) and returns; tiers are written in the background. A full
  queue drops the pages (counted in ``dtkv_offload_dropped_total``) and reports them unsaved.
* ``batch_get_v1`` reads records, verifies every one and scatters it into the host pages SGLang
  allocated. A missing, corrupt or late page ends the run: it and every later page are reported
  failed, and SGLang recomputes from there. Nothing here raises into SGLang for a tier fault.

Invalidation: SGLang's cache flush (every weight update, ``/flush_cache``) resets its radix tree
and clears the host pool registered here, but never calls ``clear()``; only
``/clear_hicache_storage_backend`` does. So registration wraps the host pool's ``clear`` too:
both move the key epoch (``epoch.KeyEpoch``), which every rank derives alike.

Only the zero-copy interface is served (``"interface_v1": 1``); the legacy per-tensor
``get``/``set`` calls return misses and log once why. Hybrid models' extra pools (``*_v2``) are
not supported.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from ...blocks.keys import ROOT_KEY, BlockKey, Namespace
from ...blocks.layout import EngineLayout
from ...blocks.tenant import tenant_id
from ...config import TieredKVConfig
from ...factory import build_store, check_record_fits
from ...store import TieredStore
from .epoch import KeyEpoch, launch_token, served_weight_version
from .identity import model_identity, namespace_for, page_keys, published_server_args, ranks_of, split_extra_config

log = logging.getLogger(__name__)


class TieredHiCacheStorage(HiCacheStorage):
    """Args are what SGLang's ``StorageBackendFactory`` passes a ``dynamic`` backend:
    ``cls(storage_config, kwargs)``. The store is built when SGLang registers its host pool."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        if not int(extra.get("interface_v1", 0) or 0):
            log.warning("dynamo_tiered_kv: set \"interface_v1\": 1 in the HiCache extra config; without it "
                        "SGLang uses the copying get/set path, which this backend answers with misses")
        self.config = TieredKVConfig.from_mapping(split_extra_config(extra))
        self.ranks = ranks_of(storage_config)
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.server_args = published_server_args()
        if self.server_args is None:
            log.warning("dynamo_tiered_kv: no ServerArgs published in this process; the model identity is the "
                        "model name alone (quantization, revision and overrides are not told apart)")
        self.model_id = model_identity(storage_config.model_name, self.config.model_id or "", self.server_args)
        # SGLang hands the storage backend no request salt: the deployment is one tenant
        self.tenant = tenant_id(None, deployment_salt=self.config.tenant_salt.get_secret_value())
        self.store: TieredStore | None = None
        self.layout: EngineLayout | None = None
        self.namespace: Namespace | None = None
        self.page_size = 0
        self._epoch = KeyEpoch(launch_token())
        self._lock = threading.Lock()  # store construction and close
        self._warned_legacy = False
        self._unhook: Callable[[], None] = lambda: None  # undoes the host pool hook (a detach, then a new attach)

    # --- SGLang wiring ---------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Map the host pool's layout and open the tiers (raising here fails SGLang's attach,
        which is what a wrong setting should do)."""
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            if self.store is not None:
                return
            layout = EngineLayout.from_sglang_host(mem_pool_host.kv_buffer, str(mem_pool_host.layout),
                                                   int(mem_pool_host.page_size), mla=self.is_mla)
            kv_dtype = str(mem_pool_host.dtype).removeprefix("torch.")
            ns = namespace_for(layout.shape, model_id=self.model_id, kv_dtype=kv_dtype, ranks=self.ranks,
                               is_mla=self.is_mla, tenant_salt=self.config.tenant_salt.get_secret_value())
            check_record_fits(self.config, layout.shape, "page")
            self.store = build_store(self.config, ns, rank=self.ranks.process_rank)
            self.layout, self.namespace, self.page_size = layout, ns, int(mem_pool_host.page_size)
            self._clear_on_flush(mem_pool_host)
            log.info("dynamo_tiered_kv SGLang backend: host layout %s -> %s, %d pages, tiers %s",
                     mem_pool_host.layout, layout.shape, layout.num_blocks, [t.name for t in self.store.tiers])

    def _clear_on_flush(self, pool: Any) -> None:
        """SGLang's flush ends in ``UnifiedRadixCache._reset_full`` -> ``mem_pool_host.clear()`` (after
        the cache controller joined its storage threads) on every rank: invalidate there too."""
        flush = pool.clear

        def clear_and_invalidate(*args: Any, **kwargs: Any) -> Any:
            out = flush(*args, **kwargs)
            try:
                self.clear()
            except Exception:
                log.exception("invalidating stored pages after SGLang's cache flush failed")
            return out

        pool.clear = clear_and_invalidate
        self._unhook = lambda: setattr(pool, "clear", flush) if pool.clear is clear_and_invalidate else None

    def keys_of(self, page_hashes: Sequence[str], epoch: bytes | None = None) -> list[BlockKey]:
        assert self.namespace is not None
        return page_keys(self.namespace, page_hashes, self._epoch.value if epoch is None else epoch)

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        """Host page of each of ``n`` keys: the token index that starts it, over ``page_size``."""
        idx = host_indices.reshape(-1)
        if idx.numel() < n * self.page_size:
            log.warning("host_indices hold %d tokens for %d pages of %d", idx.numel(), n, self.page_size)
            return None
        starts = idx[: n * self.page_size : self.page_size].tolist()
        if any(s % self.page_size for s in starts):
            log.warning("host_indices are not page aligned; pages refused")
            return None
        return [s // self.page_size for s in starts]

    # --- zero-copy page interface ---------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages present in any tier, from memory only."""
        store = self.store
        if store is None or not keys:
            return 0
        try:
            return store.lookup(self.keys_of(keys)).num_blocks
        except Exception:
            log.exception("lookup failed; reporting a miss")
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        store, layout = self.store, self.layout
        pages = self._pages(host_indices, len(keys)) if store is not None else None
        if store is None or layout is None or pages is None:
            return [False] * len(keys)
        try:
            res = store.load(layout, pages, self.keys_of(keys), timeout=self.config.load_timeout_s)
        except Exception:
            log.exception("load of %d pages failed; SGLang recomputes them", len(keys))
            return [False] * len(keys)
        ok = len(res.loaded_block_ids)  # a prefix: everything after the first failure failed
        return [True] * ok + [False] * (len(keys) - ok)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self.is_writer:  # MLA: another rank writes the one shared copy
            return [True] * len(keys)
        with self._epoch.setting() as epoch:  # pages of a set begun before a reset keep the old epoch
            store, layout = self.store, self.layout
            pages = self._pages(host_indices, len(keys)) if store is not None else None
            if store is None or layout is None or pages is None:
                return [False] * len(keys)
            prefix = list(extra_info.prefix_keys or []) if extra_info is not None else []
            try:
                chain = self.keys_of(prefix[-1:] + keys, epoch)
                parents = [*chain[:-1]] if prefix else [ROOT_KEY, *chain[:-1]]
                ok = store.submit_offload(layout, pages, chain[-len(keys):], parents, first_index=len(prefix),
                                          tenant=self.tenant)
            except Exception:
                log.exception("offload of %d pages failed; they stay unsaved", len(keys))
                ok = False
        return [ok] * len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- legacy copying interface (SGLang's generic path): not served ---------------------------
    def _legacy(self) -> None:
        if not self._warned_legacy:
            self._warned_legacy = True
            log.warning("dynamo_tiered_kv serves only the zero-copy page interface: add \"interface_v1\": 1 "
                        "to --hicache-storage-backend-extra-config")

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        self._legacy()
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[None]:
        self._legacy()
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._legacy()
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        self._legacy()
        return False

    # --- lifecycle ---------------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's ``/clear_hicache_storage_backend`` and, through the host pool, every cache flush
        (weight updates included): the next key epoch makes every stored page unreachable and this
        node's host and SSD pages are dropped (``cache_reset: keep`` ignores it)."""
        if self.config.cache_reset == "keep" or self.store is None:
            return
        self._epoch.advance(served_weight_version())
        self.store.drop_local()

    def close(self) -> None:
        with self._lock:
            store, self.store = self.store, None
            self._unhook()
        if store is not None:
            store.close()

    def get_stats(self) -> None:
        return None  # our metrics are Prometheus (metrics_port), not SGLang's storage metrics
