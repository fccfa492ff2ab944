"""vLLM KV connector. ``kv_connector_module_path="dynamo_tiered_kv.connectors.vllm"`` and
``kv_connector="TieredKVConnector"``. The class is imported lazily, so helpers in this package
import without vLLM."""

from __future__ import annotations

from typing import Any

__all__ = ["TieredKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TieredKVConnector":
        from .connector import TieredKVConnector

        return TieredKVConnector
    raise AttributeError(name)
