"""The offload path of ``TieredStore`` (a mixin, ``OffloadWrites``): engine blocks into staging on
the engine's thread, then into the tiers on the store's loop.

* ``submit_offload`` never waits: the per-block target tiers (written tiers that lack the block
  and admit it), a staging slab taken without waiting, the blocks gathered and encoded into it
  (on the device for GPU-direct tiers; a CUDA engine's checksums are left to the writer,
  ``deferred_encode``), the slab handed to the loop. Every drop is counted by its reason.
* ``_write_slab`` / ``_write_tier`` (loop thread): each tier gets its records as one
  ``write_many``; what a tier kept is tracked for TTL and reported to the residency listener.
* The slab choice: a device slab when every target tier moves records GPU-direct, else a host
  slab (``_acquire``); the load pipeline (``store.reads.pipeline``) takes its slabs the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from ..blocks.codec import record_bytes
from ..blocks.keys import BlockKey
from ..blocks.layout import EngineLayout
from ..errors import PartialWrite, TierFull, TierUnavailable
from ..policy.admission import Admission, Retention
from ..staging.device_slabs import DeviceSlab, DeviceSpan, DeviceStagingPool
from ..staging.slabs import Slab, StagingPool
from ..tiers.base import Tier
from .deferred_encode import Seal, begin_encode
from .metrics import StoreMetrics
from .reads.pipeline import slot_view

log = logging.getLogger("dynamo_tiered_kv.store")  # the store's logger: log filters keep working


def check_block_ids(layout: EngineLayout, block_ids: Sequence[int]) -> None:
    """The compiled gather/scatter does not bounds-check: refuse bad ids before any copy."""
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= layout.num_blocks):
        raise ValueError(f"block ids must be in [0, {layout.num_blocks}), got {min(block_ids)}..{max(block_ids)}")


class OffloadWrites:
    """Mixin of ``TieredStore``: the offload path. The attributes below are the store's."""

    tiers: list[Tier]
    metrics: StoreMetrics
    staging: StagingPool
    device_staging: DeviceStagingPool | None
    admission: Admission
    write_depth: int
    _ttl: list[Retention]
    _ns_digest: bytes
    _closed: bool
    _record_nbytes: int
    _reserve_pending: Callable[[], bool]
    _finish_pending: Callable[[], None]
    _schedule: Callable[..., None]
    _holds: Callable[[int, BlockKey], bool]
    _condemned: dict[tuple[int, BlockKey], asyncio.Event]
    _tell: Callable[..., None]

    # --- offload ---------------------------------------------------------------------------
    def submit_offload(self, layout: EngineLayout, block_ids: Sequence[int], keys: Sequence[BlockKey],
                       parents: Sequence[BlockKey], *, first_index: int = 0) -> bool:
        """Copy finished engine blocks into staging now; write them to the tiers in the background.

        Args:
            first_index: position of ``block_ids[0]`` in its sequence (for ``min_prefix_blocks``).

        Returns:
            True if the blocks were accepted (or every target tier already has them); False if
            the batch was dropped (queue full, no free slab, store closed). Never blocks.
        """
        if not (len(block_ids) == len(keys) == len(parents)):
            raise ValueError("block_ids, keys and parents must have the same length")
        check_block_ids(layout, block_ids)
        if self._closed:
            self.metrics.offload_dropped.labels("closed").inc()
            return False
        if first_index + len(block_ids) < self.admission.min_prefix_blocks:
            return True  # too short to be worth storing: not an error, not a drop
        # Per block: the written tiers that lack it and admit it.
        todo: list[tuple[int, list[int]]] = []
        for i, k in enumerate(keys):
            seen = self.admission.sight(k)
            targets = [ti for ti in range(self.write_depth)
                       if not self._holds(ti, k) and self._admits(ti, seen)]
            if targets:
                todo.append((i, targets))
        if not todo:
            return True
        rb = record_bytes(layout.shape)
        self._record_nbytes = rb  # for blocks retained before they are written
        per_slab = self._slab_bytes(layout) // rb
        if per_slab == 0:
            self.metrics.offload_dropped.labels("too_large").inc()
            return False
        accepted_all = True
        for c in range(0, len(todo), per_slab):
            chunk = todo[c:c + per_slab]
            if not self._reserve_pending():
                self.metrics.offload_dropped.labels("queue_full").inc()
                return False
            slab = self._acquire(layout, {ti for _, targets in chunk for ti in targets}, 0)
            if slab is None:
                self._finish_pending()
                self.metrics.offload_dropped.labels("no_staging").inc()
                return False
            seal: Seal | None = None
            try:
                args = (layout, [block_ids[i] for i, _ in chunk], [self._ns_digest] * len(chunk),
                        [keys[i] for i, _ in chunk], [parents[i] for i, _ in chunk])
                if isinstance(slab, DeviceSlab):
                    from ..blocks.device_codec import encode_blocks_on_device

                    encode_blocks_on_device(*args, slab.tensor)
                else:  # a CUDA engine's copy is only queued here: checksums are the writer's (seal)
                    seal = begin_encode(*args, slab.array)
            except Exception:
                self._release(slab)
                self._finish_pending()
                log.exception("encoding blocks for offload failed; batch dropped")
                self.metrics.offload_dropped.labels("encode_error").inc()
                accepted_all = False
                continue
            plan = [(j, keys[i], targets) for j, (i, targets) in enumerate(chunk)]
            self.metrics.offload_blocks.inc(len(plan))
            self._schedule(self._write_slab(slab, rb, plan, seal), reserved=True)
        return accepted_all

    # --- slabs: host staging, or device staging for GPU-direct tiers ---------------------------
    def _gpu_direct(self, ti: int) -> bool:
        return getattr(self.tiers[ti], "device_io", None) is not None

    def _device_fits(self, layout: EngineLayout) -> bool:
        pool = self.device_staging
        return pool is not None and (pool.device.type == "cuda") == layout.is_cuda

    def _slab_bytes(self, layout: EngineLayout) -> int:
        if self._device_fits(layout):
            assert self.device_staging is not None
            return min(self.staging.slab_bytes, self.device_staging.slab_bytes)
        return self.staging.slab_bytes

    def _acquire(self, layout: EngineLayout, tiers: set[int], wait: float | None) -> Slab | DeviceSlab | None:
        """A device slab when every tier in ``tiers`` moves records GPU-direct and one is free now,
        else a host slab (waiting up to ``wait``)."""
        if tiers and self._device_fits(layout) and all(self._gpu_direct(ti) for ti in tiers):
            assert self.device_staging is not None
            slab = self.device_staging.try_acquire(0)
            if slab is not None:
                return slab
        return self.staging.try_acquire(wait)

    def _release(self, slab: Slab | DeviceSlab) -> None:
        if isinstance(slab, DeviceSlab):
            assert self.device_staging is not None
            self.device_staging.release(slab)
        else:
            self.staging.release(slab)

    def _admits(self, ti: int, sightings: int) -> bool:
        return self.admission.admits(self.tiers[ti].capabilities.medium, sightings)

    async def _write_slab(self, slab: Slab | DeviceSlab, rb: int,
                          plan: Sequence[tuple[int, BlockKey, Sequence[int]]], seal: Seal | None = None) -> None:
        """Write records ``plan = [(slot in slab, key, tier indexes)]`` in order, then free the slab.
        ``seal``: the second half of their encoding (``deferred_encode``), run first off the loop."""
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
                await self._write_tier(ti, by_tier[ti])
        finally:
            self._release(slab)

    async def _write_tier(self, ti: int, items: list[tuple[BlockKey, memoryview | DeviceSpan]]) -> None:
        tier = self.tiers[ti]
        if self._condemned:  # fresh copies of records that failed verification: after their delete
            for key, _ in items:
                done = self._condemned.get((ti, key))
                if done is not None:
                    await done.wait()
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
            self._ttl[ti].touch(key, now)
        self._tell(ti, kept, stored=True)
