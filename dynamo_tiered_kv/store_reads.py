"""The loop side of ``TieredStore.load``: read a chunk of records into a slab, one ``read_many``
per run of blocks whose fastest tier is the same, and decide who frees the slab.

The caller verifies and scatters on its own thread; if it stops waiting (timeout, an earlier
chunk failed), the reader frees the slab when its I/O returns, so no tier ever writes into a
slab that was handed out again (failure rule 6).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .device_staging import DeviceSlab, DeviceSpan
from .keys import BlockKey
from .metrics import StoreMetrics
from .staging import Slab
from .tiers.base import ReadRequest, Tier

log = logging.getLogger("dynamo_tiered_kv.store")  # same logger as before the split: log filters keep working


class Handoff:
    """Who releases a load slab: the reader if the caller gave up waiting, else the caller."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.done = False


@dataclass
class ChunkRead:
    """One chunk of a load in flight on the loop."""

    start: int
    end: int
    slab: Slab | DeviceSlab
    fut: concurrent.futures.Future
    hand: Handoff


class ChunkReads:
    """Mixin of ``TieredStore``: the reads of a load, run on the store's loop."""

    tiers: list[Tier]
    metrics: StoreMetrics
    _loop: asyncio.AbstractEventLoop

    def _release(self, slab: Slab | DeviceSlab) -> None:
        raise NotImplementedError

    def _gpu_direct(self, ti: int) -> bool:
        raise NotImplementedError

    def _start_read(self, slab: Slab | DeviceSlab, rb: int, start: int, end: int,
                    keys: Sequence[BlockKey]) -> ChunkRead:
        hand = Handoff()
        fut = asyncio.run_coroutine_threadsafe(self._read_into_slab(slab, rb, keys, hand), self._loop)
        return ChunkRead(start, end, slab, fut, hand)

    def _finish_read(self, rd: ChunkRead, timeout: float | None) -> list[int | None] | None:
        """Each block's source tier (None from the first unreadable block on), or None on timeout
        or error (then the slab is freed: by the reader when the tier returns, or here)."""
        try:
            return rd.fut.result(timeout)
        except TimeoutError:
            with rd.hand.lock:
                if not rd.hand.done:
                    rd.hand.abandoned = True
                    log.warning("load of %d blocks timed out after %.1fs; recomputing", rd.end - rd.start, timeout)
                    return None
            try:
                return rd.fut.result()  # it finished just now
            except Exception:
                log.exception("load read failed")
                self._release(rd.slab)
                return None
        except Exception:
            log.exception("load read failed")
            self._release(rd.slab)  # the reader finished (with an error): it never frees the slab
            return None

    def _abandon(self, rd: ChunkRead) -> None:
        """Drop a prefetched read nobody will consume; whoever finishes last frees the slab."""
        with rd.hand.lock:
            if not rd.hand.done:
                rd.hand.abandoned = True
                return
        self._release(rd.slab)  # the reader is past its I/O and never frees a slab itself

    async def _read_into_slab(self, slab: Slab | DeviceSlab, rb: int, keys: Sequence[BlockKey],
                              hand: Handoff) -> list[int | None]:
        sources: list[int | None] = [None] * len(keys)
        try:
            # Runs of consecutive blocks whose fastest tier is the same: one read_many per run.
            j = 0
            while j < len(keys):
                ti = self._fastest(keys[j])
                if ti is None:
                    self.metrics.misses.labels("none").inc()
                    break
                run_end = j + 1
                while run_end < len(keys) and self._fastest(keys[run_end]) == ti:
                    run_end += 1
                got = await self._read_run(ti, slab, rb, keys, j, run_end)
                for g in range(got):
                    sources[j + g] = ti
                if got < run_end - j:
                    break
                j = run_end
            return sources
        finally:
            with hand.lock:
                hand.done = True
                abandoned = hand.abandoned
            if abandoned:
                self._release(slab)

    def _fastest(self, key: BlockKey) -> int | None:
        for ti, t in enumerate(self.tiers):
            if t.contains(key):
                return ti
        return None

    async def _read_run(self, ti: int, slab: Slab | DeviceSlab, rb: int, keys: Sequence[BlockKey], start: int,
                        end: int) -> int:
        """Read keys[start:end] from tier ``ti`` into slab slots; return how many leading ones arrived."""
        tier = self.tiers[ti]
        if isinstance(slab, DeviceSlab) and not self._gpu_direct(ti):
            self.metrics.misses.labels(tier.name).inc(end - start)
            return 0  # moved to a tier without GPU-direct (or the path failed) since the chunk started
        reqs = [ReadRequest(keys[j], slot_view(slab, j * rb, rb)) for j in range(start, end)]
        t0 = time.perf_counter()
        try:
            results = await tier.read_many(reqs)
        except Exception as e:
            self.metrics.errors.labels(tier.name, "read").inc()
            self.metrics.misses.labels(tier.name).inc(end - start)
            log.warning("read of %d blocks from tier %s failed: %s", end - start, tier.name, e)
            return 0
        self.metrics.read_seconds.labels(tier.name).observe(time.perf_counter() - t0)
        got = 0
        for r in results:
            if r is None or r < rb:
                break
            got += 1
        self.metrics.read_bytes.labels(tier.name).inc(got * rb)
        if got < end - start:
            self.metrics.misses.labels(tier.name).inc(end - start - got)
        return got


def slot_view(slab: Slab | DeviceSlab, offset: int, nbytes: int) -> memoryview | DeviceSpan:
    if isinstance(slab, DeviceSlab):
        return DeviceSpan(slab, offset, nbytes)
    return memoryview(slab.array[offset:offset + nbytes])
