"""A vLLM 0.33 tiering manager built the way vLLM builds it, minus the GPU.

``OffloadingConfig`` -> ``TieringOffloadingSpec`` -> ``get_manager()``: vLLM's own spec creates its
shared offload region (/dev/shm), the CPU primary tier and our tier through its own
``SecondaryTierFactory`` from the ``secondary_tiers`` entry. The GPU worker's part (copying
blocks between GPU and the primary region) is played by ``write_rows``/``read_rows``, which
touch the same region vLLM's worker would.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from dynamo_tiered_kv.connectors.vllm_tiering import DynamoTieredKVTier
from dynamo_tiered_kv.connectors.vllm_tiering.key_mapping import declared_model

TIER = {"type": "DynamoTieredKVTier", "module_path": "dynamo_tiered_kv.connectors.vllm_tiering"}
ROW_BYTES = 8192  # one chunk: 2 workers x 4 KiB (page-aligned, as vLLM lays rows out)


def offloading_config(tier: dict[str, Any], *, chunks: int = 8, events: bool = True, model: str = "org/model",
                      engine_id: str | None = None) -> OffloadingConfig:
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * ROW_BYTES,
             "secondary_tiers": [{**TIER, **tier}], "tier_poll_interval_s": 0}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=ROW_BYTES // 2, enable_kv_cache_events=events, extra_config=extra,
        engine_id=engine_id or f"dtkv-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )


def keys(n: int, tag: str = "k", group: int = 0) -> list[OffloadKey]:
    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), group) for i in range(n)]


def payload(key: OffloadKey) -> np.ndarray:
    """Deterministic bytes of one chunk, different for every key."""
    seed = int.from_bytes(key[:8], "little") ^ int.from_bytes(key[8:16], "little")
    return np.random.default_rng(seed).integers(0, 256, ROW_BYTES, dtype=np.uint8)


@dataclass
class Engine:
    """vLLM's scheduler side of one engine with our tier below its CPU tier."""

    spec: TieringOffloadingSpec
    manager: TieringOffloadingManager
    tier: DynamoTieredKVTier
    ctx: ReqContext = field(default_factory=lambda: ReqContext(req_id=f"r-{uuid.uuid4().hex[:8]}"))

    @classmethod
    def start(cls, tier: dict[str, Any], **kw: Any) -> Engine:
        config = offloading_config(tier, **kw)
        spec = TieringOffloadingSpec(config)
        with declared_model(config.engine_id, config.model.name, config.model.name):  # no engine: the name is the model
            manager = spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        (ours,) = manager.secondary_tiers
        assert isinstance(ours, DynamoTieredKVTier)
        eng = cls(spec, manager, ours)
        eng.new_request()
        return eng

    @property
    def rows(self) -> np.ndarray:
        return np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    def new_request(self, ctx: ReqContext | None = None) -> ReqContext:
        self.ctx = ctx or ReqContext(req_id=f"r-{uuid.uuid4().hex[:8]}")
        with self.manager.lock:
            self.manager.on_new_request(self.ctx)
        return self.ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, ks: Sequence[OffloadKey]) -> None:
        """What a request's saves do: GPU -> CPU tier (our bytes play the GPU's), then the cascade."""
        with self.manager.lock:
            out = self.manager.prepare_store(ks, self.ctx)
            assert out is not None, "primary tier full"
            for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.rows[int(c)] = payload(k)
            self.manager.complete_store(ks, self.ctx, success=True)

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no tier job is in flight (the engine steps while ``has_pending_work``)."""
        end = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < end, "tier jobs did not finish"
            time.sleep(0.005)

    def lookup(self, ks: Iterable[OffloadKey], timeout: float = 30.0) -> list[LookupResult]:
        """Per key: HIT once restored into the CPU tier (stepping while promotions run), else MISS."""
        out = []
        for k in ks:
            end = time.monotonic() + timeout
            while True:
                with self.manager.lock:
                    r = self.manager.lookup(k, self.ctx)
                if r in (LookupResult.HIT, LookupResult.MISS):
                    out.append(r)
                    break
                assert time.monotonic() < end, f"lookup stuck at {r}"
                self.step()
                time.sleep(0.002)
        return out

    def read(self, k: OffloadKey) -> np.ndarray:
        """The chunk's bytes in the CPU tier, as vLLM's worker would copy them to the GPU."""
        with self.manager.lock:
            spec = self.manager.prepare_load([k], self.ctx)
            row = self.rows[int(spec.chunk_ids[0])].copy()
            self.manager.complete_load([k], self.ctx)
        return row

    def evict_primary(self) -> None:
        """Empty vLLM's CPU tier the way a cache reset does (drains our jobs first)."""
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()

    def stop(self) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(self.ctx)
        self.manager.shutdown()
