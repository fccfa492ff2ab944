"""The object tier's publish path: ``write_many`` packs records into one data object,
``publish_segment`` uploads a sealed SSD segment as-is; both write data, then the manifest.

Publishing order (docs/OBJECTS.md, "Publishing"): data first (conditional create: a redo or a
second node writing the same bytes is free), its GC tombstone cleared, the manifest second, then
a check that the data still exists (re-uploaded if GC deleted it meanwhile), so a published
manifest never points at nothing. ``ObjectWrites`` is a part of ``ObjectTier`` (tier.py), split
off by role; it uses the tier's state and is not meant to be used alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import TierFull, TierUnavailable
from ...keys import BlockKey
from ..segments import SealedSegment, SegmentEntry
from .backend import FileSource, ObjectBackend
from .expiry import retain_field
from .manifest import Manifest, content_digest, data_name, tombstone_name

if TYPE_CHECKING:
    from ...retention import RetentionClasses
    from .catalog import Catalog
    from .stats import ObjectTierStats

log = logging.getLogger(__name__)

REDO_WINDOW_S = 6 * 3600.0  # a publish of data this recent reuses its mtime as created_at


class ObjectWrites:
    """``write``/``write_many``/``publish_segment`` of ``ObjectTier`` (see module docstring)."""

    # the tier's state this part uses (set by ObjectTier.__init__)
    backend: ObjectBackend
    stats: ObjectTierStats
    capacity_bytes: int
    origin: str
    read_timeout_s: float
    snapshot_every: int
    _cat: Catalog
    _fresh: list[Manifest]
    _lock: asyncio.Lock
    _ready: asyncio.Event
    _backend_open: asyncio.Event
    _since_snapshot: int
    retention: RetentionClasses | None
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
            entries.append(SegmentEntry(k, pos, v.nbytes))
            pos += v.nbytes
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
            self._cat.add_fresh(m.name, m.data, m.created_at, ((e.key, e.offset, e.length) for e in m.entries))
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
        dname = data_name(digest)
        if await self.backend.put_object(dname, src, if_absent=True):
            self.stats.objects_published += 1
        else:
            self.stats.objects_deduplicated += 1
            # It may be an orphan that gc tombstoned: clear the tombstone before our manifest
            # exists, so a gc that checks it before deleting spares the object.
            await self.backend.delete(tombstone_name(dname))
        # created_at = the data object's server mtime (its first publish) when recent: a redo after
        # a crash, or another node flushing the same records, then writes the very same manifest
        # name (time-ordered names would otherwise duplicate); an old tombstoned orphan restarts
        # its retention instead.
        info = await self.backend.head(dname)
        now = time.time()
        created = info.mtime if info is not None and 0 <= now - info.mtime < REDO_WINDOW_S else now
        m = Manifest(dname, size, created, entries, origin,
                     retain_field(self.retention, [e.key for e in entries]))  # optional: retained blocks
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



def _file_digest(path: os.PathLike[str], size: int, entries: Sequence[SegmentEntry]) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise OSError(f"{path} holds {actual} bytes, segment says {size}")
        return content_digest(size, entries, lambda o, n: os.pread(fd, n, o))
    finally:
        os.close(fd)
