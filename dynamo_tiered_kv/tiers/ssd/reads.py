"""The SSD tier's read path: plan hits under the lock, then one request per contiguous run.

``ReadPath`` works on the shared ``SegmentLogState``. Reads run in the default executor (or on
the caller's thread for ``read_slab_now``), concurrently with the writer thread; a reader holds a
reference on each segment it reads (``readers``), so eviction may unlink the file meanwhile and
the last reader closes its descriptor.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Sequence

import numpy as np

from ...blocks.codec import verify_record
from ...blocks.keys import BlockKey
from ...errors import RecordError
from ..base import ReadRequest, check_range
from . import metrics
from .gds import DeviceSpan
from .io import aligned_buffer, as_u8, read_extent
from .state import BOUNCE_BYTES, SegmentLogState, SegmentState

log = logging.getLogger(__name__)

ReadOp = tuple[SegmentState, int, int, int]  # (segment, file offset, length, request index or slot)


class ReadPath:
    """``read_many`` / ``read_slab`` of ``SSDTier``; identity checks when ``verify`` is on.

    Built by ``SSDTier`` with the shared ``SegmentLogState`` (index, segments, I/O path, GPU-direct
    link, statistics), whether to verify whole-record reads and the namespace digest they must
    carry. Threads: any number of readers at once (each takes a bounce buffer of its own from a
    free list; list append/pop are atomic), concurrently with the writer thread.
    """

    def __init__(self, state: SegmentLogState, *, verify: bool, namespace: bytes | None) -> None:
        self._state = state
        self._verify = verify
        self._namespace = namespace
        self._bounces: list[np.ndarray] = []

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

    def _plan_slab(self, keys: Sequence[BlockKey], rb: int) -> list[ReadOp]:
        """(segment, file offset, rb, slot) per hit, in slot order; takes a reader ref on each segment."""
        return [(seg, off, rb, i) for seg, off, i in self._state.pin_hits(keys, rb)]

    def _execute_slab(self, ops: list[ReadOp], keys: Sequence[BlockKey], dest: np.ndarray, rb: int,
                      results: list[int | None]) -> None:
        st = self._state
        assert st.io is not None
        bounce = self._take_bounce()
        try:
            start = 0
            while start < len(ops):
                seg, off, _, i0 = ops[start]
                end = start + 1
                while (end < len(ops) and ops[end][0] is seg and ops[end][3] == i0 + end - start
                       and ops[end][1] == off + (end - start) * rb):
                    end += 1
                i1 = i0 + end - start
                st.io_stats["read_requests"] += 1
                try:
                    read_extent(st.io, seg.fd, off, [dest[i0 * rb:i1 * rb]], bounce)
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
            self._bounces.append(bounce)

    def _plan_reads(self, requests: Sequence[ReadRequest]) -> list[ReadOp]:
        """(segment, file offset, length, request index) per hit; takes a reader ref on each segment."""
        ops = []
        on_device = sum(isinstance(r.into, DeviceSpan) for r in requests)
        if on_device and on_device != len(requests):
            raise ValueError("a read batch is either all host buffers or all device spans")
        st = self._state
        if on_device and (st.gpu.current is None or not st.opened or st.disabled_reason):
            return []  # no GPU-direct path (any more): all misses, the caller retries through host staging
        with st.lock:
            tick = st.next_tick()
            try:
                for i, r in enumerate(requests):
                    loc = st.index.get(r.key)
                    if loc is None:
                        continue
                    seq, rec_off, rec_len = loc
                    off, length = check_range(rec_len, r.into, r.byte_range)
                    seg = st.segments[seq]
                    seg.readers += 1
                    seg.last_used = tick
                    ops.append((seg, rec_off + off, length, i))
            except BaseException:
                for seg, *_ in ops:
                    seg.readers -= 1
                raise
        return ops

    def _release(self, segs: list[SegmentState]) -> None:
        st = self._state
        with st.lock:
            for seg in segs:
                st.release_locked(seg)

    def _execute_reads(self, ops: list[ReadOp], requests: Sequence[ReadRequest], results: list[int | None]) -> None:
        st = self._state
        assert st.io is not None
        ops = sorted(ops, key=lambda o: (o[0].seq, o[1]))
        bounce = self._take_bounce()
        try:
            start = 0
            while start < len(ops):
                end = start + 1
                while (end < len(ops) and ops[end][0] is ops[start][0]
                       and ops[end][1] == ops[end - 1][1] + ops[end - 1][2]):
                    end += 1
                run = ops[start:end]
                dsts = [_destination(requests[i].into, n) for _, _, n, i in run]
                st.io_stats["read_requests"] += 1
                try:
                    if isinstance(dsts[0], DeviceSpan):
                        self._device_read(run[0][0], run[0][1], dsts)  # type: ignore[arg-type]
                    else:
                        read_extent(st.io, run[0][0].fd, run[0][1], dsts, bounce)  # type: ignore[arg-type]
                except OSError as e:
                    log.warning("SSD read of %d records from %s failed: %s", len(run), run[0][0].path.name, e)
                    metrics.READ_ERRORS.inc()
                else:
                    for (_, _, n, i), d in zip(run, dsts):
                        results[i] = n if self._verified(requests[i], d) else None
                    metrics.BYTES_READ.inc(sum(d.nbytes for d in dsts))
                start = end
        finally:
            self._bounces.append(bounce)

    def _device_read(self, seg: SegmentState, offset: int, spans: list[DeviceSpan]) -> None:
        gpu = self._state.gpu
        dio = gpu.current
        if dio is None:
            raise OSError(errno.ENODEV, "GPU-direct path detached")
        try:
            dio.read(seg.fd, spans, offset)
        except OSError as e:
            gpu.failed("read", e)
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
            with self._state.lock:
                self._state.pop_locked(req.key)
            return False

    def _take_bounce(self) -> np.ndarray:
        try:
            return self._bounces.pop()
        except IndexError:
            return aligned_buffer(BOUNCE_BYTES)


def _destination(into: memoryview | DeviceSpan, n: int) -> np.ndarray | DeviceSpan:
    if isinstance(into, DeviceSpan):
        return DeviceSpan(into.slab, into.offset, n)
    return as_u8(into)[:n]
