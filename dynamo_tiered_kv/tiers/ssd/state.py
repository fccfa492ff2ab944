"""``SegmentLogState``: what the SSD tier's parts share, held in one object each part is given
explicitly (``SSDTier`` builds it and hands it to the writer, sealer, evictor, reclaimer,
tombstone log, read path, flush source and lifecycle).

Threads and ownership
---------------------
* ``lock`` guards ``index``, ``tenants``, ``segments``, ``open``, ``used``, ``tick`` and each
  segment's ``readers``, ``pins``, ``dead``, ``sealed``, ``flushed``, ``last_used``, ``owner``,
  ``tenants`` and ``live_bytes``. It is held for
  memory operations only, never across I/O, so lookups (``contains`` on the scheduler's hot path)
  never wait on the disk.
* The writer thread (one per tier, ``SSDTier``'s executor) is the only one that adds or removes
  segments, appends to the open one, seals, deletes and evicts; it alone changes ``next_seq``,
  ``last_write``, ``readonly_reason``/``readonly_at`` (and clears them for a retry), and uses the
  write bounce buffer. It may read the segment table without the lock (nobody else changes its
  membership).
* Readers (the default executor, or the caller's thread for ``read_slab_now``) take ``lock`` to
  plan a read (a reference on each segment, ``readers``) and to release it; the last reader of a
  segment that left the tier (``dead``) closes its descriptor.
* ``io`` and ``disabled_reason`` are set while opening (``SegmentLogLifecycle``, on the writer
  thread) before any read or write is admitted; ``opened``/``closed`` are set by
  ``SSDTier.open``/``close``.
* ``flusher_attached`` is set once by the flusher's first ``unflushed_segments`` and read by
  eviction and reclaim (a plain bool: a late read only delays a decision by one pass).
* ``io_stats`` counters are bumped by readers and the writer without the lock (statistics).

Invariants (under ``lock``)
---------------------------
* ``used`` is the sum of ``size`` over ``segments`` (the open segment counted with the footer it
  will get). Every append makes room first, so it stays within ``capacity`` (only recovery may
  load more, after the capacity was lowered; eviction then brings it down at the next append).
* ``open`` is None or the one unsealed segment, the newest in ``segments``.
* The index changes only through ``put_locked``/``pop_locked`` and the segment table only through
  ``add_segment_locked``/``remove_segment_locked``, so the tenant accounts (``tenancy.py``) stay
  exact: each segment's ``tenants`` sums its live records by tenant, the ledger sums them all.
* Every index entry names a segment in ``segments``; a segment taken out of ``segments`` is
  marked ``dead`` in the same critical section, and its fd is closed once ``readers`` is 0.
* ``next_seq`` is above every seq this rank directory ever held (files, quarantined files).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np

from ...blocks.tenant import DEFAULT_TENANT
from ...errors import TierUnavailable
from ...policy.quotas import TenantQuotas
from ..segments import SegmentEntry
from . import metrics
from .gpu_direct import GpuDirectLink
from .index import CompactIndex, Entry
from .io import PosixIO, aligned_buffer
from .tenancy import TenantAccounts

log = logging.getLogger(__name__)

#: size of the write and read bounce buffers (unaligned sources and destinations go through one)
BOUNCE_BYTES = 8 << 20
#: write errors after which the tier serves reads only for ``write_retry_s``
DEGRADING_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.EFBIG}


@dataclass(eq=False)
class SegmentState:
    """One segment file in memory. Counters and flags: under ``SegmentLogState.lock``."""

    seq: int
    path: Path
    fd: int
    data_bytes: int
    size: int  # bytes the file holds (sealed) or will hold once sealed (open: data + footer)
    sealed: bool
    flushed: bool = False
    sealed_at: float = 0.0
    last_used: int = 0
    pins: int = 0
    readers: int = 0
    dead: bool = False
    entries: list[tuple[bytes, int, int]] = field(default_factory=list)  # open segment only
    sealed_entries: tuple[SegmentEntry, ...] | None = None  # cached for the flusher
    owner: bytes = DEFAULT_TENANT  # the tenant it was opened for, charged its footer and dead bytes
    tenants: dict[bytes, int] = field(default_factory=dict)  # live record bytes per tenant
    live_bytes: int = 0  # sum of ``tenants``
    one_tenant: bool = True  # every record appended names ``owner`` (open segment: the footer's flag)


class SegmentLogState:
    """The index, segment table, open segment, counters, I/O path and flags of one rank
    directory (module docstring: ownership per field, invariants)."""

    def __init__(self, rank_dir: Path, rank: int, *, capacity: int, segment_bytes: int, fsync: bool,
                 write_retry_s: float, gpu: GpuDirectLink, quotas: TenantQuotas | None = None) -> None:
        self.rank_dir = rank_dir
        self.rank = rank
        self.capacity = capacity
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        #: after a degrading write error, writes fail fast for this many seconds
        self.write_retry_s = write_retry_s
        self.gpu = gpu

        self.lock = threading.Lock()
        self.index = CompactIndex()
        #: the tenant ledger, per-segment tenant bytes and charges (``tenancy.py``); kept by
        #: ``put_locked``/``pop_locked``, the only ways the index changes
        self.tenants = TenantAccounts(quotas)
        self.segments: dict[int, SegmentState] = {}
        self.open: SegmentState | None = None
        self.next_seq = 1
        self.used = 0
        self.tick = 0
        self.last_write = time.monotonic()
        self.io: PosixIO | None = None

        self.opened = False
        self.closed = False
        self.disabled_reason: str | None = None  # set when the tier serves nothing (no SSD tier)
        self.readonly_reason: str | None = None  # set when writes stopped (reads still served)
        self.readonly_at = 0.0
        self.flusher_attached = False
        #: logical I/O requests issued: one per contiguous run (bounced runs may take more syscalls)
        self.io_stats = {"read_requests": 0, "write_requests": 0}
        self._write_bounce: np.ndarray | None = None

    @property
    def io_path(self) -> str:
        return self.io.name if self.io else "none"

    def next_tick(self) -> int:
        """The next recency stamp (``last_used``). Under ``lock``, or on the writer thread while
        opening (no reader yet)."""
        self.tick += 1
        return self.tick

    def segment_id(self, seq: int) -> str:
        """The flusher's name of segment ``seq``: ``rank-NNN/<seq>``."""
        return f"{self.rank_dir.name}/{seq:08d}"

    def write_bounce(self) -> np.ndarray:
        """The writer thread's aligned bounce buffer (records and footers; writer thread only)."""
        if self._write_bounce is None:
            self._write_bounce = aligned_buffer(BOUNCE_BYTES)
        return self._write_bounce

    # --- index changes (under ``lock``): the index and the tenant accounts move together ----
    def put_locked(self, key: bytes, seg: SegmentState, offset: int, length: int, tenant: bytes) -> Entry | None:
        """Place ``key``'s record of ``tenant`` in ``seg``; returns the entry it replaced."""
        old = self.index.put_entry(key, seg.seq, offset, length, tenant)
        if old is not None:
            self.tenants.record_removed_locked(self.segments.get(old[0]), old[3], old[2])
        self.tenants.record_added_locked(seg, tenant, length)
        return old

    def pop_locked(self, key: bytes, only_seq: int | None = None) -> Entry | None:
        """Drop ``key`` (only from segment ``only_seq``, when given); returns its entry."""
        e = self.index.pop_entry(key, only_seq)
        if e is not None:
            self.tenants.record_removed_locked(self.segments.get(e[0]), e[3], e[2])
        return e

    def add_segment_locked(self, seg: SegmentState, owner: bytes) -> None:
        """``seg`` joins the segment table, owned by ``owner`` (counted in ``used``)."""
        self.segments[seg.seq] = seg
        self.used += seg.size
        self.tenants.segment_added_locked(seg, owner)

    def remove_segment_locked(self, seg: SegmentState) -> None:
        """``seg`` leaves the segment table (its live keys were popped first) and is retired."""
        del self.segments[seg.seq]
        self.used -= seg.size
        self.tenants.segment_removed_locked(seg)
        self.retire_locked(seg)

    # --- descriptors ----------------------------------------------------------------------
    def close_fd(self, fd: int) -> None:
        """Close a segment descriptor (GPU-direct registration first)."""
        assert self.io is not None
        self.gpu.forget(fd)
        self.io.close_fd(fd)

    def retire_locked(self, seg: SegmentState) -> None:
        """Mark ``seg`` gone (under ``lock``, after taking it out of ``segments``); its fd closes
        now when nobody reads it, else when the last reader leaves (``release_locked``)."""
        seg.dead = True
        if seg.readers == 0 and self.io is not None:
            self.close_fd(seg.fd)

    def pin_hits(self, keys: Sequence[bytes], length: int) -> list[tuple[SegmentState, int, int]]:
        """(segment, file offset, position in ``keys``) of each key indexed with a record of
        ``length`` bytes, in ``keys`` order; each returned segment holds a reader reference (give
        it back with ``release_locked``), so reclaim cannot delete its file under the read."""
        ops = []
        get = self.index.get
        segments = self.segments
        with self.lock:
            tick = self.next_tick()
            for i, k in enumerate(keys):
                loc = get(k)
                if loc is None or loc[2] != length:
                    continue
                seg = segments[loc[0]]
                seg.readers += 1
                seg.last_used = tick
                ops.append((seg, loc[1], i))
        return ops

    def release_locked(self, seg: SegmentState) -> None:
        """A reader is done with ``seg`` (under ``lock``)."""
        seg.readers -= 1
        if seg.dead and seg.readers == 0 and self.io is not None:
            self.close_fd(seg.fd)

    def drop_all(self) -> None:
        """Forget every segment and index entry (a half-recovered index must not serve; close).
        A read still in flight keeps its fd: its release closes it."""
        with self.lock:
            for seg in self.segments.values():
                with contextlib.suppress(OSError):
                    self.retire_locked(seg)
            self.segments.clear()
            self.index.clear()
            self.tenants.clear()
            self.open = None
            self.used = 0

    # --- degraded modes -------------------------------------------------------------------
    def degrade(self, reason: str, e: OSError) -> None:
        """Stop accepting writes for ``write_retry_s`` (reads still served). Writer thread."""
        log.error("SSD tier stops accepting writes for %.0fs (reads still served): %s", self.write_retry_s, reason)
        self.readonly_reason = reason
        self.readonly_at = time.monotonic()
        metrics.DEGRADED.labels(errno.errorcode.get(e.errno or 0, "EIO")).inc()

    def write_failed(self, seg: SegmentState, offset: int, e: OSError) -> NoReturn:
        """A write to ``seg`` at ``offset`` failed: cut what reached the file, go read-only if the
        device is at fault (``DEGRADING_ERRNOS``), and raise ``TierUnavailable``. Writer thread."""
        with contextlib.suppress(OSError):
            os.ftruncate(seg.fd, offset)  # drop whatever part of the run reached the file
        reason = f"write to {seg.path.name} failed: {e}"
        if e.errno in DEGRADING_ERRNOS:
            self.degrade(reason, e)
        raise TierUnavailable(reason) from e

    def retry_writes_if_due(self) -> None:
        """Writes were stopped ``write_retry_s`` ago or more: let the next one try the device."""
        if self.readonly_reason and time.monotonic() - self.readonly_at >= self.write_retry_s:
            log.info("SSD tier: retrying writes after: %s", self.readonly_reason)
            self.readonly_reason = None
