"""Background write-back of sealed SSD segments to the object tier.

One asyncio task scans the ``SegmentSource`` (the SSD tier) for sealed, unflushed segments and
feeds a bounded queue; ``concurrency`` workers upload each segment as one data object plus its
manifest (``ObjectTier.publish_segment``), then call ``mark_flushed``.

* **Live records only.** The source lists each segment with its live records (those deleted or
  superseded since they were written are left out), and the manifest lists exactly those. When
  the bytes a restore can never read (dead records, the SSD footer) exceed ``compact_dead_share``
  of the file, the live records are first copied back to back into an unnamed temporary file
  beside the segment (same file system; it vanishes with the process, so a crash leaves nothing
  to clean up) and that copy is uploaded instead: the data object then holds only live records.
  Below the share the file is uploaded as it is (no copy). Either way the object is named by its
  content (``manifest.content_digest`` over what is uploaded), so a redo of the same live set
  reuses the object a crashed attempt left, and a changed live set gets a new name.

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
  bucket lacks, or one whose copy was reported corrupt, uploads the segment (its live records).
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
import errno
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..segments import SealedSegment, SegmentEntry, SegmentSource
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
    compacted_segments: int = 0  # uploaded as a copy of their live records (dead share above the bound)
    dead_bytes_dropped: int = 0  # bytes of those segments left out of their objects (dead records, footer)
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
        compact_dead_share: share of a segment file (0..1) that may be dead (records deleted or
            superseded, the footer) before only its live records are uploaded, as a copy (module
            docstring). 0 copies every segment with a dead byte; 1 never copies.
        clock: wall clock (injectable for tests); lag is measured against ``sealed_at``.
    """

    def __init__(self, source: SegmentSource, tier: ObjectTier, *, max_queue: int = 16, concurrency: int = 2,
                 scan_interval_s: float = 1.0, retry_base_s: float = 1.0, retry_max_s: float = 60.0,
                 compact_dead_share: float = 0.1, clock: Callable[[], float] = time.time) -> None:
        if max_queue < 1 or concurrency < 1 or scan_interval_s <= 0:
            raise ValueError("max_queue, concurrency and scan_interval_s must be positive")
        if not 0.0 <= compact_dead_share <= 1.0:  # NaN too
            raise ValueError(f"compact_dead_share must be in [0, 1], got {compact_dead_share}")
        self.source = source
        self.tier = tier
        self.max_queue = max_queue
        self.concurrency = concurrency
        self.scan_interval_s = scan_interval_s
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.compact_dead_share = compact_dead_share
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
        dropped = 0
        try:
            stored = await self._already_stored(seg)  # asks the bucket: inside the retry path
            if not stored:
                dropped = await self._publish_live(seg)
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
            st = self._stats
            self._stats = replace(st, flushed_segments=st.flushed_segments + 1,
                                  flushed_bytes=st.flushed_bytes + seg.size,
                                  compacted_segments=st.compacted_segments + (dropped > 0),
                                  dead_bytes_dropped=st.dead_bytes_dropped + dropped)

    async def _publish_live(self, seg: SealedSegment) -> int:
        """Publish ``seg``'s live records (module docstring): the file as it is while its dead
        share is within ``compact_dead_share``, else a copy of its live records back to back.
        Returns the bytes left out (0: the file was uploaded whole).

        Raises:
            OSError: the segment file could not be read (the segment is retried; a copy that
                cannot be written only means the file is uploaded whole).
            TierUnavailable: the store failed; nothing half-written is visible.
        """
        dead = seg.size - sum(e.length for e in seg.entries)
        if dead <= 0 or dead <= self.compact_dead_share * seg.size:
            await self.tier.publish_segment(seg)
            return 0
        # Unnamed (O_TMPFILE, or unlinked at once): no name for a crash to leave behind, and the
        # upload reads it by its descriptor's path while this coroutine holds the file open.
        try:
            tmp = tempfile.TemporaryFile(dir=Path(seg.path).parent)  # noqa: SIM115 - closed by the with below
        except OSError as e:
            return await self._publish_whole(seg, e)
        with tmp:
            try:
                live = await run_in_thread(copy_live_records, seg, tmp.fileno())
            except OSError as e:
                return await self._publish_whole(seg, e)
            await self.tier.publish_segment(live)
        return seg.size - live.size

    async def _publish_whole(self, seg: SealedSegment, why: OSError) -> int:
        """The copy of the live records could not be made (a full or read-only disk): upload the
        file as it is, dead bytes too, rather than hold the segment on the SSD until there is room
        (unflushed segments cannot be evicted). Its manifest still lists live records only."""
        log.warning("flusher: no copy of the live records of segment %s (%s); uploading the file whole",
                    seg.segment_id, why)
        await self.tier.publish_segment(seg)
        return 0

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


def copy_live_records(seg: SealedSegment, out_fd: int) -> SealedSegment:
    """Copy ``seg``'s listed (live) records back to back into the empty file ``out_fd``, in file
    order, adjacent records in one copy. Returns the segment the copy is: same id and seal time,
    the records at their new offsets, its path the descriptor's ``/proc/self/fd`` name (valid
    while ``out_fd`` stays open). Blocking: run it in a worker thread.

    Raises:
        OSError: the segment file is shorter than ``seg.size`` or a read or write failed.
    """
    src = os.open(seg.path, os.O_RDONLY)
    try:
        if os.fstat(src).st_size < seg.size:
            raise OSError(errno.EIO, f"{seg.path} is shorter than the {seg.size} bytes its segment lists")
        entries: list[SegmentEntry] = []
        runs: list[list[int]] = []  # [offset in the segment, length] of each run of adjacent records
        pos = 0
        for e in seg.entries:
            if runs and runs[-1][0] + runs[-1][1] == e.offset:
                runs[-1][1] += e.length
            else:
                runs.append([e.offset, e.length])
            entries.append(replace(e, offset=pos))  # every other field (tenant, ...) as listed
            pos += e.length
        at = 0
        for offset, length in runs:
            _copy_range(src, out_fd, offset, length, at)
            at += length
    finally:
        os.close(src)
    return SealedSegment(seg.segment_id, Path(f"/proc/self/fd/{out_fd}"), pos, tuple(entries), seg.sealed_at)


def _copy_range(src: int, dst: int, src_off: int, length: int, dst_off: int) -> None:
    """``length`` bytes of ``src`` at ``src_off`` to ``dst`` at ``dst_off``: in the kernel where
    the file system can (``copy_file_range``), else through a bounded buffer."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, src_off + done, dst_off + done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            break
        if n == 0:
            raise OSError(errno.EIO, f"segment file ended {length - done} bytes early at {src_off + done}")
        done += n
    while done < length:  # no copy_file_range here: pread/pwrite, 8 MiB at a time
        chunk = os.pread(src, min(8 << 20, length - done), src_off + done)
        if not chunk:
            raise OSError(errno.EIO, f"segment file ended {length - done} bytes early at {src_off + done}")
        view, put = memoryview(chunk), 0
        while put < len(chunk):
            put += os.pwrite(dst, view[put:], dst_off + done + put)
        done += len(chunk)
