"""``SSDTier.read_split_now``: whole records read straight into buffers the caller gives per record.

A caller whose destination of a record's payload is its own memory (an engine's row of a block)
gives each record's bytes as a few buffers: a scratch for the header, the destination of the
payload, a scratch for the padding. Records that lie back to back in one segment are ONE
``preadv`` over all their buffers, so the payload lands where it is consumed without a staging
copy, and verification then happens there (the caller's).

O_DIRECT: the kernel takes a direct read into any buffer aligned (address and length) to the
device's logical block size (512 bytes on most disks), not only to pages. A run whose buffers
are all 512-aligned is read directly; one that is not, or a device that refuses it (EINVAL, a
4 KiB-sector disk: remembered for the tier's life), is read through a bounce buffer and copied
(``io.read_extent``), which costs the copy this path exists to avoid but reads the same bytes.

Threads: any number of callers at once (bounce buffers from a free list; list append/pop are
atomic); concurrently with the writer thread. A reader holds a reference on each segment it
reads (``readers``), as ``ReadPath`` does.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence

import numpy as np

from ...blocks.keys import BlockKey
from . import metrics
from .io import address_of, aligned_buffer, read_extent
from .state import BOUNCE_BYTES, SegmentLogState, SegmentState

log = logging.getLogger(__name__)

#: direct-read alignment of buffers tried first (the logical block size of most disks)
DIO_BUFFER_ALIGN = 512
#: file offsets of direct reads (records start on 4 KiB boundaries anyway)
DIO_OFFSET_ALIGN = 4096


class SplitReader:
    """Reads for ``SSDTier.read_split_now`` (module docstring) over the tier's shared state."""

    def __init__(self, state: SegmentLogState) -> None:
        self._state = state
        self._bounces: list[np.ndarray] = []
        #: the device refused a direct read into 512-aligned buffers: bounce unaligned runs from now on
        self.small_align_refused = False

    def read_now(self, keys: Sequence[BlockKey], parts: Sequence[Sequence[np.ndarray]],
                 rb: int) -> list[int | None]:
        if len(parts) != len(keys):
            raise ValueError("keys and parts must have the same length")
        for p in parts:
            if sum(b.nbytes for b in p) != rb:
                raise ValueError(f"a record's buffers must add up to {rb} bytes")
        results: list[int | None] = [None] * len(keys)
        ops = self._plan(keys, rb)
        if ops:
            try:
                self._execute(ops, parts, rb, results)
            finally:
                st = self._state
                with st.lock:
                    for seg, _, _ in ops:
                        st.release_locked(seg)
        return results

    def _plan(self, keys: Sequence[BlockKey], rb: int) -> list[tuple[SegmentState, int, int]]:
        """(segment, file offset, slot) per hit of length ``rb``, in slot order; takes a reader ref
        on each segment."""
        return self._state.pin_hits(keys, rb)

    def _execute(self, ops: list[tuple[SegmentState, int, int]], parts: Sequence[Sequence[np.ndarray]], rb: int,
                 results: list[int | None]) -> None:
        st = self._state
        assert st.io is not None
        start = 0
        while start < len(ops):
            seg, off, i0 = ops[start]
            end = start + 1
            while (end < len(ops) and ops[end][0] is seg and ops[end][2] == i0 + end - start
                   and ops[end][1] == off + (end - start) * rb):
                end += 1
            i1 = i0 + end - start
            bufs = [b for i in range(i0, i1) for b in parts[i]]
            st.io_stats["read_requests"] += 1
            try:
                self._read_run(seg.fd, off, bufs)
            except OSError as e:
                log.warning("SSD read of %d records from %s failed: %s", i1 - i0, seg.path.name, e)
                metrics.READ_ERRORS.inc()
            else:
                metrics.BYTES_READ.inc((i1 - i0) * rb)
                results[i0:i1] = [rb] * (i1 - i0)
            start = end

    def _read_run(self, fd: int, offset: int, bufs: list[np.ndarray]) -> None:
        io = self._state.io
        assert io is not None
        if not io.direct:
            io.read(fd, bufs, offset)
            return
        if (not self.small_align_refused and offset % DIO_OFFSET_ALIGN == 0
                and all(address_of(b) % DIO_BUFFER_ALIGN == 0 and b.nbytes % DIO_BUFFER_ALIGN == 0 for b in bufs)):
            try:
                io.read(fd, bufs, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.small_align_refused = True
                log.info("SSD tier: the device refuses direct reads into %d-byte aligned buffers; bouncing them",
                         DIO_BUFFER_ALIGN)
        bounce = self._take_bounce()
        try:
            read_extent(io, fd, offset, bufs, bounce)
        finally:
            self._bounces.append(bounce)

    def _take_bounce(self) -> np.ndarray:
        try:
            return self._bounces.pop()
        except IndexError:
            return aligned_buffer(BOUNCE_BYTES)
