"""Namespace and keys for SGLang pages, under the same rules as the vLLM connector.

SGLang hands the backend page hashes (strings; each already chains its whole token prefix), a
``HiCacheStorageConfig`` (parallel ranks, model name, MLA or not) and its host pool (dtype,
geometry, layout). The ``Namespace`` pins what makes the bytes interchangeable: model identity
(with the weights fingerprint of a local checkpoint, as ``connectors/vllm/identity.py``), KV
dtype, canonical layout and shape, TP rank and size, pipeline stage, and the tenant salt. A key is
``engine_block_key(namespace, ROOT_KEY, epoch + page_hash)``, the vLLM worker's rule for
engine-supplied hashes, so tenants and models can never read each other's pages.

MLA KV is the same on every TP rank (SGLang writes it from one rank), so an MLA namespace uses
TP rank 0 of 1 and every rank reads the one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...keys import ROOT_KEY, BlockKey, Namespace, engine_block_key
from ...layout import BlockShape
from ..vllm.identity import weights_fingerprint

#: keys of SGLang's ``--hicache-storage-backend-extra-config`` that SGLang itself reads
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "enable_metadata_cache",
                         "metadata_ttl", "tp_lcm_size"})


def split_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Our settings from SGLang's extra config (SGLang's own keys removed; the rest must be ours)."""
    return {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}


@dataclass(frozen=True)
class Ranks:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int

    @property
    def process_rank(self) -> int:
        """Unique per worker process of a host: names its SSD directory, offsets its metrics port."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank


def ranks_of(storage_config: Any) -> Ranks:
    """Parallel identity from a ``HiCacheStorageConfig``; context parallelism is refused (each rank
    would hold an interleaved share of a page's tokens, which the key does not name)."""
    if int(getattr(storage_config, "attn_cp_size", 1) or 1) > 1 or int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
        raise ConfigError("dynamo_tiered_kv SGLang backend: attention/decode context parallelism is not supported")
    return Ranks(int(storage_config.tp_rank), int(storage_config.tp_size), int(storage_config.pp_rank),
                 int(storage_config.pp_size), int(getattr(storage_config, "dp_rank", 0) or 0))


def model_identity(model_name: str | None, override: str = "") -> str:
    """``model_id`` override or SGLang's model name, plus the weights fingerprint of a local checkpoint."""
    base = override or model_name or ""
    if not base:
        raise ConfigError("SGLang gave no model name: set model_id in the backend's extra config")
    fp = weights_fingerprint(model_name) if model_name else ""
    return f"{base}|weights={fp}" if fp else base


def namespace_for(shape: BlockShape, *, model_id: str, kv_dtype: str, ranks: Ranks, is_mla: bool,
                  tenant_salt: str) -> Namespace:
    """The layout field is the canonical format (not the host layout): every SGLang host layout
    stores the same canonical bytes, so a restart with another ``--hicache-mem-layout`` still hits."""
    tp_rank, tp_size = (0, 1) if is_mla else (ranks.tp_rank, ranks.tp_size)
    return Namespace(model_id, kv_dtype, shape.canonical.name, shape.block_size, shape.num_layers,
                     shape.num_kv_heads, shape.head_size, tp_rank, tp_size, tenant_salt=tenant_salt,
                     pp_rank=ranks.pp_rank, pp_size=ranks.pp_size)


def page_keys(namespace: Namespace, page_hashes: Sequence[str], epoch: bytes = b"") -> list[BlockKey]:
    """Store keys of SGLang page hashes; ``epoch`` (empty until a cache reset) makes older keys unreachable."""
    return [engine_block_key(namespace, ROOT_KEY, epoch + h.encode()) for h in page_hashes]
