"""SGLang HiCache storage backend over the tiers (host, SSD, objects).

SGLang loads it with ``--hicache-storage-backend dynamic`` and an extra config naming
``"module_path": "dynamo_tiered_kv.connectors.sglang"``, ``"class_name": "TieredHiCacheStorage"``
and ``"interface_v1": 1`` (zero-copy page I/O). Importing this package imports SGLang; the
helpers in ``identity`` do not need it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TieredHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "TieredHiCacheStorage":  # SGLang's loader does getattr(module, class_name)
        from .backend import TieredHiCacheStorage

        return TieredHiCacheStorage
    raise AttributeError(name)
