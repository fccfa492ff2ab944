"""A vLLM 0.33 engine's configs for a tiny local checkpoint, and the tier its connector builds from them.

``vllm_config`` is a real ``VllmConfig`` (``ModelConfig`` of a checkpoint on disk, ``CacheConfig``,
``KVTransferConfig`` naming the connector and our tier); ``kv_cache_config`` plans the KV cache
with the engine core's own functions (layout resolution, global groups, per-worker configs, the
scheduler's config) from the attention spec of the model's layers; ``start`` builds the
connector's scheduler role through vLLM's ``KVConnectorFactory``, as the engine's scheduler
does; its spec builds the tiers (``get_manager``). Nothing is patched: what the tier sees is
what vLLM hands it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering_engine import TIER, Engine
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from dynamo_tiered_kv.connectors.vllm_tiering import DynamoTieredKVTier
from dynamo_tiered_kv.connectors.vllm_tiering.connector import TieredOffloadingConnector

BLOCKS = 64  # GPU blocks the plan gets memory for


def tier_settings(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {**TIER, "ssd_dir": str(tmp_path / "ssd"), "ssd_segment_bytes": 1 << 20, "ssd_capacity_bytes": 64 << 20,
            "staging_slab_bytes": 256 << 10, "staging_slabs": 4, **kw}


def vllm_config(model: str | Path, tier: dict[str, Any], *, connector: type = TieredOffloadingConnector,
                cache: dict[str, Any] | None = None, **model_kw: Any) -> VllmConfig:
    """One engine's config: ``model_kw`` go to ``ModelConfig``, ``cache`` to ``CacheConfig``; a
    new ``engine_id`` each call, as every engine start gets."""
    ktc = KVTransferConfig(
        kv_connector=connector.__name__, kv_role="kv_both", engine_id=f"dtkv-id-{uuid.uuid4().hex[:12]}",
        kv_connector_module_path=None if connector is OffloadingConnector else connector.__module__,
        kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 * 8192,
                                   "secondary_tiers": [dict(tier)], "tier_poll_interval_s": 0})
    return VllmConfig(model_config=ModelConfig(model=str(model), max_model_len=512, **model_kw),
                      cache_config=CacheConfig(block_size=16, **(cache or {})), kv_transfer_config=ktc,
                      device_config=DeviceConfig(device="cpu"))


def kv_cache_config(vc: VllmConfig) -> KVCacheConfig:
    """The scheduler's KV cache config, planned by the engine core's functions for the model's
    attention layers (one full-attention group)."""
    mc, cc, pc = vc.model_config, vc.cache_config, vc.parallel_config
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    spec = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(), dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc))
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}]
    resolve_kv_cache_layout(vc, [["LBHNC"]], list(specs[0].values()))
    groups = get_global_kv_cache_groups(vc, specs)
    configs = get_kv_cache_configs(vc, specs, [spec.page_size_bytes * len(specs[0]) * BLOCKS], groups)
    for c in configs:
        c.kv_cache_layout = cc.kv_cache_layout
    return generate_scheduler_kv_cache_config(configs)


@dataclass
class Built:
    """The scheduler side of one engine: its connector and the tier vLLM built under it."""

    connector: OffloadingConnector
    engine: Engine

    @property
    def tier(self) -> DynamoTieredKVTier:
        return self.engine.tier

    def stop(self) -> None:
        self.engine.stop()  # finishes its request, shuts the manager (and with it our tier) down


def start(vc: VllmConfig) -> Built:
    """The connector named by ``vc`` in its scheduler role, built by vLLM's ``KVConnectorFactory``
    as the engine's scheduler builds it."""
    connector = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER,
                                                    kv_cache_config=kv_cache_config(vc))
    assert isinstance(connector, OffloadingConnector)
    assert type(connector).__name__ == vc.kv_transfer_config.kv_connector
    manager = connector.connector_scheduler.manager
    assert isinstance(manager, TieringOffloadingManager)
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, DynamoTieredKVTier)
    engine = Engine(None, manager, tier)  # type: ignore[arg-type]  # the spec is the connector's
    engine.new_request()
    return Built(connector, engine)


def namespace_of(vc: VllmConfig) -> str:
    """The namespace of the tier vLLM builds for ``vc`` (the tier is stopped again)."""
    built = start(vc)
    try:
        return built.tier.namespace.hex()
    finally:
        built.stop()
