"""The SSD tier's append path: a run of records into the open segment with one I/O request.

``SegmentWriter.append`` packs a batch into as few segments as it can: a run that fits the open
segment lands there back to back (one ``pwritev``/NIXL request, one ``fdatasync`` with
``fsync``); a run that would straddle a boundary while fitting a fresh segment seals the open one
first, so it stays contiguous; a record larger than a segment gets one of its own. Room is made
first (``Evictor.make_room``); only once the bytes are durable does the index expose the keys.
An overwrite leaves a tombstone on the old location, whose bytes the reclaimer frees later.

Tenants: each record's tenant (its header's tenant field) goes into the index with it. With
quotas (``tenancy.py``) a segment holds one tenant's records: a record of another tenant seals
the open segment first, and a tenant's segments are at most a quarter of its limit (as segments
are at most a quarter of the capacity), so its quota can always be met by evicting its own.

Failures: a device error that says the disk is at fault (ENOSPC, EROFS, EIO, ...) cuts the
partial run off the file and makes the tier read-only for ``write_retry_s``
(``SegmentLogState.write_failed``); a failed GPU-direct transfer only detaches that path. A batch
that fails after some records were stored raises ``PartialWrite`` with their number. Format and
crash contract: docs/SSD.md section 4.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable

import numpy as np

from ...blocks.codec import ALIGN, record_tenant
from ...blocks.keys import KEY_BYTES, BlockKey
from ...errors import PartialWrite, TierFull, TierUnavailable
from . import metrics
from .eviction import Evictor
from .gds import DeviceIO, DeviceSpan
from .io import as_u8, write_extent
from .reclaim import Reclaimer
from .recovery import fsync_dir
from .sealing import Sealer
from .segment import footer_bytes, segment_name
from .state import SegmentLogState, SegmentState
from .tombstones import TombstoneLog

log = logging.getLogger(__name__)

Item = tuple[bytes, np.ndarray | DeviceSpan]


def checked_batch(items: Iterable[tuple[BlockKey, memoryview | DeviceSpan]],
                  device_io: DeviceIO | None) -> list[Item]:
    """The batch as (key bytes, uint8 array or ``DeviceSpan``) pairs, validated on the caller's
    thread before it is queued for the writer.

    Raises:
        ValueError: a key is not 16 bytes, a record is not a positive 4 KiB multiple, or host and
            device values are mixed.
        TierUnavailable: device values without a working GPU-direct path (``device_io`` None).
    """
    batch = [(bytes(k), v if isinstance(v, DeviceSpan) else as_u8(v)) for k, v in items]
    for k, v in batch:
        if len(k) != KEY_BYTES or v.nbytes <= 0 or v.nbytes % ALIGN:
            raise ValueError(f"SSD tier stores 16-byte keys and 4 KiB-multiple records, got {v.nbytes} bytes")
    on_device = sum(isinstance(v, DeviceSpan) for _, v in batch)
    if on_device and on_device != len(batch):
        raise ValueError("a write batch is either all host buffers or all device spans")
    if on_device and device_io is None:
        raise TierUnavailable("device records need the GPU-direct path, which this SSD tier does not have")
    return batch


def record_tenant_of(value: np.ndarray | DeviceSpan) -> bytes:
    """The tenant a record names in its header; a device record's first 120 bytes are copied to
    the host for it (a small copy, on the writer thread)."""
    if isinstance(value, DeviceSpan):
        t = value.slab.tensor
        return record_tenant(t[value.offset:value.offset + 120].cpu().numpy())
    return record_tenant(value)


class SegmentWriter:
    """Appends record runs to the open segment (module docstring).

    Built by ``SSDTier`` with the shared ``SegmentLogState`` and the parts an append calls: the
    ``Sealer`` (full segments, a pending seal), the ``Evictor`` (room; retained keys' arrivals),
    the ``TombstoneLog`` and ``Reclaimer`` (superseded locations). Threads: the writer thread only.
    """

    def __init__(self, state: SegmentLogState, sealer: Sealer, evictor: Evictor, tombstones: TombstoneLog,
                 reclaimer: Reclaimer) -> None:
        self._state = state
        self._sealer = sealer
        self._evictor = evictor
        self._tombstones = tombstones
        self._reclaimer = reclaimer

    def append(self, items: list[Item]) -> None:
        """Store ``items`` in order (``SSDTier.write_many`` states the errors)."""
        st = self._state
        self._check_writable()
        tenants = [record_tenant_of(v) for _, v in items]
        self._check_quota(items, tenants)
        if self._sealer.pending:  # an earlier seal failed: retry it first (raising here: nothing written)
            self._sealer.seal()
        i = 0
        try:
            while i < len(items):
                tenant = tenants[i]
                end = self._run_end(tenants, i)
                target = self._segment_target(tenant)
                seg = st.open
                if seg is not None and seg.owner != tenant:
                    if not seg.entries:  # (left empty by a failed append)
                        with st.lock:
                            st.tenants.reown_locked(seg, tenant)
                    elif st.tenants.one_tenant_segments:
                        self._sealer.seal()  # one tenant per segment
                        continue
                seg = seg or self._new_segment(tenant)
                n0 = len(seg.entries)
                take, nbytes = 0, 0
                while i + take < end:
                    ln = items[i + take][1].nbytes
                    if seg.data_bytes + nbytes + ln + footer_bytes(n0 + take + 1) > target:
                        break
                    take, nbytes = take + 1, nbytes + ln
                rest = end - i
                if n0 and (take == 0 or (take < rest and sum(v.nbytes for _, v in items[i:end]) + footer_bytes(rest)
                                         <= target)):
                    self._sealer.seal()  # start a fresh segment so the run stays contiguous
                    continue
                if take == 0:  # a record larger than a segment gets a segment of its own
                    take, nbytes = 1, items[i][1].nbytes
                self._append_run(seg, items[i:i + take], tenants[i:i + take], nbytes)
                i += take
        except (TierUnavailable, TierFull) as e:
            if i == 0:
                raise
            # The first i records are durable and indexed: say so, callers must not treat them as lost.
            raise PartialWrite(f"SSD tier stored {i} of {len(items)} records, then: {e}", written=i) from e
        seg = st.open
        if seg is not None and seg.data_bytes + footer_bytes(len(seg.entries) + 1) + ALIGN \
                > self._segment_target(seg.owner):
            try:
                self._sealer.seal()
            except TierUnavailable as e:  # every record is durable and indexed: the write succeeded
                log.warning("SSD tier: %d records written; sealing %s failed and is retried later: %s",
                            len(items), seg.path.name, e)

    def _check_quota(self, items: list[Item], tenants: list[bytes]) -> None:
        """A record that cannot fit its tenant's limit even alone in a segment is refused
        (before anything of the batch is stored)."""
        acc = self._state.tenants
        if acc.quotas is None:
            return
        for (_, v), tenant in zip(items, tenants):
            limit = acc.quotas.limit(tenant)
            if v.nbytes + footer_bytes(1) > limit:
                raise TierFull(f"SSD tier: a {v.nbytes}-byte record exceeds the {limit}-byte quota of tenant "
                               f"{tenant.hex()}")

    def _run_end(self, tenants: list[bytes], i: int) -> int:
        """End of the run starting at ``i`` that may share a segment: the whole batch, or with
        one tenant per segment the records of ``tenants[i]`` that follow it."""
        if not self._state.tenants.one_tenant_segments:
            return len(tenants)
        end = i + 1
        while end < len(tenants) and tenants[end] == tenants[i]:
            end += 1
        return end

    def _segment_target(self, tenant: bytes) -> int:
        """Bytes a segment of ``tenant`` may reach: ``segment_bytes``, with quotas at most a
        quarter of the tenant's limit (its own segments are what its quota evicts)."""
        st = self._state
        limit = st.tenants.limit(tenant)
        if limit is None:
            return st.segment_bytes
        return min(st.segment_bytes, max(2 * ALIGN, limit // 4 // ALIGN * ALIGN))

    def _check_writable(self) -> None:
        st = self._state
        if not st.opened or st.closed:
            raise TierUnavailable("SSD tier is not open")
        st.retry_writes_if_due()
        if st.disabled_reason or st.readonly_reason:
            raise TierUnavailable(f"SSD tier is not accepting writes: {st.disabled_reason or st.readonly_reason}")

    def _append_run(self, seg: SegmentState, run: list[Item], tenants: list[bytes], nbytes: int) -> None:
        st = self._state
        assert st.io is not None
        n0 = len(seg.entries)
        need = nbytes + footer_bytes(n0 + len(run)) - footer_bytes(n0)
        self._evictor.make_room(need, seg.owner)
        offset = seg.data_bytes
        try:
            st.io_stats["write_requests"] += 1
            if isinstance(run[0][1], DeviceSpan):
                self._device_write(seg, offset, [v for _, v in run])  # type: ignore[misc]
            else:
                write_extent(st.io, seg.fd, offset, [v for _, v in run], st.write_bounce())  # type: ignore[misc]
            if st.fsync:
                st.io.sync(seg.fd)
        except OSError as e:
            st.write_failed(seg, offset, e)
        superseded, freed = [], []
        with st.lock:
            off = offset
            for (k, v), tenant in zip(run, tenants):
                old = st.put_locked(k, seg, off, v.nbytes, tenant)
                if old is not None:
                    superseded.append((old[0], old[1], k))
                    freed.append(old[:3])
                seg.entries.append((k, off, v.nbytes))
                seg.one_tenant = seg.one_tenant and tenant == seg.owner
                off += v.nbytes
            self._evictor.arrived_locked(seg.seq, (k for k, _ in run))  # per-segment retention ranks
            seg.data_bytes = off
            seg.size += need
            st.used += need
            seg.last_used = st.next_tick()
        st.last_write = time.monotonic()
        metrics.BYTES_WRITTEN.inc(nbytes)
        metrics.USED_BYTES.set(st.used)
        if superseded and self._tombstones.append(superseded):  # old locations must not come back after a
            self._reclaimer.note_dead(freed)  # restart; their bytes are freed by the next delete batch or seal

    def _device_write(self, seg: SegmentState, offset: int, spans: list[DeviceSpan]) -> None:
        """GPU-direct append. A failure is the GDS path's, not the disk's: detach it and fail this
        batch (the caller retries through host staging) without marking the tier read-only."""
        gpu = self._state.gpu
        dio = gpu.current
        if dio is None:
            raise TierUnavailable("GPU-direct path detached")
        try:
            dio.write(seg.fd, spans, offset)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(seg.fd, offset)
            gpu.failed("write", e)
            raise TierUnavailable(f"GPU-direct write to {seg.path.name} failed: {e}") from e
        metrics.GPU_DIRECT_BYTES.labels("write").inc(sum(s.nbytes for s in spans))

    def _new_segment(self, owner: bytes) -> SegmentState:
        st = self._state
        assert st.io is not None
        seq = st.next_seq
        path = st.rank_dir / segment_name(seq)
        try:
            fd = st.io.open(path, create=True)
            fsync_dir(st.rank_dir)
        except OSError as e:
            reason = f"cannot create {path}: {e}"
            st.degrade(reason, e)
            raise TierUnavailable(reason) from e
        with st.lock:
            seg = SegmentState(seq, path, fd, 0, footer_bytes(0), sealed=False, last_used=st.next_tick())
            st.next_seq = seq + 1
            st.add_segment_locked(seg, owner)
            st.open = seg
        return seg
