"""The object tier's publish path: ``write_many`` packs records into one data object,
``publish_segment`` uploads a sealed SSD segment as-is; both write data, then the manifest.

Publishing order (docs/OBJECTS.md, "Publishing"): data first (conditional create: a redo or a
second node writing the same bytes is free), its GC tombstone cleared, the manifest second, then
a check that the data still exists (re-uploaded if GC deleted it meanwhile), so a published
manifest never points at nothing. ``ObjectWrites`` is a part of ``ObjectTier`` (tier.py), split
off by role; it uses the tier's state and is not meant to be used alone.

Reuse is never blind. Content already stored under its content-addressed name is reused only
while no node reported one of its records corrupt (a quarantine marker, or this node's own
finding): bytes damaged on their way into the store sit under the very name of the good bytes,
and reusing them would keep every later upload of that content unreadable until ``dtkv gc``.
Such content is uploaded again under an alternate name (``alternate_digest``). ``holds_now``
tells the flusher whether the bucket serves a segment's records *now* (its index may still list
manifests deleted elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...blocks.codec import record_tenant
from ...blocks.keys import BlockKey
from ...errors import TierFull, TierUnavailable
from ..segments import SealedSegment, SegmentEntry
from .backend import FileSource, ObjectBackend
from .expiry import retain_field
from .manifest import Manifest, alternate_digest, content_digest, data_name, tombstone_name
from .quarantine import has_markers
from .retry import shared_deadline, with_timeout

if TYPE_CHECKING:
    from ...policy.quotas import TenantQuotas
    from ...policy.retention import RetentionClasses
    from .catalog import Catalog
    from .stats import ObjectTierStats

log = logging.getLogger(__name__)

REDO_WINDOW_S = 6 * 3600.0  # a publish of data this recent reuses its mtime as created_at
MAX_ALTERNATES = 3  # alternate names tried for content whose stored copies were reported corrupt


class ObjectWrites:
    """``write``/``write_many``/``publish_segment`` of ``ObjectTier`` (see module docstring)."""

    # the tier's state this part uses (set by ObjectTier.__init__)
    backend: ObjectBackend
    stats: ObjectTierStats
    capacity_bytes: int
    quotas: TenantQuotas | None
    origin: str
    read_timeout_s: float
    ttl_s: float | None
    snapshot_every: int
    _cat: Catalog
    _fresh: list[Manifest]
    _lock: asyncio.Lock
    _ready: asyncio.Event
    _backend_open: asyncio.Event
    _since_snapshot: int
    _suspect_data: set[str]  # data objects this node found a corrupt record in
    _newest_created: float = 0.0  # created_at of this node's newest publish (on the tier's loop)
    _retention: RetentionClasses | None
    if TYPE_CHECKING:
        _enforce_capacity_locked: Callable[[], None]
        _spawn: Callable[[Coroutine[Any, Any, Any]], None]
        write_snapshot: Callable[[], Coroutine[Any, Any, bool]]

    async def write(self, key: BlockKey, data: memoryview) -> None:
        await self.write_many([(key, data)])

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        """Pack the run into one data object (later duplicates of a key win) and publish it."""
        last: dict[BlockKey, memoryview] = {}
        for k, v in items:
            last.pop(k, None)
            last[k] = memoryview(v).cast("B")
        if not last:
            return
        total = sum(v.nbytes for v in last.values())
        if total > self.capacity_bytes:
            raise TierFull(f"{total} bytes exceed the object tier capacity {self.capacity_bytes}")
        buf = bytearray(total)
        entries: list[SegmentEntry] = []
        pos = 0
        for k, v in last.items():
            if v.nbytes == 0:
                raise ValueError("cannot store an empty record")
            buf[pos:pos + v.nbytes] = v
            entries.append(SegmentEntry(k, pos, v.nbytes, record_tenant(v)))
            pos += v.nbytes
        if self.quotas is not None:  # an object past its tenant's quota would only be evicted again
            per: dict[bytes, int] = {}
            for e in entries:
                per[e.tenant] = per.get(e.tenant, 0) + e.length
            for tenant, n in per.items():
                if n > self.quotas.limit(tenant):
                    raise TierFull(f"{n} bytes of tenant {tenant.hex()} exceed its object tier quota "
                                   f"{self.quotas.limit(tenant)}")
        digest = content_digest(total, entries, lambda o, n: bytes(buf[o:o + n]))
        m = await self._publish(digest, memoryview(buf), total, tuple(entries), self.origin)
        # Other manifests listing these keys are left alone (they may be other nodes' only
        # copy of the rest of their records); the newest manifest wins in every index.
        await self._add_fresh(m)

    async def publish_segment(self, seg: SealedSegment) -> Manifest:
        """Upload a sealed segment file as one data object plus its manifest (idempotent).

        Raises:
            TierUnavailable: the store failed; nothing half-written is visible.
            OSError: the segment file could not be read.
        """
        digest = await asyncio.to_thread(_file_digest, seg.path, seg.size, seg.entries)
        m = await self._publish(digest, FileSource(Path(seg.path), seg.size), seg.size, seg.entries,
                                f"{self.origin}/{seg.segment_id}")
        await self._add_fresh(m)
        return m

    async def _add_fresh(self, m: Manifest) -> None:
        """Index what this node just published; it lifts this node's exclusions of those keys."""
        async with self._lock:
            if not self._ready.is_set():
                self._fresh.append(m)  # replayed into the index being built when it is swapped in
            self._cat.add_fresh(m.name, m.data, m.created_at,
                                ((e.key, e.offset, e.length, e.tenant) for e in m.entries))
            self._enforce_capacity_locked()
        self._since_snapshot += 1
        if self.snapshot_every and self._since_snapshot >= self.snapshot_every and self._ready.is_set():
            self._since_snapshot = 0
            self._spawn(self.write_snapshot())

    async def _publish(self, digest: str, src: memoryview | FileSource, size: int,
                       entries: tuple[SegmentEntry, ...], origin: str) -> Manifest:
        if not self._backend_open.is_set():
            try:
                await asyncio.wait_for(self._backend_open.wait(), self.read_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                raise TierUnavailable(f"object store {self.backend.url} is not open yet") from None
        dname, bypassed, fresh = await self._put_data(digest, src)
        # created_at = the data object's server mtime (its first publish) when recent: a redo after
        # a crash, or another node flushing the same records, then writes the very same manifest
        # name (time-ordered names would otherwise duplicate); an old tombstoned orphan restarts
        # its retention instead.
        info = await self.backend.head(dname)
        now = time.time()
        created = info.mtime if info is not None and 0 <= now - info.mtime < REDO_WINDOW_S else now
        if bypassed is not None:  # newer than the damaged copy's manifests, which it must outrank
            created = max(created, bypassed + 0.001)  # (mtimes may have whole seconds only)
        if fresh:  # after this node's earlier publishes: its overwrites win on every node, though
            created = max(created, self._newest_created + 0.001)  # S3 mtimes have whole seconds
        self._newest_created = max(self._newest_created, created)
        m = Manifest(dname, size, created, entries, origin,
                     retain_field(self._retention, [e.key for e in entries]))  # optional: retained blocks
        await self.backend.put_object(m.name, m.to_bytes(), if_absent=True)  # only after the data
        # A gc that listed manifests before ours existed may have deleted the data meanwhile:
        # check now that the manifest is visible (later gc runs see it) and upload again if so.
        for _ in range(3):
            if await self.backend.head(dname) is not None:
                return m
            log.warning("data object %s vanished while publishing (gc race); uploading it again", dname)
            self.stats.reuploaded_objects += 1
            await self.backend.put_object(dname, src, if_absent=True)
        raise TierUnavailable(f"data object {dname} keeps vanishing after upload")

    async def _put_data(self, digest: str, src: memoryview | FileSource) -> tuple[str, float | None, bool]:
        """Store the data object of content ``digest`` (conditional create). Returns its name,
        the mtime of the newest copy passed over (None: none) and whether this call created it.

        A copy already stored under the name is reused unless a record of it was reported
        corrupt (module docstring); then the next alternate name is tried, up to
        ``MAX_ALTERNATES``. The names are derived from the digest, so nodes re-uploading the same
        content still share one copy.

        Raises:
            TierUnavailable: the store failed, or every alternate name holds a reported copy.
        """
        bypassed: float | None = None
        for n in range(MAX_ALTERNATES + 1):
            dname = data_name(digest if n == 0 else alternate_digest(digest, n))
            if await self.backend.put_object(dname, src, if_absent=True):
                self.stats.objects_published += 1
                return dname, bypassed, True
            # One LIST, only when the content is already there (a redo, or another node's upload).
            if dname not in self._suspect_data and not await has_markers(self.backend, dname):
                self.stats.objects_deduplicated += 1
                # It may be an orphan that gc tombstoned: clear the tombstone before our manifest
                # exists, so a gc that checks it before deleting spares the object.
                await self.backend.delete(tombstone_name(dname))
                return dname, bypassed, False
            self.stats.corrupt_copies_bypassed += 1
            info = await self.backend.head(dname)
            bypassed = max(bypassed or 0.0, info.mtime) if info is not None else bypassed
            log.warning("stored copy %s has records reported corrupt; uploading this content again "
                        "under another name", dname)
        raise TierUnavailable(f"every stored copy of content {digest} was reported corrupt")

    async def holds_now(self, entries: Sequence[SegmentEntry]) -> bool:
        """Whether the bucket serves every one of ``entries`` (same key, same length) now, so that
        publishing them again would add nothing. Runs on the tier's loop.

        The index alone cannot tell: it keeps manifests deleted elsewhere (another node's capacity
        eviction, ``dtkv gc``) until the next full listing, and after a start from a snapshot
        everything deleted since the snapshot; trusting it could mark a block flushed that no
        tier holds once its SSD segment goes. Trusting only entries younger than the last full
        listing would still leave the time since that listing open, and this node's own writes
        are deleted by other nodes' evictions too. So each object serving an entry is confirmed
        against the bucket: one HEAD of its manifest (what makes its records discoverable; while
        it exists, gc keeps its data, ``gc.py`` rule 2) and one LIST of its quarantine markers (a
        copy some node found corrupt is no copy), both at once. That is a few requests per
        segment, not per record, against an upload of the whole segment. An object past this
        tier's TTL is not relied on (gc may delete its manifest any moment), and a manifest
        found gone is dropped from the index at once.

        Raises:
            TierUnavailable: the store did not answer within ``read_timeout_s``.
        """
        cat = self._cat
        objs: set[int] = set()
        for e in entries:
            loc = cat.index.get(e.key)
            if loc is None or loc[2] != e.length:
                return False
            objs.add(loc[0])
        if not objs:
            return False
        created = cat.objs.view["created"]
        if self.ttl_s is not None and any(created[i] + self.ttl_s <= time.time() for i in objs):
            return False
        # names resolved before the first await: a catalog swapped in meanwhile has other ids
        names = {i: (cat.manifest_name(i), cat.data_name(i)) for i in objs}

        async def confirm(i: int) -> tuple[int, bool, bool]:
            manifest, data = names[i]
            info, marked = await asyncio.gather(self.backend.head(manifest), has_markers(self.backend, data))
            return i, info is not None, marked or data in self._suspect_data

        try:
            with shared_deadline(self.read_timeout_s):
                got = await with_timeout(asyncio.gather(*(confirm(i) for i in objs)), self.read_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise TierUnavailable(f"the store did not confirm stored records in {self.read_timeout_s}s") from None
        gone = [i for i, present, _ in got if not present]
        if gone:
            self.stats.stale_index_objects += len(gone)
            log.info("%d indexed objects lost their manifests elsewhere; forgetting them", len(gone))
            async with self._lock:
                if self._cat is cat:
                    cat.forget(gone)
        return all(present and not marked for _, present, marked in got)



def _file_digest(path: os.PathLike[str], size: int, entries: Sequence[SegmentEntry]) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise OSError(f"{path} holds {actual} bytes, segment says {size}")
        return content_digest(size, entries, lambda o, n: os.pread(fd, n, o))
    finally:
        os.close(fd)
