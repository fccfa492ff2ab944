"""The SSD tier's read path: plan hits under the lock, then one request per contiguous run.

``ReadPathMixin`` is mixed into ``SSDTier`` only and uses its index, segment table, lock and I/O
path; it is split out to keep ``tier.py`` short. Reads run in the default executor, concurrently
with the writer thread; a reader holds a reference on each segment it reads (``readers``), so
eviction may unlink the file meanwhile and the last reader closes its descriptor.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import Sequence

import numpy as np

from ...blocks.codec import verify_record
from ...blocks.keys import BlockKey
from ...errors import RecordError
from ..base import ByteRange, ReadRequest, check_range
from . import metrics
from .flushing import SegmentState
from .gds import DeviceIO, DeviceSpan
from .index import CompactIndex
from .io import PosixIO, aligned_buffer, as_u8, read_extent

log = logging.getLogger(__name__)

BOUNCE_BYTES = 8 << 20


class ReadPathMixin:
    """``read_into`` / ``read_many`` of ``SSDTier``; identity checks when ``verify_reads`` is on."""

    #: how the store reads this tier (store_reads): a run is cut into pieces of at least
    #: ``read_piece_bytes`` (one NIXL transfer or preadv each), at most ``read_parallelism`` in
    #: flight across all loads (2 MiB x 16 = the raw bench's 8 MiB x 4 in flight; small pieces
    #: keep a load's first chunks from waiting behind its read-ahead). 8 MiB pieces cost a third
    #: less CPU but made an 8k restore on an idle engine 10-18 ms slower (`dtkv bench restore`,
    #: A/B), so they are used only while a pacer limits the load (a busy CPU engine pays the CPU).
    read_parallelism = 16
    read_piece_bytes = 2 << 20
    frugal_piece_bytes = 8 << 20
    slab_reads_now = True  # ``read_slab_now``: a one-chunk restore reads on the caller's thread

    _lock: threading.Lock
    _index: CompactIndex
    _segments: dict[int, SegmentState]
    _io: PosixIO | None
    _device_io: DeviceIO | None
    _verify: bool
    _namespace: bytes | None
    _read_bounces: list[np.ndarray]
    io_stats: dict[str, int]

    @property
    def device_io(self) -> DeviceIO | None:  # overridden by SSDTier
        raise NotImplementedError

    def _next_tick(self) -> int:
        raise NotImplementedError

    def _close_fd(self, fd: int) -> None:
        raise NotImplementedError

    def _device_failed(self, op: str, e: OSError) -> None:
        raise NotImplementedError

    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        return (await self.read_many([ReadRequest(key, into, byte_range)]))[0]

    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        """Read every hit; adjacent records of one segment are one read. Misses and failures are None.

        Raises:
            ValueError: a destination is too small or a byte range exceeds its record.
        """
        results: list[int | None] = [None] * len(requests)
        ops = self._plan_reads(requests)
        if ops:
            try:
                await asyncio.to_thread(self._execute_reads, ops, requests, results)
            finally:
                self._release([op[0] for op in ops])
        return results

    async def read_slab(self, keys: Sequence[BlockKey], dest: np.ndarray, rb: int) -> list[int | None]:
        """``read_many`` of whole records ``keys[i]`` into ``dest[i * rb:(i + 1) * rb]`` (one host
        buffer) without a view per record: slots whose records lie back to back in a segment are
        one read. A record whose length is not ``rb`` is a miss."""
        results: list[int | None] = [None] * len(keys)
        ops = self._plan_slab(keys, rb)
        if ops:
            try:
                await asyncio.to_thread(self._execute_slab, ops, keys, dest, rb, results)
            finally:
                self._release([op[0] for op in ops])
        return results

    def read_slab_now(self, keys: Sequence[BlockKey], dest: np.ndarray, rb: int) -> list[int | None]:
        """``read_slab`` on the calling thread (blocking): for a restore of one chunk, where handing
        the read to the store's loop and an I/O thread and back costs more than the read itself."""
        results: list[int | None] = [None] * len(keys)
        ops = self._plan_slab(keys, rb)
        if ops:
            try:
                self._execute_slab(ops, keys, dest, rb, results)
            finally:
                self._release([op[0] for op in ops])
        return results

    def _plan_slab(self, keys: Sequence[BlockKey], rb: int) -> list[tuple[SegmentState, int, int, int]]:
        """(segment, file offset, rb, slot) per hit, in slot order; takes a reader ref on each segment."""
        ops = []
        get = self._index.get
        segments = self._segments
        with self._lock:
            tick = self._next_tick()
            for i, k in enumerate(keys):
                loc = get(k)
                if loc is None or loc[2] != rb:
                    continue
                seg = segments[loc[0]]
                seg.readers += 1
                seg.last_used = tick
                ops.append((seg, loc[1], rb, i))
        return ops

    def _execute_slab(self, ops: list[tuple[SegmentState, int, int, int]], keys: Sequence[BlockKey],
                      dest: np.ndarray, rb: int, results: list[int | None]) -> None:
        assert self._io is not None
        bounce = self._take_read_bounce()
        try:
            start = 0
            while start < len(ops):
                seg, off, _, i0 = ops[start]
                end = start + 1
                while (end < len(ops) and ops[end][0] is seg and ops[end][3] == i0 + end - start
                       and ops[end][1] == off + (end - start) * rb):
                    end += 1
                i1 = i0 + end - start
                self.io_stats["read_requests"] += 1
                try:
                    read_extent(self._io, seg.fd, off, [dest[i0 * rb:i1 * rb]], bounce)
                except OSError as e:
                    log.warning("SSD read of %d records from %s failed: %s", i1 - i0, seg.path.name, e)
                    metrics.READ_ERRORS.inc()
                else:
                    metrics.BYTES_READ.inc((i1 - i0) * rb)
                    if not self._verify:
                        results[i0:i1] = [rb] * (i1 - i0)
                    else:
                        for i in range(i0, i1):
                            ok = self._verified(ReadRequest(keys[i], memoryview(dest[i * rb:(i + 1) * rb])),
                                                dest[i * rb:(i + 1) * rb])
                            results[i] = rb if ok else None
                start = end
        finally:
            self._read_bounces.append(bounce)

    def _plan_reads(self, requests: Sequence[ReadRequest]) -> list[tuple[SegmentState, int, int, int]]:
        """(segment, file offset, length, request index) per hit; takes a reader ref on each segment."""
        ops = []
        on_device = sum(isinstance(r.into, DeviceSpan) for r in requests)
        if on_device and on_device != len(requests):
            raise ValueError("a read batch is either all host buffers or all device spans")
        if on_device and self.device_io is None:
            return []  # no GPU-direct path (any more): all misses, the caller retries through host staging
        with self._lock:
            tick = self._next_tick()
            try:
                for i, r in enumerate(requests):
                    loc = self._index.get(r.key)
                    if loc is None:
                        continue
                    seq, rec_off, rec_len = loc
                    off, length = check_range(rec_len, r.into, r.byte_range)
                    seg = self._segments[seq]
                    seg.readers += 1
                    seg.last_used = tick
                    ops.append((seg, rec_off + off, length, i))
            except BaseException:
                for seg, *_ in ops:
                    seg.readers -= 1
                raise
        return ops

    def _release(self, segs: list[SegmentState]) -> None:
        with self._lock:
            for seg in segs:
                seg.readers -= 1
                if seg.dead and seg.readers == 0 and self._io is not None:
                    self._close_fd(seg.fd)

    def _execute_reads(self, ops: list[tuple[SegmentState, int, int, int]], requests: Sequence[ReadRequest],
                       results: list[int | None]) -> None:
        assert self._io is not None
        ops = sorted(ops, key=lambda o: (o[0].seq, o[1]))
        bounce = self._take_read_bounce()
        try:
            start = 0
            while start < len(ops):
                end = start + 1
                while (end < len(ops) and ops[end][0] is ops[start][0]
                       and ops[end][1] == ops[end - 1][1] + ops[end - 1][2]):
                    end += 1
                run = ops[start:end]
                dsts = [_destination(requests[i].into, n) for _, _, n, i in run]
                self.io_stats["read_requests"] += 1
                try:
                    if isinstance(dsts[0], DeviceSpan):
                        self._device_read(run[0][0], run[0][1], dsts)  # type: ignore[arg-type]
                    else:
                        read_extent(self._io, run[0][0].fd, run[0][1], dsts, bounce)  # type: ignore[arg-type]
                except OSError as e:
                    log.warning("SSD read of %d records from %s failed: %s", len(run), run[0][0].path.name, e)
                    metrics.READ_ERRORS.inc()
                else:
                    for (_, _, n, i), d in zip(run, dsts):
                        results[i] = n if self._verified(requests[i], d) else None
                    metrics.BYTES_READ.inc(sum(d.nbytes for d in dsts))
                start = end
        finally:
            self._read_bounces.append(bounce)

    def _device_read(self, seg: SegmentState, offset: int, spans: list[DeviceSpan]) -> None:
        dio = self._device_io
        if dio is None:
            raise OSError(errno.ENODEV, "GPU-direct path detached")
        try:
            dio.read(seg.fd, spans, offset)
        except OSError as e:
            self._device_failed("read", e)
            raise
        metrics.GPU_DIRECT_BYTES.labels("read").inc(sum(s.nbytes for s in spans))

    def _verified(self, req: ReadRequest, data: np.ndarray | DeviceSpan) -> bool:
        # Device records are verified on the device where they are consumed (device_codec).
        if not self._verify or req.byte_range is not None or isinstance(data, DeviceSpan):
            return True
        try:
            # The full identity: a foreign tenant's record under the same key bytes is a miss too.
            verify_record(data, namespace=self._namespace, key=req.key)
            return True
        except RecordError as e:
            log.warning("SSD record %s failed verification (%s); dropped", req.key.hex(), e)
            metrics.CHECKSUM_FAILURES.inc()
            with self._lock:
                self._index.pop(req.key)
            return False

    def _take_read_bounce(self) -> np.ndarray:
        try:
            return self._read_bounces.pop()
        except IndexError:
            return aligned_buffer(BOUNCE_BYTES)


def _destination(into: memoryview | DeviceSpan, n: int) -> np.ndarray | DeviceSpan:
    if isinstance(into, DeviceSpan):
        return DeviceSpan(into.slab, into.offset, n)
    return as_u8(into)[:n]
