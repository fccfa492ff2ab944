"""vLLM ``OffloadKey`` -> our block key, inside a namespace derived from vLLM's offloading config.

A vLLM 0.33 offload key is ``block_hash + group_idx`` (4 bytes, big-endian): the hash of the last
GPU block of a chunk of ``blocks_per_chunk`` blocks, already chained over the whole prefix (and
the request's cache salt, LoRA and multimodal inputs) by vLLM. Its record payload is one row of
vLLM's CPU tier: every worker's pages of that chunk, in vLLM's host layout, padding included.

Our key is ``engine_block_key(namespace, ROOT_KEY, offload_key)`` (``keys``): the namespace pins
what makes a row's bytes reusable (model identity, KV dtype, the chunk geometry, the KV cache
groups and their layers, the parallel shape unless vLLM certified the bytes topology-free, the
layout and canonical-format choice) and the tenant salt, so two engines share records exactly
when their rows are interchangeable. Records written by our own KV connector are never found
here, nor the reverse (docs/FORMAT.md, "vLLM secondary tier keys").
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ...keys import ROOT_KEY, BlockKey, Namespace, engine_block_key
from ..vllm.identity import model_identity

log = logging.getLogger(__name__)

LAYOUT_PREFIX = "vllm-tiering/1:"


def engine_model_id(config: Any, override: str = "") -> str:
    """Model identity of the engine whose offloading ``config`` (vLLM ``OffloadingConfig``) this is.

    The scheduler builds its connector inside vLLM's current config, which names the revision,
    quantization, overrides and local weights (``identity.model_identity``); without it (a bench,
    a test) only the model name and ``override`` are known.
    """
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - every vLLM with tiering has it
        vllm_config = None
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and str(model_config.model) == config.model.name:
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        return model_identity(model_config, override=override, kv_cache_dtype=cache_dtype)
    return override or config.model.name


def namespace_for(config: Any, row_bytes: int, *, model_id: str, tenant_salt: str) -> Namespace:
    """Namespace of the chunks of one engine: ``config`` is vLLM's ``OffloadingConfig`` (None: a
    bench driving the tier alone, whose rows are known only by their size)."""
    if config is None:
        return Namespace(model_id, "bytes", LAYOUT_PREFIX + json.dumps({"row_bytes": row_bytes}), 1, 1, 1,
                         row_bytes, tenant_salt=tenant_salt)
    parallel = config.parallel
    portable = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    geometry: dict[str, Any] = {
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "row_bytes": row_bytes,
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": bool(config.canonical_layout),
        "replicated_layout": bool(config.replicated_layout),
    }
    if not portable:  # rows hold every worker's shard: the topology is part of the bytes
        geometry.update(world_size=parallel.world_size, pcp_size=parallel.pcp_size, dcp_size=parallel.dcp_size,
                        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block)
    tokens_per_chunk = (config.groups[0].tokens_per_block if config.groups else config.cache.tokens_per_hash) \
        * config.cache.blocks_per_chunk
    return Namespace(
        model_id=model_id,
        kv_dtype=config.model.dtype,
        layout=LAYOUT_PREFIX + json.dumps(geometry, sort_keys=True, separators=(",", ":")),
        block_size=max(1, tokens_per_chunk),
        num_layers=max(1, sum(len(g.layer_names) for g in config.groups)),
        num_kv_heads=1,
        head_size=row_bytes,
        tp_size=1 if portable else parallel.tp_size,
        pp_size=1 if portable else parallel.pp_size,
        tenant_salt=tenant_salt,
    )


def block_keys(namespace: Namespace, offload_keys: Any) -> list[BlockKey]:
    """Our key of each vLLM offload key (the whole key, group index included)."""
    return [engine_block_key(namespace, ROOT_KEY, bytes(k)) for k in offload_keys]
