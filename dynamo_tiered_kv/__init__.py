"""dynamo-tiered-kv: persistent, tiered KV-cache storage for NVIDIA Dynamo and vLLM.

The public surface is the names in ``__all__``: the store (``TieredStore``, built from a
``TieredKVConfig`` by ``build_store``), block identity (``Namespace``) and the errors. The store,
its factory, the settings and ``Namespace`` are imported on first use, so ``import
dynamo_tiered_kv`` (and ``dtkv --help``) stays light: torch and the tiers load only when a program
asks for them. What each package owns: docs/DESIGN.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BadMagic,
    ChecksumMismatch,
    ConfigError,
    HeaderCorrupt,
    KeyMismatch,
    LayoutMismatch,
    NamespaceMismatch,
    PartialWrite,
    RecordError,
    RecordTruncated,
    StagingExhausted,
    TieredKVError,
    TierFull,
    TierUnavailable,
    UnsupportedVersion,
)

if TYPE_CHECKING:
    from .blocks.keys import Namespace
    from .config import TieredKVConfig
    from .factory import build_store
    from .store import TieredStore

__version__ = "0.1.0"

__all__ = [
    "BadMagic",
    "ChecksumMismatch",
    "ConfigError",
    "HeaderCorrupt",
    "KeyMismatch",
    "LayoutMismatch",
    "Namespace",
    "NamespaceMismatch",
    "PartialWrite",
    "RecordError",
    "RecordTruncated",
    "StagingExhausted",
    "TierFull",
    "TierUnavailable",
    "TieredKVConfig",
    "TieredKVError",
    "TieredStore",
    "UnsupportedVersion",
    "__version__",
    "build_store",
]

#: lazily imported public name -> the module that defines it
_LAZY = {"TieredStore": ".store", "build_store": ".factory", "TieredKVConfig": ".config", "Namespace": ".blocks.keys"}


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
