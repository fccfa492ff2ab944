"""What the scheduler role tells the worker role each step (pickled across processes).

Blocks are named by *token hashes*: a chained BLAKE2b over the request's token ids (plus tenant
salt and vLLM's per-request ``cache_salt``), computed by the scheduler. vLLM's own block hashes
are seeded randomly per process unless ``PYTHONHASHSEED`` is set, so they cannot name blocks
across restarts. The worker turns a token hash into its store key by mixing in its namespace
(layout, dtype, TP rank), so the scheduler needs no knowledge of the worker's KV layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...blocks.tenant import DEFAULT_TENANT
from ...hints.stats import HintCounts

try:  # the base classes live in vLLM; keep this module importable without it (unit tests)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # pragma: no cover - only without vLLM
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass
try:  # 0.31 and 0.32 have it (their model runners send it back every step)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - only without vLLM
    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class LoadSpec:
    """Restore ``token_hashes[i]`` into engine block ``block_ids[i]``: before this step's forward,
    or with ``is_async`` in the background (the request waits in WAITING_FOR_REMOTE_KVS)."""

    req_id: str
    block_ids: list[int]
    token_hashes: list[bytes]
    is_async: bool = False


@dataclass
class SaveSpec:
    """Offload engine blocks that are full after this step's forward.

    ``token_hashes`` has one more leading entry than ``block_ids`` when ``first_index > 0``: the
    parent of the first block, so the worker can name each record's parent.
    """

    req_id: str
    block_ids: list[int]
    token_hashes: list[bytes]
    first_index: int
    token_ids: list[int] | None = None  # the blocks' tokens, only when KV events are enabled
    lora_id: int | None = None  # the request's LoRA adapter, named in its KV events
    lora_name: str | None = None
    tenant: bytes = DEFAULT_TENANT  # the request's tenant (``blocks.tenant``), written into its records


@dataclass
class RetainSpec:
    """Give the blocks of ``token_hashes`` retention classes (``TieredStore.retain``) held by
    ``holder``; with ``demote``, release ``holder``'s claims on them and move them out of the host
    tier instead; with ``prefetch``, queue their promotion into the fastest tier
    (``session_retain``)."""

    token_hashes: list[bytes]
    priorities: list[int] = field(default_factory=list)
    expiries: list[float | None] = field(default_factory=list)
    demote: bool = False
    prefetch: bool = False
    holder: tuple[str, str | None] = ("", None)  # (tenant digest, kv.retain scope): hints.sessions


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    retains: list[RetainSpec] = field(default_factory=list)  # KV hints (``session_retain``)
    #: the scheduler's cache was reset (weights changed): workers drop their host and SSD blocks
    reset_cache: bool = False
    #: nothing is scheduled this step (every request waits for its restore): the worker may block
    #: briefly in ``get_finished`` instead of letting the engine loop spin on the GIL
    idle: bool = False
    #: the scheduler's number for this step (from 1; 0: unnumbered), echoed back in ``StepEcho``
    step: int = 0
    #: what the scheduler's hint counters gained since the last step that carried them (None:
    #: nothing); the workers export them, having no hints of their own to count
    hint_counts: HintCounts | None = None


@dataclass
class StepEcho(KVConnectorWorkerMetadata):
    """What every worker sends back each step (``KVConnectorOutput.kv_connector_worker_meta``):
    the number of the step it ran, so the scheduler pairs the step's output with the step it
    built. It also keeps the output non-empty, so vLLM hands every step's output to the
    connector, a step without a forward included."""

    step: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Every rank runs the same step; were they ever to differ, the older one is answered.
        return StepEcho(min(self.step, other.step)) if isinstance(other, StepEcho) else self
