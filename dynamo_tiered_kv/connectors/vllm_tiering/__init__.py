"""dynamo-tiered-kv as a secondary tier under vLLM >= 0.33's own ``OffloadingConnector``.

``--kv-transfer-config '{"kv_connector": "TieredOffloadingConnector", "kv_role": "kv_both",
"kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm_tiering.connector",
"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
"secondary_tiers": [{"type": "DynamoTieredKVTier", "module_path": "dynamo_tiered_kv.connectors.vllm_tiering",
"ssd_dir": "/nvme/kv", "object_url": "s3://bucket/kv"}]}}'``

``TieredOffloadingConnector`` (``connector``) is vLLM's ``OffloadingConnector`` that also hands the
tier the engine's model config; under the stock one the tier keeps its chunks to itself.

Modules: ``tier`` (the ``SecondaryTierManager``), ``key_mapping`` (offload key -> our key and
namespace), ``config`` (settings), ``events`` (KV events), ``jobs`` (our threads), ``primary``
(vLLM's CPU tier as a layout). Importing this package needs vLLM >= 0.33.
"""

from .tier import DynamoTieredKVTier, RequestHints, open_tier

__all__ = ["DynamoTieredKVTier", "RequestHints", "open_tier"]
