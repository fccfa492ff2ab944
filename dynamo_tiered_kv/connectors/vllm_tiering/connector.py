"""``TieredOffloadingConnector``: vLLM's own ``OffloadingConnector`` that tells its tiers which model it serves.

vLLM 0.33 builds its offloading spec, and from it every secondary tier, out of an
``OffloadingConfig`` that names the model only by its path or hub id: the revision, quantization,
``hf_overrides``, dtype behind a quantized KV cache and the files at a local path never reach a
tier, and vLLM's block hashes do not depend on them either. A persistent tier keyed by that name
alone would serve one engine's chunks to another engine whose weights differ.

This class is ``OffloadingConnector`` unchanged, except that it publishes the engine's
``VllmConfig`` under its ``engine_id`` while vLLM builds the connector (``key_mapping.
published_engine``), so ``DynamoTieredKVTier`` names its chunks by the full model identity
(``identity.engine_identity``) and shares them across restarts and nodes exactly when the weights
and their settings are the same::

    --kv-transfer-config '{"kv_connector": "TieredOffloadingConnector",
      "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm_tiering.connector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", ...}}'

Under vLLM's stock ``OffloadingConnector`` the tier still works, but keeps its chunks to itself
(docs/FORMAT.md, "vLLM secondary tier keys").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .key_mapping import published_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["TieredOffloadingConnector"]


class TieredOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` whose secondary tiers know the engine's model identity.

    Built by vLLM (``KVConnectorFactory``) on the thread that builds the engine, once per role;
    the scheduler role builds the tiers (``spec.get_manager()``) inside the publication, which
    ends when the constructor returns; the worker role builds none and publishes nothing.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        if role != KVConnectorRole.SCHEDULER:  # a worker builds no tier: nothing to publish
            super().__init__(vllm_config, role, kv_cache_config)
            return
        with published_engine(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)
