"""G3 SSD tier: append-only segment files in a per-rank directory, with a compact index.

Data path: ``write_many`` appends a run of records back to back into the open segment with one
I/O request (NIXL POSIX/io_uring or pwritev, O_DIRECT) and, with ``fsync``, one ``fdatasync``;
only then does the index expose the keys. ``read_many`` looks keys up in memory, sorts the hits
and reads every run of adjacent records of one segment with one request, straight into the
caller's buffers when they are page aligned (staging slabs are), through a bounce buffer
otherwise. A full or idle segment is sealed with a footer; eviction drops whole sealed segments,
least recently used first; deletes free their records' bytes (``reclaim.py``), and the tombstone
log sheds the entries of segments that are gone (``tombstones.py``). Format, crash contract and
concurrency rule: docs/SSD.md.

Threads: all mutations (append, seal, delete, evict) run on one writer thread, so appends are
ordered; reads run in the default executor concurrently with it. ``self._lock`` guards the index
and segment table, never I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ...blocks.codec import ALIGN
from ...blocks.keys import KEY_BYTES, BlockKey
from ...errors import PartialWrite, TierFull, TierUnavailable
from ..base import Tier, TierCapabilities, TierExpiry, TierUsage
from ..segments import SealedSegment
from . import metrics
from .eviction import EvictionMixin
from .flushing import SegmentSourceMixin, SegmentState
from .gds import DeviceIO, DeviceSpan
from .gds_probe import GdsVerdict, gds_verdict
from .index import CompactIndex
from .io import PosixIO, aligned_buffer, as_u8, select_io, write_extent
from .quarantine import highest_quarantined_seq, quarantine
from .reads import BOUNCE_BYTES, ReadPathMixin
from .reclaim import ReclaimMixin
from .recovery import fsync_dir, load_tombstones, recover_segments
from .sealing import SealingMixin
from .segment import (
    LOCK_FILE,
    footer_bytes,
    list_segments,
    segment_name,
)
from .tombstones import TombstoneLogMixin

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 256 << 20
_DEGRADING_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.EFBIG}


class SSDTier(SegmentSourceMixin, ReadPathMixin, ReclaimMixin, TombstoneLogMixin, EvictionMixin, SealingMixin,
              Tier):
    """Segment-log SSD tier. Constructor keyword arguments are its config schema.

    Args:
        path: root directory; this worker uses ``<path>/rank-<rank>/`` exclusively (flock).
        capacity_bytes: byte budget for all segment files of this rank, enforced on every write.
        segment_bytes: target segment size (records + footer). Clamped to ``capacity_bytes // 4``
            so eviction, which works on whole segments, has room to work.
        rank: worker rank (TP rank); selects the subdirectory.
        io: ``auto`` (NIXL POSIX, else O_DIRECT pwritev, else buffered), ``nixl``, ``odirect``,
            ``buffered``. Paths that cannot work here fall back with a warning.
        allow_evict_unflushed: may eviction drop sealed segments the object tier has not yet
            copied? ``None`` (default) means yes until a flusher calls ``unflushed_segments``
            (a standalone SSD tier must be able to evict), no afterwards.
        fsync: ``fdatasync`` after every write batch, seal and delete. An acknowledged write then
            survives power loss, not only a process kill.
        verify_reads: verify whole-record reads (checksum, key and, when ``namespace`` is given,
            namespace) before reporting a hit; a failure is a miss and drops the entry. Off by
            default because the codec verifies every record where it is consumed.
        namespace: expected namespace digest (``Namespace.digest``) of every record this tier
            serves; with ``verify_reads`` a record of another model, layout or tenant that
            carries the same key bytes is a miss. ``None``: the key alone is checked.
        idle_seal_s: seal the open segment after this many idle seconds (None: only when full
            and on close).
        write_retry_s: after a write failed with ENOSPC/EROFS/EIO the tier serves reads only and
            fails writes fast; the first write after this many seconds tries the device again.
        on_sealed: called on the writer thread with each newly sealed segment; keep it short.
        device_io: GPU-direct transfers (NIXL GDS_MT) for records in registered device slabs:
            ``write_many`` values and ``read_many`` destinations may then be ``DeviceSpan``s.
            Used only over O_DIRECT files; the first failed transfer detaches it for good (log
            line, ``dtkv_ssd_gpu_direct_failures``) and callers take the host-bounce path.
    """

    name = "ssd"
    capabilities = TierCapabilities(medium="ssd", durable=True, shared=False)

    def __init__(self, path: str | os.PathLike[str], *, capacity_bytes: int,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, rank: int = 0, io: str = "auto",
                 allow_evict_unflushed: bool | None = None, fsync: bool = True, verify_reads: bool = False,
                 idle_seal_s: float | None = 60.0, write_retry_s: float = 30.0,
                 on_sealed: Callable[[SealedSegment], None] | None = None,
                 device_io: DeviceIO | None = None, namespace: bytes | None = None) -> None:
        if capacity_bytes <= 0 or segment_bytes < 2 * ALIGN or rank < 0:
            raise ValueError("capacity_bytes and rank must be positive and segment_bytes at least 8 KiB")
        if io not in ("auto", "nixl", "odirect", "buffered"):
            raise ValueError(f"io must be auto|nixl|odirect|buffered, got {io!r}")
        self.root = Path(path)
        self.rank = rank
        self.rank_dir = self.root / f"rank-{rank:03d}"
        self._capacity = capacity_bytes
        clamp = max(2 * ALIGN, capacity_bytes // 4 // ALIGN * ALIGN)
        self._segment_bytes = min(segment_bytes // ALIGN * ALIGN, clamp)
        self._io_mode = io
        self._allow_unflushed = allow_evict_unflushed
        self._flusher_attached = False
        self._fsync = fsync
        self._verify = verify_reads
        self._namespace = namespace
        self._idle_seal_s = idle_seal_s
        self._write_retry_s = write_retry_s
        self._readonly_at = 0.0
        self.on_sealed = on_sealed
        self._device_io = device_io
        self._gpu_direct_counted = False  # whether this tier counts in dtkv_ssd_gpu_direct_active

        self._lock = threading.Lock()
        self._index = CompactIndex()
        self._segments: dict[int, SegmentState] = {}
        self._open: SegmentState | None = None
        self._next_seq = 1
        self._used = 0
        self._tick = 0
        self._last_write = time.monotonic()
        self._io: PosixIO | None = None
        self._lock_fd: int | None = None
        self._write_bounce: np.ndarray | None = None
        self._read_bounces: list[np.ndarray] = []
        self._superseded_at_recovery: list[tuple[int, int, bytes]] = []
        self._seal_pending = False  # a seal of the open segment failed: retried by the next write or idle seal
        self._init_reclaim()
        self._init_tombstone_log()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"dtkv-ssd{rank}")
        self._stop = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self._opened = False
        self._closed = False
        self.disabled_reason: str | None = None  # set when the tier serves nothing (no SSD tier)
        self.readonly_reason: str | None = None  # set when writes stopped (reads still served)
        self.gds: GdsVerdict = GdsVerdict(False, "not probed")
        #: logical I/O requests issued: one per contiguous run (bounced runs may take more syscalls)
        self.io_stats = {"read_requests": 0, "write_requests": 0}

    # --- lifecycle --------------------------------------------------------------------------
    @property
    def io_path(self) -> str:
        return self._io.name if self._io else "none"

    @property
    def available(self) -> bool:
        return self._opened and self.disabled_reason is None

    async def open(self) -> None:
        """Lock the rank directory, choose the I/O path, recover segments and rebuild the index.

        Never raises for environmental faults (unwritable directory, lock held by another
        process, no space): the tier is disabled with a log line and the ``dtkv_ssd_disabled``
        metric, and behaves as an empty tier whose writes raise ``TierUnavailable``.
        """
        if self._opened:
            return
        await asyncio.get_running_loop().run_in_executor(self._writer, self._open_sync)
        self._opened = True
        if self._idle_seal_s and self.disabled_reason is None:
            self._idle_thread = threading.Thread(target=self._idle_loop, name=f"dtkv-ssd{self.rank}-idle",
                                                 daemon=True)
            self._idle_thread.start()

    def _open_sync(self) -> None:
        try:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.rank_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._disable(f"{self.rank_dir} is locked by another process (one writer per rank directory)")
                return
            self._io = select_io(self.rank_dir, self._io_mode)
            self._probe_fs_block()
            metrics.IO_PATH.labels(self._io.name).set(1)
            self.gds = gds_verdict(self.rank_dir)  # the self-test file goes where this tier's segments go
            if self._device_io is not None:
                self._check_gpu_direct()
            self._recover()
            self._open_tombstones()
            if self._superseded_at_recovery:
                self._append_tombstones(self._superseded_at_recovery)
                self._superseded_at_recovery = []
            self._reclaim_sync()  # segments recovery found without a live record
        except OSError as e:
            self._disable(f"cannot use {self.rank_dir}: {e}")
            self._drop_state()  # a half-recovered index must not serve anything

    def _drop_state(self) -> None:
        """Forget every segment. A read still in flight keeps its fd: ``_release`` closes it."""
        with self._lock:
            for seg in self._segments.values():
                seg.dead = True
                if self._io is not None and seg.readers == 0:
                    with contextlib.suppress(OSError):
                        self._close_fd(seg.fd)
            self._segments.clear()
            self._index.clear()
            self._dead.clear()
            self._open = None
            self._used = 0

    def _recover(self) -> None:
        assert self._io is not None
        seen = list_segments(self.rank_dir)
        # never reuse a seq, even of a removed or quarantined file (the object tier may hold it)
        self._next_seq = max(seen[-1][0] if seen else 0, highest_quarantined_seq(self.rank_dir)) + 1
        recovered = recover_segments(self.rank_dir, self.rank)
        dead = load_tombstones(self.rank_dir, {r.seq for r in recovered})
        self._note_live_tombstones(dead)
        superseded: list[tuple[int, int, bytes]] = []
        for r in recovered:
            try:
                fd = self._io.open(r.path)
            except OSError as e:  # one unreadable file must not turn the whole tier off
                quarantine(r.path, f"cannot open it for I/O: {e}")
                continue
            seg = SegmentState(r.seq, r.path, fd, r.data_bytes, r.size, sealed=True,
                               flushed=r.flushed, sealed_at=r.sealed_at_ns / 1e9, last_used=self._next_tick())
            self._segments[r.seq] = seg
            self._used += r.size
            if r.seal_error and self.readonly_reason is None:
                self.readonly_reason = f"cannot seal recovered {r.path.name}: {r.seal_error}"
                metrics.DEGRADED.labels("recovery").inc()
            for key, off, length in zip(r.entries["key"].tolist(), r.entries["offset"].tolist(),
                                        r.entries["length"].tolist()):
                # Entries arrive in write order, so the newest location decides: a tombstone on
                # it means the key was deleted after every older copy was written.
                if (r.seq, off) in dead:
                    self._index.pop(key)
                else:
                    old = self._index.put(key, r.seq, off, length)
                    if old is not None:  # a crash beat the overwrite's tombstone: write it now,
                        superseded.append((old[0], old[1], key))  # or evicting the new copy revives this one
        self._superseded_at_recovery = superseded
        self._note_empty_segments(r.seq for r in recovered)
        metrics.USED_BYTES.set(self._used)
        log.info("SSD tier %s: recovered %d segments, %d blocks, %d bytes; io=%s", self.rank_dir,
                 len(recovered), len(self._index), self._used, self.io_path)

    def _check_gpu_direct(self) -> None:
        """Keep the GPU-direct path only if it round-trips real bytes in the rank directory now."""
        assert self._io is not None and self._device_io is not None
        dio = self._device_io
        if not self._io.direct:
            log.warning("SSD tier %s: GPU-direct needs O_DIRECT files, this filesystem refuses them; "
                        "device records take the host-bounce path", self.rank_dir)
            self._device_io = None
            return
        try:
            dio.self_test(self.rank_dir)
        except (OSError, ValueError) as e:
            log.warning("SSD tier %s: GPU-direct self-test through NIXL %s failed (%s); device records take the "
                        "host-bounce path", self.rank_dir, dio.backend, e)
            metrics.GPU_DIRECT_FAILURES.inc()
            self._device_io = None
            return
        self._gpu_direct_counted = True
        metrics.GPU_DIRECT_ACTIVE.inc()
        log.info("SSD tier %s: GPU-direct transfers through NIXL %s (self-test passed)", self.rank_dir, dio.backend)

    def _close_fd(self, fd: int) -> None:
        assert self._io is not None
        if self._device_io is not None:
            self._device_io.forget(fd)
        self._io.close_fd(fd)

    @property
    def device_io(self) -> DeviceIO | None:
        """The GPU-direct path while it works (None before ``open``, without one, or after a failure)."""
        return self._device_io if self.available else None

    def _device_failed(self, op: str, e: OSError) -> None:
        with self._lock:  # a reader and the writer may fail at once: detach and count once
            if self._device_io is None:
                return
            self._device_io = None  # never used again; its fd registrations die with its agent
        log.error("SSD tier %s: GPU-direct %s failed (%s); falling back to host bounce for good", self.rank_dir,
                  op, e)
        metrics.GPU_DIRECT_FAILURES.inc()
        self._uncount_gpu_direct()

    def _uncount_gpu_direct(self) -> None:
        with self._lock:
            counted, self._gpu_direct_counted = self._gpu_direct_counted, False
        if counted:
            metrics.GPU_DIRECT_ACTIVE.dec()

    def _disable(self, reason: str) -> None:
        log.error("SSD tier disabled (no SSD tier): %s", reason)
        self.disabled_reason = reason
        metrics.DISABLED.inc()  # one per disabled tier; close() takes it back
        metrics.DEGRADED.labels("disabled").inc()

    async def close(self) -> None:
        """Seal the open segment, close files and release the rank lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._opened:
            await asyncio.get_running_loop().run_in_executor(self._writer, self._close_sync)
        self._writer.shutdown(wait=True)
        self._uncount_gpu_direct()
        if self.disabled_reason is not None:
            metrics.DISABLED.dec()
        if self._idle_thread is not None:
            self._idle_thread.join(timeout=5)

    def _close_sync(self) -> None:
        if self.disabled_reason is None:  # even read-only: the footer may still fit after a failed write
            with contextlib.suppress(TierUnavailable):
                self._seal_sync()
        self._drop_state()
        for fd in (self._tomb_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)  # closing the lock fd releases the flock
        self._tomb_fd = self._lock_fd = None

    # --- index (memory only) ----------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._index

    def size_of(self, key: BlockKey) -> int | None:
        with self._lock:
            loc = self._index.get(key)
        return None if loc is None else loc[2]

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return self._index.keys()

    def usage(self) -> TierUsage:
        return TierUsage(self._capacity, self._used, len(self._index))

    def index_nbytes(self) -> int:
        return self._index.nbytes()

    # --- writes -----------------------------------------------------------------------------
    async def write(self, key: BlockKey, data: memoryview) -> None:
        await self.write_many([(key, data)])

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview | DeviceSpan]]) -> None:
        """Append the records in order; a run that fits one segment lands contiguously in it.

        Values are host buffers, or (all of them) ``DeviceSpan``s when ``device_io`` is set.

        Raises:
            ValueError: a key is not 16 bytes, a record is not a positive 4 KiB multiple, or
                host and device values are mixed.
            TierFull: nothing evictable is left to make room.
            TierUnavailable: the tier is disabled, the device failed (ENOSPC, EROFS, EIO), or
                device values came without a working GPU-direct path. Nothing of the batch is stored.
            PartialWrite: (a ``TierUnavailable``) the first ``written`` records are durable and
                indexed, the rest are not. A failed seal after the last record is no error: the
                records are stored and the seal is retried (next write, idle seal, close).
        """
        batch = [(bytes(k), v if isinstance(v, DeviceSpan) else as_u8(v)) for k, v in items]
        for k, v in batch:
            if len(k) != KEY_BYTES or v.nbytes <= 0 or v.nbytes % ALIGN:
                raise ValueError(f"SSD tier stores 16-byte keys and 4 KiB-multiple records, got {v.nbytes} bytes")
        on_device = sum(isinstance(v, DeviceSpan) for _, v in batch)
        if on_device and on_device != len(batch):
            raise ValueError("a write batch is either all host buffers or all device spans")
        if on_device and self.device_io is None:
            raise TierUnavailable("device records need the GPU-direct path, which this SSD tier does not have")
        if batch:
            await asyncio.get_running_loop().run_in_executor(self._writer, self._append_sync, batch)

    def _check_writable(self) -> None:
        if not self._opened or self._closed:
            raise TierUnavailable("SSD tier is not open")
        if self.readonly_reason and time.monotonic() - self._readonly_at >= self._write_retry_s:
            log.info("SSD tier: retrying writes after: %s", self.readonly_reason)
            self.readonly_reason = None
        if self.disabled_reason or self.readonly_reason:
            raise TierUnavailable(f"SSD tier is not accepting writes: {self.disabled_reason or self.readonly_reason}")

    def _append_sync(self, items: list[tuple[bytes, np.ndarray | DeviceSpan]]) -> None:
        self._check_writable()
        if self._seal_pending:  # an earlier seal failed: retry it first (raising here: nothing written)
            self._seal_sync()
        i = 0
        try:
            while i < len(items):
                seg = self._open or self._new_segment()
                n0 = len(seg.entries)
                take, nbytes = 0, 0
                while i + take < len(items):
                    ln = items[i + take][1].nbytes
                    if seg.data_bytes + nbytes + ln + footer_bytes(n0 + take + 1) > self._segment_bytes:
                        break
                    take, nbytes = take + 1, nbytes + ln
                rest = len(items) - i
                if n0 and (take == 0 or (take < rest and sum(v.nbytes for _, v in items[i:]) + footer_bytes(rest)
                                         <= self._segment_bytes)):
                    self._seal_sync()  # start a fresh segment so the run stays contiguous
                    continue
                if take == 0:  # a record larger than a segment gets a segment of its own
                    take, nbytes = 1, items[i][1].nbytes
                self._append_run(seg, items[i:i + take], nbytes)
                i += take
        except (TierUnavailable, TierFull) as e:
            if i == 0:
                raise
            # The first i records are durable and indexed: say so, callers must not treat them as lost.
            raise PartialWrite(f"SSD tier stored {i} of {len(items)} records, then: {e}", written=i) from e
        if self._open is not None and self._open.data_bytes + footer_bytes(len(self._open.entries) + 1) + ALIGN \
                > self._segment_bytes:
            try:
                self._seal_sync()
            except TierUnavailable as e:  # every record is durable and indexed: the write succeeded
                log.warning("SSD tier: %d records written; sealing %s failed and is retried later: %s",
                            len(items), self._open.path.name, e)

    def _append_run(self, seg: SegmentState, run: list[tuple[bytes, np.ndarray | DeviceSpan]], nbytes: int) -> None:
        assert self._io is not None
        n0 = len(seg.entries)
        need = nbytes + footer_bytes(n0 + len(run)) - footer_bytes(n0)
        self._make_room(need)
        offset = seg.data_bytes
        try:
            self.io_stats["write_requests"] += 1
            if isinstance(run[0][1], DeviceSpan):
                self._device_write(seg, offset, [v for _, v in run])  # type: ignore[misc]
            else:
                write_extent(self._io, seg.fd, offset, [v for _, v in run], self._bounce())  # type: ignore[misc]
            if self._fsync:
                self._io.sync(seg.fd)
        except OSError as e:
            self._write_failed(seg, offset, e)
        superseded, freed = [], []
        with self._lock:
            off = offset
            for k, v in run:
                old = self._index.put(k, seg.seq, off, v.nbytes)
                if old is not None:
                    superseded.append((old[0], old[1], k))
                    freed.append(old)
                seg.entries.append((k, off, v.nbytes))
                off += v.nbytes
            self._retained_arrived_locked(seg.seq, (k for k, _ in run))  # per-segment retention ranks
            seg.data_bytes = off
            seg.size += need
            self._used += need
            seg.last_used = self._next_tick()
        self._last_write = time.monotonic()
        metrics.BYTES_WRITTEN.inc(nbytes)
        metrics.USED_BYTES.set(self._used)
        if superseded and self._append_tombstones(superseded):  # old locations must not come back after a
            self._note_dead(freed)  # restart; their bytes are freed by the next delete batch or seal

    def _device_write(self, seg: SegmentState, offset: int, spans: list[DeviceSpan]) -> None:
        """GPU-direct append. A failure is the GDS path's, not the disk's: detach it and fail this
        batch (the caller retries through host staging) without marking the tier read-only."""
        dio = self._device_io
        if dio is None:
            raise TierUnavailable("GPU-direct path detached")
        try:
            dio.write(seg.fd, spans, offset)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(seg.fd, offset)
            self._device_failed("write", e)
            raise TierUnavailable(f"GPU-direct write to {seg.path.name} failed: {e}") from e
        metrics.GPU_DIRECT_BYTES.labels("write").inc(sum(s.nbytes for s in spans))

    def _write_failed(self, seg: SegmentState, offset: int, e: OSError) -> None:
        with contextlib.suppress(OSError):
            os.ftruncate(seg.fd, offset)  # drop whatever part of the run reached the file
        reason = f"write to {seg.path.name} failed: {e}"
        if e.errno in _DEGRADING_ERRNOS:
            log.error("SSD tier stops accepting writes for %.0fs (reads still served): %s", self._write_retry_s,
                      reason)
            self.readonly_reason = reason
            self._readonly_at = time.monotonic()
            metrics.DEGRADED.labels(errno.errorcode.get(e.errno or 0, "EIO")).inc()
        raise TierUnavailable(reason) from e

    def _new_segment(self) -> SegmentState:
        assert self._io is not None
        seq = self._next_seq
        path = self.rank_dir / segment_name(seq)
        try:
            fd = self._io.open(path, create=True)
            fsync_dir(self.rank_dir)
        except OSError as e:
            self.readonly_reason = f"cannot create {path}: {e}"
            self._readonly_at = time.monotonic()
            log.error("SSD tier stops accepting writes: %s", self.readonly_reason)
            metrics.DEGRADED.labels(errno.errorcode.get(e.errno or 0, "EIO")).inc()
            raise TierUnavailable(self.readonly_reason) from e
        seg = SegmentState(seq, path, fd, 0, footer_bytes(0), sealed=False, last_used=self._next_tick())
        with self._lock:
            self._next_seq = seq + 1
            self._segments[seq] = seg
            self._open = seg
            self._used += seg.size
        return seg

    def _bounce(self) -> np.ndarray:
        if self._write_bounce is None:
            self._write_bounce = aligned_buffer(BOUNCE_BYTES)
        return self._write_bounce

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # --- deletes ----------------------------------------------------------------------------
    async def expire(self, now: float, max_bytes: int) -> TierExpiry:
        """``Tier.expire``, then the open segment is sealed if expired records lie in it, so no
        byte of an expired block stays on disk after the pass (``seal_deleted``)."""
        done = await super().expire(now, max_bytes)
        if done.blocks:
            await self.seal_deleted()
        return done

    async def delete(self, key: BlockKey) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._delete_sync, bytes(key))

    def _delete_sync(self, key: bytes) -> bool:
        return self._delete_many_sync([bytes(key)]) == 1

    async def delete_many(self, keys: Iterable[BlockKey]) -> int:
        batch = [bytes(k) for k in keys]
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._delete_many_sync, batch)

    def _delete_many_sync(self, keys: list[bytes]) -> int:
        """One tombstone append (one fdatasync) for the whole batch, then free the records' bytes."""
        locs = []
        with self._lock:
            for key in keys:
                loc = self._index.pop(key)
                if loc is not None:
                    locs.append((loc, key))
        if locs and self._append_tombstones([(s, o, k) for (s, o, _), k in locs]):
            self._note_dead(loc for loc, _ in locs)
        self._reclaim_sync()  # also what an earlier batch had to defer
        return len(locs)
