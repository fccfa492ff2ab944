"""The README's vLLM >= 0.33 configuration, as written, loads our classes through vLLM 0.33's own
factories: the connector named by ``kv_connector_module_path``, and the tier built from its
``secondary_tiers`` entry (local paths in place of the README's, no S3 endpoint) stores and
restores a chunk."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from tiering_engine import Engine, keys, payload
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from dynamo_tiered_kv.connectors.vllm_tiering import DynamoTieredKVTier
from dynamo_tiered_kv.connectors.vllm_tiering.connector import TieredOffloadingConnector

ROOT = Path(__file__).resolve().parents[2]


def readme_config() -> dict[str, Any]:
    """The README's ``--kv-transfer-config`` for vLLM >= 0.33 (the one naming TieredOffloadingConnector)."""
    found = [json.loads(m.group(1)) for m in re.finditer(r"'(\{.*?\})'", (ROOT / "README.md").read_text())]
    (cfg,) = [c for c in found if c.get("kv_connector") == "TieredOffloadingConnector"]
    return cfg


def test_readme_connector_path_names_our_connector() -> None:
    cfg = readme_config()
    module = importlib.import_module(cfg["kv_connector_module_path"])
    assert getattr(module, cfg["kv_connector"]) is TieredOffloadingConnector


def test_readme_tier_entry_builds_our_tier_and_round_trips_a_chunk(tmp_path: Path) -> None:
    (entry,) = readme_config()["kv_connector_extra_config"]["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is DynamoTieredKVTier
    local = {k: v for k, v in entry.items() if k != "s3_endpoint_url"}
    local.update(ssd_dir=str(tmp_path / "ssd"), object_url=(tmp_path / "objects").as_uri(),
                 ssd_segment_bytes=1 << 20, ssd_capacity_bytes=64 << 20, staging_slab_bytes=256 << 10,
                 staging_slabs=4)
    eng = Engine.start(local)
    try:
        ks = keys(2)
        eng.store(ks)
        eng.settle()
        eng.evict_primary()
        assert eng.lookup(ks) == [LookupResult.HIT] * 2
        assert all(np.array_equal(eng.read(k), payload(k)) for k in ks)
    finally:
        eng.stop()
