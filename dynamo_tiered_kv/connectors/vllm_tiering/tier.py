"""``DynamoTieredKVTier``: our SSD segment log and S3 object tier as ONE vLLM 0.33 secondary tier.

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` owns the GPU <-> CPU copies and its
CPU tier (the primary); chunks it stores there cascade to each secondary tier, and chunks found
in a secondary tier are promoted back into the primary. This tier hands those chunks to one
``TieredStore`` (``factory.build_store``): SSD written by the store, S3 fed by its flusher from
sealed segments, one in-memory index over both (docs/DESIGN.md, "vLLM secondary tier").

Contract kept (vLLM's ``SecondaryTierManager`` runs on the scheduler thread, under its lock):

* ``lookup`` reads the store's in-memory index only. A chunk accepted for writing but not yet
  in a tier is ``RETRY`` (until the write lands or the store has nothing queued); a chunk whose
  load failed is ``MISS`` until it is stored again.
* ``submit_store``/``submit_load`` enqueue a job on our threads (``jobs``) and return. A store
  job copies its chunks from the primary into staging (records are encoded and checksummed
  there) and is done once the copy is: the primary slots are free again while the SSD write
  proceeds. A load job restores with one deadline (``load_timeout_s`` from submission). Chunks
  on the SSD are read straight into their primary rows and verified there (no staging copy);
  chunks from S3 are verified in staging before their bytes are copied into the rows. A record
  that fails (corrupt, missing, late) fails its key and every key after it: ``successful_keys``
  names the prefix that was restored, and vLLM never uses a failed key's row (it recomputes).
* ``drain_jobs`` waits for our jobs; ``shutdown`` waits for them, then closes the store, which
  writes every accepted chunk, seals the open segment and lets the flusher upload (bounded by
  ``close_flush_timeout_s``); what is sealed but not uploaded by then is uploaded at next start.
* Hints: a request's ``kv_hints`` envelope is kept on its context (``RequestHints``); its
  ``kv.retain`` directives give the chunks it stores or looks up their retention class in the
  store, a ``dtkv.prefetch`` queues a retained session's chunks up into the SSD, and a
  session's final request demotes its chunks (``session_hints``). Hint counters are on the
  store's metrics registry.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...blocks.codec import record_bytes
from ...blocks.keys import ROOT_KEY, BlockKey
from ...blocks.tenant import tenant_id
from ...factory import build_store, check_record_fits, worker_rank
from .config import split_settings
from .events import TierEvents
from .jobs import JobRunner
from .key_mapping import block_keys, engine_model_id, namespace_for
from .primary import primary_layout, primary_rows
from .session_hints import HintApplier

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

#: a chunk accepted for writing is RETRY at most this long (then MISS: the engine recomputes)
PENDING_RETRY_S = 5.0
#: failed keys remembered as MISS (oldest forgotten first)
MAX_FAILED_KEYS = 1 << 16
#: after a direct load waited past its deadline for a read in flight, loads go through staging this long
STAGED_AFTER_LATE_S = 60.0
#: staged keys remembered as RETRY; past this, expired ones go, then the oldest (a tier whose
#: writes keep failing never reports them stored)
MAX_PENDING_KEYS = 1 << 16


@dataclass(frozen=True)
class RequestHints:
    """The request's ``kv_hints`` envelope, kept on its ``ReqContext`` (``get_state(RequestHints)``)."""

    envelope: Any  # vllm.v1.kv_hints.KvHintsEnvelope


class DynamoTieredKVTier(SecondaryTierManager):
    """SSD + S3 (dynamo-tiered-kv) below vLLM's CPU offloading tier.

    Configured by the keys of its ``secondary_tiers`` entry: any ``TieredKVConfig`` setting
    (``ssd_dir``, ``object_url``, ``s3_endpoint_url``, ``tenant_salt``, capacities, TTLs...) plus
    the ``TierOptions`` (``config``).

    Model identity (``key_mapping.engine_model_id``): built under ``TieredOffloadingConnector``
    (``connector``), the namespace names the engine's full model identity, with the ``model_id``
    setting replacing only the model's path or hub id, so chunks are shared across restarts and
    nodes exactly when the weights and their settings are the same. Under vLLM's stock
    ``OffloadingConnector`` the engine's configs never reach the tier: it then keeps its chunks
    to itself (a namespace unique to this instance, with a warning) rather than share them by a
    name that other weights may carry. ``open_tier`` without a spec (a bench, no engine) names
    the model by ``model_id`` as given.
    """

    medium: ClassVar[Medium] = Medium.STORAGE  # cache_hit_source DISK (SSD); S3 only: set per instance

    def __init__(self, offloading_spec: OffloadingSpec | None, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)  # type: ignore[arg-type]
        self.config, self.options = split_settings(settings)
        self.layout = primary_layout(primary_kv_view)
        # each chunk's row IS a record's payload (opaque bytes, one layer): loads read records
        # straight into the rows and verify them there (``TieredStore.load_into``)
        self._rows: np.ndarray | None = primary_rows(primary_kv_view)
        self._staged_until = 0.0  # monotonic: until then loads go through staging (``_load``)
        check_record_fits(self.config, self.layout.shape, "chunk")
        self._record_bytes = record_bytes(self.layout.shape)
        spec_config = getattr(offloading_spec, "config", None)
        salt = self.config.tenant_salt.get_secret_value()
        # vLLM hands a secondary tier no request (its cache_salt is inside vLLM's block hashes): the
        # deployment is one tenant for quotas and listings; its salt still keys every block
        self.tenant = tenant_id(None, deployment_salt=salt)
        if spec_config is not None:  # the engine's model identity, or a namespace of this tier's own
            model_id = engine_model_id(offloading_spec, self.config.model_id or "")
            self.namespace = namespace_for(spec_config, self.block_size_bytes, model_id=model_id, tenant_salt=salt)
            # one tier per engine (its scheduler): only data-parallel replicas tell tiers of a host apart
            rank = worker_rank(tp_rank=0, tp_size=1, dp_rank=spec_config.parallel.data_parallel_index)
        else:  # driven without vLLM's spec (a bench; no engine, no weights): model_id names the model as given
            if not self.config.model_id:
                raise ValueError("model_id must be set when the tier is built without vLLM's offloading spec")
            self.namespace = namespace_for(None, self.block_size_bytes, model_id=self.config.model_id,
                                           tenant_salt=salt)
            rank = 0
        self.locality = Locality(self.options.locality.upper()) if self.options.locality else \
            Locality.LOCAL if self.config.ssd_dir is not None else Locality.REMOTE
        if self.config.ssd_dir is None:  # hits come from the shared object store
            self.cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED  # type: ignore[misc]
        events_on = bool(self.options.enable_kv_events and offloading_spec is not None
                         and offloading_spec.kv_events_config.enable_kv_cache_events)
        self._events = TierEvents(tier_type, self.options.tracked_keys, self.locality) if events_on else None
        self._lock = threading.Lock()  # guards _pending and _failed (scheduler thread, jobs, store loop)
        self._pending: dict[BlockKey, float] = {}  # accepted for writing, not yet in a tier: monotonic deadline
        self._failed: OrderedDict[BlockKey, None] = OrderedDict()
        self.store = build_store(self.config, self.namespace, rank=rank)
        self.store.set_residency(self)
        self._hints = HintApplier(self.store, _chunk_tokens(offloading_spec))
        self._hints.stats.register(self.store.metrics.registry)
        self._jobs = JobRunner(self.options.job_threads, f"dtkv-{tier_type}")
        self._closed = False
        log.info("vLLM secondary tier %s: %s, chunk %d bytes, namespace %s", tier_type,
                 ", ".join(t.name for t in self.store.tiers), self.block_size_bytes, self.namespace.hex())

    # --- residency (the store's listener) ------------------------------------------------
    def stored(self, medium: str, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                self._pending.pop(bytes(k), None)
        if self._events is not None:
            self._events.stored(medium, keys)

    def removed(self, medium: str, keys: Sequence[BlockKey]) -> None:
        if self._events is not None:
            self._events.removed(medium, keys)

    # --- scheduler-facing ------------------------------------------------------------------
    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        (bk,) = block_keys(self.namespace, (key,))
        self._hints.on_keys(req_context, (key,), (bk,))
        with self._lock:
            if bk in self._failed:
                return LookupResult.MISS
        if self.store.lookup((bk,)).num_blocks:
            return LookupResult.HIT
        with self._lock:
            until = self._pending.get(bk)
            if until is None:
                return LookupResult.MISS
            if time.monotonic() < until and self.store.writer.pending_offloads:
                return LookupResult.RETRY
            self._pending.pop(bk, None)  # its write failed or was dropped
        return LookupResult.MISS

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        bks = block_keys(self.namespace, keys)
        self._hints.on_keys(job_metadata.req_context, keys, bks)
        if self._events is not None:
            self._events.remember(bks, keys)
        with self._lock:
            for k in bks:
                self._failed.pop(k, None)
        ids = [int(c) for c in job_metadata.chunk_ids]
        self._jobs.submit(job_metadata.job_id, functools.partial(self._store, job_metadata.job_id, ids, bks))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        ids = [int(c) for c in job_metadata.chunk_ids]
        deadline = job_metadata.submit_time + self.config.load_timeout_s
        self._jobs.submit(job_metadata.job_id, functools.partial(self._load, job_metadata.job_id, ids, keys,
                                                                  deadline))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return self._jobs.finished()

    @override
    def has_pending_work(self) -> bool:
        return self._jobs.busy

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._events.take() if self._events is not None else ()

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        hints = getattr(req_context, "kv_hints", None)
        if hints is not None:
            req_context.set_state(RequestHints(hints))
        self._hints.on_new_request(req_context)
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._hints.on_request_finished(req_context)

    @override
    def drain_jobs(self) -> None:
        self._jobs.wait_idle()

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.stop()
        self.store.close()
        self.layout = None  # type: ignore[assignment]  # drop our views of vLLM's region before it unmaps
        self._rows = None

    # --- jobs (our threads) ----------------------------------------------------------------
    def _store(self, job_id: int, ids: list[int], bks: list[BlockKey]) -> JobResult:
        t0 = time.monotonic()
        per_slab = max(1, self.config.staging_slab_bytes // self._record_bytes)
        give_up = t0 + self.options.store_wait_s
        accepted = 0
        for i in range(0, len(ids), per_slab):
            part, keys = ids[i:i + per_slab], bks[i:i + per_slab]
            with self._lock:
                for k in keys:
                    self._pending[k] = t0 + PENDING_RETRY_S
                if len(self._pending) > MAX_PENDING_KEYS:
                    self._prune_pending_locked(time.monotonic())
            # one slab's worth is accepted or dropped whole; short of a free slab or queue room it
            # waits (the primary keeps the chunks pinned for us) and is offered once there is room,
            # so a wait does not count as another sighting for admission
            while not (self._has_room() and self.store.submit_offload(self.layout, part, keys, [ROOT_KEY] * len(keys),
                                                                      tenant=self.tenant)):
                if self.store.closed or time.monotonic() >= give_up:
                    with self._lock:
                        for k in bks[i:]:
                            self._pending.pop(k, None)
                    return JobResult(job_id, False, transfer_time=time.monotonic() - t0,
                                     transfer_bytes=accepted * self.block_size_bytes)
                time.sleep(0.002)
            accepted += len(part)
            give_up = time.monotonic() + self.options.store_wait_s  # the bound is per slab: progress resets it
        return JobResult(job_id, True, transfer_time=time.monotonic() - t0,
                         transfer_bytes=accepted * self.block_size_bytes)

    def _prune_pending_locked(self, now: float) -> None:
        for k in [k for k, until in self._pending.items() if until <= now]:
            del self._pending[k]
        while len(self._pending) > MAX_PENDING_KEYS:
            del self._pending[next(iter(self._pending))]

    def _has_room(self) -> bool:
        writer = self.store.writer
        return self.store.staging.free_count > 0 and writer.pending_offloads < writer.max_pending_offloads

    def _load(self, job_id: int, ids: list[int], keys: list[OffloadKey], deadline: float) -> JobResult:
        t0 = time.monotonic()
        bks = block_keys(self.namespace, keys)
        n = 0
        if deadline > t0:
            n = self._restore(ids, bks, deadline)
        took = time.monotonic() - t0
        if n == len(keys):
            return JobResult(job_id, True, transfer_time=took, transfer_bytes=n * self.block_size_bytes)
        with self._lock:
            for k in bks[n:]:
                self._failed[k] = None
            while len(self._failed) > MAX_FAILED_KEYS:
                self._failed.popitem(last=False)
        log.warning("secondary tier load restored %d of %d chunks; the rest are recomputed", n, len(keys))
        return JobResult(job_id, False, successful_keys=tuple(keys[:n]) or None, transfer_time=took,
                         transfer_bytes=n * self.block_size_bytes)

    def _restore(self, ids: list[int], bks: list[BlockKey], deadline: float) -> int:
        """Restore chunks into rows ``ids`` by ``deadline``; how many leading ones were restored.

        Chunks of tiers that read into the caller's buffers (the SSD; S3, whose GET bodies are
        received into the rows) are read straight into their rows and verified there; the rest
        (host memory, encrypted records, or all of them while ``_staged_until`` holds) through
        staging slabs, verified there and then copied into the rows. A row whose chunk failed
        holds unspecified bytes; vLLM is told it failed and recomputes it. A direct load waits for
        a blocking SSD read still in flight at its deadline (it writes into vLLM's row, which must
        not be handed back before it lands; S3 GETs are cancelled instead); after one did, loads
        are staged for ``STAGED_AFTER_LATE_S``, since staged reads can be abandoned at the
        deadline."""
        rows = self._rows
        n = 0
        now = time.monotonic()
        if rows is not None and now >= self._staged_until:
            into = self.store.load_into(self.layout.shape, [rows[c] for c in ids], bks, timeout=deadline - now)
            if into.waited_past_deadline:
                self._staged_until = time.monotonic() + STAGED_AFTER_LATE_S
            n = into.restored
            if n < into.planned or n == len(ids):
                return n
            now = time.monotonic()
            if now >= deadline:
                return n
        return n + len(self.store.load(self.layout, ids[n:], bks[n:], timeout=deadline - now).loaded_block_ids)


def open_tier(settings: Mapping[str, Any], primary_kv_view: memoryview, offloading_spec: OffloadingSpec | None = None,
              tier_type: str = "dtkv") -> DynamoTieredKVTier:
    """Build the tier as vLLM's factory would (for benches and tools): ``settings`` are the keys of
    a ``secondary_tiers`` entry; without ``offloading_spec``, ``model_id`` must name the model."""
    return DynamoTieredKVTier(offloading_spec, primary_kv_view, tier_type, **dict(settings))


def _chunk_tokens(spec: Any) -> int | None:
    """Tokens per offloaded chunk (a chunk's end position over this is its index), None unknown."""
    try:
        return int(spec.tokens_per_block[0]) * int(spec.blocks_per_chunk)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
