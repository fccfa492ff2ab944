"""G3 SSD tier: append-only segment files in a per-rank directory, with a compact index.

Data path: ``write_many`` appends a run of records back to back into the open segment with one
I/O request (NIXL POSIX/io_uring or pwritev, O_DIRECT) and, with ``fsync``, one ``fdatasync``;
only then does the index expose the keys. ``read_many`` looks keys up in memory, sorts the hits
and reads every run of adjacent records of one segment with one request, straight into the
caller's buffers when they are page aligned (staging slabs are), through a bounce buffer
otherwise. A full or idle segment is sealed with a footer; eviction drops whole sealed segments,
least recently used first; deletes free their records' bytes, and the tombstone log sheds the
entries of segments that are gone. Every record's tenant is accounted (``tenant_usage``); with
quotas a segment holds one tenant and eviction respects the tenants' limits (``tenancy.py``).
Format, crash contract and concurrency rule: docs/SSD.md.

``SSDTier`` is a facade over parts it builds and owns, each with one job, all sharing one
``SegmentLogState`` (``state.py``: index, segment table, open segment, counters, I/O path,
flags, and the lock that guards them):

* ``SegmentWriter`` (``writer.py``): the append path;
* ``Sealer`` and ``IdleSealer`` (``sealing.py``): footers, on demand, when full or idle;
* ``Evictor`` (``eviction.py``): room for a write, by retention rank then recency;
* ``Reclaimer`` (``reclaim.py``): deletes, and freeing the bytes of dead records;
* ``TombstoneLog`` (``tombstones.py``): appends and compaction of the tombstone log;
* ``ReadPath`` (``reads.py``): planned, coalesced reads;
* ``FlushSource`` (``flushing.py``): the ``SegmentSource`` face for the object-tier flusher;
* ``SegmentLogLifecycle`` (``lifecycle.py``): lock, I/O path, recovery; close;
* ``GpuDirectLink`` (``gpu_direct.py``): the GPU-direct path until it fails;
* ``TenantAccounts`` (``tenancy.py``, held by the state): the tenant ledger, charges and quotas.

Threads: all mutations (append, seal, delete, evict, open, close) run on one writer thread (the
tier's executor), so appends are ordered; reads run in the default executor concurrently with
it. The state's lock guards the index and segment table, never I/O.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ...blocks.codec import ALIGN
from ...blocks.keys import BlockKey
from ...policy.quotas import TenantQuotas, holder_limit
from ..base import ReadRequest, Tier, TierCapabilities, TierExpiry, TierUsage
from ..segments import SealedSegment
from . import metrics
from .eviction import Evictor
from .flushing import FlushSource
from .gds import DeviceIO, DeviceSpan
from .gds_probe import GdsVerdict
from .gpu_direct import GpuDirectLink
from .lifecycle import SegmentLogLifecycle
from .reads import ReadPath
from .reclaim import Reclaimer
from .sealing import IdleSealer, Sealer
from .split_reads import SplitReader
from .state import SegmentLogState
from .tombstones import TombstoneLog
from .writer import SegmentWriter, checked_batch

DEFAULT_SEGMENT_BYTES = 256 << 20

_T = TypeVar("_T")


class SSDTier(Tier):
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
        quotas: per-tenant byte limits (``policy.quotas``; None or not ``enforced``: none). A
            tenant over its limit evicts its own segments; a full tier never evicts a tenant within
            its limit for another tenant's writes while a tenant is over its limit (docs/SSD.md
            section 8). With quotas each segment holds one tenant's records.
    """

    name = "ssd"
    capabilities = TierCapabilities(medium="ssd", durable=True, shared=False)

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
    split_reads_now = True  # ``read_split_now``: records straight into the caller's buffers

    def __init__(self, path: str | os.PathLike[str], *, capacity_bytes: int,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, rank: int = 0, io: str = "auto",
                 allow_evict_unflushed: bool | None = None, fsync: bool = True, verify_reads: bool = False,
                 idle_seal_s: float | None = 60.0, write_retry_s: float = 30.0,
                 on_sealed: Callable[[SealedSegment], None] | None = None,
                 device_io: DeviceIO | None = None, namespace: bytes | None = None,
                 quotas: TenantQuotas | None = None) -> None:
        if capacity_bytes <= 0 or segment_bytes < 2 * ALIGN or rank < 0:
            raise ValueError("capacity_bytes and rank must be positive and segment_bytes at least 8 KiB")
        if io not in ("auto", "nixl", "odirect", "buffered"):
            raise ValueError(f"io must be auto|nixl|odirect|buffered, got {io!r}")
        self.root = Path(path)
        self.rank = rank
        self.rank_dir = self.root / f"rank-{rank:03d}"
        #: the namespace digest every record served must carry (with ``verify_reads``)
        self.namespace = namespace
        clamp = max(2 * ALIGN, capacity_bytes // 4 // ALIGN * ALIGN)
        self._idle_seal_s = idle_seal_s
        self._state = st = SegmentLogState(
            self.rank_dir, rank, capacity=capacity_bytes, segment_bytes=min(segment_bytes // ALIGN * ALIGN, clamp),
            fsync=fsync, write_retry_s=write_retry_s, gpu=GpuDirectLink(device_io, self.rank_dir), quotas=quotas)
        #: logical I/O requests issued: one per contiguous run (bounced runs may take more syscalls)
        self.io_stats = st.io_stats
        self._tombstones = TombstoneLog(st)
        self._evictor = Evictor(st, allow_unflushed=allow_evict_unflushed, retention=lambda: self._retention,
                                report_evicted=self._report_evicted)
        self._reclaimer = Reclaimer(st, self._tombstones, self._evictor)
        self._sealer = Sealer(st, self._reclaimer, on_sealed)
        self._appender = SegmentWriter(st, self._sealer, self._evictor, self._tombstones, self._reclaimer)
        self._reads = ReadPath(st, verify=verify_reads, namespace=namespace)
        self._split_reads = SplitReader(st)
        self._flush_source = FlushSource(st, lambda: self._residency_hook)
        self._lifecycle = SegmentLogLifecycle(st, io, tombstones=self._tombstones, reclaimer=self._reclaimer,
                                              sealer=self._sealer)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"dtkv-ssd{rank}")
        self._idle: IdleSealer | None = None

    # --- state shown to callers -------------------------------------------------------------
    @property
    def on_sealed(self) -> Callable[[SealedSegment], None] | None:
        """Called on the writer thread with each newly sealed segment; may be replaced any time."""
        return self._sealer.on_sealed

    @on_sealed.setter
    def on_sealed(self, callback: Callable[[SealedSegment], None] | None) -> None:
        self._sealer.on_sealed = callback

    @property
    def disabled_reason(self) -> str | None:
        """Why the tier serves nothing (None: it serves)."""
        return self._state.disabled_reason

    @property
    def readonly_reason(self) -> str | None:
        """Why writes stopped, reads still served (None: writes accepted)."""
        return self._state.readonly_reason

    @property
    def gds(self) -> GdsVerdict:
        """The GPUDirect Storage verdict for the rank directory's filesystem (after ``open``)."""
        return self._lifecycle.gds

    @property
    def io_path(self) -> str:
        return self._state.io_path

    @property
    def available(self) -> bool:
        return self._state.opened and self._state.disabled_reason is None

    @property
    def device_io(self) -> DeviceIO | None:
        """The GPU-direct path while it works (None before ``open``, without one, or after a failure)."""
        return self._state.gpu.current if self.available else None

    # --- lifecycle --------------------------------------------------------------------------
    async def _on_writer(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the writer thread, the one that makes every change."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def open(self) -> None:
        """Lock the rank directory, choose the I/O path, recover segments and rebuild the index.

        Never raises for environmental faults (unwritable directory, lock held by another
        process, no space): the tier is disabled with a log line and the ``dtkv_ssd_disabled``
        metric, and behaves as an empty tier whose writes raise ``TierUnavailable``.
        """
        if self._state.opened:
            return
        await self._on_writer(self._lifecycle.open)
        self._state.opened = True
        if self._idle_seal_s and self._state.disabled_reason is None:
            self._idle = IdleSealer(self._sealer, self._writer, self._idle_seal_s, f"dtkv-ssd{self.rank}-idle")

    async def close(self) -> None:
        """Seal the open segment, close files and release the rank lock. Idempotent."""
        st = self._state
        if st.closed:
            return
        st.closed = True
        if self._idle is not None:
            self._idle.stop()
        if st.opened:
            await self._on_writer(self._lifecycle.close)
        self._writer.shutdown(wait=True)
        st.gpu.release()
        if st.disabled_reason is not None:
            metrics.DISABLED.dec()
        if self._idle is not None:
            self._idle.join(timeout=5)

    # --- index (memory only) ----------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        with self._state.lock:
            return key in self._state.index

    def size_of(self, key: BlockKey) -> int | None:
        with self._state.lock:
            loc = self._state.index.get(key)
        return None if loc is None else loc[2]

    def keys(self) -> Iterator[BlockKey]:
        with self._state.lock:
            return self._state.index.keys()

    def usage(self) -> TierUsage:
        st = self._state
        return TierUsage(st.capacity, st.used, len(st.index))

    def tenant_limit(self, tenant: str) -> int:
        """``Tier.tenant_limit``: the tenant's quota here (``tenant`` in hex), else the capacity."""
        return holder_limit(self._state.tenants.quotas, tenant, self._state.capacity)

    def tenant_usage(self) -> dict[bytes, tuple[int, int]]:
        """Live record bytes and blocks each tenant holds here (a copy)."""
        with self._state.lock:
            return self._state.tenants.snapshot()

    def index_nbytes(self) -> int:
        return self._state.index.nbytes()

    def location(self, key: BlockKey) -> tuple[Path, int, int] | None:
        """(segment file, offset, length) of ``key``'s record; for tools and tests. The file may
        be gone by the time the caller opens it (eviction does not wait for callers of this)."""
        st = self._state
        with st.lock:
            loc = st.index.get(key)
            if loc is None:
                return None
            return st.segments[loc[0]].path, loc[1], loc[2]

    # --- writes and deletes -----------------------------------------------------------------
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
        batch = checked_batch(items, self.device_io)
        if batch:
            await self._on_writer(self._appender.append, batch)

    async def delete(self, key: BlockKey) -> bool:
        return await self._on_writer(self._reclaimer.delete, [bytes(key)]) == 1

    async def delete_many(self, keys: Iterable[BlockKey]) -> int:
        """One tombstone append (one fdatasync) for the whole batch, then free the records' bytes."""
        return await self._on_writer(self._reclaimer.delete, [bytes(k) for k in keys])

    async def erase_tenant(self, tenant: bytes) -> int:
        """``Tier.erase_tenant`` from the index's tenant column (no record read); the records go
        like any deleted record (tombstoned, their bytes punched or their segment reclaimed)."""
        st = self._state
        with st.lock:
            index = st.index
            keys = index.keys()
            doomed = [k for k in keys if (e := index.entry(k)) is not None and e[3] == tenant]
        n = await self.delete_many(doomed)
        if self._retention is not None:
            self._retention.forget(doomed)
        self._report_evicted(doomed)
        return n

    async def expire(self, now: float, max_bytes: int) -> TierExpiry:
        """``Tier.expire``, then the open segment is sealed if expired records lie in it, so no
        byte of an expired block stays on disk after the pass (``seal_deleted``)."""
        done = await super().expire(now, max_bytes)
        if done.blocks:
            await self.seal_deleted()
        return done

    # --- reads --------------------------------------------------------------------------------
    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        """Read every hit; adjacent records of one segment are one read. Misses and failures are None.

        Raises:
            ValueError: a destination is too small or a byte range exceeds its record.
        """
        return await self._reads.read_many(requests)

    async def read_slab(self, keys: Sequence[BlockKey], dest: np.ndarray, record_bytes: int) -> list[int | None]:
        """``Tier.read_slab`` without a view per record: slots whose records lie back to back in a
        segment are one read."""
        return await self._reads.read_slab(keys, dest, record_bytes)

    def read_slab_now(self, keys: Sequence[BlockKey], dest: np.ndarray, record_bytes: int) -> list[int | None]:
        """``read_slab`` on the calling thread (blocking): for a restore of one chunk."""
        return self._reads.read_slab_now(keys, dest, record_bytes)

    def read_split_now(self, keys: Sequence[BlockKey], parts: Sequence[Sequence[np.ndarray]],
                       record_bytes: int) -> list[int | None]:
        """``Tier.read_split_now``: records back to back in a segment are one ``preadv`` over all
        their buffers (``split_reads``). Never verifies (``verify_reads`` covers staged reads)."""
        return self._split_reads.read_now(keys, parts, record_bytes)

    # --- sealing ------------------------------------------------------------------------------
    async def seal(self) -> SealedSegment | None:
        """Seal the open segment now (None when it holds nothing)."""
        return await self._on_writer(self._sealer.seal)

    async def seal_if_idle(self, max_age_s: float) -> SealedSegment | None:
        """Seal the open segment if nothing was appended for ``max_age_s`` seconds."""
        return await self._on_writer(self._sealer.seal_if_idle, max_age_s)

    async def seal_deleted(self) -> bool:
        """Seal the open segment if deleted records lie in it, so their bytes are freed now rather
        than once it fills (an expiry pass calls this at its end). Returns whether it sealed."""
        return await self._on_writer(self._sealer.seal_deleted)

    # --- SegmentSource (for the object-tier flusher) ------------------------------------------
    def unflushed_segments(self) -> list[SealedSegment]:
        """Sealed segments not yet in the object tier, oldest first, each with its live records
        only (one with none is left to reclaim). Marks a flusher as attached."""
        return self._flush_source.unflushed_segments()

    def mark_flushed(self, segment_id: str) -> None:
        """Durably record that the segment is in the object tier; then tell the residency hook."""
        self._flush_source.mark_flushed(segment_id)

    def pin_segment(self, segment_id: str) -> bool:
        """Keep the segment from eviction and reclaim until ``unpin_segment`` (False: gone)."""
        return self._flush_source.pin_segment(segment_id)

    def unpin_segment(self, segment_id: str) -> None:
        self._flush_source.unpin_segment(segment_id)
