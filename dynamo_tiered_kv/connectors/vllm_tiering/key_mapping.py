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

The model identity needs the engine's model and cache configs (revision, quantization,
overrides, the local weights: ``identity.engine_identity``). vLLM 0.33 hands a secondary tier
only its ``OffloadingConfig``, which names the model by path or hub id alone, so the engine's
configs reach the tier through this module: ``TieredOffloadingConnector`` (``connector``)
publishes its ``VllmConfig`` under its ``engine_id`` while vLLM builds its tiers
(``published_engine``), and the tier looks it up by the ``engine_id`` of its spec. A tier whose
engine published nothing cannot know which weights its chunks come from: it keeps them to itself
(a namespace unique to that tier, ``engine_model_id``) rather than share them by name.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ...blocks.keys import ROOT_KEY, BlockKey, Namespace, engine_block_key
from ...errors import ConfigError
from ..common.identity import engine_identity

log = logging.getLogger(__name__)

LAYOUT_PREFIX = "vllm-tiering/1:"
#: ``model_id`` field of a tier that does not know its engine's weights (followed by a random token)
UNSHARED_MARK = "unshared="


@dataclass(frozen=True)
class _Published:
    """What one engine told the tiers built for it: its model's name and how to identify it."""

    model: str  # vLLM's ``model_config.model``, as the engine's ``OffloadingConfig`` names it
    identity: Callable[[str], str]  # the tier's ``model_id`` setting ("" for none) -> model identity


_published: dict[str, _Published] = {}  # engine_id -> what that engine published
_published_lock = threading.Lock()  # engines may be built on several threads of one process


@contextmanager
def _publishing(engine_id: str, entry: _Published) -> Iterator[None]:
    with _published_lock:
        if engine_id in _published:
            raise ConfigError(f"vLLM engine_id {engine_id!r} is building its offloading tiers twice at once in this "
                              "process; every engine needs its own engine_id")
        _published[engine_id] = entry
    try:
        yield
    finally:
        with _published_lock:
            _published.pop(engine_id, None)


@contextmanager
def published_engine(vllm_config: Any) -> Iterator[None]:
    """While inside, a tier built for this engine (its ``kv_transfer_config.engine_id``) takes its
    model identity from ``vllm_config``'s model and cache configs (``identity.engine_identity``).

    Entered by ``TieredOffloadingConnector`` around vLLM's own connector construction, on the
    thread that builds the engine; the tier reads it in its constructor, on the same thread.
    """
    engine_id = str(vllm_config.kv_transfer_config.engine_id)
    entry = _Published(str(vllm_config.model_config.model),
                       lambda override: engine_identity(vllm_config, override=override))
    with _publishing(engine_id, entry):
        yield


@contextmanager
def declared_model(engine_id: str, model: str, model_id: str) -> Iterator[None]:
    """For tools and tests that build vLLM's offloading spec without an engine: while inside, a
    tier built for ``engine_id`` (whose ``OffloadingConfig`` names ``model``) is identified as
    ``model_id`` (or by its own ``model_id`` setting), which the caller vouches names the weights."""
    with _publishing(engine_id, _Published(model, lambda override: override or model_id)):
        yield


def engine_model_id(offloading_spec: Any, override: str = "") -> str:
    """Model identity of a tier built by vLLM for ``offloading_spec`` (vLLM's ``OffloadingSpec``).

    With the engine's configs published for the spec's ``engine_id``: ``engine_identity`` with the
    tier's ``model_id`` setting (``override``) as the name. Without (vLLM's stock
    ``OffloadingConnector``, or a tool that declared nothing): the name, then ``|unshared=``
    and a random token, and a warning: its records are found by this tier only, never by another
    process, another engine or a later start, since the same name may be other weights there.
    """
    config = offloading_spec.config
    name = str(config.model.name)
    with _published_lock:
        entry = _published.get(str(config.engine_id))
    if entry is not None:
        if entry.model != name:
            raise ConfigError(f"vLLM engine {config.engine_id!r} published model {entry.model!r} but its offloading "
                              f"config names {name!r}")
        return entry.identity(override)
    log.warning(
        "vLLM secondary tier: the engine did not hand over its model config, so the weights behind %r (revision, "
        "quantization, overrides, files) are unknown; this tier's chunks are kept to this tier and will NOT be "
        "found after a restart or by other engines. To share them, use kv_connector \"TieredOffloadingConnector\" "
        "with kv_connector_module_path \"dynamo_tiered_kv.connectors.vllm_tiering.connector\" in place of "
        "OffloadingConnector", override or name)
    return f"{override or name}|{UNSHARED_MARK}{secrets.token_hex(8)}"


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
