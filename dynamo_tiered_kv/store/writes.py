"""The offload path of ``TieredStore`` (``OffloadWriter``, the store's writer): engine blocks into staging on
the engine's thread, then into the tiers on the store's loop.

* ``submit_offload`` never waits: the per-block target tiers (written tiers that lack the block,
  admit it and have no save of it in flight: ``StoreState.claim_saves``), a staging slab taken
  without waiting, the blocks gathered into it (into a device slab for GPU-direct tiers,
  ``device_codec.begin_encode_on_device``; else a host slab, ``deferred_encode``); a CUDA
  engine's gather is only queued, and checksums and headers are left to the writer), the slab
  handed to the loop. Every drop is counted by its reason; every save skipped because one is in flight too.
* ``write_slab`` / ``write_tier`` (loop thread): each tier gets its records as one
  ``write_many``; what a tier kept is tracked for TTL and reported to the residency listener.
* The slab choice: a device slab when every target tier moves records GPU-direct, else a host
  slab (``acquire``); the load pipeline (``store.reads.pipeline``) takes its slabs the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from ..blocks.codec import record_bytes
from ..blocks.keys import BlockKey
from ..blocks.layout import EngineLayout
from ..blocks.tenant import DEFAULT_TENANT
from ..errors import PartialWrite, TierFull, TierUnavailable
from ..policy.admission import Admission
from ..staging.device_slabs import DeviceSlab, DeviceSpan, DeviceStagingPool
from ..staging.slabs import Slab, StagingPool
from .deferred_encode import Seal, begin_encode
from .reads.chunk import slot_view
from .state import StoreState

log = logging.getLogger("dynamo_tiered_kv.store")  # the store's logger: log filters keep working


def check_block_ids(layout: EngineLayout, block_ids: Sequence[int]) -> None:
    """The compiled gather/scatter does not bounds-check: refuse bad ids before any copy."""
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= layout.num_blocks):
        raise ValueError(f"block ids must be in [0, {layout.num_blocks}), got {min(block_ids)}..{max(block_ids)}")


class OffloadWriter:
    """The offload path (module docstring): ``submit_offload`` on engine threads (never waits),
    ``write_slab``/``write_tier`` on the store's loop. Also picks slabs for the reader
    (``acquire``/``release``: a device slab when every tier involved moves records GPU-direct).

    Built by ``TieredStore`` with the shared ``StoreState`` (tiers, metrics, pending count, TTL
    tracking, condemned records), the staging pools and the admission policy. Threads: engine
    threads call ``submit_offload`` (``admission`` has its own lock; the pending count is behind
    the state's lock, the saves in flight behind its ``saving_lock``); the loop runs
    ``write_slab``/``write_tier``; ``acquire``/``release`` run on any thread (the pools have
    their own locks).
    """

    def __init__(self, state: StoreState, staging: StagingPool, device_staging: DeviceStagingPool | None,
                 admission: Admission, write_depth: int, ns_digest: bytes) -> None:
        self._state = state
        self.tiers = state.tiers
        self.metrics = state.metrics
        self.staging = staging
        self.device_staging = device_staging
        self.admission = admission
        self.write_depth = write_depth
        self._ns_digest = ns_digest

    # --- offload ---------------------------------------------------------------------------
    def submit_offload(self, layout: EngineLayout, block_ids: Sequence[int], keys: Sequence[BlockKey],
                       parents: Sequence[BlockKey], *, first_index: int = 0, tenant: bytes = DEFAULT_TENANT) -> bool:
        """Copy finished engine blocks into staging now; write them to the tiers in the background.

        Args:
            first_index: position of ``block_ids[0]`` in its sequence (for ``min_prefix_blocks``).
            tenant: the blocks' tenant (``blocks.tenant``), written into every record: tiers
                account and evict by it (quotas).

        Returns:
            True if the blocks were accepted (or every target tier already has them); False if
            the batch was dropped (queue full, no free slab, store closed). Never blocks.
        """
        if not (len(block_ids) == len(keys) == len(parents)):
            raise ValueError("block_ids, keys and parents must have the same length")
        check_block_ids(layout, block_ids)
        if self._state.closed:
            self.metrics.offload_dropped.labels("closed").inc()
            return False
        if first_index + len(block_ids) < self.admission.min_prefix_blocks:
            return True  # too short to be worth storing: not an error, not a drop
        # Per block: the written tiers that lack it, admit it and have no save of it in flight.
        wanted: list[tuple[int, BlockKey]] = []
        for k in keys:
            seen = self.admission.sight(k)
            wanted += [(ti, k) for ti in range(self.write_depth)
                       if not self._state.holds(ti, k) and self.admits(ti, seen)]
        if not wanted:
            return True
        rb = record_bytes(layout.shape)
        per_slab = self.slab_bytes(layout) // rb
        if per_slab == 0:
            self.metrics.offload_dropped.labels("too_large").inc()
            return False
        claim = object()  # this call's saves (``StoreState.claim_saves``)
        by_block: dict[BlockKey, list[int]] = {}
        for (ti, k), mine in zip(wanted, self._state.claim_saves(wanted, claim), strict=True):
            if mine:
                by_block.setdefault(k, []).append(ti)
            else:  # its first save has not finished: it will store the block
                self.metrics.offload_inflight_skips.labels(self.tiers[ti].name).inc()
        todo = [(i, by_block.pop(k)) for i, k in enumerate(keys) if k in by_block]
        if not todo:
            return True
        self._state.record_nbytes = rb  # for blocks retained before they are written
        accepted_all = True
        for c in range(0, len(todo), per_slab):
            chunk = todo[c:c + per_slab]
            if not self._state.reserve_pending():
                self._release_claims(todo[c:], keys, claim)
                self.metrics.offload_dropped.labels("queue_full").inc()
                return False
            slab = self.acquire(layout, {ti for _, targets in chunk for ti in targets}, 0)
            if slab is None:
                self._state.finish_pending()
                self._release_claims(todo[c:], keys, claim)
                self.metrics.offload_dropped.labels("no_staging").inc()
                return False
            seal: Seal | None = None
            try:
                args = (layout, [block_ids[i] for i, _ in chunk], [self._ns_digest] * len(chunk),
                        [keys[i] for i, _ in chunk], [parents[i] for i, _ in chunk])
                if isinstance(slab, DeviceSlab):  # only the gather is queued here: checksums, headers: the writer's
                    from ..blocks.device_codec import begin_encode_on_device

                    seal = begin_encode_on_device(*args, slab.tensor, tenant=tenant)
                else:  # a CUDA engine's copy is only queued here: checksums are the writer's (seal)
                    seal = begin_encode(*args, slab.array, tenant=tenant)
            except Exception:
                self.release(slab)
                self._state.finish_pending()
                self._release_claims(chunk, keys, claim)
                log.exception("encoding blocks for offload failed; batch dropped")
                self.metrics.offload_dropped.labels("encode_error").inc()
                accepted_all = False
                continue
            plan = [(j, keys[i], targets) for j, (i, targets) in enumerate(chunk)]
            self.metrics.offload_blocks.inc(len(plan))
            self._state.schedule(self.write_slab(slab, rb, plan, seal, claim=claim), reserved=True)
        return accepted_all

    def _release_claims(self, todo: Sequence[tuple[int, Sequence[int]]], keys: Sequence[BlockKey],
                        claim: object) -> None:
        """End ``claim``'s saves of blocks ``todo = [(index in keys, tiers)]`` that were dropped."""
        by_tier: dict[int, list[BlockKey]] = {}
        for i, targets in todo:
            for ti in targets:
                by_tier.setdefault(ti, []).append(keys[i])
        for ti, tier_keys in by_tier.items():
            self._state.release_saves(ti, tier_keys, claim)

    # --- what is queued, and the sizes of the maps offloads fill ----------------------------------
    @property
    def pending_offloads(self) -> int:
        """Offload batches (and promotions, repairs) accepted and not yet written. Any thread."""
        return self._state.pending

    @property
    def max_pending_offloads(self) -> int:
        """Batches queued on the loop before ``submit_offload`` drops new ones (``queue_full``)."""
        return self._state.max_pending

    def bookkeeping(self) -> dict[str, int]:
        """Sizes of the store's own maps (for soak tests and leak hunting): retention entries per
        tier, admission sightings, tasks on the loop, offload batches pending, block saves in flight
        (tier and key pairs). Any thread (sizes read without the maps' locks: a snapshot, not a
        consistent cut)."""
        out = {f"retention_{t.name}": len(r) for t, r in zip(self.tiers, self._state.ttl)}
        out["admission_keys"] = len(self.admission)
        out["loop_tasks"] = len(self._state.tasks)
        out["pending_offloads"] = self._state.pending
        out["saves_in_flight"] = len(self._state.saving)
        return out

    # --- slabs: host staging, or device staging for GPU-direct tiers ---------------------------
    def gpu_direct(self, ti: int) -> bool:
        return self.tiers[ti].device_io is not None

    def device_fits(self, layout: EngineLayout) -> bool:
        pool = self.device_staging
        return pool is not None and (pool.device.type == "cuda") == layout.is_cuda

    def slab_bytes(self, layout: EngineLayout) -> int:
        if self.device_fits(layout):
            assert self.device_staging is not None
            return min(self.staging.slab_bytes, self.device_staging.slab_bytes)
        return self.staging.slab_bytes

    def acquire(self, layout: EngineLayout, tiers: set[int], wait: float | None) -> Slab | DeviceSlab | None:
        """A device slab when every tier in ``tiers`` moves records GPU-direct and one is free now,
        else a host slab (waiting up to ``wait``)."""
        if tiers and self.device_fits(layout) and all(self.gpu_direct(ti) for ti in tiers):
            assert self.device_staging is not None
            slab = self.device_staging.try_acquire(0)
            if slab is not None:
                return slab
        return self.staging.try_acquire(wait)

    def release(self, slab: Slab | DeviceSlab) -> None:
        if isinstance(slab, DeviceSlab):
            assert self.device_staging is not None
            self.device_staging.release(slab)
        else:
            self.staging.release(slab)

    def admits(self, ti: int, sightings: int) -> bool:
        return self.admission.admits(self.tiers[ti].capabilities.medium, sightings)

    async def write_slab(self, slab: Slab | DeviceSlab, rb: int,
                          plan: Sequence[tuple[int, BlockKey, Sequence[int]]], seal: Seal | None = None, *,
                          claim: object | None = None) -> None:
        """Write records ``plan = [(slot in slab, key, tier indexes)]`` in order, then free the slab.
        ``seal``: the second half of their encoding (``deferred_encode``), run first off the loop.
        ``claim``: the offload's claim on these saves (``StoreState.claim_saves``), released per
        tier as soon as that tier's write returned or failed, and for every tier if the batch is
        dropped or cancelled."""
        released: set[int] = set()  # tiers whose saves of this batch ended
        try:
            if seal is not None:
                try:
                    await asyncio.to_thread(seal)
                except Exception:  # a failed device copy: the slab's bytes are not a record
                    log.exception("finishing the encoding of %d offloaded blocks failed; batch dropped", len(plan))
                    self.metrics.offload_dropped.labels("encode_error").inc()
                    return
            by_tier: dict[int, list[tuple[BlockKey, memoryview | DeviceSpan]]] = {}
            for j, key, targets in plan:
                view = slot_view(slab, j * rb, rb)
                for ti in targets:
                    by_tier.setdefault(ti, []).append((key, view))
            for ti in sorted(by_tier):
                try:
                    await self.write_tier(ti, by_tier[ti])
                finally:  # written (the tier holds them now) or failed (the next offload saves them)
                    if claim is not None:
                        self._state.release_saves(ti, [key for key, _ in by_tier[ti]], claim)
                        released.add(ti)
        finally:
            self.release(slab)
            if claim is not None:  # ended early (encoding failed, cancelled): its other saves are off too
                for ti in {ti for _, _, targets in plan for ti in targets} - released:
                    self._state.release_saves(ti, [key for _, key, targets in plan if ti in targets], claim)

    async def write_tier(self, ti: int, items: list[tuple[BlockKey, memoryview | DeviceSpan]]) -> None:
        tier = self.tiers[ti]
        # fresh copies of records that failed verification: after their delete
        await self._state.wait_condemned(ti, [key for key, _ in items])
        t0 = time.perf_counter()
        try:
            await tier.write_many(items)
        except PartialWrite as e:  # its first e.written records ARE stored: account them as written
            self.metrics.errors.labels(tier.name, "write").inc()
            log.warning("write of %d blocks to tier %s stored the first %d: %s", len(items), tier.name, e.written, e)
            items = items[:e.written]
        except (TierUnavailable, TierFull, OSError) as e:
            self.metrics.errors.labels(tier.name, "write").inc()
            log.warning("write of %d blocks to tier %s failed: %s", len(items), tier.name, e)
            return
        except Exception:
            self.metrics.errors.labels(tier.name, "write").inc()
            log.exception("write of %d blocks to tier %s failed", len(items), tier.name)
            return
        self.metrics.write_seconds.labels(tier.name).observe(time.perf_counter() - t0)
        self.metrics.written_bytes.labels(tier.name).inc(sum(v.nbytes for _, v in items))
        # not those it evicted since: a batch larger than the tier evicts its own first records, and
        # their eviction was reported before this point (tracking them would outlive the tier's copy)
        kept = [k for k, _ in items if tier.contains(k)]
        now = time.monotonic()
        for key in kept:
            self._state.ttl[ti].touch(key, now)
        self._state.tell(ti, kept, stored=True)
