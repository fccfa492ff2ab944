"""``TieredStore``: lookup, offload and onboard of KV blocks across tiers (fast -> slow).

``TieredStore`` is a facade over three parts it builds and owns: a writer (``store.writes``:
offload, deferred encode, write-behind into the written tiers), a reader (``store.reads.pipeline``:
the restore pipeline) and a retention service (``store.retention``: retain, prefetch, demote,
expire). What they share (the tiers, the loop, pending counts, TTL tracking, condemned records) is
one ``StoreState`` (``store.state``) each is given explicitly; this module holds the store's loop,
its lifecycle and the engine-facing entry points, and nothing else: tools, benchmarks and adapters
that read a part's tables and counters (pending offloads, retention tables, prefetch and expiry
counters, the retention clock) reach the part through the read-only ``writer``, ``reader`` and
``retention`` attributes.

Threads and ownership
---------------------
The store is the one component that owns an asyncio event loop: it runs on a private daemon
thread (``dtkv-store``), tiers' coroutines and background tasks (the flusher) run there. Engine
threads only use the synchronous facade:

* ``lookup`` reads the tiers' in-memory indexes (``Tier.contains``): no I/O, no await.
* ``submit_offload`` never waits: it takes a staging slab with ``try_acquire(0)``, gathers and
  encodes the blocks into it (memcpy speed; the engine may overwrite its blocks as soon as we
  return, so the copy cannot be deferred), and hands the slab to the loop. A full queue or an
  empty staging pool drops the batch and counts it (architecture rule 1).
* ``load`` is called when the engine must wait anyway (or from a background loader thread): the
  loop reads records into slabs, several chunks ahead, and the *calling* thread verifies each
  record and scatters it into the engine (host-tier records straight from the arena). Scattering
  on the caller's thread means a timed-out load can never write into engine blocks later; an
  abandoned read releases its slab itself when the tier returns. ``LoadResult.stages`` says where
  the time went (``dtkv_restore_stage_seconds``).

Shared state of the store itself, and who touches it:

* ``StoreState.pending`` (offload batches and promotions not yet written): engine threads, loading
  threads and the loop; behind its lock (``drain`` waits on it).
* ``StoreState.tasks``/``bg_tasks`` and the read gates (``store.reads.pipeline``): the loop thread only.
* ``StoreState.ttl`` (``policy.admission.Retention`` per tier): the loop and tiers' writer threads
  (eviction hooks); each has its own lock. ``admission`` (``policy.admission.Admission``): engine
  and loading threads; its lock.
* The periodic passes run as tasks on the loop, never on an engine thread: the TTL sweep, and
  every ``expire_interval_s`` one expiry pass (``expire``: retained blocks whose expiry passed
  leave every tier, at most ``EXPIRE_PASS_BYTES`` per pass), so nobody has to call ``expire``.
* ``StoreState.residency`` and the tiers' hooks: replaced whole by ``set_residency`` (hooks are immutable).
* ``StoreState.closed``: set once, under ``_close_lock``; read anywhere (a late engine call is dropped).
* ``StoreState.condemned`` (records that failed verification, until their delete is done): marked
  by the loading thread, cleared by the loop; single dict operations only (atomic under the GIL).

A store that is never closed is closed at process exit by ``lifecycle`` (before Python stops its
thread pools), within ``exit_timeout_s``; ``close`` and ``close_by`` are idempotent and thread-safe.

Writes go to the first ``write_depth`` tiers (host, SSD); slower tiers (objects) are fed by
background tasks such as the segment flusher. The host tier admits every block; lower written
tiers follow the admission policy. Loaded blocks are promoted into faster tiers off the caller's
thread, reusing the slab they were read into.

GPU-direct (``staging.device_slabs``, an SSD tier with ``device_io``): a batch whose every target tier
moves records straight from device memory (GDS) is encoded on the device into a device slab,
and a load chunk whose every block's fastest tier is such a tier is read into a device slab and
verified and scattered there; no host copy either way. Everything else, and everything after a
GPU-direct failure (the tier detaches its path), takes the host slabs. Blocks loaded GPU-direct
are not promoted: the host tier is for blocks that come from the GPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..blocks.keys import BlockKey, Namespace
from ..blocks.layout import BlockShape, EngineLayout
from ..blocks.tenant import DEFAULT_TENANT
from ..policy.admission import Admission, AdmissionPolicy, Retention
from ..policy.pacing import Pacer
from ..policy.residency import ResidencyListener, install
from ..policy.retention import ANONYMOUS, Holder
from ..staging.device_slabs import DeviceStagingPool
from ..staging.slabs import StagingPool
from ..tiers.base import Tier
from . import lifecycle
from .erasure import ErasureService
from .lifecycle import Background
from .metrics import StoreMetrics
from .reads.into_buffers import BufferLoader, IntoResult
from .reads.pipeline import ChunkReader, LoadStages
from .retention import ExpireStats, RetentionService
from .state import StoreState
from .writes import OffloadWriter, check_block_ids

if TYPE_CHECKING:
    from ..hints.plan import BlockRetention

log = logging.getLogger("dynamo_tiered_kv.store")  # the store's logger, shared by its modules

#: bytes one periodic expiry pass frees at most; the next pass continues
EXPIRE_PASS_BYTES = 1 << 30

__all__ = ["Background", "LoadResult", "LoadStages", "LookupResult", "TieredStore"]


@dataclass(frozen=True)
class LookupResult:
    """Longest restorable prefix: ``num_blocks`` leading keys, and the fastest tier of each."""

    num_blocks: int
    tier_per_block: tuple[str, ...] = ()


@dataclass
class LoadResult:
    """Engine block ids restored (verified and scattered) and those the engine must recompute.

    Failures form a suffix: after the first failed block every later block is reported failed,
    since the engine recomputes a prefix from its first missing block on.
    """

    loaded_block_ids: list[int] = field(default_factory=list)
    failed_block_ids: list[int] = field(default_factory=list)
    tier_per_block: list[str] = field(default_factory=list)  # source tier of each loaded block
    stages: LoadStages = field(default_factory=LoadStages)  # where the time went (store_reads.LoadStages)


def _block_count(tier: Tier) -> Callable[[], int]:
    """How many blocks ``tier`` holds now (its in-memory index), for bounding retention tracking."""
    return lambda: tier.usage().num_blocks


class TieredStore:
    """Tiered KV block store with a synchronous, never-blocking engine facade.

    Args:
        tiers: fastest first (host, SSD, objects). Each is opened on the store's loop.
        namespace: identity written into and checked against every record.
        staging: slabs used for every transfer; the pool bounds memory and in-flight work.
        admission: ``"always"``, ``"second_hit"`` or an ``Admission`` instance.
        min_prefix_blocks: used when ``admission`` is a policy name.
        max_pending_offloads: offload batches queued on the loop before new ones are dropped.
        write_depth: how many leading tiers the store writes itself (default: host and the next).
        ttl_s: retention per tier (None = no expiry), applied to blocks this store wrote.
        background: long-running tasks started on the loop and stopped on ``close``.
        metrics_port: serve Prometheus metrics on this port (None = off, 0 = any free port); a busy
            port never fails the store (see ``StoreMetrics.serve``).
        close_flush_timeout_s: how long ``close`` lets write-back (SSD -> objects) finish.
        exit_timeout_s: bound on closing at process exit when nobody called ``close`` (``lifecycle``).
        load_chunk_bytes: a load reads and verifies in chunks of about this size, overlapped.
        load_first_chunk_bytes: size of a load's first chunk (small: verify+scatter starts early).
        load_depth: chunks of one load read ahead at most (each takes a staging slab while free).
        device_staging: device slabs for GPU-direct transfers to tiers that have ``device_io``.
        on_residency: told which blocks each tier stores and drops (``residency``; KV events).
        retain_max_share: share of each tier retention classes may protect (``store.retention``).
        expire_interval_s: seconds between the loop's expiry passes (``expire``); 0 turns them off.
        clock: the clock retention expiries are measured on (injected by tests and benchmarks).
    """

    def __init__(self, tiers: Sequence[Tier], namespace: Namespace, staging: StagingPool, *,
                 admission: AdmissionPolicy | Admission = "always", min_prefix_blocks: int = 1,
                 max_pending_offloads: int = 64, write_depth: int = 2,
                 ttl_s: Sequence[float | None] | None = None, background: Sequence[Background] = (),
                 metrics_port: int | None = None, sweep_interval_s: float = 5.0,
                 close_flush_timeout_s: float = 30.0, load_chunk_bytes: int = 8 << 20,
                 device_staging: DeviceStagingPool | None = None, exit_timeout_s: float = 10.0,
                 load_first_chunk_bytes: int = 1 << 20, load_depth: int = 4,
                 on_residency: ResidencyListener | None = None, retain_max_share: float = 0.5,
                 expire_interval_s: float = 300.0, clock: Callable[[], float] = time.time) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        if not expire_interval_s >= 0:  # NaN too
            raise ValueError(f"expire_interval_s must be >= 0 (0: off), got {expire_interval_s}")
        self.tiers = list(tiers)
        self.namespace = namespace
        self.staging = staging
        self.device_staging = device_staging
        admission = admission if isinstance(admission, Admission) else Admission(admission, min_prefix_blocks)
        write_depth = max(1, min(write_depth, len(self.tiers)))
        ttls = list(ttl_s or [])
        ttl = [Retention(ttls[i] if i < len(ttls) else None, t.contains, _block_count(t))
               for i, t in enumerate(self.tiers)]
        self.metrics = StoreMetrics(self.tiers)
        self.metrics_port = self.metrics.serve(metrics_port) if metrics_port is not None else None
        self._close_lock = threading.Lock()
        self.exit_timeout_s = exit_timeout_s
        self._close_flush_timeout_s = close_flush_timeout_s
        self._background = list(background)
        self._loop = asyncio.new_event_loop()
        self._state = StoreState(self.tiers, self.metrics, ttl, self._loop, max_pending_offloads)
        self._writer = OffloadWriter(self._state, staging, device_staging, admission, write_depth, namespace.digest)
        self._reader = ChunkReader(self._state, staging, self._writer, admission, write_depth=write_depth,
                                   ns_digest=namespace.digest, load_chunk_bytes=load_chunk_bytes,
                                   load_first_chunk_bytes=load_first_chunk_bytes, load_depth=load_depth)
        self._into = BufferLoader(self._state, namespace.digest, lambda: self._reader.recompute_tokens_per_s)
        self._retention = RetentionService(self._state, staging, self._writer.write_tier, max_share=retain_max_share,
                                           clock=clock, sweep_interval_s=sweep_interval_s,
                                           expire_interval_s=expire_interval_s, expire_pass_bytes=EXPIRE_PASS_BYTES)
        self._erasure = ErasureService(self._state, interval_s=sweep_interval_s)
        self.set_residency(on_residency)
        # the thread runs a method of the store: while the loop runs, the store stays alive even when
        # nobody else holds it, so the exit hook (which tracks stores weakly) still closes it
        self._thread = threading.Thread(target=self._run_loop, name="dtkv-store", daemon=True)
        self._thread.start()
        self._call(self._start(), timeout=120)
        lifecycle.track(self)  # a process that ends without close() still drains, seals, hands over

    # --- lifecycle -----------------------------------------------------------------------
    async def _start(self) -> None:
        for t in self.tiers:
            await t.open()
        for b in self._background:
            self._state.bg_tasks.append(asyncio.ensure_future(lifecycle.run_background(b)))
        for name, coro in [*self._retention.background(), *self._erasure.background()]:
            self._state.bg_tasks.append(asyncio.create_task(coro, name=name))

    def _run_loop(self) -> None:
        self._loop.run_forever()

    def _call(self, coro, timeout: float | None = None):
        return self._state.call(coro, timeout)

    @property
    def closed(self) -> bool:
        return self._state.closed

    # --- the parts, for tools, benchmarks and adapters that read their tables and counters --------
    @property
    def writer(self) -> OffloadWriter:
        """The offload path (``store.writes``): pending count, admission, bookkeeping sizes."""
        return self._writer

    @property
    def reader(self) -> ChunkReader:
        """The restore pipeline (``store.reads.pipeline``)."""
        return self._reader

    @property
    def retention(self) -> RetentionService:
        """Retain, prefetch, demote and expire (``store.retention``): retention tables, prefetch
        and expiry counters, the clock expiries are measured on, a synchronous TTL sweep."""
        return self._retention

    def close(self, timeout: float = 30.0) -> None:
        """Drain queued offloads (up to ``timeout``), seal open segments, let write-back finish (up to
        ``close_flush_timeout_s`` more), stop background tasks, close tiers and the loop.
        Idempotent and thread-safe (a second caller waits for the first)."""
        now = time.monotonic()
        flush_until = now + timeout + self._close_flush_timeout_s
        self._close(now + timeout, flush_until, flush_until + 10.0)

    def close_by(self, deadline: float) -> None:
        """Close before ``deadline`` (``time.monotonic()``), as at process exit: accepted offloads get
        the first 60% of the time, sealing and write-back the next 20% (what is left unflushed stays
        sealed on the SSD for the next start), stopping and closing tiers the rest."""
        left = max(0.0, deadline - time.monotonic())
        self._close(deadline - 0.4 * left, deadline - 0.2 * left, deadline)

    def _close(self, drain_until: float, flush_until: float, end: float) -> None:
        if not self._close_lock.acquire(timeout=max(0.0, end - time.monotonic())):
            log.warning("store close still running in another thread; not waiting longer")
            return
        try:
            if self._state.closed:
                return
            lifecycle.untrack(self)
            if lifecycle.executors_stopped():  # too late to write: recovery seals what reached the SSD
                log.warning("store closed after Python stopped its thread pools; queued writes may be lost "
                            "(close the store before interpreter exit)")
            if not self.drain(max(0.0, drain_until - time.monotonic())):
                log.warning("%d offload batches still queued at close; they may be lost", self._state.pending)
            self._state.closed = True
            try:
                self._call(lifecycle.shut_down(self.tiers, self._background, self._state.bg_tasks, flush_until, end),
                           timeout=max(0.1, end - time.monotonic()))
            except Exception:
                log.exception("store shutdown did not finish cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(max(1.0, end - time.monotonic()))
            if not self._thread.is_alive():
                self._loop.close()
            self.metrics.close()
        finally:
            self._close_lock.release()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- lookup ----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        """Longest prefix of ``keys`` held by any tier, with the fastest tier of each block.

        Memory only (``Tier.contains``); safe on the scheduler's hot path.
        """
        names: list[str] = []
        for k in keys:
            for ti, t in enumerate(self.tiers):
                if self._state.holds(ti, k):
                    names.append(t.name)
                    break
            else:
                self.metrics.lookup_blocks.labels("none").inc()
                break
        for name in names:
            self.metrics.lookup_blocks.labels(name).inc()
        return LookupResult(len(names), tuple(names))

    # --- offload (the writer) ----------------------------------------------------------------
    def submit_offload(self, layout: EngineLayout, block_ids: Sequence[int], keys: Sequence[BlockKey],
                       parents: Sequence[BlockKey], *, first_index: int = 0, tenant: bytes = DEFAULT_TENANT) -> bool:
        """Copy finished engine blocks of ``tenant`` (``blocks.tenant``) into staging now; write them to
        the tiers in the background (``OffloadWriter.submit_offload``). Never blocks; False if the batch
        was dropped."""
        return self.writer.submit_offload(layout, block_ids, keys, parents, first_index=first_index, tenant=tenant)

    def set_residency(self, listener: ResidencyListener | None) -> None:
        """Report to ``listener`` which blocks each tier stores and drops from now on (None: stop)."""
        self._state.residency = listener
        install(self.tiers, listener, [r.forget if r.ttl_s is not None else None for r in self._state.ttl])

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every accepted offload has been written (tests, shutdown)."""
        return self._state.drain(timeout)

    def persist(self, timeout: float = 30.0) -> None:
        """Drain offloads, then seal open segments and wait for write-back (SSD -> objects).

        For tools, tests and planned shutdowns; ``close`` does the same. Bounded by ``timeout``.
        """
        self.drain(timeout)
        self._call(lifecycle.persist(self.tiers, self._background, time.monotonic() + timeout),
                   timeout=2 * timeout + 5)

    # --- load ------------------------------------------------------------------------------
    def load(self, layout: EngineLayout, block_ids: Sequence[int], keys: Sequence[BlockKey],
             timeout: float | None = 30.0, pacer: Pacer | None = None,
             decode_threads: int | None = None) -> LoadResult:
        """Restore ``keys`` into engine blocks ``block_ids``, verifying every record.

        Returns which blocks were restored and which the engine must recompute, and where the time
        went (``LoadResult.stages``). Never raises for a tier fault, a missing or corrupt record,
        or a timeout: those blocks (and every block after the first of them) are reported failed.
        Once it returns, nothing writes into engine memory or a slab for this call any more.

        Any thread but the store's own may call it (the engine's, or a background loader); the
        verify+scatter runs on the calling thread. Reads are pipelined (``store.reads.pipeline``).
        ``pacer``: lets the CPU verify+scatter through in slices (``pacing``); None: unpaced.
        ``decode_threads``: most threads an unpaced CPU verify+scatter may use, the caller's
        included (None: up to ``store.reads.fanout.WAYS``); 1 keeps it on the calling thread.
        """
        if len(block_ids) != len(keys):
            raise ValueError("block_ids and keys must have the same length")
        if threading.current_thread() is self._thread:
            raise RuntimeError("TieredStore.load must not be called on the store's own loop thread")
        check_block_ids(layout, block_ids)
        t0 = time.perf_counter()
        res = LoadResult()
        self._reader.load_pipelined(layout, block_ids, keys, timeout, res.loaded_block_ids, res.tier_per_block,
                                    res.stages, pacer, decode_threads)
        res.failed_block_ids = list(block_ids[len(res.loaded_block_ids):])
        if res.failed_block_ids:
            self.metrics.load_failed_blocks.inc(len(res.failed_block_ids))
        res.stages.total_s = time.perf_counter() - t0
        if block_ids:
            self.metrics.observe_restore(res.stages)
        return res

    def load_into(self, shape: BlockShape, dests: Sequence[np.ndarray], keys: Sequence[BlockKey],
                  timeout: float | None = 30.0) -> IntoResult:
        """Restore ``keys`` with each record's payload read straight into ``dests[i]`` (the caller's
        buffer of block i: writable contiguous uint8 of ``shape.payload_bytes``, which must be exactly
        the block's bytes as the record's canonical payload holds them) and verified there; no
        staging slab, no scatter copy. Only tiers that read into caller buffers serve it
        (``IntoResult.planned``); the caller loads the rest with ``load``. Same failure rules as
        ``load`` (a failure fails every later block); once it returns nothing writes into ``dests``
        for this call, which may mean waiting past ``timeout`` for a read in flight
        (``store.reads.into_buffers``). Any thread but the store's own."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("TieredStore.load_into must not be called on the store's own loop thread")
        return self._into.load_into(shape, dests, keys, timeout)

    def suspend_device(self, timeout: float = 30.0) -> bool:
        """Before GPU sleep: finish accepted offloads (they may read device slabs), then deregister
        device memory from every GPU-direct tier. True if every offload finished in ``timeout``.
        The engine does not step while asleep, so nothing new arrives until ``resume_device``."""
        drained = self.drain(timeout)
        for tier in self.tiers:
            dio = tier.device_io
            if dio is not None:
                dio.suspend()
        return drained

    def resume_device(self) -> None:
        """After wake-up: register the device memory ``suspend_device`` deregistered."""
        for tier in self.tiers:
            dio = tier.device_io
            if dio is not None:
                dio.resume()

    def drop_local(self) -> None:
        """Forget every block of this node's own tiers (host, SSD) in the background.

        For a weight update: the caller has already moved to keys that can never equal the old
        ones, so this frees capacity rather than guarding correctness. Shared tiers keep their
        objects (other nodes may still serve the old weights); TTL and GC expire them.
        """
        for ti, tier in enumerate(self.tiers):
            if not tier.capabilities.shared:
                self._state.schedule(self._drop_tier(ti))

    async def _drop_tier(self, ti: int) -> None:
        tier = self.tiers[ti]
        try:
            keys = list(tier.keys())
            n = await tier.delete_many(keys)
            self._state.ttl[ti].forget(keys)
            self._state.tell(ti, keys, stored=False)
            log.info("dropped %d blocks from tier %s (cache reset)", n, tier.name)
        except Exception as e:
            log.warning("dropping tier %s after a cache reset failed: %s", tier.name, e)

    # --- retention (the retention service) ---------------------------------------------------
    def retain(self, keys: Sequence[BlockKey], retention: BlockRetention | Sequence[BlockRetention], *,
               holder: Holder = ANONYMOUS) -> int:
        """``RetentionService.retain``: ``holder`` claims a retention class for ``keys`` in every tier."""
        return self._retention.retain(keys, retention, holder=holder)

    def prefetch(self, keys: Sequence[BlockKey], *, into: int = 0) -> None:
        """``RetentionService.prefetch``: queue promotion into tier ``into``; never waits."""
        self._retention.prefetch(keys, into=into)

    def prefetch_now(self, keys: Sequence[BlockKey], *, into: int = 0, timeout: float = 60.0) -> int:
        """``RetentionService.prefetch_now``: promote synchronously; returns blocks promoted."""
        return self._retention.prefetch_now(keys, into=into, timeout=timeout)

    def demote(self, keys: Sequence[BlockKey], *, holder: Holder = ANONYMOUS, wait: bool = True) -> int:
        """``RetentionService.demote``: release ``holder``'s claims and move unprotected host blocks down."""
        return self._retention.demote(keys, holder=holder, wait=wait)

    def expire(self, now: float | None = None, max_bytes: int = 1 << 30) -> ExpireStats:
        """``RetentionService.expire``: one GC pass, synchronous."""
        return self._retention.expire(now, max_bytes)
