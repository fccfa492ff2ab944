"""Background write-back of sealed SSD segments to the object tier.

One asyncio task scans the ``SegmentSource`` (the SSD tier) for sealed, unflushed segments and
feeds a bounded queue; ``concurrency`` workers upload each segment as one data object plus its
manifest (``ObjectTier.publish_segment``), then call ``mark_flushed``.

* **Backpressure.** The queue holds at most ``max_queue`` segments. When it is full the scanner
  stops enqueuing and picks the rest up on a later scan; nothing is dropped, because the durable
  list of unflushed segments lives on the SSD side. ``stats.lag_bytes`` / ``lag_seconds`` tell
  the SSD tier how far behind the object tier is (it must not evict unflushed segments).
* **Crash-resume by construction.** Progress is the SSD tier's durable ``mark_flushed``; an
  upload interrupted by a crash is simply redone after restart. Publishing is atomic (complete
  multipart / rename) and idempotent (content-addressed names with conditional create), so no
  object is ever visible half-written and a redo never duplicates data.
* **Failures** (store down, breaker open) are counted; the segment is retried with exponential
  backoff on later scans. The flusher never blocks its callers: ``notify`` only sets an event.
* **Already stored.** Blocks restored or prefetched from the object tier land in new SSD
  segments. A segment whose every live record the bucket serves now under the same key and
  length is marked flushed without an upload and counted in ``already_stored_*``. The object
  tier's in-memory index is only the first filter: it may still list manifests deleted
  elsewhere (another node's eviction, ``dtkv gc``) until its next full listing, and a segment
  marked flushed on its word alone would hold the only copy of its blocks once the SSD evicts
  it. So ``ObjectTier.holds_now`` confirms each serving object in the bucket (a HEAD of its
  manifest and a LIST of its quarantine markers: a few requests per segment). One record the
  bucket lacks, or one whose copy was reported corrupt, uploads the whole file, as before.
* **Retention.** A publish records the protected entries' priority and expiry in its manifest
  (``retain_field``), which other nodes and restarts take over and ``dtkv gc`` honours past the
  TTL. The object tier does not remember in memory which retention the manifest serving a key
  carries, so a segment holding a block the object tier protects now (e.g. a ``kv.retain`` on a
  returning session) is uploaded as before: its new manifest records the current retention.
  A skipped segment's blocks keep the created_at of the copy that serves them, so their object
  TTL counts from that upload, as for blocks that never left the SSD.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..segments import SealedSegment, SegmentSource
from .expiry import retain_field
from .retry import wait_event
from .threads import run_in_thread
from .tier import ObjectTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlushStats:
    """A snapshot of the flusher's state (the lead maps these to Prometheus)."""

    queue_length: int = 0  # segments waiting for a worker
    in_flight: int = 0  # segments being uploaded
    lag_bytes: int = 0  # sealed bytes not yet confirmed in the object tier
    lag_seconds: float = 0.0  # age of the oldest unflushed segment
    flushed_segments: int = 0
    flushed_bytes: int = 0
    failures: int = 0  # failed upload attempts (each is retried later)
    skipped_segments: int = 0  # segments that vanished before upload (pin refused)
    already_stored_segments: int = 0  # marked flushed without upload: the object tier held every record
    already_stored_bytes: int = 0  # their sizes: the uploads saved
    queue_full_events: int = 0  # scans that found the queue full (backpressure engaged)
    last_error: str = ""


class Flusher:
    """Copies sealed segments from ``source`` to ``tier`` in the background.

    Args:
        source: the SSD tier (``SegmentSource``).
        tier: an opened ``ObjectTier``.
        max_queue: bound of the upload queue (segments).
        concurrency: segments uploaded at once (each also uploads its parts in parallel).
        scan_interval_s: how often the source is rescanned without a ``notify``.
        retry_base_s, retry_max_s: backoff of a segment whose upload failed.
        clock: wall clock (injectable for tests); lag is measured against ``sealed_at``.
    """

    def __init__(self, source: SegmentSource, tier: ObjectTier, *, max_queue: int = 16, concurrency: int = 2,
                 scan_interval_s: float = 1.0, retry_base_s: float = 1.0, retry_max_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        if max_queue < 1 or concurrency < 1 or scan_interval_s <= 0:
            raise ValueError("max_queue, concurrency and scan_interval_s must be positive")
        self.source = source
        self.tier = tier
        self.max_queue = max_queue
        self.concurrency = concurrency
        self.scan_interval_s = scan_interval_s
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._clock = clock
        self._queue: asyncio.Queue[SealedSegment] | None = None
        self._pending: set[str] = set()  # queued or in flight
        self._in_flight = 0
        self._unflushed: dict[str, SealedSegment] = {}  # as of the last scan, minus completions
        self._retry_at: dict[str, tuple[float, int]] = {}  # segment -> (not before, attempts)
        self._stats = FlushStats()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flushed_meanwhile: set[str] | None = None  # set while a scan lists the source

    # --- control ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the scanner and workers on the running loop."""
        if self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(self.max_queue)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._tasks = [asyncio.create_task(self._scan_loop(), name="dtkv-flush-scan")]
        self._tasks += [asyncio.create_task(self._worker(), name=f"dtkv-flush-{i}")
                        for i in range(self.concurrency)]

    async def stop(self) -> None:
        """Cancel scanning and uploads at once. Interrupted uploads are aborted (never visible)
        and redone by the next flusher, since their segments are still unflushed."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def notify(self) -> None:
        """Wake the scanner (a segment was sealed). Non-blocking; safe from any thread."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake.set()
        else:
            loop.call_soon_threadsafe(wake.set)

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until the source has no unflushed segment left; False on timeout."""
        assert self._idle is not None, "start() first"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._idle.clear()
            self.notify()
            if not await run_in_thread(self.source.unflushed_segments) and not self._pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            await wait_event(self._idle, min(left or 1.0, 1.0))

    @property
    def stats(self) -> FlushStats:
        now = self._clock()
        oldest = min((s.sealed_at for s in self._unflushed.values()), default=now)
        return replace(self._stats, queue_length=self._queue.qsize() if self._queue else 0,
                       in_flight=self._in_flight, lag_bytes=sum(s.size for s in self._unflushed.values()),
                       lag_seconds=max(0.0, now - oldest))

    # --- loops ------------------------------------------------------------------------------
    async def _scan_loop(self) -> None:
        assert self._wake is not None and self._queue is not None
        while True:
            self._wake.clear()
            try:
                await self._scan()
            except Exception as e:  # the SSD tier failed to list: try again next time
                log.warning("flusher: listing unflushed segments failed: %s", e)
            await wait_event(self._wake, self.scan_interval_s)

    async def _scan(self) -> None:
        assert self._queue is not None
        # Listing reads segment footers: off the loop. A worker that completes meanwhile has left
        # ``_pending`` already; ``_flushed_meanwhile`` keeps its segment from being queued again.
        flushed: set[str] = set()
        self._flushed_meanwhile = flushed
        try:
            segs = await run_in_thread(self.source.unflushed_segments)
        finally:
            self._flushed_meanwhile = None
        segs = [s for s in segs if s.segment_id not in flushed]
        self._unflushed = {s.segment_id: s for s in segs}
        now = time.monotonic()
        for s in segs:
            if s.segment_id in self._pending:
                continue
            retry = self._retry_at.get(s.segment_id)
            if retry is not None and retry[0] > now:
                continue
            if self._queue.full():
                self._stats = replace(self._stats, queue_full_events=self._stats.queue_full_events + 1)
                break
            self._pending.add(s.segment_id)
            self._queue.put_nowait(s)
        if not segs and not self._pending and self._idle is not None:
            self._idle.set()

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            seg = await self._queue.get()
            self._in_flight += 1
            try:
                await self._flush_one(seg)
            finally:
                self._in_flight -= 1
                self._pending.discard(seg.segment_id)
                self._queue.task_done()
                if not self._pending and self._wake is not None:
                    self._wake.set()  # rescan: more work, or report idle

    async def _flush_one(self, seg: SealedSegment) -> None:
        sid = seg.segment_id
        if not self.source.pin_segment(sid):
            log.warning("flusher: segment %s vanished before upload", sid)
            self._stats = replace(self._stats, skipped_segments=self._stats.skipped_segments + 1)
            return
        stored = False
        try:
            stored = await self._already_stored(seg)  # asks the bucket: inside the retry path
            if not stored:
                await self.tier.publish_segment(seg)
            await run_in_thread(self.source.mark_flushed, sid)  # fsyncs: off the loop
        except asyncio.CancelledError:
            raise
        except Exception as e:
            attempts = self._retry_at.get(sid, (0.0, 0))[1] + 1
            delay = min(self.retry_max_s, self.retry_base_s * 2 ** (attempts - 1))
            self._retry_at[sid] = (time.monotonic() + delay, attempts)
            self._stats = replace(self._stats, failures=self._stats.failures + 1,
                                  last_error=f"{type(e).__name__}: {e}")
            log.warning("flusher: segment %s failed (attempt %d, retry in %.1fs): %s", sid, attempts, delay, e)
            return
        finally:
            self.source.unpin_segment(sid)
        self._retry_at.pop(sid, None)
        self._unflushed.pop(sid, None)
        if self._flushed_meanwhile is not None:
            self._flushed_meanwhile.add(sid)
        if stored:
            self._stats = replace(self._stats, already_stored_segments=self._stats.already_stored_segments + 1,
                                  already_stored_bytes=self._stats.already_stored_bytes + seg.size)
        else:
            self._stats = replace(self._stats, flushed_segments=self._stats.flushed_segments + 1,
                                  flushed_bytes=self._stats.flushed_bytes + seg.size)

    async def _already_stored(self, seg: SealedSegment) -> bool:
        """Whether publishing ``seg`` would add nothing: the bucket serves every live record (same
        key, same length) now and none of them is protected, so the manifest would record no
        retention (module docstring). The index is asked first (memory only): most segments
        hold a record it lacks and cost no request."""
        tier = self.tier
        if not seg.entries or not all(tier.size_of(e.key) == e.length for e in seg.entries):
            return False
        if retain_field(tier.retention, [e.key for e in seg.entries]):
            return False
        return await tier.holds_now(seg.entries)
